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
use arrow_array::{Array, ArrayRef, BooleanArray, RecordBatch, RecordBatchOptions, UInt32Array, new_empty_array};
use arrow_schema::{DataType, Schema};
use arrow_select::take::take_record_batch;

use super::layout::{Acc, Groups, JoinKind, JoinStep, SlotKind, StagePlan, Step, ordered_f64, string_capacity};
use super::{Outcome, StageResult};
use crate::array::DeviceRecordBatch;
use crate::device::Stream;
use crate::error::Error;

/// The host side of a stage over the batches of one device.
pub(crate) struct HostStage<'p> {
    plan: &'p StagePlan,
    steps: Vec<HostStep>,
    keys: Vec<Arc<dyn PhysicalExpr>>,
    /// A rows stage's output columns.
    rows: Vec<Arc<dyn PhysicalExpr>>,
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

/// A step of the row pipeline, over the batch the steps before it made.
enum HostStep {
    Filter(Arc<dyn PhysicalExpr>),
    Join(HostJoin),
}

/// A hash join's build side, hashed by its keys.
struct HostJoin {
    kind: JoinKind,
    probe: Vec<Arc<dyn PhysicalExpr>>,
    filter: Option<Arc<dyn PhysicalExpr>>,
    build: RecordBatch,
    /// The build rows of each key (rows with a null key never match).
    rows: HashMap<Vec<ScalarValue>, Vec<u32>>,
    /// Whether a build row's key is null (`NOT IN`'s null rule keeps no row then).
    null_key: bool,
}

impl HostJoin {
    fn new(
        j: &JoinStep,
        build: &RecordBatch,
        remap: impl Fn(&Arc<dyn PhysicalExpr>) -> StageResult<Arc<dyn PhysicalExpr>>,
    ) -> StageResult<Self> {
        let mut rows: HashMap<Vec<ScalarValue>, Vec<u32>> = HashMap::new();
        let mut null_key = false;
        'rows: for r in 0..build.num_rows() {
            let mut key = Vec::with_capacity(j.keys.len());
            for &k in &j.keys {
                let v = ScalarValue::try_from_array(build.column(k), r)?;
                if v.is_null() {
                    null_key = true;
                    continue 'rows;
                }
                key.push(v);
            }
            rows.entry(key).or_default().push(r as u32);
        }
        if j.kind.needs_unique_keys() && rows.values().any(|r| r.len() > 1) {
            return Err(Outcome::GiveBack("a join's build side has duplicate keys".into()));
        }
        Ok(HostJoin {
            kind: j.kind,
            probe: j.probe.iter().map(&remap).collect::<StageResult<_>>()?,
            filter: j.filter.as_ref().map(&remap).transpose()?,
            build: build.clone(),
            rows,
            null_key,
        })
    }

    /// The rows of `work` this join keeps, each with its match's build columns (nulls without
    /// one) after its own.
    fn apply(&self, work: &RecordBatch) -> StageResult<RecordBatch> {
        let n = work.num_rows();
        let keys = self
            .probe
            .iter()
            .map(|p| p.evaluate(work)?.into_array(n))
            .collect::<Result<Vec<_>, _>>()?;
        let mut candidates = vec![Vec::new(); n];
        let mut null_probe = vec![false; n];
        for (r, found) in candidates.iter_mut().enumerate() {
            let key = keys
                .iter()
                .map(|k| ScalarValue::try_from_array(k, r))
                .collect::<Result<Vec<_>, _>>()?;
            if key.iter().any(ScalarValue::is_null) {
                null_probe[r] = true;
                continue;
            }
            if let Some(rows) = self.rows.get(&key) {
                found.clone_from(rows);
            }
        }
        let matches: Vec<Option<u32>> = match &self.filter {
            None => candidates.iter().map(|c| c.first().copied()).collect(),
            Some(f) => {
                let pairs: Vec<(u32, u32)> = candidates
                    .iter()
                    .enumerate()
                    .flat_map(|(r, c)| c.iter().map(move |&b| (r as u32, b)))
                    .collect();
                let left = UInt32Array::from_iter_values(pairs.iter().map(|p| p.0));
                let right = UInt32Array::from_iter_values(pairs.iter().map(|p| p.1));
                let both = joined(&take_record_batch(work, &left)?, &self.build, &right)?;
                let ok = truth(&f.evaluate(&both)?.into_array(pairs.len())?)?;
                let mut out = vec![None; n];
                for (&(r, b), ok) in pairs.iter().zip(ok) {
                    if ok && out[r as usize].is_none() {
                        out[r as usize] = Some(b);
                    }
                }
                out
            }
        };
        let empty = self.build.num_rows() == 0;
        let keep: Vec<bool> = matches
            .iter()
            .zip(&null_probe)
            .map(|(m, &null)| match self.kind {
                JoinKind::Inner | JoinKind::Semi => m.is_some(),
                JoinKind::Anti => m.is_none(),
                JoinKind::NullAwareAnti => !self.null_key && m.is_none() && (!null || empty),
                JoinKind::Right => true,
            })
            .collect();
        let at: UInt32Array = matches
            .iter()
            .zip(&keep)
            .filter(|(_, k)| **k)
            .map(|(m, _)| *m)
            .collect();
        let kept = arrow_select::filter::filter_record_batch(work, &BooleanArray::from(keep))?;
        joined(&kept, &self.build, &at)
    }
}

/// The columns of `a`, then those of `b` at rows `at` (one per row of `a`; nullable: an outer
/// join's rows without a match hold nulls there).
fn joined(a: &RecordBatch, b: &RecordBatch, at: &UInt32Array) -> StageResult<RecordBatch> {
    let (sa, sb) = (a.schema(), b.schema());
    let nullable = sb
        .fields()
        .iter()
        .map(|f| Arc::new(f.as_ref().clone().with_nullable(true)));
    let fields: Vec<_> = sa.fields().iter().cloned().chain(nullable).collect();
    let taken = b
        .columns()
        .iter()
        .map(|c| arrow_select::take::take(c, at, None))
        .collect::<Result<Vec<_>, _>>()?;
    let columns: Vec<ArrayRef> = a.columns().iter().cloned().chain(taken).collect();
    let options = RecordBatchOptions::new().with_row_count(Some(a.num_rows()));
    Ok(RecordBatch::try_new_with_options(
        Arc::new(Schema::new(fields)),
        columns,
        &options,
    )?)
}

/// `expr` over the batch the host stage works on: the table columns the stage reads (`columns`,
/// ascending table indices, of a table of `width` columns), then the joins' build columns.
fn remap(expr: &Arc<dyn PhysicalExpr>, columns: &[usize], width: usize) -> StageResult<Arc<dyn PhysicalExpr>> {
    let out = Arc::clone(expr).transform(|e| {
        Ok(match e.downcast_ref::<Column>() {
            Some(c) => {
                let at = if c.index() < width {
                    columns.binary_search(&c.index()).unwrap_or(0)
                } else {
                    columns.len() + c.index() - width
                };
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
    /// A stage of `plan` whose joins' build sides hold `builds`' rows.
    pub(crate) fn new(plan: &'p StagePlan, builds: &[RecordBatch]) -> StageResult<Self> {
        let width = plan.table.schema.fields().len();
        let remap = |e: &Arc<dyn PhysicalExpr>| remap(e, &plan.columns, width);
        let (slots, first) = plan.slot_layout();
        let (offsets, nw) = plan.key_layout();
        let mut builds = builds.iter();
        let steps = plan
            .steps
            .iter()
            .map(|s| match s {
                Step::Filter(f) => Ok(HostStep::Filter(remap(f)?)),
                Step::Join(j) => {
                    let build = builds.next().ok_or_else(|| {
                        Outcome::Fail(Error::InvalidData("a join without its build side".into()).into())
                    })?;
                    Ok(HostStep::Join(HostJoin::new(j, build, remap)?))
                }
            })
            .collect::<StageResult<_>>()?;
        Ok(HostStage {
            steps,
            keys: plan.keys.iter().map(remap).collect::<StageResult<_>>()?,
            rows: plan.rows.iter().flatten().map(remap).collect::<StageResult<_>>()?,
            args: plan.aggs.iter().map(|a| remap(&a.arg)).collect::<StageResult<_>>()?,
            agg_filters: plan
                .aggs
                .iter()
                .map(|a| a.filter.as_ref().map(remap).transpose())
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

    /// The rows of `batch` (on host-accessible memory) that the row pipeline keeps: the table
    /// columns the stage reads, then the joins' build columns.
    fn kept(&self, batch: &DeviceRecordBatch, stream: &Stream) -> StageResult<RecordBatch> {
        let plan = self.plan;
        let mut kept = crate::transfer::dtoh(&batch.project(&plan.columns)?, stream)?;
        if let Some(p) = &plan.predicate {
            let position = |c: usize| plan.columns.binary_search(&c).unwrap_or(0);
            let mask = p.evaluate(&kept, &position)?;
            let keep: BooleanArray = mask.iter().map(|v| Some(v == Some(true))).collect();
            kept = arrow_select::filter::filter_record_batch(&kept, &keep)?;
        }
        for step in &self.steps {
            kept = match step {
                HostStep::Filter(f) => {
                    let t = truth(&f.evaluate(&kept)?.into_array(kept.num_rows())?)?;
                    arrow_select::filter::filter_record_batch(&kept, &BooleanArray::from(t))?
                }
                HostStep::Join(j) => j.apply(&kept)?,
            };
        }
        Ok(kept)
    }

    /// A rows stage's output for the rows of `batch` that its pipeline keeps; `None` when it
    /// keeps none.
    pub(crate) fn rows(&self, batch: &DeviceRecordBatch, stream: &Stream) -> StageResult<Option<RecordBatch>> {
        let kept = self.kept(batch, stream)?;
        let m = kept.num_rows();
        if m == 0 {
            return Ok(None);
        }
        let columns = self
            .rows
            .iter()
            .map(|e| e.evaluate(&kept)?.into_array(m))
            .collect::<Result<Vec<_>, _>>()?;
        let options = RecordBatchOptions::new().with_row_count(Some(m));
        Ok(Some(RecordBatch::try_new_with_options(
            self.plan.schema.clone(),
            columns,
            &options,
        )?))
    }

    /// Adds the rows of `batch` (on host-accessible memory).
    pub(crate) fn add(&mut self, batch: &DeviceRecordBatch, stream: &Stream) -> StageResult<()> {
        let plan = self.plan;
        let kept = self.kept(batch, stream)?;
        let groups = self.groups_of(&kept)?;
        if self.nw == 0 && self.index.is_empty() {
            self.group(&[]);
        }
        let m = kept.num_rows();
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
