//! "The status of these resources must be refreshed", the sending half: a Postgres
//! NOTIFY on a channel per kind, payload `namespace/name`, sent inside the transaction
//! that made the change (delivered at commit, never for a rolled-back change) or at once.
//! The leader's listener, which feeds the reconcilers, is the operator's (`refresh`).

use sqlx::{PgConnection, PgPool};

use crate::db::{QueryError, Step};

/// A namespaced resource, named as Kubernetes names it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NamespacedName {
    pub namespace: String,
    pub name: String,
}

impl NamespacedName {
    pub fn new(namespace: impl Into<String>, name: impl Into<String>) -> Self {
        Self { namespace: namespace.into(), name: name.into() }
    }

    pub fn payload(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    /// The resource a NOTIFY payload names, if it names one.
    pub fn from_payload(payload: &str) -> Option<Self> {
        let (namespace, name) = payload.split_once('/')?;
        (!namespace.is_empty() && !name.is_empty()).then(|| Self::new(namespace, name))
    }
}

/// Which reconciler a signal is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Registration,
    RunSession,
}

impl Kind {
    /// The Postgres channel its signals go on.
    pub fn channel(self) -> &'static str {
        match self {
            Kind::Registration => "prism_registrations",
            Kind::RunSession => "prism_runsessions",
        }
    }
}

/// Asks for a status refresh of these resources, delivered when the caller's
/// transaction commits (or at once outside one).
pub async fn announce<'a>(
    conn: &mut PgConnection,
    kind: Kind,
    resources: impl IntoIterator<Item = &'a NamespacedName>,
) -> Result<(), QueryError> {
    let payloads = payloads(resources);
    if payloads.is_empty() {
        return Ok(());
    }
    sqlx::query("SELECT pg_notify($1, p) FROM unnest($2::text[]) AS p")
        .bind(kind.channel())
        .bind(&payloads)
        .execute(conn)
        .await
        .step("refresh: notify")?;
    Ok(())
}

/// The NOTIFY payloads of `resources` (for a statement that sends them with other work).
pub fn payloads<'a>(resources: impl IntoIterator<Item = &'a NamespacedName>) -> Vec<String> {
    resources.into_iter().map(NamespacedName::payload).collect()
}

/// `announce` on a connection of the pool, for a change that was not a transaction of ours.
pub async fn announce_now<'a>(
    pool: &PgPool,
    kind: Kind,
    resources: impl IntoIterator<Item = &'a NamespacedName>,
) -> Result<(), QueryError> {
    let mut conn = crate::db::acquire(pool).await.step("refresh: acquire a connection")?;
    announce(&mut conn, kind, resources).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_round_trip_and_malformed_ones_are_refused() {
        let n = NamespacedName::new("agents", "desk-pgr01");
        assert_eq!(NamespacedName::from_payload(&n.payload()), Some(n));
        assert_eq!(NamespacedName::from_payload("no-slash"), None);
        assert_eq!(NamespacedName::from_payload("/name"), None);
        assert_eq!(NamespacedName::from_payload("ns/"), None);
    }
}
