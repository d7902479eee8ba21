//! Per-process tables of mappings, held weakly so that a mapping lives exactly as long as something
//! uses it: a cache of opened mappings (one per key, shared through `Arc`), and a registry of
//! regions by address (which region holds a buffer).

use std::collections::{BTreeMap, HashMap};
use std::hash::Hash;
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use crate::error::Result;

/// Mappings by key. Opening and closing both run under the cache's lock, so a key is never opened
/// twice at once, nor opened again while its previous mapping is still being closed.
pub(crate) struct MappingCache<K, V> {
    map: Mutex<HashMap<K, Weak<V>>>,
}

impl<K: Eq + Hash + Clone, V> MappingCache<K, V> {
    pub(crate) fn new() -> Self {
        MappingCache {
            map: Mutex::new(HashMap::new()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<K, Weak<V>>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The live mapping for `key`, or a new one made by `open`. A mapping whose last reference is
    /// being dropped right now is waited for: its `Drop` calls [`MappingCache::release`], which
    /// forgets it. `open` runs under the cache's lock, so it must not drop a mapping of this cache
    /// (whose `Drop` would take the lock again).
    pub(crate) fn get_or_open(&self, key: &K, open: impl FnOnce() -> Result<V>) -> Result<Arc<V>> {
        loop {
            let mut map = self.lock();
            match map.get(key) {
                Some(weak) => match weak.upgrade() {
                    Some(v) => return Ok(v),
                    None => {
                        drop(map);
                        std::thread::yield_now();
                    }
                },
                None => {
                    let v = Arc::new(open()?);
                    map.insert(key.clone(), Arc::downgrade(&v));
                    return Ok(v);
                }
            }
        }
    }

    /// Runs `close` under the lock and forgets `key` if its mapping is gone. Called from the
    /// mapping's `Drop`.
    pub(crate) fn release(&self, key: &K, close: impl FnOnce()) {
        let mut map = self.lock();
        close();
        if map.get(key).is_some_and(|w| w.strong_count() == 0) {
            map.remove(key);
        }
    }

    /// The number of live mappings.
    pub(crate) fn live(&self) -> usize {
        self.lock().values().filter(|w| w.strong_count() > 0).count()
    }
}

/// A mapped region of memory: where it starts and how many bytes it holds.
pub(crate) trait Region {
    fn address(&self) -> u64;
    fn size(&self) -> usize;
}

/// Live regions by start address, so the region behind any buffer that views one is found.
pub(crate) struct Registry<V> {
    map: Mutex<BTreeMap<u64, Weak<V>>>,
}

impl<V: Region> Registry<V> {
    pub(crate) const fn new() -> Self {
        Registry {
            map: Mutex::new(BTreeMap::new()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, BTreeMap<u64, Weak<V>>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers a live region.
    pub(crate) fn insert(&self, region: &Arc<V>) {
        self.lock().insert(region.address(), Arc::downgrade(region));
    }

    /// Forgets the region at `address` once it is gone. Called from the region's `Drop`.
    pub(crate) fn remove(&self, address: u64) {
        let mut map = self.lock();
        if map.get(&address).is_some_and(|w| w.strong_count() == 0) {
            map.remove(&address);
        }
    }

    /// The number of live regions for which `pred` holds.
    pub(crate) fn count(&self, pred: impl Fn(&V) -> bool) -> usize {
        let mut n = 0;
        self.for_each(|r| n += usize::from(pred(r)));
        n
    }

    /// Visits every live region.
    pub(crate) fn for_each(&self, mut visit: impl FnMut(&V)) {
        let map = self.lock();
        map.values().filter_map(Weak::upgrade).for_each(|r| visit(&r));
    }

    /// The live region holding all of `address..address + len`, and the offset of `address` in it.
    pub(crate) fn find(&self, address: u64, len: usize) -> Option<(Arc<V>, usize)> {
        let map = self.lock();
        let (&start, weak) = map.range(..=address).next_back()?;
        let region = weak.upgrade()?;
        let end = start + region.size() as u64;
        (address + len as u64 <= end).then(|| (region, (address - start) as usize))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    static CACHE: std::sync::LazyLock<MappingCache<u32, Thing>> = std::sync::LazyLock::new(MappingCache::new);
    static CLOSED: AtomicUsize = AtomicUsize::new(0);

    struct Thing(u32);

    impl Drop for Thing {
        fn drop(&mut self) {
            CACHE.release(&self.0, || {
                CLOSED.fetch_add(1, Ordering::SeqCst);
            });
        }
    }

    #[test]
    fn one_mapping_per_key_while_used() {
        let opens = AtomicUsize::new(0);
        let open = |k| {
            opens.fetch_add(1, Ordering::SeqCst);
            Ok(Thing(k))
        };
        let a = CACHE.get_or_open(&7, || open(7)).unwrap();
        let b = CACHE.get_or_open(&7, || open(7)).unwrap();
        assert!(Arc::ptr_eq(&a, &b));
        assert_eq!(opens.load(Ordering::SeqCst), 1);
        drop(a);
        drop(b);
        assert_eq!(CLOSED.load(Ordering::SeqCst), 1);
        assert_eq!(CACHE.live(), 0);
        let _c = CACHE.get_or_open(&7, || open(7)).unwrap();
        assert_eq!(opens.load(Ordering::SeqCst), 2);
        assert!(
            CACHE
                .get_or_open(&8, || Err(crate::error::Error::InvalidData("no".into())))
                .is_err()
        );
    }
}
