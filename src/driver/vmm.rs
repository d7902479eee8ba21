//! Shareable device memory through CUDA's virtual memory management (`cuMemCreate`), exported as a
//! POSIX file descriptor: physical memory that lives as long as any process maps it or holds a
//! handle of it, so a process that imported it keeps reading it after the exporter freed it or
//! died (unlike a `cuIpcOpenMemHandle` mapping, whose reads are then undefined).
//!
//! Optional, as batched copies are: its entry points are checked on their own
//! ([`shareable_available`]), and a driver or device without them still serves everything else.

use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::OnceLock;

use cudarc::driver::sys::{
    CUdeviceptr, CUmemAccess_flags, CUmemAccessDesc, CUmemAllocationGranularity_flags, CUmemAllocationHandleType,
    CUmemAllocationProp, CUmemAllocationType, CUmemGenericAllocationHandle, CUmemLocation, CUmemLocationType,
};

/// Allocation properties of pinned device memory on device `ordinal`, exportable as a POSIX file
/// descriptor.
fn properties(ordinal: usize) -> CUmemAllocationProp {
    // SAFETY: a plain C struct for which all zeroes is the default of every field.
    let mut prop: CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes = CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop.location = device_location(ordinal);
    prop
}

fn device_location(ordinal: usize) -> CUmemLocation {
    CUmemLocation {
        type_: CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: ordinal as i32,
    }
}

driver_calls! {
    /// The granularity that sizes and addresses of shareable allocations on device `ordinal` are
    /// multiples of (`cuMemGetAllocationGranularity`, minimum).
    ///
    /// # Safety
    /// [`shareable_available`] returned true for `ordinal`.
    unsafe fn granularity(ordinal: usize) -> usize = cuMemGetAllocationGranularity {
        let prop = properties(ordinal);
        let mut bytes = 0;
        let flag = CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM;
        // SAFETY: valid properties and out-parameter.
        unsafe { cuMemGetAllocationGranularity(&mut bytes, &prop, flag) }.result()?;
        Ok(bytes)
    }

    /// Creates `size` bytes of physical memory on device `ordinal` (`cuMemCreate`).
    ///
    /// # Safety
    /// [`shareable_available`]; `size` is a multiple of the granularity. The handle is released
    /// once, with [`release`].
    unsafe fn create(size: usize, ordinal: usize) -> CUmemGenericAllocationHandle = cuMemCreate {
        let prop = properties(ordinal);
        let mut handle = 0;
        // SAFETY: valid properties and out-parameter.
        unsafe { cuMemCreate(&mut handle, size, &prop, 0) }.result()?;
        Ok(handle)
    }

    /// Releases a handle of physical memory (`cuMemRelease`); the memory is freed once no handle
    /// and no mapping of it is left, in any process.
    ///
    /// # Safety
    /// A live handle, released once.
    unsafe fn release(handle: CUmemGenericAllocationHandle) -> () = cuMemRelease {
        // SAFETY: as the caller promises.
        unsafe { cuMemRelease(handle) }.result()
    }

    /// Reserves `size` bytes of device address space (`cuMemAddressReserve`).
    ///
    /// # Safety
    /// [`shareable_available`]; freed once, with [`address_free`].
    unsafe fn address_reserve(size: usize) -> CUdeviceptr = cuMemAddressReserve {
        let mut ptr = 0;
        // SAFETY: a valid out-parameter; no fixed address asked for.
        unsafe { cuMemAddressReserve(&mut ptr, size, 0, 0, 0) }.result()?;
        Ok(ptr)
    }

    /// Frees reserved address space (`cuMemAddressFree`).
    ///
    /// # Safety
    /// A reservation of exactly `size` bytes with nothing mapped in it, freed once.
    unsafe fn address_free(ptr: CUdeviceptr, size: usize) -> () = cuMemAddressFree {
        // SAFETY: as the caller promises.
        unsafe { cuMemAddressFree(ptr, size) }.result()
    }

    /// Maps `size` bytes of `handle`'s memory at `ptr` (`cuMemMap`).
    ///
    /// # Safety
    /// `ptr..ptr + size` is reserved and unmapped; `handle` is live and holds `size` bytes.
    unsafe fn map(ptr: CUdeviceptr, size: usize, handle: CUmemGenericAllocationHandle) -> () = cuMemMap {
        // SAFETY: as the caller promises.
        unsafe { cuMemMap(ptr, size, 0, handle, 0) }.result()
    }

    /// Unmaps `ptr..ptr + size` (`cuMemUnmap`).
    ///
    /// # Safety
    /// A mapping made by [`map`], unmapped once, that nothing uses any more.
    unsafe fn unmap(ptr: CUdeviceptr, size: usize) -> () = cuMemUnmap {
        // SAFETY: as the caller promises.
        unsafe { cuMemUnmap(ptr, size) }.result()
    }

    /// Lets device `ordinal` read and write the mapping `ptr..ptr + size` (`cuMemSetAccess`).
    ///
    /// # Safety
    /// `ptr..ptr + size` is mapped by [`map`].
    unsafe fn set_access(ptr: CUdeviceptr, size: usize, ordinal: usize) -> () = cuMemSetAccess {
        let desc = CUmemAccessDesc {
            location: device_location(ordinal),
            flags: CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: one valid descriptor; the range is mapped (caller).
        unsafe { cuMemSetAccess(ptr, size, &desc, 1) }.result()
    }

    /// A new file descriptor that another process imports `handle`'s memory with
    /// (`cuMemExportToShareableHandle`).
    ///
    /// # Safety
    /// A live handle made by [`create`].
    unsafe fn export_fd(handle: CUmemGenericAllocationHandle) -> OwnedFd = cuMemExportToShareableHandle {
        let mut fd: std::ffi::c_int = -1;
        let kind = CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        // SAFETY: for a POSIX descriptor the out-parameter is an int.
        unsafe { cuMemExportToShareableHandle((&raw mut fd).cast(), handle, kind, 0) }.result()?;
        // SAFETY: the driver returned a new descriptor that nothing else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// A handle of the memory that a peer's descriptor names (`cuMemImportFromShareableHandle`).
    ///
    /// # Safety
    /// [`shareable_available`]; the handle is released once, with [`release`]. The driver checks
    /// that the descriptor names shareable memory.
    unsafe fn import_fd(fd: BorrowedFd<'_>) -> CUmemGenericAllocationHandle = cuMemImportFromShareableHandle {
        let mut handle = 0;
        let kind = CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        // For a POSIX descriptor the OS handle is the descriptor's number, passed as a pointer.
        let os_handle = fd.as_raw_fd() as isize as *mut std::ffi::c_void;
        // SAFETY: a valid out-parameter; the descriptor is open for the call.
        unsafe { cuMemImportFromShareableHandle(&mut handle, os_handle, kind) }.result()?;
        Ok(handle)
    }
}

/// Whether device `ordinal`'s driver and GPU can make memory that another process imports by file
/// descriptor: the entry points are present (checked once) and the device says it supports virtual
/// memory management and POSIX descriptors (`supports`, asked of its context's attributes).
pub(crate) fn shareable_available(supports: impl FnOnce() -> bool) -> bool {
    static HAS: OnceLock<bool> = OnceLock::new();
    let symbols = *HAS.get_or_init(|| {
        // SAFETY: `available` returning Ok means the driver library is present.
        super::available().is_ok() && SYMBOLS.iter().all(|s| unsafe { super::probe::has_symbol(s) })
    });
    symbols && supports()
}

/// Physical memory of a device mapped into this process's address space: what
/// [`shareable_alloc`] and [`shareable_import`] return. [`shareable_free`] gives it back.
#[derive(Debug)]
pub(crate) struct ShareableMemory {
    /// The address of the first byte.
    pub(crate) ptr: CUdeviceptr,
    /// The mapped size (a multiple of the granularity).
    pub(crate) size: usize,
    /// This process's handle of the physical memory, kept for exports.
    pub(crate) handle: CUmemGenericAllocationHandle,
}

/// Reserves address space for `handle`'s `size` bytes, maps them and lets device `ordinal` read
/// and write them; undoes what it did on an error (the handle stays the caller's).
///
/// # Safety
/// A context of device `ordinal` is bound; `handle` is live and holds `size` bytes, a multiple of
/// the granularity.
unsafe fn map_handle(handle: CUmemGenericAllocationHandle, size: usize, ordinal: usize) -> crate::error::Result<u64> {
    // SAFETY: the caller's contract.
    let ptr = unsafe { address_reserve(size) }?;
    // SAFETY: the range was just reserved, and the handle holds `size` bytes (caller).
    if let Err(e) = unsafe { map(ptr, size, handle) } {
        // SAFETY: the reservation made above, with nothing mapped.
        let _ = unsafe { address_free(ptr, size) };
        return Err(e);
    }
    // SAFETY: mapped above.
    if let Err(e) = unsafe { set_access(ptr, size, ordinal) } {
        // SAFETY: the mapping and reservation made above, unused.
        let _ = unsafe { unmap(ptr, size) };
        // SAFETY: as above.
        let _ = unsafe { address_free(ptr, size) };
        return Err(e);
    }
    Ok(ptr)
}

/// `size` rounded up to the granularity of shareable allocations on device `ordinal`: the size
/// [`shareable_alloc`] maps for it.
///
/// # Safety
/// [`shareable_available`] returned true for `ordinal`.
pub(crate) unsafe fn shareable_size(size: usize, ordinal: usize) -> crate::error::Result<usize> {
    // SAFETY: the caller's contract.
    let grain = unsafe { granularity(ordinal) }?.max(1);
    size.max(1).div_ceil(grain).checked_mul(grain).ok_or_else(|| {
        crate::error::Error::InvalidArgument(format!("{size} bytes of shareable memory overflow the address space"))
    })
}

/// Allocates `size` bytes of shareable memory on device `ordinal`, mapped here.
///
/// # Safety
/// [`shareable_available`] returned true for `ordinal`, whose context is bound; `size` is a
/// [`shareable_size`]. The memory is given back once, with [`shareable_free`].
pub(crate) unsafe fn shareable_alloc(size: usize, ordinal: usize) -> crate::error::Result<ShareableMemory> {
    // SAFETY: `size` is a multiple of the granularity (caller).
    let handle = unsafe { create(size, ordinal) }?;
    // SAFETY: a context of `ordinal` is bound (caller); the handle holds `size` bytes.
    match unsafe { map_handle(handle, size, ordinal) } {
        Ok(ptr) => Ok(ShareableMemory { ptr, size, handle }),
        Err(e) => {
            // SAFETY: created above and not mapped.
            let _ = unsafe { release(handle) };
            Err(e)
        }
    }
}

/// Maps the shareable memory that a peer's descriptor names, which must hold `size` bytes, on
/// device `ordinal`.
///
/// # Safety
/// As for [`shareable_alloc`]. The driver checks the descriptor; the size is checked against the
/// mapping (a descriptor of less memory than announced fails to map).
pub(crate) unsafe fn shareable_import(
    fd: BorrowedFd<'_>,
    size: usize,
    ordinal: usize,
) -> crate::error::Result<ShareableMemory> {
    // SAFETY: the caller's contract.
    let handle = unsafe { import_fd(fd) }?;
    // SAFETY: a context of `ordinal` is bound (caller). A handle of less than `size` bytes makes
    // cuMemMap fail (it maps `size` bytes from offset 0 of the handle's memory).
    match unsafe { map_handle(handle, size, ordinal) } {
        Ok(ptr) => Ok(ShareableMemory { ptr, size, handle }),
        Err(e) => {
            // SAFETY: imported above and not mapped.
            let _ = unsafe { release(handle) };
            Err(e)
        }
    }
}

/// A new descriptor for another process to import `memory` with.
///
/// # Safety
/// `memory` is live (not yet given to [`shareable_free`]).
pub(crate) unsafe fn shareable_export(memory: &ShareableMemory) -> crate::error::Result<OwnedFd> {
    // SAFETY: a live handle (caller).
    unsafe { export_fd(memory.handle) }
}

/// Unmaps `memory` and releases this process's handle of it; the physical memory goes once no
/// other process maps it either.
///
/// # Safety
/// A context of its device is bound; nothing uses the mapping any more; called once.
pub(crate) unsafe fn shareable_free(memory: &ShareableMemory) -> crate::error::Result<()> {
    // SAFETY: the caller's contract.
    unsafe { unmap(memory.ptr, memory.size) }?;
    // SAFETY: unmapped above.
    unsafe { address_free(memory.ptr, memory.size) }?;
    // SAFETY: the handle is live and released once (caller).
    unsafe { release(memory.handle) }
}
