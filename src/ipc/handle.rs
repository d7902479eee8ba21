//! CUDA IPC memory handles: export a device allocation, open a peer's allocation.
//!
//! A `CUipcMemHandle` names a whole base allocation (`cuMemAlloc`), never a range of it, so what
//! crosses a process boundary is always `(handle, offset, length)`. Stream-ordered pool memory
//! (`cuMemAllocAsync`) cannot be exported (`CUDA_ERROR_INVALID_VALUE`): only
//! [`MemoryResource::Device`] memory can.
//!
//! Opening a handle costs about 49 µs and closing it about 26 µs (H200), so opened mappings are
//! cached per process by handle, shared through `Arc` and held weakly: opening a handle that is
//! already open returns the same mapping, and the mapping is closed (`cuIpcCloseMemHandle`) when its
//! last user drops it (the driver counts opens of one handle too). The exporter must not free
//! memory that another process still has open (CUDA leaves that undefined): the channel
//! ([`crate::ipc::Sender`]) keeps lent memory until the receiver has closed its mapping.

use std::fmt;
use std::sync::{Arc, LazyLock};

use cudarc::driver::CudaContext;

use crate::device::{self, Device};
use crate::driver;
use crate::error::{Error, Result};
use crate::memory::cache::MappingCache;
use crate::memory::fence::Fence;
use crate::memory::{DeviceBuffer, MemoryResource};

/// The size of a `CUipcMemHandle` (and of a `CUipcEventHandle`).
pub const HANDLE_BYTES: usize = driver::IPC_HANDLE_BYTES;

/// A CUDA IPC memory handle with the size of the allocation it names: Arrow C++'s
/// `CudaIpcMemHandle`.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct IpcMemHandle {
    size: usize,
    bytes: [u8; HANDLE_BYTES],
}

impl fmt::Debug for IpcMemHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let head: String = self.bytes[..8].iter().map(|b| format!("{b:02x}")).collect();
        write!(f, "IpcMemHandle({} bytes, {head}..)", self.size)
    }
}

impl IpcMemHandle {
    /// The length of [`IpcMemHandle::serialize`]'s output.
    pub const SERIALIZED_LEN: usize = 8 + HANDLE_BYTES;

    /// A handle from its parts (a size and the 64 bytes of a `CUipcMemHandle`).
    pub fn from_parts(size: usize, bytes: [u8; HANDLE_BYTES]) -> IpcMemHandle {
        IpcMemHandle { size, bytes }
    }

    /// Exports the base allocation that `buffer` views (`cuIpcGetMemHandle`). The handle covers the
    /// whole allocation: the buffer is the range `buffer.offset()..buffer.offset() + buffer.len()`
    /// of it. Only [`MemoryResource::Device`] memory can be exported ([`Error::Unsupported`]
    /// otherwise).
    pub fn export(buffer: &DeviceBuffer) -> Result<IpcMemHandle> {
        let ordinal = match buffer.resource() {
            MemoryResource::Device(o) => o,
            MemoryResource::DevicePool(_) => {
                return Err(Error::Unsupported(
                    "stream-ordered pool memory cannot be exported through CUDA IPC \
                     (cuIpcGetMemHandle rejects it); allocate from MemoryResource::Device"
                        .into(),
                ));
            }
            MemoryResource::SharedDevice(_) => {
                return Err(Error::Unsupported(
                    "shared device memory travels by file descriptor (SharedDeviceHandle::export), \
                     not through CUDA IPC"
                        .into(),
                ));
            }
            other => {
                return Err(Error::Unsupported(format!(
                    "{other:?} memory cannot be exported through CUDA IPC; allocate from MemoryResource::Device"
                )));
            }
        };
        let size = buffer.parent().map_or(buffer.len(), |p| p.len());
        if size == 0 {
            return Err(Error::Unsupported("an empty allocation has no CUDA IPC handle".into()));
        }
        let base = buffer.address() - buffer.offset() as u64;
        // One handle per allocation: peers cache their mappings by handle.
        let bytes = buffer.ipc_handle(|| {
            let ctx = device::context(ordinal)?;
            ctx.bind_to_thread().map_err(Error::driver("cuCtxSetCurrent"))?;
            // SAFETY: `base` is the start of a live cuMemAlloc allocation of this context (the
            // buffer holds it), which is bound.
            unsafe { driver::ipc_get_mem_handle(base) }
        })?;
        Ok(IpcMemHandle { size, bytes })
    }

    /// The size of the allocation in bytes.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The 64 bytes of the `CUipcMemHandle`.
    pub fn bytes(&self) -> &[u8; HANDLE_BYTES] {
        &self.bytes
    }

    /// The handle as Arrow C++ serializes a `CudaIpcMemHandle`: the size as a little-endian `int64`,
    /// then the 64 handle bytes.
    pub fn serialize(&self) -> [u8; Self::SERIALIZED_LEN] {
        let mut out = [0u8; Self::SERIALIZED_LEN];
        out[..8].copy_from_slice(&(self.size as i64).to_le_bytes());
        out[8..].copy_from_slice(&self.bytes);
        out
    }

    /// Reads [`IpcMemHandle::serialize`]'s form: [`Error::InvalidData`] for a wrong length or a
    /// negative size.
    pub fn deserialize(bytes: &[u8]) -> Result<IpcMemHandle> {
        if bytes.len() != Self::SERIALIZED_LEN {
            return Err(Error::InvalidData(format!(
                "a serialized CUDA IPC handle has {} bytes, not {}",
                bytes.len(),
                Self::SERIALIZED_LEN
            )));
        }
        let size = i64::from_le_bytes(bytes[..8].try_into().expect("8 bytes"));
        let size = usize::try_from(size)
            .map_err(|_| Error::InvalidData(format!("a serialized CUDA IPC handle has size {size}")))?;
        let mut handle = [0u8; HANDLE_BYTES];
        handle.copy_from_slice(&bytes[8..]);
        Ok(IpcMemHandle { size, bytes: handle })
    }

    /// Opens the allocation in this process on device `ordinal` of this process (`cuIpcOpenMemHandle` with
    /// `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`), or returns the mapping this process already has of the
    /// same handle, whatever ordinal it was opened on. The mapping is closed when the last `Arc`
    /// drops. A handle that announces more bytes than the driver maps is [`Error::InvalidData`].
    ///
    /// The ordinal is this process's number for the exporter's device, which differs from the
    /// exporter's own where the two run with different `CUDA_VISIBLE_DEVICES`: send the device's
    /// UUID ([`DeviceUuid::of`](crate::device::DeviceUuid::of)) with the handle and find the
    /// ordinal here with [`DeviceUuid::ordinal`](crate::device::DeviceUuid::ordinal), as
    /// [`BatchDescriptor`](crate::ipc::BatchDescriptor)s do.
    pub fn open(&self, ordinal: usize) -> Result<Arc<OpenedHandle>> {
        open(self, ordinal)
    }
}

/// Open mappings by handle bytes.
static OPENED: LazyLock<MappingCache<[u8; HANDLE_BYTES], OpenedHandle>> = LazyLock::new(MappingCache::new);

/// Opens a peer's allocation on device `ordinal` (`cuIpcOpenMemHandle` with
/// `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`), or returns the mapping this process already has of the
/// same handle, whatever ordinal it was opened on. The mapping is closed when the last `Arc` drops.
///
/// The size the handle announces is checked against the size of the mapped range the driver
/// reports: a larger claim is [`Error::InvalidData`].
pub(crate) fn open(handle: &IpcMemHandle, ordinal: usize) -> Result<Arc<OpenedHandle>> {
    OPENED.get_or_open(&handle.bytes, || {
        let ctx = device::context(ordinal)?;
        ctx.bind_to_thread().map_err(Error::driver("cuCtxSetCurrent"))?;
        // SAFETY: the context is bound; the driver validates the handle bytes. The mapping is closed
        // once: below on failure, by the OpenedHandle otherwise.
        let address = unsafe { driver::ipc_open_mem_handle(handle.bytes) }?;
        // SAFETY: `address` is a live mapping in the bound context.
        let range = unsafe { driver::mem_get_address_range(address) }.and_then(|(base, mapped)| {
            if base == address && handle.size <= mapped {
                return Ok(());
            }
            Err(Error::InvalidData(format!(
                "a CUDA IPC handle announces {} bytes but maps {mapped} at offset {}",
                handle.size,
                address.wrapping_sub(base)
            )))
        });
        if let Err(e) = range {
            // Closed here rather than by an OpenedHandle's Drop, which would take the lock of the
            // cache that this closure runs under.
            // SAFETY: opened above and never handed out.
            let _ = unsafe { driver::ipc_close_mem_handle(address) };
            return Err(e);
        }
        Ok(OpenedHandle {
            address,
            size: handle.size,
            ordinal,
            bytes: handle.bytes,
            ctx,
        })
    })
}

/// A peer's allocation mapped into this process. Closed (`cuIpcCloseMemHandle`) when dropped.
pub struct OpenedHandle {
    address: u64,
    size: usize,
    ordinal: usize,
    bytes: [u8; HANDLE_BYTES],
    ctx: Arc<CudaContext>,
}

impl fmt::Debug for OpenedHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "OpenedHandle({} bytes at {:#x} on cuda:{})",
            self.size, self.address, self.ordinal
        )
    }
}

impl OpenedHandle {
    /// The device address of the allocation's first byte in this process.
    pub fn address(&self) -> u64 {
        self.address
    }

    /// The size of the allocation in bytes.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The device it was opened on.
    pub fn device(&self) -> Device {
        Device::Cuda(self.ordinal)
    }

    /// The whole allocation as a buffer that keeps the mapping open until its last view drops.
    pub fn buffer(self: &Arc<Self>) -> DeviceBuffer {
        self.buffer_owned_by(self.clone(), None)
    }

    /// The whole allocation as a buffer that keeps `owner` alive until its last view drops, and
    /// whose reads check `fence` first, when given. The owner must keep this mapping open (hold an
    /// `Arc` of it).
    pub(crate) fn buffer_owned_by(
        &self,
        owner: impl std::any::Any + Send + Sync,
        fence: Option<Arc<dyn Fence>>,
    ) -> DeviceBuffer {
        // SAFETY: the mapping is device memory of `size` bytes that stays open while the owner
        // (which holds it) lives; buffers from foreign memory are never written through safe code.
        unsafe {
            match fence {
                Some(f) => DeviceBuffer::from_raw_parts_fenced(self.address, self.size, self.device(), owner, f),
                None => DeviceBuffer::from_raw_parts(self.address, self.size, self.device(), owner),
            }
        }
    }

    /// The number of mappings open in this process now (a test hook: see `crate::ipc::testing`).
    pub(crate) fn open_count() -> usize {
        OPENED.live()
    }
}

impl Drop for OpenedHandle {
    fn drop(&mut self) {
        let (ctx, address) = (&self.ctx, self.address);
        OPENED.release(&self.bytes, || {
            // Errors cannot be reported from Drop; the driver keeps them for the next call.
            if ctx.bind_to_thread().is_ok() {
                // SAFETY: `address` was returned by cuIpcOpenMemHandle and is closed once; every view
                // of it is gone (they own this mapping).
                let _ = unsafe { driver::ipc_close_mem_handle(address) };
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serialized_form_is_size_then_handle() {
        let mut bytes = [0u8; HANDLE_BYTES];
        bytes.iter_mut().enumerate().for_each(|(i, b)| *b = i as u8);
        let h = IpcMemHandle::from_parts(0x0102_0304_0506, bytes);
        let s = h.serialize();
        assert_eq!(s.len(), 72);
        assert_eq!(&s[..8], &0x0102_0304_0506i64.to_le_bytes());
        assert_eq!(&s[8..], &bytes);
        assert_eq!(IpcMemHandle::deserialize(&s).unwrap(), h);
    }

    #[test]
    fn malformed_serialized_handles_are_errors() {
        assert!(matches!(
            IpcMemHandle::deserialize(&[0; 71]),
            Err(Error::InvalidData(_))
        ));
        assert!(matches!(
            IpcMemHandle::deserialize(&[0; 73]),
            Err(Error::InvalidData(_))
        ));
        let mut s = [0u8; 72];
        s[..8].copy_from_slice(&(-5i64).to_le_bytes());
        assert!(matches!(IpcMemHandle::deserialize(&s), Err(Error::InvalidData(_))));
    }

    #[test]
    fn host_memory_is_not_exportable_through_cuda_ipc() {
        let b = DeviceBuffer::alloc(MemoryResource::Host, 64, &crate::device::Stream::cpu()).unwrap();
        assert!(matches!(IpcMemHandle::export(&b), Err(Error::Unsupported(_))));
    }
}
