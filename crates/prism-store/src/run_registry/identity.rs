//! Run identities mirrored from RunSession resources into Postgres, so any replica can
//! check a hello without the Kubernetes API.
//!
//! Each row carries an **epoch**: a number from one sequence, taken anew whenever the
//! identity's key changes or it is revoked. A session is opened in the epoch its hello
//! proved, and authorizes nothing once that is not the current epoch of its address:
//! that is what makes a rotation or a deletion stick whatever failed at that moment
//! (SPEC §12). Each row also carries the hello high-water mark that makes a hello
//! impossible to replay after Redis forgot its nonces.

use sqlx::PgPool;
use uuid::Uuid;

use super::{RegistryError, RunAddress};
use crate::db::{QueryError, Step};
use crate::refresh::{self, NamespacedName};

// A Run's identity is the domain's.
pub use prism_core::run::{Identity, IdentitySpec, Mirror};

/// How a hello's mark was taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HelloMark {
    /// Accepted: the session opens in this epoch.
    Taken { epoch: i64 },
    /// The identity went away (revoked) since it was read.
    Revoked,
    /// Its key generation is no longer the one the hello proved.
    Rotated,
    /// A hello of this identity with a later timestamp, or this same second and nonce,
    /// was accepted before.
    Replayed,
}

const COLUMNS: &str =
    "id, namespace, name, server_instance_id, component_kind, public_key, key_generation, lease_seconds, paused, epoch";

/// What a session of the current epoch acts as (`IdentityStore::current`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Acting {
    /// The identity's namespace: the only one whose jobs the session claims or steps.
    pub namespace: String,
    /// spec.paused: its claims hand out no new job.
    pub paused: bool,
}

#[derive(Clone)]
pub struct IdentityStore {
    pool: PgPool,
}

impl IdentityStore {
    pub fn new(pool: PgPool) -> Self {
        Self { pool }
    }

    /// Mirrors a resource's identity. The first live resource to claim a
    /// (server, component) owns it; a later one is a duplicate (partial unique index).
    ///
    /// One exception: a live row of the same namespace and name but another uid is an
    /// earlier incarnation of this very resource that went without its finalizer running
    /// (a control plane rebuilt or restored over this database: restored objects get new
    /// uids). Two objects of one name cannot live at once, so that one is gone: its row is
    /// revoked and this resource takes the identity, as a rotation (the old key's session
    /// ends). Without this, every restored RunSession would be a duplicate of itself.
    #[tracing::instrument(level = "debug", skip_all, fields(store = "identities"))]
    pub async fn mirror(&self, i: &IdentitySpec) -> Result<Mirror, RegistryError> {
        match self.upsert(i).await? {
            Mirror::Duplicate { owner_namespace, owner_name }
                if owner_namespace == i.namespace && owner_name == i.name =>
            {
                let replaced: Option<Uuid> = sqlx::query_scalar(
                    "UPDATE run_identities SET revoked_at = now(), epoch = nextval('run_identity_epochs')
                     WHERE server_instance_id = $1 AND component_kind = $2 AND revoked_at IS NULL
                       AND namespace = $3 AND name = $4 AND id <> $5
                     RETURNING id",
                )
                .bind(&i.server_instance_id)
                .bind(&i.component_kind)
                .bind(&i.namespace)
                .bind(&i.name)
                .bind(i.id)
                .fetch_optional(&self.pool)
                .await
                .step("mirror identity: revoke an earlier incarnation's row")?;
                if let Some(old) = replaced {
                    tracing::warn!(
                        namespace = %i.namespace, name = %i.name, old_uid = %old, uid = %i.id,
                        "{}/{} taken over from an earlier resource of the same name that was deleted without its finalizer",
                        i.server_instance_id, i.component_kind
                    );
                }
                match self.upsert(i).await? {
                    Mirror::Owned { epoch, .. } => Ok(Mirror::Owned { rotated: true, epoch }),
                    duplicate => Ok(duplicate),
                }
            }
            mirrored => Ok(mirrored),
        }
    }

    async fn upsert(&self, i: &IdentitySpec) -> Result<Mirror, RegistryError> {
        let previous: Option<(String, i64, Option<i32>, bool, i64)> = sqlx::query_as(
            "SELECT public_key, key_generation, lease_seconds, paused, epoch FROM run_identities WHERE id = $1 AND revoked_at IS NULL",
        )
        .bind(i.id)
        .fetch_optional(&self.pool)
        .await
        .step("mirror identity: read it")?;
        if let Some((key, generation, lease, paused, epoch)) = &previous
            && (key.as_str(), *generation, *lease, *paused)
                == (i.public_key.as_str(), i.key_generation, i.lease_seconds, i.paused)
        {
            // Unchanged (every live Run's reconcile, once a lease): the upsert below would
            // change nothing but still lock the row, a WAL record and a commit flush each
            // time (the scale bench: ~400 a second at 10,000 Runs).
            return Ok(Mirror::Owned { rotated: false, epoch: *epoch });
        }
        let previous = previous.map(|(key, generation, ..)| (key, generation));
        let res: Result<Option<i64>, sqlx::Error> = sqlx::query_scalar(
            "INSERT INTO run_identities (id, namespace, name, server_instance_id, component_kind, public_key, key_generation, lease_seconds, paused)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
             ON CONFLICT (id) DO UPDATE SET public_key = EXCLUDED.public_key, key_generation = EXCLUDED.key_generation,
                 lease_seconds = EXCLUDED.lease_seconds, paused = EXCLUDED.paused, updated_at = now(),
                 -- A new key is a new epoch: sessions of the old one authorize nothing.
                 epoch = CASE WHEN (run_identities.public_key, run_identities.key_generation)
                                   IS DISTINCT FROM (EXCLUDED.public_key, EXCLUDED.key_generation)
                              THEN nextval('run_identity_epochs') ELSE run_identities.epoch END
             WHERE run_identities.revoked_at IS NULL
               -- Only a real change writes: every reconcile mirrors (a Redis outage
               -- reconciles them all), and that must not touch a durable row (SPEC §10).
               AND (run_identities.public_key, run_identities.key_generation, run_identities.lease_seconds, run_identities.paused)
                   IS DISTINCT FROM (EXCLUDED.public_key, EXCLUDED.key_generation, EXCLUDED.lease_seconds, EXCLUDED.paused)
             RETURNING epoch",
        )
        .bind(i.id)
        .bind(&i.namespace)
        .bind(&i.name)
        .bind(&i.server_instance_id)
        .bind(&i.component_kind)
        .bind(&i.public_key)
        .bind(i.key_generation)
        .bind(i.lease_seconds)
        .bind(i.paused)
        .fetch_optional(&self.pool)
        .await;
        match res {
            Ok(Some(epoch)) => {
                let rotated =
                    previous.is_some_and(|(key, g)| (key.as_str(), g) != (i.public_key.as_str(), i.key_generation));
                Ok(Mirror::Owned { rotated, epoch })
            }
            // Nothing written: the row changed under us to what we mirror, or was revoked.
            Ok(None) => {
                let row: Option<(i64, bool)> =
                    sqlx::query_as("SELECT epoch, revoked_at IS NULL FROM run_identities WHERE id = $1")
                        .bind(i.id)
                        .fetch_optional(&self.pool)
                        .await
                        .step("mirror identity: read it again")?;
                Ok(match row {
                    Some((epoch, true)) => Mirror::Owned { rotated: false, epoch },
                    _ => Mirror::Revoked,
                })
            }
            Err(sqlx::Error::Database(db)) if db.constraint() == Some("run_identities_one_live_identity") => {
                let owner: (String, String) = sqlx::query_as(
                    "SELECT namespace, name FROM run_identities
                     WHERE server_instance_id = $1 AND component_kind = $2 AND revoked_at IS NULL",
                )
                .bind(&i.server_instance_id)
                .bind(&i.component_kind)
                .fetch_one(&self.pool)
                .await
                .step("mirror identity: find the owner of the address")?;
                Ok(Mirror::Duplicate { owner_namespace: owner.0, owner_name: owner.1 })
            }
            Err(e) => Err(QueryError { step: "mirror identity: upsert", source: e }.into()),
        }
    }

    /// The resource is gone: its identity stops authenticating, in a new epoch. Returns
    /// the revoked row's epoch whether it is revoked now or was before (a finalizer that
    /// retries after a failed Redis write must fence with it again); None if the row
    /// does not exist.
    #[tracing::instrument(level = "debug", skip_all, fields(store = "identities"))]
    pub async fn revoke(&self, id: Uuid) -> Result<Option<i64>, RegistryError> {
        Ok(sqlx::query_scalar(
            "UPDATE run_identities
             SET epoch = CASE WHEN revoked_at IS NULL THEN nextval('run_identity_epochs') ELSE epoch END,
                 revoked_at = COALESCE(revoked_at, now())
             WHERE id = $1
             RETURNING epoch",
        )
        .bind(id)
        .fetch_optional(&self.pool)
        .await
        .step("revoke identity")?)
    }

    /// Takes a hello's high-water mark: accepted only while the identity is live with the
    /// generation the hello proved, and only for a timestamp after the mark, or at the
    /// mark's second with a nonce not seen in it. One statement, so two hellos never both
    /// pass on one mark, and a key rotated since the identity was read refuses the hello.
    #[tracing::instrument(level = "debug", skip_all, fields(store = "identities"))]
    pub async fn mark_hello(
        &self,
        id: Uuid,
        generation: i64,
        timestamp: i64,
        nonce: &str,
    ) -> Result<HelloMark, RegistryError> {
        let taken: Option<i64> = sqlx::query_scalar(
            "UPDATE run_identities
             SET hello_nonces = CASE WHEN hello_mark = $3 THEN array_append(hello_nonces, $4) ELSE ARRAY[$4] END,
                 hello_mark = $3
             WHERE id = $1 AND revoked_at IS NULL AND key_generation = $2
               AND (hello_mark IS NULL OR hello_mark < $3 OR (hello_mark = $3 AND NOT $4 = ANY(hello_nonces)))
             RETURNING epoch",
        )
        .bind(id)
        .bind(generation)
        .bind(timestamp)
        .bind(nonce)
        .fetch_optional(&self.pool)
        .await
        .step("hello: take the high-water mark")?;
        if let Some(epoch) = taken {
            return Ok(HelloMark::Taken { epoch });
        }
        // Say why, without changing anything.
        let row: Option<(bool, i64)> =
            sqlx::query_as("SELECT revoked_at IS NOT NULL, key_generation FROM run_identities WHERE id = $1")
                .bind(id)
                .fetch_optional(&self.pool)
                .await
                .step("hello: read the identity that refused the mark")?;
        Ok(match row {
            None | Some((true, _)) => HelloMark::Revoked,
            Some((false, g)) if g != generation => HelloMark::Rotated,
            Some(_) => HelloMark::Replayed,
        })
    }

    /// The namespace of the address's live identity, if `epoch` is its current epoch:
    /// what a session of that epoch may still act in (None: revoked, rotated or gone).
    #[tracing::instrument(level = "debug", skip_all, fields(store = "identities"))]
    pub async fn current_namespace(&self, a: &RunAddress, epoch: i64) -> Result<Option<String>, RegistryError> {
        Ok(self.current(a, epoch).await?.map(|acting| acting.namespace))
    }

    /// What a session of `epoch` acts as, if that is the current epoch of the address's
    /// live identity: its namespace, and whether it is paused (one query; None: revoked,
    /// rotated or gone).
    #[tracing::instrument(level = "debug", skip_all, fields(store = "identities"))]
    pub async fn current(&self, a: &RunAddress, epoch: i64) -> Result<Option<Acting>, RegistryError> {
        let row: Option<(String, bool)> = sqlx::query_as(
            "SELECT namespace, paused FROM run_identities
             WHERE server_instance_id = $1 AND component_kind = $2 AND revoked_at IS NULL AND epoch = $3",
        )
        .bind(&a.server_instance_id)
        .bind(&a.component_kind)
        .bind(epoch)
        .fetch_optional(&self.pool)
        .await
        .step("check the session's identity is current")?;
        Ok(row.map(|(namespace, paused)| Acting { namespace, paused }))
    }

    /// Deletes identities revoked over `days` ago (retention): their epoch is long out of
    /// Redis and no job of theirs is unfinished. Returns how many.
    #[tracing::instrument(level = "debug", skip_all, fields(store = "identities"))]
    pub async fn prune_revoked(&self, days: u32) -> Result<u64, RegistryError> {
        Ok(crate::election::store::prune_batches(&self.pool, "retention: prune revoked identities", || {
            sqlx::query(
                "DELETE FROM run_identities WHERE id IN (
                     SELECT id FROM run_identities WHERE revoked_at < now() - make_interval(days => $1) LIMIT 1000)",
            )
            .bind(days as i32)
        })
        .await?)
    }

    /// Asks the leader to refresh the status of the identity's RunSession now (a Run
    /// said hello, or started or stopped draining), not at its next requeue.
    pub async fn announce_status(&self, i: &IdentitySpec) -> Result<(), RegistryError> {
        let resource = NamespacedName::new(i.namespace.as_str(), i.name.as_str());
        Ok(refresh::announce_now(&self.pool, refresh::Kind::RunSession, [&resource]).await?)
    }

    /// The live identity of a (server, component).
    #[tracing::instrument(level = "debug", skip_all, fields(store = "identities"))]
    pub async fn live(&self, a: &RunAddress) -> Result<Option<Identity>, RegistryError> {
        let sql = format!(
            "SELECT {COLUMNS} FROM run_identities WHERE server_instance_id = $1 AND component_kind = $2 AND revoked_at IS NULL"
        );
        Ok(sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .bind(&a.server_instance_id)
            .bind(&a.component_kind)
            .fetch_optional(&self.pool)
            .await
            .step("read the identity of an address")?)
    }

    /// The live identity of a (server, component) in `namespace` only.
    #[tracing::instrument(level = "debug", skip_all, fields(store = "identities"))]
    pub async fn live_in(&self, namespace: &str, a: &RunAddress) -> Result<Option<Identity>, RegistryError> {
        Ok(self.live(a).await?.filter(|i| i.spec.namespace == namespace))
    }

    /// Every live identity of a server (in `namespace`, when given).
    #[tracing::instrument(level = "debug", skip_all, fields(store = "identities"))]
    pub async fn of_server(
        &self,
        server_instance_id: &str,
        namespace: Option<&str>,
    ) -> Result<Vec<Identity>, RegistryError> {
        let sql = format!(
            "SELECT {COLUMNS} FROM run_identities WHERE server_instance_id = $1 AND revoked_at IS NULL
               AND ($2::text IS NULL OR namespace = $2)
             ORDER BY component_kind"
        );
        Ok(sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .bind(server_instance_id)
            .bind(namespace)
            .fetch_all(&self.pool)
            .await
            .step("read the identities of a server")?)
    }

    /// Every live (server, component).
    #[tracing::instrument(level = "debug", skip_all, fields(store = "identities"))]
    pub async fn all_addresses(&self) -> Result<Vec<RunAddress>, RegistryError> {
        let rows: Vec<(String, String)> =
            sqlx::query_as("SELECT server_instance_id, component_kind FROM run_identities WHERE revoked_at IS NULL")
                .fetch_all(&self.pool)
                .await
                .step("list live addresses")?;
        Ok(rows.into_iter().map(|(s, c)| RunAddress { server_instance_id: s, component_kind: c }).collect())
    }
}
