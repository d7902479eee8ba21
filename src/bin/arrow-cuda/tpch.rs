//! TPC-H data generated in process, and the queries the tool knows by name.

use arrow_array::RecordBatch;
use arrow_schema::ArrowError;

/// A named table's batches, by partition.
pub type Table = (String, Vec<Vec<RecordBatch>>);

/// lineitem, orders and part at scale factor `sf`, each in `parts` partitions.
pub fn generate(sf: f64, parts: usize) -> Result<Vec<Table>, ArrowError> {
    Ok(vec![
        ("lineitem".into(), lineitem(sf, parts)?),
        ("orders".into(), orders(sf, parts)?),
        ("part".into(), part(sf, parts)?),
    ])
}

/// lineitem at scale factor `sf`, in `parts` partitions (the table TPC-H Q1 and Q6 read).
pub(crate) fn lineitem(sf: f64, parts: usize) -> Result<Vec<Vec<RecordBatch>>, ArrowError> {
    partitions(parts, |p, n| {
        tpchgen_arrow::LineItemArrow::new(tpchgen::generators::LineItemGenerator::new(sf, p, n))
            .with_batch_size(BATCH_ROWS)
    })
}

/// orders at scale factor `sf`, in `parts` partitions.
fn orders(sf: f64, parts: usize) -> Result<Vec<Vec<RecordBatch>>, ArrowError> {
    partitions(parts, |p, n| {
        tpchgen_arrow::OrderArrow::new(tpchgen::generators::OrderGenerator::new(sf, p, n)).with_batch_size(BATCH_ROWS)
    })
}

/// part at scale factor `sf`, in `parts` partitions.
fn part(sf: f64, parts: usize) -> Result<Vec<Vec<RecordBatch>>, ArrowError> {
    partitions(parts, |p, n| {
        tpchgen_arrow::PartArrow::new(tpchgen::generators::PartGenerator::new(sf, p, n)).with_batch_size(BATCH_ROWS)
    })
}

/// Rows per generated batch.
const BATCH_ROWS: usize = 1 << 17;

/// The batches of `parts` partitions (at least one), partition `p` of `n` from `make(p, n)`.
fn partitions<I>(parts: usize, make: impl Fn(i32, i32) -> I) -> Result<Vec<Vec<RecordBatch>>, ArrowError>
where
    I: Iterator<Item = Result<RecordBatch, ArrowError>>,
{
    let n = parts.max(1) as i32;
    (1..=n).map(|p| make(p, n).collect()).collect()
}

/// The SQL of a TPC-H query the tool knows by name.
pub fn query(name: &str) -> Option<&'static str> {
    let name = name.to_ascii_lowercase();
    crate::workloads::QUERIES
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, sql)| *sql)
}
