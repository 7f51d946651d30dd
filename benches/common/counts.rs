//! Figures that can be counted instead of timed: what Postgres, Redis and the API server
//! did, read from their own counters before and after. A count does not move with the
//! machine's load, so it is printed beside the rate it explains.
//!
//! * Postgres: `pg_stat_database` of one database (transactions, rows). A backend
//!   publishes its counters at most once a second while busy and on a 10 s timer once
//!   idle, so a count is read only after `PG_STATS_DELAY` of quiet, and the baseline of a
//!   comparison runs in a database of its own (a window-by-window count is not possible).
//!   pg_stat_statements would count statements, but it needs a server restart with
//!   `shared_preload_libraries`, which a shared Postgres does not get for a benchmark.
//! * Redis: `INFO commandstats` (commands by name) and `INFO stats`
//!   `total_reads_processed` (read events: a pipeline of many commands is a few), summed
//!   over the nodes; they are current at once, so they are read around each window.
//! * The API server: `apiserver_request_total` from its `/metrics`, by verb, resource and
//!   subresource.

use std::collections::BTreeMap;
use std::time::Duration;

/// How long after its last statement a Postgres backend's counters are surely published.
pub const PG_STATS_DELAY: Duration = Duration::from_secs(11);

/// What Postgres counted for one database.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PgActivity {
    pub xact_commit: i64,
    pub xact_rollback: i64,
    pub tup_returned: i64,
    pub tup_fetched: i64,
    pub tup_inserted: i64,
    pub tup_updated: i64,
    pub tup_deleted: i64,
    /// Entries read by each index and rows by each table's sequential scans
    /// (pg_stat_user_indexes, pg_stat_user_tables): which one a large read is.
    pub reads: BTreeMap<String, i64>,
    /// Scans started on each index and sequential scans of each table: which queries
    /// the transactions are (most reads here are one scan of one index).
    pub scans: BTreeMap<String, i64>,
}

/// What grew of each counter since `before`.
fn grown(now: &BTreeMap<String, i64>, before: &BTreeMap<String, i64>) -> BTreeMap<String, i64> {
    now.iter().map(|(k, v)| (k.clone(), v - before.get(k).copied().unwrap_or(0))).filter(|(_, v)| *v > 0).collect()
}

impl PgActivity {
    /// The counters of the database `pool` is connected to, as published so far.
    pub async fn read(pool: &sqlx::PgPool) -> Result<PgActivity, sqlx::Error> {
        let (xact_commit, xact_rollback, tup_returned, tup_fetched, tup_inserted, tup_updated, tup_deleted) =
            sqlx::query_as(
                "SELECT xact_commit, xact_rollback, tup_returned, tup_fetched, tup_inserted, tup_updated, tup_deleted
                 FROM pg_stat_database WHERE datname = current_database()",
            )
            .fetch_one(pool)
            .await?;
        let counted: Vec<(String, i64, i64)> = sqlx::query_as(
            "SELECT 'index ' || indexrelname, idx_tup_read, idx_scan FROM pg_stat_user_indexes
             UNION ALL
             SELECT 'seq scan ' || relname, seq_tup_read, seq_scan FROM pg_stat_user_tables",
        )
        .fetch_all(pool)
        .await?;
        let reads = counted.iter().map(|(name, read, _)| (name.clone(), *read)).collect();
        let scans = counted.into_iter().map(|(name, _, scans)| (name, scans)).collect();
        Ok(PgActivity {
            xact_commit,
            xact_rollback,
            tup_returned,
            tup_fetched,
            tup_inserted,
            tup_updated,
            tup_deleted,
            reads,
            scans,
        })
    }

    /// Waits until every backend of the database has published (see `PG_STATS_DELAY`),
    /// then reads.
    pub async fn settled(pool: &sqlx::PgPool) -> Result<PgActivity, sqlx::Error> {
        tokio::time::sleep(PG_STATS_DELAY).await;
        Self::read(pool).await
    }

    /// `settled` for two databases (a side and its baseline) with one wait.
    pub async fn settled_pair(a: &sqlx::PgPool, b: &sqlx::PgPool) -> Result<(PgActivity, PgActivity), sqlx::Error> {
        tokio::time::sleep(PG_STATS_DELAY).await;
        Ok((Self::read(a).await?, Self::read(b).await?))
    }

    pub fn since(&self, before: &PgActivity) -> PgActivity {
        PgActivity {
            xact_commit: self.xact_commit - before.xact_commit,
            xact_rollback: self.xact_rollback - before.xact_rollback,
            tup_returned: self.tup_returned - before.tup_returned,
            tup_fetched: self.tup_fetched - before.tup_fetched,
            tup_inserted: self.tup_inserted - before.tup_inserted,
            tup_updated: self.tup_updated - before.tup_updated,
            tup_deleted: self.tup_deleted - before.tup_deleted,
            reads: grown(&self.reads, &before.reads),
            scans: grown(&self.scans, &before.scans),
        }
    }

    /// "index a 41.7, index b 16.7, seq scan t 0.1": the `n` indexes and tables scanned
    /// most, in scans per `ops`.
    pub fn busiest_scans(&self, n: usize, ops: f64) -> String {
        let mut scans: Vec<(&String, &i64)> = self.scans.iter().collect();
        scans.sort_by(|a, b| b.1.cmp(a.1));
        let top: Vec<String> =
            scans.iter().take(n).map(|(name, count)| format!("{name} {:.1}", **count as f64 / ops.max(1.0))).collect();
        top.join(", ")
    }

    /// "1.00 transactions, 2.0 rows fetched, 1.0 rows written per op". Rows fetched are
    /// live rows an index scan fetched; `tup_returned` (index entries and sequential-scan
    /// rows read) is shown when there are any, with the index or table that read most: it
    /// is what grows when a query reads more than it needs.
    pub fn per(&self, ops: u64, op: &str) -> String {
        let per = |x: i64| x as f64 / (ops as f64).max(1.0);
        let written = self.tup_inserted + self.tup_updated + self.tup_deleted;
        let mut s = format!(
            "{:.2} transactions, {:.1} rows fetched, {:.2} rows written per {op}",
            per(self.xact_commit + self.xact_rollback),
            per(self.tup_fetched),
            per(written)
        );
        if per(self.tup_returned) >= 0.05 {
            s.push_str(&format!(" ({:.1} index entries/scanned rows read", per(self.tup_returned)));
            if let Some((most, n)) = self.reads.iter().max_by_key(|(_, n)| **n) {
                s.push_str(&format!(", most by {most}: {:.1}", per(*n)));
            }
            s.push(')');
        }
        // Rounded to nothing is not nothing: the totals show what coalescing left.
        s.push_str(&format!(
            "; in all {} transactions, {written} rows written for {ops} {op}s",
            self.xact_commit + self.xact_rollback
        ));
        s
    }
}

/// What Redis counted, summed over the nodes asked.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RedisActivity {
    /// Calls by command (lowercase), without the INFO calls that read them.
    pub commands: BTreeMap<String, u64>,
    /// Read events (`total_reads_processed`): about one per round trip of a client.
    pub reads: u64,
}

/// Connections to every node of a Redis, made once, that read its counters.
pub struct RedisCounters {
    conns: Vec<redis::aio::MultiplexedConnection>,
    /// Reads made so far: each made two read events on every node, which are not the
    /// activity being counted.
    readings: std::sync::atomic::AtomicU64,
}

impl RedisCounters {
    /// `nodes`: each node's URL (a standalone Redis has one).
    pub async fn connect(nodes: &[String]) -> Result<RedisCounters, redis::RedisError> {
        let mut conns = Vec::new();
        for url in nodes {
            conns.push(redis::Client::open(url.as_str())?.get_multiplexed_async_connection().await?);
        }
        Ok(RedisCounters { conns, readings: Default::default() })
    }

    pub async fn read(&self) -> Result<RedisActivity, redis::RedisError> {
        let mut all = RedisActivity::default();
        for conn in &self.conns {
            let mut conn = conn.clone();
            let stats: String = redis::cmd("INFO").arg("commandstats").query_async(&mut conn).await?;
            for (command, calls) in parse_commandstats(&stats) {
                *all.commands.entry(command).or_default() += calls;
            }
            let info: String = redis::cmd("INFO").arg("stats").query_async(&mut conn).await?;
            all.reads += info_number(&info, "total_reads_processed");
        }
        // Our own INFO calls are not the activity, nor the read events they took.
        all.commands.remove("info");
        let readings = self.readings.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        all.reads = all.reads.saturating_sub(2 * self.conns.len() as u64 * readings);
        Ok(all)
    }
}

impl RedisActivity {
    pub fn since(&self, before: &RedisActivity) -> RedisActivity {
        let commands = self
            .commands
            .iter()
            .map(|(c, n)| (c.clone(), n.saturating_sub(before.commands.get(c).copied().unwrap_or(0))))
            .filter(|(_, n)| *n > 0)
            .collect();
        RedisActivity { commands, reads: self.reads.saturating_sub(before.reads) }
    }

    pub fn add(&mut self, other: &RedisActivity) {
        for (c, n) in &other.commands {
            *self.commands.entry(c.clone()).or_default() += n;
        }
        self.reads += other.reads;
    }

    pub fn total(&self) -> u64 {
        self.commands.values().sum()
    }

    /// "1.00 commands (evalsha 1.00), 1.01 read events per op". Commands a script runs
    /// count too (Redis counts them under their own names).
    pub fn per(&self, ops: u64, op: &str) -> String {
        let per = |x: u64| x as f64 / (ops as f64).max(1.0);
        let each: Vec<String> = self
            .commands
            .iter()
            .filter(|(_, n)| per(**n) >= 0.005)
            .map(|(c, n)| format!("{c} {:.2}", per(*n)))
            .collect();
        format!(
            "{:.2} Redis commands incl. those in scripts ({}), {:.2} read events per {op}",
            per(self.total()),
            each.join(", "),
            per(self.reads)
        )
    }
}

/// Runs `work` and returns its output with what Redis counted meanwhile.
pub async fn redis_counted<T>(redis: &RedisCounters, work: impl std::future::Future<Output = T>) -> (T, RedisActivity) {
    let before = redis.read().await.expect("read the Redis counters");
    let out = work.await;
    let after = redis.read().await.expect("read the Redis counters");
    (out, after.since(&before))
}

/// `cmdstat_evalsha:calls=12,usec=...` lines of `INFO commandstats`: calls by command.
/// Subcommands (`cmdstat_client|setname`) count under their own name.
pub fn parse_commandstats(text: &str) -> BTreeMap<String, u64> {
    text.lines()
        .filter_map(|line| {
            let (name, rest) = line.trim().strip_prefix("cmdstat_")?.split_once(':')?;
            let calls = rest.split(',').find_map(|kv| kv.strip_prefix("calls="))?.parse().ok()?;
            Some((name.to_lowercase(), calls))
        })
        .collect()
}

/// A numeric `field:value` line of an INFO section (0 when absent).
pub fn info_number(info: &str, field: &str) -> u64 {
    info.lines().find_map(|l| l.trim().strip_prefix(field)?.strip_prefix(':')?.trim().parse().ok()).unwrap_or(0)
}

/// Writes the API server counted: `apiserver_request_total` of the write verbs, keyed
/// "VERB resource[/subresource]".
pub async fn apiserver_writes(client: &kube::Client) -> Result<BTreeMap<String, f64>, kube::Error> {
    let request = http::Request::get("/metrics").body(Vec::new()).map_err(kube::Error::HttpError)?;
    let text = client.request_text(request).await?;
    Ok(parse_apiserver_writes(&text))
}

const WRITE_VERBS: [&str; 6] = ["POST", "PUT", "PATCH", "APPLY", "DELETE", "DELETECOLLECTION"];

pub fn parse_apiserver_writes(text: &str) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("apiserver_request_total{") else { continue };
        let Some((labels, value)) = rest.rsplit_once("} ") else { continue };
        let Ok(value) = value.trim().parse::<f64>() else { continue };
        let label = |name: &str| {
            labels
                .split("\",")
                .find_map(|kv| kv.strip_prefix(name)?.strip_prefix("=\""))
                .map(|v| v.trim_end_matches('"'))
        };
        let verb = label("verb").unwrap_or_default();
        if !WRITE_VERBS.contains(&verb) {
            continue;
        }
        let resource = label("resource").unwrap_or_default();
        let key = match label("subresource").unwrap_or_default() {
            "" => format!("{verb} {resource}"),
            sub => format!("{verb} {resource}/{sub}"),
        };
        *out.entry(key).or_insert(0.0) += value;
    }
    out
}

/// `after - before` of two `apiserver_writes` readings, without the zeros.
pub fn writes_since(after: &BTreeMap<String, f64>, before: &BTreeMap<String, f64>) -> BTreeMap<String, f64> {
    after
        .iter()
        .map(|(k, v)| (k.clone(), v - before.get(k).copied().unwrap_or(0.0)))
        .filter(|(_, v)| *v > 0.0)
        .collect()
}

/// A memory figure of /proc/<pid>/status in MiB; NaN when it cannot be read (the
/// process is gone).
fn status_mib(pid: u32, field: &str) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find(|l| l.strip_prefix(field).is_some_and(|rest| rest.starts_with(':')))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kb| kb.parse::<f64>().ok())
        .map_or(f64::NAN, |kb| kb / 1024.0)
}

/// Peak resident set size (VmHWM) of a process in MiB.
pub fn peak_rss_mib(pid: u32) -> f64 {
    status_mib(pid, "VmHWM")
}

/// Resident set size now (VmRSS) of a process in MiB.
pub fn rss_mib(pid: u32) -> f64 {
    status_mib(pid, "VmRSS")
}

/// User + system CPU seconds of a process (0 when it cannot be read).
pub fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The fields after the command name (which may hold spaces): utime and stime are
    // the 12th and 13th of them, in clock ticks (100 per second on Linux).
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or_default();
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) / 100.0
}

/// CPU seconds of every process with this name whose command line holds `needle` ("":
/// any). Other engineers' control planes run beside the bench's own: `needle` picks
/// the bench's (`control_plane_needle`).
pub fn cpu_of(comm: &str, needle: &str) -> f64 {
    let Ok(dir) = std::fs::read_dir("/proc") else { return 0.0 };
    dir.flatten()
        .filter_map(|e| e.file_name().to_string_lossy().parse::<u32>().ok())
        .filter(|pid| std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == comm))
        .filter(|pid| {
            needle.is_empty()
                || std::fs::read(format!("/proc/{pid}/cmdline"))
                    .is_ok_and(|c| String::from_utf8_lossy(&c).contains(needle))
        })
        .map(cpu_seconds)
        .sum()
}

/// What the command lines of a test control plane's etcd and kube-apiserver hold: the
/// name of its directory (the kubeconfig's).
pub fn control_plane_needle(kubeconfig: &std::path::Path) -> String {
    kubeconfig.parent().and_then(|d| d.file_name()).map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
}

#[cfg(test)]
// Bench targets compile this with cfg(test) but without the harness, which drops the
// #[test] functions and leaves the import unused there.
#[allow(unused_imports)]
mod tests {
    use super::*;

    #[test]
    fn commandstats_and_info_fields_parse() {
        let text = "# Commandstats\r\ncmdstat_evalsha:calls=120,usec=900,usec_per_call=7.50,rejected_calls=0,failed_calls=0\r\n\
                    cmdstat_client|setname:calls=2,usec=1,usec_per_call=0.5,rejected_calls=0,failed_calls=0\r\n\
                    cmdstat_INFO:calls=3,usec=30\r\nnot a line\r\n";
        let stats = parse_commandstats(text);
        assert_eq!(stats.get("evalsha"), Some(&120));
        assert_eq!(stats.get("client|setname"), Some(&2));
        assert_eq!(stats.get("info"), Some(&3));
        assert_eq!(stats.len(), 3);
        let info = "# Stats\r\ntotal_connections_received:5\r\ntotal_reads_processed:4242\r\n";
        assert_eq!(info_number(info, "total_reads_processed"), 4242);
        assert_eq!(info_number(info, "total_writes_processed"), 0);
    }

    #[test]
    fn redis_activity_subtracts_and_reads_per_op() {
        let before = RedisActivity { commands: [("evalsha".to_string(), 10)].into(), reads: 10 };
        let after =
            RedisActivity { commands: [("evalsha".to_string(), 110), ("ping".to_string(), 1)].into(), reads: 111 };
        let d = after.since(&before);
        assert_eq!(d.total(), 101);
        assert_eq!(
            d.per(100, "heartbeat"),
            "1.01 Redis commands incl. those in scripts (evalsha 1.00, ping 0.01), 1.01 read events per heartbeat"
        );
    }

    #[test]
    fn apiserver_writes_are_the_write_verbs_by_resource() {
        let text = r#"# TYPE apiserver_request_total counter
apiserver_request_total{code="201",component="apiserver",dry_run="",group="prism.ntecdev.ai",resource="controllerregistrations",scope="resource",subresource="",verb="POST",version="v1alpha1"} 1000
apiserver_request_total{code="200",component="apiserver",dry_run="",group="prism.ntecdev.ai",resource="controllerregistrations",scope="resource",subresource="status",verb="PATCH",version="v1alpha1"} 1001
apiserver_request_total{code="409",component="apiserver",dry_run="",group="prism.ntecdev.ai",resource="controllerregistrations",scope="resource",subresource="status",verb="PATCH",version="v1alpha1"} 4
apiserver_request_total{code="200",component="apiserver",dry_run="",group="prism.ntecdev.ai",resource="controllerregistrations",scope="namespace",subresource="",verb="WATCH",version="v1alpha1"} 3
apiserver_request_total{code="201",component="apiserver",dry_run="",group="events.k8s.io",resource="events",scope="resource",subresource="",verb="POST",version="v1"} 7e+00
"#;
        let w = parse_apiserver_writes(text);
        assert_eq!(w.get("POST controllerregistrations"), Some(&1000.0));
        assert_eq!(w.get("PATCH controllerregistrations/status"), Some(&1005.0));
        assert_eq!(w.get("POST events"), Some(&7.0));
        assert_eq!(w.len(), 3, "{w:?}");
        let before: BTreeMap<String, f64> = [("POST events".to_string(), 7.0)].into();
        assert_eq!(writes_since(&w, &before).len(), 2);
    }

    #[test]
    fn process_counters_read_this_process() {
        let me = std::process::id();
        let rss = peak_rss_mib(me);
        assert!(rss > 1.0 && rss < 100_000.0, "{rss}");
        assert!(cpu_seconds(me) >= 0.0);
        assert!(peak_rss_mib(u32::MAX).is_nan());
        assert_eq!(cpu_seconds(u32::MAX), 0.0);
    }

    #[test]
    fn pg_activity_per_op() {
        let a = PgActivity { xact_commit: 200, tup_fetched: 300, tup_inserted: 100, ..Default::default() };
        assert_eq!(
            a.per(100, "registration"),
            "2.00 transactions, 3.0 rows fetched, 1.00 rows written per registration; \
             in all 200 transactions, 100 rows written for 100 registrations"
        );
        let scans = PgActivity {
            tup_returned: 50,
            reads: [("index a".to_string(), 10), ("seq scan t".to_string(), 40)].into(),
            ..Default::default()
        };
        assert!(
            scans.per(100, "x").contains("(0.5 index entries/scanned rows read, most by seq scan t: 0.4); in all 0"),
            "{}",
            scans.per(100, "x")
        );
        let before = PgActivity { reads: [("index a".to_string(), 4)].into(), ..Default::default() };
        assert_eq!(scans.since(&before).reads, [("index a".to_string(), 6), ("seq scan t".to_string(), 40)].into());
        assert_eq!(a.since(&a), PgActivity::default());
    }

    #[test]
    fn busiest_scans_ranks_the_indexes_scanned_most() {
        let before = PgActivity { scans: [("index a".to_string(), 100)].into(), ..Default::default() };
        let after = PgActivity {
            scans: [("index a".to_string(), 110), ("index b".to_string(), 50), ("seq scan t".to_string(), 2)].into(),
            ..Default::default()
        };
        let window = after.since(&before);
        assert_eq!(window.busiest_scans(2, 10.0), "index b 5.0, index a 1.0");
        assert_eq!(window.busiest_scans(8, 10.0), "index b 5.0, index a 1.0, seq scan t 0.2");
    }
}
