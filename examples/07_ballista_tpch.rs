//! TPC-H over GPU tables in Apache DataFusion Ballista: the 22 queries, each timed and checked
//! against DataFusion's answer over the same Parquet files in this process.
//!
//! ```text
//! 07_ballista_tpch standalone DIR [SF]          scheduler and executor in this process
//! 07_ballista_tpch scheduler PORT               a scheduler (tasks spread round-robin)
//! 07_ballista_tpch executor SCHEDULER_PORT PORT [VCORES]
//!                                               an executor (GPU tables on its first visible GPU;
//!                                               VCORES tasks at once, default: its cores)
//! 07_ballista_tpch client DIR SCHEDULER_PORT    the queries, on that scheduler's executors (a
//!                                               partition per task)
//! ```
//!
//! `DIR` holds TPC-H as Parquet, a directory per table; where it does not exist, the tables are
//! generated at scale factor `SF` (default 0.1) and written there. Every process must see `DIR`
//! at the same path. The scheduler and the client stage the tables on the CPU device (they only
//! plan); executors stage them on their GPU, the CPU device on a machine without one.
//!
//! Two executors on two GPUs of one machine (each sees one GPU as its first):
//!
//! ```text
//! cargo build --release --example 07_ballista_tpch --features ballista
//! B=target/release/examples/07_ballista_tpch
//! $B scheduler 50050 &
//! CUDA_VISIBLE_DEVICES=0 $B executor 50050 50051 4 &
//! CUDA_VISIBLE_DEVICES=1 $B executor 50050 50061 4 &
//! $B client /tmp/tpch-sf1 50050
//! ```
//!
//! Run with `cargo run --release --example 07_ballista_tpch --features ballista -- standalone /tmp/tpch`.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use arrow_cuda::Device;
use arrow_cuda::ballista::{GpuTableCache, executor_config, scheduler_config, session_state};
use arrow_cuda_workloads::tpch;
use ballista::prelude::{SessionConfigExt, SessionContextExt};
use ballista_core::config::BALLISTA_SCHEDULER_MAX_PARTITIONS_PER_TASK;
use ballista_executor::executor_process::{ExecutorProcessConfig, start_executor_process};
use ballista_scheduler::cluster::BallistaCluster;
use ballista_scheduler::config::{SchedulerConfig, TaskDistributionPolicy};
use ballista_scheduler::scheduler_process::start_server;
use datafusion::arrow::util::pretty::pretty_format_batches;
use datafusion::parquet::arrow::ArrowWriter;
use datafusion::prelude::{SessionConfig, SessionContext};

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// The most device memory an executor's table cache holds: 16 GiB.
const CACHE_LIMIT: u64 = 16 << 30;

fn main() -> Result<()> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(run())
}

async fn run() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize| {
        args.get(i)
            .map(String::as_str)
            .ok_or("missing arguments: see the example's docs")
    };
    match arg(0)? {
        "standalone" => {
            let sf = args.get(2).map(|s| s.parse()).transpose()?.unwrap_or(0.1);
            write_tpch(Path::new(arg(1)?), sf)?;
            let state = session_state(
                SessionConfig::new_with_ballista(),
                Arc::new(GpuTableCache::new(CACHE_LIMIT)),
            );
            run_queries(SessionContext::standalone_with_state(state).await?, Path::new(arg(1)?)).await
        }
        "scheduler" => {
            let port: u16 = arg(1)?.parse()?;
            let cache = Arc::new(GpuTableCache::new(CACHE_LIMIT).with_devices([Device::Cpu]));
            let config = scheduler_config(
                SchedulerConfig {
                    bind_port: port,
                    task_distribution: TaskDistributionPolicy::RoundRobin,
                    ..Default::default()
                },
                cache,
            );
            let cluster = BallistaCluster::new_from_config(&config).await?;
            start_server(cluster, format!("0.0.0.0:{port}").parse()?, Arc::new(config)).await?;
            Ok(())
        }
        "executor" => {
            let port: u16 = arg(2)?.parse()?;
            let mut config = ExecutorProcessConfig {
                scheduler_port: arg(1)?.parse()?,
                scheduler_connect_timeout_seconds: 30,
                port,
                grpc_port: port + 1,
                ..Default::default()
            };
            if let Some(vcores) = args.get(3) {
                config.vcores = vcores.parse()?;
            }
            let cache = Arc::new(GpuTableCache::new(CACHE_LIMIT));
            tokio::spawn(report(cache.clone(), port));
            start_executor_process(Arc::new(executor_config(config, cache))).await?;
            Ok(())
        }
        "client" => {
            let cache = Arc::new(GpuTableCache::new(CACHE_LIMIT).with_devices([Device::Cpu]));
            // A partition per task, so that a stage's partitions spread over the executors.
            let config = SessionConfig::new_with_ballista().set_usize(BALLISTA_SCHEDULER_MAX_PARTITIONS_PER_TASK, 1);
            let state = session_state(config, cache);
            let url = format!("df://localhost:{}", arg(2)?);
            run_queries(
                SessionContext::remote_with_state(&url, state).await?,
                Path::new(arg(1)?),
            )
            .await
        }
        other => Err(format!("no mode {other}: standalone, scheduler, executor or client").into()),
    }
}

/// Prints what the executor on `port` has staged, each time it changes.
async fn report(cache: Arc<GpuTableCache>, port: u16) {
    let mut seen = (0, 0);
    loop {
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        let now = (cache.len(), cache.bytes());
        if now != seen {
            println!(
                "executor {port}: {} GPU tables staged, {} bytes on the device",
                now.0, now.1
            );
            seen = now;
        }
    }
}

/// Writes the TPC-H tables at scale factor `sf` as Parquet under `dir`, a directory per table,
/// unless `dir` exists.
fn write_tpch(dir: &Path, sf: f64) -> Result<()> {
    if dir.exists() {
        return Ok(());
    }
    let t = Instant::now();
    let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
    for table in tpch::tables(sf, cores, tpch::LARGE_BATCH_SIZE)? {
        std::fs::create_dir_all(dir.join(table.name))?;
        for (i, partition) in table.partitions.iter().enumerate() {
            let file = std::fs::File::create(dir.join(table.name).join(format!("{i}.parquet")))?;
            let mut writer = ArrowWriter::try_new(file, table.schema.clone(), None)?;
            for batch in partition {
                writer.write(batch)?;
            }
            writer.close()?;
        }
    }
    println!("wrote TPC-H at SF {sf} to {} in {:.2?}", dir.display(), t.elapsed());
    Ok(())
}

/// Creates the eight tables in `ctx`, stored `as` (`GPU` or `PARQUET`).
async fn create_tables(ctx: &SessionContext, dir: &Path, stored_as: &str) -> Result<()> {
    for name in tpch::TABLES {
        let location = dir.join(name);
        let sql = format!(
            "CREATE EXTERNAL TABLE {name} STORED AS {stored_as} LOCATION '{}/'",
            location.display()
        );
        ctx.sql(&sql).await?.collect().await?;
    }
    Ok(())
}

/// Runs the 22 queries in `ballista` over GPU tables and in a local DataFusion session over the
/// Parquet files, printing Ballista's times; fails where the answers differ.
async fn run_queries(ballista: SessionContext, dir: &Path) -> Result<()> {
    let t = Instant::now();
    create_tables(&ballista, dir, "GPU").await?;
    println!("created the GPU tables in {:.2?}", t.elapsed());
    let local = SessionContext::new();
    create_tables(&local, dir, "PARQUET").await?;
    let mut total = std::time::Duration::ZERO;
    for (name, sql) in tpch::QUERIES {
        let t = Instant::now();
        let got = ballista.sql(sql).await?.collect().await?;
        let took = t.elapsed();
        total += took;
        let expected = local.sql(sql).await?.collect().await?;
        let (got, expected) = (lines(&got, sql)?, lines(&expected, sql)?);
        if got != expected {
            return Err(format!("{name}: Ballista and DataFusion differ").into());
        }
        println!("{name}: {} rows in {took:.2?}, as DataFusion", got.len());
    }
    println!("22 queries in {total:.2?}");
    Ok(())
}

/// The rows of a result as text lines, in order where the query orders them.
fn lines(batches: &[datafusion::arrow::array::RecordBatch], sql: &str) -> Result<Vec<String>> {
    let text = pretty_format_batches(batches)?.to_string();
    let mut rows: Vec<String> = text.lines().skip(3).map(str::to_string).collect();
    rows.pop();
    if !sql.to_lowercase().contains("order by") {
        rows.sort();
    }
    Ok(rows)
}
