//! Record batches of one CUDA device concatenated in its memory: staging gathers a table's host
//! batches into device batches there (after copying them as they are), and a device stage hashes a
//! join's build side read from a GPU table where it lives, without a trip through the host.
//!
//! Fixed-width values and views are copied device to device; validity bitmaps and booleans are
//! re-packed by `concat_bits` (`kernels/scan.cu`); the data buffers of view columns are copied
//! into one new buffer (more where they pass `i32::MAX` bytes), their long views pointed there by
//! `rebase_views`. The result shares no memory with its inputs, which may be freed at once.

use std::sync::Arc;

use arrow_schema::{DataType, SchemaRef};
use cudarc::driver::{CudaContext, CudaStream};

use super::device_filter::SCAN_KERNELS;
use super::nvrtc::{BLOCK, cuda_stream, function, launch};
use crate::array::{DeviceArrayData, DeviceRecordBatch};
use crate::device::{Device, Stream};
use crate::error::{Error, Result};
use crate::memory::{DeviceBuffer, MemoryResource};

/// Whether [`concat_batches`] takes columns of this type.
pub(crate) fn concatenable(dt: &DataType) -> bool {
    matches!(dt, DataType::Boolean | DataType::Utf8View | DataType::BinaryView) || fixed_width(dt).is_some()
}

fn fixed_width(dt: &DataType) -> Option<usize> {
    match dt {
        DataType::FixedSizeBinary(w) => usize::try_from(*w).ok(),
        DataType::Boolean => None,
        other => other.primitive_width(),
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
    let ctx = cuda.context().clone();
    let resource = MemoryResource::default_for(device);
    let rows: usize = batches.iter().map(DeviceRecordBatch::num_rows).sum();
    for b in batches {
        stream.wait(b.ready())?;
    }
    let bits = function(&ctx, SCAN_KERNELS, "concat_bits")?;
    // ORs each array's bits (`None`: all ones) into `out` from its first row.
    let pack_bits = |out: &DeviceBuffer, parts: &[(Option<&DeviceBuffer>, usize, usize)]| -> Result<()> {
        let mut at = 0u64;
        for &(src, offset, len) in parts {
            if len > 0 {
                let src = src.map_or(0, DeviceBuffer::address);
                let args = [src, offset as u64, len as u64, out.address(), at];
                launch(&cuda, &bits, (len as u64).div_ceil(BLOCK as u64), BLOCK, &args)?;
            }
            at += len as u64;
        }
        Ok(())
    };
    let bitmap_len = rows.div_ceil(32) * 4;
    let mut columns = Vec::with_capacity(schema.fields().len());
    // Where each data buffer of each view part went (see `merge_data`), and the views to point
    // there.
    let mut moves: Vec<u32> = Vec::new();
    let mut rebases: Vec<Rebase> = Vec::new();
    for (c, field) in schema.fields().iter().enumerate() {
        let dt = field.data_type();
        let parts: Vec<&DeviceArrayData> = batches.iter().map(|b| &b.columns()[c]).collect();
        if let Some(p) = parts.iter().find(|p| p.data_type() != dt) {
            return Err(Error::InvalidData(format!(
                "a column of {} where the schema says {dt}",
                p.data_type()
            )));
        }
        let has_nulls = |p: &&DeviceArrayData| p.nulls().is_some() && p.null_count() != Some(0);
        let nulls = if parts.iter().any(has_nulls) {
            let out = DeviceBuffer::zeroed(resource, bitmap_len.max(4), &stream)?;
            let spans: Vec<_> = parts
                .iter()
                .map(|p| (p.nulls().filter(|_| has_nulls(p)), p.offset(), p.len()))
                .collect();
            pack_bits(&out, &spans)?;
            Some(out)
        } else {
            None
        };
        let null_count = if nulls.is_none() {
            Some(0)
        } else {
            parts.iter().map(|p| p.null_count()).sum::<Option<usize>>()
        };
        let buffers = match dt {
            DataType::Boolean => {
                let out = DeviceBuffer::zeroed(resource, bitmap_len.max(4), &stream)?;
                let spans: Vec<_> = parts
                    .iter()
                    .map(|p| (p.buffers().first(), p.offset(), p.len()))
                    .collect();
                pack_bits(&out, &spans)?;
                vec![out]
            }
            DataType::Utf8View | DataType::BinaryView => {
                let views = copy_values(&parts, 16, resource, &stream)?.slice(0, rows * 16)?;
                // The first entry of `moves` for each part's data buffers.
                let mut entry = moves.len() / 2;
                let data = merge_data(&parts, resource, &stream, &mut moves)?;
                let mut at = 0usize;
                for p in &parts {
                    let buffers = p.buffers().len().saturating_sub(1);
                    if buffers > 0 && !p.is_empty() {
                        rebases.push(Rebase {
                            views: views.address() + at as u64 * 16,
                            len: p.len() as u64,
                            entry,
                            buffers,
                        });
                    }
                    entry += buffers;
                    at += p.len();
                }
                std::iter::once(views).chain(data).collect()
            }
            other => {
                let width = fixed_width(other)
                    .ok_or_else(|| Error::Unsupported(format!("concatenating {other} on the device")))?;
                vec![copy_values(&parts, width, resource, &stream)?]
            }
        };
        let mut column = DeviceArrayData::try_new(dt.clone(), rows, 0, null_count, nulls, buffers, vec![])?;
        // Copies of the parts' values, bits and views: as valid as they are.
        column.trusted = parts.iter().all(|p| p.is_trusted());
        columns.push(column);
    }
    // Kept until the stream is synchronised: the kernels read it.
    let _moves = rebase_views(&cuda, &ctx, &moves, &rebases, resource, &stream)?;
    stream.synchronize()?;
    DeviceRecordBatch::try_new(schema, columns, rows, stream.record()?)
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

/// Points the long views of each part of `rebases` at the new data buffers, as `moves` says (see
/// [`merge_data`]). Returns the table of moves on the device, which must live until the stream
/// is synchronised.
fn rebase_views(
    cuda: &Arc<CudaStream>,
    ctx: &Arc<CudaContext>,
    moves: &[u32],
    rebases: &[Rebase],
    resource: MemoryResource,
    stream: &Stream,
) -> Result<Option<DeviceBuffer>> {
    if rebases.is_empty() {
        return Ok(None);
    }
    let bytes: Vec<u8> = moves.iter().flat_map(|m| m.to_ne_bytes()).collect();
    let table = DeviceBuffer::from_host(&bytes, resource, stream)?;
    let rebase = function(ctx, SCAN_KERNELS, "rebase_views")?;
    for r in rebases {
        // Two `u32` per data buffer.
        let args = [r.views, r.len, table.address() + r.entry as u64 * 8, r.buffers as u64];
        launch(cuda, &rebase, r.len.div_ceil(BLOCK as u64), BLOCK, &args)?;
    }
    Ok(Some(table))
}

/// The data buffers of the view arrays `parts`, copied one after another into new buffers of at
/// most `i32::MAX` bytes each (the most a view's offset reaches); appends to `moves`, for each
/// data buffer of each part in order, the index of the new buffer it went to and its offset
/// there.
fn merge_data(
    parts: &[&DeviceArrayData],
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

/// The values (`width` bytes each) of `parts`, one after another in a new buffer.
fn copy_values(
    parts: &[&DeviceArrayData],
    width: usize,
    resource: MemoryResource,
    stream: &Stream,
) -> Result<DeviceBuffer> {
    let rows: usize = parts.iter().map(|p| p.len()).sum();
    let mut out = DeviceBuffer::alloc(resource, (rows * width).max(1), stream)?;
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
        unsafe { out.copy_from_async(at, &src, stream)? };
        at += p.len() * width;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow_array::builder::{FixedSizeBinaryBuilder, StringViewBuilder};
    use arrow_array::{ArrayRef, BooleanArray, Decimal128Array, Int32Array, Int64Array, RecordBatch};
    use arrow_schema::{DataType, Field, Schema};

    use super::concat_batches;
    use crate::device::{Device, Stream, cuda_available};

    /// A batch of every concatenable kind, `seed` varying its values; strings long and short, in
    /// several data buffers.
    fn batch(rows: usize, seed: usize) -> RecordBatch {
        let mut views = StringViewBuilder::new().with_fixed_block_size(64);
        let mut fixed = FixedSizeBinaryBuilder::new(3);
        for i in 0..rows {
            if (i + seed).is_multiple_of(5) {
                views.append_null();
            } else {
                views.append_value("x".repeat((i * 7 + seed) % 30));
            }
            fixed.append_value([i as u8, seed as u8, 7]).unwrap();
        }
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
        ];
        let schema = Schema::new(vec![
            Field::new("i64", DataType::Int64, true),
            Field::new("i32", DataType::Int32, true),
            Field::new("flag", DataType::Boolean, true),
            Field::new("dec", DataType::Decimal128(30, 2), true),
            Field::new("s", DataType::Utf8View, true),
            Field::new("fixed", DataType::FixedSizeBinary(3), true),
        ]);
        RecordBatch::try_new(Arc::new(schema), columns).unwrap()
    }

    /// Batches of odd lengths, sliced at odd offsets, empty ones (one an empty slice of strings in
    /// data buffers), their strings in many data buffers: the device's concatenation equals
    /// arrow's and holds none of their memory.
    #[test]
    fn concatenation_on_the_device_matches_arrow() {
        if !cuda_available() {
            eprintln!("skipped: no CUDA device");
            return;
        }
        let device = Device::Cuda(0);
        let stream = Stream::new(device).unwrap();
        let hosts = [
            batch(200, 6).slice(50, 0),
            batch(37, 1).slice(3, 30),
            batch(0, 2),
            batch(101, 3),
            batch(300, 4).slice(77, 150),
            batch(9, 5),
        ];
        let on_device: Vec<_> = hosts
            .iter()
            .map(|b| crate::transfer::htod(b, device, &stream).unwrap())
            .collect();
        let schema = hosts[0].schema();
        let joined = concat_batches(schema.clone(), &on_device, device, &stream).unwrap();
        let inputs: Vec<_> = on_device
            .iter()
            .flat_map(|b| b.columns().iter().flat_map(|c| c.buffers().iter().chain(c.nulls())))
            .collect();
        for (c, column) in joined.columns().iter().enumerate() {
            for b in column.buffers().iter().chain(column.nulls()) {
                assert!(!inputs.iter().any(|i| i.shares_allocation(b)), "column {c}");
            }
        }
        drop(on_device);
        let back = crate::transfer::dtoh(&joined, &stream).unwrap();
        let expected = arrow_select::concat::concat_batches(&schema, &hosts).unwrap();
        assert_eq!(back.num_rows(), expected.num_rows());
        for (c, (got, want)) in back.columns().iter().zip(expected.columns()).enumerate() {
            assert_eq!(got.as_ref(), want.as_ref(), "column {c}");
            assert_eq!(got.null_count(), want.null_count(), "column {c}");
            got.to_data().validate_full().unwrap();
        }
    }
}
