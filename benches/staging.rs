//! Staging TPC-H `lineitem` on the GPU: from `RecordBatch`es in host memory (gathered into device
//! batches, as they are, and gathered again once the process has pinned its staging), and from
//! Parquet files beside DataFusion reading the same files into a `MemTable`, in GB/s of Arrow data
//! (the bytes staging copies). After each load, the time of its steps (`StagingTimes`: setup,
//! decode, prepare, handoff, idle, upload, alloc, pack, copy, wait, gather, release, finish),
//! summed over the threads that ran each, beside the load's wall time.
//!
//! The scale factor comes from `ARROW_CUDA_BENCH_SF` (default 10); the Parquet files (one per
//! core, Snappy, row groups of 1,048,576 rows) are written to `ARROW_CUDA_BENCH_DIR` (default: a
//! temporary directory, removed afterwards). Without a GPU it prints `skipped: no CUDA device`.
//!
//! Run with `cargo bench --bench staging --features datafusion`.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use arrow_array::RecordBatch;
use arrow_cuda::datafusion::{GpuTable, LoadOptions, Progress, StagingTimes};
use arrow_cuda_workloads::tpch;
use datafusion::datasource::MemTable;
use datafusion::parquet::arrow::ArrowWriter;
use datafusion::parquet::basic::Compression;
use datafusion::parquet::file::properties::WriterProperties;
use datafusion::prelude::{SessionConfig, SessionContext};

fn env<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Runs `load` with a progress callback and its steps timed; returns its table, the seconds it
/// took, the bytes it staged and the time of its steps.
fn timed(load: impl FnOnce(LoadOptions) -> GpuTable) -> (GpuTable, f64, u64, Arc<StagingTimes>) {
    let last: Arc<Mutex<Option<Progress>>> = Arc::default();
    let l = last.clone();
    let times = Arc::new(StagingTimes::new());
    let options = LoadOptions::new()
        .with_progress(move |p| *l.lock().unwrap() = Some(p))
        .with_staging_times(times.clone());
    let t = Instant::now();
    let table = load(options);
    let secs = t.elapsed().as_secs_f64();
    let bytes = last.lock().unwrap().map_or(0, |p| p.bytes);
    (table, secs, bytes, times)
}

/// Prints the time of a load's steps, each summed over the threads that ran it.
fn print_steps(times: &StagingTimes) {
    println!("  steps, in seconds summed over threads: {times}");
}

fn main() {
    if !arrow_cuda::device::cuda_available() {
        println!("skipped: no CUDA device");
        return;
    }
    let sf: f64 = env("ARROW_CUDA_BENCH_SF", 10.0);
    let cores = std::thread::available_parallelism().map_or(8, |n| n.get());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    println!("device: {}, {cores} cores", arrow_cuda::datafusion::default_device());
    let t = Instant::now();
    let lineitem = tpch::table("lineitem", sf, cores, tpch::LARGE_BATCH_SIZE).expect("generate");
    println!("generated lineitem SF {sf} in {:.1?}", t.elapsed());

    // From host batches.
    // The first load in a process pins its staging; the last one shows a load that reuses it.
    for (what, batch_rows) in [
        ("gathered into device batches", None),
        ("batch by batch", Some(1)),
        ("gathered into device batches, again", None),
    ] {
        let (table, secs, bytes, times) = timed(|options| {
            let options = match batch_rows {
                Some(rows) => options.with_batch_rows(rows),
                None => options,
            };
            GpuTable::try_new(lineitem.schema.clone(), lineitem.partitions.clone(), &options).expect("stage")
        });
        println!(
            "lineitem from host batches, {what}: {:.2} GB in {secs:.3} s, {:.1} GB/s ({} device batches, {:.2} GB on the device)",
            bytes as f64 / 1e9,
            bytes as f64 / secs / 1e9,
            table.partitions().iter().map(Vec::len).sum::<usize>(),
            table.size_in_bytes() as f64 / 1e9
        );
        print_steps(&times);
    }

    // From Parquet files.
    let dir = match std::env::var("ARROW_CUDA_BENCH_DIR") {
        Ok(d) => std::path::PathBuf::from(d),
        Err(_) => std::env::temp_dir().join(format!("arrow-cuda-staging-{}", std::process::id())),
    };
    std::fs::create_dir_all(&dir).expect("directory");
    let t = Instant::now();
    std::thread::scope(|s| {
        for (i, part) in lineitem.partitions.iter().enumerate() {
            let path = dir.join(format!("lineitem-{i:03}.parquet"));
            let schema = lineitem.schema.clone();
            s.spawn(move || {
                let props = WriterProperties::builder().set_compression(Compression::SNAPPY).build();
                let file = std::fs::File::create(path).expect("create");
                let mut w = ArrowWriter::try_new(file, schema, Some(props)).expect("writer");
                part.iter().for_each(|b: &RecordBatch| w.write(b).expect("write"));
                w.close().expect("close");
            });
        }
    });
    println!(
        "wrote {} Parquet files in {:.1?}",
        lineitem.partitions.len(),
        t.elapsed()
    );
    drop(lineitem);
    let path = format!("{}/", dir.display());
    let (table, secs, bytes, times) = timed(|options| {
        rt.block_on(GpuTable::from_parquet(&path, &options))
            .expect("from parquet")
    });
    println!(
        "lineitem from Parquet to the GPU: {:.2} GB in {secs:.3} s, {:.1} GB/s ({} partitions, {} device batches, {:.2} GB on the device)",
        bytes as f64 / 1e9,
        bytes as f64 / secs / 1e9,
        table.partitions().len(),
        table.partitions().iter().map(Vec::len).sum::<usize>(),
        table.size_in_bytes() as f64 / 1e9
    );
    print_steps(&times);
    drop(table);
    let ctx = SessionContext::new_with_config(SessionConfig::new().with_target_partitions(cores));
    let t = Instant::now();
    let (schema, partitions) = rt.block_on(async {
        let df = ctx.read_parquet(path.as_str(), Default::default()).await.expect("read");
        let schema = Arc::new(df.schema().as_arrow().clone());
        (schema, df.collect_partitioned().await.expect("collect"))
    });
    let mem = MemTable::try_new(schema, partitions).expect("memtable");
    let secs_mem = t.elapsed().as_secs_f64();
    println!(
        "lineitem from Parquet into DataFusion's MemTable: {secs_mem:.3} s, {:.1} GB/s of the same bytes",
        bytes as f64 / secs_mem / 1e9
    );
    drop(mem);
    if std::env::var_os("ARROW_CUDA_BENCH_DIR").is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
}
