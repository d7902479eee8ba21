//! The GPU side of a GPU table scan: CUDA C kernels compiled at run time with NVRTC.
//!
//! A scan with a pushed-down predicate runs, on the batch's device and in the order of one stream:
//!
//! 1. `pred`: a kernel generated from the predicate tree (one thread per row) reads the columns it
//!    needs, with their offsets and validity bitmaps, in SQL's three-valued logic, and writes a
//!    selection byte per row: 1 only where the predicate is true. Literals live in a small device
//!    buffer, so the source depends only on the predicate's shape and the column types: each
//!    shape compiles once per context.
//! 2. `tile_count_u8`, `scan_tiles`: the selected rows are counted per tile of 2048 rows and the
//!    tile counts prefix-summed; the total is the only value read back before compaction.
//! 3. `select_indices`: each tile scans its selection in shared memory and writes the indices of
//!    its selected rows, up to the scan's remaining limit.
//! 4. Compaction of every projected column by those indices: `gather_w1` .. `gather_w16` and
//!    `gather_fixed` (fixed-width values), `gather_bits` (validity bitmaps and booleans,
//!    re-packed), and for `Utf8`/`Binary` (`i32` offsets) and their large variants (`i64`):
//!    `string_lengths_*`, `tile_sum_u64` + `scan_tiles` + `scan_write_*` (new offsets from the
//!    prefix sum of the selected lengths) and `gather_bytes_*` (the bytes). `Utf8View` and
//!    `BinaryView` gather their views and keep their data buffers.
//!
//! A device stage's computed string columns come as references (the address and length of each
//! string's bytes) and become columns the same way: offsets from the prefix sum of the lengths,
//! then `ref_bytes_*` (the bytes) and, for `Utf8View`, `ref_views` ([`strings_from_refs`]).
//!
//! Only the compacted columns are copied to the host. A projected column of a type the
//! compaction does not handle (lists, structs, dictionaries...) makes the scan download the
//! selection bytes and the projected columns and filter them on the host instead.
//!
//! Compiled modules are cached per (device, source). Without a driver, a GPU or the NVRTC
//! library, every entry point returns an [`Error`], never panics: the libraries and the entry
//! points cudarc calls are probed first.

use std::collections::BTreeSet;
use std::sync::Arc;

use arrow_array::{BooleanArray, RecordBatch, RecordBatchOptions};
use arrow_buffer::BooleanBuffer;
use arrow_schema::DataType;
use cudarc::driver::{CudaContext, CudaStream};

use super::nvrtc::{BLOCK, TILE, available, cuda_stream, function, launch};
use super::predicate::Predicate;
use super::predicate_codegen::generate;
use crate::array::{DeviceArrayData, DeviceRecordBatch};
use crate::device::{Device, Stream};
use crate::error::{Error, Result};
use crate::memory::{DeviceBuffer, MemoryResource};

/// The kernels every scan shares: counting, prefix sums, index selection and gathers.
pub(crate) const SCAN_KERNELS: &str = include_str!("kernels/scan.cu");

/// What a filtered scan of one batch produced.
pub(crate) enum Filtered {
    /// No row was selected (or the limit was 0).
    Empty,
    /// The selected rows of the projected columns, compacted on the device.
    Device(DeviceRecordBatch),
    /// The selected rows, filtered on the host because a projected column's type has no
    /// compaction kernel.
    Host(RecordBatch),
}

/// Allocations of a scan, in stream order on its device.
pub(crate) struct Scratch {
    pub(crate) resource: MemoryResource,
    pub(crate) stream: Stream,
}

impl Scratch {
    fn alloc(&self, len: usize) -> Result<DeviceBuffer> {
        DeviceBuffer::alloc(self.resource, len.max(1), &self.stream)
    }
}

/// Evaluates `predicate` on `batch` (on a CUDA device) and compacts the `output` columns to the
/// first `limit` selected rows; see the module docs for the kernels.
pub(crate) fn filter_compact(
    batch: &DeviceRecordBatch,
    predicate: &Predicate,
    output: &[usize],
    limit: usize,
    stream: &Stream,
) -> Result<Filtered> {
    if batch.num_rows() == 0 || limit == 0 {
        return Ok(Filtered::Empty);
    }
    on_stream(batch, stream, |ctx, cuda, scratch, keep| {
        run(ctx, cuda, scratch, keep, batch, predicate, output, limit)
    })
}

/// The indices (`u32`, on the batch's device) of the rows of `batch` (on a CUDA device) where
/// `predicate` is true, and their count; `None` for none.
pub(crate) fn selected(
    batch: &DeviceRecordBatch,
    predicate: &Predicate,
    stream: &Stream,
) -> Result<Option<(DeviceBuffer, usize)>> {
    if batch.num_rows() == 0 {
        return Ok(None);
    }
    on_stream(batch, stream, |ctx, cuda, scratch, keep| {
        let sel = predicate_bytes(ctx, cuda, scratch, keep, batch, predicate)?;
        selected_rows(ctx, cuda, scratch, &sel, batch.num_rows(), batch.num_rows())
    })
}

/// The rows `rows[0..m]` (`u32` indices on the batch's device) of every column of `batch` (on a
/// CUDA device, of types [`compact`] handles), in new device memory.
pub(crate) fn take(
    batch: &DeviceRecordBatch,
    rows: &DeviceBuffer,
    m: usize,
    stream: &Stream,
) -> Result<DeviceRecordBatch> {
    on_stream(batch, stream, |ctx, cuda, scratch, _| {
        let columns = batch
            .columns()
            .iter()
            .map(|c| compact(ctx, cuda, scratch, c, rows, m))
            .collect::<Result<Vec<_>>>()?;
        DeviceRecordBatch::try_new(batch.schema().clone(), columns, m, scratch.stream.record()?)
    })
}

/// Runs `work` on `stream` (made a stream of `batch`'s CUDA device) once the batch is ready, and
/// waits for its kernels before its scratch memory (and what it puts in the keep list) is freed.
fn on_stream<T>(
    batch: &DeviceRecordBatch,
    stream: &Stream,
    work: impl FnOnce(&Arc<CudaContext>, &Arc<CudaStream>, &Scratch, &mut Vec<DeviceBuffer>) -> Result<T>,
) -> Result<T> {
    let device = batch.device();
    let Device::Cuda(_) = device else {
        return Err(Error::Unsupported(format!(
            "GPU filters run on CUDA devices, not {device}"
        )));
    };
    available()?;
    let (stream, cuda) = cuda_stream(stream, device, "a GPU filter")?;
    if cuda.context().ordinal() != device.ordinal().unwrap_or(usize::MAX) {
        return Err(Error::InvalidArgument(format!(
            "stream of cuda:{} for a batch on {device}",
            cuda.context().ordinal()
        )));
    }
    let n = batch.num_rows();
    if n > u32::MAX as usize {
        return Err(Error::InvalidArgument(format!(
            "a batch of {n} rows (at most 2^32 - 1 per batch)"
        )));
    }
    stream.wait(batch.ready())?;
    let ctx = cuda.context().clone();
    let scratch = Scratch {
        resource: MemoryResource::default_for(device),
        stream: stream.clone(),
    };
    let mut keep = Vec::new();
    let result = work(&ctx, &cuda, &scratch, &mut keep);
    // Scratch memory is freed when this returns: let the kernels finish first, also on error.
    let synced = stream.synchronize();
    drop(keep);
    let out = result?;
    synced?;
    Ok(out)
}

/// Step 1: a selection byte per row of `batch`, 1 where `predicate` is true; the tables its
/// kernel reads go to `keep`.
fn predicate_bytes(
    ctx: &Arc<CudaContext>,
    cuda: &Arc<CudaStream>,
    scratch: &Scratch,
    keep: &mut Vec<DeviceBuffer>,
    batch: &DeviceRecordBatch,
    predicate: &Predicate,
) -> Result<DeviceBuffer> {
    let n = batch.num_rows();
    let n64 = n as u64;
    let mut cols = BTreeSet::new();
    predicate.columns(&mut cols);
    let cols: Vec<usize> = cols.into_iter().collect();
    let generated = generate(predicate, batch, &cols)?;
    let pred = function(ctx, &generated.source, "pred")?;
    let lit = DeviceBuffer::from_host(&generated.literals, scratch.resource, &scratch.stream)?;
    let sel = scratch.alloc(n)?;
    let mut args = vec![n64, sel.address(), lit.address()];
    keep.extend(column_args(batch, &cols, &mut args, scratch.resource, &scratch.stream)?);
    keep.push(lit);
    launch(cuda, &pred, n64.div_ceil(BLOCK as u64), BLOCK, &args)?;
    Ok(sel)
}

#[allow(clippy::too_many_arguments)]
fn run(
    ctx: &Arc<CudaContext>,
    cuda: &Arc<CudaStream>,
    scratch: &Scratch,
    keep: &mut Vec<DeviceBuffer>,
    batch: &DeviceRecordBatch,
    predicate: &Predicate,
    output: &[usize],
    limit: usize,
) -> Result<Filtered> {
    let (stream, n) = (&scratch.stream, batch.num_rows());
    // 1. The predicate.
    let sel = predicate_bytes(ctx, cuda, scratch, keep, batch, predicate)?;
    // 2. and 3. The indices of the first `limit` selected rows.
    let Some((idx, m)) = selected_rows(ctx, cuda, scratch, &sel, n, limit)? else {
        return Ok(Filtered::Empty);
    };
    // A projected column without a compaction kernel: filter on the host.
    if output.iter().any(|&c| !compactable(batch.column(c).data_type())) {
        let mut bytes = vec![0u8; n];
        sel.copy_to_host(0, &mut bytes, stream)?;
        let mask = BooleanArray::new(BooleanBuffer::collect_bool(n, |i| bytes[i] != 0), None);
        let host = crate::transfer::dtoh(&batch.project(output)?, stream)?;
        let filtered = arrow_select::filter::filter_record_batch(&host, &mask)?;
        return Ok(Filtered::Host(filtered.slice(0, m)));
    }
    // 4. Compact the projected columns.
    let schema = Arc::new(batch.schema().project(output)?);
    let columns = output
        .iter()
        .map(|&c| compact(ctx, cuda, scratch, batch.column(c), &idx, m))
        .collect::<Result<Vec<_>>>()?;
    Ok(Filtered::Device(DeviceRecordBatch::try_new(
        schema,
        columns,
        m,
        stream.record()?,
    )?))
}

/// The elements `rows` (indices into its buffers, its offset included) of `a`, an array on a CUDA
/// device, gathered there and copied to the host.
pub(crate) fn gather_to_host(a: &DeviceArrayData, rows: &[u32], stream: &Stream) -> Result<arrow_array::ArrayRef> {
    let device = a.device();
    let (stream, cuda) = cuda_stream(stream, device, "a device gather")?;
    if !compactable(a.data_type()) {
        return Err(Error::Unsupported(format!("gathering {} on the device", a.data_type())));
    }
    let scratch = Scratch {
        resource: MemoryResource::default_for(device),
        stream: stream.clone(),
    };
    let relative: Vec<u8> = rows
        .iter()
        .map(|&r| {
            (r as usize)
                .checked_sub(a.offset())
                .filter(|&r| r < a.len())
                .map(|r| r as u32)
                .ok_or_else(|| Error::InvalidArgument(format!("element {r} outside the array")))
        })
        .collect::<Result<Vec<u32>>>()?
        .iter()
        .flat_map(|r| r.to_le_bytes())
        .collect();
    let idx = DeviceBuffer::from_host(&relative, scratch.resource, &stream)?;
    let ctx = cuda.context().clone();
    let column = compact(&ctx, &cuda, &scratch, a, &idx, rows.len())?;
    let schema = Arc::new(arrow_schema::Schema::new(vec![arrow_schema::Field::new(
        "v",
        a.data_type().clone(),
        true,
    )]));
    let batch = DeviceRecordBatch::try_new(schema, vec![column], rows.len(), stream.record()?)?;
    let host = crate::transfer::dtoh(&batch, &stream)?;
    stream.synchronize()?;
    Ok(host.column(0).clone())
}

/// The indices (`u32`) of the first `limit` rows whose selection byte in `sel` (one per row of
/// `n`) is nonzero, and their count; `None` when there are none. The count is the one value read
/// back.
pub(crate) fn selected_rows(
    ctx: &Arc<CudaContext>,
    cuda: &Arc<CudaStream>,
    scratch: &Scratch,
    sel: &DeviceBuffer,
    n: usize,
    limit: usize,
) -> Result<Option<(DeviceBuffer, usize)>> {
    let n64 = n as u64;
    let (tiles, total) = scan_u8(ctx, cuda, scratch, sel, n64)?;
    let m = (total as usize).min(limit);
    if m == 0 {
        return Ok(None);
    }
    let idx = scratch.alloc(m * 4)?;
    let select = function(ctx, SCAN_KERNELS, "select_indices")?;
    launch(
        cuda,
        &select,
        n64.div_ceil(TILE),
        BLOCK,
        &[sel.address(), n64, tiles.address(), m as u64, idx.address()],
    )?;
    Ok(Some((idx, m)))
}

/// Counts the nonzero selection bytes: returns the exclusive prefix sums of the tiles (with the
/// total at the end) and the total.
fn scan_u8(
    ctx: &Arc<CudaContext>,
    cuda: &Arc<CudaStream>,
    scratch: &Scratch,
    sel: &DeviceBuffer,
    n: u64,
) -> Result<(DeviceBuffer, u64)> {
    let ntiles = n.div_ceil(TILE);
    let tiles = scratch.alloc((ntiles as usize + 1) * 8)?;
    let count = function(ctx, SCAN_KERNELS, "tile_count_u8")?;
    launch(cuda, &count, ntiles, BLOCK, &[sel.address(), n, tiles.address()])?;
    let scan = function(ctx, SCAN_KERNELS, "scan_tiles")?;
    launch(cuda, &scan, 1, BLOCK, &[tiles.address(), ntiles])?;
    let mut total = [0u8; 8];
    tiles.copy_to_host(ntiles as usize * 8, &mut total, &scratch.stream)?;
    Ok((tiles, u64::from_le_bytes(total)))
}

/// Whether [`compact`] handles a column of this type.
pub(crate) fn compactable(dt: &DataType) -> bool {
    matches!(
        dt,
        DataType::Boolean
            | DataType::Utf8
            | DataType::Binary
            | DataType::LargeUtf8
            | DataType::LargeBinary
            | DataType::Utf8View
            | DataType::BinaryView
            | DataType::FixedSizeBinary(_)
    ) || (dt.is_primitive() && dt.primitive_width().is_some())
}

/// The rows `idx[0..m]` of `a`, in new device memory.
pub(crate) fn compact(
    ctx: &Arc<CudaContext>,
    cuda: &Arc<CudaStream>,
    scratch: &Scratch,
    a: &DeviceArrayData,
    idx: &DeviceBuffer,
    m: usize,
) -> Result<DeviceArrayData> {
    let m64 = m as u64;
    let off = a.offset() as u64;
    let grid = m64.div_ceil(BLOCK as u64);
    let bits = |src: &DeviceBuffer| -> Result<DeviceBuffer> {
        let out = scratch.alloc(m.div_ceil(8))?;
        let f = function(ctx, SCAN_KERNELS, "gather_bits")?;
        let bytes = m64.div_ceil(8);
        launch(
            cuda,
            &f,
            bytes.div_ceil(BLOCK as u64),
            BLOCK,
            &[src.address(), off, idx.address(), m64, out.address()],
        )?;
        Ok(out)
    };
    let nulls = match (a.nulls(), a.null_count()) {
        (Some(_), Some(0)) | (None, _) => None,
        (Some(b), _) => Some(bits(b)?),
    };
    let null_count = if nulls.is_none() { Some(0) } else { None };
    let buffer = |i: usize| {
        a.buffers()
            .get(i)
            .ok_or_else(|| Error::InvalidData(format!("{} array without buffer {i}", a.data_type())))
    };
    let dt = a.data_type().clone();
    let buffers = match &dt {
        DataType::Boolean => vec![bits(buffer(0)?)?],
        DataType::Utf8 | DataType::Binary | DataType::LargeUtf8 | DataType::LargeBinary => {
            let large = matches!(dt, DataType::LargeUtf8 | DataType::LargeBinary);
            let (lengths_fn, bytes_fn) = if large {
                ("string_lengths_i64", "gather_bytes_i64")
            } else {
                ("string_lengths_i32", "gather_bytes_i32")
            };
            let (offsets, data) = (buffer(0)?, buffer(1)?);
            let lengths = scratch.alloc(m * 8)?;
            launch(
                cuda,
                &function(ctx, SCAN_KERNELS, lengths_fn)?,
                grid,
                BLOCK,
                &[offsets.address(), off, idx.address(), m64, lengths.address()],
            )?;
            let (new_offsets, total) = offsets_of(ctx, cuda, scratch, &lengths, m, large)?;
            let new_data = scratch.alloc(total)?;
            launch(
                cuda,
                &function(ctx, SCAN_KERNELS, bytes_fn)?,
                grid,
                BLOCK,
                &[
                    offsets.address(),
                    off,
                    data.address(),
                    idx.address(),
                    m64,
                    new_offsets.address(),
                    new_data.address(),
                ],
            )?;
            vec![new_offsets, new_data.slice(0, total)?]
        }
        DataType::Utf8View | DataType::BinaryView => {
            let views = scratch.alloc(m * 16)?;
            launch(
                cuda,
                &function(ctx, SCAN_KERNELS, "gather_w16")?,
                grid,
                BLOCK,
                &[buffer(0)?.address(), off, idx.address(), m64, views.address()],
            )?;
            let mut b = vec![views];
            b.extend(a.buffers()[1..].iter().cloned());
            b
        }
        other => {
            let width = match other {
                DataType::FixedSizeBinary(w) => *w as usize,
                _ => other
                    .primitive_width()
                    .ok_or_else(|| Error::Unsupported(format!("GPU compaction of {other}")))?,
            };
            let out = scratch.alloc(m * width)?;
            let src = buffer(0)?.address();
            let (name, args) = match width {
                1 => ("gather_w1", vec![src, off, idx.address(), m64, out.address()]),
                2 => ("gather_w2", vec![src, off, idx.address(), m64, out.address()]),
                4 => ("gather_w4", vec![src, off, idx.address(), m64, out.address()]),
                8 => ("gather_w8", vec![src, off, idx.address(), m64, out.address()]),
                16 => ("gather_w16", vec![src, off, idx.address(), m64, out.address()]),
                w => (
                    "gather_fixed",
                    vec![src, off, w as u64, idx.address(), m64, out.address()],
                ),
            };
            launch(cuda, &function(ctx, SCAN_KERNELS, name)?, grid, BLOCK, &args)?;
            vec![out.slice(0, m * width)?]
        }
    };
    let offsets_computed = matches!(
        dt,
        DataType::Utf8 | DataType::Binary | DataType::LargeUtf8 | DataType::LargeBinary
    );
    let mut out = DeviceArrayData::try_new(dt, m, 0, null_count, nulls, buffers, vec![])?;
    // Gathered values, bits and views are copies of a valid array's: the result is as valid as
    // the input, and its download needs no validation. New string offsets are computed here, so
    // those arrays are validated when downloaded.
    out.trusted = a.is_trusted() && !offsets_computed;
    Ok(out)
}

/// New string offsets (`i64` when `large`, else `i32`) for `m` strings of `lengths` (`u64` each):
/// the prefix sums of the lengths, and their total (the one value read back).
fn offsets_of(
    ctx: &Arc<CudaContext>,
    cuda: &Arc<CudaStream>,
    scratch: &Scratch,
    lengths: &DeviceBuffer,
    m: usize,
    large: bool,
) -> Result<(DeviceBuffer, usize)> {
    let m64 = m as u64;
    let ntiles = m64.div_ceil(TILE);
    let tiles = scratch.alloc((ntiles as usize + 1) * 8)?;
    launch(
        cuda,
        &function(ctx, SCAN_KERNELS, "tile_sum_u64")?,
        ntiles,
        BLOCK,
        &[lengths.address(), m64, tiles.address()],
    )?;
    launch(
        cuda,
        &function(ctx, SCAN_KERNELS, "scan_tiles")?,
        1,
        BLOCK,
        &[tiles.address(), ntiles],
    )?;
    let mut total = [0u8; 8];
    tiles.copy_to_host(ntiles as usize * 8, &mut total, &scratch.stream)?;
    let total = u64::from_le_bytes(total) as usize;
    if !large && total > i32::MAX as usize {
        return Err(Error::InvalidData(format!(
            "{total} bytes of strings overflow i32 offsets"
        )));
    }
    let (write, width) = if large {
        ("scan_write_i64", 8)
    } else {
        ("scan_write_i32", 4)
    };
    let offsets = scratch.alloc((m + 1) * width)?;
    launch(
        cuda,
        &function(ctx, SCAN_KERNELS, write)?,
        ntiles,
        BLOCK,
        &[lengths.address(), m64, tiles.address(), offsets.address()],
    )?;
    Ok((offsets, total))
}

/// The buffers of a string column of `dt` (`Utf8`, `LargeUtf8` or `Utf8View`) of `m` strings given
/// by reference, in new device memory: `refs` holds the address of each string's bytes (in device
/// memory that outlives the kernels), `lengths` its length in bytes (0 for a null), `u64` each. A
/// view column's data buffer holds every string's bytes, its views the inline copies of the short
/// ones too.
pub(crate) fn strings_from_refs(
    ctx: &Arc<CudaContext>,
    cuda: &Arc<CudaStream>,
    scratch: &Scratch,
    dt: &DataType,
    (refs, lengths): (&DeviceBuffer, &DeviceBuffer),
    m: usize,
) -> Result<Vec<DeviceBuffer>> {
    let (large, bytes_fn) = match dt {
        DataType::Utf8 => (false, "ref_bytes_i32"),
        DataType::LargeUtf8 | DataType::Utf8View => (true, "ref_bytes_i64"),
        other => return Err(Error::Unsupported(format!("strings by reference as {other}"))),
    };
    let m64 = m as u64;
    let grid = m64.div_ceil(BLOCK as u64);
    let (offsets, total) = offsets_of(ctx, cuda, scratch, lengths, m, large)?;
    if *dt == DataType::Utf8View && total > u32::MAX as usize {
        return Err(Error::InvalidData(format!(
            "{total} bytes of strings overflow a view's u32 offsets"
        )));
    }
    let data = scratch.alloc(total)?;
    let pair = [refs.address(), lengths.address(), m64];
    let mut args = pair.to_vec();
    args.extend([offsets.address(), data.address()]);
    launch(cuda, &function(ctx, SCAN_KERNELS, bytes_fn)?, grid, BLOCK, &args)?;
    let data = data.slice(0, total)?;
    if *dt != DataType::Utf8View {
        return Ok(vec![offsets, data]);
    }
    let views = scratch.alloc(m * 16)?;
    let mut args = pair.to_vec();
    args.extend([offsets.address(), views.address()]);
    launch(cuda, &function(ctx, SCAN_KERNELS, "ref_views")?, grid, BLOCK, &args)?;
    Ok(vec![views.slice(0, m * 16)?, data])
}

/// Wraps a host-filtered batch with the scan's schema and row count.
pub(crate) fn host_batch(batch: RecordBatch, schema: arrow_schema::SchemaRef) -> Result<RecordBatch> {
    let options = RecordBatchOptions::new().with_row_count(Some(batch.num_rows()));
    Ok(RecordBatch::try_new_with_options(
        schema,
        batch.columns().to_vec(),
        &options,
    )?)
}

/// Appends the kernel arguments of `cols` (see [`Codegen::column_params`]) to `args`; returns the
/// device buffers the arguments point into that must live until the kernels finish (the buffer
/// tables of view columns).
///
/// [`Codegen::column_params`]: super::predicate_codegen::Codegen::column_params
pub(crate) fn column_args(
    batch: &DeviceRecordBatch,
    cols: &[usize],
    args: &mut Vec<u64>,
    resource: MemoryResource,
    stream: &Stream,
) -> Result<Vec<DeviceBuffer>> {
    let mut keep = Vec::new();
    for &c in cols {
        let a = batch.column(c);
        let values = a.buffers().first().map_or(0, DeviceBuffer::address);
        let data = match a.data_type() {
            DataType::Utf8 | DataType::LargeUtf8 => a.buffers().get(1).map_or(0, DeviceBuffer::address),
            DataType::Utf8View => {
                let table: Vec<u8> = a.buffers()[1..]
                    .iter()
                    .flat_map(|b| b.address().to_le_bytes())
                    .collect();
                let t = DeviceBuffer::from_host(&table, resource, stream)?;
                let addr = t.address();
                keep.push(t);
                addr
            }
            // The values' buffers, validity and offset (see `Codegen::column_decl`).
            DataType::Dictionary(..) => {
                let values = a
                    .children()
                    .first()
                    .ok_or_else(|| Error::InvalidData("a dictionary without values".into()))?;
                let table: Vec<u8> = [
                    values.buffers().first().map_or(0, DeviceBuffer::address),
                    values.buffers().get(1).map_or(0, DeviceBuffer::address),
                    validity(values),
                    values.offset() as u64,
                ]
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect();
                let t = DeviceBuffer::from_host(&table, resource, stream)?;
                let addr = t.address();
                keep.push(t);
                addr
            }
            _ => 0,
        };
        args.extend([values, data, validity(a), a.offset() as u64]);
    }
    Ok(keep)
}

/// The address of an array's validity bitmap, 0 when no element is null.
fn validity(a: &DeviceArrayData) -> u64 {
    match (a.nulls(), a.null_count()) {
        (Some(_), Some(0)) | (None, _) => 0,
        (Some(b), _) => b.address(),
    }
}

#[cfg(test)]
mod tests {
    //! The kernels that assemble a column from strings by reference, compiled as C++ on the host:
    //! their bytes and views are arrow-rs's.

    use arrow_array::builder::make_view;

    use super::SCAN_KERNELS;
    use crate::datafusion::cuda_as_cpp;

    /// Reads `m` strings as hex ("-": empty), runs `ref_bytes_i64` and `ref_views` one thread at a
    /// time, and prints the data buffer, then each view as a 128-bit hex number.
    const MAIN: &str = r#"
int main() {
    static unsigned char strings[64][64], data[4096];
    static u64 refs[64], len[64];
    static long long offsets[65];
    static unsigned int views[256];
    u64 m = 0;
    if (scanf("%llu", &m) != 1 || m > 64) return 1;
    for (u64 j = 0; j < m; j++) {
        char hex[130];
        if (scanf("%129s", hex) != 1) return 1;
        len[j] = hex[0] == '-' ? 0 : strlen(hex) / 2;
        for (u64 k = 0; k < len[j]; k++) sscanf(hex + 2 * k, "%2hhx", &strings[j][k]);
        refs[j] = (u64)strings[j];
        offsets[j + 1] = offsets[j] + (long long)len[j];
    }
    blockDim.x = 1;
    for (u64 j = 0; j < m; j++) {
        blockIdx.x = (unsigned int)j;
        ref_bytes_i64(refs, len, m, offsets, data);
        ref_views(refs, len, m, offsets, views);
    }
    for (long long i = 0; i < offsets[m]; i++) printf("%02x", data[i]);
    printf("\n");
    for (u64 j = 0; j < m; j++) printf("%08x%08x%08x%08x\n", views[4 * j + 3], views[4 * j + 2], views[4 * j + 1], views[4 * j]);
    return 0;
}
"#;

    #[test]
    fn strings_by_reference_match_arrow() {
        let words = [
            "",
            "a",
            "twelve bytes",
            "thirteen byte",
            "日本語テキスト",
            "🌏x🌏",
            "",
            "a longer value than twelve bytes",
            "ü",
        ];
        let hex = |w: &str| w.bytes().map(|b| format!("{b:02x}")).collect::<String>();
        let input: String = std::iter::once(words.len().to_string())
            .chain(words.iter().map(|w| if w.is_empty() { "-".into() } else { hex(w) }))
            .map(|l| l + "\n")
            .collect();
        let Some(cxx) = cuda_as_cpp::compiler() else {
            eprintln!("skipped: no C++ compiler");
            return;
        };
        let got = cuda_as_cpp::run(cxx, "ref_strings", &format!("{SCAN_KERNELS}\n{MAIN}"), &input);
        assert_eq!(got.len(), words.len() + 1);
        assert_eq!(got[0], hex(&words.concat()));
        let mut offset = 0;
        for (w, view) in words.iter().zip(&got[1..]) {
            assert_eq!(view, &format!("{:032x}", make_view(w.as_bytes(), 0, offset)), "{w:?}");
            offset += w.len() as u32;
        }
    }
}
