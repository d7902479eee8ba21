//! Planning and issuing a download: the buffers of each allocation are grouped into spans (nearby
//! buffers of one allocation share one), each span is copied in one DMA into one host block, and
//! each array's [`Layout`] in that block is worked out from where its buffers landed.

use std::ops::Range;

use rayon::prelude::*;

use crate::array::DeviceArrayData;
use crate::device::{Device, Event, Stream};
use crate::error::{Error, Result};
use crate::memory::fence::check_all;
use crate::memory::pinned::PinnedPool;
use crate::memory::{ALIGNMENT, DeviceBuffer, MemoryResource, copy, stream_for};
use crate::trace::Laps;

use super::layout::Layout;

/// One run of bytes in one allocation, copied in one piece.
struct Span {
    src: u64,
    len: usize,
    dst: usize,
}

/// A device-to-host copy issued by [`gather`].
pub(crate) struct Gathered {
    /// The host block.
    pub memory: DeviceBuffer,
    /// Where each array's buffers land in it.
    pub layouts: Vec<Layout>,
    /// The event of the last copy.
    pub event: Event,
}

/// Copies every buffer of `arrays` into one host block, once their memory is found readable
/// ([`DeviceArrayData::check_readable`]).
pub(crate) fn gather(
    arrays: &[DeviceArrayData],
    device: Device,
    ready: Option<&Event>,
    stream: &Stream,
) -> Result<Gathered> {
    let mut laps = Laps::start();
    check_all(arrays.iter().flat_map(DeviceArrayData::all_buffers))?;
    laps.lap("dtoh.check");
    let stream = stream_for(stream, device, Device::Cpu)?;
    if let Some(ready) = ready {
        stream.wait(ready)?;
    }
    laps.lap("dtoh.wait_ready");
    // Group buffers by allocation, in address order; nearby buffers of one allocation share a span.
    let all: Vec<&DeviceBuffer> = arrays.iter().flat_map(|a| a.all_buffers()).collect();
    let mut order: Vec<usize> = (0..all.len()).collect();
    order.sort_by_key(|&i| all[i].address());
    let buffers: Vec<&DeviceBuffer> = order.iter().map(|&i| all[i]).collect();
    let (spans, span_of, size) = plan_spans(&buffers);
    laps.lap("dtoh.spans");
    let mut memory = match device {
        Device::Cpu => DeviceBuffer::alloc(MemoryResource::Host, size, &stream)?,
        _ => {
            let ordinal = device.ordinal().unwrap_or(0);
            PinnedPool::shared(MemoryResource::PinnedHost(ordinal))?.take(size)?
        }
    };
    laps.lap("dtoh.alloc");
    match stream.cuda() {
        None => {
            let out = memory
                .host_slice_mut()
                .ok_or_else(|| Error::Unsupported("host block is not host memory".into()))?;
            copy_spans_on_host(&spans, out);
        }
        Some(_) => copy_spans_on_device(&spans, &memory, device, &stream)?,
    }
    let event = stream.record()?;
    laps.lap("dtoh.copy");
    // Where each buffer landed, in the order of `all_buffers`, which `host_layout` walks too.
    let mut place = vec![0..0; buffers.len()];
    for ((b, &si), &i) in buffers.iter().zip(&span_of).zip(&order) {
        let s = &spans[si];
        let start = s.dst + (b.address() - s.src) as usize;
        place[i] = start..start + b.len();
    }
    let mut place = place.into_iter();
    let layouts = arrays.iter().map(|a| host_layout(a, &mut place)).collect();
    laps.lap("dtoh.layouts");
    Ok(Gathered { memory, layouts, event })
}

/// The spans that cover `buffers` (in address order) in one host block: the spans, the span of each
/// buffer, and the block's size.
fn plan_spans(buffers: &[&DeviceBuffer]) -> (Vec<Span>, Vec<usize>, usize) {
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
    (spans, span_of, size)
}

/// Issues the copies of `spans` from `device` into `memory` (a host block) on `stream`, a CUDA
/// stream.
fn copy_spans_on_device(spans: &[Span], memory: &DeviceBuffer, device: Device, stream: &Stream) -> Result<()> {
    for s in spans {
        // SAFETY: each span lies inside one live allocation (its buffers are views of it) and
        // inside `memory`; `memory` is not read until the event recorded after the copies
        // completes.
        unsafe {
            copy(
                memory.address() + s.dst as u64,
                memory.device(),
                s.src,
                device,
                s.len,
                stream,
            )?
        };
    }
    Ok(())
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
fn host_layout(a: &DeviceArrayData, place: &mut impl Iterator<Item = Range<usize>>) -> Layout {
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
        trusted: a.is_trusted(),
    }
}
