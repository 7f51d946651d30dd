//! The OpenAPI document as a client meets it (issue #13): served at
//! `GET /api/v1/openapi.json` without a token, OpenAPI 3.1, and true of the running
//! router: every documented operation is answered by its handler (not the fallback's 404
//! `no such endpoint`, not a 405), every other method on a documented path is a 405, and
//! paths next to documented ones are the fallback's 404. (`api::docs`' unit tests compare
//! the router's own route table with the document; scripts/fuzz-api runs the full
//! validator and schemathesis.)

use prism_testkit as support;

use serde_json::Value;
use support::{Operator, TestDb, control_plane};

const METHODS: [&str; 7] = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE"];

/// A path of the document with its parameters filled in.
fn concrete(path: &str) -> String {
    path.split('/')
        .map(|s| match s {
            "{id}" => "00000000-0000-4000-8000-000000000000",
            "{project_id}" => "P",
            "{server_instance_id}" => "srv-1",
            other => other,
        })
        .collect::<Vec<_>>()
        .join("/")
}

#[tokio::test]
async fn the_served_document_is_true_of_the_router() {
    let cp = control_plane().await;
    let client = cp.client().await;
    let ns = support::namespace(&client, "openapi").await;
    let db = TestDb::new().await;
    let op = Operator::start(cp, &db.url, &ns, &[]).await;
    let http = support::http();

    let r = http.get(op.url("/api/v1/openapi.json")).send().await.expect("GET openapi.json");
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "application/json");
    let doc: Value = r.json().await.expect("the document is JSON");
    assert_eq!(doc["openapi"], "3.1.0");
    let paths = doc["paths"].as_object().expect("paths");
    assert!(paths.len() >= 14, "{:?}", paths.keys());

    for (path, item) in paths {
        let url = op.url(&concrete(path));
        let documented: Vec<String> = item.as_object().expect("path item").keys().map(|m| m.to_uppercase()).collect();
        for method in METHODS {
            let m = reqwest::Method::from_bytes(method.as_bytes()).expect("method");
            // No token, no body: refused early by every handler, so nothing is written.
            let r = http.request(m, &url).send().await.expect("request");
            let status = r.status().as_u16();
            let body: Value = r.json().await.unwrap_or(Value::Null);
            let fallback = status == 404 && body["error"]["message"] == "no such endpoint";
            if documented.iter().any(|d| d == method) {
                assert!(!fallback && status != 405, "{method} {path}: answered {status} {body}");
                let documented_status = item[method.to_lowercase()]["responses"].get(status.to_string());
                assert!(documented_status.is_some(), "{method} {path}: {status} is not in the document");
            } else {
                assert_eq!(status, 405, "{method} {path}: not documented, yet answered {status} {body}");
            }
        }
        // A sibling of a documented path is no route (unless a documented template
        // takes it, as `/jobs/{id}` takes `/jobs/nope`).
        let sibling = format!("{}/nope", concrete(path));
        if paths.keys().any(|template| matches_template(template, &sibling)) {
            continue;
        }
        let r = http.post(op.url(&sibling)).send().await.expect("request");
        assert_eq!(r.status(), 404, "{path}/nope");
    }
}

/// Whether `path` is one `template` names (`{x}` matches any one segment).
fn matches_template(template: &str, path: &str) -> bool {
    let (t, p): (Vec<&str>, Vec<&str>) = (template.split('/').collect(), path.split('/').collect());
    t.len() == p.len() && t.iter().zip(&p).all(|(a, b)| (a.starts_with('{') && a.ends_with('}')) || a == b)
}
