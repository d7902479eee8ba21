//! GPU tables and device stages in Ballista: the codecs carry plans with GPU scans and device
//! stages unchanged, and Ballista's standalone mode (scheduler and executor in this process)
//! answers the 22 TPC-H queries over GPU tables as DataFusion answers them over the same Parquet
//! files. Tables go to the default device: the CPU device in CI (device stages run their host
//! implementation), the first GPU on the GPU machine.
#![cfg(feature = "ballista")]

mod common;

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use arrow_array::RecordBatch;
use arrow_cuda::ballista::{GpuLogicalCodec, GpuPhysicalCodec, GpuTableCache, session_state};
use arrow_cuda::datafusion::{GpuTable, LoadOptions};
use arrow_cuda_workloads::tpch;
use ballista::prelude::{SessionConfigExt, SessionContextExt};
use common::rows;
use datafusion::parquet::arrow::ArrowWriter;
use datafusion::physical_plan::{ExecutionPlan, collect, displayable};
use datafusion::prelude::{SessionConfig, SessionContext};
use datafusion_proto::bytes::{
    logical_plan_from_bytes_with_extension_codec, logical_plan_to_bytes_with_extension_codec,
    physical_plan_from_bytes_with_extension_codec, physical_plan_to_bytes_with_extension_codec,
};

/// The cache's limit in these tests: far more than TPC-H at SF 0.01 takes.
const CACHE_LIMIT: u64 = 1 << 30;

/// Ballista's session config with two partitions: few tasks per stage, for a quick test.
fn config() -> SessionConfig {
    SessionConfig::new_with_ballista().with_target_partitions(2)
}

/// TPC-H at SF 0.01 as Parquet, a directory per table of two files each, written once.
fn tpch_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("arrow-cuda-ballista-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for table in tpch::tables(0.01, 2, tpch::BATCH_SIZE).expect("generate") {
            let table_dir = dir.join(table.name);
            std::fs::create_dir_all(&table_dir).expect("temp dir");
            for (i, partition) in table.partitions.iter().enumerate() {
                let file = std::fs::File::create(table_dir.join(format!("{i}.parquet"))).expect("create");
                let mut w = ArrowWriter::try_new(file, table.schema.clone(), None).expect("writer");
                for batch in partition {
                    w.write(batch).expect("write");
                }
                w.close().expect("close");
            }
        }
        dir
    })
}

/// Creates the eight TPC-H tables in `ctx`, stored `as` (`GPU` or `PARQUET`).
async fn create_tables(ctx: &SessionContext, stored_as: &str) {
    for name in tpch::TABLES {
        let location = tpch_dir().join(name);
        let sql = format!(
            "CREATE EXTERNAL TABLE {name} STORED AS {stored_as} LOCATION '{}/'",
            location.display()
        );
        ctx.sql(&sql)
            .await
            .expect("create table")
            .collect()
            .await
            .expect("create table");
    }
}

async fn run(ctx: &SessionContext, sql: &str) -> datafusion::error::Result<Vec<RecordBatch>> {
    ctx.sql(sql).await?.collect().await
}

/// A plan with a device stage, a GPU scan under it and another as a join's build side goes
/// through the physical codec and comes back the same (its `EXPLAIN`), and runs to the same rows;
/// the logical plan over GPU tables goes through the logical codec the same way.
#[test]
fn plans_round_trip_through_the_codecs() {
    common::runtime().block_on(async {
        let cache = Arc::new(GpuTableCache::new(CACHE_LIMIT));
        let ctx = SessionContext::new_with_state(session_state(config(), cache.clone()));
        create_tables(&ctx, "GPU").await;
        let tables = cache.len();
        assert_eq!(
            tables,
            tpch::TABLES.len(),
            "CREATE EXTERNAL TABLE keeps each table in the cache"
        );
        let (logical, physical) = (GpuLogicalCodec::default(), GpuPhysicalCodec::default());
        for name in ["q1", "q3", "q6", "q14", "q18"] {
            let sql = tpch::query(name).expect("a TPC-H query");
            let df = ctx.sql(sql).await.expect("plan");
            let plan = df.clone().into_optimized_plan().expect("logical plan");
            let bytes = logical_plan_to_bytes_with_extension_codec(&plan, &logical).expect("encode logical");
            let back = logical_plan_from_bytes_with_extension_codec(&bytes, &ctx.task_ctx(), &logical)
                .expect("decode logical");
            assert_eq!(
                plan.display_indent().to_string(),
                back.display_indent().to_string(),
                "{name}: logical plan"
            );

            let plan = df.create_physical_plan().await.expect("physical plan");
            let text = displayable(plan.as_ref()).indent(true).to_string();
            assert!(text.contains("DeviceStageExec"), "{name}: no device stage\n{text}");
            let bytes = physical_plan_to_bytes_with_extension_codec(plan.clone(), &physical).expect("encode");
            let back: Arc<dyn ExecutionPlan> =
                physical_plan_from_bytes_with_extension_codec(&bytes, &ctx.task_ctx(), &physical).expect("decode");
            assert_eq!(
                text,
                displayable(back.as_ref()).indent(true).to_string(),
                "{name}: physical plan"
            );

            let ordered = sql.to_lowercase().contains("order by");
            let expected = rows(&collect(plan, ctx.task_ctx()).await.expect("run"), ordered);
            let got = rows(&collect(back, ctx.task_ctx()).await.expect("run decoded"), ordered);
            assert_eq!(got, expected, "{name}: rows of the decoded plan");
        }
        assert_eq!(cache.len(), tables, "decoding finds the tables in the cache");
    });
}

/// A GPU table staged from batches has no source: encoding a plan over it is an error that says so.
#[test]
fn a_table_without_a_source_does_not_travel() {
    common::runtime().block_on(async {
        let ctx = SessionContext::new_with_state(session_state(config(), Arc::new(GpuTableCache::new(CACHE_LIMIT))));
        let batch = arrow_cuda_workloads::small_batch();
        let table = GpuTable::from_batches(batch.schema(), vec![batch], &LoadOptions::new()).expect("stage");
        assert!(table.source().is_none());
        ctx.register_table("t", Arc::new(table)).expect("register");
        let df = ctx.sql("SELECT * FROM t").await.expect("plan");
        let plan = df.clone().into_optimized_plan().expect("logical plan");
        let err = logical_plan_to_bytes_with_extension_codec(&plan, &GpuLogicalCodec::default())
            .expect_err("a table without a source");
        assert!(err.to_string().contains("has no source"), "{err}");
        let plan = df.create_physical_plan().await.expect("physical plan");
        let err = physical_plan_to_bytes_with_extension_codec(plan, &GpuPhysicalCodec::default())
            .expect_err("a scan without a source");
        assert!(err.to_string().contains("has no source"), "{err}");
    });
}

/// Ballista in standalone mode (scheduler and executor in this process) runs the 22 TPC-H queries
/// over GPU tables with device stages and returns what DataFusion returns over the Parquet files.
#[test]
fn ballista_standalone_answers_tpch_as_datafusion() {
    common::runtime().block_on(async {
        let cache = Arc::new(GpuTableCache::new(CACHE_LIMIT));
        let ballista = SessionContext::standalone_with_state(session_state(config(), cache.clone()))
            .await
            .expect("standalone Ballista");
        create_tables(&ballista, "GPU").await;
        let local = SessionContext::new();
        create_tables(&local, "PARQUET").await;
        let explained = run(&ballista, &format!("EXPLAIN {}", tpch::query("q1").unwrap()))
            .await
            .expect("explain");
        let explained = datafusion::arrow::util::pretty::pretty_format_batches(&explained)
            .expect("format")
            .to_string();
        assert!(
            explained.contains("DeviceStageExec"),
            "q1 has no device stage\n{explained}"
        );
        for (name, sql) in tpch::QUERIES {
            let ordered = sql.to_lowercase().contains("order by");
            let got = run(&ballista, sql)
                .await
                .unwrap_or_else(|e| panic!("{name} in Ballista: {e}"));
            let expected = run(&local, sql).await.expect("DataFusion");
            assert_eq!(rows(&got, ordered), rows(&expected, ordered), "{name}: results differ");
            eprintln!("{name}: {} rows", rows(&got, false).len());
        }
        assert_eq!(
            cache.len(),
            tpch::TABLES.len(),
            "the scheduler and the executor find the tables that CREATE EXTERNAL TABLE staged"
        );
    });
}
