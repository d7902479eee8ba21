//! `arrow-cuda query`: TPC-H (generated in process) or Parquet / CSV files staged on the GPU, then SQL.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use arrow_array::{ArrayRef, RecordBatch, StringArray, UInt64Array};
use arrow_cuda::Device;
use arrow_cuda::datafusion::{
    GPU_FILE_TYPE, GpuTable, GpuTableFactory, LoadOptions, files_statement, with_device_stages,
};
use arrow_cuda_workloads::tpch;
use arrow_schema::SchemaRef;
use datafusion::arrow::util::pretty::pretty_format_batches;
use datafusion::catalog::{TableProvider, TableProviderFactory};
use datafusion::datasource::MemTable;
use datafusion::datasource::listing_table_factory::ListingTableFactory;
use datafusion::error::DataFusionError;
use datafusion::execution::SessionStateBuilder;
use datafusion::logical_expr::{CreateExternalTable, LogicalPlan, TableType};
use datafusion::physical_plan::collect_partitioned;
use datafusion::prelude::{CsvReadOptions, SessionConfig, SessionContext};
use indicatif::{HumanBytes, ProgressBar, ProgressStyle};

/// Options of `arrow-cuda query`.
#[derive(clap::Args)]
#[command(after_help = crate::prompt::ABOUT)]
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
    /// with --tpch, --parquet and --csv, and those `CREATE EXTERNAL TABLE ... STORED AS GPU`
    /// makes, read from the same files), print both times and check that both return the same
    /// rows (a difference fails the query).
    #[arg(long)]
    compare: bool,
    /// How results are written: a text table, CSV with a header, JSON lines or an Arrow IPC stream.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    format: Format,
    /// Write the results to this file instead of stdout; for several queries, one file each,
    /// `NAME-q6.EXT` for a TPC-H query, `NAME-2.EXT` for the second query given as SQL (at the
    /// prompt or from stdin, `NAME-N.EXT` for the Nth statement).
    #[arg(long)]
    output: Option<std::path::PathBuf>,
    /// Runs of each query (the best time is printed): 3 for queries given here, 1 at the prompt
    /// or from stdin.
    #[arg(long)]
    runs: Option<usize>,
    /// Queries, in order: `q1` ... `q22` (TPC-H) or SQL text; statements such as `CREATE EXTERNAL
    /// TABLE t STORED AS GPU LOCATION 'path'` (Parquet, or CSV with `OPTIONS ('has_header'
    /// 'true')`) run once. With none, an interactive prompt when stdin is a terminal, else the
    /// statements read from stdin (see below).
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
/// prints its error and the others still run; the command fails when any did. With no query,
/// statements come from the prompt (stdin a terminal) or from stdin as a script.
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
    let mut session = Session::new(args, device, cores)?;
    session.stage_tables(args, cores)?;
    if args.queries.is_empty() {
        let runs = args.runs.unwrap_or(1);
        let stdin = std::io::stdin();
        return match stdin.is_terminal() {
            true => crate::prompt::interactive(&mut session, runs),
            false => crate::prompt::script(&mut session, runs, stdin.lock()),
        };
    }
    let runs = args.runs.unwrap_or(3);
    let mut failed = Vec::new();
    for (i, q) in args.queries.iter().enumerate() {
        let sql = tpch::query(q).unwrap_or(q.as_str());
        // A file per query: a TPC-H query's name, else the query's place on the command line.
        let label = match tpch::query(q) {
            Some(_) => q.to_lowercase(),
            None => (i + 1).to_string(),
        };
        let output = session.output(&label, args.queries.len() > 1);
        if let Err(e) = session.execute(Some(q), sql, runs, output.as_deref()) {
            eprintln!("{q}: error: {e}");
            failed.push(q.as_str());
        }
    }
    match failed.as_slice() {
        [] => Ok(()),
        some => Err(format!(
            "{} of {} queries failed: {}",
            some.len(),
            args.queries.len(),
            some.join(", ")
        )
        .into()),
    }
}

/// What `arrow-cuda query` runs statements on: the device session and, with `--compare`, the host
/// session of `MemTable`s that every query runs on too.
pub(crate) struct Session {
    gpu: SessionContext,
    host: Option<SessionContext>,
    runtime: tokio::runtime::Runtime,
    device: Device,
    format: Format,
    output: Option<PathBuf>,
    /// Whether times are printed (`\timing` at the prompt turns them off and on).
    pub(crate) timing: bool,
}

impl Session {
    /// The sessions for `args` on `device`, with `cores` partitions; no tables yet.
    fn new(args: &Args, device: Device, cores: usize) -> Result<Self, Box<dyn std::error::Error>> {
        let config = SessionConfig::new().with_target_partitions(cores);
        let host = args.compare.then(|| {
            let state = SessionStateBuilder::new()
                .with_default_features()
                .with_config(config.clone())
                .with_table_factory(GPU_FILE_TYPE.to_string(), Arc::new(HostTables));
            SessionContext::new_with_state(state.build())
        });
        Ok(Session {
            gpu: device_session(config, device),
            host,
            runtime: tokio::runtime::Builder::new_multi_thread().enable_all().build()?,
            device,
            format: args.format,
            output: args.output.clone(),
            timing: true,
        })
    }

    /// The device this session stages tables on.
    pub(crate) fn device(&self) -> Device {
        self.device
    }

    /// Stages the tables of `--tpch`, `--parquet` and `--csv` (and, with `--compare`, registers
    /// them as `MemTable`s in the host session).
    fn stage_tables(&mut self, args: &Args, cores: usize) -> Result<(), Box<dyn std::error::Error>> {
        let device = self.device;
        // Generated tables: each one's name and batches, by partition.
        let mut generated: Vec<(String, Vec<Vec<RecordBatch>>)> = Vec::new();
        if let Some(sf) = args.tpch {
            let t = Instant::now();
            let tables = tpch::tables(sf, cores, tpch::LARGE_BATCH_SIZE)?;
            generated.extend(tables.into_iter().map(|t| (t.name.to_string(), t.partitions)));
            eprintln!("generated the 8 TPC-H tables at SF {sf} in {:.2?}", t.elapsed());
        }
        for (name, partitions) in generated {
            let schema = match partitions.iter().flatten().next() {
                Some(b) => b.schema(),
                None => continue,
            };
            let (table, secs) = stage(&name, schema.clone(), partitions.clone(), device)?;
            staged(&name, &table, device, secs);
            self.gpu.register_table(name.as_str(), Arc::new(table))?;
            if let Some(host) = &self.host {
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
            let table = self.runtime.block_on(async {
                match parquet {
                    true => GpuTable::from_parquet(path, &options).await,
                    false => GpuTable::from_csv(path, CsvReadOptions::new(), &options).await,
                }
            });
            bar.finish_and_clear();
            let table = table?;
            staged(&name, &table, device, t.elapsed().as_secs_f64());
            if let Some(host) = &self.host {
                let df = match parquet {
                    true => self.runtime.block_on(host.read_parquet(path, Default::default()))?,
                    false => self.runtime.block_on(host.read_csv(path, CsvReadOptions::new()))?,
                };
                let partitions = self.runtime.block_on(df.collect_partitioned())?;
                host.register_table(name.as_str(), Arc::new(MemTable::try_new(table.schema(), partitions)?))?;
            }
            self.gpu.register_table(name.as_str(), Arc::new(table))?;
        }
        Ok(())
    }

    /// Where the result labelled `label` goes: `--output` itself, or with `several` results,
    /// `NAME-LABEL.EXT` beside it; `None` for stdout.
    pub(crate) fn output(&self, label: &str, several: bool) -> Option<PathBuf> {
        let path = self.output.as_ref()?;
        if !several {
            return Some(path.clone());
        }
        let stem = path
            .file_stem()
            .map_or("out".into(), |s| s.to_string_lossy().into_owned());
        let ext = path
            .extension()
            .map_or(self.format.extension().into(), |e| e.to_string_lossy().into_owned());
        Some(path.with_file_name(format!("{stem}-{label}.{ext}")))
    }

    /// Runs one SQL statement. A query runs `runs` times on the device session (and on the host
    /// session with `--compare`, where rows that differ are an error); its result goes to
    /// `output` (stdout when `None`), headed by `name` in a text table, and `name` starts the
    /// line of its times. A statement that changes the session (`CREATE EXTERNAL TABLE ...
    /// STORED AS GPU`, `CREATE VIEW`, `SET`, ...) runs once, on both sessions.
    pub(crate) fn execute(
        &self,
        name: Option<&str>,
        sql: &str,
        runs: usize,
        output: Option<&Path>,
    ) -> Result<(), Box<dyn std::error::Error>> {
        let prefix = name.map_or(String::new(), |n| format!("{n}: "));
        let device = self.device;
        let plan = self.runtime.block_on(self.gpu.state().create_logical_plan(sql))?;
        if let LogicalPlan::Ddl(_) | LogicalPlan::Statement(_) = plan {
            let t = Instant::now();
            self.runtime
                .block_on(async { self.gpu.execute_logical_plan(plan).await?.collect().await })?;
            if let Some(host) = &self.host {
                self.runtime
                    .block_on(async { host.sql(sql).await?.collect().await })
                    .map_err(|e| format!("on MemTable: {e}"))?;
            }
            if self.timing {
                eprintln!("{prefix}done in {:.2} s", t.elapsed().as_secs_f64());
            }
            return Ok(());
        }
        // A plan's text differs between the engines: EXPLAIN runs on the device session only.
        let host = match plan {
            LogicalPlan::Explain(_) | LogicalPlan::Analyze(_) => None,
            _ => self.host.as_ref(),
        };
        let (out, gpu_secs, host_run) = self.runtime.block_on(async {
            let (out, gpu_secs) = time_query(&self.gpu, sql, runs).await?;
            let host_run = match host {
                Some(host) => Some(time_query(host, sql, runs).await?),
                None => None,
            };
            Ok::<_, DataFusionError>((out, gpu_secs, host_run))
        })?;
        write_result(name, &out, self.format, output)?;
        let count = match out.iter().map(RecordBatch::num_rows).sum::<usize>() {
            1 => "1 row".to_string(),
            n => format!("{n} rows"),
        };
        let Some((theirs, host_secs)) = host_run else {
            if self.timing {
                eprintln!("{prefix}{count} in {:.2} ms", gpu_secs * 1e3);
            }
            return Ok(());
        };
        if self.timing {
            eprintln!(
                "{prefix}{count} in {:.2} ms on the {device} table, {:.2} ms on MemTable ({:.1}x)",
                gpu_secs * 1e3,
                host_secs * 1e3,
                host_secs / gpu_secs
            );
        }
        let ordered = sql.to_lowercase().contains("order by");
        if rows(&out, ordered)? != rows(&theirs, ordered)? {
            return Err(format!("the {device} table's rows differ from MemTable's").into());
        }
        Ok(())
    }

    /// The tables of the device session, a row each (sorted by name): its name, what it is, and
    /// for a GPU table its rows, bytes and device; as `--format` writes them.
    pub(crate) fn list_tables(&self) -> Result<(), Box<dyn std::error::Error>> {
        let options = self.gpu.state().config().options().catalog.clone();
        let schema = self
            .gpu
            .catalog(&options.default_catalog)
            .and_then(|c| c.schema(&options.default_schema))
            .ok_or("the session has no default schema")?;
        let mut names = schema.table_names();
        names.sort();
        let (mut kinds, mut rows, mut bytes) = (Vec::new(), Vec::new(), Vec::new());
        for name in &names {
            let table = self.runtime.block_on(schema.table(name))?;
            let gpu = table.as_deref().and_then(|t| t.downcast_ref::<GpuTable>());
            let kind = match (gpu, table.as_ref().map(|t| t.table_type())) {
                (Some(g), _) => {
                    let devices: Vec<String> = g.partition_devices().iter().map(Device::to_string).collect();
                    format!("GPU table on {}", devices.join(", "))
                }
                (None, Some(TableType::View)) => "view".to_string(),
                (None, _) => "table".to_string(),
            };
            kinds.push(kind);
            rows.push(gpu.map(|g| g.num_rows() as u64));
            bytes.push(gpu.map(|g| g.size_in_bytes() as u64));
        }
        let batch = RecordBatch::try_from_iter([
            ("name", Arc::new(StringArray::from(names)) as ArrayRef),
            ("type", Arc::new(StringArray::from(kinds))),
            ("rows", Arc::new(UInt64Array::from(rows))),
            ("bytes", Arc::new(UInt64Array::from(bytes))),
        ])?;
        write_result(None, &[batch], self.format, None)
    }
}

/// `CREATE EXTERNAL TABLE ... STORED AS GPU` in the host session of `--compare`: the files the
/// device session stages, read by DataFusion into a `MemTable` (as `--parquet` and `--csv` tables
/// are), so that both engines answer every query on it.
#[derive(Debug)]
struct HostTables;

#[async_trait::async_trait]
impl TableProviderFactory for HostTables {
    async fn create(
        &self,
        state: &dyn datafusion::catalog::Session,
        cmd: &CreateExternalTable,
    ) -> datafusion::error::Result<Arc<dyn TableProvider>> {
        let listing = ListingTableFactory::new().create(state, &files_statement(cmd)?).await?;
        let plan = listing.scan(state, None, &[], None).await?;
        let partitions = collect_partitioned(plan, state.task_ctx()).await?;
        Ok(Arc::new(MemTable::try_new(listing.schema(), partitions)?))
    }
}

/// Writes `batches` as `format` to `path`, or to stdout; a text table is headed by `name`.
fn write_result(
    name: Option<&str>,
    batches: &[RecordBatch],
    format: Format,
    path: Option<&std::path::Path>,
) -> Result<(), Box<dyn std::error::Error>> {
    let mut out: Box<dyn Write> = match path {
        Some(p) => Box::new(std::io::BufWriter::new(std::fs::File::create(p)?)),
        None => Box::new(std::io::stdout().lock()),
    };
    match format {
        Format::Table => match name {
            Some(name) => writeln!(out, "{name}:\n{}", pretty_format_batches(batches)?)?,
            None => writeln!(out, "{}", pretty_format_batches(batches)?)?,
        },
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
/// `CREATE EXTERNAL TABLE ... STORED AS GPU` stages files on `device` as
/// [`with_gpu_tables`](arrow_cuda::datafusion::with_gpu_tables) does, with a progress bar and the
/// staged line as for `--parquet` tables ([`StagedTables`]).
pub(crate) fn device_session(config: SessionConfig, device: Device) -> SessionContext {
    let builder = SessionStateBuilder::new().with_default_features().with_config(config);
    let builder = builder.with_table_factory(GPU_FILE_TYPE.to_string(), Arc::new(StagedTables { device }));
    SessionContext::new_with_state(with_device_stages(builder).build())
}

/// `CREATE EXTERNAL TABLE ... STORED AS GPU` in the tool's device session: [`GpuTableFactory`]
/// staging on `device` with a progress bar named after the table, then the line that says what
/// staging took.
#[derive(Debug)]
struct StagedTables {
    device: Device,
}

#[async_trait::async_trait]
impl TableProviderFactory for StagedTables {
    async fn create(
        &self,
        state: &dyn datafusion::catalog::Session,
        cmd: &CreateExternalTable,
    ) -> datafusion::error::Result<Arc<dyn TableProvider>> {
        let name = cmd.name.to_string();
        let (bar, options) = progress_bar(&name, self.device)
            .map_err(|e| datafusion::error::DataFusionError::Execution(e.to_string()))?;
        let t = Instant::now();
        let table = GpuTableFactory::new(options).create(state, cmd).await;
        bar.finish_and_clear();
        let table = table?;
        if let Some(gpu) = table.as_ref().downcast_ref::<GpuTable>() {
            staged(&name, gpu, self.device, t.elapsed().as_secs_f64());
        }
        Ok(table)
    }
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
