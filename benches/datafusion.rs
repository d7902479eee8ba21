//! DataFusion over GPU tables against `MemTable` over the same batches.
//!
//! - staging of TPC-H `lineitem` (time and GB/s);
//! - TPC-H Q6, Q1, Q12 and Q14 on GPU tables with device stages, on GPU tables without them (scans on
//!   the device, everything above on the host) and on `MemTable` (best of five runs after a warm-up);
//! - all 22 TPC-H queries over the eight tables with device stages and on `MemTable`, with whether a
//!   stage ran (best of three after a warm-up; `ARROW_CUDA_BENCH_ALL=0` skips it);
//! - a filter selectivity sweep (0.1 % to 50 %) over one `Int64` column of 100M rows, in rows/s.
//!
//! The scale factor comes from `ARROW_CUDA_BENCH_SF` (default 10), the sweep's rows from
//! `ARROW_CUDA_BENCH_ROWS` (default 100,000,000), the streams per device from
//! `ARROW_CUDA_BENCH_STREAMS` (default 4, the library's default); `ARROW_CUDA_BENCH_EXPLAIN=q9,q18`
//! prints the `EXPLAIN ANALYZE` of those queries on the GPU tables after their timings;
//! `ARROW_CUDA_BENCH_QUERIES=q2,q18` runs only those of the 22 queries and nothing else.
//! `target_partitions` is the number of cores.
//! Without a GPU it prints `skipped: no CUDA device` and exits.
//!
//! Run with `cargo bench --bench datafusion --features datafusion`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use arrow_array::{ArrayRef, Int64Array, RecordBatch};
use arrow_cuda::datafusion::{GpuTable, LoadOptions, with_device_stages};
use arrow_cuda_workloads::tpch;
use arrow_schema::SchemaRef;
use datafusion::datasource::MemTable;
use datafusion::execution::SessionStateBuilder;
use datafusion::prelude::{SessionConfig, SessionContext};

type Partitions = (SchemaRef, Vec<Vec<RecordBatch>>);

/// TPC-H table `name` at scale factor `sf` in `parts` partitions, in batches of 131,072 rows.
fn generate(name: &str, sf: f64, parts: usize) -> Partitions {
    let table = tpch::table(name, sf, parts, tpch::LARGE_BATCH_SIZE).expect("generate");
    (table.schema, table.partitions)
}

fn env<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn bytes(p: &Partitions) -> usize {
    p.1.iter().flatten().map(RecordBatch::get_array_memory_size).sum()
}

fn gpu(p: &Partitions) -> (GpuTable, Duration) {
    let t = Instant::now();
    let options = LoadOptions::new().with_streams_per_device(env("ARROW_CUDA_BENCH_STREAMS", 4));
    let table = GpuTable::try_new(p.0.clone(), p.1.clone(), &options).expect("stage");
    (table, t.elapsed())
}

fn mem(p: &Partitions) -> MemTable {
    MemTable::try_new(p.0.clone(), p.1.clone()).expect("memtable")
}

/// The plan of one more run of `sql`, with its metrics.
fn explain_analyze(rt: &tokio::runtime::Runtime, ctx: &SessionContext, sql: &str) -> String {
    rt.block_on(async {
        let batches = ctx
            .sql(&format!("explain analyze {sql}"))
            .await
            .expect("plan")
            .collect()
            .await
            .expect("run");
        datafusion::arrow::util::pretty::pretty_format_batches(&batches)
            .expect("format")
            .to_string()
    })
}

/// The best of `runs` runs of `sql` after a warm-up: the whole query, and the part of it spent
/// planning (SQL to physical plan, device stages placed).
fn time(rt: &tokio::runtime::Runtime, ctx: &SessionContext, sql: &str, runs: usize) -> (Duration, Duration) {
    let run = || {
        rt.block_on(async {
            let t = Instant::now();
            let df = ctx.sql(sql).await.expect("plan");
            let plan = df.create_physical_plan().await.expect("plan");
            let planned = t.elapsed();
            datafusion::physical_plan::collect(plan, ctx.task_ctx())
                .await
                .expect("run");
            (t.elapsed(), planned)
        })
    };
    run();
    (0..runs).map(|_| run()).min().unwrap_or_default()
}

fn main() {
    if !arrow_cuda::device::cuda_available() {
        println!("skipped: no CUDA device");
        return;
    }
    let sf: f64 = env("ARROW_CUDA_BENCH_SF", 10.0);
    let sweep_rows: usize = env("ARROW_CUDA_BENCH_ROWS", 100_000_000);
    let cores = std::thread::available_parallelism().map_or(8, |n| n.get());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let config = || SessionConfig::new().with_target_partitions(cores);
    println!("device: {}", arrow_cuda::datafusion::default_device());
    let only = names("ARROW_CUDA_BENCH_QUERIES");
    if !only.is_empty() {
        all_queries(&rt, sf, cores, &config, &only);
        return;
    }

    // TPC-H
    let t = Instant::now();
    let lineitem = generate("lineitem", sf, cores);
    let orders = generate("orders", sf, cores);
    let part = generate("part", sf, cores);
    println!("generated TPC-H SF {sf} in {:.1?}", t.elapsed());

    let (gpu_lineitem, took) = gpu(&lineitem);
    let gb = bytes(&lineitem) as f64 / 1e9;
    println!(
        "staging lineitem: {gb:.2} GB host, {:.2} GB device, {took:.2?}, {:.1} GB/s",
        gpu_lineitem.size_in_bytes() as f64 / 1e9,
        gb / took.as_secs_f64()
    );
    let gpu_ctx = SessionContext::new_with_config(config());
    let stage_ctx = SessionContext::new_with_state(
        with_device_stages(SessionStateBuilder::new().with_default_features().with_config(config())).build(),
    );
    let mem_ctx = SessionContext::new_with_config(config());
    for (name, table) in [
        ("lineitem", gpu_lineitem),
        ("orders", gpu(&orders).0),
        ("part", gpu(&part).0),
    ] {
        let table = Arc::new(table);
        gpu_ctx.register_table(name, table.clone()).unwrap();
        stage_ctx.register_table(name, table).unwrap();
    }
    mem_ctx.register_table("lineitem", Arc::new(mem(&lineitem))).unwrap();
    mem_ctx.register_table("orders", Arc::new(mem(&orders))).unwrap();
    mem_ctx.register_table("part", Arc::new(mem(&part))).unwrap();
    drop((lineitem, orders, part));
    for name in ["Q6", "Q1", "Q12", "Q14"] {
        let q = tpch::query(name).expect("a TPC-H query");
        let (s, planning) = time(&rt, &stage_ctx, q, 5);
        let (g, _) = time(&rt, &gpu_ctx, q, 5);
        let (m, _) = time(&rt, &mem_ctx, q, 5);
        println!(
            "TPC-H {name} SF {sf}: device stages {s:.2?} (planning {planning:.2?}; {:.2}x MemTable), \
             GPU table scans only {g:.2?} ({:.2}x), MemTable {m:.2?}",
            m.as_secs_f64() / s.as_secs_f64(),
            m.as_secs_f64() / g.as_secs_f64()
        );
    }
    drop((gpu_ctx, stage_ctx, mem_ctx));

    if env("ARROW_CUDA_BENCH_ALL", 1) == 1 {
        all_queries(&rt, sf, cores, &config, &[]);
    }

    // Selectivity sweep over one Int64 column.
    let batch_rows = 1 << 20;
    let batches: Vec<RecordBatch> = (0..sweep_rows.div_ceil(batch_rows))
        .map(|b| {
            let start = b * batch_rows;
            let n = batch_rows.min(sweep_rows - start);
            // Values spread evenly over 0..1,000,000 in a scrambled order.
            let values: ArrayRef = Arc::new(Int64Array::from_iter_values(
                (start..start + n).map(|i| ((i as u64).wrapping_mul(2_654_435_761) % 1_000_000) as i64),
            ));
            RecordBatch::try_from_iter([("x", values)]).expect("batch")
        })
        .collect();
    let schema = batches[0].schema();
    let mut partitions = vec![Vec::new(); cores];
    for (i, b) in batches.into_iter().enumerate() {
        partitions[i % cores].push(b);
    }
    let sweep: Partitions = (schema, partitions);
    let gpu_ctx = SessionContext::new_with_config(config());
    let mem_ctx = SessionContext::new_with_config(config());
    gpu_ctx.register_table("t", Arc::new(gpu(&sweep).0)).unwrap();
    mem_ctx.register_table("t", Arc::new(mem(&sweep))).unwrap();
    for selectivity in [0.001, 0.01, 0.05, 0.1, 0.25, 0.5] {
        let k = (selectivity * 1_000_000.0) as i64;
        let sql = format!("select sum(x) from t where x < {k}");
        let (g, _) = time(&rt, &gpu_ctx, &sql, 5);
        let (m, _) = time(&rt, &mem_ctx, &sql, 5);
        let rate = |d: Duration| sweep_rows as f64 / d.as_secs_f64() / 1e9;
        println!(
            "filter x < {k} ({:.1} %) over {sweep_rows} rows: GPU table {g:.2?} ({:.2} G rows/s), \
             MemTable {m:.2?} ({:.2} G rows/s)",
            selectivity * 100.0,
            rate(g),
            rate(m)
        );
    }
}

/// The query names listed in environment variable `var`, e.g. `q9,q18`.
fn names(var: &str) -> Vec<String> {
    env(var, String::new())
        .split(',')
        .filter(|q| !q.is_empty())
        .map(str::to_string)
        .collect()
}

/// The 22 TPC-H queries (or those in `only`) over the eight tables: device stages beside `MemTable`.
fn all_queries(
    rt: &tokio::runtime::Runtime,
    sf: f64,
    cores: usize,
    config: &dyn Fn() -> SessionConfig,
    only: &[String],
) {
    // Queries whose `EXPLAIN ANALYZE` is printed after their timing.
    let explain = names("ARROW_CUDA_BENCH_EXPLAIN");
    let t = Instant::now();
    let tables = tpch::tables(sf, cores, tpch::BATCH_SIZE).expect("generate");
    println!("generated the 8 TPC-H tables at SF {sf} in {:.1?}", t.elapsed());
    let stage_ctx = SessionContext::new_with_state(
        with_device_stages(SessionStateBuilder::new().with_default_features().with_config(config())).build(),
    );
    let mem_ctx = SessionContext::new_with_config(config());
    let t = Instant::now();
    let mut device_bytes = 0;
    for table in tables {
        let staged =
            GpuTable::try_new(table.schema.clone(), table.partitions.clone(), &LoadOptions::new()).expect("stage");
        device_bytes += staged.size_in_bytes();
        stage_ctx.register_table(table.name, Arc::new(staged)).unwrap();
        let mem = MemTable::try_new(table.schema, table.partitions).expect("memtable");
        mem_ctx.register_table(table.name, Arc::new(mem)).unwrap();
    }
    println!(
        "staged the 8 tables ({:.2} GB on the device) in {:.1?}",
        device_bytes as f64 / 1e9,
        t.elapsed()
    );
    let (mut total_s, mut total_m, mut log_ratio, mut ran) = (Duration::ZERO, Duration::ZERO, 0.0, 0);
    for (name, sql) in tpch::QUERIES
        .iter()
        .filter(|(q, _)| only.is_empty() || only.iter().any(|o| o == q))
    {
        let staged = rt.block_on(async {
            let plan = stage_ctx
                .sql(sql)
                .await
                .expect("plan")
                .create_physical_plan()
                .await
                .expect("plan");
            format!(
                "{}",
                datafusion::physical_plan::displayable(plan.as_ref()).indent(false)
            )
            .contains("DeviceStageExec")
        });
        let (s, _) = time(rt, &stage_ctx, sql, 3);
        let (m, _) = time(rt, &mem_ctx, sql, 3);
        if explain.iter().any(|q| q == name) {
            println!(
                "EXPLAIN ANALYZE of TPC-H {name} on the GPU tables:\n{}",
                explain_analyze(rt, &stage_ctx, sql)
            );
        }
        total_s += s;
        total_m += m;
        log_ratio += (m.as_secs_f64() / s.as_secs_f64()).ln();
        ran += 1;
        println!(
            "TPC-H {name} SF {sf}: {} {s:.2?}, MemTable {m:.2?} ({:.2}x)",
            if staged { "device stage" } else { "no stage    " },
            m.as_secs_f64() / s.as_secs_f64()
        );
    }
    println!(
        "TPC-H {ran} queries SF {sf}: GPU tables with device stages {total_s:.2?}, MemTable {total_m:.2?}, geometric mean {:.2}x",
        (log_ratio / ran.max(1) as f64).exp()
    );
}
