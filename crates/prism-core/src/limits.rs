//! The lengths and alphabets of the identifiers (SPEC §3.1, §5), each said once here.
//! The CRD schemas are generated from these constants; the HTTP API's checks call these
//! functions, and its OpenAPI document (whose attributes take literals only) is held to
//! them by a property test (`api::docs`); the tables' CHECK constraints say the same.

/// A Kubernetes namespace name (an RFC 1123 label).
pub const NAMESPACE_MAX: usize = 63;
/// Longest project id and session id (characters), as the CRD and the tables have them.
pub const PROJECT_ID_MAX: usize = 128;
pub const SESSION_ID_MAX: usize = 256;
/// A Run's server instance id (a DNS subdomain's length) and component kind (a label's).
pub const SERVER_INSTANCE_ID_MAX: usize = 253;
pub const COMPONENT_KIND_MAX: usize = 63;
/// A Kubernetes label value.
pub const LABEL_VALUE_MAX: usize = 63;

/// Printable text (SPEC §3.1): no control character (C0, DEL, C1, what `char::is_control`
/// says). Spelled so that Go's RE2 (the API server), Python's `re` and ECMAScript read it
/// alike: `\xHH` is a code point in all three.
pub const PRINTABLE_PATTERN: &str = r"^[^\x00-\x1F\x7F-\x9F]*$";

/// A namespace name: 1-63 of `[a-z0-9-]`, alphanumeric at both ends.
pub fn is_namespace(ns: &str) -> bool {
    !ns.is_empty()
        && ns.len() <= NAMESPACE_MAX
        && ns.bytes().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-')
        && !ns.starts_with('-')
        && !ns.ends_with('-')
}

/// An identifier (a project or session id): 1 to `max` characters (Unicode scalar values,
/// as JSON Schema's `maxLength` counts), all printable. No control character: a newline
/// would split `kubectl get` rows and log lines, and a NUL cannot be stored.
pub fn is_identifier(v: &str, max: usize) -> bool {
    !v.is_empty() && v.chars().count() <= max && !v.chars().any(char::is_control)
}

/// What `is_identifier` asks, for an error message.
pub fn identifier_rule(field: &str, max: usize) -> String {
    format!("{field} must be 1 to {max} printable characters (no control characters)")
}

/// Whether `v` may be a label value (63 characters of `[A-Za-z0-9._-]`, alphanumeric
/// at both ends, or empty).
pub fn is_label_value(v: &str) -> bool {
    let b = v.as_bytes();
    b.len() <= LABEL_VALUE_MAX
        && (b.is_empty()
            || (b[0].is_ascii_alphanumeric()
                && b[b.len() - 1].is_ascii_alphanumeric()
                && b.iter().all(|c| c.is_ascii_alphanumeric() || b"-_.".contains(c))))
}

/// The shapes a Run's identity may have (the RunSession schema's). They carry no braces,
/// so the Redis hash tag `{server/component}` of the address's keys is always the whole
/// address and every key of one identity is on one cluster slot.
pub fn server_instance_id_ok(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= SERVER_INSTANCE_ID_MAX
        && s.bytes().all(|c| c.is_ascii_alphanumeric() || b"._-".contains(&c))
}

pub fn component_kind_ok(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= COMPONENT_KIND_MAX
        && s.bytes().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-')
}

/// What `server_instance_id_ok` and `component_kind_ok` ask, for error messages.
pub fn server_instance_id_rule() -> String {
    format!("server_instance_id: 1-{SERVER_INSTANCE_ID_MAX} characters of [A-Za-z0-9._-]")
}

pub fn component_kind_rule() -> String {
    format!("component_kind: 1-{COMPONENT_KIND_MAX} characters of [a-z0-9-]")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_limit_is_where_it_says() {
        let ns = "a".repeat(NAMESPACE_MAX);
        assert!(is_namespace(&ns) && !is_namespace(&format!("{ns}a")));
        assert!(!is_namespace("") && !is_namespace("-a") && !is_namespace("a-") && !is_namespace("A"));
        // Characters, not bytes.
        assert!(is_identifier(&"é".repeat(PROJECT_ID_MAX), PROJECT_ID_MAX));
        assert!(!is_identifier(&"é".repeat(PROJECT_ID_MAX + 1), PROJECT_ID_MAX));
        assert!(!is_identifier("", SESSION_ID_MAX) && !is_identifier("a\nb", SESSION_ID_MAX));
        assert!(!is_identifier("a\u{85}b", SESSION_ID_MAX), "C1 controls too");
        assert!(is_identifier("PID-42 ü 日本 🚀", PROJECT_ID_MAX));
        let server = "s".repeat(SERVER_INSTANCE_ID_MAX);
        assert!(server_instance_id_ok(&server) && !server_instance_id_ok(&format!("{server}s")));
        assert!(!server_instance_id_ok("a{b}") && !server_instance_id_ok(""));
        let kind = "k".repeat(COMPONENT_KIND_MAX);
        assert!(component_kind_ok(&kind) && !component_kind_ok(&format!("{kind}k")) && !component_kind_ok("Run"));
        assert!(is_label_value("") && is_label_value("web.app_2") && !is_label_value("-web"));
        assert!(!is_label_value(&"v".repeat(LABEL_VALUE_MAX + 1)));
        assert!(server_instance_id_rule().contains("1-253") && component_kind_rule().contains("1-63"));
    }
}
