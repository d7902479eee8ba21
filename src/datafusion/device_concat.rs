//! Record batches of one CUDA device concatenated in its memory: staging gathers a table's host
//! batches into device batches there (after copying them as they are), and a device stage hashes a
//! join's build side read from a GPU table where it lives, without a trip through the host.
//!
//! Fixed-width values and views are copied device to device; validity bitmaps and booleans are
//! re-packed by `concat_bits` (`kernels/scan.cu`); the data buffers of view columns are copied
//! into one new buffer (more where they pass `i32::MAX` bytes), their long views pointed there by
//! `rebase_views`. Offsets (strings, binaries, lists, maps) are rebased by `rebase_offsets32/64`
//! after one read of every part's first and last offset (a gather kernel, one synchronisation per
//! level of nesting), and the bytes or child rows they span are concatenated in turn; structs and
//! fixed-size lists concatenate their children's windows. The result shares no memory with its
//! inputs, which may be freed at once.

use std::sync::Arc;

use arrow_schema::{DataType, SchemaRef};
use cudarc::driver::{CudaFunction, CudaStream};

use super::device_filter::SCAN_KERNELS;
use super::nvrtc::{BLOCK, cuda_stream, function, launch};
use crate::array::{DeviceArrayData, DeviceRecordBatch};
use crate::device::{Device, Stream};
use crate::error::{Error, Result};
use crate::memory::{DeviceBuffer, MemoryResource};
use crate::transfer::offsets::start_reading;

/// Whether [`concat_batches`] takes columns of this type: every type but dictionaries, unions,
/// list views and run-end encoded arrays (and nestings of them).
pub(crate) fn concatenable(dt: &DataType) -> bool {
    match dt {
        DataType::Null | DataType::Boolean | DataType::Utf8View | DataType::BinaryView => true,
        DataType::List(f) | DataType::LargeList(f) | DataType::FixedSizeList(f, _) | DataType::Map(f, _) => {
            concatenable(f.data_type())
        }
        DataType::Struct(fields) => fields.iter().all(|f| concatenable(f.data_type())),
        other => offset_width(other).is_some() || fixed_width(other).is_some(),
    }
}

fn fixed_width(dt: &DataType) -> Option<usize> {
    match dt {
        DataType::FixedSizeBinary(w) => usize::try_from(*w).ok(),
        DataType::Boolean => None,
        other => other.primitive_width(),
    }
}

/// The width of the offsets of a type that has them.
fn offset_width(dt: &DataType) -> Option<usize> {
    match dt {
        DataType::Utf8 | DataType::Binary | DataType::List(_) | DataType::Map(..) => Some(4),
        DataType::LargeUtf8 | DataType::LargeBinary | DataType::LargeList(_) => Some(8),
        _ => None,
    }
}

/// The rows of `batches` (on `device`, a CUDA device; columns of [`concatenable`] types) in one
/// batch of `schema`, in new device memory (sharing none with `batches`). Returns when the
/// copies have finished.
pub(crate) fn concat_batches(
    schema: SchemaRef,
    batches: &[DeviceRecordBatch],
    device: Device,
    stream: &Stream,
) -> Result<DeviceRecordBatch> {
    let (stream, cuda) = cuda_stream(stream, device, "a device concatenation")?;
    let rows: usize = batches.iter().map(DeviceRecordBatch::num_rows).sum();
    for b in batches {
        stream.wait(b.ready())?;
    }
    let mut concat = Concat::new(cuda, device, &stream)?;
    let columns: Vec<Vec<DeviceArrayData>> = (0..schema.fields().len())
        .map(|c| batches.iter().map(|b| b.columns()[c].clone()).collect())
        .collect();
    // The first and last offsets of every column that has them, in one read.
    let arrays: Vec<_> = schema
        .fields()
        .iter()
        .map(|f| f.data_type())
        .zip(columns.iter().map(Vec::as_slice))
        .collect();
    let mut ends = concat.ends(&arrays)?;
    let columns = schema
        .fields()
        .iter()
        .zip(&columns)
        .zip(&mut ends)
        .map(|((f, parts), ends)| concat.array(f.data_type(), parts, std::mem::take(ends)))
        .collect::<Result<Vec<_>>>()?;
    // Kept until the stream is synchronised: the kernels read it.
    let _moves = concat.rebase_views()?;
    stream.synchronize()?;
    DeviceRecordBatch::try_new(schema, columns, rows, stream.record()?)
}

/// A concatenation under way on one stream: its kernels, and the views to point at their new data
/// buffers once every column's are in place.
struct Concat<'s> {
    cuda: Arc<CudaStream>,
    stream: &'s Stream,
    device: Device,
    resource: MemoryResource,
    bits: CudaFunction,
    offsets32: CudaFunction,
    offsets64: CudaFunction,
    rebase: CudaFunction,
    /// Where each data buffer of each view part went (see `merge_data`).
    moves: Vec<u32>,
    /// The views to point there.
    rebases: Vec<Rebase>,
}

/// The first and last offset of each part of an array (`(0, 0)` for empty parts), or nothing for
/// a type without offsets.
type Ends = Vec<(i64, i64)>;

impl<'s> Concat<'s> {
    fn new(cuda: Arc<CudaStream>, device: Device, stream: &'s Stream) -> Result<Self> {
        let ctx = cuda.context().clone();
        Ok(Concat {
            bits: function(&ctx, SCAN_KERNELS, "concat_bits")?,
            offsets32: function(&ctx, SCAN_KERNELS, "rebase_offsets32")?,
            offsets64: function(&ctx, SCAN_KERNELS, "rebase_offsets64")?,
            rebase: function(&ctx, SCAN_KERNELS, "rebase_views")?,
            cuda,
            stream,
            device,
            resource: MemoryResource::default_for(device),
            moves: Vec::new(),
            rebases: Vec::new(),
        })
    }

    /// `len` bytes of new device memory.
    fn alloc(&self, len: usize) -> Result<DeviceBuffer> {
        DeviceBuffer::alloc(self.resource, len.max(1), self.stream)?.slice(0, len)
    }

    /// The [`Ends`] of each array whose parts are given, read from the device at once.
    fn ends(&self, arrays: &[(&DataType, &[DeviceArrayData])]) -> Result<Vec<Ends>> {
        let mut reads = Vec::new();
        for (dt, parts) in arrays {
            let Some(width) = offset_width(dt) else {
                continue;
            };
            for p in parts.iter().filter(|p| !p.is_empty()) {
                let offsets = p
                    .buffers()
                    .first()
                    .ok_or_else(|| Error::InvalidData(format!("a {dt} array without offsets")))?;
                let end = (p.offset() + p.len() + 1) * width;
                if end > offsets.len() {
                    return Err(Error::InvalidData(format!(
                        "a {dt} array of {} elements from {} with {} bytes of offsets",
                        p.len(),
                        p.offset(),
                        offsets.len()
                    )));
                }
                let first = offsets.address() + (p.offset() * width) as u64;
                if !first.is_multiple_of(width as u64) {
                    return Err(Error::Unsupported(format!(
                        "concatenating {dt} offsets not aligned to their width"
                    )));
                }
                reads.extend([(first, width), (first + (p.len() * width) as u64, width)]);
            }
        }
        // SAFETY: every read is an offset inside an offsets buffer of `arrays` (checked above),
        // which the caller keeps until the read has synchronised.
        let mut values = unsafe { start_reading(&reads, self.device, self.stream)? }
            .wait()?
            .into_iter();
        let mut out = Vec::with_capacity(arrays.len());
        for (dt, parts) in arrays {
            out.push(match offset_width(dt) {
                None => Vec::new(),
                Some(_) => parts
                    .iter()
                    .map(|p| match p.is_empty() {
                        true => (0, 0),
                        false => (values.next().unwrap_or(0), values.next().unwrap_or(0)),
                    })
                    .collect(),
            });
        }
        Ok(out)
    }

    /// The rows of `parts` (arrays of `dt`) in one new array; `ends` are their [`Ends`] when read
    /// already (empty otherwise).
    fn array(&mut self, dt: &DataType, parts: &[DeviceArrayData], ends: Ends) -> Result<DeviceArrayData> {
        if let Some(p) = parts.iter().find(|p| p.data_type() != dt) {
            return Err(Error::InvalidData(format!(
                "a column of {} where the schema says {dt}",
                p.data_type()
            )));
        }
        let rows: usize = parts.iter().map(DeviceArrayData::len).sum();
        let has_nulls = |p: &&DeviceArrayData| p.nulls().is_some() && p.null_count() != Some(0);
        let nulls = if parts.iter().any(|p| has_nulls(&p)) {
            let spans: Vec<_> = parts
                .iter()
                .map(|p| (p.nulls().filter(|_| has_nulls(&p)), p.offset(), p.len()))
                .collect();
            Some(self.pack_bits(rows, &spans)?)
        } else {
            None
        };
        let null_count = match nulls {
            None => Some(0),
            Some(_) => parts.iter().map(|p| p.null_count()).sum::<Option<usize>>(),
        };
        let (buffers, children) = match dt {
            DataType::Null => (vec![], vec![]),
            DataType::Boolean => {
                let spans: Vec<_> = parts
                    .iter()
                    .map(|p| (p.buffers().first(), p.offset(), p.len()))
                    .collect();
                (vec![self.pack_bits(rows, &spans)?], vec![])
            }
            DataType::Utf8View | DataType::BinaryView => (self.views(parts, rows)?, vec![]),
            DataType::Utf8 | DataType::LargeUtf8 | DataType::Binary | DataType::LargeBinary => {
                let (ends, bytes, offsets) = self.offsets(dt, parts, ends, rows)?;
                let mut data = self.alloc(bytes)?;
                let mut at = 0;
                for (p, &(first, last)) in parts.iter().zip(&ends) {
                    let len = (last - first) as usize;
                    if len > 0 {
                        let values = p
                            .buffers()
                            .get(1)
                            .ok_or_else(|| Error::InvalidData(format!("a {dt} array without its data buffer")))?;
                        let src = values.slice(first as usize, len)?;
                        // SAFETY: `src` and `data` live until the caller synchronises the stream.
                        unsafe { data.copy_from_async(at, &src, self.stream)? };
                    }
                    at += len;
                }
                (vec![offsets, data], vec![])
            }
            DataType::List(f) | DataType::LargeList(f) | DataType::Map(f, _) => {
                let (ends, _, offsets) = self.offsets(dt, parts, ends, rows)?;
                let values = parts
                    .iter()
                    .zip(&ends)
                    .map(|(p, &(first, last))| child(p, 0)?.slice(first as usize, (last - first) as usize))
                    .collect::<Result<Vec<_>>>()?;
                (vec![offsets], vec![self.array(f.data_type(), &values, Ends::new())?])
            }
            DataType::FixedSizeList(f, size) => {
                let size = usize::try_from(*size).map_err(|_| Error::InvalidData(format!("{dt}")))?;
                let values = parts
                    .iter()
                    .map(|p| child(p, 0)?.slice(p.offset() * size, p.len() * size))
                    .collect::<Result<Vec<_>>>()?;
                (vec![], vec![self.array(f.data_type(), &values, Ends::new())?])
            }
            DataType::Struct(fields) => {
                let mut children = Vec::with_capacity(fields.len());
                for (i, f) in fields.iter().enumerate() {
                    let windows = parts
                        .iter()
                        .map(|p| child(p, i)?.slice(p.offset(), p.len()))
                        .collect::<Result<Vec<_>>>()?;
                    children.push(self.array(f.data_type(), &windows, Ends::new())?);
                }
                (vec![], children)
            }
            other => {
                let width = fixed_width(other)
                    .ok_or_else(|| Error::Unsupported(format!("concatenating {other} on the device")))?;
                (vec![self.values(parts, width, rows)?], vec![])
            }
        };
        let mut array = DeviceArrayData::try_new(dt.clone(), rows, 0, null_count, nulls, buffers, children)?;
        // Copies of the parts' values, bits, views and rebased offsets: as valid as they are.
        array.trusted = parts.iter().all(|p| p.is_trusted());
        Ok(array)
    }

    /// A new bitmap of `rows` bits holding each span's bits (`(bitmap, offset, len)`, all ones
    /// for no bitmap), one after another.
    fn pack_bits(&self, rows: usize, spans: &[(Option<&DeviceBuffer>, usize, usize)]) -> Result<DeviceBuffer> {
        let out = DeviceBuffer::zeroed(self.resource, rows.div_ceil(32).max(1) * 4, self.stream)?;
        let mut at = 0u64;
        for &(src, offset, len) in spans {
            if len > 0 {
                let src = src.map_or(0, DeviceBuffer::address);
                let args = [src, offset as u64, len as u64, out.address(), at];
                launch(
                    &self.cuda,
                    &self.bits,
                    (len as u64).div_ceil(BLOCK as u64),
                    BLOCK,
                    &args,
                )?;
            }
            at += len as u64;
        }
        Ok(out)
    }

    /// The offsets of `parts` (arrays of `dt`) one after another in a new buffer of `rows + 1`
    /// offsets, each part's rebased to start where the previous ended; with the parts' [`Ends`]
    /// (`ends` when read already, else read now) and the values they span in all (see
    /// [`spanned`]).
    fn offsets(
        &self,
        dt: &DataType,
        parts: &[DeviceArrayData],
        ends: Ends,
        rows: usize,
    ) -> Result<(Ends, usize, DeviceBuffer)> {
        let ends = match ends.len() == parts.len() {
            true => ends,
            false => self.ends(&[(dt, parts)])?.remove(0),
        };
        let spanned = spanned(dt, &ends)?;
        let width = offset_width(dt).ok_or_else(|| Error::Unsupported(format!("offsets of {dt}")))?;
        let out = DeviceBuffer::zeroed(self.resource, (rows + 1) * width, self.stream)?;
        let kernel = if width == 4 { &self.offsets32 } else { &self.offsets64 };
        let (mut at, mut base) = (0usize, 0i64);
        for (p, &(first, last)) in parts.iter().zip(&ends) {
            if !p.is_empty() {
                // `ends` checked that the part's offsets lie in its buffer.
                let src = p.buffers()[0].address() + (p.offset() * width) as u64;
                let dst = out.address() + (at * width) as u64;
                let n = p.len() as u64 + 1;
                let args = [src, n, dst, base.wrapping_sub(first) as u64];
                launch(&self.cuda, kernel, n.div_ceil(BLOCK as u64), BLOCK, &args)?;
            }
            at += p.len();
            base += last - first;
        }
        Ok((ends, spanned, out))
    }

    /// The values (`width` bytes each) of `parts`, one after another in a new buffer.
    fn values(&self, parts: &[DeviceArrayData], width: usize, rows: usize) -> Result<DeviceBuffer> {
        let mut out = self.alloc(rows * width)?;
        let mut at = 0;
        for p in parts {
            let values = p
                .buffers()
                .first()
                .ok_or_else(|| Error::InvalidData(format!("a {} array without values", p.data_type())))?;
            if p.is_empty() {
                continue;
            }
            let src = values.slice(p.offset() * width, p.len() * width)?;
            // SAFETY: `src` and `out` live until the caller synchronises the stream.
            unsafe { out.copy_from_async(at, &src, self.stream)? };
            at += p.len() * width;
        }
        Ok(out)
    }

    /// The views of the view arrays `parts` in a new buffer, and their data buffers copied into
    /// new ones (see [`merge_data`]); the long views are noted to be pointed there.
    fn views(&mut self, parts: &[DeviceArrayData], rows: usize) -> Result<Vec<DeviceBuffer>> {
        let views = self.values(parts, 16, rows)?;
        // The first entry of `moves` for each part's data buffers.
        let mut entry = self.moves.len() / 2;
        let data = merge_data(parts, self.resource, self.stream, &mut self.moves)?;
        let mut at = 0usize;
        for p in parts {
            let buffers = p.buffers().len().saturating_sub(1);
            if buffers > 0 && !p.is_empty() {
                self.rebases.push(Rebase {
                    views: views.address() + at as u64 * 16,
                    len: p.len() as u64,
                    entry,
                    buffers,
                });
            }
            entry += buffers;
            at += p.len();
        }
        Ok(std::iter::once(views).chain(data).collect())
    }

    /// Points the long views of each part noted by [`Concat::views`] at the new data buffers.
    /// Returns the table of moves on the device, which must live until the stream is synchronised.
    fn rebase_views(&self) -> Result<Option<DeviceBuffer>> {
        if self.rebases.is_empty() {
            return Ok(None);
        }
        let bytes: Vec<u8> = self.moves.iter().flat_map(|m| m.to_ne_bytes()).collect();
        let table = DeviceBuffer::from_host(&bytes, self.resource, self.stream)?;
        for r in &self.rebases {
            // Two `u32` per data buffer.
            let args = [r.views, r.len, table.address() + r.entry as u64 * 8, r.buffers as u64];
            launch(&self.cuda, &self.rebase, r.len.div_ceil(BLOCK as u64), BLOCK, &args)?;
        }
        Ok(Some(table))
    }
}

/// Child `i` of `p`.
fn child(p: &DeviceArrayData, i: usize) -> Result<&DeviceArrayData> {
    p.children()
        .get(i)
        .ok_or_else(|| Error::InvalidData(format!("a {} array without child {i}", p.data_type())))
}

/// The values the parts' offsets span in all (bytes, or child rows), which must rise within each
/// part and fit the type's offsets.
fn spanned(dt: &DataType, ends: &[(i64, i64)]) -> Result<usize> {
    let most = if offset_width(dt) == Some(4) {
        i32::MAX as i64
    } else {
        i64::MAX
    };
    let mut total = 0i64;
    for &(first, last) in ends {
        if first < 0 || last < first {
            return Err(Error::InvalidData(format!("{dt} offsets from {first} to {last}")));
        }
        total = total
            .checked_add(last - first)
            .filter(|t| *t <= most)
            .ok_or_else(|| Error::InvalidData(format!("the concatenated {dt} values overflow its offsets")))?;
    }
    usize::try_from(total).map_err(|_| Error::InvalidData(format!("{dt} values of {total} bytes")))
}

/// The long views of a part of a view column, to point at the concatenation's data buffers.
struct Rebase {
    /// The address of the part's views in the concatenation.
    views: u64,
    /// Its views.
    len: u64,
    /// The entry of `moves` (see [`merge_data`]) of its first data buffer.
    entry: usize,
    /// Its data buffers.
    buffers: usize,
}

/// The data buffers of the view arrays `parts`, copied one after another into new buffers of at
/// most `i32::MAX` bytes each (the most a view's offset reaches); appends to `moves`, for each
/// data buffer of each part in order, the index of the new buffer it went to and its offset
/// there.
fn merge_data(
    parts: &[DeviceArrayData],
    resource: MemoryResource,
    stream: &Stream,
    moves: &mut Vec<u32>,
) -> Result<Vec<DeviceBuffer>> {
    const MOST: usize = i32::MAX as usize;
    // The new buffers' sizes, and which buffer each old one goes to, where.
    let mut sizes: Vec<usize> = Vec::new();
    let mut placed = Vec::new();
    for p in parts {
        for b in p.buffers().iter().skip(1) {
            if b.len() > MOST {
                return Err(Error::InvalidData(format!("a view data buffer of {} bytes", b.len())));
            }
            let last = sizes.len().wrapping_sub(1);
            match sizes.last_mut() {
                Some(size) if *size + b.len() <= MOST => {
                    placed.push((last, *size));
                    *size += b.len();
                }
                _ => {
                    placed.push((sizes.len(), 0));
                    sizes.push(b.len());
                }
            }
        }
    }
    let mut out = sizes
        .iter()
        .map(|&size| DeviceBuffer::alloc(resource, size.max(1), stream))
        .collect::<Result<Vec<_>>>()?;
    let old = parts.iter().flat_map(|p| p.buffers().iter().skip(1));
    for (b, &(to, at)) in old.zip(&placed) {
        if !b.is_empty() {
            // SAFETY: `b` and `out` live until the caller synchronises the stream.
            unsafe { out[to].copy_from_async(at, b, stream)? };
        }
        // Both fit in `u32`: at most `i32::MAX` (checked above).
        moves.extend([to as u32, at as u32]);
    }
    for (b, size) in out.iter_mut().zip(&sizes) {
        *b = b.slice(0, *size)?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow_array::builder::{
        FixedSizeBinaryBuilder, FixedSizeListBuilder, GenericListBuilder, Int32Builder, Int64Builder, ListBuilder,
        MapBuilder, StringBuilder, StringViewBuilder,
    };
    use arrow_array::{
        Array, ArrayRef, BinaryArray, BooleanArray, Decimal128Array, Int32Array, Int64Array, LargeBinaryArray,
        LargeStringArray, NullArray, RecordBatch, StringArray, StructArray,
    };
    use arrow_buffer::NullBuffer;
    use arrow_schema::{DataType, Field, Fields, Schema};

    use super::{concat_batches, concatenable};
    use crate::device::{Stream, cuda_for_tests};

    /// A batch of every concatenable kind, `seed` varying its values: view strings long and
    /// short in several data buffers, offset strings and binaries of both widths, lists, maps,
    /// fixed-size lists and a struct, all with nulls.
    fn batch(rows: usize, seed: usize) -> RecordBatch {
        let text = |i: usize| (!(i + seed).is_multiple_of(5)).then(|| "x".repeat((i * 7 + seed) % 30));
        let mut views = StringViewBuilder::new().with_fixed_block_size(64);
        let mut fixed = FixedSizeBinaryBuilder::new(3);
        let mut list = ListBuilder::new(StringBuilder::new());
        let mut large_list = GenericListBuilder::<i64, _>::new(Int32Builder::new());
        let mut pairs = FixedSizeListBuilder::new(Int64Builder::new(), 2);
        let mut map = MapBuilder::new(None, StringBuilder::new(), Int32Builder::new());
        for i in 0..rows {
            views.append_option(text(i));
            fixed.append_value([i as u8, seed as u8, 7]).unwrap();
            for j in 0..(i + seed) % 4 {
                list.values().append_option(text(i + j));
                large_list.values().append_option((j != 1).then_some((i * j) as i32));
                map.keys().append_value(format!("k{j}"));
                map.values().append_option((j != 2).then_some(j as i32));
            }
            list.append(!(i + seed).is_multiple_of(6));
            large_list.append(!(i + seed).is_multiple_of(7));
            map.append(!(i + seed).is_multiple_of(8)).unwrap();
            pairs.values().append_value(i as i64);
            pairs.values().append_option((i % 3 != 0).then_some(-(seed as i64)));
            pairs.append(!(i + seed).is_multiple_of(9));
        }
        let strings = StringArray::from_iter((0..rows).map(text));
        let record = StructArray::new(
            Fields::from(vec![
                Field::new("s", DataType::Utf8, true),
                Field::new("n", DataType::Int32, true),
            ]),
            vec![
                Arc::new(strings.clone()) as ArrayRef,
                Arc::new(Int32Array::from_iter(
                    (0..rows).map(|i| (i % 4 != 1).then_some(i as i32)),
                )),
            ],
            Some(NullBuffer::from_iter((0..rows).map(|i| !(i + seed).is_multiple_of(10)))),
        );
        let columns: Vec<ArrayRef> = vec![
            Arc::new(Int64Array::from_iter(
                (0..rows).map(|i| (!(i + seed).is_multiple_of(3)).then_some((i * seed) as i64)),
            )),
            Arc::new(Int32Array::from_iter_values((0..rows).map(|i| (i + seed) as i32))),
            Arc::new(BooleanArray::from_iter(
                (0..rows).map(|i| (!(i + seed).is_multiple_of(4)).then_some(i.is_multiple_of(3))),
            )),
            Arc::new(
                Decimal128Array::from_iter(
                    (0..rows).map(|i| i.is_multiple_of(2).then_some(i as i128 * -1_000_000_007)),
                )
                .with_precision_and_scale(30, 2)
                .unwrap(),
            ),
            Arc::new(views.finish()),
            Arc::new(fixed.finish()),
            Arc::new(strings),
            Arc::new(LargeStringArray::from_iter((0..rows).map(text))),
            Arc::new(BinaryArray::from_iter(
                (0..rows).map(|i| text(i).map(String::into_bytes)),
            )),
            Arc::new(LargeBinaryArray::from_iter(
                (0..rows).map(|i| text(i).map(String::into_bytes)),
            )),
            Arc::new(list.finish()),
            Arc::new(large_list.finish()),
            Arc::new(pairs.finish()),
            Arc::new(map.finish()),
            Arc::new(record),
            Arc::new(NullArray::new(rows)),
        ];
        let fields: Vec<Field> = columns
            .iter()
            .enumerate()
            .map(|(i, c)| Field::new(format!("c{i}"), c.data_type().clone(), true))
            .collect();
        RecordBatch::try_new(Arc::new(Schema::new(fields)), columns).unwrap()
    }

    /// Batches of odd lengths, sliced at odd offsets on the host and on the device (where the
    /// offsets of a part start past zero and a struct's window lies inside its children), empty
    /// ones (one an empty slice of strings in data buffers), their view strings in many data
    /// buffers: the device's concatenation equals arrow's and holds none of their memory.
    #[test]
    fn concatenation_on_the_device_matches_arrow() {
        let Some(device) = cuda_for_tests() else {
            return;
        };
        let stream = Stream::new(device).unwrap();
        let hosts = [
            batch(200, 6).slice(50, 0),
            batch(37, 1).slice(3, 30),
            batch(0, 2),
            batch(101, 3),
            batch(300, 4).slice(77, 150),
            batch(9, 5),
        ];
        let schema = hosts[0].schema();
        assert!(schema.fields().iter().all(|f| concatenable(f.data_type())));
        // The second half of the parts are cut on the device.
        let cuts = [(0, 0), (0, 30), (0, 0), (13, 70), (29, 101), (2, 5)];
        let mut on_device = Vec::new();
        let mut expected = Vec::new();
        for (i, (host, (offset, len))) in hosts.iter().zip(cuts).enumerate() {
            let uploaded = crate::transfer::htod(host, device, &stream).unwrap();
            match i >= 3 {
                true => {
                    on_device.push(uploaded.slice(offset, len).unwrap());
                    expected.push(host.slice(offset, len));
                }
                false => {
                    on_device.push(uploaded);
                    expected.push(host.clone());
                }
            }
        }
        let joined = concat_batches(schema.clone(), &on_device, device, &stream).unwrap();
        let inputs: Vec<_> = on_device
            .iter()
            .flat_map(|b| b.columns().iter().flat_map(|c| c.all_buffers()))
            .collect();
        for (c, column) in joined.columns().iter().enumerate() {
            for b in column.all_buffers() {
                assert!(!inputs.iter().any(|i| i.shares_allocation(b)), "column {c}");
            }
        }
        drop(inputs);
        drop(on_device);
        let back = crate::transfer::dtoh(&joined, &stream).unwrap();
        let expected = arrow_select::concat::concat_batches(&schema, &expected).unwrap();
        assert_eq!(back.num_rows(), expected.num_rows());
        for (c, (got, want)) in back.columns().iter().zip(expected.columns()).enumerate() {
            assert_eq!(got.as_ref(), want.as_ref(), "column {c}");
            assert_eq!(got.null_count(), want.null_count(), "column {c}");
            got.to_data().validate_full().unwrap();
        }
    }

    /// Dictionaries, unions, list views and run-end encoded columns (and lists of them) are not
    /// taken: staging concatenates them on the host.
    #[test]
    fn types_without_a_device_concatenation_are_refused() {
        let dictionary = DataType::Dictionary(Box::new(DataType::Int32), Box::new(DataType::Utf8));
        let list = DataType::List(Arc::new(Field::new_list_field(dictionary.clone(), true)));
        let view = DataType::ListView(Arc::new(Field::new_list_field(DataType::Int32, true)));
        for dt in [dictionary, list, view] {
            assert!(!concatenable(&dt), "{dt}");
        }
    }
}
