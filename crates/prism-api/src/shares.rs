//! At most so many of something per key, each given back when its permit is dropped: a
//! caller's held streams (`streams`), a source address's connections (`transport::cap`).
//! A key holding none is forgotten, so the map is as large as what is held now.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex, MutexGuard};

pub struct Shares<K: Hash + Eq + Clone> {
    per_key: usize,
    held: Mutex<HashMap<K, usize>>,
}

impl<K: Hash + Eq + Clone> Shares<K> {
    pub fn new(per_key: usize) -> Arc<Self> {
        Arc::new(Shares { per_key: per_key.max(1), held: Mutex::new(HashMap::new()) })
    }

    /// The most one key may hold.
    pub fn per_key(&self) -> usize {
        self.per_key
    }

    fn locked(&self) -> MutexGuard<'_, HashMap<K, usize>> {
        // A panic elsewhere while the lock was held leaves a map that is still a map.
        self.held.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// One more for `key`, or None when it holds its share already.
    pub fn take(self: &Arc<Self>, key: K) -> Option<Share<K>> {
        let mut held = self.locked();
        let n = held.entry(key.clone()).or_insert(0);
        if *n >= self.per_key {
            return None;
        }
        *n += 1;
        Some(Share { shares: self.clone(), key })
    }

    /// How many `key` holds now.
    pub fn held_by(&self, key: &K) -> usize {
        self.locked().get(key).copied().unwrap_or(0)
    }

    /// Keys holding any now.
    pub fn keys(&self) -> usize {
        self.locked().len()
    }
}

/// One place in a key's share; given back when dropped.
pub struct Share<K: Hash + Eq + Clone> {
    shares: Arc<Shares<K>>,
    key: K,
}

impl<K: Hash + Eq + Clone> Drop for Share<K> {
    fn drop(&mut self) {
        let mut held = self.shares.locked();
        if let Some(n) = held.get_mut(&self.key) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                held.remove(&self.key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_gets_its_share_and_places_come_back() {
        let shares = Shares::new(2);
        let a = shares.take("a").expect("first");
        let b = shares.take("a").expect("second");
        assert!(shares.take("a").is_none(), "the third");
        assert!(shares.take("b").is_some(), "another key has its own share");
        drop(a);
        assert_eq!(shares.held_by(&"a"), 1);
        let c = shares.take("a").expect("a place came back");
        drop((b, c));
        assert_eq!(shares.keys(), 0, "a key holding none is forgotten");
    }
}
