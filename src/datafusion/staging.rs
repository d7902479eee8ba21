//! Staging: host batches made and prepared on every core (decoded, compacted, their statistics
//! computed, and packed into pinned staging where they are small) and copied to their devices as
//! they are ready by one thread, which gathers them into device batches there (or they are
//! gathered on the host first, where the device cannot), with budgets and progress.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use ::datafusion::common::DataFusionError;
use arrow_array::cast::AsArray;
use arrow_array::types::ByteViewType;
use arrow_array::{Array, ArrayRef, GenericByteViewArray, RecordBatch, RecordBatchOptions};
use arrow_data::ArrayData;
use arrow_schema::{DataType, SchemaRef};

use super::device_concat::{concat_batches, concatenable};
use super::device_extremes::{self, Finding};
use super::error::DfResult;
use super::lanes::DeviceLane;
use super::options::{LoadOptions, MAX_GATHERED_BYTES, Progress, ProgressFn};
use super::stats::{KnownExtremes, StatsBuilder, ViewScan, scan_views};
use super::table::{GpuTable, TableData};
use crate::array::DeviceRecordBatch;
use crate::device::{Device, Stream};
use crate::error::Error;
use crate::transfer::times::{StagingStep, StagingTimes, timed};
use crate::transfer::{Packed, htod_async_timed};

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

/// The bytes of a batch that staging copies: the used ranges of its buffers, each 64-byte aligned,
/// and the data buffers of its view arrays as [`compact`] leaves them.
pub(crate) fn host_bytes(batch: &RecordBatch) -> u64 {
    batch.columns().iter().map(|c| column_bytes(c, view_bytes(c))).sum()
}

/// [`host_bytes`] of one column, given its [`view_bytes`] (those of the column before [`compact`]
/// made it: compacting keeps the bytes its views reference).
fn column_bytes(column: &ArrayRef, views: Option<(usize, usize)>) -> u64 {
    let d = column.to_data();
    // The slice size of a view array counts its views, not its data buffers.
    let views = views.map_or(0, |(held, referenced)| held.min(referenced));
    let nested: usize = d.child_data().iter().map(nested_view_data).sum();
    (d.get_slice_memory_size()
        .unwrap_or_else(|_| column.get_array_memory_size())
        + views
        + nested
        + 64 * (d.buffers().len() + 1)) as u64
}

/// The bytes of the data buffers of the view arrays among `data` and its descendants: staging
/// copies them whole.
fn nested_view_data(data: &ArrayData) -> usize {
    let own: usize = match data.data_type() {
        DataType::Utf8View | DataType::BinaryView => data.buffers().iter().skip(1).map(|b| b.len()).sum(),
        _ => 0,
    };
    own + data.child_data().iter().map(nested_view_data).sum::<usize>()
}

/// The bytes the data buffers of a view column hold (each buffer as often as the column lists it:
/// staging copies every one whole) and the bytes its views reference (the values too long to be
/// inlined); `None` for a column of another type.
fn view_bytes(column: &ArrayRef) -> Option<(usize, usize)> {
    let referenced = match column.data_type() {
        DataType::Utf8View => column.as_string_view().total_buffer_bytes_used(),
        DataType::BinaryView => column.as_binary_view().total_buffer_bytes_used(),
        _ => return None,
    };
    Some((held_bytes(column), referenced))
}

/// The bytes the data buffers of a view column hold (each buffer as often as the column lists
/// it); 0 for a column of another type.
fn held_bytes(column: &ArrayRef) -> usize {
    match column.data_type() {
        DataType::Utf8View => column.as_string_view().data_buffers().iter().map(|b| b.len()).sum(),
        DataType::BinaryView => column.as_binary_view().data_buffers().iter().map(|b| b.len()).sum(),
        _ => 0,
    }
}

/// `batch` with each view column whose data buffers hold more bytes than its views reference
/// compacted: its long values copied into new buffers of just their size (arrow's `gc`); and
/// its [`host_bytes`]. `scans` are the [`scan_views`] of its columns, which say what the views
/// reference.
///
/// DataFusion's Parquet reader hands out string views into the decoded pages and dictionaries of a
/// whole row group: every batch of the row group lists the same buffers, and each buffer holds the
/// values of other batches too (and, in plain-encoded pages, their length prefixes). Staged as
/// they are, those buffers were copied once per batch. A column whose views reference every byte
/// of its buffers or more (a small dictionary shared by many rows) stays as it is.
pub(crate) fn compact(batch: &RecordBatch, scans: &[Option<ViewScan>]) -> DfResult<(RecordBatch, u64)> {
    fn gc<T: ByteViewType + ?Sized>(a: &GenericByteViewArray<T>) -> ArrayRef {
        Arc::new(a.gc())
    }
    let mut bytes = 0;
    // One column after the other: batches are prepared on every core at once.
    let columns: Vec<ArrayRef> = batch
        .columns()
        .iter()
        .zip(scans)
        .map(|(c, scan)| {
            let views = scan.map(|s| (held_bytes(c), s.referenced));
            let c = match (c.data_type(), views) {
                (DataType::Utf8View, Some((held, referenced))) if held > referenced => gc(c.as_string_view()),
                (DataType::BinaryView, Some((held, referenced))) if held > referenced => gc(c.as_binary_view()),
                _ => c.clone(),
            };
            bytes += column_bytes(&c, views);
            c
        })
        .collect();
    let options = RecordBatchOptions::new().with_row_count(Some(batch.num_rows()));
    Ok((
        RecordBatch::try_new_with_options(batch.schema(), columns, &options)?,
        bytes,
    ))
}

/// The [`scan_views`] of each column of `batch`, with the extremes unless they are left to the
/// device (`defer`).
fn scans(batch: &RecordBatch, defer: bool) -> Vec<Option<ViewScan>> {
    batch.columns().iter().map(|c| scan_views(c, !defer)).collect()
}

/// A device batch's worth of host data (or a piece of one, see [`Place`]), ready to copy: one
/// batch (or its bytes packed for its GPU already), its statistics and its bytes.
pub(crate) struct Prepared {
    data: HostData,
    rows: usize,
    stats: StatsBuilder,
    bytes: u64,
    /// The input batches it was made of.
    inputs: u64,
}

/// A prepared batch as it waits for its copy.
enum HostData {
    Batch(RecordBatch),
    Packed(Packed),
}

impl Prepared {
    /// The bytes staging copies of it (see [`host_bytes`]).
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Packs the batch into pinned staging for CUDA device `ordinal` on this thread, when
    /// `budget` has room for it (see [`PackingBudget`]), and frees the host batch; otherwise
    /// leaves it for the copying thread to pack.
    fn pack(mut self, ordinal: usize, budget: &Arc<PackingBudget>, times: Option<&StagingTimes>) -> DfResult<Prepared> {
        if let HostData::Batch(batch) = &self.data
            && let Some(reserved) = PackingBudget::reserve(budget, self.bytes)
        {
            let packed = Packed::new(batch, ordinal, Box::new(reserved), times)?;
            let batch = std::mem::replace(&mut self.data, HostData::Packed(packed));
            timed(times, StagingStep::Release, || drop(batch));
        }
        Ok(self)
    }
}

/// The pinned staging that threads preparing batches may fill at once: 1 GiB, in batches of at
/// most 32 MiB. A larger batch, or one that finds no room, is packed by the copying thread (in
/// chunks, through a few blocks of staging it reuses): pinning memory costs about as much as
/// copying it, so a block must serve many batches to pay off.
pub(crate) struct PackingBudget {
    left: AtomicU64,
}

impl PackingBudget {
    const BYTES: u64 = 1 << 30;
    const LARGEST: u64 = 32 << 20;

    fn new() -> Arc<PackingBudget> {
        Arc::new(PackingBudget {
            left: AtomicU64::new(Self::BYTES),
        })
    }

    /// Takes `bytes` of the budget, if it has them and they are at most [`Self::LARGEST`], until
    /// the reservation drops.
    fn reserve(budget: &Arc<PackingBudget>, bytes: u64) -> Option<Reservation> {
        if bytes > Self::LARGEST {
            return None;
        }
        budget
            .left
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |left| left.checked_sub(bytes))
            .ok()
            .map(|_| Reservation {
                budget: budget.clone(),
                bytes,
            })
    }
}

/// Bytes of a [`PackingBudget`] in use: kept with the staging until its copy has finished.
struct Reservation {
    budget: Arc<PackingBudget>,
    bytes: u64,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.budget.left.fetch_add(self.bytes, Ordering::AcqRel);
    }
}

/// Makes one device batch's worth of `batches` (all of `schema`; or a piece of one, see
/// [`Place`]) for `device`: concatenated when there are several, view columns compacted,
/// statistics computed while the data is at hand (but the extremes `known` gives, and those a GPU
/// finds once the batch is there: see [`device_extremes`]).
pub(crate) fn prepare(
    schema: &SchemaRef,
    batches: Vec<RecordBatch>,
    known: Option<&KnownExtremes>,
    device: Device,
) -> DfResult<Prepared> {
    let defer = device_extremes::on_device(device);
    if let Some(b) = batches.iter().find(|b| b.schema().fields() != schema.fields()) {
        return Err(DataFusionError::Plan(format!(
            "batch schema {:?} does not match the table schema {:?}",
            b.schema(),
            schema
        )));
    }
    let inputs = batches.len() as u64;
    let (batch, bytes, scans) = match batches.as_slice() {
        [one] => {
            let scans = scans(one, defer);
            let (batch, bytes) = compact(one, &scans)?;
            (batch, bytes, scans)
        }
        many => {
            let compacted = many
                .iter()
                .map(|b| compact(b, &scans(b, defer)))
                .collect::<DfResult<Vec<_>>>()?;
            let batch = arrow_select::concat::concat_batches(schema, compacted.iter().map(|(b, _)| b))?;
            let bytes = host_bytes(&batch);
            // The statistics scan the concatenation's views.
            (batch, bytes, Vec::new())
        }
    };
    let mut stats = StatsBuilder::new(schema);
    stats.update(&batch, &scans, known, defer);
    Ok(Prepared {
        bytes,
        rows: batch.num_rows(),
        data: HostData::Batch(batch),
        stats,
        inputs,
    })
}

/// Where a unit of staging goes: a partition, a device batch's place in its order, and which
/// piece of it the unit is, of how many. A device batch of several pieces is gathered on its
/// device: each piece is prepared and copied by itself, and the stager concatenates them once
/// all are there (see [`device_concatenable`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Place {
    pub(crate) partition: usize,
    pub(crate) order: usize,
    pub(crate) piece: usize,
    pub(crate) pieces: usize,
}

impl Place {
    /// The whole device batch at `order` of `partition`.
    pub(crate) fn whole(partition: usize, order: usize) -> Place {
        Place {
            partition,
            order,
            piece: 0,
            pieces: 1,
        }
    }

    /// The units of a run of host batches that makes the device batch at `order` of
    /// `partition`: its batches one by one where `on_device` gathers them, else all at once.
    pub(crate) fn units(
        partition: usize,
        order: usize,
        run: Vec<RecordBatch>,
        on_device: bool,
    ) -> Vec<(Place, Vec<RecordBatch>)> {
        if !on_device || run.len() < 2 {
            return vec![(Place::whole(partition, order), run)];
        }
        let pieces = run.len();
        run.into_iter()
            .enumerate()
            .map(|(piece, b)| {
                let place = Place {
                    partition,
                    order,
                    piece,
                    pieces,
                };
                (place, vec![b])
            })
            .collect()
    }
}

/// Whether a device batch of several host batches of `schema` is gathered on `device` (each
/// copied as it is, then concatenated there) rather than on the host: on a GPU, where every column
/// has a type `device_concat::concat_batches` takes (all but dictionaries, unions, list views and
/// run-end encoded columns).
fn device_concatenable(schema: &SchemaRef, device: Device) -> bool {
    device.ordinal().is_some() && schema.fields().iter().all(|f| concatenable(f.data_type()))
}

/// Each batch with its [`host_bytes`], computed on every core (a view column's bytes take a pass
/// over its views).
pub(crate) fn sized(partitions: Vec<Vec<RecordBatch>>) -> Vec<Vec<(RecordBatch, u64)>> {
    use rayon::prelude::*;
    partitions
        .into_par_iter()
        .map(|p| {
            p.into_par_iter()
                .map(|b| {
                    let bytes = host_bytes(&b);
                    (b, bytes)
                })
                .collect()
        })
        .collect()
}

/// Splits the batches of a partition (each with its [`host_bytes`]) into runs of consecutive
/// batches, each a device batch: a run takes whole batches while they fit in `rows` rows and
/// [`MAX_GATHERED_BYTES`] (a larger batch stays whole).
pub(crate) fn gather(batches: Vec<(RecordBatch, u64)>, rows: usize) -> Vec<Vec<(RecordBatch, u64)>> {
    let mut runs = Vec::new();
    let mut run = Vec::new();
    let (mut run_rows, mut run_bytes) = (0, 0);
    for (b, bytes) in batches.into_iter().filter(|(b, _)| b.num_rows() > 0) {
        if run_rows > 0 && (run_rows + b.num_rows() > rows || run_bytes + bytes > MAX_GATHERED_BYTES) {
            runs.push(std::mem::take(&mut run));
            (run_rows, run_bytes) = (0, 0);
        }
        run_rows += b.num_rows();
        run_bytes += bytes;
        run.push((b, bytes));
        if run_rows >= rows {
            runs.push(std::mem::take(&mut run));
            (run_rows, run_bytes) = (0, 0);
        }
    }
    if !run.is_empty() {
        runs.push(run);
    }
    runs
}

/// The batches of a run of [`gather`], without their sizes.
pub(crate) fn batches(run: Vec<(RecordBatch, u64)>) -> Vec<RecordBatch> {
    run.into_iter().map(|(b, _)| b).collect()
}

/// Stages `units` through `stager` on every core: worker threads make each unit's host batches
/// (`make`: decode a file's row groups, say, with the extremes their metadata knows) and
/// [`prepare`] them, while this thread copies each
/// prepared batch to its device as soon as it is ready, so that decoding, preparing and copying
/// overlap. A unit is its [`Place`] and what `make` takes; `make` gives the host batches of the
/// unit's pieces one piece after the other, from the place's piece on (a device batch that its
/// device gathers can be decoded in pieces, each prepared and copied as soon as it is made).
///
/// At most a few prepared batches wait for their copy: workers wait while the queue is full, so
/// host memory holds a few device batches per core, never the whole table. The first error stops
/// the workers and is returned.
pub(crate) fn stage_parallel<U: Send, P: Iterator<Item = DfResult<Vec<RecordBatch>>>>(
    stager: &mut Stager,
    units: Vec<(Place, U)>,
    make: impl Fn(U) -> DfResult<(P, Option<KnownExtremes>)> + Sync,
) -> DfResult<()> {
    let workers = std::thread::available_parallelism()
        .map_or(4, |n| n.get())
        .min(units.len());
    let queue = std::sync::Mutex::new(units.into_iter());
    let schema = stager.schema.clone();
    let times = stager.times.clone();
    let times = times.as_deref();
    let devices = stager.devices.clone();
    let budget = PackingBudget::new();
    let (tx, rx) = std::sync::mpsc::sync_channel::<DfResult<(Place, Prepared)>>(2);
    // Host batches are freed on a thread of their own: giving back hundreds of megabytes to the
    // system (`munmap`) takes longer than copying them, and the copying thread must not wait on it.
    let (release, released) = std::sync::mpsc::channel::<RecordBatch>();
    std::thread::scope(|scope| {
        scope.spawn(move || {
            for batch in released {
                timed(times, StagingStep::Release, || drop(batch));
            }
        });
        for _ in 0..workers {
            let tx = tx.clone();
            let (queue, make, schema, devices, budget) = (&queue, &make, &schema, &devices, &budget);
            scope.spawn(move || {
                loop {
                    // The lock is held only to take the next unit.
                    let next = match queue.lock() {
                        Ok(mut q) => q.next(),
                        Err(_) => None,
                    };
                    let Some((place, unit)) = next else {
                        return;
                    };
                    let device = device_for(devices, place.partition);
                    let (mut pieces, known) = match timed(times, StagingStep::Decode, || make(unit)) {
                        Ok(made) => made,
                        Err(e) => {
                            let _ = tx.send(Err(e));
                            return;
                        }
                    };
                    let mut piece = place.piece;
                    while let Some(batches) = timed(times, StagingStep::Decode, || pieces.next()) {
                        let prepared = batches
                            .and_then(|b| {
                                if piece >= place.pieces {
                                    return Err(DataFusionError::Internal(format!(
                                        "device batch {} of partition {} has more than {} pieces",
                                        place.order, place.partition, place.pieces
                                    )));
                                }
                                timed(times, StagingStep::Prepare, || {
                                    prepare(schema, b, known.as_ref(), device)
                                })
                            })
                            .and_then(|p| match device {
                                Device::Cuda(ordinal) => p.pack(ordinal, budget, times),
                                _ => Ok(p),
                            });
                        let failed = prepared.is_err();
                        let closed = timed(times, StagingStep::Handoff, || {
                            tx.send(prepared.map(|p| (Place { piece, ..place }, p))).is_err()
                        });
                        // A closed queue means the stager stopped on an error: stop too.
                        if closed || failed {
                            return;
                        }
                        piece += 1;
                    }
                }
            });
        }
        drop(tx);
        // Owned here, so that returning (on an error too) closes the queue and stops the workers
        // before the scope waits for them.
        let rx = rx;
        while let Ok(prepared) = timed(times, StagingStep::Idle, || rx.recv()) {
            let (place, prepared) = prepared?;
            stager.decoded(prepared.bytes());
            // The releasing thread stops once `release` is dropped, when this returns.
            if let Some(batch) = stager.put(place, prepared)? {
                let _ = release.send(batch);
            }
        }
        drop(release);
        Ok(())
    })
}

/// Reads the extremes of `findings` (waiting for them) into their partitions' statistics.
fn take_extremes(stats: &mut [StatsBuilder], findings: Vec<(usize, Finding)>) -> DfResult<()> {
    let (partitions, findings): (Vec<usize>, Vec<Finding>) = findings.into_iter().unzip();
    let found = device_extremes::finish(&findings)?;
    for (partition, columns) in partitions.into_iter().zip(found) {
        for (column, least, greatest) in columns {
            stats[partition].take_extremes(column, least, greatest);
        }
    }
    Ok(())
}

/// The device of `partition` of a table staged on `devices`: partitions go round-robin.
fn device_for(devices: &[Device], partition: usize) -> Device {
    devices[partition % devices.len()]
}

/// What a device can take of a table.
#[derive(Clone, Copy, Debug)]
struct Room {
    /// The bytes the device could take when staging began: its free memory, or the memory limit
    /// when that is lower; `None` on host memory without a limit.
    free: Option<u64>,
    /// Whether `free` is the memory limit.
    limited: bool,
    /// The bytes staged there so far.
    staged: u64,
}

/// Copies prepared batches to their devices, keeping budgets, statistics and progress.
///
/// Its users return on the first error, dropping the stager and with it every device batch staged
/// so far: nothing of a table that did not fit stays on its devices (memory of a GPU's pool goes
/// back to the pool, where the next load counts it as free).
pub(crate) struct Stager {
    /// The table's name, for errors.
    name: Option<String>,
    schema: SchemaRef,
    devices: Vec<Device>,
    streams: HashMap<Device, Stream>,
    room: HashMap<Device, Room>,
    /// The device batches of each partition, each with its place in the partition's order.
    partitions: Vec<Vec<(usize, DeviceRecordBatch)>>,
    /// The pieces copied so far of each device batch gathered on its device (see [`Place`]), by
    /// partition and place in its order.
    gathering: HashMap<(usize, usize), Vec<Option<DeviceRecordBatch>>>,
    partition_stats: Vec<StatsBuilder>,
    /// The extremes being found on the device, with their partitions, oldest first (see
    /// [`device_extremes`]); at most [`Stager::FINDINGS`].
    findings: std::collections::VecDeque<(usize, Finding)>,
    progress: Option<ProgressFn>,
    done: Progress,
    streams_per_device: usize,
    /// Where the load's steps count their time, if anywhere.
    pub(crate) times: Option<Arc<StagingTimes>>,
}

impl Stager {
    pub(crate) fn new(
        schema: SchemaRef,
        partitions: usize,
        options: &LoadOptions,
        total_rows: Option<u64>,
        total_bytes: Option<u64>,
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
            let device_free = match d {
                Device::Cuda(o) => {
                    let info = free
                        .iter()
                        .find(|i| i.ordinal == o)
                        .ok_or_else(|| Error::InvalidArgument(format!("CUDA device {o} does not exist")))?;
                    // Memory freed into the pool (a dropped table's, say) is free for staging too.
                    Some(info.free_memory as u64 + crate::device::pool_idle_memory(o)?)
                }
                _ => None,
            };
            let limit = options.memory_limit;
            let limited = limit.is_some_and(|l| device_free.is_none_or(|f| l < f));
            let free = if limited { limit } else { device_free };
            room.insert(
                d,
                Room {
                    free,
                    limited,
                    staged: 0,
                },
            );
            streams.insert(d, Stream::new(d)?);
        }
        Ok(Stager {
            name: options.name.clone(),
            partitions: vec![Vec::new(); partitions.max(1)],
            gathering: HashMap::new(),
            partition_stats: (0..partitions.max(1)).map(|_| StatsBuilder::new(&schema)).collect(),
            findings: Default::default(),
            schema,
            devices,
            streams,
            room,
            progress: options.progress.clone(),
            done: Progress {
                rows: 0,
                bytes: 0,
                decoded: 0,
                batches: 0,
                total_rows,
                total_bytes,
            },
            streams_per_device: options.streams_per_device.unwrap_or(4),
            times: options.staging_times.clone(),
        })
    }

    pub(crate) fn device_of(&self, partition: usize) -> Device {
        device_for(&self.devices, partition)
    }

    /// Fails with [`Stager::no_room`] unless `device` has room for `bytes` more.
    pub(crate) fn check_room(&self, device: Device, bytes: u64) -> DfResult<()> {
        let room = self.room.get(&device);
        match room.and_then(|r| Some((r.free?, r.staged))) {
            Some((free, staged)) if staged.saturating_add(bytes) > free => Err(self.no_room(device, bytes, None)),
            _ => Ok(()),
        }
    }

    /// The error of a table that does not fit on `device` with `bytes` more to stage there (`cause`:
    /// the allocation that failed, if one did): it names the table, the bytes it takes there and
    /// in all, and the device's free memory (or the memory limit).
    fn no_room(&self, device: Device, bytes: u64, cause: Option<Error>) -> DataFusionError {
        let room = self.room.get(&device).copied().unwrap_or(Room {
            free: None,
            limited: false,
            staged: 0,
        });
        let table = match &self.name {
            Some(name) => format!("table `{name}`"),
            None => "the table".into(),
        };
        let total = self.done.total_bytes;
        // Its share of the device is known only before anything is staged, from a known total.
        let at_least = if total.is_none() || room.staged > 0 {
            "at least "
        } else {
            ""
        };
        let mut m = format!(
            "{table} does not fit on {device}: it takes {at_least}{} bytes there",
            room.staged.saturating_add(bytes)
        );
        if let Some(total) = total {
            m += &format!(" ({total} bytes in all)");
        }
        match room.free {
            Some(free) if room.limited => m += &format!(", and the memory limit is {free} bytes"),
            Some(free) => m += &format!(", and {free} bytes were free"),
            None => {}
        }
        if let Some(cause) = cause {
            m += &format!(" ({cause})");
        }
        if room.staged > 0 {
            m += "; what was staged is freed";
        }
        DataFusionError::ResourcesExhausted(m)
    }

    /// Counts `bytes` more as decoded (made on the host) and reports progress.
    pub(crate) fn decoded(&mut self, bytes: u64) {
        self.done.decoded += bytes;
        if let Some(p) = &self.progress {
            p(self.done);
        }
    }

    /// Copies `prepared` to the device of its partition, to its `place` (a piece of a device
    /// batch waits there for the others; the last to come concatenates them). Returns once the
    /// host data has been read (the copy may still be under way), with the host batch when it was
    /// not packed already, for the caller to free.
    pub(crate) fn put(&mut self, place: Place, prepared: Prepared) -> DfResult<Option<RecordBatch>> {
        let Prepared {
            data,
            rows,
            stats,
            bytes,
            inputs,
        } = prepared;
        let partition = place.partition;
        let device = self.device_of(partition);
        self.check_room(device, bytes)?;
        let stream = &self.streams[&device];
        let resource = crate::memory::MemoryResource::default_for(device);
        let times = self.times.as_deref();
        let (staged, batch) = match data {
            HostData::Batch(batch) => (htod_async_timed(&batch, resource, stream, times), Some(batch)),
            HostData::Packed(packed) => (
                timed(times, StagingStep::Upload, || packed.send(resource, stream, times)),
                None,
            ),
        };
        let staged = staged.map_err(|e| self.failed(device, bytes, e))?;
        let staged = self
            .gathered(place, staged)
            .map_err(|e| self.failed(device, bytes, e))?;
        if let Some(r) = self.room.get_mut(&device) {
            r.staged += bytes;
        }
        self.partition_stats[partition].absorb(stats);
        self.done.rows += rows as u64;
        self.done.bytes += bytes;
        self.done.batches += inputs;
        if let Some(p) = &self.progress {
            p(self.done);
        }
        if let Some(staged) = staged {
            // Keep the table's schema (with its metadata) on every batch.
            let staged = DeviceRecordBatch::try_new(
                self.schema.clone(),
                staged.columns().to_vec(),
                staged.num_rows(),
                staged.ready().clone(),
            )?;
            let deferred = self.partition_stats[partition].deferred_columns();
            if !deferred.is_empty() {
                let finding = timed(self.times.as_deref(), StagingStep::Extremes, || {
                    device_extremes::start(&staged, &deferred, &self.streams[&device])
                })?;
                self.findings.push_back((partition, finding));
                if self.findings.len() > Self::FINDINGS {
                    // Long done, most likely: its kernels ran before the copies queued since.
                    let oldest = self.findings.pop_front().into_iter().collect();
                    timed(self.times.as_deref(), StagingStep::Extremes, || {
                        take_extremes(&mut self.partition_stats, oldest)
                    })?;
                }
            }
            self.partitions[partition].push((place.order, staged));
        }
        Ok(batch)
    }

    /// The device batch at `place` once `staged` has come: `staged` itself when it is the whole
    /// batch, else the concatenation of the pieces once the last has come (`None` before).
    fn gathered(&mut self, place: Place, staged: DeviceRecordBatch) -> crate::error::Result<Option<DeviceRecordBatch>> {
        if place.pieces == 1 {
            return Ok(Some(staged));
        }
        let key = (place.partition, place.order);
        let pieces = self.gathering.entry(key).or_insert_with(|| vec![None; place.pieces]);
        if let Some(slot) = pieces.get_mut(place.piece) {
            *slot = Some(staged);
        }
        if !pieces.iter().all(Option::is_some) {
            return Ok(None);
        }
        let pieces: Vec<_> = self.gathering.remove(&key).into_iter().flatten().flatten().collect();
        let device = self.device_of(place.partition);
        // The pieces' memory is freed in the order of the stream, after the concatenation.
        timed(self.times.as_deref(), StagingStep::Gather, || {
            concat_batches(self.schema.clone(), &pieces, device, &self.streams[&device])
        })
        .map(Some)
    }

    /// The units of a run of host batches that makes the device batch at `order` of `partition`
    /// (see [`Place::units`]): its batches one by one where its device gathers them.
    pub(crate) fn units(
        &self,
        partition: usize,
        order: usize,
        run: Vec<RecordBatch>,
    ) -> Vec<(Place, Vec<RecordBatch>)> {
        Place::units(partition, order, run, self.gathers(partition))
    }

    /// Whether the device of `partition` gathers device batches from pieces copied one by one
    /// (see [`device_concatenable`]).
    pub(crate) fn gathers(&self, partition: usize) -> bool {
        device_concatenable(&self.schema, self.device_of(partition))
    }

    /// The error of a copy (or concatenation) to `device` of `bytes` more that failed with `e`:
    /// [`Stager::no_room`] when the device was out of memory.
    fn failed(&self, device: Device, bytes: u64, e: Error) -> DataFusionError {
        match e {
            Error::OutOfMemory { .. } => self.no_room(device, bytes, Some(e)),
            e => e.into(),
        }
    }

    /// The table, once every copy has finished.
    pub(crate) fn finish(self) -> DfResult<GpuTable> {
        let times = self.times.clone();
        timed(times.as_deref(), StagingStep::Finish, || self.build())
    }

    /// Findings of extremes in flight at most: each holds a little pinned and device memory
    /// until it is read.
    const FINDINGS: usize = 64;

    /// [`Stager::finish`]'s work.
    fn build(mut self) -> DfResult<GpuTable> {
        if let Some((partition, order)) = self.gathering.keys().next() {
            return Err(DataFusionError::Internal(format!(
                "device batch {order} of partition {partition} is missing pieces"
            )));
        }
        let partition_devices = (0..self.partitions.len()).map(|i| self.device_of(i)).collect();
        let mut partitions = Vec::with_capacity(self.partitions.len());
        for mut p in self.partitions {
            p.sort_by_key(|(order, _)| *order);
            for (_, b) in &p {
                timed(self.times.as_deref(), StagingStep::Wait, || b.ready().synchronize())?;
            }
            partitions.push(p.into_iter().map(|(_, b)| b).collect::<Vec<_>>());
        }
        let findings = std::mem::take(&mut self.findings).into();
        timed(self.times.as_deref(), StagingStep::Extremes, || {
            take_extremes(&mut self.partition_stats, findings)
        })?;
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
                partitions,
                partition_devices,
                lanes,
                source: None,
            }),
        })
    }
}

#[cfg(test)]
mod tests {
    use arrow_array::Int32Array;

    use super::*;

    /// Reservations take bytes of the budget while they live; one that does not fit gets none.
    #[test]
    fn the_packing_budget_lends_only_what_it_has_until_it_is_given_back() {
        let budget = PackingBudget::new();
        let largest = PackingBudget::LARGEST;
        let n = (PackingBudget::BYTES / largest) as usize;
        let mut all: Vec<_> = (0..n)
            .map(|_| PackingBudget::reserve(&budget, largest).expect("fits"))
            .collect();
        assert!(PackingBudget::reserve(&budget, 1).is_none());
        all.pop();
        assert!(
            PackingBudget::reserve(&budget, largest + 1).is_none(),
            "larger than a batch may be"
        );
        all.push(PackingBudget::reserve(&budget, largest).expect("given back"));
        assert!(PackingBudget::reserve(&budget, 1).is_none());
        drop(all);
        assert_eq!(budget.left.load(Ordering::Acquire), PackingBudget::BYTES);
    }

    /// A run gathered on the device is one unit per batch, each knowing its piece of the device
    /// batch; otherwise (or when it is one batch) the run is one unit.
    #[test]
    fn runs_gathered_on_the_device_are_cut_into_pieces() {
        let batch =
            |n: i32| RecordBatch::try_from_iter([("a", Arc::new(Int32Array::from(vec![n])) as ArrayRef)]).unwrap();
        let run = vec![batch(1), batch(2), batch(3)];
        let pieces = Place::units(2, 7, run.clone(), true);
        assert_eq!(pieces.len(), 3);
        for (k, (place, unit)) in pieces.iter().enumerate() {
            let expected = Place {
                partition: 2,
                order: 7,
                piece: k,
                pieces: 3,
            };
            assert_eq!(*place, expected);
            assert_eq!(unit, &vec![run[k].clone()]);
        }
        assert_eq!(Place::units(2, 7, run.clone(), false), vec![(Place::whole(2, 7), run)]);
        assert_eq!(
            Place::units(0, 1, vec![batch(4)], true),
            vec![(Place::whole(0, 1), vec![batch(4)])]
        );
    }
}
