//! A buffer cut into equal slots, each lent as a buffer of its own ([`Slots`]): staging packs many
//! batches into pinned memory at once, from one block pinned in one call rather than one block
//! per batch (pinning calls are serialised in the driver, and threads that pin at once wait on
//! each other).

use std::sync::{Arc, Mutex};

use crate::memory::{Allocation, DeviceBuffer};

/// A buffer cut into slots of `slot` bytes. A slot taken is a [`DeviceBuffer`] that is the only
/// view of its bytes (so it can be written); it goes back when its last view drops.
#[derive(Debug)]
pub(crate) struct Slots {
    block: DeviceBuffer,
    slot: usize,
    free: Mutex<Vec<usize>>,
}

/// Gives its slot back on drop.
struct Lent {
    slots: Arc<Slots>,
    index: usize,
}

impl Drop for Lent {
    fn drop(&mut self) {
        self.slots.lock().push(self.index);
    }
}

impl Slots {
    /// `block` cut into as many slots of `slot` bytes as it holds.
    pub(crate) fn new(block: DeviceBuffer, slot: usize) -> Arc<Slots> {
        let n = block.len().checked_div(slot).unwrap_or(0);
        Arc::new(Slots {
            block,
            slot,
            // Taken from the end: the first slot first.
            free: Mutex::new((0..n).rev().collect()),
        })
    }

    /// `len` bytes of a free slot, when one is free and `len` fits in it.
    pub(crate) fn take(self: &Arc<Self>, len: usize) -> Option<DeviceBuffer> {
        if len > self.slot {
            return None;
        }
        let index = self.lock().pop()?;
        let owner = Lent {
            slots: self.clone(),
            index,
        };
        let address = self.block.address() + (index * self.slot) as u64;
        // SAFETY: slot `index` is `slot >= len` bytes inside the block, which `owner` keeps alive
        // (through `slots`); no other slot overlaps it, and it is lent to nobody else until
        // `owner` drops.
        let alloc = unsafe { Allocation::owned_by(address, len, self.block.resource(), Box::new(owner)) };
        Some(DeviceBuffer::from_allocation(alloc))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<usize>> {
        self.free.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Stream;
    use crate::memory::MemoryResource;

    /// Slots are lent while they live, each writable and apart from the others; one that does
    /// not fit gets none.
    #[test]
    fn slots_are_lent_until_they_drop() {
        let block = DeviceBuffer::alloc(MemoryResource::Host, 4 * 100 + 7, &Stream::cpu()).unwrap();
        let slots = Slots::new(block, 100);
        assert!(slots.take(101).is_none(), "larger than a slot");
        let mut all: Vec<DeviceBuffer> = (0..4).map(|_| slots.take(100).expect("free")).collect();
        assert!(slots.take(1).is_none(), "all lent");
        for (i, b) in all.iter_mut().enumerate() {
            b.host_slice_mut().expect("writable").fill(i as u8);
        }
        for (i, b) in all.iter().enumerate() {
            assert!(b.host_slice().unwrap().iter().all(|&v| v == i as u8), "slot {i}");
        }
        let one = all.pop().unwrap();
        let view = one.slice(10, 5).unwrap();
        drop(one);
        assert!(slots.take(1).is_none(), "a view keeps its slot");
        drop(view);
        assert_eq!(slots.take(3).expect("given back").len(), 3);
    }
}
