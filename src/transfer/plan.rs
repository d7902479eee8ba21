//! Planning a copy: where every buffer of a batch goes in one allocation, and how its bytes are
//! produced from the source.
//!
//! A sliced array is copied in proportion to the slice: values, offsets and children are cut to
//! the range the slice views, offsets are rebased to start at zero, and validity bitmaps that start
//! inside a byte are shifted, so that (except for run-end encoded arrays) every planned array has
//! offset 0. The bytes between buffers are zeroed.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, TryLockError};

use arrow_buffer::{BooleanBuffer, Buffer, NullBuffer};
use arrow_data::ArrayData;
use arrow_schema::{DataType, UnionMode};
use rayon::prelude::*;

use crate::array::{Buffers, DeviceArrayData};
use crate::error::{Error, Result, try_collect};
use crate::memory::{ALIGNMENT, DeviceBuffer};

/// How an operation's destination bytes are made from its source.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Transform {
    /// A plain copy.
    Copy,
    /// A bitmap of `bits` bits whose first bit is bit `shift` (1..=7) of the first source byte,
    /// moved to bit 0. The bits past the last are zeroed, as arrow-rs zeroes them when it shifts a
    /// bitmap.
    ShiftBits { shift: u8, bits: usize },
    /// Little-endian `i32` offsets minus a base.
    Rebase32(i32),
    /// Little-endian `i64` offsets minus a base.
    Rebase64(i64),
}

/// Produces `dst..dst + len` of the destination from `src`.
#[derive(Clone, Debug)]
pub(crate) struct PackOp<'a> {
    src: &'a [u8],
    dst: usize,
    len: usize,
    transform: Transform,
    /// The arrow buffer `src` lies in, for plain copies: kept alive while a DMA reads it directly.
    owner: Option<&'a Buffer>,
}

impl PackOp<'_> {
    /// Writes destination bytes `dst + at .. dst + at + out.len()` of this operation into `out`.
    /// `at` is a multiple of the element size (so of 64, or 0).
    fn write(&self, at: usize, out: &mut [u8]) {
        let src = &self.src[at.min(self.src.len())..];
        match self.transform {
            Transform::Copy => out.copy_from_slice(&src[..out.len()]),
            Transform::ShiftBits { shift, bits } => {
                for (j, o) in out.iter_mut().enumerate() {
                    let lo = src[j] >> shift;
                    let hi = src.get(j + 1).map_or(0, |h| h << (8 - shift));
                    *o = lo | hi;
                }
                let tail = bits % 8;
                if tail != 0
                    && at + out.len() == self.len
                    && let Some(last) = out.last_mut()
                {
                    *last &= (1u8 << tail) - 1;
                }
            }
            Transform::Rebase32(base) => {
                for (o, s) in out.chunks_exact_mut(4).zip(src.chunks_exact(4)) {
                    let v = i32::from_le_bytes([s[0], s[1], s[2], s[3]]).wrapping_sub(base);
                    o.copy_from_slice(&v.to_le_bytes());
                }
            }
            Transform::Rebase64(base) => {
                for (o, s) in out.chunks_exact_mut(8).zip(src.chunks_exact(8)) {
                    let v = i64::from_le_bytes(s.try_into().unwrap_or_default()).wrapping_sub(base);
                    o.copy_from_slice(&v.to_le_bytes());
                }
            }
        }
    }
}

/// A plain copy straight from a source buffer, with the buffer that keeps the source alive.
#[derive(Clone, Debug)]
pub(crate) struct DirectCopy<'a> {
    pub src: &'a [u8],
    pub dst: usize,
    pub owner: Buffer,
}

/// Where one array's buffers are, as byte ranges of one allocation.
#[derive(Clone, Debug)]
pub(crate) struct Layout {
    pub data_type: DataType,
    pub len: usize,
    pub offset: usize,
    pub null_count: Option<usize>,
    pub nulls: Option<Range<usize>>,
    pub buffers: smallvec::SmallVec<[Range<usize>; 2]>,
    pub children: Vec<Layout>,
    /// The bytes are a copy of a valid arrow array (see `DeviceArrayData::trusted`): the host
    /// array is built without validating them again.
    pub trusted: bool,
}

impl Layout {
    /// The device array these ranges of `memory` hold.
    pub fn to_device(&self, memory: &DeviceBuffer) -> Result<DeviceArrayData> {
        let slice = |r: &Range<usize>| memory.slice(r.start, r.len());
        let mut buffers = Buffers::new();
        for r in &self.buffers {
            buffers.push(slice(r)?);
        }
        Ok(DeviceArrayData {
            data_type: self.data_type.clone(),
            len: self.len,
            offset: self.offset,
            null_count: self.null_count,
            nulls: self.nulls.as_ref().map(slice).transpose()?,
            buffers,
            children: try_collect(self.children.iter().map(|c| c.to_device(memory)))?,
            trusted: true,
        })
    }

    /// The end of the last byte the array (its children included) takes.
    pub fn end(&self) -> usize {
        let own = self.nulls.iter().chain(&self.buffers).map(|r| r.end).max().unwrap_or(0);
        self.children.iter().map(Layout::end).fold(own, usize::max)
    }

    /// The arrow array these ranges of `memory` (a host block wrapped as one arrow buffer) hold,
    /// fully validated unless the layout is trusted. Its buffers are slices of `memory`.
    pub fn to_host(&self, memory: &Buffer) -> Result<ArrayData> {
        self.host_window(memory, 0, self.len)
    }

    /// Elements `start..start + len` of this layout as an arrow array, fully validated unless the
    /// layout is trusted.
    ///
    /// A struct's offset applies to its children here (as in the C Data Interface), but arrow-rs
    /// cannot take a struct `ArrayData` with an offset: `ArrayData::slice` slices a struct's
    /// children and sets its offset, and `StructArray::from` then slices them again, so
    /// `make_array(struct_data.slice(k, n))` panics for `k > 0` (arrow-rs 59), and fixed-size
    /// lists and sparse unions reach that path by slicing their children. So structs,
    /// fixed-size lists and unions are built with offset 0: their offset moves into their
    /// children's windows and their own buffers are cut.
    fn host_window(&self, memory: &Buffer, start: usize, len: usize) -> Result<ArrayData> {
        if start.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(Error::InvalidData(format!(
                "{} window {start}..+{len} of an array of {} elements",
                self.data_type, self.len
            )));
        }
        let offset = self.offset + start;
        let bits = offset
            .checked_add(len)
            .ok_or_else(|| Error::InvalidData("length overflows".into()))?;
        let buffer = |r: &Range<usize>| {
            if r.start > r.end || r.end > memory.len() {
                return Err(Error::OutOfBounds {
                    offset: r.start,
                    len: r.len(),
                    size: memory.len(),
                });
            }
            Ok(memory.slice_with_length(r.start, r.len()))
        };
        // `n` bytes from byte `from` of the buffer at `r`.
        let cut = |r: &Range<usize>, from: usize, n: usize| {
            if from.checked_add(n).is_none_or(|end| end > r.len()) {
                return Err(Error::InvalidData(format!(
                    "buffer of {} bytes is too short for {}",
                    r.len(),
                    self.data_type
                )));
            }
            buffer(&(r.start + from..r.start + from + n))
        };
        let nulls = match &self.nulls {
            None => None,
            Some(r) => {
                if r.len() < bits.div_ceil(8) {
                    return Err(Error::InvalidData(format!(
                        "validity bitmap of {} bytes is too short for {bits} bits",
                        r.len()
                    )));
                }
                Some(NullBuffer::new(BooleanBuffer::new(buffer(r)?, offset, len)))
            }
        };
        let whole = |c: &Layout| c.host_window(memory, 0, c.len);
        let buffer_at = |i: usize| {
            self.buffers
                .get(i)
                .ok_or_else(|| Error::InvalidData(format!("{} array without buffer {i}", self.data_type)))
        };
        let (offset, buffers, children) = match &self.data_type {
            DataType::Struct(_) => (
                0,
                vec![],
                self.children
                    .iter()
                    .map(|c| c.host_window(memory, offset, len))
                    .collect::<Result<_>>()?,
            ),
            DataType::FixedSizeList(_, size) => {
                let size = *size as usize;
                let children = self
                    .children
                    .iter()
                    .map(|c| c.host_window(memory, offset * size, len * size));
                (0, vec![], children.collect::<Result<_>>()?)
            }
            DataType::Union(_, mode) => {
                let mut buffers = vec![cut(buffer_at(0)?, offset, len)?];
                let children: Result<Vec<_>> = match mode {
                    UnionMode::Sparse => self
                        .children
                        .iter()
                        .map(|c| c.host_window(memory, offset, len))
                        .collect(),
                    UnionMode::Dense => {
                        buffers.push(cut(buffer_at(1)?, offset * 4, len * 4)?);
                        self.children.iter().map(whole).collect()
                    }
                };
                (0, buffers, children?)
            }
            _ => (
                offset,
                self.buffers.iter().map(buffer).collect::<Result<_>>()?,
                self.children.iter().map(whole).collect::<Result<_>>()?,
            ),
        };
        let builder = ArrayData::builder(self.data_type.clone())
            .len(len)
            .offset(offset)
            .align_buffers(true)
            .buffers(buffers)
            .child_data(children)
            .nulls(nulls);
        // SAFETY: a trusted layout holds the bytes of a valid arrow array, written by `Plan` (whose
        // windows keep arrays valid) and unchanged since; the bounds above still hold for it.
        let builder = unsafe { builder.skip_validation(self.trusted) };
        Ok(builder.build()?)
    }
}

/// Every operation that fills one allocation, and the arrays it will hold.
#[derive(Debug, Default)]
pub(crate) struct Plan<'a> {
    ops: Vec<PackOp<'a>>,
    size: usize,
    /// Where the part planned since the last [`Plan::cut`] starts.
    cut: usize,
}

/// Eight zero bytes: the offsets of an empty array whose source has no offsets buffer.
static ZERO_OFFSETS: [u8; 8] = [0; 8];

impl<'a> Plan<'a> {
    /// The size of the allocation.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The bytes planned since the last [`Plan::cut`].
    pub fn uncut(&self) -> usize {
        self.size - self.cut
    }

    /// Ends the part planned since the last cut at the next multiple of [`ALIGNMENT`] (the plan
    /// grows to it) and returns its range, which [`Plan::ops_in`] can fill while planning goes on.
    pub fn cut(&mut self) -> Range<usize> {
        self.size = self.size.next_multiple_of(ALIGNMENT);
        std::mem::replace(&mut self.cut, self.size)..self.size
    }

    /// The operations that fill `range`, a range [`Plan::cut`] returned, for [`fill_part`].
    pub fn ops_in(&self, range: Range<usize>) -> &[PackOp<'a>] {
        let first = self.ops.partition_point(|op| op.dst < range.start);
        let end = self.ops.partition_point(|op| op.dst < range.end);
        &self.ops[first..end]
    }

    /// Plans a whole array.
    pub fn array(&mut self, data: &'a ArrayData) -> Result<Layout> {
        self.window(data, 0, data.len())
    }

    /// Reserves `len` bytes produced from `src` and returns their range.
    fn push(&mut self, src: &'a [u8], len: usize, transform: Transform) -> Range<usize> {
        self.push_op(PackOp {
            src,
            dst: 0,
            len,
            transform,
            owner: None,
        })
    }

    fn push_op(&mut self, mut op: PackOp<'a>) -> Range<usize> {
        op.dst = self.size.next_multiple_of(ALIGNMENT);
        self.size = op.dst + op.len;
        let range = op.dst..op.dst + op.len;
        if op.len > 0 {
            self.ops.push(op);
        }
        range
    }

    /// `len` bytes of `buffer` from `start`, copied.
    fn bytes(&mut self, buffer: &'a Buffer, start: usize, len: usize) -> Result<Range<usize>> {
        let src = source(buffer, start, len)?;
        Ok(self.push_op(PackOp {
            src,
            dst: 0,
            len,
            transform: Transform::Copy,
            owner: Some(buffer),
        }))
    }

    /// Plain copies of at least `min_len` bytes whose source passes `pinned`, in destination
    /// order: these can be copied by DMA straight from the source.
    pub fn direct_copies(&self, min_len: usize, mut pinned: impl FnMut(&[u8]) -> bool) -> Vec<DirectCopy<'a>> {
        self.ops
            .iter()
            .filter(|op| op.len >= min_len && op.transform == Transform::Copy)
            .filter_map(|op| {
                Some(DirectCopy {
                    src: op.src,
                    dst: op.dst,
                    owner: op.owner?.clone(),
                })
            })
            .filter(|d| pinned(d.src))
            .collect()
    }

    /// `bits` bits of a bitmap from bit `start`, moved to bit 0.
    fn bitmap(&mut self, buffer: &'a Buffer, start: usize, bits: usize) -> Result<Range<usize>> {
        let len = bits.div_ceil(8);
        let first = start / 8;
        let needed = (start + bits).div_ceil(8) - first;
        match (start % 8) as u8 {
            0 => self.bytes(buffer, first, len),
            shift => {
                let src = source(buffer, first, needed)?;
                Ok(self.push(src, len, Transform::ShiftBits { shift, bits }))
            }
        }
    }

    /// `count + 1` offsets of `width` bytes from element `start`, rebased to 0; returns their range
    /// and the first and last source offsets.
    fn offsets(
        &mut self,
        buffer: &'a Buffer,
        start: usize,
        count: usize,
        width: usize,
    ) -> Result<(Range<usize>, usize, usize)> {
        let len = (count + 1) * width;
        if buffer.is_empty() && count == 0 {
            return Ok((self.push(&ZERO_OFFSETS[..width], len, Transform::Copy), 0, 0));
        }
        let src = source(buffer, start * width, len)?;
        let read = |i: usize| -> i64 {
            let b = &src[i * width..(i + 1) * width];
            if width == 4 {
                i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as i64
            } else {
                i64::from_le_bytes(b.try_into().unwrap_or_default())
            }
        };
        let (first, last) = (read(0), read(count));
        if first < 0 || last < first {
            return Err(Error::InvalidData(format!("offsets run from {first} to {last}")));
        }
        let transform = match (first, width) {
            (0, _) => Transform::Copy,
            (_, 4) => Transform::Rebase32(first as i32),
            _ => Transform::Rebase64(first),
        };
        Ok((self.push(src, len, transform), first as usize, last as usize))
    }

    /// Plans elements `start..start + len` of `data` (logical indices, before `data.offset()`).
    fn window(&mut self, data: &'a ArrayData, start: usize, len: usize) -> Result<Layout> {
        let p = data.offset() + start;
        let (nulls, null_count) = match data.nulls() {
            None => (None, 0),
            Some(n) => {
                let bits = n.inner();
                let count = if start == 0 && len == data.len() {
                    n.null_count()
                } else {
                    n.slice(start, len).null_count()
                };
                (Some(self.bitmap(bits.inner(), bits.offset() + start, len)?), count)
            }
        };
        let mut layout = Layout {
            data_type: data.data_type().clone(),
            len,
            offset: 0,
            null_count: Some(null_count),
            nulls,
            buffers: Default::default(),
            children: vec![],
            trusted: false,
        };
        let buffers = data.buffers();
        let child = |i: usize| {
            data.child_data()
                .get(i)
                .ok_or_else(|| Error::InvalidData(format!("{} array without child {i}", data.data_type())))
        };
        let buffer = |i: usize| {
            buffers
                .get(i)
                .ok_or_else(|| Error::InvalidData(format!("{} array without buffer {i}", data.data_type())))
        };
        match data.data_type() {
            DataType::Null => {}
            DataType::Boolean => layout.buffers.push(self.bitmap(buffer(0)?, p, len)?),
            DataType::FixedSizeBinary(w) => {
                let w = *w as usize;
                layout.buffers.push(self.bytes(buffer(0)?, p * w, len * w)?);
            }
            DataType::Utf8 | DataType::Binary | DataType::LargeUtf8 | DataType::LargeBinary => {
                let width = if matches!(data.data_type(), DataType::Utf8 | DataType::Binary) {
                    4
                } else {
                    8
                };
                let (offsets, first, last) = self.offsets(buffer(0)?, p, len, width)?;
                layout.buffers.push(offsets);
                layout.buffers.push(self.bytes(buffer(1)?, first, last - first)?);
            }
            DataType::Utf8View | DataType::BinaryView => {
                // Views address their data buffers by index and offset: the data buffers travel whole.
                layout.buffers.push(self.bytes(buffer(0)?, p * 16, len * 16)?);
                for b in &buffers[1..] {
                    layout.buffers.push(self.bytes(b, 0, b.len())?);
                }
            }
            DataType::List(_) | DataType::Map(..) | DataType::LargeList(_) => {
                let width = if matches!(data.data_type(), DataType::LargeList(_)) {
                    8
                } else {
                    4
                };
                let (offsets, first, last) = self.offsets(buffer(0)?, p, len, width)?;
                layout.buffers.push(offsets);
                layout.children.push(self.window(child(0)?, first, last - first)?);
            }
            DataType::ListView(_) | DataType::LargeListView(_) => {
                // Views may point anywhere in the child: it travels whole.
                let width = if matches!(data.data_type(), DataType::ListView(_)) {
                    4
                } else {
                    8
                };
                layout.buffers.push(self.bytes(buffer(0)?, p * width, len * width)?);
                layout.buffers.push(self.bytes(buffer(1)?, p * width, len * width)?);
                let c = child(0)?;
                layout.children.push(self.window(c, 0, c.len())?);
            }
            DataType::FixedSizeList(_, size) => {
                let size = *size as usize;
                layout.children.push(self.window(child(0)?, p * size, len * size)?);
            }
            DataType::Struct(_) => {
                for c in data.child_data() {
                    layout.children.push(self.window(c, p, len)?);
                }
            }
            DataType::Union(_, mode) => {
                layout.buffers.push(self.bytes(buffer(0)?, p, len)?);
                match mode {
                    UnionMode::Sparse => {
                        for c in data.child_data() {
                            layout.children.push(self.window(c, p, len)?);
                        }
                    }
                    UnionMode::Dense => {
                        layout.buffers.push(self.bytes(buffer(1)?, p * 4, len * 4)?);
                        for c in data.child_data() {
                            layout.children.push(self.window(c, 0, c.len())?);
                        }
                    }
                }
            }
            DataType::Dictionary(key, _) => {
                let w = key
                    .primitive_width()
                    .ok_or_else(|| Error::InvalidData(format!("dictionary key {key}")))?;
                layout.buffers.push(self.bytes(buffer(0)?, p * w, len * w)?);
                let values = child(0)?;
                layout.children.push(self.window(values, 0, values.len())?);
            }
            DataType::RunEndEncoded(..) => {
                // Run ends are logical positions: the children travel whole and the offset stays.
                layout.offset = p;
                for c in data.child_data() {
                    layout.children.push(self.window(c, 0, c.len())?);
                }
            }
            dt => {
                let w = dt
                    .primitive_width()
                    .ok_or_else(|| Error::Unsupported(format!("data type {dt}")))?;
                layout.buffers.push(self.bytes(buffer(0)?, p * w, len * w)?);
            }
        }
        Ok(layout)
    }

    /// Writes destination bytes `start..start + out.len()` into `out`, zeroing the gaps between
    /// buffers. `start` must be a multiple of [`ALIGNMENT`].
    pub fn fill(&self, start: usize, out: &mut [u8]) {
        fill_part(&self.ops, start, out)
    }

    /// [`Plan::fill`] on the threads of the pool, in pieces of at least 256 KiB (on the H100
    /// machine a 1.3 MB batch packed faster on 4 threads than on 16).
    pub fn fill_parallel(&self, start: usize, out: &mut [u8]) {
        const PIECE: usize = 256 << 10;
        if out.len() <= PIECE {
            return self.fill(start, out);
        }
        let piece = (out.len() / rayon::current_num_threads()).next_multiple_of(PIECE);
        out.par_chunks_mut(piece)
            .enumerate()
            .for_each(|(i, part)| self.fill(start + i * piece, part));
    }
}

/// A part of a plan cut off while planning goes on, packed into its share of the staging by
/// whichever thread gets to it first: a pool thread it was handed to, or the planning thread once it
/// needs it.
pub(crate) struct Part<'a> {
    range: Range<usize>,
    ops: Vec<PackOp<'a>>,
    /// Where the part goes, until a thread takes it to pack it there.
    out: Mutex<Option<&'a mut [u8]>>,
    /// Set once the bytes are written (not from the lock: another thread may hold it to find the
    /// part packed already).
    packed: AtomicBool,
}

impl<'a> Part<'a> {
    /// The part of `plan` in `range` (from [`Plan::cut`]), to be packed into `out`.
    pub fn new(plan: &Plan<'a>, range: Range<usize>, out: &'a mut [u8]) -> Part<'a> {
        Part {
            ops: plan.ops_in(range.clone()).to_vec(),
            range,
            out: Mutex::new(Some(out)),
            packed: AtomicBool::new(false),
        }
    }

    /// The part's range of the allocation.
    pub fn range(&self) -> Range<usize> {
        self.range.clone()
    }

    /// Packs the part unless that was done; spins while another thread packs it (for some
    /// microseconds: sleeping and being woken would take longer).
    pub fn pack(&self) {
        loop {
            let mut out = match self.out.try_lock() {
                Ok(out) => out,
                Err(TryLockError::Poisoned(p)) => p.into_inner(),
                Err(TryLockError::WouldBlock) => {
                    std::hint::spin_loop();
                    continue;
                }
            };
            if let Some(out) = out.take() {
                fill_part(&self.ops, self.range.start, out);
                self.packed.store(true, Ordering::Release);
            }
            return;
        }
    }

    /// Whether a thread has packed the part; its bytes are then visible to this thread (and to a
    /// DMA it issues).
    pub fn is_packed(&self) -> bool {
        self.packed.load(Ordering::Acquire)
    }
}

/// Parts on their way from the planning thread, which cuts them, to pool threads that pack them
/// while planning goes on.
#[derive(Default)]
pub(crate) struct Handoff<'a> {
    queue: Mutex<VecDeque<Arc<Part<'a>>>>,
    queued: AtomicUsize,
    closed: AtomicBool,
}

impl<'a> Handoff<'a> {
    /// Queues a part for the pool threads.
    pub fn push(&self, part: Arc<Part<'a>>) {
        self.queue.lock().unwrap_or_else(|p| p.into_inner()).push_back(part);
        self.queued.fetch_add(1, Ordering::Release);
    }

    /// Says that no more parts will come: [`Handoff::pack`] returns once the queue is empty.
    pub fn close(&self) {
        self.closed.store(true, Ordering::Release);
    }

    /// A pool thread's job: packs parts as they come until the handoff is closed and empty,
    /// spinning in between (planning cuts one every few microseconds, and waking a sleeping
    /// thread takes longer).
    pub fn pack(&self) {
        loop {
            // Read first: once closed, every part pushed is in the queue.
            let closed = self.closed.load(Ordering::Acquire);
            if self.queued.load(Ordering::Acquire) > 0 {
                let next = self.queue.lock().unwrap_or_else(|p| p.into_inner()).pop_front();
                if let Some(part) = next {
                    self.queued.fetch_sub(1, Ordering::AcqRel);
                    part.pack();
                    continue;
                }
            }
            if closed {
                return;
            }
            std::hint::spin_loop();
        }
    }
}

/// Writes destination bytes `start..start + out.len()` with `ops` (those of the range, or more),
/// zeroing the gaps between buffers. `start` must be a multiple of [`ALIGNMENT`].
pub(crate) fn fill_part(ops: &[PackOp<'_>], start: usize, out: &mut [u8]) {
    let end = start + out.len();
    let first = ops.partition_point(|op| op.dst + op.len <= start);
    let mut cursor = start;
    for op in ops[first..].iter().take_while(|op| op.dst < end) {
        let from = op.dst.max(start);
        let to = (op.dst + op.len).min(end);
        out[cursor - start..from - start].fill(0);
        op.write(from - op.dst, &mut out[from - start..to - start]);
        cursor = to;
    }
    out[cursor - start..].fill(0);
}

/// `len` bytes of `buffer` from `start`, or an error naming the overrun.
fn source(buffer: &Buffer, start: usize, len: usize) -> Result<&[u8]> {
    start
        .checked_add(len)
        .and_then(|end| buffer.as_slice().get(start..end))
        .ok_or(Error::OutOfBounds {
            offset: start,
            len,
            size: buffer.len(),
        })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow_array::{Array, ArrayRef, BooleanArray, Int32Array, StringArray};

    use super::*;

    /// Parts cut while planning, each packed into its own staging, hold exactly the bytes the
    /// whole plan fills: every range, the gaps between buffers and the alignment at each cut.
    #[test]
    fn cut_parts_pack_what_the_whole_plan_fills() {
        let strings: ArrayRef = Arc::new(StringArray::from_iter(
            (0..3000).map(|i| (i % 7 != 0).then(|| format!("v{i}"))),
        ));
        let arrays: Vec<ArrayRef> = vec![
            Arc::new(Int32Array::from_iter((0..1000).map(|i| (i % 3 != 0).then_some(i)))),
            strings.slice(13, 2000),
            Arc::new(BooleanArray::from_iter((0..999).map(|i| Some(i % 2 == 0))).slice(3, 900)),
            strings.slice(1, 5),
            Arc::new(Int32Array::from(Vec::<i32>::new())),
        ];
        let data: Vec<ArrayData> = arrays.iter().map(|a| a.to_data()).collect();
        let mut plan = Plan::default();
        let mut ranges = Vec::new();
        for (i, d) in data.iter().enumerate() {
            if i % 2 == 1 {
                ranges.push(plan.cut());
            }
            plan.array(d).unwrap();
        }
        ranges.push(plan.cut());
        assert_eq!(plan.uncut(), 0);
        assert_eq!(ranges.last().unwrap().end, plan.size());
        assert!(ranges.windows(2).all(|w| w[0].end == w[1].start));
        let mut whole = vec![0xAAu8; plan.size()];
        plan.fill(0, &mut whole);
        let mut staging = vec![0x55u8; plan.size()];
        let mut free = staging.as_mut_slice();
        let parts: Vec<Arc<Part<'_>>> = ranges
            .iter()
            .map(|range| {
                let (out, rest) = std::mem::take(&mut free).split_at_mut(range.len());
                free = rest;
                Arc::new(Part::new(&plan, range.clone(), out))
            })
            .collect();
        for (part, range) in parts.iter().zip(&ranges) {
            assert_eq!(&part.range(), range);
            assert!(!part.is_packed());
        }
        // A packed part stays packed while another thread holds it to find it packed (an upload
        // once read such a moment as "not packed" and left the part unsent).
        parts[0].pack();
        let done = AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                (0..100_000).for_each(|_| parts[0].pack());
                done.store(true, Ordering::Release);
            });
            while !done.load(Ordering::Acquire) {
                assert!(parts[0].is_packed());
            }
        });
        // Two threads pack what is handed off; this one packs the rest, as an upload does.
        let handoff = Handoff::default();
        std::thread::scope(|s| {
            for _ in 0..2 {
                s.spawn(|| handoff.pack());
            }
            for part in &parts[..2] {
                handoff.push(part.clone());
            }
            handoff.close();
            for part in &parts {
                part.pack();
                assert!(part.is_packed());
            }
        });
        drop((parts, handoff));
        assert_eq!(staging, whole);
    }
}
