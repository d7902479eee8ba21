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
use std::sync::{Arc, Mutex, PoisonError};

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

/// The interprocess events of this process whose handles were taken, with their device ordinals:
/// `cuIpcOpenEventHandle` refuses a handle in the process that made it, so a receiver there finds
/// the event here. An event leaves the list, under its lock, before it is destroyed.
static LOCAL: Mutex<Vec<([u8; HANDLE_BYTES], usize, usize)>> = Mutex::new(Vec::new());

/// Makes work issued later to `stream` wait for the last record of this process's event whose
/// handle is `handle`; false, waiting for nothing, when there is no such event on the stream's
/// device (it was destroyed, or made elsewhere).
pub(crate) fn wait_local(handle: &IpcEventHandle, stream: &Stream) -> Result<bool> {
    let local = LOCAL.lock().unwrap_or_else(PoisonError::into_inner);
    let found = local
        .iter()
        .find(|(h, ordinal, _)| *h == handle.0 && stream.device() == Device::Cuda(*ordinal));
    let Some(&(_, _, event)) = found else {
        return Ok(false);
    };
    let raw = stream.bind()?;
    // SAFETY: the event is live while it is listed, and the lock is held; a live stream.
    unsafe { driver::stream_wait_event(raw, event as CUevent) }?;
    Ok(true)
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
        let mut local = LOCAL.lock().unwrap_or_else(PoisonError::into_inner);
        if !local.iter().any(|(h, ..)| *h == bytes) {
            local.push((bytes, self.ordinal, self.event as usize));
        }
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
        LOCAL
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|&(_, _, event)| event != self.event as usize);
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

    /// A process finds its own events by their handles (which it cannot open) while they live, on
    /// their own device only.
    #[test]
    fn waits_find_this_processs_events_by_handle() {
        let Some(gpu) = device::cuda_for_tests() else { return };
        let stream = Stream::new(gpu).unwrap();
        let event = IpcEvent::new(gpu).unwrap();
        event.record(&stream).unwrap();
        let handle = event.handle().unwrap();
        // CUDA refuses it (the failing call is left out under compute-sanitizer, which reports it).
        if !device::under_sanitizer() {
            assert!(
                IpcEvent::open(&handle, gpu.ordinal().unwrap()).is_err(),
                "CUDA opened a handle of its own process"
            );
        }
        let other = Stream::new(gpu).unwrap();
        assert!(wait_local(&handle, &other).unwrap());
        assert!(!wait_local(&handle, &Stream::new(Device::Cpu).unwrap()).unwrap());
        drop(event);
        assert!(!wait_local(&handle, &other).unwrap());
        other.synchronize().unwrap();
    }
}
