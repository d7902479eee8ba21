//! The IPC layout of a device batch: field nodes, buffers and variadic counts in the order the
//! Arrow IPC format lists them, and the `RecordBatch` metadata built from them.
//!
//! Arrays are walked depth first. Each array contributes a field node `(length, null_count)` and,
//! in order: a validity slot where its type has one (an empty buffer when it has no nulls), its data
//! buffers in arrow-rs order, then its children. In metadata version V5, null, union and run-end
//! encoded arrays have no validity slot. View types list their views buffer and then their data
//! buffers, and each contributes its data-buffer count to `variadicBufferCounts`.
//!
//! The IPC format has no array offsets: every array starts at element 0. Arrays with an offset or an
//! unknown null count (slices) have no direct IPC layout ([`needs_normalising`]); the writer takes a
//! slow path for them.
//!
//! A dictionary-encoded array contributes its keys (node, validity, keys buffer); its values travel
//! in a `DictionaryBatch` message of their own, sent before the `RecordBatch` message. Dictionary
//! ids are numbered as arrow-rs numbers them when it writes a schema: in the order the fields'
//! descriptions complete, depth first, so a dictionary nested in another's values comes first.

use arrow_ipc::{
    DictionaryBatchBuilder, FieldNode, MessageBuilder, MessageHeader, MetadataVersion, RecordBatchBuilder,
};
use arrow_schema::{DataType, UnionMode};
use flatbuffers::FlatBufferBuilder;

use crate::array::{DeviceArrayData, DeviceRecordBatch};
use crate::error::{Error, Result};
use crate::memory::{ALIGNMENT, DeviceBuffer};

/// Whether arrays of `data_type` have a validity slot in IPC metadata of `version`.
pub(crate) fn has_validity(data_type: &DataType, version: MetadataVersion) -> bool {
    if version < MetadataVersion::V5 {
        !matches!(data_type, DataType::Null)
    } else {
        !matches!(
            data_type,
            DataType::Null | DataType::Union(..) | DataType::RunEndEncoded(..)
        )
    }
}

fn overflow(data_type: &DataType, len: usize) -> Error {
    Error::InvalidData(format!(
        "the buffers of a {data_type} array of {len} elements overflow usize"
    ))
}

fn times(data_type: &DataType, len: usize, width: usize) -> Result<usize> {
    len.checked_mul(width).ok_or_else(|| overflow(data_type, len))
}

/// Offsets of `len` elements: none for an empty array, `len + 1` otherwise.
fn offsets(data_type: &DataType, len: usize, width: usize) -> Result<usize> {
    if len == 0 {
        Ok(0)
    } else {
        times(data_type, len + 1, width)
    }
}

/// The exact size of each fixed-size data buffer (validity excluded) of an array of `len` elements,
/// in IPC order; `None` for buffers whose size depends on the data (string values, the data
/// buffers of views). The writer cuts buffers to these sizes; the reader requires at least them.
// Inlined into its callers: returned through memory, its sizes cost a send's layout a fifth of
// its time (3.9 against 3.2 µs for a 100-column batch's description on the CPU device).
#[inline(always)]
pub(crate) fn fixed_sizes(data_type: &DataType, len: usize) -> Result<Sizes> {
    let dt = data_type;
    Ok(match dt {
        DataType::Null | DataType::Struct(_) | DataType::FixedSizeList(..) | DataType::RunEndEncoded(..) => {
            Sizes::from([])
        }
        DataType::Boolean => Sizes::from([Some(len.div_ceil(8))]),
        DataType::FixedSizeBinary(w) => {
            let w = usize::try_from(*w).map_err(|_| Error::InvalidData(format!("{dt} has a negative width")))?;
            Sizes::from([Some(times(dt, len, w)?)])
        }
        DataType::Utf8 | DataType::Binary => Sizes::from([Some(offsets(dt, len, 4)?), None]),
        DataType::LargeUtf8 | DataType::LargeBinary => Sizes::from([Some(offsets(dt, len, 8)?), None]),
        DataType::Utf8View | DataType::BinaryView => Sizes::from([Some(times(dt, len, 16)?)]),
        DataType::List(_) | DataType::Map(..) => Sizes::from([Some(offsets(dt, len, 4)?)]),
        DataType::LargeList(_) => Sizes::from([Some(offsets(dt, len, 8)?)]),
        DataType::ListView(_) => Sizes::from([Some(times(dt, len, 4)?); 2]),
        DataType::LargeListView(_) => Sizes::from([Some(times(dt, len, 8)?); 2]),
        DataType::Union(_, UnionMode::Sparse) => Sizes::from([Some(len)]),
        DataType::Union(_, UnionMode::Dense) => Sizes::from([Some(len), Some(times(dt, len, 4)?)]),
        DataType::Dictionary(key, _) => match key.primitive_width() {
            Some(w) if key.is_dictionary_key_type() => Sizes::from([Some(times(dt, len, w)?)]),
            _ => return Err(Error::InvalidData(format!("{dt} has an invalid key type"))),
        },
        other => match other.primitive_width() {
            Some(w) => Sizes::from([Some(times(dt, len, w)?)]),
            None => return Err(Error::Unsupported(format!("data type {other} in Arrow IPC"))),
        },
    })
}

/// The sizes [`fixed_sizes`] gives: at most two, kept inline, as they are asked for once per array
/// on every send and receive.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Sizes {
    pub sizes: [Option<usize>; 2],
    pub len: usize,
}

impl<const N: usize> From<[Option<usize>; N]> for Sizes {
    fn from(given: [Option<usize>; N]) -> Sizes {
        let mut sizes = [None; 2];
        sizes[..N].copy_from_slice(&given);
        Sizes { sizes, len: N }
    }
}

impl std::ops::Deref for Sizes {
    type Target = [Option<usize>];

    fn deref(&self) -> &[Option<usize>] {
        &self.sizes[..self.len]
    }
}

/// The number of dictionary-encoded types in `data_type`, itself included.
pub(crate) fn dictionaries_in(data_type: &DataType) -> usize {
    let own = matches!(data_type, DataType::Dictionary(..)) as usize;
    let nested = match data_type {
        DataType::Dictionary(_, values) => dictionaries_in(values),
        DataType::List(f)
        | DataType::LargeList(f)
        | DataType::ListView(f)
        | DataType::LargeListView(f)
        | DataType::FixedSizeList(f, _)
        | DataType::Map(f, _) => dictionaries_in(f.data_type()),
        DataType::Struct(fields) => fields.iter().map(|f| dictionaries_in(f.data_type())).sum(),
        DataType::Union(fields, _) => fields.iter().map(|(_, f)| dictionaries_in(f.data_type())).sum(),
        DataType::RunEndEncoded(_, values) => dictionaries_in(values.data_type()),
        _ => 0,
    };
    own + nested
}

/// Whether the batch has arrays the IPC format cannot describe as they are (an offset, an unknown
/// null count).
pub fn needs_normalising(batch: &DeviceRecordBatch) -> bool {
    fn walk(a: &DeviceArrayData) -> bool {
        a.offset() != 0 || a.null_count().is_none() || a.children().iter().any(walk)
    }
    batch.columns().iter().any(walk)
}

/// One IPC buffer: the bytes it is cut from (none for an empty buffer), and its place in a
/// contiguous body.
#[derive(Clone, Debug)]
pub(crate) struct BodyBuffer<'a> {
    pub source: Option<&'a DeviceBuffer>,
    pub offset: usize,
    pub len: usize,
}

/// One message of a batch in IPC order: the `RecordBatch` message, or the `DictionaryBatch` message
/// of one dictionary's values.
#[derive(Debug)]
pub(crate) struct BodyLayout<'a> {
    /// The id of the dictionary whose values this is, for a `DictionaryBatch` message.
    pub dictionary: Option<i64>,
    pub num_rows: usize,
    pub nodes: Vec<FieldNode>,
    pub buffers: Vec<BodyBuffer<'a>>,
    pub variadic_counts: Vec<i64>,
    /// The body's length: every buffer starts at a multiple of 64 bytes and the body is padded to one.
    pub body_len: usize,
}

impl<'a> BodyLayout<'a> {
    /// The messages of a batch that does not need normalising ([`needs_normalising`]; one that does
    /// is [`Error::Unsupported`]): one `DictionaryBatch` per dictionary, in id order, then the
    /// `RecordBatch`.
    pub fn of(batch: &'a DeviceRecordBatch) -> Result<Vec<Self>> {
        let mut messages = vec![];
        let mut layout = BodyLayout::new(batch.num_rows(), batch.num_columns());
        for c in batch.columns() {
            layout.array(c, &mut messages)?;
        }
        messages.push(layout);
        Ok(messages)
    }

    /// An empty layout with room for `arrays` arrays of a node and two buffers each (most have
    /// that many or fewer).
    fn new(num_rows: usize, arrays: usize) -> Self {
        BodyLayout {
            dictionary: None,
            num_rows,
            nodes: Vec::with_capacity(arrays),
            buffers: Vec::with_capacity(2 * arrays),
            variadic_counts: vec![],
            body_len: 0,
        }
    }

    fn push(&mut self, source: Option<&'a DeviceBuffer>, len: usize) {
        let offset = self.body_len;
        self.buffers.push(BodyBuffer {
            source: source.filter(|_| len > 0),
            offset,
            len,
        });
        self.body_len = (offset + len).next_multiple_of(ALIGNMENT);
    }

    /// Lays out `a`; the values of its dictionaries go to `dictionaries`, numbered by their place.
    fn array(&mut self, a: &'a DeviceArrayData, dictionaries: &mut Vec<BodyLayout<'a>>) -> Result<()> {
        let dt = a.data_type();
        let (len, null_count) = match (a.offset(), a.null_count()) {
            (0, Some(n)) => (a.len(), n),
            _ => {
                return Err(Error::Unsupported(format!(
                    "a {dt} array with offset {} and null count {:?} has no IPC layout; it needs normalising first",
                    a.offset(),
                    a.null_count()
                )));
            }
        };
        let node_nulls = if matches!(dt, DataType::Null) { len } else { null_count };
        self.nodes.push(FieldNode::new(len as i64, node_nulls as i64));
        if has_validity(dt, MetadataVersion::V5) {
            match a.nulls() {
                Some(bitmap) if null_count > 0 => {
                    let need = len.div_ceil(8);
                    if bitmap.len() < need {
                        return Err(short(dt, "validity bitmap", bitmap.len(), need));
                    }
                    self.push(Some(bitmap), need);
                }
                _ => self.push(None, 0),
            }
        }
        let sizes = fixed_sizes(dt, len)?;
        let expected = match dt {
            DataType::Utf8View | DataType::BinaryView => {
                let data = a
                    .buffers()
                    .len()
                    .checked_sub(1)
                    .ok_or_else(|| short(dt, "views buffer", 0, 16 * len))?;
                self.variadic_counts.push(data as i64);
                a.buffers().len()
            }
            _ => sizes.len(),
        };
        if a.buffers().len() != expected {
            return Err(Error::InvalidData(format!(
                "a {dt} array with {} buffers; expected {expected}",
                a.buffers().len()
            )));
        }
        for (i, b) in a.buffers().iter().enumerate() {
            let len = match sizes.get(i).copied().flatten() {
                Some(need) if b.len() < need => return Err(short(dt, "buffer", b.len(), need)),
                Some(need) => need,
                None => b.len(),
            };
            self.push(Some(b), len);
        }
        if let DataType::Dictionary(..) = dt {
            let [values] = a.children() else {
                return Err(Error::InvalidData(format!(
                    "a {dt} array with {} children; expected its values",
                    a.children().len()
                )));
            };
            let mut message = BodyLayout::new(values.len(), 1);
            message.array(values, dictionaries)?;
            message.dictionary = Some(dictionaries.len() as i64);
            dictionaries.push(message);
            return Ok(());
        }
        for c in a.children() {
            self.array(c, dictionaries)?;
        }
        Ok(())
    }

    /// The IPC `Buffer` entries.
    pub fn ipc_buffers(&self) -> Vec<arrow_ipc::Buffer> {
        self.buffers
            .iter()
            .map(|b| arrow_ipc::Buffer::new(b.offset as i64, b.len as i64))
            .collect()
    }

    /// The flatbuffer `Message` (metadata version V5) with this layout's `RecordBatch` header, or a
    /// `DictionaryBatch` header holding it, built as arrow-rs builds them.
    pub fn metadata(&self) -> Vec<u8> {
        // Room for the vectors of buffers (16 bytes each) and nodes (16 each) and the tables.
        let mut fbb = FlatBufferBuilder::with_capacity(256 + 16 * (self.buffers.len() + self.nodes.len()));
        let buffers = fbb.create_vector(&self.ipc_buffers());
        let nodes = fbb.create_vector(&self.nodes);
        let variadic = (!self.variadic_counts.is_empty()).then(|| fbb.create_vector(&self.variadic_counts));
        let header = {
            let mut b = RecordBatchBuilder::new(&mut fbb);
            b.add_length(self.num_rows as i64);
            b.add_nodes(nodes);
            b.add_buffers(buffers);
            if let Some(v) = variadic {
                b.add_variadicBufferCounts(v);
            }
            b.finish()
        };
        let (header_type, header) = match self.dictionary {
            None => (MessageHeader::RecordBatch, header.as_union_value()),
            Some(id) => {
                let mut b = DictionaryBatchBuilder::new(&mut fbb);
                b.add_id(id);
                b.add_data(header);
                b.add_isDelta(false);
                (MessageHeader::DictionaryBatch, b.finish().as_union_value())
            }
        };
        let mut m = MessageBuilder::new(&mut fbb);
        m.add_version(MetadataVersion::V5);
        m.add_header_type(header_type);
        m.add_bodyLength(self.body_len as i64);
        m.add_header(header);
        let root = m.finish();
        fbb.finish(root, None);
        fbb.finished_data().to_vec()
    }
}

fn short(dt: &DataType, what: &str, has: usize, need: usize) -> Error {
    Error::InvalidData(format!("the {what} of a {dt} array has {has} bytes; it needs {need}"))
}

/// The continuation marker that starts an encapsulated IPC message.
pub(crate) const CONTINUATION: [u8; 4] = [0xff; 4];

/// The encapsulation of flatbuffer `metadata`: the continuation marker, the metadata length, the
/// metadata and zero padding, so that the body starts at a multiple of 64 bytes (which is also a
/// multiple of the 8 bytes the format requires).
pub(crate) fn encapsulate(metadata: &[u8]) -> Vec<u8> {
    let total = (8 + metadata.len()).next_multiple_of(ALIGNMENT);
    let mut out = Vec::with_capacity(total);
    out.extend_from_slice(&CONTINUATION);
    out.extend_from_slice(&((total - 8) as i32).to_le_bytes());
    out.extend_from_slice(metadata);
    out.resize(total, 0);
    out
}
