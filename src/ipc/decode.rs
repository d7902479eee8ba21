//! Building device arrays from a `RecordBatch` message's metadata, with every count and size checked
//! against the schema before anything is built.
//!
//! The metadata is host memory (verified by the flatbuffers verifier in `arrow_ipc::root_as_message`);
//! the buffers it names are device memory that is never read here. Each buffer is resolved to a
//! [`DeviceBuffer`] by the caller (a slice of a message body, or of a region received from another
//! process), which checks that it lies inside that memory. What can be checked without reading the
//! device is checked: node and buffer counts, null counts, the sizes of every fixed-size buffer,
//! children's lengths. What depends on the data (string and list offsets, view indices, union type
//! ids) is checked when the batch is copied to the host ([`crate::transfer::dtoh`] validates every
//! array); device code that reads a received batch must treat those as untrusted.

use arrow_ipc::{MessageHeader, MetadataVersion};
use arrow_schema::{DataType, Field, Fields, SchemaRef, UnionMode};

use crate::array::{DeviceArrayData, DeviceRecordBatch};
use crate::device::{Device, Event};
use crate::error::{Error, Result};
use crate::ipc::layout::{dictionary_unsupported, fixed_sizes, has_validity};
use crate::memory::{ALIGNMENT, DeviceBuffer};

/// Nesting deeper than this is refused.
const MAX_DEPTH: usize = 64;

fn invalid(msg: impl Into<String>) -> Error {
    Error::InvalidData(msg.into())
}

fn count(value: i64, what: &str) -> Result<usize> {
    usize::try_from(value).map_err(|_| invalid(format!("negative {what} ({value}) in IPC metadata")))
}

/// A zero-length buffer on `device`.
pub(crate) fn empty_buffer(device: Device) -> DeviceBuffer {
    // SAFETY: a zero-length range is never read or written; the address is aligned and non-null.
    unsafe { DeviceBuffer::from_raw_parts(ALIGNMENT as u64, 0, device, ()) }
}

/// Resolves IPC buffer `index` with the metadata's `(offset, length)` to device memory.
pub(crate) type Resolve<'r> = dyn FnMut(usize, usize, usize) -> Result<DeviceBuffer> + 'r;

/// The checked header of a `RecordBatch` message.
pub(crate) struct Header<'m> {
    pub version: MetadataVersion,
    pub batch: arrow_ipc::RecordBatch<'m>,
    pub body_len: usize,
}

/// Checks that `message` is an uncompressed `RecordBatch` message of a version this crate reads.
pub(crate) fn header<'m>(message: &arrow_ipc::Message<'m>) -> Result<Header<'m>> {
    let version = message.version();
    if version != MetadataVersion::V4 && version != MetadataVersion::V5 {
        return Err(invalid(format!("IPC metadata version {version:?}; V4 and V5 are read")));
    }
    if message.header_type() == MessageHeader::DictionaryBatch {
        return Err(dictionary_unsupported());
    }
    let batch = message.header_as_record_batch().ok_or_else(|| {
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
        batch,
        body_len,
    })
}

/// Parses flatbuffer `metadata` (verified) into a `Message`.
pub(crate) fn parse(metadata: &[u8]) -> Result<arrow_ipc::Message<'_>> {
    arrow_ipc::root_as_message(metadata).map_err(|e| invalid(format!("IPC metadata is not a valid Message: {e}")))
}

/// Builds the batch a `RecordBatch` header describes, on `device`, with `ready` as its event.
pub(crate) fn batch(
    schema: &SchemaRef,
    header: &Header<'_>,
    device: Device,
    resolve: &mut Resolve<'_>,
    ready: Event,
) -> Result<DeviceRecordBatch> {
    let num_rows = count(header.batch.length(), "batch length")?;
    let mut d = Decoder {
        version: header.version,
        nodes: header
            .batch
            .nodes()
            .map(|n| n.iter().map(|n| (n.length(), n.null_count())).collect())
            .unwrap_or_default(),
        buffers: header
            .batch
            .buffers()
            .map(|b| b.iter().map(|b| (b.offset(), b.length())).collect())
            .unwrap_or_default(),
        variadic: header
            .batch
            .variadicBufferCounts()
            .map(|v| v.iter().collect())
            .unwrap_or_default(),
        next_node: 0,
        next_buffer: 0,
        next_variadic: 0,
        device,
        resolve,
    };
    let columns = schema
        .fields()
        .iter()
        .map(|f| d.array(f, 0))
        .collect::<Result<Vec<_>>>()?;
    let unread = [
        (d.nodes.len() - d.next_node, "field nodes"),
        (d.buffers.len() - d.next_buffer, "buffers"),
        (d.variadic.len() - d.next_variadic, "variadic buffer counts"),
    ];
    if let Some((n, what)) = unread.iter().find(|(n, _)| *n > 0) {
        return Err(invalid(format!(
            "{n} {what} in the IPC metadata beyond those the schema describes"
        )));
    }
    DeviceRecordBatch::try_new(schema.clone(), columns, num_rows, ready)
}

struct Decoder<'r, 'f> {
    version: MetadataVersion,
    nodes: Vec<(i64, i64)>,
    buffers: Vec<(i64, i64)>,
    variadic: Vec<i64>,
    next_node: usize,
    next_buffer: usize,
    next_variadic: usize,
    device: Device,
    resolve: &'r mut Resolve<'f>,
}

impl Decoder<'_, '_> {
    fn node(&mut self, field: &Field) -> Result<(usize, usize)> {
        let &(len, nulls) = self
            .nodes
            .get(self.next_node)
            .ok_or_else(|| invalid(format!("the IPC metadata has no field node for {}", field.name())))?;
        self.next_node += 1;
        Ok((count(len, "length")?, count(nulls, "null count")?))
    }

    fn buffer(&mut self, dt: &DataType, min: Option<usize>) -> Result<DeviceBuffer> {
        let index = self.next_buffer;
        let &(offset, len) = self
            .buffers
            .get(index)
            .ok_or_else(|| invalid(format!("the IPC metadata has too few buffers for a {dt} array")))?;
        self.next_buffer += 1;
        let (offset, len) = (count(offset, "buffer offset")?, count(len, "buffer length")?);
        if let Some(min) = min.filter(|m| len < *m) {
            return Err(invalid(format!(
                "IPC buffer {index} of a {dt} array has {len} bytes; it needs {min}"
            )));
        }
        if len == 0 {
            return Ok(empty_buffer(self.device));
        }
        let buffer = (self.resolve)(index, offset, len)?;
        // A fixed-size buffer is cut to its size: the bytes past it belong to no element, and
        // arrow-rs refuses (panics on) typed buffers whose length is not a multiple of the width.
        match min {
            Some(min) if min < len => buffer.slice(0, min),
            _ => Ok(buffer),
        }
    }

    fn array(&mut self, field: &Field, depth: usize) -> Result<DeviceArrayData> {
        if depth > MAX_DEPTH {
            return Err(invalid(format!("nesting deeper than {MAX_DEPTH}")));
        }
        let dt = field.data_type();
        if matches!(dt, DataType::Dictionary(..)) {
            return Err(dictionary_unsupported());
        }
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
            let need = (carries_nulls && node_nulls > 0).then(|| len.div_ceil(8));
            let bitmap = self.buffer(dt, need)?;
            if need.is_some() {
                (null_count, nulls) = (node_nulls, Some(bitmap));
            }
        }
        let sizes = fixed_sizes(dt, len)?;
        let mut buffers = sizes
            .iter()
            .map(|&min| self.buffer(dt, min))
            .collect::<Result<Vec<_>>>()?;
        if matches!(dt, DataType::Utf8View | DataType::BinaryView) {
            let n = *self
                .variadic
                .get(self.next_variadic)
                .ok_or_else(|| invalid(format!("no variadic buffer count for a {dt} array")))?;
            self.next_variadic += 1;
            let n = count(n, "variadic buffer count")?;
            if n > self.buffers.len() - self.next_buffer {
                return Err(invalid(format!(
                    "a {dt} array with {n} data buffers; the metadata has fewer"
                )));
            }
            for _ in 0..n {
                buffers.push(self.buffer(dt, None)?);
            }
        }
        let children = self.children(dt, len, depth)?;
        Ok(DeviceArrayData {
            data_type: dt.clone(),
            len,
            offset: 0,
            null_count: Some(null_count),
            nulls,
            buffers,
            children,
            trusted: false,
        })
    }

    fn children(&mut self, dt: &DataType, len: usize, depth: usize) -> Result<Vec<DeviceArrayData>> {
        let all =
            |d: &mut Self, fields: &Fields| fields.iter().map(|f| d.array(f, depth + 1)).collect::<Result<Vec<_>>>();
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
            | DataType::Map(f, _) => {
                vec![self.array(f, depth + 1)?]
            }
            DataType::FixedSizeList(f, size) => {
                let size = usize::try_from(*size).map_err(|_| invalid(format!("{dt} has a negative size")))?;
                let child = vec![self.array(f, depth + 1)?];
                at_least(
                    &child,
                    len.checked_mul(size)
                        .ok_or_else(|| invalid(format!("{dt} of {len} elements overflows")))?,
                )?;
                child
            }
            DataType::Struct(fields) => {
                let children = all(self, fields)?;
                at_least(&children, len)?;
                children
            }
            DataType::Union(fields, mode) => {
                let children = fields
                    .iter()
                    .map(|(_, f)| self.array(f, depth + 1))
                    .collect::<Result<Vec<_>>>()?;
                if *mode == UnionMode::Sparse {
                    at_least(&children, len)?;
                }
                children
            }
            DataType::RunEndEncoded(run_ends, values) => {
                let children = vec![self.array(run_ends, depth + 1)?, self.array(values, depth + 1)?];
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
