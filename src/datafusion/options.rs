//! How a [`GpuTable`](super::GpuTable) is loaded: devices, memory limit, batch size, progress.

use std::fmt;
use std::sync::Arc;

use crate::device::Device;
use crate::transfer::times::StagingTimes;

/// How far a load has come, passed to the callback of [`LoadOptions::with_progress`] each time a
/// device batch's worth of data has been decoded (or gathered) on the host and each time one has
/// been handed to its device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Progress {
    /// Rows staged so far.
    pub rows: u64,
    /// Bytes on the device so far (the host size of the arrays' used ranges, view columns as
    /// staging compacts them): their copy has been issued, and the table is returned only once
    /// every copy has finished.
    pub bytes: u64,
    /// Bytes decoded (from files) or gathered (from batches) on the host so far, counted as
    /// [`Progress::bytes`] is; at least `bytes`, ahead of it while copies wait.
    pub decoded: u64,
    /// Input batches staged so far.
    pub batches: u64,
    /// Rows in the whole load, when known in advance.
    pub total_rows: Option<u64>,
    /// Bytes in the whole load, when known in advance.
    pub total_bytes: Option<u64>,
}

/// A progress callback.
pub type ProgressFn = Arc<dyn Fn(Progress) + Send + Sync>;

/// How a [`GpuTable`](super::GpuTable) is loaded and scanned.
///
/// # Devices
///
/// A table goes to one device unless told otherwise: the first GPU (CUDA device 0), or the CPU
/// device on a machine without one ([`default_device`]). It is spread over several devices only
/// when [`LoadOptions::with_devices`] names them, never over every visible GPU on its own: tables
/// that join must share a device, and a split nobody asked for surprises.
#[derive(Clone, Default)]
pub struct LoadOptions {
    pub(crate) name: Option<String>,
    pub(crate) devices: Option<Vec<Device>>,
    pub(crate) memory_limit: Option<u64>,
    pub(crate) progress: Option<ProgressFn>,
    pub(crate) streams_per_device: Option<usize>,
    pub(crate) partitions: Option<usize>,
    pub(crate) batch_rows: Option<usize>,
    pub(crate) staging_times: Option<Arc<StagingTimes>>,
}

impl fmt::Debug for LoadOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LoadOptions")
            .field("name", &self.name)
            .field("devices", &self.devices)
            .field("memory_limit", &self.memory_limit)
            .field("progress", &self.progress.is_some())
            .field("streams_per_device", &self.streams_per_device)
            .field("partitions", &self.partitions)
            .field("batch_rows", &self.batch_rows)
            .field("staging_times", &self.staging_times)
            .finish()
    }
}

impl LoadOptions {
    /// Default options: the first GPU (the CPU device when there is none; see [`default_device`]),
    /// four streams per device, the input's partitioning, no progress callback, no memory limit
    /// beyond the device's free memory.
    pub fn new() -> Self {
        Self::default()
    }

    /// Names the table in errors (a table that does not fit, say). Loads from files name it by
    /// their path unless given a name.
    pub fn with_name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// Places the table on these devices, partitions round-robin (an empty list means the
    /// default device).
    pub fn with_devices(mut self, devices: impl IntoIterator<Item = Device>) -> Self {
        self.devices = Some(devices.into_iter().collect());
        self
    }

    /// Places the table on one device.
    pub fn with_device(self, device: Device) -> Self {
        self.with_devices([device])
    }

    /// Refuses to stage more than `bytes` on any one device (on top of the device's free memory,
    /// which is always checked for GPUs). A table that does not fit is a
    /// `DataFusionError::ResourcesExhausted` naming the table, the bytes it takes and the bytes free,
    /// and nothing of it stays staged.
    pub fn with_memory_limit(mut self, bytes: u64) -> Self {
        self.memory_limit = Some(bytes);
        self
    }

    /// Calls `f` with the load's [`Progress`] after every device batch decoded and after every one
    /// staged (on the thread that stages, one call at a time).
    pub fn with_progress(mut self, f: impl Fn(Progress) + Send + Sync + 'static) -> Self {
        self.progress = Some(Arc::new(f));
        self
    }

    /// How many batches each device works on at once during scans (default 4), whatever the
    /// number of DataFusion partitions.
    pub fn with_streams_per_device(mut self, n: usize) -> Self {
        self.streams_per_device = Some(n.max(1));
        self
    }

    /// Redistributes the input's batches round-robin into `n` partitions (by default the input's
    /// partitioning is kept).
    pub fn with_partitions(mut self, n: usize) -> Self {
        self.partitions = Some(n.max(1));
        self
    }

    /// Concatenates consecutive input batches of a partition on the host until a device batch
    /// holds about `rows` rows (default [`DEFAULT_BATCH_ROWS`]; a larger input batch stays whole).
    /// Every device batch costs a few kernel launches and synchronisations per scan, so few large
    /// ones scan fastest; `1` keeps the input's batches as they are.
    pub fn with_batch_rows(mut self, rows: usize) -> Self {
        self.batch_rows = Some(rows.max(1));
        self
    }

    /// Counts the wall time of each step of the load (decoding, preparing, packing into pinned
    /// staging, issuing copies, waiting for them, ...) in `times`, summed over the threads that
    /// ran it: to see where a load spends its time. Off by default.
    pub fn with_staging_times(mut self, times: Arc<StagingTimes>) -> Self {
        self.staging_times = Some(times);
        self
    }

    pub(crate) fn devices(&self) -> Vec<Device> {
        match &self.devices {
            Some(d) if !d.is_empty() => d.clone(),
            _ => vec![default_device()],
        }
    }
}

/// The rows a device batch gathers by default (see [`LoadOptions::with_batch_rows`]).
pub const DEFAULT_BATCH_ROWS: usize = 1 << 22;

/// Input batches are also gathered only until they hold this many bytes.
pub(crate) const MAX_GATHERED_BYTES: u64 = 1 << 30;

/// The device a table goes to unless [`LoadOptions::with_devices`] names others: the first GPU,
/// or the CPU device when there is none (or no usable driver).
pub fn default_device() -> Device {
    first_device(crate::device::cuda_device_count().unwrap_or(0))
}

/// The first of `gpus` visible CUDA devices, or the CPU device when there are none.
fn first_device(gpus: usize) -> Device {
    if gpus > 0 { Device::Cuda(0) } else { Device::Cpu }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One device by default, however many GPUs are visible; the CPU device without one.
    #[test]
    fn the_default_is_the_first_gpu() {
        assert_eq!(first_device(0), Device::Cpu);
        assert_eq!(first_device(1), Device::Cuda(0));
        assert_eq!(first_device(8), Device::Cuda(0));
        assert_eq!(LoadOptions::new().devices(), vec![default_device()]);
        assert_eq!(LoadOptions::new().with_devices([]).devices(), vec![default_device()]);
        let two = [Device::Cuda(1), Device::Cuda(0)];
        assert_eq!(LoadOptions::new().with_devices(two).devices(), two);
    }
}
