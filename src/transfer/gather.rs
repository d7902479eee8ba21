//! Planning and issuing a download: the buffers of each allocation are grouped into spans (nearby
//! buffers of one allocation share one), each span is copied in one DMA into one host block, and
//! each array's [`Layout`] in that block is worked out from where its buffers landed. A batch in
//! one allocation (uploaded or received in one) takes one span, found in the walk that checks its
//! buffers, so its copy leaves before anything else is planned.

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
    let buffers = || arrays.iter().flat_map(DeviceArrayData::all_buffers);
    // One walk checks the buffers and finds whether one span covers them: the copy leaves soon.
    let mut extent = Extent::default();
    check_all(buffers().inspect(|b| extent.add(b)))?;
    laps.lap("dtoh.check");
    let stream = stream_for(stream, device, Device::Cpu)?;
    if let Some(ready) = ready {
        stream.wait(ready)?;
    }
    laps.lap("dtoh.wait_ready");
    // Where each buffer lands, in the order of `all_buffers` (which `host_layout` walks too), is
    // worked out once the copy is on its way when one span covers them.
    let (spans, placed, size) = match extent.span() {
        Some(span) => {
            let size = span.dst + span.len;
            (vec![span], None, size)
        }
        None => {
            let (spans, place, size) = plan_spans(&buffers().collect::<Vec<_>>());
            (spans, Some(place), size)
        }
    };
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
    // Placed first, in a loop of their own: the walk below then takes each place without a call
    // through the iterators that find them.
    let places = placed.unwrap_or_else(|| buffers().map(|b| spans[0].place(b)).collect());
    let mut place = places.into_iter();
    let layouts = arrays.iter().map(|a| host_layout(a, &mut place)).collect();
    laps.lap("dtoh.layouts");
    Ok(Gathered { memory, layouts, event })
}

/// Spans, where each buffer lands in the host block, and the block's size.
type Planned = (Vec<Span>, Vec<Range<usize>>, usize);

/// The bytes between two buffers of one allocation up to which one span covers both.
const JOIN_GAP: u64 = 4096;

impl Span {
    /// Where `buffer`, one of the span's, lands in the host block (an empty one anywhere).
    fn place(&self, buffer: &DeviceBuffer) -> Range<usize> {
        match buffer.is_empty() {
            true => 0..0,
            false => {
                let start = self.dst + (buffer.address() - self.src) as usize;
                start..start + buffer.len()
            }
        }
    }
}

/// The bytes of a download's buffers, taken one at a time, while they are views of one
/// allocation: one span covers them (a batch uploaded or received in one allocation) unless the
/// bytes between them come to more than [`JOIN_GAP`] per buffer.
#[derive(Default)]
struct Extent<'a> {
    first: Option<&'a DeviceBuffer>,
    start: u64,
    end: u64,
    bytes: u64,
    count: u64,
    /// A buffer with bytes in another allocation was seen.
    scattered: bool,
}

impl<'a> Extent<'a> {
    fn add(&mut self, b: &'a DeviceBuffer) {
        if b.is_empty() || self.scattered {
            return;
        }
        let (start, end) = (b.address(), b.address() + b.len() as u64);
        match self.first {
            None => {
                self.first = Some(b);
                (self.start, self.end) = (start, end);
            }
            Some(first) if b.shares_allocation(first) => {
                self.start = self.start.min(start);
                self.end = self.end.max(end);
            }
            Some(_) => self.scattered = true,
        }
        self.bytes += b.len() as u64;
        self.count += 1;
    }

    /// The one span that covers the buffers, if one does.
    fn span(&self) -> Option<Span> {
        let covers = self.first.is_some()
            && !self.scattered
            && self.end - self.start <= self.bytes.saturating_add(JOIN_GAP * self.count);
        // The span's address modulo the alignment is kept, so aligned buffers stay aligned.
        covers.then(|| Span {
            src: self.start,
            len: (self.end - self.start) as usize,
            dst: (self.start % ALIGNMENT as u64) as usize,
        })
    }
}

/// The spans that cover `buffers` in one host block, grouped by allocation in address order
/// (nearby buffers of one allocation share a span).
fn plan_spans(all: &[&DeviceBuffer]) -> Planned {
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
                b.address() <= end + JOIN_GAP
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
    let mut place = vec![0..0; all.len()];
    for ((b, &si), &i) in buffers.iter().zip(&span_of).zip(&order) {
        place[i] = spans[si].place(b);
    }
    (spans, place, size)
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

#[cfg(test)]
mod tests {
    use super::*;

    fn views(of: &DeviceBuffer, at: &[(usize, usize)]) -> Vec<DeviceBuffer> {
        at.iter().map(|&(offset, len)| of.slice(offset, len).unwrap()).collect()
    }

    /// The one span's plan, if one span covers `buffers`, and the sorting plan.
    fn plans(buffers: &[DeviceBuffer]) -> (Option<Planned>, Planned) {
        let mut extent = Extent::default();
        buffers.iter().for_each(|b| extent.add(b));
        let one = extent.span().map(|span| {
            let place = buffers.iter().map(|b| span.place(b)).collect();
            let size = span.dst + span.len;
            (vec![span], place, size)
        });
        let refs: Vec<&DeviceBuffer> = buffers.iter().collect();
        (one, plan_spans(&refs))
    }

    fn spans(p: &Planned) -> Vec<(u64, usize, usize)> {
        p.0.iter().map(|s| (s.src, s.len, s.dst)).collect()
    }

    /// Views of one allocation close together, in any order, take one span planned without
    /// sorting, placed exactly as the sorting plan places them; others take the sorting plan.
    #[test]
    fn views_of_one_allocation_take_one_span() {
        let stream = Stream::cpu();
        let block = DeviceBuffer::alloc(MemoryResource::Host, 1 << 20, &stream).unwrap();
        // Out of address order, one empty, gaps below the join distance, an unaligned start.
        let near = views(&block, &[(9000, 64), (100, 800), (4000, 0), (1000, 5000), (6100, 2000)]);
        let (one, sorted) = plans(&near);
        let one = one.expect("one span");
        assert_eq!(spans(&one), spans(&sorted));
        assert_eq!(spans(&one), vec![(block.address() + 100, 8964, 100 % ALIGNMENT)]);
        assert_eq!(one.2, sorted.2);
        for (i, (a, b)) in one.1.iter().zip(&sorted.1).enumerate() {
            if !near[i].is_empty() {
                assert_eq!(a, b, "buffer {i}");
            }
        }
        // Sparse views: the sorting plan, which leaves the gaps out.
        let sparse = views(&block, &[(0, 64), (500_000, 64), (1_000_000, 64)]);
        let (one, sorted) = plans(&sparse);
        assert!(one.is_none());
        assert_eq!(sorted.0.len(), 3);
        // Two allocations.
        let other = DeviceBuffer::alloc(MemoryResource::Host, 4096, &stream).unwrap();
        let mut two = views(&block, &[(0, 64)]);
        two.extend(views(&other, &[(0, 64)]));
        assert!(plans(&two).0.is_none());
        // Nothing with bytes.
        assert!(plans(&views(&block, &[(0, 0)])).0.is_none());
    }
}
