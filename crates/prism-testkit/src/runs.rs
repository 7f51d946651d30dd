//! A world of Runs for one test: a namespace, a database, a private Redis (to stop, pause
//! and flush), a Redis key prefix, the operator, and the RunSession API of the namespace.

use kube::Api;
use prism_api::run_client::RunClient;
use prism_kube::crd::RunSession;

use super::{ControlPlane, Operator, PrivateRedis, TestDb, control_plane, eventually};

pub struct RunWorld {
    pub cp: &'static ControlPlane,
    pub client: kube::Client,
    pub ns: String,
    pub db: TestDb,
    pub redis: PrivateRedis,
    pub prefix: String,
    pub op: Operator,
    pub api: Api<RunSession>,
}

impl RunWorld {
    /// `env`: more settings for the operator (its Redis and prefix are the world's).
    pub async fn start(hint: &str, env: &[(&str, &str)]) -> RunWorld {
        let cp = control_plane().await;
        let client = cp.client().await;
        let ns = super::namespace(&client, hint).await;
        let db = TestDb::new().await;
        let redis = PrivateRedis::start().await;
        let prefix = super::redis_prefix();
        let mut all = vec![("REDIS_URL", redis.url.as_str()), ("PRISM_REDIS_PREFIX", prefix.as_str())];
        all.extend_from_slice(env);
        let op = Operator::start(cp, &db.url, &ns, &all).await;
        let api = Api::namespaced(client.clone(), &ns);
        RunWorld { cp, client, ns, db, redis, prefix, op, api }
    }

    /// A RunSession with a fresh key of generation 1 (and `lease` seconds), once its
    /// identity is mirrored; a client holding that key.
    pub async fn run(&self, name: &str, server: &str, lease: Option<i32>) -> RunClient {
        self.run_with_key(name, server, lease).await.0
    }

    /// The same, and the key.
    pub async fn run_with_key(
        &self,
        name: &str,
        server: &str,
        lease: Option<i32>,
    ) -> (RunClient, ed25519_dalek::SigningKey) {
        let key = super::create_run_session(&self.api, name, server, lease).await;
        eventually(10, "identity mirrored", || async {
            let n: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM run_identities WHERE server_instance_id = $1 AND revoked_at IS NULL",
            )
            .bind(server)
            .fetch_one(&self.db.pool)
            .await
            .ok()?;
            (n == 1).then_some(())
        })
        .await;
        (RunClient::new(&self.op.base, server, "run", 1, key.clone()), key)
    }

    /// Pauses every write to Redis (scripts included) for `ms`: the Redis writes the
    /// operator makes meanwhile fail (their 2 s timeout), as a flaky Redis fails them.
    pub async fn pause_writes(&self, ms: u64) {
        for port in self.redis.masters().await {
            let out = super::redis_cli(port, &["CLIENT", "PAUSE", &ms.to_string(), "WRITE"]).await;
            assert_eq!(out.trim(), "OK", "CLIENT PAUSE on {port}");
        }
    }
}
