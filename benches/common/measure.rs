//! How every benchmark measures and judges, in one place: a window of work on concurrent
//! tasks, rounds that alternate the sides being compared, and a verdict on the median of
//! the rounds with their spread.
//!
//! One window per side cannot tell a regression from noise on a shared 2-core machine
//! (store/raw SQL gave 0.40, 0.77, 1.08 and 1.11 in four runs). So each figure is taken
//! in at least `MIN_ROUNDS` short rounds, the sides rotating their order from round to
//! round (A B, B A, A B, ...) so a drift of the machine's load weighs on all of them; a
//! ratio is computed per round (the sides of one round ran seconds apart), and reported
//! as the median with its min-max. A result whose min-max crosses its target is
//! "inconclusive", never a pass.
//!
//! Compiled into each bench and into tests/bench_common.rs, which runs the unit tests
//! below (bench targets run without the test harness).

use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Concurrent clients of a window.
pub const CONCURRENCY: usize = 16;
/// The fewest rounds a verdict is given on.
pub const MIN_ROUNDS: usize = 5;
const DEFAULT_WINDOW: Duration = Duration::from_secs(2);

/// Rounds per figure: BENCH_ROUNDS, default `MIN_ROUNDS` (fewer is allowed for a quick
/// look, and then judged inconclusive).
pub fn rounds() -> usize {
    std::env::var("BENCH_ROUNDS").ok().and_then(|v| v.parse().ok()).filter(|n| *n > 0).unwrap_or(MIN_ROUNDS)
}

/// The length of one window: BENCH_WINDOW_MS, default 2 s.
pub fn window_length() -> Duration {
    std::env::var("BENCH_WINDOW_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|ms| *ms > 0)
        .map(Duration::from_millis)
        .unwrap_or(DEFAULT_WINDOW)
}

/// One window of work: the operations that succeeded, how long the window took, and
/// each operation's latency.
#[derive(Clone, Debug, Default)]
pub struct Window {
    pub ops: u64,
    pub seconds: f64,
    pub latencies: Vec<Duration>,
    /// Tasks that stopped at a failure before the window ended.
    pub stopped: usize,
}

impl Window {
    /// Operations per second.
    pub fn rate(&self) -> f64 {
        self.ops as f64 / self.seconds.max(f64::MIN_POSITIVE)
    }

    /// Milliseconds per operation, as one client saw it (concurrency 1).
    pub fn ms_per_op(&self) -> f64 {
        1000.0 * self.seconds / (self.ops as f64).max(f64::MIN_POSITIVE)
    }
}

/// Runs `op(task, n)` on `concurrency` tasks for `length` (n counts each task's calls).
/// A task stops at its first failure (`op` returned false), so a broken side shows as a
/// low rate rather than as a fast loop of errors.
pub async fn window<F, Fut>(concurrency: usize, length: Duration, op: F) -> Window
where
    F: Fn(usize, u64) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = bool> + Send,
{
    window_paced(concurrency, length, None, op).await
}

/// `window` with each task calling at most once per `period` (its call `n` waits for
/// `start + n * period`; the wait is not timed): clients at the pace real ones keep,
/// rather than as fast as they can, so that a latency compared between two windows is
/// not that of a machine the clients themselves saturate. A task that falls behind calls
/// again at once.
pub async fn window_paced<F, Fut>(concurrency: usize, length: Duration, period: Option<Duration>, op: F) -> Window
where
    F: Fn(usize, u64) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = bool> + Send,
{
    let op = Arc::new(op);
    let latencies = Arc::new(Mutex::new(Vec::new()));
    let stopped = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let start = Instant::now();
    let tasks: Vec<_> = (0..concurrency)
        .map(|i| {
            let (op, latencies, stopped) = (op.clone(), latencies.clone(), stopped.clone());
            tokio::spawn(async move {
                let mut mine = Vec::new();
                let mut n = 0u64;
                while start.elapsed() < length {
                    if let Some(period) = period {
                        let slot = start + period.saturating_mul(u32::try_from(n).unwrap_or(u32::MAX));
                        if slot >= start + length {
                            break;
                        }
                        tokio::time::sleep_until(slot.into()).await;
                    }
                    let t = Instant::now();
                    if !op(i, n).await {
                        stopped.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        break;
                    }
                    mine.push(t.elapsed());
                    n += 1;
                }
                latencies.lock().unwrap_or_else(|e| e.into_inner()).extend(mine);
            })
        })
        .collect();
    for t in tasks {
        let _ = t.await;
    }
    let seconds = start.elapsed().as_secs_f64();
    let latencies = std::mem::take(&mut *latencies.lock().unwrap_or_else(|e| e.into_inner()));
    let stopped = stopped.load(std::sync::atomic::Ordering::Relaxed);
    if stopped > 0 {
        // Its rate is low for a reason that is not speed: say so where it is printed.
        eprintln!("warning: {stopped} of {concurrency} tasks stopped at a failure in a window");
    }
    Window { ops: latencies.len() as u64, seconds, latencies, stopped }
}

/// A window at CONCURRENCY for the configured length.
pub async fn rate<F, Fut>(op: F) -> Window
where
    F: Fn(usize, u64) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = bool> + Send,
{
    window(CONCURRENCY, window_length(), op).await
}

/// The order the sides run in during `round`: rotated by one each round, so over the
/// rounds each side takes each position equally often (two sides: A B, B A, A B, ...).
pub fn order(round: usize, sides: usize) -> Vec<usize> {
    (0..sides).map(|k| (round + k) % sides).collect()
}

/// Runs `rounds` rounds of one measurement per side, in `order`, and returns each side's
/// results in round order: `out[side][round]`. `measure(side, round)` takes one window
/// (or whatever one measurement of that side is).
pub async fn interleave<T, F, Fut>(sides: usize, rounds: usize, mut measure: F) -> Vec<Vec<T>>
where
    F: FnMut(usize, usize) -> Fut,
    Fut: Future<Output = T>,
{
    let mut out: Vec<Vec<T>> = (0..sides).map(|_| Vec::with_capacity(rounds)).collect();
    for round in 0..rounds {
        // Each side once per round: its results stay in round order.
        for side in order(round, sides) {
            out[side].push(measure(side, round).await);
        }
    }
    out
}

/// Each round's `a / b`: a ratio of the two sides of one round.
pub fn ratios(a: &[f64], b: &[f64]) -> Vec<f64> {
    a.iter().zip(b).map(|(a, b)| a / b).collect()
}

/// Rates of a side's windows.
pub fn rates(windows: &[Window]) -> Vec<f64> {
    windows.iter().map(Window::rate).collect()
}

/// The median of some values and their min-max. NaNs (a round that measured nothing)
/// are left out.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Spread {
    pub median: f64,
    pub min: f64,
    pub max: f64,
    pub n: usize,
}

impl Spread {
    pub fn of(values: &[f64]) -> Option<Spread> {
        let mut v: Vec<f64> = values.iter().copied().filter(|x| !x.is_nan()).collect();
        v.sort_by(f64::total_cmp);
        let n = v.len();
        let median = match n {
            0 => return None,
            _ if n % 2 == 1 => v[n / 2],
            _ => (v[n / 2 - 1] + v[n / 2]) / 2.0,
        };
        Some(Spread { median, min: v[0], max: v[n - 1], n })
    }

    /// "0.95 (0.90-1.01)" with `digits` decimals.
    pub fn show(&self, digits: usize) -> String {
        format!("{:.*} ({:.*}-{:.*})", digits, self.median, digits, self.min, digits, self.max)
    }
}

/// What a figure is held to.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Target {
    AtLeast(f64),
    AtMost(f64),
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Target::AtLeast(t) => write!(f, ">= {t}"),
            Target::AtMost(t) => write!(f, "<= {t}"),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Every round met the target.
    Pass,
    /// No round met it.
    Fail,
    /// The spread crosses the target, or there were too few rounds to say.
    Inconclusive,
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Verdict::Pass => "PASS",
            Verdict::Fail => "FAIL",
            Verdict::Inconclusive => "INCONCLUSIVE",
        })
    }
}

impl Target {
    pub fn met_by(&self, x: f64) -> bool {
        match *self {
            Target::AtLeast(t) => x >= t,
            Target::AtMost(t) => x <= t,
        }
    }

    /// Pass only when the whole spread meets the target; fail only when none of it does.
    pub fn verdict(&self, spread: Option<&Spread>) -> Verdict {
        match spread {
            Some(s) if s.n >= MIN_ROUNDS && self.met_by(s.min) && self.met_by(s.max) => Verdict::Pass,
            Some(s) if s.n >= MIN_ROUNDS && !self.met_by(s.min) && !self.met_by(s.max) => Verdict::Fail,
            _ => Verdict::Inconclusive,
        }
    }
}

/// One judged figure, as every bench prints it:
/// "0.95 (0.90-1.01) over 5 rounds   target >= 0.7: PASS".
pub fn judged(values: &[f64], digits: usize, target: Target) -> String {
    let spread = Spread::of(values);
    let verdict = target.verdict(spread.as_ref());
    let why = match spread {
        Some(s) if s.n < MIN_ROUNDS => format!(" (fewer than {MIN_ROUNDS} rounds)"),
        Some(_) if verdict == Verdict::Inconclusive => " (the spread crosses the target)".to_string(),
        None => " (nothing measured)".to_string(),
        _ => String::new(),
    };
    match spread {
        Some(s) => format!("{} over {} rounds   target {target}: {verdict}{why}", s.show(digits), s.n),
        None => format!("-   target {target}: {verdict}{why}"),
    }
}

/// A figure without a target: "2 564 (2 400-2 700)".
pub fn spread(values: &[f64], digits: usize) -> String {
    Spread::of(values).map_or_else(|| "-".to_string(), |s| s.show(digits))
}

/// The `p` quantile (0..=1) of some values, nearest rank; NaNs are left out, NaN when
/// nothing is left.
pub fn percentile(values: &[f64], p: f64) -> f64 {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| !x.is_nan()).collect();
    v.sort_by(f64::total_cmp);
    let rank = ((v.len() as f64 * p).ceil() as usize).saturating_sub(1);
    v.get(rank.min(v.len().saturating_sub(1))).copied().unwrap_or(f64::NAN)
}

/// One machine-readable line of a figure at a size, for scripts/bench-plot:
/// `SCALE n=1000 figure=rss_mib median=42.1 min=40.0 max=44.2 rounds=5`.
pub fn scale_line(n: usize, figure: &str, values: &[f64]) -> String {
    match Spread::of(values) {
        Some(s) => format!(
            "SCALE n={n} figure={figure} median={:.4} min={:.4} max={:.4} rounds={}",
            s.median, s.min, s.max, s.n
        ),
        None => format!("SCALE n={n} figure={figure} median=nan min=nan max=nan rounds=0"),
    }
}

#[cfg(test)]
// Bench targets compile this with cfg(test) but without the harness, which drops the
// #[test] functions and leaves the import unused there.
#[allow(unused_imports)]
mod tests {
    use super::*;

    fn five(v: [f64; 5]) -> Spread {
        Spread::of(&v).expect("values")
    }

    #[test]
    fn median_and_spread() {
        assert_eq!(five([3.0, 1.0, 2.0, 5.0, 4.0]), Spread { median: 3.0, min: 1.0, max: 5.0, n: 5 });
        let even = Spread::of(&[4.0, 1.0, 3.0, 2.0]).expect("values");
        assert_eq!((even.median, even.n), (2.5, 4));
        let with_nan = Spread::of(&[f64::NAN, 2.0, 1.0]).expect("values");
        assert_eq!((with_nan.median, with_nan.n), (1.5, 2));
        assert_eq!(Spread::of(&[]), None);
        assert_eq!(Spread::of(&[f64::NAN]), None);
        assert_eq!(five([0.9, 0.95, 1.01, 0.93, 0.97]).show(2), "0.95 (0.90-1.01)");
    }

    #[test]
    fn a_spread_that_crosses_its_target_is_inconclusive() {
        let at_least = Target::AtLeast(0.7);
        assert_eq!(at_least.verdict(Some(&five([0.8, 0.9, 1.0, 0.75, 0.7]))), Verdict::Pass);
        assert_eq!(at_least.verdict(Some(&five([0.4, 0.77, 1.08, 1.11, 0.9]))), Verdict::Inconclusive);
        assert_eq!(at_least.verdict(Some(&five([0.4, 0.5, 0.6, 0.69, 0.3]))), Verdict::Fail);
        let at_most = Target::AtMost(1.5);
        assert_eq!(at_most.verdict(Some(&five([1.0, 1.1, 1.5, 1.2, 1.3]))), Verdict::Pass);
        assert_eq!(at_most.verdict(Some(&five([1.0, 1.1, 1.6, 1.2, 1.3]))), Verdict::Inconclusive);
        assert_eq!(at_most.verdict(Some(&five([1.6, 1.7, 2.0, 1.51, 3.0]))), Verdict::Fail);
    }

    #[test]
    fn too_few_rounds_or_none_is_inconclusive() {
        let t = Target::AtLeast(0.5);
        let four = Spread::of(&[1.0, 1.0, 1.0, 1.0]).expect("values");
        assert_eq!(t.verdict(Some(&four)), Verdict::Inconclusive);
        assert_eq!(t.verdict(None), Verdict::Inconclusive);
        assert!(judged(&[1.0; 4], 2, t).ends_with("INCONCLUSIVE (fewer than 5 rounds)"));
        assert!(judged(&[], 2, t).ends_with("INCONCLUSIVE (nothing measured)"));
    }

    #[test]
    fn judged_lines_read_as_printed() {
        assert_eq!(
            judged(&[0.9, 0.95, 1.01, 0.93, 0.97], 2, Target::AtLeast(0.7)),
            "0.95 (0.90-1.01) over 5 rounds   target >= 0.7: PASS"
        );
        assert_eq!(
            judged(&[0.4, 0.77, 1.08, 1.11, 0.9], 2, Target::AtLeast(0.7)),
            "0.90 (0.40-1.11) over 5 rounds   target >= 0.7: INCONCLUSIVE (the spread crosses the target)"
        );
        assert_eq!(spread(&[2400.0, 2564.4, 2700.0], 0), "2564 (2400-2700)");
    }

    #[test]
    fn percentiles_and_scale_lines() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.5), 50.0);
        assert_eq!(percentile(&v, 0.99), 99.0);
        assert_eq!(percentile(&v, 1.0), 100.0);
        assert_eq!(percentile(&[3.0, f64::NAN, 1.0], 0.0), 1.0);
        assert!(percentile(&[], 0.5).is_nan());
        assert_eq!(
            scale_line(1000, "rss_mib", &[40.0, 42.0, 41.0]),
            "SCALE n=1000 figure=rss_mib median=41.0000 min=40.0000 max=42.0000 rounds=3"
        );
        assert_eq!(scale_line(10, "x", &[f64::NAN]), "SCALE n=10 figure=x median=nan min=nan max=nan rounds=0");
    }

    #[test]
    fn sides_rotate_so_each_takes_each_place() {
        let two: Vec<Vec<usize>> = (0..4).map(|r| order(r, 2)).collect();
        assert_eq!(two, [[0, 1], [1, 0], [0, 1], [1, 0]]);
        let three: Vec<Vec<usize>> = (0..3).map(|r| order(r, 3)).collect();
        assert_eq!(three, [[0, 1, 2], [1, 2, 0], [2, 0, 1]]);
        for place in 0..3 {
            let mut seen: Vec<usize> = three.iter().map(|o| o[place]).collect();
            seen.sort();
            assert_eq!(seen, [0, 1, 2], "place {place}");
        }
    }

    #[test]
    fn interleave_runs_every_side_every_round_in_order() {
        let rt = tokio::runtime::Builder::new_current_thread().build().expect("runtime");
        let mut log = Vec::new();
        let out = rt.block_on(interleave(2, 3, |side, round| {
            log.push((side, round));
            async move { side * 10 + round }
        }));
        assert_eq!(out, [vec![0, 1, 2], vec![10, 11, 12]]);
        assert_eq!(log, [(0, 0), (1, 0), (1, 1), (0, 1), (0, 2), (1, 2)]);
        assert_eq!(ratios(&[2.0, 3.0], &[4.0, 3.0]), [0.5, 1.0]);
    }

    #[test]
    fn windows_count_what_succeeded() {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
        let w = rt.block_on(window(3, Duration::from_millis(200), |task, n| async move {
            tokio::time::sleep(Duration::from_millis(10)).await;
            // Task 0 fails at its fifth call: it stops, the others carry on.
            !(task == 0 && n == 4)
        }));
        let per_task = w.seconds / 0.010;
        assert!(w.ops >= 4 + 2 * 10 && (w.ops as f64) <= 4.0 + 2.0 * per_task + 2.0, "{} ops", w.ops);
        assert_eq!(w.latencies.len() as u64, w.ops);
        assert_eq!(w.stopped, 1);
        assert!(w.latencies.iter().all(|l| *l >= Duration::from_millis(10)));
        assert!((w.rate() - w.ops as f64 / w.seconds).abs() < 1e-9);
    }
}
