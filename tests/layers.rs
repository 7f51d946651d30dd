//! The layers hold (issue 22). The domain crate (`prism-core`) links none of the outer
//! layers' crates; the Kubernetes crate (`prism-kube`) none of the stores' or the API's;
//! the stores' crate (`prism-store`) neither the Kubernetes client nor the API's; the
//! API's crate (`prism-api`) no database or Redis driver of its own.
//! Within each crate, no import cycle: a module's non-test code names other modules as
//! `crate::…` or `super::…`, and following those names never leads back to where it
//! started. A cycle would let any layer reach any other; this holds the line within a
//! crate, where the compiler does not (between crates it does).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Module path ("api::mcp", "" for the crate root) → the source of its non-test code, of
/// the crate whose `src` is `root`.
fn modules(root: &Path) -> BTreeMap<String, String> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<String, String>) {
        let mut entries: Vec<_> = std::fs::read_dir(dir).expect("read src").flatten().map(|e| e.path()).collect();
        entries.sort();
        for path in entries {
            if path.is_dir() {
                walk(root, &path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let rel = path.strip_prefix(root).expect("under src");
                let mut parts: Vec<String> =
                    rel.with_extension("").iter().map(|p| p.to_string_lossy().into_owned()).collect();
                if matches!(parts.last().map(String::as_str), Some("mod" | "lib" | "main")) {
                    parts.pop();
                }
                let text = std::fs::read_to_string(&path).expect("read module");
                // Tests may reach anywhere: what is checked is the code that ships.
                let code = text.split("#[cfg(test)]").next().unwrap_or_default().to_string();
                out.entry(parts.join("::")).or_default().push_str(&code);
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(root, root, &mut out);
    out
}

/// The module of `path` (the longest prefix that is a module).
fn resolve(path: &str, modules: &BTreeMap<String, String>) -> Option<String> {
    let segments: Vec<&str> = path.split("::").filter(|s| !s.is_empty()).collect();
    (1..=segments.len()).rev().map(|k| segments[..k].join("::")).find(|m| modules.contains_key(m))
}

fn edges(modules: &BTreeMap<String, String>) -> BTreeMap<String, BTreeSet<String>> {
    let named = regex::Regex::new(r"\b(crate|super)::([a-z_][a-z0-9_]*(?:::[a-z_][a-z0-9_]*)*)").expect("regex");
    let mut edges = BTreeMap::new();
    for (module, code) in modules {
        let mut to = BTreeSet::new();
        for c in named.captures_iter(code) {
            let path = if &c[1] == "super" {
                let parent = module.rsplit_once("::").map(|(p, _)| p).unwrap_or("");
                format!("{parent}::{}", &c[2])
            } else {
                c[2].to_string()
            };
            if let Some(target) = resolve(&path, modules)
                && &target != module
            {
                to.insert(target);
            }
        }
        edges.insert(module.clone(), to);
    }
    edges
}

/// The strongly connected components of more than one module (Tarjan).
fn cycles(edges: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct Walk<'a> {
        edges: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        found: Vec<Vec<String>>,
    }
    fn visit<'a>(w: &mut Walk<'a>, v: &'a str) {
        let i = w.index.len();
        w.index.insert(v, i);
        w.low.insert(v, i);
        w.stack.push(v);
        for t in &w.edges[v] {
            if !w.index.contains_key(t.as_str()) {
                visit(w, t);
                let l = w.low[t.as_str()].min(w.low[v]);
                w.low.insert(v, l);
            } else if w.stack.contains(&t.as_str()) {
                let l = w.index[t.as_str()].min(w.low[v]);
                w.low.insert(v, l);
            }
        }
        if w.low[v] == w.index[v] {
            let mut component = Vec::new();
            while let Some(m) = w.stack.pop() {
                component.push(m.to_string());
                if m == v {
                    break;
                }
            }
            if component.len() > 1 {
                component.sort();
                w.found.push(component);
            }
        }
    }
    let mut w = Walk { edges, index: BTreeMap::new(), low: BTreeMap::new(), stack: Vec::new(), found: Vec::new() };
    for v in edges.keys() {
        if !w.index.contains_key(v.as_str()) {
            visit(&mut w, v);
        }
    }
    w.found
}

#[test]
fn the_modules_form_no_import_cycle() {
    let operator = modules(Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/src")));
    assert!(operator.contains_key("config") && operator.contains_key("commands::run"), "the walk found the modules");
    let found = cycles(&edges(&operator));
    assert!(found.is_empty(), "import cycles among the operator crate's modules: {found:?}");
    let api = modules(Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/crates/prism-api/src")));
    assert!(api.contains_key("mcp::tools") && api.contains_key("transport::tls"), "the walk found the modules");
    let found = cycles(&edges(&api));
    assert!(found.is_empty(), "import cycles among prism-api's modules: {found:?}");
    let kube = modules(Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/crates/prism-kube/src")));
    assert!(kube.contains_key("reconcilers::registration"), "the walk found the modules");
    let found = cycles(&edges(&kube));
    assert!(found.is_empty(), "import cycles among prism-kube's modules: {found:?}");
    let store = modules(Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/crates/prism-store/src")));
    assert!(store.contains_key("election::store") && store.contains_key("run_registry::jobs"), "the walk found them");
    let found = cycles(&edges(&store));
    assert!(found.is_empty(), "import cycles among prism-store's modules: {found:?}");
}

#[test]
fn the_check_finds_a_cycle_when_there_is_one() {
    let mut modules = BTreeMap::new();
    modules.insert("a".to_string(), "use crate::b::Thing;".to_string());
    modules.insert("b".to_string(), "fn f() { super::c::g() }".to_string());
    modules.insert("c".to_string(), "use crate::a;".to_string());
    modules.insert("d".to_string(), "use crate::a;".to_string());
    assert_eq!(cycles(&edges(&modules)), vec![vec!["a".to_string(), "b".to_string(), "c".to_string()]]);
}

/// The crates a layer of the domain must not depend on (issue 22): the outer layers'.
const OUTER: &[&str] =
    &["kube", "kube_client", "kube_runtime", "k8s_openapi", "sqlx", "axum", "rmcp", "redis", "hyper"];

/// The libraries `package` links in normal builds with its default features (what
/// `cargo tree` resolves, from Cargo.lock, offline); `depth` 1: those it names itself.
fn tree(package: &str, depth: Option<u32>) -> BTreeSet<String> {
    let depth = depth.map(|d| d.to_string());
    let out = std::process::Command::new(env!("CARGO"))
        .args(["tree", "-p", package, "-e", "normal", "--prefix", "none", "-f", "{lib}", "--offline", "--locked"])
        .args(depth.iter().flat_map(|d| ["--depth", d.as_str()]))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run cargo tree");
    assert!(out.status.success(), "cargo tree -p {package}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| l.trim_end_matches(" (*)").trim().to_string())
        .filter(|l| !l.is_empty())
        .collect()
}

fn linked(package: &str) -> BTreeSet<String> {
    tree(package, None)
}

#[test]
fn the_domain_crate_links_none_of_the_outer_layers() {
    let core = linked("prism-core");
    assert!(core.contains("chrono") && core.contains("ed25519_dalek"), "the tree was read: {core:?}");
    let outer: Vec<&&str> = OUTER.iter().filter(|c| core.contains(**c)).collect();
    assert!(outer.is_empty(), "prism-core links {outer:?}; their codecs belong behind a feature or in an adapter");
    // The check sees them where they are.
    let operator = linked("prism-operator");
    for c in ["kube", "sqlx", "axum", "rmcp", "redis"] {
        assert!(operator.contains(c), "{c} not found in prism-operator's tree: the check reads the wrong thing");
    }
}

/// What the Kubernetes side must not link: the stores' and the API's crates. Its
/// reconcilers drive the stores through prism-core's traits, which is what lets them be
/// tested with no service (`cargo test -p prism-kube`).
const STORES_AND_API: &[&str] = &["sqlx", "redis", "axum", "rmcp", "axum_server", "utoipa_axum"];

#[test]
fn the_kubernetes_crate_links_no_store_and_no_api() {
    let kube = linked("prism-kube");
    assert!(kube.contains("kube_runtime") && kube.contains("prism_core"), "the tree was read: {kube:?}");
    let found: Vec<&&str> = STORES_AND_API.iter().filter(|c| kube.contains(**c)).collect();
    assert!(found.is_empty(), "prism-kube links {found:?}; the stores belong behind prism-core's traits");
}

/// What the API's modules may not name: the database and Redis clients. The HTTP and MCP
/// handlers parse, authorize, call a service or a store's method, and map errors; the
/// SQL and the Redis commands are the stores' (election, run_registry, mcp_store).
const DRIVERS: &[&str] = &["sqlx", "PgPool", "PgConnection", "redis::"];

/// The API's modules whose shipped code names a driver, with what it names.
fn api_reaching_drivers(modules: &BTreeMap<String, String>) -> Vec<(String, &'static str)> {
    let mut found = Vec::new();
    for (path, code) in modules {
        for driver in DRIVERS {
            if code.contains(driver) {
                found.push((path.clone(), *driver));
            }
        }
    }
    found
}

#[test]
fn the_api_runs_no_sql_and_no_redis_command_of_its_own() {
    // Its crate cannot: it does not depend on the drivers (they reach it only through
    // prism-store, whose services run the SQL and the Redis commands)...
    let direct = tree("prism-api", Some(1));
    assert!(direct.contains("axum") && direct.contains("prism_store"), "the tree was read: {direct:?}");
    let drivers: Vec<&str> = ["sqlx", "redis"].into_iter().filter(|c| direct.contains(*c)).collect();
    assert!(drivers.is_empty(), "prism-api depends on {drivers:?} itself; the stores own the drivers");
    // ...and no module names them through prism-store's re-exports either.
    let api = modules(Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/crates/prism-api/src")));
    assert!(api.len() > 15, "the walk found the API's modules");
    let found = api_reaching_drivers(&api);
    assert!(found.is_empty(), "the API reaches past the stores: {found:?}");
    // The check sees one where it is.
    let mut planted = BTreeMap::new();
    planted.insert("health".to_string(), "sqlx::query(\"SELECT 1\")".to_string());
    planted.insert("runs".to_string(), "let n = state.registry.census().await;".to_string());
    assert_eq!(api_reaching_drivers(&planted), vec![("health".to_string(), "sqlx")]);
}

/// What the stores must not link: the Kubernetes client and the API's crates. The
/// reconcilers drive them through prism-core's traits, the API through their methods.
const KUBE_AND_API: &[&str] = &["kube", "kube_client", "kube_runtime", "k8s_openapi", "axum", "rmcp", "prism_kube"];

#[test]
fn the_store_crate_links_no_kubernetes_and_no_api() {
    let store = linked("prism-store");
    assert!(store.contains("sqlx") && store.contains("redis") && store.contains("prism_core"), "read: {store:?}");
    let found: Vec<&&str> = KUBE_AND_API.iter().filter(|c| store.contains(**c)).collect();
    assert!(found.is_empty(), "prism-store links {found:?}; the stores are reached through traits and methods");
}

#[test]
fn no_store_hands_out_its_connections() {
    let operator = modules(Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/src")));
    let api = modules(Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/crates/prism-api/src")));
    let store = modules(Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/crates/prism-store/src")));
    assert!(store.contains_key("election::store") && api.contains_key("mcp"), "the walk found the crates");
    let open: Vec<String> = [("prism-operator", &operator), ("prism-api", &api), ("prism-store", &store)]
        .iter()
        .flat_map(|(krate, modules)| {
            modules
                .iter()
                .filter(|(_, code)| {
                    code.contains("pub fn pool(") || code.contains("pub pool:") || code.contains("pub conn:")
                })
                .map(move |(path, _)| format!("{krate}::{path}"))
        })
        .collect();
    assert!(open.is_empty(), "these modules hand out a store's pool or connection: {open:?}");
}
