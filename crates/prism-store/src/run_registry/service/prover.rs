//! A hello's signature is checked on a thread of its own, one at a time, never on the
//! runtime's workers (SPEC §12, "A refusal costs the refused, not the victim").
//!
//! An Ed25519 verification is ~70 µs of CPU that does not yield. Checked on the async
//! workers, a flood of forged hellos (the abuse bench: 10,000, 64 in flight) kept their
//! run queues full of such tasks, and every other request — an agent's heartbeat — was
//! queued behind dozens of them: its p99 went from 0.9 ms to 11-13 ms with the operator
//! using 0.4 of its 2 cores. Here the proofs queue for one thread instead: a flood slows
//! the hellos down (at most ~14,000 a second, in arrival order), not everyone else.

use tokio::sync::{mpsc, oneshot};

use super::{Hello, ProofRefused, check_proof};

/// Proofs waiting for the thread; a caller past them waits to hand its own over.
const QUEUE: usize = 256;

struct Job {
    hello: Hello,
    key_generation: i64,
    public_key: String,
    now: i64,
    answer: oneshot::Sender<Result<(), ProofRefused>>,
}

/// The proof thread's queue. The thread ends when the last clone is dropped.
#[derive(Clone)]
pub(crate) struct Prover {
    jobs: mpsc::Sender<Job>,
}

impl Prover {
    /// Starts the thread. Without one (the system refused a thread), proofs are checked
    /// by their callers, as before.
    pub(crate) fn start() -> Option<Prover> {
        let (jobs, mut queue) = mpsc::channel::<Job>(QUEUE);
        let started = std::thread::Builder::new().name("prism-proofs".into()).spawn(move || {
            lower_priority();
            while let Some(job) = queue.blocking_recv() {
                let checked = check_proof(&job.hello, job.key_generation, &job.public_key, job.now);
                // The caller may have gone (its request was cut): nothing to tell.
                let _ = job.answer.send(checked);
            }
        });
        match started {
            Ok(_) => Some(Prover { jobs }),
            Err(error) => {
                tracing::warn!(%error, "no thread for hello proofs: they are checked on the runtime's workers");
                None
            }
        }
    }

    /// `check_proof` on the proof thread.
    pub(crate) async fn check(
        prover: Option<&Prover>,
        hello: &Hello,
        key_generation: i64,
        public_key: &str,
        now: i64,
    ) -> Result<(), ProofRefused> {
        let Some(prover) = prover else { return check_proof(hello, key_generation, public_key, now) };
        let (answer, answered) = oneshot::channel();
        let job = Job { hello: hello.clone(), key_generation, public_key: public_key.to_string(), now, answer };
        if prover.jobs.send(job).await.is_err() {
            return check_proof(hello, key_generation, public_key, now);
        }
        match answered.await {
            Ok(checked) => checked,
            // The thread died with the job (a panic in the check): checked here instead.
            Err(_) => check_proof(hello, key_generation, public_key, now),
        }
    }
}

/// How much lower than the workers the proof thread runs (nice 10: about a tenth of a
/// contended core against a worker's share). On two cores a flood of forged hellos kept
/// this thread busy at the workers' priority and every heartbeat waited for a core; a
/// Run's hello waits instead. Linux's nice value is per thread (setpriority(2), BUGS),
/// so `who = 0` is this thread alone.
const NICE: i32 = 10;

fn lower_priority() {
    #[cfg(target_os = "linux")]
    // SAFETY: setpriority only reads its arguments; 0 names the calling thread.
    let refused = unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, NICE) } != 0;
    #[cfg(not(target_os = "linux"))]
    let refused = false;
    if refused {
        tracing::debug!(error = %std::io::Error::last_os_error(), "the proof thread keeps the workers' priority");
    }
}

#[cfg(test)]
mod tests {
    use base64::Engine as _;
    use base64::engine::general_purpose::STANDARD;
    use ed25519_dalek::{Signer, SigningKey};

    use super::*;
    use crate::run_registry::proof;

    fn signed(key: &SigningKey, timestamp: i64, nonce: &str) -> Hello {
        let message = proof::hello_message("srv-1", "run", 2, timestamp, nonce);
        Hello {
            server_instance_id: "srv-1".into(),
            component_kind: "run".into(),
            key_generation: 2,
            timestamp,
            nonce: nonce.into(),
            signature: STANDARD.encode(key.sign(message.as_bytes()).to_bytes()),
            version: None,
            target: None,
            capabilities: None,
            capacity: None,
        }
    }

    /// The proofs' thread runs below the workers (its nice value, read from /proc).
    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn the_thread_runs_below_the_workers_priority() {
        let prover = Prover::start().expect("a thread");
        let key = SigningKey::from_bytes(&[7u8; 32]);
        let public = STANDARD.encode(key.verifying_key().to_bytes());
        // Once it has answered, it has lowered itself.
        let _ = Prover::check(Some(&prover), &signed(&key, 1_764_400_000, "n-0"), 2, &public, 1_764_400_000).await;
        let mut nices = Vec::new();
        for task in std::fs::read_dir("/proc/self/task").unwrap() {
            let dir = task.unwrap().path();
            if std::fs::read_to_string(dir.join("comm")).unwrap_or_default().trim() == "prism-proofs" {
                let stat = std::fs::read_to_string(dir.join("stat")).unwrap();
                // Fields after the command's closing parenthesis: nice is the 17th.
                let after = &stat[stat.rfind(')').unwrap() + 2..];
                nices.push(after.split(' ').nth(16).unwrap().parse::<i32>().unwrap());
            }
        }
        assert!(!nices.is_empty(), "no prism-proofs thread");
        assert!(nices.iter().all(|n| *n == NICE), "nice values of the proof threads: {nices:?}");
    }

    /// The thread answers as the function does, for each of many callers at once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_thread_answers_each_caller_as_check_proof_would() {
        let key = SigningKey::from_bytes(&[7u8; 32]);
        let other = SigningKey::from_bytes(&[8u8; 32]);
        let public = STANDARD.encode(key.verifying_key().to_bytes());
        let prover = Prover::start().expect("a thread");
        let now = 1_764_400_000;
        let mut calls = Vec::new();
        for n in 0..100 {
            let (prover, public) = (prover.clone(), public.clone());
            let hello = signed(if n % 2 == 0 { &key } else { &other }, now, &format!("nonce-{n:012}"));
            calls.push(tokio::spawn(async move {
                let got = Prover::check(Some(&prover), &hello, 2, &public, now).await;
                (n, got, check_proof(&hello, 2, &public, now))
            }));
        }
        for call in calls {
            let (n, got, want) = call.await.expect("call");
            assert_eq!(got, want, "caller {n}");
            assert_eq!(got.is_ok(), n % 2 == 0, "caller {n}: signed by the identity's key or not");
        }
        let stale = signed(&key, now, "nonce-stale-00001");
        assert_eq!(Prover::check(Some(&prover), &stale, 3, &public, now).await, Err(ProofRefused::StaleGeneration));
        assert_eq!(Prover::check(None, &stale, 2, &public, now).await, Ok(()), "without a thread, inline");
    }
}
