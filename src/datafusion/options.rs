//! How a [`GpuTable`](super::GpuTable) is loaded: devices, memory limit, batch size, progress.

use std::fmt;
use std::sync::Arc;

use crate::device::Device;

/// How far a load has come, passed to the callback of [`LoadOptions::with_progress`] after every
/// device batch staged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Progress {
    /// Rows staged so far.
    pub rows: u64,
    /// Bytes staged so far (the host size of the arrays' used ranges).
    pub bytes: u64,
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
#[derive(Clone, Default)]
pub struct LoadOptions {
    pub(crate) devices: Option<Vec<Device>>,
    pub(crate) memory_limit: Option<u64>,
    pub(crate) progress: Option<ProgressFn>,
    pub(crate) streams_per_device: Option<usize>,
    pub(crate) partitions: Option<usize>,
    pub(crate) batch_rows: Option<usize>,
}

impl fmt::Debug for LoadOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LoadOptions")
            .field("devices", &self.devices)
            .field("memory_limit", &self.memory_limit)
            .field("progress", &self.progress.is_some())
            .field("streams_per_device", &self.streams_per_device)
            .field("partitions", &self.partitions)
            .field("batch_rows", &self.batch_rows)
            .finish()
    }
}

impl LoadOptions {
    /// Default options: every visible GPU (the CPU device when there is none), four streams per
    /// device, the input's partitioning, no progress callback, no memory limit beyond the
    /// devices' free memory.
    pub fn new() -> Self {
        Self::default()
    }

    /// Places the table on these devices, partitions round-robin.
    pub fn with_devices(mut self, devices: impl IntoIterator<Item = Device>) -> Self {
        self.devices = Some(devices.into_iter().collect());
        self
    }

    /// Places the table on one device.
    pub fn with_device(self, device: Device) -> Self {
        self.with_devices([device])
    }

    /// Refuses to stage more than `bytes` on any one device (on top of the device's free memory,
    /// which is always checked for GPUs).
    pub fn with_memory_limit(mut self, bytes: u64) -> Self {
        self.memory_limit = Some(bytes);
        self
    }

    /// Calls `f` after every device batch staged.
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

    pub(crate) fn devices(&self) -> Vec<Device> {
        match &self.devices {
            Some(d) if !d.is_empty() => d.clone(),
            _ => default_devices(),
        }
    }
}

/// The rows a device batch gathers by default (see [`LoadOptions::with_batch_rows`]).
pub const DEFAULT_BATCH_ROWS: usize = 1 << 22;

/// Input batches are also gathered only until they hold this many bytes.
pub(crate) const MAX_GATHERED_BYTES: u64 = 1 << 30;

/// Every visible CUDA device, or the CPU device when there is no GPU.
pub fn default_devices() -> Vec<Device> {
    match crate::device::cuda_device_count() {
        Ok(n) if n > 0 => (0..n).map(Device::Cuda).collect(),
        _ => vec![Device::Cpu],
    }
}
