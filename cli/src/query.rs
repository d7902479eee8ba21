//! `arrow-cuda query`: TPC-H (generated in process) or Parquet / CSV files staged on the GPU, then SQL.

use std::io::Write;
use std::sync::Arc;
use std::time::Instant;

use arrow_array::RecordBatch;
use arrow_cuda::Device;
use arrow_cuda::datafusion::{GpuTable, LoadOptions, with_device_stages, with_gpu_tables};
use arrow_cuda_workloads::tpch;
use arrow_schema::SchemaRef;
use datafusion::arrow::util::pretty::pretty_format_batches;
use datafusion::catalog::TableProvider;
use datafusion::datasource::MemTable;
use datafusion::error::DataFusionError;
use datafusion::execution::SessionStateBuilder;
use datafusion::logical_expr::LogicalPlan;
use datafusion::prelude::{CsvReadOptions, SessionConfig, SessionContext};
use indicatif::{HumanBytes, ProgressBar, ProgressStyle};

/// Options of `arrow-cuda query`.
#[derive(clap::Args)]
pub struct Args {
    /// Generate the 8 TPC-H tables at this scale factor and stage them.
    #[arg(long)]
    tpch: Option<f64>,
    /// Stage a Parquet file, or a directory of them, as a table named after it, or `NAME=PATH`
    /// (repeatable); row groups are decoded on every core and copied as they are ready.
    #[arg(long)]
    parquet: Vec<String>,
    /// Stage a CSV file with a header row, or a directory of them, as a table named after it, or
    /// `NAME=PATH` (repeatable).
    #[arg(long)]
    csv: Vec<String>,
    /// `cuda` (the default, when a GPU is present) or `cpu`.
    #[arg(long)]
    device: Option<crate::DeviceArg>,
    /// Also run each query on DataFusion's MemTable over the same batches (of the tables given
    /// with --tpch, --parquet and --csv), print both times and check that both return the same
    /// rows (a difference fails the query).
    #[arg(long)]
    compare: bool,
    /// How results are written: a text table, CSV with a header, JSON lines or an Arrow IPC stream.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    format: Format,
    /// Write the results to this file instead of stdout; for several queries, one file each,
    /// `NAME-q6.EXT` for a TPC-H query, `NAME-2.EXT` for the second query given as SQL.
    #[arg(long)]
    output: Option<std::path::PathBuf>,
    /// Runs of each query (the best time is printed).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Queries, in order: `q1` ... `q22` (TPC-H) or SQL text; statements such as `CREATE EXTERNAL
    /// TABLE t STORED AS GPU LOCATION 'path'` (Parquet, or CSV with `OPTIONS ('has_header'
    /// 'true')`) run once. Default: q6.
    queries: Vec<String>,
}

/// How `arrow-cuda query` writes results.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// A text table (with the query's name and time).
    Table,
    /// CSV with a header row.
    Csv,
    /// One JSON object per row.
    Json,
    /// An Arrow IPC stream.
    Arrow,
}

impl Format {
    fn extension(self) -> &'static str {
        match self {
            Format::Table => "txt",
            Format::Csv => "csv",
            Format::Json => "json",
            Format::Arrow => "arrows",
        }
    }
}

/// `arrow-cuda query`: stages the tables, then runs each query on them with device stages (and on
/// `MemTable`s with `--compare`), writing its result and printing its times. A failing query
/// prints its error and the others still run; the command fails when any did.
pub fn run(args: &Args) -> Result<(), Box<dyn std::error::Error>> {
    let device = match args.device {
        Some(d) => d.resolve()?,
        None => match arrow_cuda::device::cuda_device_count() {
            Ok(_) => arrow_cuda::Device::Cuda(0),
            Err(e) => {
                eprintln!("no GPU ({e}); running on the CPU device");
                arrow_cuda::Device::Cpu
            }
        },
    };
    let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
    let config = SessionConfig::new().with_target_partitions(cores);
    let gpu = device_session(config.clone(), device);
    let host = SessionContext::new_with_config(config);
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;

    // Generated tables: each one's name and batches, by partition.
    let mut generated: Vec<(String, Vec<Vec<RecordBatch>>)> = Vec::new();
    if let Some(sf) = args.tpch {
        let t = Instant::now();
        let tables = tpch::tables(sf, cores, tpch::LARGE_BATCH_SIZE)?;
        generated.extend(tables.into_iter().map(|t| (t.name.to_string(), t.partitions)));
        eprintln!("generated the 8 TPC-H tables at SF {sf} in {:.2?}", t.elapsed());
    }
    if generated.is_empty() && args.parquet.is_empty() && args.csv.is_empty() && args.queries.is_empty() {
        return Err("nothing to query: give --tpch SF, --parquet FILE, --csv FILE or \
                    CREATE EXTERNAL TABLE ... STORED AS GPU"
            .into());
    }
    for (name, partitions) in generated {
        let schema = match partitions.iter().flatten().next() {
            Some(b) => b.schema(),
            None => continue,
        };
        let (table, secs) = stage(&name, schema.clone(), partitions.clone(), device)?;
        staged(&name, &table, device, secs);
        gpu.register_table(name.as_str(), Arc::new(table))?;
        if args.compare {
            host.register_table(name.as_str(), Arc::new(MemTable::try_new(schema, partitions)?))?;
        }
    }
    // Files: staged straight from them (Parquet row groups decoded on every core); with
    // --compare, also read by DataFusion into a MemTable.
    let files = args
        .parquet
        .iter()
        .map(|a| (a, true))
        .chain(args.csv.iter().map(|a| (a, false)));
    for (arg, parquet) in files {
        let (name, path) = named(arg);
        let (bar, options) = progress_bar(&name, device)?;
        let t = Instant::now();
        let table = runtime.block_on(async {
            match parquet {
                true => GpuTable::from_parquet(path, &options).await,
                false => GpuTable::from_csv(path, CsvReadOptions::new(), &options).await,
            }
        });
        bar.finish_and_clear();
        let table = table?;
        staged(&name, &table, device, t.elapsed().as_secs_f64());
        if args.compare {
            let df = match parquet {
                true => runtime.block_on(host.read_parquet(path, Default::default()))?,
                false => runtime.block_on(host.read_csv(path, CsvReadOptions::new()))?,
            };
            let partitions = runtime.block_on(df.collect_partitioned())?;
            host.register_table(name.as_str(), Arc::new(MemTable::try_new(table.schema(), partitions)?))?;
        }
        gpu.register_table(name.as_str(), Arc::new(table))?;
    }

    let queries = if args.queries.is_empty() {
        vec!["q6".to_string()]
    } else {
        args.queries.clone()
    };
    let mut failed = Vec::new();
    for (i, q) in queries.iter().enumerate() {
        let sql = tpch::query(q).unwrap_or(q.as_str());
        // A file per query: a TPC-H query's name, else the query's place on the command line.
        let label = match tpch::query(q) {
            Some(_) => q.to_lowercase(),
            None => (i + 1).to_string(),
        };
        let output = args.output.as_ref().map(|path| match queries.len() {
            1 => path.clone(),
            _ => {
                let stem = path
                    .file_stem()
                    .map_or("out".into(), |s| s.to_string_lossy().into_owned());
                let ext = path
                    .extension()
                    .map_or(args.format.extension().into(), |e| e.to_string_lossy().into_owned());
                path.with_file_name(format!("{stem}-{label}.{ext}"))
            }
        });
        // Statements that change the session (CREATE EXTERNAL TABLE ... STORED AS GPU, say) run
        // once, on the device session only.
        let plan = runtime.block_on(gpu.state().create_logical_plan(sql));
        if let Ok(plan @ (LogicalPlan::Ddl(_) | LogicalPlan::Statement(_))) = plan {
            let t = Instant::now();
            match runtime.block_on(async { gpu.execute_logical_plan(plan).await?.collect().await }) {
                Ok(_) => eprintln!("{q}: done in {:.2} s", t.elapsed().as_secs_f64()),
                Err(e) => {
                    eprintln!("{q}: error: {e}");
                    failed.push(q.as_str());
                }
            }
            continue;
        }
        let outcome = runtime.block_on(async {
            let (out, gpu_secs) = time_query(&gpu, sql, args.runs).await?;
            let host_run = match args.compare {
                true => Some(time_query(&host, sql, args.runs).await?),
                false => None,
            };
            Ok::<_, Box<dyn std::error::Error>>((out, gpu_secs, host_run))
        });
        let result = outcome.and_then(|(out, gpu_secs, host_run)| {
            write_result(q, &out, args.format, output.as_deref())?;
            let Some((theirs, host_secs)) = host_run else {
                eprintln!("{q}: {:.2} ms", gpu_secs * 1e3);
                return Ok(());
            };
            eprintln!(
                "{q}: {:.2} ms on the {device} table, {:.2} ms on MemTable ({:.1}x)",
                gpu_secs * 1e3,
                host_secs * 1e3,
                host_secs / gpu_secs
            );
            let ordered = sql.to_lowercase().contains("order by");
            if rows(&out, ordered)? != rows(&theirs, ordered)? {
                return Err(format!("the {device} table's rows differ from MemTable's").into());
            }
            Ok(())
        });
        if let Err(e) = result {
            eprintln!("{q}: error: {e}");
            failed.push(q.as_str());
        }
    }
    match failed.as_slice() {
        [] => Ok(()),
        some => Err(format!(
            "{} of {} queries failed: {}",
            some.len(),
            queries.len(),
            some.join(", ")
        )
        .into()),
    }
}

/// Writes the result of query `q` as `format` to `path`, or to stdout.
fn write_result(
    q: &str,
    batches: &[RecordBatch],
    format: Format,
    path: Option<&std::path::Path>,
) -> Result<(), Box<dyn std::error::Error>> {
    let mut out: Box<dyn Write> = match path {
        Some(p) => Box::new(std::io::BufWriter::new(std::fs::File::create(p)?)),
        None => Box::new(std::io::stdout().lock()),
    };
    match format {
        Format::Table => writeln!(out, "{q}:\n{}", pretty_format_batches(batches)?)?,
        Format::Csv => {
            let mut w = arrow_csv::Writer::new(&mut out);
            batches.iter().try_for_each(|b| w.write(b))?;
        }
        Format::Json => {
            let mut w = arrow_json::LineDelimitedWriter::new(&mut out);
            batches.iter().try_for_each(|b| w.write(b))?;
            w.finish()?;
        }
        Format::Arrow => {
            let Some(schema) = batches.first().map(|b| b.schema()) else {
                return Err("an empty result has no schema to write as Arrow".into());
            };
            let mut w = arrow_ipc::writer::StreamWriter::try_new(&mut out, &schema)?;
            batches.iter().try_for_each(|b| w.write(b))?;
            w.finish()?;
        }
    }
    out.flush()?;
    Ok(())
}

/// A result's rows as text lines, sorted unless the query orders them: what `--compare` checks.
fn rows(batches: &[RecordBatch], ordered: bool) -> Result<Vec<String>, Box<dyn std::error::Error>> {
    let text = pretty_format_batches(batches)?.to_string();
    let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
    if !ordered {
        lines.sort();
    }
    Ok(lines)
}

/// A table's name and path from `NAME=PATH`, or from `PATH` (the name is the file's stem).
fn named(arg: &str) -> (String, &str) {
    match arg.split_once('=') {
        Some((name, path)) if !name.is_empty() && !name.contains('/') => (name.to_string(), path),
        _ => (table_name(arg), arg),
    }
}

/// A session whose physical plans run the partial aggregates over GPU tables in device stages
/// ([`with_device_stages`]): the device computes them and copies only their small results back;
/// `CREATE EXTERNAL TABLE ... STORED AS GPU` stages files on `device` ([`with_gpu_tables`]).
pub(crate) fn device_session(config: SessionConfig, device: Device) -> SessionContext {
    let builder = SessionStateBuilder::new().with_default_features().with_config(config);
    let builder = with_gpu_tables(builder, LoadOptions::new().with_device(device));
    SessionContext::new_with_state(with_device_stages(builder).build())
}

/// Stages the batches of table `name` on `device` as a [`GpuTable`], with a progress bar (on stderr,
/// when it is a terminal) while it copies; returns the table and the seconds staging took.
pub(crate) fn stage(
    name: &str,
    schema: SchemaRef,
    partitions: Vec<Vec<RecordBatch>>,
    device: Device,
) -> Result<(GpuTable, f64), Box<dyn std::error::Error>> {
    let (bar, options) = progress_bar(name, device)?;
    let t = Instant::now();
    let table = GpuTable::try_new(schema, partitions, &options);
    bar.finish_and_clear();
    Ok((table?, t.elapsed().as_secs_f64()))
}

/// A progress bar for staging table `name` (on stderr, when it is a terminal): the rows staged
/// of the rows there are, the bytes decoded and the bytes on the device; and the load options
/// that move it.
fn progress_bar(name: &str, device: Device) -> Result<(ProgressBar, LoadOptions), Box<dyn std::error::Error>> {
    let bar = ProgressBar::new(0).with_prefix(format!("staging {name}"));
    bar.set_style(ProgressStyle::with_template(
        "{prefix} [{bar:30}] {human_pos}/{human_len} rows, {msg} ({elapsed})",
    )?);
    let progress = bar.clone();
    let options = LoadOptions::new()
        .with_name(name)
        .with_device(device)
        .with_progress(move |p| {
            if let Some(total) = p.total_rows {
                progress.set_length(total);
            }
            progress.set_position(p.rows);
            progress.set_message(format!(
                "{} decoded, {} on {device}",
                HumanBytes(p.decoded),
                HumanBytes(p.bytes)
            ));
        });
    Ok((bar, options))
}

/// Prints what staging `table` took.
fn staged(name: &str, table: &GpuTable, device: Device, secs: f64) {
    eprintln!(
        "staged {name}: {} rows, {:.1} MB on {device} in {:.3} s ({:.1} GB/s)",
        table.num_rows(),
        table.size_in_bytes() as f64 / 1e6,
        secs,
        table.size_in_bytes() as f64 / secs / 1e9
    );
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
