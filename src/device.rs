//! Devices, CUDA contexts, streams and events.
//!
//! The CPU is a device like any other: every layer above this one runs the same code on
//! [`Device::Cpu`] (with `memcpy` for copies) and on CUDA devices. A machine without a CUDA driver or
//! GPU gets an [`Error`] from every CUDA entry point, never a panic: the driver library and every
//! entry point the crate calls are probed (by `crate::driver`) before cudarc touches them (cudarc
//! panics when a library or symbol is missing).

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{CudaContext, CudaEvent, CudaStream};

use crate::abi::DeviceType;
use crate::driver::{self, CUdevice_attribute, CUstream};
use crate::error::{Error, Result};

/// A place where Arrow buffers can live, named as the C Device Data Interface names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Device {
    /// Ordinary host memory (`ARROW_DEVICE_CPU`).
    Cpu,
    /// Memory of the CUDA device with this ordinal (`ARROW_DEVICE_CUDA`).
    Cuda(usize),
    /// Page-locked host memory registered with the CUDA driver of this device (`ARROW_DEVICE_CUDA_HOST`).
    CudaHost(usize),
    /// CUDA managed (unified) memory of this device (`ARROW_DEVICE_CUDA_MANAGED`).
    CudaManaged(usize),
}

impl Device {
    /// The C Device Data Interface device type.
    pub fn device_type(self) -> DeviceType {
        match self {
            Device::Cpu => DeviceType::CPU,
            Device::Cuda(_) => DeviceType::CUDA,
            Device::CudaHost(_) => DeviceType::CUDA_HOST,
            Device::CudaManaged(_) => DeviceType::CUDA_MANAGED,
        }
    }

    /// The C Device Data Interface device id: -1 for the CPU, the CUDA ordinal otherwise.
    pub fn device_id(self) -> i64 {
        self.ordinal().map_or(-1, |o| o as i64)
    }

    /// The device named by a C Device Data Interface type and id, if this crate can serve it.
    pub fn from_c(device_type: DeviceType, device_id: i64) -> Result<Device> {
        let ordinal = || {
            usize::try_from(device_id)
                .map_err(|_| Error::InvalidData(format!("device id {device_id} is not a CUDA ordinal")))
        };
        match device_type {
            DeviceType::CPU if device_id == -1 || device_id == 0 => Ok(Device::Cpu),
            DeviceType::CPU => Err(Error::InvalidData(format!(
                "CPU device id must be -1 or 0, got {device_id}"
            ))),
            DeviceType::CUDA => Ok(Device::Cuda(ordinal()?)),
            DeviceType::CUDA_HOST => Ok(Device::CudaHost(ordinal()?)),
            DeviceType::CUDA_MANAGED => Ok(Device::CudaManaged(ordinal()?)),
            other => Err(Error::Unsupported(format!("device type {other} (id {device_id})"))),
        }
    }

    /// The CUDA ordinal, or `None` for the CPU.
    pub fn ordinal(self) -> Option<usize> {
        match self {
            Device::Cpu => None,
            Device::Cuda(o) | Device::CudaHost(o) | Device::CudaManaged(o) => Some(o),
        }
    }

    /// Whether the CPU can read and write this memory directly.
    pub fn is_host_accessible(self) -> bool {
        !matches!(self, Device::Cuda(_))
    }

    /// The CUDA context that serves this device, or `None` for the CPU.
    pub fn context(self) -> Result<Option<Arc<CudaContext>>> {
        self.ordinal().map(context).transpose()
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(o) => write!(f, "cuda:{o}"),
            Device::CudaHost(o) => write!(f, "cuda_host:{o}"),
            Device::CudaManaged(o) => write!(f, "cuda_managed:{o}"),
        }
    }
}

/// Whether a CUDA driver and at least one GPU are usable.
pub fn cuda_available() -> bool {
    driver::available().is_ok()
}

/// The number of visible CUDA devices (an error when there is no driver or no GPU).
pub fn cuda_device_count() -> Result<usize> {
    driver::available()?;
    // SAFETY: the driver is loaded and initialised (probed above).
    unsafe { driver::device_count() }
}

/// The CUDA version the driver supports, as (major, minor): (13, 0) for a CUDA 13.0 driver.
pub fn driver_version() -> Result<(i32, i32)> {
    driver::available()?;
    // SAFETY: the driver is loaded (probed above).
    let v = unsafe { driver::driver_version() }?;
    Ok((v / 1000, (v % 1000) / 10))
}

/// The 16-byte UUID of a CUDA device (`cuDeviceGetUuid`). Unlike its ordinal, which depends on the
/// `CUDA_VISIBLE_DEVICES` of each process, it names the same device in every process of the
/// machine: it is how processes that exchange device memory agree on a device.
///
/// Shown as `nvidia-smi -L` shows a GPU's (`GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`), the form
/// `CUDA_VISIBLE_DEVICES` accepts too. (The driver gives a MIG instance a UUID of its own, which
/// `nvidia-smi` writes with `MIG-` instead.)
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct DeviceUuid(pub [u8; 16]);

impl DeviceUuid {
    /// The UUID of CUDA device `ordinal` of this process.
    pub fn of(ordinal: usize) -> Result<DeviceUuid> {
        let uuids = cuda_device_uuids()?;
        uuids.get(ordinal).copied().ok_or_else(|| {
            Error::InvalidArgument(format!(
                "CUDA device {ordinal} does not exist ({} visible)",
                uuids.len()
            ))
        })
    }

    /// The ordinal, in this process, of the CUDA device with this UUID: [`Error::UnknownDevice`]
    /// when this process sees no such device (another `CUDA_VISIBLE_DEVICES`, another machine, or no
    /// GPU at all).
    pub fn ordinal(&self) -> Result<usize> {
        let uuids = cuda_device_uuids().map_err(|e| Error::UnknownDevice {
            uuid: *self,
            reason: e.to_string(),
        })?;
        uuids
            .iter()
            .position(|u| u == self)
            .ok_or_else(|| Error::UnknownDevice {
                uuid: *self,
                reason: match uuids.len() {
                    1 => format!("the one device it sees is {}", uuids[0]),
                    n => format!(
                        "the {n} devices it sees are {}",
                        uuids.iter().map(|u| u.to_string()).collect::<Vec<_>>().join(", ")
                    ),
                },
            })
    }
}

impl fmt::Display for DeviceUuid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "GPU-")?;
        for (i, b) in self.0.iter().enumerate() {
            if matches!(i, 4 | 6 | 8 | 10) {
                write!(f, "-")?;
            }
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for DeviceUuid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DeviceUuid({self})")
    }
}

/// The UUID of every CUDA device this process sees, by ordinal; read once (the devices a process
/// sees do not change while it runs).
fn cuda_device_uuids() -> Result<&'static [DeviceUuid]> {
    static UUIDS: OnceLock<Vec<DeviceUuid>> = OnceLock::new();
    if let Some(uuids) = UUIDS.get() {
        return Ok(uuids);
    }
    let uuids = (0..cuda_device_count()?)
        .map(|ordinal| {
            // SAFETY: the driver is initialised (`cuda_device_count` probed it) and the ordinal is
            // one it counts.
            let device = unsafe { driver::device_get(ordinal) }?;
            // SAFETY: a device handle the driver just gave.
            unsafe { driver::device_uuid(device) }.map(DeviceUuid)
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(UUIDS.get_or_init(|| uuids))
}

/// The primary context of a CUDA device, retained once per process.
pub fn context(ordinal: usize) -> Result<Arc<CudaContext>> {
    static CONTEXTS: OnceLock<Mutex<HashMap<usize, Arc<CudaContext>>>> = OnceLock::new();
    let count = cuda_device_count()?;
    if ordinal >= count {
        return Err(Error::InvalidArgument(format!(
            "CUDA device {ordinal} does not exist ({count} visible)"
        )));
    }
    let mut map = CONTEXTS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    if let Some(ctx) = map.get(&ordinal) {
        ctx.bind_to_thread().map_err(Error::driver("cuCtxSetCurrent"))?;
        return Ok(ctx.clone());
    }
    let ctx = CudaContext::new(ordinal).map_err(Error::driver("cuDevicePrimaryCtxRetain"))?;
    if ctx.has_async_alloc() {
        keep_pool_memory(&ctx)?;
    }
    map.insert(ordinal, ctx.clone());
    Ok(ctx)
}

/// Lets the device's default memory pool keep memory it has handed out and got back. Its release
/// threshold is 0 by default, so every synchronisation returns freed memory to the driver and the next
/// allocation maps it again: a gigabyte batch paid for that on every upload.
fn keep_pool_memory(ctx: &CudaContext) -> Result<()> {
    // SAFETY: the device handle is valid for the retained context; the pool is the device's own.
    let pool = unsafe { driver::default_mem_pool(ctx.cu_device()) }?;
    // SAFETY: the device's default pool, alive as long as the driver.
    unsafe { driver::mem_pool_set_release_threshold(pool, u64::MAX) }
}

/// The bytes the default memory pool of CUDA device `ordinal` keeps for this process's next
/// stream-ordered allocations: memory freed into it, which [`keep_pool_memory`] stops it from
/// returning to the driver, so that the driver's free memory leaves it out. 0 on a device without
/// memory pools.
// Only staging (the `datafusion` feature) counts it.
#[cfg_attr(not(feature = "datafusion"), allow(dead_code))]
pub(crate) fn pool_idle_memory(ordinal: usize) -> Result<u64> {
    let ctx = context(ordinal)?;
    if !ctx.has_async_alloc() {
        return Ok(0);
    }
    // SAFETY: the device handle is valid for the retained context; the pool is the device's own.
    let pool = unsafe { driver::default_mem_pool(ctx.cu_device()) }?;
    // SAFETY: the device's default pool, alive as long as the driver.
    unsafe { driver::mem_pool_idle_bytes(pool) }
}

/// What the driver reports about one CUDA device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaDeviceInfo {
    /// The device's ordinal.
    pub ordinal: usize,
    /// The marketing name, such as "NVIDIA H200".
    pub name: String,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
    /// Total device memory in bytes.
    pub total_memory: usize,
    /// Free device memory in bytes at the time of the call.
    pub free_memory: usize,
    /// Whether the device supports stream-ordered memory pools (`cuMemAllocAsync`).
    pub memory_pools: bool,
    /// PCI bus id, as `domain:bus:device`.
    pub pci_bus_id: String,
    /// The device's UUID, the same in every process.
    pub uuid: DeviceUuid,
}

/// Lists the CUDA devices (an error when there is no driver or no GPU).
pub fn cuda_devices() -> Result<Vec<CudaDeviceInfo>> {
    (0..cuda_device_count()?).map(cuda_device_info).collect()
}

fn cuda_device_info(ordinal: usize) -> Result<CudaDeviceInfo> {
    let ctx = context(ordinal)?;
    let attr = |a| ctx.attribute(a).map_err(Error::driver("cuDeviceGetAttribute"));
    let (free_memory, total_memory) = ctx.mem_get_info().map_err(Error::driver("cuMemGetInfo"))?;
    Ok(CudaDeviceInfo {
        ordinal,
        name: ctx.name().map_err(Error::driver("cuDeviceGetName"))?,
        compute_capability: ctx
            .compute_capability()
            .map_err(Error::driver("cuDeviceGetAttribute"))?,
        total_memory,
        free_memory,
        memory_pools: ctx.has_async_alloc(),
        pci_bus_id: format!(
            "{:04x}:{:02x}:{:02x}",
            attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID)?,
            attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID)?,
            attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID)?
        ),
        uuid: DeviceUuid::of(ordinal)?,
    })
}

/// Every device this machine offers: the CPU, then for each GPU its device memory and its
/// pinned host memory.
pub fn devices() -> Vec<Device> {
    let gpus = cuda_device_count().unwrap_or(0);
    std::iter::once(Device::Cpu)
        .chain((0..gpus).flat_map(|o| [Device::Cuda(o), Device::CudaHost(o)]))
        .collect()
}

/// An ordered queue of work on a device. On the CPU, work runs when it is issued.
#[derive(Clone, Debug)]
pub struct Stream {
    inner: StreamInner,
}

#[derive(Clone, Debug)]
enum StreamInner {
    Cpu,
    Cuda(Arc<CudaStream>),
}

impl Stream {
    /// The CPU's stream: work completes before the call that issues it returns.
    pub fn cpu() -> Stream {
        Stream {
            inner: StreamInner::Cpu,
        }
    }

    /// A new non-blocking stream on `device`'s GPU (the CPU stream for [`Device::Cpu`]).
    pub fn new(device: Device) -> Result<Stream> {
        match device.context()? {
            None => Ok(Stream::cpu()),
            Some(ctx) => {
                let s = ctx.new_stream().map_err(Error::driver("cuStreamCreate"))?;
                Ok(Stream {
                    inner: StreamInner::Cuda(s),
                })
            }
        }
    }

    /// The crate's shared stream for `device`, created on first use and kept for the process.
    pub fn shared(device: Device) -> Result<Stream> {
        static STREAMS: OnceLock<Mutex<HashMap<usize, Stream>>> = OnceLock::new();
        let Some(ordinal) = device.ordinal() else {
            return Ok(Stream::cpu());
        };
        let mut map = STREAMS
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some(s) = map.get(&ordinal) {
            return Ok(s.clone());
        }
        let s = Stream::new(Device::Cuda(ordinal))?;
        map.insert(ordinal, s.clone());
        Ok(s)
    }

    /// Wraps a cudarc stream.
    pub fn from_cuda(stream: Arc<CudaStream>) -> Stream {
        Stream {
            inner: StreamInner::Cuda(stream),
        }
    }

    /// The cudarc stream, or `None` for the CPU.
    pub fn cuda(&self) -> Option<&Arc<CudaStream>> {
        match &self.inner {
            StreamInner::Cpu => None,
            StreamInner::Cuda(s) => Some(s),
        }
    }

    /// The device whose work this stream orders.
    pub fn device(&self) -> Device {
        match &self.inner {
            StreamInner::Cpu => Device::Cpu,
            StreamInner::Cuda(s) => Device::Cuda(s.context().ordinal()),
        }
    }

    /// The raw `CUstream` (null for the CPU) with its context bound to the calling thread.
    pub(crate) fn bind(&self) -> Result<CUstream> {
        match &self.inner {
            StreamInner::Cpu => Ok(std::ptr::null_mut()),
            StreamInner::Cuda(s) => {
                s.context().bind_to_thread().map_err(Error::driver("cuCtxSetCurrent"))?;
                Ok(s.cu_stream())
            }
        }
    }

    /// Blocks until all work issued so far has finished.
    pub fn synchronize(&self) -> Result<()> {
        match &self.inner {
            StreamInner::Cpu => Ok(()),
            StreamInner::Cuda(s) => s.synchronize().map_err(Error::driver("cuStreamSynchronize")),
        }
    }

    /// Records an event that completes when all work issued so far has finished.
    pub fn record(&self) -> Result<Event> {
        match &self.inner {
            StreamInner::Cpu => Ok(Event::completed()),
            StreamInner::Cuda(s) => {
                let e = s.record_event(None).map_err(Error::driver("cuEventRecord"))?;
                Ok(Event {
                    inner: EventInner::Cuda(Arc::new(e)),
                })
            }
        }
    }

    /// Makes work issued later on this stream wait for `event`, without blocking the host.
    /// On the CPU stream this blocks until the event completes.
    pub fn wait(&self, event: &Event) -> Result<()> {
        match (&self.inner, &event.inner) {
            (_, EventInner::Completed) => Ok(()),
            (StreamInner::Cpu, EventInner::Cuda(_)) => event.synchronize(),
            (StreamInner::Cuda(s), EventInner::Cuda(e)) => {
                self.bind()?;
                // SAFETY: both handles are alive for the call and the stream's context is bound; a
                // wait across contexts is allowed.
                unsafe { driver::stream_wait_event(s.cu_stream(), e.cu_event()) }
            }
        }
    }
}

/// A point in a stream's work. Completed events (from the CPU) never block.
#[derive(Clone, Debug)]
pub struct Event {
    inner: EventInner,
}

#[derive(Clone, Debug)]
enum EventInner {
    Completed,
    Cuda(Arc<CudaEvent>),
}

impl Event {
    /// An event with nothing to wait for.
    pub fn completed() -> Event {
        Event {
            inner: EventInner::Completed,
        }
    }

    /// Wraps a cudarc event.
    pub fn from_cuda(event: Arc<CudaEvent>) -> Event {
        Event {
            inner: EventInner::Cuda(event),
        }
    }

    /// The cudarc event, or `None` when there is nothing to wait for.
    pub fn cuda(&self) -> Option<&Arc<CudaEvent>> {
        match &self.inner {
            EventInner::Completed => None,
            EventInner::Cuda(e) => Some(e),
        }
    }

    /// Blocks until the event has completed.
    pub fn synchronize(&self) -> Result<()> {
        match &self.inner {
            EventInner::Completed => Ok(()),
            EventInner::Cuda(e) => e.synchronize().map_err(Error::driver("cuEventSynchronize")),
        }
    }

    /// Whether the work before the event has finished.
    pub fn is_complete(&self) -> Result<bool> {
        match &self.inner {
            EventInner::Completed => Ok(true),
            EventInner::Cuda(e) => e.try_is_complete().map_err(Error::driver("cuEventQuery")),
        }
    }
}

/// For the crate's unit tests of CUDA code: device 0, or `None` (printing `skipped: no CUDA
/// device`) on a machine without a GPU; a machine with a GPU whose CUDA is unusable fails the test.
#[cfg(test)]
pub(crate) fn cuda_for_tests() -> Option<Device> {
    match cuda_device_count() {
        Ok(n) if n > 0 => Some(Device::Cuda(0)),
        _ if std::path::Path::new("/dev/nvidia0").exists() => panic!("this machine has a GPU but CUDA is unusable"),
        _ => {
            eprintln!("skipped: no CUDA device");
            None
        }
    }
}

/// For the crate's unit tests: whether they run under compute-sanitizer (the GPU run sets
/// `ARROW_CUDA_SANITIZER`), which reports every failed driver call and runs a stream's work one
/// piece at a time.
#[cfg(test)]
pub(crate) fn under_sanitizer() -> bool {
    std::env::var_os("ARROW_CUDA_SANITIZER").is_some()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_probe_agrees_with_every_entry_point() {
        // On a GPU machine this initialises the driver; without one every entry point fails alike.
        match cuda_device_count() {
            Ok(n) => {
                assert!(n > 0 && cuda_available());
                assert_eq!(cuda_devices().expect("devices").len(), n);
                assert!(driver_version().expect("version").0 >= 12);
                assert_eq!(devices().len(), 1 + 2 * n);
            }
            Err(e) => {
                assert!(!cuda_available());
                assert!(
                    matches!(
                        e,
                        Error::NoDriver { .. } | Error::NoDevice { .. } | Error::DriverTooOld { .. }
                    ),
                    "{e}"
                );
                assert!(context(0).is_err() && driver_version().is_err());
                assert_eq!(devices(), vec![Device::Cpu]);
            }
        }
    }

    #[test]
    fn uuids_show_as_nvidia_smi_shows_them() {
        let uuid = DeviceUuid(std::array::from_fn(|i| (i as u8) * 0x11));
        assert_eq!(uuid.to_string(), "GPU-00112233-4455-6677-8899-aabbccddeeff");
        match cuda_device_count() {
            Ok(n) => {
                let uuids: Vec<_> = (0..n).map(|o| DeviceUuid::of(o).expect("a UUID")).collect();
                for (o, u) in uuids.iter().enumerate() {
                    assert_eq!(u.ordinal().expect("found"), o);
                    assert_eq!(cuda_device_info(o).expect("info").uuid, *u);
                }
                assert!(DeviceUuid::of(n).is_err());
                assert!(!uuids.contains(&uuid));
            }
            Err(_) => assert!(DeviceUuid::of(0).is_err()),
        }
        // Nowhere (almost surely): named, with the reason.
        let e = uuid.ordinal().unwrap_err();
        assert!(matches!(e, Error::UnknownDevice { uuid: u, .. } if u == uuid), "{e}");
        assert!(
            e.to_string().contains("GPU-00112233-4455-6677-8899-aabbccddeeff"),
            "{e}"
        );
    }

    #[test]
    fn c_device_types_round_trip() {
        for d in [
            Device::Cpu,
            Device::Cuda(1),
            Device::CudaHost(0),
            Device::CudaManaged(2),
        ] {
            assert_eq!(Device::from_c(d.device_type(), d.device_id()).unwrap(), d);
        }
        assert_eq!(Device::from_c(DeviceType::CPU, 0).unwrap(), Device::Cpu);
        assert!(Device::from_c(DeviceType::CPU, 3).is_err());
        assert!(Device::from_c(DeviceType::CUDA, -1).is_err());
        assert!(Device::from_c(DeviceType::METAL, 0).is_err());
    }
}
