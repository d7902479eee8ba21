//! Shared host memory: what stands in for CUDA IPC on the CPU device.
//!
//! [`MemoryResource::SharedHost`](crate::memory::MemoryResource::SharedHost) allocations are `memfd`s, sized
//! with `ftruncate`, mapped `MAP_SHARED` for reading and writing by their creator, then sealed against
//! shrinking, growing and any further write access (`F_SEAL_FUTURE_WRITE`). Their "handle" is the
//! file descriptor plus the size ([`SharedMemHandle`]); it crosses a Unix socket with `SCM_RIGHTS`,
//! and the peer maps it read-only. The seals are what make a region safe to share both ways: a
//! creator that could shrink the file would turn the receiver's reads into `SIGBUS`, and a receiver
//! holding the descriptor can neither `write` it, nor map it writable, nor `mprotect` its mapping
//! writable, nor punch holes in it (the kernel refuses each with `EPERM`), so it cannot change the
//! bytes of the creator's batches under them. Only the creator's own mapping, made before the seal,
//! writes.
//!
//! Every live region, created or opened, is registered by address, so the IPC layer finds the
//! region (and its descriptor) behind any [`DeviceBuffer`] that views it, including buffers
//! received from another process, which can therefore be forwarded without a copy.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::{Arc, LazyLock};

use crate::device::Device;
use crate::error::{Error, Result};
use crate::memory::DeviceBuffer;
use crate::memory::cache::{MappingCache, Region, Registry};
use crate::memory::fence::Fence;

/// One shared region mapped into this process.
pub(crate) struct SharedRegion {
    fd: OwnedFd,
    address: u64,
    size: usize,
    /// `(st_dev, st_ino)` for regions opened from a peer's descriptor (the key of the open cache).
    opened: Option<(u64, u64)>,
}

impl std::fmt::Debug for SharedRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "SharedRegion(fd {}, {} bytes at {:#x})",
            self.fd.as_raw_fd(),
            self.size,
            self.address
        )
    }
}

/// Live regions by start address (created and opened ones).
static REGISTRY: Registry<SharedRegion> = Registry::new();

/// Regions opened from a peer's descriptor, by file identity: the same memfd received twice is
/// mapped once.
static OPENED: LazyLock<MappingCache<(u64, u64), SharedRegion>> = LazyLock::new(MappingCache::new);

fn os_error(what: &str) -> Error {
    Error::io(what, std::io::Error::last_os_error())
}

fn register(region: &Arc<SharedRegion>) {
    REGISTRY.insert(region);
}

impl Region for SharedRegion {
    fn address(&self) -> u64 {
        self.address
    }

    fn size(&self) -> usize {
        self.size
    }
}

impl SharedRegion {
    /// Creates a sealed memfd of `size` bytes (zero-filled) and maps it for reading and writing.
    pub(crate) fn create(size: usize) -> Result<Arc<SharedRegion>> {
        create(size)
    }

    /// A handle for another process: a duplicate of the descriptor, and the size.
    pub(crate) fn handle(&self) -> Result<SharedMemHandle> {
        let fd = self.fd.try_clone().map_err(|e| Error::io("duplicating a memfd", e))?;
        Ok(SharedMemHandle { fd, size: self.size })
    }

    /// The registered region holding `buffer`'s bytes, and the buffer's offset in it.
    pub(crate) fn find(buffer: &DeviceBuffer) -> Option<(Arc<SharedRegion>, usize)> {
        REGISTRY.find(buffer.address(), buffer.len())
    }
}

impl Drop for SharedRegion {
    fn drop(&mut self) {
        REGISTRY.remove(self.address);
        let (address, size) = (self.address, self.size);
        let unmap = move || {
            // SAFETY: the mapping was made by `mmap` with this address and size and is unmapped once;
            // every view of it is gone (they own this region).
            unsafe { libc::munmap(address as *mut libc::c_void, size) };
        };
        match self.opened {
            Some(key) => OPENED.release(&key, unmap),
            None => unmap(),
        }
    }
}

#[cfg(target_os = "linux")]
fn create(size: usize) -> Result<Arc<SharedRegion>> {
    let fd = memfd(size)?;
    let address = map(fd.as_fd(), size, libc::PROT_READ | libc::PROT_WRITE, false)?;
    // From here on the region owns the mapping (and unmaps it if sealing fails).
    let region = SharedRegion {
        fd,
        address,
        size,
        opened: None,
    };
    // Sealed after this mapping is made: it stays writable, and no other one ever is.
    seal(region.fd.as_fd(), SEALS | libc::F_SEAL_FUTURE_WRITE)?;
    let region = Arc::new(region);
    register(&region);
    Ok(region)
}

/// The seals of every shared memfd: its size is fixed, and the seals too.
const SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

/// A new memfd of `size` zero bytes, sealed against shrinking and growing but writable through any
/// mapping: a peer that maps it can read all of it for as long as it is mapped. For memory both
/// ends write (the channel's ring); regions of batches are sealed against writes too.
#[cfg(target_os = "linux")]
pub(crate) fn sealed_memfd(size: usize) -> Result<OwnedFd> {
    let fd = memfd(size)?;
    seal(fd.as_fd(), SEALS)?;
    Ok(fd)
}

/// Adds `seals` to a memfd made by [`memfd`].
#[cfg(target_os = "linux")]
fn seal(fd: BorrowedFd<'_>, seals: libc::c_int) -> Result<()> {
    // SAFETY: a valid memfd created with MFD_ALLOW_SEALING.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
        return Err(os_error("sealing a memfd"));
    }
    Ok(())
}

/// A new memfd of `size` zero bytes that allows sealing, not sealed yet.
#[cfg(target_os = "linux")]
fn memfd(size: usize) -> Result<OwnedFd> {
    if size == 0 {
        return Err(Error::InvalidArgument("a shared region needs at least one byte".into()));
    }
    let name = c"arrow-cuda";
    // SAFETY: a valid NUL-terminated name and flags; the result is checked.
    let raw = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if raw < 0 {
        return Err(os_error("memfd_create"));
    }
    // SAFETY: `raw` is a new descriptor that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let len = libc::off_t::try_from(size).map_err(|_| Error::OutOfMemory {
        device: Device::Cpu,
        requested: size,
    })?;
    // SAFETY: a valid descriptor and length.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), len) } != 0 {
        let e = std::io::Error::last_os_error();
        return Err(match e.raw_os_error() {
            Some(libc::ENOSPC | libc::ENOMEM | libc::EFBIG) => Error::OutOfMemory {
                device: Device::Cpu,
                requested: size,
            },
            _ => Error::io("ftruncate of a memfd", e),
        });
    }
    Ok(fd)
}

#[cfg(not(target_os = "linux"))]
fn create(_size: usize) -> Result<Arc<SharedRegion>> {
    Err(Error::Unsupported("shared host memory (memfd) needs Linux".into()))
}

#[cfg(not(target_os = "linux"))]
pub(crate) fn sealed_memfd(_size: usize) -> Result<OwnedFd> {
    Err(Error::Unsupported("shared host memory (memfd) needs Linux".into()))
}

/// Maps `size` bytes of `fd` shared; the caller unmaps them. With `populate`, every page is
/// faulted in (allocated, for a memfd's pages not yet written) as it is mapped, so that the first
/// writes and reads of the mapping take no page faults (`scripts/probes/first_touch.c`: a first
/// 8 KiB copy into a fresh memfd mapping took 5.1-5.2 µs on an H200 machine, into a populated one
/// 0.8-1.0 µs).
pub(crate) fn map(fd: BorrowedFd<'_>, size: usize, prot: libc::c_int, populate: bool) -> Result<u64> {
    #[cfg(target_os = "linux")]
    let flags = libc::MAP_SHARED | if populate { libc::MAP_POPULATE } else { 0 };
    #[cfg(not(target_os = "linux"))]
    let flags = {
        let _ = populate;
        libc::MAP_SHARED
    };
    // SAFETY: a fresh mapping chosen by the kernel, of a descriptor we hold; the result is checked.
    let p = unsafe { libc::mmap(std::ptr::null_mut(), size, prot, flags, fd.as_raw_fd(), 0) };
    if p == libc::MAP_FAILED {
        return Err(os_error("mmap of shared memory"));
    }
    Ok(p as u64)
}

/// What another process needs to map a shared region: its descriptor and size.
#[derive(Debug)]
pub struct SharedMemHandle {
    fd: OwnedFd,
    size: usize,
}

impl SharedMemHandle {
    /// The handle of the region that holds `buffer` (memory of
    /// [`MemoryResource::SharedHost`](crate::memory::MemoryResource::SharedHost), or a region received from a
    /// peer), and the buffer's offset in it. The handle covers the whole region. The peer can map it
    /// read-only only (the memfd is sealed against writes); still, from this call on downloads of
    /// arrays in the region validate them, as for any memory handed to another process.
    pub fn export(buffer: &DeviceBuffer) -> Result<(SharedMemHandle, usize)> {
        let (region, offset) = SharedRegion::find(buffer).ok_or_else(|| {
            Error::Unsupported(format!(
                "{buffer:?} is not shared memory; allocate it from MemoryResource::SharedHost to send it without a copy"
            ))
        })?;
        let handle = region.handle()?;
        buffer.mark_exported();
        Ok((handle, offset))
    }

    /// A handle from a received descriptor and the size the peer announced.
    pub fn from_fd(fd: OwnedFd, size: usize) -> SharedMemHandle {
        SharedMemHandle { fd, size }
    }

    /// The descriptor.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// The size of the region in bytes.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Maps the region read-only, or returns the mapping this process already has of it. Refused
    /// ([`Error::InvalidData`]) unless the descriptor is a memfd sealed against shrinking whose size
    /// is the announced one.
    pub fn open(self) -> Result<SharedMapping> {
        let region = open(self)?;
        Ok(SharedMapping { region })
    }
}

#[cfg(target_os = "linux")]
fn open(handle: SharedMemHandle) -> Result<Arc<SharedRegion>> {
    let key = check_sealed(handle.fd.as_fd(), handle.size)?;
    OPENED
        .get_or_open(&key, || {
            let address = map(handle.fd.as_fd(), handle.size, libc::PROT_READ, false)?;
            Ok(SharedRegion {
                fd: handle.fd,
                address,
                size: handle.size,
                opened: Some(key),
            })
        })
        .inspect(register)
}

/// Checks that a received descriptor is a memfd sealed against shrinking that holds the announced
/// `size` bytes (so mapping and reading all of them is safe), and returns its identity,
/// `(st_dev, st_ino)`. Anything else is [`Error::InvalidData`].
pub(crate) fn check_sealed(fd: BorrowedFd<'_>, size: usize) -> Result<(u64, u64)> {
    let raw = fd.as_raw_fd();
    // SAFETY: `stat` is plain data; `fstat` fills it for a descriptor we hold.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::fstat(raw, &mut st) } != 0 {
        return Err(os_error("fstat of a received descriptor"));
    }
    if st.st_mode & libc::S_IFMT != libc::S_IFREG {
        return Err(Error::InvalidData("a received region descriptor is not a memfd".into()));
    }
    // SAFETY: F_GET_SEALS only reads the descriptor's seals.
    let seals = unsafe { libc::fcntl(raw, libc::F_GET_SEALS) };
    if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
        return Err(Error::InvalidData(
            "a received region is not a memfd sealed against shrinking".into(),
        ));
    }
    if size == 0 || st.st_size < 0 || st.st_size as u64 != size as u64 {
        return Err(Error::InvalidData(format!(
            "a received region announces {size} bytes but holds {}",
            st.st_size
        )));
    }
    Ok((st.st_dev as u64, st.st_ino as u64))
}

#[cfg(not(target_os = "linux"))]
fn open(_handle: SharedMemHandle) -> Result<Arc<SharedRegion>> {
    Err(Error::Unsupported("shared host memory (memfd) needs Linux".into()))
}

#[cfg(not(target_os = "linux"))]
pub(crate) fn check_sealed(_fd: BorrowedFd<'_>, _size: usize) -> Result<(u64, u64)> {
    Err(Error::Unsupported("shared host memory (memfd) needs Linux".into()))
}

/// A peer's shared region mapped read-only into this process, shared by every open of it here.
#[derive(Clone, Debug)]
pub struct SharedMapping {
    region: Arc<SharedRegion>,
}

impl SharedMapping {
    /// The address of the first byte in this process.
    pub fn address(&self) -> u64 {
        self.region.address
    }

    /// The size in bytes.
    pub fn size(&self) -> usize {
        self.region.size
    }

    /// The number of peers' regions mapped in this process now (a hook for the crate's tests).
    pub(crate) fn open_count() -> usize {
        OPENED.live()
    }

    /// Whether two mappings are the same mapping.
    pub fn same_as(&self, other: &SharedMapping) -> bool {
        Arc::ptr_eq(&self.region, &other.region)
    }

    /// The whole region as a (read-only, CPU) buffer that keeps `owner` alive until its last view
    /// drops, and whose reads check `fence` first, when given. The owner must keep this mapping
    /// alive (hold a clone of it).
    pub(crate) fn buffer(
        &self,
        owner: impl std::any::Any + Send + Sync,
        fence: Option<Arc<dyn Fence>>,
    ) -> DeviceBuffer {
        let (address, size) = (self.address(), self.size());
        // SAFETY: the mapping is valid for `size` bytes while the owner (which holds it) lives, and
        // the CPU device's buffers from foreign memory are never written through safe code.
        unsafe {
            match fence {
                Some(f) => DeviceBuffer::from_raw_parts_fenced(address, size, Device::Cpu, owner, f),
                None => DeviceBuffer::from_raw_parts(address, size, Device::Cpu, owner),
            }
        }
    }
}
