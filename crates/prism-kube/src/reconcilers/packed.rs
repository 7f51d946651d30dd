//! What the controllers' watch cache keeps of each object: `Packed<K>`.
//!
//! kube's controller holds every watched object in its reflector store for as long as it
//! exists, and reads only its metadata (its key, generation, deletion and finalizers)
//! until a reconcile needs the object. A typed object keeps its spec, status and maps as
//! many small allocations (a condition is five strings, a one-entry label map an 11-slot
//! B-tree node of ~550 bytes): at 10,000 + 10,000 objects the stores were 51 MiB, over
//! half of the operator's live heap (BENCHMARKS.md). A `Packed` object keeps the
//! metadata kube reads as it is and the rest (spec, status, the operator's own labels and
//! annotations) as the object's JSON, LZ4-compressed against a dictionary of its kind's
//! usual text; a reconcile unpacks the whole object again (`Packed::unpack`), so nothing
//! downstream of the cache changes.

use std::borrow::Cow;
use std::marker::PhantomData;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Resource;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize};

/// The prefix of every label and annotation the operator reads or writes.
const OWN_PREFIX: &str = "prism.ntecdev.ai/";

/// A kind the controllers cache packed.
pub trait Packable: Resource<DynamicType = ()> + Serialize + DeserializeOwned {
    /// JSON text that objects of this kind usually contain (field names, condition types,
    /// reasons and messages): the compressor finds it in here instead of in the object,
    /// which is too short to repeat much of itself. Only the ratio depends on it.
    const DICTIONARY: &'static [u8];
}

/// An object as the watch cache keeps it: `metadata` without labels, annotations and
/// `managedFields`; everything else in `body`.
pub struct Packed<K> {
    metadata: ObjectMeta,
    /// LZ4 (its uncompressed length first) of the object's JSON whose metadata is only its
    /// own labels and annotations.
    body: Box<[u8]>,
    kind: PhantomData<fn() -> K>,
}

/// A packed object could not be made whole again (a bug: the cache packed it itself).
#[derive(Debug, thiserror::Error)]
pub enum UnpackError {
    #[error("watch cache: decompress: {0}")]
    Decompress(#[from] lz4_flex::block::DecompressError),
    #[error("watch cache: parse: {0}")]
    Parse(#[from] serde_json::Error),
}

impl<K: Packable> Packed<K> {
    /// Packs `obj`, dropping from it what no reconcile reads (`own_metadata_only`).
    pub fn pack(mut obj: K) -> Result<Self, serde_json::Error> {
        own_metadata_only(obj.meta_mut());
        let meta = obj.meta_mut();
        let (labels, annotations) = (meta.labels.take(), meta.annotations.take());
        let metadata = std::mem::replace(meta, ObjectMeta { labels, annotations, ..Default::default() });
        let json = serde_json::to_vec(&obj)?;
        let body = lz4_flex::block::compress_prepend_size_with_dict(&json, K::DICTIONARY).into_boxed_slice();
        Ok(Self { metadata, body, kind: PhantomData })
    }

    /// The object again, as it was packed.
    pub fn unpack(&self) -> Result<K, UnpackError> {
        let json = lz4_flex::block::decompress_size_prepended_with_dict(&self.body, K::DICTIONARY)?;
        let mut obj: K = serde_json::from_slice(&json)?;
        let meta = obj.meta_mut();
        let (labels, annotations) = (meta.labels.take(), meta.annotations.take());
        *meta = ObjectMeta { labels, annotations, ..self.metadata.clone() };
        Ok(obj)
    }

    /// Bytes of the packed part.
    pub fn packed_len(&self) -> usize {
        self.body.len()
    }
}

impl<'de, K: Packable> Deserialize<'de> for Packed<K> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        Packed::pack(K::deserialize(deserializer)?).map_err(serde::de::Error::custom)
    }
}

impl<K> Clone for Packed<K> {
    fn clone(&self) -> Self {
        Self { metadata: self.metadata.clone(), body: self.body.clone(), kind: PhantomData }
    }
}

impl<K> std::fmt::Debug for Packed<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Packed").field("metadata", &self.metadata).field("packed_bytes", &self.body.len()).finish()
    }
}

/// The same kind, URL and scope as `K`: the controller watches `K`'s resources.
impl<K: Resource> Resource for Packed<K> {
    type DynamicType = K::DynamicType;
    type Scope = K::Scope;

    fn kind(dt: &Self::DynamicType) -> Cow<'_, str> {
        K::kind(dt)
    }

    fn group(dt: &Self::DynamicType) -> Cow<'_, str> {
        K::group(dt)
    }

    fn version(dt: &Self::DynamicType) -> Cow<'_, str> {
        K::version(dt)
    }

    fn api_version(dt: &Self::DynamicType) -> Cow<'_, str> {
        K::api_version(dt)
    }

    fn plural(dt: &Self::DynamicType) -> Cow<'_, str> {
        K::plural(dt)
    }

    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }

    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

/// Drops from a cached object what no reconcile reads: `managedFields` (most of an
/// object's bytes), and labels and annotations not of this operator (a `kubectl apply`
/// leaves the whole object again in its last-applied annotation). The reconcilers read
/// the project label and the owner and registered-by annotations, and patch only those
/// (a merge patch of the label alone, the finalizer list whole): the resource keeps
/// everything else.
fn own_metadata_only(meta: &mut ObjectMeta) {
    meta.managed_fields = None;
    for map in [&mut meta.labels, &mut meta.annotations] {
        if let Some(entries) = map {
            entries.retain(|key, _| key.starts_with(OWN_PREFIX));
            if entries.is_empty() {
                *map = None;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::{ControllerRegistration, OWNER_ANNOTATION, PROJECT_LABEL, REGISTERED_BY_ANNOTATION};

    #[test]
    fn the_cache_keeps_the_operators_own_metadata_only() {
        let mut meta = ObjectMeta {
            name: Some("r".into()),
            labels: Some([(PROJECT_LABEL.to_string(), "P".to_string()), ("app".to_string(), "x".to_string())].into()),
            annotations: Some(
                [
                    (OWNER_ANNOTATION.to_string(), "alice".to_string()),
                    (REGISTERED_BY_ANNOTATION.to_string(), "api".to_string()),
                    ("kubectl.kubernetes.io/last-applied-configuration".to_string(), "{...}".repeat(100)),
                ]
                .into(),
            ),
            finalizers: Some(vec!["prism.ntecdev.ai/release".into(), "other/keep".into()]),
            managed_fields: Some(vec![Default::default()]),
            ..Default::default()
        };
        own_metadata_only(&mut meta);
        assert_eq!(meta.labels, Some([(PROJECT_LABEL.to_string(), "P".to_string())].into()));
        let annotations: Vec<&String> = meta.annotations.iter().flatten().map(|(k, _)| k).collect();
        assert_eq!(annotations, [OWNER_ANNOTATION, REGISTERED_BY_ANNOTATION]);
        assert_eq!(meta.managed_fields, None);
        assert_eq!(
            meta.finalizers.map(|f| f.len()),
            Some(2),
            "every finalizer stays (kube's finalizer() patches the list)"
        );
        let mut bare = ObjectMeta { labels: Some([("app".to_string(), "x".to_string())].into()), ..Default::default() };
        own_metadata_only(&mut bare);
        assert_eq!(bare.labels, None, "no empty map kept");
    }

    fn registration() -> ControllerRegistration {
        let mut obj = crate::reconcilers::mock_api_tests::registration("4711");
        obj.metadata.generation = Some(1);
        obj.metadata.finalizers = Some(vec!["prism.ntecdev.ai/release".into()]);
        obj.metadata.labels = Some([(PROJECT_LABEL.to_string(), "PID-1".to_string())].into());
        obj.metadata.annotations = Some(
            [
                (OWNER_ANNOTATION.to_string(), "alice".to_string()),
                ("kubectl.kubernetes.io/last-applied-configuration".to_string(), "{}".to_string()),
            ]
            .into(),
        );
        obj.status = Some(Default::default());
        obj
    }

    #[test]
    fn an_object_unpacks_as_it_was_cached_and_the_cache_reads_its_metadata() {
        let obj = registration();
        let packed = Packed::pack(obj.clone()).expect("pack");
        assert_eq!(packed.meta().name.as_deref(), Some("r"));
        assert_eq!(packed.meta().generation, Some(1));
        assert_eq!(packed.meta().finalizers, obj.metadata.finalizers, "kube's finalizer() and the predicate read them");
        assert_eq!(packed.meta().labels, None, "the maps are packed, not kept as B-tree nodes");
        let mut expected = obj;
        own_metadata_only(&mut expected.metadata);
        let json = |o: &ControllerRegistration| serde_json::to_value(o).expect("json");
        assert_eq!(json(&packed.unpack().expect("unpack")), json(&expected));
    }

    #[test]
    fn the_watch_deserializes_straight_into_the_packed_form() {
        let json = serde_json::to_string(&registration()).expect("json");
        let packed: Packed<ControllerRegistration> = serde_json::from_str(&json).expect("packed");
        assert_eq!(packed.unpack().expect("unpack").spec.project_id, "PID-1");
        assert_eq!(
            <Packed<ControllerRegistration> as Resource>::url_path(&(), Some("ns")),
            ControllerRegistration::url_path(&(), Some("ns")),
            "the same resources are watched"
        );
        assert!(serde_json::from_str::<Packed<ControllerRegistration>>(r#"{"spec": 1}"#).is_err(), "bad input fails");
    }
}
