//! Page-locked host memory: a reusable pool, so that pinning never happens on a hot path.
//!
//! Pinning costs more than copying the memory over the link (see
//! [`MemoryResource::PinnedHost`]), so blocks are kept and reused.
//! A block taken from a [`PinnedPool`] is a [`DeviceBuffer`]; when its last view drops (including
//! arrow buffers made from it), the block goes back to the pool.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};

use crate::device::Stream;
use crate::error::{Error, Result};
use crate::memory::DeviceBuffer;
use crate::memory::resource::{Allocation, MemoryResource};

/// The bytes of free blocks a pool keeps by default: half of the machine's physical memory (8 GiB
/// where it is unknown). Blocks freed past the limit must be pinned again when the next large
/// download comes, which costs more than the copy itself: with an 8 GiB limit, GPU table scans that
/// keep 16 partitions of large batches in flight pinned memory over and over, and TPC-H at SF10 ran
/// at half the speed.
fn default_cache_limit() -> usize {
    physical_memory().map_or(8 << 30, |bytes| bytes / 2)
}

/// The machine's physical memory in bytes, where the system says.
pub(crate) fn physical_memory() -> Option<usize> {
    // SAFETY: `sysconf` only reads system configuration.
    let (pages, size) = unsafe { (libc::sysconf(libc::_SC_PHYS_PAGES), libc::sysconf(libc::_SC_PAGESIZE)) };
    match (usize::try_from(pages), usize::try_from(size)) {
        (Ok(pages), Ok(size)) if pages > 0 && size > 0 => Some(pages.saturating_mul(size)),
        _ => None,
    }
}

/// A cache of pinned host blocks of one kind (plain or write-combined) for one device.
#[derive(Debug)]
pub struct PinnedPool {
    resource: MemoryResource,
    state: Mutex<PoolState>,
}

#[derive(Debug, Default)]
struct PoolState {
    free: HashMap<usize, Vec<Allocation>>,
    cached: usize,
    limit: usize,
}

/// Returns its block to the pool on drop.
struct PooledBlock {
    block: Option<Allocation>,
    pool: Weak<PinnedPool>,
}

impl Drop for PooledBlock {
    fn drop(&mut self) {
        if let (Some(block), Some(pool)) = (self.block.take(), self.pool.upgrade()) {
            pool.put_back(block);
        }
    }
}

impl PinnedPool {
    /// The process-wide pool of `resource` ([`MemoryResource::PinnedHost`] or
    /// [`MemoryResource::WriteCombinedHost`]).
    pub fn shared(resource: MemoryResource) -> Result<Arc<PinnedPool>> {
        static POOLS: OnceLock<Mutex<HashMap<MemoryResource, Arc<PinnedPool>>>> = OnceLock::new();
        if !matches!(
            resource,
            MemoryResource::PinnedHost(_) | MemoryResource::WriteCombinedHost(_)
        ) {
            return Err(Error::InvalidArgument(format!(
                "{resource:?} is not pinned host memory"
            )));
        }
        let mut pools = POOLS
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        Ok(pools
            .entry(resource)
            .or_insert_with(|| Arc::new(PinnedPool::new(resource)))
            .clone())
    }

    /// A new, empty pool of `resource`.
    pub fn new(resource: MemoryResource) -> PinnedPool {
        PinnedPool {
            resource,
            state: Mutex::new(PoolState {
                limit: default_cache_limit(),
                ..Default::default()
            }),
        }
    }

    /// Sets how many bytes of free blocks the pool keeps; blocks beyond it are freed.
    pub fn set_cache_limit(&self, bytes: usize) {
        let mut s = self.lock();
        s.limit = bytes;
        s.trim();
    }

    /// Bytes held in free blocks.
    pub fn cached_bytes(&self) -> usize {
        self.lock().cached
    }

    /// Frees every cached block.
    pub fn trim(&self) {
        let mut s = self.lock();
        s.free.clear();
        s.cached = 0;
    }

    /// A buffer of exactly `len` bytes of pinned memory, from a cached block when one fits. Its
    /// contents are whatever the block held before.
    pub fn take(self: &Arc<Self>, len: usize) -> Result<DeviceBuffer> {
        let class = size_class(len);
        let cached = {
            let mut s = self.lock();
            let block = s.free.get_mut(&class).and_then(Vec::pop);
            if block.is_some() {
                s.cached -= class;
            }
            block
        };
        let block = match cached {
            Some(b) => b,
            None => self.resource.allocate(class, &Stream::cpu())?,
        };
        let (ptr, resource) = (block.ptr(), block.resource());
        let owner = PooledBlock {
            block: Some(block),
            pool: Arc::downgrade(self),
        };
        // SAFETY: the block is `class >= len` bytes of pinned memory of `resource`, kept alive by `owner`.
        let alloc = unsafe { Allocation::owned_by(ptr, class, resource, Box::new(owner)) };
        DeviceBuffer::from_allocation(alloc).slice(0, len)
    }

    fn put_back(&self, block: Allocation) {
        let mut s = self.lock();
        let size = block.size();
        if s.cached + size <= s.limit {
            s.cached += size;
            s.free.entry(size).or_default().push(block);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, PoolState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl PoolState {
    fn trim(&mut self) {
        let mut sizes: Vec<usize> = self.free.keys().copied().collect();
        sizes.sort_unstable_by(|a, b| b.cmp(a));
        for size in sizes {
            while self.cached > self.limit {
                match self.free.get_mut(&size).and_then(Vec::pop) {
                    Some(_) => self.cached -= size,
                    None => break,
                }
            }
        }
    }
}

/// Rounds up to one of eight sizes per power of two (at least 64 KiB), wasting at most 12.5%.
fn size_class(len: usize) -> usize {
    let len = len.max(64 << 10);
    // Steps of an eighth of the power of two at or below `len`.
    let step = (1usize << len.ilog2()) / 8;
    len.div_ceil(step) * step
}

#[cfg(test)]
mod tests {
    use super::{default_cache_limit, size_class};

    #[test]
    fn the_default_cache_is_half_of_physical_memory() {
        let text = std::fs::read_to_string("/proc/meminfo").expect("/proc/meminfo");
        let total_kib: usize = text
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("MemTotal in /proc/meminfo");
        let half = total_kib * 1024 / 2;
        let limit = default_cache_limit();
        // `sysconf` and `/proc/meminfo` count the same pages, up to the kernel's own reservations.
        assert!(limit.abs_diff(half) <= half / 20, "{limit} vs {half}");
    }

    #[test]
    fn size_classes_round_up_by_at_most_an_eighth() {
        assert_eq!(size_class(0), 64 << 10);
        assert_eq!(size_class(1 << 30), 1 << 30);
        assert_eq!(size_class((1 << 30) + 1), (1 << 30) + (1 << 27));
        for len in [65_537usize, 1_000_000, 3 << 20, 123_456_789] {
            let c = size_class(len);
            assert!(c >= len && c - len <= len / 8 + 1, "{len} -> {c}");
        }
    }
}
