//! Fences: the check that memory another process lent is still there before anything reads it.
//!
//! A CUDA IPC mapping stays in this process's address space after the process that exported the
//! allocation has freed it (or died, which frees it), and CUDA leaves reads of it undefined. The
//! layer that received the memory knows when its owner let go (the IPC channel: when the sender's
//! end of the connection closed) and attaches a [`Fence`] to the allocation saying so. Every read
//! of the memory through this crate, and every path that hands its address on, calls
//! [`DeviceBuffer::check_readable`](crate::memory::DeviceBuffer::check_readable) (or
//! [`check_all`] for many buffers) first, and fails with the fence's error once the owner is gone.

use std::sync::Arc;

use crate::error::Result;
use crate::memory::DeviceBuffer;

/// Whether memory that another process owns may still be read.
pub(crate) trait Fence: Send + Sync {
    /// `Ok` while the owner keeps the memory; afterwards, an error naming the owner, every time.
    fn check(&self) -> Result<()>;
}

/// Checks every buffer of `buffers` ([`DeviceBuffer::check_readable`]), asking each fence once
/// however many buffers share it (all buffers of one received batch share one).
pub(crate) fn check_all<'a>(buffers: impl IntoIterator<Item = &'a DeviceBuffer>) -> Result<()> {
    let mut checked: Vec<&Arc<dyn Fence>> = Vec::new();
    for fence in buffers.into_iter().filter_map(DeviceBuffer::fence) {
        if !checked.iter().any(|c| Arc::ptr_eq(c, fence)) {
            fence.check()?;
            checked.push(fence);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    use super::*;
    use crate::device::{Device, Stream};
    use crate::error::Error;
    use crate::memory::MemoryResource;

    /// A fence that counts its checks and fails once `gone` is set.
    #[derive(Default)]
    struct Switch {
        gone: AtomicBool,
        checks: AtomicUsize,
    }

    impl Fence for Switch {
        fn check(&self) -> Result<()> {
            self.checks.fetch_add(1, Ordering::SeqCst);
            match self.gone.load(Ordering::SeqCst) {
                false => Ok(()),
                true => Err(Error::Unsupported("the owner is gone".into())),
            }
        }
    }

    #[test]
    fn fenced_memory_fails_its_reads_once_the_owner_is_gone() {
        let stream = Stream::cpu();
        let backing = DeviceBuffer::from_host(&[7; 256], MemoryResource::Host, &stream).unwrap();
        let switch = Arc::new(Switch::default());
        let fence: Arc<dyn Fence> = switch.clone();
        // SAFETY: `backing` is host memory of 256 bytes, kept alive by the owner and never written.
        let fenced =
            unsafe { DeviceBuffer::from_raw_parts_fenced(backing.address(), 256, Device::Cpu, backing.clone(), fence) };
        let (a, b) = (fenced.slice(0, 64).unwrap(), fenced.slice(64, 64).unwrap());
        let plain = DeviceBuffer::from_host(&[1; 64], MemoryResource::Host, &stream).unwrap();
        assert_eq!(a.to_vec(&stream).unwrap(), vec![7; 64]);
        check_all([&a, &plain, &b, &a]).unwrap();
        assert_eq!(
            switch.checks.load(Ordering::SeqCst),
            2,
            "one check per read, one for all views"
        );

        switch.gone.store(true, Ordering::SeqCst);
        let gone = |r: Result<()>| matches!(r, Err(Error::Unsupported(m)) if m.contains("gone"));
        assert!(gone(b.check_readable()));
        assert!(gone(check_all([&plain, &b])));
        assert!(gone(a.to_vec(&stream).map(drop)));
        assert!(gone(a.copy_to(MemoryResource::Host, &stream).map(drop)));
        assert!(gone(a.to_arrow_buffer().map(drop)));
        assert!(gone(a.equals(&plain, &stream).map(drop)));
        assert!(
            a.host_slice().is_none(),
            "no bytes of fenced memory once its owner is gone"
        );
        let mut out = DeviceBuffer::alloc(MemoryResource::Host, 64, &stream).unwrap();
        assert!(gone(out.copy_from(0, &a, &stream)));
        // Unfenced memory and other views of the backing allocation are not affected.
        assert!(plain.check_readable().is_ok() && backing.to_vec(&stream).is_ok());
    }
}
