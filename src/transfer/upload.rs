//! Host to device: [`htod`] and its variants.
//!
//! Every buffer is planned (see `plan`) into one device allocation and packed into pinned staging
//! (see `pack`): a small batch on the calling thread, each piece sent as soon as it is packed; a
//! larger one by the threads of the packing crew (see `crew`) and the calling thread, its first
//! megabytes in parts packed while the rest is planned and sent as they are packed, the rest on
//! the pool's threads in chunks while the previous chunk's DMA runs. The device arrays are
//! views of the allocation. A host-accessible destination is filled in place.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::Arc;

use arrow_array::{Array, RecordBatch};
use arrow_data::ArrayData;

use crate::array::{DeviceArrayData, DeviceRecordBatch};
use crate::device::{Device, Event, Stream};
use crate::error::{Error, Result, try_collect};
use crate::memory::pinned::PinnedPool;
use crate::memory::{ALIGNMENT, DeviceBuffer, MemoryResource, copy, stream_for};
use crate::trace::Laps;

use super::crew::Crew;
use super::deferred::{Keep, defer_release, release_finished};
use super::layout::Layout;
use super::pack::{CACHED_MAX, Cutter, Handoff};
use super::plan::{Plan, column_data, estimated_size, flat_size_bound};
use super::times::{StagingStep, StagingTimes, timed};

/// Bytes packed and sent per DMA on large uploads.
const CHUNK: usize = 32 << 20;
/// The first bytes of an upload, packed into one staging block while the batch is planned.
const EARLY: usize = 4 << 20;
/// The bytes of that block handed to a crew thread at a time: a thread packs one in a few
/// microseconds, so the packed bytes grow in small steps and are sent soon after they are packed.
const SEGMENT: usize = 64 << 10;
/// The least of the block's packed bytes sent in one copy before the last. Each copy costs the
/// calling thread about 2 µs to issue (`scripts/probes/copy_issue.c`) and the link about 2.7 µs
/// besides its bytes (on an H100, 1.3 MB of pinned memory took 29.2-29.4 µs to the device in one
/// copy, 39.4-39.5 µs in five, 53.0-53.1 µs in ten: `scripts/probes/split_copies.cu`); from about
/// 256 KiB on, the copies carry bytes faster than the crew packs them.
const SEND_MIN: usize = 256 << 10;
/// Chunks whose DMA may be in flight while the next is packed.
const IN_FLIGHT: usize = 4;
/// Batches of up to about this many bytes ([`estimated_size`]) are packed by the calling thread
/// alone (see [`upload_solo`]): handing parts to other threads costs more than they would save.
/// (On the H100 and H200 machines one thread packs about 10 GB/s: a 1.3 MB batch took 120 µs
/// alone, against 22 µs of the caller's time with four other threads.) It is the size up to which
/// plans are packed with ordinary stores, so the parts crew threads pack are always streamed past
/// the cache.
const SOLO: usize = CACHED_MAX;
/// The first piece of such a batch sent by itself; each next piece is twice as large, so that the
/// first DMA starts early and few are issued.
const FIRST_PIECE: usize = 64 << 10;

/// Copies `batch` to `device` and returns when the copy has finished.
pub fn htod(batch: &RecordBatch, device: Device, stream: &Stream) -> Result<DeviceRecordBatch> {
    let out = htod_async(batch, MemoryResource::default_for(device), stream)?;
    let mut laps = Laps::start();
    out.ready().synchronize()?;
    laps.lap("htod.synchronize");
    Ok(out)
}

/// Copies `batch` into memory of `resource`. Returns once `batch` has been read (it may be dropped
/// then); the result's [`DeviceRecordBatch::ready`] event completes when the data is in place.
pub fn htod_async(batch: &RecordBatch, resource: MemoryResource, stream: &Stream) -> Result<DeviceRecordBatch> {
    htod_async_timed(batch, resource, stream, None)
}

/// [`htod_async`], counting the time of its steps (the whole upload, allocations, packing, copies
/// issued, waits for staging) in `times`.
pub(crate) fn htod_async_timed(
    batch: &RecordBatch,
    resource: MemoryResource,
    stream: &Stream,
    times: Option<&StagingTimes>,
) -> Result<DeviceRecordBatch> {
    let arrays: Vec<&dyn Array> = batch.columns().iter().map(|c| c.as_ref()).collect();
    let (columns, ready) = timed(times, StagingStep::Upload, || upload(&arrays, resource, stream, times))?;
    let mut laps = Laps::start();
    // The columns of a record batch, each copied whole into one allocation: of the schema's types
    // and the batch's length, on one device.
    let out = DeviceRecordBatch::of_columns(batch.schema(), columns, batch.num_rows(), ready);
    laps.lap("htod.batch");
    Ok(out)
}

/// Copies one array to `device` and returns when the copy has finished.
pub fn htod_array(array: &dyn Array, device: Device, stream: &Stream) -> Result<DeviceArrayData> {
    let (mut columns, ready) = upload(&[array], MemoryResource::default_for(device), stream, None)?;
    ready.synchronize()?;
    Ok(columns.remove(0))
}

/// Copies `arrays` into one allocation of `resource`, counting its steps in `times`; returns the
/// device arrays and the event of the last copy.
fn upload(
    arrays: &[&dyn Array],
    resource: MemoryResource,
    stream: &Stream,
    times: Option<&StagingTimes>,
) -> Result<(Vec<DeviceArrayData>, Event)> {
    let device = resource.device();
    let stream = stream_for(stream, device, Device::Cpu)?;
    match device.ordinal().filter(|_| !device.is_host_accessible()) {
        None => upload_in_place(arrays, resource, &stream, times),
        Some(ordinal) => upload_staged(arrays, resource, &stream, ordinal, times),
    }
}

/// [`upload`] into host-accessible memory: the plan fills the allocation itself.
fn upload_in_place(
    arrays: &[&dyn Array],
    resource: MemoryResource,
    stream: &Stream,
    times: Option<&StagingTimes>,
) -> Result<(Vec<DeviceArrayData>, Event)> {
    let device = resource.device();
    let mut laps = Laps::start();
    let data = column_data(arrays);
    laps.lap("htod.to_data");
    let (plan, layouts) = plan_columns(arrays, &data)?;
    laps.lap("htod.plan");
    let mut memory = timed(times, StagingStep::Alloc, || {
        DeviceBuffer::alloc(resource, plan.size(), stream)
    })?;
    laps.lap("htod.alloc");
    let out = memory
        .host_slice_mut()
        .ok_or_else(|| Error::Unsupported(format!("{device} is not host-accessible")))?;
    plan.fill_parallel(0, out, times);
    laps.lap("htod.pack");
    let columns = try_collect(layouts.iter().map(|l| l.to_device(&memory)))?;
    laps.lap("htod.arrays");
    Ok((columns, Event::completed()))
}

/// [`upload`] to a GPU (CUDA device `ordinal`), through pinned staging.
///
/// The batch is planned column by column; its first [`EARLY`] bytes are cut into parts of
/// [`SEGMENT`] bytes of one pinned staging block as they are planned, which the [`Crew`]'s threads
/// pack while the rest is planned. A batch of flat columns has its allocation before it is
/// planned ([`flat_size_bound`]), so what is packed is sent, in order and in a few copies, while
/// the rest is planned; others, once they are planned. This thread then builds the device arrays
/// while the crew packs, packs the parts no other thread has started on, in order, and sends the
/// rest of what is packed. The rest of a larger batch goes through [`send_chunks`].
fn upload_staged(
    arrays: &[&dyn Array],
    resource: MemoryResource,
    stream: &Stream,
    ordinal: usize,
    times: Option<&StagingTimes>,
) -> Result<(Vec<DeviceArrayData>, Event)> {
    let device = resource.device();
    let mut laps = Laps::start();
    let pool = PinnedPool::shared(MemoryResource::PinnedHost(ordinal))?;
    release_finished();
    stream.bind()?;
    if arrays.iter().map(|a| estimated_size(*a)).sum::<usize>() <= SOLO {
        laps.lap("htod.setup");
        return upload_solo(arrays, resource, stream, &pool, times, laps);
    }
    // Chunks of a large batch, each with the event of its copy: their staging goes back to the
    // pool as they complete, so a few chunks' worth of it serves the whole batch.
    let mut in_flight: VecDeque<(Keep, Event)> = VecDeque::new();
    // What the other copies read: kept until the last copy is done.
    let mut keep: Vec<Keep> = Vec::new();
    // A batch of flat columns takes at most its estimate and each buffer's alignment: its
    // allocation is made before it is planned, so that its first parts are sent as they are
    // packed, while the rest is planned.
    let early_memory = match flat_size_bound(arrays) {
        Some(bound) => Some(timed(times, StagingStep::Alloc, || {
            DeviceBuffer::alloc(resource, bound, stream)
        })?),
        None => None,
    };
    // The first EARLY bytes are packed into one block, part by part while the rest is planned.
    let mut early = timed(times, StagingStep::Alloc, || pool.take(EARLY))?;
    let early_at = early.address();
    let send_early = |memory: &DeviceBuffer, range: Range<usize>| {
        timed(times, StagingStep::Copy, || {
            // SAFETY: the range lies in both allocations; `early` is kept until the copy is done.
            unsafe {
                copy(
                    memory.address() + range.start as u64,
                    device,
                    early_at + range.start as u64,
                    Device::CudaHost(ordinal),
                    range.len(),
                    stream,
                )
            }
        })
    };
    // Sends the packed parts of the handoff from `*next` on in one copy, if they come to at least
    // `min` bytes and lie in `memory`. The copy is traced as `htod.copy`, apart from the `step` it
    // interrupts.
    let send_packed = |laps: &mut Laps,
                       step: &'static str,
                       memory: &DeviceBuffer,
                       handoff: &Handoff<'_>,
                       next: &mut usize,
                       min: usize| {
        let mut packed = handoff.parts().skip(*next).take_while(|p| p.is_packed());
        if let Some(first) = packed.next() {
            let (count, end) = packed.fold((1, first.range().end), |(n, _), p| (n + 1, p.range().end));
            let range = first.range().start..end;
            if range.len() >= min && range.end <= memory.len() {
                laps.lap(step);
                send_early(memory, range)?;
                laps.lap("htod.copy");
                *next += count;
            }
        }
        Ok::<_, Error>(())
    };
    let free = early
        .host_slice_mut()
        .ok_or_else(|| Error::Unsupported("staging is not host memory".into()))?;
    let data = column_data(arrays);
    let data = &data;
    laps.lap("htod.to_data");
    let handoff = Handoff::new(EARLY.div_ceil(SEGMENT));
    let mut cutter = Cutter::new(free, SEGMENT, times);
    let result = Crew::get().help(&handoff, |help| {
        laps.lap("htod.wake");
        // The first of the handoff's parts not sent.
        let mut next = 0;
        let mut plan = Plan::for_columns(arrays.len());
        let mut layouts = Vec::with_capacity(arrays.len());
        // The first EARLY bytes are handed to the crew part by part as they are planned, so that
        // they are packed while the rest is planned.
        for (array, data) in arrays.iter().zip(data) {
            layouts.push(plan.column(*array, data.as_ref())?);
            handoff.push_all(cutter.cut_whole(&plan, plan.size().min(EARLY)));
            if let Some(memory) = &early_memory {
                send_packed(&mut laps, "htod.plan", memory, &handoff, &mut next, SEND_MIN)?;
            }
        }
        handoff.push_all(cutter.cut(&plan, plan.size().min(EARLY)));
        help.close();
        let (plan, rest) = (&plan, cutter.at()..plan.size());
        laps.lap("htod.plan");
        let memory = match early_memory {
            Some(memory) if memory.len() >= plan.size() => memory,
            early_memory => {
                // Copies sent into memory too small for the plan are sent again.
                next = 0;
                keep.extend(early_memory.map(|m| Box::new(m) as Keep));
                timed(times, StagingStep::Alloc, || {
                    DeviceBuffer::alloc(resource, plan.size(), stream)
                })?
            }
        };
        laps.lap("htod.alloc");
        // Whatever is packed by now is sent, however little, so that the link is busy while the
        // device arrays are built; and again after them.
        send_packed(&mut laps, "htod.arrays", &memory, &handoff, &mut next, 1)?;
        // The device arrays are built while the crew packs the rest and the first copies travel.
        let columns = try_collect(layouts.iter().map(|l| l.to_device(&memory)))?;
        laps.lap("htod.arrays");
        send_packed(&mut laps, "htod.pack", &memory, &handoff, &mut next, 1)?;
        let sink = Sink {
            memory: &memory,
            pool: &pool,
            stream,
            times,
        };
        // The parts are packed here in order, those a crew thread packs waited for, so that what
        // is packed is sent as soon as it is, at least SEND_MIN bytes at a time.
        for part in handoff.parts() {
            part.pack();
            send_packed(&mut laps, "htod.pack", &memory, &handoff, &mut next, SEND_MIN)?;
        }
        send_packed(&mut laps, "htod.pack", &memory, &handoff, &mut next, 1)?;
        let sent = handoff.parts().take(next).last().map_or(0, |p| p.range().end);
        if sent < rest.start {
            // Only a crew thread that panicked leaves a part unpacked.
            return Err(Error::InvalidData(format!(
                "bytes {sent}.. of the batch were not packed"
            )));
        }
        laps.lap("htod.pack");
        send_chunks(plan, rest, &sink, &mut keep, &mut in_flight)?;
        let done = timed(times, StagingStep::Copy, || stream.record())?;
        laps.lap("htod.send");
        Ok((columns, done))
    });
    // Once the crew's threads have left the handoff.
    laps.lap("htod.join");
    drop(handoff);
    keep.push(Box::new(early));
    retire(result.as_ref().ok().map(|(_, e)| e), stream, keep, in_flight);
    laps.lap("htod.retire");
    result
}

/// [`upload_staged`] of a batch of at most [`SOLO`] bytes: planned whole, then packed into one
/// block of pinned staging on this thread in pieces, each sent as soon as it is packed (the first
/// [`FIRST_PIECE`] bytes, then twice as many each time), so that the link carries one piece while
/// the next is packed and the device arrays are built while the last is on its way.
fn upload_solo(
    arrays: &[&dyn Array],
    resource: MemoryResource,
    stream: &Stream,
    pool: &Arc<PinnedPool>,
    times: Option<&StagingTimes>,
    mut laps: Laps,
) -> Result<(Vec<DeviceArrayData>, Event)> {
    let device = resource.device();
    let data = column_data(arrays);
    laps.lap("htod.to_data");
    let (plan, layouts) = plan_columns(arrays, &data)?;
    laps.lap("htod.plan");
    let size = plan.size();
    let memory = timed(times, StagingStep::Alloc, || {
        DeviceBuffer::alloc(resource, size, stream)
    })?;
    let mut staging = timed(times, StagingStep::Alloc, || pool.take(size))?;
    laps.lap("htod.alloc");
    let (from, from_device) = (staging.address(), staging.device());
    let mut send = || {
        let out = staging
            .host_slice_mut()
            .ok_or_else(|| Error::Unsupported("staging is not host memory".into()))?;
        let (mut start, mut piece) = (0, FIRST_PIECE);
        while start < size {
            let end = size.min(start + piece);
            timed(times, StagingStep::Pack, || plan.fill(start, &mut out[start..end]));
            timed(times, StagingStep::Copy, || {
                // SAFETY: the range lies in both allocations; the staging is kept until the last
                // copy is done (see `retire`).
                unsafe {
                    copy(
                        memory.address() + start as u64,
                        device,
                        from + start as u64,
                        from_device,
                        end - start,
                        stream,
                    )
                }
            })?;
            (start, piece) = (end, piece * 2);
        }
        laps.lap("htod.pack");
        let columns = try_collect(layouts.iter().map(|l| l.to_device(&memory)))?;
        laps.lap("htod.arrays");
        let done = timed(times, StagingStep::Copy, || stream.record())?;
        Ok((columns, done))
    };
    let result = send();
    retire(
        result.as_ref().ok().map(|(_, e)| e),
        stream,
        vec![Box::new(staging)],
        VecDeque::new(),
    );
    laps.lap("htod.retire");
    result
}

/// Keeps what an upload's copies read until they are done: `in_flight` until their own events,
/// `keep` until `done` (the last copy's event) or, when there is none (the upload failed), until an
/// event recorded now; when none can be recorded, the stream is synchronised instead.
fn retire(done: Option<&Event>, stream: &Stream, keep: Vec<Keep>, mut in_flight: VecDeque<(Keep, Event)>) {
    match done.cloned().or_else(|| stream.record().ok()) {
        Some(done) => in_flight.extend(keep.into_iter().map(|k| (k, done.clone()))),
        None => {
            let _ = stream.synchronize();
        }
    }
    defer_release(in_flight);
}

/// Where [`send_chunks`] sends: the upload's device memory, the pinned pool its staging comes
/// from, the stream of its copies, and the times its steps count in.
struct Sink<'s> {
    memory: &'s DeviceBuffer,
    pool: &'s Arc<PinnedPool>,
    stream: &'s Stream,
    times: Option<&'s StagingTimes>,
}

/// Sends `rest` of `plan` (what was not packed while planning) into `sink`'s memory: plain copies
/// of at least [`DIRECT_MIN`] bytes from pinned memory straight from their source, the rest through
/// [`CHUNK`]s of pinned staging from its pool packed on every core, each sent while the next is
/// packed. What the copies read goes to `keep` (kept until the last copy is done) or, for the
/// staging, to `in_flight` with its copy's event.
fn send_chunks(
    plan: &Plan<'_>,
    rest: Range<usize>,
    sink: &Sink<'_>,
    keep: &mut Vec<Keep>,
    in_flight: &mut VecDeque<(Keep, Event)>,
) -> Result<()> {
    if rest.is_empty() {
        return Ok(());
    }
    let Sink {
        memory,
        pool,
        stream,
        times,
    } = *sink;
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
        timed(times, StagingStep::Copy, || {
            // SAFETY: the source is pinned host memory of an arrow buffer kept alive (in `keep`)
            // until the last copy completes; the destination lies inside `memory`.
            unsafe {
                copy(
                    memory.address() + d.dst as u64,
                    device,
                    d.src.as_ptr() as u64,
                    pinned_host,
                    d.src.len(),
                    stream,
                )
            }
        })?;
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
                timed(times, StagingStep::Wait, || done.synchronize())?;
            }
            let mut stage = timed(times, StagingStep::Alloc, || pool.take(len))?;
            let out = stage
                .host_slice_mut()
                .ok_or_else(|| Error::Unsupported("staging is not host memory".into()))?;
            plan.fill_parallel(start, out, times);
            let copied = timed(times, StagingStep::Copy, || {
                // SAFETY: both ranges are valid; the staging block is kept (in `in_flight`, then
                // the deferred list) until the event recorded after the copy completes.
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
                stream.record()
            })?;
            in_flight.push_back((Box::new(stage), copied));
        }
    }
    Ok(())
}

/// Plans `arrays` whole (with their `data`, see [`Plan::column`]): the plan and the arrays'
/// layouts.
fn plan_columns<'a>(arrays: &[&'a dyn Array], data: &'a [Option<ArrayData>]) -> Result<(Plan<'a>, Vec<Layout>)> {
    let mut plan = Plan::for_columns(arrays.len());
    let layouts = try_collect(arrays.iter().zip(data).map(|(a, d)| plan.column(*a, d.as_ref())))?;
    Ok((plan, layouts))
}

/// Plain copies at least this large from pinned memory skip the staging.
const DIRECT_MIN: usize = 1 << 20;

/// Whether host memory is page-locked (and so can be the source of an asynchronous DMA).
fn is_pinned(src: &[u8]) -> bool {
    // SAFETY: only called once a CUDA stream is bound, so the driver is loaded. Unlike
    // cuPointerGetAttribute, the query succeeds for memory the driver does not know (pageable
    // memory), so it raises no API error.
    unsafe { crate::driver::is_pinned_host(src.as_ptr() as u64) }.unwrap_or(false)
}

impl DeviceRecordBatch {
    /// Copies a host batch to `device` on the device's shared stream; returns when it is there.
    pub fn from_record_batch(batch: &RecordBatch, device: Device) -> Result<Self> {
        htod(batch, device, &Stream::shared(device)?)
    }
}
