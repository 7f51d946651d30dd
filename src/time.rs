//! The one conversion between the times the operator computes with (chrono, as Postgres
//! and Redis give them) and the `Time` of Kubernetes objects (jiff).

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_seconds_survive_a_round_trip_through_json() {
        let t = DateTime::from_timestamp_micros(1_764_400_000_123_456).expect("time");
        let k = to_k8s(t);
        assert_eq!(from_k8s(&k), DateTime::from_timestamp(1_764_400_000, 0).expect("time"));
        let back: Time = serde_json::from_value(serde_json::to_value(&k).expect("json")).expect("time");
        assert_eq!(back, k, "what the API server gives back is what was built");
    }
}
