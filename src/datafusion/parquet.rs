//! Parquet files staged run of row groups by run of row groups: each run decoded on a core of its
//! own (the reader's batches span row groups), in pieces of [`PIECE_ROWS`] rows where its device
//! gathers them (else straight into one batch), each piece prepared there and copied to its device
//! while other runs and pieces are still being decoded (see `staging::stage_parallel`).

use std::fs::File;
use std::path::{Path, PathBuf};

use ::datafusion::common::DataFusionError;
use ::datafusion::parquet::arrow::arrow_reader::statistics::StatisticsConverter;
use ::datafusion::parquet::arrow::arrow_reader::{
    ArrowReaderMetadata, ArrowReaderOptions, ParquetRecordBatchReaderBuilder,
};
use arrow_array::{Array, ArrayRef, RecordBatch, RecordBatchOptions};
use arrow_schema::{DataType, Field, Schema, SchemaRef};

use super::error::DfResult;
use super::options::{DEFAULT_BATCH_ROWS, LoadOptions, MAX_GATHERED_BYTES};
use super::staging::{Place, Stager, stage_parallel};
use super::stats::KnownExtremes;
use super::table::GpuTable;
use crate::transfer::times::StagingStep;

/// The rows of the pieces a run is decoded in where its device gathers them: the reader's buffers
/// stay small enough for the allocator to reuse them (a run decoded whole into one batch takes
/// fresh memory from the system for every buffer, and faulting it in costs more than decoding),
/// and each piece is copied as soon as it is made.
const PIECE_ROWS: usize = 1 << 17;

/// Consecutive row groups of one file, decoded as one device batch.
struct Run {
    file: usize,
    row_groups: Vec<usize>,
    rows: usize,
    /// The rows of each batch the reader makes: [`PIECE_ROWS`] (or a test's), or the whole run
    /// (set once the stager knows the run's device).
    batch_rows: usize,
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
    stage_in_pieces(files, schema, options, share, PIECE_ROWS)
}

/// [`stage`], decoding runs in pieces of `piece_rows` rows where their device gathers them.
fn stage_in_pieces(
    files: &[PathBuf],
    schema: SchemaRef,
    options: &LoadOptions,
    share: Option<&[usize]>,
    piece_rows: usize,
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
    let mut units: Vec<(Place, Run)> = runs
        .into_iter()
        .enumerate()
        .map(|(i, run)| (Place::whole(i * partitions / n, i), run))
        .filter(|(p, _)| share.is_none_or(|s| s.contains(&p.partition)))
        .collect();
    let staged_rows = units.iter().map(|(_, run)| run.rows as u64).sum();
    let mut stager = Stager::new(schema.clone(), partitions, options, Some(staged_rows), None)?;
    for (place, run) in &mut units {
        run.batch_rows = if stager.gathers(place.partition) {
            place.pieces = run.rows.div_ceil(piece_rows);
            piece_rows
        } else {
            run.rows
        };
    }
    if let Some(times) = &options.staging_times {
        times.add(StagingStep::Setup, setup.elapsed());
    }
    stage_parallel(&mut stager, units, |run: Run| {
        let path = &files[run.file];
        let known = known_extremes(&schema, &metadata[run.file], &run.row_groups);
        let reader = ParquetRecordBatchReaderBuilder::new_with_metadata(open(path)?, metadata[run.file].clone())
            .with_row_groups(run.row_groups)
            .with_batch_size(run.batch_rows)
            .build()
            .map_err(|e| in_file(path, e))?;
        let batch_options = |b: &RecordBatch| RecordBatchOptions::new().with_row_count(Some(b.num_rows()));
        let schema = schema.clone();
        let pieces = reader.map(move |b| {
            let b = b.map_err(|e| in_file(path, e))?;
            // The table's schema, with its metadata, on every batch.
            RecordBatch::try_new_with_options(schema.clone(), b.columns().to_vec(), &batch_options(&b))
                .map(|b| vec![b])
                .map_err(|e| in_file(path, e))
        });
        Ok((pieces, Some(known)))
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
            batch_rows: 0,
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

/// The extremes of the columns of `row_groups` that their statistics give exactly: those the
/// writer marked exact (not truncated) in every row group that has a value, of types whose order
/// in Parquet is arrow's (integers that fit in 32 signed bits or are signed, decimals, dates,
/// times, timestamps, booleans, strings and binaries; not floats, whose NaNs and zeros Parquet
/// orders its own way).
fn known_extremes(schema: &Schema, metadata: &ArrowReaderMetadata, row_groups: &[usize]) -> KnownExtremes {
    let file = metadata.metadata();
    let groups = || row_groups.iter().map(|&i| file.row_group(i));
    let rows: Vec<u64> = groups().map(|g| g.num_rows().max(0) as u64).collect();
    let column = |field: &Field| -> Option<(ArrayRef, ArrayRef)> {
        if !ordered_as_in_arrow(field.data_type()) {
            return None;
        }
        let stats =
            StatisticsConverter::try_new(field.name(), metadata.schema(), file.file_metadata().schema_descr()).ok()?;
        let (least, greatest) = (
            stats.row_group_mins(groups()).ok()?,
            stats.row_group_maxes(groups()).ok()?,
        );
        let exact = stats
            .row_group_is_min_value_exact(groups())
            .ok()?
            .values()
            .count_set_bits()
            + stats
                .row_group_is_max_value_exact(groups())
                .ok()?
                .values()
                .count_set_bits();
        let nulls = stats.row_group_null_counts(groups()).ok()?;
        // A row group without extremes must be all nulls (not without statistics).
        let complete = (0..rows.len()).all(|g| {
            let all_null = nulls.is_valid(g) && nulls.value(g) == rows[g];
            all_null || (least.is_valid(g) && greatest.is_valid(g))
        });
        (complete
            && exact == 2 * rows.len()
            && least.data_type() == field.data_type()
            && greatest.data_type() == field.data_type())
        .then_some((least, greatest))
    };
    schema.fields().iter().map(|f| column(f)).collect()
}

/// Whether Parquet orders values of `dt` (as DataFusion reads them) as arrow does.
fn ordered_as_in_arrow(dt: &DataType) -> bool {
    use DataType::*;
    matches!(
        dt,
        Boolean
            | Int8
            | Int16
            | Int32
            | Int64
            | UInt8
            | UInt16
            | Decimal128(..)
            | Date32
            | Time32(_)
            | Time64(_)
            | Timestamp(..)
            | Utf8
            | LargeUtf8
            | Utf8View
            | Binary
            | LargeBinary
            | BinaryView
    )
}

fn open(path: &Path) -> DfResult<File> {
    File::open(path).map_err(|e| in_file(path, e))
}

/// An error reading `path`, naming it.
fn in_file(path: &Path, e: impl std::fmt::Display) -> DataFusionError {
    DataFusionError::Execution(format!("{}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use ::datafusion::parquet::arrow::ArrowWriter;
    use ::datafusion::parquet::file::properties::{EnabledStatistics, WriterProperties};
    use arrow_array::cast::AsArray;
    use arrow_array::types::Int64Type;
    use arrow_array::{Float64Array, Int64Array, StringViewArray};

    use super::*;

    /// 300 rows in row groups of 100: integers with nulls, strings long and short, floats.
    fn write(path: &Path, statistics: EnabledStatistics) -> RecordBatch {
        let ints = Int64Array::from_iter((0..300i64).map(|i| (i % 7 != 0).then_some((i * 37) % 101 - 50)));
        let strings = StringViewArray::from_iter_values((0..300).map(|i| format!("{}{}", "s".repeat(i % 20), i)));
        let floats = Float64Array::from_iter_values((0..300).map(|i| i as f64 - 0.5));
        let batch = RecordBatch::try_from_iter([
            ("i", Arc::new(ints) as ArrayRef),
            ("s", Arc::new(strings) as ArrayRef),
            ("f", Arc::new(floats) as ArrayRef),
        ])
        .unwrap();
        let props = WriterProperties::builder()
            .set_max_row_group_row_count(Some(100))
            .set_statistics_enabled(statistics)
            .build();
        let mut w = ArrowWriter::try_new(File::create(path).unwrap(), batch.schema(), Some(props)).unwrap();
        w.write(&batch).unwrap();
        w.close().unwrap();
        batch
    }

    /// Runs decoded in pieces (where the device gathers them; whole on the CPU device) stage
    /// every value in file order, with the statistics of the same rows staged from host batches.
    #[test]
    fn runs_decoded_in_pieces_keep_values_and_statistics() {
        use arrow_array::types::Int32Type;
        use arrow_array::{Decimal128Array, ListArray, StructArray, TimestampMicrosecondArray};
        let dir = std::env::temp_dir().join(format!("arrow-cuda-pieces-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let rows = 2500;
        let strings = StringViewArray::from_iter(
            (0..rows).map(|i| (i % 11 != 3).then(|| format!("{}{}", "long value ".repeat(i % 5), i))),
        );
        let list = ListArray::from_iter_primitive::<Int32Type, _, _>(
            (0..rows as i32).map(|i| (i % 9 != 0).then(|| (0..i % 4).map(Some).collect::<Vec<_>>())),
        );
        let st = StructArray::from(vec![
            (
                Arc::new(Field::new("n", DataType::Int64, true)),
                Arc::new(Int64Array::from_iter(
                    (0..rows as i64).map(|i| (i % 6 != 0).then_some(-i)),
                )) as ArrayRef,
            ),
            (
                Arc::new(Field::new("s", DataType::Utf8View, true)),
                Arc::new(strings.clone()) as ArrayRef,
            ),
        ]);
        let batch = RecordBatch::try_from_iter([
            (
                "i",
                Arc::new(Int64Array::from_iter(
                    (0..rows as i64).map(|i| (i % 7 != 0).then_some(i * 31 % 977)),
                )) as ArrayRef,
            ),
            ("s", Arc::new(strings) as ArrayRef),
            (
                "f",
                Arc::new(Float64Array::from_iter_values((0..rows).map(|i| i as f64 / 3.0))),
            ),
            (
                "d",
                Arc::new(
                    Decimal128Array::from_iter((0..rows as i128).map(|i| (i % 5 != 0).then_some(i * 1_000_003 - 7)))
                        .with_precision_and_scale(20, 2)
                        .unwrap(),
                ),
            ),
            (
                "t",
                Arc::new(TimestampMicrosecondArray::from_iter_values(
                    (0..rows as i64).map(|i| i * 86_400_000_001),
                )),
            ),
            ("l", Arc::new(list)),
            ("st", Arc::new(st)),
        ])
        .unwrap();
        let path = dir.join("pieces.parquet");
        let props = WriterProperties::builder()
            .set_max_row_group_row_count(Some(1000))
            .build();
        let mut w = ArrowWriter::try_new(File::create(&path).unwrap(), batch.schema(), Some(props)).unwrap();
        w.write(&batch).unwrap();
        w.close().unwrap();
        let schema = batch.schema();
        let devices = [Some(crate::device::Device::Cpu), crate::device::cuda_for_tests()];
        for device in devices.into_iter().flatten() {
            // Runs of one 1,000-row group (500 on the last), decoded in pieces of 300 rows.
            let options = LoadOptions::new().with_device(device).with_batch_rows(1000);
            let table = stage_in_pieces(std::slice::from_ref(&path), schema.clone(), &options, None, 300).unwrap();
            assert_eq!(table.partitions().iter().flatten().count(), 3, "{device}");
            let back: Vec<RecordBatch> = table
                .partitions()
                .iter()
                .flatten()
                .map(|b| b.to_record_batch().unwrap())
                .collect();
            let back = arrow_select::concat::concat_batches(&schema, &back).unwrap();
            assert_eq!(back, batch, "{device}");
            let host = GpuTable::try_new(
                schema.clone(),
                vec![vec![batch.clone()]],
                &LoadOptions::new().with_device(device),
            )
            .unwrap();
            let (ours, theirs) = (table.statistics_ref(), host.statistics_ref());
            assert_eq!(ours.num_rows, theirs.num_rows, "{device}");
            assert_eq!(ours.column_statistics, theirs.column_statistics, "{device}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    fn metadata(path: &Path, schema: &SchemaRef) -> ArrowReaderMetadata {
        let options = ArrowReaderOptions::new().with_schema(schema.clone());
        ArrowReaderMetadata::load(&File::open(path).unwrap(), options).unwrap()
    }

    /// Row-group statistics give the extremes of integer and string columns as arrow finds them,
    /// not of float columns; a file without statistics gives none.
    #[test]
    fn row_group_statistics_give_exact_extremes() {
        let dir = std::env::temp_dir().join(format!("arrow-cuda-extremes-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (with, without) = (dir.join("with.parquet"), dir.join("without.parquet"));
        let batch = write(&with, EnabledStatistics::Chunk);
        write(&without, EnabledStatistics::None);
        let schema = batch.schema();

        let known = known_extremes(&schema, &metadata(&with, &schema), &[0, 1, 2]);
        let (least, greatest) = known[0].as_ref().expect("integers");
        let ints = batch.column(0).as_primitive::<Int64Type>();
        assert_eq!(
            arrow_arith::aggregate::min(least.as_primitive::<Int64Type>()),
            arrow_arith::aggregate::min(ints)
        );
        assert_eq!(
            arrow_arith::aggregate::max(greatest.as_primitive::<Int64Type>()),
            arrow_arith::aggregate::max(ints)
        );
        let (least, greatest) = known[1].as_ref().expect("strings");
        let strings = batch.column(1).as_string_view();
        assert_eq!(
            arrow_arith::aggregate::min_string_view(least.as_string_view()),
            arrow_arith::aggregate::min_string_view(strings)
        );
        assert_eq!(
            arrow_arith::aggregate::max_string_view(greatest.as_string_view()),
            arrow_arith::aggregate::max_string_view(strings)
        );
        assert!(known[2].is_none(), "floats");
        // The first row group alone: its own extremes.
        let first = known_extremes(&schema, &metadata(&with, &schema), &[0]);
        let (least, _) = first[0].as_ref().expect("integers");
        assert_eq!(
            arrow_arith::aggregate::min(least.as_primitive::<Int64Type>()),
            arrow_arith::aggregate::min(&ints.slice(0, 100))
        );

        let none = known_extremes(&schema, &metadata(&without, &schema), &[0, 1, 2]);
        assert!(none.iter().all(Option::is_none));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
