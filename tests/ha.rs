//! High availability: two operator processes on one database and namespace; only the
//! Lease holder reconciles, the other takes over within the lease duration when the
//! leader dies, and Postgres never shows two masters of a project.

use prism_testkit as support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;
use kube::api::PostParams;
use prism_operator::crd::{AgentSurface, ControllerRegistration, Role};
use support::{Operator, TestDb, control_plane, creg, eventually, role};

const LEASE: &str = support::LEADER_LEASE;

/// One look at the cluster, taken by the sampler every few tens of milliseconds.
#[derive(Clone, Debug)]
struct Sample {
    at: Instant,
    /// The Lease's holder (None before anyone took it).
    holder: Option<String>,
    /// Reconciles each replica has run so far (its /metrics), None once it is gone.
    reconciles: [Option<u64>; 2],
    /// The most live masters any project has in Postgres.
    max_masters: i64,
}

/// Sum of `prism_reconciles_total` over every controller, from a /metrics text.
fn reconciles(metrics: &str) -> u64 {
    metrics
        .lines()
        .filter(|l| l.starts_with("prism_reconciles_total{"))
        .map(|l| l.rsplit(' ').next().and_then(|n| n.parse::<u64>().ok()).expect("a counter value"))
        .sum()
}

/// The standby (up, answering /metrics) had run no reconcile at any of these samples.
fn assert_standby_idle(samples: &[Sample], standby: usize, leader: &str) {
    for s in samples {
        assert_eq!(s.reconciles[standby], Some(0), "the standby reconciled while {leader} held the Lease: {s:?}");
    }
}

#[tokio::test]
async fn the_standby_takes_over_when_the_leader_dies() {
    let cp = control_plane().await;
    let client = cp.client().await;
    let ns = support::namespace(&client, "ha").await;
    let db = TestDb::new().await;
    let start = |pod: &'static str| {
        let (cp, db_url, ns) = (cp, db.url.clone(), ns.clone());
        async move { Operator::replica(cp, &db_url, &ns, pod).await }
    };
    const PODS: [&str; 2] = ["replica-a", "replica-b"];
    let mut replicas = [Some(start(PODS[0]).await), Some(start(PODS[1]).await)];
    let bases: Vec<String> = replicas.iter().flatten().map(|op| op.base.clone()).collect();
    // The Lease lives in the operator's own namespace.
    let leases: Api<Lease> = Api::namespaced(client.clone(), support::OPERATOR_NAMESPACE);

    // Watch the whole failover: the Lease holder, each replica's reconcile count and
    // Postgres's masters, continuously, from now until the end.
    let samples = Arc::new(Mutex::new(Vec::<Sample>::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (leases, pool, samples, stop) = (leases.clone(), db.pool.clone(), samples.clone(), stop.clone());
        tokio::spawn(async move {
            let http = support::http();
            while !stop.load(Ordering::Relaxed) {
                // Counts first, then the holder: a replica that has reconciled by the
                // time of its count holds the Lease by the time of the holder's read.
                let mut counts = [None, None];
                for (count, base) in counts.iter_mut().zip(&bases) {
                    let text = match http.get(format!("{base}/metrics")).send().await {
                        Ok(r) => r.text().await.ok(),
                        Err(_) => None,
                    };
                    *count = text.map(|t| reconciles(&t));
                }
                let holder = leases.get_opt(LEASE).await.expect("read the Lease").and_then(|l| l.spec?.holder_identity);
                let max_masters: i64 = sqlx::query_scalar(
                    "SELECT coalesce(max(n), 0) FROM (SELECT count(*) AS n FROM controller_registrations
                     WHERE is_master AND released_at IS NULL GROUP BY namespace, project_id) AS live",
                )
                .fetch_one(&pool)
                .await
                .expect("count live masters");
                let sample = Sample { at: Instant::now(), holder, reconciles: counts, max_masters };
                samples.lock().expect("samples").push(sample);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    let latest = || samples.lock().expect("samples").last().cloned();

    let leader =
        eventually(20, "a leader", || async { leases.get_opt(LEASE).await.ok().flatten()?.spec?.holder_identity })
            .await;
    let (lead, standby) = match PODS.iter().position(|p| *p == leader) {
        Some(i) => (i, 1 - i),
        None => panic!("the Lease is held by {leader:?}, not by one of {PODS:?}"),
    };

    let api: Api<ControllerRegistration> = Api::namespaced(client.clone(), &ns);
    api.create(&PostParams::default(), &creg("one", "HA", "s1", AgentSurface::Codex)).await.expect("create");
    role(&api, "one", Role::Master, 15).await;
    api.create(&PostParams::default(), &creg("two", "HA", "s2", AgentSurface::Cursor)).await.expect("create");
    role(&api, "two", Role::Peer, 15).await;
    // The sampler has seen the leader's reconciles and the master in Postgres 25 times
    // (about a second: a standby that reconciled too would have done it by then) ...
    let settled = |s: &Sample| s.reconciles[lead].is_some_and(|n| n > 0) && s.max_masters == 1;
    eventually(20, "25 samples after the leader reconciled", || async {
        (samples.lock().expect("samples").iter().filter(|s| settled(s)).count() >= 25).then_some(())
    })
    .await;
    // ... and, at every sample so far, a standby that reconciled nothing.
    let so_far = samples.lock().expect("samples").clone();
    assert_standby_idle(&so_far, standby, &leader);

    // Kill the leader (SIGKILL: no graceful release); the standby must take over within
    // the lease duration (15 s) plus its retry period.
    let killed = Instant::now();
    drop(replicas[lead].take());
    let new_leader = eventually(25, "a new leader", || async {
        let holder = leases.get_opt(LEASE).await.ok().flatten()?.spec?.holder_identity?;
        (holder != leader).then_some(holder)
    })
    .await;
    let took = killed.elapsed();
    assert!(took <= Duration::from_secs(19), "takeover after {took:?}");
    assert_eq!(new_leader, PODS[standby], "the standby, not some third identity, holds the Lease");

    // The new leader reconciles: a desktop preempts, statuses follow.
    api.create(&PostParams::default(), &creg("desk", "HA", "s3", AgentSurface::ClaudeDesktop)).await.expect("create");
    role(&api, "desk", Role::Master, 15).await;
    role(&api, "one", Role::Peer, 15).await;
    eventually(10, "a sample after the new leader reconciled", || async {
        latest().filter(|s| s.reconciles[standby].is_some_and(|n| n > 0)).map(|_| ())
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    sampler.await.expect("the sampler ran to the end");
    let samples = samples.lock().expect("samples").clone();
    let before_kill: Vec<Sample> = samples.iter().filter(|s| s.at < killed).cloned().collect();
    eprintln!("{} samples, {} of them while both replicas ran", samples.len(), before_kill.len());

    // Postgres: at no sample two live masters of a project.
    assert!(samples.iter().any(|s| s.max_masters == 1), "the sampler saw the election");
    let doubles: Vec<&Sample> = samples.iter().filter(|s| s.max_masters > 1).collect();
    assert!(doubles.is_empty(), "two live masters of a project at {} samples: {doubles:?}", doubles.len());

    // The Lease: held by the leader, then by the standby, and by nobody else in between.
    let mut holders: Vec<&str> = samples.iter().filter_map(|s| s.holder.as_deref()).collect();
    holders.dedup();
    assert_eq!(holders, [PODS[lead], PODS[standby]], "Lease holders in order");

    // Only the Lease holder reconciles: at no sample while the leader lived had the
    // standby reconciled, and it started only once it held the Lease.
    assert_standby_idle(&before_kill, standby, &leader);
    let first_reconcile = samples.iter().find(|s| s.reconciles[standby].is_some_and(|n| n > 0)).expect("seen above");
    assert_eq!(first_reconcile.holder.as_deref(), Some(PODS[standby]), "{first_reconcile:?}");

    // Events name the replica that wrote them: "one" became master under the first
    // leader; the preemption after the failover was decided by the new one.
    let reporters = |events: Vec<k8s_openapi::api::events::v1::Event>| -> Vec<(String, String)> {
        events
            .into_iter()
            .map(|e| (e.reason.unwrap_or_default(), e.reporting_instance.unwrap_or_default()))
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect()
    };
    let one = eventually(10, "Preempted event of one", || async {
        let r = reporters(support::events_about(&client, &ns, "one").await);
        r.iter().any(|(reason, _)| reason == "Preempted").then_some(r)
    })
    .await;
    let expect = |pairs: &[(&str, &str)]| -> Vec<(String, String)> {
        pairs.iter().map(|(a, b)| (a.to_string(), b.to_string())).collect()
    };
    assert_eq!(one, expect(&[("BecameMaster", PODS[lead]), ("Preempted", PODS[standby])]));
    let desk = eventually(10, "BecameMaster event of desk", || async {
        let r = reporters(support::events_about(&client, &ns, "desk").await);
        (!r.is_empty()).then_some(r)
    })
    .await;
    assert_eq!(desk, expect(&[("BecameMaster", PODS[standby])]));
}
