//! Run identities mirrored from RunSession resources into Postgres, so any replica can
//! check a hello without the Kubernetes API.

use sqlx::PgPool;
use uuid::Uuid;

use super::{RegistryError, RunAddress};
use crate::db::{QueryError, Step};

#[derive(Clone, Debug, PartialEq, sqlx::FromRow)]
pub struct Identity {
    pub id: Uuid,
    pub namespace: String,
    pub name: String,
    pub server_instance_id: String,
    pub component_kind: String,
    pub public_key: String,
    pub key_generation: i64,
    pub lease_seconds: Option<i32>,
}

impl Identity {
    pub fn address(&self) -> RunAddress {
        RunAddress { server_instance_id: self.server_instance_id.clone(), component_kind: self.component_kind.clone() }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum Mirror {
    /// The resource owns the identity (new, or its credential was updated).
    Owned { rotated: bool },
    /// Another live resource owns this (server, component): this one is not used.
    Duplicate { owner_namespace: String, owner_name: String },
}

const COLUMNS: &str =
    "id, namespace, name, server_instance_id, component_kind, public_key, key_generation, lease_seconds";

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
    pub async fn mirror(&self, i: &Identity) -> Result<Mirror, RegistryError> {
        match self.upsert(i).await? {
            Mirror::Duplicate { owner_namespace, owner_name }
                if owner_namespace == i.namespace && owner_name == i.name =>
            {
                let replaced: Option<Uuid> = sqlx::query_scalar(
                    "UPDATE run_identities SET revoked_at = now()
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
                    Mirror::Owned { .. } => Ok(Mirror::Owned { rotated: true }),
                    duplicate => Ok(duplicate),
                }
            }
            mirrored => Ok(mirrored),
        }
    }

    async fn upsert(&self, i: &Identity) -> Result<Mirror, RegistryError> {
        let previous: Option<(String, i64, Option<i32>)> = sqlx::query_as(
            "SELECT public_key, key_generation, lease_seconds FROM run_identities WHERE id = $1 AND revoked_at IS NULL",
        )
        .bind(i.id)
        .fetch_optional(&self.pool)
        .await
        .step("mirror identity: read it")?;
        if previous.as_ref().is_some_and(|(key, generation, lease)| {
            (key.as_str(), *generation, *lease) == (i.public_key.as_str(), i.key_generation, i.lease_seconds)
        }) {
            // Unchanged (every live Run's reconcile, once a lease): the upsert below would
            // change nothing but still lock the row, a WAL record and a commit flush each
            // time (the scale bench: ~400 a second at 10,000 Runs).
            return Ok(Mirror::Owned { rotated: false });
        }
        let previous = previous.map(|(_, generation, _)| generation);
        let res = sqlx::query(
            "INSERT INTO run_identities (id, namespace, name, server_instance_id, component_kind, public_key, key_generation, lease_seconds)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
             ON CONFLICT (id) DO UPDATE SET public_key = EXCLUDED.public_key, key_generation = EXCLUDED.key_generation,
                 lease_seconds = EXCLUDED.lease_seconds, updated_at = now()
             WHERE run_identities.revoked_at IS NULL
               -- Only a real change writes: every reconcile mirrors (a Redis outage
               -- reconciles them all), and that must not touch a durable row (SPEC §10).
               AND (run_identities.public_key, run_identities.key_generation, run_identities.lease_seconds)
                   IS DISTINCT FROM (EXCLUDED.public_key, EXCLUDED.key_generation, EXCLUDED.lease_seconds)",
        )
        .bind(i.id)
        .bind(&i.namespace)
        .bind(&i.name)
        .bind(&i.server_instance_id)
        .bind(&i.component_kind)
        .bind(&i.public_key)
        .bind(i.key_generation)
        .bind(i.lease_seconds)
        .execute(&self.pool)
        .await;
        match res {
            Ok(_) => Ok(Mirror::Owned { rotated: previous.is_some_and(|g| g != i.key_generation) }),
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

    /// The resource is gone: its identity stops authenticating. Returns whether it was live.
    pub async fn revoke(&self, id: Uuid) -> Result<bool, RegistryError> {
        let done = sqlx::query("UPDATE run_identities SET revoked_at = now() WHERE id = $1 AND revoked_at IS NULL")
            .bind(id)
            .execute(&self.pool)
            .await
            .step("revoke identity")?;
        Ok(done.rows_affected() > 0)
    }

    /// The live identity of a (server, component).
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

    /// Every live identity of a server.
    pub async fn of_server(&self, server_instance_id: &str) -> Result<Vec<Identity>, RegistryError> {
        let sql = format!(
            "SELECT {COLUMNS} FROM run_identities WHERE server_instance_id = $1 AND revoked_at IS NULL ORDER BY component_kind"
        );
        Ok(sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .bind(server_instance_id)
            .fetch_all(&self.pool)
            .await
            .step("read the identities of a server")?)
    }

    /// (namespace, name) of every resource that owns a live identity.
    pub async fn all_live(&self) -> Result<Vec<(String, String)>, RegistryError> {
        Ok(sqlx::query_as("SELECT namespace, name FROM run_identities WHERE revoked_at IS NULL")
            .fetch_all(&self.pool)
            .await
            .step("list live identities")?)
    }

    /// Every live (server, component).
    pub async fn all_addresses(&self) -> Result<Vec<RunAddress>, RegistryError> {
        let rows: Vec<(String, String)> =
            sqlx::query_as("SELECT server_instance_id, component_kind FROM run_identities WHERE revoked_at IS NULL")
                .fetch_all(&self.pool)
                .await
                .step("list live addresses")?;
        Ok(rows.into_iter().map(|(s, c)| RunAddress { server_instance_id: s, component_kind: c }).collect())
    }
}
