//! Staging: host batches gathered and copied to their devices, with budgets, statistics and
//! progress.

use std::collections::HashMap;
use std::sync::Arc;

use ::datafusion::common::DataFusionError;
use arrow_array::RecordBatch;
use arrow_schema::SchemaRef;

use super::error::DfResult;
use super::lanes::DeviceLane;
use super::options::{DEFAULT_BATCH_ROWS, LoadOptions, MAX_GATHERED_BYTES, Progress, ProgressFn};
use super::stats::StatsBuilder;
use super::table::{GpuTable, TableData};
use crate::array::DeviceRecordBatch;
use crate::device::{Device, Stream};
use crate::error::Error;

/// Batches into `n` partitions round-robin, or as they are.
pub(crate) fn redistribute(partitions: Vec<Vec<RecordBatch>>, n: Option<usize>) -> Vec<Vec<RecordBatch>> {
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
pub(crate) fn host_bytes(batch: &RecordBatch) -> u64 {
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
pub(crate) struct Stager {
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
    pub(crate) fn new(
        schema: SchemaRef,
        partitions: usize,
        options: &LoadOptions,
        total: Option<(u64, u64)>,
    ) -> DfResult<Self> {
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

    pub(crate) fn device_of(&self, partition: usize) -> Device {
        self.devices[partition % self.devices.len()]
    }

    pub(crate) fn check_room(&self, device: Device, bytes: u64) -> DfResult<()> {
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
    pub(crate) fn stage(&mut self, partition: usize, batch: &RecordBatch) -> DfResult<()> {
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

    pub(crate) fn finish(mut self) -> DfResult<GpuTable> {
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
                longest_strings: StatsBuilder::longest_strings(&self.schema, &self.partition_stats),
                column_bytes: self.partition_stats.iter().map(StatsBuilder::column_bytes).collect(),
                schema: self.schema,
                partitions: self.partitions,
                partition_devices,
                lanes,
            }),
        })
    }
}
