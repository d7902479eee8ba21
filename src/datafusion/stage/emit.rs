//! A stage's groups as a batch of DataFusion's partial aggregate state, made on the device: the
//! kernel `stage_emit` (`kernels/stage.cu`) writes every state column in Arrow's layout from the
//! group table's key words and accumulator slots (one thread per group; validity bitmaps and null
//! counts through warp votes), and the columns come to the host in one copy into pinned memory
//! that becomes the arrays' buffers. String keys come as `Utf8View` (a view per group over its
//! key words) and dictionary keys as their values, cast on the host where the state's type
//! differs; `MIN`/`MAX` kept as row references come from [`DeviceStage`]'s gather.
//!
//! [`DeviceStage`]: super::device::DeviceStage

use std::sync::Arc;

use ::datafusion::arrow::compute::cast;
use arrow_array::{ArrayRef, RecordBatch, RecordBatchOptions};
use arrow_schema::{DataType, Field, Schema};
use cudarc::driver::{CudaFunction, CudaStream};

use super::super::nvrtc::{BLOCK, launch};
use super::layout::{Acc, AggKind, StagePlan, key_value_type};
use super::narrow::{Narrowing, kept_on_device, narrow_on_host};
use super::{Outcome, StageResult};
use crate::array::{DeviceArrayData, DeviceRecordBatch};
use crate::device::Stream;
use crate::error::Error;
use crate::memory::{DeviceBuffer, MemoryResource};

// The column kinds of `stage_emit` (kernels/stage.cu).
const KEY_INT: u64 = 0;
const KEY_BOOL: u64 = 1;
const KEY_DEC: u64 = 2;
const KEY_STR: u64 = 3;
const COUNT: u64 = 4;
const COUNT_OR_NULL: u64 = 5;
const SUM128: u64 = 6;
const I64: u64 = 7;
const F64: u64 = 8;
const ORDERED_F64: u64 = 9;

/// How one state column is made.
enum Column {
    /// By `stage_emit`.
    Device(Emitted),
    /// The values of row-reference aggregate `agg`, gathered by the stage.
    Extremes(usize),
}

/// A column `stage_emit` writes: its kind, the kind's `a`, `b` and `c`, the bytes of a value, and
/// the type it is written as.
struct Emitted {
    kind: u64,
    abc: [u64; 3],
    width: u64,
    emitted: DataType,
}

/// How each column of `plan`'s state batch is made.
fn columns(plan: &StagePlan) -> StageResult<Vec<Column>> {
    let (offsets, _) = plan.key_layout();
    let (_, first) = plan.slot_layout();
    let width = |dt: &DataType| {
        dt.primitive_width()
            .map(|w| w as u64)
            .ok_or_else(|| Outcome::Fail(Error::Unsupported(format!("a stage output column of {dt}")).into()))
    };
    let mut out = Vec::with_capacity(plan.schema.fields().len());
    for (j, key_type) in plan.key_types.iter().enumerate() {
        let (at, j64) = (offsets[j] as u64, j as u64);
        let dt = key_value_type(key_type);
        out.push(match dt {
            DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View => Column::Device(Emitted {
                kind: KEY_STR,
                abc: [at, j64, plan.key_words[j] as u64],
                width: 16,
                emitted: DataType::Utf8View,
            }),
            DataType::Boolean => Column::Device(Emitted {
                kind: KEY_BOOL,
                abc: [at, j64, 0],
                width: 0,
                emitted: DataType::Boolean,
            }),
            DataType::Decimal128(..) => Column::Device(Emitted {
                kind: KEY_DEC,
                abc: [at, j64, 0],
                width: 16,
                emitted: dt.clone(),
            }),
            _ => Column::Device(Emitted {
                kind: KEY_INT,
                abc: [at, j64, 0],
                width: width(dt)?,
                emitted: dt.clone(),
            }),
        });
    }
    for (a, spec) in plan.aggs.iter().enumerate() {
        let s = first[a] as u64;
        for (f, field) in spec.state.iter().enumerate() {
            let dt = field.data_type();
            // COUNT's state and AVG's first state field are the count; everything else the value,
            // null for a group without a non-null argument (AVG's count too, as DataFusion's
            // partial AVG emits it).
            let kind = if spec.kind == AggKind::Count {
                COUNT
            } else if spec.kind == AggKind::Avg && f == 0 {
                COUNT_OR_NULL
            } else {
                match spec.acc {
                    Acc::Float => F64,
                    Acc::Int128 => SUM128,
                    Acc::MinF64 | Acc::MaxF64 => ORDERED_F64,
                    Acc::MinI64 | Acc::MaxI64 => I64,
                    Acc::MinRow | Acc::MaxRow => {
                        out.push(Column::Extremes(a));
                        continue;
                    }
                    Acc::Count => return Err(Error::InvalidData("a COUNT with a value state".into()).into()),
                }
            };
            out.push(Column::Device(Emitted {
                kind,
                abc: [s, 0, 0],
                width: width(dt)?,
                emitted: dt.clone(),
            }));
        }
    }
    Ok(out)
}

/// Where a state column's buffers sit in the one allocation `stage_emit` writes.
struct Placed {
    values: usize,
    validity: usize,
    data: usize,
    /// Bytes of the values (a view column: of its views) and of a view column's data.
    values_len: usize,
    data_len: usize,
}

fn align(n: usize) -> usize {
    n.div_ceil(64) * 64
}

/// The group table of a stage on the device, read by `stage_emit`.
pub(crate) struct GroupTable<'a> {
    /// Groups `0..count`, each `nw` key words (the last one the keys' null bits).
    pub(crate) count: usize,
    pub(crate) group_keys: &'a DeviceBuffer,
    pub(crate) nw: u64,
    /// Accumulator slots, slot-major with a stride of `stride` groups.
    pub(crate) acc: &'a DeviceBuffer,
    pub(crate) stride: u64,
}

/// The state batch of `plan`'s groups in `table`, made by `emit` (the stage's `stage_emit`) on
/// the device and copied to the host, with only the groups `narrowing` keeps (narrowed on the
/// device, or on the host where a row-reference aggregate's values come from there); `extremes`
/// holds the values of each row-reference aggregate. Returns the batch and the bytes copied.
pub(crate) fn state_batch(
    plan: &StagePlan,
    table: &GroupTable<'_>,
    extremes: &[Option<ArrayRef>],
    narrowing: Option<&Narrowing>,
    kernel: (&CudaFunction, &Arc<CudaStream>),
    resource: MemoryResource,
    stream: &Stream,
) -> StageResult<(RecordBatch, u64)> {
    let empty = || Ok((RecordBatch::new_empty(plan.schema.clone()), 0));
    if table.count == 0 {
        return empty();
    }
    let columns = columns(plan)?;
    // The columns `stage_emit` writes, with their index among the state's.
    let device: Vec<(usize, &Emitted)> = columns
        .iter()
        .enumerate()
        .filter_map(|(i, c)| match c {
            Column::Device(e) => Some((i, e)),
            Column::Extremes(_) => None,
        })
        .collect();
    let emit = |chosen: &[(usize, &Emitted)], rows: Option<&(DeviceBuffer, usize)>| {
        emit_columns(chosen, table, rows, kernel, resource, stream)
    };
    // Narrowed on the device where every state column is the device's: the columns narrowing
    // reads first, then only the groups it keeps.
    let on_device = narrowing.filter(|_| device.len() == columns.len());
    let kept = match on_device {
        Some(n) => {
            let reads = n.columns();
            let read: Vec<(usize, &Emitted)> = reads.iter().map(|&c| device[c]).collect();
            match kept_on_device(&emit(&read, None)?, &n.over(&reads), stream)? {
                None => return empty(),
                Some(kept) => kept,
            }
        }
        None => None,
    };
    let emitted = emit(&device, kept.as_ref())?;
    let count = emitted.num_rows();
    let copied = emitted.size_in_bytes() as u64;
    let host = crate::transfer::dtoh(&emitted, stream)?;
    let mut downloaded = host.columns().iter();
    let mut out = Vec::with_capacity(columns.len());
    for (c, field) in columns.iter().zip(plan.schema.fields()) {
        let column = match c {
            Column::Device(_) => downloaded
                .next()
                .cloned()
                .ok_or_else(|| Error::InvalidData("a stage's emitted column is missing".into()))?,
            Column::Extremes(a) => extremes
                .get(*a)
                .cloned()
                .flatten()
                .ok_or_else(|| Error::InvalidData(format!("no values of {}", plan.aggs[*a].name)))?,
        };
        out.push(if column.data_type() == field.data_type() {
            column
        } else {
            cast(&column, field.data_type())?
        });
    }
    let options = RecordBatchOptions::new().with_row_count(Some(count));
    let batch = RecordBatch::try_new_with_options(plan.schema.clone(), out, &options)?;
    match narrowing {
        Some(n) if on_device.is_none() => Ok((narrow_on_host(batch, n)?, copied)),
        _ => Ok((batch, copied)),
    }
}

/// The `chosen` state columns of the groups of `table` (or of the `rows` among them: indices on
/// the device and their count), written by `stage_emit` into one allocation on the device.
fn emit_columns(
    chosen: &[(usize, &Emitted)],
    table: &GroupTable<'_>,
    rows: Option<&(DeviceBuffer, usize)>,
    (emit, cuda): (&CudaFunction, &Arc<CudaStream>),
    resource: MemoryResource,
    stream: &Stream,
) -> StageResult<DeviceRecordBatch> {
    let count = rows.map_or(table.count, |r| r.1);
    // Validity bitmaps (and boolean values) are written 32 groups a word.
    let bitmap = count.div_ceil(32) * 4;
    let mut placed = Vec::with_capacity(chosen.len());
    let mut end = 0;
    for (_, e) in chosen {
        let (values_len, data_len) = match e.kind {
            KEY_BOOL => (bitmap, 0),
            KEY_STR => (count * 16, count * 8 * e.abc[2] as usize),
            _ => (count * e.width as usize, 0),
        };
        if data_len > u32::MAX as usize {
            return Err(Outcome::GiveBack(format!(
                "{data_len} bytes of string keys (a view's offset holds 32 bits)"
            )));
        }
        let validity = end;
        let values = validity + align(bitmap);
        let data = values + align(values_len);
        end = data + align(data_len);
        placed.push(Placed {
            values,
            validity,
            data,
            values_len,
            data_len,
        });
    }
    let null_counts = end;
    end += chosen.len() * 8;
    let memory = DeviceBuffer::zeroed(resource, end, stream)?;
    let base = memory.address();
    let descriptors: Vec<u8> = chosen
        .iter()
        .zip(&placed)
        .flat_map(|((_, e), p)| {
            let at = |offset: usize| base + offset as u64;
            [
                e.kind,
                e.abc[0],
                e.abc[1],
                e.abc[2],
                e.width,
                at(p.values),
                at(p.validity),
                at(p.data),
            ]
            .into_iter()
            .flat_map(u64::to_le_bytes)
        })
        .collect();
    let descriptors = DeviceBuffer::from_host(&descriptors, resource, stream)?;
    let args = [
        count as u64,
        table.group_keys.address(),
        table.nw,
        table.acc.address(),
        table.stride,
        descriptors.address(),
        chosen.len() as u64,
        base + null_counts as u64,
        rows.map_or(0, |r| r.0.address()),
    ];
    launch(cuda, emit, (count as u64).div_ceil(BLOCK as u64), BLOCK, &args)?;
    // Synchronous: the kernel is done when the counts are here.
    let mut nulls = vec![0u8; chosen.len() * 8];
    memory.copy_to_host(null_counts, &mut nulls, stream)?;

    let mut fields = Vec::with_capacity(chosen.len());
    let mut arrays = Vec::with_capacity(chosen.len());
    for (k, (&(i, e), p)) in chosen.iter().zip(&placed).enumerate() {
        let n = u64::from_le_bytes(nulls[k * 8..k * 8 + 8].try_into().expect("8 bytes")) as usize;
        let validity = (n > 0).then(|| memory.slice(p.validity, bitmap)).transpose()?;
        let mut buffers = vec![memory.slice(p.values, p.values_len)?];
        if e.kind == KEY_STR {
            buffers.push(memory.slice(p.data, p.data_len)?);
        }
        let mut array = DeviceArrayData::try_new(e.emitted.clone(), count, 0, Some(n), validity, buffers, vec![])?;
        // Written by `stage_emit` from the stage's own keys and accumulators: valid by construction.
        array.trusted = true;
        arrays.push(array);
        fields.push(Field::new(format!("c{i}"), e.emitted.clone(), true));
    }
    Ok(DeviceRecordBatch::try_new(
        Arc::new(Schema::new(fields)),
        arrays,
        count,
        stream.record()?,
    )?)
}
