//! GPU-resident tables for DataFusion 55: columns live in device memory, and the scan does the
//! projection, the pushed-down filters and the limit on the device, so only the selected rows of
//! the projected columns travel to the host.
//!
//! [`GpuTable`] is a [`TableProvider`](::datafusion::catalog::TableProvider) whose partitions are lists of
//! [`DeviceRecordBatch`](crate::array::DeviceRecordBatch)es, on the first GPU by default (the CPU device when there is none), or
//! spread round-robin over the devices [`LoadOptions::with_devices`] names. Its scan is a [`GpuScan`], a
//! [`DataSource`](::datafusion::datasource::source::DataSource) under `DataSourceExec`, the way
//! `MemTable` uses `MemorySourceConfig`.
//!
//! # Staging
//!
//! A table is staged by a pipeline: its host batches are made and prepared on every core (Parquet
//! runs of row groups decoded straight into one batch each, by [`GpuTable::from_parquet`], their
//! columns' extremes taken from the row-group statistics where those are exact; string views
//! compacted; statistics computed while the batch is at hand), and each is copied to its device as
//! soon as it is ready, while the next ones are prepared. Small host batches
//! ([`GpuTable::try_new`]) are gathered into device batches of about
//! [`LoadOptions::with_batch_rows`] rows on the GPU, each concatenated there once its last piece
//! is copied, where no column is a dictionary, union, list view or run-end encoded (on the host
//! before the copy otherwise). A
//! few prepared batches wait at most: host memory never holds the whole table. Partitions are
//! the input's (runs of consecutive row groups for Parquet, one per core) unless
//! [`LoadOptions::with_partitions`] sets them. [`LoadOptions::with_progress`] reports the bytes
//! decoded and the bytes on the device; [`LoadOptions::with_staging_times`] counts the time of
//! each step ([`StagingTimes`]).
//!
//! # Tables from SQL
//!
//! [`with_gpu_tables`] installs [`GpuTableFactory`] in a `SessionStateBuilder` (as
//! [`with_device_stages`] installs the device stages), after which SQL stages tables:
//!
//! ```sql
//! CREATE EXTERNAL TABLE lineitem STORED AS GPU LOCATION 'tpch/lineitem/';
//! CREATE EXTERNAL TABLE t STORED AS GPU LOCATION 'data/t.csv' OPTIONS ('has_header' 'true');
//! ```
//!
//! The location is a Parquet file or directory (CSV where it ends in `.csv`, or with `OPTIONS
//! ('format' 'csv')`); other options are DataFusion's own for the format. `arrow-cuda query`
//! takes such statements among its queries. [`files_statement`] gives the `STORED AS PARQUET` or
//! `STORED AS CSV` statement of the same files, for a host session that should read the same table.
//!
//! # Filters
//!
//! [`GpuTable::supports_filters_pushdown`](::datafusion::catalog::TableProvider::supports_filters_pushdown) answers
//! `Exact` only for predicates the device evaluates completely, and `Unsupported` for everything
//! else (DataFusion keeps those in a `FilterExec`):
//!
//! - comparisons (`= != < <= > >=`) of a column with a literal, `BETWEEN`, `IN` lists and
//!   `IS [NOT] NULL`, over integers, floats (compared as DataFusion compares them: arrow-rs's
//!   total order, so `NaN` equals itself and sorts last, after `-0.0` becomes `+0.0`; `IN` lists
//!   of floats stay with DataFusion, whose `IN` keeps the two zeros apart), `Decimal128`, dates,
//!   timestamps and booleans, and a bare boolean column;
//! - `=`, `!=`, `IN` lists and prefix matches (`LIKE 'abc%'`, `starts_with`) on `Utf8`,
//!   `LargeUtf8` and `Utf8View` columns;
//! - `AND`, `OR` and `NOT` of those.
//!
//! A literal of another type than its column is accepted only when it converts to the column's
//! type and back without change. Null semantics are SQL's: a row is kept only where the predicate
//! is true.
//!
//! On a CUDA device the predicate becomes a CUDA C kernel (generated from the expression tree,
//! compiled once per context with NVRTC and cached), followed by a count, a prefix sum and a
//! compaction of the projected columns on the device (see `device_filter.rs`). On the CPU device (and on
//! host-accessible memory) the same predicate is evaluated with arrow-rs compute kernels on a host
//! copy of the columns it needs.
//!
//! # What reaches DataFusion
//!
//! Only host [`RecordBatch`](arrow_array::RecordBatch)es, made by an explicit device-to-host copy
//! ([`crate::transfer::dtoh`]): DataFusion's metrics read every batch through `to_data()`, so no
//! device memory may ever be wrapped in an arrow buffer that flows through a plan.
//!
//! # Concurrency
//!
//! Each device has a small pool of streams (four by default) guarded by a semaphore: partitions on
//! one device share it whatever DataFusion's `target_partitions` is, and partitions on different
//! devices run concurrently.
//!
//! # Device stages
//!
//! A device stage is the part of a query plan over a GPU table that runs where the table lives.
//!
//! [`DeviceStageRule`] is a DataFusion physical optimizer rule. Installed with
//! [`with_device_stages`], it finds each aggregation whose input is a [`GpuScan`] through
//! projections, filters, repartitioning and hash joins (the scan on their probe side), and replaces
//! it with one [`DeviceStageExec`]. The stage evaluates the scan's pushed-down predicate, the
//! filters, the joins, the computed projections, the group keys and the aggregates on the device
//! in one or two passes over
//! the columns (see `stage/codegen.rs`), keeps its groups and accumulators in device memory, and
//! copies only the groups' partial state to the host: a batch with exactly the schema of
//! DataFusion's partial aggregate, written in Arrow's layout on the device (`stage/emit.rs`) and
//! copied in one transfer. Many groups are split into partitions on several threads. Where the stage covers the whole aggregation (a `Final`
//! aggregate over the partial one, with only repartitioning or coalescing between them, or a
//! `Single` or `SinglePartitioned` aggregate) it replaces all of it and emits the final rows, DataFusion's own groups
//! accumulators merging the state, partitioned by the hash of the group keys as the `Final`
//! aggregate was; otherwise it replaces the partial aggregate and DataFusion's `Final` aggregate
//! above merges the state as it would merge its own.
//!
//! ## Where the rule sits
//!
//! The rule is appended after DataFusion's own physical optimizer rules. Only then is the plan's
//! shape final: `EnforceDistribution` has split aggregates into `Partial` and `Final` with the
//! repartitioning between them, projections and filters have been pushed down as far as they go,
//! and repartitioning has been placed. A stage keeps the partitioning and the schema of what it
//! replaces (it runs once, and each partition emits its share of the rows), so the plan above it
//! stays valid: a join that needs its input hash-partitioned by the group keys still gets it.
//!
//! ## What a stage runs
//!
//! - expressions: see `stage/expr.rs` (arithmetic on integers, floats and `Decimal128` with DataFusion's
//!   types, precision and overflow errors; comparisons; three-valued `AND`/`OR`/`NOT`; `IS [NOT]
//!   NULL`; `CASE WHEN`; `CAST` between integer, float and decimal types; negation; `IN` lists; `LIKE` with `%`
//!   and `_`; `date_part` of year and month; `substr` of strings with DataFusion's character
//!   semantics, `COALESCE` and `NULLIF`);
//! - group keys of integers, dates, booleans, decimals and strings of up to 255 bytes, computed
//!   ones among them (`substr`, `CASE` yielding literals or string columns: TPC-H Q22 groups by
//!   `substring(c_phone, 1, 2)`). Each string key takes the words its longest value needs: its
//!   columns' longest values, measured while staging, its literals, and for `substr` at most the
//!   characters it keeps, 4 bytes each; a longer string found while running makes the stage give
//!   its work back. Dictionary columns of those group by their values (so batches with different
//!   dictionaries agree);
//! - `COUNT`, `SUM` and `AVG` of integers, decimals (exact, 128-bit) and floats, `MIN` and `MAX`
//!   of integers, dates, decimals and floats, and of string columns (`Utf8`, `LargeUtf8`,
//!   `Utf8View`; compared byte by byte, as arrow compares them), each with an optional
//!   `FILTER (WHERE ...)`. The minimum or maximum of a string column or of a decimal wider than 18
//!   digits is kept as a reference to the row that holds it (a compare-and-swap loop on the
//!   device), and only the winning values are gathered and copied when the stage finishes. Float minima and maxima follow IEEE 754's total order, as arrow's `min`
//!   and `max` kernels do (NaN above every number, -0 below +0); DataFusion's grouped accumulator
//!   resolves NaN and the two zeros by arrival order, so only those cases can differ.
//!
//! ## Joins
//!
//! A hash join whose probe side (DataFusion's right input) leads to the stage's scan becomes a
//! step of the stage; its build side stays a DataFusion plan (the stage node's child, shown under
//! it in `EXPLAIN`), which the stage runs to completion before its own pass and whose rows it
//! copies to the device. A build side that is a scan of a GPU table on the stage's device (with
//! its pushed-down filters and projection) never leaves it: its batches are filtered, compacted
//! and concatenated there (`device_concat.rs`), and its plan does not run (its scan shows no
//! metrics in `EXPLAIN ANALYZE`). The build rows are hashed on the device by their key words (an
//! open-addressing table, each row in a slot of its own, twice as many slots as rows); every
//! table row that reaches the join finds its first match (the first for which the join filter
//! holds, where there is one) in the same thread that then evaluates the rest of the stage,
//! reading the match's columns where the build side lives. Inner joins keep the rows with a
//! match, right outer joins every row (the build columns null without a match), right semi and
//! anti joins (`IN`, `EXISTS`, `NOT EXISTS`) the rows with or without one. A left semi or anti
//! join whose left input leads to the stage's scan (DataFusion builds on the smaller side, here
//! the stage's table) is a step too when its right input is a GPU scan on the stage's device, or
//! a projection or filter over one that a rows stage runs there (see below; its kept rows stay on
//! the device): the stage hashes that side instead, and the table's rows probe it; so is an inner
//! join built on its larger side, when the smaller is such a scan. A semi or anti join's filter
//! is tried on every build row with the probe's keys. Where the stage reads a match's
//! columns, the match must be the only one: a build side with duplicate keys there makes the
//! stage give its work back, and the rule does not place such a join where statistics say the
//! build side has more rows than the table (it cannot then be the unique side of the key). Keys
//! are integers, dates, decimals and strings (their bytes in key words sized from both sides'
//! longest strings; a longer key gives the work back), one or several columns; nulls never
//! match. `NOT IN` (DataFusion's null-aware anti join, one key) keeps SQL's null rule: the build
//! kernel flags a null key, and then no row is kept; a row whose key is null is kept only when
//! the build side is empty. A build side of more than 2^20 rows (or of rows statistics do
//! not bound) whose strings the stage reads stays with DataFusion unless it is such a device
//! scan: copying its strings to the host and back costs more than the join saves.
//!
//! An inner join whose build side is itself an inner join of sides that stay on the stage's
//! device (GPU scans, rows stages, or such joins again) is flattened: `L ⋈ (A ⋈ B)`, with the
//! keys on B's columns, runs as `(L ⋈ B) ⋈ A`, two steps of the stage, and neither A nor B
//! crosses to the host (TPC-H Q3, Q10 and Q18: lineitem joins orders, then customer, on the
//! device). Inner joins make this exact; where B repeats a key that A would have filtered out,
//! the stage gives its work back.
//!
//! A join that keeps its build side's rows without a match (left outer with the build side on
//! the left, full outer) or marks rows by whether they have one (mark joins: `EXISTS` inside
//! `OR`) runs as two stages whose rows together are the join's, unioned below DataFusion's final
//! aggregate (or as rows): the matched rows (an inner, right outer or semi join, a stage over
//! the probe side) and the build rows without a match (an anti join, a stage over the build side
//! that hashes the probe side; the other side's columns null, or the mark `false`). TPC-H Q13
//! (customers left-joined with their orders) runs so.
//!
//! A `HAVING` filter over a stage's final rows is part of the stage (`having=` in `EXPLAIN`):
//! where one device holds every group and the filter reads only group keys and aggregates whose
//! state is their value (`SUM`, `COUNT`, `MIN`, `MAX`), the device evaluates it over that state
//! (the scan's predicate kernels) and only the groups it keeps are written out and cross to the
//! host (TPC-H Q18's subquery keeps about 600 of its 15 million groups at SF 10).
//!
//! A sort with a limit (`ORDER BY ... LIMIT k`, DataFusion's `TopK`) over a stage's final rows,
//! through projections of columns, whose first sort key is such a column of an integer, date or
//! decimal type, cuts the stage's groups (`top=` in `EXPLAIN`): on the device, after the
//! `HAVING`, radix selection finds the first key's value at rank `k` of the order, and only the
//! groups whose key reaches it (nulls too where they sort first) are written out: `k` rows and
//! their ties, not every group (TPC-H Q3, Q10 and Q18). The sort stays with DataFusion and orders
//! those candidates, so the answer and its tie-breaking by later keys are DataFusion's.
//!
//! ## Rows stages
//!
//! A projection, a filter or a hash join over a [`GpuScan`] (through other projections, filters,
//! joins and repartitioning) with no aggregate above it that a stage runs becomes a rows stage
//! when it does something the scan alone does not: a computed column, a filter the scan cannot
//! take (two columns compared, an expression), or a join whose build side stays on the device
//! (TPC-H Q20: partsupp semi-joined with the parts named `forest%`). The stage runs the row pipeline on the device, once to select
//! the rows it keeps and once, for those rows only, to compute its output columns: fixed-width
//! types (integers, floats, decimals, dates, booleans; values and validity bitmaps written by warp
//! votes) and strings (`Utf8`, `LargeUtf8`, `Utf8View`: `substr`, `CASE`, `COALESCE`, a build
//! side's string column). A computed string is written as the address and length of its bytes,
//! which always lie in a column or the literal buffer (the expressions never make new bytes);
//! the scan's prefix-sum kernels turn the lengths into offsets and copy the bytes into the new
//! column. Output columns that are table columns as they are (strings among them) are gathered
//! by the scan's compaction kernels. Only the kept rows' output columns cross to the host, one
//! batch per table batch with kept rows, split among the partitions of the node it replaced (by
//! the hash of columns where that node's output was hash-partitioned). A rows stage that is a join's
//! build side for a stage on the same device keeps its rows there (TPC-H Q4 and Q21: lineitem
//! filtered by `l_commitdate < l_receiptdate`, hashed for the stage's semi and anti joins).
//!
//! Uncorrelated scalar subqueries (`x > (select avg(y) from t)`) in a stage's expressions are
//! literals whose values the stage reads when it runs, after DataFusion's `ScalarSubqueryExec`
//! has computed them.
//!
//! Anything else stays with DataFusion, unchanged. Without NVRTC or a GPU the rule leaves every
//! plan alone and logs one line saying why.
//!
//! ## The CPU device
//!
//! A stage over a table on the CPU device runs its host implementation (`stage/host.rs`, DataFusion's
//! own expression evaluation and the same group and accumulator layout as the kernels). The rule
//! places such stages only when asked ([`DeviceStageRule::with_host_stages`]): the tests do, so
//! that CI proves the plan rewrite, the partial state and DataFusion's merge of it without a GPU.

#[cfg(test)]
mod cuda_as_cpp;
mod device_concat;
mod device_extremes;
mod device_filter;
mod error;
mod files;
mod lanes;
mod nvrtc;
mod options;
mod parquet;
mod predicate;
mod predicate_codegen;
mod source;
mod stage;
mod staging;
mod stats;
mod table;

pub use crate::transfer::times::{StagingStep, StagingTimes};
pub use files::{GPU_FILE_TYPE, GpuTableFactory, GpuTableSource, files_statement, with_gpu_tables};
pub use nvrtc::gpu_kernels_available;
pub use options::{DEFAULT_BATCH_ROWS, LoadOptions, Progress, ProgressFn, default_device};
pub use predicate::supports_filter;
pub use source::GpuScan;
pub use stage::{DeviceStageExec, DeviceStageRule, with_device_stages};
pub use table::GpuTable;
