//! Where one array's buffers are in one allocation, and the arrays built from those ranges: device
//! arrays of an upload's allocation ([`Layout::to_device`]), arrow arrays of a download's host block
//! ([`Layout::to_host`]).

use std::ops::Range;

use arrow_buffer::{BooleanBuffer, Buffer, NullBuffer};
use arrow_data::ArrayData;
use arrow_schema::{DataType, UnionMode};

use crate::array::{Buffers, DeviceArrayData};
use crate::error::{Error, Result, try_collect};
use crate::memory::DeviceBuffer;

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
        let nulls = match &self.nulls {
            None => None,
            Some(r) => {
                if r.len() < bits.div_ceil(8) {
                    return Err(Error::InvalidData(format!(
                        "validity bitmap of {} bytes is too short for {bits} bits",
                        r.len()
                    )));
                }
                Some(NullBuffer::new(BooleanBuffer::new(slice_of(memory, r)?, offset, len)))
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
