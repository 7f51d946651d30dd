//! One window of `GET /metrics` scrapes, one after another (one client, as Prometheus
//! scrapes): the metrics bench's project side and the scale bench's scrape at size.

use super::measure::{Window, window, window_length};

/// Scrapes `url` for the configured window length; a scrape counts when it answers 2xx
/// and, if `expected` is given, its body holds that exact line.
pub async fn scrapes(http: reqwest::Client, url: String, expected: Option<String>) -> Window {
    window(1, window_length(), move |_, _| {
        let (http, url, expected) = (http.clone(), url.clone(), expected.clone());
        async move {
            match http.get(&url).send().await {
                Ok(r) if r.status().is_success() => {
                    r.text().await.is_ok_and(|t| expected.as_ref().is_none_or(|e| t.lines().any(|l| l == e)))
                }
                _ => false,
            }
        }
    })
    .await
}
