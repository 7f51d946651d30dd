//! Fail points for the tests (the `failpoints` feature; without it each is nothing): a
//! step made slow on purpose, the fault a test cannot stage for real (a replica slow
//! under load). `FAILPOINTS=<name>=return(<ms>)` in the environment of such a build
//! delays the step named by that many milliseconds.

/// Waits as long as the fail point `name` says, if it is set.
pub async fn delay(name: &str) {
    #[cfg(feature = "failpoints")]
    if let Some(Some(ms)) = fail::eval(name, |arg| arg.and_then(|a| a.parse::<u64>().ok())) {
        tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
    }
    #[cfg(not(feature = "failpoints"))]
    let _ = name;
}

/// Reads `FAILPOINTS` for the life of the process (a build with the feature); nothing
/// otherwise.
pub fn setup() -> impl Drop {
    #[cfg(feature = "failpoints")]
    return fail::FailScenario::setup();
    #[cfg(not(feature = "failpoints"))]
    return Nothing;
}

#[cfg(not(feature = "failpoints"))]
struct Nothing;

#[cfg(not(feature = "failpoints"))]
impl Drop for Nothing {
    fn drop(&mut self) {}
}
