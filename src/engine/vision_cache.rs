//! The vision-embedding cache: a screenshot goes through the vision tower once per episode however
//! often it is shown. Entries are keyed by image content hash and model, and evicted least recently
//! used under a byte capacity.

use std::collections::HashMap;
use std::sync::Arc;

use crate::engine::prompt::ImageHash;
use crate::model::GridThw;

/// The tower's output for one image.
pub struct VisionEntry<T> {
    pub grid: GridThw,
    /// `[tokens, hidden]` merged image tokens.
    pub embeds: T,
    /// Qwen3-VL deepstack features, each `[tokens, hidden]`.
    pub deepstack: Vec<T>,
    /// Bytes the entry occupies (for the capacity).
    pub bytes: usize,
}

/// A cached entry and the tick of its last use.
type Slot<T> = (Arc<VisionEntry<T>>, u64);

/// LRU cache of vision-tower outputs.
pub struct VisionCache<T> {
    /// Distinguishes models sharing a cache (part of every key).
    model_id: u64,
    entries: HashMap<(u64, ImageHash), Slot<T>>,
    capacity_bytes: usize,
    used_bytes: usize,
    tick: u64,
    /// Times the vision tower ran (cache misses that were filled).
    pub tower_runs: u64,
    /// Lookups served from the cache.
    pub hits: u64,
    pub evictions: u64,
}

impl<T> VisionCache<T> {
    /// An empty cache holding at most `capacity_bytes` of embeddings for model `model_id`.
    pub fn new(model_id: u64, capacity_bytes: usize) -> Self {
        VisionCache {
            model_id,
            entries: HashMap::new(),
            capacity_bytes,
            used_bytes: 0,
            tick: 0,
            tower_runs: 0,
            hits: 0,
            evictions: 0,
        }
    }

    /// The entry for `hash`, marking it recently used.
    pub fn get(&mut self, hash: ImageHash) -> Option<Arc<VisionEntry<T>>> {
        self.tick += 1;
        let tick = self.tick;
        let e = self.entries.get_mut(&(self.model_id, hash))?;
        e.1 = tick;
        self.hits += 1;
        Some(e.0.clone())
    }

    /// The entry for `hash` without marking it used.
    pub fn peek(&self, hash: ImageHash) -> Option<&Arc<VisionEntry<T>>> {
        self.entries.get(&(self.model_id, hash)).map(|e| &e.0)
    }

    /// Whether `hash` is cached (does not count as a use).
    pub fn contains(&self, hash: ImageHash) -> bool {
        self.entries.contains_key(&(self.model_id, hash))
    }

    /// Stores a freshly computed entry (counted as one tower run), evicting least recently used
    /// entries to stay under the capacity. An entry larger than the capacity is still kept until the
    /// next insertion, so the request that needs it can run.
    pub fn insert(&mut self, hash: ImageHash, entry: VisionEntry<T>) -> Arc<VisionEntry<T>> {
        self.tower_runs += 1;
        self.tick += 1;
        while self.used_bytes + entry.bytes > self.capacity_bytes && !self.entries.is_empty() {
            let oldest = self.entries.iter().min_by_key(|(_, (_, t))| *t).map(|(k, _)| *k);
            if let Some(k) = oldest {
                if let Some((e, _)) = self.entries.remove(&k) {
                    self.used_bytes -= e.bytes;
                    self.evictions += 1;
                }
            }
        }
        self.used_bytes += entry.bytes;
        let entry = Arc::new(entry);
        self.entries
            .insert((self.model_id, hash), (entry.clone(), self.tick));
        entry
    }

    /// Bytes held.
    pub fn used_bytes(&self) -> usize {
        self.used_bytes
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the cache is empty.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(bytes: usize) -> VisionEntry<()> {
        VisionEntry {
            grid: [1, 2, 2],
            embeds: (),
            deepstack: Vec::new(),
            bytes,
        }
    }

    #[test]
    fn evicts_least_recently_used_under_capacity() {
        let mut c = VisionCache::new(1, 100);
        c.insert(ImageHash(1), entry(40));
        c.insert(ImageHash(2), entry(40));
        assert!(c.get(ImageHash(1)).is_some()); // 1 is now more recent than 2
        c.insert(ImageHash(3), entry(40));
        assert!(c.contains(ImageHash(1)) && c.contains(ImageHash(3)) && !c.contains(ImageHash(2)));
        assert_eq!((c.used_bytes(), c.evictions, c.tower_runs, c.hits), (80, 1, 3, 1));
    }
}
