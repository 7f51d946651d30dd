//! Whether the CRDs the API server serves carry the schema this build needs (SPEC §15).
//!
//! The API server prunes every field its CRD's schema does not name: an operator running
//! against a CRD from an older chart (or an older `kubectl apply`) would write a new
//! field and read nothing back, silently. So at start the operator compares the served
//! CRDs with the ones it was built with and refuses to run on a stale one, naming it and
//! what it lacks in one line. A newer CRD (a rollback to this build keeps the newer
//! release's CRDs until the chart applies its own) has everything this build needs:
//! only what is *missing* counts, never what is extra.

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
    CustomResourceDefinition, JSONSchemaProps, JSONSchemaPropsOrArray, JSONSchemaPropsOrBool,
};
use kube::{Api, CustomResourceExt};

use crate::crd::{ControllerRegistration, RunSession};

/// What a served CRD lacks of the one this build needs.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Lacks {
    /// Versions this build uses that the API server does not serve.
    pub versions: Vec<String>,
    /// Fields (dotted paths from the object's root, `[]` for a list's items) its schema
    /// does not name.
    pub fields: Vec<String>,
}

impl Lacks {
    pub fn is_empty(&self) -> bool {
        self.versions.is_empty() && self.fields.is_empty()
    }
}

impl std::fmt::Display for Lacks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut parts = Vec::new();
        if !self.versions.is_empty() {
            parts.push(format!("the served version(s) {}", self.versions.join(", ")));
        }
        // A handful names the cause; a whole schema's worth would not fit a line.
        const SHOWN: usize = 5;
        if !self.fields.is_empty() {
            let more = self.fields.len().saturating_sub(SHOWN);
            let shown = self.fields.iter().take(SHOWN).cloned().collect::<Vec<_>>().join(", ");
            parts.push(if more > 0 { format!("{shown} and {more} more field(s)") } else { shown });
        }
        f.write_str(&parts.join(" and "))
    }
}

/// What `served` lacks of `needed`: each version of `needed` must be served, and its
/// schema name every field `needed`'s does. Pure; extra versions and fields are fine.
pub fn lacks(needed: &CustomResourceDefinition, served: &CustomResourceDefinition) -> Lacks {
    let mut out = Lacks::default();
    for version in &needed.spec.versions {
        let Some(theirs) = served.spec.versions.iter().find(|v| v.name == version.name && v.served) else {
            out.versions.push(version.name.clone());
            continue;
        };
        let ours = version.schema.as_ref().and_then(|s| s.open_api_v3_schema.as_ref());
        let theirs = theirs.schema.as_ref().and_then(|s| s.open_api_v3_schema.as_ref());
        if let Some(ours) = ours {
            match theirs {
                Some(theirs) => missing_fields("", ours, theirs, &mut out.fields),
                None => out.fields.push(format!("the schema of {}", version.name)),
            }
        }
    }
    out
}

fn missing_fields(path: &str, needed: &JSONSchemaProps, served: &JSONSchemaProps, out: &mut Vec<String>) {
    // A level that keeps unknown fields prunes nothing below it.
    if served.x_kubernetes_preserve_unknown_fields == Some(true) {
        return;
    }
    let join = |name: &str| if path.is_empty() { name.to_string() } else { format!("{path}.{name}") };
    for (name, ours) in needed.properties.iter().flatten() {
        match served.properties.as_ref().and_then(|p| p.get(name)) {
            Some(theirs) => missing_fields(&join(name), ours, theirs, out),
            None => out.push(join(name)),
        }
    }
    if let Some(JSONSchemaPropsOrArray::Schema(ours)) = &needed.items {
        match &served.items {
            Some(JSONSchemaPropsOrArray::Schema(theirs)) => missing_fields(&format!("{path}[]"), ours, theirs, out),
            _ => out.push(format!("{path}[]")),
        }
    }
    if let Some(JSONSchemaPropsOrBool::Schema(ours)) = &needed.additional_properties {
        match &served.additional_properties {
            Some(JSONSchemaPropsOrBool::Schema(theirs)) => missing_fields(&format!("{path}{{}}"), ours, theirs, out),
            Some(JSONSchemaPropsOrBool::Bool(true)) => {}
            _ => out.push(format!("{path}{{}}")),
        }
    }
}

/// The CRDs this build was made with (what `crdgen` prints).
pub fn needed() -> [CustomResourceDefinition; 2] {
    [ControllerRegistration::crd(), RunSession::crd()]
}

/// Why the served CRDs cannot be run against, in one line with the way out.
#[derive(Debug, thiserror::Error)]
pub enum CrdCheckError {
    #[error(
        "CRD {name} is stale: it lacks {lacks} (installed by an older chart or manifest); apply this release's CRDs: \
         `helm upgrade` (the chart's CRDs follow the release), or `prism-operator crdgen | kubectl apply --server-side -f -`"
    )]
    Stale { name: String, lacks: Lacks },
    #[error(
        "CRD {name} is not installed: `helm install` the chart, or `prism-operator crdgen | kubectl apply --server-side -f -`"
    )]
    Missing { name: String },
    #[error("reading CRD {name}: {source}")]
    Read {
        name: String,
        #[source]
        source: kube::Error,
    },
}

/// How the check ended when it could run at all.
#[derive(Debug, PartialEq, Eq)]
pub enum Checked {
    /// Every CRD carries what this build needs.
    Current,
    /// The operator may not read CRDs (RBAC of a chart older than this check): nothing
    /// was compared, which the caller says in a warning.
    NotAllowed { name: String },
}

/// Reads the served CRDs and compares them with `needed()`.
#[tracing::instrument(level = "debug", skip_all)]
pub async fn check_served(client: kube::Client) -> Result<Checked, CrdCheckError> {
    let api: Api<CustomResourceDefinition> = Api::all(client);
    for crd in needed() {
        let name = crd.metadata.name.clone().unwrap_or_default();
        let served = match api.get(&name).await {
            Ok(served) => served,
            Err(kube::Error::Api(s)) if s.code == 404 => return Err(CrdCheckError::Missing { name }),
            Err(kube::Error::Api(s)) if s.code == 403 => return Ok(Checked::NotAllowed { name }),
            Err(source) => return Err(CrdCheckError::Read { name, source }),
        };
        let lacks = lacks(&crd, &served);
        if !lacks.is_empty() {
            return Err(CrdCheckError::Stale { name, lacks });
        }
    }
    Ok(Checked::Current)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    fn registration() -> CustomResourceDefinition {
        ControllerRegistration::crd()
    }

    fn schema_mut(crd: &mut CustomResourceDefinition) -> &mut JSONSchemaProps {
        crd.spec.versions[0].schema.as_mut().and_then(|s| s.open_api_v3_schema.as_mut()).expect("a schema")
    }

    /// Every field path of a schema, as `lacks` names them.
    fn paths(crd: &CustomResourceDefinition) -> Vec<String> {
        let mut empty = crd.clone();
        *schema_mut(&mut empty) = JSONSchemaProps { type_: Some("object".into()), ..Default::default() };
        lacks(crd, &empty).fields
    }

    #[test]
    fn the_crd_this_build_makes_lacks_nothing() {
        for crd in needed() {
            assert_eq!(lacks(&crd, &crd), Lacks::default());
        }
    }

    #[test]
    fn an_older_crd_without_a_field_is_named_by_its_path() {
        // A RunSession CRD from before `spec.paused`.
        let needed = RunSession::crd();
        let mut served = needed.clone();
        let spec = schema_mut(&mut served).properties.as_mut().and_then(|p| p.get_mut("spec")).expect("spec");
        spec.properties.as_mut().map(|p| p.remove("paused"));
        let lacks = lacks(&needed, &served);
        assert_eq!(lacks.fields, ["spec.paused"]);
        assert!(lacks.versions.is_empty());
        let line = CrdCheckError::Stale { name: "runsessions.prism.ntecdev.ai".into(), lacks }.to_string();
        assert!(line.contains("runsessions.prism.ntecdev.ai is stale: it lacks spec.paused"), "{line}");
        assert!(!line.contains('\n'), "one line: {line}");
    }

    #[test]
    fn a_version_not_served_is_named() {
        let needed = registration();
        let mut served = needed.clone();
        served.spec.versions[0].served = false;
        assert_eq!(lacks(&needed, &served).versions, ["v1alpha1"]);
    }

    #[test]
    fn a_newer_crd_with_more_fields_and_versions_lacks_nothing() {
        let needed = registration();
        let mut served = needed.clone();
        let root = schema_mut(&mut served);
        root.properties
            .get_or_insert_default()
            .insert("future".into(), JSONSchemaProps { type_: Some("string".into()), ..Default::default() });
        let mut next = served.spec.versions[0].clone();
        next.name = "v1beta1".into();
        served.spec.versions.push(next);
        assert!(lacks(&needed, &served).is_empty());
    }

    #[test]
    fn a_level_that_keeps_unknown_fields_lacks_nothing_below_it() {
        let needed = registration();
        let mut served = needed.clone();
        let status = schema_mut(&mut served).properties.as_mut().and_then(|p| p.get_mut("status")).expect("status");
        *status = JSONSchemaProps { x_kubernetes_preserve_unknown_fields: Some(true), ..Default::default() };
        assert!(lacks(&needed, &served).is_empty());
    }

    #[test]
    fn a_long_list_is_cut_to_a_line() {
        let needed = registration();
        let mut served = needed.clone();
        // Its spec and status name no field at all.
        for part in schema_mut(&mut served).properties.iter_mut().flat_map(|p| p.values_mut()) {
            *part = JSONSchemaProps { type_: Some("object".into()), ..Default::default() };
        }
        let lacks = lacks(&needed, &served);
        assert!(lacks.fields.len() > 5);
        assert!(lacks.to_string().ends_with(&format!("and {} more field(s)", lacks.fields.len() - 5)));
    }

    proptest! {
        /// Whichever fields a served schema lost, exactly those are named (the fields
        /// below a lost one are not named again: it is the lost one that is missing).
        #[test]
        fn exactly_the_removed_fields_are_named(picks in proptest::collection::vec(any::<proptest::sample::Index>(), 1..6)) {
            for needed in needed() {
                // Fields reached through properties alone (list items and maps are
                // covered by their own cases above).
                let all: Vec<String> = paths(&needed).into_iter().filter(|p| !p.contains(['[', '{'])).collect();
                let removed: BTreeSet<String> = picks.iter().map(|i| all[i.index(all.len())].clone()).collect();
                let outermost: BTreeSet<String> = removed
                    .iter()
                    .filter(|p| !removed.iter().any(|q| p.starts_with(&format!("{q}."))))
                    .cloned()
                    .collect();
                let mut served = needed.clone();
                for path in &outermost {
                    remove(schema_mut(&mut served), path);
                }
                let named: BTreeSet<String> = lacks(&needed, &served).fields.into_iter().collect();
                prop_assert_eq!(named, outermost);
            }
        }
    }

    /// Removes the field at a dotted `path` from a schema.
    fn remove(root: &mut JSONSchemaProps, path: &str) {
        let (parents, last) = path.rsplit_once('.').map_or((None, path), |(a, b)| (Some(a), b));
        let mut node = root;
        for name in parents.into_iter().flat_map(|p| p.split('.')) {
            node = node.properties.as_mut().and_then(|p| p.get_mut(name)).expect("a parent the path names");
        }
        node.properties.as_mut().map(|p| p.remove(last));
    }
}
