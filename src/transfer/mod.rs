//! Copies of whole record batches between the host and a device.
//!
//! Host to device: plan every buffer (64-byte aligned, only the bytes a slice views), pack the
//! batch into pinned staging on the pool's threads (a small batch part by part while it is still
//! being planned, a large one in chunks while the previous chunk's DMA runs), and issue as few DMAs
//! as that allows into one device allocation; the device arrays are views of it.
//!
//! Device to host: the buffers of each allocation are copied in one DMA per contiguous span into one
//! pinned block, whose ranges become the arrow buffers without another copy. The block goes back
//! to the pinned pool when the last arrow buffer drops.
//!
//! On the CPU device the same plans run with `memcpy`.

mod plan;

use std::cell::OnceCell;
use std::collections::VecDeque;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use arrow_array::{Array, ArrayRef, RecordBatch, RecordBatchOptions, make_array};
use arrow_data::ArrayData;
use arrow_schema::SchemaRef;
use cudarc::driver::sys;
use rayon::prelude::*;

use crate::array::{DeviceArrayData, DeviceRecordBatch};
use crate::device::{Device, Event, Stream};
use crate::error::{Error, Result, try_collect};
use crate::memory::pinned::PinnedPool;
use crate::memory::{ALIGNMENT, DeviceBuffer, MemoryResource, copy, stream_for};

use plan::{Handoff, Layout, Part, Plan};

/// Bytes packed and sent per DMA on large uploads.
const CHUNK: usize = 32 << 20;
/// The first bytes of an upload, packed into one staging block while the batch is planned.
const EARLY: usize = 4 << 20;
/// The bytes of that block handed to a pool thread at a time.
const SEGMENT: usize = 128 << 10;
/// Pool threads that pack those parts.
const PACKERS: usize = 4;
/// Chunks whose DMA may be in flight while the next is packed.
const IN_FLIGHT: usize = 4;

/// Copies `batch` to `device` and returns when the copy has finished.
pub fn htod(batch: &RecordBatch, device: Device, stream: &Stream) -> Result<DeviceRecordBatch> {
    let out = htod_async(batch, MemoryResource::default_for(device), stream)?;
    out.ready().synchronize()?;
    Ok(out)
}

/// Copies `batch` into memory of `resource`. Returns once `batch` has been read (it may be dropped
/// then); the result's [`DeviceRecordBatch::ready`] event completes when the data is in place.
pub fn htod_async(batch: &RecordBatch, resource: MemoryResource, stream: &Stream) -> Result<DeviceRecordBatch> {
    let arrays: Vec<&dyn Array> = batch.columns().iter().map(|c| c.as_ref()).collect();
    let (columns, ready) = upload(&arrays, resource, stream)?;
    DeviceRecordBatch::try_new(batch.schema(), columns, batch.num_rows(), ready)
}

/// Copies one array to `device` and returns when the copy has finished.
pub fn htod_array(array: &dyn Array, device: Device, stream: &Stream) -> Result<DeviceArrayData> {
    let (mut columns, ready) = upload(&[array], MemoryResource::default_for(device), stream)?;
    ready.synchronize()?;
    Ok(columns.remove(0))
}

/// Copies `arrays` into one allocation of `resource`; returns the device arrays and the event of
/// the last copy.
///
/// For a GPU: the first [`EARLY`] bytes are packed into one pinned staging block while the batch is
/// still being planned: every [`SEGMENT`] bytes planned are cut off as a part, which one of
/// [`PACKERS`] pool threads (started with the upload, so they are awake by then) packs; this thread
/// packs the parts no pool thread has started on once it needs them. They go to the device in a few
/// copies, each of the parts packed since the last, while the device arrays are built. The rest of
/// a larger batch goes through [`send_chunks`].
fn upload(arrays: &[&dyn Array], resource: MemoryResource, stream: &Stream) -> Result<(Vec<DeviceArrayData>, Event)> {
    let to_data = || arrays.iter().map(|a| a.to_data()).collect::<Vec<_>>();
    let device = resource.device();
    let stream = stream_for(stream, device, Device::Cpu)?;
    let Some(ordinal) = device.ordinal().filter(|_| !device.is_host_accessible()) else {
        let data = to_data();
        let mut plan = Plan::default();
        let layouts = try_collect(data.iter().map(|d| plan.array(d)))?;
        let mut memory = DeviceBuffer::alloc(resource, plan.size(), &stream)?;
        let out = memory
            .host_slice_mut()
            .ok_or_else(|| Error::Unsupported(format!("{device} is not host-accessible")))?;
        plan.fill_parallel(0, out);
        let columns = try_collect(layouts.iter().map(|l| l.to_device(&memory)))?;
        return Ok((columns, Event::completed()));
    };
    let pool = PinnedPool::shared(MemoryResource::PinnedHost(ordinal))?;
    release_finished();
    stream.bind()?;
    // Chunks of a large batch, each with the event of its copy: their staging goes back to the
    // pool as they complete, so a few chunks' worth of it serves the whole batch.
    let mut in_flight: VecDeque<(Keep, Event)> = VecDeque::new();
    // What the other copies read: kept until the last copy is done.
    let mut keep: Vec<Keep> = Vec::new();
    // The first EARLY bytes are packed into one block, part by part while the rest is planned.
    let mut early = pool.take(EARLY)?;
    let early_at = early.address();
    let send_early = |memory: &DeviceBuffer, range: Range<usize>| {
        // SAFETY: the range lies in both allocations; `early` is kept until the copy is done.
        unsafe {
            copy(
                memory.address() + range.start as u64,
                device,
                early_at + range.start as u64,
                Device::CudaHost(ordinal),
                range.len(),
                &stream,
            )
        }
    };
    let free = early
        .host_slice_mut()
        .ok_or_else(|| Error::Unsupported("staging is not host memory".into()))?;
    // Filled once the packers have been started (below): copying the arrays' layouts out takes
    // long enough for them to wake.
    let data: OnceCell<Vec<ArrayData>> = OnceCell::new();
    let handoff = Handoff::default();
    let result = rayon::in_place_scope(|scope| {
        // The packers start first, to be awake by the time the first part is cut (if one will be).
        let bytes: usize = arrays.iter().map(|a| a.get_buffer_memory_size()).sum();
        if bytes >= 2 * SEGMENT {
            let packers = rayon::current_num_threads().min(PACKERS);
            let handoff = &handoff;
            scope.spawn(move |s| {
                for _ in 1..packers {
                    s.spawn(move |_| handoff.pack());
                }
                handoff.pack();
            });
        }
        let planned = plan_in_parts(data.get_or_init(to_data), free, &handoff);
        // The packers stop once the queue is empty, however planning ended.
        handoff.close();
        let (plan, layouts, parts, rest) = planned?;
        let memory = DeviceBuffer::alloc(resource, plan.size(), &stream)?;
        // Sends the parts packed since the last call, in one copy.
        let mut sent = 0;
        let send_packed = |sent: &mut usize| {
            let packed = parts
                .iter()
                .skip_while(|p| p.range().end <= *sent)
                .take_while(|p| p.is_packed())
                .last()
                .map_or(*sent, |p| p.range().end);
            if packed > *sent {
                send_early(&memory, *sent..packed)?;
                *sent = packed;
            }
            Ok::<_, Error>(())
        };
        send_packed(&mut sent)?;
        send_chunks(&plan, rest, &memory, &pool, &stream, &mut keep, &mut in_flight)?;
        // The device arrays are built while the pool packs, and what it has packed is sent on the
        // way, so that little is left to copy at the end.
        let mut columns = Vec::with_capacity(layouts.len());
        for (i, layout) in layouts.iter().enumerate() {
            columns.push(layout.to_device(&memory)?);
            if i % 32 == 31 {
                send_packed(&mut sent)?;
            }
        }
        // Parts no pool thread has started on are packed here, so nothing waits on an idle pool.
        parts.iter().for_each(|p| p.pack());
        send_packed(&mut sent)?;
        Ok((columns, stream.record()?))
    });
    keep.push(Box::new(early));
    // What the copies read stays until they are done: until the last one's event, or, when none
    // could be recorded, until the stream has finished.
    match result
        .as_ref()
        .ok()
        .map(|(_, e)| e.clone())
        .or_else(|| stream.record().ok())
    {
        Some(done) => in_flight.extend(keep.into_iter().map(|k| (k, done.clone()))),
        None => {
            let _ = stream.synchronize();
        }
    }
    defer_release(in_flight);
    result
}

/// Sends `rest` of `plan` (what was not packed while planning) into `memory`: plain copies of at
/// least [`DIRECT_MIN`] bytes from pinned memory straight from their source, the rest through
/// [`CHUNK`]s of pinned staging from `pool` packed on every core, each sent while the next is packed.
/// What the copies read goes to `keep` (kept until the last copy is done) or, for the staging, to
/// `in_flight` with its copy's event.
fn send_chunks(
    plan: &Plan<'_>,
    rest: Range<usize>,
    memory: &DeviceBuffer,
    pool: &Arc<PinnedPool>,
    stream: &Stream,
    keep: &mut Vec<Keep>,
    in_flight: &mut VecDeque<(Keep, Event)>,
) -> Result<()> {
    if rest.is_empty() {
        return Ok(());
    }
    let device = memory.device();
    let pinned_host = Device::CudaHost(device.ordinal().unwrap_or(0));
    let direct: Vec<_> = plan
        .direct_copies(DIRECT_MIN, is_pinned)
        .into_iter()
        .filter(|d| d.dst >= rest.start)
        .collect();
    // The ranges between direct copies go through staging.
    let mut staged = Vec::with_capacity(direct.len() + 1);
    let mut at = rest.start;
    for d in direct {
        if d.dst > at {
            staged.push(at..d.dst);
        }
        at = (d.dst + d.src.len()).next_multiple_of(ALIGNMENT);
        // SAFETY: the source is pinned host memory of an arrow buffer kept alive (in `keep`) until
        // the last copy completes; the destination lies inside `memory`.
        unsafe {
            copy(
                memory.address() + d.dst as u64,
                device,
                d.src.as_ptr() as u64,
                pinned_host,
                d.src.len(),
                stream,
            )?
        };
        keep.push(Box::new(d.owner));
    }
    if at < rest.end {
        staged.push(at..rest.end);
    }
    for range in staged {
        for start in range.clone().step_by(CHUNK) {
            let len = CHUNK.min(range.end - start);
            if in_flight.len() >= IN_FLIGHT
                && let Some((_, done)) = in_flight.pop_front()
            {
                done.synchronize()?;
            }
            let mut stage = pool.take(len)?;
            let out = stage
                .host_slice_mut()
                .ok_or_else(|| Error::Unsupported("staging is not host memory".into()))?;
            plan.fill_parallel(start, out);
            // SAFETY: both ranges are valid; the staging block is kept (in `in_flight`, then the
            // deferred list) until the event recorded after the copy completes.
            unsafe {
                copy(
                    memory.address() + start as u64,
                    device,
                    stage.address(),
                    stage.device(),
                    len,
                    stream,
                )?
            };
            in_flight.push_back((Box::new(stage), stream.record()?));
        }
    }
    Ok(())
}

/// Plans `data`, cutting off every [`SEGMENT`] bytes of the first [`EARLY`] as a part to be packed
/// into the front of `free` and handing it to `handoff`. Returns the plan, the arrays' layouts, the
/// parts in order, and the range left for packing in chunks (empty when the whole plan was cut).
#[allow(clippy::type_complexity)]
fn plan_in_parts<'a>(
    data: &'a [ArrayData],
    mut free: &'a mut [u8],
    handoff: &Handoff<'a>,
) -> Result<(Plan<'a>, Vec<Layout>, Vec<Arc<Part<'a>>>, Range<usize>)> {
    let mut plan = Plan::default();
    let mut layouts = Vec::with_capacity(data.len());
    let mut parts = Vec::new();
    let mut cut = |plan: &mut Plan<'a>, free: &mut &'a mut [u8]| {
        let range = plan.cut();
        let (out, rest) = std::mem::take(free).split_at_mut(range.len());
        *free = rest;
        let part = Arc::new(Part::new(plan, range, out));
        handoff.push(part.clone());
        parts.push(part);
    };
    for d in data {
        if plan.size() <= EARLY && plan.uncut() >= SEGMENT {
            cut(&mut plan, &mut free);
        }
        layouts.push(plan.array(d)?);
        if plan.size() > EARLY {
            // No more parts: the pool threads need not wait for the rest of the planning.
            handoff.close();
        }
    }
    let rest = match plan.size() <= EARLY {
        true => {
            if plan.uncut() > 0 {
                cut(&mut plan, &mut free);
            }
            0..0
        }
        false => plan.cut(),
    };
    Ok((plan, layouts, parts, rest))
}

/// Plain copies at least this large from pinned memory skip the staging.
const DIRECT_MIN: usize = 1 << 20;

/// Whether host memory is page-locked (and so can be the source of an asynchronous DMA).
fn is_pinned(src: &[u8]) -> bool {
    let mut kind = 0u32;
    let mut attribute = sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE;
    let mut out = (&mut kind as *mut u32).cast::<std::ffi::c_void>();
    // SAFETY: a query about an address with one 4-byte `CUmemorytype` out-parameter. Unlike
    // cuPointerGetAttribute, the plural form succeeds for memory the driver does not know (pageable
    // memory), leaving the type 0, so it raises no API error.
    let status = unsafe { sys::cuPointerGetAttributes(1, &mut attribute, &mut out, src.as_ptr() as u64) };
    status == sys::CUresult::CUDA_SUCCESS && kind == sys::CUmemorytype::CU_MEMORYTYPE_HOST as u32
}

/// Something that must outlive an in-flight copy.
type Keep = Box<dyn std::any::Any + Send + Sync>;

/// Memory that a DMA may still be reading, kept until its event completes.
static DEFERRED: Mutex<Vec<(Keep, Event)>> = Mutex::new(Vec::new());

fn defer_release(items: VecDeque<(Keep, Event)>) {
    let mut deferred = DEFERRED.lock().unwrap_or_else(|p| p.into_inner());
    deferred.extend(items);
}

/// Drops what finished copies no longer need (staging goes back to its pool).
fn release_finished() {
    let mut deferred = DEFERRED.lock().unwrap_or_else(|p| p.into_inner());
    // An event that cannot be queried is kept: freeing memory a DMA may still read is worse.
    deferred.retain(|(_, e)| !e.is_complete().unwrap_or(false));
}

/// Copies `batch` to the host and returns it once the copy has finished and been validated.
pub fn dtoh(batch: &DeviceRecordBatch, stream: &Stream) -> Result<RecordBatch> {
    dtoh_async(batch, stream)?.wait()
}

/// Starts copying `batch` to the host; [`PendingBatch::wait`] finishes the job. The copy waits on
/// the batch's ready event on the device, without blocking the host.
pub fn dtoh_async(batch: &DeviceRecordBatch, stream: &Stream) -> Result<PendingBatch> {
    let gathered = gather(batch.columns(), batch.device(), Some(batch.ready()), stream)?;
    Ok(PendingBatch {
        schema: batch.schema().clone(),
        num_rows: batch.num_rows(),
        copy: Some(InFlight {
            memory: gathered.memory,
            _source: batch.clone(),
        }),
        layouts: gathered.layouts,
        first_half: gathered.first_half,
        event: gathered.event,
    })
}

/// Copies one array to the host and returns it once the copy has finished and been validated.
pub fn dtoh_array(array: &DeviceArrayData, stream: &Stream) -> Result<ArrayRef> {
    let gathered = gather(std::slice::from_ref(array), array.device(), None, stream)?;
    gathered.event.synchronize()?;
    Ok(make_array(
        gathered.layouts[0].to_host(&gathered.memory.to_arrow_buffer()?)?,
    ))
}

/// A device-to-host copy in flight. Dropping it without [`PendingBatch::wait`] is safe: what the
/// copy reads and writes is kept until it has finished.
#[derive(Debug)]
pub struct PendingBatch {
    schema: SchemaRef,
    num_rows: usize,
    /// `None` only once `wait` has taken it.
    copy: Option<InFlight>,
    layouts: Vec<Layout>,
    /// The bytes of the host block below this offset are in place when the event completes.
    first_half: Option<(usize, Event)>,
    event: Event,
}

/// The two ends of a copy: the host block it writes and the device arrays it reads.
#[derive(Debug)]
struct InFlight {
    memory: DeviceBuffer,
    _source: DeviceRecordBatch,
}

impl Drop for PendingBatch {
    fn drop(&mut self) {
        if let Some(copy) = self.copy.take()
            && !self.event.is_complete().unwrap_or(false)
        {
            defer_release([(Box::new(copy) as Keep, self.event.clone())].into());
        }
    }
}

impl PendingBatch {
    /// The number of rows the batch will have.
    pub fn num_rows(&self) -> usize {
        self.num_rows
    }

    /// The event that completes when the bytes have arrived.
    pub fn event(&self) -> &Event {
        &self.event
    }

    /// Waits for the copy and builds the record batch, validating every array.
    pub fn wait(mut self) -> Result<RecordBatch> {
        // Views of the block; until the copy is done, `self` keeps the block (and defers its release
        // if this returns early).
        let memory = self
            .copy
            .as_ref()
            .expect("a pending batch is waited for once")
            .memory
            .to_arrow_buffer()?;
        let build = |l: &Layout| Ok(make_array(l.to_host(&memory)?));
        // Validation reads every string: untrusted columns are validated on every core. Trusted
        // ones only need their arrays built, which threads would slow down (they would all count
        // references to the one host block); those whose bytes came with the first half of the
        // copy are built while the second half is on its way.
        let columns = if self.layouts.iter().all(|l| l.trusted) {
            let mut landed = match &self.first_half {
                Some((end, first)) => {
                    first.synchronize()?;
                    *end
                }
                None => 0,
            };
            let mut columns = Vec::with_capacity(self.layouts.len());
            for layout in &self.layouts {
                if layout.end() > landed {
                    self.event.synchronize()?;
                    landed = usize::MAX;
                }
                columns.push(build(layout)?);
            }
            columns
        } else {
            self.event.synchronize()?;
            self.layouts.par_iter().map(build).collect::<Result<Vec<_>>>()?
        };
        // The copy is done: nothing to defer.
        self.copy = None;
        let options = RecordBatchOptions::new().with_row_count(Some(self.num_rows));
        Ok(RecordBatch::try_new_with_options(
            self.schema.clone(),
            columns,
            &options,
        )?)
    }
}

/// One run of bytes in one allocation, copied in one piece.
struct Span {
    src: u64,
    len: usize,
    dst: usize,
}

/// A device-to-host copy issued by [`gather`].
struct Gathered {
    /// The host block.
    memory: DeviceBuffer,
    /// Where each array's buffers land in it.
    layouts: Vec<Layout>,
    /// For a large enough copy: where its first half ends, and the event that completes with it.
    first_half: Option<(usize, Event)>,
    /// The event of the last copy.
    event: Event,
}

/// Copies of at least this many bytes are sent in two halves, so that arrays in the first can be
/// built while the second is on its way.
const HALVES_MIN: usize = 256 << 10;

/// Copies every buffer of `arrays` into one host block.
fn gather(arrays: &[DeviceArrayData], device: Device, ready: Option<&Event>, stream: &Stream) -> Result<Gathered> {
    let stream = stream_for(stream, device, Device::Cpu)?;
    if let Some(ready) = ready {
        stream.wait(ready)?;
    }
    // Group buffers by allocation, in address order; nearby buffers of one allocation share a span.
    let all: Vec<&DeviceBuffer> = arrays.iter().flat_map(|a| a.all_buffers()).collect();
    let mut order: Vec<usize> = (0..all.len()).collect();
    order.sort_by_key(|&i| all[i].address());
    let buffers: Vec<&DeviceBuffer> = order.iter().map(|&i| all[i]).collect();
    let mut spans: Vec<Span> = Vec::new();
    let mut span_of = Vec::with_capacity(buffers.len());
    let mut size = 0usize;
    for (i, b) in buffers.iter().enumerate() {
        let joins = i > 0
            && b.shares_allocation(buffers[i - 1])
            && spans.last().is_some_and(|s| {
                let end = s.src + s.len as u64;
                b.address() <= end + 4096
            });
        if joins {
            let s = spans.last_mut().expect("joined span");
            s.len = s.len.max((b.address() + b.len() as u64 - s.src) as usize);
        } else {
            // Keep each span's address modulo the alignment, so aligned buffers stay aligned.
            let dst = size.next_multiple_of(ALIGNMENT) + (b.address() % ALIGNMENT as u64) as usize;
            spans.push(Span {
                src: b.address(),
                len: b.len(),
                dst,
            });
        }
        let s = spans.last().expect("span");
        size = size.max(s.dst + s.len);
        span_of.push(spans.len() - 1);
    }
    let mut first_half = None;
    let mut memory = match device {
        Device::Cpu => DeviceBuffer::alloc(MemoryResource::Host, size, &stream)?,
        _ => {
            let ordinal = device.ordinal().unwrap_or(0);
            PinnedPool::shared(MemoryResource::PinnedHost(ordinal))?.take(size)?
        }
    };
    match stream.cuda() {
        None => {
            let out = memory
                .host_slice_mut()
                .ok_or_else(|| Error::Unsupported("host block is not host memory".into()))?;
            copy_spans_on_host(&spans, out);
        }
        Some(_) => {
            let half = (size >= HALVES_MIN).then_some(size / 2);
            for s in &spans {
                // A span across the middle is sent in two pieces, an event between them.
                let cut = match half {
                    Some(h) if s.dst < h && h < s.dst + s.len => h - s.dst,
                    _ => s.len,
                };
                for (from, len) in [(0, cut), (cut, s.len - cut)] {
                    if len == 0 {
                        continue;
                    }
                    // SAFETY: each span lies inside one live allocation (its buffers are views of
                    // it) and inside `memory`; `memory` is not read until the event recorded after
                    // the piece completes.
                    unsafe {
                        copy(
                            memory.address() + (s.dst + from) as u64,
                            memory.device(),
                            s.src + from as u64,
                            device,
                            len,
                            &stream,
                        )?
                    };
                    if half == Some(s.dst + from + len) {
                        first_half = Some((s.dst + from + len, stream.record()?));
                    }
                }
            }
        }
    }
    let event = stream.record()?;
    // Where each buffer landed, in the order of `all_buffers`, which `host_layout` walks too.
    let mut place = vec![0..0; buffers.len()];
    for ((b, &si), &i) in buffers.iter().zip(&span_of).zip(&order) {
        let s = &spans[si];
        let start = s.dst + (b.address() - s.src) as usize;
        place[i] = start..start + b.len();
    }
    let mut place = place.into_iter();
    let layouts = arrays.iter().map(|a| host_layout(a, &mut place)).collect();
    Ok(Gathered {
        memory,
        layouts,
        first_half,
        event,
    })
}

fn copy_spans_on_host(spans: &[Span], out: &mut [u8]) {
    let base = out.as_mut_ptr() as usize;
    spans.par_iter().for_each(|s| {
        // SAFETY: spans are disjoint ranges of `out` (each starts past the previous end) and each
        // source is a live host-accessible buffer of at least `len` bytes.
        unsafe { std::ptr::copy_nonoverlapping(s.src as *const u8, (base + s.dst) as *mut u8, s.len) };
    });
}

/// The layout of `a` in the host block, taking its buffers' places (in `all_buffers` order).
fn host_layout(a: &DeviceArrayData, place: &mut impl Iterator<Item = std::ops::Range<usize>>) -> Layout {
    let mut at = || place.next().unwrap_or_default();
    let nulls = a.nulls.as_ref().map(|_| at());
    let buffers = a.buffers.iter().map(|_| at()).collect();
    Layout {
        data_type: a.data_type.clone(),
        len: a.len,
        offset: a.offset,
        null_count: a.null_count,
        nulls,
        buffers,
        children: a.children.iter().map(|c| host_layout(c, place)).collect(),
        trusted: a.trusted,
    }
}

impl DeviceRecordBatch {
    /// Copies a host batch to `device` on the device's shared stream; returns when it is there.
    pub fn from_record_batch(batch: &RecordBatch, device: Device) -> Result<Self> {
        htod(batch, device, &Stream::shared(device)?)
    }

    /// Copies the batch to the host on its device's shared stream.
    pub fn to_record_batch(&self) -> Result<RecordBatch> {
        dtoh(self, &Stream::shared(self.device())?)
    }
}
