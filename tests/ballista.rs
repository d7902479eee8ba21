//! GPU tables and device stages in Ballista: the codecs carry plans with GPU scans and device
//! stages unchanged, and Ballista's standalone mode (scheduler and executor in this process)
//! answers the 22 TPC-H queries over GPU tables as DataFusion answers them over the same Parquet
//! files. Tables go to the default device: the CPU device in CI (device stages run their host
//! implementation), the first GPU on the GPU machine.
//!
//! The cluster tests run a scheduler in this process and executors in child processes (this
//! binary again, running `executor_process`), each on its own GPU where the machine has two or
//! more (`CUDA_VISIBLE_DEVICES`), on the default device otherwise.
#![cfg(feature = "ballista")]

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use arrow_array::RecordBatch;
use arrow_cuda::Device;
use arrow_cuda::ballista::{
    GpuLogicalCodec, GpuPhysicalCodec, GpuTableCache, executor_config, scheduler_config, session_state,
};
use arrow_cuda::datafusion::{GpuTable, LoadOptions};
use arrow_cuda_workloads::tpch;
use ballista::prelude::{SessionConfigExt, SessionContextExt};
use ballista_core::JobId;
use ballista_executor::execution_engine::{DefaultExecutionEngine, ExecutionEngine, QueryStageExecutor};
use ballista_executor::executor_process::{ExecutorProcessConfig, start_executor_process};
use ballista_scheduler::cluster::BallistaCluster;
use ballista_scheduler::config::{SchedulerConfig, TaskDistributionPolicy};
use ballista_scheduler::scheduler_process::start_server;
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

/// `EXPLAIN sql` in `ctx`, as text.
async fn explain(ctx: &SessionContext, sql: &str) -> String {
    let explained = run(ctx, &format!("EXPLAIN {sql}")).await.expect("explain");
    datafusion::arrow::util::pretty::pretty_format_batches(&explained)
        .expect("format")
        .to_string()
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
        let explained = explain(&ballista, tpch::query("q1").unwrap()).await;
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
        let whole = cache.tables().iter().filter(|t| t.partitions.is_none()).count();
        assert_eq!(
            whole,
            tpch::TABLES.len(),
            "the scheduler and the executor find the tables that CREATE EXTERNAL TABLE staged"
        );
    });
}

// ---- Executors in processes of their own -------------------------------------------------------

/// Set in a child process of this test binary: `SCHEDULER_PORT,PORT,GRPC_PORT` of the Ballista
/// executor that [`executor_process`] runs there.
const EXECUTOR: &str = "ARROW_CUDA_BALLISTA_EXECUTOR";
/// The child executor's cache limit, in bytes.
const EXECUTOR_CACHE_LIMIT: &str = "ARROW_CUDA_BALLISTA_CACHE_LIMIT";
/// Set for a child executor that hangs in its first task, until the test kills it.
const EXECUTOR_HANGS: &str = "ARROW_CUDA_BALLISTA_HANGS";

/// Not a test of its own: the Ballista executor of a child process that the cluster tests start
/// (this binary again, with [`EXECUTOR`] set), configured by `executor_config` with a cache on
/// its default device (its first visible GPU, `CUDA_VISIBLE_DEVICES` choosing it, or the CPU
/// device). It prints `DEVICE` (its device and PCI bus), a `TASK` line per task it starts and a
/// `CACHE` line each time its cache changes, for the test to read. Without [`EXECUTOR`] it
/// returns at once.
#[test]
fn executor_process() {
    let Ok(ports) = std::env::var(EXECUTOR) else { return };
    let ports: Vec<u16> = ports.split(',').map(|p| p.parse().expect("port")).collect();
    let limit: u64 = std::env::var(EXECUTOR_CACHE_LIMIT)
        .expect("cache limit")
        .parse()
        .expect("cache limit");
    let hangs = std::env::var_os(EXECUTOR_HANGS).is_some();
    common::runtime().block_on(async {
        let cache = Arc::new(GpuTableCache::new(limit));
        // On a line of its own, after the test harness's `test executor_process ... `.
        let device = arrow_cuda::datafusion::default_device();
        let pci = device
            .ordinal()
            .and_then(|o| {
                arrow_cuda::device::cuda_devices()
                    .ok()?
                    .into_iter()
                    .find(|d| d.ordinal == o)
            })
            .map_or_else(|| "-".to_string(), |d| d.pci_bus_id);
        println!("\nDEVICE {device} {pci}");
        tokio::spawn(report_cache(cache.clone()));
        let config = ExecutorProcessConfig {
            scheduler_host: "localhost".into(),
            scheduler_port: ports[0],
            port: ports[1],
            grpc_port: ports[2],
            vcores: 1,
            executor_heartbeat_interval_seconds: 1,
            override_execution_engine: Some(Arc::new(Announcing { hangs })),
            ..Default::default()
        };
        start_executor_process(Arc::new(executor_config(config, cache)))
            .await
            .expect("executor");
    });
}

/// Ballista's execution engine, printing a `TASK` line for each task before it starts it (and,
/// for an executor that [hangs](EXECUTOR_HANGS), never starting it).
struct Announcing {
    hangs: bool,
}

impl ExecutionEngine for Announcing {
    fn create_query_stage_exec(
        &self,
        job_id: JobId,
        stage_id: usize,
        task_id: usize,
        partitions: Vec<usize>,
        plan: Arc<dyn ExecutionPlan>,
        work_dir: &str,
        config: &SessionConfig,
    ) -> datafusion::error::Result<Arc<dyn QueryStageExecutor>> {
        println!("TASK {job_id} stage {stage_id} partitions {partitions:?}");
        if self.hangs {
            loop {
                std::thread::sleep(Duration::from_secs(60));
            }
        }
        DefaultExecutionEngine::new()
            .create_query_stage_exec(job_id, stage_id, task_id, partitions, plan, work_dir, config)
    }
}

/// Prints `CACHE BYTES LIMIT TABLE=PARTITIONS ...` each time `cache` changes (`PARTITIONS`: `all`,
/// or the staged ones, `.`-separated).
async fn report_cache(cache: Arc<GpuTableCache>) {
    let mut last = String::new();
    loop {
        let tables: Vec<String> = cache
            .tables()
            .iter()
            .map(|t| {
                let name = t
                    .source
                    .as_ref()
                    .and_then(|s| s.locations().first())
                    .map(|l| {
                        l.trim_end_matches('/')
                            .rsplit('/')
                            .next()
                            .unwrap_or_default()
                            .to_string()
                    })
                    .unwrap_or_default();
                let partitions = match &t.partitions {
                    Some(p) => p.iter().map(|p| p.to_string()).collect::<Vec<_>>().join("."),
                    None => "all".into(),
                };
                format!("{name}={partitions}")
            })
            .collect();
        let line = format!("CACHE {} {} {}", cache.bytes(), cache.limit(), tables.join(" "));
        if line != last {
            println!("{line}");
            last = line;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// What a child executor has said.
#[derive(Debug, Default)]
struct Said {
    device: Option<String>,
    tasks: usize,
    /// Each `CACHE` line's bytes and limit.
    cache_bytes: Vec<(u64, u64)>,
    /// The last `CACHE` line's tables: name and partitions (`None`: all).
    tables: Vec<(String, Option<Vec<usize>>)>,
    /// Whether a table held in one `CACHE` line was gone in a later one.
    evicted: bool,
}

impl Said {
    fn hear(&mut self, line: &str) {
        let mut words = line.split_whitespace();
        match words.next() {
            Some("DEVICE") => self.device = Some(words.collect::<Vec<_>>().join(" ")),
            Some("TASK") => self.tasks += 1,
            Some("CACHE") => {
                let mut number = || words.next().and_then(|w| w.parse().ok()).expect("a CACHE line");
                self.cache_bytes.push((number(), number()));
                let tables: Vec<_> = words
                    .map(|w| {
                        let (name, partitions) = w.split_once('=').expect("TABLE=PARTITIONS");
                        let partitions = (partitions != "all")
                            .then(|| partitions.split('.').map(|p| p.parse().expect("partition")).collect());
                        (name.to_string(), partitions)
                    })
                    .collect();
                self.evicted |= self.tables.iter().any(|t| !tables.contains(t));
                self.tables = tables;
            }
            _ => {}
        }
    }
}

/// A child process of this test binary running a Ballista executor; killed when dropped.
struct Executor {
    child: Child,
    said: Arc<Mutex<Said>>,
}

impl Executor {
    /// Starts executor `index` for the scheduler on `scheduler_port`, with a cache of `limit`
    /// bytes, on GPU `index` where the machine has several (`CUDA_VISIBLE_DEVICES`).
    fn start(index: usize, scheduler_port: u16, limit: u64, hangs: bool) -> Executor {
        let mut command = Command::new(std::env::current_exe().expect("test binary"));
        command
            .args(["--exact", "executor_process", "--nocapture", "--test-threads", "1"])
            .env(EXECUTOR, format!("{scheduler_port},{},{}", free_port(), free_port()))
            .env(EXECUTOR_CACHE_LIMIT, limit.to_string())
            .stdout(Stdio::piped());
        if hangs {
            command.env(EXECUTOR_HANGS, "1");
        }
        if let Some(gpu) = own_gpu(index) {
            command.env("CUDA_VISIBLE_DEVICES", gpu);
        }
        let mut child = command.spawn().expect("spawn an executor");
        let said = Arc::new(Mutex::new(Said::default()));
        let stdout = child.stdout.take().expect("the executor's stdout");
        let heard = said.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                eprintln!("executor {index}: {line}");
                heard.lock().unwrap().hear(&line);
            }
        });
        Executor { child, said }
    }

    /// Waits (up to a minute) until what the executor has said satisfies `done`, and returns it.
    fn wait_until<T>(&self, what: &str, mut done: impl FnMut(&Said) -> Option<T>) -> T {
        for _ in 0..1200 {
            if let Some(t) = done(&self.said.lock().unwrap()) {
                return t;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("an executor never said {what}: {:?}", self.said.lock().unwrap());
    }
}

impl Drop for Executor {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The GPU of executor `index`: the `index`-th visible one where there are two or more, none
/// (the default device) otherwise.
fn own_gpu(index: usize) -> Option<String> {
    let gpus = arrow_cuda::device::cuda_device_count().unwrap_or(0);
    if gpus < 2 {
        return None;
    }
    let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    let listed: Vec<String> = match &visible {
        Some(v) => v.split(',').map(str::to_string).collect(),
        None => (0..gpus).map(|g| g.to_string()).collect(),
    };
    Some(listed[index % listed.len()].clone())
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// A Ballista scheduler in this process (planning on the CPU device, tasks spread round-robin,
/// an executor that misses its heartbeats for 5 s counted lost), and its cluster state.
async fn start_scheduler() -> (u16, BallistaCluster) {
    let port = free_port();
    let cache = Arc::new(GpuTableCache::new(CACHE_LIMIT).with_devices([Device::Cpu]));
    let config = scheduler_config(
        SchedulerConfig {
            bind_port: port,
            task_distribution: TaskDistributionPolicy::RoundRobin,
            executor_timeout_seconds: 5,
            expire_dead_executor_interval_seconds: 1,
            ..Default::default()
        },
        cache,
    );
    let cluster = BallistaCluster::new_from_config(&config).await.expect("cluster");
    let address = format!("127.0.0.1:{port}").parse().expect("address");
    tokio::spawn(start_server(cluster.clone(), address, Arc::new(config)));
    (port, cluster)
}

/// Waits (up to a minute) until `n` executors have registered with the scheduler of `cluster`.
async fn registered(cluster: &BallistaCluster, n: usize) {
    for _ in 0..600 {
        if cluster.cluster_state().registered_executor_metadata().await.len() >= n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("{n} executors never registered");
}

/// A client of the scheduler on `port`, planning on the CPU device, with the TPC-H tables.
async fn client(port: u16) -> (SessionContext, Arc<GpuTableCache>) {
    let cache = Arc::new(GpuTableCache::new(CACHE_LIMIT).with_devices([Device::Cpu]));
    let ctx = SessionContext::remote_with_state(
        &format!("df://localhost:{port}"),
        session_state(config(), cache.clone()),
    )
    .await
    .expect("connect to the scheduler");
    create_tables(&ctx, "GPU").await;
    (ctx, cache)
}

/// The partition count of the client's copy of `table`.
fn partition_count(cache: &GpuTableCache, table: &str) -> usize {
    cache
        .tables()
        .iter()
        .find(|t| {
            t.source
                .as_ref()
                .is_some_and(|s| s.locations().iter().any(|l| l.trim_end_matches('/').ends_with(table)))
        })
        .expect("the client staged the table")
        .partition_count
}

/// The partitions of `table` that an executor has said it holds (all of them for a whole copy).
fn held(said: &Said, table: &str, count: usize) -> Vec<usize> {
    let mut out: Vec<usize> = said
        .tables
        .iter()
        .filter(|(name, _)| name == table)
        .flat_map(|(_, p)| p.clone().unwrap_or_else(|| (0..count).collect()))
        .collect();
    out.sort_unstable();
    out.dedup();
    out
}

/// Runs `sql` in `ballista` and checks its rows against DataFusion's over the Parquet files.
async fn check_query(ballista: &SessionContext, local: &SessionContext, name: &str) {
    let sql = tpch::query(name).expect("a TPC-H query");
    let ordered = sql.to_lowercase().contains("order by");
    let got = run(ballista, sql)
        .await
        .unwrap_or_else(|e| panic!("{name} in Ballista: {e}"));
    let expected = run(local, sql).await.expect("DataFusion");
    assert_eq!(rows(&got, ordered), rows(&expected, ordered), "{name}: results differ");
}

/// Two executors, each a process of its own on its own device (a GPU each where the machine has
/// two), and a scheduler: TPC-H queries return what DataFusion returns, and lineitem's partitions
/// are split between the executors (each stages the partitions of its tasks, neither all of
/// them) for Q1, whose device stage reads them partition by partition.
#[test]
fn executors_in_their_own_processes_split_the_partitions() {
    common::runtime().block_on(async {
        let (port, cluster) = start_scheduler().await;
        let executors: Vec<Executor> = (0..2).map(|i| Executor::start(i, port, CACHE_LIMIT, false)).collect();
        registered(&cluster, 2).await;
        let devices: Vec<String> = executors
            .iter()
            .map(|e| e.wait_until("its device", |s| s.device.clone()))
            .collect();
        eprintln!("executors on {devices:?}");
        if arrow_cuda::device::cuda_device_count().unwrap_or(0) > 0 {
            assert!(devices.iter().all(|d| d.starts_with("cuda")), "{devices:?}");
        }
        if own_gpu(0).is_some() {
            assert_ne!(devices[0], devices[1], "two GPUs, and the executors share one");
        }
        let (ballista, client_cache) = client(port).await;
        let local = SessionContext::new();
        create_tables(&local, "PARQUET").await;

        let explained = explain(&ballista, tpch::query("q1").unwrap()).await;
        assert!(
            explained.contains("ShareExec") && explained.contains("output=partial"),
            "q1's device stage does not share its partitions\n{explained}"
        );
        check_query(&ballista, &local, "q1").await;
        let n = partition_count(&client_cache, "lineitem");
        assert!(n >= 2, "lineitem has {n} partitions: nothing to split");
        let shares: Vec<Vec<usize>> = executors
            .iter()
            .map(|e| {
                e.wait_until("its lineitem partitions", |s| {
                    Some(held(s, "lineitem", n)).filter(|p| !p.is_empty())
                })
            })
            .collect();
        eprintln!("lineitem's {n} partitions on the executors: {shares:?}");
        for share in &shares {
            assert!(
                share.len() < n,
                "an executor staged every partition of lineitem: {shares:?}"
            );
        }
        let mut all: Vec<usize> = shares.concat();
        all.sort_unstable();
        assert_eq!(
            all,
            (0..n).collect::<Vec<_>>(),
            "the executors split lineitem's partitions"
        );

        for name in ["q3", "q6", "q12", "q14"] {
            check_query(&ballista, &local, name).await;
        }
        for e in &executors {
            let said = e.said.lock().unwrap();
            assert!(said.tasks > 0, "an executor ran no task");
            assert!(said.cache_bytes.iter().all(|&(b, l)| b <= l), "{:?}", said.cache_bytes);
        }
    });
}

/// An executor killed while it runs a task (it hangs in its first one): Ballista counts it lost
/// once it misses its heartbeats, runs its tasks again on the other executor, and the query
/// completes, within two minutes, with DataFusion's rows; the surviving executor's cache stays
/// within its limit, which is smaller than the tables it stages (it evicts).
#[test]
fn a_killed_executor_s_tasks_run_again_on_the_other() {
    common::runtime().block_on(async {
        let (port, cluster) = start_scheduler().await;
        let (ballista, client_cache) = client(port).await;
        // Room for the largest table (as the client's CPU copy counts it, half as much again for
        // a GPU's alignment), not for all that the queries read: the surviving executor evicts.
        let largest = client_cache.tables().iter().map(|t| t.bytes).max().expect("tables");
        let limit = largest + largest / 2;
        let survivor = Executor::start(0, port, limit, false);
        let mut doomed = Executor::start(1, port, CACHE_LIMIT, true);
        registered(&cluster, 2).await;
        let local = SessionContext::new();
        create_tables(&local, "PARQUET").await;

        let query = tokio::spawn(async move {
            let sql = tpch::query("q3").expect("q3");
            let outcome = tokio::time::timeout(Duration::from_secs(120), run(&ballista, sql)).await;
            (ballista, outcome)
        });
        doomed.wait_until("that it started a task", |s| (s.tasks > 0).then_some(()));
        doomed.child.kill().expect("kill the executor");
        doomed.child.wait().expect("the killed executor");
        let (ballista, outcome) = query.await.expect("the query's task");
        let got = outcome
            .expect("the query ended within two minutes")
            .unwrap_or_else(|e| panic!("q3 failed after an executor died: {e}"));
        let sql = tpch::query("q3").expect("q3");
        let expected = run(&local, sql).await.expect("DataFusion");
        assert_eq!(rows(&got, true), rows(&expected, true), "q3: results differ");

        for name in ["q1", "q5", "q10"] {
            check_query(&ballista, &local, name).await;
        }
        let said = survivor.said.lock().unwrap();
        assert!(said.tasks > 0, "the surviving executor ran no task");
        assert!(said.evicted, "the surviving executor's cache never evicted a table");
        assert!(
            said.cache_bytes.iter().all(|&(bytes, l)| bytes <= l && l == limit),
            "the surviving executor's cache went past its limit: {:?}",
            said.cache_bytes
        );
    });
}
