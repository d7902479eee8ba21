//! `arrow-cuda query`: TPC-H (generated in process) or Parquet / CSV files staged on the GPU, then SQL.

use std::sync::Arc;
use std::time::Instant;

use arrow_array::RecordBatch;
use arrow_cuda::Device;
use arrow_cuda::datafusion::{GpuTable, LoadOptions, with_device_stages};
use arrow_cuda_workloads::tpch;
use arrow_schema::SchemaRef;
use datafusion::arrow::util::pretty::pretty_format_batches;
use datafusion::datasource::MemTable;
use datafusion::error::DataFusionError;
use datafusion::execution::SessionStateBuilder;
use datafusion::prelude::{CsvReadOptions, SessionConfig, SessionContext};
use indicatif::{ProgressBar, ProgressStyle};

/// Options of `arrow-cuda query`.
#[derive(clap::Args)]
pub struct Args {
    /// Generate the 8 TPC-H tables at this scale factor and stage them.
    #[arg(long)]
    tpch: Option<f64>,
    /// Stage a Parquet file as a table named after the file (repeatable).
    #[arg(long)]
    parquet: Vec<String>,
    /// Stage a CSV file with a header row as a table named after the file (repeatable).
    #[arg(long)]
    csv: Vec<String>,
    /// `cuda` (the default, when a GPU is present) or `cpu`.
    #[arg(long)]
    device: Option<crate::DeviceArg>,
    /// Also run each query on DataFusion's MemTable over the same batches and print both times.
    #[arg(long)]
    compare: bool,
    /// Runs of each query (the best time is printed).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Queries: `q1` ... `q22` (TPC-H) or SQL text. Default: q6.
    queries: Vec<String>,
}

/// `arrow-cuda query`: stages the tables, then runs each query on them with device stages (and on
/// `MemTable`s with `--compare`), printing its result and times.
pub fn run(args: &Args) -> Result<(), Box<dyn std::error::Error>> {
    let device = match args.device {
        Some(d) => d.resolve()?,
        None => match arrow_cuda::device::cuda_device_count() {
            Ok(_) => arrow_cuda::Device::Cuda(0),
            Err(e) => {
                println!("no GPU ({e}); running on the CPU device");
                arrow_cuda::Device::Cpu
            }
        },
    };
    let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
    let config = SessionConfig::new().with_target_partitions(cores);
    let gpu = device_session(config.clone());
    let host = SessionContext::new_with_config(config);
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;

    // Each table's name and batches, by partition.
    let mut tables: Vec<(String, Vec<Vec<RecordBatch>>)> = Vec::new();
    if let Some(sf) = args.tpch {
        let t = Instant::now();
        let generated = tpch::tables(sf, cores, tpch::LARGE_BATCH_SIZE)?;
        tables.extend(generated.into_iter().map(|t| (t.name.to_string(), t.partitions)));
        println!("generated the 8 TPC-H tables at SF {sf} in {:.2?}", t.elapsed());
    }
    for path in &args.parquet {
        let df = runtime.block_on(host.read_parquet(path.as_str(), Default::default()))?;
        tables.push((table_name(path), vec![runtime.block_on(df.collect())?]));
    }
    for path in &args.csv {
        let df = runtime.block_on(host.read_csv(path.as_str(), CsvReadOptions::new()))?;
        tables.push((table_name(path), vec![runtime.block_on(df.collect())?]));
    }
    if tables.is_empty() {
        return Err("nothing to query: give --tpch SF, --parquet FILE or --csv FILE".into());
    }

    for (name, partitions) in tables {
        let schema = match partitions.iter().flatten().next() {
            Some(b) => b.schema(),
            None => continue,
        };
        let (table, secs) = stage(&name, schema.clone(), partitions.clone(), device)?;
        println!(
            "staged {name}: {} rows, {:.1} MB on {device} in {:.3} s ({:.1} GB/s)",
            table.num_rows(),
            table.size_in_bytes() as f64 / 1e6,
            secs,
            table.size_in_bytes() as f64 / secs / 1e9
        );
        gpu.register_table(name.as_str(), Arc::new(table))?;
        if args.compare {
            host.register_table(name.as_str(), Arc::new(MemTable::try_new(schema, partitions)?))?;
        }
    }

    let queries = if args.queries.is_empty() {
        vec!["q6".to_string()]
    } else {
        args.queries.clone()
    };
    for q in &queries {
        let sql = tpch::query(q).unwrap_or(q.as_str());
        let (out, gpu_secs) = runtime.block_on(time_query(&gpu, sql, args.runs))?;
        println!("{q}:\n{}", pretty_format_batches(&out)?);
        if args.compare {
            let (_, host_secs) = runtime.block_on(time_query(&host, sql, args.runs))?;
            println!(
                "{q}: {:.2} ms on the {device} table, {:.2} ms on MemTable ({:.1}x)",
                gpu_secs * 1e3,
                host_secs * 1e3,
                host_secs / gpu_secs
            );
        } else {
            println!("{q}: {:.2} ms", gpu_secs * 1e3);
        }
    }
    Ok(())
}

/// A session whose physical plans run the partial aggregates over GPU tables in device stages
/// ([`with_device_stages`]): the device computes them and copies only their small results back.
pub(crate) fn device_session(config: SessionConfig) -> SessionContext {
    let state = with_device_stages(SessionStateBuilder::new().with_default_features().with_config(config)).build();
    SessionContext::new_with_state(state)
}

/// Stages the batches of table `name` on `device` as a [`GpuTable`], with a progress bar (on stderr,
/// when it is a terminal) while it copies; returns the table and the seconds staging took.
pub(crate) fn stage(
    name: &str,
    schema: SchemaRef,
    partitions: Vec<Vec<RecordBatch>>,
    device: Device,
) -> Result<(GpuTable, f64), Box<dyn std::error::Error>> {
    let total: u64 = partitions
        .iter()
        .flatten()
        .map(|b| b.get_array_memory_size() as u64)
        .sum();
    let bar = ProgressBar::new(total).with_message(format!("staging {name}"));
    bar.set_style(ProgressStyle::with_template(
        "{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec}",
    )?);
    let progress = bar.clone();
    let options = LoadOptions::new()
        .with_name(name)
        .with_device(device)
        .with_progress(move |p| progress.set_position(p.bytes));
    let t = Instant::now();
    let table = GpuTable::try_new(schema, partitions, &options)?;
    bar.finish_and_clear();
    Ok((table, t.elapsed().as_secs_f64()))
}

/// Runs `sql` `runs` times; returns the last result and the best time in seconds.
async fn time_query(ctx: &SessionContext, sql: &str, runs: usize) -> Result<(Vec<RecordBatch>, f64), DataFusionError> {
    let mut best = f64::INFINITY;
    let mut out = Vec::new();
    for _ in 0..runs.max(1) {
        let t = Instant::now();
        out = ctx.sql(sql).await?.collect().await?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok((out, best))
}

/// The table name of a file: its stem, with every character but ASCII letters and digits as `_`.
fn table_name(path: &str) -> String {
    let stem = std::path::Path::new(path)
        .file_stem()
        .map_or("t".into(), |s| s.to_string_lossy().into_owned());
    stem.chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect()
}
