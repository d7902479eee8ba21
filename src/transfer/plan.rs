//! Planning an upload: where every buffer of a batch goes in one allocation, and how its bytes are
//! produced from the source.
//!
//! A sliced array is copied in proportion to the slice: values, offsets and children are cut to
//! the range the slice views, offsets are rebased to start at zero, and validity bitmaps that start
//! inside a byte are shifted, so that (except for run-end encoded arrays) every planned array has
//! offset 0. The bytes between buffers are zeroed.

use std::ops::Range;

use arrow_array::cast::AsArray;
use arrow_array::{Array, OffsetSizeTrait, downcast_primitive_array};
use arrow_buffer::{Buffer, NullBuffer};
use arrow_data::ArrayData;
use arrow_schema::{DataType, UnionMode};
use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::memory::ALIGNMENT;

use super::layout::Layout;
use super::pack::{CACHED_MAX, PackOp, Transform, fill_part};
use super::times::{StagingStep, StagingTimes, timed};

/// A plain copy straight from a source buffer, with the buffer that keeps the source alive.
#[derive(Clone, Debug)]
pub(crate) struct DirectCopy<'a> {
    pub src: &'a [u8],
    pub dst: usize,
    pub owner: Buffer,
}

/// Every operation that fills one allocation, and the arrays it will hold.
#[derive(Debug, Default)]
pub(crate) struct Plan<'a> {
    ops: Vec<PackOp<'a>>,
    size: usize,
}

/// Eight zero bytes: the offsets of an empty array whose source has no offsets buffer.
static ZERO_OFFSETS: [u8; 8] = [0; 8];

impl<'a> Plan<'a> {
    /// An empty plan with room for the operations of `columns` columns of up to three buffers
    /// each (a bitmap, offsets and data), so that a batch's few hundred operations are not moved
    /// as the list grows.
    pub fn for_columns(columns: usize) -> Self {
        Plan {
            ops: Vec::with_capacity(columns * 3),
            ..Plan::default()
        }
    }

    /// The size of the allocation.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The operations that write some of `range`, for [`fill_part`], looked for from operation
    /// `*from` on (none before it may write bytes past `range.start`), which moves to the first of
    /// them: ranges asked for in order are found in one pass over the operations.
    pub fn ops_in(&self, range: Range<usize>, from: &mut usize) -> &[PackOp<'a>] {
        let rest = self.ops.get(*from..).unwrap_or_default();
        let first = *from + rest.iter().take_while(|op| op.dst + op.len <= range.start).count();
        let end = first + self.ops[first..].iter().take_while(|op| op.dst < range.end).count();
        *from = first;
        &self.ops[first..end]
    }

    /// Plans a whole array.
    pub fn array(&mut self, data: &'a ArrayData) -> Result<Layout> {
        self.window(data, 0, data.len())
    }

    /// Plans a whole column: one of a [flat type](is_flat) from the typed array's own buffers,
    /// any other from `data`, its `ArrayData` (which [`column_data`] makes for it).
    ///
    /// arrow-rs's `to_data` clones every buffer of an array into a new `ArrayData` (a few
    /// allocations per column); a flat array needs none of that to be planned.
    pub fn column(&mut self, array: &'a dyn Array, data: Option<&'a ArrayData>) -> Result<Layout> {
        match data {
            Some(data) => self.array(data),
            None => self.flat(array),
        }
    }

    /// Plans a whole array of a flat type from its typed buffers: typed arrays keep their slice
    /// in their buffers (values and offsets cut to it, the validity bitmap with its bit offset).
    fn flat(&mut self, array: &'a dyn Array) -> Result<Layout> {
        let len = array.len();
        // As in an `ArrayData`, a bitmap without nulls is left out.
        let nulls = array.nulls().filter(|n| n.null_count() > 0);
        let mut layout = Layout {
            data_type: array.data_type().clone(),
            len,
            offset: 0,
            null_count: Some(nulls.map_or(0, NullBuffer::null_count)),
            nulls: nulls
                .map(|n| self.bitmap(n.inner().inner(), n.offset(), len))
                .transpose()?,
            buffers: Default::default(),
            children: vec![],
            trusted: false,
        };
        let buffers = &mut layout.buffers;
        match array.data_type() {
            DataType::Boolean => {
                let values = array.as_boolean().values();
                buffers.push(self.bitmap(values.inner(), values.offset(), len)?);
            }
            DataType::Utf8 => self.flat_bytes(array.as_string::<i32>(), buffers)?,
            DataType::LargeUtf8 => self.flat_bytes(array.as_string::<i64>(), buffers)?,
            DataType::Binary => self.flat_bytes(array.as_binary::<i32>(), buffers)?,
            DataType::LargeBinary => self.flat_bytes(array.as_binary::<i64>(), buffers)?,
            dt => {
                let values: &'a Buffer = downcast_primitive_array!(
                    array => array.values().inner(),
                    _ => return Err(Error::Unsupported(format!("{dt} is not a flat type"))),
                );
                buffers.push(self.bytes(values, 0, values.len())?);
            }
        }
        Ok(layout)
    }

    /// The offsets (rebased) and the data they reach of a string or binary array.
    fn flat_bytes<T: arrow_array::types::ByteArrayType>(
        &mut self,
        array: &'a arrow_array::GenericByteArray<T>,
        buffers: &mut smallvec::SmallVec<[Range<usize>; 2]>,
    ) -> Result<()>
    where
        T::Offset: OffsetSizeTrait,
    {
        let width = std::mem::size_of::<T::Offset>();
        let offsets = array.offsets().inner().inner();
        let (range, first, last) = self.offsets(offsets, 0, array.len(), width)?;
        buffers.push(range);
        buffers.push(self.bytes(array.values(), first, last - first)?);
        Ok(())
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
        self.contents(data, p, len, &mut layout)?;
        Ok(layout)
    }

    /// Plans the buffers and children of elements `p..p + len` of `data` (physical indices, after
    /// `data.offset()`) into `layout`.
    fn contents(&mut self, data: &'a ArrayData, p: usize, len: usize, layout: &mut Layout) -> Result<()> {
        let buffers = data.buffers();
        match data.data_type() {
            DataType::Null => {}
            DataType::Boolean => layout.buffers.push(self.bitmap(buffer_of(data, 0)?, p, len)?),
            DataType::FixedSizeBinary(w) => {
                let w = *w as usize;
                layout.buffers.push(self.bytes(buffer_of(data, 0)?, p * w, len * w)?);
            }
            DataType::Utf8 | DataType::Binary | DataType::LargeUtf8 | DataType::LargeBinary => {
                let width = if matches!(data.data_type(), DataType::Utf8 | DataType::Binary) {
                    4
                } else {
                    8
                };
                let (offsets, first, last) = self.offsets(buffer_of(data, 0)?, p, len, width)?;
                layout.buffers.push(offsets);
                layout
                    .buffers
                    .push(self.bytes(buffer_of(data, 1)?, first, last - first)?);
            }
            DataType::Utf8View | DataType::BinaryView => {
                // Views address their data buffers by index and offset: the data buffers travel whole.
                layout.buffers.push(self.bytes(buffer_of(data, 0)?, p * 16, len * 16)?);
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
                let (offsets, first, last) = self.offsets(buffer_of(data, 0)?, p, len, width)?;
                layout.buffers.push(offsets);
                layout
                    .children
                    .push(self.window(child_of(data, 0)?, first, last - first)?);
            }
            DataType::ListView(_) | DataType::LargeListView(_) => {
                // Views may point anywhere in the child: it travels whole.
                let width = if matches!(data.data_type(), DataType::ListView(_)) {
                    4
                } else {
                    8
                };
                layout
                    .buffers
                    .push(self.bytes(buffer_of(data, 0)?, p * width, len * width)?);
                layout
                    .buffers
                    .push(self.bytes(buffer_of(data, 1)?, p * width, len * width)?);
                let c = child_of(data, 0)?;
                layout.children.push(self.window(c, 0, c.len())?);
            }
            DataType::FixedSizeList(_, size) => {
                let size = *size as usize;
                layout
                    .children
                    .push(self.window(child_of(data, 0)?, p * size, len * size)?);
            }
            DataType::Struct(_) => {
                for c in data.child_data() {
                    layout.children.push(self.window(c, p, len)?);
                }
            }
            DataType::Union(_, mode) => self.union(data, *mode, p, len, layout)?,
            DataType::Dictionary(key, _) => {
                let w = key
                    .primitive_width()
                    .ok_or_else(|| Error::InvalidData(format!("dictionary key {key}")))?;
                layout.buffers.push(self.bytes(buffer_of(data, 0)?, p * w, len * w)?);
                let values = child_of(data, 0)?;
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
                layout.buffers.push(self.bytes(buffer_of(data, 0)?, p * w, len * w)?);
            }
        }
        Ok(())
    }

    /// Plans the type ids, offsets (dense) and children of elements `p..p + len` of a union.
    fn union(&mut self, data: &'a ArrayData, mode: UnionMode, p: usize, len: usize, layout: &mut Layout) -> Result<()> {
        layout.buffers.push(self.bytes(buffer_of(data, 0)?, p, len)?);
        match mode {
            UnionMode::Sparse => {
                for c in data.child_data() {
                    layout.children.push(self.window(c, p, len)?);
                }
            }
            UnionMode::Dense => {
                layout.buffers.push(self.bytes(buffer_of(data, 1)?, p * 4, len * 4)?);
                for c in data.child_data() {
                    layout.children.push(self.window(c, 0, c.len())?);
                }
            }
        }
        Ok(())
    }

    /// Writes destination bytes `start..start + out.len()` into `out`, zeroing the gaps between
    /// buffers, with non-temporal stores unless the plan fits in the cache ([`CACHED_MAX`]).
    /// `start` must be a multiple of [`ALIGNMENT`].
    pub fn fill(&self, start: usize, out: &mut [u8]) {
        fill_part(&self.ops, start, out, self.size > CACHED_MAX)
    }

    /// [`Plan::fill`] on the threads of the pool, in pieces of at least 256 KiB (on the H100
    /// machine a 1.3 MB batch packed faster on 4 threads than on 16); each piece's time counts
    /// in [`StagingStep::Pack`] of `times`.
    pub fn fill_parallel(&self, start: usize, out: &mut [u8], times: Option<&StagingTimes>) {
        const PIECE: usize = 256 << 10;
        if out.len() <= PIECE {
            return timed(times, StagingStep::Pack, || self.fill(start, out));
        }
        let piece = (out.len() / rayon::current_num_threads()).next_multiple_of(PIECE);
        out.par_chunks_mut(piece)
            .enumerate()
            .for_each(|(i, part)| timed(times, StagingStep::Pack, || self.fill(start + i * piece, part)));
    }
}

/// Whether [`Plan::column`] plans arrays of `data_type` from their typed buffers: primitives
/// (`DataType::is_primitive`), booleans, strings and binaries.
pub(crate) fn is_flat(data_type: &DataType) -> bool {
    data_type.is_primitive()
        || matches!(
            data_type,
            DataType::Boolean | DataType::Utf8 | DataType::LargeUtf8 | DataType::Binary | DataType::LargeBinary
        )
}

/// About the bytes a plan of `array` copies, without planning it: those of the slice of a [flat
/// type](is_flat) (its bitmap, its values or offsets, and the bytes its offsets reach), all its
/// buffers' for other types (an upper bound for slices).
pub(crate) fn estimated_size(array: &dyn Array) -> usize {
    fn bytes<O: OffsetSizeTrait>(offsets: &[O]) -> usize {
        let reach = match (offsets.first(), offsets.last()) {
            (Some(first), Some(last)) => {
                let at = |o: &O| o.to_usize().unwrap_or(0);
                at(last).saturating_sub(at(first))
            }
            _ => 0,
        };
        std::mem::size_of_val(offsets) + reach
    }
    let nulls = array.nulls().map_or(0, |n| n.len().div_ceil(8));
    nulls
        + match array.data_type() {
            DataType::Boolean => array.len().div_ceil(8),
            DataType::Utf8 => bytes(array.as_string::<i32>().value_offsets()),
            DataType::LargeUtf8 => bytes(array.as_string::<i64>().value_offsets()),
            DataType::Binary => bytes(array.as_binary::<i32>().value_offsets()),
            DataType::LargeBinary => bytes(array.as_binary::<i64>().value_offsets()),
            _ => downcast_primitive_array!(
                array => array.values().inner().len(),
                _ => array.get_buffer_memory_size(),
            ),
        }
}

/// The most buffers an array of a flat type has: a validity bitmap, offsets and values.
const FLAT_BUFFERS: usize = 3;

/// When every array is of a [flat type](is_flat), a size the plan of them cannot exceed, known
/// without planning them: their [`estimated_size`]s (exact for these types, slices included) and
/// the alignment of each of their buffers.
pub(crate) fn flat_size_bound(arrays: &[&dyn Array]) -> Option<usize> {
    arrays
        .iter()
        .map(|a| is_flat(a.data_type()).then(|| estimated_size(*a) + FLAT_BUFFERS * ALIGNMENT))
        .sum()
}

/// The `ArrayData` [`Plan::column`] needs for each of `arrays`: none for a [flat type](is_flat).
pub(crate) fn column_data(arrays: &[&dyn Array]) -> Vec<Option<ArrayData>> {
    arrays
        .iter()
        .map(|a| (!is_flat(a.data_type())).then(|| a.to_data()))
        .collect()
}

/// `len` bytes of `buffer` from `start`, or an error naming the overrun.
fn source(buffer: &Buffer, start: usize, len: usize) -> Result<&[u8]> {
    start
        .checked_add(len)
        .and_then(|end| buffer.as_slice().get(start..end))
        .ok_or_else(|| Error::OutOfBounds {
            offset: start,
            len,
            size: buffer.len(),
        })
}

/// Child `i` of `data`, or an error naming the missing child.
fn child_of(data: &ArrayData, i: usize) -> Result<&ArrayData> {
    data.child_data()
        .get(i)
        .ok_or_else(|| Error::InvalidData(format!("{} array without child {i}", data.data_type())))
}

/// Buffer `i` of `data`, or an error naming the missing buffer.
fn buffer_of(data: &ArrayData, i: usize) -> Result<&Buffer> {
    data.buffers()
        .get(i)
        .ok_or_else(|| Error::InvalidData(format!("{} array without buffer {i}", data.data_type())))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow_array::types::{Decimal128Type, Int64Type, TimestampMicrosecondType};
    use arrow_array::{
        ArrayRef, BinaryArray, BooleanArray, Float64Array, LargeStringArray, PrimitiveArray, StringArray, UInt8Array,
    };

    use super::*;

    /// Arrays of flat types: sliced, with nulls at bit offsets, empty.
    fn flat_arrays() -> Vec<ArrayRef> {
        let strings = StringArray::from_iter((0..300).map(|i| (i % 7 != 0).then(|| format!("s{i}"))));
        vec![
            Arc::new(PrimitiveArray::<Int64Type>::from_iter(
                (0..100).map(|i| (i % 3 != 0).then_some(i)),
            )),
            Arc::new(PrimitiveArray::<Int64Type>::from_iter((0..100).map(|i| (i % 3 != 0).then_some(i))).slice(5, 61)),
            Arc::new(strings.slice(3, 200)),
            Arc::new(strings.slice(300, 0)),
            Arc::new(LargeStringArray::from_iter_values(["a", "bc", "", "def"]).slice(1, 2)),
            Arc::new(BinaryArray::from_iter([Some(&b"x"[..]), None, Some(b"yz")])),
            Arc::new(BooleanArray::from_iter((0..99).map(|i| (i % 4 != 0).then_some(i % 3 == 0))).slice(7, 50)),
            Arc::new(Float64Array::from(Vec::<f64>::new())),
            Arc::new(UInt8Array::from_iter_values(0..=255).slice(9, 17)),
            Arc::new(
                PrimitiveArray::<Decimal128Type>::from_iter([Some(1), None, Some(3)])
                    .with_precision_and_scale(20, 2)
                    .unwrap(),
            ),
            Arc::new(
                PrimitiveArray::<TimestampMicrosecondType>::from_iter_values([1, 2, 3])
                    .with_timezone("+01:00")
                    .slice(1, 2),
            ),
        ]
    }

    /// Planned from their typed buffers, flat arrays get the layouts and bytes that planning their
    /// `ArrayData` gives.
    #[test]
    fn flat_columns_plan_as_their_array_data_does() {
        let arrays = flat_arrays();
        for array in &arrays {
            assert!(is_flat(array.data_type()), "{}", array.data_type());
            let data = array.to_data();
            let (mut typed, mut whole) = (Plan::default(), Plan::default());
            let a = typed.column(array.as_ref(), None).unwrap();
            let b = whole.column(array.as_ref(), Some(&data)).unwrap();
            assert_eq!(format!("{a:?}"), format!("{b:?}"), "{}", array.data_type());
            assert_eq!(typed.size(), whole.size());
            let (mut x, mut y) = (vec![0xAA; typed.size()], vec![0x55; whole.size()]);
            typed.fill(0, &mut x);
            whole.fill(0, &mut y);
            assert_eq!(x, y, "{}", array.data_type());
        }
        assert_eq!(column_data(&[arrays[0].as_ref()]).len(), 1);
        assert!(column_data(&[arrays[0].as_ref()])[0].is_none());
    }

    /// The plan of flat columns, in any order and one by one, stays within the bound its upload
    /// allocates before planning; a column of another type has none.
    #[test]
    fn flat_columns_plan_within_their_bound() {
        let mut arrays = flat_arrays();
        for _ in 0..2 {
            let refs: Vec<&dyn Array> = arrays.iter().map(|a| a.as_ref()).collect();
            let mut plan = Plan::default();
            for a in &refs {
                plan.column(*a, None).unwrap();
                let bound = flat_size_bound(&[*a]).unwrap();
                let mut alone = Plan::default();
                alone.column(*a, None).unwrap();
                assert!(alone.size() <= bound, "{}: {} > {bound}", a.data_type(), alone.size());
            }
            let bound = flat_size_bound(&refs).unwrap();
            assert!(plan.size() <= bound, "{} > {bound}", plan.size());
            arrays.reverse();
        }
        let list: ArrayRef = Arc::new(arrow_array::ListArray::from_iter_primitive::<Int64Type, _, _>([Some(
            [Some(1)],
        )]));
        assert_eq!(flat_size_bound(&[arrays[0].as_ref(), list.as_ref()]), None);
    }
}
