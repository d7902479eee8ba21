//! The driver itself and its devices: initialisation, counts, versions, UUIDs, default memory pools.

use cudarc::driver::sys::{CUdevice, CUmemPool_attribute, CUmemoryPool, CUuuid};

/// The size of a device UUID (`CUuuid`).
const UUID_BYTES: usize = 16;

driver_calls! {
    /// Initialises the driver (`cuInit`); repeated calls are cheap.
    ///
    /// # Safety
    /// The driver library is loaded (`is_culib_present` returned true).
    pub(super) unsafe fn init() -> () = cuInit {
        // SAFETY: flags must be 0; the library is loaded (caller).
        unsafe { cuInit(0) }.result()
    }

    /// The number of visible CUDA devices.
    ///
    /// # Safety
    /// The driver is initialised ([`available`](super::available) returned `Ok`, or `init` did).
    pub(crate) unsafe fn device_count() -> usize = cuDeviceGetCount {
        let mut n = 0;
        // SAFETY: an initialised driver (caller) and a valid out-parameter.
        unsafe { cuDeviceGetCount(&mut n) }.result()?;
        Ok(usize::try_from(n).unwrap_or(0))
    }

    /// The handle of the device with `ordinal` among those this process sees (`cuDeviceGet`).
    ///
    /// # Safety
    /// The driver is initialised ([`available`](super::available) returned `Ok`).
    pub(crate) unsafe fn device_get(ordinal: usize) -> CUdevice = cuDeviceGet {
        // An ordinal past `c_int` names no device: the driver says so (CUDA_ERROR_INVALID_DEVICE).
        let ordinal = i32::try_from(ordinal).unwrap_or(-1);
        let mut device = 0;
        // SAFETY: an initialised driver (caller) and a valid out-parameter; the driver checks the
        // ordinal.
        unsafe { cuDeviceGet(&mut device, ordinal) }.result()?;
        Ok(device)
    }

    /// The 16-byte UUID of `device` (`cuDeviceGetUuid_v2`): the same in every process, whatever
    /// ordinal `CUDA_VISIBLE_DEVICES` gives the device there (a MIG instance has a UUID of its own).
    ///
    /// # Safety
    /// `device` is a device handle of the initialised driver ([`device_get`]).
    pub(crate) unsafe fn device_uuid(device: CUdevice) -> [u8; UUID_BYTES] = cuDeviceGetUuid_v2 {
        let mut uuid = CUuuid { bytes: [0; UUID_BYTES] };
        // SAFETY: a valid device (caller) and a valid out-parameter.
        unsafe { cuDeviceGetUuid_v2(&mut uuid, device) }.result()?;
        Ok(uuid.bytes.map(|c| c as u8))
    }

    /// The CUDA version the driver supports, as `1000 * major + 10 * minor`.
    ///
    /// # Safety
    /// The driver library is loaded ([`available`](super::available) returned `Ok`).
    pub(crate) unsafe fn driver_version() -> i32 = cuDriverGetVersion {
        let mut v = 0;
        // SAFETY: a loaded driver (caller) and a valid out-parameter.
        unsafe { cuDriverGetVersion(&mut v) }.result()?;
        Ok(v)
    }

    /// The default stream-ordered memory pool of `device`.
    ///
    /// # Safety
    /// `device` is a device handle of the initialised driver (`CudaContext::cu_device`).
    pub(crate) unsafe fn default_mem_pool(device: CUdevice) -> CUmemoryPool = cuDeviceGetDefaultMemPool {
        let mut pool = std::ptr::null_mut();
        // SAFETY: a valid device (caller) and a valid out-parameter.
        unsafe { cuDeviceGetDefaultMemPool(&mut pool, device) }.result()?;
        Ok(pool)
    }

    /// Sets how many bytes `pool` keeps reserved after synchronisations before it returns memory to
    /// the driver (`CU_MEMPOOL_ATTR_RELEASE_THRESHOLD`).
    ///
    /// # Safety
    /// `pool` is a live memory pool (a device's default pool).
    pub(crate) unsafe fn mem_pool_set_release_threshold(pool: CUmemoryPool, bytes: u64) -> () = cuMemPoolSetAttribute {
        let mut threshold = bytes;
        // SAFETY: a live pool (caller); the release-threshold attribute takes a pointer to a
        // `cuuint64_t`, which lives for the call.
        unsafe {
            cuMemPoolSetAttribute(
                pool,
                CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut threshold as *mut u64).cast(),
            )
        }
        .result()
    }

    /// The bytes `pool` keeps without having handed them out: memory freed into it and not yet
    /// returned to the driver (`CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT` less
    /// `CU_MEMPOOL_ATTR_USED_MEM_CURRENT`).
    ///
    /// # Safety
    /// `pool` is a live memory pool (a device's default pool).
    #[cfg_attr(not(feature = "datafusion"), allow(dead_code))]
    pub(crate) unsafe fn mem_pool_idle_bytes(pool: CUmemoryPool) -> u64 = cuMemPoolGetAttribute {
        let get = |attribute| {
            let mut value = 0u64;
            // SAFETY: a live pool (caller); both attributes write a `cuuint64_t` through the pointer,
            // which lives for the call.
            unsafe { cuMemPoolGetAttribute(pool, attribute, (&mut value as *mut u64).cast()) }
                .result()
                .map(|()| value)
        };
        let reserved = get(CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?;
        let used = get(CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?;
        Ok(reserved.saturating_sub(used))
    }
}
