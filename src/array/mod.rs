//! Arrays and record batches whose buffers live on a device.
//!
//! [`DeviceArrayData`] mirrors arrow-rs [`ArrayData`]: the same data type, length, offset, null
//! bitmap, buffers and children (dictionary values are child 0, as in arrow-rs), with every buffer a
//! [`DeviceBuffer`]. CPU code never reads the buffers of a CUDA array; it reaches the host only
//! through an explicit copy (the transfer layer above this one).

use std::sync::Arc;

use arrow_data::ArrayData;
use arrow_schema::{DataType, Schema, SchemaRef};

use crate::device::{Device, Event};
use crate::error::{Error, Result};
use crate::memory::DeviceBuffer;
use crate::memory::fence::check_all;

mod sizes;

/// An array's data buffers: most arrays have one or two, kept inline.
pub(crate) type Buffers = smallvec::SmallVec<[DeviceBuffer; 2]>;

/// The layout of one array on a device, as arrow-rs [`ArrayData`] lays it out on the host.
#[derive(Clone, Debug)]
pub struct DeviceArrayData {
    pub(crate) data_type: DataType,
    pub(crate) len: usize,
    pub(crate) offset: usize,
    pub(crate) null_count: Option<usize>,
    pub(crate) nulls: Option<DeviceBuffer>,
    pub(crate) buffers: Buffers,
    pub(crate) children: Vec<DeviceArrayData>,
    /// The bytes were written by this crate from an arrow-rs array (which arrow-rs had validated)
    /// and cannot have changed since: buffers are immutable while shared, and the array holds
    /// views of them. Downloads of such arrays skip arrow-rs's validation. Arrays assembled from
    /// parts, imported or received are not trusted, and neither is an array whose memory was
    /// handed to another process ([`DeviceArrayData::is_trusted`]). A trusted array's memory is
    /// this process's own (allocated here, not lent by another process), so no fence guards it
    /// and [`DeviceArrayData::check_readable`] has nothing to ask.
    pub(crate) trusted: bool,
}

impl DeviceArrayData {
    /// Assembles an array from its parts, checking that every buffer is on one device, that the
    /// null count fits the length, and that the buffers and children, recursively, are those of
    /// the type ([`DeviceArrayData::children`] says how children are laid out).
    ///
    /// Every buffer and child whose size follows from `offset + len` is checked to be large enough,
    /// at every level of nesting: the validity bitmap (a bit per element), fixed-width values
    /// (booleans, primitives, decimals, `FixedSizeBinary`, dictionary keys, union type ids and
    /// dense union offsets, list view offsets and sizes, the 16-byte views of view arrays),
    /// `offset + len + 1` offsets of strings, binaries, lists and maps (none at all is accepted
    /// when `offset + len` is 0), the children of structs and sparse unions (`offset + len`
    /// elements) and of fixed-size lists (`(offset + len) * size`), and as many values as run ends
    /// in a run-end encoded array. An array that fails is an [`Error::InvalidData`] naming the
    /// buffer or child.
    ///
    /// What only the contents of the buffers tell is not checked, because CPU code never reads a
    /// device array's memory (on a GPU that would take a copy and a synchronisation): the size of
    /// the data buffer of `Utf8`, `Binary`, `LargeUtf8` and `LargeBinary` arrays (their last
    /// offset), the data buffers of view arrays (which the views address), the lengths of the
    /// children of lists, maps, list views and dense unions (reached through offsets and sizes),
    /// of dictionary values (reached through keys) and the length a run-end encoded array's last
    /// run end gives; nor whether offsets rise, type ids name children or keys lie in the values.
    /// The check is the same on every device, the CPU included. A copy to the host
    /// ([`crate::transfer`]) validates all of it; an array assembled from untrusted parts must be
    /// validated so before it is exported to a consumer that trusts it.
    #[allow(clippy::too_many_arguments)]
    pub fn try_new(
        data_type: DataType,
        len: usize,
        offset: usize,
        null_count: Option<usize>,
        nulls: Option<DeviceBuffer>,
        buffers: Vec<DeviceBuffer>,
        children: Vec<DeviceArrayData>,
    ) -> Result<Self> {
        if let Some(n) = null_count
            && (n > len || (n > 0 && nulls.is_none()))
        {
            return Err(Error::InvalidData(format!(
                "null count {n} with length {len} and bitmap: {}",
                nulls.is_some()
            )));
        }
        let data = DeviceArrayData {
            data_type,
            len,
            offset,
            null_count,
            nulls,
            buffers: buffers.into(),
            children,
            trusted: false,
        };
        data.check()?;
        Ok(data)
    }

    /// Checks what [`DeviceArrayData::try_new`] promises of every array: its buffers are on one
    /// device, and its type and its buffers and children, recursively, are laid out as arrow-rs
    /// lays them out (the buffer count of the type, a validity bitmap only where the type has one,
    /// the children of the type's fields, sizes that hold `offset + len` elements). The export
    /// relies on it. A trusted array (laid out by this crate from a valid arrow array: an upload,
    /// a concatenation) is so by construction and is not walked again.
    pub(crate) fn check(&self) -> Result<()> {
        if self.trusted {
            return Ok(());
        }
        one_device(self.all_buffers(), "array")?;
        check_type(&self.data_type)?;
        self.check_layout()
    }

    /// The layout part of [`DeviceArrayData::check`], for an array whose type passed [`check_type`]:
    /// buffers and children as the type has them, of the sizes the lengths need.
    fn check_layout(&self) -> Result<()> {
        let dt = &self.data_type;
        let (expected, variadic) = buffer_count(dt);
        let n = self.buffers.len();
        if n != expected && !(variadic && n > expected) {
            let at_least = if variadic { "at least " } else { "" };
            return Err(Error::InvalidData(format!(
                "{dt} array with {n} buffers; expected {at_least}{expected}"
            )));
        }
        if self.nulls.is_some() && !has_validity(dt) {
            return Err(Error::InvalidData(format!(
                "a {dt} array cannot have a validity bitmap"
            )));
        }
        let types = child_types(dt);
        if self.children.len() != types.len() {
            return Err(Error::InvalidData(format!(
                "{dt} array with {} children; expected {}",
                self.children.len(),
                types.len()
            )));
        }
        for (child, expected) in self.children.iter().zip(types) {
            if child.data_type() != expected {
                return Err(Error::InvalidData(format!(
                    "a {} child where {dt} has {expected}",
                    child.data_type()
                )));
            }
            child.check_layout()?;
        }
        sizes::check_sizes(self)
    }

    /// The Arrow data type.
    pub fn data_type(&self) -> &DataType {
        &self.data_type
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the array has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The offset of the first element in the buffers, in elements (bits for bitmaps).
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// The number of nulls, when known (a slice of an array with nulls does not know it).
    pub fn null_count(&self) -> Option<usize> {
        self.null_count
    }

    /// The validity bitmap, if any element may be null.
    pub fn nulls(&self) -> Option<&DeviceBuffer> {
        self.nulls.as_ref()
    }

    /// The data buffers, without the validity bitmap, in arrow-rs order.
    pub fn buffers(&self) -> &[DeviceBuffer] {
        &self.buffers
    }

    /// The children (dictionary values are child 0).
    pub fn children(&self) -> &[DeviceArrayData] {
        &self.children
    }

    /// The device the buffers live on (the CPU for an array without buffers).
    pub fn device(&self) -> Device {
        self.all_buffers().next().map_or(Device::Cpu, DeviceBuffer::device)
    }

    /// Every buffer of the array and its descendants, validity bitmaps included: each array's
    /// bitmap and buffers, then its children's, depth first. Allocates nothing for an array
    /// without children.
    pub fn all_buffers(&self) -> impl Iterator<Item = &DeviceBuffer> + '_ {
        AllBuffers {
            own: self.nulls.iter().chain(self.buffers.iter()),
            children: self.children.iter(),
            above: Vec::new(),
        }
    }

    /// Whether the array's memory can still be read: an error when a buffer (children included) lies
    /// in memory that another process lent and no longer keeps, because it died or reclaimed it
    /// ([`DeviceBuffer::check_readable`]). Every read of the array through this crate checks it
    /// first; code that hands the buffers' addresses on itself calls it too.
    pub fn check_readable(&self) -> Result<()> {
        match self.is_own_memory() {
            true => Ok(()),
            false => check_all(self.all_buffers()),
        }
    }

    /// Whether the array's memory is known to be this process's own, so that no fence guards it:
    /// a trusted array's is (see `trusted`).
    fn is_own_memory(&self) -> bool {
        debug_assert!(
            !self.trusted || self.all_buffers().all(|b| b.fence().is_none()),
            "a trusted array holds memory another process lent"
        );
        self.trusted
    }

    /// Whether a download may skip validating the array: its bytes were written by this crate from
    /// a valid arrow-rs array, and none of its buffers (children included) lies in memory that was
    /// ever exported to another process, which could have rewritten it since (a CUDA IPC mapping is
    /// always writable). Exported memory stays untrusted for good: the other process may keep
    /// writing until the allocation is freed.
    pub(crate) fn is_trusted(&self) -> bool {
        self.trusted && !self.all_buffers().any(DeviceBuffer::is_exported)
    }

    /// The total number of bytes of all buffers.
    pub fn size_in_bytes(&self) -> usize {
        self.all_buffers().map(DeviceBuffer::len).sum()
    }

    /// A zero-copy slice of `len` elements from `offset`. As in the C Data Interface, the offset of
    /// a struct applies to its children too.
    pub fn slice(&self, offset: usize, len: usize) -> Result<DeviceArrayData> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => {}
            _ => {
                return Err(Error::OutOfBounds {
                    offset,
                    len,
                    size: self.len,
                });
            }
        }
        let mut out = self.clone();
        out.len = len;
        out.offset = self.offset + offset;
        // Counting the slice's nulls would read the bitmap; it is unknown unless there were none.
        out.null_count = if self.null_count == Some(0) { Some(0) } else { None };
        Ok(out)
    }

    /// Converts to an arrow-rs [`ArrayData`] whose buffers point at this array's memory, for APIs
    /// that only move pointers (arrow-rs's C Data Interface export, say). The buffers keep the
    /// memory alive. Fails when a device array's null count is unknown (after a slice): arrow-rs
    /// would count it by reading the bitmap.
    ///
    /// # Safety
    /// When the array is not host-accessible, nothing may read the returned data's buffers on the
    /// CPU: no validation, no `make_array` accessors, no printing, no IPC writing. Only pointers may
    /// be moved.
    pub unsafe fn to_array_data_unchecked(&self) -> Result<ArrayData> {
        self.check_readable()?;
        // SAFETY: the caller's contract.
        unsafe { self.array_data_unchecked() }
    }

    /// [`DeviceArrayData::to_array_data_unchecked`] once the memory was found readable.
    ///
    /// # Safety
    /// As for [`DeviceArrayData::to_array_data_unchecked`].
    unsafe fn array_data_unchecked(&self) -> Result<ArrayData> {
        let children = self
            .children
            .iter()
            // SAFETY: the caller's contract covers the children.
            .map(|c| unsafe { c.array_data_unchecked() })
            .collect::<Result<Vec<_>>>()?;
        // SAFETY: the caller keeps the CPU away from device memory.
        let buffers = self
            .buffers
            .iter()
            .map(|b| unsafe { b.arrow_buffer_unchecked() })
            .collect();
        let mut builder = ArrayData::builder(self.data_type.clone())
            .len(self.len)
            .offset(self.offset)
            .buffers(buffers)
            .child_data(children);
        if let Some(n) = &self.nulls {
            if self.null_count.is_none() && !n.is_host_accessible() {
                return Err(Error::Unsupported(
                    "the null count of a sliced device array is unknown".into(),
                ));
            }
            // SAFETY: as above.
            builder = builder.null_bit_buffer(Some(unsafe { n.arrow_buffer_unchecked() }));
            if let Some(count) = self.null_count {
                builder = builder.null_count(count);
            }
        }
        // SAFETY: not validated, so nothing reads the buffers; the caller's contract covers the rest.
        Ok(unsafe { builder.build_unchecked() })
    }
}

/// A record batch whose columns live on a device, with the event that marks them ready. Clones
/// share the columns, as arrow-rs `RecordBatch` clones share their arrays.
#[derive(Clone, Debug)]
pub struct DeviceRecordBatch {
    schema: SchemaRef,
    columns: Arc<Vec<DeviceArrayData>>,
    num_rows: usize,
    ready: Event,
}

impl DeviceRecordBatch {
    /// Assembles a batch, checking column count, types and lengths against the schema, and that
    /// every buffer of every column is on one device.
    pub fn try_new(schema: SchemaRef, columns: Vec<DeviceArrayData>, num_rows: usize, ready: Event) -> Result<Self> {
        if schema.fields().len() != columns.len() {
            return Err(Error::InvalidData(format!(
                "schema has {} fields but {} columns were given",
                schema.fields().len(),
                columns.len()
            )));
        }
        one_device(columns.iter().flat_map(DeviceArrayData::all_buffers), "batch")?;
        for (field, column) in schema.fields().iter().zip(&columns) {
            if field.data_type() != column.data_type() {
                return Err(Error::InvalidData(format!(
                    "column {} has type {} but the schema says {}",
                    field.name(),
                    column.data_type(),
                    field.data_type()
                )));
            }
        }
        check_rows(&schema, &columns, num_rows)?;
        Ok(Self::of_columns(schema, columns, num_rows, ready))
    }

    /// Assembles a batch of columns that match `schema` (types and count), each of `num_rows`
    /// rows, all on one device: what [`DeviceRecordBatch::try_new`] checks, known by the caller
    /// (the columns were built from the schema's fields).
    pub(crate) fn of_columns(schema: SchemaRef, columns: Vec<DeviceArrayData>, num_rows: usize, ready: Event) -> Self {
        debug_assert!(schema.fields().len() == columns.len());
        debug_assert!(columns.iter().all(|c| c.len == num_rows));
        debug_assert!(
            schema
                .fields()
                .iter()
                .zip(&columns)
                .all(|(f, c)| f.data_type() == c.data_type())
        );
        DeviceRecordBatch {
            schema,
            columns: Arc::new(columns),
            num_rows,
            ready,
        }
    }

    /// The schema, with its metadata.
    pub fn schema(&self) -> &SchemaRef {
        &self.schema
    }

    /// The columns.
    pub fn columns(&self) -> &[DeviceArrayData] {
        &self.columns
    }

    /// The column at `i`.
    pub fn column(&self, i: usize) -> &DeviceArrayData {
        &self.columns[i]
    }

    /// The number of rows.
    pub fn num_rows(&self) -> usize {
        self.num_rows
    }

    /// The number of columns.
    pub fn num_columns(&self) -> usize {
        self.columns.len()
    }

    /// The event that completes when the columns' contents are in place. Work on another stream
    /// must wait on it ([`crate::Stream::wait`]) before using them.
    pub fn ready(&self) -> &Event {
        &self.ready
    }

    /// The device of the columns (the CPU for a batch without buffers).
    pub fn device(&self) -> Device {
        self.columns
            .iter()
            .find(|c| c.all_buffers().next().is_some())
            .map_or(Device::Cpu, DeviceArrayData::device)
    }

    /// The total bytes of all buffers.
    pub fn size_in_bytes(&self) -> usize {
        self.columns.iter().map(DeviceArrayData::size_in_bytes).sum()
    }

    /// Whether the batch's memory can still be read: an error once the process that lent it (the
    /// sender of a batch received through [`crate::ipc::Receiver`]) no longer keeps it
    /// ([`DeviceArrayData::check_readable`]).
    pub fn check_readable(&self) -> Result<()> {
        let maybe_lent = self.columns.iter().filter(|c| !c.is_own_memory());
        check_all(maybe_lent.flat_map(DeviceArrayData::all_buffers))
    }

    /// Keeps only the columns at `indices`, in that order, sharing their memory.
    pub fn project(&self, indices: &[usize]) -> Result<DeviceRecordBatch> {
        let schema = Arc::new(self.schema.project(indices)?);
        let columns = indices.iter().map(|&i| self.columns[i].clone()).collect();
        Ok(DeviceRecordBatch {
            schema,
            columns: Arc::new(columns),
            num_rows: self.num_rows,
            ready: self.ready.clone(),
        })
    }

    /// A zero-copy slice of `len` rows from `offset`.
    pub fn slice(&self, offset: usize, len: usize) -> Result<DeviceRecordBatch> {
        let columns = self
            .columns
            .iter()
            .map(|c| c.slice(offset, len))
            .collect::<Result<_>>()?;
        Ok(DeviceRecordBatch {
            schema: self.schema.clone(),
            columns: Arc::new(columns),
            num_rows: len,
            ready: self.ready.clone(),
        })
    }
}

/// The walk of [`DeviceArrayData::all_buffers`].
struct AllBuffers<'a> {
    /// The buffers of the array being walked.
    own: std::iter::Chain<std::option::Iter<'a, DeviceBuffer>, std::slice::Iter<'a, DeviceBuffer>>,
    /// Its children not walked yet.
    children: std::slice::Iter<'a, DeviceArrayData>,
    /// The children left at each level above it.
    above: Vec<std::slice::Iter<'a, DeviceArrayData>>,
}

impl<'a> Iterator for AllBuffers<'a> {
    type Item = &'a DeviceBuffer;

    fn next(&mut self) -> Option<&'a DeviceBuffer> {
        loop {
            if let Some(b) = self.own.next() {
                return Some(b);
            }
            match self.children.next() {
                Some(child) => {
                    let siblings = std::mem::replace(&mut self.children, child.children.iter());
                    self.above.push(siblings);
                    self.own = child.nulls.iter().chain(child.buffers.iter());
                }
                None => self.children = self.above.pop()?,
            }
        }
    }
}

/// Fails unless each of `columns` (those of `schema`'s fields, in order) has `num_rows` elements.
pub(crate) fn check_rows(schema: &Schema, columns: &[DeviceArrayData], num_rows: usize) -> Result<()> {
    match schema.fields().iter().zip(columns).find(|(_, c)| c.len != num_rows) {
        Some((field, column)) => Err(Error::InvalidData(format!(
            "column {} has {} rows, the batch {num_rows}",
            field.name(),
            column.len
        ))),
        None => Ok(()),
    }
}

/// Fails when `buffers` are not all on one device (of one `what`: an array, a batch).
fn one_device<'a>(mut buffers: impl Iterator<Item = &'a DeviceBuffer>, what: &str) -> Result<()> {
    let Some(first) = buffers.next().map(DeviceBuffer::device) else {
        return Ok(());
    };
    match buffers.map(DeviceBuffer::device).find(|d| *d != first) {
        Some(other) => Err(Error::InvalidData(format!(
            "buffers on {first} and {other} in one {what}"
        ))),
        None => Ok(()),
    }
}

/// The data buffers an array of `dt` has (beside the validity bitmap), and whether it may have
/// more (the data buffers of views): arrow-rs's `layout`, which allocates, asked only for types
/// other than primitives, booleans, strings and binaries.
fn buffer_count(dt: &DataType) -> (usize, bool) {
    match dt {
        DataType::Utf8 | DataType::Binary | DataType::LargeUtf8 | DataType::LargeBinary => (2, false),
        DataType::Boolean => (1, false),
        dt if dt.is_primitive() => (1, false),
        dt => {
            let spec = arrow_data::layout(dt);
            (spec.buffers.len(), spec.variadic)
        }
    }
}

/// Whether an array of `dt` has a validity bitmap: every type but null, unions and run-end encoded
/// arrays (as arrow-rs's `layout` says, without building the layout).
pub(crate) fn has_validity(dt: &DataType) -> bool {
    !matches!(dt, DataType::Null | DataType::Union(..) | DataType::RunEndEncoded(..))
}

/// The types of the children that arrow-rs gives an array of `dt` (dictionary values are child 0).
pub(crate) fn child_types(dt: &DataType) -> Vec<&DataType> {
    match dt {
        DataType::List(f)
        | DataType::LargeList(f)
        | DataType::ListView(f)
        | DataType::LargeListView(f)
        | DataType::FixedSizeList(f, _)
        | DataType::Map(f, _) => vec![f.data_type()],
        DataType::Struct(fields) => fields.iter().map(|f| f.data_type()).collect(),
        DataType::Union(fields, _) => fields.iter().map(|(_, f)| f.data_type()).collect(),
        DataType::Dictionary(_, values) => vec![values],
        DataType::RunEndEncoded(run_ends, values) => vec![run_ends.data_type(), values.data_type()],
        _ => vec![],
    }
}

/// Checks that `dt` and every type nested in it describe a layout: fixed sizes that are not
/// negative (a C producer can write `w:-1`, on which arrow-rs's layout panics), integer dictionary
/// keys and run ends, and map entries that are a struct of two fields.
pub(crate) fn check_type(dt: &DataType) -> Result<()> {
    check_own_type(dt)?;
    child_types(dt).into_iter().try_for_each(check_type)
}

/// [`check_type`] of `dt` alone, not of the types nested in it: for a walk that visits those itself.
#[inline]
pub(crate) fn check_own_type(dt: &DataType) -> Result<()> {
    let fault = match dt {
        DataType::FixedSizeBinary(w) if *w < 0 => Some("a negative width"),
        DataType::FixedSizeList(_, n) if *n < 0 => Some("a negative size"),
        DataType::Dictionary(key, _) if !key.is_dictionary_key_type() => Some("a key type that is not an integer"),
        DataType::RunEndEncoded(r, _)
            if !matches!(r.data_type(), DataType::Int16 | DataType::Int32 | DataType::Int64) =>
        {
            Some("run ends that are not Int16, Int32 or Int64")
        }
        DataType::Map(f, _) if !matches!(f.data_type(), DataType::Struct(entries) if entries.len() == 2) => {
            Some("entries that are not a struct of two fields")
        }
        _ => None,
    };
    match fault {
        Some(fault) => Err(Error::InvalidData(format!("{dt} has {fault}"))),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow_schema::{Field, Fields, UnionFields, UnionMode};

    use super::*;

    #[test]
    fn has_validity_agrees_with_arrow_rs_layouts() {
        let item = Arc::new(Field::new("item", DataType::Int32, true));
        let entries = Fields::from(vec![
            Field::new("k", DataType::Utf8, false),
            Field::new("v", DataType::Int32, true),
        ]);
        let union = UnionFields::try_new(vec![0, 1], entries.iter().map(|f| f.as_ref().clone())).unwrap();
        let types = [
            DataType::Null,
            DataType::Boolean,
            DataType::Int32,
            DataType::Float64,
            DataType::Decimal128(10, 2),
            DataType::FixedSizeBinary(3),
            DataType::Utf8,
            DataType::LargeBinary,
            DataType::Utf8View,
            DataType::List(item.clone()),
            DataType::LargeListView(item.clone()),
            DataType::FixedSizeList(item.clone(), 2),
            DataType::Struct(entries.clone()),
            DataType::Map(Arc::new(Field::new("entries", DataType::Struct(entries), false)), false),
            DataType::Union(union.clone(), UnionMode::Sparse),
            DataType::Union(union, UnionMode::Dense),
            DataType::Dictionary(Box::new(DataType::Int8), Box::new(DataType::Utf8)),
            DataType::RunEndEncoded(
                Arc::new(Field::new("run_ends", DataType::Int32, false)),
                Arc::new(Field::new("values", DataType::Utf8, true)),
            ),
        ];
        for dt in &types {
            assert_eq!(has_validity(dt), arrow_data::layout(dt).can_contain_null_mask, "{dt}");
        }
    }
}
