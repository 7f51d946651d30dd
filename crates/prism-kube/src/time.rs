//! The one conversion between the times the operator computes with (chrono, as Postgres
//! and Redis give them) and the `Time` of Kubernetes objects (jiff), and the one way the
//! CLI prints how long ago something was.

use chrono::{DateTime, Utc};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;

/// A time as a Kubernetes `Time`, in whole seconds: `Time` is written at second precision
/// (k8s-openapi serializes it as metav1.Time does), so a status built with finer times
/// would never equal the same status read back, and would be rewritten by every
/// reconcile (the scale bench found every RunSession rewritten each lease, 10,000 Runs
/// ~330 writes/s). Times outside jiff's range (years beyond ±9999) cannot come from a
/// clock; they clamp.
pub fn to_k8s(t: DateTime<Utc>) -> Time {
    let secs = t.timestamp().clamp(Timestamp::MIN.as_second(), Timestamp::MAX.as_second());
    Time(Timestamp::from_second(secs).unwrap_or(Timestamp::UNIX_EPOCH))
}

/// A Kubernetes `Time` as a chrono time (every `Time` is within chrono's range).
pub fn from_k8s(t: &Time) -> DateTime<Utc> {
    DateTime::from_timestamp_micros(t.0.as_microsecond()).unwrap_or(DateTime::UNIX_EPOCH)
}

/// How long before `now` `t` was, as kubectl prints an AGE column (apimachinery's
/// `HumanDuration`: `45s`, `3m5s`, `15m`, `2h30m`, `10h`, `3d4h`, `12d`, `2y30d`). The
/// Unix epoch stands for "unknown" (`-`); a time a little ahead of this machine's clock
/// (another machine's) is `0s`, not kubectl's `<invalid>`.
pub fn age(t: DateTime<Utc>, now: DateTime<Utc>) -> String {
    if t == DateTime::UNIX_EPOCH {
        return "-".into();
    }
    let seconds = (now - t).num_seconds().max(0);
    if seconds < 120 {
        return format!("{seconds}s");
    }
    let minutes = seconds / 60;
    if minutes < 10 {
        return match seconds % 60 {
            0 => format!("{minutes}m"),
            s => format!("{minutes}m{s}s"),
        };
    }
    if minutes < 3 * 60 {
        return format!("{minutes}m");
    }
    let hours = minutes / 60;
    if hours < 8 {
        return match minutes % 60 {
            0 => format!("{hours}h"),
            m => format!("{hours}h{m}m"),
        };
    }
    if hours < 48 {
        return format!("{hours}h");
    }
    let days = hours / 24;
    if hours < 24 * 8 {
        return match hours % 24 {
            0 => format!("{days}d"),
            h => format!("{days}d{h}h"),
        };
    }
    if hours < 24 * 365 * 2 {
        return format!("{days}d");
    }
    let years = days / 365;
    if hours < 24 * 365 * 8 {
        return match days % 365 {
            0 => format!("{years}y"),
            d => format!("{years}y{d}d"),
        };
    }
    format!("{years}y")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_read_as_kubectl_prints_them() {
        let now = DateTime::from_timestamp(1_764_400_000, 0).expect("time");
        let ago = |s: i64| age(now - chrono::Duration::seconds(s), now);
        let cases = [
            (0, "0s"),
            (45, "45s"),
            (119, "119s"),
            (120, "2m"),
            (185, "3m5s"),
            (599, "9m59s"),
            (600, "10m"),
            (3 * 3600 - 1, "179m"),
            (3 * 3600, "3h"),
            (2 * 3600 + 30 * 60 + 3 * 3600, "5h30m"),
            (8 * 3600, "8h"),
            (47 * 3600 + 59 * 60, "47h"),
            (48 * 3600, "2d"),
            (4 * 86_400 + 5 * 3600, "4d5h"),
            (8 * 86_400, "8d"),
            (729 * 86_400, "729d"),
            (730 * 86_400, "2y"),
            (731 * 86_400, "2y1d"),
            (9 * 365 * 86_400, "9y"),
        ];
        for (seconds, want) in cases {
            assert_eq!(ago(seconds), want, "{seconds} s");
        }
        // Another machine's clock a little ahead: no negative age.
        assert_eq!(age(now + chrono::Duration::seconds(3), now), "0s");
        assert_eq!(age(DateTime::UNIX_EPOCH, now), "-");
    }

    #[test]
    fn whole_seconds_survive_a_round_trip_through_json() {
        let t = DateTime::from_timestamp_micros(1_764_400_000_123_456).expect("time");
        let k = to_k8s(t);
        assert_eq!(from_k8s(&k), DateTime::from_timestamp(1_764_400_000, 0).expect("time"));
        let back: Time = serde_json::from_value(serde_json::to_value(&k).expect("json")).expect("time");
        assert_eq!(back, k, "what the API server gives back is what was built");
    }
}
