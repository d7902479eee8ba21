//! Building device arrays from a `RecordBatch` message's metadata, with every count and size checked
//! against the schema before anything is built.
//!
//! The metadata is host memory (verified by the flatbuffers verifier in `arrow_ipc::root_as_message`);
//! the buffers it names are device memory that is never read here. Each buffer is resolved to a
//! [`DeviceBuffer`] by the caller (a slice of a message body, or of a region received from another
//! process), which checks that it lies inside that memory. What can be checked without reading the
//! device is checked: node and buffer counts, null counts, the sizes of every fixed-size buffer,
//! children's lengths. What depends on the data (string and list offsets, view indices, union type
//! ids, dictionary keys) is checked when the batch is copied to the host ([`crate::transfer::dtoh`]
//! validates every array); device code that reads a received batch must treat those as untrusted.
//! The schema's types are checked as [`DeviceArrayData::try_new`] checks them, each as the decoder
//! reaches its arrays (the value types of dictionaries in their `DictionaryBatch`); every array built
//! from them then passes its other checks too (one device, the buffers and children of its type,
//! sizes that hold its elements) by construction, so those are not run again on every receive:
//! debug builds assert it, and the fuzz targets of `tests/ipc_fuzz.rs` (run in debug builds in CI)
//! feed the decoder malformed metadata and descriptors.
//!
//! Dictionaries come first, one `DictionaryBatch` message each ([`dictionary`]); the batch's
//! dictionary-encoded arrays then take their values from them by id ([`crate::ipc::layout`] says
//! how ids are numbered).

use std::collections::HashMap;

use arrow_ipc::{MessageHeader, MetadataVersion};
use arrow_schema::{DataType, Field, Fields, Schema, SchemaRef, UnionMode};

use crate::array::{Buffers, DeviceArrayData, DeviceRecordBatch, check_own_type, check_rows};
use crate::device::{Device, Event};
use crate::error::{Error, Result};
use crate::ipc::layout::{Sizes, dictionaries_in, fixed_sizes, has_validity};
use crate::memory::{ALIGNMENT, DeviceBuffer};

/// Nesting deeper than this is refused.
const MAX_DEPTH: usize = 64;

fn invalid(msg: impl Into<String>) -> Error {
    Error::InvalidData(msg.into())
}

/// `value` as a count. Inlined: a batch's metadata has a few hundred counts, and the error is
/// made apart, out of the way.
#[inline]
fn count(value: i64, what: &str) -> Result<usize> {
    match usize::try_from(value) {
        Ok(n) => Ok(n),
        Err(_) => Err(negative(value, what)),
    }
}

#[cold]
fn negative(value: i64, what: &str) -> Error {
    invalid(format!("negative {what} ({value}) in IPC metadata"))
}

/// A zero-length buffer on `device`.
pub(crate) fn empty_buffer(device: Device) -> DeviceBuffer {
    // SAFETY: a zero-length range is never read or written; the address is aligned and non-null.
    unsafe { DeviceBuffer::from_raw_parts(ALIGNMENT as u64, 0, device, ()) }
}

/// Where the IPC buffers of a message lie in device memory.
pub(crate) trait Resolve {
    /// The memory that holds IPC buffer `index` (`len` bytes at `offset` in the metadata) and where
    /// in it the buffer starts, once checked to lie inside it ([`Error::InvalidData`] otherwise).
    fn check(&self, index: usize, offset: usize, len: usize) -> Result<(&DeviceBuffer, usize)>;

    /// [`Resolve::check`] without its error, which comes back in registers where a `Result` comes
    /// back through memory, to be read before the stores that wrote it have landed: the decoder
    /// asks for every buffer of a batch, and for the error of a buffer not found only.
    fn find(&self, index: usize, offset: usize, len: usize) -> Option<(&DeviceBuffer, usize)> {
        self.check(index, offset, len).ok()
    }
}

/// The dictionaries received so far, by id.
pub(crate) type Dictionaries = HashMap<i64, DeviceArrayData>;

/// The checked header of a `RecordBatch` message, or of the record batch in a `DictionaryBatch`.
pub(crate) struct Header<'m> {
    pub version: MetadataVersion,
    /// The dictionary id, for a `DictionaryBatch` message.
    pub dictionary: Option<i64>,
    pub batch: arrow_ipc::RecordBatch<'m>,
    pub body_len: usize,
}

/// Checks that `message` is an uncompressed `RecordBatch` or (replacing, not delta)
/// `DictionaryBatch` message of a version this crate reads.
pub(crate) fn header<'m>(message: &arrow_ipc::Message<'m>) -> Result<Header<'m>> {
    let version = message.version();
    if version != MetadataVersion::V4 && version != MetadataVersion::V5 {
        return Err(invalid(format!("IPC metadata version {version:?}; V4 and V5 are read")));
    }
    let (dictionary, batch) = match message.header_type() {
        MessageHeader::DictionaryBatch => {
            let d = message
                .header_as_dictionary_batch()
                .ok_or_else(|| invalid("a DictionaryBatch message without its header"))?;
            if d.isDelta() {
                return Err(Error::Unsupported(
                    "delta dictionaries cannot be read on a device".into(),
                ));
            }
            (Some(d.id()), d.data())
        }
        _ => (None, message.header_as_record_batch()),
    };
    let batch = batch.ok_or_else(|| {
        invalid(format!(
            "an IPC message with a {:?} header, not a RecordBatch",
            message.header_type()
        ))
    })?;
    if batch.compression().is_some() {
        return Err(Error::Unsupported(
            "compressed IPC bodies cannot be read on a device".into(),
        ));
    }
    let body_len = count(message.bodyLength(), "body length")?;
    Ok(Header {
        version,
        dictionary,
        batch,
        body_len,
    })
}

/// Parses flatbuffer `metadata` (verified) into a `Message`.
pub(crate) fn parse(metadata: &[u8]) -> Result<arrow_ipc::Message<'_>> {
    arrow_ipc::root_as_message(metadata).map_err(|e| invalid(format!("IPC metadata is not a valid Message: {e}")))
}

/// Builds the batch a `RecordBatch` header describes, on `device`, with `ready` as its event. Its
/// buffers are numbered from `first_buffer` when resolved; its dictionary-encoded arrays take their
/// values from `dictionaries`.
pub(crate) fn batch(
    schema: &SchemaRef,
    header: &Header<'_>,
    device: Device,
    resolve: &dyn Resolve,
    first_buffer: usize,
    dictionaries: &Dictionaries,
    ready: Event,
) -> Result<DeviceRecordBatch> {
    if let Some(id) = header.dictionary {
        return Err(invalid(format!(
            "dictionary {id} where a RecordBatch message was expected"
        )));
    }
    let num_rows = count(header.batch.length(), "batch length")?;
    let mut d = Decoder::new(header, device, resolve, first_buffer, 0, dictionaries);
    let columns = d.arrays(schema.fields().iter().map(AsRef::as_ref), 0)?;
    d.finish()?;
    check_rows(schema, &columns, num_rows)?;
    // One column per field, of its (checked) type, every buffer on `device`, of the sizes its
    // length needs: built so.
    debug_assert!(columns.iter().all(|c| c.check().is_ok()));
    Ok(DeviceRecordBatch::of_columns(schema.clone(), columns, num_rows, ready))
}

/// Builds the dictionary a `DictionaryBatch` header describes and adds it to `dictionaries`
/// (replacing one of the same id). Its buffers are numbered from `first_buffer` when resolved.
pub(crate) fn dictionary(
    schema: &Schema,
    header: &Header<'_>,
    device: Device,
    resolve: &dyn Resolve,
    first_buffer: usize,
    dictionaries: &mut Dictionaries,
) -> Result<()> {
    let id = header
        .dictionary
        .ok_or_else(|| invalid("a RecordBatch message where a dictionary was expected"))?;
    let values = value_type(schema.fields(), id, &mut 0)
        .ok_or_else(|| invalid(format!("dictionary id {id}: the schema has no such dictionary")))?;
    let len = count(header.batch.length(), "dictionary length")?;
    let first_id = id - dictionaries_in(&values) as i64;
    let mut d = Decoder::new(header, device, resolve, first_buffer, first_id, dictionaries);
    let array = d
        .arrays([&Field::new("dictionary", values, true)], 0)?
        .pop()
        .expect("one array");
    d.finish()?;
    debug_assert!(array.check().is_ok());
    if array.len() != len {
        return Err(invalid(format!(
            "dictionary {id} says {len} values and its field node {}",
            array.len()
        )));
    }
    dictionaries.insert(id, array);
    Ok(())
}

/// The value type of the dictionary numbered `id` among `fields`, counting from `*next`.
fn value_type(fields: &Fields, id: i64, next: &mut i64) -> Option<DataType> {
    fields.iter().find_map(|f| value_type_in(f.data_type(), id, next))
}

fn value_type_in(dt: &DataType, id: i64, next: &mut i64) -> Option<DataType> {
    match dt {
        DataType::Dictionary(_, values) => value_type_in(values, id, next).or_else(|| {
            *next += 1;
            (*next - 1 == id).then(|| values.as_ref().clone())
        }),
        DataType::List(f)
        | DataType::LargeList(f)
        | DataType::ListView(f)
        | DataType::LargeListView(f)
        | DataType::FixedSizeList(f, _)
        | DataType::Map(f, _) => value_type_in(f.data_type(), id, next),
        DataType::Struct(fields) => value_type(fields, id, next),
        DataType::Union(fields, _) => fields.iter().find_map(|(_, f)| value_type_in(f.data_type(), id, next)),
        DataType::RunEndEncoded(_, values) => value_type_in(values.data_type(), id, next),
        _ => None,
    }
}

/// Entry `i` of a flatbuffer vector of 16-byte structs of two little-endian `i64`s (`FieldNode`,
/// `Buffer`), read from its bytes: no copy of the vector is made.
fn pair(vector: &[u8], i: usize) -> Option<(i64, i64)> {
    let entry = vector.get(16 * i..16 * i + 16)?;
    let word = |b: &[u8]| i64::from_le_bytes(b.try_into().expect("8 bytes"));
    Some((word(&entry[..8]), word(&entry[8..])))
}

struct Decoder<'m, 'r, 'd> {
    version: MetadataVersion,
    /// The metadata's field nodes and buffers, as the bytes of their vectors.
    nodes: &'m [u8],
    buffers: &'m [u8],
    variadic: Vec<i64>,
    next_node: usize,
    next_buffer: usize,
    next_variadic: usize,
    /// The number given to this message's first buffer.
    first_buffer: usize,
    /// The id of the next dictionary-encoded array met.
    next_dictionary: i64,
    dictionaries: &'d Dictionaries,
    device: Device,
    resolve: &'r dyn Resolve,
    /// The zero-length buffer every empty buffer shares, once one is met.
    empty: Option<DeviceBuffer>,
}

impl<'m, 'r, 'd> Decoder<'m, 'r, 'd> {
    fn new(
        header: &Header<'m>,
        device: Device,
        resolve: &'r dyn Resolve,
        first_buffer: usize,
        first_dictionary: i64,
        dictionaries: &'d Dictionaries,
    ) -> Self {
        Decoder {
            version: header.version,
            nodes: header.batch.nodes().map_or(&[], |n| n.bytes()),
            buffers: header.batch.buffers().map_or(&[], |b| b.bytes()),
            variadic: header
                .batch
                .variadicBufferCounts()
                .map(|v| v.iter().collect())
                .unwrap_or_default(),
            next_node: 0,
            next_buffer: 0,
            next_variadic: 0,
            first_buffer,
            next_dictionary: first_dictionary,
            dictionaries,
            device,
            resolve,
            empty: None,
        }
    }

    /// Checks that every node, buffer and count of the metadata was used.
    fn finish(&self) -> Result<()> {
        let unread = [
            (self.nodes.len() / 16 - self.next_node, "field nodes"),
            (self.buffers.len() / 16 - self.next_buffer, "buffers"),
            (self.variadic.len() - self.next_variadic, "variadic buffer counts"),
        ];
        match unread.iter().find(|(n, _)| *n > 0) {
            Some((n, what)) => Err(invalid(format!(
                "{n} {what} in the IPC metadata beyond those the schema describes"
            ))),
            None => Ok(()),
        }
    }

    fn node(&mut self, field: &Field) -> Result<(usize, usize)> {
        let (len, nulls) = pair(self.nodes, self.next_node)
            .ok_or_else(|| invalid(format!("the IPC metadata has no field node for {}", field.name())))?;
        self.next_node += 1;
        Ok((count(len, "length")?, count(nulls, "null count")?))
    }

    /// Passes over the next buffer without resolving it.
    fn skip_buffer(&mut self, dt: &DataType) -> Result<()> {
        if self.next_buffer >= self.buffers.len() / 16 {
            return Err(invalid(format!(
                "the IPC metadata has too few buffers for a {dt} array"
            )));
        }
        self.next_buffer += 1;
        Ok(())
    }

    // Inlined into `array`, for the reason `Resolve::find` gives: the buffer it returned was read
    // back through memory.
    #[inline(always)]
    fn buffer(&mut self, dt: &DataType, min: Option<usize>) -> Result<DeviceBuffer> {
        let index = self.next_buffer;
        let (offset, len) = pair(self.buffers, index)
            .ok_or_else(|| invalid(format!("the IPC metadata has too few buffers for a {dt} array")))?;
        self.next_buffer += 1;
        let (offset, len) = (count(offset, "buffer offset")?, count(len, "buffer length")?);
        if let Some(min) = min.filter(|m| len < *m) {
            return Err(invalid(format!(
                "IPC buffer {index} of a {dt} array has {len} bytes; it needs {min}"
            )));
        }
        if len == 0 {
            let device = self.device;
            return Ok(self.empty.get_or_insert_with(|| empty_buffer(device)).clone());
        }
        let at = self.first_buffer + index;
        let Some((memory, start)) = self.resolve.find(at, offset, len) else {
            let e = self.resolve.check(at, offset, len).err();
            return Err(e.unwrap_or_else(|| invalid(format!("IPC buffer {at} was not found"))));
        };
        let mut buffer = memory.slice(start, len)?;
        // A fixed-size buffer is cut to its size: the bytes past it belong to no element, and
        // arrow-rs refuses (panics on) typed buffers whose length is not a multiple of the width.
        if let Some(min) = min {
            buffer.truncate(min);
        }
        Ok(buffer)
    }

    /// The next arrays, of `fields`.
    fn arrays<'a>(
        &mut self,
        fields: impl IntoIterator<Item = &'a Field>,
        depth: usize,
    ) -> Result<Vec<DeviceArrayData>> {
        let fields = fields.into_iter();
        let mut out = Vec::with_capacity(fields.size_hint().0);
        for f in fields {
            self.array(f, depth, &mut out)?;
        }
        Ok(out)
    }

    /// Appends the next array, of `field`, to `out`. It is built where it goes: an array is large,
    /// and moving one from a returned value into a vector costs a `memcpy` call.
    fn array(&mut self, field: &Field, depth: usize, out: &mut Vec<DeviceArrayData>) -> Result<()> {
        if depth > MAX_DEPTH {
            return Err(invalid(format!("nesting deeper than {MAX_DEPTH}")));
        }
        let dt = field.data_type();
        // Every type of the schema that has arrays is reached here (dictionary values as the
        // arrays of their `DictionaryBatch`), so each is checked here.
        check_own_type(dt)?;
        let (len, node_nulls) = self.node(field)?;
        let mut null_count = 0;
        let mut nulls = None;
        if has_validity(dt, self.version) {
            let carries_nulls = !matches!(dt, DataType::Union(..) | DataType::RunEndEncoded(..));
            if carries_nulls && node_nulls > len {
                return Err(invalid(format!(
                    "null count {node_nulls} of a {dt} array of {len} elements"
                )));
            }
            if carries_nulls && node_nulls > 0 {
                let bitmap = self.buffer(dt, Some(len.div_ceil(8)))?;
                (null_count, nulls) = (node_nulls, Some(bitmap));
            } else {
                // A bitmap no element needs (or none at all) is not resolved.
                self.skip_buffer(dt)?;
            }
        }
        // Taken apart rather than iterated, so the sizes stay in registers.
        let Sizes {
            sizes: [first, second],
            len: n,
        } = fixed_sizes(dt, len)?;
        let mut buffers = Buffers::new();
        if n > 0 {
            buffers.push(self.buffer(dt, first)?);
        }
        if n > 1 {
            buffers.push(self.buffer(dt, second)?);
        }
        if matches!(dt, DataType::Utf8View | DataType::BinaryView) {
            let n = *self
                .variadic
                .get(self.next_variadic)
                .ok_or_else(|| invalid(format!("no variadic buffer count for a {dt} array")))?;
            self.next_variadic += 1;
            let n = count(n, "variadic buffer count")?;
            if n > self.buffers.len() / 16 - self.next_buffer {
                return Err(invalid(format!(
                    "a {dt} array with {n} data buffers; the metadata has fewer"
                )));
            }
            for _ in 0..n {
                buffers.push(self.buffer(dt, None)?);
            }
        }
        // Only nested types call `children`: for the leaves that most columns are, the call and
        // its returned vector cost a tenth of a receive.
        let children = match dt {
            DataType::Dictionary(_, values) => vec![self.dictionary_values(values)?],
            DataType::List(_)
            | DataType::LargeList(_)
            | DataType::ListView(_)
            | DataType::LargeListView(_)
            | DataType::Map(..)
            | DataType::FixedSizeList(..)
            | DataType::Struct(_)
            | DataType::Union(..)
            | DataType::RunEndEncoded(..) => self.children(dt, len, depth)?,
            _ => Vec::new(),
        };
        out.reserve(1);
        out.spare_capacity_mut()[0].write(DeviceArrayData {
            data_type: dt.clone(),
            len,
            offset: 0,
            null_count: Some(null_count),
            nulls,
            buffers,
            children,
            trusted: false,
        });
        // SAFETY: the element past the length was written just above, within the capacity.
        unsafe { out.set_len(out.len() + 1) };
        Ok(())
    }

    /// The values of the next dictionary-encoded array, whose values have type `values`.
    fn dictionary_values(&mut self, values: &DataType) -> Result<DeviceArrayData> {
        let id = self.next_dictionary + dictionaries_in(values) as i64;
        self.next_dictionary = id + 1;
        let array = self
            .dictionaries
            .get(&id)
            .ok_or_else(|| invalid(format!("dictionary {id} was not sent before the batch that uses it")))?;
        if array.data_type() != values {
            return Err(invalid(format!(
                "dictionary {id} holds {}; the schema says {values}",
                array.data_type()
            )));
        }
        Ok(array.clone())
    }

    fn children(&mut self, dt: &DataType, len: usize, depth: usize) -> Result<Vec<DeviceArrayData>> {
        let at_least = |children: &[DeviceArrayData], need: usize| match children.iter().find(|c| c.len() < need) {
            Some(c) => Err(invalid(format!(
                "a child of a {dt} array of {len} elements has {} elements",
                c.len()
            ))),
            None => Ok(()),
        };
        Ok(match dt {
            DataType::List(f)
            | DataType::LargeList(f)
            | DataType::ListView(f)
            | DataType::LargeListView(f)
            | DataType::Map(f, _) => self.arrays([f.as_ref()], depth + 1)?,
            DataType::FixedSizeList(f, size) => {
                let size = usize::try_from(*size).map_err(|_| invalid(format!("{dt} has a negative size")))?;
                let child = self.arrays([f.as_ref()], depth + 1)?;
                at_least(
                    &child,
                    len.checked_mul(size)
                        .ok_or_else(|| invalid(format!("{dt} of {len} elements overflows")))?,
                )?;
                child
            }
            DataType::Struct(fields) => {
                let children = self.arrays(fields.iter().map(AsRef::as_ref), depth + 1)?;
                at_least(&children, len)?;
                children
            }
            DataType::Union(fields, mode) => {
                let children = self.arrays(fields.iter().map(|(_, f)| f.as_ref()), depth + 1)?;
                if *mode == UnionMode::Sparse {
                    at_least(&children, len)?;
                }
                children
            }
            DataType::RunEndEncoded(run_ends, values) => {
                let children = self.arrays([run_ends.as_ref(), values.as_ref()], depth + 1)?;
                if children[0].len() != children[1].len()
                    || children[0].null_count() != Some(0)
                    || (len > 0 && children[0].is_empty())
                {
                    return Err(invalid(format!(
                        "a {dt} array of {len} elements with {} run ends ({:?} null) and {} values",
                        children[0].len(),
                        children[0].null_count(),
                        children[1].len()
                    )));
                }
                children
            }
            _ => vec![],
        })
    }
}
