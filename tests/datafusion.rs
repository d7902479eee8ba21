//! GPU tables in DataFusion: query results against `MemTable` over the same batches, pushdown in
//! explain plans, limits, projections, statistics, loading and memory accounting. Every case runs
//! on the CPU device and, where a GPU is present, on CUDA device 0 (where the scans run the NVRTC
//! predicate and compaction kernels).
#![cfg(feature = "datafusion")]

mod common;

use std::sync::{Arc, Mutex, OnceLock};

use arrow_array::{
    ArrayRef, BooleanArray, Date32Array, Decimal128Array, Float64Array, Int32Array, Int64Array, LargeStringArray,
    RecordBatch, StringArray, StringViewArray, TimestampMicrosecondArray, UInt8Array,
};
use arrow_cuda::Device;
use arrow_cuda::datafusion::{GpuTable, LoadOptions, Progress, StagingStep, StagingTimes, supports_filter};
use arrow_schema::{DataType, Field, Schema, TimeUnit};
use common::rows;
use common::tables::{Data, Tpch, tpch_query};
use datafusion::arrow::util::pretty::pretty_format_batches;
use datafusion::catalog::TableProvider;
use datafusion::common::stats::Precision;
use datafusion::common::{DataFusionError, ScalarValue};
use datafusion::datasource::MemTable;
use datafusion::prelude::{SessionConfig, SessionContext};
use proptest::prelude::*;

const PARTITIONS: usize = 4;

fn session() -> SessionContext {
    SessionContext::new_with_config(SessionConfig::new().with_target_partitions(PARTITIONS))
}

/// TPC-H at scale factor 0.01 (lineitem: 60,175 rows) in 4,096-row batches, generated once.
fn tpch() -> &'static Tpch {
    static TPCH: OnceLock<Tpch> = OnceLock::new();
    TPCH.get_or_init(|| Tpch::generate(0.01, PARTITIONS, 4096))
}

fn gpu_table(data: &Data, device: Device) -> GpuTable {
    GpuTable::try_new(
        data.schema.clone(),
        data.partitions.clone(),
        &LoadOptions::new().with_device(device),
    )
    .expect("stage table")
}

fn mem_table(data: &Data) -> MemTable {
    MemTable::try_new(data.schema.clone(), data.partitions.clone()).expect("memtable")
}

/// Two sessions over the same TPC-H batches: GPU tables on `device`, and `MemTable`s.
fn tpch_sessions(device: Device) -> (SessionContext, SessionContext) {
    let t = tpch();
    let gpu = session();
    let mem = session();
    for (name, data) in [("lineitem", &t.lineitem), ("orders", &t.orders), ("part", &t.part)] {
        gpu.register_table(name, Arc::new(gpu_table(data, device)))
            .expect("register");
        mem.register_table(name, Arc::new(mem_table(data))).expect("register");
    }
    (gpu, mem)
}

fn query(ctx: &SessionContext, sql: &str) -> Vec<RecordBatch> {
    common::runtime().block_on(async {
        let df = ctx.sql(sql).await.unwrap_or_else(|e| panic!("planning {sql}: {e}"));
        df.collect().await.unwrap_or_else(|e| panic!("running {sql}: {e}"))
    })
}

fn assert_same(gpu: &SessionContext, mem: &SessionContext, sql: &str) -> usize {
    let ordered = sql.to_lowercase().contains("order by");
    let g = rows(&query(gpu, sql), ordered);
    let m = rows(&query(mem, sql), ordered);
    assert_eq!(g, m, "results differ for {sql}");
    g.len()
}

fn explain(ctx: &SessionContext, sql: &str) -> String {
    let batches = query(ctx, &format!("explain {sql}"));
    pretty_format_batches(&batches).expect("format").to_string()
}

/// TPC-H Q1, Q6, Q12, Q14 and other queries: the GPU tables' results equal `MemTable`'s.
#[test]
fn tpch_queries_match_memtable() {
    let others = [
        "select count(*) from lineitem where l_shipmode = 'AIR' and l_quantity > 10",
        "select l_orderkey, l_linenumber, l_comment from lineitem where l_comment like 'care%' \
         order by l_orderkey, l_linenumber",
        "select o_orderpriority, count(*) as c from orders where o_orderdate >= date '1993-07-01' \
         and o_orderdate < date '1993-10-01' group by o_orderpriority order by o_orderpriority",
        "select p_brand, p_size, count(*) as c from part where p_brand <> 'Brand#45' \
         and p_size in (49, 14, 23, 45, 19, 3, 36, 9) and not p_type like 'MEDIUM POLISHED%' \
         group by p_brand, p_size order by p_brand, p_size",
        "select * from orders where o_orderkey < 500",
        "select o_orderkey, o_totalprice from orders where o_orderstatus = 'F' and o_totalprice > 100000 \
         and o_shippriority = 0",
        "select l_orderkey, l_shipdate from lineitem where l_shipdate between date '1996-01-01' and date '1996-01-03' \
         or l_receiptdate is null",
        "select count(*), min(l_shipdate), max(l_extendedprice) from lineitem",
        "select l_returnflag, count(*) from lineitem where l_returnflag in ('A', 'N') and not (l_linenumber >= 3) \
         group by l_returnflag order by l_returnflag",
        "select o_custkey from orders where starts_with(o_clerk, 'Clerk#00000001') order by o_custkey",
        "select o_custkey, count(*) from orders where o_comment not like '%special%requests%' \
         group by o_custkey order by o_custkey",
        "select p_partkey from part where p_type like '%BRASS' or p_name like '_o%e_' order by p_partkey",
    ];
    common::each_device(|device, _| {
        let (gpu, mem) = tpch_sessions(device);
        let queries = ["q1", "q6", "q12", "q14"].map(tpch_query);
        for q in queries.iter().chain(others.iter()) {
            let n = assert_same(&gpu, &mem, q);
            eprintln!("{n} rows: {}", &q[..q.len().min(60)]);
        }
    });
}

/// Supported predicates are pushed into the scan as `Exact` (no `FilterExec` above it), others
/// stay in DataFusion.
#[test]
fn explain_shows_exact_pushdown() {
    common::each_device(|device, _| {
        let (gpu, _) = tpch_sessions(device);
        let plan = explain(
            &gpu,
            "select l_orderkey from lineitem where l_quantity < 24 and l_shipmode = 'AIR' \
             and l_shipdate >= date '1994-01-01' and l_comment like 'fur%' limit 5",
        );
        assert!(plan.contains("full_filters="), "{plan}");
        assert!(plan.contains("GpuTableScan"), "{plan}");
        assert!(plan.contains("filters=["), "{plan}");
        assert!(plan.contains("fetch=5"), "{plan}");
        assert!(!plan.contains("FilterExec"), "{plan}");
        // LIKE with wildcards anywhere, as in TPC-H Q13.
        let plan = explain(
            &gpu,
            "select o_custkey from orders where o_comment not like '%special%requests%'",
        );
        assert!(plan.contains("full_filters="), "{plan}");
        assert!(!plan.contains("FilterExec"), "{plan}");
        // A comparison of two columns is not evaluated on the device.
        let plan = explain(
            &gpu,
            "select l_orderkey from lineitem where l_commitdate < l_receiptdate",
        );
        assert!(plan.contains("FilterExec"), "{plan}");
        assert!(!plan.contains("full_filters="), "{plan}");
        // Nor is an ordering comparison of strings.
        for sql in [
            "select l_orderkey from lineitem where l_shipmode < 'B'",
            "select l_orderkey from lineitem where l_orderkey + 1 = 5",
        ] {
            let plan = explain(&gpu, sql);
            assert!(plan.contains("FilterExec"), "{sql}: {plan}");
        }
    });
}

/// `EXPLAIN ANALYZE` shows what a GPU table scan copied to the host and where its time went.
#[test]
fn explain_analyze_shows_scan_metrics() {
    common::each_device(|device, _| {
        let (gpu, mem) = tpch_sessions(device);
        let sql = "select l_orderkey, l_quantity from lineitem where l_orderkey < 200";
        let n: usize = query(&mem, sql).iter().map(RecordBatch::num_rows).sum();
        assert!((1..1000).contains(&n), "{n} rows");
        let text = pretty_format_batches(&query(&gpu, &format!("explain analyze {sql}")))
            .unwrap()
            .to_string();
        let scan = text.lines().find(|l| l.contains("GpuTableScan")).expect("a scan");
        assert!(scan.contains(&format!("output_rows={n},")), "{scan}");
        // An `Int64` and a `Decimal128` column: 24 bytes a row (no nulls), shown as DataFusion
        // shows counts.
        let bytes = 24 * n;
        let shown = if bytes < 1000 {
            bytes.to_string()
        } else {
            format!("{:.2} K", bytes as f64 / 1000.0)
        };
        assert!(scan.contains(&format!("bytes_to_host={shown},")), "{scan}");
        for metric in ["elapsed_compute=", "copy_time="] {
            assert!(scan.contains(metric), "{metric}: {scan}");
        }
    });
}

/// `supports_filter` over the kinds of predicates and types.
#[test]
fn filter_support_by_expression() {
    use datafusion::logical_expr::{col, lit};
    let schema = random_schema();
    let yes = [
        col("i32").gt(lit(5i32)),
        col("i32").eq(lit(5i64)),
        col("i64").between(lit(1i64), lit(9i64)),
        col("f64").lt_eq(lit(2.5f64)),
        col("dec").gt(lit(ScalarValue::Decimal128(Some(1234), 10, 2))),
        col("date").lt(lit(ScalarValue::Date32(Some(18000)))),
        col("ts").gt_eq(lit(ScalarValue::TimestampMicrosecond(
            Some(1_600_000_000_000_000),
            None,
        ))),
        col("flag"),
        col("flag").eq(lit(true)),
        col("utf8").eq(lit("abc")),
        col("large").not_eq(lit("abc")),
        col("vstr").in_list(vec![lit("a"), lit("b")], false),
        col("utf8").like(lit("ab%")),
        col("utf8").like(lit("a%c")),
        col("large").like(lit("%c_")),
        col("vstr").not_like(lit("%special%requests%")),
        col("vstr").is_null(),
        col("u8").is_not_null().and(col("u8").gt(lit(3u8))),
        !col("i32").gt(lit(1i32)).or(col("f64").is_null()),
    ];
    for e in &yes {
        assert!(supports_filter(e, &schema), "{e} should be pushed down");
    }
    let no = [
        col("i32").gt(col("i64")),
        col("utf8").lt(lit("abc")),
        col("utf8").like(lit("a\\%c")),
        col("utf8").ilike(lit("ab%")),
        col("i32").eq(lit(ScalarValue::Int32(None))),
        col("i32").gt(lit(3_000_000_000i64)),
        (col("i32") + lit(1i32)).gt(lit(5i32)),
        col("f64").gt(lit(1i32)).and(col("utf8").lt(lit("x"))),
    ];
    for e in &no {
        assert!(!supports_filter(e, &schema), "{e} should not be pushed down");
    }
}

/// Limits stop the scan early; projections return only the asked columns; a column used only by
/// a filter is not returned.
#[test]
fn limit_and_projection_pushdown() {
    common::each_device(|device, _| {
        let (gpu, mem) = tpch_sessions(device);
        let out = query(&gpu, "select l_orderkey, l_comment from lineitem limit 7");
        assert_eq!(out.iter().map(RecordBatch::num_rows).sum::<usize>(), 7);
        assert_eq!(out[0].num_columns(), 2);
        let out = query(&gpu, "select l_comment from lineitem where l_quantity < 5 limit 11");
        assert_eq!(out.iter().map(RecordBatch::num_rows).sum::<usize>(), 11);
        assert_eq!(out[0].schema().fields().len(), 1);
        // Filters before the limit: every returned row satisfies the filter.
        let out = query(&gpu, "select l_quantity from lineitem where l_quantity < 5 limit 3000");
        let total: usize = out.iter().map(RecordBatch::num_rows).sum();
        let expected = query(&mem, "select count(*) from lineitem where l_quantity < 5");
        let expected = rows(&expected, true)[0]
            .trim_matches(|c| c == '|' || c == ' ')
            .parse::<usize>()
            .unwrap();
        assert_eq!(total, expected.min(3000));
        let all = rows(
            &query(&mem, "select l_quantity from lineitem where l_quantity < 5"),
            false,
        );
        for r in rows(&out, false) {
            assert!(all.binary_search(&r).is_ok(), "{r}");
        }
        // Scan-level checks straight on the data source.
        let table = gpu_table(&tpch().lineitem, device);
        let ctx = session();
        let plan = common::runtime()
            .block_on(table.scan(&ctx.state(), Some(&vec![0, 15]), &[], Some(5)))
            .expect("scan");
        let batches = common::runtime()
            .block_on(datafusion::physical_plan::collect(plan, ctx.task_ctx()))
            .expect("collect");
        // One partition's limit each: at most 5 rows per partition.
        let n: usize = batches.iter().map(RecordBatch::num_rows).sum();
        assert!((5..=5 * PARTITIONS).contains(&n), "{n}");
        assert!(batches.iter().all(|b| b.num_columns() == 2));
        // count(*) with an empty projection.
        assert_same(&gpu, &mem, "select count(*) from lineitem where l_linenumber = 1");
    });
}

/// Staging gathers consecutive input batches of a partition into device batches of about the
/// rows asked for, keeping every row in order: TPC-H orders, random rows with nulls of every
/// type the GPU concatenates (on a GPU they are gathered there, after their copy: offset and view
/// strings included), and the same with a dictionary column (gathered on the host first).
#[test]
fn staging_gathers_batches() {
    common::each_device(|device, _| {
        let random = random_data(6000, 5);
        let with_dictionary = with_dictionary(&random);
        for data in [&tpch().orders, &random, &with_dictionary] {
            for batch_rows in [1, 5000, usize::MAX] {
                let options = LoadOptions::new().with_device(device).with_batch_rows(batch_rows);
                let table = GpuTable::try_new(data.schema.clone(), data.partitions.clone(), &options).expect("stage");
                for (input, staged) in data.partitions.iter().zip(table.partitions()) {
                    let expected = match batch_rows {
                        1 => input.len(),
                        usize::MAX => 1,
                        n => {
                            // Whole input batches are gathered while they fit in `n` rows.
                            let (mut count, mut rows) = (0, 0);
                            for b in input {
                                if rows > 0 && rows + b.num_rows() > n {
                                    rows = 0;
                                }
                                if rows == 0 {
                                    count += 1;
                                }
                                rows += b.num_rows();
                                if rows >= n {
                                    rows = 0;
                                }
                            }
                            count
                        }
                    };
                    assert_eq!(staged.len(), expected, "{batch_rows} rows a batch");
                    let back: Vec<RecordBatch> =
                        staged.iter().map(|b| b.to_record_batch().expect("download")).collect();
                    for b in &back {
                        b.columns()
                            .iter()
                            .for_each(|c| c.to_data().validate_full().expect("valid"));
                    }
                    let back = arrow_select::concat::concat_batches(&data.schema, &back).expect("concat");
                    let input = arrow_select::concat::concat_batches(&data.schema, input).expect("concat");
                    assert_eq!(back, input, "{batch_rows} rows a batch");
                }
            }
        }
    });
}

/// `data` with a dictionary column more: its `utf8` column's words, dictionary encoded.
fn with_dictionary(data: &Data) -> Data {
    use arrow_array::DictionaryArray;
    use arrow_array::cast::AsArray;
    use arrow_array::types::Int32Type;

    let dictionary = DataType::Dictionary(Box::new(DataType::Int32), Box::new(DataType::Utf8));
    let mut fields: Vec<Field> = data.schema.fields().iter().map(|f| f.as_ref().clone()).collect();
    fields.push(Field::new("dict", dictionary, true));
    let schema = Arc::new(Schema::new(fields));
    let encode = |b: &RecordBatch| {
        let words = b.column_by_name("utf8").unwrap().as_string::<i32>();
        let dict: DictionaryArray<Int32Type> = words.iter().collect();
        let columns = b.columns().iter().cloned().chain([Arc::new(dict) as ArrayRef]);
        RecordBatch::try_new(schema.clone(), columns.collect()).unwrap()
    };
    let partitions = data.partitions.iter().map(|p| p.iter().map(encode).collect()).collect();
    Data { schema, partitions }
}

/// With several GPUs named, partitions spread over all of them and scan concurrently; results
/// equal `MemTable`'s. Without names, a table goes to the first GPU only. Needs two GPUs; says
/// `skipped` elsewhere.
#[test]
fn several_gpus_share_a_table() {
    let n = arrow_cuda::device::cuda_device_count().unwrap_or(0);
    if n < 2 {
        eprintln!("skipped: {n} CUDA devices, two needed");
        return;
    }
    let t = tpch();
    let gpu = session();
    let mem = session();
    let all = LoadOptions::new()
        .with_devices((0..n).map(Device::Cuda))
        .with_batch_rows(2048);
    for (name, data) in [("lineitem", &t.lineitem), ("orders", &t.orders), ("part", &t.part)] {
        let table = GpuTable::try_new(data.schema.clone(), data.partitions.clone(), &all).expect("stage");
        let used: std::collections::BTreeSet<Device> = table.partition_devices().iter().copied().collect();
        assert_eq!(used, (0..n).map(Device::Cuda).collect(), "{name}");
        let default =
            GpuTable::try_new(data.schema.clone(), data.partitions.clone(), &LoadOptions::new()).expect("stage");
        assert!(
            default.partition_devices().iter().all(|&d| d == Device::Cuda(0)),
            "{name}: {:?}",
            default.partition_devices()
        );
        gpu.register_table(name, Arc::new(table)).expect("register");
        mem.register_table(name, Arc::new(mem_table(data))).expect("register");
    }
    for name in ["q1", "q6", "q12", "q14"] {
        assert!(assert_same(&gpu, &mem, tpch_query(name)) > 0, "{name}");
    }
}

/// `table`'s statistics are exact and agree with what DataFusion computes over `data`.
fn assert_exact_statistics(table: &GpuTable, data: &Data) -> datafusion::common::Statistics {
    let stats = table.statistics().expect("statistics");
    assert_eq!(stats.num_rows, Precision::Exact(data.rows()));
    let ctx = session();
    ctx.register_table("t", Arc::new(mem_table(data))).expect("register");
    for (i, f) in data.schema.fields().iter().enumerate() {
        let name = f.name();
        let nulls = query(&ctx, &format!("select count(*) - count({name}) from t"));
        let nulls = nulls[0]
            .column(0)
            .as_any()
            .downcast_ref::<Int64Array>()
            .unwrap()
            .value(0) as usize;
        let cs = &stats.column_statistics[i];
        assert_eq!(cs.null_count, Precision::Exact(nulls), "null count of {name}");
        let mm = query(&ctx, &format!("select min({name}), max({name}) from t"));
        let min = ScalarValue::try_from_array(mm[0].column(0), 0).unwrap();
        let max = ScalarValue::try_from_array(mm[0].column(1), 0).unwrap();
        match (&cs.min_value, &cs.max_value) {
            (Precision::Exact(a), Precision::Exact(b)) => {
                assert_eq!(a, &min, "min of {name}");
                assert_eq!(b, &max, "max of {name}");
            }
            other => panic!("min/max of {name} not exact: {other:?}"),
        }
    }
    stats
}

/// Statistics are exact and agree with what DataFusion computes, whether a partition's extremes
/// come from a few device batches or from more than the stager keeps in flight (batch by batch).
#[test]
fn statistics_values() {
    common::each_device(|device, _| {
        let many = random_data(40_000, 8);
        let table = GpuTable::try_new(
            many.schema.clone(),
            many.partitions.clone(),
            &LoadOptions::new().with_device(device).with_batch_rows(1),
        )
        .expect("stage batch by batch");
        assert!(table.partitions().iter().map(Vec::len).sum::<usize>() > 64);
        assert_exact_statistics(&table, &many);
        let data = random_data(2000, 7);
        let table = gpu_table(&data, device);
        let stats = assert_exact_statistics(&table, &data);
        // The scan reports the same statistics, projected.
        let scan = table
            .scan_source()
            .with_projection(Some(vec![1, 0]))
            .expect("projection");
        use datafusion::datasource::source::DataSource;
        let s = scan.partition_statistics(None).expect("stats");
        assert_eq!(s.num_rows, Precision::Exact(data.rows()));
        assert_eq!(s.column_statistics[0], stats.column_statistics[1]);
        // Its byte size is that of the columns it returns, as `MemTable` counts them (DataFusion's
        // join selection puts the smaller side first by it): additive over columns, and within a
        // tenth of `MemTable`'s (staging gathers batches, whose buffers round differently).
        let bytes = |projection: Vec<usize>| {
            let scan = table
                .scan_source()
                .with_projection(Some(projection.clone()))
                .expect("projection");
            let gpu = *scan
                .partition_statistics(None)
                .expect("stats")
                .total_byte_size
                .get_value()
                .expect("bytes");
            let mem = datafusion::datasource::memory::MemorySourceConfig::try_new(
                &data.partitions,
                data.schema.clone(),
                Some(projection),
            )
            .expect("memory source");
            let mem = *mem
                .partition_statistics(None)
                .expect("stats")
                .total_byte_size
                .get_value()
                .expect("bytes");
            (gpu, mem)
        };
        let (both, mem_both) = bytes(vec![1, 0]);
        assert_eq!(both, bytes(vec![0]).0 + bytes(vec![1]).0);
        assert!(
            both.abs_diff(mem_both) * 10 <= mem_both,
            "{both} bytes, MemTable {mem_both}"
        );
        let all: Vec<usize> = (0..data.schema.fields().len()).collect();
        let (whole, mem_whole) = bytes(all);
        assert!(
            both < whole && whole.abs_diff(mem_whole) * 10 <= mem_whole,
            "{whole}, MemTable {mem_whole}"
        );
    });
}

/// Loading reports progress and, when asked, the time of its steps; other providers, Parquet and
/// CSV files load and query like the source.
#[test]
fn loading_from_providers_and_files() {
    common::each_device(|device, _| {
        let data = &tpch().orders;
        let seen: Arc<Mutex<Vec<Progress>>> = Arc::default();
        let s = seen.clone();
        let options = LoadOptions::new()
            .with_device(device)
            .with_progress(move |p| s.lock().unwrap().push(p));
        let table = GpuTable::try_new(data.schema.clone(), data.partitions.clone(), &options).expect("stage");
        let seen = seen.lock().unwrap().clone();
        let last = seen.last().expect("progress was reported");
        assert_eq!(last.rows, data.rows() as u64);
        assert_eq!(last.total_rows, Some(data.rows() as u64));
        assert_eq!(last.batches as usize, data.partitions.iter().flatten().count());
        assert!(
            seen.windows(2)
                .all(|w| w[0].rows <= w[1].rows && w[0].bytes <= w[1].bytes)
        );
        assert_eq!(table.num_rows(), data.rows());

        let sql = "select o_orderpriority, count(*), sum(o_totalprice) from t \
                   where o_orderstatus = 'O' group by o_orderpriority order by o_orderpriority";
        let mem = session();
        mem.register_table("t", Arc::new(mem_table(data))).expect("register");
        let from_provider = common::runtime()
            .block_on(GpuTable::from_provider(
                Arc::new(mem_table(data)),
                &LoadOptions::new().with_device(device).with_partitions(3),
            ))
            .expect("from provider");
        assert_eq!(from_provider.partitions().len(), 3);
        let gpu = session();
        gpu.register_table("t", Arc::new(from_provider)).expect("register");
        assert_same(&gpu, &mem, sql);

        // Files written by DataFusion, read back by the GPU table and by DataFusion.
        let dir = std::env::temp_dir().join(format!("arrow-cuda-df-{}-{device}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        let parquet = dir.join("orders.parquet");
        let csv = dir.join("orders.csv");
        common::runtime().block_on(async {
            use datafusion::dataframe::DataFrameWriteOptions;
            let df = mem.table("t").await.unwrap();
            df.clone()
                .write_parquet(parquet.to_str().unwrap(), DataFrameWriteOptions::new(), None)
                .await
                .expect("write parquet");
            df.write_csv(csv.to_str().unwrap(), DataFrameWriteOptions::new(), None)
                .await
                .expect("write csv");
        });
        // With its steps timed: each that ran counted some time, and none that did not.
        let times = Arc::new(StagingTimes::new());
        let from_parquet = common::runtime()
            .block_on(GpuTable::from_parquet(
                &parquet,
                &LoadOptions::new().with_device(device).with_staging_times(times.clone()),
            ))
            .expect("from parquet");
        let ran = [
            StagingStep::Decode,
            StagingStep::Prepare,
            StagingStep::Upload,
            StagingStep::Alloc,
            StagingStep::Pack,
        ];
        for step in ran {
            assert!(!times.get(step).is_zero(), "{step:?}: {times}");
        }
        let gpu_only = StagingStep::Copy;
        assert_eq!(times.get(gpu_only).is_zero(), device == Device::Cpu, "{times}");
        let from_csv = common::runtime()
            .block_on(GpuTable::from_csv(
                &csv,
                datafusion::prelude::CsvReadOptions::new(),
                &LoadOptions::new().with_device(device),
            ))
            .expect("from csv");
        // (CSV reads prices as floats, whose sums depend on the partitioning: min and max do not.)
        let file_sql = "select o_orderpriority, count(*), min(o_totalprice), max(o_totalprice) from t \
                   where o_orderstatus = 'O' and o_orderkey > 100 group by o_orderpriority order by o_orderpriority";
        let (g1, g2, m1, m2) = (session(), session(), session(), session());
        g1.register_table("t", Arc::new(from_parquet)).unwrap();
        g2.register_table("t", Arc::new(from_csv)).unwrap();
        common::runtime().block_on(async {
            m1.register_parquet("t", parquet.to_str().unwrap(), Default::default())
                .await
                .unwrap();
            m2.register_csv("t", csv.to_str().unwrap(), Default::default())
                .await
                .unwrap();
        });
        assert_same(&g1, &m1, file_sql);
        assert_same(&g2, &m2, file_sql);
        let _ = std::fs::remove_dir_all(&dir);
    });
}

/// The bytes a batch's values need in its own types: the used ranges of its buffers, and for view
/// columns the views and the bytes of the values too long to be inlined in them (each once).
fn value_bytes(batch: &RecordBatch) -> usize {
    use arrow_array::Array;
    use arrow_array::cast::AsArray;
    batch
        .columns()
        .iter()
        .map(|c| match c.data_type() {
            DataType::Utf8View => {
                let v = c.as_string_view();
                16 * v.len() + v.total_buffer_bytes_used() + v.nulls().map_or(0, |n| n.len().div_ceil(8))
            }
            _ => c.to_data().get_slice_memory_size().expect("slice size"),
        })
        .sum()
}

/// Strings read from Parquet by DataFusion come as `Utf8View` arrays whose data buffers are the
/// decoded pages (and dictionaries) of a whole row group, shared by every batch of it and holding
/// bytes no view of the batch references. A staged table takes device memory in proportion to its
/// values all the same, and its size, its byte statistics and the progress it reports count what
/// staging really copies.
#[test]
fn staged_views_take_the_memory_of_their_values() {
    use datafusion::parquet::arrow::ArrowWriter;
    use datafusion::parquet::file::properties::WriterProperties;
    let rows = 100_000usize;
    let schema = Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("flag", DataType::Utf8, false),
        Field::new("mode", DataType::Utf8, false),
        Field::new("comment", DataType::Utf8, true),
    ]));
    let modes = [
        "DELIVER IN PERSON",
        "COLLECT COD",
        "TAKE BACK RETURN",
        "NONE OF THE ABOVE, THANKS",
    ];
    let batch = RecordBatch::try_new(
        schema.clone(),
        vec![
            Arc::new(Int64Array::from_iter_values(0..rows as i64)),
            Arc::new(StringArray::from_iter_values((0..rows).map(|i| ["A", "N", "R"][i % 3]))),
            Arc::new(StringArray::from_iter_values((0..rows).map(|i| modes[i % 4]))),
            Arc::new(StringArray::from_iter((0..rows).map(|i| {
                (i % 10 != 0).then(|| format!("comment {i} {}", "lorem ipsum ".repeat(i * 7 % 9)))
            }))),
        ],
    )
    .expect("batch");
    let dir = std::env::temp_dir().join(format!("arrow-cuda-views-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("strings.parquet");
    // One row group: every batch DataFusion reads shares its pages and dictionaries.
    let properties = WriterProperties::builder()
        .set_max_row_group_row_count(Some(rows))
        .build();
    let mut writer =
        ArrowWriter::try_new(std::fs::File::create(&path).expect("create"), schema, Some(properties)).expect("writer");
    writer.write(&batch).expect("write");
    writer.close().expect("close");

    common::each_device(|device, _| {
        let seen: Arc<Mutex<Vec<Progress>>> = Arc::default();
        let s = seen.clone();
        let options = LoadOptions::new()
            .with_device(device)
            .with_progress(move |p| s.lock().unwrap().push(p));
        let table = common::runtime()
            .block_on(GpuTable::from_parquet(&path, &options))
            .expect("from parquet");
        // What DataFusion reads: the same batches, in the same partitions.
        let read: Vec<RecordBatch> = common::runtime().block_on(async {
            let ctx = SessionContext::new();
            let df = ctx
                .read_parquet(path.to_str().unwrap(), Default::default())
                .await
                .expect("read");
            df.collect().await.expect("collect")
        });
        assert_eq!(
            table.schema_ref().field(3).data_type(),
            &DataType::Utf8View,
            "DataFusion reads strings as views"
        );
        let needed: usize = read.iter().map(value_bytes).sum();
        let within = |what: &str, bytes: usize| {
            eprintln!("{what}: {bytes} bytes, the values need {needed}");
            assert!(
                bytes * 4 <= needed * 5,
                "{what}: {bytes} bytes, more than 1.25 times the {needed} bytes the values need"
            );
        };
        within("device memory", table.size_in_bytes());
        let progress = seen.lock().unwrap().last().copied().expect("progress");
        within("progress", progress.bytes as usize);
        assert!(
            progress.bytes as usize >= table.size_in_bytes(),
            "progress counts every byte staged: {progress:?}"
        );
        let stats = table
            .statistics_ref()
            .total_byte_size
            .get_value()
            .copied()
            .expect("bytes");
        within("statistics", stats);
        // Every value survives.
        let back = downloaded(&table);
        let read = arrow_select::concat::concat_batches(table.schema_ref(), &read).expect("concat");
        assert_eq!(back, read);
    });
    let _ = std::fs::remove_dir_all(&dir);
}

/// A table that does not fit is an error before anything is copied, not an abort; allocation
/// failures become `ResourcesExhausted`. The error names the table, the bytes it takes on the
/// device and the bytes free there (here: the memory limit).
#[test]
fn out_of_memory_is_an_error() {
    common::each_device(|device, _| {
        let data = &tpch().orders;
        let message = |err: DataFusionError| match err {
            DataFusionError::ResourcesExhausted(m) => m,
            other => panic!("expected ResourcesExhausted, got {other}"),
        };
        let err = GpuTable::try_new(
            data.schema.clone(),
            data.partitions.clone(),
            &LoadOptions::new()
                .with_name("orders")
                .with_device(device)
                .with_memory_limit(100_000),
        )
        .expect_err("must not fit");
        // The whole table goes to one device: its share is the whole table.
        let m = message(err);
        let whole = m
            .split("it takes ")
            .nth(1)
            .and_then(|rest| rest.split(' ').next())
            .and_then(|n| n.parse::<u64>().ok())
            .unwrap_or_else(|| panic!("no size in: {m}"));
        assert!(whole > 1_000_000, "{m}");
        assert_eq!(
            m,
            format!(
                "table `orders` does not fit on {device}: it takes {whole} bytes there ({whole} bytes in all), \
                 and the memory limit is 100000 bytes"
            )
        );
        // Streaming loads check batch by batch (one of 4,096 rows fits, not two), and free what they
        // staged.
        let err = common::runtime()
            .block_on(GpuTable::from_provider(
                Arc::new(mem_table(data)),
                &LoadOptions::new()
                    .with_name("orders")
                    .with_device(device)
                    .with_batch_rows(1)
                    .with_memory_limit(1_000_000),
            ))
            .expect_err("must not fit");
        let m = message(err);
        assert!(
            m.starts_with(&format!("table `orders` does not fit on {device}: it takes at least ")),
            "{m}"
        );
        assert!(
            m.ends_with(", and the memory limit is 1000000 bytes; what was staged is freed"),
            "{m}"
        );
        // A file names the table by its path.
        let dir = std::env::temp_dir().join(format!("arrow-cuda-oom-{}-{device}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("orders.parquet");
        common::runtime().block_on(async {
            let ctx = session();
            ctx.register_table("t", Arc::new(mem_table(data))).unwrap();
            ctx.table("t")
                .await
                .unwrap()
                .write_parquet(path.to_str().unwrap(), Default::default(), None)
                .await
                .expect("write parquet")
        });
        let err = common::runtime()
            .block_on(GpuTable::from_parquet(
                &path,
                &LoadOptions::new().with_device(device).with_memory_limit(200_000),
            ))
            .expect_err("must not fit");
        let m = message(err);
        assert!(
            m.starts_with(&format!("table `{}` does not fit", path.display())),
            "{m}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    });
    let e: DataFusionError = arrow_cuda::Error::OutOfMemory {
        device: Device::Cuda(0),
        requested: 1 << 40,
    }
    .into();
    assert!(matches!(e, DataFusionError::ResourcesExhausted(_)), "{e}");
    // On a GPU, a table larger than the device's free memory is refused up front.
    if let Some(device) = common::cuda() {
        let free = arrow_cuda::device::cuda_devices().unwrap()[0].free_memory;
        // One column of 2^24 Int64 zeros (128 MiB), repeated by reference past the free memory.
        let column: ArrayRef = Arc::new(Int64Array::from(vec![0i64; 1 << 24]));
        let batch = RecordBatch::try_from_iter([("x", column)]).unwrap();
        let copies = free / (8 << 24) + 2;
        let partitions = vec![vec![batch.clone(); copies]];
        let err = GpuTable::try_new(batch.schema(), partitions, &LoadOptions::new().with_device(device))
            .expect_err("larger than the GPU");
        assert!(matches!(err, DataFusionError::ResourcesExhausted(_)), "{err}");
    }
}

// ---- random predicates --------------------------------------------------------------------

fn random_schema() -> Schema {
    Schema::new(vec![
        Field::new("i32", DataType::Int32, true),
        Field::new("i64", DataType::Int64, true),
        Field::new("u8", DataType::UInt8, true),
        Field::new("f64", DataType::Float64, true),
        Field::new("dec", DataType::Decimal128(10, 2), true),
        Field::new("date", DataType::Date32, true),
        Field::new("ts", DataType::Timestamp(TimeUnit::Microsecond, None), true),
        Field::new("flag", DataType::Boolean, true),
        Field::new("utf8", DataType::Utf8, true),
        Field::new("large", DataType::LargeUtf8, true),
        Field::new("vstr", DataType::Utf8View, true),
    ])
}

const WORDS: [&str; 8] = ["", "a", "ab", "abc", "abcdefghijklmnop", "b", "ba", "abcdefghijklmnopq"];

/// Random rows with nulls, NaN and signed zeros, in four partitions of a few batches.
fn random_data(rows: usize, seed: u64) -> Data {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let schema = Arc::new(random_schema());
    let mut batches = Vec::new();
    let mut left = rows;
    while left > 0 {
        let n = left.min(rng.random_range(1..700));
        left -= n;
        let null = |rng: &mut rand::rngs::StdRng| rng.random_bool(0.15);
        macro_rules! col {
            ($t:ty, $f:expr) => {{
                let v: $t = (0..n)
                    .map(|_| if null(&mut rng) { None } else { Some($f(&mut rng)) })
                    .collect();
                Arc::new(v) as ArrayRef
            }};
        }
        let floats = [0.0, -0.0, 1.5, -2.25, f64::NAN, 100.0, 3.0];
        let columns = vec![
            col!(Int32Array, |r: &mut rand::rngs::StdRng| r.random_range(-20..20)),
            col!(Int64Array, |r: &mut rand::rngs::StdRng| r.random_range(-1000..1000)),
            col!(UInt8Array, |r: &mut rand::rngs::StdRng| r.random_range(0..10)),
            col!(Float64Array, |r: &mut rand::rngs::StdRng| floats
                [r.random_range(0..floats.len())]),
            Arc::new(
                (0..n)
                    .map(|_| (!null(&mut rng)).then(|| rng.random_range(-5000i128..5000)))
                    .collect::<Decimal128Array>()
                    .with_precision_and_scale(10, 2)
                    .unwrap(),
            ) as ArrayRef,
            col!(Date32Array, |r: &mut rand::rngs::StdRng| 18000 + r.random_range(0..30)),
            col!(
                TimestampMicrosecondArray,
                |r: &mut rand::rngs::StdRng| 1_600_000_000_000_000 + r.random_range(0..10i64) * 1_000_000
            ),
            col!(BooleanArray, |r: &mut rand::rngs::StdRng| r.random_bool(0.5)),
            col!(StringArray, |r: &mut rand::rngs::StdRng| WORDS
                [r.random_range(0..WORDS.len())]),
            col!(LargeStringArray, |r: &mut rand::rngs::StdRng| WORDS
                [r.random_range(0..WORDS.len())]),
            col!(StringViewArray, |r: &mut rand::rngs::StdRng| WORDS
                [r.random_range(0..WORDS.len())]),
        ];
        batches.push(RecordBatch::try_new(schema.clone(), columns).unwrap());
    }
    let mut partitions = vec![Vec::new(); PARTITIONS];
    for (i, b) in batches.into_iter().enumerate() {
        partitions[i % PARTITIONS].push(b);
    }
    Data { schema, partitions }
}

/// A random leaf predicate, in SQL.
fn leaf() -> impl Strategy<Value = String> {
    let ops = prop::sample::select(vec!["=", "<>", "<", "<=", ">", ">="]);
    let eq = prop::sample::select(vec!["=", "<>"]);
    let word = prop::sample::select(WORDS.to_vec());
    let string_col = prop::sample::select(vec!["utf8", "large", "vstr"]);
    let any_col = prop::sample::select(vec![
        "i32", "i64", "u8", "f64", "dec", "date", "ts", "flag", "utf8", "large", "vstr",
    ]);
    prop_oneof![
        (ops.clone(), -25i32..25).prop_map(|(o, v)| format!("i32 {o} {v}")),
        (ops.clone(), -1100i64..1100).prop_map(|(o, v)| format!("i64 {o} {v}")),
        (ops.clone(), 0u8..12).prop_map(|(o, v)| format!("u8 {o} {v}")),
        (
            ops.clone(),
            prop::sample::select(vec!["0.0", "-0.0", "1.5", "-2.25", "'NaN'", "3", "99.5"])
        )
            .prop_map(|(o, v)| format!("f64 {o} cast({v} as double)")),
        (ops.clone(), -6000i64..6000).prop_map(|(o, v)| format!(
            "dec {o} cast({}.{:02} as decimal(10, 2))",
            v / 100,
            (v % 100).abs()
        )
        .replace("cast(0.", if v < 0 { "cast(-0." } else { "cast(0." })),
        (ops.clone(), 0i32..30).prop_map(|(o, v)| format!("date {o} date '2019-04-14' + interval '{v}' day")),
        (ops.clone(), 0i64..10).prop_map(|(o, v)| format!("ts {o} timestamp '2020-09-13T12:26:{:02}'", 40 + v)),
        (ops, any::<bool>()).prop_map(|(o, v)| format!("flag {o} {v}")),
        Just("flag".to_string()),
        (string_col.clone(), eq, word.clone()).prop_map(|(c, o, w)| format!("{c} {o} '{w}'")),
        (string_col.clone(), word.clone(), any::<bool>())
            .prop_map(|(c, w, n)| format!("{c} {}like '{w}%'", if n { "not " } else { "" })),
        (string_col.clone(), word.clone(), word.clone(), 0..4usize, any::<bool>()).prop_map(|(c, a, b, shape, n)| {
            let pattern = match shape {
                0 => format!("%{a}%"),
                1 => format!("{a}%{b}"),
                2 => format!("_{a}%"),
                _ => format!("%{a}_{b}%"),
            };
            format!("{c} {}like '{pattern}'", if n { "not " } else { "" })
        }),
        (string_col.clone(), word.clone()).prop_map(|(c, w)| format!("starts_with({c}, '{w}')")),
        (string_col, prop::collection::vec(word, 1..4), any::<bool>()).prop_map(|(c, ws, n)| {
            let list: Vec<String> = ws.iter().map(|w| format!("'{w}'")).collect();
            format!("{c} {}in ({})", if n { "not " } else { "" }, list.join(", "))
        }),
        (prop::collection::vec(-20i32..20, 1..5), any::<bool>()).prop_map(|(vs, n)| {
            let list: Vec<String> = vs.iter().map(i32::to_string).collect();
            format!("i32 {}in ({})", if n { "not " } else { "" }, list.join(", "))
        }),
        (-1000i64..1000, 0i64..500, any::<bool>()).prop_map(|(lo, w, n)| format!(
            "i64 {}between {lo} and {}",
            if n { "not " } else { "" },
            lo + w
        )),
        (any_col, any::<bool>()).prop_map(|(c, n)| format!("{c} is {}null", if n { "not " } else { "" })),
    ]
}

fn predicate() -> impl Strategy<Value = String> {
    leaf().prop_recursive(3, 12, 2, |inner| {
        prop_oneof![
            (inner.clone(), inner.clone()).prop_map(|(a, b)| format!("({a} and {b})")),
            (inner.clone(), inner.clone()).prop_map(|(a, b)| format!("({a} or {b})")),
            inner.prop_map(|a| format!("not ({a})")),
        ]
    })
}

struct RandomSessions {
    device: Device,
    gpu: SessionContext,
    mem: SessionContext,
}

fn random_sessions() -> &'static Vec<RandomSessions> {
    static S: OnceLock<Vec<RandomSessions>> = OnceLock::new();
    S.get_or_init(|| {
        let data = random_data(3000, 42);
        common::devices()
            .into_iter()
            .map(|device| {
                // Small device batches: limits and compaction run over several per partition.
                let options = LoadOptions::new().with_device(device).with_batch_rows(500);
                let table = GpuTable::try_new(data.schema.clone(), data.partitions.clone(), &options).unwrap();
                let gpu = session();
                gpu.register_table("t", Arc::new(table)).unwrap();
                let mem = session();
                mem.register_table("t", Arc::new(mem_table(&data))).unwrap();
                RandomSessions { device, gpu, mem }
            })
            .collect()
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    /// Random predicates over every supported type, with nulls: the GPU table returns what
    /// `MemTable` returns, with and without a limit and a narrow projection.
    #[test]
    fn random_predicates_match_memtable(p in predicate(), limit in prop::option::of(0usize..50)) {
        for s in random_sessions() {
            let sql = format!("select * from t where {p}");
            let g = rows(&query(&s.gpu, &sql), false);
            let m = rows(&query(&s.mem, &sql), false);
            prop_assert_eq!(&g, &m, "{} on {}", sql, s.device);
            let sql = format!("select i64, vstr from t where {p}");
            prop_assert_eq!(
                rows(&query(&s.gpu, &sql), false),
                rows(&query(&s.mem, &sql), false),
                "{} on {}", sql, s.device
            );
            if let Some(limit) = limit {
                // With a limit, the rows returned are some `limit` of the matching ones.
                let sql = format!("select i32, i64, utf8 from t where {p} limit {limit}");
                let g = rows(&query(&s.gpu, &sql), false);
                let all = rows(&query(&s.mem, &format!("select i32, i64, utf8 from t where {p}")), false);
                prop_assert_eq!(g.len(), all.len().min(limit), "{} on {}", sql, s.device);
                for r in &g {
                    prop_assert!(all.binary_search(r).is_ok(), "{} on {}: {}", sql, s.device, r);
                }
            }
        }
    }
}

/// The random predicates are mostly pushed down (so the property test exercises the device).
#[test]
fn random_predicates_are_pushed_down() {
    let s = &random_sessions()[0];
    for sql in [
        "select * from t where i32 > 3 and f64 <= cast(1.5 as double)",
        "select * from t where dec > cast(1.25 as decimal(10, 2)) or date = date '2019-04-20'",
        "select * from t where ts >= timestamp '2020-09-13T12:26:45' and not flag",
        "select * from t where vstr like 'ab%' and large in ('a', 'b') and utf8 <> 'ba'",
        "select * from t where u8 is null or i64 not between 1 and 20",
    ] {
        let plan = explain(&s.gpu, sql);
        assert!(!plan.contains("FilterExec"), "{sql}: {plan}");
        assert!(plan.contains("full_filters="), "{sql}: {plan}");
    }
}

// ---- files and SQL ------------------------------------------------------------------------------

/// A fresh temporary directory for one case on one device.
fn temp_dir(case: &str, device: Device) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("arrow-cuda-{case}-{}-{device}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

/// `random_data` with dictionary, list and struct columns too, as one batch.
fn wide_batch(rows: usize, seed: u64) -> RecordBatch {
    use arrow_array::cast::AsArray;
    use arrow_array::types::Int32Type;
    use arrow_array::{ListArray, StructArray};
    let data = random_data(rows, seed);
    let batch = arrow_select::concat::concat_batches(&data.schema, data.partitions.iter().flatten()).expect("concat");
    let dict = arrow_cast::cast(
        batch.column_by_name("utf8").unwrap(),
        &DataType::Dictionary(Box::new(DataType::Int32), Box::new(DataType::Utf8)),
    )
    .expect("dictionary");
    let ints = batch.column_by_name("i32").unwrap().as_primitive::<Int32Type>();
    let list: ArrayRef = Arc::new(ListArray::from_iter_primitive::<Int32Type, _, _>(
        ints.iter()
            .map(|v| v.map(|v| (0..v.rem_euclid(4)).map(|k| Some(v + k)).collect::<Vec<_>>())),
    ));
    let st: ArrayRef = Arc::new(StructArray::from(vec![
        (
            Arc::new(Field::new("n", DataType::Int64, true)),
            batch.column_by_name("i64").unwrap().clone(),
        ),
        (
            Arc::new(Field::new("s", DataType::Utf8, true)),
            batch.column_by_name("utf8").unwrap().clone(),
        ),
    ]));
    let mut fields: Vec<Field> = batch.schema().fields().iter().map(|f| f.as_ref().clone()).collect();
    let mut columns = batch.columns().to_vec();
    for (name, c) in [("dict", dict), ("list", list), ("st", st)] {
        fields.push(Field::new(name, c.data_type().clone(), true));
        columns.push(c);
    }
    RecordBatch::try_new(Arc::new(Schema::new(fields)), columns).expect("wide batch")
}

/// Writes `batch` as Parquet files `a.parquet` and `b.parquet` (half the rows each) in `dir`, in
/// row groups of 250 rows.
fn write_parquet(dir: &std::path::Path, batch: &RecordBatch) {
    use datafusion::parquet::arrow::ArrowWriter;
    use datafusion::parquet::file::properties::WriterProperties;
    let half = batch.num_rows() / 2;
    for (name, part) in [
        ("a", batch.slice(0, half)),
        ("b", batch.slice(half, batch.num_rows() - half)),
    ] {
        let file = std::fs::File::create(dir.join(format!("{name}.parquet"))).expect("create");
        let props = WriterProperties::builder()
            .set_max_row_group_row_count(Some(250))
            .build();
        let mut w = ArrowWriter::try_new(file, part.schema(), Some(props)).expect("writer");
        w.write(&part).expect("write");
        w.close().expect("close");
    }
}

/// DataFusion's read of the Parquet files at `path`, in file and row order.
fn datafusion_read(path: &str) -> RecordBatch {
    let ctx = SessionContext::new_with_config(SessionConfig::new().with_target_partitions(1));
    let batches = common::runtime()
        .block_on(async { ctx.read_parquet(path, Default::default()).await?.collect().await })
        .expect("read parquet");
    arrow_select::concat::concat_batches(&batches[0].schema(), &batches).expect("concat")
}

/// Staging from Parquet keeps every value (of every type the reader makes: view strings,
/// dictionaries, lists, structs, decimals, timestamps, nulls) in file order, as DataFusion reads
/// them; its runs of row groups make the partitions asked for; its statistics are those of the
/// same rows staged from host batches.
#[test]
fn parquet_staging_keeps_values_partitions_and_statistics() {
    common::each_device(|device, _| {
        let dir = temp_dir("parquet", device);
        write_parquet(&dir, &wide_batch(3000, 11));
        let path = format!("{}/", dir.display());
        let expected = datafusion_read(&path);
        for partitions in [None, Some(1), Some(3)] {
            let mut options = LoadOptions::new().with_device(device).with_batch_rows(600);
            if let Some(n) = partitions {
                options = options.with_partitions(n);
            }
            let seen: Arc<Mutex<Vec<Progress>>> = Arc::default();
            let s = seen.clone();
            let options = options.with_progress(move |p| s.lock().unwrap().push(p));
            let table = common::runtime()
                .block_on(GpuTable::from_parquet(&dir, &options))
                .expect("from parquet");
            assert_eq!(table.schema(), expected.schema(), "{partitions:?}");
            if let Some(n) = partitions {
                assert_eq!(table.partitions().len(), n);
            }
            // Runs of row groups: 250-row groups gathered up to 600 rows (fewer on machines with
            // many cores), never more than one file's.
            assert!(table.partitions().iter().flatten().all(|b| b.num_rows() <= 750));
            let back = downloaded(&table);
            assert_eq!(back, expected, "{partitions:?}");

            let host = GpuTable::try_new(
                expected.schema(),
                vec![vec![expected.clone()]],
                &LoadOptions::new().with_device(device),
            )
            .expect("stage host batch");
            // (Byte sizes are estimates, which differ with the batches.)
            let (ours, theirs) = (table.statistics().unwrap(), host.statistics().unwrap());
            assert_eq!(ours.num_rows, Precision::Exact(expected.num_rows()));
            assert_eq!(ours.num_rows, theirs.num_rows);
            assert_eq!(ours.column_statistics, theirs.column_statistics, "{partitions:?}");
            assert!(matches!(ours.column_statistics[0].min_value, Precision::Exact(_)));

            let seen = seen.lock().unwrap().clone();
            let last = seen.last().expect("progress");
            assert_eq!(last.rows, expected.num_rows() as u64);
            assert_eq!(last.total_rows, Some(expected.num_rows() as u64));
            assert!(last.decoded >= last.bytes && last.bytes > 0, "{last:?}");
            assert!(
                seen.windows(2)
                    .all(|w| w[0].decoded <= w[1].decoded && w[0].bytes <= w[1].bytes)
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    });
}

/// A session with `STORED AS GPU` on `device`.
fn sql_session(device: Device) -> SessionContext {
    use datafusion::execution::SessionStateBuilder;
    let builder = SessionStateBuilder::new()
        .with_default_features()
        .with_config(SessionConfig::new().with_target_partitions(PARTITIONS));
    let state = arrow_cuda::datafusion::with_gpu_tables(builder, LoadOptions::new().with_device(device)).build();
    SessionContext::new_with_state(state)
}

fn sql(ctx: &SessionContext, statement: &str) -> Result<Vec<RecordBatch>, DataFusionError> {
    common::runtime().block_on(async { ctx.sql(statement).await?.collect().await })
}

/// `CREATE EXTERNAL TABLE ... STORED AS GPU` stages Parquet files (a directory) and CSV files
/// (with DataFusion's CSV options) as GPU tables that answer as DataFusion's own tables over the
/// same files; bad locations, formats and options are clear errors.
#[test]
fn create_external_table_stored_as_gpu() {
    common::each_device(|device, _| {
        let dir = temp_dir("sql", device);
        write_parquet(&dir, &wide_batch(1200, 5));
        let csv = dir.join("t.csv");
        std::fs::write(&csv, "id|name|price\n1|a|1.5\n2||-2\n3|ccc|\n4|a|0.25\n").expect("csv");
        let ctx = sql_session(device);
        let (d, c) = (dir.display(), csv.display());
        for statement in [
            format!("create external table g stored as gpu location '{d}/'"),
            format!("create external table p stored as parquet location '{d}/'"),
            format!(
                "create external table gc stored as gpu location '{c}' options ('has_header' 'true', 'delimiter' '|')"
            ),
            format!(
                "create external table gc2 stored as gpu location '{c}' \
                 options ('format' 'csv', 'format.has_header' 'true', 'delimiter' '|')"
            ),
            format!(
                "create external table pc stored as csv location '{c}' options ('has_header' 'true', 'delimiter' '|')"
            ),
        ] {
            sql(&ctx, &statement).unwrap_or_else(|e| panic!("{statement}: {e}"));
        }
        for name in ["g", "gc", "gc2"] {
            let provider = common::runtime().block_on(ctx.table_provider(name)).expect("provider");
            assert!(provider.downcast_ref::<GpuTable>().is_some(), "{name} is a GPU table");
        }
        let same = |a: &str, b: &str| {
            let ga = rows(&sql(&ctx, a).expect(a), false);
            assert!(!ga.is_empty(), "{a}");
            assert_eq!(ga, rows(&sql(&ctx, b).expect(b), false), "{a}");
        };
        same("select * from g", "select * from p");
        same(
            "select * from g where i64 > 0 and utf8 = 'ab'",
            "select * from p where i64 > 0 and utf8 = 'ab'",
        );
        same("select * from gc", "select * from pc");
        same("select * from gc2 where price > 0", "select * from pc where price > 0");

        let error = |statement: String| sql(&ctx, &statement).expect_err(&statement).to_string();
        let missing = error(format!(
            "create external table e1 stored as gpu location '{d}/nothing.parquet'"
        ));
        assert!(missing.contains("does not exist"), "{missing}");
        let format = error(format!(
            "create external table e2 stored as gpu location '{d}/' options ('format' 'orc')"
        ));
        assert!(format.contains("Parquet or CSV"), "{format}");
        // A CSV file read as Parquet, and a CSV option on Parquet files.
        error(format!(
            "create external table e3 stored as gpu location '{c}' options ('format' 'parquet')"
        ));
        error(format!(
            "create external table e4 stored as gpu location '{d}/' options ('has_header' 'true')"
        ));
        let _ = std::fs::remove_dir_all(&dir);
    });
}

/// Every row of `table`, downloaded, in partition order, as one batch.
fn downloaded(table: &GpuTable) -> RecordBatch {
    let back: Vec<RecordBatch> = table
        .partitions()
        .iter()
        .flatten()
        .map(|b| b.to_record_batch().expect("download"))
        .collect();
    arrow_select::concat::concat_batches(table.schema_ref(), &back).expect("concat")
}
