//! Where one array's buffers are in one allocation, and the arrays built from those ranges: device
//! arrays of an upload's allocation ([`Layout::to_device`]), arrow arrays of a download's host block
//! ([`Layout::to_host`]).

use std::ops::Range;

use std::sync::Arc;

use arrow_array::types::{ByteArrayType, GenericBinaryType, GenericStringType};
use arrow_array::{ArrayRef, ArrowPrimitiveType, BooleanArray, GenericByteArray, PrimitiveArray, make_array};
use arrow_buffer::{ArrowNativeType, BooleanBuffer, Buffer, NullBuffer, OffsetBuffer, ScalarBuffer};
use arrow_data::ArrayData;
use arrow_schema::{DataType, UnionMode};

use crate::array::{Buffers, DeviceArrayData};
use crate::error::{Error, Result, try_collect};
use crate::memory::DeviceBuffer;

use super::plan::is_flat;

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
            // Leaves (most columns) skip the call and the vector it returns.
            children: match self.children.is_empty() {
                true => Vec::new(),
                false => try_collect(self.children.iter().map(|c| c.to_device(memory)))?,
            },
            trusted: true,
        })
    }

    /// The arrow array these ranges of `memory` (a host block wrapped as one arrow buffer) hold,
    /// fully validated unless the layout is trusted. Its buffers are slices of `memory`.
    pub fn to_host(&self, memory: &Buffer) -> Result<ArrayData> {
        self.host_window(memory, 0, self.len)
    }

    /// [`Layout::to_host`] as an arrow array: [`Layout::to_host_array_unread`] where it builds
    /// one, else through an `ArrayData`.
    pub fn to_host_array(&self, memory: &Buffer) -> Result<ArrayRef> {
        match self.to_host_array_unread(memory)? {
            Some(array) => Ok(array),
            None => Ok(make_array(self.to_host(memory)?)),
        }
    }

    /// The arrow array of a layout built without reading any of its bytes in `memory` (so also
    /// while they are still being copied there), or `None` where that cannot be done: a trusted
    /// layout of a flat type (primitives, booleans, strings, binaries) whose null count is known
    /// and whose buffers are aligned to their types, built as its typed array straight from the
    /// buffers, without an `ArrayData` in between or counting its nulls again.
    pub fn to_host_array_unread(&self, memory: &Buffer) -> Result<Option<ArrayRef>> {
        // Counting the nulls would read the bitmap.
        let uncounted = self.nulls.is_some() && self.null_count.is_none();
        if !self.trusted || uncounted || !is_flat(&self.data_type) {
            return Ok(None);
        }
        let (offset, len) = (self.offset, self.len);
        let bits = offset
            .checked_add(len)
            .ok_or_else(|| Error::InvalidData("length overflows".into()))?;
        let Some(first) = self.buffers.first() else {
            return Ok(None);
        };
        let nulls = (self.nulls.as_ref().zip(self.null_count))
            .map(|(r, n)| self.host_nulls(memory, r, n))
            .transpose()?;
        let array: ArrayRef = match &self.data_type {
            DataType::Boolean => {
                self.bitmap_fits(first, bits)?;
                Arc::new(BooleanArray::new(
                    BooleanBuffer::new(slice_of(memory, first)?, offset, len),
                    nulls,
                ))
            }
            DataType::Utf8 => return self.flat_bytes::<GenericStringType<i32>>(memory, nulls),
            DataType::LargeUtf8 => return self.flat_bytes::<GenericStringType<i64>>(memory, nulls),
            DataType::Binary => return self.flat_bytes::<GenericBinaryType<i32>>(memory, nulls),
            DataType::LargeBinary => return self.flat_bytes::<GenericBinaryType<i64>>(memory, nulls),
            dt => {
                macro_rules! primitive {
                    ($t:ty) => {
                        self.flat_primitive::<$t>(memory, nulls)
                    };
                }
                return arrow_array::downcast_primitive!(dt => (primitive), _ => Ok(None));
            }
        };
        Ok(Some(array))
    }

    /// The validity bitmap at `r` of `memory` of a trusted layout, with its null count `n`.
    fn host_nulls(&self, memory: &Buffer, r: &Range<usize>, n: usize) -> Result<NullBuffer> {
        self.bitmap_fits(r, self.offset + self.len)?;
        let bits = BooleanBuffer::new(slice_of(memory, r)?, self.offset, self.len);
        // SAFETY: a trusted layout's null count is that of a valid arrow array's bitmap, whose bytes
        // these are.
        Ok(unsafe { NullBuffer::new_unchecked(bits, n) })
    }

    /// An error unless the bitmap at `r` holds `bits` bits.
    fn bitmap_fits(&self, r: &Range<usize>, bits: usize) -> Result<()> {
        if r.len() < bits.div_ceil(8) {
            return Err(Error::InvalidData(format!(
                "bitmap of {} bytes is too short for {bits} bits of {}",
                r.len(),
                self.data_type
            )));
        }
        Ok(())
    }

    /// The `count` elements of `T` from element `offset` of the buffer at `r` of `memory`, or
    /// `None` when the buffer is not aligned to `T`.
    fn scalars<T: ArrowNativeType>(
        &self,
        memory: &Buffer,
        r: &Range<usize>,
        offset: usize,
        count: usize,
    ) -> Result<Option<ScalarBuffer<T>>> {
        let size = std::mem::size_of::<T>();
        if offset
            .checked_add(count)
            .and_then(|n| n.checked_mul(size))
            .is_none_or(|n| n > r.len())
        {
            return Err(Error::InvalidData(format!(
                "buffer of {} bytes is too short for {count} elements of {}",
                r.len(),
                self.data_type
            )));
        }
        let buffer = slice_of(memory, r)?;
        if buffer.as_ptr().align_offset(std::mem::align_of::<T>()) != 0 {
            return Ok(None);
        }
        Ok(Some(ScalarBuffer::new(buffer, offset, count)))
    }

    /// A primitive array of type `T` (and this layout's data type, with its parameters).
    fn flat_primitive<T: ArrowPrimitiveType>(
        &self,
        memory: &Buffer,
        nulls: Option<NullBuffer>,
    ) -> Result<Option<ArrayRef>> {
        let Some(values) = self.scalars::<T::Native>(memory, self.buffer_at(0)?, self.offset, self.len)? else {
            return Ok(None);
        };
        let array = PrimitiveArray::<T>::try_new(values, nulls)?.with_data_type(self.data_type.clone());
        Ok(Some(Arc::new(array)))
    }

    /// A string or binary array of type `T`, its offsets and data taken as they are.
    fn flat_bytes<T: ByteArrayType>(&self, memory: &Buffer, nulls: Option<NullBuffer>) -> Result<Option<ArrayRef>> {
        let Some(offsets) = self.scalars::<T::Offset>(memory, self.buffer_at(0)?, self.offset, self.len + 1)? else {
            return Ok(None);
        };
        let values = slice_of(memory, self.buffer_at(1)?)?;
        if nulls.as_ref().is_some_and(|n| n.len() != self.len) {
            return Err(Error::InvalidData(format!(
                "{} bitmap of another length",
                self.data_type
            )));
        }
        // SAFETY: a trusted layout holds the bytes of a valid arrow array (see `to_host`): its
        // offsets start within, rise through and end within `values`, and strings are UTF-8.
        let array =
            unsafe { GenericByteArray::<T>::new_unchecked(OffsetBuffer::new_unchecked(offsets), values, nulls) };
        Ok(Some(Arc::new(array)))
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
        let nulls = match &self.nulls {
            None => None,
            Some(r) => {
                if r.len() < bits.div_ceil(8) {
                    return Err(Error::InvalidData(format!(
                        "validity bitmap of {} bytes is too short for {bits} bits",
                        r.len()
                    )));
                }
                let bits = BooleanBuffer::new(slice_of(memory, r)?, offset, len);
                Some(match self.null_count {
                    // SAFETY: a trusted layout's null count is that of a valid arrow array's
                    // bitmap, whose bytes these are; it holds for the whole array only.
                    Some(n) if self.trusted && start == 0 && len == self.len => unsafe {
                        NullBuffer::new_unchecked(bits, n)
                    },
                    _ => NullBuffer::new(bits),
                })
            }
        };
        let (offset, buffers, children) = self.host_contents(memory, offset, len)?;
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

    /// The offset, buffers and children of elements `offset..offset + len` (`offset` counted from
    /// the start of the buffers) in `memory`, as [`Layout::host_window`] builds them: structs,
    /// fixed-size lists and unions with offset 0 and their offset moved into their children's
    /// windows and their own buffers.
    fn host_contents(
        &self,
        memory: &Buffer,
        offset: usize,
        len: usize,
    ) -> Result<(usize, Vec<Buffer>, Vec<ArrayData>)> {
        let whole = |c: &Layout| c.host_window(memory, 0, c.len);
        Ok(match &self.data_type {
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
                let mut buffers = vec![self.cut(memory, self.buffer_at(0)?, offset, len)?];
                let children: Result<Vec<_>> = match mode {
                    UnionMode::Sparse => self
                        .children
                        .iter()
                        .map(|c| c.host_window(memory, offset, len))
                        .collect(),
                    UnionMode::Dense => {
                        buffers.push(self.cut(memory, self.buffer_at(1)?, offset * 4, len * 4)?);
                        self.children.iter().map(whole).collect()
                    }
                };
                (0, buffers, children?)
            }
            _ => (
                offset,
                self.buffers
                    .iter()
                    .map(|r| slice_of(memory, r))
                    .collect::<Result<_>>()?,
                self.children.iter().map(whole).collect::<Result<_>>()?,
            ),
        })
    }

    /// The range of buffer `i`, or an error naming the missing buffer.
    fn buffer_at(&self, i: usize) -> Result<&Range<usize>> {
        self.buffers
            .get(i)
            .ok_or_else(|| Error::InvalidData(format!("{} array without buffer {i}", self.data_type)))
    }

    /// `n` bytes from byte `from` of the buffer at `r` of `memory`.
    fn cut(&self, memory: &Buffer, r: &Range<usize>, from: usize, n: usize) -> Result<Buffer> {
        if from.checked_add(n).is_none_or(|end| end > r.len()) {
            return Err(Error::InvalidData(format!(
                "buffer of {} bytes is too short for {}",
                r.len(),
                self.data_type
            )));
        }
        slice_of(memory, &(r.start + from..r.start + from + n))
    }
}

/// The bytes at `r` of `memory`, or an error naming the overrun.
fn slice_of(memory: &Buffer, r: &Range<usize>) -> Result<Buffer> {
    if r.start > r.end || r.end > memory.len() {
        return Err(Error::OutOfBounds {
            offset: r.start,
            len: r.len(),
            size: memory.len(),
        });
    }
    Ok(memory.slice_with_length(r.start, r.len()))
}

#[cfg(test)]
mod tests {
    use std::alloc::Layout as AllocLayout;
    use std::ptr::NonNull;

    use arrow_array::builder::{Int32Builder, ListBuilder};
    use arrow_array::{Array, BooleanArray, Float64Array, Int32Array, LargeBinaryArray, StringArray};

    use super::*;
    use crate::transfer::plan::{Plan, column_data};

    /// Memory written after arrow buffers over it were made, as a DMA writes a download's block.
    struct Block {
        ptr: NonNull<u8>,
        layout: AllocLayout,
    }

    // SAFETY: the block is plain memory, freed once, by its last owner.
    unsafe impl Send for Block {}
    // SAFETY: as for `Send`; the block itself is never read or written through `&Block`.
    unsafe impl Sync for Block {}

    impl Drop for Block {
        fn drop(&mut self) {
            // SAFETY: allocated in `block` with this layout.
            unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
        }
    }

    /// A block of `len` bytes of 0xAB, as an arrow buffer, and a pointer to write it through.
    fn block(len: usize) -> (Buffer, *mut u8) {
        let layout = AllocLayout::from_size_align(len.max(1), 64).unwrap();
        // SAFETY: the layout has a non-zero size.
        let ptr = NonNull::new(unsafe { std::alloc::alloc(layout) }).unwrap();
        // SAFETY: `len` bytes just allocated.
        unsafe { ptr.as_ptr().write_bytes(0xAB, len) };
        let owner = Arc::new(Block { ptr, layout });
        // SAFETY: `len` bytes of memory that `owner` keeps alive.
        let buffer = unsafe { Buffer::from_custom_allocation(ptr, len, owner) };
        (buffer, ptr.as_ptr())
    }

    /// Trusted arrays of flat types are built before their bytes are in the block and read them
    /// once they are; others (nested, untrusted, nulls not counted) wait for the bytes.
    #[test]
    fn flat_trusted_arrays_are_built_before_their_bytes_land() {
        let mut list = ListBuilder::new(Int32Builder::new());
        for i in 0..50 {
            list.values().append_slice(&[i, i + 1]);
            list.append(i % 4 != 0);
        }
        let arrays: Vec<ArrayRef> = vec![
            Arc::new(Int32Array::from_iter((0..300).map(|i| (i % 3 != 0).then_some(i)))),
            Arc::new(StringArray::from_iter((0..300).map(|i| (i % 5 != 0).then(|| format!("s{i}")))).slice(7, 200)),
            Arc::new(BooleanArray::from_iter((0..99).map(|i| Some(i % 2 == 0)))),
            Arc::new(Float64Array::from_iter_values((0..10).map(f64::from))),
            Arc::new(LargeBinaryArray::from_iter_values([b"ab".as_slice(), b"", b"cde"])),
            Arc::new(list.finish()),
        ];
        let refs: Vec<&dyn Array> = arrays.iter().map(|a| a.as_ref()).collect();
        let data = column_data(&refs);
        let mut plan = Plan::for_columns(refs.len());
        let mut layouts: Vec<Layout> = refs
            .iter()
            .zip(&data)
            .map(|(a, d)| plan.column(*a, d.as_ref()).unwrap())
            .collect();
        let (memory, at) = block(plan.size());
        assert!(
            layouts
                .iter()
                .all(|l| l.to_host_array_unread(&memory).unwrap().is_none())
        );
        for l in &mut layouts {
            l.trusted = true;
        }
        let early: Vec<Option<ArrayRef>> = layouts
            .iter()
            .map(|l| l.to_host_array_unread(&memory).unwrap())
            .collect();
        assert!(early[..5].iter().all(Option::is_some));
        assert!(early[5].is_none(), "a list is built once its bytes are in");
        let mut uncounted = layouts[0].clone();
        uncounted.null_count = None;
        assert!(uncounted.to_host_array_unread(&memory).unwrap().is_none());
        // The bytes land.
        // SAFETY: `at` is the block's start and the block holds `plan.size()` bytes, which nothing
        // reads while they are written.
        plan.fill(0, unsafe { std::slice::from_raw_parts_mut(at, plan.size()) });
        for ((array, layout), early) in arrays.iter().zip(&layouts).zip(early) {
            let built = early.unwrap_or_else(|| layout.to_host_array(&memory).unwrap());
            assert_eq!(&built, array);
        }
    }
}
