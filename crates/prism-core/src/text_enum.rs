//! Domain values spelled as one lowercase word in JSON, in Postgres (a text column
//! guarded by a CHECK constraint) and in logs, declared once with their spellings.

/// A spelling of a domain value that this build does not know (a newer writer, or a
/// row changed by hand): an error, never a silent default.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown {kind} {value:?}")]
pub struct UnknownValue {
    pub kind: &'static str,
    pub value: String,
}

/// Declares the enum with its spellings and implements serde, `Display`, `FromStr` and
/// `ALL` from that one list. The codecs of the outer layers come from the same spellings:
/// `sqlx_text!` and `utoipa_text!`.
#[macro_export]
macro_rules! text_enum {
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident {
            $( $(#[$vmeta:meta])* $variant:ident = $text:literal ),+ $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(::serde::Serialize, ::serde::Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
        $vis enum $name {
            $( $(#[$vmeta])* #[serde(rename = $text)] $variant ),+
        }

        impl $name {
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            /// The wire and database spelling.
            pub fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $text),+
                }
            }
        }

        impl ::std::fmt::Display for $name {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl ::std::str::FromStr for $name {
            type Err = $crate::UnknownValue;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                match s {
                    $($text => Ok($name::$variant),)+
                    _ => Err($crate::UnknownValue { kind: stringify!($name), value: s.to_string() }),
                }
            }
        }
    };
}

/// The Postgres text codec of `text_enum!` types (TEXT and VARCHAR columns alike; an
/// unknown spelling is a decode error naming the type and the value). Expands where
/// `sqlx` is a dependency.
#[macro_export]
macro_rules! sqlx_text {
    ($($name:ty),+ $(,)?) => {$(
        impl ::sqlx::Type<::sqlx::Postgres> for $name {
            fn type_info() -> ::sqlx::postgres::PgTypeInfo {
                <String as ::sqlx::Type<::sqlx::Postgres>>::type_info()
            }
            fn compatible(ty: &::sqlx::postgres::PgTypeInfo) -> bool {
                <String as ::sqlx::Type<::sqlx::Postgres>>::compatible(ty)
            }
        }

        impl ::sqlx::Encode<'_, ::sqlx::Postgres> for $name {
            fn encode_by_ref(
                &self,
                buf: &mut ::sqlx::postgres::PgArgumentBuffer,
            ) -> Result<::sqlx::encode::IsNull, ::sqlx::error::BoxDynError> {
                <&str as ::sqlx::Encode<::sqlx::Postgres>>::encode(self.as_str(), buf)
            }
        }

        impl<'r> ::sqlx::Decode<'r, ::sqlx::Postgres> for $name {
            fn decode(value: ::sqlx::postgres::PgValueRef<'r>) -> Result<Self, ::sqlx::error::BoxDynError> {
                let text = <&str as ::sqlx::Decode<::sqlx::Postgres>>::decode(value)?;
                Ok(text.parse::<$name>()?)
            }
        }
    )+};
}

/// The OpenAPI schema of `text_enum!` types: a string of the serde spellings (a derive
/// would not see the `rename`s `text_enum!` writes, and would list the variant names).
/// Expands where `utoipa` is a dependency.
#[macro_export]
macro_rules! utoipa_text {
    ($($name:ty),+ $(,)?) => {$(
        impl ::utoipa::PartialSchema for $name {
            fn schema() -> ::utoipa::openapi::RefOr<::utoipa::openapi::schema::Schema> {
                ::utoipa::openapi::schema::ObjectBuilder::new()
                    .schema_type(::utoipa::openapi::schema::Type::String)
                    .enum_values(Some(<$name>::ALL.iter().map(|v| v.as_str())))
                    .into()
            }
        }

        impl ::utoipa::ToSchema for $name {}
    )+};
}

#[cfg(test)]
mod tests {
    crate::text_enum! {
        enum Colour {
            Red = "red",
            DeepBlue = "deep_blue",
        }
    }

    #[test]
    fn one_list_spells_it_everywhere() {
        assert_eq!(Colour::ALL, &[Colour::Red, Colour::DeepBlue]);
        for c in Colour::ALL {
            assert_eq!(c.as_str().parse::<Colour>(), Ok(*c));
            assert_eq!(c.to_string(), c.as_str());
            let json = serde_json::to_string(c).expect("serializes");
            assert_eq!(json, format!("\"{}\"", c.as_str()));
            assert_eq!(serde_json::from_str::<Colour>(&json).expect("deserializes"), *c);
        }
        assert!(serde_json::from_str::<Colour>("\"DeepBlue\"").is_err(), "the variant name is not a spelling");
        let e = "blue".parse::<Colour>().expect_err("not a colour");
        assert_eq!(e.to_string(), "unknown Colour \"blue\"");
    }
}
