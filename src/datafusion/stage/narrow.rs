//! Narrowing a stage's groups before they leave its device: the groups a `HAVING` keeps, and of
//! those the candidates of an `ORDER BY ... LIMIT k` above the stage.
//!
//! Where one device holds every group, the state of `SUM`, `COUNT`, `MIN` and `MAX` is their final
//! value, so both run over the state batch where `stage_emit` wrote it: the `HAVING` predicate
//! through the scan's filter kernels, then a *top-k cut*. The cut finds the value of the
//! first sort key at rank `k` of the order by radix selection (`kernels/top.cu`: the bits every
//! key shares, then one 256-bin histogram per 8-bit digit below them) and keeps the rows whose
//! first key is at least as far up the order (nulls too where they sort first). Ties included,
//! those are a superset of any `k` first rows, so DataFusion's sort above, which stays, orders
//! them and keeps `k`: the answer is DataFusion's, and only the candidates cross to the host.
//! On the CPU device the same cut runs on the host with arrow-rs's sort.

use std::collections::BTreeSet;
use std::sync::Arc;

use ::datafusion::common::ScalarValue;
use ::datafusion::physical_expr::aggregate::AggregateFunctionExpr;
use arrow_array::{ArrayRef, RecordBatch};
use arrow_schema::{DataType, Field, Schema, SortOptions};

use super::super::device_filter::{selected, take};
use super::super::nvrtc::{BLOCK, cuda_stream, function, launch};
use super::super::predicate::{CmpOp, Predicate};
use crate::array::{DeviceArrayData, DeviceRecordBatch};
use crate::device::Stream;
use crate::error::{Error, Result};
use crate::memory::{DeviceBuffer, MemoryResource};

/// The radix selection kernels.
const TOP_KERNELS: &str = include_str!("../kernels/top.cu");

/// Blocks the selection kernels launch at most (each thread strides over the rows).
const MAX_GRID: u64 = 2048;

/// Which of a device's groups a stage emits.
#[derive(Clone, Debug, Default)]
pub(crate) struct Narrowing {
    /// A `HAVING` predicate over the state batch.
    pub(crate) having: Option<Predicate>,
    /// The top-k cut, after `having`.
    pub(crate) top: Option<Top>,
}

/// The first `k` rows of an order whose first sort key is state column `column` (column
/// `output` of the stage's output).
#[derive(Clone, Debug)]
pub(crate) struct Top {
    pub(crate) column: usize,
    pub(crate) output: usize,
    pub(crate) k: usize,
    pub(crate) options: SortOptions,
}

/// Where the first `k` rows of an order end, by their first sort key.
#[derive(Debug, PartialEq)]
enum Cut {
    /// At or past the last row: every row is a candidate.
    All,
    /// Among the nulls that sort first: only they are.
    Nulls,
    /// At a row with this value.
    At(ScalarValue),
}

/// Whether a top-k cut handles a first sort key of this type (signed integers of 4, 8 or 16
/// bytes: integers, dates, decimals).
pub(crate) fn top_key_supported(dt: &DataType) -> bool {
    key_width(dt).is_some()
}

fn key_width(dt: &DataType) -> Option<u64> {
    match dt {
        DataType::Int32 | DataType::Date32 => Some(4),
        DataType::Int64 | DataType::Date64 => Some(8),
        DataType::Decimal128(..) => Some(16),
        _ => None,
    }
}

/// For each column of an aggregate's output (its `keys` group columns, then one per aggregate),
/// the column of the state batch that holds its final value on a device that holds every group:
/// the group columns, and the one state column of `SUM`, `COUNT`, `MIN` and `MAX` where it has
/// the output's type.
pub(crate) fn state_columns(aggr: &[Arc<AggregateFunctionExpr>], keys: usize) -> Vec<Option<usize>> {
    let mut at = keys;
    let mut out: Vec<Option<usize>> = (0..keys).map(Some).collect();
    for a in aggr {
        let Ok(state) = a.state_fields() else {
            out.push(None);
            continue;
        };
        let kept = matches!(
            a.fun().name().to_ascii_lowercase().as_str(),
            "sum" | "count" | "min" | "max"
        ) && !a.is_distinct()
            && state.len() == 1
            && state[0].data_type() == a.field().data_type();
        out.push(kept.then_some(at));
        at += state.len();
    }
    out
}

impl Top {
    /// The rows of a batch that a cut keeps.
    fn predicate(&self, cut: Cut) -> Option<Predicate> {
        let col = self.column;
        let null = || Predicate::IsNull { col };
        match cut {
            Cut::All => None,
            Cut::Nulls => Some(null()),
            Cut::At(lit) => {
                let op = if self.options.descending {
                    CmpOp::GtEq
                } else {
                    CmpOp::LtEq
                };
                let reached = Predicate::Cmp { col, op, lit };
                Some(if self.options.nulls_first {
                    Predicate::Or(Box::new(null()), Box::new(reached))
                } else {
                    reached
                })
            }
        }
    }

    /// The cut of `column` (a host array), by arrow-rs's sort.
    fn cut_on_host(&self, column: &ArrayRef) -> Result<Cut> {
        if column.len() <= self.k {
            return Ok(Cut::All);
        }
        let first = arrow_ord::sort::sort_to_indices(column, Some(self.options), Some(self.k))?;
        let row = first.value(self.k - 1) as usize;
        Ok(match (column.is_null(row), self.options.nulls_first) {
            (true, true) => Cut::Nulls,
            (true, false) => Cut::All,
            (false, _) => {
                Cut::At(ScalarValue::try_from_array(column, row).map_err(|e| Error::InvalidData(e.to_string()))?)
            }
        })
    }

    /// The cut of `column` (an array on a CUDA device), by radix selection there.
    fn cut_on_device(&self, column: &DeviceArrayData, stream: &Stream) -> Result<Cut> {
        let dt = column.data_type();
        let width = key_width(dt).ok_or_else(|| Error::Unsupported(format!("a top-k cut of {dt}")))?;
        let n = column.len() as u64;
        if n <= self.k as u64 {
            return Ok(Cut::All);
        }
        let device = column.device();
        let (stream, cuda) = cuda_stream(stream, device, "a top-k cut")?;
        let ctx = cuda.context().clone();
        let resource = MemoryResource::default_for(device);
        let ascending = u64::from(!self.options.descending);
        let source = [
            column.buffers()[0].address(),
            width,
            column.nulls().map_or(0, DeviceBuffer::address),
            column.offset() as u64,
            n,
            ascending,
        ];
        let grid = n.div_ceil(u64::from(BLOCK)).min(MAX_GRID);
        // The bits every key shares, and the valid rows.
        let init: Vec<u8> = [u64::MAX, u64::MAX, 0, 0]
            .into_iter()
            .flat_map(u64::to_le_bytes)
            .collect();
        let bounds = DeviceBuffer::from_host(&init, resource, &stream)?;
        let f = function(&ctx, TOP_KERNELS, "top_bounds")?;
        let mut args = source.to_vec();
        args.push(bounds.address());
        launch(&cuda, &f, grid, BLOCK, &args)?;
        let mut words = [0u8; 32];
        bounds.copy_to_host(0, &mut words, &stream)?;
        let word = |i: usize| u128::from(u64::from_le_bytes(words[i * 8..i * 8 + 8].try_into().expect("8 bytes")));
        let (and, or) = ((word(0) << 64) | word(1), (word(2) << 64) | word(3));
        let nulls = column.null_count().map_or_else(|| count_nulls(column, &stream), Ok)? as u64;
        let k = self.k as u64;
        let valid = n - nulls;
        let mut rank = if self.options.nulls_first {
            if nulls >= k {
                return Ok(Cut::Nulls);
            }
            k - nulls
        } else if valid < k {
            return Ok(Cut::All);
        } else {
            k
        };
        // The key at `rank` among the valid rows, the largest first: the shared bits, then one
        // digit per histogram.
        let mut key = and;
        let differ = and ^ or;
        if differ != 0 {
            let f = function(&ctx, TOP_KERNELS, "top_histogram")?;
            let mut shift = (127 - differ.leading_zeros()) / 8 * 8;
            let mut mask = if shift + 8 == 128 { 0 } else { u128::MAX << (shift + 8) };
            key &= mask;
            loop {
                let hist = DeviceBuffer::zeroed(resource, 256 * 4, &stream)?;
                let mut args = source.to_vec();
                args.extend([(key >> 64) as u64, key as u64, (mask >> 64) as u64, mask as u64]);
                args.extend([u64::from(shift), hist.address()]);
                launch(&cuda, &f, grid, BLOCK, &args)?;
                let mut counts = [0u8; 256 * 4];
                hist.copy_to_host(0, &mut counts, &stream)?;
                // The digit whose rows hold the rank (the counts are exact; were they short, digit
                // 0 would keep more rows, never fewer).
                let mut digit = 0;
                for d in (0..256).rev() {
                    let c = u64::from(u32::from_le_bytes(
                        counts[d * 4..d * 4 + 4].try_into().expect("4 bytes"),
                    ));
                    if rank <= c {
                        digit = d;
                        break;
                    }
                    rank -= c;
                }
                key |= (digit as u128) << shift;
                mask |= 0xff << shift;
                if shift == 0 {
                    break;
                }
                shift -= 8;
            }
        }
        let value = ((if ascending == 1 { !key } else { key }) ^ (1 << 127)) as i128;
        Ok(Cut::At(scalar(dt, value)?))
    }
}

/// Nulls of a device array whose count is not recorded, counted from its validity bitmap.
fn count_nulls(column: &DeviceArrayData, stream: &Stream) -> Result<usize> {
    let Some(bits) = column.nulls() else {
        return Ok(0);
    };
    let bytes = bits.to_vec(stream)?;
    let buffer = arrow_buffer::Buffer::from(bytes);
    let valid = arrow_buffer::BooleanBuffer::new(buffer, column.offset(), column.len()).count_set_bits();
    Ok(column.len() - valid)
}

/// `value` as a scalar of `dt` (one of [`top_key_supported`]'s types).
fn scalar(dt: &DataType, value: i128) -> Result<ScalarValue> {
    Ok(match dt {
        DataType::Int32 => ScalarValue::Int32(Some(value as i32)),
        DataType::Date32 => ScalarValue::Date32(Some(value as i32)),
        DataType::Int64 => ScalarValue::Int64(Some(value as i64)),
        DataType::Date64 => ScalarValue::Date64(Some(value as i64)),
        DataType::Decimal128(p, s) => ScalarValue::Decimal128(Some(value), *p, *s),
        _ => return Err(Error::Unsupported(format!("a top-k cut of {dt}"))),
    })
}

/// The rows of `batch` (a state batch on the host) that `narrowing` keeps.
pub(crate) fn narrow_on_host(batch: RecordBatch, narrowing: &Narrowing) -> Result<RecordBatch> {
    let keep = |batch: RecordBatch, p: &Predicate| -> Result<RecordBatch> {
        let mask = p.evaluate(&batch, &|c| c)?;
        Ok(arrow_select::filter::filter_record_batch(&batch, &mask)?)
    };
    let mut batch = batch;
    if let Some(p) = &narrowing.having {
        batch = keep(batch, p)?;
    }
    if let Some(top) = &narrowing.top
        && let Some(p) = top.predicate(top.cut_on_host(batch.column(top.column))?)
    {
        batch = keep(batch, &p)?;
    }
    Ok(batch)
}

/// The rows of `batch` (state columns on a CUDA device) that `narrowing` keeps: `Some(None)` for
/// every row, `Some(Some((indices, count)))` for some (`u32` indices on the device), `None` for
/// none.
pub(crate) fn kept_on_device(
    batch: &DeviceRecordBatch,
    narrowing: &Narrowing,
    stream: &Stream,
) -> Result<Option<Option<(DeviceBuffer, usize)>>> {
    let mut batch = batch.clone();
    let mut kept: Option<(DeviceBuffer, usize)> = None;
    if let Some(p) = &narrowing.having {
        let Some((rows, m)) = selected(&batch, p, stream)? else {
            return Ok(None);
        };
        batch = take(&batch, &rows, m, stream)?;
        kept = Some((rows, m));
    }
    if let Some(top) = &narrowing.top
        && let Some(p) = top.predicate(top.cut_on_device(batch.column(top.column), stream)?)
    {
        let Some((rows, m)) = selected(&batch, &p, stream)? else {
            return Ok(None);
        };
        kept = Some(match kept {
            None => (rows, m),
            // Rows of the rows `having` kept.
            Some((first, n)) => {
                let schema = Arc::new(Schema::new(vec![Field::new("row", DataType::UInt32, false)]));
                let first = DeviceArrayData::try_new(DataType::UInt32, n, 0, Some(0), None, vec![first], vec![])?;
                let first = DeviceRecordBatch::try_new(schema, vec![first], n, stream.record()?)?;
                let rows = take(&first, &rows, m, stream)?.column(0).buffers()[0].clone();
                (rows, m)
            }
        });
    }
    Ok(Some(kept))
}

impl Narrowing {
    /// The state columns it reads, in order.
    pub(crate) fn columns(&self) -> Vec<usize> {
        let mut out = BTreeSet::new();
        if let Some(p) = &self.having {
            p.columns(&mut out);
        }
        out.extend(self.top.as_ref().map(|t| t.column));
        out.into_iter().collect()
    }

    /// The same narrowing over a batch of only the state columns `columns` (those it reads, in
    /// order).
    pub(crate) fn over(&self, columns: &[usize]) -> Narrowing {
        let at = |c: usize| columns.iter().position(|&x| x == c).unwrap_or(c);
        Narrowing {
            having: self.having.as_ref().map(|p| p.remapped(&at)),
            top: self.top.as_ref().map(|t| Top {
                column: at(t.column),
                ..t.clone()
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use arrow_array::{Array, Date32Array, Decimal128Array, Int32Array, Int64Array};

    use super::*;
    use crate::datafusion::cuda_as_cpp;

    /// A column of `n` values of `dt`, a tenth of them null (none with `nulls` false), drawn from
    /// `range` values around zero (ties when it is small) or from the whole type.
    fn column(dt: &DataType, n: usize, range: Option<i128>, nulls: bool, seed: u64) -> ArrayRef {
        let mut x = seed | 1;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let values: Vec<Option<i128>> = (0..n)
            .map(|_| {
                let r = next();
                let v = match range {
                    Some(m) => (r % (2 * m as u64)) as i128 - m,
                    None => ((u128::from(r) << 64) | u128::from(next())) as i128,
                };
                (!nulls || r % 10 != 0).then_some(v)
            })
            .collect();
        match dt {
            DataType::Int32 => Arc::new(Int32Array::from_iter(values.iter().map(|v| v.map(|v| v as i32)))),
            DataType::Date32 => Arc::new(Date32Array::from_iter(values.iter().map(|v| v.map(|v| v as i32)))),
            DataType::Int64 => Arc::new(Int64Array::from_iter(values.iter().map(|v| v.map(|v| v as i64)))),
            DataType::Decimal128(p, s) => Arc::new(
                Decimal128Array::from_iter(values.iter().copied())
                    .with_precision_and_scale(*p, *s)
                    .unwrap(),
            ),
            _ => unreachable!("a test column of {dt}"),
        }
    }

    use crate::device::cuda_for_tests as cuda;

    /// The radix selection on the device finds what arrow-rs's sort finds: every key type, both
    /// orders, nulls first and last (more nulls than the limit too), ties, whole-range values, a
    /// sliced column, limits of 1, in the middle, at and past the end.
    #[test]
    fn device_cuts_match_arrow_sorts() {
        let Some(device) = cuda() else {
            return;
        };
        let stream = Stream::new(device).unwrap();
        let types = [
            DataType::Int32,
            DataType::Date32,
            DataType::Int64,
            DataType::Decimal128(38, 2),
        ];
        let mut seed = 7;
        for dt in &types {
            for (n, range, nulls) in [
                (1000, Some(50), true),
                (1000, None, true),
                (200_000, Some(1_000_000), true),
                (200_000, None, false),
                (300, Some(3), true),
            ] {
                seed += 1;
                let host = column(dt, n, range, nulls, seed);
                for (sliced, host) in [(false, host.clone()), (true, host.slice(3, n - 10))] {
                    let on_device = crate::transfer::htod_array(host.as_ref(), device, &stream).unwrap();
                    let len = host.len();
                    for k in [1, 7, len / 3, len - 1, len, len + 5] {
                        for (descending, nulls_first) in [(true, true), (true, false), (false, true), (false, false)] {
                            let top = Top {
                                column: 0,
                                output: 0,
                                k,
                                options: SortOptions {
                                    descending,
                                    nulls_first,
                                },
                            };
                            let expected = top.cut_on_host(&host).unwrap();
                            let found = top.cut_on_device(&on_device, &stream).unwrap();
                            assert_eq!(
                                found, expected,
                                "{dt}, {len} rows (sliced {sliced}), range {range:?}, k {k}, {:?}",
                                top.options
                            );
                        }
                    }
                }
            }
        }
    }

    /// The kernels are valid C++ for a host compiler given a few CUDA declarations (a syntax check
    /// for machines without NVRTC; the GPU run compiles them for real).
    #[test]
    fn top_kernels_parse_as_cpp() {
        let Some(cxx) = cuda_as_cpp::compiler() else {
            eprintln!("skipped: no C++ compiler");
            return;
        };
        if let Err(e) = cuda_as_cpp::check_syntax(cxx, "top", TOP_KERNELS) {
            panic!("{e}");
        }
    }
}
