//! A restore never reissues a term (SPEC §15): the mark the operator keeps outside
//! Postgres, a ConfigMap of its namespace (`PRISM_TERM_MARK`), and what it does with it.
//!
//! At start, before the API serves or a controller runs, the database's election history
//! is compared with the mark and with the registrations' `status.term`
//! (`prism_core::election::restore::verdict`): a database that forgot changes is raised
//! above everything seen, which is said in a warning and an Event on the ConfigMap. Then
//! the mark follows the database, checked every second and written when it moved, and
//! once more at a clean stop.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::Context as _;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{ListParams, ObjectMeta, PostParams};
use kube::runtime::events::EventType;
use kube::{Api, Client};
use tracing::{info, warn};

use crate::crd::ControllerRegistration;
use crate::election::restore::RestoreGuard;
use crate::reconcilers::events::EventPublisher;
use prism_core::election::restore::{History, Verdict, next_mark, verdict};

/// How often the mark is compared with the database.
const EVERY: Duration = Duration::from_secs(1);

pub struct TermGuard {
    configmaps: Api<ConfigMap>,
    name: String,
    store: RestoreGuard,
    client: Client,
    /// The mark as last read or written, with the ConfigMap's resourceVersion.
    kept: Option<(History, Option<String>)>,
}

fn decode(cm: &ConfigMap) -> Option<History> {
    let data = cm.data.as_ref()?;
    let number = |key: &str| data.get(key).and_then(|v| v.parse::<i64>().ok());
    Some(History { events: number("electionEvents")?, highest_term: number("highestTerm")? })
}

fn encode(mark: History) -> BTreeMap<String, String> {
    BTreeMap::from([
        ("electionEvents".to_string(), mark.events.to_string()),
        ("highestTerm".to_string(), mark.highest_term.to_string()),
    ])
}

impl TermGuard {
    pub fn new(client: Client, namespace: &str, name: &str, store: RestoreGuard) -> Self {
        TermGuard {
            configmaps: Api::namespaced(client.clone(), namespace),
            name: name.to_string(),
            store,
            client,
            kept: None,
        }
    }

    async fn read(&mut self) -> anyhow::Result<Option<History>> {
        let cm = self
            .configmaps
            .get_opt(&self.name)
            .await
            .with_context(|| format!("reading the term mark (ConfigMap {})", self.name))?;
        let mark = cm.as_ref().and_then(decode);
        if cm.is_some() && mark.is_none() {
            anyhow::bail!(
                "the term mark (ConfigMap {}) has no electionEvents and highestTerm numbers: restore it from a backup, \
                 or delete it to start a new one",
                self.name
            );
        }
        self.kept = cm.map(|cm| (mark.unwrap_or_default(), cm.metadata.resource_version));
        Ok(mark)
    }

    /// Writes `mark` (create, or replace at the resourceVersion read: a concurrent writer
    /// makes this fail, and the next round reads again).
    async fn write(&mut self, mark: History) -> anyhow::Result<ConfigMap> {
        let mut cm = ConfigMap {
            metadata: ObjectMeta { name: Some(self.name.clone()), ..Default::default() },
            data: Some(encode(mark)),
            ..Default::default()
        };
        let written = match self.kept.as_ref().map(|(_, rv)| rv.clone()) {
            Some(rv) => {
                cm.metadata.resource_version = rv;
                self.configmaps.replace(&self.name, &PostParams::default(), &cm).await
            }
            None => self.configmaps.create(&PostParams::default(), &cm).await,
        };
        match written {
            Ok(cm) => {
                self.kept = Some((mark, cm.metadata.resource_version.clone()));
                Ok(cm)
            }
            Err(e) => {
                // Read again next time (another replica wrote, or it was deleted).
                self.kept = None;
                Err(e).with_context(|| format!("writing the term mark (ConfigMap {})", self.name))
            }
        }
    }

    /// The check at start (see the module's doc). `watch_namespace`: where the
    /// registrations are (all namespaces when `None`). Replicas starting together race
    /// to write the mark: the one that loses reads it again and checks again.
    pub async fn check_at_start(&mut self, watch_namespace: Option<&str>) -> anyhow::Result<()> {
        let mut attempt = 1;
        loop {
            match self.check_once(watch_namespace).await {
                Err(e) if attempt < 10 && is_conflict(&e) => {
                    attempt += 1;
                    tokio::time::sleep(Duration::from_millis(100 * attempt)).await;
                }
                done => return done,
            }
        }
    }

    async fn check_once(&mut self, watch_namespace: Option<&str>) -> anyhow::Result<()> {
        let mark = self.read().await?;
        let db = self.store.history().await.context("reading the election history")?;
        let status = highest_status_term(&self.client, watch_namespace).await?;
        match verdict(db, mark, status) {
            Verdict::Current => {
                // A first mark is made here; an existing one is the keepers' to move (the
                // other replicas' keepers write it every second the history moves: a
                // write here would only race them).
                if mark.is_none() {
                    self.write(next_mark(None, db)).await?;
                }
                info!(events = db.events, highest_term = db.highest_term, "the database knows every term issued");
            }
            Verdict::Restored { above } => {
                warn!(
                    database_events = db.events,
                    database_highest_term = db.highest_term,
                    mark_events = mark.map(|m| m.events),
                    mark_highest_term = mark.map(|m| m.highest_term),
                    highest_status_term = status,
                    raise_above = above,
                    "the database forgot terms it issued (restored from a backup, or replaced): raising every project's term"
                );
                let raised =
                    self.store.raise_after_restore(above).await.context("raising the terms after a restore")?;
                // The restore is handled: the mark starts again from this database.
                let after = self.store.history().await.context("reading the election history")?;
                let cm = self.write(after).await?;
                let note = format!(
                    "The database forgot terms it issued (its election history ends at {}, the operator had seen {}; \
                     the highest term seen was {}): {} project(s) raised above {above}, new projects start at {}.",
                    db.events,
                    mark.map_or(0, |m| m.events),
                    mark.map_or(0, |m| m.highest_term).max(status),
                    raised.projects,
                    raised.floor
                );
                warn!(projects = raised.projects, floor = raised.floor, "terms raised after a restore");
                EventPublisher::of_this_pod(self.client.clone())
                    .publish(&cm, (EventType::Warning, "Restored", note), "RaiseTerms")
                    .await;
            }
        }
        Ok(())
    }

    /// Keeps the mark up with the database until `stop`, then writes it once more.
    pub async fn keep(mut self, mut stop: tokio::sync::watch::Receiver<bool>) {
        loop {
            let stopping = tokio::select! {
                _ = tokio::time::sleep(EVERY) => false,
                _ = stop.changed() => true,
            };
            match self.follow().await {
                // Another replica's keeper wrote it first: expected under churn, read again.
                Err(e) if is_conflict(&e) => tracing::debug!("the term mark moved meanwhile; reading it again"),
                Err(e) => warn!(error = format!("{e:#}"), "the term mark could not be kept up; trying again"),
                Ok(()) => {}
            }
            if stopping || *stop.borrow() {
                return;
            }
        }
    }

    async fn follow(&mut self) -> anyhow::Result<()> {
        if self.kept.is_none() {
            self.read().await?;
        }
        let db = self.store.history().await.context("reading the election history")?;
        let kept = self.kept.as_ref().map(|(m, _)| *m);
        let next = next_mark(kept, db);
        if Some(next) != kept {
            self.write(next).await?;
        }
        Ok(())
    }
}

/// A write of the mark lost to another replica's (409: created or changed meanwhile).
fn is_conflict(e: &anyhow::Error) -> bool {
    e.chain().any(|c| matches!(c.downcast_ref::<kube::Error>(), Some(kube::Error::Api(s)) if s.code == 409))
}

/// The highest `status.term` of any registration (pages of 500: once, at start).
async fn highest_status_term(client: &Client, namespace: Option<&str>) -> anyhow::Result<i64> {
    let api: Api<ControllerRegistration> = match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    let mut highest = 0;
    let mut params = ListParams::default().limit(500);
    loop {
        let page = api.list(&params).await.context("listing registrations for their status.term")?;
        highest = page.items.iter().filter_map(|r| r.status.as_ref()?.term).fold(highest, i64::max);
        match page.metadata.continue_ {
            Some(token) if !token.is_empty() => params = params.continue_token(&token),
            _ => return Ok(highest),
        }
    }
}
