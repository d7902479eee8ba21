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
    Some(match name.to_ascii_lowercase().as_str() {
        "q1" => {
            "select l_returnflag, l_linestatus, sum(l_quantity) as sum_qty, sum(l_extendedprice) as sum_base_price, \
             sum(l_extendedprice * (1 - l_discount)) as sum_disc_price, \
             sum(l_extendedprice * (1 - l_discount) * (1 + l_tax)) as sum_charge, avg(l_quantity) as avg_qty, \
             avg(l_extendedprice) as avg_price, avg(l_discount) as avg_disc, count(*) as count_order \
             from lineitem where l_shipdate <= date '1998-12-01' - interval '90' day \
             group by l_returnflag, l_linestatus order by l_returnflag, l_linestatus"
        }
        "q6" => {
            "select sum(l_extendedprice * l_discount) as revenue from lineitem \
             where l_shipdate >= date '1994-01-01' and l_shipdate < date '1995-01-01' \
             and l_discount between 0.05 and 0.07 and l_quantity < 24"
        }
        "q12" => {
            "select l_shipmode, \
             sum(case when o_orderpriority = '1-URGENT' or o_orderpriority = '2-HIGH' then 1 else 0 end) as high_line_count, \
             sum(case when o_orderpriority <> '1-URGENT' and o_orderpriority <> '2-HIGH' then 1 else 0 end) as low_line_count \
             from orders, lineitem where o_orderkey = l_orderkey and l_shipmode in ('MAIL', 'SHIP') \
             and l_commitdate < l_receiptdate and l_shipdate < l_commitdate \
             and l_receiptdate >= date '1994-01-01' and l_receiptdate < date '1995-01-01' \
             group by l_shipmode order by l_shipmode"
        }
        "q14" => {
            "select 100.00 * sum(case when p_type like 'PROMO%' then l_extendedprice * (1 - l_discount) else 0 end) \
             / sum(l_extendedprice * (1 - l_discount)) as promo_revenue from lineitem, part \
             where l_partkey = p_partkey and l_shipdate >= date '1995-09-01' and l_shipdate < date '1995-10-01'"
        }
        _ => return None,
    })
}
