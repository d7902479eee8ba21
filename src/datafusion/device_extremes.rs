//! The least and the greatest value of staged columns, found on their GPU (`kernels/extremes.cu`):
//! staging reads each host batch once, to pack it, and leaves the extremes of the columns this
//! module orders to the device they were copied to.
//!
//! Per device batch, `extremes_blocks` reduces each column's rows to a few candidates and
//! `extremes_final` those to two places and their values' bytes, written to mapped pinned memory
//! (launched as each batch is staged, without waiting); once staging is done, one synchronisation
//! later the values (longer strings copied from the device) become arrays of the column's type,
//! which DataFusion's `MIN` / `MAX` accumulators take in.

use std::sync::Arc;

use arrow_array::{
    ArrayRef, BinaryArray, BinaryViewArray, LargeBinaryArray, LargeStringArray, StringArray, StringViewArray,
    make_array,
};
use arrow_buffer::Buffer;
use arrow_data::ArrayData;
use arrow_schema::DataType;

use super::nvrtc::{BLOCK, cuda_stream, function, launch};
use crate::array::DeviceRecordBatch;
use crate::device::{Device, Event, Stream};
use crate::error::{Error, Result};
use crate::memory::pinned::PinnedPool;
use crate::memory::{DeviceBuffer, MemoryResource, copy};

const EXTREMES_KERNELS: &str = include_str!("kernels/extremes.cu");

/// How the kernels read a column (`KIND_*` in `kernels/extremes.cu`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Int = 0,
    UInt = 1,
    Float = 2,
    Bytes32 = 3,
    Bytes64 = 4,
    View = 5,
}

/// The kind and value width of columns of `dt` whose extremes the device finds; `None` for others
/// (booleans, intervals, dictionaries, nested types...), whose extremes the host finds.
fn kind(dt: &DataType) -> Option<(Kind, u64)> {
    use DataType::*;
    let width = dt.primitive_width().unwrap_or(0) as u64;
    Some(match dt {
        UInt8 | UInt16 | UInt32 | UInt64 => (Kind::UInt, width),
        Float16 | Float32 | Float64 => (Kind::Float, width),
        Int8 | Int16 | Int32 | Int64 | Date32 | Date64 | Time32(_) | Time64(_) | Timestamp(..) | Duration(_) => {
            (Kind::Int, width)
        }
        Decimal32(..) | Decimal64(..) | Decimal128(..) | Decimal256(..) => (Kind::Int, width),
        Utf8 | Binary => (Kind::Bytes32, 0),
        LargeUtf8 | LargeBinary => (Kind::Bytes64, 0),
        Utf8View | BinaryView => (Kind::View, 0),
        _ => return None,
    })
}

/// Whether the device finds the extremes of columns of `dt` (see [`start`]).
pub(crate) fn supported(dt: &DataType) -> bool {
    kind(dt).is_some()
}

/// Whether the extremes of batches staged on `device` are left to it: a GPU, with the kernels
/// available.
pub(crate) fn on_device(device: Device) -> bool {
    matches!(device, Device::Cuda(_)) && super::nvrtc::available().is_ok()
}

/// The bytes of a value that [`Found`] holds itself (`INLINE` in the kernels); the host copies
/// longer ones from the device.
const INLINE: usize = 128;

/// What `extremes_final` writes (`Found` in `kernels/extremes.cu`), for the least value (`[0]`)
/// and the greatest (`[1]`): its place (-1 when there is no valid value), the address and length
/// of its bytes, and its first [`INLINE`] bytes.
#[repr(C)]
#[derive(Clone, Copy)]
struct Found {
    place: [i64; 2],
    at: [u64; 2],
    len: [u64; 2],
    value: [[u8; INLINE]; 2],
}

/// How the kernels see a column (`Column` in `kernels/extremes.cu`).
#[repr(C)]
#[derive(Clone, Copy)]
struct Column {
    kind: u64,
    width: u64,
    values: u64,
    data: u64,
    nulls: u64,
    offset: u64,
    len: u64,
}

/// Blocks of the first pass per column, at most: enough for every multiprocessor several times
/// over, few enough that the final block's candidates stay few.
const MAX_BLOCKS: u64 = 1024;

/// The extremes of some columns of one device batch, being found in the order of a stream (see
/// [`start`]); [`finish`] reads them.
pub(crate) struct Finding {
    batch: DeviceRecordBatch,
    columns: Vec<usize>,
    /// One [`Found`] per column, then what the kernels read (copied to `scratch`), in mapped
    /// pinned memory.
    pinned: DeviceBuffer,
    /// The columns as the kernels see them, the view columns' tables of data buffer addresses,
    /// and the first pass's candidates.
    _scratch: DeviceBuffer,
    stream: Stream,
    /// Recorded after the kernels once they are launched.
    done: Option<Event>,
}

impl Drop for Finding {
    /// The kernels write `pinned` and read the rest: they are waited for before those can go
    /// (the whole stream, when launching failed part of the way).
    fn drop(&mut self) {
        let _ = match &self.done {
            Some(done) => done.synchronize(),
            None => self.stream.synchronize(),
        };
    }
}

/// Writes `values` into `out` from byte `at` on, as their bytes.
fn put<T: Copy>(out: &mut [u8], at: usize, values: &[T]) {
    let len = std::mem::size_of_val(values);
    // SAFETY: `T` is plain old data (`Column`, `u64`), read as `len` bytes.
    let bytes = unsafe { std::slice::from_raw_parts(values.as_ptr() as *const u8, len) };
    out[at..at + len].copy_from_slice(bytes);
}

/// Starts finding the extremes of `columns` (indices, each of a [`supported`] type) of `batch`, on
/// its GPU in the order of `stream` (after the batch is ready): one copy of the columns'
/// descriptions and two launches, however many columns; returns without waiting.
pub(crate) fn start(batch: &DeviceRecordBatch, columns: &[usize], stream: &Stream) -> Result<Finding> {
    let device = batch.device();
    let (stream, cuda) = cuda_stream(stream, device, "finding extremes")?;
    let ctx = cuda.context().clone();
    let (blocks_fn, final_fn) = (
        function(&ctx, EXTREMES_KERNELS, "extremes_blocks")?,
        function(&ctx, EXTREMES_KERNELS, "extremes_final")?,
    );
    let arrays = columns
        .iter()
        .map(|&c| {
            let a = batch
                .columns()
                .get(c)
                .ok_or_else(|| Error::InvalidArgument(format!("no column {c}")))?;
            let (kind, width) =
                kind(&a.data_type).ok_or_else(|| Error::Unsupported(format!("the extremes of {}", a.data_type)))?;
            a.check_readable()?;
            Ok((a, kind, width))
        })
        .collect::<Result<Vec<_>>>()?;
    let n = arrays.len();
    let per = arrays
        .iter()
        .map(|(a, ..)| (a.len as u64).div_ceil(BLOCK as u64 * 8))
        .max()
        .unwrap_or(0)
        .clamp(1, MAX_BLOCKS);
    // The view columns' data buffer addresses, one table after another.
    let mut tables: Vec<u64> = Vec::new();
    let mut table_at = Vec::with_capacity(n);
    for (a, kind, _) in &arrays {
        table_at.push(tables.len());
        if *kind == Kind::View {
            tables.extend(a.buffers[1..].iter().map(DeviceBuffer::address));
        }
    }
    let record = std::mem::size_of::<Found>();
    let described = n * std::mem::size_of::<Column>() + tables.len() * 8;
    let resource = MemoryResource::default_for(device);
    let scratch = DeviceBuffer::alloc(resource, described + n * per as usize * 16, &stream)?;
    let descriptions = scratch.address();
    let candidates = descriptions + described as u64;
    let described_columns: Vec<Column> = arrays
        .iter()
        .zip(&table_at)
        .map(|((a, kind, width), &table)| Column {
            kind: *kind as u64,
            width: *width,
            values: a.buffers.first().map_or(0, DeviceBuffer::address),
            data: match kind {
                Kind::Bytes32 | Kind::Bytes64 => a.buffers.get(1).map_or(0, DeviceBuffer::address),
                Kind::View => descriptions + (n * std::mem::size_of::<Column>() + 8 * table) as u64,
                _ => 0,
            },
            nulls: match a.null_count {
                Some(0) => 0,
                _ => a.nulls.as_ref().map_or(0, DeviceBuffer::address),
            },
            offset: a.offset as u64,
            len: a.len as u64,
        })
        .collect();
    let pool = PinnedPool::shared(MemoryResource::PinnedHost(device.ordinal().unwrap_or(0)))?;
    let mut pinned = pool.take(n * record + described)?;
    let out = pinned
        .host_slice_mut()
        .ok_or_else(|| Error::Unsupported("pinned block is not host memory".into()))?;
    put(out, n * record, &described_columns);
    put(out, n * record + n * std::mem::size_of::<Column>(), &tables);
    let mut finding = Finding {
        batch: batch.clone(),
        columns: columns.to_vec(),
        pinned,
        _scratch: scratch,
        stream: stream.clone(),
        done: None,
    };
    stream.wait(batch.ready())?;
    let found = finding.pinned.address();
    // SAFETY: both ranges lie in allocations the finding keeps until its work is done.
    unsafe {
        copy(
            descriptions,
            device,
            found + (n * record) as u64,
            finding.pinned.device(),
            described,
            &stream,
        )?
    };
    launch(
        &cuda,
        &blocks_fn,
        per * n as u64,
        BLOCK,
        &[descriptions, per, candidates],
    )?;
    launch(
        &cuda,
        &final_fn,
        n as u64,
        BLOCK,
        &[descriptions, per, candidates, found],
    )?;
    finding.done = Some(stream.record()?);
    Ok(finding)
}

/// The extremes each of `findings` found, once their work is done: for each finding, each of its
/// columns with two arrays of the column's type, holding the batch's least and its greatest valid
/// value (none when it has none).
pub(crate) fn finish(findings: &[Finding]) -> Result<Vec<Vec<(usize, ArrayRef, ArrayRef)>>> {
    for f in findings {
        match &f.done {
            Some(done) => done.synchronize()?,
            None => {
                return Err(Error::InvalidArgument(
                    "extremes whose kernels were not launched".into(),
                ));
            }
        }
    }
    let record = std::mem::size_of::<Found>();
    let mut found = Vec::with_capacity(findings.len());
    for f in findings {
        let bytes = f
            .pinned
            .host_slice()
            .ok_or_else(|| Error::Unsupported("pinned block is not host memory".into()))?;
        let records: Vec<Found> = bytes[..f.columns.len() * record]
            .chunks_exact(record)
            // SAFETY: `Found` is plain old data of `record` bytes, which the kernel wrote.
            .map(|r| unsafe { std::ptr::read_unaligned(r.as_ptr() as *const Found) })
            .collect();
        found.push(records);
    }
    let long = long_values(findings, &found)?;
    let mut long = long.into_iter();
    let mut value = |place: i64, inline: &[u8; INLINE], len: u64| -> Option<Vec<u8>> {
        match (place >= 0, len as usize) {
            (false, _) => None,
            (true, len) if len <= INLINE => Some(inline[..len].to_vec()),
            (true, _) => long.next(),
        }
    };
    findings
        .iter()
        .zip(&found)
        .map(|(f, records)| {
            f.columns
                .iter()
                .zip(records)
                .map(|(&c, r)| {
                    let dt = f.batch.schema().field(c).data_type().clone();
                    let least = value(r.place[0], &r.value[0], r.len[0]);
                    let greatest = value(r.place[1], &r.value[1], r.len[1]);
                    Ok((c, array_of(&dt, least)?, array_of(&dt, greatest)?))
                })
                .collect()
        })
        .collect()
}

/// The bytes of the values longer than [`INLINE`] that `found` (the records of `findings`) point
/// to, in the order of the records (least before greatest), copied from their devices.
fn long_values(findings: &[Finding], found: &[Vec<Found>]) -> Result<Vec<Vec<u8>>> {
    let mut copies = Vec::new();
    let mut size = 0usize;
    for (f, records) in findings.iter().zip(found) {
        for r in records {
            for w in 0..2 {
                let len = r.len[w] as usize;
                if r.place[w] >= 0 && len > INLINE {
                    copies.push((f, r.at[w], len, size));
                    size += len;
                }
            }
        }
    }
    let Some((first, ..)) = copies.first() else {
        return Ok(Vec::new());
    };
    let device = first.batch.device();
    let pool = PinnedPool::shared(MemoryResource::PinnedHost(device.ordinal().unwrap_or(0)))?;
    let block = pool.take(size)?;
    // Each value is copied in the order of its batch's stream; every such stream is waited for
    // before the block is read (or goes back to the pool, on an error).
    let mut issued = Ok(());
    for &(f, at, len, dst) in &copies {
        // SAFETY: `at..at + len` is a value's bytes in a buffer of `f.batch` (the kernel found it
        // there), alive while `findings` are; the block is not read before the synchronisation.
        issued = unsafe {
            copy(
                block.address() + dst as u64,
                block.device(),
                at,
                f.batch.device(),
                len,
                &f.stream,
            )
        };
        if issued.is_err() {
            break;
        }
    }
    // Copies come finding by finding: each finding's stream once (waiting again costs little).
    let mut last: Option<&Finding> = None;
    for &(f, ..) in &copies {
        if !last.is_some_and(|l| std::ptr::eq(l, f)) {
            let synchronized = f.stream.synchronize();
            issued = issued.and(synchronized);
            last = Some(f);
        }
    }
    issued?;
    let landed = block
        .host_slice()
        .ok_or_else(|| Error::Unsupported("pinned block is not host memory".into()))?;
    Ok(copies
        .iter()
        .map(|&(_, _, len, at)| landed[at..at + len].to_vec())
        .collect())
}

/// An array of `dt` holding `value` (its bytes as the device holds them), or no value.
fn array_of(dt: &DataType, value: Option<Vec<u8>>) -> Result<ArrayRef> {
    let values: Vec<Vec<u8>> = value.into_iter().collect();
    let strings = || {
        values
            .iter()
            .map(|v| std::str::from_utf8(v).map_err(|e| Error::InvalidData(format!("a {dt} value: {e}"))))
            .collect::<Result<Vec<&str>>>()
    };
    Ok(match dt {
        DataType::Utf8 => Arc::new(StringArray::from(strings()?)),
        DataType::LargeUtf8 => Arc::new(LargeStringArray::from(strings()?)),
        DataType::Utf8View => Arc::new(StringViewArray::from(strings()?)),
        DataType::Binary => Arc::new(BinaryArray::from_iter_values(&values)),
        DataType::LargeBinary => Arc::new(LargeBinaryArray::from_iter_values(&values)),
        DataType::BinaryView => Arc::new(BinaryViewArray::from_iter_values(&values)),
        _ => {
            let bytes: Vec<u8> = values.concat();
            make_array(ArrayData::try_new(
                dt.clone(),
                values.len(),
                None,
                0,
                vec![Buffer::from_slice_ref(&bytes)],
                vec![],
            )?)
        }
    })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use ::datafusion::functions_aggregate::min_max::{MaxAccumulator, MinAccumulator};
    use ::datafusion::logical_expr::Accumulator;
    use arrow_array::*;
    use arrow_buffer::i256;
    use arrow_schema::{DataType, Field, Schema};
    use half::f16;

    use super::{finish, start, supported};
    use crate::device::{Stream, cuda_for_tests};
    use crate::transfer::htod;

    /// Every type the device orders, with nulls (first, between, last) and `rows` values that
    /// `seed` varies: integers at both ends of their range, floats with NaN of both signs, signed
    /// zeros and infinities, decimals of every width with negative values, zoned timestamps,
    /// strings and binaries of every layout with shared prefixes, long values (past what the
    /// record holds) and the empty value.
    fn batch(rows: usize, seed: u64) -> RecordBatch {
        let pick = |i: usize| {
            (i as u64)
                .wrapping_mul(2654435761)
                .wrapping_add(seed.wrapping_mul(40503))
        };
        let valid = |i: usize| !(i + seed as usize).is_multiple_of(4);
        let floats = [
            0.0,
            -0.0,
            1.5,
            -2.25,
            f64::INFINITY,
            f64::NEG_INFINITY,
            f64::NAN,
            -f64::NAN,
            1e300,
            -1e-300,
        ];
        let float = |i: usize| floats[(pick(i) % floats.len() as u64) as usize];
        let text = |i: usize| {
            let v = pick(i);
            let long = "é".repeat((v % 90) as usize);
            ["", "a", "ab", "abcdefghijkl", "abcdefghijklm", "zz\u{0}", &long][(v % 7) as usize].to_string()
        };
        let ints = |i: usize| pick(i) as i64 ^ ((pick(i) % 3) as i64).wrapping_neg().wrapping_shl(60);
        macro_rules! values {
            ($array:ty, $f:expr) => {
                <$array>::from_iter((0..rows).map(|i| valid(i).then(|| $f(i))))
            };
        }
        macro_rules! column {
            ($array:ty, $f:expr) => {
                Arc::new(values!($array, $f)) as ArrayRef
            };
        }
        let columns: Vec<(&str, ArrayRef)> = vec![
            ("i8", column!(Int8Array, |i| ints(i) as i8)),
            ("i16", column!(Int16Array, |i| ints(i) as i16)),
            ("i32", column!(Int32Array, |i| ints(i) as i32)),
            ("i64", column!(Int64Array, &ints)),
            ("u8", column!(UInt8Array, |i| ints(i) as u8)),
            ("u16", column!(UInt16Array, |i| ints(i) as u16)),
            ("u32", column!(UInt32Array, |i| ints(i) as u32)),
            ("u64", column!(UInt64Array, |i| ints(i) as u64)),
            ("f16", column!(Float16Array, |i| f16::from_f64(float(i)))),
            ("f32", column!(Float32Array, |i| float(i) as f32)),
            ("f64", column!(Float64Array, float)),
            ("date32", column!(Date32Array, |i| ints(i) as i32)),
            ("date64", column!(Date64Array, ints)),
            (
                "time64",
                column!(Time64MicrosecondArray, |i| ints(i).rem_euclid(86_400_000_000)),
            ),
            (
                "ts",
                Arc::new(values!(TimestampNanosecondArray, ints).with_timezone("+02:00")),
            ),
            ("duration", column!(DurationSecondArray, ints)),
            (
                "d128",
                Arc::new(
                    values!(Decimal128Array, |i| (ints(i) as i128) << 40 | pick(i) as i128)
                        .with_precision_and_scale(38, 4)
                        .unwrap(),
                ),
            ),
            (
                "d256",
                Arc::new(
                    values!(Decimal256Array, |i| i256::from_parts(
                        pick(i) as u128,
                        (ints(i) as i128) >> 3
                    ))
                    .with_precision_and_scale(76, 10)
                    .unwrap(),
                ),
            ),
            ("utf8", column!(StringArray, text)),
            ("large_utf8", column!(LargeStringArray, text)),
            ("view", column!(StringViewArray, text)),
            ("binary", column!(BinaryArray, |i| text(i).into_bytes())),
            ("large_binary", column!(LargeBinaryArray, |i| text(i).into_bytes())),
            ("binary_view", column!(BinaryViewArray, |i| text(i).into_bytes())),
        ];
        let schema = Schema::new(
            columns
                .iter()
                .map(|(n, a)| Field::new(*n, a.data_type().clone(), true))
                .collect::<Vec<_>>(),
        );
        RecordBatch::try_new(Arc::new(schema), columns.into_iter().map(|(_, a)| a).collect()).unwrap()
    }

    /// DataFusion's `MIN` and `MAX` of the arrays.
    fn min_max(dt: &DataType, arrays: &[ArrayRef]) -> (String, String) {
        let mut min = MinAccumulator::try_new(dt).unwrap();
        let mut max = MaxAccumulator::try_new(dt).unwrap();
        for a in arrays {
            min.update_batch(std::slice::from_ref(a)).unwrap();
            max.update_batch(std::slice::from_ref(a)).unwrap();
        }
        // The scalars' `Debug` would print NaN of either sign alike: compare their bits.
        let show = |v: ::datafusion::common::ScalarValue| match v {
            ::datafusion::common::ScalarValue::Float16(Some(f)) => format!("f16 {:#x}", f.to_bits()),
            ::datafusion::common::ScalarValue::Float32(Some(f)) => format!("f32 {:#x}", f.to_bits()),
            ::datafusion::common::ScalarValue::Float64(Some(f)) => format!("f64 {:#x}", f.to_bits()),
            v => format!("{v:?} {}", v.data_type()),
        };
        (show(min.evaluate().unwrap()), show(max.evaluate().unwrap()))
    }

    /// The extremes the device finds in batches of every type it orders, whole, sliced (values,
    /// offsets and bitmaps not starting at 0), without valid values and empty, are those
    /// DataFusion's `MIN` and `MAX` find in the host batches, bit for bit.
    #[test]
    fn the_extremes_found_on_the_device_are_datafusions() {
        let Some(device) = cuda_for_tests() else { return };
        let stream = Stream::new(device).unwrap();
        let all_null = {
            let b = batch(8, 1);
            let nulls = b
                .columns()
                .iter()
                .map(|c| arrow_array::new_null_array(c.data_type(), 5))
                .collect();
            RecordBatch::try_new(b.schema(), nulls).unwrap()
        };
        let cases = [
            vec![batch(5000, 1)],
            vec![batch(3000, 2).slice(37, 2500), batch(100, 3).slice(99, 1)],
            vec![batch(700, 4).slice(3, 0), all_null.clone()],
            vec![all_null, batch(64, 5)],
        ];
        for hosts in &cases {
            let schema = hosts[0].schema();
            assert!(schema.fields().iter().all(|f| supported(f.data_type())));
            let columns: Vec<usize> = (0..schema.fields().len()).collect();
            let staged: Vec<_> = hosts.iter().map(|h| htod(h, device, &stream).unwrap()).collect();
            let findings: Vec<_> = staged.iter().map(|b| start(b, &columns, &stream).unwrap()).collect();
            let found = finish(&findings).unwrap();
            for (c, field) in schema.fields().iter().enumerate() {
                let host: Vec<ArrayRef> = hosts.iter().map(|h| h.column(c).clone()).collect();
                let mut least = Vec::new();
                let mut greatest = Vec::new();
                for per_batch in &found {
                    let (column, l, g) = &per_batch[c];
                    assert_eq!(*column, c);
                    assert!(l.len() <= 1 && g.len() == l.len(), "{}", field.name());
                    assert_eq!((l.data_type(), g.data_type()), (field.data_type(), field.data_type()));
                    least.push(l.clone());
                    greatest.push(g.clone());
                }
                let (min, max) = min_max(field.data_type(), &host);
                assert_eq!(min_max(field.data_type(), &least).0, min, "{}", field.name());
                assert_eq!(min_max(field.data_type(), &greatest).1, max, "{}", field.name());
            }
        }
    }
}
