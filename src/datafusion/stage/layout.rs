//! What a stage computes, lowered from the plan, and how its groups are laid out in memory: the
//! key words of each group and the accumulator slots of each aggregate. The device kernels and the
//! host implementation fill the same layout; [`super::output`] turns it into DataFusion's partial
//! aggregate state.

use std::sync::Arc;

use ::datafusion::common::ScalarValue;
use ::datafusion::common::stats::Precision;
use ::datafusion::common::tree_node::TreeNode;
use ::datafusion::physical_expr::PhysicalExpr;
use ::datafusion::physical_expr::expressions::Column;
use ::datafusion::physical_plan::ExecutionPlan;
use arrow_schema::{DataType, FieldRef, Schema, SchemaRef};

use super::super::device_filter::compactable;
use super::super::predicate::Predicate;
use super::super::table::TableData;
use super::codegen::StageSource;

/// An aggregate function a stage runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AggKind {
    /// `COUNT(x)` (and `COUNT(*)`, whose argument is a literal).
    Count,
    /// `SUM(x)`.
    Sum,
    /// `AVG(x)`.
    Avg,
    /// `MIN(x)`.
    Min,
    /// `MAX(x)`.
    Max,
}

/// How an aggregate's values accumulate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Acc {
    /// Only the count of non-null arguments.
    Count,
    /// A wrapping 128-bit integer sum (integers and decimals) in three slots.
    Int128,
    /// A `f64` sum.
    Float,
    /// The minimum of 64-bit integers (integers and dates).
    MinI64,
    /// The maximum of 64-bit integers.
    MaxI64,
    /// The minimum of floats, in IEEE 754's total order (see [`ordered_f64`]).
    MinF64,
    /// The maximum of floats, in IEEE 754's total order.
    MaxF64,
    /// The minimum of a string or wide decimal column, kept as a reference to the row that
    /// holds it (see [`SlotKind::MinRow`]); the values are gathered when the stage finishes.
    MinRow,
    /// The maximum of a string or wide decimal column, kept as a row reference.
    MaxRow,
}

/// A float's bits as a signed integer that orders as `f64::total_cmp` does (negative values with
/// their magnitude bits flipped), so that floats share the integer minimum and maximum slots. NaN
/// sorts above every number, as arrow's `min` and `max` kernels order it. The mapping is its own
/// inverse.
pub(crate) fn ordered_f64(bits: u64) -> i64 {
    let b = bits as i64;
    b ^ (((b >> 63) as u64) >> 1) as i64
}

/// One accumulator slot's kind: how two partial values merge, and its initial value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SlotKind {
    /// Unsigned 64-bit addition (counts, the parts of 128-bit sums); starts at 0.
    Add,
    /// `f64` addition; starts at 0.0.
    AddF64,
    /// Signed minimum; starts at `i64::MAX`.
    Min,
    /// Signed maximum; starts at `i64::MIN`.
    Max,
    /// The row holding the least value so far, `batch << 32 | element` (the batch's index among
    /// the device's batches, the element's index in its column's buffers); starts at [`NO_ROW`].
    MinRow,
    /// The row holding the greatest value so far; starts at [`NO_ROW`].
    MaxRow,
}

/// A row-reference slot without a row yet.
pub(crate) const NO_ROW: u64 = u64::MAX;

impl SlotKind {
    /// The slot's initial value, as stored.
    pub(crate) fn init(self) -> u64 {
        match self {
            SlotKind::Add | SlotKind::AddF64 => 0,
            SlotKind::Min => i64::MAX as u64,
            SlotKind::Max => i64::MIN as u64,
            SlotKind::MinRow | SlotKind::MaxRow => NO_ROW,
        }
    }
}

/// An aggregate of a stage.
#[derive(Clone, Debug)]
pub(crate) struct AggSpec {
    pub(crate) kind: AggKind,
    pub(crate) acc: Acc,
    /// The argument, over the table's columns.
    pub(crate) arg: Arc<dyn PhysicalExpr>,
    /// `FILTER (WHERE ...)`, over the table's columns.
    pub(crate) filter: Option<Arc<dyn PhysicalExpr>>,
    /// DataFusion's partial state fields of this aggregate.
    pub(crate) state: Vec<FieldRef>,
    /// The display name.
    pub(crate) name: String,
}

impl AggSpec {
    /// The accumulator slots: the count of non-null arguments first, then the values.
    pub(crate) fn slots(&self) -> &'static [SlotKind] {
        match self.acc {
            Acc::Count => &[SlotKind::Add],
            Acc::Int128 => &[SlotKind::Add, SlotKind::Add, SlotKind::Add, SlotKind::Add],
            Acc::Float => &[SlotKind::Add, SlotKind::AddF64],
            Acc::MinI64 | Acc::MinF64 => &[SlotKind::Add, SlotKind::Min],
            Acc::MaxI64 | Acc::MaxF64 => &[SlotKind::Add, SlotKind::Max],
            Acc::MinRow => &[SlotKind::Add, SlotKind::MinRow],
            Acc::MaxRow => &[SlotKind::Add, SlotKind::MaxRow],
        }
    }

    /// The table column a row-reference aggregate reads.
    pub(crate) fn row_column(&self) -> Option<usize> {
        matches!(self.acc, Acc::MinRow | Acc::MaxRow)
            .then(|| self.arg.downcast_ref::<Column>().map(Column::index))
            .flatten()
    }
}

/// The 64-bit words a group key of this type takes. A string takes the words its bytes and their
/// length (the last word's top byte) need: enough for `longest` bytes when the table's statistics
/// bound it (up to [`MAX_KEY_STRING`]), else two (15 bytes). A longer string found while running
/// makes the stage give its work back to DataFusion.
pub(crate) fn key_words(dt: &DataType, longest: Option<usize>) -> Option<usize> {
    use DataType::*;
    match key_value_type(dt) {
        Int8 | Int16 | Int32 | Int64 | UInt8 | UInt16 | UInt32 | Date32 | Date64 | Boolean => Some(1),
        Decimal128(_, s) if *s >= 0 => Some(2),
        Utf8 | LargeUtf8 | Utf8View => Some(longest.map_or(2, |n| n.min(MAX_KEY_STRING) / 8 + 1)),
        _ => None,
    }
}

/// Whether a stage's hash join takes keys of this type: integers, dates, booleans, decimals and
/// strings (by their bytes, in the key words [`key_words`] gives them).
pub(crate) fn join_key_supported(dt: &DataType) -> bool {
    !matches!(dt, DataType::Dictionary(..)) && key_words(dt, None).is_some()
}

/// The type of a group key's values: a dictionary's value type (the stage groups by values, and
/// the output encodes them as the dictionary type again), else the key's type.
pub(crate) fn key_value_type(dt: &DataType) -> &DataType {
    match dt {
        DataType::Dictionary(_, v) => v,
        dt => dt,
    }
}

/// The longest string a group key holds (its length must fit the length byte).
pub(crate) const MAX_KEY_STRING: usize = 255;

/// The first word of each key of `words` words, and the words of all.
fn word_offsets(words: &[usize]) -> (Vec<usize>, usize) {
    let mut offsets = Vec::with_capacity(words.len());
    let mut n = 0;
    for w in words {
        offsets.push(n);
        n += w;
    }
    (offsets, n)
}

/// The bytes a string key of `words` words holds.
pub(crate) fn string_capacity(words: usize) -> usize {
    8 * words - 1
}

/// What a hash join of a stage keeps of the rows it probes with (the stage's rows are the join's
/// probe side, DataFusion's right input).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum JoinKind {
    /// Rows with a matching build row, the build row's columns beside them (`Inner`).
    Inner,
    /// Every row, the matching build row's columns beside it or nulls (`Right`).
    Right,
    /// Rows with a matching build row (`RightSemi`).
    Semi,
    /// Rows without one (`RightAnti`).
    Anti,
    /// Rows without one under `NOT IN`'s null rule (DataFusion's null-aware `LeftAnti`, a single
    /// key): none when a build row's key is null; a row whose key is null only when the build
    /// side is empty.
    NullAwareAnti,
}

impl JoinKind {
    /// Whether the stage reads the matched build row's columns after the join, so that the match
    /// must be the only one: a build side with duplicate keys makes the stage give its work back.
    /// Semi and anti joins only ask whether a match exists (with a join filter, whether one of
    /// the rows with equal keys passes it: the probe walks them all), so duplicates are fine.
    pub(crate) fn needs_unique_keys(self) -> bool {
        matches!(self, JoinKind::Inner | JoinKind::Right)
    }
}

/// A hash join inside a stage: DataFusion runs the build side's plan, the stage hashes its rows
/// where the table lives and probes them with each of its rows.
#[derive(Clone, Debug)]
pub(crate) struct JoinStep {
    /// The build side (DataFusion's left input).
    pub(crate) build: Arc<dyn ExecutionPlan>,
    pub(crate) kind: JoinKind,
    /// The probe keys, over the stage's columns.
    pub(crate) probe: Vec<Arc<dyn PhysicalExpr>>,
    /// The build key columns (indices of the build side's schema).
    pub(crate) keys: Vec<usize>,
    /// The key words of each key (see [`key_words`]): a string key's fit the longer of its two
    /// sides' longest strings, so that equal keys have equal words.
    pub(crate) words: Vec<usize>,
    /// The join's filter, over the stage's columns: a match counts only where it is true.
    pub(crate) filter: Option<Arc<dyn PhysicalExpr>>,
    /// The stage column of the build side's first column (see [`StagePlan::columns_schema`]).
    pub(crate) base: usize,
}

impl JoinStep {
    /// The first key word of each key, and their total.
    pub(crate) fn key_layout(&self) -> (Vec<usize>, usize) {
        word_offsets(&self.words)
    }

    /// The build side's key columns, ascending and each once: the build kernel's columns.
    pub(crate) fn key_columns(&self) -> Vec<usize> {
        let mut columns = self.keys.clone();
        columns.sort_unstable();
        columns.dedup();
        columns
    }
}

/// One step of a stage's row pipeline, in plan order.
#[derive(Clone, Debug)]
pub(crate) enum Step {
    /// Rows where the expression (over the stage's columns) is true.
    Filter(Arc<dyn PhysicalExpr>),
    /// A hash join with another plan's rows.
    Join(JoinStep),
}

/// A lowered stage: a GPU table's scan with its pushed-down predicate, the filters and hash joins
/// above it, and either the group keys and the aggregates or, for a rows stage, the expressions of
/// its output columns. Expressions are over the stage's columns: the table's, then each join's
/// build columns ([`StagePlan::columns_schema`]).
#[derive(Clone, Debug)]
pub(crate) struct StagePlan {
    pub(crate) table: Arc<TableData>,
    pub(crate) predicate: Option<Arc<Predicate>>,
    pub(crate) steps: Vec<Step>,
    pub(crate) keys: Vec<Arc<dyn PhysicalExpr>>,
    pub(crate) key_types: Vec<DataType>,
    /// The words of each key (see [`key_words`]).
    pub(crate) key_words: Vec<usize>,
    pub(crate) aggs: Vec<AggSpec>,
    /// A rows stage (no keys, no aggregates): the value of each output column for each row the
    /// pipeline keeps.
    pub(crate) rows: Option<Vec<Arc<dyn PhysicalExpr>>>,
    /// The output: DataFusion's partial aggregate schema (group columns, then state fields), or
    /// the rows' schema.
    pub(crate) schema: SchemaRef,
    /// The table columns the stage reads, ascending.
    pub(crate) columns: Vec<usize>,
    /// The kernels, generated when the plan was lowered.
    pub(crate) source: Option<StageSource>,
}

impl StagePlan {
    /// The hash joins, in plan order.
    pub(crate) fn joins(&self) -> impl Iterator<Item = &JoinStep> {
        self.steps.iter().filter_map(|s| match s {
            Step::Join(j) => Some(j),
            Step::Filter(_) => None,
        })
    }

    /// The schema of the stage's columns: the table's, then each join's build side's.
    pub(crate) fn columns_schema(&self) -> Schema {
        let fields = self.table.schema.fields().iter().cloned();
        let built = self
            .joins()
            .flat_map(|j| j.build.schema().fields().iter().cloned().collect::<Vec<_>>());
        Schema::new(fields.chain(built).collect::<Vec<_>>())
    }

    /// The stage columns each expression reads (ascending): the table's among them are
    /// [`columns`](Self::columns), the others the build sides' columns the stage reads.
    pub(crate) fn stage_columns(&self) -> Vec<usize> {
        let mut columns = std::collections::BTreeSet::new();
        for e in self.expressions() {
            let _ = e.apply(|n| {
                if let Some(c) = n.downcast_ref::<Column>() {
                    columns.insert(c.index());
                }
                Ok(::datafusion::common::tree_node::TreeNodeRecursion::Continue)
            });
        }
        for j in self.joins() {
            columns.extend(j.keys.iter().map(|k| j.base + k));
        }
        columns.into_iter().collect()
    }

    /// Every expression of the stage's row pipeline, keys and aggregates.
    pub(crate) fn expressions(&self) -> Vec<&Arc<dyn PhysicalExpr>> {
        let mut out = Vec::new();
        for step in &self.steps {
            match step {
                Step::Filter(f) => out.push(f),
                Step::Join(j) => out.extend(j.probe.iter().chain(&j.filter)),
            }
        }
        out.extend(&self.keys);
        for a in &self.aggs {
            out.push(&a.arg);
            out.extend(&a.filter);
        }
        out.extend(self.rows.iter().flatten());
        out
    }

    /// For output column `k` of a rows stage: the table column it copies, when the stage gathers
    /// that column's kept rows as they are rather than computing them.
    pub(crate) fn gathered(&self, k: usize) -> Option<usize> {
        let c = self.rows.as_ref()?.get(k)?.downcast_ref::<Column>()?.index();
        let table = &self.table.schema;
        (c < table.fields().len() && compactable(table.field(c).data_type())).then_some(c)
    }

    /// The first word of each key, and the number of key words (a last word holds the keys'
    /// null bits); 0 words without keys.
    pub(crate) fn key_layout(&self) -> (Vec<usize>, usize) {
        let (offsets, n) = word_offsets(&self.key_words);
        if self.keys.is_empty() {
            (offsets, 0)
        } else {
            (offsets, n + 1)
        }
    }

    /// An upper bound on the stage's groups from the table's statistics: the product over the
    /// keys of their distinct values (an integer or date column's range, a boolean's two, one more
    /// where the column has nulls); `None` when a key is computed or its column has no range.
    pub(crate) fn group_bound(&self) -> Option<u64> {
        let stats = &self.table.stats.column_statistics;
        self.keys.iter().try_fold(1u64, |bound, key| {
            let c = stats.get(key.downcast_ref::<Column>()?.index())?;
            let values = match (&c.min_value, &c.max_value) {
                (Precision::Exact(ScalarValue::Boolean(_)), _) => 2,
                (Precision::Exact(min), Precision::Exact(max)) => {
                    let (min, max) = (integer(min)?, integer(max)?);
                    u64::try_from(max.checked_sub(min)?).ok()?.checked_add(1)?
                }
                _ => return None,
            };
            let nulls = u64::from(!matches!(c.null_count, Precision::Exact(0)));
            bound.checked_mul(values.checked_add(nulls)?)
        })
    }

    /// `count` (0 or 1) groups without keys, their accumulators at their initial values and
    /// their row-reference aggregates' values null.
    pub(crate) fn initial_groups(&self, count: usize) -> Groups {
        let (slots, _) = self.slot_layout();
        Groups {
            count,
            keys: vec![],
            acc: slots
                .iter()
                .flat_map(|s| std::iter::repeat_n(s.init(), count))
                .collect(),
            extremes: self
                .aggs
                .iter()
                .map(|a| {
                    a.row_column()
                        .map(|_| arrow_array::new_null_array(a.state[0].data_type(), count))
                })
                .collect(),
        }
    }

    /// Every accumulator slot, and the first slot of each aggregate.
    pub(crate) fn slot_layout(&self) -> (Vec<SlotKind>, Vec<usize>) {
        let mut slots = Vec::new();
        let mut first = Vec::with_capacity(self.aggs.len());
        for a in &self.aggs {
            first.push(slots.len());
            slots.extend_from_slice(a.slots());
        }
        (slots, first)
    }
}

/// The value of an integer or date statistic.
fn integer(v: &ScalarValue) -> Option<i64> {
    use ScalarValue::*;
    match v {
        Int8(Some(x)) => Some(i64::from(*x)),
        Int16(Some(x)) => Some(i64::from(*x)),
        Int32(Some(x)) | Date32(Some(x)) => Some(i64::from(*x)),
        Int64(Some(x)) | Date64(Some(x)) => Some(*x),
        UInt8(Some(x)) => Some(i64::from(*x)),
        UInt16(Some(x)) => Some(i64::from(*x)),
        UInt32(Some(x)) => Some(i64::from(*x)),
        _ => None,
    }
}

/// What a stage accumulated on the host (a stage on a CUDA device emits its state batch there:
/// `emit.rs`), or the initial groups of one that keeps no row: `count` groups, their key words
/// (`count * words`, group-major), their accumulators (`slots * count`, slot-major) and, for each
/// row-reference aggregate, its values (one per group, null without one).
#[derive(Debug, Default)]
pub(crate) struct Groups {
    pub(crate) count: usize,
    pub(crate) keys: Vec<u64>,
    pub(crate) acc: Vec<u64>,
    /// Per aggregate: the values of a row-reference aggregate, else `None`.
    pub(crate) extremes: Vec<Option<arrow_array::ArrayRef>>,
}
