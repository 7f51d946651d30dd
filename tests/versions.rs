//! One version for the binary, its crates and the chart, raised with every change a user
//! can see (SPEC §15): the manifests agree with each other and with CHANGELOG.md, each
//! released section's commit holds that version, and nothing a user sees changed after
//! the newest release without a new version.

use prism_testkit as support;

use std::process::Command;

use support::releases::{self, Version};
use support::repo_root;

/// What a user of a release sees: the binary, its migrations, the chart, the CRDs.
const SEEN_BY_USERS: &[&str] =
    &["src", "crates", "migrations", "charts", "crds", "Dockerfile", "Cargo.toml", "Cargo.lock"];

fn git(args: &[&str]) -> (bool, String) {
    let out = Command::new("git").args(args).current_dir(repo_root()).output().expect("git runs");
    (
        out.status.success(),
        String::from_utf8_lossy(if out.status.success() { &out.stdout } else { &out.stderr }).into_owned(),
    )
}

/// The first `key = "value"` / `key: value` of a manifest's text.
fn field(text: &str, key: &str) -> Option<String> {
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(key)?.trim_start();
        let rest = rest.strip_prefix('=').or_else(|| rest.strip_prefix(':'))?;
        Some(rest.trim().trim_matches('"').to_string())
    })
}

fn read(path: &str) -> String {
    std::fs::read_to_string(repo_root().join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

#[test]
fn the_binary_its_crates_and_the_chart_have_one_version() {
    let root = field(&read("Cargo.toml"), "version").expect("Cargo.toml version");
    for krate in ["prism-core", "prism-kube", "prism-store", "prism-api", "prism-testkit"] {
        let path = format!("crates/{krate}/Cargo.toml");
        assert_eq!(field(&read(&path), "version").as_deref(), Some(root.as_str()), "{path}");
    }
    let chart = read("charts/prism-operator/Chart.yaml");
    assert_eq!(field(&chart, "version").as_deref(), Some(root.as_str()), "Chart.yaml version");
    assert_eq!(field(&chart, "appVersion").as_deref(), Some(root.as_str()), "Chart.yaml appVersion");
    let out = Command::new(env!("CARGO_BIN_EXE_prism-operator")).arg("--version").output().expect("the binary runs");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), format!("prism-operator {root}"), "--version");
}

#[test]
fn nothing_a_user_sees_changed_since_the_newest_release_without_a_new_version() {
    let current: Version =
        releases::parse_version(&field(&read("Cargo.toml"), "version").expect("version")).expect("semver");
    let list = releases::changelog(repo_root());
    for release in &list {
        let Some(commit) = &release.commit else { continue };
        let (ok, manifest) = git(&["show", &format!("{commit}:Cargo.toml")]);
        assert!(
            ok,
            "CHANGELOG.md's {} names commit {commit}, which this clone lacks: {manifest}",
            release.version_string()
        );
        assert_eq!(
            field(&manifest, "version"),
            Some(release.version_string()),
            "CHANGELOG.md says {commit} is {}",
            release.version_string()
        );
    }
    // Against the work tree, so an uncommitted change counts too.
    let changed = match list.first().and_then(|r| r.commit.as_deref()) {
        Some(commit) => {
            let mut args = vec!["diff", "--name-only", commit, "--"];
            args.extend_from_slice(SEEN_BY_USERS);
            let (ok, out) = git(&args);
            assert!(ok, "git diff: {out}");
            out.lines().map(str::to_string).collect()
        }
        None => Vec::new(),
    };
    let problems = releases::problems(current, &list, &changed);
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    assert!(
        releases::previous_release(&list, current).is_some(),
        "no released version below {}: the upgrade tests have nothing to start from",
        list[0].version_string()
    );
}
