//! The one conversion between the times the operator computes with (chrono, as Postgres
//! and Redis give them) and the `Time` of Kubernetes objects (jiff).

use chrono::{DateTime, Utc};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;

/// A time as a Kubernetes `Time`, at microsecond precision (what Postgres keeps). Times
/// outside jiff's range (years beyond ±9999) cannot come from a clock; they clamp.
pub fn to_k8s(t: DateTime<Utc>) -> Time {
    let micros = t.timestamp_micros().clamp(Timestamp::MIN.as_microsecond(), Timestamp::MAX.as_microsecond());
    Time(Timestamp::from_microsecond(micros).unwrap_or(Timestamp::UNIX_EPOCH))
}

/// A Kubernetes `Time` as a chrono time (every `Time` is within chrono's range).
pub fn from_k8s(t: &Time) -> DateTime<Utc> {
    DateTime::from_timestamp_micros(t.0.as_microsecond()).unwrap_or(DateTime::UNIX_EPOCH)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_at_microsecond_precision() {
        let t = DateTime::from_timestamp_micros(1_764_400_000_123_456).expect("time");
        assert_eq!(from_k8s(&to_k8s(t)), t);
    }
}
