//! Tables from files in SQL: [`GpuTableFactory`] makes `CREATE EXTERNAL TABLE ... STORED AS GPU`
//! stage Parquet or CSV files, and [`with_gpu_tables`] installs it in a session. The loads behind
//! it serve [`GpuTable::from_parquet`] too.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ::datafusion::catalog::{Session, TableProvider, TableProviderFactory};
use ::datafusion::common::{DataFusionError, not_impl_err, plan_err};
use ::datafusion::datasource::listing::ListingTable;
use ::datafusion::datasource::listing_table_factory::ListingTableFactory;
use ::datafusion::execution::SessionStateBuilder;
use ::datafusion::execution::object_store::ObjectStoreUrl;
use ::datafusion::logical_expr::CreateExternalTable;
use arrow_schema::SchemaRef;
use async_trait::async_trait;

use super::error::DfResult;
use super::options::LoadOptions;
use super::table::GpuTable;

/// The file type that names GPU tables in SQL: `STORED AS GPU`.
pub const GPU_FILE_TYPE: &str = "GPU";

/// The option of `CREATE EXTERNAL TABLE ... STORED AS GPU` that names the files' format
/// (`OPTIONS ('format' 'csv')`; DataFusion's SQL planner prefixes a key without a dot with
/// `format.`).
const FORMAT_OPTION: &str = "format.format";

/// A DataFusion [`TableProviderFactory`] whose tables are [`GpuTable`]s staged from Parquet or CSV
/// files: what `CREATE EXTERNAL TABLE name STORED AS GPU LOCATION 'path'` runs once
/// [`with_gpu_tables`] has installed it.
///
/// - `LOCATION` is a file, a directory of files or a glob, local (more than one location reads
///   them all as one table, as DataFusion does).
/// - The format is Parquet, or CSV where the location ends in `.csv` or `.tsv`; `OPTIONS ('format'
///   'parquet')` or `OPTIONS ('format' 'csv')` says so explicitly.
/// - The other options, and a column list when one is given, are DataFusion's own for that
///   format, checked by DataFusion's `ListingTableFactory` (`OPTIONS ('format' 'csv', 'has_header'
///   'true', 'delimiter' '|')`), and so are the column types: the table's schema is the one
///   `STORED AS PARQUET` or `STORED AS CSV` would give.
/// - Parquet files are staged by [`GpuTable::from_parquet`]'s pipeline (row groups decoded on
///   every core while earlier ones are copied); CSV files are read by DataFusion and staged as
///   they arrive ([`GpuTable::from_provider`]).
///
/// A location that does not exist, a format other than Parquet or CSV, partition columns (not
/// supported) and files that DataFusion cannot read are errors of the `CREATE` statement.
#[derive(Debug, Clone, Default)]
pub struct GpuTableFactory {
    options: LoadOptions,
}

impl GpuTableFactory {
    /// A factory staging its tables with `options` (each named after its SQL table).
    pub fn new(options: LoadOptions) -> Self {
        GpuTableFactory { options }
    }
}

#[async_trait]
impl TableProviderFactory for GpuTableFactory {
    async fn create(&self, state: &dyn Session, cmd: &CreateExternalTable) -> DfResult<Arc<dyn TableProvider>> {
        let listing = files_statement(cmd)?;
        let load_options = self.options.clone().with_name(cmd.name.to_string());
        let table = load_listing(state, &listing, load_options, None).await?;
        Ok(Arc::new(table))
    }
}

/// The `STORED AS PARQUET` or `STORED AS CSV` statement that reads the files of `cmd`, a
/// `CREATE EXTERNAL TABLE ... STORED AS GPU`, with the same options: the table [`GpuTableFactory`]
/// stages is the one DataFusion's `ListingTableFactory` makes of it, so a host session can read
/// the same table by running it (the CLI's `--compare` does).
///
/// Fails for a format other than Parquet or CSV and for partition columns, as the factory does.
pub fn files_statement(cmd: &CreateExternalTable) -> DfResult<CreateExternalTable> {
    let mut options = cmd.options.clone();
    let format = match options.remove(FORMAT_OPTION) {
        Some(format) => format,
        None => guess_format(&cmd.locations).to_string(),
    };
    let format = match format.to_lowercase().as_str() {
        "parquet" => "PARQUET",
        "csv" => "CSV",
        _ => {
            return plan_err!(
                "GPU tables are staged from Parquet or CSV files, not `{format}`: \
                 OPTIONS ('format' 'parquet') or OPTIONS ('format' 'csv')"
            );
        }
    };
    if !cmd.table_partition_cols.is_empty() {
        return not_impl_err!("GPU tables do not take partition columns (PARTITIONED BY)");
    }
    Ok(CreateExternalTable {
        file_type: format.to_string(),
        options,
        ..cmd.clone()
    })
}

/// Where a [`GpuTable`] was staged from ([`GpuTable::source`]): its files, their format, DataFusion's
/// options for that format, the column list it was declared with (if any), and the
/// [`LoadOptions`] it was staged with, its partition count among them. Enough for another machine
/// that sees the same files to stage the same table; nothing of the device memory that holds it.
#[derive(Clone, Debug)]
pub struct GpuTableSource {
    pub(crate) locations: Vec<String>,
    /// `PARQUET` or `CSV`.
    pub(crate) format: String,
    pub(crate) options: BTreeMap<String, String>,
    #[cfg_attr(not(feature = "ballista"), allow(dead_code))]
    pub(crate) schema: Option<SchemaRef>,
    /// The options of the load, without its progress callback, and with the partition count
    /// the table has.
    pub(crate) load: LoadOptions,
}

impl GpuTableSource {
    /// The files, directories or globs the table was read from.
    pub fn locations(&self) -> &[String] {
        &self.locations
    }

    /// Their format: `PARQUET` or `CSV`.
    pub fn format(&self) -> &str {
        &self.format
    }

    /// DataFusion's options for the format (`format.has_header`, ...).
    pub fn options(&self) -> &BTreeMap<String, String> {
        &self.options
    }

    /// The options the table was staged with; their partition count is the table's.
    pub fn load_options(&self) -> &LoadOptions {
        &self.load
    }

    /// Stages the same files again, with `options` (the source's own, a device chosen elsewhere,
    /// say), through a fresh DataFusion session: the whole table, or with `share`, only those of
    /// its partitions (Parquet files only; see `parquet::stage`), the others left empty.
    #[cfg(feature = "ballista")]
    pub(crate) async fn stage(&self, options: LoadOptions, share: Option<Vec<usize>>) -> DfResult<GpuTable> {
        let Some(first) = self.locations.first() else {
            return plan_err!("a GPU table source needs at least one location");
        };
        let schema = match &self.schema {
            Some(s) => ::datafusion::common::DFSchema::try_from(s.clone())?,
            None => ::datafusion::common::DFSchema::empty(),
        };
        let name = options.name.clone().unwrap_or_else(|| first.clone());
        let cmd = CreateExternalTable::builder(name.as_str(), first.clone(), self.format.as_str(), Arc::new(schema))
            .with_locations(self.locations.clone())
            .with_options(self.options.clone().into_iter().collect())
            .build();
        load_listing(
            &::datafusion::execution::context::SessionContext::new().state(),
            &cmd,
            options,
            share,
        )
        .await
    }
}

/// `builder` with [`GpuTableFactory`] installed for `STORED AS GPU`, staging tables with `options`
/// (`LoadOptions::new()`: on the first GPU, or the CPU device without one):
///
/// ```sql
/// CREATE EXTERNAL TABLE lineitem STORED AS GPU LOCATION 'tpch/lineitem/';
/// CREATE EXTERNAL TABLE t STORED AS GPU LOCATION 't.csv' OPTIONS ('has_header' 'true');
/// ```
///
/// Install it before or after `with_default_features`: both keep it.
pub fn with_gpu_tables(builder: SessionStateBuilder, options: LoadOptions) -> SessionStateBuilder {
    builder.with_table_factory(GPU_FILE_TYPE.to_string(), Arc::new(GpuTableFactory::new(options)))
}

/// The format of `locations` by the first one's extension: CSV for `.csv` and `.tsv` (compressed
/// or not), Parquet otherwise.
fn guess_format(locations: &[String]) -> &'static str {
    let first = locations.first().map(|l| l.to_lowercase()).unwrap_or_default();
    let csv = [".csv", ".tsv"]
        .iter()
        .any(|ext| first.ends_with(ext) || first.contains(&format!("{ext}.")));
    if csv { "csv" } else { "parquet" }
}

/// Stages the files of `locations` in `format` (`PARQUET` or `CSV`, with DataFusion's `options`
/// for it) as a [`GpuTable`] with the types `state` reads them as.
pub(crate) async fn load(
    state: &dyn Session,
    locations: &[String],
    format: &str,
    options: HashMap<String, String>,
    load_options: LoadOptions,
) -> DfResult<GpuTable> {
    let Some(first) = locations.first() else {
        return plan_err!("a GPU table needs at least one location");
    };
    let schema = Arc::new(::datafusion::common::DFSchema::empty());
    let cmd = CreateExternalTable::builder(first.as_str(), first.clone(), format, schema)
        .with_locations(locations.to_vec())
        .with_options(options)
        .build();
    load_listing(state, &cmd, load_options, None).await
}

/// Stages the files `cmd` names (file type `PARQUET` or `CSV`), as DataFusion's own
/// `ListingTableFactory` reads them (with `share`, only those partitions), and remembers them as
/// the table's source.
async fn load_listing(
    state: &dyn Session,
    cmd: &CreateExternalTable,
    options: LoadOptions,
    share: Option<Vec<usize>>,
) -> DfResult<GpuTable> {
    let mut load = options.clone();
    load.progress = None;
    let table = stage_listing(state, cmd, options, share).await?;
    load.partitions = Some(table.partitions().len());
    let source = GpuTableSource {
        locations: cmd.locations.clone(),
        format: cmd.file_type.clone(),
        options: cmd.options.clone().into_iter().collect(),
        schema: (!cmd.schema.fields().is_empty()).then(|| cmd.schema.inner().clone()),
        load,
    };
    table.with_source(source)
}

async fn stage_listing(
    state: &dyn Session,
    cmd: &CreateExternalTable,
    options: LoadOptions,
    share: Option<Vec<usize>>,
) -> DfResult<GpuTable> {
    for location in &cmd.locations {
        check_exists(location)?;
    }
    let listing = ListingTableFactory::new().create(state, cmd).await?;
    if cmd.file_type == "CSV" {
        if share.is_some() {
            return not_impl_err!("a share of a GPU table's partitions is staged from Parquet files only");
        }
        return GpuTable::from_provider(listing, &options).await;
    }
    let Some(table) = listing.downcast_ref::<ListingTable>() else {
        return plan_err!("DataFusion's ListingTableFactory made no ListingTable");
    };
    if table
        .table_paths()
        .iter()
        .any(|p| p.object_store() != ObjectStoreUrl::local_filesystem())
    {
        return not_impl_err!("GPU tables are staged from local files only, not {:?}", cmd.locations);
    }
    if !table.options().table_partition_cols.is_empty() {
        return not_impl_err!("GPU tables do not take partition columns (directories named `key=value`)");
    }
    let listed = table.list_files_for_scan(state, &[], None).await?;
    let mut files: Vec<PathBuf> = listed
        .file_groups
        .iter()
        .flat_map(|g| g.iter())
        .map(|f| Path::new("/").join(f.object_meta.location.as_ref()))
        .collect();
    files.sort();
    files.dedup();
    if files.is_empty() {
        return plan_err!("no Parquet files at {}", cmd.locations.join(", "));
    }
    let schema = table.schema();
    blocking(move || super::parquet::stage(&files, schema, &options, share.as_deref())).await
}

/// Fails unless the local path `location` (not a URL or glob) exists.
fn check_exists(location: &str) -> DfResult<()> {
    let url_or_glob = location.contains("://") || location.contains(['*', '?', '[']);
    if url_or_glob || Path::new(location).exists() {
        return Ok(());
    }
    plan_err!("{location} does not exist")
}

/// Runs `f`, which blocks for a while, off the async runtime's worker threads where there is one.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> DfResult<T> + Send + 'static) -> DfResult<T> {
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => runtime
            .spawn_blocking(f)
            .await
            .map_err(|e| DataFusionError::External(Box::new(e)))?,
        Err(_) => f(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_format_follows_the_extension() {
        let of = |l: &str| guess_format(&[l.to_string()]);
        assert_eq!(of("a/b.csv"), "csv");
        assert_eq!(of("B.TSV"), "csv");
        assert_eq!(of("b.csv.gz"), "csv");
        assert_eq!(of("b.parquet"), "parquet");
        assert_eq!(of("dir/"), "parquet");
        assert_eq!(guess_format(&[]), "parquet");
    }
}
