//! Exact statistics, computed on the host batches while they are staged.

use ::datafusion::common::stats::Precision;
use ::datafusion::common::{ColumnStatistics, ScalarValue, Statistics};
use ::datafusion::functions_aggregate::min_max::{MaxAccumulator, MinAccumulator};
use ::datafusion::logical_expr::Accumulator;
use std::sync::Arc;

use arrow_array::{Array, ArrayRef, RecordBatch};
use arrow_schema::{DataType, Schema};

use super::device_extremes;

/// Running statistics of one column. Minimum and maximum use DataFusion's own `MIN` / `MAX`
/// accumulators, so the statistics agree with what those aggregates compute; a type they do
/// not handle, and a nested type (list, struct, map), gets no minimum or maximum.
#[derive(Clone)]
struct ColumnStats {
    nulls: usize,
    non_null: usize,
    min: Option<MinAccumulator>,
    max: Option<MaxAccumulator>,
    /// The longest value of a string column, in bytes (`None` for other types).
    max_bytes: Option<usize>,
    /// The host memory of the column's arrays (`get_array_memory_size`), as `MemTable` counts it.
    bytes: usize,
    /// Whether the extremes of some of its rows were left to the device they were staged on
    /// (see [`StatsBuilder::take_extremes`]).
    deferred: bool,
}

impl ColumnStats {
    /// Feeds candidates for the least and the greatest value to the accumulators; one that fails
    /// leaves no extreme.
    fn take_extremes(&mut self, least: ArrayRef, greatest: ArrayRef) {
        if self.min.as_mut().is_some_and(|m| m.update_batch(&[least]).is_err()) {
            self.min = None;
        }
        if self.max.as_mut().is_some_and(|m| m.update_batch(&[greatest]).is_err()) {
            self.max = None;
        }
    }
}

impl std::fmt::Debug for ColumnStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ColumnStats(nulls {}, values {})", self.nulls, self.non_null)
    }
}

/// The least and the greatest value of the columns of some rows where they are known without
/// reading the rows (from a Parquet file's row-group statistics): for each column, `None`, or
/// arrays of candidates (of the column's type) whose least and greatest non-null values are the
/// column's.
pub(crate) type KnownExtremes = Vec<Option<(ArrayRef, ArrayRef)>>;

/// Statistics of a partition or a table, fed batch by batch.
#[derive(Clone, Debug)]
pub(crate) struct StatsBuilder {
    rows: usize,
    columns: Vec<ColumnStats>,
}

impl StatsBuilder {
    pub(crate) fn new(schema: &Schema) -> Self {
        StatsBuilder {
            rows: 0,
            columns: schema
                .fields()
                .iter()
                .map(|f| ColumnStats {
                    nulls: 0,
                    non_null: 0,
                    // No extremes of lists and structs: the minimum of partial minima (scalars)
                    // can differ from the minimum of all values (arrays) where fields are null.
                    min: (!f.data_type().is_nested())
                        .then(|| MinAccumulator::try_new(f.data_type()).ok())
                        .flatten(),
                    max: (!f.data_type().is_nested())
                        .then(|| MaxAccumulator::try_new(f.data_type()).ok())
                        .flatten(),
                    max_bytes: longest_string(&arrow_array::new_empty_array(f.data_type())),
                    bytes: 0,
                    deferred: false,
                })
                .collect(),
        }
    }

    /// Takes in the values of `batch`, one column after the other (batches are prepared on every
    /// core at once), given the [`scan_views`] of each of its view columns (`scans`, column by
    /// column; found here where missing); the extremes of the columns `known` gives are taken
    /// from there rather than found in the values. With `defer`, the extremes of the other
    /// columns of a type the device orders ([`device_extremes::supported`]) are not looked for
    /// here but left to the device the batch is staged on (the scans need not have them).
    pub(crate) fn update(
        &mut self,
        batch: &RecordBatch,
        scans: &[Option<ViewScan>],
        known: Option<&KnownExtremes>,
        defer: bool,
    ) {
        self.rows += batch.num_rows();
        for (i, (c, a)) in self.columns.iter_mut().zip(batch.columns()).enumerate() {
            let nulls = a.logical_nulls().map_or(0, |n| n.null_count());
            c.nulls += nulls;
            c.non_null += a.len() - nulls;
            let scan = scans.get(i).copied().flatten().or_else(|| scan_views(a, !defer));
            let longest = match (a.data_type(), scan) {
                (DataType::Utf8View, Some(scan)) => Some(scan.longest),
                _ => longest_string(a),
            };
            c.max_bytes = c.max_bytes.max(longest);
            c.bytes += a.get_array_memory_size();
            // A view column's extremes are fed to the accumulators alone.
            let known = known.and_then(|k| k.get(i)).and_then(Option::as_ref);
            if defer && known.is_none() && device_extremes::supported(a.data_type()) {
                c.deferred = true;
                continue;
            }
            let (least, greatest) = match (known, scan.map(|s| s.extremes)) {
                (Some((least, greatest)), _) => (least.clone(), greatest.clone()),
                (None, Some(Some((least, greatest)))) => (a.slice(least, 1), a.slice(greatest, 1)),
                (None, Some(None)) => (a.slice(0, 0), a.slice(0, 0)),
                (None, None) => match primitive_extremes(a) {
                    Some(Some(extremes)) => extremes,
                    Some(None) => (a.slice(0, 0), a.slice(0, 0)),
                    None => (a.clone(), a.clone()),
                },
            };
            c.take_extremes(least, greatest);
        }
    }

    /// The columns whose extremes were left to the device for some rows (see
    /// [`StatsBuilder::update`]).
    pub(crate) fn deferred_columns(&self) -> Vec<usize> {
        (0..self.columns.len()).filter(|&i| self.columns[i].deferred).collect()
    }

    /// Takes in the extremes the device found for some rows of `column`: arrays of candidates
    /// whose least and greatest values are those rows'.
    pub(crate) fn take_extremes(&mut self, column: usize, least: ArrayRef, greatest: ArrayRef) {
        if let Some(c) = self.columns.get_mut(column) {
            c.take_extremes(least, greatest);
        }
    }

    /// Takes in the statistics of `other`, of other rows of the same schema.
    pub(crate) fn absorb(&mut self, other: StatsBuilder) {
        self.rows += other.rows;
        for (c, o) in self.columns.iter_mut().zip(other.columns) {
            c.nulls += o.nulls;
            c.bytes += o.bytes;
            c.max_bytes = c.max_bytes.max(o.max_bytes);
            c.deferred |= o.deferred;
            if o.non_null == 0 {
                continue;
            }
            c.non_null += o.non_null;
            absorb_extreme(&mut c.min, &o.min);
            absorb_extreme(&mut c.max, &o.max);
        }
    }

    /// The host memory of each column's arrays so far: a scan's byte size is that of the columns
    /// it returns, as DataFusion's `MemTable` reports it (its join selection compares them).
    pub(crate) fn column_bytes(&self) -> Vec<usize> {
        self.columns.iter().map(|c| c.bytes).collect()
    }

    /// The longest value of each string column of the union of `parts`, in bytes (`None` for
    /// columns of other types).
    pub(crate) fn longest_strings(schema: &Schema, parts: &[StatsBuilder]) -> Vec<Option<usize>> {
        (0..schema.fields().len())
            .map(|i| parts.iter().map(|p| p.columns[i].max_bytes).max().flatten())
            .collect()
    }

    /// The statistics of the union of `parts` (partitions of one table).
    pub(crate) fn merge(schema: &Schema, parts: &[StatsBuilder]) -> Statistics {
        let mut out = StatsBuilder::new(schema);
        for p in parts {
            out.absorb(p.clone());
        }
        out.finish()
    }

    pub(crate) fn finish(&self) -> Statistics {
        let exact = |v: Option<ScalarValue>| match v {
            Some(v) if !v.is_null() => Precision::Exact(v),
            _ => Precision::Absent,
        };
        let column_statistics = self
            .columns
            .iter()
            .map(|c| {
                // Evaluating consumes nothing: the accumulators are cloned state.
                let (min, max) = if c.non_null == 0 {
                    (None, None)
                } else {
                    (
                        c.min.as_ref().and_then(|m| m.clone_evaluate()),
                        c.max.as_ref().and_then(|m| m.clone_evaluate()),
                    )
                };
                ColumnStatistics::new_unknown()
                    .with_null_count(Precision::Exact(c.nulls))
                    .with_min_value(exact(min))
                    .with_max_value(exact(max))
            })
            .collect();
        Statistics {
            num_rows: Precision::Exact(self.rows),
            total_byte_size: Precision::Inexact(self.columns.iter().map(|c| c.bytes).sum()),
            column_statistics,
        }
    }
}

/// The longest value of a string array in bytes, null slots included (an upper bound); `None`
/// when the array does not hold strings.
fn longest_string(a: &ArrayRef) -> Option<usize> {
    use arrow_array::cast::AsArray;
    fn widest<O: arrow_array::OffsetSizeTrait>(offsets: &[O]) -> usize {
        offsets.windows(2).map(|w| (w[1] - w[0]).as_usize()).max().unwrap_or(0)
    }
    Some(match a.data_type() {
        DataType::Utf8 => widest(a.as_string::<i32>().value_offsets()),
        DataType::LargeUtf8 => widest(a.as_string::<i64>().value_offsets()),
        // A view's first four bytes are its length.
        DataType::Utf8View => a
            .as_string_view()
            .views()
            .iter()
            .map(|&v| v as u32 as usize)
            .max()
            .unwrap_or(0),
        // A dictionary's values, referenced or not.
        DataType::Dictionary(..) => longest_string(a.as_any_dictionary().values())?,
        _ => return None,
    })
}

/// The least and the greatest valid value of a primitive array (integers, floats, decimals,
/// dates, times, timestamps, durations; not intervals) in one pass, each as an array of one value,
/// or `None` inside when every value is null; `None` for other arrays. The order is arrow's
/// `min` and `max` (which DataFusion's `MIN` and `MAX` use): IEEE total order for floats, NaN
/// greatest. Two passes, `min` and `max`, read the column twice.
fn primitive_extremes(a: &ArrayRef) -> Option<Option<(ArrayRef, ArrayRef)>> {
    use arrow_array::cast::AsArray;
    use arrow_array::{ArrowNativeTypeOp, ArrowPrimitiveType, PrimitiveArray};

    fn fold<N: ArrowNativeTypeOp>(mut values: impl Iterator<Item = N>) -> Option<(N, N)> {
        let first = values.next()?;
        Some(values.fold((first, first), |(least, greatest), v| {
            (
                if v.is_lt(least) { v } else { least },
                if v.is_gt(greatest) { v } else { greatest },
            )
        }))
    }
    fn extremes<T: ArrowPrimitiveType>(a: &PrimitiveArray<T>) -> Option<(ArrayRef, ArrayRef)> {
        let values = a.values();
        let (least, greatest) = match a.nulls().filter(|n| n.null_count() > 0) {
            None => fold(values.iter().copied()),
            Some(nulls) => fold(nulls.valid_indices().map(|i| values[i])),
        }?;
        let one = |v: T::Native| -> ArrayRef {
            Arc::new(PrimitiveArray::<T>::new(vec![v].into(), None).with_data_type(a.data_type().clone()))
        };
        Some((one(least), one(greatest)))
    }
    macro_rules! typed {
        ($t:ty) => {
            Some(extremes(a.as_primitive::<$t>()))
        };
    }
    match a.data_type() {
        DataType::Interval(_) => None,
        dt => arrow_array::downcast_primitive!(dt => (typed), _ => None),
    }
}

/// What one pass over the views of a view column finds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ViewScan {
    /// The places of its least and greatest values, in the byte order of DataFusion's `MIN` and
    /// `MAX` (arrow's); `None` when every value is null or they were not looked for.
    pub(crate) extremes: Option<(usize, usize)>,
    /// Its longest value in bytes, null slots included (an upper bound).
    pub(crate) longest: usize,
    /// The bytes its long views (more than 12 bytes) reference, null slots included (arrow's
    /// `total_buffer_bytes_used`).
    pub(crate) referenced: usize,
}

/// One pass over the views of `a`, when it is a view array (see [`ViewScan`]); its extremes only
/// when asked for (they take most of the time).
pub(crate) fn scan_views(a: &ArrayRef, extremes: bool) -> Option<ViewScan> {
    use arrow_array::GenericByteViewArray;
    use arrow_array::cast::AsArray;
    use arrow_array::types::ByteViewType;
    use std::cmp::Ordering;
    /// A value found so far, with what orders it quickly: its inline key (for a value of 12
    /// bytes or fewer) and its first four bytes, big-endian.
    #[derive(Clone, Copy)]
    struct Found {
        at: usize,
        inline: Option<u128>,
        prefix: u32,
    }
    fn found<T: ByteViewType + ?Sized>(at: usize, view: u128) -> Found {
        Found {
            at,
            inline: (view as u32 <= 12).then(|| GenericByteViewArray::<T>::inline_key_fast(view)),
            prefix: ((view >> 32) as u32).swap_bytes(),
        }
    }
    fn scan<T: ByteViewType + ?Sized>(a: &GenericByteViewArray<T>, valid: impl Fn(usize) -> bool) -> ViewScan {
        // Arrow's order (`compare_unchecked`), with the found value's keys computed once.
        let order = |i: usize, view: u128, f: &Found| match f.inline {
            Some(key) if view as u32 <= 12 => GenericByteViewArray::<T>::inline_key_fast(view).cmp(&key),
            _ => match ((view >> 32) as u32).swap_bytes().cmp(&f.prefix) {
                // SAFETY: both indices are below the array's length.
                Ordering::Equal => unsafe { GenericByteViewArray::compare_unchecked(a, i, a, f.at) },
                other => other,
            },
        };
        let (mut longest, mut referenced) = (0u32, 0usize);
        let mut extremes: Option<(Found, Found)> = None;
        for (i, &view) in a.views().iter().enumerate() {
            let len = view as u32;
            longest = longest.max(len);
            if len > 12 {
                referenced += len as usize;
            }
            if !valid(i) {
                continue;
            }
            match &mut extremes {
                None => extremes = Some((found::<T>(i, view), found::<T>(i, view))),
                Some((least, greatest)) => {
                    if order(i, view, least) == Ordering::Less {
                        *least = found::<T>(i, view);
                    } else if order(i, view, greatest) == Ordering::Greater {
                        *greatest = found::<T>(i, view);
                    }
                }
            }
        }
        ViewScan {
            extremes: extremes.map(|(least, greatest)| (least.at, greatest.at)),
            longest: longest as usize,
            referenced,
        }
    }
    /// The sizes alone.
    fn sizes(views: &[u128]) -> ViewScan {
        let (mut longest, mut referenced) = (0u32, 0usize);
        for &view in views {
            let len = view as u32;
            longest = longest.max(len);
            referenced += if len > 12 { len as usize } else { 0 };
        }
        ViewScan {
            extremes: None,
            longest: longest as usize,
            referenced,
        }
    }
    fn of<T: ByteViewType + ?Sized>(a: &GenericByteViewArray<T>, extremes: bool) -> ViewScan {
        match (extremes, a.nulls().filter(|n| n.null_count() > 0)) {
            (false, _) => sizes(a.views()),
            (true, Some(nulls)) => scan(a, |i| nulls.is_valid(i)),
            (true, None) => scan(a, |_| true),
        }
    }
    match a.data_type() {
        DataType::Utf8View => Some(of(a.as_string_view(), extremes)),
        DataType::BinaryView => Some(of(a.as_binary_view(), extremes)),
        _ => None,
    }
}

/// Feeds `other`'s extreme to `mine`; a missing one (or one that fails) leaves none.
fn absorb_extreme<A: Accumulator + CloneEvaluate>(mine: &mut Option<A>, other: &Option<A>) {
    let extreme = other
        .as_ref()
        .and_then(CloneEvaluate::clone_evaluate)
        .and_then(|v| v.to_array().ok());
    let absorbed = match (mine.as_mut(), extreme) {
        (Some(m), Some(a)) => m.update_batch(std::slice::from_ref(&a)).is_ok(),
        _ => false,
    };
    if !absorbed {
        *mine = None;
    }
}

/// Evaluates an accumulator without needing it mutable.
trait CloneEvaluate {
    fn clone_evaluate(&self) -> Option<ScalarValue>;
}

impl CloneEvaluate for MinAccumulator {
    fn clone_evaluate(&self) -> Option<ScalarValue> {
        self.clone().evaluate().ok()
    }
}

impl CloneEvaluate for MaxAccumulator {
    fn clone_evaluate(&self) -> Option<ScalarValue> {
        self.clone().evaluate().ok()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow_array::{ArrayRef, BinaryViewArray, StringViewArray};

    use super::{primitive_extremes, scan_views};

    /// Long and short values sharing prefixes, nulls first, between and last: one pass finds
    /// arrow's minimum and maximum, the longest value and the bytes the long views reference (the
    /// sizes alone when the extremes are not asked for).
    #[test]
    fn a_scan_of_the_views_finds_arrows_min_max_and_sizes() {
        let words = [
            None,
            Some("abcdefghijklmnopq"),
            Some("abcdefghijklmnop"),
            Some("abcd"),
            None,
            Some("abcdefghijkl"),
            Some("abcdefghijklm"),
            Some("zz"),
            Some("z"),
            Some("zzzzzzzzzzzzzzzzz\u{0}"),
            Some(""),
            None,
        ];
        for n in 0..=words.len() {
            for start in 0..n {
                let strings = StringViewArray::from_iter(words[start..n].iter().copied());
                let a: ArrayRef = Arc::new(strings.clone());
                let expected = arrow_arith::aggregate::min_string_view(&strings)
                    .zip(arrow_arith::aggregate::max_string_view(&strings));
                let scan = scan_views(&a, true).expect("a view array");
                let got = scan.extremes.map(|(lo, hi)| (strings.value(lo), strings.value(hi)));
                assert_eq!(got, expected, "{:?}", &words[start..n]);
                assert_eq!(scan.referenced, strings.total_buffer_bytes_used());
                let longest = strings.views().iter().map(|&v| v as u32 as usize).max().unwrap_or(0);
                assert_eq!(scan.longest, longest);
                let sizes = scan_views(&a, false).expect("a view array");
                assert_eq!(
                    (sizes.extremes, sizes.longest, sizes.referenced),
                    (None, longest, scan.referenced)
                );

                let bytes = BinaryViewArray::from_iter(words[start..n].iter().map(|w| w.map(str::as_bytes)));
                let b: ArrayRef = Arc::new(bytes.clone());
                let got = scan_views(&b, true)
                    .expect("a view array")
                    .extremes
                    .map(|(lo, hi)| (bytes.value(lo), bytes.value(hi)));
                assert_eq!(got, expected.map(|(lo, hi)| (lo.as_bytes(), hi.as_bytes())));
            }
        }
        assert!(scan_views(&(Arc::new(arrow_array::Int32Array::from(vec![1])) as ArrayRef), true).is_none());
    }

    /// One pass finds what arrow's `min` and `max` find: integers with nulls, floats with NaN of
    /// both signs and signed zeros, decimals and zoned timestamps keeping their types, sliced,
    /// all-null and empty arrays; other arrays are not primitive.
    #[test]
    fn one_pass_over_primitives_finds_arrows_min_and_max() {
        use arrow_array::types::{Decimal128Type, Float64Type, Int32Type, TimestampMillisecondType};
        use arrow_array::{Array, ArrowNumericType, cast::AsArray};
        use arrow_array::{Decimal128Array, Float64Array, Int32Array, PrimitiveArray, TimestampMillisecondArray};
        use arrow_buffer::ToByteSlice;

        fn check<T: ArrowNumericType>(a: PrimitiveArray<T>) {
            for (offset, len) in [(0, a.len()), (1, a.len().saturating_sub(2)), (0, 0)] {
                let a = a.slice(offset.min(a.len()), len);
                let array: ArrayRef = Arc::new(a.clone());
                let got = primitive_extremes(&array).expect("a primitive array");
                let expected = arrow_arith::aggregate::min(&a).zip(arrow_arith::aggregate::max(&a));
                let got = got.map(|(least, greatest)| {
                    assert_eq!(least.data_type(), a.data_type());
                    assert_eq!(greatest.data_type(), a.data_type());
                    (
                        least.as_primitive::<T>().value(0),
                        greatest.as_primitive::<T>().value(0),
                    )
                });
                // Bit for bit: NaN and signed zeros included.
                let bits = |p: Option<(T::Native, T::Native)>| {
                    p.map(|(l, g)| (l.to_byte_slice().to_vec(), g.to_byte_slice().to_vec()))
                };
                assert_eq!(bits(got), bits(expected), "{a:?}");
            }
        }
        check::<Int32Type>(Int32Array::from(vec![Some(3), None, Some(-7), Some(12), None, Some(0)]));
        check::<Int32Type>(Int32Array::from(vec![None, None, None]));
        check::<Float64Type>(Float64Array::from(vec![
            Some(0.0),
            Some(-0.0),
            Some(f64::NAN),
            None,
            Some(-f64::NAN),
            Some(-3.5),
            Some(f64::INFINITY),
        ]));
        check::<Float64Type>(Float64Array::from(vec![0.0, -0.0, 1.0, -1.0]));
        check::<Decimal128Type>(
            Decimal128Array::from(vec![Some(12_345), None, Some(-99_999), Some(7)])
                .with_precision_and_scale(15, 2)
                .unwrap(),
        );
        check::<TimestampMillisecondType>(
            TimestampMillisecondArray::from(vec![Some(5), Some(-1), None, Some(9)]).with_timezone("+02:00"),
        );
        let strings: ArrayRef = Arc::new(arrow_array::StringArray::from(vec!["a"]));
        assert!(primitive_extremes(&strings).is_none());
    }
}
