//! Events and waits on them: the synchronisation that travels with the data.
//!
//! cudarc's `CudaEvent` serves the crate's own events ([`crate::Event`]); these calls serve events
//! that cudarc does not own: interprocess events, and the `sync_event` of arrays other libraries
//! export.

use cudarc::driver::sys::{CUevent, CUevent_flags, CUevent_wait_flags, CUstream};

driver_calls! {
    /// A new event that other processes can open and wait on, with timing disabled
    /// (`cuEventCreate` with `CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING`, both of which the
    /// driver requires of interprocess events).
    ///
    /// # Safety
    /// A context is bound to the calling thread. The event must be destroyed once, with
    /// [`event_destroy`].
    pub(crate) unsafe fn event_create_interprocess() -> CUevent = cuEventCreate {
        let flags = CUevent_flags::CU_EVENT_INTERPROCESS as u32 | CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        let mut event = std::ptr::null_mut();
        // SAFETY: a bound context (caller) and a valid out-parameter.
        unsafe { cuEventCreate(&mut event, flags) }.result()?;
        Ok(event)
    }

    /// Records `event` on `stream`: it completes when the work issued to `stream` so far has
    /// finished (`cuEventRecord`).
    ///
    /// # Safety
    /// A live event and a live stream of the same context, which is bound.
    pub(crate) unsafe fn event_record(event: CUevent, stream: CUstream) -> () = cuEventRecord {
        // SAFETY: as the caller promises.
        unsafe { cuEventRecord(event, stream) }.result()
    }

    /// Blocks until the last record of `event` has completed (`cuEventSynchronize`).
    ///
    /// # Safety
    /// A live event; its context is bound.
    pub(crate) unsafe fn event_synchronize(event: CUevent) -> () = cuEventSynchronize {
        // SAFETY: as the caller promises.
        unsafe { cuEventSynchronize(event) }.result()
    }

    /// Destroys `event` (`cuEventDestroy`).
    ///
    /// # Safety
    /// A live event this code created or opened, destroyed once; its context is bound.
    pub(crate) unsafe fn event_destroy(event: CUevent) -> () = cuEventDestroy_v2 {
        // SAFETY: as the caller promises.
        unsafe { cuEventDestroy_v2(event) }.result()
    }

    /// Makes work issued later to `stream` wait for the last record of `event`, without blocking
    /// the host (`cuStreamWaitEvent`, `CU_EVENT_WAIT_DEFAULT`).
    ///
    /// # Safety
    /// A live stream and a live event (of any context: a wait across contexts is allowed).
    pub(crate) unsafe fn stream_wait_event(stream: CUstream, event: CUevent) -> () = cuStreamWaitEvent {
        let flags = CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT as u32;
        // SAFETY: as the caller promises.
        unsafe { cuStreamWaitEvent(stream, event, flags) }.result()
    }
}
