//! The CUDA C of a stage: three kernels generated from a [`StagePlan`], after the predicate
//! prelude and `kernels/stage.cu`.
//!
//! - `stage_groups(n, row_group, state, keys, mask, group_keys, count, max_groups, flags, lit,
//!   columns...)`: one thread per row evaluates the scan's predicate and the filters, computes the
//!   row's key words and finds (or inserts) its group in an open-addressing table; it writes the
//!   group id of each row, or `NO_GROUP` for rows filtered out. Only for stages with keys.
//! - `stage_accumulate(n, row_group, acc, stride, groups, shared, flags, lit, columns...)`: a
//!   grid-stride pass that evaluates every aggregate's filter and argument for the rows of a group
//!   and adds them to the accumulator slots, in shared memory per block when the groups' slots fit
//!   there (then merged with one atomic per slot and block), else in global memory. Without keys it
//!   evaluates the predicate and filters itself: scan, filter, projection and aggregation are one
//!   pass, and no filtered column is materialized.
//! - `stage_init(acc, stride, from, to)`: sets the slots of groups `from..to` to their initial
//!   values.
//!
//! Every scalar parameter is a `u64`. The literal buffer holds the predicate's and the expressions'
//! literals, so the source depends only on the plan's shape and types.

use std::sync::Arc;

use ::datafusion::physical_expr::PhysicalExpr;
use ::datafusion::physical_expr::expressions::Column;
use arrow_schema::{DataType, Schema};

use super::super::predicate_codegen::{Codegen, LateLiteral, PREDICATE_PRELUDE};
use super::expr::{ExprCompiler, Val, int_width};
use super::layout::{Acc, JoinKind, JoinStep, SlotKind, StagePlan, Step, key_value_type, string_capacity};
use crate::array::DeviceRecordBatch;
use crate::error::{Error, Result};

/// What every stage kernel shares.
const STAGE_PRELUDE: &str = include_str!("../kernels/stage.cu");

/// A stage's kernels and their literal buffer.
#[derive(Clone, Debug)]
pub(crate) struct StageSource {
    pub(crate) source: String,
    pub(crate) literals: Vec<u8>,
    /// The literals (slots of `literals`) whose values are known only when the stage runs.
    pub(crate) late: Vec<LateLiteral>,
}

/// Generates the kernels of `plan` for batches shaped like `batch` (the table's schema).
pub(crate) fn generate(plan: &StagePlan, batch: &DeviceRecordBatch) -> Result<StageSource> {
    let schema = plan.columns_schema();
    let width = batch.num_columns();
    let types = batch
        .columns()
        .iter()
        .map(|c| c.data_type().clone())
        .chain(schema.fields().iter().skip(width).map(|f| f.data_type().clone()))
        .collect();
    let mut g = Codegen::over(types);
    let (key_offsets, nw) = plan.key_layout();
    let (slots, first) = plan.slot_layout();
    let built: Vec<usize> = plan.stage_columns().into_iter().filter(|&c| c >= width).collect();
    let decls: String = plan.columns.iter().map(|&c| g.column_decl(c)).collect::<Result<_>>()?;
    let joins: Vec<&JoinStep> = plan.joins().collect();
    let params: String = plan
        .columns
        .iter()
        .chain(&built)
        .map(|&c| Codegen::column_params(c))
        .chain((0..joins.len()).map(|k| format!(", const u32* jt{k}, const u64* jk{k}, u64 jm{k}, u64 jr{k}")))
        .collect();

    let mut source = String::from(PREDICATE_PRELUDE);
    source.push_str(STAGE_PRELUDE);
    for (k, j) in joins.iter().enumerate() {
        source.push_str(&build_kernel(&mut g, &schema, j, k)?);
    }
    // Each join's columns are read at its match from here on.
    for (k, j) in joins.iter().enumerate() {
        for &c in built.iter().filter(|&&c| join_of(&joins, c) == Some(j.base)) {
            g.read_at(c, Some(&format!("j{k}")));
        }
    }

    // stage_groups
    if nw > 0 {
        g.body.clear();
        g.body.push_str("    u32 rg = NO_GROUP;\n");
        let open = emit_rows(&mut g, plan, &schema, &built)?;
        g.body.push_str(&format!("    u64 kw[{nw}]; u64 nulls = 0;\n"));
        for (j, (key, dt)) in plan.keys.iter().zip(&plan.key_types).enumerate() {
            let val = ExprCompiler::new(&mut g, &schema).compile(key)?;
            if &val.dt != key_value_type(dt) {
                return Err(Error::Unsupported(format!("group key of type {} for {dt}", val.dt)));
            }
            encode_key(&mut g.body, &val, key_offsets[j], plan.key_words[j], j)?;
        }
        g.body.push_str(&format!("    kw[{}] = nulls;\n", nw - 1));
        g.body.push_str(&format!(
            "    rg = group_of(kw, {nw}, state, keys, mask, group_keys, count, (u32)max_groups, flags);\n"
        ));
        for k in 0..joins.len() {
            g.body.push_str(&format!("    jrows[(u64){k} * n + i] = j{k};\n"));
        }
        g.body.push_str(&"    }\n".repeat(open));
        g.body.push_str("    row_group[i] = rg;\n");
        source.push_str(&format!(
            "extern \"C\" __global__ void stage_groups(u64 n, u32* row_group, u32* state, u64* keys, u64 mask, \
             u64* group_keys, u32* count, u64 max_groups, u32* flags, const unsigned char* lit, u32* jrows{params}) {{\n\
             \x20   u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;\n    if (i >= n) return;\n\
             \x20   bool ovf = false, dz = false;\n{decls}{}\
             \x20   if (ovf) atomicOr(flags, FLAG_OVERFLOW);\n    if (dz) atomicOr(flags, FLAG_DIV_ZERO);\n}}\n",
            g.body
        ));
    }

    // stage_accumulate
    g.body.clear();
    let open = if nw > 0 {
        g.body.push_str("    u32 g = row_group[i];\n    if (g != NO_GROUP) {\n");
        for k in 0..joins.len() {
            g.body.push_str(&format!("    u32 j{k} = jrows[(u64){k} * n + i];\n"));
        }
        for &c in &built {
            let decl = g.column_decl(c)?;
            g.body.push_str(&decl);
        }
        1
    } else {
        let open = emit_rows(&mut g, plan, &schema, &built)?;
        g.body.push_str("    u32 g = 0;\n");
        open
    };
    for (a, spec) in plan.aggs.iter().enumerate() {
        let s0 = first[a];
        g.body.push_str("    {\n");
        let fk = match &spec.filter {
            Some(f) => {
                let v = ExprCompiler::new(&mut g, &schema).compile(f)?;
                format!("({} && {})", v.k, v.v)
            }
            None => "true".into(),
        };
        let v = ExprCompiler::new(&mut g, &schema).compile(&spec.arg)?;
        let slot = |s: usize| format!("base + (u64){} * st + g", s0 + s);
        let update = match spec.acc {
            Acc::Count => String::new(),
            Acc::Int128 => format!("add128({}, {}, {}, (i128){});", slot(1), slot(2), slot(3), v.v),
            Acc::Float => format!("add_f64({}, (double){});", slot(1), v.v),
            Acc::MinI64 => format!("min_i64({}, (long long){});", slot(1), v.v),
            Acc::MaxI64 => format!("max_i64({}, (long long){});", slot(1), v.v),
            Acc::MinF64 => format!("min_i64({}, ordered_f64((double){}));", slot(1), v.v),
            Acc::MaxF64 => format!("max_i64({}, ordered_f64((double){}));", slot(1), v.v),
            Acc::MinRow | Acc::MaxRow => {
                let c = spec
                    .row_column()
                    .ok_or_else(|| Error::Unsupported("a row-reference aggregate of an expression".into()))?;
                format!("row_update{a}({}, ((u64)batch << 32) | e{c}, refs);", slot(1))
            }
        };
        g.body.push_str(&format!(
            "    if ({fk} && {}) {{ add_u64({}, 1ull); {update} }}\n    }}\n",
            v.k,
            slot(0)
        ));
    }
    let nslots = slots.len();
    let mut flush = String::new();
    for (s, kind) in slots.iter().enumerate() {
        let row_update = first
            .iter()
            .rposition(|&f| f <= s)
            .map(|a| format!("row_update{a}(p, x, refs)"));
        let (test, merge) = match kind {
            SlotKind::MinRow | SlotKind::MaxRow => ("x != NO_ROW", row_update.as_deref().unwrap_or("")),
            SlotKind::Add => ("x != 0", "atomicAdd((unsigned long long*)p, x)"),
            SlotKind::AddF64 => ("x != 0", "atomicAdd((double*)p, __longlong_as_double((long long)x))"),
            SlotKind::Min => (
                "(long long)x != 9223372036854775807LL",
                "atomicMin((long long*)p, (long long)x)",
            ),
            SlotKind::Max => (
                "(long long)x != (-9223372036854775807LL - 1)",
                "atomicMax((long long*)p, (long long)x)",
            ),
        };
        flush.push_str(&format!(
            "        if (s == {s}) {{ u64* p = acc + (u64){s} * stride + gg; if ({test}) {merge}; }}\n"
        ));
    }
    let init: String = slots
        .iter()
        .enumerate()
        .map(|(s, k)| format!("        if (s == {s}) v = {}ull;\n", k.init()))
        .collect();
    source.push_str(&row_functions(plan)?);
    source.push_str(&format!(
        "extern \"C\" __global__ void stage_accumulate(u64 n, const u32* row_group, u64* acc, u64 stride, u64 groups, \
         u64 shared, u32* flags, const unsigned char* lit, const u64* refs, u64 batch, const u32* jrows{params}) {{\n\
         \x20   extern __shared__ u64 sh[];\n\
         \x20   const u64 nslots = {nslots};\n\
         \x20   if (shared) {{\n\
         \x20       for (u64 t = threadIdx.x; t < nslots * groups; t += blockDim.x) {{\n\
         \x20           u64 s = t / groups; u64 v = 0;\n{init}\
         \x20           sh[t] = v;\n        }}\n        __syncthreads();\n    }}\n\
         \x20   u64* base = shared ? sh : acc;\n    u64 st = shared ? groups : stride;\n\
         \x20   bool ovf = false, dz = false;\n\
         \x20   for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {{\n\
         {decls}{}{}    }}\n\
         \x20   if (ovf) atomicOr(flags, FLAG_OVERFLOW);\n    if (dz) atomicOr(flags, FLAG_DIV_ZERO);\n\
         \x20   if (shared) {{\n        __syncthreads();\n\
         \x20       for (u64 t = threadIdx.x; t < nslots * groups; t += blockDim.x) {{\n\
         \x20           u64 s = t / groups, gg = t % groups; u64 x = sh[t];\n{flush}\
         \x20       }}\n    }}\n}}\n",
        g.body,
        "    }\n".repeat(open)
    ));

    source.push_str(&format!(
        "extern \"C\" __global__ void stage_init(u64* acc, u64 stride, u64 from, u64 to) {{\n\
         \x20   u64 i = from + (u64)blockIdx.x * blockDim.x + threadIdx.x;\n    if (i >= to) return;\n\
         \x20   for (u64 s = 0; s < {nslots}; s++) {{\n        u64 v = 0;\n{init}\
         \x20       acc[s * stride + i] = v;\n    }}\n}}\n"
    ));
    if let Some(rows) = &plan.rows {
        source.push_str(&rows_kernels(&mut g, plan, &schema, &built, (&decls, &params), rows)?);
    }
    let literals = g.literal_buffer()?;
    Ok(StageSource {
        source,
        literals,
        late: std::mem::take(&mut g.late),
    })
}

/// A rows stage's kernels:
///
/// - `stage_select(n, sel, flags, lit, columns...)`: one thread per row runs the row pipeline and
///   writes a selection byte, 1 for each row it keeps;
/// - `stage_project(m, idx, flags, lit, nulls, outputs..., columns...)`: one thread per kept row
///   (`idx`, the selected rows' indices) runs the pipeline for its row again, to reach the values
///   its outputs read, and writes each computed output column at the thread's position: the
///   value, and the validity bitmap (a boolean's values too) by warp votes, with the column's null
///   count. A string output (`Utf8`, `LargeUtf8`, `Utf8View`) is written by reference: the address
///   of its bytes (in a column or the literal buffer: the expressions never make new bytes) and
///   its length, from which the scan's kernels assemble the column
///   (`device_filter::strings_from_refs`). Output columns that copy a table column are gathered by
///   the scan's kernels instead.
fn rows_kernels(
    g: &mut Codegen,
    plan: &StagePlan,
    schema: &Schema,
    built: &[usize],
    (decls, params): (&str, &str),
    rows: &[Arc<dyn PhysicalExpr>],
) -> Result<String> {
    g.body.clear();
    let open = emit_rows(g, plan, schema, built)?;
    let select = format!(
        "extern \"C\" __global__ void stage_select(u64 n, unsigned char* sel, u32* flags, const unsigned char* lit{params}) {{\n\
         \x20   u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;\n    if (i >= n) return;\n\
         \x20   bool ovf = false, dz = false;\n    unsigned char keep = 0;\n{decls}{}    keep = 1;\n{}\
         \x20   sel[i] = keep;\n\
         \x20   if (ovf) atomicOr(flags, FLAG_OVERFLOW);\n    if (dz) atomicOr(flags, FLAG_DIV_ZERO);\n}}\n",
        g.body,
        "    }\n".repeat(open)
    );
    g.body.clear();
    let open = emit_rows(g, plan, schema, built)?;
    let (mut vars, mut outs, mut writes) = (String::new(), String::new(), String::new());
    // `n`: the output's place among the computed ones (its null count's).
    let computed = rows.iter().enumerate().filter(|(k, _)| plan.gathered(*k).is_none());
    for (n, (k, expr)) in computed.enumerate() {
        let dt = plan.schema.field(k).data_type();
        let val = ExprCompiler::new(g, schema).compile(expr)?;
        if &val.dt != dt {
            return Err(Error::Unsupported(format!("an output column of {} for {dt}", val.dt)));
        }
        let held = super::expr::c_type(dt).ok_or_else(|| Error::Unsupported(format!("an output column of {dt}")))?;
        vars.push_str(&format!("    {held} rv{k} = 0; bool rk{k} = false;\n"));
        g.body.push_str(&format!("    rv{k} = {}; rk{k} = {};\n", val.v, val.k));
        outs.push_str(&format!(", void* ro{k}, u32* rb{k}"));
        let value = match (dt, &val.len) {
            (DataType::Boolean, _) => format!(
                "u32 bv = __ballot_sync(0xffffffffu, live && rk{k} && rv{k}); if (lane0) ((u32*)ro{k})[t >> 5] = bv;"
            ),
            // A string by reference: the address of its bytes and its length.
            (_, Some(len)) => {
                vars.push_str(&format!("    u64 rl{k} = 0;\n"));
                g.body.push_str(&format!("    rl{k} = {len};\n"));
                outs.push_str(&format!(", u64* rz{k}"));
                format!("if (live) {{ ((u64*)ro{k})[t] = rk{k} ? (u64)rv{k} : 0; rz{k}[t] = rk{k} ? rl{k} : 0; }}")
            }
            (_, None) => {
                let ty = stored(dt)?;
                format!("if (live) (({ty}*)ro{k})[t] = rk{k} ? ({ty})rv{k} : 0;")
            }
        };
        writes.push_str(&format!(
            "    {{\n    u32 b = __ballot_sync(0xffffffffu, live && rk{k});\n\
             \x20   if (lane0) {{ rb{k}[t >> 5] = b; u32 z = alive & ~b; \
             if (z) atomicAdd((unsigned long long*)&rnulls[{n}], (unsigned long long)__popc(z)); }}\n\
             \x20   {value}\n    }}\n"
        ));
    }
    let project = format!(
        "extern \"C\" __global__ void stage_project(u64 m, const u32* idx, u32* flags, const unsigned char* lit, \
         u64* rnulls{outs}{params}) {{\n\
         \x20   u64 t = (u64)blockIdx.x * blockDim.x + threadIdx.x;\n    bool live = t < m;\n\
         \x20   u32 alive = __ballot_sync(0xffffffffu, live);\n    bool lane0 = live && (threadIdx.x & 31) == 0;\n\
         \x20   bool ovf = false, dz = false;\n{vars}\
         \x20   if (live) {{\n    u64 i = idx[t];\n{decls}{}{}    }}\n{writes}\
         \x20   if (ovf) atomicOr(flags, FLAG_OVERFLOW);\n    if (dz) atomicOr(flags, FLAG_DIV_ZERO);\n}}\n",
        g.body,
        "    }\n".repeat(open)
    );
    Ok(select + &project)
}

/// The C type of an output column's values of `dt` (Arrow's layout).
fn stored(dt: &DataType) -> Result<&'static str> {
    match dt {
        DataType::Float32 => Ok("float"),
        DataType::Float64 => Ok("double"),
        DataType::Decimal128(..) => Ok("i128"),
        other => int_width(other).ok_or_else(|| Error::Unsupported(format!("an output column of {other}"))),
    }
}

/// The base column of the join whose build side stage column `c` belongs to.
fn join_of(joins: &[&JoinStep], c: usize) -> Option<usize> {
    joins.iter().map(|j| j.base).filter(|&b| b <= c).max()
}

/// `join<k>_build(n, slots, keys, mask, flags, lit, columns...)`: one thread per build row inserts
/// the row into join `k`'s table under its key words; rows with a null key never match and stay
/// out (raising `FLAG_NULL_BUILD_KEY`, which `NOT IN`'s null rule asks for).
fn build_kernel(g: &mut Codegen, schema: &Schema, j: &JoinStep, k: usize) -> Result<String> {
    let columns: Vec<usize> = j.key_columns().iter().map(|&key| j.base + key).collect();
    let (offsets, nw) = j.key_layout();
    g.body.clear();
    g.body.push_str(&format!("    u64 kw[{nw}]; u64 nulls = 0;\n"));
    for (i, &key) in j.keys.iter().enumerate() {
        let column: Arc<dyn PhysicalExpr> = Arc::new(Column::new(schema.field(j.base + key).name(), j.base + key));
        let val = ExprCompiler::new(g, schema).compile(&column)?;
        encode_key(&mut g.body, &val, offsets[i], j.words[i], i)?;
    }
    let decls: String = columns.iter().map(|&c| g.column_decl(c)).collect::<Result<_>>()?;
    let params: String = columns.iter().map(|&c| Codegen::column_params(c)).collect();
    Ok(format!(
        "extern \"C\" __global__ void join{k}_build(u64 n, u32* slots, u64* keys, u64 mask, u32* flags, \
         const unsigned char* lit{params}) {{\n\
         \x20   u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;\n    if (i >= n) return;\n\
         \x20   bool ovf = false, dz = false;\n{decls}{}\
         \x20   if (nulls == 0) join_insert(kw, {nw}, (u32)i, slots, keys, mask);\n\
         \x20   else atomicOr(flags, FLAG_NULL_BUILD_KEY);\n}}\n",
        g.body
    ))
}

/// Emits the row pipeline: the scan's predicate, then the filters and hash joins in plan order,
/// each opening the block of the rows it keeps (closed by the caller: the count is returned), so
/// nothing is evaluated for a row an earlier step dropped. A join leaves its match in `j<k>`
/// (`NO_MATCH` without one) and declares the build columns the stage reads (`built`).
fn emit_rows(g: &mut Codegen, plan: &StagePlan, schema: &Schema, built: &[usize]) -> Result<usize> {
    let mut open = 0;
    if let Some(p) = &plan.predicate {
        let (v, k) = g.emit(p)?;
        g.body.push_str(&format!("    if ({k} && {v}) {{\n"));
        open += 1;
    }
    let joins: Vec<&JoinStep> = plan.joins().collect();
    let mut k = 0;
    for step in &plan.steps {
        match step {
            Step::Filter(f) => {
                let val = ExprCompiler::new(g, schema).compile(f)?;
                if val.dt != DataType::Boolean {
                    return Err(Error::Unsupported("a filter that is not boolean".into()));
                }
                g.body.push_str(&format!("    if ({} && {}) {{\n", val.k, val.v));
                open += 1;
            }
            Step::Join(j) => {
                let mine: Vec<usize> = built
                    .iter()
                    .copied()
                    .filter(|&c| join_of(&joins, c) == Some(j.base))
                    .collect();
                emit_probe(g, schema, j, k, &mine)?;
                match j.kind {
                    JoinKind::Inner | JoinKind::Semi => {
                        g.body.push_str(&format!("    if (j{k} != NO_MATCH) {{\n"));
                        open += 1;
                    }
                    JoinKind::Anti => {
                        g.body.push_str(&format!("    if (j{k} == NO_MATCH) {{\n"));
                        open += 1;
                    }
                    JoinKind::NullAwareAnti => {
                        g.body.push_str(&format!(
                            "    if (jr{k} != BUILD_NULL_KEY && j{k} == NO_MATCH && (!jz{k} || jr{k} == BUILD_EMPTY)) {{\n"
                        ));
                        open += 1;
                    }
                    JoinKind::Right => {}
                }
                for &c in &mine {
                    let decl = g.column_decl(c)?;
                    g.body.push_str(&decl);
                }
                k += 1;
            }
        }
    }
    Ok(open)
}

/// Finds row `i`'s match in join `k`'s table: the first build row with equal keys (and, with a
/// filter, the first for which the filter is true), into `j<k>`.
fn emit_probe(g: &mut Codegen, schema: &Schema, j: &JoinStep, k: usize, mine: &[usize]) -> Result<()> {
    let mut vals = Vec::with_capacity(j.probe.len());
    g.body
        .push_str(&format!("    u32 j{k} = NO_MATCH; bool jz{k} = false;\n    {{\n"));
    for p in &j.probe {
        vals.push(ExprCompiler::new(g, schema).compile(p)?);
    }
    let (offsets, nw) = j.key_layout();
    g.body.push_str(&format!("    u64 kw[{nw}]; u64 nulls = 0;\n"));
    for (i, val) in vals.iter().enumerate() {
        encode_key(&mut g.body, val, offsets[i], j.words[i], i)?;
    }
    g.body.push_str(&format!("    jz{k} = nulls != 0;\n"));
    let next = |from: &str| format!("join_next(kw, {nw}, jt{k}, jk{k}, jm{k}, {from})");
    g.body.push_str(&format!(
        "    if (nulls == 0) for (u64 s = {}; s != NO_SLOT; s = {}) {{\n    j{k} = jt{k}[s] - 1;\n",
        next(&format!("key_hash(kw, {nw}) & jm{k}")),
        next(&format!("(s + 1) & jm{k}"))
    ));
    match &j.filter {
        Some(f) => {
            g.body.push_str("    {\n");
            for &c in mine {
                let decl = g.column_decl(c)?;
                g.body.push_str(&decl);
            }
            let val = ExprCompiler::new(g, schema).compile(f)?;
            g.body.push_str(&format!(
                "    if ({} && {}) break;\n    }}\n    j{k} = NO_MATCH;\n",
                val.k, val.v
            ));
        }
        None => g.body.push_str("    break;\n"),
    }
    g.body.push_str("    }\n    }\n");
    Ok(())
}

/// For each row-reference aggregate `a`, `row_update<a>(slot, row, refs)`: replaces the row in
/// `slot` with `row` while `row`'s value is less (`MIN`) or greater (`MAX`) than the slot's, with
/// a compare-and-swap loop. `refs` holds, per batch of the device and per row-reference
/// aggregate (in plan order), the column's values and data buffers (see `DeviceStage`).
fn row_functions(plan: &StagePlan) -> Result<String> {
    let rows: Vec<usize> = (0..plan.aggs.len())
        .filter(|&a| plan.aggs[a].row_column().is_some())
        .collect();
    let mut out = String::new();
    for (k, &a) in rows.iter().enumerate() {
        let spec = &plan.aggs[a];
        let c = spec.row_column().expect("a row-reference aggregate");
        let dt = plan.table.schema.field(c).data_type();
        let nrows = rows.len();
        // The value of row `r` as `(p, l)` bytes or `v`, an `i128`.
        let read = |r: &str| -> Result<String> {
            let t =
                format!("const u64* t{r} = refs + (({r} >> 32) * {nrows} + {k}) * 2; u64 e{r} = {r} & 0xFFFFFFFFull;");
            Ok(match dt {
                DataType::Utf8 => format!(
                    "{t} const int* o{r} = (const int*)t{r}[0]; const unsigned char* p{r} = (const unsigned char*)t{r}[1] + o{r}[e{r}]; \
                     u64 l{r} = (u64)(o{r}[e{r} + 1] - o{r}[e{r}]);"
                ),
                DataType::LargeUtf8 => format!(
                    "{t} const long long* o{r} = (const long long*)t{r}[0]; \
                     const unsigned char* p{r} = (const unsigned char*)t{r}[1] + o{r}[e{r}]; u64 l{r} = (u64)(o{r}[e{r} + 1] - o{r}[e{r}]);"
                ),
                DataType::Utf8View => format!(
                    "{t} const unsigned char* w{r} = (const unsigned char*)t{r}[0] + 16 * e{r}; u64 l{r} = *(const u32*)w{r}; \
                     const unsigned char* p{r} = l{r} <= 12 ? w{r} + 4 : \
                     (const unsigned char*)(((const u64*)t{r}[1])[*(const u32*)(w{r} + 8)]) + *(const u32*)(w{r} + 12);"
                ),
                DataType::Decimal128(..) => {
                    format!("{t} i128 v{r} = *(const i128*)((const unsigned char*)t{r}[0] + 16 * e{r});")
                }
                other => return Err(Error::Unsupported(format!("MIN or MAX of {other}"))),
            })
        };
        let cmp = if matches!(dt, DataType::Decimal128(..)) {
            "(vx < vy ? -1 : (vx > vy ? 1 : 0))"
        } else {
            "str_cmp(px, lx, py, ly)"
        };
        let better = if spec.acc == Acc::MinRow { "< 0" } else { "> 0" };
        out.push_str(&format!(
            "__device__ __forceinline__ int row_cmp{a}(u64 x, u64 y, const u64* refs) {{\n    {}\n    {}\n    return {cmp};\n}}\n\
             __device__ void row_update{a}(u64* p, u64 row, const u64* refs) {{\n\
             \x20   u64 x = row, cur = *(volatile u64*)p;\n\
             \x20   while (cur == NO_ROW || row_cmp{a}(x, cur, refs) {better}) {{\n\
             \x20       u64 prev = atomicCAS((unsigned long long*)p, cur, x);\n\
             \x20       if (prev == cur) return;\n        cur = prev;\n    }}\n}}\n",
            read("x")?,
            read("y")?,
        ));
    }
    Ok(out)
}

/// Writes the `words` key words of `val` at `kw[at..]`, and its null bit `j`. A string's bytes fill
/// the words from the first, its length the last word's top byte.
fn encode_key(body: &mut String, val: &Val, at: usize, words: usize, j: usize) -> Result<()> {
    let (v, k) = (&val.v, &val.k);
    let code = match &val.dt {
        DataType::Decimal128(..) => {
            format!(
                "kw[{at}] = {k} ? (u64){v} : 0; kw[{}] = {k} ? (u64)({v} >> 64) : 0;",
                at + 1
            )
        }
        DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View => {
            let l = val.len.as_ref().expect("string");
            let cap = string_capacity(words);
            let last = at + words - 1;
            format!(
                "for (int t = 0; t < {words}; t++) kw[{at} + t] = 0; \
                 if ({k}) {{ if ({l} > {cap}) atomicOr(flags, FLAG_LONG_KEY); \
                 for (u64 t = 0; t < {l} && t < {cap}; t++) kw[{at} + (t >> 3)] |= (u64){v}[t] << (8 * (t & 7)); \
                 kw[{last}] |= (u64){l} << 56; }}"
            )
        }
        DataType::Boolean => format!("kw[{at}] = {k} ? (u64){v} : 0;"),
        _ => format!("kw[{at}] = {k} ? (u64)(long long){v} : 0;"),
    };
    body.push_str(&format!("    {code} if (!{k}) nulls |= 1ull << {j};\n"));
    Ok(())
}
