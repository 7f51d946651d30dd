//! Integers as JSON means them: `434` and `434.0` are the same number (JSON Schema's
//! `integer` is any number with a zero fraction), so a field documented as an integer
//! takes both. serde's i64 takes only the first; these take any JSON number that is a
//! whole number within i64, and refuse the rest (`1.5`, `1e300`, `2^63`).

use std::collections::BTreeMap;
use std::fmt;

use serde::de::{self, Deserializer, MapAccess, Visitor};

struct WholeI64;

impl<'de> Visitor<'de> for WholeI64 {
    type Value = i64;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a whole number within -2^63..2^63")
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<i64, E> {
        Ok(v)
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<i64, E> {
        i64::try_from(v).map_err(|_| E::invalid_value(de::Unexpected::Unsigned(v), &self))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<i64, E> {
        // -2^63 is exact as an f64; 2^63 (where i64::MAX rounds to) is not in range.
        const LIMIT: f64 = 9_223_372_036_854_775_808.0;
        if v.fract() == 0.0 && (-LIMIT..LIMIT).contains(&v) {
            Ok(v as i64)
        } else {
            Err(E::invalid_value(de::Unexpected::Float(v), &self))
        }
    }
}

pub fn i64<'de, D: Deserializer<'de>>(d: D) -> Result<i64, D::Error> {
    d.deserialize_any(WholeI64)
}

/// For `Option<i64>` fields (with `#[serde(default)]`): null is None.
pub fn opt_i64<'de, D: Deserializer<'de>>(d: D) -> Result<Option<i64>, D::Error> {
    #[derive(serde::Deserialize)]
    struct Whole(#[serde(deserialize_with = "i64")] i64);
    Ok(<Option<Whole> as serde::Deserialize>::deserialize(d)?.map(|Whole(v)| v))
}

/// For `Option<BTreeMap<String, i64>>` fields (with `#[serde(default)]`).
pub fn opt_map_i64<'de, D: Deserializer<'de>>(d: D) -> Result<Option<BTreeMap<String, i64>>, D::Error> {
    #[derive(serde::Deserialize)]
    struct Whole(#[serde(deserialize_with = "i64")] i64);
    struct Map;
    impl<'de> Visitor<'de> for Map {
        type Value = BTreeMap<String, i64>;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("an object of whole numbers")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Self::Value, A::Error> {
            let mut out = BTreeMap::new();
            while let Some((k, Whole(v))) = m.next_entry::<String, Whole>()? {
                out.insert(k, v);
            }
            Ok(out)
        }
    }
    struct OptMap;
    impl<'de> Visitor<'de> for OptMap {
        type Value = Option<BTreeMap<String, i64>>;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("null or an object of whole numbers")
        }
        fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
            d.deserialize_map(Map).map(Some)
        }
    }
    d.deserialize_option(OptMap)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[derive(serde::Deserialize, Debug)]
    struct T {
        #[serde(deserialize_with = "i64")]
        n: i64,
        #[serde(default, deserialize_with = "opt_i64")]
        o: Option<i64>,
        #[serde(default, deserialize_with = "opt_map_i64")]
        m: Option<BTreeMap<String, i64>>,
    }

    fn n(json: &str) -> Option<i64> {
        serde_json::from_str::<T>(&format!("{{\"n\": {json}}}")).ok().map(|t| t.n)
    }

    #[test]
    fn whole_numbers_in_any_spelling_and_nothing_else() {
        assert_eq!(n("434"), Some(434));
        assert_eq!(n("434.0"), Some(434));
        assert_eq!(n("-4.34e2"), Some(-434));
        assert_eq!(n("-9223372036854775808"), Some(i64::MIN));
        assert_eq!(n("9223372036854775807"), Some(i64::MAX));
        assert_eq!(n("-9223372036854775808.0"), Some(i64::MIN));
        for bad in
            ["9223372036854775808", "18446744073709551615", "9223372036854775808.0", "1.5", "1e300", "\"1\"", "null"]
        {
            assert_eq!(n(bad), None, "{bad}");
        }
        let t: T = serde_json::from_str(r#"{"n": 1, "o": 2.0, "m": {"slots": 4.0}}"#).expect("whole numbers");
        assert_eq!((t.o, t.m.and_then(|m| m.get("slots").copied())), (Some(2), Some(4)));
        let t: T = serde_json::from_str(r#"{"n": 1, "o": null, "m": null}"#).expect("nulls");
        assert_eq!((t.o, t.m), (None, None));
        assert!(serde_json::from_str::<T>(r#"{"n": 1, "m": {"slots": 0.5}}"#).is_err());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        /// Any i64, written as an integer or as a float that is exactly it, reads back;
        /// any f64 reads as itself when whole and in range, else is refused.
        #[test]
        fn every_integer_and_float(i in any::<i64>(), f in any::<f64>()) {
            prop_assert_eq!(n(&i.to_string()), Some(i));
            let exact = (i as f64) as i128 == i128::from(i);
            if exact {
                prop_assert_eq!(n(&format!("{:.1}", i as f64)), Some(i));
            }
            if f.is_finite() {
                let limit = 2f64.powi(63);
                let whole = f.fract() == 0.0 && (-limit..limit).contains(&f);
                prop_assert_eq!(n(&format!("{f:e}")), whole.then_some(f as i64));
            }
        }
    }
}
