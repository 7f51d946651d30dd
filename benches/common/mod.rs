//! What the benchmarks share: how they measure and judge (`measure`), what they count
//! (`counts`), a convergence round of registrations on the API server (`converge`) and a
//! window of /metrics scrapes (`scrape`) the Run heartbeat's raw baseline (`raw`) and many Runs at once (`runs`).
//! Each bench uses part of it.
#![allow(dead_code)]

pub mod converge;
pub mod counts;
pub mod measure;
pub mod raw;
pub mod runs;
pub mod scrape;

/// The per-identity rate limit (SPEC §12, PRISM_RATE_PER_IDENTITY) opened wide: a bench's
/// thousands of simulated agents share one ServiceAccount, where real agents each have
/// their own identity and budget.
pub const UNTHROTTLED_RATE: (&str, &str) = ("PRISM_RATE_PER_IDENTITY", "1000000");
pub const UNTHROTTLED_BURST: (&str, &str) = ("PRISM_BURST_PER_IDENTITY", "10000000");
/// One source address's share of the connection cap (SPEC §12) opened to the whole cap: a
/// bench's clients all come from 127.0.0.1.
pub const UNCAPPED_ADDRESS: (&str, &str) = ("PRISM_MAX_CONNECTIONS_PER_ADDRESS", "1000000");

/// An operator's environment for a bench: `own` and the per-identity rate and per-address
/// connection share opened wide (see the constants above).
pub fn open_limits<'a>(own: &[(&'a str, &'a str)]) -> Vec<(&'a str, &'a str)> {
    let mut env = own.to_vec();
    env.extend([UNTHROTTLED_RATE, UNTHROTTLED_BURST, UNCAPPED_ADDRESS]);
    env
}

/// The HTTP heartbeat of agent session `hb-{i}` of `token` in `ns`, as a window's
/// operation (`measure::window`): true when answered 2xx.
pub fn heartbeat_op(
    http: reqwest::Client,
    url: String,
    token: String,
    ns: String,
) -> impl Fn(usize, u64) -> std::pin::Pin<Box<dyn std::future::Future<Output = bool> + Send>> + Clone {
    move |i: usize, _n: u64| {
        let (h, url, tok, ns) = (http.clone(), url.clone(), token.clone(), ns.clone());
        Box::pin(async move {
            let body = serde_json::json!({"namespace": ns, "session_id": format!("hb-{i}")});
            let r = h.post(url).bearer_auth(tok).json(&body).send().await;
            matches!(r, Ok(r) if r.status().is_success())
        })
    }
}

/// The p99 of each window's latencies, in ms.
pub fn p99_ms(windows: &[measure::Window]) -> Vec<f64> {
    windows
        .iter()
        .map(|w| {
            let ms: Vec<f64> = w.latencies.iter().map(|d| d.as_secs_f64() * 1000.0).collect();
            measure::percentile(&ms, 0.99)
        })
        .collect()
}

/// Prints a heartbeat's p99 in quiet windows (`sides[0]`) and attacked ones (`sides[1]`),
/// and their ratio judged against 2x (the limits and abuse benches).
pub fn print_attacked_vs_quiet(sides: &[Vec<measure::Window>]) {
    let quiet = p99_ms(&sides[0]);
    let attacked = p99_ms(&sides[1]);
    println!("heartbeat p99, quiet      {} ms", measure::spread(&quiet, 2));
    println!("heartbeat p99, attacked   {} ms", measure::spread(&attacked, 2));
    let ratios: Vec<f64> = attacked.iter().zip(&quiet).map(|(a, q)| a / q.max(f64::MIN_POSITIVE)).collect();
    println!("attacked / quiet          {}", measure::judged(&ratios, 2, measure::Target::AtMost(2.0)));
}
