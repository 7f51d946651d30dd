//! High availability: two operator processes on one database and namespace; only the
//! Lease holder reconciles, the other takes over within the lease duration when the
//! leader dies, and Postgres never shows two masters of a project.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;
use kube::api::PostParams;
use prism_operator::crd::{AgentSurface, ControllerRegistration, ControllerRegistrationSpec, Role};
use support::{Operator, TestDb, control_plane, eventually};

fn creg(name: &str, session: &str, surface: AgentSurface) -> ControllerRegistration {
    ControllerRegistration::new(
        name,
        ControllerRegistrationSpec { project_id: "HA".into(), session_id: session.into(), agent_surface: surface },
    )
}

async fn role(api: &Api<ControllerRegistration>, name: &str, want: Role, secs: u64) {
    eventually(secs, &format!("{name} {want:?}"), || async {
        let r = api.get_opt(name).await.ok().flatten()?;
        (r.status?.role == want).then_some(())
    })
    .await
}

#[tokio::test]
async fn the_standby_takes_over_when_the_leader_dies() {
    let cp = control_plane();
    let client = cp.client().await;
    let ns = support::namespace(&client, "ha").await;
    let db = TestDb::new().await;
    let start = |pod: &'static str| {
        let (cp, db_url, ns) = (cp, db.url.clone(), ns.clone());
        async move { Operator::start(cp, &db_url, &ns, &[("PRISM_LEADER_ELECTION", "true"), ("POD_NAME", pod)]).await }
    };
    let mut replicas = [("replica-a", Some(start("replica-a").await)), ("replica-b", Some(start("replica-b").await))];
    // The Lease lives in the operator's own namespace.
    let leases: Api<Lease> = Api::namespaced(client.clone(), support::OPERATOR_NAMESPACE);
    let leader = eventually(20, "a leader", || async {
        leases.get_opt("prism-operator-leader").await.ok().flatten()?.spec?.holder_identity
    })
    .await;

    // Watch Postgres for a double master during the whole test.
    let worst = Arc::new(AtomicI64::new(0));
    let watcher = {
        let (pool, worst) = (db.pool.clone(), worst.clone());
        tokio::spawn(async move {
            loop {
                if let Ok(n) = sqlx::query_scalar::<_, i64>(
                    "SELECT count(*) FROM controller_registrations WHERE project_id = 'HA' AND is_master AND released_at IS NULL",
                )
                .fetch_one(&pool)
                .await
                {
                    worst.fetch_max(n, Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };

    let api: Api<ControllerRegistration> = Api::namespaced(client.clone(), &ns);
    api.create(&PostParams::default(), &creg("one", "s1", AgentSurface::Codex)).await.expect("create");
    role(&api, "one", Role::Master, 15).await;

    // Kill the leader (SIGKILL: no graceful release); the standby must take over within
    // the lease duration (15 s) plus its retry period.
    let killed = Instant::now();
    for (name, op) in replicas.iter_mut() {
        if *name == leader {
            drop(op.take());
        }
    }
    let new_leader = eventually(25, "a new leader", || async {
        let holder = leases.get_opt("prism-operator-leader").await.ok().flatten()?.spec?.holder_identity?;
        (holder != leader).then_some(holder)
    })
    .await;
    let took = killed.elapsed();
    assert!(took <= Duration::from_secs(19), "takeover after {took:?}");

    // The new leader reconciles: a desktop preempts, statuses follow.
    api.create(&PostParams::default(), &creg("desk", "s2", AgentSurface::ClaudeDesktop)).await.expect("create");
    role(&api, "desk", Role::Master, 15).await;
    role(&api, "one", Role::Peer, 15).await;
    watcher.abort();
    assert_eq!(worst.load(Ordering::Relaxed), 1, "never two masters");
    assert_ne!(new_leader, leader);
}
