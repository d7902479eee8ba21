//! CUDA IPC events: ordering work across processes without synchronising a device.
//!
//! The producer records an [`IpcEvent`] on its stream after writing a batch and sends the event's
//! [`IpcEventHandle`] with it; the consumer opens the handle and makes its stream wait on the event
//! before touching the batch. Interprocess events are created with
//! `CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING` (the driver requires both).
//!
//! A wait captures the event's most recent record at the time of the wait, so a producer must not
//! record an event again until every consumer has waited on the previous record (the channel reuses
//! an event only after every receiver acknowledged the batch it was sent with).

use std::fmt;
use std::sync::Arc;

use cudarc::driver::CudaContext;

use crate::device::{self, Device, Stream};
use crate::driver::{self, CUevent};
use crate::error::{Error, Result};
use crate::ipc::handle::HANDLE_BYTES;

/// The 64 bytes of a `CUipcEventHandle`.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct IpcEventHandle(pub [u8; HANDLE_BYTES]);

impl fmt::Debug for IpcEventHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let head: String = self.0[..8].iter().map(|b| format!("{b:02x}")).collect();
        write!(f, "IpcEventHandle({head}..)")
    }
}

/// A CUDA event that other processes can wait on: created here, or opened from a peer's handle.
/// Destroyed when dropped.
pub struct IpcEvent {
    event: CUevent,
    ordinal: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: a CUevent is a driver handle usable from any thread once its context is bound, which every
// method here does first.
unsafe impl Send for IpcEvent {}
// SAFETY: as above; the driver serialises operations on one event.
unsafe impl Sync for IpcEvent {}

impl fmt::Debug for IpcEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IpcEvent({:p} on cuda:{})", self.event, self.ordinal)
    }
}

fn cuda_ordinal(device: Device) -> Result<usize> {
    match device {
        Device::Cuda(o) => Ok(o),
        other => Err(Error::Unsupported(format!(
            "IPC events live on CUDA devices, not {other}"
        ))),
    }
}

impl IpcEvent {
    /// A new interprocess event on `device` (a CUDA device), with nothing recorded.
    pub fn new(device: Device) -> Result<IpcEvent> {
        let ordinal = cuda_ordinal(device)?;
        let ctx = device::context(ordinal)?;
        ctx.bind_to_thread().map_err(Error::driver("cuCtxSetCurrent"))?;
        // SAFETY: the context is bound; the event is destroyed once, by Drop.
        let event = unsafe { driver::event_create_interprocess() }?;
        Ok(IpcEvent { event, ordinal, ctx })
    }

    /// Opens a peer's event on device `ordinal` of this process (`cuIpcOpenEventHandle`): the
    /// device the event was created on, which this process may number differently from the peer
    /// (`CUDA_VISIBLE_DEVICES`). Have the peer send the device's UUID
    /// ([`DeviceUuid::of`](crate::device::DeviceUuid::of)) with the handle and find the ordinal
    /// here with [`DeviceUuid::ordinal`](crate::device::DeviceUuid::ordinal), as the channel does.
    pub fn open(handle: &IpcEventHandle, ordinal: usize) -> Result<IpcEvent> {
        let ctx = device::context(ordinal)?;
        ctx.bind_to_thread().map_err(Error::driver("cuCtxSetCurrent"))?;
        // SAFETY: the context is bound; the driver validates the handle; the event is destroyed
        // once, by Drop.
        let event = unsafe { driver::ipc_open_event_handle(handle.0) }?;
        Ok(IpcEvent { event, ordinal, ctx })
    }

    /// The handle another process opens this event with (`cuIpcGetEventHandle`).
    pub fn handle(&self) -> Result<IpcEventHandle> {
        self.bind()?;
        // SAFETY: a live interprocess event of the bound context.
        let bytes = unsafe { driver::ipc_get_event_handle(self.event) }?;
        Ok(IpcEventHandle(bytes))
    }

    /// The device the event belongs to.
    pub fn device(&self) -> Device {
        Device::Cuda(self.ordinal)
    }

    fn bind(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(Error::driver("cuCtxSetCurrent"))
    }

    /// Records the event on `stream`, a stream of the event's device: it completes when the work
    /// issued to `stream` so far has finished.
    pub fn record(&self, stream: &Stream) -> Result<()> {
        if stream.device() != self.device() {
            return Err(Error::InvalidArgument(format!(
                "an event of {} recorded on a stream of {}",
                self.device(),
                stream.device()
            )));
        }
        let raw = stream.bind()?;
        // SAFETY: a live event and a live stream of the same, bound context.
        unsafe { driver::event_record(self.event, raw) }
    }

    /// Makes work issued later to `stream` wait for the event's last record, without blocking the
    /// host. On the CPU stream this blocks until the event has completed.
    pub fn wait_on(&self, stream: &Stream) -> Result<()> {
        if stream.cuda().is_none() {
            return self.synchronize();
        }
        let raw = stream.bind()?;
        // SAFETY: a live event and a live stream; waiting across contexts is allowed.
        unsafe { driver::stream_wait_event(raw, self.event) }
    }

    /// Blocks until the event's last record has completed.
    pub fn synchronize(&self) -> Result<()> {
        self.bind()?;
        // SAFETY: a live event of the bound context.
        unsafe { driver::event_synchronize(self.event) }
    }
}

impl Drop for IpcEvent {
    fn drop(&mut self) {
        // Errors cannot be reported from Drop; the driver keeps them for the next call.
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: created or opened by this value, destroyed once.
            let _ = unsafe { driver::event_destroy(self.event) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_live_on_cuda_devices() {
        assert!(matches!(IpcEvent::new(Device::Cpu), Err(Error::Unsupported(_))));
    }
}
