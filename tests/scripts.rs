//! The decisions the scripts make are tested where they are written: Python's unittest
//! over `scripts/tests` (the control plane's port picking, retries and kubeconfig). No
//! service is needed; this runs them as part of `cargo test`.

#[test]
fn the_scripts_own_tests_pass() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = std::process::Command::new("python3")
        .args(["-B", "-m", "unittest", "discover", "-s", "scripts/tests", "-v"])
        .current_dir(root)
        .output()
        .expect("python3 runs");
    let report = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "scripts/tests failed:\n{report}");
    // It found them: an empty discovery also "succeeds".
    let ran = report.lines().find_map(|l| l.strip_prefix("Ran ")?.split_whitespace().next()?.parse::<u32>().ok());
    assert!(ran.is_some_and(|n| n >= 7), "scripts/tests ran {ran:?} tests:\n{report}");
}
