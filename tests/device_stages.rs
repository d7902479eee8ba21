//! Device stages: queries over GPU tables with the stage rule return exactly what DataFusion returns
//! over `MemTable`s of the same batches, and `EXPLAIN` shows which stages ran. Every case runs on
//! the CPU device (the stages' host implementation, switched on for the tests) and, where a GPU is
//! present, on CUDA device 0 (the generated kernels).
#![cfg(feature = "datafusion")]

mod common;

use std::sync::{Arc, OnceLock, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

use arrow_array::{
    ArrayRef, Date32Array, Decimal128Array, DictionaryArray, Float64Array, Int8Array, Int32Array, Int64Array,
    LargeStringArray, RecordBatch, StringArray, StringViewArray,
};
use arrow_cuda::datafusion::{DeviceStageRule, GpuTable, LoadOptions};
use arrow_cuda::{Device, DeviceBuffer, Error, MemoryResource, Stream};
use arrow_cuda_workloads::tpch;
use common::rows;
use common::tables::{Data, Tpch, tpch_query};
use datafusion::arrow::util::pretty::pretty_format_batches;
use datafusion::datasource::MemTable;
use datafusion::execution::SessionStateBuilder;
use datafusion::prelude::{SessionConfig, SessionContext};
use futures::StreamExt;
use proptest::prelude::*;

const PARTITIONS: usize = 4;

/// The TPC-H queries with a device stage: an aggregate over one table's rows, filtered and joined
/// with other plans' rows by hash joins (all 22; Q13's left outer join as two stages).
const STAGED_TPCH: &[&str] = &[
    "q1", "q2", "q3", "q4", "q5", "q6", "q7", "q8", "q9", "q10", "q11", "q12", "q13", "q14", "q15", "q16", "q17",
    "q18", "q19", "q20", "q21", "q22",
];

/// Every test holds the GPU shared; the tests that measure or exhaust its memory hold it alone.
static GPU: RwLock<()> = RwLock::new(());

fn gpu_shared() -> RwLockReadGuard<'static, ()> {
    GPU.read().unwrap_or_else(PoisonError::into_inner)
}

fn gpu_alone() -> RwLockWriteGuard<'static, ()> {
    GPU.write().unwrap_or_else(PoisonError::into_inner)
}

fn config() -> SessionConfig {
    SessionConfig::new().with_target_partitions(PARTITIONS)
}

/// A session with device stages (their host implementation on the CPU device).
fn stage_session() -> SessionContext {
    let rule = DeviceStageRule::new().with_host_stages(true);
    let state = SessionStateBuilder::new()
        .with_default_features()
        .with_config(config())
        .with_physical_optimizer_rule(Arc::new(rule))
        .build();
    SessionContext::new_with_state(state)
}

/// Two sessions over the same tables: GPU tables on `device` with device stages, and `MemTable`s.
fn sessions(tables: &[(&str, &Data)], device: Device) -> (SessionContext, SessionContext) {
    let gpu = stage_session();
    let mem = SessionContext::new_with_config(config());
    for (name, data) in tables {
        let table = GpuTable::try_new(
            data.schema.clone(),
            data.partitions.clone(),
            &LoadOptions::new().with_device(device),
        )
        .expect("stage table");
        gpu.register_table(*name, Arc::new(table)).expect("register");
        let mem_table = MemTable::try_new(data.schema.clone(), data.partitions.clone()).expect("memtable");
        mem.register_table(*name, Arc::new(mem_table)).expect("register");
    }
    (gpu, mem)
}

fn run(ctx: &SessionContext, sql: &str) -> datafusion::error::Result<Vec<RecordBatch>> {
    common::runtime().block_on(async { ctx.sql(sql).await?.collect().await })
}

fn explain(ctx: &SessionContext, sql: &str) -> String {
    let batches = run(ctx, &format!("explain {sql}")).expect("explain");
    pretty_format_batches(&batches).expect("format").to_string()
}

/// Asserts the same rows (or both errors) and whether a stage ran; returns the row count.
fn assert_same(gpu: &SessionContext, mem: &SessionContext, sql: &str, staged: bool) -> usize {
    let plan = explain(gpu, sql);
    assert_eq!(plan.contains("DeviceStageExec"), staged, "{sql}\n{plan}");
    let ordered = sql.to_lowercase().contains("order by");
    match (run(gpu, sql), run(mem, sql)) {
        (Ok(g), Ok(m)) => {
            let (g, m) = (rows(&g, ordered), rows(&m, ordered));
            assert_eq!(g, m, "results differ for {sql}");
            g.len()
        }
        (Err(_), Err(_)) => 0,
        (g, m) => panic!(
            "{sql}: stage {:?}, DataFusion {:?}",
            g.map(|_| "rows"),
            m.map(|_| "rows")
        ),
    }
}

/// TPC-H at scale factor 0.1 (lineitem: 600,572 rows) in 65,536-row batches, generated once.
fn tpch() -> &'static Tpch {
    static TPCH: OnceLock<Tpch> = OnceLock::new();
    TPCH.get_or_init(|| Tpch::generate(0.1, PARTITIONS, 1 << 16))
}

/// TPC-H queries and other aggregates over lineitem: a stage runs each single-table aggregate,
/// the joins stay with DataFusion, and every result equals `MemTable`'s (decimals bit for bit).
#[test]
fn tpch_stages_match_memtable() {
    let _gpu = gpu_shared();
    let staged = [
        tpch_query("q1"),
        tpch_query("q6"),
        "select l_returnflag, l_linestatus, count(*), sum(l_quantity), min(l_shipdate), max(l_orderkey) \
         from lineitem group by l_returnflag, l_linestatus order by 1, 2",
        "select l_shipmode, sum(case when l_quantity > 25 then l_extendedprice else 0 end), \
         avg(l_discount), count(l_comment) from lineitem where l_shipmode in ('MAIL', 'SHIP', 'AIR') \
         group by l_shipmode order by l_shipmode",
        "select extract(year from l_shipdate) as y, sum(l_extendedprice * (1 - l_discount)) \
         from lineitem where l_comment like '%special%' group by y order by y",
        "select l_suppkey, count(*), sum(l_tax) from lineitem group by l_suppkey order by l_suppkey",
        "select l_orderkey, sum(l_quantity) from lineitem group by l_orderkey having sum(l_quantity) > 300 \
         order by l_orderkey",
        "select count(*) filter (where l_receiptdate > l_commitdate), sum(l_linenumber) \
         from lineitem where l_shipdate >= date '1995-01-01'",
        "select count(distinct l_suppkey) from lineitem where l_quantity < 5",
    ];
    let t = tpch();
    common::each_device(|device, _| {
        let (gpu, mem) = sessions(
            &[("lineitem", &t.lineitem), ("orders", &t.orders), ("part", &t.part)],
            device,
        );
        for q in staged {
            let n = assert_same(&gpu, &mem, q, true);
            eprintln!("{n} rows: {}", &q[..q.len().min(60)]);
        }
        for q in ["q12", "q14"] {
            assert_same(&gpu, &mem, tpch_query(q), true);
        }
    });
}

/// All 22 TPC-H queries at SF 0.1 over the eight tables: each returns what `MemTable` returns,
/// `EXPLAIN` shows a stage exactly where one is expected, and no stage gives its work back.
#[test]
fn all_tpch_queries_match_memtable() {
    let _gpu = gpu_shared();
    common::each_device(|device, _| tpch_queries_match_memtable(0.1, device));
}

/// The same at SF 1 (lineitem: 6 million rows), where the stages' hash tables and build sides
/// are larger than a block's share of the device: on CUDA only (the CPU device's host stages
/// are the same code at either scale).
#[test]
fn all_tpch_queries_match_memtable_at_sf1() {
    let _gpu = gpu_shared();
    if let Some(device) = common::cuda() {
        tpch_queries_match_memtable(1.0, device);
    }
}

fn tpch_queries_match_memtable(sf: f64, device: Device) {
    let tables = tpch::tables(sf, PARTITIONS, tpch::BATCH_SIZE).expect("generate");
    let data: Vec<(&str, Data)> = tables.into_iter().map(|t| (t.name, Data::from(t))).collect();
    let refs: Vec<(&str, &Data)> = data.iter().map(|(n, d)| (*n, d)).collect();
    let (gpu, mem) = sessions(&refs, device);
    let mut staged = Vec::new();
    for (name, sql) in tpch::QUERIES {
        let has_stage = explain(&gpu, sql).contains("DeviceStageExec");
        let n = assert_same(&gpu, &mem, sql, has_stage);
        eprintln!("SF {sf}, {name}: {n} rows, stage: {has_stage}");
        if has_stage {
            staged.push(name);
            let analyzed = run(&gpu, &format!("explain analyze {sql}")).expect("explain analyze");
            let text = pretty_format_batches(&analyzed).unwrap().to_string();
            assert!(!text.contains("given_back=1"), "SF {sf}, {name}\n{text}");
        }
    }
    assert_eq!(staged, STAGED_TPCH, "the TPC-H queries with a device stage at SF {sf}");
}

/// Stages that emit final rows partition them as DataFusion's `Final` aggregate would (by the hash
/// of the group keys): a partitioned hash join of two aggregates, with no repartitioning between
/// them and the join, pairs the same partitions of both.
#[test]
fn final_rows_keep_the_hash_partitioning_a_join_needs() {
    let _gpu = gpu_shared();
    let t = tpch();
    let sql = "select a.l_suppkey, a.n, b.q from \
               (select l_suppkey, count(*) as n from lineitem group by l_suppkey) a join \
               (select l_suppkey, sum(l_quantity) as q from lineitem where l_quantity < 10 group by l_suppkey) b \
               on a.l_suppkey = b.l_suppkey";
    common::each_device(|device, _| {
        let (gpu, mem) = sessions(&[("lineitem", &t.lineitem)], device);
        for ctx in [&gpu, &mem] {
            for option in [
                "hash_join_single_partition_threshold",
                "hash_join_single_partition_threshold_rows",
            ] {
                run(ctx, &format!("set datafusion.optimizer.{option} = 0")).expect("set");
            }
        }
        let plan = explain(&gpu, sql);
        assert!(plan.contains("HashJoinExec: mode=Partitioned"), "{plan}");
        assert_eq!(plan.matches("output=final").count(), 2, "{plan}");
        assert!(!plan.contains("RepartitionExec"), "{plan}");
        let n = assert_same(&gpu, &mem, sql, true);
        assert!(n > 100, "{n} rows");
    });
}

/// Outer joins that keep their build side, under plans DataFusion partitions by hash (joins of
/// every size partitioned): a `SinglePartitioned` aggregate becomes DataFusion's final aggregate
/// over the two stages' partial state, repartitioned by its keys, and rows stay in their hash
/// partitions (each the interleaving of both stages'), so that no group is split.
#[test]
fn outer_joins_keep_hash_partitions() {
    let _gpu = gpu_shared();
    let tables = join_tables();
    let refs: Vec<(&str, &Data)> = tables.iter().map(|(n, d)| (*n, d)).collect();
    common::each_device(|device, _| {
        let (gpu, mem) = sessions(&refs, device);
        for ctx in [&gpu, &mem] {
            for option in [
                "hash_join_single_partition_threshold",
                "hash_join_single_partition_threshold_rows",
            ] {
                run(ctx, &format!("set datafusion.optimizer.{option} = 0")).expect("set");
            }
        }
        for (sql, merged) in [
            (
                "select d.k, count(*), count(f.k), sum(f.amount) from d left join f on d.k = f.k group by d.k",
                "UnionExec",
            ),
            (
                "select d.k2, count(*), count(f.k) from d left join f on d.k = f.k group by d.k2",
                "UnionExec",
            ),
            (
                "select d.k, d.w, f.amount from d left join f on d.k = f.k",
                "InterleaveExec",
            ),
        ] {
            let plan = explain(&gpu, sql);
            assert!(!plan.contains("HashJoinExec") && plan.contains(merged), "{sql}\n{plan}");
            assert_eq!(plan.matches("DeviceStageExec").count(), 2, "{sql}\n{plan}");
            assert_same(&gpu, &mem, sql, true);
        }
    });
}

/// A `HAVING` filter over a stage's final rows joins the stage (`having=` in `EXPLAIN`, no
/// `FilterExec` left) when every aggregate it reads keeps its value as its state (`SUM`, `COUNT`,
/// `MIN`, `MAX`): the groups it drops are never split or merged. Over an `AVG` it stays with
/// DataFusion. Every result equals `MemTable`'s.
#[test]
fn having_filters_the_final_rows() {
    let _gpu = gpu_shared();
    let t = tpch();
    common::each_device(|device, _| {
        let (gpu, mem) = sessions(&[("lineitem", &t.lineitem)], device);
        for sql in [
            "select l_orderkey, sum(l_quantity) from lineitem group by l_orderkey having sum(l_quantity) > 250",
            "select l_suppkey, count(*), max(l_extendedprice) from lineitem group by l_suppkey \
             having count(*) > 600 and max(l_extendedprice) < 104000 or l_suppkey < 3",
            "select l_returnflag, l_linestatus, sum(l_quantity) from lineitem group by l_returnflag, l_linestatus \
             having min(l_discount) = 0 and l_returnflag <> 'N'",
            "select count(*), sum(l_quantity) from lineitem where l_orderkey in \
             (select l_orderkey from lineitem group by l_orderkey having sum(l_quantity) > 250)",
        ] {
            let plan = explain(&gpu, sql);
            let stage = plan.lines().find(|l| l.contains("having=")).unwrap_or_default();
            assert!(stage.contains("DeviceStageExec"), "{sql}\n{plan}");
            assert!(!plan.contains("FilterExec"), "{sql}\n{plan}");
            let n = assert_same(&gpu, &mem, sql, true);
            assert!(n > 0, "{sql}: no rows");
        }
        let sql = "select l_partkey, avg(l_quantity) from lineitem group by l_partkey having avg(l_quantity) > 40";
        let plan = explain(&gpu, sql);
        assert!(
            plan.contains("FilterExec") && !plan.contains("having="),
            "{sql}\n{plan}"
        );
        assert_same(&gpu, &mem, sql, true);
    });
}

/// A sort with a limit over a stage's final rows cuts them in the stage (`top=` in `EXPLAIN`) to
/// the candidates of its first rows by the first sort key (decimal sums, counts, integer and date
/// keys; ascending and descending; nulls first and last, more of them than the limit; ties; a
/// limit past the groups; after a `HAVING`), and the sort above returns what `MemTable` returns.
#[test]
fn sorts_with_a_limit_cut_the_final_rows() {
    let _gpu = gpu_shared();
    let t = tpch();
    let tables = join_tables();
    common::each_device(|device, _| {
        let (gpu, mem) = sessions(&[("f", &tables[0].1), ("lineitem", &t.lineitem)], device);
        let some = "sum(case when k2 = 0 then amount end)";
        for sql in [
            "select k, sum(amount) s from f group by k order by s desc, k limit 10".to_string(),
            format!("select k, {some} s from f group by k order by s desc, k limit 50"),
            format!("select k, {some} s from f group by k order by s desc nulls last, k limit 30"),
            format!("select k, {some} s from f group by k order by s asc nulls first, k limit 90"),
            "select k, count(*) c from f group by k order by c, k limit 7".into(),
            "select k2, min(k) m from f group by k2 order by m desc limit 2".into(),
            "select k, count(*) c from f group by k having count(*) > 80 order by k desc limit 5".into(),
            "select k2, count(*) from f group by k2 order by count(*) desc limit 100".into(),
            "select l_orderkey, sum(l_extendedprice * (1 - l_discount)) as revenue from lineitem \
             group by l_orderkey order by revenue desc, l_orderkey limit 10"
                .into(),
            "select l_shipdate, sum(l_quantity) q from lineitem group by l_shipdate \
             having sum(l_quantity) > 100 order by l_shipdate desc limit 5"
                .into(),
        ] {
            let plan = explain(&gpu, &sql);
            let stage = plan.lines().find(|l| l.contains("top=")).unwrap_or_default();
            assert!(stage.contains("DeviceStageExec"), "{sql}\n{plan}");
            let n = assert_same(&gpu, &mem, &sql, true);
            assert!(n > 0, "{sql}: no rows");
        }
        // Of 121 and 150,000 groups, the stage emits the candidates only.
        for (sql, limit) in [
            (
                "select k, sum(amount) s from f group by k order by s desc, k limit 10",
                10,
            ),
            (
                "select l_orderkey, sum(l_extendedprice * (1 - l_discount)) as revenue from lineitem \
                 group by l_orderkey order by revenue desc, l_orderkey limit 10",
                10,
            ),
        ] {
            let analyzed = run(&gpu, &format!("explain analyze {sql}")).expect("explain analyze");
            let text = pretty_format_batches(&analyzed).unwrap().to_string();
            let stage = text.lines().find(|l| l.contains("DeviceStageExec")).expect("a stage");
            let emitted: usize = stage
                .split("output_rows=")
                .nth(1)
                .and_then(|r| r.split([',', ' ', ']']).next())
                .and_then(|n| n.parse().ok())
                .unwrap_or_else(|| panic!("no output_rows: {stage}"));
            assert!((limit..=2 * limit).contains(&emitted), "{sql}: {stage}");
        }
    });
}

/// The tables of the join tests: a fact table `f` (10,000 rows over 4 batches; its key `k` null in
/// every 13th row) and dimensions keyed by `k`: `d` (unique keys, one null key, a second key `k2`
/// and a key `c` into `d3`), `dd` (every key twice), `d3` (keyed by `c`) and `e` (empty).
fn join_tables() -> Vec<(&'static str, Data)> {
    fn data(batches: Vec<RecordBatch>) -> Data {
        Data::new(batches.into_iter().map(|b| vec![b]).collect())
    }
    fn decimals(values: impl Iterator<Item = i128>) -> ArrayRef {
        Arc::new(
            Decimal128Array::from_iter_values(values)
                .with_precision_and_scale(15, 2)
                .unwrap(),
        )
    }
    let fact = (0..4)
        .map(|b| {
            let rows = (b * 2500..(b + 1) * 2500).map(|i: i64| i);
            RecordBatch::try_from_iter(vec![
                (
                    "k",
                    Arc::new(Int64Array::from_iter(
                        rows.clone().map(|i| (i % 13 != 0).then_some(i % 120)),
                    )) as ArrayRef,
                ),
                (
                    "k2",
                    Arc::new(Int32Array::from_iter_values(rows.clone().map(|i| (i % 3) as i32))),
                ),
                ("amount", decimals(rows.clone().map(|i| i128::from(i % 997) * 7))),
                (
                    "g",
                    Arc::new(StringArray::from_iter_values(rows.map(|i| format!("g{}", i % 5)))),
                ),
            ])
            .unwrap()
        })
        .collect();
    // Keys 0..100 (and a null one): fact keys 100..120 have no match.
    let dim = |keys: Vec<Option<i64>>| {
        let n = keys.len();
        RecordBatch::try_from_iter(vec![
            ("k", Arc::new(Int64Array::from(keys.clone())) as ArrayRef),
            (
                "k2",
                Arc::new(Int32Array::from_iter_values((0..n).map(|i| (i % 3) as i32))),
            ),
            (
                "name",
                Arc::new(StringArray::from_iter_values(
                    keys.iter().map(|k| format!("name of {}", k.unwrap_or(-1) % 7)),
                )),
            ),
            ("w", decimals((0..n).map(|i| (i as i128 * 37) % 5000))),
            (
                "c",
                Arc::new(Int32Array::from_iter(
                    (0..n).map(|i| (i % 11 != 0).then_some((i % 6) as i32)),
                )),
            ),
        ])
        .unwrap()
    };
    let unique: Vec<Option<i64>> = (0..100).map(Some).chain([None]).collect();
    let twice: Vec<Option<i64>> = (0..100).chain(0..100).map(Some).collect();
    let d3 = RecordBatch::try_from_iter(vec![
        ("c", Arc::new(Int32Array::from_iter_values(0..6)) as ArrayRef),
        (
            "label",
            Arc::new(StringArray::from_iter_values(
                (0..6).map(|i| format!("label {}", i % 4)),
            )),
        ),
    ])
    .unwrap();
    vec![
        ("f", data(fact)),
        ("d", data(vec![dim(unique.clone())])),
        ("dd", data(vec![dim(twice)])),
        ("d3", data(vec![d3])),
        ("e", data(vec![dim(unique).slice(0, 0)])),
    ]
}

/// Hash joins inside stages: inner joins on one and two keys, a chain of joins (a key read from
/// the build side of the join before), outer joins that keep every fact row, semi and anti joins
/// (`IN`, `EXISTS`, `NOT EXISTS`), join filters, empty build sides and keys that are null. Each
/// returns what `MemTable` returns, with the join inside the stage; a build side with duplicate
/// keys where the stage reads the match makes the stage give its work back (same answer). A build
/// side that is an inner join of GPU scans is flattened into the stage's joins. Joins without an
/// aggregate above run as rows stages.
#[test]
fn joins_inside_stages() {
    let _gpu = gpu_shared();
    let tables = join_tables();
    let refs: Vec<(&str, &Data)> = tables.iter().map(|(n, d)| (*n, d)).collect();
    let joined = [
        "select d.name, sum(f.amount), count(*), min(d.w) from f join d on f.k = d.k group by d.name",
        "select f.g, count(*), sum(d.w) from f join d on f.k = d.k and f.k2 = d.k2 group by f.g",
        "select d3.label, sum(f.amount), count(d.c) from f join d on f.k = d.k join d3 on d.c = d3.c \
         group by d3.label",
        "select d.name, count(*), count(d.w), sum(f.amount) from f left join d on f.k = d.k group by d.name",
        "select count(*), sum(amount) from f where k in (select k from d where w > 1000)",
        "select g, count(*) from f where not exists (select 1 from d where d.k = f.k) group by g",
        "select count(*), sum(f.amount - d.w) from f join d on f.k = d.k and f.amount > d.w",
        "select g, count(*) from f where exists (select 1 from d where d.k = f.k and d.w < f.amount) group by g",
        // Duplicate keys: a semi or anti join's filter is tried on every row with the key.
        "select count(*) from f where exists (select 1 from dd where dd.k = f.k and dd.w < f.amount)",
        "select g, count(*) from f where not exists (select 1 from dd where dd.k = f.k and dd.w > f.amount) group by g",
        "select count(*), sum(amount) from f join e on f.k = e.k",
        "select count(*), sum(amount) from f where not exists (select 1 from e where e.k = f.k)",
        "select count(*), sum(f.amount), count(e.w) from f left join e on f.k = e.k",
        // The aggregated table is the smaller one: DataFusion builds on it (left semi and anti
        // joins), and the stage hashes the larger scan instead.
        "select name, count(*), sum(w) from d where exists (select 1 from f where f.k = d.k) group by name",
        "select name, count(*) from d where w > (select avg(amount) from f) \
         and not exists (select 1 from f where f.k = d.k) group by name",
        "select count(*), sum(w) from d where w < (select max(amount) / 3 from f) \
         and k in (select k from f where g = 'g1')",
        // ... and the larger side is a rows stage (a filter over two columns, a computed key),
        // whose kept rows stay on the device for the stage's table to probe.
        "select name, count(*) from d where exists (select 1 from f where f.k = d.k and f.k2 < f.k) group by name",
        "select name, count(*), sum(w) from d where k + 1 in (select k + 1 from f where g = 'g2') group by name",
    ];
    // A build side that is itself an inner join of GPU scans whose columns stay on the device
    // (DataFusion joins the tables in FROM order): the stage joins the fact rows with each of
    // them in turn, filtered after.
    let flattened = [
        "select d3.c, sum(f.amount), count(*) from d3, d, f where d.c = d3.c and f.k = d.k group by d3.c",
        "select d3.c, count(*), sum(d.w) from d3, d, f where d.c = d3.c and f.k = d.k and f.k2 = d.k2 \
         and f.amount > d.w group by d3.c",
    ];
    let given_back = [
        "select d.name, count(*), sum(f.amount) from f join dd as d on f.k = d.k group by d.name",
        "select d3.c, count(*) from d3, dd, f where dd.c = d3.c and f.k = dd.k group by d3.c",
    ];
    common::each_device(|device, _| {
        let (gpu, mem) = sessions(&refs, device);
        for sql in joined.iter().chain(&flattened).chain(&given_back) {
            let plan = explain(&gpu, sql);
            let stage = plan.lines().find(|l| l.contains("DeviceStageExec")).unwrap_or_default();
            assert!(stage.contains(" join("), "{sql}\n{plan}");
            let n = assert_same(&gpu, &mem, sql, true);
            let analyzed = run(&gpu, &format!("explain analyze {sql}")).expect("explain analyze");
            let text = pretty_format_batches(&analyzed).unwrap().to_string();
            let back = given_back.contains(sql);
            assert!(
                text.contains(if back { "given_back=1" } else { "given_back=0" }),
                "{sql}\n{text}"
            );
            eprintln!("{n} rows, given back: {back}: {sql}");
        }
        for sql in flattened.iter().chain(&given_back[1..]) {
            let plan = explain(&gpu, sql);
            let stage = plan.lines().find(|l| l.contains("DeviceStageExec")).unwrap_or_default();
            assert_eq!(stage.matches("inner join(").count(), 2, "{sql}\n{plan}");
            assert!(!plan.contains("HashJoinExec"), "{sql}\n{plan}");
        }
        for sql in &joined[joined.len() - 2..] {
            let plan = explain(&gpu, sql);
            assert_eq!(plan.matches("DeviceStageExec").count(), 2, "{sql}\n{plan}");
            assert!(plan.contains("rows=["), "{sql}\n{plan}");
        }
        // Without an aggregate above: rows stages over joins whose build sides stay on the
        // device, their build columns of fixed width computed like any other output; a string of
        // a build side stays with DataFusion.
        for sql in [
            "select f.k, f.amount from f where exists (select 1 from d where d.k = f.k and d.w < 1000)",
            "select f.g, f.amount, d.w, d.k2 from f join d on f.k = d.k where f.k2 = 1",
            "select f.k, f.amount from f where not exists (select 1 from d where d.k = f.k)",
            "select f.amount, d.w, d.c from f left join d on f.k = d.k and f.k2 = d.k2",
            "select f.amount, d3.c from d3, d, f where d.c = d3.c and f.k = d.k",
            "select f.amount, e.w from f join e on f.k = e.k",
        ] {
            assert_same(&gpu, &mem, sql, true);
            let plan = explain(&gpu, sql);
            let stage = plan.lines().find(|l| l.contains("DeviceStageExec")).unwrap_or_default();
            assert!(stage.contains(" join(") && stage.contains("rows=["), "{sql}\n{plan}");
        }
        // A build side's strings are outputs of a rows stage where the build side stays on the
        // device (a GPU scan there), not where it does not (a limit over the scan).
        assert_same(&gpu, &mem, "select f.amount, d.name from f join d on f.k = d.k", true);
        let limited = "select f.amount, x.name from f join (select k, name from d limit 1000) x on f.k = x.k";
        assert_same(&gpu, &mem, limited, false);
        // Joins that keep or mark the rows of their build side without a match (`d`, `dd` and `e`
        // are smaller than `f`: DataFusion builds on them) run as two stages, the matched rows and
        // an anti join of the build side with `f`, unioned: aggregated and as rows.
        for sql in [
            "select d.name, count(*), count(f.k), sum(f.amount) from d left join f on d.k = f.k group by d.name",
            "select count(*), count(f.k), sum(d.w), sum(f.amount) from d left join f on d.k = f.k and f.amount > d.w",
            "select d.k2, count(*), count(d.k), count(f.k) from d full join f on d.k = f.k group by d.k2",
            "select count(*), count(f.k), sum(d.w) from f right join d on f.k = d.k",
            "select d.name, count(*) from d where exists (select 1 from f where f.k = d.k) or d.w > 5000              group by d.name",
            "select d.k2, d.w, f.amount from d left join f on d.k = f.k",
            "select d.k, d.w, f.amount from d full join f on d.k = f.k where f.k2 = 1 or f.k2 is null",
        ] {
            let plan = explain(&gpu, sql);
            assert!(plan.contains("UnionExec"), "{sql}\n{plan}");
            assert_eq!(plan.matches("DeviceStageExec").count(), 2, "{sql}\n{plan}");
            assert!(plan.contains("anti join("), "{sql}\n{plan}");
            assert!(!plan.contains("HashJoinExec"), "{sql}\n{plan}");
            assert_same(&gpu, &mem, sql, true);
        }
        // NOT IN is a null-aware anti join, with its null rule: no row when the subquery has a
        // null key (`d` has one), rows with a null key only when it is empty.
        for sql in [
            "select count(*), count(k) from f where k not in (select k from d)",
            "select count(*), count(k), sum(amount) from f where k not in (select k from d where k is not null)",
            "select count(*), count(k), sum(amount) from f where k not in (select k from e)",
        ] {
            assert!(explain(&gpu, sql).contains("nullawareanti join("), "{sql}");
            assert_same(&gpu, &mem, sql, true);
        }
    });
}

/// `EXPLAIN` shows the stage and what it runs; `EXPLAIN ANALYZE` its metrics.
#[test]
fn explain_shows_stages_and_their_metrics() {
    let _gpu = gpu_shared();
    let t = tpch();
    common::each_device(|device, _| {
        let (gpu, _) = sessions(&[("lineitem", &t.lineitem)], device);
        let q1 = tpch_query("q1");
        let plan = explain(&gpu, q1);
        assert!(
            plan.contains("DeviceStageExec: scan=7 columns, pushed predicate"),
            "{plan}"
        );
        assert!(plan.contains("output=final"), "{plan}");
        assert!(!plan.contains("AggregateExec"), "{plan}");
        assert!(plan.contains("group_by=[l_returnflag@8, l_linestatus@9]"), "{plan}");
        assert!(plan.contains("aggr=[sum(lineitem.l_quantity)"), "{plan}");
        assert!(!plan.contains("GpuTableScan"), "{plan}");
        let analyzed = run(&gpu, &format!("explain analyze {q1}")).expect("explain analyze");
        let text = pretty_format_batches(&analyzed).unwrap().to_string();
        let stage = text.lines().find(|l| l.contains("DeviceStageExec")).expect("a stage");
        assert!(stage.contains("rows_in=600.6 K"), "{stage}");
        assert!(stage.contains("output_rows=4"), "{stage}");
        for metric in ["elapsed_compute=", "bytes_to_host=", "kernel_compile_time="] {
            assert!(stage.contains(metric), "{metric}: {stage}");
        }
    });
}

/// A table of `rows` rows whose key `k` has `groups` values (`None`: a tenth of the keys null,
/// and every ninth key skewed to 0).
fn grouped(rows: usize, groups: usize) -> Data {
    let batch_rows = 1 << 16;
    let batches: Vec<RecordBatch> = (0..rows)
        .step_by(batch_rows)
        .map(|start| {
            let r = start..(start + batch_rows).min(rows);
            let k: ArrayRef = Arc::new(Int64Array::from_iter(r.clone().map(|i| {
                let i = i as i64;
                if i % 10 == 9 {
                    None
                } else if i % 9 == 0 {
                    Some(0)
                } else {
                    Some(i.wrapping_mul(2_654_435_761) % groups as i64)
                }
            })));
            let s: ArrayRef = Arc::new(StringArray::from_iter(
                r.clone().map(|i| Some(format!("g{}", (i * 7) % groups.min(50)))),
            ));
            let v: ArrayRef = Arc::new(Int32Array::from_iter(r.clone().map(|i| {
                // Group 3's values are all null.
                let key = (i as i64).wrapping_mul(2_654_435_761) % groups as i64;
                (i % 13 != 0 && !(key == 3 && i % 9 != 0 && i % 10 != 9)).then_some(i as i32 - 1000)
            })));
            let d: ArrayRef = Arc::new(
                Decimal128Array::from_iter(r.clone().map(|i| Some(i as i128 * 1_000_003 - 7)))
                    .with_precision_and_scale(20, 3)
                    .unwrap(),
            );
            let f: ArrayRef = Arc::new(Float64Array::from_iter(
                r.clone().map(|i| Some((i % 1000) as f64 * 0.5)),
            ));
            let t: ArrayRef = Arc::new(Date32Array::from_iter(r.map(|i| Some(10_000 + (i % 3000) as i32))));
            RecordBatch::try_from_iter([("k", k), ("s", s), ("v", v), ("d", d), ("f", f), ("t", t)]).unwrap()
        })
        .collect();
    let schema = batches[0].schema();
    let mut partitions = vec![Vec::new(); PARTITIONS];
    for (i, b) in batches.into_iter().enumerate() {
        partitions[i % PARTITIONS].push(b);
    }
    Data { schema, partitions }
}

/// Aggregation with 1, 4, 1,000 and 1,000,000 groups, skewed keys, a null key, a group whose
/// values are all null, inputs that filter to nothing, float minima and maxima, and `COUNT(DISTINCT)`.
#[test]
fn aggregation_by_group_count() {
    let _gpu = gpu_shared();
    let cases = [(1, 20_000), (4, 50_000), (1000, 200_000), (1_000_000, 2_100_000)];
    for (groups, rows) in cases {
        let data = grouped(rows, groups);
        common::each_device(|device, _| {
            let (gpu, mem) = sessions(&[("g", &data)], device);
            for sql in [
                "select k, count(*), count(v), sum(v), avg(v), min(v), max(t), sum(d), avg(d) from g group by k",
                "select s, k % 3, sum(d * 2), round(avg(f), 6) from g where v > 0 or v is null group by s, k % 3",
                "select k, sum(v) from g where k < 0 group by k",
                "select count(*), sum(v), avg(d) from g where v > 1000000000",
                "select sum(v), min(t), max(v) from g",
                // Floats: negatives, zero, and a Float32 argument.
                "select k % 7, min(f), max(f), min(f - 250.0), max(f - 250.0), min(cast(v as real)) from g group by k % 7",
                "select min(f - 250.0), max(cast(f as real)) from g where k > 5",
                "select s, min(cast(d as decimal(18, 3))), max(cast(d as decimal(18, 3))), min(cast(v as decimal(9, 2))) \
                 from g group by s",
                // DataFusion plans a single COUNT(DISTINCT) as a group-by on the distinct column under
                // an ordinary COUNT: the stage runs the group-by.
                "select s, count(distinct k) from g group by s",
                "select count(distinct t) from g where v > 0",
            ] {
                let n = assert_same(&gpu, &mem, sql, true);
                eprintln!("{groups} groups: {n} rows: {sql}");
            }
        });
    }
}

/// Projections and filters without an aggregate above them run as rows stages: computed columns of
/// every fixed-width type (integers, decimals, floats, dates, booleans, with nulls) and strings, and filters the
/// scan cannot take, beside table columns (strings among them) gathered as they are, over many
/// batches; a stage that keeps no row, and arithmetic errors, as DataFusion has them.
#[test]
fn rows_stages_compute_projections_and_filters() {
    let _gpu = gpu_shared();
    let data = grouped(150_000, 1000);
    let errors = error_table();
    common::each_device(|device, _| {
        let (gpu, mem) = sessions(&[("g", &data), ("e", &errors)], device);
        for sql in [
            "select k * 2 + v as x, s, d * 2, f * 0.5 from g where v > 0",
            "select case when v > 0 then d else -d end, v is null, not (v > 3), cast(v as double), k from g",
            "select t + interval '1' day, t, k % 7 = 3 or v < 0 from g where s = 'g7'",
            "select cast(k as int), cast(v as smallint), cast(d as decimal(30, 2)), cast(f as real) from g where k < 500",
            "select -d, -v, -f, -k from g where k > 990",
            // A filter the scan does not take (two columns), the columns gathered as they are.
            "select v, k, s from g where k < v",
            "select v + 1 from g where v > 1000000000",
            "select a * 2, a - a from e",
            // A computed string beside a computed number.
            "select substr(s, 1, 2), v + 1 from g where v > 0",
        ] {
            assert_same(&gpu, &mem, sql, true);
            let plan = explain(&gpu, sql);
            assert!(plan.contains("rows=["), "{sql}\n{plan}");
        }
        for sql in ["select d * d from e", "select a / (a - a) from e"] {
            assert!(run(&gpu, sql).is_err(), "{sql}");
            assert!(run(&mem, sql).is_err(), "{sql}");
        }
        // The scan's own filter and projection need no stage.
        assert_same(&gpu, &mem, "select s, v from g where v > 0", false);
        let analyzed = run(&gpu, "explain analyze select k * 2 + v from g where v > 0").expect("explain analyze");
        let text = pretty_format_batches(&analyzed).unwrap().to_string();
        let stage = text.lines().find(|l| l.contains("DeviceStageExec")).expect("a stage");
        assert!(
            stage.contains("given_back=0") && stage.contains("rows_in=150.0 K"),
            "{stage}"
        );
    });
}

/// A table whose `d * d` overflows `Decimal128(38, 0)` and whose `a - a` is zero.
fn error_table() -> Data {
    let big = 10i128.pow(37);
    let d: ArrayRef = Arc::new(
        Decimal128Array::from(vec![Some(big), Some(-big), None, Some(5)])
            .with_precision_and_scale(38, 0)
            .unwrap(),
    );
    let a: ArrayRef = Arc::new(Int64Array::from(vec![Some(1), Some(2), None, Some(0)]));
    Data::new(vec![vec![RecordBatch::try_from_iter([("d", d), ("a", a)]).unwrap()]])
}

/// Decimal overflow and division by zero are errors on the device as in DataFusion.
#[test]
fn arithmetic_errors_match_datafusion() {
    let _gpu = gpu_shared();
    let data = error_table();
    common::each_device(|device, _| {
        let (gpu, mem) = sessions(&[("e", &data)], device);
        for sql in [
            "select sum(d * d) from e",
            "select sum(a / (a - a)) from e",
            "select a, sum(d / (d - d)) from e group by a",
            "select sum(d * d) from e where a = 0",
            "select sum(a % 2) from e",
        ] {
            assert_same(&gpu, &mem, sql, true);
        }
    });
}

/// A random table for the expression properties.
fn random_table() -> &'static Data {
    static DATA: OnceLock<Data> = OnceLock::new();
    DATA.get_or_init(|| {
        let n = 3000usize;
        let mut x: u64 = 0x2545_f491_4f6c_dd1d;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let mut cols: Vec<Vec<u64>> = vec![Vec::new(); 6];
        for _ in 0..n {
            for c in cols.iter_mut() {
                c.push(next());
            }
        }
        let null = |r: u64| r.is_multiple_of(11);
        let a: ArrayRef = Arc::new(Int32Array::from_iter(
            cols[0]
                .iter()
                .map(|&r| (!null(r)).then_some((r >> 8) as i32 % 2000 - 1000)),
        ));
        let b: ArrayRef = Arc::new(Int64Array::from_iter(
            cols[1].iter().map(|&r| (!null(r)).then_some((r >> 8) as i64 % 100_000)),
        ));
        let d: ArrayRef = Arc::new(
            Decimal128Array::from_iter(
                cols[2]
                    .iter()
                    .map(|&r| (!null(r)).then_some((r >> 8) as i128 % 10_000_000)),
            )
            .with_precision_and_scale(15, 2)
            .unwrap(),
        );
        let f: ArrayRef = Arc::new(Float64Array::from_iter(
            cols[3]
                .iter()
                .map(|&r| (!null(r)).then_some(((r >> 8) % 4000) as f64 / 8.0 - 100.0)),
        ));
        let words = ["apple", "banana", "cherry pie", "date", "é-accent", "fig_1%", ""];
        let s: ArrayRef =
            Arc::new(StringArray::from_iter(cols[4].iter().map(|&r| {
                (!null(r)).then(|| words[(r >> 8) as usize % words.len()].to_string())
            })));
        let t: ArrayRef = Arc::new(Date32Array::from_iter(
            cols[5]
                .iter()
                .map(|&r| (!null(r)).then_some(8000 + ((r >> 8) % 5000) as i32)),
        ));
        let batch = RecordBatch::try_from_iter([("a", a), ("b", b), ("d", d), ("f", f), ("s", s), ("t", t)]).unwrap();
        let rows = batch.num_rows();
        let parts = (0..PARTITIONS)
            .map(|p| vec![batch.slice(p * rows / PARTITIONS, rows / PARTITIONS)])
            .collect();
        Data::new(parts)
    })
}

/// Integer, decimal and float expressions of the random table's columns.
fn number() -> impl Strategy<Value = (String, &'static str)> {
    let leaf = prop_oneof![
        Just(("a".to_string(), "int")),
        Just(("b".to_string(), "int")),
        Just(("d".to_string(), "dec")),
        Just(("f".to_string(), "float")),
        (-50i64..50).prop_map(|v| (v.to_string(), "int")),
        (-500i64..500).prop_map(|v| (format!("cast({v} as decimal(10, 2)) / 100"), "dec")),
    ];
    leaf.prop_recursive(3, 12, 2, |inner| {
        prop_oneof![
            (inner.clone(), inner.clone(), prop::sample::select(vec!["+", "-", "*"]))
                .prop_map(|((l, tl), (r, tr), op)| (format!("({l} {op} {r})"), mix(tl, tr))),
            (inner.clone(), inner.clone()).prop_map(|((l, tl), (r, tr))| (format!("({l} / {r})"), mix(tl, tr))),
            (inner.clone(), predicate_leaf(), inner.clone())
                .prop_map(|((l, tl), p, (r, tr))| { (format!("(case when {p} then {l} else {r} end)"), mix(tl, tr)) }),
            inner.clone().prop_map(|(e, t)| if t == "int" {
                (format!("cast({e} as decimal(20, 2))"), "dec")
            } else {
                (e, t)
            }),
        ]
    })
}

fn mix(a: &'static str, b: &'static str) -> &'static str {
    if a == "float" || b == "float" {
        "float"
    } else if a == "dec" || b == "dec" {
        "dec"
    } else {
        "int"
    }
}

fn predicate_leaf() -> impl Strategy<Value = String> {
    prop_oneof![
        (
            prop::sample::select(vec!["a", "b", "d", "f"]),
            prop::sample::select(vec!["<", "<=", "=", "<>", ">"]),
            -100i64..100
        )
            .prop_map(|(c, op, v)| format!("{c} {op} {v}")),
        prop::sample::select(vec![
            "s like 'b%'",
            "s like '%e%'",
            "s like '_a%a'",
            "s not like '%\\_%'",
            "s in ('apple', 'date')",
            "s = 'fig_1%'",
            "s < 'c'",
            "a is null",
            "d is not null",
            "a in (1, 2, 3, -7)",
            "b > a",
            "extract(year from t) = 1995",
            "date_part('month', t) in (1, 12)",
            "t < date '1995-06-01'",
        ])
        .prop_map(str::to_string),
    ]
}

fn predicate() -> impl Strategy<Value = String> {
    predicate_leaf().prop_recursive(2, 6, 2, |inner| {
        prop_oneof![
            (inner.clone(), inner.clone()).prop_map(|(l, r)| format!("({l} and {r})")),
            (inner.clone(), inner.clone()).prop_map(|(l, r)| format!("({l} or {r})")),
            inner.prop_map(|p| format!("not ({p})")),
        ]
    })
}

/// String expressions of the random table's `s`: `substr` with starts before, at and after the
/// string's characters and counts from zero past its end, `CASE` with literals, nulls and columns,
/// `COALESCE` and `NULLIF`.
fn text() -> impl Strategy<Value = String> {
    let leaf = prop_oneof![
        Just("s".to_string()),
        prop::sample::select(vec!["'x'", "'é-accent'", "''", "'a literal longer than twelve bytes'"])
            .prop_map(str::to_string),
    ];
    leaf.prop_recursive(3, 10, 2, |inner| {
        prop_oneof![
            (inner.clone(), -3i64..9, 0i64..7).prop_map(|(t, start, count)| format!("substr({t}, {start}, {count})")),
            (inner.clone(), -3i64..9).prop_map(|(t, start)| format!("substr({t}, {start})")),
            (predicate_leaf(), inner.clone(), inner.clone())
                .prop_map(|(p, a, b)| format!("(case when {p} then {a} else {b} end)")),
            (predicate_leaf(), inner.clone()).prop_map(|(p, a)| format!("(case when {p} then {a} end)")),
            (inner.clone(), inner.clone()).prop_map(|(a, b)| format!("coalesce({a}, {b})")),
            inner.prop_map(|a| format!("nullif({a}, 'apple')")),
        ]
    })
}

/// Whether two result rows are equal, float cells to a relative 1e-9 when `floats`.
fn same_row(a: &str, b: &str, floats: bool) -> bool {
    if a == b {
        return true;
    }
    let (ca, cb): (Vec<&str>, Vec<&str>) = (a.split('|').collect(), b.split('|').collect());
    floats
        && ca.len() == cb.len()
        && ca.iter().zip(&cb).all(|(x, y)| {
            x == y
                || match (x.parse::<f64>(), y.parse::<f64>()) {
                    (Ok(x), Ok(y)) => (x - y).abs() <= 1e-9 * x.abs().max(y.abs()).max(1.0),
                    _ => false,
                }
        })
}

/// DataFusion over `MemTable`s without its physical projection pushdown, which moves computed
/// projections below filters and so can fail on rows the filter removes (`a / a` where `a = 0`).
/// A stage filters first, as SQL does; where it succeeds and DataFusion fails, its rows are
/// checked against this session's.
fn filter_first_session() -> &'static SessionContext {
    static S: OnceLock<SessionContext> = OnceLock::new();
    S.get_or_init(|| {
        let rules = datafusion::physical_optimizer::optimizer::PhysicalOptimizer::new()
            .rules
            .into_iter()
            .filter(|r| r.name() != "ProjectionPushdown")
            .collect();
        let state = SessionStateBuilder::new()
            .with_default_features()
            .with_config(config())
            .with_physical_optimizer_rules(rules)
            .build();
        let ctx = SessionContext::new_with_state(state);
        let data = random_table();
        let table = MemTable::try_new(data.schema.clone(), data.partitions.clone()).expect("memtable");
        ctx.register_table("r", Arc::new(table)).expect("register");
        ctx
    })
}

fn random_sessions() -> &'static Vec<(Device, SessionContext, SessionContext)> {
    static S: OnceLock<Vec<(Device, SessionContext, SessionContext)>> = OnceLock::new();
    S.get_or_init(|| {
        common::devices()
            .into_iter()
            .map(|d| {
                let (g, m) = sessions(&[("r", random_table())], d);
                (d, g, m)
            })
            .collect()
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Random expressions in filters, group keys and aggregates: the stage's results (or errors)
    /// equal DataFusion's (see `filter_first_session` for the one case where DataFusion fails and
    /// the stage, filtering first, does not).
    #[test]
    fn random_expressions_match_datafusion((e, ty) in number(), p in predicate(), q in predicate()) {
        let _gpu = gpu_shared();
        let value = format!("sum({e})");
        let sql = format!(
            "select s, {p} as key, {value}, count({e}), count(*) filter (where {q}) from r \
             where {q} or a > 0 group by s, {p}"
        );
        for (device, gpu, mem) in random_sessions() {
            let g = run(gpu, &sql);
            let m = match (&g, run(mem, &sql)) {
                (Ok(_), Err(_)) => run(filter_first_session(), &sql),
                (_, m) => m,
            };
            match (g, m) {
                (Ok(g), Ok(m)) => {
                    let (g, m) = (rows(&g, false), rows(&m, false));
                    // Float sums depend on the order of the additions: equal to 1e-9, relative.
                    let close = g.len() == m.len() && g.iter().zip(&m).all(|(a, b)| same_row(a, b, ty == "float"));
                    prop_assert!(close, "{} on {}:\n{:?}\n{:?}", sql, device, g, m);
                }
                (Err(_), Err(_)) => {}
                (g, m) => prop_assert!(false, "{} on {}: stage {:?}, DataFusion {:?}", sql, device, g.map(|_| "rows"), m.map(|_| "rows")),
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Random string expressions as a rows stage's output columns (with whether each is null:
    /// the rows print nulls and empty strings alike) and as group keys: a stage runs them (unless
    /// the query has a LIKE pattern with an escape) and its rows equal DataFusion's.
    #[test]
    fn random_string_columns_match_datafusion(t in text(), u in text(), p in predicate()) {
        let _gpu = gpu_shared();
        let projected = format!("select {t} as x, {t} is null as xn, {u} as y, {u} is null as yn, a from r where {p}");
        let grouped = format!("select {t} as x, {t} is null as xn, count(*), sum(a) from r where {p} or a > 0 group by 1, 2");
        for (device, gpu, mem) in random_sessions() {
            for sql in [&projected, &grouped] {
                // (A LIKE pattern with an escape stays with DataFusion, and the query with it; a
                // predicate that can never hold leaves DataFusion no table to read.)
                let plan = explain(gpu, sql);
                let stageable = !sql.contains('\\') && !plan.contains("EmptyExec");
                prop_assert!(plan.contains("DeviceStageExec") || !stageable, "{} on {}: no stage\n{}", sql, device, plan);
                match (run(gpu, sql), run(mem, sql)) {
                    (Ok(g), Ok(m)) => prop_assert_eq!(rows(&g, false), rows(&m, false), "{} on {}", sql, device),
                    (g, m) => prop_assert!(false, "{} on {}: stage {:?}, DataFusion {:?}", sql, device, g.map(|_| "rows"), m.map(|_| "rows")),
                }
            }
        }
    }
}

/// A query's stream dropped after its first batch frees every device allocation it made.
#[test]
fn cancel_frees_device_memory() {
    let Some(device) = common::cuda() else {
        return;
    };
    let _gpu = gpu_alone();
    let data = grouped(500_000, 100_000);
    let (gpu, _) = sessions(&[("g", &data)], device);
    let free = || free_memory(device);
    let sql = "select k, sum(d), count(*) from g group by k";
    // Once, so that kernels are compiled and pools warmed.
    run(&gpu, sql).expect("query");
    let before = free();
    common::runtime().block_on(async {
        let mut s = gpu.sql(sql).await.unwrap().execute_stream().await.unwrap();
        let first = s.next().await;
        assert!(first.is_some());
        drop(s);
    });
    let after = free();
    assert!(
        after + (64 << 20) >= before,
        "free device memory {before} before the query, {after} after dropping it"
    );
}

/// The free memory of a CUDA device, as the driver tells it.
fn free_memory(device: Device) -> usize {
    arrow_cuda::device::cuda_devices()
        .expect("devices")
        .into_iter()
        .find(|i| Some(i.ordinal) == device.ordinal())
        .expect("device")
        .free_memory
}

/// A stage that finds no device memory for its group table gives its work back: DataFusion's
/// operators answer with the same rows, and `EXPLAIN ANALYZE` counts the stage as given back.
#[test]
fn out_of_device_memory_gives_the_work_back() {
    let Some(device) = common::cuda() else {
        return;
    };
    if common::under_sanitizer() {
        eprintln!("skipped under compute-sanitizer: the failed allocations are deliberate");
        return;
    }
    let _gpu = gpu_alone();
    let data = grouped(2_100_000, 1_000_000);
    let (gpu, mem) = sessions(&[("g", &data)], device);
    let sql = "select k, count(*), sum(v) from g group by k";
    // Once with memory to spare: the kernels are compiled and the stage runs on the device.
    let analyzed = |gpu: &SessionContext| {
        let batches = run(gpu, &format!("explain analyze {sql}")).expect("explain analyze");
        let text = pretty_format_batches(&batches).unwrap().to_string();
        let stage = text.lines().find(|l| l.contains("DeviceStageExec")).expect("a stage");
        stage.to_string()
    };
    assert!(analyzed(&gpu).contains("given_back=0"), "{}", analyzed(&gpu));
    // Take all of the device's memory that the stage's pool can hand out, down to the last MiB:
    // the 900,000 groups' table cannot fit in what is left, whatever the device's size.
    let stream = Stream::new(device).unwrap();
    let pool = MemoryResource::default_for(device);
    let mut hog = Vec::new();
    let mut chunk = 1usize << 30;
    while chunk >= 1 << 20 {
        match DeviceBuffer::alloc(pool, chunk, &stream) {
            Ok(b) => hog.push(b),
            Err(Error::OutOfMemory { .. }) => chunk /= 2,
            Err(e) => panic!("allocating: {e}"),
        }
    }
    stream.synchronize().unwrap();
    let held: usize = hog.iter().map(|b| b.len()).sum();
    let stage = analyzed(&gpu);
    let same = (
        rows(&run(&gpu, sql).expect("query"), false),
        rows(&run(&mem, sql).expect("query"), false),
    );
    let free = free_memory(device);
    drop(hog);
    assert!(
        stage.contains("given_back=1") && stage.contains("given back: out of memory on"),
        "{held} bytes held, {free} free: {stage}"
    );
    assert_eq!(same.0, same.1, "results differ for {sql}");
    // With the memory back, the stage runs on the device again.
    assert!(analyzed(&gpu).contains("given_back=0"), "{}", analyzed(&gpu));
}

/// String group keys of 0 to 255 bytes (multi-byte UTF-8 among them) take the key words the
/// column's longest value needs; a longer one makes the stage give its work back, with the same
/// answer.
#[test]
fn long_string_keys() {
    let _gpu = gpu_shared();
    let table = |longest: usize| {
        let n = 40_000;
        let s: ArrayRef = Arc::new(StringArray::from_iter((0..n).map(|i| {
            let len = i * 7919 % (longest + 1);
            (i % 17 != 0).then(|| "ä".repeat(len / 2) + &"x".repeat(len % 2))
        })));
        let v: ArrayRef = Arc::new(Int64Array::from_iter_values((0..n).map(|i| i as i64)));
        let batch = RecordBatch::try_from_iter([("s", s), ("v", v)]).unwrap();
        Data::new(vec![vec![batch]])
    };
    let fits = table(255);
    let too_long = table(300);
    common::each_device(|device, _| {
        let (gpu, mem) = sessions(&[("l", &fits), ("x", &too_long)], device);
        for sql in [
            "select s, count(*), sum(v) from l group by s",
            "select substr(s, 3, 20), max(v) from l where v % 3 = 0 group by 1",
            "select case when v > 100 then s else 'short' end, count(*) from l group by 1",
        ] {
            assert_same(&gpu, &mem, sql, true);
        }
        let sql = "select s, count(*) from x group by s";
        assert_same(&gpu, &mem, sql, true);
        let batches = run(&gpu, &format!("explain analyze {sql}")).expect("explain analyze");
        let text = pretty_format_batches(&batches).unwrap().to_string();
        let stage = text.lines().find(|l| l.contains("DeviceStageExec")).expect("a stage");
        // EXPLAIN ANALYZE says why.
        assert!(
            stage.contains("given_back=1") && stage.contains("given back: a group") && stage.contains("key string"),
            "{stage}"
        );
    });
}

/// Group keys of dictionary columns group by their values, as DataFusion groups them: batches with
/// different dictionaries (the same value under different keys, values no key references), null
/// keys and null values, string and integer values, a value longer than two key words, sliced
/// batches.
#[test]
fn dictionary_group_keys() {
    let _gpu = gpu_shared();
    let batch = |b: usize| {
        let n = 5_000;
        let names = ["ant", "bee", "cat", "a dictionary value of 33 bytes..."];
        // Each batch orders its values differently and holds a null value and one more value.
        let values: Vec<Option<&str>> = (0..names.len() + 2)
            .map(|v| match (v + b) % (names.len() + 2) {
                0 => None,
                1 => Some("eel"),
                x => Some(names[x - 2]),
            })
            .collect();
        let keys = Int32Array::from_iter((0..n).map(|i| (i % 13 != 0).then_some(((i * 7 + b) % values.len()) as i32)));
        let ds: ArrayRef = Arc::new(DictionaryArray::new(keys, Arc::new(StringArray::from(values))));
        let small = Int8Array::from_iter((0..n).map(|i| (i % 11 != 0).then_some((i % 3) as i8)));
        let di: ArrayRef = Arc::new(DictionaryArray::new(
            small,
            Arc::new(Int64Array::from(vec![Some(-5 + b as i64), None, Some(1 << 40)])),
        ));
        let x: ArrayRef = Arc::new(Int64Array::from_iter_values((0..n).map(|i| (i * b) as i64 % 1000)));
        let batch = RecordBatch::try_from_iter([("ds", ds), ("di", di), ("x", x)]).unwrap();
        batch.slice(b * 10, n - b * 20)
    };
    let batches: Vec<RecordBatch> = (1..4).map(batch).collect();
    let data = Data::new(vec![batches[..2].to_vec(), batches[2..].to_vec()]);
    common::each_device(|device, _| {
        let (gpu, mem) = sessions(&[("t", &data)], device);
        for sql in [
            "select ds, count(*), sum(x) from t group by ds",
            "select di, ds, min(x), max(x), count(ds) from t where x > 10 group by di, ds",
            "select substr(ds, 2, 2), count(*) from t where x % 3 = 0 group by 1",
            "select count(di), count(*) from t where x > 0",
        ] {
            assert_same(&gpu, &mem, sql, true);
        }
        // Answered from the table's statistics, which count null values as nulls.
        assert_same(&gpu, &mem, "select count(di), count(ds) from t", false);
    });
}

/// `MIN` and `MAX` of strings (`Utf8`, `LargeUtf8`, `Utf8View`) and of decimals wider than 18
/// digits, kept on the device as references to their rows: few groups (accumulated in shared
/// memory) and many, nulls, empty strings, values longer than a view's inline 12 bytes, several
/// batches and partitions.
#[test]
fn min_and_max_of_strings_and_wide_decimals() {
    let _gpu = gpu_shared();
    let batch = |b: usize| {
        let n = 20_000;
        let text = |i: usize| {
            (!i.is_multiple_of(19)).then(|| match i * 7919 % 5 {
                0 => String::new(),
                1 => format!("{}", i * 31 % 977),
                2 => format!("a longer value than twelve bytes {}", i % 101),
                3 => "ü".repeat(i % 7),
                _ => format!("z{}", (i + b) % 13),
            })
        };
        let s: ArrayRef = Arc::new(StringArray::from_iter((0..n).map(text)));
        let l: ArrayRef = Arc::new(LargeStringArray::from_iter((0..n).map(|i| text(i * 3 + b))));
        let v: ArrayRef = Arc::new(StringViewArray::from_iter((0..n).map(|i| text(i * 5 + 2 * b))));
        let d: ArrayRef = Arc::new(
            Decimal128Array::from_iter(
                (0..n).map(|i| (i % 23 != 0).then(|| (i as i128 - 9_000) * 10i128.pow(20) + (i * b) as i128 % 997)),
            )
            .with_precision_and_scale(30, 3)
            .unwrap(),
        );
        let k: ArrayRef = Arc::new(Int64Array::from_iter_values((0..n).map(|i| (i * 13 + b) as i64)));
        RecordBatch::try_from_iter([("s", s), ("l", l), ("v", v), ("d", d), ("k", k)]).unwrap()
    };
    let batches: Vec<RecordBatch> = (0..3).map(batch).collect();
    let data = Data::new(vec![batches[..1].to_vec(), batches[1..].to_vec()]);
    common::each_device(|device, _| {
        let (gpu, mem) = sessions(&[("t", &data)], device);
        for sql in [
            "select min(s), max(s), min(l), max(l), min(v), max(v), min(d), max(d) from t where k > 100",
            "select k % 7, min(s), max(v), min(d), max(l), count(*) from t group by k % 7",
            "select k % 5000, max(s), min(v), max(d) from t group by k % 5000",
            "select k % 3, min(s) filter (where k > 50000), max(d) from t where k < 0 group by k % 3",
        ] {
            assert_same(&gpu, &mem, sql, true);
        }
    });
}

/// A table of `Utf8`, `LargeUtf8` and `Utf8View` columns with nulls, empty strings, multi-byte
/// characters and values longer than a view's inline 12 bytes, over several batches and partitions.
fn text_table() -> Data {
    let batch = |b: usize| {
        let n = 20_000;
        let text = |i: usize| {
            (!i.is_multiple_of(19)).then(|| match i * 7919 % 6 {
                0 => String::new(),
                1 => format!("{}", i * 31 % 977),
                2 => format!("a longer value than twelve bytes {}", i % 101),
                3 => "ü".repeat(i % 7),
                4 => format!("日本{}🌏x", i % 11),
                _ => format!("z{}", (i + b) % 13),
            })
        };
        let s: ArrayRef = Arc::new(StringArray::from_iter((0..n).map(text)));
        let l: ArrayRef = Arc::new(LargeStringArray::from_iter((0..n).map(|i| text(i * 3 + b))));
        let v: ArrayRef = Arc::new(StringViewArray::from_iter((0..n).map(|i| text(i * 5 + 2 * b))));
        let k: ArrayRef = Arc::new(Int64Array::from_iter_values((0..n).map(|i| (i * 13 + b) as i64)));
        RecordBatch::try_from_iter([("s", s), ("l", l), ("v", v), ("k", k)]).unwrap()
    };
    let batches: Vec<RecordBatch> = (0..3).map(batch).collect();
    Data::new(vec![batches[..1].to_vec(), batches[1..].to_vec()])
}

/// Computed string columns (`substr` with every kind of start and count, `CASE` yielding string
/// literals or passing a string column through, `COALESCE`, `NULLIF`, a join's build-side string
/// columns) of `Utf8`, `LargeUtf8` and `Utf8View` as a rows stage's output columns and as group
/// keys: DataFusion's rows, nulls told from empty strings by an `IS NULL` column beside each.
#[test]
fn computed_string_columns() {
    let _gpu = gpu_shared();
    let data = text_table();
    // A dimension of 200 rows whose ids match some of `t`'s keys (its columns of types the device
    // concatenates, so that it stays there as a join's build side).
    let id: ArrayRef = Arc::new(Int64Array::from_iter_values((0..200).map(|i| i * 39)));
    let name: ArrayRef = Arc::new(StringViewArray::from_iter(
        (0..200).map(|i| (i % 7 != 3).then(|| format!("näme {i} of the dimension"))),
    ));
    let tag: ArrayRef = Arc::new(StringViewArray::from_iter(
        (0..200).map(|i| (i % 5 != 1).then(|| "t".repeat(i % 17))),
    ));
    let dim = Data::new(vec![vec![
        RecordBatch::try_from_iter([("id", id), ("name", name), ("tag", tag)]).unwrap(),
    ]]);
    common::each_device(|device, _| {
        let (gpu, mem) = sessions(&[("t", &data), ("d", &dim)], device);
        for sql in [
            "select substr(s, 1, 2), substr(s, 1, 2) is null, substr(l, 0, 3), substr(v, -2, 5), \
             substr(v, -2, 5) is null, k from t where k % 3 = 0",
            "select substring(v from 3), substring(v from 3) is null, substr(s, 2), substr(l, 7, 0), \
             substr(l, 20), k from t where k > 100",
            "select case when k % 4 = 0 then s else 'other' end, case when k % 2 = 0 then v end, \
             case when k % 2 = 0 then v end is null, case when k % 3 = 0 then 'three' \
             when k % 3 = 1 then 'a literal longer than twelve bytes' end, k from t where k < 30000",
            "select coalesce(s, 'none'), nullif(v, ''), nullif(v, '') is null, k from t where k % 7 = 2",
            "select l, v, substr(l, 2, 1) from t where k % 11 = 0",
        ] {
            assert_same(&gpu, &mem, sql, true);
            let plan = explain(&gpu, sql);
            assert!(plan.contains("rows=["), "{sql}\n{plan}");
        }
        // A join's build-side strings, read at each row's match: the join is in the stage.
        let sql = "select t.k, d.name, substr(d.tag, 2), d.tag is null from t join d on t.k = d.id where t.k % 2 = 0";
        assert_same(&gpu, &mem, sql, true);
        let plan = explain(&gpu, sql);
        assert!(
            plan.contains("inner join") && !plan.contains("HashJoinExec"),
            "{sql}\n{plan}"
        );
        for sql in [
            "select substr(v, 2, 3), count(*), sum(k) from t group by 1",
            "select case when k % 3 = 0 then 'three' else l end, count(*) from t group by 1",
            "select substr(s, -1, 4), substr(l, 0), count(*), min(k) from t where k % 2 = 1 group by 1, 2",
            "select nullif(substr(v, 1, 1), 'a'), coalesce(s, 'none'), count(*) from t group by 1, 2",
        ] {
            assert_same(&gpu, &mem, sql, true);
        }
    });
}

/// The shape of a random join: the fact table's rows, the dimension's (none: an empty side), the
/// key domain, the share of fact rows on key 0 (skew) and of null keys in both tables, and
/// whether the dimension repeats its keys.
#[derive(Clone, Debug)]
struct JoinShape {
    fact_rows: usize,
    dim_rows: usize,
    domain: i64,
    skew: u32,
    nulls: u32,
    duplicates: bool,
    seed: u64,
}

fn join_shape() -> impl Strategy<Value = JoinShape> {
    (
        500usize..3000,
        0usize..300,
        1i64..400,
        0u32..90,
        0u32..30,
        any::<bool>(),
        any::<u64>(),
    )
        .prop_map(
            |(fact_rows, dim_rows, domain, skew, nulls, duplicates, seed)| JoinShape {
                fact_rows,
                dim_rows,
                domain,
                skew,
                nulls,
                duplicates,
                seed: seed | 1,
            },
        )
}

/// Fact table `f` (`k`, `k2`, `amount`) and dimension `d` (`k`, `k2`, `w`) of `shape`, in two
/// partitions each: `k` Int64, `k2` Int32 (0..3), both nullable, decimal amounts.
fn join_pair(shape: &JoinShape) -> (Data, Data) {
    let mut x = shape.seed;
    let mut next = move |n: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n
    };
    let mut table = |rows: usize, fact: bool| {
        let mut k = Vec::with_capacity(rows);
        let mut k2 = Vec::with_capacity(rows);
        let mut v = Vec::with_capacity(rows);
        for i in 0..rows {
            let key = if next(100) < u64::from(shape.nulls) {
                None
            } else if fact && next(100) < u64::from(shape.skew) {
                Some(0)
            } else if !fact && !shape.duplicates {
                // Unique keys: the even numbers, half of them inside the fact keys' domain or so.
                Some(i as i64 * 2)
            } else {
                Some(next(shape.domain as u64) as i64)
            };
            k.push(key);
            k2.push((next(4) < 3).then(|| next(3) as i32));
            v.push(next(10_000) as i128);
        }
        // A string key of each key (views, as Parquet's strings are read): some longer than two
        // key words hold (15 bytes).
        let s: Vec<Option<String>> = k
            .iter()
            .map(|k| {
                k.map(|k| {
                    if k % 3 == 0 {
                        format!("a longer string key {k:08}")
                    } else {
                        format!("s{k}")
                    }
                })
            })
            .collect();
        let half = rows / 2;
        let batch = |r: std::ops::Range<usize>| {
            // Every column nullable in both partitions, whatever their values.
            RecordBatch::try_from_iter_with_nullable(vec![
                ("k", Arc::new(Int64Array::from(k[r.clone()].to_vec())) as ArrayRef, true),
                ("k2", Arc::new(Int32Array::from(k2[r.clone()].to_vec())), true),
                (
                    if fact { "amount" } else { "w" },
                    Arc::new(
                        Decimal128Array::from_iter_values(v[r.clone()].iter().copied())
                            .with_precision_and_scale(12, 2)
                            .unwrap(),
                    ),
                    true,
                ),
                ("s", Arc::new(StringViewArray::from(s[r].to_vec())), true),
            ])
            .unwrap()
        };
        Data::new(vec![vec![batch(0..half)], vec![batch(half..rows)]])
    };
    (table(shape.fact_rows, true), table(shape.dim_rows, false))
}

/// Joins of every type DataFusion plans, over random tables, aggregated so that a stage takes
/// them where it can (inner, left outer keeping the fact rows, semi, anti, and `NOT IN` with its
/// null rule; on one or two integer keys or a string key; with and without a join filter); right
/// and full outer joins stay with DataFusion. Every result equals `MemTable`'s (DataFusion's
/// `HashJoinExec`).
const RANDOM_JOINS: &[&str] = &[
    "select f.k2, count(*), sum(f.amount), sum(d.w) from f join d on f.k = d.k group by f.k2",
    "select count(*), sum(f.amount - d.w) from f join d on f.k = d.k and f.k2 = d.k2",
    "select count(*), sum(d.w) from f join d on f.k = d.k and f.amount > d.w",
    "select f.k2, count(*), count(d.w), sum(f.amount) from f left join d on f.k = d.k group by f.k2",
    "select count(*), count(d.k), sum(f.amount) from f left join d on f.k = d.k and f.k2 = d.k2",
    "select count(*), count(f.k), sum(d.w) from f right join d on f.k = d.k",
    "select count(*), count(f.k), count(d.k) from f full join d on f.k = d.k",
    "select k2, count(*), sum(amount) from f where k in (select k from d) group by k2",
    "select count(*) from f where exists (select 1 from d where d.k = f.k and d.k2 = f.k2)",
    "select count(*), sum(amount) from f where exists (select 1 from d where d.k = f.k and d.w < f.amount)",
    "select k2, count(*) from f where not exists (select 1 from d where d.k = f.k) group by k2",
    "select count(*) from f where not exists (select 1 from d where d.k = f.k and d.w > f.amount)",
    "select count(*), sum(amount) from f where k not in (select k from d)",
    "select f.k2, count(*), sum(d.w) from f join d on f.s = d.s group by f.k2",
    "select count(*), sum(amount) from f where s in (select s from d where k2 = 1)",
    "select count(*), sum(amount) from f where s not in (select s from d where k2 = 1)",
];

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Random joins (duplicate keys, null keys, empty sides, skew, multi-column keys, every join
    /// type) return what DataFusion's `HashJoinExec` returns; the inner, semi and anti joins run
    /// inside the stage.
    #[test]
    fn random_joins_match_datafusion(shape in join_shape()) {
        let _gpu = gpu_shared();
        let (f, d) = join_pair(&shape);
        for device in common::devices() {
            let (gpu, mem) = sessions(&[("f", &f), ("d", &d)], device);
            for (i, sql) in RANDOM_JOINS.iter().enumerate() {
                if [0, 1, 7, 10, 12, 13, 14, 15].contains(&i) {
                    let plan = explain(&gpu, sql);
                    prop_assert!(plan.contains(" join("), "{} on {}, {:?}:\n{}", sql, device, shape, plan);
                }
                if [12, 15].contains(&i) {
                    let plan = explain(&gpu, sql);
                    prop_assert!(plan.contains("nullawareanti join("), "{} on {}, {:?}:\n{}", sql, device, shape, plan);
                }
                let (g, m) = (run(&gpu, sql).expect("stage"), run(&mem, sql).expect("DataFusion"));
                prop_assert_eq!(rows(&g, false), rows(&m, false), "{} on {}, {:?}", sql, device, shape);
            }
        }
    }
}

/// A rows stage replaces a node that DataFusion partitioned by the hash of columns its projection
/// then dropped (TPC-H Q2 at SF 1: partsupp joined with part, supplier, nation and region, their
/// strings read at each match): the stage promises no partitioning it cannot compute, and the
/// answer is `MemTable`'s. On the CPU device, where CI runs it.
#[test]
fn rows_stage_under_a_projected_hash_partitioning() {
    let tables = tpch::tables(1.0, PARTITIONS, tpch::BATCH_SIZE).expect("generate");
    let data: Vec<(&str, Data)> = tables.into_iter().map(|t| (t.name, Data::from(t))).collect();
    let refs: Vec<(&str, &Data)> = data.iter().map(|(n, d)| (*n, d)).collect();
    let (gpu, mem) = sessions(&refs, Device::Cpu);
    let sql = tpch_query("q2");
    let plan = explain(&gpu, sql);
    assert!(plan.contains("rows=[p_partkey"), "{plan}");
    assert!(assert_same(&gpu, &mem, sql, true) > 0);
}
