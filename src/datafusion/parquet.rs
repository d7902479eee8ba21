//! Parquet files staged run of row groups by run of row groups: each run decoded on a core of its
//! own straight into one batch (the reader's batches span row groups), prepared there, and copied
//! to its device while other runs are still being decoded (see `staging::stage_parallel`).

use std::fs::File;
use std::path::{Path, PathBuf};

use ::datafusion::common::DataFusionError;
use ::datafusion::parquet::arrow::arrow_reader::{
    ArrowReaderMetadata, ArrowReaderOptions, ParquetRecordBatchReaderBuilder,
};
use arrow_array::{RecordBatch, RecordBatchOptions};
use arrow_schema::SchemaRef;

use super::error::DfResult;
use super::options::{DEFAULT_BATCH_ROWS, LoadOptions, MAX_GATHERED_BYTES};
use super::staging::{Stager, stage_parallel};
use super::table::GpuTable;
use crate::transfer::times::StagingStep;

/// Consecutive row groups of one file, decoded as one device batch.
struct Run {
    file: usize,
    row_groups: Vec<usize>,
    rows: usize,
}

/// Stages the Parquet `files` as a table of `schema` (the types DataFusion reads them as): runs of
/// consecutive row groups of about [`LoadOptions::with_batch_rows`] rows (fewer where that leaves
/// fewer than two runs per core) are the device batches; consecutive runs make each partition.
///
/// With `share`, only those partitions are staged and the others stay empty (a Ballista executor
/// stages the partitions its tasks read). Which rows make each partition then depends on the
/// files, the batch rows and the partition count only (runs of fewer than two per partition,
/// rather than per core), so that processes on machines of any size that stage different
/// partitions of the same files split their rows exactly.
pub(crate) fn stage(
    files: &[PathBuf],
    schema: SchemaRef,
    options: &LoadOptions,
    share: Option<&[usize]>,
) -> DfResult<GpuTable> {
    let setup = std::time::Instant::now();
    let reader_options = ArrowReaderOptions::new().with_schema(schema.clone());
    let metadata = files
        .iter()
        .map(|path| {
            let file = open(path)?;
            ArrowReaderMetadata::load(&file, reader_options.clone()).map_err(|e| in_file(path, e))
        })
        .collect::<DfResult<Vec<_>>>()?;
    let total_rows: u64 = metadata
        .iter()
        .map(|m| m.metadata().file_metadata().num_rows().max(0) as u64)
        .sum();
    let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
    let spread = match (share, options.partitions) {
        (Some(_), Some(partitions)) => partitions,
        (Some(_), None) => {
            return Err(DataFusionError::Internal(
                "staging a share of a table's partitions needs its partition count".into(),
            ));
        }
        (None, _) => cores,
    };
    let rows = options
        .batch_rows
        .unwrap_or(DEFAULT_BATCH_ROWS)
        .min((total_rows as usize / (2 * spread.max(1))).max(1));
    let runs = runs(&metadata, rows);
    let partitions = options.partitions.unwrap_or(cores.min(runs.len())).max(1);
    let n = runs.len();
    let units: Vec<(usize, Run)> = runs
        .into_iter()
        .enumerate()
        .map(|(i, run)| (i * partitions / n, run))
        .filter(|(p, _)| share.is_none_or(|s| s.contains(p)))
        .collect();
    let staged_rows = units.iter().map(|(_, run)| run.rows as u64).sum();
    let mut stager = Stager::new(schema.clone(), partitions, options, Some(staged_rows), None)?;
    if let Some(times) = &options.staging_times {
        times.add(StagingStep::Setup, setup.elapsed());
    }
    stage_parallel(&mut stager, units, |run: Run| {
        let path = &files[run.file];
        let reader = ParquetRecordBatchReaderBuilder::new_with_metadata(open(path)?, metadata[run.file].clone())
            .with_row_groups(run.row_groups)
            .with_batch_size(run.rows)
            .build()
            .map_err(|e| in_file(path, e))?;
        let batch_options = |b: &RecordBatch| RecordBatchOptions::new().with_row_count(Some(b.num_rows()));
        reader
            .map(|b| {
                let b = b.map_err(|e| in_file(path, e))?;
                // The table's schema, with its metadata, on every batch.
                RecordBatch::try_new_with_options(schema.clone(), b.columns().to_vec(), &batch_options(&b))
                    .map_err(|e| in_file(path, e))
            })
            .collect()
    })?;
    stager.finish()
}

/// Runs of consecutive row groups of each file, each of at least `rows` rows (but the last of a
/// file) unless that would take more than [`MAX_GATHERED_BYTES`] (uncompressed, as the files say).
fn runs(metadata: &[ArrowReaderMetadata], rows: usize) -> Vec<Run> {
    let mut runs = Vec::new();
    for (file, m) in metadata.iter().enumerate() {
        let empty = || Run {
            file,
            row_groups: Vec::new(),
            rows: 0,
        };
        let (mut run, mut bytes) = (empty(), 0u64);
        for (i, rg) in m.metadata().row_groups().iter().enumerate() {
            let rg_bytes = rg.total_byte_size().max(0) as u64;
            if run.rows > 0 && bytes + rg_bytes > MAX_GATHERED_BYTES {
                runs.push(std::mem::replace(&mut run, empty()));
                bytes = 0;
            }
            run.row_groups.push(i);
            run.rows += rg.num_rows().max(0) as usize;
            bytes += rg_bytes;
            if run.rows >= rows {
                runs.push(std::mem::replace(&mut run, empty()));
                bytes = 0;
            }
        }
        if run.rows > 0 {
            runs.push(run);
        }
    }
    runs
}

fn open(path: &Path) -> DfResult<File> {
    File::open(path).map_err(|e| in_file(path, e))
}

/// An error reading `path`, naming it.
fn in_file(path: &Path, e: impl std::fmt::Display) -> DataFusionError {
    DataFusionError::Execution(format!("{}: {e}", path.display()))
}
