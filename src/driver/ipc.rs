//! CUDA IPC: handles that let another process map an allocation or wait on an event.
//!
//! Handles cross this module as their 64 raw bytes; the `ipc` layer gives them types.

use std::ffi::c_char;

use cudarc::driver::sys::{CUdeviceptr, CUevent, CUipcEventHandle, CUipcMem_flags, CUipcMemHandle};

/// The size of a `CUipcMemHandle` and of a `CUipcEventHandle`.
pub(crate) const IPC_HANDLE_BYTES: usize = 64;

driver_calls! {
    /// The handle of the allocation that starts at `base` (`cuIpcGetMemHandle`). The driver rejects
    /// stream-ordered pool memory (`CUDA_ERROR_INVALID_VALUE`).
    ///
    /// # Safety
    /// `base` is the start of a live `cuMemAlloc` allocation of the context bound to the calling
    /// thread.
    pub(crate) unsafe fn ipc_get_mem_handle(base: CUdeviceptr) -> [u8; IPC_HANDLE_BYTES] = cuIpcGetMemHandle {
        let mut handle = CUipcMemHandle {
            reserved: [0; IPC_HANDLE_BYTES],
        };
        // SAFETY: a live allocation of the bound context (caller), a valid out-parameter.
        unsafe { cuIpcGetMemHandle(&mut handle, base) }.result()?;
        Ok(handle.reserved.map(|c| c as u8))
    }

    /// Maps another process's allocation into this one (`cuIpcOpenMemHandle` with
    /// `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`) and returns its address here.
    ///
    /// # Safety
    /// A context is bound to the calling thread. The driver validates the handle bytes. The mapping
    /// must be closed once, with [`ipc_close_mem_handle`].
    pub(crate) unsafe fn ipc_open_mem_handle(handle: [u8; IPC_HANDLE_BYTES]) -> CUdeviceptr = cuIpcOpenMemHandle_v2 {
        let raw = CUipcMemHandle {
            reserved: handle.map(|b| b as c_char),
        };
        let flags = CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
        let mut address = 0;
        // SAFETY: a bound context (caller), a valid out-parameter.
        unsafe { cuIpcOpenMemHandle_v2(&mut address, raw, flags) }.result()?;
        Ok(address)
    }

    /// Unmaps an allocation opened by [`ipc_open_mem_handle`] (`cuIpcCloseMemHandle`).
    ///
    /// # Safety
    /// `address` was returned by [`ipc_open_mem_handle`] and is closed once; nothing uses the mapping
    /// any more; its context is bound.
    pub(crate) unsafe fn ipc_close_mem_handle(address: CUdeviceptr) -> () = cuIpcCloseMemHandle {
        // SAFETY: as the caller promises.
        unsafe { cuIpcCloseMemHandle(address) }.result()
    }

    /// The handle another process opens `event` with (`cuIpcGetEventHandle`).
    ///
    /// # Safety
    /// A live interprocess event ([`event_create_interprocess`](super::event_create_interprocess))
    /// of the bound context.
    pub(crate) unsafe fn ipc_get_event_handle(event: CUevent) -> [u8; IPC_HANDLE_BYTES] = cuIpcGetEventHandle {
        let mut raw = CUipcEventHandle {
            reserved: [0; IPC_HANDLE_BYTES],
        };
        // SAFETY: a live interprocess event of the bound context (caller); a valid out-parameter.
        unsafe { cuIpcGetEventHandle(&mut raw, event) }.result()?;
        Ok(raw.reserved.map(|c| c as u8))
    }

    /// Opens another process's interprocess event (`cuIpcOpenEventHandle`).
    ///
    /// # Safety
    /// A context is bound to the calling thread. The driver validates the handle bytes. The event
    /// must be destroyed once, with [`event_destroy`](super::event_destroy).
    pub(crate) unsafe fn ipc_open_event_handle(handle: [u8; IPC_HANDLE_BYTES]) -> CUevent = cuIpcOpenEventHandle {
        let raw = CUipcEventHandle {
            reserved: handle.map(|b| b as c_char),
        };
        let mut event = std::ptr::null_mut();
        // SAFETY: a bound context (caller), a valid out-parameter.
        unsafe { cuIpcOpenEventHandle(&mut event, raw) }.result()?;
        Ok(event)
    }
}
