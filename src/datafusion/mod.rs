//! GPU-resident tables for DataFusion 55: columns live in device memory, and the scan does the
//! projection, the pushed-down filters and the limit on the device, so only the selected rows of
//! the projected columns travel to the host.
//!
//! [`GpuTable`] is a [`TableProvider`] whose partitions are lists of
//! [`DeviceRecordBatch`]es, spread round-robin over the devices it was given (every visible GPU by
//! default, the CPU device when there is none). Its scan is a [`GpuScan`], a
//! [`DataSource`](::datafusion::datasource::source::DataSource) under `DataSourceExec`, the way
//! `MemTable` uses `MemorySourceConfig`.
//!
//! # Filters
//!
//! [`GpuTable::supports_filters_pushdown`](TableProvider::supports_filters_pushdown) answers
//! `Exact` only for predicates the device evaluates completely, and `Unsupported` for everything
//! else (DataFusion keeps those in a `FilterExec`):
//!
//! - comparisons (`= != < <= > >=`) of a column with a literal, `BETWEEN`, `IN` lists and
//!   `IS [NOT] NULL`, over integers, floats (compared as DataFusion compares them: arrow-rs's
//!   total order, so `NaN` equals itself and sorts last, after `-0.0` becomes `+0.0`; `IN` lists
//!   of floats stay with DataFusion, whose `IN` keeps the two zeros apart), `Decimal128`, dates,
//!   timestamps and booleans, and a bare boolean column;
//! - `=`, `!=`, `IN` lists and prefix matches (`LIKE 'abc%'`, `starts_with`) on `Utf8`,
//!   `LargeUtf8` and `Utf8View` columns;
//! - `AND`, `OR` and `NOT` of those.
//!
//! A literal of another type than its column is accepted only when it converts to the column's
//! type and back without change. Null semantics are SQL's: a row is kept only where the predicate
//! is true.
//!
//! On a CUDA device the predicate becomes a CUDA C kernel (generated from the expression tree,
//! compiled once per context with NVRTC and cached), followed by a count, a prefix sum and a
//! compaction of the projected columns on the device (the kernels are listed in
//! `src/datafusion/kernels.rs`). On the CPU device (and on
//! host-accessible memory) the same predicate is evaluated with arrow-rs compute kernels on a host
//! copy of the columns it needs.
//!
//! # What reaches DataFusion
//!
//! Only host [`RecordBatch`]es, made by an explicit device-to-host copy
//! ([`crate::transfer::dtoh`]): DataFusion's metrics read every batch through `to_data()`, so no
//! device memory may ever be wrapped in an arrow buffer that flows through a plan.
//!
//! # Concurrency
//!
//! Each device has a small pool of streams (four by default) guarded by a semaphore: partitions on
//! one device share it whatever DataFusion's `target_partitions` is, and partitions on different
//! devices run concurrently.

mod kernels;
mod predicate;
mod source;
mod stats;

use std::collections::HashMap;
use std::fmt;
use std::path::Path;
use std::sync::{Arc, Mutex};

use ::datafusion::catalog::{Session, TableProvider};
use ::datafusion::common::{DataFusionError, Statistics};
use ::datafusion::datasource::source::DataSourceExec;
use ::datafusion::execution::context::SessionContext;
use ::datafusion::logical_expr::{Expr, TableProviderFilterPushDown, TableType};
use ::datafusion::physical_plan::{ExecutionPlan, SendableRecordBatchStream};
use ::datafusion::prelude::{CsvReadOptions, ParquetReadOptions};
use arrow_array::RecordBatch;
use arrow_schema::SchemaRef;
use async_trait::async_trait;
use futures::StreamExt;
use tokio::sync::Semaphore;

use crate::array::DeviceRecordBatch;
use crate::device::{Device, Stream};
use crate::error::Error;

pub use kernels::gpu_kernels_available;
pub use predicate::supports_filter;
pub use source::GpuScan;

use predicate::Predicate;
use stats::StatsBuilder;

/// Result with DataFusion's error.
type DfResult<T> = ::datafusion::common::Result<T>;

impl From<Error> for DataFusionError {
    /// Allocation failures become [`DataFusionError::ResourcesExhausted`], arrow errors stay arrow
    /// errors, and everything else is [`DataFusionError::External`].
    fn from(e: Error) -> Self {
        match e {
            Error::OutOfMemory { .. } => DataFusionError::ResourcesExhausted(e.to_string()),
            Error::Arrow(e) => DataFusionError::ArrowError(Box::new(e), None),
            other => DataFusionError::External(Box::new(other)),
        }
    }
}

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

/// How a [`GpuTable`] is loaded and scanned.
#[derive(Clone, Default)]
pub struct LoadOptions {
    devices: Option<Vec<Device>>,
    memory_limit: Option<u64>,
    progress: Option<ProgressFn>,
    streams_per_device: Option<usize>,
    partitions: Option<usize>,
    batch_rows: Option<usize>,
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

    fn devices(&self) -> Vec<Device> {
        match &self.devices {
            Some(d) if !d.is_empty() => d.clone(),
            _ => default_devices(),
        }
    }
}

/// The rows a device batch gathers by default (see [`LoadOptions::with_batch_rows`]).
pub const DEFAULT_BATCH_ROWS: usize = 1 << 22;

/// Input batches are also gathered only until they hold this many bytes.
const MAX_GATHERED_BYTES: u64 = 1 << 30;

/// Every visible CUDA device, or the CPU device when there is no GPU.
pub fn default_devices() -> Vec<Device> {
    match crate::device::cuda_device_count() {
        Ok(n) if n > 0 => (0..n).map(Device::Cuda).collect(),
        _ => vec![Device::Cpu],
    }
}

/// A small pool of streams on one device, with a semaphore bounding its concurrent users.
#[derive(Debug)]
pub(crate) struct DeviceLane {
    device: Device,
    permits: Semaphore,
    streams: Mutex<Vec<Stream>>,
}

impl DeviceLane {
    fn new(device: Device, streams: usize) -> Result<Self, Error> {
        let pool = (0..streams)
            .map(|_| Stream::new(device))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(DeviceLane {
            device,
            permits: Semaphore::new(streams),
            streams: Mutex::new(pool),
        })
    }

    /// Waits for a free stream of this device.
    pub(crate) async fn acquire(&self) -> DfResult<StreamLease<'_>> {
        let permit = self
            .permits
            .acquire()
            .await
            .map_err(|e| DataFusionError::Execution(format!("device lane closed: {e}")))?;
        let stream = self.streams.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let stream = match stream {
            Some(s) => s,
            None => Stream::new(self.device)?,
        };
        Ok(StreamLease {
            lane: self,
            stream: Some(stream),
            _permit: permit,
        })
    }
}

/// A stream borrowed from a [`DeviceLane`]; it goes back to the pool when dropped.
pub(crate) struct StreamLease<'a> {
    lane: &'a DeviceLane,
    stream: Option<Stream>,
    _permit: tokio::sync::SemaphorePermit<'a>,
}

impl StreamLease<'_> {
    pub(crate) fn stream(&self) -> &Stream {
        self.stream.as_ref().expect("a lease holds its stream until dropped")
    }
}

impl Drop for StreamLease<'_> {
    fn drop(&mut self) {
        if let Some(s) = self.stream.take() {
            self.lane.streams.lock().unwrap_or_else(|p| p.into_inner()).push(s);
        }
    }
}

/// What a table holds: device batches per partition, where each partition lives, statistics.
#[derive(Debug)]
pub(crate) struct TableData {
    pub(crate) schema: SchemaRef,
    pub(crate) partitions: Vec<Vec<DeviceRecordBatch>>,
    pub(crate) partition_devices: Vec<Device>,
    pub(crate) partition_stats: Vec<Statistics>,
    pub(crate) stats: Statistics,
    pub(crate) lanes: HashMap<Device, Arc<DeviceLane>>,
}

/// A DataFusion table whose columns live in device memory.
///
/// Build it from host batches ([`GpuTable::try_new`]), from any other provider
/// ([`GpuTable::from_provider`]) or from Parquet and CSV files ([`GpuTable::from_parquet`],
/// [`GpuTable::from_csv`]), then register it with `SessionContext::register_table`.
#[derive(Debug, Clone)]
pub struct GpuTable {
    data: Arc<TableData>,
}

impl GpuTable {
    /// Stages `partitions` of host batches (all of `schema`) on the devices of `options`,
    /// partition `i` on device `i % devices`. Checks beforehand that every device has room for its
    /// share and fails with [`DataFusionError::ResourcesExhausted`] when one has not.
    pub fn try_new(schema: SchemaRef, partitions: Vec<Vec<RecordBatch>>, options: &LoadOptions) -> DfResult<Self> {
        let partitions = redistribute(partitions, options.partitions);
        let total_rows = partitions.iter().flatten().map(|b| b.num_rows() as u64).sum();
        let total_bytes = partitions.iter().flatten().map(host_bytes).sum();
        let mut stager = Stager::new(schema, partitions.len(), options, Some((total_rows, total_bytes)))?;
        // Check each device's share before copying anything.
        let mut need: HashMap<Device, u64> = HashMap::new();
        for (i, p) in partitions.iter().enumerate() {
            *need.entry(stager.device_of(i)).or_default() += p.iter().map(host_bytes).sum::<u64>();
        }
        for (device, bytes) in need {
            stager.check_room(device, bytes)?;
        }
        for (i, p) in partitions.into_iter().enumerate() {
            for batch in p {
                stager.stage(i, &batch)?;
            }
        }
        stager.finish()
    }

    /// Stages host batches as one partition per batch.
    pub fn from_batches(schema: SchemaRef, batches: Vec<RecordBatch>, options: &LoadOptions) -> DfResult<Self> {
        let partitions = batches.into_iter().map(|b| vec![b]).collect();
        Self::try_new(schema, partitions, options)
    }

    /// Scans `provider` through a fresh `SessionContext` and stages its batches as they arrive,
    /// keeping its partitioning (or the one of [`LoadOptions::with_partitions`]).
    pub async fn from_provider(provider: Arc<dyn TableProvider>, options: &LoadOptions) -> DfResult<Self> {
        let ctx = SessionContext::new();
        let df = ctx.read_table(provider)?;
        let streams = df.execute_stream_partitioned().await?;
        Self::from_streams(streams, options).await
    }

    /// Reads Parquet files (a file, a directory or a glob, as `SessionContext::read_parquet`
    /// takes them) with DataFusion's reader and stages the batches as they arrive.
    pub async fn from_parquet(path: impl AsRef<Path>, options: &LoadOptions) -> DfResult<Self> {
        let ctx = SessionContext::new();
        let df = ctx
            .read_parquet(path_str(path.as_ref())?, ParquetReadOptions::default())
            .await?;
        Self::from_streams(df.execute_stream_partitioned().await?, options).await
    }

    /// Reads CSV files with DataFusion's reader (`csv` says how: header, delimiter, schema...)
    /// and stages the batches as they arrive.
    pub async fn from_csv(path: impl AsRef<Path>, csv: CsvReadOptions<'_>, options: &LoadOptions) -> DfResult<Self> {
        let ctx = SessionContext::new();
        let df = ctx.read_csv(path_str(path.as_ref())?, csv).await?;
        Self::from_streams(df.execute_stream_partitioned().await?, options).await
    }

    async fn from_streams(streams: Vec<SendableRecordBatchStream>, options: &LoadOptions) -> DfResult<Self> {
        let schema = match streams.first() {
            Some(s) => s.schema(),
            None => {
                return Err(DataFusionError::Plan("the source has no partitions".into()));
            }
        };
        let n_out = options.partitions.unwrap_or(streams.len());
        let mut stager = Stager::new(schema, n_out, options, None)?;
        let mut next = 0usize;
        for (i, mut s) in streams.into_iter().enumerate() {
            while let Some(batch) = s.next().await {
                let batch = batch?;
                if batch.num_rows() == 0 {
                    continue;
                }
                let target = match options.partitions {
                    None => i,
                    Some(n) => {
                        next += 1;
                        (next - 1) % n
                    }
                };
                stager.stage(target, &batch)?;
            }
        }
        stager.finish()
    }

    /// The table's schema.
    pub fn schema_ref(&self) -> &SchemaRef {
        &self.data.schema
    }

    /// The device batches of each partition.
    pub fn partitions(&self) -> &[Vec<DeviceRecordBatch>] {
        &self.data.partitions
    }

    /// The device each partition lives on.
    pub fn partition_devices(&self) -> &[Device] {
        &self.data.partition_devices
    }

    /// The number of rows.
    pub fn num_rows(&self) -> usize {
        self.data
            .partitions
            .iter()
            .flatten()
            .map(DeviceRecordBatch::num_rows)
            .sum()
    }

    /// The bytes of device memory the table holds.
    pub fn size_in_bytes(&self) -> usize {
        self.data
            .partitions
            .iter()
            .flatten()
            .map(DeviceRecordBatch::size_in_bytes)
            .sum()
    }

    /// Exact statistics computed on the host batches while staging: row count, and per column
    /// the null count and (for the types DataFusion's `MIN`/`MAX` handle) the minimum and maximum.
    pub fn statistics_ref(&self) -> &Statistics {
        &self.data.stats
    }

    /// A scan of the whole table with no projection, filter or limit; see [`GpuScan`].
    pub fn scan_source(&self) -> GpuScan {
        GpuScan::new(self.data.clone())
    }
}

fn path_str(p: &Path) -> DfResult<&str> {
    p.to_str()
        .ok_or_else(|| DataFusionError::Plan(format!("path {} is not UTF-8", p.display())))
}

/// Batches into `n` partitions round-robin, or as they are.
fn redistribute(partitions: Vec<Vec<RecordBatch>>, n: Option<usize>) -> Vec<Vec<RecordBatch>> {
    let Some(n) = n else {
        return partitions;
    };
    let mut out = vec![Vec::new(); n];
    for (i, b) in partitions.into_iter().flatten().enumerate() {
        out[i % n].push(b);
    }
    out
}

/// The bytes of a batch that staging copies: the used ranges of its buffers, each 64-byte aligned.
fn host_bytes(batch: &RecordBatch) -> u64 {
    batch
        .columns()
        .iter()
        .map(|c| {
            let d = c.to_data();
            (d.get_slice_memory_size().unwrap_or_else(|_| c.get_array_memory_size()) + 64 * (d.buffers().len() + 1))
                as u64
        })
        .sum()
}

/// Copies batches to their devices one at a time, keeping budgets, statistics and progress.
/// Consecutive batches of a partition are gathered into one device batch first.
struct Stager {
    schema: SchemaRef,
    devices: Vec<Device>,
    streams: HashMap<Device, Stream>,
    room: HashMap<Device, u64>,
    partitions: Vec<Vec<DeviceRecordBatch>>,
    partition_stats: Vec<StatsBuilder>,
    progress: Option<ProgressFn>,
    done: Progress,
    streams_per_device: usize,
    batch_rows: usize,
    /// Input batches of each partition not staged yet, with their rows and bytes.
    gathered: Vec<(Vec<RecordBatch>, usize, u64)>,
}

impl Stager {
    fn new(schema: SchemaRef, partitions: usize, options: &LoadOptions, total: Option<(u64, u64)>) -> DfResult<Self> {
        let devices = options.devices();
        let mut room = HashMap::new();
        let mut streams = HashMap::new();
        let free = devices
            .iter()
            .any(|d| d.ordinal().is_some())
            .then(crate::device::cuda_devices)
            .transpose()?
            .unwrap_or_default();
        for &d in &devices {
            let mut r = options.memory_limit.unwrap_or(u64::MAX);
            if let Device::Cuda(o) = d {
                let info = free
                    .iter()
                    .find(|i| i.ordinal == o)
                    .ok_or_else(|| Error::InvalidArgument(format!("CUDA device {o} does not exist")))?;
                r = r.min(info.free_memory as u64);
            }
            room.insert(d, r);
            streams.insert(d, Stream::new(d)?);
        }
        Ok(Stager {
            partitions: vec![Vec::new(); partitions.max(1)],
            partition_stats: (0..partitions.max(1)).map(|_| StatsBuilder::new(&schema)).collect(),
            schema,
            devices,
            streams,
            room,
            progress: options.progress.clone(),
            done: Progress {
                rows: 0,
                bytes: 0,
                batches: 0,
                total_rows: total.map(|t| t.0),
                total_bytes: total.map(|t| t.1),
            },
            streams_per_device: options.streams_per_device.unwrap_or(4),
            batch_rows: options.batch_rows.unwrap_or(DEFAULT_BATCH_ROWS),
            gathered: vec![(Vec::new(), 0, 0); partitions.max(1)],
        })
    }

    fn device_of(&self, partition: usize) -> Device {
        self.devices[partition % self.devices.len()]
    }

    fn check_room(&self, device: Device, bytes: u64) -> DfResult<()> {
        let room = self.room.get(&device).copied().unwrap_or(u64::MAX);
        if bytes > room {
            return Err(DataFusionError::ResourcesExhausted(format!(
                "the table does not fit on {device}: {bytes} bytes to stage, {room} bytes available"
            )));
        }
        Ok(())
    }

    /// Takes `batch` into `partition`, staging what the partition has gathered once it is large
    /// enough.
    fn stage(&mut self, partition: usize, batch: &RecordBatch) -> DfResult<()> {
        if batch.schema().fields() != self.schema.fields() {
            return Err(DataFusionError::Plan(format!(
                "batch schema {:?} does not match the table schema {:?}",
                batch.schema(),
                self.schema
            )));
        }
        let bytes = host_bytes(batch);
        let (_, rows, gathered_bytes) = &self.gathered[partition];
        if *rows > 0 && (rows + batch.num_rows() > self.batch_rows || gathered_bytes + bytes > MAX_GATHERED_BYTES) {
            self.flush(partition)?;
        }
        let g = &mut self.gathered[partition];
        g.0.push(batch.clone());
        g.1 += batch.num_rows();
        g.2 += bytes;
        if g.1 >= self.batch_rows {
            self.flush(partition)?;
        }
        Ok(())
    }

    /// Stages what `partition` has gathered as one device batch.
    fn flush(&mut self, partition: usize) -> DfResult<()> {
        let (batches, rows, bytes) = std::mem::take(&mut self.gathered[partition]);
        let batch = match batches.as_slice() {
            [] => return Ok(()),
            [one] => one.clone(),
            many => arrow_select::concat::concat_batches(&self.schema, many)?,
        };
        let device = self.device_of(partition);
        self.check_room(device, bytes)?;
        let stream = &self.streams[&device];
        // Statistics come from the host batch, before it is copied.
        self.partition_stats[partition].update(&batch);
        let staged = crate::transfer::htod(&batch, device, stream)?;
        // Keep the table's schema (with its metadata) on every batch.
        let staged = DeviceRecordBatch::try_new(
            self.schema.clone(),
            staged.columns().to_vec(),
            staged.num_rows(),
            staged.ready().clone(),
        )?;
        if let Some(r) = self.room.get_mut(&device) {
            *r = r.saturating_sub(bytes);
        }
        self.partitions[partition].push(staged);
        self.done.rows += rows as u64;
        self.done.bytes += bytes;
        self.done.batches += batches.len() as u64;
        if let Some(p) = &self.progress {
            p(self.done);
        }
        Ok(())
    }

    fn finish(mut self) -> DfResult<GpuTable> {
        for p in 0..self.partitions.len() {
            self.flush(p)?;
        }
        let partition_devices = (0..self.partitions.len()).map(|i| self.device_of(i)).collect();
        let mut lanes = HashMap::new();
        for &d in &self.devices {
            lanes.insert(d, Arc::new(DeviceLane::new(d, self.streams_per_device)?));
        }
        Ok(GpuTable {
            data: Arc::new(TableData {
                partition_stats: self.partition_stats.iter().map(|s| s.finish()).collect(),
                stats: StatsBuilder::merge(&self.schema, &self.partition_stats),
                schema: self.schema,
                partitions: self.partitions,
                partition_devices,
                lanes,
            }),
        })
    }
}

#[async_trait]
impl TableProvider for GpuTable {
    fn schema(&self) -> SchemaRef {
        self.data.schema.clone()
    }

    fn table_type(&self) -> TableType {
        TableType::Base
    }

    async fn scan(
        &self,
        _state: &dyn Session,
        projection: Option<&Vec<usize>>,
        filters: &[Expr],
        limit: Option<usize>,
    ) -> DfResult<Arc<dyn ExecutionPlan>> {
        let mut predicates = Vec::with_capacity(filters.len());
        for f in filters {
            match Predicate::from_expr(f, &self.data.schema) {
                Some(p) => predicates.push(p),
                None => {
                    return Err(DataFusionError::Plan(format!(
                        "filter {f} was not accepted for pushdown into a GPU table"
                    )));
                }
            }
        }
        let source = GpuScan::new(self.data.clone())
            .with_projection(projection.cloned())?
            .with_filters(filters.to_vec(), predicates)
            .with_limit(limit);
        Ok(DataSourceExec::from_data_source(source))
    }

    fn supports_filters_pushdown(&self, filters: &[&Expr]) -> DfResult<Vec<TableProviderFilterPushDown>> {
        Ok(filters
            .iter()
            .map(|f| {
                if supports_filter(f, &self.data.schema) {
                    TableProviderFilterPushDown::Exact
                } else {
                    TableProviderFilterPushDown::Unsupported
                }
            })
            .collect())
    }

    fn statistics(&self) -> Option<Statistics> {
        Some(self.data.stats.clone())
    }
}
