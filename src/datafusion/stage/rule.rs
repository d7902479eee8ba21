//! [`DeviceStageRule`]: the physical optimizer rule that replaces aggregations over GPU table scans,
//! and projections, filters and joins over them without such an aggregate above, with device stages.

use std::sync::Arc;

use ::datafusion::common::config::ConfigOptions;
use ::datafusion::common::tree_node::{Transformed, TreeNode};
use ::datafusion::common::{JoinSide, JoinType, NullEquality};
use ::datafusion::datasource::source::DataSourceExec;
use ::datafusion::execution::SessionStateBuilder;
use ::datafusion::physical_expr::expressions::{Column, Literal};
use ::datafusion::physical_expr::utils::collect_columns;
use ::datafusion::physical_expr::{PhysicalExpr, ScalarFunctionExpr};
use ::datafusion::physical_optimizer::PhysicalOptimizerRule;
use ::datafusion::physical_plan::aggregates::{AggregateExec, AggregateMode};
use ::datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use ::datafusion::physical_plan::coop::CooperativeExec;
use ::datafusion::physical_plan::execution_plan::replace_children_if_necessary;
use ::datafusion::physical_plan::filter::FilterExec;
use ::datafusion::physical_plan::joins::HashJoinExec;
use ::datafusion::physical_plan::projection::ProjectionExec;
use ::datafusion::physical_plan::repartition::RepartitionExec;
use ::datafusion::physical_plan::sorts::sort::SortExec;
use ::datafusion::physical_plan::statistics::{StatisticsArgs, StatisticsContext};
use ::datafusion::physical_plan::union::{InterleaveExec, UnionExec};
use ::datafusion::physical_plan::{ExecutionPlan, Partitioning};
use arrow_schema::DataType;

use super::super::error::DfResult;
use super::super::nvrtc::gpu_kernels_available;
use super::super::predicate::Predicate;
use super::super::source::GpuScan;
use super::build::stays_on;
use super::codegen;
use super::exec::{DeviceStageExec, Having, Output};
use super::expr::{int_literal, substr_range};
use super::layout::{self, Acc, AggKind, AggSpec, JoinKind, JoinStep, StagePlan, Step};
use super::narrow::state_columns;
use super::outer;
use super::output::state_type_supported;
use crate::device::Device;

/// Replaces each aggregation over a GPU table scan (through projections, filters and joins) with
/// one [`DeviceStageExec`], when the device can run all of it, and each projection, filter or join
/// over such a scan that no stage above covers with a rows stage, when it computes something the
/// scan does not; everything else stays with DataFusion. See the [module docs](crate::datafusion#device-stages) for where it sits among DataFusion's rules.
#[derive(Debug, Default, Clone)]
pub struct DeviceStageRule {
    host_stages: bool,
}

impl DeviceStageRule {
    /// A rule that places stages over tables on CUDA devices.
    pub fn new() -> Self {
        Self::default()
    }

    /// Also places stages over tables on the CPU device, run by their host implementation
    /// (arrow-rs kernels). Off by default: DataFusion's own operators are the better choice there;
    /// tests switch it on to prove the plan rewrite and the partial state without a GPU.
    pub fn with_host_stages(mut self, on: bool) -> Self {
        self.host_stages = on;
        self
    }
}

impl PhysicalOptimizerRule for DeviceStageRule {
    fn optimize(&self, plan: Arc<dyn ExecutionPlan>, _config: &ConfigOptions) -> DfResult<Arc<dyn ExecutionPlan>> {
        let out = plan.transform_down(|node| {
            // A filter over an aggregate's rows (`HAVING`), partitioned as they are.
            let having = node.downcast_ref::<FilterExec>().and_then(|f| {
                let agg = f.input().downcast_ref::<AggregateExec>()?;
                (f.properties().partitioning == agg.properties().partitioning).then_some((agg, f))
            });
            let placed = if let Some(agg) = node.downcast_ref::<AggregateExec>() {
                self.stage(agg, &node, None)
            } else if let Some(stage) = having.and_then(|(agg, f)| self.stage(agg, &node, Some(f)).ok()) {
                Ok(stage)
            } else if node.downcast_ref::<ProjectionExec>().is_some()
                || node.downcast_ref::<FilterExec>().is_some()
                || node.downcast_ref::<HashJoinExec>().is_some()
            {
                self.rows_stage(&node)
            } else {
                return Ok(Transformed::no(node));
            };
            match placed {
                Ok(stage) => Ok(Transformed::yes(stage)),
                Err(why) => {
                    log::debug!("arrow-cuda: no device stage for {}: {why}", node.name());
                    Ok(Transformed::no(node))
                }
            }
        })?;
        // Sorts with a limit over stages of final rows: cut in the stage.
        let out = out.data.transform_up(|node| {
            Ok(match self.top(&node)? {
                Some(cut) => Transformed::yes(cut),
                None => Transformed::no(node),
            })
        })?;
        Ok(out.data)
    }

    fn name(&self) -> &str {
        "arrow_cuda_device_stages"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

/// The subtree under an aggregate, down to the scan: its filters and joins, and the expressions
/// of its output columns, all over the stage's columns (the table's, then each join's build
/// side's).
#[derive(Clone)]
struct Lowered<'a> {
    scan: &'a GpuScan,
    steps: Vec<Step>,
    outputs: Vec<Arc<dyn PhysicalExpr>>,
    /// Per stage column: the longest string it holds where statistics say, [`UNKNOWN_LENGTH`]
    /// for a build side's string column they do not bound.
    longest: Vec<Option<usize>>,
}

/// The longest string of a column no statistics bound.
const UNKNOWN_LENGTH: usize = usize::MAX;

/// `expr` with each column replaced by the expression that computes it.
fn substitute(
    expr: &Arc<dyn PhysicalExpr>,
    outputs: &[Arc<dyn PhysicalExpr>],
) -> Result<Arc<dyn PhysicalExpr>, String> {
    Arc::clone(expr)
        .transform(|e| {
            Ok(match e.downcast_ref::<Column>() {
                Some(c) => Transformed::yes(Arc::clone(&outputs[c.index()])),
                None => Transformed::no(e),
            })
        })
        .map(|t| t.data)
        .map_err(|e| e.to_string())
}

/// The partial aggregate under a `Final` one, through the repartitioning or coalescing between them.
fn partial_below(plan: &Arc<dyn ExecutionPlan>) -> Result<Arc<dyn ExecutionPlan>, String> {
    if let Some(agg) = plan.downcast_ref::<AggregateExec>()
        && *agg.mode() == AggregateMode::Partial
    {
        return Ok(plan.clone());
    }
    if moves_rows(plan) {
        return partial_below(plan.children()[0]);
    }
    Err(format!("{} under the final aggregate", plan.name()))
}

/// Whether `plan` only moves its input's rows between partitions (repartitioning, coalescing
/// without a limit, cooperative scheduling): a stage, which reads every partition at once, looks
/// through it.
fn moves_rows(plan: &Arc<dyn ExecutionPlan>) -> bool {
    plan.downcast_ref::<RepartitionExec>().is_some()
        || plan.downcast_ref::<CooperativeExec>().is_some()
        || plan
            .downcast_ref::<CoalescePartitionsExec>()
            .is_some_and(|c| c.fetch().is_none())
}

/// A join's build side without the repartitioning or coalescing on top of it: the stage takes
/// all of its rows at once.
fn build_input(plan: &Arc<dyn ExecutionPlan>) -> Arc<dyn ExecutionPlan> {
    if moves_rows(plan) {
        build_input(plan.children()[0])
    } else {
        plan.clone()
    }
}

/// The longest string of each of `plan`'s output columns whose values come unchanged from a GPU
/// table's column (through projections, filters, joins and repartitioning), from the table's
/// statistics; `None` for the others.
fn traced_longest(plan: &Arc<dyn ExecutionPlan>) -> Vec<Option<usize>> {
    let width = plan.schema().fields().len();
    let through = |below: Vec<Option<usize>>, exprs: &mut dyn Iterator<Item = &Arc<dyn PhysicalExpr>>| {
        exprs
            .map(|e| {
                e.downcast_ref::<Column>()
                    .and_then(|c| below.get(c.index()).copied().flatten())
            })
            .collect::<Vec<_>>()
    };
    if let Some(source) = plan.downcast_ref::<DataSourceExec>()
        && let Some(scan) = source.data_source().downcast_ref::<GpuScan>()
    {
        let longest = &scan.table().longest_strings;
        return scan
            .output_columns()
            .into_iter()
            .map(|c| longest.get(c).copied().flatten())
            .collect();
    }
    if let Some(p) = plan.downcast_ref::<ProjectionExec>() {
        return through(traced_longest(p.input()), &mut p.expr().iter().map(|e| &e.expr));
    }
    if let Some(f) = plan.downcast_ref::<FilterExec>() {
        let below = traced_longest(f.input());
        return match f.projection() {
            Some(p) => p.iter().map(|&i| below.get(i).copied().flatten()).collect(),
            None => below,
        };
    }
    if let Some(j) = plan.downcast_ref::<HashJoinExec>() {
        let (left, right) = (traced_longest(j.left()), traced_longest(j.right()));
        let all: Vec<Option<usize>> = match j.join_type() {
            JoinType::LeftSemi | JoinType::LeftAnti => left,
            JoinType::RightSemi | JoinType::RightAnti => right,
            JoinType::Inner | JoinType::Left | JoinType::Right | JoinType::Full => {
                left.into_iter().chain(right).collect()
            }
            _ => vec![None; j.join_schema().fields().len()],
        };
        return match &j.projection {
            Some(p) => p.iter().map(|&i| all.get(i).copied().flatten()).collect(),
            None => all,
        };
    }
    if moves_rows(plan) {
        return traced_longest(plan.children()[0]);
    }
    vec![None; width]
}

/// The longest strings of a build side's columns: traced to a GPU table's statistics, else
/// [`UNKNOWN_LENGTH`] for a string column.
fn build_longest(build: &Arc<dyn ExecutionPlan>) -> Vec<Option<usize>> {
    let traced = traced_longest(build);
    build
        .schema()
        .fields()
        .iter()
        .enumerate()
        .map(|(i, f)| {
            let string = matches!(
                layout::key_value_type(f.data_type()),
                DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View
            );
            traced.get(i).copied().flatten().or(string.then_some(UNKNOWN_LENGTH))
        })
        .collect()
}

/// The rows DataFusion's statistics expect `plan` to produce, where they say.
fn estimated_rows(plan: &Arc<dyn ExecutionPlan>) -> Option<usize> {
    let stats = StatisticsContext::new()
        .compute(plan.as_ref(), &StatisticsArgs::new())
        .ok()?;
    stats.num_rows.get_value().copied()
}

/// A hash join whose probe side (DataFusion's right input) leads to the stage's scan, as a step
/// of the stage; its build side stays a DataFusion plan that the stage runs (a rows stage where
/// one can run it on the stage's device). A left semi or anti join whose left input leads to the
/// scan is a step too when its right input is a GPU scan, or a rows stage, on the stage's device:
/// the stage hashes that side where it lives and probes it with the table's rows.
/// So is an inner join that cannot be placed the first way (DataFusion built on the larger side).
fn walk_join<'a>(rule: &DeviceStageRule, j: &'a HashJoinExec) -> Result<Lowered<'a>, String> {
    match j.join_type() {
        JoinType::Inner => walk_join_as(rule, j, JoinKind::Inner, false).or_else(|e| {
            walk_join_as(rule, j, JoinKind::Inner, true)
                .map_err(|swapped| format!("{e}; with the sides swapped: {swapped}"))
        }),
        JoinType::Right => walk_join_as(rule, j, JoinKind::Right, false),
        JoinType::RightSemi => walk_join_as(rule, j, JoinKind::Semi, false),
        JoinType::RightAnti => walk_join_as(rule, j, JoinKind::Anti, false),
        JoinType::LeftSemi => walk_join_as(rule, j, JoinKind::Semi, true),
        JoinType::LeftAnti if j.null_aware => walk_join_as(rule, j, JoinKind::NullAwareAnti, true),
        JoinType::LeftAnti => walk_join_as(rule, j, JoinKind::Anti, true),
        other => Err(format!("a {other} join")),
    }
}

/// [`walk_join`] with the stage's table on the left side of `j` (`scan_left`) or its right.
fn walk_join_as<'a>(
    rule: &DeviceStageRule,
    j: &'a HashJoinExec,
    kind: JoinKind,
    scan_left: bool,
) -> Result<Lowered<'a>, String> {
    if !plain_equi_join(j) || j.null_aware != (kind == JoinKind::NullAwareAnti) {
        return Err("a join where nulls match or a join with a limit".into());
    }
    if matches!(kind, JoinKind::Right | JoinKind::NullAwareAnti) && j.filter().is_some() {
        return Err(format!("a {kind:?} join with a filter"));
    }
    // The side whose rows the stage reads, and the side it hashes.
    let (scanned, hashed) = if scan_left {
        (j.left(), j.right())
    } else {
        (j.right(), j.left())
    };
    let mut below = walk(rule, scanned)?;
    let keys = join_keys(j, scan_left, &below.outputs, &scanned.schema())?;
    let steps = below.steps.len();
    let build_columns = join_steps(rule, &mut below, hashed, kind, keys, scan_left)?;
    if let Some(f) = j.filter() {
        let sides = f
            .column_indices()
            .iter()
            .map(|ci| match (ci.side, scan_left) {
                (JoinSide::Left, false) | (JoinSide::Right, true) => Ok(build_columns[ci.index].clone()),
                (JoinSide::Right, false) | (JoinSide::Left, true) => Ok(below.outputs[ci.index].clone()),
                (JoinSide::None, _) => Err("a join filter over a mark column".to_string()),
            })
            .collect::<Result<Vec<_>, _>>()?;
        let filter = substitute(f.expression(), &sides)?;
        // One join step holds its filter; an inner join flattened into several is filtered after them.
        match &mut below.steps[steps..] {
            [Step::Join(step)] => step.filter = Some(filter),
            _ => below.steps.push(Step::Filter(filter)),
        }
    }
    // DataFusion's output: the left input's columns then the right's (inner and outer joins), or
    // one side's (semi and anti joins: the stage's).
    let outputs: Vec<_> = match kind {
        JoinKind::Inner | JoinKind::Right if scan_left => below.outputs.into_iter().chain(build_columns).collect(),
        JoinKind::Inner | JoinKind::Right => build_columns.into_iter().chain(below.outputs).collect(),
        JoinKind::Semi | JoinKind::Anti | JoinKind::NullAwareAnti => below.outputs,
    };
    below.outputs = match &j.projection {
        Some(p) => p.iter().map(|&i| outputs[i].clone()).collect(),
        None => outputs,
    };
    Ok(below)
}

/// Whether `j` matches rows on equal, non-null keys, with no limit: what a stage's join steps do
/// (a null-aware anti join adds `NOT IN`'s null rule, [`JoinKind::NullAwareAnti`]).
fn plain_equi_join(j: &HashJoinExec) -> bool {
    j.null_equality() == NullEquality::NullEqualsNothing && j.fetch().is_none()
}

/// The keys of `j` with its right side hashed (`build_right`) or its left: each build key a
/// column of that side, each probe key the other side's expression over `columns` (that side's
/// columns as expressions over the stage's), of its type in `schema` (that side's).
fn join_keys(
    j: &HashJoinExec,
    build_right: bool,
    columns: &[Arc<dyn PhysicalExpr>],
    schema: &arrow_schema::Schema,
) -> Result<Vec<JoinKey>, String> {
    j.on()
        .iter()
        .map(|(l, r)| {
            let (build, probe) = if build_right { (r, l) } else { (l, r) };
            Ok(JoinKey {
                build: build
                    .downcast_ref::<Column>()
                    .ok_or("a build key that is not a column")?
                    .index(),
                probe: substitute(probe, columns)?,
                probe_type: probe.data_type(schema).map_err(|e| e.to_string())?,
            })
        })
        .collect()
}

/// A key of a join the stage runs: the build side's column and the value the stage's rows probe
/// it with (over the stage's columns), of type `probe_type`.
struct JoinKey {
    build: usize,
    probe: Arc<dyn PhysicalExpr>,
    probe_type: DataType,
}

/// Adds the steps that join the stage's rows with `hashed`, a join's build side, on `keys`, and
/// returns `hashed`'s columns as expressions over the stage's columns. An inner join whose build
/// side is itself an inner join of sides the stage keeps on its device is flattened (see
/// [`flattened`]); `on_device`: the build side must stay on the stage's device.
fn join_steps(
    rule: &DeviceStageRule,
    below: &mut Lowered,
    hashed: &Arc<dyn ExecutionPlan>,
    kind: JoinKind,
    keys: Vec<JoinKey>,
    on_device: bool,
) -> Result<Vec<Arc<dyn PhysicalExpr>>, String> {
    if kind == JoinKind::Inner {
        let mut flat = below.clone();
        match flattened(rule, &mut flat, hashed, &keys) {
            Ok(columns) => {
                *below = flat;
                return Ok(columns);
            }
            Err(why) => log::trace!("arrow-cuda: a build side not flattened: {why}"),
        }
    }
    join_step(rule, below, hashed, kind, keys, on_device)
}

/// The steps of an inner join with `hashed` when it is an inner join of two sides, A and B, that
/// stay on the stage's device (GPU scans, rows stages, or such joins again) and `keys` are all
/// B's: the stage's rows join B, then A on the inner join's keys, and no row of A or B crosses to
/// the host (`L ⋈ (A ⋈ B) = (L ⋈ B) ⋈ A` for inner joins). Returns `hashed`'s columns.
fn flattened(
    rule: &DeviceStageRule,
    below: &mut Lowered,
    hashed: &Arc<dyn ExecutionPlan>,
    keys: &[JoinKey],
) -> Result<Vec<Arc<dyn PhysicalExpr>>, String> {
    let input = build_input(hashed);
    let j = input.downcast_ref::<HashJoinExec>().ok_or("not a join")?;
    if *j.join_type() != JoinType::Inner || j.filter().is_some() || !plain_equi_join(j) {
        return Err(format!(
            "a {} join with a filter, a limit or matching nulls",
            j.join_type()
        ));
    }
    let left_width = j.left().schema().fields().len();
    let column = |i: usize| j.projection.as_ref().map_or(i, |p| p[i]);
    let (keyed_left, keyed) = if keys.iter().all(|k| column(k.build) < left_width) {
        (true, j.left())
    } else if keys.iter().all(|k| column(k.build) >= left_width) {
        (false, j.right())
    } else {
        return Err("keys on both sides of the build side's join".into());
    };
    let offset = if keyed_left { 0 } else { left_width };
    let keyed_keys = keys
        .iter()
        .map(|k| JoinKey {
            build: column(k.build) - offset,
            probe: k.probe.clone(),
            probe_type: k.probe_type.clone(),
        })
        .collect();
    let keyed_columns = join_steps(rule, below, keyed, JoinKind::Inner, keyed_keys, true)?;
    let other = if keyed_left { j.right() } else { j.left() };
    let other_keys = join_keys(j, keyed_left, &keyed_columns, &keyed.schema())?;
    let other_columns = join_steps(rule, below, other, JoinKind::Inner, other_keys, true)?;
    let all: Vec<_> = if keyed_left {
        keyed_columns.into_iter().chain(other_columns).collect()
    } else {
        other_columns.into_iter().chain(keyed_columns).collect()
    };
    Ok(match &j.projection {
        Some(p) => p.iter().map(|&i| all[i].clone()).collect(),
        None => all,
    })
}

/// The step that joins the stage's rows with `hashed` (a build side the stage hashes whole) on
/// `keys`; returns `hashed`'s columns. Its build side is the plan itself, or the rows stage that
/// runs it on the stage's device; `on_device`: it must stay there.
fn join_step(
    rule: &DeviceStageRule,
    below: &mut Lowered,
    hashed: &Arc<dyn ExecutionPlan>,
    kind: JoinKind,
    keys: Vec<JoinKey>,
    on_device: bool,
) -> Result<Vec<Arc<dyn PhysicalExpr>>, String> {
    let original = build_input(hashed);
    let device = below.scan.table().single_device();
    // A build side that a rows stage can run on the stage's device (a filter the scan cannot
    // take, computed columns) becomes one: its kept rows stay there too.
    let build = match device {
        Some(d) if !stays_on(&original, d) => rule
            .rows_stage(&original)
            .ok()
            .filter(|stage| stays_on(stage, d))
            .unwrap_or_else(|| original.clone()),
        _ => original.clone(),
    };
    if on_device && !device.is_some_and(|d| stays_on(&build, d)) {
        return Err(format!(
            "a build side ({}) that is neither a GPU scan nor a rows stage on the stage's device",
            original.name()
        ));
    }
    // A build side with more rows than the stage's table is not the unique side of a key: an
    // inner or outer join would find duplicate keys and give the work back.
    if kind.needs_unique_keys() {
        let table_rows = below.scan.table().stats.num_rows;
        if let (Some(b), Some(t)) = (estimated_rows(&original), table_rows.get_value())
            && b > *t
        {
            return Err(format!("a build side of {b} rows for a table of {t}"));
        }
    }
    let hashed_schema = hashed.schema();
    let hashed_longest = build_longest(&original);
    let mut words = Vec::with_capacity(keys.len());
    for k in &keys {
        let ht = hashed_schema.field(k.build).data_type();
        if *ht != k.probe_type || !layout::join_key_supported(ht) {
            return Err(format!("join keys of {ht} and {}", k.probe_type));
        }
        // Both sides' strings in the same words: the longer side's longest, where both bound it.
        let built = hashed_longest[k.build].filter(|&n| n != UNKNOWN_LENGTH);
        let longest = built
            .zip(longest_string(&k.probe, &below.longest))
            .map(|(b, p)| b.max(p));
        words.push(layout::key_words(ht, longest).ok_or_else(|| format!("a join key of {ht}"))?);
    }
    let base = below.longest.len();
    let build_columns = hashed_schema
        .fields()
        .iter()
        .enumerate()
        .map(|(i, f)| Arc::new(Column::new(f.name(), base + i)) as Arc<dyn PhysicalExpr>)
        .collect();
    below.longest.extend(hashed_longest);
    let (keys, probe) = keys.into_iter().map(|k| (k.build, k.probe)).unzip();
    below.steps.push(Step::Join(JoinStep {
        build,
        kind,
        probe,
        keys,
        words,
        filter: None,
        base,
    }));
    Ok(build_columns)
}

fn walk<'a>(rule: &DeviceStageRule, plan: &'a Arc<dyn ExecutionPlan>) -> Result<Lowered<'a>, String> {
    if let Some(source) = plan.downcast_ref::<DataSourceExec>() {
        let scan = source
            .data_source()
            .downcast_ref::<GpuScan>()
            .ok_or("a data source that is not a GPU table")?;
        if scan.limit().is_some() {
            return Err("a scan with a limit".into());
        }
        let table = &scan.table().schema;
        let outputs = scan
            .output_columns()
            .into_iter()
            .map(|c| Arc::new(Column::new(table.field(c).name(), c)) as Arc<dyn PhysicalExpr>)
            .collect();
        return Ok(Lowered {
            scan,
            steps: vec![],
            outputs,
            longest: scan.table().longest_strings.clone(),
        });
    }
    if let Some(p) = plan.downcast_ref::<ProjectionExec>() {
        let mut below = walk(rule, p.input())?;
        below.outputs = p
            .expr()
            .iter()
            .map(|e| substitute(&e.expr, &below.outputs))
            .collect::<Result<_, _>>()?;
        return Ok(below);
    }
    if let Some(f) = plan.downcast_ref::<FilterExec>() {
        let mut below = walk(rule, f.input())?;
        let predicate = substitute(f.predicate(), &below.outputs)?;
        below.steps.push(Step::Filter(predicate));
        if let Some(projection) = f.projection() {
            below.outputs = projection.iter().map(|&i| Arc::clone(&below.outputs[i])).collect();
        }
        return Ok(below);
    }
    if let Some(j) = plan.downcast_ref::<HashJoinExec>() {
        return walk_join(rule, j);
    }
    if moves_rows(plan) {
        return walk(rule, plan.children()[0]);
    }
    Err(format!("{} under the aggregate", plan.name()))
}

/// Build sides of more rows than this, whose strings the stage reads, stay with DataFusion's
/// joins unless they are GPU scans on the stage's device: copying a large build side's strings
/// to the host and back costs more than the join saves.
const MAX_STRING_BUILD_ROWS: usize = 1 << 20;

/// Why the stage should not run join `j`, if it should not: the stage reads string columns of
/// its build side (`read`: the stage columns it reads) and the build side has (or may have)
/// more than [`MAX_STRING_BUILD_ROWS`] rows.
fn costly_build(j: &JoinStep, read: &[usize]) -> Option<String> {
    let schema = j.build.schema();
    let strings = read.iter().any(|&c| {
        c >= j.base
            && schema.fields().get(c - j.base).is_some_and(|f| {
                matches!(
                    layout::key_value_type(f.data_type()),
                    DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View
                )
            })
    });
    if !strings {
        return None;
    }
    let rows = estimated_rows(&j.build);
    match rows {
        Some(n) if n <= MAX_STRING_BUILD_ROWS => None,
        _ => Some(format!("the strings of a build side of {rows:?} rows")),
    }
}

impl DeviceStageRule {
    /// The stage that replaces `agg` (the node `node`): for a `Final` aggregate over a partial one
    /// (through the repartitioning between them) or a `Single` or `SinglePartitioned` aggregate, a stage that emits the
    /// final rows; for a `Partial` aggregate whose `Final` stays with DataFusion, a stage that
    /// emits the partial state. `having`: a filter over the aggregate's rows (the node `node`),
    /// which the stage applies to the final rows.
    fn stage(
        &self,
        agg: &AggregateExec,
        node: &Arc<dyn ExecutionPlan>,
        having: Option<&FilterExec>,
    ) -> Result<Arc<dyn ExecutionPlan>, String> {
        let partial = match agg.mode() {
            AggregateMode::Partial if having.is_some() => return Err("a filter over partial state".into()),
            AggregateMode::Partial => {
                return match self.lower(agg) {
                    Ok(plan) => Ok(Arc::new(DeviceStageExec::new(plan, Output::Partial, node.clone()))),
                    Err(why) => self
                        .split_stages(node, true, |half| {
                            let agg = half.downcast_ref::<AggregateExec>().ok_or("not an aggregate")?;
                            Ok(Arc::new(DeviceStageExec::new(
                                self.lower(agg)?,
                                Output::Partial,
                                half.clone(),
                            )))
                        })
                        .map_err(|split| format!("{why}; as two stages: {split}")),
                };
            }
            AggregateMode::Final | AggregateMode::FinalPartitioned => partial_below(agg.input())?,
            AggregateMode::Single | AggregateMode::SinglePartitioned => Arc::new(
                AggregateExec::try_new(
                    AggregateMode::Partial,
                    agg.group_expr().clone(),
                    agg.aggr_expr().to_vec(),
                    agg.filter_expr().to_vec(),
                    agg.input().clone(),
                    agg.input_schema(),
                )
                .map_err(|e| e.to_string())?,
            ),
            other => return Err(format!("mode {other:?}")),
        };
        if agg.limit_options().is_some() || node.properties().output_ordering().is_some() {
            return Err("a limit or an output ordering".into());
        }
        if let Some(a) = agg.aggr_expr().iter().find(|a| !a.groups_accumulator_supported()) {
            return Err(format!("{} has no groups accumulator", a.name()));
        }
        // The stage splits its rows into the partitions of the aggregate it replaces by the hash of
        // its group columns (the first of its output).
        if let Partitioning::Hash(exprs, _) = &node.properties().partitioning {
            let keys = agg.group_expr().expr().len();
            if !exprs
                .iter()
                .all(|e| e.downcast_ref::<Column>().is_some_and(|c| c.index() < keys))
            {
                return Err("an output partitioned by more than its group columns".into());
            }
        }
        let plan = match self.lower(partial.downcast_ref::<AggregateExec>().ok_or("not an aggregate")?) {
            Ok(plan) => plan,
            Err(why)
                if having.is_none()
                    && matches!(agg.mode(), AggregateMode::Single | AggregateMode::SinglePartitioned) =>
            {
                return self
                    .split_single(agg, &partial, node)
                    .map_err(|split| format!("{why}; as two stages: {split}"));
            }
            Err(why) => return Err(why),
        };
        let having = having.map(|p| self.having(agg, p, &plan)).transpose()?;
        let output = Output::Final {
            aggr: agg.aggr_expr().to_vec(),
            schema: agg.schema(),
            having,
            top: None,
        };
        Ok(Arc::new(DeviceStageExec::new(plan, output, node.clone())))
    }

    /// The [`Having`] of `filter` over `agg`'s rows: every aggregate its predicate reads must keep
    /// its value as its one state column (`SUM`, `COUNT`, `MIN`, `MAX`), so that it reads the
    /// state batch too, where the device evaluates it; and there must be groups (without group
    /// keys the one row is DataFusion's to keep or drop).
    fn having(&self, agg: &AggregateExec, filter: &FilterExec, plan: &StagePlan) -> Result<Having, String> {
        let predicate = filter.predicate();
        let keys = agg.group_expr().expr().len();
        if keys == 0 {
            return Err("a filter over an aggregate without groups".into());
        }
        let state_column = state_columns(agg.aggr_expr(), keys);
        if collect_columns(predicate)
            .iter()
            .any(|c| state_column[c.index()].is_none())
        {
            return Err("a filter over an aggregate whose state is not its value".into());
        }
        let on_state: Vec<Arc<dyn PhysicalExpr>> = state_column
            .iter()
            .zip(agg.schema().fields())
            .map(|(c, f)| Arc::new(Column::new(f.name(), c.unwrap_or(0))) as Arc<dyn PhysicalExpr>)
            .collect();
        let on_state = Predicate::from_physical(&substitute(predicate, &on_state)?, &plan.schema)
            .ok_or("a filter the device does not evaluate")?;
        Ok(Having {
            predicate: predicate.clone(),
            on_state,
            projection: filter.projection().as_deref().map(<[usize]>::to_vec),
        })
    }

    /// `node` with a top-k cut in the stage below it, where `node` is a sort with a limit whose
    /// first key is a column of a stage of final rows (through projections of columns and
    /// coalescing), and the stage can cut by it; `None` otherwise.
    fn top(&self, node: &Arc<dyn ExecutionPlan>) -> DfResult<Option<Arc<dyn ExecutionPlan>>> {
        let Some((sort, k)) = node.downcast_ref::<SortExec>().and_then(|s| Some((s, s.fetch()?))) else {
            return Ok(None);
        };
        let first = sort.expr().first();
        let Some(mut column) = first.expr.downcast_ref::<Column>().map(Column::index) else {
            return Ok(None);
        };
        // The nodes between the sort and the stage, the sort's first.
        let mut path = vec![node.clone()];
        let mut at = sort.input().clone();
        loop {
            let next = if let Some(p) = at.downcast_ref::<ProjectionExec>() {
                match p.expr().get(column).and_then(|e| e.expr.downcast_ref::<Column>()) {
                    Some(c) => column = c.index(),
                    None => return Ok(None),
                }
                p.input().clone()
            } else if let Some(c) = at.downcast_ref::<CoalescePartitionsExec>() {
                c.input().clone()
            } else {
                break;
            };
            path.push(std::mem::replace(&mut at, next));
        }
        let Some(stage) = at.downcast_ref::<DeviceStageExec>() else {
            return Ok(None);
        };
        let mut rebuilt: Arc<dyn ExecutionPlan> = match stage.with_top(column, k, first.options) {
            Ok(stage) => Arc::new(stage),
            Err(why) => {
                log::debug!("arrow-cuda: no top-k cut in a device stage: {why}");
                return Ok(None);
            }
        };
        for above in path.into_iter().rev() {
            rebuilt = replace_children_if_necessary(above, vec![rebuilt])?;
        }
        Ok(Some(rebuilt))
    }

    pub(crate) fn lower(&self, agg: &AggregateExec) -> Result<StagePlan, String> {
        if *agg.mode() != AggregateMode::Partial {
            return Err(format!("mode {:?}", agg.mode()));
        }
        if agg.group_expr().has_grouping_set() || agg.limit_options().is_some() {
            return Err("grouping sets or a limit".into());
        }
        let below = walk(self, agg.input())?;
        let table = below.scan.table().clone();
        let input_schema = agg.input_schema();
        let mut keys = Vec::new();
        let mut key_types = Vec::new();
        let mut key_words = Vec::new();
        for (e, _) in agg.group_expr().expr() {
            let dt = e.data_type(&input_schema).map_err(|e| e.to_string())?;
            let key = substitute(e, &below.outputs)?;
            let words = layout::key_words(&dt, longest_string(&key, &below.longest))
                .ok_or_else(|| format!("a group key of {dt}"))?;
            keys.push(key);
            key_types.push(dt);
            key_words.push(words);
        }
        let mut aggs = Vec::new();
        for (a, filter) in agg.aggr_expr().iter().zip(agg.filter_expr()) {
            if a.is_distinct() || !a.order_bys().is_empty() {
                return Err(format!("{} with DISTINCT or ORDER BY", a.name()));
            }
            let kind = match a.fun().name().to_ascii_lowercase().as_str() {
                "count" => AggKind::Count,
                "sum" => AggKind::Sum,
                "avg" => AggKind::Avg,
                "min" => AggKind::Min,
                "max" => AggKind::Max,
                other => return Err(format!("aggregate {other}")),
            };
            let [arg] = a
                .expressions()
                .try_into()
                .map_err(|_| "an aggregate of several arguments")?;
            let dt = arg.data_type(&input_schema).map_err(|e| e.to_string())?;
            let int = matches!(
                dt,
                DataType::Int8
                    | DataType::Int16
                    | DataType::Int32
                    | DataType::Int64
                    | DataType::UInt8
                    | DataType::UInt16
                    | DataType::UInt32
            );
            let acc = match (kind, &dt) {
                (AggKind::Count, _) => Acc::Count,
                (AggKind::Sum | AggKind::Avg, DataType::Decimal128(_, s)) if *s >= 0 => Acc::Int128,
                (AggKind::Sum | AggKind::Avg, _) if int => Acc::Int128,
                (AggKind::Sum | AggKind::Avg, DataType::Float32 | DataType::Float64) => Acc::Float,
                (AggKind::Min, DataType::Date32 | DataType::Date64) => Acc::MinI64,
                (AggKind::Max, DataType::Date32 | DataType::Date64) => Acc::MaxI64,
                // Decimals of at most 18 digits fit the 64-bit minimum and maximum.
                (AggKind::Min, DataType::Decimal128(p, s)) if *p <= 18 && *s >= 0 => Acc::MinI64,
                (AggKind::Max, DataType::Decimal128(p, s)) if *p <= 18 && *s >= 0 => Acc::MaxI64,
                (AggKind::Min, DataType::Float32 | DataType::Float64) => Acc::MinF64,
                (AggKind::Max, DataType::Float32 | DataType::Float64) => Acc::MaxF64,
                (AggKind::Min, _) if int => Acc::MinI64,
                (AggKind::Max, _) if int => Acc::MaxI64,
                // Strings and wider decimals: the row holding the extreme, of a column.
                (
                    AggKind::Min | AggKind::Max,
                    DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View | DataType::Decimal128(..),
                ) if substitute(&arg, &below.outputs)?
                    .downcast_ref::<Column>()
                    .is_some_and(|c| c.index() < table.schema.fields().len()) =>
                {
                    if kind == AggKind::Min {
                        Acc::MinRow
                    } else {
                        Acc::MaxRow
                    }
                }
                (k, dt) => return Err(format!("{k:?} of {dt}")),
            };
            let state = a.state_fields().map_err(|e| e.to_string())?;
            let expected = if kind == AggKind::Avg { 2 } else { 1 };
            if state.len() != expected
                || !state
                    .iter()
                    .enumerate()
                    .all(|(i, f)| state_type_supported(acc, i, f.data_type()))
            {
                return Err(format!("the state of {}", a.name()));
            }
            aggs.push(AggSpec {
                kind,
                acc,
                arg: substitute(&arg, &below.outputs)?,
                filter: filter.as_ref().map(|f| substitute(f, &below.outputs)).transpose()?,
                state,
                name: a.name().to_string(),
            });
        }
        self.finish(StagePlan {
            predicate: below.scan.predicate().cloned(),
            steps: below.steps,
            keys,
            key_types,
            key_words,
            aggs,
            rows: None,
            schema: agg.schema(),
            columns: vec![],
            source: None,
            table,
        })
    }

    /// The rows stage that replaces `node`, a projection, a filter or a hash join over a GPU
    /// table's scan (through other projections, filters and joins) with no aggregate above it
    /// that a stage runs: when the stage does something the scan alone does not (a filter, a join,
    /// a computed column), every output column is either a table column that the scan's
    /// compaction gathers or a value of a fixed-width or string type that the stage computes (a
    /// build side's column among them), and every join's build side stays on the stage's device (a
    /// build side DataFusion runs on the host is better joined there too).
    fn rows_stage(&self, node: &Arc<dyn ExecutionPlan>) -> Result<Arc<dyn ExecutionPlan>, String> {
        if node.properties().output_ordering().is_some() {
            return Err("an output ordering".into());
        }
        let below = match walk(self, node) {
            Ok(below) => below,
            Err(why) => {
                return self
                    .split_stages(node, true, |half| self.rows_stage(half))
                    .map_err(|split| format!("{why}; as two stages: {split}"));
            }
        };
        let device = below.scan.table().single_device();
        let mut joins = below.steps.iter().filter_map(|s| match s {
            Step::Join(j) => Some(j),
            Step::Filter(_) => None,
        });
        if joins.any(|j| !device.is_some_and(|d| stays_on(&j.build, d))) {
            return Err("a join whose build side does not stay on the stage's device".into());
        }
        let width = below.scan.table().schema.fields().len();
        let plain = |e: &Arc<dyn PhysicalExpr>| e.downcast_ref::<Column>().is_some_and(|c| c.index() < width);
        if below.steps.is_empty() && below.outputs.iter().all(plain) {
            return Err("nothing that the scan does not do".into());
        }
        let plan = self.finish(StagePlan {
            predicate: below.scan.predicate().cloned(),
            steps: below.steps,
            keys: vec![],
            key_types: vec![],
            key_words: vec![],
            aggs: vec![],
            rows: Some(below.outputs),
            schema: node.schema(),
            columns: vec![],
            source: None,
            table: below.scan.table().clone(),
        })?;
        Ok(Arc::new(DeviceStageExec::new(plan, Output::Rows, node.clone())))
    }

    /// `node` (a partial aggregate or rows over a join that keeps or marks rows without a match)
    /// as the union of two stages, `stage` of each of its halves (see [`outer`]). With `keep`,
    /// partitioned as `node`'s output, for the plan above it: one partition stays one, and hash
    /// partitions stay hash partitions (each the interleaving of both stages' partition, or the
    /// union repartitioned by the same hash).
    fn split_stages(
        &self,
        node: &Arc<dyn ExecutionPlan>,
        keep: bool,
        stage: impl Fn(&Arc<dyn ExecutionPlan>) -> Result<Arc<dyn ExecutionPlan>, String>,
    ) -> Result<Arc<dyn ExecutionPlan>, String> {
        let [matched, unmatched] = outer::split(node)?;
        let stages = vec![stage(&matched)?, stage(&unmatched)?];
        let partitioning = &node.properties().partitioning;
        let err = |e: ::datafusion::common::DataFusionError| e.to_string();
        let merged: Arc<dyn ExecutionPlan> = match partitioning {
            _ if !keep => UnionExec::try_new(stages).map_err(err)?,
            _ if partitioning.partition_count() == 1 => {
                Arc::new(CoalescePartitionsExec::new(UnionExec::try_new(stages).map_err(err)?))
            }
            Partitioning::Hash(..) if stages.iter().all(|s| s.properties().partitioning == *partitioning) => {
                Arc::new(InterleaveExec::try_new(stages).map_err(err)?)
            }
            // (A hash of columns the output no longer has promises nothing to the plan above.)
            Partitioning::Hash(exprs, _) if exprs.iter().all(|e| e.downcast_ref::<Column>().is_some()) => Arc::new(
                RepartitionExec::try_new(UnionExec::try_new(stages).map_err(err)?, partitioning.clone())
                    .map_err(err)?,
            ),
            _ => UnionExec::try_new(stages).map_err(err)?,
        };
        Ok(merged)
    }

    /// A `Single` or `SinglePartitioned` aggregate (`agg`, whose partial form is `partial`) over a
    /// join that keeps or marks rows without a match, as DataFusion's `Final` aggregate over the
    /// partial state of the two stages of [`split_stages`](Self::split_stages) (repartitioned by
    /// the group keys for `SinglePartitioned`): only groups cross to the host, not rows.
    fn split_single(
        &self,
        agg: &AggregateExec,
        partial: &Arc<dyn ExecutionPlan>,
        node: &Arc<dyn ExecutionPlan>,
    ) -> Result<Arc<dyn ExecutionPlan>, String> {
        let states = self.split_stages(partial, false, |half| {
            let agg = half.downcast_ref::<AggregateExec>().ok_or("not an aggregate")?;
            Ok(Arc::new(DeviceStageExec::new(
                self.lower(agg)?,
                Output::Partial,
                half.clone(),
            )))
        })?;
        let group_by = agg.group_expr().as_final();
        let (mode, input): (_, Arc<dyn ExecutionPlan>) = match agg.mode() {
            AggregateMode::SinglePartitioned => {
                let n = node.properties().partitioning.partition_count();
                let keys = group_by.expr().iter().map(|(e, _)| e.clone()).collect();
                let repartitioned =
                    RepartitionExec::try_new(states, Partitioning::Hash(keys, n)).map_err(|e| e.to_string())?;
                (AggregateMode::FinalPartitioned, Arc::new(repartitioned))
            }
            _ => (AggregateMode::Final, Arc::new(CoalescePartitionsExec::new(states))),
        };
        let final_agg = AggregateExec::try_new(
            mode,
            group_by,
            agg.aggr_expr().to_vec(),
            vec![None; agg.aggr_expr().len()],
            input,
            partial.schema(),
        )
        .map_err(|e| e.to_string())?;
        let same = |a: &arrow_schema::Schema, b: &arrow_schema::Schema| {
            a.fields().len() == b.fields().len()
                && a.fields()
                    .iter()
                    .zip(b.fields())
                    .all(|(x, y)| x.name() == y.name() && x.data_type() == y.data_type())
        };
        if !same(&final_agg.schema(), &agg.schema()) {
            return Err("a final aggregate of another schema".into());
        }
        Ok(Arc::new(final_agg))
    }

    /// `plan` (without its columns and kernels) made ready to run: when the table is where the
    /// stage can run, the table columns it reads, and its kernels, generated now so that a plan
    /// the device cannot run is never chosen (they compile when the stage first runs).
    fn finish(&self, mut plan: StagePlan) -> Result<StagePlan, String> {
        let table = &plan.table;
        let devices = &table.partition_devices;
        let cuda = devices.iter().all(|d| matches!(d, Device::Cuda(_)));
        let host = devices.iter().all(|d| d.is_host_accessible());
        if cuda && !gpu_kernels_available() {
            log::info!("arrow-cuda: device stages are off: NVRTC or the GPU is not usable here");
            return Err("no NVRTC".into());
        }
        if !(cuda || (host && self.host_stages)) {
            return Err("the table's devices".into());
        }
        if table
            .partitions
            .iter()
            .map(|p| p.iter().map(|b| b.num_rows()).sum::<usize>())
            .sum::<usize>()
            > u32::MAX as usize
        {
            return Err("more than 2^32 rows".into());
        }
        let width = plan.table.schema.fields().len();
        let mut columns: std::collections::BTreeSet<usize> =
            plan.stage_columns().into_iter().filter(|&c| c < width).collect();
        if let Some(p) = &plan.predicate {
            p.columns(&mut columns);
        }
        plan.columns = columns.into_iter().collect();
        let read = plan.stage_columns();
        // Build sides that are GPU scans on the stage's device stay there: their strings cost no copy.
        let device = plan.table.single_device().unwrap_or(Device::Cpu);
        let on_host = |j: &&JoinStep| !stays_on(&j.build, device);
        if let Some(why) = plan.joins().filter(on_host).find_map(|j| costly_build(j, &read)) {
            return Err(why);
        }
        let first = plan.table.partitions.iter().flatten().next().ok_or("an empty table")?;
        let source = codegen::generate(&plan, first).map_err(|e| e.to_string())?;
        plan.source = Some(source);
        Ok(plan)
    }
}

/// A bound on the bytes of the strings `expr` yields: the longest value of the string columns
/// (from the tables' statistics; `None` where they do not bound one) and string literals in it,
/// and for `substr`, at most the characters its start and count keep, of up to 4 bytes each. The
/// expressions a stage compiles never lengthen a string: columns, literals, `substr`, `CASE`,
/// `COALESCE`, `NULLIF`, casts between string types.
fn longest_string(expr: &Arc<dyn PhysicalExpr>, longest: &[Option<usize>]) -> Option<usize> {
    if let Some(c) = expr.downcast_ref::<Column>() {
        let n = longest.get(c.index()).copied().flatten();
        return if n == Some(UNKNOWN_LENGTH) {
            None
        } else {
            Some(n.unwrap_or(0))
        };
    }
    if let Some(l) = expr.downcast_ref::<Literal>() {
        return Some(l.value().try_as_str().flatten().map_or(0, str::len));
    }
    if let Some(f) = expr.downcast_ref::<ScalarFunctionExpr>()
        && matches!(f.name(), "substr" | "substring")
        && let [s, start, count] = f.args()
        && let (Ok(start), Ok(count)) = (int_literal(start), int_literal(count))
        && count >= 0
        && let Some((from, to)) = substr_range(start, Some(count))
    {
        let bytes = usize::try_from(to - from).ok()?.checked_mul(4)?;
        return Some(longest_string(s, longest).map_or(bytes, |n| n.min(bytes)));
    }
    expr.children()
        .into_iter()
        .try_fold(0, |bound, e| Some(bound.max(longest_string(e, longest)?)))
}

/// Adds [`DeviceStageRule`] to a session's physical optimizer rules, after DataFusion's own:
///
/// ```no_run
/// use datafusion::execution::SessionStateBuilder;
/// use datafusion::prelude::SessionContext;
///
/// let state = arrow_cuda::datafusion::with_device_stages(SessionStateBuilder::new().with_default_features()).build();
/// let ctx = SessionContext::new_with_state(state);
/// ```
pub fn with_device_stages(builder: SessionStateBuilder) -> SessionStateBuilder {
    builder.with_physical_optimizer_rule(Arc::new(DeviceStageRule::new()))
}
