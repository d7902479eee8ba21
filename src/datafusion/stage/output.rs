//! A stage's output: the [`Groups`] of a stage on the host as a batch of DataFusion's partial
//! aggregate state (the group columns, then each aggregate's state fields as
//! `AggregateFunctionExpr::state_fields` declares them; a stage on a CUDA device makes the same
//! batch on the device, `emit.rs`), which DataFusion's `Final` aggregate merges, or which
//! [`final_batch`] turns into the final rows with DataFusion's own accumulators.

use std::sync::Arc;

use ::datafusion::arrow::compute::cast;
use ::datafusion::logical_expr::EmitTo;
use ::datafusion::physical_expr::aggregate::AggregateFunctionExpr;
use ::datafusion::physical_plan::aggregates::group_values::new_group_values;
use ::datafusion::physical_plan::aggregates::order::GroupOrdering;
use arrow_array::builder::{
    BooleanBuilder, Date32Builder, Date64Builder, Decimal128Builder, Float64Builder, Int8Builder, Int16Builder,
    Int32Builder, Int64Builder, LargeStringBuilder, StringBuilder, StringViewBuilder, UInt8Builder, UInt16Builder,
    UInt32Builder, UInt64Builder,
};
use arrow_array::{ArrayRef, Float32Array, Float64Array, RecordBatch, RecordBatchOptions};
use arrow_schema::{DataType, Schema, SchemaRef};

use super::super::error::DfResult;

use super::layout::{Acc, AggKind, Groups, StagePlan, key_value_type, ordered_f64, string_capacity};
use crate::error::{Error, Result};

/// An integer column of `dt` from `values` (`None` is null).
fn int_column(dt: &DataType, values: impl Iterator<Item = Option<i128>>) -> Result<ArrayRef> {
    macro_rules! build {
        ($b:ty, $t:ty) => {{
            let mut b = <$b>::new();
            for v in values {
                b.append_option(v.map(|v| v as $t));
            }
            Arc::new(b.finish()) as ArrayRef
        }};
    }
    Ok(match dt {
        DataType::Int8 => build!(Int8Builder, i8),
        DataType::Int16 => build!(Int16Builder, i16),
        DataType::Int32 => build!(Int32Builder, i32),
        DataType::Int64 => build!(Int64Builder, i64),
        DataType::UInt8 => build!(UInt8Builder, u8),
        DataType::UInt16 => build!(UInt16Builder, u16),
        DataType::UInt32 => build!(UInt32Builder, u32),
        DataType::UInt64 => build!(UInt64Builder, u64),
        DataType::Date32 => build!(Date32Builder, i32),
        DataType::Date64 => build!(Date64Builder, i64),
        DataType::Boolean => {
            let mut b = BooleanBuilder::new();
            for v in values {
                b.append_option(v.map(|v| v != 0));
            }
            Arc::new(b.finish())
        }
        DataType::Decimal128(p, s) => {
            let mut b = Decimal128Builder::new();
            for v in values {
                b.append_option(v);
            }
            Arc::new(b.finish().with_precision_and_scale(*p, *s)?)
        }
        other => return Err(Error::Unsupported(format!("a stage output column of {other}"))),
    })
}

/// Whether a stage can produce a state field of this type for this accumulator.
pub(crate) fn state_type_supported(acc: Acc, field: usize, dt: &DataType) -> bool {
    match (acc, field) {
        (Acc::MinRow | Acc::MaxRow, _) => matches!(
            dt,
            DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View | DataType::Decimal128(..)
        ),
        (_, 0) if matches!(dt, DataType::Int64 | DataType::UInt64) => true,
        (Acc::Float, _) => *dt == DataType::Float64,
        (Acc::MinF64 | Acc::MaxF64, _) => matches!(dt, DataType::Float32 | DataType::Float64),
        _ => matches!(
            dt,
            DataType::Int8
                | DataType::Int16
                | DataType::Int32
                | DataType::Int64
                | DataType::UInt8
                | DataType::UInt16
                | DataType::UInt32
                | DataType::UInt64
                | DataType::Date32
                | DataType::Date64
                | DataType::Decimal128(..)
        ),
    }
}

/// Key `j` of every group, a string in the `words` words at `at` (see `layout::key_words`).
fn key_strings(groups: &Groups, nw: usize, at: usize, words: usize, j: usize) -> Vec<Option<Vec<u8>>> {
    (0..groups.count)
        .map(|g| {
            let w = &groups.keys[g * nw..(g + 1) * nw];
            if w[nw - 1] >> j & 1 == 1 {
                return None;
            }
            let len = (w[at + words - 1] >> 56) as usize;
            let mut bytes: Vec<u8> = w[at..at + words].iter().flat_map(|x| x.to_le_bytes()).collect();
            bytes.truncate(len.min(string_capacity(words)));
            Some(bytes)
        })
        .collect()
}

fn string_column(dt: &DataType, values: Vec<Option<Vec<u8>>>) -> Result<ArrayRef> {
    let strings = values
        .into_iter()
        .map(|v| v.map(String::from_utf8).transpose())
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| Error::InvalidData(format!("a group key that is not UTF-8: {e}")))?;
    Ok(match dt {
        DataType::Utf8 => {
            let mut b = StringBuilder::new();
            strings.iter().for_each(|s| b.append_option(s.as_deref()));
            Arc::new(b.finish())
        }
        DataType::LargeUtf8 => {
            let mut b = LargeStringBuilder::new();
            strings.iter().for_each(|s| b.append_option(s.as_deref()));
            Arc::new(b.finish())
        }
        _ => {
            let mut b = StringViewBuilder::new();
            strings.iter().for_each(|s| b.append_option(s.as_deref()));
            Arc::new(b.finish())
        }
    })
}

/// The 128-bit wrapping sum held in slots `s..s + 3` of group `g`.
fn sum128(groups: &Groups, s: usize, g: usize) -> i128 {
    let n = groups.count;
    let p0 = groups.acc[s * n + g] as u128;
    let p1 = groups.acc[(s + 1) * n + g] as u128;
    let p2 = groups.acc[(s + 2) * n + g] as u128;
    p0.wrapping_add(p1 << 32).wrapping_add(p2 << 64) as i128
}

/// The partial state batch of `groups`.
pub(crate) fn state_batch(plan: &StagePlan, groups: &Groups) -> Result<RecordBatch> {
    let (offsets, nw) = plan.key_layout();
    let (_, first) = plan.slot_layout();
    let n = groups.count;
    let mut columns: Vec<ArrayRef> = Vec::with_capacity(plan.schema.fields().len());
    for (j, key_type) in plan.key_types.iter().enumerate() {
        let at = offsets[j];
        let dt = key_value_type(key_type);
        let column = match dt {
            DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View => {
                string_column(dt, key_strings(groups, nw, at, plan.key_words[j], j))?
            }
            _ => {
                let values = (0..n).map(|g| {
                    let w = &groups.keys[g * nw..(g + 1) * nw];
                    let null = w[nw - 1] >> j & 1 == 1;
                    let v = match dt {
                        DataType::Decimal128(..) => (w[at] as u128 | (w[at + 1] as u128) << 64) as i128,
                        _ => w[at] as i64 as i128,
                    };
                    (!null).then_some(v)
                });
                int_column(dt, values)?
            }
        };
        let column = if dt == key_type {
            column
        } else {
            cast(&column, key_type)?
        };
        columns.push(column);
    }
    for (a, spec) in plan.aggs.iter().enumerate() {
        let s = first[a];
        let count = |g: usize| groups.acc[s * n + g];
        for (f, field) in spec.state.iter().enumerate() {
            let dt = field.data_type();
            // COUNT's state and AVG's first state field are the count; everything else the value,
            // null for a group without a non-null argument.
            // (AVG's count is null too without a value, as DataFusion's partial AVG emits it.)
            let column = if spec.kind == AggKind::Count {
                int_column(dt, (0..n).map(|g| Some(count(g) as i128)))?
            } else if spec.kind == AggKind::Avg && f == 0 {
                int_column(dt, (0..n).map(|g| (count(g) > 0).then_some(count(g) as i128)))?
            } else {
                match spec.acc {
                    Acc::Float => {
                        let mut b = Float64Builder::new();
                        for g in 0..n {
                            let v = f64::from_bits(groups.acc[(s + 1) * n + g]);
                            b.append_option((count(g) > 0).then_some(v));
                        }
                        Arc::new(b.finish()) as ArrayRef
                    }
                    Acc::Int128 => {
                        let wrap64 = matches!(dt, DataType::Int64 | DataType::UInt64);
                        int_column(
                            dt,
                            (0..n).map(|g| {
                                let v = sum128(groups, s + 1, g);
                                // Integer sums wrap at 64 bits, as DataFusion's do.
                                let v = if wrap64 { v as i64 as i128 } else { v };
                                (count(g) > 0).then_some(v)
                            }),
                        )?
                    }
                    Acc::MinF64 | Acc::MaxF64 => {
                        let value = |g: usize| f64::from_bits(ordered_f64(groups.acc[(s + 1) * n + g]) as u64);
                        let valid = (0..n).map(|g| (count(g) > 0).then(|| value(g)));
                        if *dt == DataType::Float32 {
                            Arc::new(valid.map(|v| v.map(|v| v as f32)).collect::<Float32Array>()) as ArrayRef
                        } else {
                            Arc::new(valid.collect::<Float64Array>())
                        }
                    }
                    Acc::MinI64 | Acc::MaxI64 => int_column(
                        dt,
                        (0..n).map(|g| (count(g) > 0).then_some(groups.acc[(s + 1) * n + g] as i64 as i128)),
                    )?,
                    Acc::MinRow | Acc::MaxRow => {
                        let values = groups
                            .extremes
                            .get(a)
                            .cloned()
                            .flatten()
                            .ok_or_else(|| Error::InvalidData(format!("no values of {}", spec.name)))?;
                        if values.data_type() == dt {
                            values
                        } else {
                            cast(&values, dt)?
                        }
                    }
                    Acc::Count => return Err(Error::InvalidData("a COUNT with a value state".into())),
                }
            };
            columns.push(column);
        }
    }
    let options = RecordBatchOptions::new().with_row_count(Some(n));
    Ok(RecordBatch::try_new_with_options(
        plan.schema.clone(),
        columns,
        &options,
    )?)
}

/// The final rows (`schema`: the `keys` group columns, then one value per aggregate) of partial
/// state batches, merged as DataFusion's `Final` aggregate merges them: the keys interned by
/// DataFusion's group values (a single batch's are a device's groups, each once, and need no
/// interning), each aggregate's state merged and evaluated by its own groups accumulator, so
/// results are DataFusion's to the bit.
pub(crate) fn final_batch(
    aggr: &[Arc<AggregateFunctionExpr>],
    keys: usize,
    schema: &SchemaRef,
    states: &[RecordBatch],
) -> DfResult<RecordBatch> {
    let mut indices = Vec::with_capacity(states.len());
    let (groups, mut columns) = if keys == 0 {
        indices.extend(states.iter().map(|b| vec![0; b.num_rows()]));
        (1, vec![])
    } else if let [state] = states {
        indices.push((0..state.num_rows()).collect());
        (state.num_rows(), state.columns()[..keys].to_vec())
    } else {
        let key_schema = Arc::new(Schema::new(schema.fields()[..keys].to_vec()));
        let mut values = new_group_values(key_schema, &GroupOrdering::None)?;
        for b in states {
            let mut g = Vec::with_capacity(b.num_rows());
            values.intern(&b.columns()[..keys], &mut g)?;
            indices.push(g);
        }
        (values.len(), values.emit(EmitTo::All)?)
    };
    let mut at = keys;
    for a in aggr {
        let width = a.state_fields()?.len();
        let mut acc = a.create_groups_accumulator()?;
        for (b, g) in states.iter().zip(&indices) {
            acc.merge_batch(&b.columns()[at..at + width], g, groups)?;
        }
        columns.push(acc.evaluate(EmitTo::All)?);
        at += width;
    }
    let options = RecordBatchOptions::new().with_row_count(Some(groups));
    Ok(RecordBatch::try_new_with_options(schema.clone(), columns, &options)?)
}
