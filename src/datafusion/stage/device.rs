//! The CUDA side of a stage: the generated kernels run over each batch of one device, the groups
//! and accumulators stay in device memory until the last batch, and only they are copied to the
//! host (a few bytes per group).
//!
//! The group table starts with room for the groups the table's statistics allow (at most the
//! device's rows; small when they say nothing) and grows by four (re-inserting the groups found so
//! far with `stage_rehash`) whenever a batch finds it full; the batch's `stage_groups` then runs
//! again, which is safe because inserting a key is idempotent and no accumulator has been touched
//! yet.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaFunction, CudaStream};

use std::collections::BTreeMap;

use arrow_array::{Array, ArrayRef, RecordBatch, new_null_array};
use arrow_schema::{DataType, Schema};
use arrow_select::interleave::interleave;

use super::super::device_filter::{Scratch, column_args, compact, gather_to_host, selected_rows, strings_from_refs};
use super::super::nvrtc::{BLOCK, cuda_stream, function, launch, launch_shared};
use super::build::BuildRows;
use super::emit::{self, GroupTable};
use super::expr::late_literals;
use super::layout::{JoinKind, JoinStep, NO_ROW, StagePlan};
use super::narrow::Narrowing;
use super::{Outcome, StageResult};
use crate::array::{DeviceArrayData, DeviceRecordBatch};
use crate::device::{Device, Stream};
use crate::error::Error;
use crate::memory::{DeviceBuffer, MemoryResource, StridedView};

/// Group-table slots a stage starts with, at least.
const INITIAL_SLOTS: u64 = 4096;
/// The most groups a stage makes room for up front (from statistics); more grow the table.
const PRESIZED_GROUPS: u64 = 1 << 24;
/// Dynamic shared memory a block may use for its groups' accumulators.
const SHARED_BYTES: u64 = 32 << 10;
/// Blocks of the grid-stride accumulation.
const MAX_BLOCKS: u64 = 2048;

const FLAG_TABLE_FULL: u32 = 1;
const FLAG_LONG_KEY: u32 = 2;
const FLAG_OVERFLOW: u32 = 4;
const FLAG_DIV_ZERO: u32 = 8;
const FLAG_DUPLICATE_KEY: u32 = 16;
const FLAG_NULL_BUILD_KEY: u32 = 32;
// What a probe knows of a join's build side (`kernels/stage.cu`).
const BUILD_EMPTY: u64 = 0;
const BUILD_ROWS: u64 = 1;
const BUILD_NULL_KEY: u64 = 2;

/// Kernels of one stage on one device.
struct Kernels {
    groups: Option<CudaFunction>,
    accumulate: CudaFunction,
    init: CudaFunction,
    rehash: CudaFunction,
    emit: CudaFunction,
    /// A rows stage's `stage_select` and `stage_project`.
    rows: Option<(CudaFunction, CudaFunction)>,
}

/// The device side of a stage over the batches of one device.
pub(crate) struct DeviceStage<'p> {
    plan: &'p StagePlan,
    stream: Stream,
    cuda: Arc<CudaStream>,
    resource: MemoryResource,
    kernels: Kernels,
    lit: DeviceBuffer,
    nw: u64,
    nslots: u64,
    /// Group table: slot states (`u32`) and key words, `mask + 1` slots.
    state: DeviceBuffer,
    keys: DeviceBuffer,
    mask: u64,
    /// At most this many groups before the table grows; the dense arrays below hold as many.
    max_groups: u64,
    group_keys: DeviceBuffer,
    /// Accumulator slots, slot-major with a stride of `max_groups`.
    acc: DeviceBuffer,
    /// The kernels' flags word, then the group count (two `u32`s, read back together).
    status: DeviceBuffer,
    /// Scratch memory of batches whose kernels may still run, released after the stream's next
    /// synchronisation.
    pending: Vec<DeviceBuffer>,
    /// Time spent compiling (or finding compiled) kernels.
    pub(crate) compile_time: Duration,
    /// For row-reference aggregates (`MIN`/`MAX` of strings and wide decimals): per batch and per
    /// such aggregate, the column's values and data buffer addresses (a view column's data is a
    /// table of its buffers' addresses, in `_row_tables`, which only keeps them alive), and the
    /// columns, gathered at the end.
    refs: DeviceBuffer,
    _row_tables: Vec<DeviceBuffer>,
    row_columns: Vec<Vec<DeviceArrayData>>,
    /// The index of the next batch among the device's batches.
    batch: u64,
    /// The joins' build sides on the device, their hash tables and the buffers that only keep
    /// their kernel arguments alive.
    _joins: Vec<DeviceBuffer>,
    _built: Vec<DeviceRecordBatch>,
    /// The kernel arguments of the build columns the stage reads, then of each join's table.
    join_args: Vec<u64>,
}

/// The status words of a stage (`status`): the kernels' flags and the group count.
fn status_words(status: &DeviceBuffer, stream: &Stream) -> StageResult<(u32, u32)> {
    let mut x = [0u8; 8];
    status.copy_to_host(0, &mut x, stream)?;
    let word = |i: usize| u32::from_le_bytes(x[i..i + 4].try_into().expect("4 bytes"));
    Ok((word(0), word(4)))
}

/// A join's build side on the device and its hash table.
struct BuiltJoin {
    batch: DeviceRecordBatch,
    slots: DeviceBuffer,
    keys: DeviceBuffer,
    mask: u64,
    /// What the probe knows of the build side: `BUILD_EMPTY`, `BUILD_ROWS` or `BUILD_NULL_KEY`
    /// (`kernels/stage.cu`).
    known: u64,
    /// Buffers the build kernel's arguments point into.
    scratch: Vec<DeviceBuffer>,
}

impl<'p> DeviceStage<'p> {
    /// Prepares a stage of `plan` over `batches` on `device` (CUDA), compiling its kernels once
    /// per context; [`add`](Self::add) must then be given the same batches in the same order.
    pub(crate) fn new(
        plan: &'p StagePlan,
        device: Device,
        stream: &Stream,
        batches: &[&DeviceRecordBatch],
        builds: &[BuildRows],
    ) -> StageResult<Self> {
        let source = plan
            .source
            .as_ref()
            .ok_or_else(|| Outcome::GiveBack("no kernels were generated".into()))?;
        let rows = batches.iter().map(|b| b.num_rows() as u64).sum::<u64>();
        let (stream, cuda) = cuda_stream(stream, device, "a device stage")?;
        let ctx = cuda.context().clone();
        let started = Instant::now();
        let (_, nw) = plan.key_layout();
        let kernels = Kernels {
            groups: (nw > 0)
                .then(|| function(&ctx, &source.source, "stage_groups"))
                .transpose()?,
            accumulate: function(&ctx, &source.source, "stage_accumulate")?,
            init: function(&ctx, &source.source, "stage_init")?,
            rehash: function(&ctx, &source.source, "stage_rehash")?,
            emit: function(&ctx, &source.source, "stage_emit")?,
            rows: plan
                .rows
                .is_some()
                .then(|| {
                    Ok::<_, Error>((
                        function(&ctx, &source.source, "stage_select")?,
                        function(&ctx, &source.source, "stage_project")?,
                    ))
                })
                .transpose()?,
        };
        let compile_time = started.elapsed();
        let resource = MemoryResource::default_for(device);
        let (slots, _) = plan.slot_layout();
        let nslots = slots.len() as u64;
        let nw = nw as u64;
        let (slots_n, max_groups) = if nw == 0 {
            (1, 1)
        } else {
            let expected = plan.group_bound().unwrap_or(0).min(rows).min(PRESIZED_GROUPS);
            let slots = (expected * 2).next_power_of_two().max(INITIAL_SLOTS);
            (slots, slots / 2)
        };
        let alloc = |len: u64| DeviceBuffer::alloc(resource, (len as usize).max(1), &stream);
        let zeroed = |len: u64| DeviceBuffer::zeroed(resource, (len as usize).max(1), &stream);
        let row_cols: Vec<usize> = plan.aggs.iter().filter_map(|a| a.row_column()).collect();
        let mut refs = Vec::new();
        let mut row_tables = Vec::new();
        let mut row_columns = Vec::new();
        for b in batches {
            // Each column's values and data addresses (see `column_args`), without validity and offset.
            let mut args = Vec::with_capacity(4 * row_cols.len());
            row_tables.extend(column_args(b, &row_cols, &mut args, resource, &stream)?);
            refs.extend(args.chunks_exact(4).flat_map(|a| [a[0], a[1]]));
            row_columns.push(row_cols.iter().map(|&c| b.column(c).clone()).collect::<Vec<_>>());
        }
        let refs: Vec<u8> = refs.iter().flat_map(|x| x.to_le_bytes()).collect();
        let literals = late_literals(&source.literals, &source.late)?;
        let lit = DeviceBuffer::from_host(&literals, resource, &stream)?;
        let mut status = zeroed(8)?;
        let joins: Vec<_> = plan.joins().collect();
        let mut built = Vec::with_capacity(joins.len());
        for (k, (j, rows)) in joins.iter().zip(builds).enumerate() {
            let build = function(&ctx, &source.source, &format!("join{k}_build"))?;
            let unique = j
                .kind
                .needs_unique_keys()
                .then(|| function(&ctx, &source.source, "join_unique"))
                .transpose()?;
            let kernels = (&build, unique.as_ref());
            let mut b = build_join(j, rows, kernels, &cuda, &stream, resource, &lit, &status)?;
            if j.kind == JoinKind::NullAwareAnti {
                // NOT IN's null rule asks whether this build side has a null key: the flag the
                // build kernel raised, read and cleared before the next join's build.
                let (flags, count) = status_words(&status, &stream)?;
                if flags & FLAG_NULL_BUILD_KEY != 0 {
                    b.known = BUILD_NULL_KEY;
                    let mut x = (flags & !FLAG_NULL_BUILD_KEY).to_le_bytes().to_vec();
                    x.extend_from_slice(&count.to_le_bytes());
                    status.copy_from_host(0, &x, &stream)?;
                }
            }
            built.push(b);
        }
        let width = plan.table.schema.fields().len();
        let mut join_args = Vec::new();
        let mut scratch = Vec::new();
        for c in plan.stage_columns().into_iter().filter(|&c| c >= width) {
            let k = joins.iter().rposition(|j| j.base <= c).expect("a build column");
            scratch.extend(column_args(
                &built[k].batch,
                &[c - joins[k].base],
                &mut join_args,
                resource,
                &stream,
            )?);
        }
        for b in &built {
            join_args.extend([b.slots.address(), b.keys.address(), b.mask, b.known]);
        }
        let mut s = DeviceStage {
            refs: DeviceBuffer::from_host(&refs, resource, &stream)?,
            _row_tables: row_tables,
            row_columns,
            batch: 0,
            join_args,
            _built: built.iter().map(|b| b.batch.clone()).collect(),
            _joins: built
                .into_iter()
                .flat_map(|b| [b.slots, b.keys].into_iter().chain(b.scratch))
                .chain(scratch)
                .collect(),
            lit,
            state: zeroed(slots_n * 4)?,
            keys: alloc(slots_n * nw * 8)?,
            mask: slots_n - 1,
            max_groups,
            group_keys: alloc(max_groups * nw * 8)?,
            acc: alloc(nslots * max_groups * 8)?,
            status,
            pending: Vec::new(),
            plan,
            cuda,
            resource,
            kernels,
            nw,
            nslots,
            compile_time,
            stream,
        };
        s.init_acc(0)?;
        if !s.join_args.is_empty() {
            let (flags, _) = s.read_status()?;
            if flags & FLAG_DUPLICATE_KEY != 0 {
                return Err(Outcome::GiveBack(
                    "a join's build side has duplicate keys where the stage reads its matches".into(),
                ));
            }
            s.check(flags)?;
        }
        Ok(s)
    }

    fn alloc(&self, len: u64) -> StageResult<DeviceBuffer> {
        Ok(DeviceBuffer::alloc(self.resource, (len as usize).max(1), &self.stream)?)
    }

    /// Sets the accumulators of groups `from..max_groups` to their initial values.
    fn init_acc(&mut self, from: u64) -> StageResult<()> {
        let n = self.max_groups - from;
        let args = [self.acc.address(), self.max_groups, from, self.max_groups];
        launch(&self.cuda, &self.kernels.init, n.div_ceil(BLOCK as u64), BLOCK, &args)?;
        Ok(())
    }

    /// The flags word and the group count.
    fn read_status(&self) -> StageResult<(u32, u64)> {
        let (flags, count) = status_words(&self.status, &self.stream)?;
        Ok((flags, u64::from(count)))
    }

    fn write_status(&mut self, flags: u32, count: u32) -> StageResult<()> {
        let mut x = flags.to_le_bytes().to_vec();
        x.extend_from_slice(&count.to_le_bytes());
        self.status.copy_from_host(0, &x, &self.stream)?;
        Ok(())
    }

    fn flags_address(&self) -> u64 {
        self.status.address()
    }

    fn count_address(&self) -> u64 {
        self.status.address() + 4
    }

    /// Raises the errors the kernels flagged.
    fn check(&self, flags: u32) -> StageResult<()> {
        if flags & FLAG_LONG_KEY != 0 {
            return Err(Outcome::GiveBack(
                "a group or join key string longer than its key words hold (the column's longest value, \
                 at most 255 bytes)"
                    .into(),
            ));
        }
        if flags & FLAG_DIV_ZERO != 0 {
            return Err(Outcome::Fail(arrow_schema::ArrowError::DivideByZero.into()));
        }
        if flags & FLAG_OVERFLOW != 0 {
            return Err(Outcome::Fail(
                arrow_schema::ArrowError::ArithmeticOverflow("in a device stage's arithmetic".into()).into(),
            ));
        }
        Ok(())
    }

    /// Quadruples the group table and the dense arrays, keeping the groups found so far.
    fn grow(&mut self, groups: u64) -> StageResult<()> {
        let slots = (self.mask + 1) * 4;
        let max_groups = slots / 2;
        let (nw, nslots) = (self.nw, self.nslots);
        let state = DeviceBuffer::zeroed(self.resource, slots as usize * 4, &self.stream)?;
        let keys = self.alloc(slots * nw * 8)?;
        let mut group_keys = self.alloc(max_groups * nw * 8)?;
        group_keys.copy_from(0, &self.group_keys.slice(0, (groups * nw * 8) as usize)?, &self.stream)?;
        let args = [
            group_keys.address(),
            nw,
            groups,
            state.address(),
            keys.address(),
            slots - 1,
        ];
        launch(
            &self.cuda,
            &self.kernels.rehash,
            groups.div_ceil(BLOCK as u64),
            BLOCK,
            &args,
        )?;
        let acc = self.alloc(nslots * max_groups * 8)?;
        let old = std::mem::replace(&mut self.acc, acc);
        let old_stride = self.max_groups;
        self.max_groups = max_groups;
        self.init_acc(0)?;
        for s in 0..nslots {
            let column = old.slice((s * old_stride * 8) as usize, (groups * 8) as usize)?;
            self.acc
                .copy_from((s * max_groups * 8) as usize, &column, &self.stream)?;
        }
        self.state = state;
        self.keys = keys;
        self.group_keys = group_keys;
        self.mask = slots - 1;
        Ok(())
    }

    /// Adds the rows of `batch` (on this stage's device).
    pub(crate) fn add(&mut self, batch: &DeviceRecordBatch) -> StageResult<()> {
        let index = self.batch;
        self.batch += 1;
        let n = batch.num_rows() as u64;
        if n == 0 {
            return Ok(());
        }
        if n > u32::MAX as u64 {
            return Err(Outcome::GiveBack(format!("a batch of {n} rows")));
        }
        // A row reference holds the element's index in 32 bits.
        if self.row_columns[index as usize]
            .iter()
            .any(|a| (a.offset() + a.len()) as u64 > u32::MAX as u64)
        {
            return Err(Outcome::GiveBack("a column of more than 2^32 elements".into()));
        }
        self.stream.wait(batch.ready())?;
        let mut cols = Vec::new();
        let views = column_args(batch, &self.plan.columns, &mut cols, self.resource, &self.stream)?;
        let row_group = if self.nw > 0 { Some(self.alloc(n * 4)?) } else { None };
        let joins = self.plan.joins().count() as u64;
        let jrows = if self.nw > 0 && joins > 0 {
            Some(self.alloc(n * joins * 4)?)
        } else {
            None
        };
        let jrows_address = jrows.as_ref().map_or(0, DeviceBuffer::address);
        cols.extend_from_slice(&self.join_args);
        let mut groups = 1;
        if let (Some(rg), Some(f)) = (&row_group, self.kernels.groups.clone()) {
            loop {
                let mut args = vec![
                    n,
                    rg.address(),
                    self.state.address(),
                    self.keys.address(),
                    self.mask,
                    self.group_keys.address(),
                    self.count_address(),
                    self.max_groups,
                    self.flags_address(),
                    self.lit.address(),
                    jrows_address,
                ];
                args.extend_from_slice(&cols);
                launch(&self.cuda, &f, n.div_ceil(BLOCK as u64), BLOCK, &args)?;
                let (flags, count) = self.read_status()?;
                // The stream is idle: the earlier batches' scratch memory can go.
                self.pending.clear();
                self.check(flags)?;
                if flags & FLAG_TABLE_FULL == 0 {
                    groups = count;
                    break;
                }
                let kept = count.min(self.max_groups);
                self.write_status(0, kept as u32)?;
                self.grow(kept)?;
            }
        }
        let shared = self.nslots * groups * 8 <= SHARED_BYTES;
        let mut args = vec![
            n,
            row_group.as_ref().map_or(0, DeviceBuffer::address),
            self.acc.address(),
            self.max_groups,
            groups,
            shared as u64,
            self.flags_address(),
            self.lit.address(),
            self.refs.address(),
            index,
            jrows_address,
        ];
        args.extend_from_slice(&cols);
        let grid = n.div_ceil(BLOCK as u64).min(MAX_BLOCKS);
        let bytes = if shared { (self.nslots * groups * 8) as u32 } else { 0 };
        launch_shared(&self.cuda, &self.kernels.accumulate, grid, BLOCK, bytes, &args)?;
        self.pending.extend(views);
        self.pending.extend(row_group);
        self.pending.extend(jrows);
        // The accumulation's flags are read with the next batch's groups, or by `finish`: a stage
        // without keys synchronises once, at the end.
        Ok(())
    }

    /// A rows stage's output for the rows of `batch` (on this stage's device) that its pipeline
    /// keeps, and the bytes copied to the host; `None` when it keeps none.
    pub(crate) fn rows(&mut self, batch: &DeviceRecordBatch) -> StageResult<Option<(RecordBatch, u64)>> {
        let Some(out) = self.device_rows(batch)? else {
            return Ok(None);
        };
        let bytes = out.columns().iter().map(DeviceArrayData::size_in_bytes).sum::<usize>() as u64;
        Ok(Some((crate::transfer::dtoh(&out, &self.stream)?, bytes)))
    }

    /// A rows stage's output for the rows of `batch` that its pipeline keeps, in device memory
    /// (the kernels done); `None` when it keeps none. See [`codegen`](super::codegen) for the
    /// kernels.
    pub(crate) fn device_rows(&mut self, batch: &DeviceRecordBatch) -> StageResult<Option<DeviceRecordBatch>> {
        let plan = self.plan;
        let (Some((select, project)), Some(rows)) = (self.kernels.rows.clone(), plan.rows.as_ref()) else {
            return Err(Outcome::Fail(
                Error::InvalidData("rows of a stage that aggregates".into()).into(),
            ));
        };
        let n = batch.num_rows();
        if n == 0 {
            return Ok(None);
        }
        if n > u32::MAX as usize {
            return Err(Outcome::GiveBack(format!("a batch of {n} rows")));
        }
        self.stream.wait(batch.ready())?;
        let mut cols = Vec::new();
        let _views = column_args(batch, &plan.columns, &mut cols, self.resource, &self.stream)?;
        cols.extend_from_slice(&self.join_args);
        let sel = self.alloc(n as u64)?;
        let mut args = vec![n as u64, sel.address(), self.flags_address(), self.lit.address()];
        args.extend_from_slice(&cols);
        launch(&self.cuda, &select, (n as u64).div_ceil(BLOCK as u64), BLOCK, &args)?;
        let ctx = self.cuda.context().clone();
        let scratch = Scratch {
            resource: self.resource,
            stream: self.stream.clone(),
        };
        let selected = selected_rows(&ctx, &self.cuda, &scratch, &sel, n, usize::MAX)?;
        // Reading the count back waited for the selection: its flags are in.
        self.check(self.read_status()?.0)?;
        let Some((idx, m)) = selected else {
            return Ok(None);
        };
        let computed: Vec<usize> = (0..rows.len()).filter(|&k| plan.gathered(k).is_none()).collect();
        let nulls = DeviceBuffer::zeroed(self.resource, computed.len().max(1) * 8, &self.stream)?;
        let bitmap = m.div_ceil(32) * 4;
        let mut args = vec![
            m as u64,
            idx.address(),
            self.flags_address(),
            self.lit.address(),
            nulls.address(),
        ];
        let mut written = Vec::with_capacity(computed.len());
        for &k in &computed {
            let dt = plan.schema.field(k).data_type();
            let string = matches!(dt, DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View);
            let len = match dt {
                DataType::Boolean => m.div_ceil(8),
                // Strings by reference: each one's address here, its length in `lengths`.
                _ if string => m * 8,
                _ => {
                    m * dt
                        .primitive_width()
                        .ok_or_else(|| Error::Unsupported(format!("an output column of {dt}")))?
                }
            };
            let (values, validity) = (self.alloc(len.max(bitmap) as u64)?, self.alloc(bitmap as u64)?);
            args.extend([values.address(), validity.address()]);
            let lengths = string.then(|| self.alloc(len as u64)).transpose()?;
            args.extend(lengths.as_ref().map(DeviceBuffer::address));
            written.push((values.slice(0, len)?, validity.slice(0, m.div_ceil(8))?, lengths));
        }
        args.extend_from_slice(&cols);
        launch(&self.cuda, &project, (m as u64).div_ceil(BLOCK as u64), BLOCK, &args)?;
        // The string outputs' columns, assembled from their references while the batch's columns
        // and the literals they point into are alive.
        let written = written
            .into_iter()
            .zip(&computed)
            .map(|((values, validity, lengths), &k)| {
                let buffers = match lengths {
                    Some(lengths) => {
                        let dt = plan.schema.field(k).data_type();
                        strings_from_refs(&ctx, &self.cuda, &scratch, dt, (&values, &lengths), m)?
                    }
                    None => vec![values],
                };
                Ok((buffers, validity))
            })
            .collect::<StageResult<Vec<_>>>()?;
        let mut gathered = (0..rows.len())
            .map(|k| {
                plan.gathered(k)
                    .map(|c| compact(&ctx, &self.cuda, &scratch, batch.column(c), &idx, m))
            })
            .collect::<Vec<_>>()
            .into_iter();
        // Reading the counts back waits for the kernels: the scratch memory can go on return.
        let mut counts = vec![0u8; computed.len() * 8];
        nulls.copy_to_host(0, &mut counts, &self.stream)?;
        self.check(self.read_status()?.0)?;
        let mut written = written.into_iter().zip(counts.chunks_exact(8));
        let mut arrays = Vec::with_capacity(rows.len());
        for field in plan.schema.fields() {
            arrays.push(match gathered.next().flatten().transpose()? {
                Some(column) => column,
                None => {
                    let ((buffers, validity), count) = written
                        .next()
                        .ok_or_else(|| Error::InvalidData("a stage's output column is missing".into()))?;
                    let count = u64::from_le_bytes(count.try_into().expect("8 bytes")) as usize;
                    let validity = (count > 0).then_some(validity);
                    DeviceArrayData::try_new(field.data_type().clone(), m, 0, Some(count), validity, buffers, vec![])?
                }
            });
        }
        Ok(Some(DeviceRecordBatch::try_new(
            plan.schema.clone(),
            arrays,
            m,
            self.stream.record()?,
        )?))
    }

    /// The stage's state batch (see [`emit`](super::emit)), with only the groups `narrowing`
    /// keeps, and the bytes copied to the host.
    pub(crate) fn finish(self, narrowing: Option<&Narrowing>) -> StageResult<(RecordBatch, u64)> {
        let (flags, count) = self.read_status()?;
        self.check(flags)?;
        let count = if self.nw == 0 { 1 } else { count as usize };
        let mut copied = 0;
        let extremes = if count == 0 {
            vec![]
        } else {
            self.extremes(count, &mut copied)?
        };
        let table = GroupTable {
            count,
            group_keys: &self.group_keys,
            nw: self.nw,
            acc: &self.acc,
            stride: self.max_groups,
        };
        let kernel = (&self.kernels.emit, &self.cuda);
        let (batch, bytes) = emit::state_batch(
            self.plan,
            &table,
            &extremes,
            narrowing,
            kernel,
            self.resource,
            &self.stream,
        )?;
        Ok((batch, copied + bytes))
    }

    /// The values of each row-reference aggregate's groups (null for a group without one),
    /// gathered on the device batch by batch; adds the bytes copied to `copied`.
    fn extremes(&self, count: usize, copied: &mut u64) -> StageResult<Vec<Option<ArrayRef>>> {
        let (_, first) = self.plan.slot_layout();
        let mut k = 0;
        let mut out = Vec::with_capacity(self.plan.aggs.len());
        for (a, spec) in self.plan.aggs.iter().enumerate() {
            let Some(c) = spec.row_column() else {
                out.push(None);
                continue;
            };
            // The aggregate's count and row-reference slots.
            let slots = self.acc.slice(
                first[a] * self.max_groups as usize * 8,
                (self.max_groups as usize + count) * 8,
            )?;
            let acc = StridedView::<u64>::with_strides(slots, &[2, count], &[self.max_groups as isize * 8, 8])?
                .copy_to_host(&self.stream)?;
            *copied += (acc.len() * 8) as u64;
            let row = |g: usize| (acc[g] > 0).then(|| acc[count + g]).filter(|&r| r != NO_ROW);
            let mut per_batch: BTreeMap<u64, Vec<u32>> = BTreeMap::new();
            for r in (0..count).filter_map(row) {
                per_batch.entry(r >> 32).or_default().push(r as u32);
            }
            let dt = self.plan.table.schema.field(c).data_type();
            let mut sources = vec![new_null_array(dt, 1)];
            let mut at = BTreeMap::new();
            for (b, mut rows) in per_batch {
                rows.sort_unstable();
                rows.dedup();
                let column = self
                    .row_columns
                    .get(b as usize)
                    .and_then(|cs| cs.get(k))
                    .ok_or_else(|| Error::InvalidData(format!("a row reference to batch {b}")))?;
                let values = gather_to_host(column, &rows, &self.stream)?;
                *copied += values.get_array_memory_size() as u64;
                at.insert(b, (sources.len(), rows));
                sources.push(values);
            }
            let indices: Vec<(usize, usize)> = (0..count)
                .map(|g| match row(g) {
                    None => (0, 0),
                    Some(r) => {
                        let (source, rows) = &at[&(r >> 32)];
                        (*source, rows.binary_search(&(r as u32)).unwrap_or(0))
                    }
                })
                .collect();
            let sources: Vec<&dyn Array> = sources.iter().map(|a| a.as_ref()).collect();
            out.push(Some(interleave(&sources, &indices)?));
            k += 1;
        }
        Ok(out)
    }
}

/// Copies a join's build side to the device and hashes its rows by their keys with the join's
/// build kernel, then, where given, checks with `join_unique` that no two rows share a key. An
/// empty build side becomes one row of nulls that no key finds, so that kernels reading a
/// match's columns stay in bounds.
#[allow(clippy::too_many_arguments)]
fn build_join(
    j: &JoinStep,
    rows: &BuildRows,
    (build, unique): (&CudaFunction, Option<&CudaFunction>),
    cuda: &Arc<CudaStream>,
    stream: &Stream,
    resource: MemoryResource,
    lit: &DeviceBuffer,
    status: &DeviceBuffer,
) -> StageResult<BuiltJoin> {
    let n = rows.num_rows() as u64;
    let batch = match rows {
        BuildRows::Device(batch) => batch.clone(),
        BuildRows::Host(rows) if n == 0 => {
            let fields: Vec<_> = rows
                .schema()
                .fields()
                .iter()
                .map(|f| f.as_ref().clone().with_nullable(true))
                .collect();
            let columns = fields.iter().map(|f| new_null_array(f.data_type(), 1)).collect();
            let host = RecordBatch::try_new(Arc::new(Schema::new(fields)), columns)?;
            crate::transfer::htod_async(&host, resource, stream)?
        }
        BuildRows::Host(rows) => crate::transfer::htod_async(rows, resource, stream)?,
    };
    stream.wait(batch.ready())?;
    let nw = j.key_layout().1 as u64;
    let nslots = (n * 2).next_power_of_two().max(16);
    let slots = DeviceBuffer::zeroed(resource, (nslots * 4) as usize, stream)?;
    let keys = DeviceBuffer::alloc(resource, (nslots * nw * 8).max(8) as usize, stream)?;
    let mut args = vec![
        n,
        slots.address(),
        keys.address(),
        nslots - 1,
        status.address(),
        lit.address(),
    ];
    let scratch = column_args(&batch, &j.key_columns(), &mut args, resource, stream)?;
    if n > 0 {
        launch(cuda, build, n.div_ceil(BLOCK as u64), BLOCK, &args)?;
    }
    if let Some(unique) = unique {
        let args = [nslots - 1, slots.address(), keys.address(), nw, status.address()];
        launch(cuda, unique, nslots.div_ceil(BLOCK as u64), BLOCK, &args)?;
    }
    Ok(BuiltJoin {
        batch,
        slots,
        keys,
        mask: nslots - 1,
        known: if n == 0 { BUILD_EMPTY } else { BUILD_ROWS },
        scratch,
    })
}
