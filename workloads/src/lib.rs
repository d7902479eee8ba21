//! The workloads that arrow-cuda's command-line tool (`arrow-cuda bench`, `arrow-cuda query`), its
//! criterion benches and its tests share, so that each is defined once: the 100-column batch, batches
//! of `Int64` columns, the buffer walker, one clock for two processes, and TPC-H (the 22 queries and
//! the 8 tables, generated in process).
//!
//! The crate does not depend on arrow-cuda: the library's own benches and tests use it.

pub mod tpch;

use std::sync::Arc;

use arrow_array::{ArrayRef, Float64Array, Int64Array, RecordBatch, StringArray};
use arrow_buffer::Buffer;
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

/// `columns` `Int64` columns (`c0`, `c1`, ...) of `rows` rows without nulls: `8 * columns * rows`
/// bytes in one buffer per column.
pub fn int64_batch(columns: usize, rows: usize) -> RecordBatch {
    let columns = (0..columns as i64).map(|c| {
        (
            format!("c{c}"),
            Arc::new(Int64Array::from_iter_values((0..rows as i64).map(|i| i ^ c))) as ArrayRef,
        )
    });
    RecordBatch::try_from_iter(columns).expect("valid batch")
}

/// Every Arrow buffer of `batch`, validity bitmaps and children included.
pub fn buffers(batch: &RecordBatch) -> Vec<Buffer> {
    fn walk(d: &ArrayData, out: &mut Vec<Buffer>) {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_have_their_shapes() {
        let small = small_batch();
        assert_eq!((small.num_columns(), small.num_rows()), (100, 1000));
        // Int64 and Float64 columns: validity and values; strings: validity, offsets and values.
        assert_eq!(buffers(&small).len(), 34 * 2 + 33 * 2 + 33 * 3);
        let ints = int64_batch(3, 10);
        assert_eq!((ints.num_columns(), ints.num_rows()), (3, 10));
        assert_eq!(buffers(&ints).iter().map(|b| b.len()).sum::<usize>(), 3 * 10 * 8);
    }

    #[test]
    fn the_clock_moves_forward() {
        let a = monotonic_ns();
        assert!(monotonic_ns() >= a);
    }
}
