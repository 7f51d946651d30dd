//! JSON read as the OpenAPI document describes it. serde's derives are more lenient than
//! JSON Schema: a struct also reads from an array of its fields in order (`["agents",
//! "P", "s", "codex"]` registered a session), and a unit enum also from a one-key object
//! (`{"codex": null}`). Request bodies are parsed to a `Value` and read through
//! `Strict`, which takes structs and maps only from objects and enums only from strings;
//! everything else is the `Value`'s own deserializer.

use serde::de::value::{MapDeserializer, SeqDeserializer, StringDeserializer};
use serde::de::{self, Deserializer, IntoDeserializer, Visitor};
use serde::forward_to_deserialize_any;
use serde_json::Value;

/// A JSON value that deserializes as JSON Schema reads it.
pub struct Strict(pub Value);

impl<'de> IntoDeserializer<'de, serde_json::Error> for Strict {
    type Deserializer = Strict;
    fn into_deserializer(self) -> Strict {
        self
    }
}

fn invalid(v: &Value, expected: &str) -> serde_json::Error {
    let unexpected = match v {
        Value::Null => de::Unexpected::Unit,
        Value::Bool(b) => de::Unexpected::Bool(*b),
        Value::Number(_) => de::Unexpected::Other("number"),
        Value::String(s) => de::Unexpected::Str(s),
        Value::Array(_) => de::Unexpected::Seq,
        Value::Object(_) => de::Unexpected::Map,
    };
    de::Error::invalid_type(unexpected, &expected)
}

impl<'de> Deserializer<'de> for Strict {
    type Error = serde_json::Error;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        // Arrays and objects keep the strict reading in their elements.
        match self.0 {
            Value::Array(items) => visitor.visit_seq(SeqDeserializer::new(items.into_iter().map(Strict))),
            Value::Object(map) => visitor.visit_map(MapDeserializer::new(map.into_iter().map(|(k, v)| (k, Strict(v))))),
            other => other.deserialize_any(visitor),
        }
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        match self.0 {
            Value::Null => visitor.visit_none(),
            other => visitor.visit_some(Strict(other)),
        }
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        visitor.visit_newtype_struct(self)
    }

    fn deserialize_seq<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        match self.0 {
            Value::Array(_) => self.deserialize_any(visitor),
            other => Err(invalid(&other, "an array")),
        }
    }

    fn deserialize_map<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        match self.0 {
            Value::Object(_) => self.deserialize_any(visitor),
            other => Err(invalid(&other, "an object")),
        }
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        self.deserialize_map(visitor)
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        match self.0 {
            Value::String(s) => visitor.visit_enum(StringDeserializer::<serde_json::Error>::new(s)),
            other => Err(invalid(&other, "a string")),
        }
    }

    fn deserialize_ignored_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        visitor.visit_unit()
    }

    // Scalars: the value's own reading (a type mismatch is its error).
    fn deserialize_bool<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        self.0.deserialize_bool(visitor)
    }
    fn deserialize_i64<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        self.0.deserialize_i64(visitor)
    }
    fn deserialize_i32<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        self.0.deserialize_i32(visitor)
    }
    fn deserialize_u64<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        self.0.deserialize_u64(visitor)
    }
    fn deserialize_u32<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        self.0.deserialize_u32(visitor)
    }
    fn deserialize_f64<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        self.0.deserialize_f64(visitor)
    }
    fn deserialize_str<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        self.0.deserialize_str(visitor)
    }
    fn deserialize_string<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        self.0.deserialize_string(visitor)
    }
    fn deserialize_identifier<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        self.0.deserialize_identifier(visitor)
    }
    fn deserialize_unit<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        self.0.deserialize_unit(visitor)
    }

    forward_to_deserialize_any! {
        i8 i16 i128 u8 u16 u128 f32 char bytes byte_buf unit_struct tuple tuple_struct
    }
}

/// `T` from a JSON value, strictly, with the path of the field at fault in the message.
pub fn from_value<T: de::DeserializeOwned>(v: Value) -> Result<T, serde_path_to_error::Error<serde_json::Error>> {
    serde_path_to_error::deserialize(Strict(v))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;
    use serde_json::json;
    use std::collections::BTreeMap;

    #[derive(Deserialize, Debug, PartialEq)]
    #[serde(rename_all = "snake_case")]
    enum Surface {
        Codex,
        Other,
    }

    #[derive(Deserialize, Debug, PartialEq)]
    #[serde(deny_unknown_fields)]
    struct Inner {
        os: String,
    }

    #[derive(Deserialize, Debug, PartialEq)]
    #[serde(deny_unknown_fields)]
    struct Body {
        name: String,
        surface: Surface,
        inner: Option<Inner>,
        #[serde(default)]
        caps: Vec<String>,
        #[serde(default, deserialize_with = "crate::json_int::opt_map_i64")]
        capacity: Option<BTreeMap<String, i64>>,
        #[serde(default)]
        payload: Value,
        #[serde(deserialize_with = "crate::json_int::i64")]
        n: i64,
    }

    #[test]
    fn objects_and_strings_where_the_schema_says_so() {
        let good = json!({"name": "a", "surface": "codex", "inner": {"os": "linux"}, "caps": ["x"],
                          "capacity": {"slots": 4.0}, "payload": [1, {"a": [2]}], "n": 7.0});
        let b: Body = from_value(good).expect("a good body");
        assert_eq!(b.surface, Surface::Codex);
        assert_eq!(b.inner, Some(Inner { os: "linux".into() }));
        assert_eq!(b.payload, json!([1, {"a": [2]}]));
        assert_eq!((b.n, b.capacity.and_then(|c| c.get("slots").copied())), (7, Some(4)));
        let minimal: Body =
            from_value(json!({"name": "a", "surface": "other", "inner": null, "n": 1})).expect("minimal");
        assert_eq!((minimal.inner, minimal.payload), (None, Value::Null));

        for bad in [
            json!(["a", "codex", null, [], null, null, 1]),
            json!({"name": "a", "surface": {"codex": null}, "n": 1}),
            json!({"name": "a", "surface": "codex", "inner": ["linux"], "n": 1}),
            json!({"name": "a", "surface": "codex", "capacity": [["slots", 4]], "n": 1}),
            json!({"name": "a", "surface": "codex", "caps": {"0": "x"}, "n": 1}),
            json!({"name": "a", "surface": "codex", "n": 1, "extra": 1}),
            json!({"name": "a", "surface": "codex", "n": 1.5}),
            json!({"name": 1, "surface": "codex", "n": 1}),
        ] {
            assert!(from_value::<Body>(bad.clone()).is_err(), "{bad}");
        }
    }
}
