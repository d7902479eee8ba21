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

use arrow_schema::DataType;

use super::super::predicate_codegen::{Codegen, PREDICATE_PRELUDE};
use super::expr::{ExprCompiler, Val};
use super::layout::{Acc, SlotKind, StagePlan, key_value_type, string_capacity};
use crate::array::DeviceRecordBatch;
use crate::error::{Error, Result};

/// What every stage kernel shares.
const STAGE_PRELUDE: &str = include_str!("../kernels/stage.cu");

/// A stage's kernels and their literal buffer.
#[derive(Debug)]
pub(crate) struct StageSource {
    pub(crate) source: String,
    pub(crate) literals: Vec<u8>,
}

/// Generates the kernels of `plan` for batches shaped like `batch` (the table's schema).
pub(crate) fn generate(plan: &StagePlan, batch: &DeviceRecordBatch) -> Result<StageSource> {
    let schema = batch.schema();
    let mut g = Codegen::new(batch);
    let (key_offsets, nw) = plan.key_layout();
    let (slots, first) = plan.slot_layout();
    let decls: String = plan.columns.iter().map(|&c| g.column_decl(c)).collect::<Result<_>>()?;
    let params: String = plan.columns.iter().map(|&c| Codegen::column_params(c)).collect();

    // The rows kept: the scan's predicate and the filters above it.
    let keep = |g: &mut Codegen| -> Result<String> {
        let mut terms = Vec::new();
        if let Some(p) = &plan.predicate {
            let (v, k) = g.emit(p)?;
            terms.push(format!("({k} && {v})"));
        }
        for f in &plan.filters {
            let mut c = ExprCompiler::new(g, schema);
            let val = c.compile(f)?;
            if val.dt != DataType::Boolean {
                return Err(Error::Unsupported("a filter that is not boolean".into()));
            }
            terms.push(format!("({} && {})", val.k, val.v));
        }
        Ok(if terms.is_empty() {
            "true".into()
        } else {
            terms.join(" && ")
        })
    };

    let mut source = String::from(PREDICATE_PRELUDE);
    source.push_str(STAGE_PRELUDE);

    // stage_groups
    if nw > 0 {
        g.body.clear();
        let kept = keep(&mut g)?;
        g.body
            .push_str(&format!("    if (!({kept})) {{ row_group[i] = NO_GROUP; }} else {{\n"));
        g.body.push_str(&format!("    u64 kw[{nw}]; u64 nulls = 0;\n"));
        for (j, (key, dt)) in plan.keys.iter().zip(&plan.key_types).enumerate() {
            let val = ExprCompiler::new(&mut g, schema).compile(key)?;
            if &val.dt != key_value_type(dt) {
                return Err(Error::Unsupported(format!("group key of type {} for {dt}", val.dt)));
            }
            encode_key(&mut g.body, &val, key_offsets[j], plan.key_words[j], j)?;
        }
        g.body.push_str(&format!("    kw[{}] = nulls;\n", nw - 1));
        g.body.push_str(&format!(
            "    row_group[i] = group_of(kw, {nw}, state, keys, mask, group_keys, count, (u32)max_groups, flags);\n    }}\n"
        ));
        source.push_str(&format!(
            "extern \"C\" __global__ void stage_groups(u64 n, u32* row_group, u32* state, u64* keys, u64 mask, \
             u64* group_keys, u32* count, u64 max_groups, u32* flags, const unsigned char* lit{params}) {{\n\
             \x20   u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;\n    if (i >= n) return;\n\
             \x20   bool ovf = false, dz = false;\n{decls}{}\
             \x20   if (ovf) atomicOr(flags, FLAG_OVERFLOW);\n    if (dz) atomicOr(flags, FLAG_DIV_ZERO);\n}}\n",
            g.body
        ));
    }

    // stage_accumulate
    g.body.clear();
    let group = if nw > 0 {
        "u32 g = row_group[i];\n    if (g != NO_GROUP) {\n".to_string()
    } else {
        let kept = keep(&mut g)?;
        let pre = std::mem::take(&mut g.body);
        format!("{pre}    u32 g = 0;\n    if ({kept}) {{\n")
    };
    for (a, spec) in plan.aggs.iter().enumerate() {
        let s0 = first[a];
        g.body.push_str("    {\n");
        let fk = match &spec.filter {
            Some(f) => {
                let v = ExprCompiler::new(&mut g, schema).compile(f)?;
                format!("({} && {})", v.k, v.v)
            }
            None => "true".into(),
        };
        let v = ExprCompiler::new(&mut g, schema).compile(&spec.arg)?;
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
         u64 shared, u32* flags, const unsigned char* lit, const u64* refs, u64 batch{params}) {{\n\
         \x20   extern __shared__ u64 sh[];\n\
         \x20   const u64 nslots = {nslots};\n\
         \x20   if (shared) {{\n\
         \x20       for (u64 t = threadIdx.x; t < nslots * groups; t += blockDim.x) {{\n\
         \x20           u64 s = t / groups; u64 v = 0;\n{init}\
         \x20           sh[t] = v;\n        }}\n        __syncthreads();\n    }}\n\
         \x20   u64* base = shared ? sh : acc;\n    u64 st = shared ? groups : stride;\n\
         \x20   bool ovf = false, dz = false;\n\
         \x20   for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {{\n\
         {decls}    {group}{}    }}\n    }}\n\
         \x20   if (ovf) atomicOr(flags, FLAG_OVERFLOW);\n    if (dz) atomicOr(flags, FLAG_DIV_ZERO);\n\
         \x20   if (shared) {{\n        __syncthreads();\n\
         \x20       for (u64 t = threadIdx.x; t < nslots * groups; t += blockDim.x) {{\n\
         \x20           u64 s = t / groups, gg = t % groups; u64 x = sh[t];\n{flush}\
         \x20       }}\n    }}\n}}\n",
        g.body
    ));

    source.push_str(&format!(
        "extern \"C\" __global__ void stage_init(u64* acc, u64 stride, u64 from, u64 to) {{\n\
         \x20   u64 i = from + (u64)blockIdx.x * blockDim.x + threadIdx.x;\n    if (i >= to) return;\n\
         \x20   for (u64 s = 0; s < {nslots}; s++) {{\n        u64 v = 0;\n{init}\
         \x20       acc[s * stride + i] = v;\n    }}\n}}\n"
    ));
    let literals = g.literal_buffer()?;
    Ok(StageSource { source, literals })
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
