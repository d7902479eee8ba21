//! The workloads that `arrow-cuda bench`, the criterion benches and the DataFusion tests share:
//! the 100-column batch, the buffer walker, one clock for two processes, and the TPC-H queries.
//! The benches and tests include this file with `#[path]`; each uses only part of it.
#![allow(dead_code)]

use std::sync::Arc;

use arrow_array::{ArrayRef, Float64Array, Int64Array, RecordBatch, StringArray};
use arrow_data::ArrayData;

/// 100 columns x 1,000 rows with nulls and strings: about 300 small buffers, 1.3 MB.
pub fn small_batch() -> RecordBatch {
    let rows = 1000;
    let columns = (0..100).map(|c| {
        let array: ArrayRef = match c % 3 {
            0 => Arc::new(Int64Array::from_iter(
                (0..rows).map(|i| (i % 7 != 0).then_some(i as i64 * c)),
            )),
            1 => Arc::new(Float64Array::from_iter(
                (0..rows).map(|i| (i % 5 != 0).then_some(i as f64 / 3.0)),
            )),
            _ => Arc::new(StringArray::from_iter(
                (0..rows).map(|i| (i % 11 != 0).then(|| format!("value {i} of column {c}"))),
            )),
        };
        (format!("c{c}"), array)
    });
    RecordBatch::try_from_iter(columns).expect("valid batch")
}

/// Every Arrow buffer of `batch`, validity bitmaps and children included.
pub fn buffers(batch: &RecordBatch) -> Vec<arrow_buffer::Buffer> {
    fn walk(d: &ArrayData, out: &mut Vec<arrow_buffer::Buffer>) {
        out.extend(d.nulls().map(|n| n.buffer().clone()));
        out.extend(d.buffers().iter().cloned());
        d.child_data().iter().for_each(|c| walk(c, out));
    }
    let mut out = vec![];
    batch.columns().iter().for_each(|c| walk(&c.to_data(), &mut out));
    out
}

/// `CLOCK_MONOTONIC` in nanoseconds: one clock for every process of the machine.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid out-parameter; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// TPC-H Q1.
pub const Q1: &str = "select l_returnflag, l_linestatus, sum(l_quantity) as sum_qty, \
    sum(l_extendedprice) as sum_base_price, sum(l_extendedprice * (1 - l_discount)) as sum_disc_price, \
    sum(l_extendedprice * (1 - l_discount) * (1 + l_tax)) as sum_charge, avg(l_quantity) as avg_qty, \
    avg(l_extendedprice) as avg_price, avg(l_discount) as avg_disc, count(*) as count_order \
    from lineitem where l_shipdate <= date '1998-12-01' - interval '90' day \
    group by l_returnflag, l_linestatus order by l_returnflag, l_linestatus";

/// TPC-H Q6.
pub const Q6: &str = "select sum(l_extendedprice * l_discount) as revenue from lineitem \
    where l_shipdate >= date '1994-01-01' and l_shipdate < date '1994-01-01' + interval '1' year \
    and l_discount between 0.06 - 0.01 and 0.06 + 0.01 and l_quantity < 24";

/// TPC-H Q12.
pub const Q12: &str = "select l_shipmode, \
    sum(case when o_orderpriority = '1-URGENT' or o_orderpriority = '2-HIGH' then 1 else 0 end) as high_line_count, \
    sum(case when o_orderpriority <> '1-URGENT' and o_orderpriority <> '2-HIGH' then 1 else 0 end) as low_line_count \
    from orders, lineitem where o_orderkey = l_orderkey and l_shipmode in ('MAIL', 'SHIP') \
    and l_commitdate < l_receiptdate and l_shipdate < l_commitdate \
    and l_receiptdate >= date '1994-01-01' and l_receiptdate < date '1994-01-01' + interval '1' year \
    group by l_shipmode order by l_shipmode";

/// TPC-H Q14.
pub const Q14: &str = "select 100.00 * sum(case when p_type like 'PROMO%' then l_extendedprice * (1 - l_discount) else 0 end) \
    / sum(l_extendedprice * (1 - l_discount)) as promo_revenue from lineitem, part \
    where l_partkey = p_partkey and l_shipdate >= date '1995-09-01' \
    and l_shipdate < date '1995-09-01' + interval '1' month";

/// Q1, Q6, Q12 and Q14 by name.
pub const QUERIES: [(&str, &str); 4] = [("q1", Q1), ("q6", Q6), ("q12", Q12), ("q14", Q14)];
