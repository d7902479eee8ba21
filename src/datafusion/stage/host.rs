//! The host implementation of a stage, for tables on host-accessible memory: the expressions are
//! DataFusion's own (`PhysicalExpr::evaluate`, arrow-rs compute kernels), and the groups and
//! accumulators are filled in the same layout as the device kernels fill them, so the plan
//! rewrite, the key encoding and the partial state are proven in CI without a GPU.

use std::cmp::Ordering;
use std::collections::HashMap;
use std::sync::Arc;

use ::datafusion::arrow::compute::cast;
use ::datafusion::common::ScalarValue;
use ::datafusion::common::tree_node::{Transformed, TreeNode};
use ::datafusion::physical_expr::PhysicalExpr;
use ::datafusion::physical_expr::expressions::Column;
use arrow_array::cast::AsArray;
use arrow_array::types::{
    Date32Type, Date64Type, Decimal128Type, Float32Type, Float64Type, Int8Type, Int16Type, Int32Type, Int64Type,
    UInt8Type, UInt16Type, UInt32Type,
};
use arrow_array::{Array, ArrayRef, BooleanArray, RecordBatch, new_empty_array};
use arrow_schema::DataType;

use super::layout::{Acc, Groups, SlotKind, StagePlan, ordered_f64, string_capacity};
use super::{Outcome, StageResult};
use crate::array::DeviceRecordBatch;
use crate::device::Stream;
use crate::error::Error;

/// The host side of a stage over the batches of one device.
pub(crate) struct HostStage<'p> {
    plan: &'p StagePlan,
    filters: Vec<Arc<dyn PhysicalExpr>>,
    keys: Vec<Arc<dyn PhysicalExpr>>,
    args: Vec<Arc<dyn PhysicalExpr>>,
    agg_filters: Vec<Option<Arc<dyn PhysicalExpr>>>,
    slots: Vec<SlotKind>,
    first: Vec<usize>,
    nw: usize,
    offsets: Vec<usize>,
    index: HashMap<Vec<u64>, usize>,
    keys_out: Vec<u64>,
    /// Per slot, per group.
    acc: Vec<Vec<u64>>,
    /// Per aggregate, per group: the extreme value of a row-reference aggregate (empty for
    /// other aggregates).
    extremes: Vec<Vec<Option<ScalarValue>>>,
}

/// `expr` over the columns `columns` (ascending table indices) instead of the whole table.
fn remap(expr: &Arc<dyn PhysicalExpr>, columns: &[usize]) -> StageResult<Arc<dyn PhysicalExpr>> {
    let out = Arc::clone(expr).transform(|e| {
        Ok(match e.downcast_ref::<Column>() {
            Some(c) => {
                let at = columns.binary_search(&c.index()).unwrap_or(0);
                Transformed::yes(Arc::new(Column::new(c.name(), at)) as Arc<dyn PhysicalExpr>)
            }
            None => Transformed::no(e),
        })
    })?;
    Ok(out.data)
}

/// Integer (and decimal) values of an array as `i128`.
fn ints(a: &ArrayRef) -> StageResult<Vec<Option<i128>>> {
    macro_rules! prim {
        ($t:ty) => {
            a.as_primitive::<$t>()
                .iter()
                .map(|v| v.map(|v| v as i128))
                .collect()
        };
    }
    Ok(match a.data_type() {
        DataType::Int8 => prim!(Int8Type),
        DataType::Int16 => prim!(Int16Type),
        DataType::Int32 => prim!(Int32Type),
        DataType::Int64 => prim!(Int64Type),
        DataType::UInt8 => prim!(UInt8Type),
        DataType::UInt16 => prim!(UInt16Type),
        DataType::UInt32 => prim!(UInt32Type),
        DataType::Date32 => prim!(Date32Type),
        DataType::Date64 => prim!(Date64Type),
        DataType::Decimal128(..) => a.as_primitive::<Decimal128Type>().iter().collect(),
        DataType::Boolean => a.as_boolean().iter().map(|v| v.map(i128::from)).collect(),
        other => {
            return Err(Outcome::Fail(
                Error::Unsupported(format!("host stage values of {other}")).into(),
            ));
        }
    })
}

fn floats(a: &ArrayRef) -> StageResult<Vec<Option<f64>>> {
    Ok(match a.data_type() {
        DataType::Float32 => a
            .as_primitive::<Float32Type>()
            .iter()
            .map(|v| v.map(f64::from))
            .collect(),
        DataType::Float64 => a.as_primitive::<Float64Type>().iter().collect(),
        _ => ints(a)?.into_iter().map(|v| v.map(|v| v as f64)).collect(),
    })
}

fn strings(a: &ArrayRef) -> Vec<Option<&[u8]>> {
    match a.data_type() {
        DataType::Utf8 => a.as_string::<i32>().iter().map(|s| s.map(str::as_bytes)).collect(),
        DataType::LargeUtf8 => a.as_string::<i64>().iter().map(|s| s.map(str::as_bytes)).collect(),
        _ => a.as_string_view().iter().map(|s| s.map(str::as_bytes)).collect(),
    }
}

/// A boolean result as a selection: only true is kept.
fn truth(a: &ArrayRef) -> StageResult<Vec<bool>> {
    let b: &BooleanArray = a
        .as_boolean_opt()
        .ok_or_else(|| Outcome::Fail(Error::InvalidData("a filter that is not boolean".into()).into()))?;
    Ok(b.iter().map(|v| v == Some(true)).collect())
}

impl<'p> HostStage<'p> {
    pub(crate) fn new(plan: &'p StagePlan) -> StageResult<Self> {
        let cols = &plan.columns;
        let (slots, first) = plan.slot_layout();
        let (offsets, nw) = plan.key_layout();
        Ok(HostStage {
            filters: plan
                .filters
                .iter()
                .map(|f| remap(f, cols))
                .collect::<StageResult<_>>()?,
            keys: plan.keys.iter().map(|k| remap(k, cols)).collect::<StageResult<_>>()?,
            args: plan
                .aggs
                .iter()
                .map(|a| remap(&a.arg, cols))
                .collect::<StageResult<_>>()?,
            agg_filters: plan
                .aggs
                .iter()
                .map(|a| a.filter.as_ref().map(|f| remap(f, cols)).transpose())
                .collect::<StageResult<_>>()?,
            acc: vec![Vec::new(); slots.len()],
            extremes: vec![Vec::new(); plan.aggs.len()],
            slots,
            first,
            nw,
            offsets,
            index: HashMap::new(),
            keys_out: Vec::new(),
            plan,
        })
    }

    /// The group of a key, added when new.
    fn group(&mut self, words: &[u64]) -> usize {
        if let Some(&g) = self.index.get(words) {
            return g;
        }
        let g = self.index.len();
        self.index.insert(words.to_vec(), g);
        self.keys_out.extend_from_slice(words);
        for (s, kind) in self.slots.iter().enumerate() {
            self.acc[s].push(kind.init());
        }
        for (a, spec) in self.plan.aggs.iter().enumerate() {
            if spec.row_column().is_some() {
                self.extremes[a].push(None);
            }
        }
        g
    }

    /// Adds the rows of `batch` (on host-accessible memory).
    pub(crate) fn add(&mut self, batch: &DeviceRecordBatch, stream: &Stream) -> StageResult<()> {
        let plan = self.plan;
        let host = crate::transfer::dtoh(&batch.project(&plan.columns)?, stream)?;
        let n = host.num_rows();
        let mut keep = vec![true; n];
        if let Some(p) = &plan.predicate {
            let position = |c: usize| plan.columns.binary_search(&c).unwrap_or(0);
            let mask = p.evaluate(&host, &position)?;
            for (i, v) in mask.iter().enumerate() {
                keep[i] &= v == Some(true);
            }
        }
        for f in &self.filters {
            let t = truth(&f.evaluate(&host)?.into_array(n)?)?;
            keep.iter_mut().zip(t).for_each(|(k, t)| *k &= t);
        }
        let rows: Vec<usize> = (0..n).filter(|&i| keep[i]).collect();
        let kept = arrow_select::filter::filter_record_batch(&host, &BooleanArray::from(keep))?;
        let groups = self.groups_of(&kept)?;
        if self.nw == 0 && self.index.is_empty() {
            self.group(&[]);
        }
        let m = rows.len();
        for (a, spec) in plan.aggs.iter().enumerate() {
            let s = self.first[a];
            let fk = match &self.agg_filters[a] {
                Some(f) => truth(&f.evaluate(&kept)?.into_array(m)?)?,
                None => vec![true; m],
            };
            let arg = self.args[a].evaluate(&kept)?.into_array(m)?;
            // Logical nulls: a dictionary's null values too.
            let nulls = arg.logical_nulls();
            let valid = |r: usize| fk[r] && nulls.as_ref().is_none_or(|n| n.is_valid(r));
            match spec.acc {
                Acc::MinRow | Acc::MaxRow => {
                    for r in (0..m).filter(|&r| valid(r)) {
                        let g = groups[r];
                        self.acc[s][g] += 1;
                        let x = ScalarValue::try_from_array(&arg, r)?;
                        let best = &mut self.extremes[a][g];
                        let replace = best.as_ref().is_none_or(|b| {
                            let order = x.partial_cmp(b);
                            if spec.acc == Acc::MinRow {
                                order == Some(Ordering::Less)
                            } else {
                                order == Some(Ordering::Greater)
                            }
                        });
                        if replace {
                            *best = Some(x);
                        }
                    }
                }
                Acc::Count => {
                    for r in (0..m).filter(|&r| valid(r)) {
                        self.acc[s][groups[r]] += 1;
                    }
                }
                Acc::Int128 => {
                    let v = ints(&arg)?;
                    for r in (0..m).filter(|&r| valid(r)) {
                        let (g, x) = (groups[r], v[r].unwrap_or(0) as u128);
                        self.acc[s][g] += 1;
                        self.acc[s + 1][g] = self.acc[s + 1][g].wrapping_add(x as u64 & 0xffff_ffff);
                        self.acc[s + 2][g] = self.acc[s + 2][g].wrapping_add((x as u64) >> 32);
                        self.acc[s + 3][g] = self.acc[s + 3][g].wrapping_add((x >> 64) as u64);
                    }
                }
                Acc::Float => {
                    let v = floats(&arg)?;
                    for r in (0..m).filter(|&r| valid(r)) {
                        let g = groups[r];
                        self.acc[s][g] += 1;
                        let sum = f64::from_bits(self.acc[s + 1][g]) + v[r].unwrap_or(0.0);
                        self.acc[s + 1][g] = sum.to_bits();
                    }
                }
                Acc::MinI64 | Acc::MaxI64 | Acc::MinF64 | Acc::MaxF64 => {
                    let v: Vec<Option<i64>> = if matches!(spec.acc, Acc::MinF64 | Acc::MaxF64) {
                        floats(&arg)?
                            .into_iter()
                            .map(|v| v.map(|v| ordered_f64(v.to_bits())))
                            .collect()
                    } else {
                        ints(&arg)?.into_iter().map(|v| v.map(|v| v as i64)).collect()
                    };
                    for r in (0..m).filter(|&r| valid(r)) {
                        let g = groups[r];
                        self.acc[s][g] += 1;
                        let (x, old) = (v[r].unwrap_or(0), self.acc[s + 1][g] as i64);
                        let new = if matches!(spec.acc, Acc::MinI64 | Acc::MinF64) {
                            old.min(x)
                        } else {
                            old.max(x)
                        };
                        self.acc[s + 1][g] = new as u64;
                    }
                }
            }
        }
        Ok(())
    }

    /// The group of every kept row.
    fn groups_of(&mut self, kept: &RecordBatch) -> StageResult<Vec<usize>> {
        let m = kept.num_rows();
        if self.nw == 0 {
            if self.index.is_empty() {
                self.group(&[]);
            }
            return Ok(vec![0; m]);
        }
        let mut words = vec![0u64; m * self.nw];
        let nw = self.nw;
        for (j, key) in self.keys.iter().enumerate() {
            let a = key.evaluate(kept)?.into_array(m)?;
            // A dictionary's keys group by their values.
            let a = match a.data_type() {
                DataType::Dictionary(_, v) => cast(&a, v)?,
                _ => a,
            };
            let at = self.offsets[j];
            for r in 0..m {
                if a.is_null(r) {
                    words[r * nw + nw - 1] |= 1 << j;
                }
            }
            match a.data_type() {
                DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View => {
                    for (r, s) in strings(&a).into_iter().enumerate() {
                        let Some(s) = s else { continue };
                        let width = self.plan.key_words[j];
                        let capacity = string_capacity(width);
                        if s.len() > capacity {
                            return Err(Outcome::GiveBack(format!(
                                "a group key string of {} bytes (its key words hold {capacity})",
                                s.len()
                            )));
                        }
                        let mut bytes = vec![0u8; width * 8];
                        bytes[..s.len()].copy_from_slice(s);
                        bytes[width * 8 - 1] = s.len() as u8;
                        for (w, b) in bytes.chunks_exact(8).enumerate() {
                            words[r * nw + at + w] = u64::from_le_bytes(b.try_into().expect("8 bytes"));
                        }
                    }
                }
                DataType::Decimal128(..) => {
                    for (r, v) in ints(&a)?.into_iter().enumerate() {
                        let v = v.unwrap_or(0) as u128;
                        words[r * nw + at] = v as u64;
                        words[r * nw + at + 1] = (v >> 64) as u64;
                    }
                }
                _ => {
                    for (r, v) in ints(&a)?.into_iter().enumerate() {
                        words[r * nw + at] = v.unwrap_or(0) as i64 as u64;
                    }
                }
            }
        }
        Ok((0..m).map(|r| self.group(&words[r * nw..(r + 1) * nw])).collect())
    }

    /// What was accumulated.
    pub(crate) fn finish(self) -> StageResult<Groups> {
        let count = self.index.len();
        let extremes = self
            .plan
            .aggs
            .iter()
            .zip(self.extremes)
            .map(|(spec, values)| {
                let Some(c) = spec.row_column() else {
                    return Ok(None);
                };
                let dt = self.plan.table.schema.field(c).data_type();
                if values.is_empty() {
                    return Ok(Some(new_empty_array(dt)));
                }
                let null = ScalarValue::try_from(dt)?;
                let values = values.into_iter().map(|v| v.unwrap_or_else(|| null.clone()));
                Ok(Some(ScalarValue::iter_to_array(values)?))
            })
            .collect::<StageResult<_>>()?;
        Ok(Groups {
            count,
            keys: self.keys_out,
            acc: self.acc.into_iter().flatten().collect(),
            extremes,
        })
    }
}
