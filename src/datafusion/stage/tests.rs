//! Unit tests of the stage compiler: which plans get a stage, and that the generated CUDA C parses
//! (as C++ with a few CUDA declarations; the GPU run compiles it with NVRTC for real).

use std::sync::Arc;

use ::datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
use ::datafusion::execution::SessionStateBuilder;
use ::datafusion::physical_plan::ExecutionPlan;
use ::datafusion::physical_plan::aggregates::AggregateExec;
use ::datafusion::prelude::{SessionConfig, SessionContext};
use arrow_array::{
    ArrayRef, BooleanArray, Date32Array, Decimal128Array, DictionaryArray, Float64Array, Int8Array, Int32Array,
    Int64Array, RecordBatch, StringArray,
};

use super::DeviceStageRule;
use super::exec::DeviceStageExec;
use crate::datafusion::{GpuTable, LoadOptions, cuda_as_cpp};
use crate::device::Device;

fn table() -> GpuTable {
    table_in(1)
}

/// The test table, its 100 rows spread over `partitions` partitions.
fn table_in(partitions: usize) -> GpuTable {
    let n = 100;
    let columns: Vec<(&str, ArrayRef)> = vec![
        (
            "a",
            Arc::new(Int32Array::from_iter((0..n).map(|i| (i % 7 != 0).then_some(i)))),
        ),
        (
            "b",
            Arc::new(Int64Array::from_iter_values((0..n).map(|i| i as i64 * 3))),
        ),
        (
            "d",
            Arc::new(
                Decimal128Array::from_iter_values((0..n).map(|i| i as i128 * 101))
                    .with_precision_and_scale(12, 2)
                    .unwrap(),
            ),
        ),
        (
            "f",
            Arc::new(Float64Array::from_iter_values((0..n).map(|i| i as f64 / 4.0))),
        ),
        (
            "s",
            Arc::new(StringArray::from_iter_values((0..n).map(|i| format!("k{}", i % 5)))),
        ),
        ("t", Arc::new(Date32Array::from_iter_values((0..n).map(|i| 9000 + i)))),
        (
            "flag",
            Arc::new(BooleanArray::from_iter((0..n).map(|i| Some(i % 3 == 0)))),
        ),
        (
            "w",
            Arc::new(
                Decimal128Array::from_iter_values((0..n).map(|i| (i as i128 - 50) * 10i128.pow(25)))
                    .with_precision_and_scale(30, 4)
                    .unwrap(),
            ),
        ),
        (
            "ds",
            Arc::new(DictionaryArray::new(
                Int8Array::from_iter((0..n).map(|i| (i % 4 != 0).then_some((i % 3) as i8))),
                Arc::new(StringArray::from(vec![Some("x"), None, Some("zz")])),
            )),
        ),
    ];
    let batch = RecordBatch::try_from_iter(columns).unwrap();
    let share = (n as usize).div_ceil(partitions);
    let parts = (0..partitions)
        .map(|p| vec![batch.slice(p * share, share.min(n as usize - p * share))])
        .collect();
    GpuTable::try_new(batch.schema(), parts, &LoadOptions::new().with_device(Device::Cpu)).unwrap()
}

/// Queries whose aggregate a stage runs, covering every expression the compiler handles.
pub(crate) const STAGED: &[&str] = &[
    "select sum(d * (1 - d)), avg(d), count(*) from t where b > 10",
    "select s, sum(a + 1), min(t), max(b), avg(f) from t group by s",
    "select flag, min(f), max(f), min(f - 20.0), max(cast(a as real)), max(cast(f * 3.0 as real)) from t where a > 3 group by flag",
    "select a % 3, t, count(a) filter (where f > 2.0) from t group by a % 3, t",
    "select flag, d, sum(case when s like 'k_%' then d * 2 else d / 3 end) from t group by flag, d",
    "select sum(cast(a as bigint) * b), sum(cast(a as double)), sum(cast(b as decimal(20, 3))) from t \
     where s in ('k1', 'k2') and not (f < 1.5) and a is not null",
    "select extract(year from t), date_part('month', t), count(*) from t \
     where s not like '%3' and (a > 5 or d < 2.5) group by 1, 2",
    "select sum(b / (a + 1)), sum(f * f - 1.5) from t where a is null or b >= a",
    "select substr(s, 2), substring(s from 0 for 2), count(*) from t where substring(s, 1, 1) = 'k' \
     and substr(s, -1, 3) like 'k%' and substr(s, 2, 5) in ('1', '3') group by 1, 2",
    "select t + interval '1 month 2 days', sum(a) from t where t + interval '3' month > date '1995-01-01' \
     and t - interval '10' day < date '1996-01-01' and t - interval '1' year < t group by 1",
    "select sum(cast(d as decimal(10, 1))) as d1, sum(cast(d * 2 as decimal(20, 0))) as d0, sum(cast(f as int)) as fi, \
     sum(cast(f * 1e9 as bigint)) as fb, sum(cast(t as int) + 1) as ti, count(cast(f as smallint)) as fs from t",
    "select abs(f) > 3, sum(abs(a - 50)), sum(abs(d - 30)), sum(coalesce(a, b)), sum(nullif(a, 3)), \
     count(nullif(s, 'k1')), count(coalesce(s, 'z')) from t group by abs(f) > 3",
    "select ds, substr(ds, 2), count(ds), sum(a) from t where ds is not null or a > 3 group by ds, 2",
    "select flag, min(s), max(s), min(w), max(w) from t where a > 3 group by flag",
    // A group-by without aggregates: DataFusion's plan for a single COUNT(DISTINCT).
    "select s, count(distinct a) from t group by s",
    // Hash joins inside the stage (`b` is unique): inner on one and two keys, with a filter, a
    // chain, semi and anti joins (outer joins: `tests/device_stages.rs`).
    "select x.s, sum(u.d), count(*) from t as x join t as u on x.b = u.b group by x.s",
    "select count(*), sum(u.f) from t as x join t as u on x.b = u.b and x.a = u.a where x.f > 3",
    "select sum(x.d - u.d) from t as x join t as u on x.b = u.b and x.f > u.f / 2",
    "select v.s, count(*) from t as x join t as u on x.b = u.b join t as v on u.a = v.b group by v.s",
    "select count(*) from t as x where x.b in (select a from t as u where u.f > 3)",
    "select x.s, count(*) from t as x where not exists (select 1 from t as u where u.b = x.a and u.d > x.d) \
     group by x.s",
    // Rows stages: computed columns of every fixed-width type beside gathered ones, a filter the
    // scan does not take.
    "select a * 2 + b, s, d * (1 - d), f / 2.0, flag, not flag, a is null from t where b > 10",
    "select t + interval '1' day, cast(a as smallint), -d, case when a > 3 then f else -f end, cast(f as real) \
     from t where b > a",
    // Computed strings: a rows stage writes them by reference.
    "select substr(s, 2), case when a > 3 then 'big' when a > 1 then s end, coalesce(s, 'z'), a from t where b > 10",
];

/// Why the rule declines each partial aggregate of `sql`'s plan.
fn declined(sql: &str) -> Vec<String> {
    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    let ctx = SessionContext::new_with_config(SessionConfig::new().with_target_partitions(4));
    ctx.register_table("t", Arc::new(table())).unwrap();
    let plan = rt
        .block_on(async { ctx.sql(sql).await.unwrap().create_physical_plan().await })
        .unwrap();
    let rule = DeviceStageRule::new().with_host_stages(true);
    let mut why = Vec::new();
    plan.apply(|p| {
        if let Some(agg) = p.downcast_ref::<AggregateExec>()
            && let Err(e) = rule.lower(agg)
        {
            why.push(e);
        }
        Ok(TreeNodeRecursion::Continue)
    })
    .unwrap();
    why
}

fn stage_plans(sql: &str) -> Vec<Arc<dyn ExecutionPlan>> {
    stage_plans_over(sql, table())
}

fn stage_plans_over(sql: &str, table: GpuTable) -> Vec<Arc<dyn ExecutionPlan>> {
    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    let state = SessionStateBuilder::new()
        .with_default_features()
        .with_config(SessionConfig::new().with_target_partitions(4))
        .with_physical_optimizer_rule(Arc::new(DeviceStageRule::new().with_host_stages(true)))
        .build();
    let ctx = SessionContext::new_with_state(state);
    ctx.register_table("t", Arc::new(table)).unwrap();
    let plan = rt
        .block_on(async { ctx.sql(sql).await.unwrap().create_physical_plan().await })
        .unwrap();
    let mut found = Vec::new();
    plan.apply(|p| {
        if p.downcast_ref::<DeviceStageExec>().is_some() {
            found.push(p.clone());
        }
        Ok(TreeNodeRecursion::Continue)
    })
    .unwrap();
    found
}

#[test]
fn supported_queries_get_a_stage_whose_kernels_parse() {
    let cxx = cuda_as_cpp::compiler();
    for (i, sql) in STAGED.iter().enumerate() {
        // A join's build side may hold a stage of its own (a rows stage computing its keys).
        let stages = stage_plans(sql);
        assert!(!stages.is_empty(), "{sql}: {:?}", declined(sql));
        for (j, stage) in stages.iter().enumerate() {
            let stage = stage.downcast_ref::<DeviceStageExec>().unwrap();
            let source = &stage.stage_plan().source.as_ref().expect("generated").source;
            if let Some(out) = std::env::var_os("ARROW_CUDA_KERNEL_DIR") {
                std::fs::write(std::path::Path::new(&out).join(format!("stage{i}_{j}.cu")), source).unwrap();
            }
            let Some(cxx) = cxx else {
                eprintln!("skipped: no C++ compiler");
                continue;
            };
            if let Err(e) = cuda_as_cpp::check_syntax(cxx, &format!("stage{i}_{j}"), source) {
                panic!("{sql}:\n{e}\n{source}");
            }
        }
    }
}

#[test]
fn unsupported_aggregates_stay_with_datafusion() {
    for sql in [
        "select median(b) from t",
        "select s, string_agg(s, ',') from t group by s",
        "select f, count(*) from t group by f",
        "select sum(a) from (select a from t limit 10)",
    ] {
        assert!(stage_plans(sql).is_empty(), "{sql}");
        assert!(!declined(sql).is_empty(), "{sql}");
    }
}

#[test]
fn group_bound_comes_from_the_key_columns_statistics() {
    for (sql, bound) in [
        // `a` holds 1..=99 and nulls: 99 values and the null group.
        ("select a, count(*) from t group by a", Some(100)),
        ("select flag, t, count(*) from t group by flag, t", Some(2 * 100)),
        ("select b, a, sum(f) from t group by b, a", Some(298 * 100)),
        ("select sum(f) from t", Some(1)),
        ("select s, count(*) from t group by s", None),
        ("select a % 3, count(*) from t group by a % 3", None),
    ] {
        let stages = stage_plans(sql);
        assert_eq!(stages.len(), 1, "{sql}: {:?}", declined(sql));
        let stage = stages[0].downcast_ref::<DeviceStageExec>().unwrap();
        assert_eq!(stage.stage_plan().group_bound(), bound, "{sql}");
    }
}

#[test]
fn string_key_words_come_from_the_longest_value() {
    // `s` holds "k0" to "k4": one word holds up to 7 bytes and the length.
    for (sql, words) in [
        ("select s, count(*) from t group by s", vec![1]),
        ("select substr(s, 2), a, count(*) from t group by 1, 2", vec![1, 1]),
        (
            "select case when a > 3 then s else 'a literal of 26 characters' end, count(*) from t group by 1",
            vec![4],
        ),
        // At most as many characters as `substr`'s count, of up to 4 bytes each.
        (
            "select substr(case when a > 3 then s else 'a literal of 26 characters' end, 2, 3), count(*) \
             from t group by 1",
            vec![2],
        ),
        (
            "select substr(case when a > 3 then s else 'a literal of 26 characters' end, -1, 2), count(*) \
             from t group by 1",
            vec![1],
        ),
    ] {
        let stages = stage_plans(sql);
        assert_eq!(stages.len(), 1, "{sql}: {:?}", declined(sql));
        let stage = stages[0].downcast_ref::<DeviceStageExec>().unwrap();
        assert_eq!(stage.stage_plan().key_words, words, "{sql}");
    }
}

#[test]
fn stages_replace_the_whole_aggregation_and_keep_its_partitioning() {
    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    for partitions in [1, 3] {
        for sql in ["select s, count(*) from t group by s", "select sum(b) from t"] {
            // The aggregate DataFusion plans without the rule: its last (top) half.
            let ctx = SessionContext::new_with_config(SessionConfig::new().with_target_partitions(4));
            ctx.register_table("t", Arc::new(table_in(partitions))).unwrap();
            let plain = rt
                .block_on(async { ctx.sql(sql).await.unwrap().create_physical_plan().await })
                .unwrap();
            let mut top = None;
            plain
                .apply(|p| {
                    top = p
                        .downcast_ref::<AggregateExec>()
                        .map(|_| p.properties().partitioning.clone());
                    Ok(if top.is_some() {
                        TreeNodeRecursion::Stop
                    } else {
                        TreeNodeRecursion::Continue
                    })
                })
                .unwrap();
            let stages = stage_plans_over(sql, table_in(partitions));
            assert_eq!(stages.len(), 1, "{sql}");
            // (`UnknownPartitioning` is never equal to itself: compare what they print.)
            assert_eq!(
                format!("{:?}", stages[0].properties().partitioning),
                format!("{:?}", top.unwrap()),
                "{sql}"
            );
            let shown = ::datafusion::physical_plan::displayable(stages[0].as_ref())
                .one_line()
                .to_string();
            assert!(shown.contains("output=final"), "{shown}");
        }
    }
}
