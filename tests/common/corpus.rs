//! One array of every Arrow type arrow-rs supports, with nulls at every level the type allows,
//! and a record batch holding all of them. Everything is deterministic.

use std::collections::HashMap;
use std::sync::Arc;

use arrow_array::builder::{
    BinaryViewBuilder, Int32Builder, ListBuilder, MapBuilder, StringBuilder, StringViewBuilder,
};
use arrow_array::types::*;
use arrow_array::*;
use arrow_buffer::{IntervalDayTime, IntervalMonthDayNano, NullBuffer, OffsetBuffer, ScalarBuffer, i256};
use arrow_schema::{DataType, Field, FieldRef, Fields, Schema, UnionFields};

/// The length of every array in the corpus.
pub const ROWS: usize = 150;

/// Whether row `i` is valid under a pattern keyed by `seed`: roughly one row in five is null,
/// at positions that differ between seeds.
pub fn valid(i: usize, seed: usize) -> bool {
    (i * 7 + seed * 3) % 5 != 1
}

fn nulls(len: usize, seed: usize) -> NullBuffer {
    NullBuffer::from((0..len).map(|i| valid(i, seed)).collect::<Vec<_>>())
}

/// A deterministic pseudo-random number for row `i` (splitmix64).
pub fn mix(i: usize, seed: u64) -> u64 {
    let mut z = (i as u64)
        .wrapping_add(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15))
        .wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A string for row `i`: empty, short (inlined in a view) or longer than 12 bytes.
pub fn text(i: usize, seed: u64) -> String {
    let len = match mix(i, seed) % 4 {
        0 => 0,
        1 => (mix(i, seed + 1) % 12) as usize,
        _ => 13 + (mix(i, seed + 2) % 30) as usize,
    };
    (0..len).map(|j| (b'a' + ((i + j) % 26) as u8) as char).collect()
}

fn prim<T: ArrowPrimitiveType>(seed: usize, f: impl Fn(usize) -> T::Native) -> PrimitiveArray<T> {
    (0..ROWS).map(|i| valid(i, seed).then(|| f(i))).collect()
}

fn strings(seed: u64) -> Vec<Option<String>> {
    (0..ROWS)
        .map(|i| valid(i, seed as usize).then(|| text(i, seed)))
        .collect()
}

fn field(name: &str, data_type: DataType) -> FieldRef {
    Arc::new(Field::new(name, data_type, true))
}

fn list_of_ints(seed: usize) -> ListArray {
    let mut b = ListBuilder::new(Int32Builder::new());
    for i in 0..ROWS {
        if valid(i, seed) {
            for j in 0..(mix(i, seed as u64) % 5) as usize {
                b.values()
                    .append_option(valid(i + j, seed + 1).then_some((i * 10 + j) as i32));
            }
            b.append(true);
        } else {
            b.append(false);
        }
    }
    b.finish()
}

fn large_list_of_strings(seed: usize) -> LargeListArray {
    let mut offsets = vec![0i64];
    let mut values: Vec<Option<String>> = vec![];
    for i in 0..ROWS {
        // Null lists still own some values, as arrow allows.
        for j in 0..(mix(i, seed as u64) % 4) as usize {
            values.push(valid(i + j, seed + 2).then(|| text(i * 3 + j, seed as u64)));
        }
        offsets.push(values.len() as i64);
    }
    LargeListArray::new(
        field("item", DataType::Utf8),
        OffsetBuffer::new(ScalarBuffer::from(offsets)),
        Arc::new(StringArray::from(values)),
        Some(nulls(ROWS, seed)),
    )
}

/// List views whose windows are out of order, overlap and skip parts of the child.
fn list_view<O: OffsetSizeTrait>(values: ArrayRef, seed: usize) -> GenericListViewArray<O> {
    let child = values.len();
    let mut offsets = vec![];
    let mut sizes = vec![];
    for i in 0..ROWS {
        let size = (mix(i, seed as u64) % 6) as usize;
        let offset = (mix(i, seed as u64 + 1) as usize) % (child - size + 1);
        offsets.push(O::usize_as(offset));
        sizes.push(O::usize_as(if valid(i, seed) { size } else { 0 }));
    }
    GenericListViewArray::new(
        field("item", values.data_type().clone()),
        ScalarBuffer::from(offsets),
        ScalarBuffer::from(sizes),
        values,
        Some(nulls(ROWS, seed)),
    )
}

fn fixed_size_list(values: ArrayRef, size: i32, seed: usize) -> FixedSizeListArray {
    FixedSizeListArray::new(
        field("item", values.data_type().clone()),
        size,
        values,
        Some(nulls(ROWS, seed)),
    )
}

/// A struct of lists of structs, with a struct of a struct beside them: nulls on every level.
fn nested_struct(seed: usize) -> StructArray {
    // The innermost struct: {x: Utf8, y: Float64}, as the values of a list.
    let inner_len = 2 * ROWS + 7;
    let x: ArrayRef = Arc::new(StringArray::from(
        (0..inner_len)
            .map(|i| valid(i, seed + 1).then(|| text(i, 11)))
            .collect::<Vec<_>>(),
    ));
    let y: ArrayRef = Arc::new(Float64Array::from(
        (0..inner_len)
            .map(|i| valid(i, seed + 2).then_some(i as f64 * 0.25))
            .collect::<Vec<_>>(),
    ));
    let inner_fields = Fields::from(vec![field("x", DataType::Utf8), field("y", DataType::Float64)]);
    let inner = StructArray::new(inner_fields.clone(), vec![x, y], Some(nulls(inner_len, seed + 3)));
    let mut offsets = vec![0i32];
    for i in 0..ROWS {
        let last = *offsets.last().unwrap() as usize;
        let step = (mix(i, seed as u64) % 4) as usize;
        offsets.push((last + step).min(inner_len) as i32);
    }
    let list = ListArray::new(
        field("item", DataType::Struct(inner_fields)),
        OffsetBuffer::new(ScalarBuffer::from(offsets)),
        Arc::new(inner),
        Some(nulls(ROWS, seed + 4)),
    );
    // A struct of a struct: offsets of a sliced struct must reach the grandchildren.
    let d: ArrayRef = Arc::new(BooleanArray::from(
        (0..ROWS)
            .map(|i| valid(i, seed + 5).then_some(i % 3 == 0))
            .collect::<Vec<_>>(),
    ));
    let e: ArrayRef = Arc::new(prim::<Int16Type>(seed + 6, |i| i as i16 - 70));
    let c_fields = Fields::from(vec![field("d", DataType::Boolean), field("e", DataType::Int16)]);
    let c = StructArray::new(c_fields.clone(), vec![d, e], Some(nulls(ROWS, seed + 7)));
    let a: ArrayRef = Arc::new(prim::<Int32Type>(seed + 8, |i| i as i32 * 3));
    let fields = Fields::from(vec![
        field("a", DataType::Int32),
        field("b", list.data_type().clone()),
        field("c", DataType::Struct(c_fields)),
    ]);
    StructArray::new(fields, vec![a, Arc::new(list), Arc::new(c)], Some(nulls(ROWS, seed)))
}

fn map(seed: usize) -> MapArray {
    let mut b = MapBuilder::new(None, StringBuilder::new(), Int32Builder::new());
    for i in 0..ROWS {
        if valid(i, seed) {
            for j in 0..(mix(i, seed as u64) % 4) as usize {
                b.keys().append_value(format!("k{i}-{j}"));
                b.values()
                    .append_option(valid(i + j, seed + 1).then_some((i * j) as i32));
            }
            b.append(true).unwrap();
        } else {
            b.append(false).unwrap();
        }
    }
    b.finish()
}

fn union_fields() -> UnionFields {
    UnionFields::try_new(
        vec![0, 3, 7],
        vec![
            Field::new("i", DataType::Int32, true),
            Field::new("s", DataType::Utf8, true),
            Field::new("l", DataType::List(field("item", DataType::Int32)), true),
        ],
    )
    .unwrap()
}

fn union(dense: bool) -> UnionArray {
    let ids = [0i8, 3, 7];
    let type_ids: Vec<i8> = (0..ROWS).map(|i| ids[(mix(i, 5) % 3) as usize]).collect();
    if dense {
        let mut counts = [0usize; 3];
        let mut offsets = vec![];
        for &t in &type_ids {
            let k = ids.iter().position(|&x| x == t).unwrap();
            offsets.push(counts[k] as i32);
            counts[k] += 1;
        }
        let ints: ArrayRef = Arc::new(
            (0..counts[0])
                .map(|i| valid(i, 21).then_some(i as i32))
                .collect::<Int32Array>(),
        );
        let strs: ArrayRef = Arc::new(StringArray::from(
            (0..counts[1])
                .map(|i| valid(i, 22).then(|| text(i, 22)))
                .collect::<Vec<_>>(),
        ));
        let lists: ArrayRef = Arc::new(list_of_ints(23).slice(0, counts[2]));
        UnionArray::try_new(
            union_fields(),
            type_ids.into(),
            Some(offsets.into()),
            vec![ints, strs, lists],
        )
        .unwrap()
    } else {
        let ints: ArrayRef = Arc::new(prim::<Int32Type>(24, |i| i as i32));
        let strs: ArrayRef = Arc::new(StringArray::from(strings(25)));
        let lists: ArrayRef = Arc::new(list_of_ints(26));
        UnionArray::try_new(union_fields(), type_ids.into(), None, vec![ints, strs, lists]).unwrap()
    }
}

fn dictionary<K: ArrowDictionaryKeyType>(seed: usize) -> ArrayRef
where
    K::Native: TryFrom<usize>,
{
    let values: ArrayRef = Arc::new(StringArray::from(
        (0..20)
            .map(|i| (i % 7 != 4).then(|| text(i, seed as u64)))
            .collect::<Vec<_>>(),
    ));
    let keys: PrimitiveArray<K> = (0..ROWS)
        .map(|i| valid(i, seed).then(|| K::Native::try_from((mix(i, seed as u64) % 20) as usize).ok().unwrap()))
        .collect();
    Arc::new(DictionaryArray::<K>::try_new(keys, values).unwrap())
}

fn run_end_encoded<R: RunEndIndexType>(seed: usize) -> ArrayRef
where
    R::Native: TryFrom<usize>,
{
    let mut ends = vec![];
    let mut end = 0;
    while end < ROWS {
        end = (end + 1 + (mix(end, seed as u64) % 9) as usize).min(ROWS);
        ends.push(R::Native::try_from(end).ok().unwrap());
    }
    let run_ends = PrimitiveArray::<R>::from_iter_values(ends.iter().copied());
    let values = StringArray::from(
        (0..ends.len())
            .map(|i| valid(i, seed).then(|| text(i, seed as u64)))
            .collect::<Vec<_>>(),
    );
    Arc::new(RunArray::<R>::try_new(&run_ends, &values).unwrap())
}

fn view_builder_strings(seed: u64) -> StringViewArray {
    // Small blocks: the long strings spread over many data buffers.
    let mut b = StringViewBuilder::new().with_fixed_block_size(128);
    for s in strings(seed) {
        b.append_option(s);
    }
    b.finish()
}

fn view_builder_binary(seed: u64) -> BinaryViewArray {
    let mut b = BinaryViewBuilder::new().with_fixed_block_size(96);
    for s in strings(seed) {
        b.append_option(s.map(String::into_bytes));
    }
    b.finish()
}

/// One array of every type, named after it.
pub fn every_type() -> Vec<(String, ArrayRef)> {
    let mut out: Vec<(&str, ArrayRef)> = vec![
        ("null", Arc::new(NullArray::new(ROWS))),
        (
            "boolean",
            Arc::new(
                (0..ROWS)
                    .map(|i| valid(i, 1).then_some(mix(i, 1).is_multiple_of(2)))
                    .collect::<BooleanArray>(),
            ),
        ),
        ("int8", Arc::new(prim::<Int8Type>(2, |i| (i as i64 - 75) as i8))),
        ("int16", Arc::new(prim::<Int16Type>(3, |i| mix(i, 3) as i16))),
        ("int32", Arc::new(prim::<Int32Type>(4, |i| mix(i, 4) as i32))),
        ("int64", Arc::new(prim::<Int64Type>(5, |i| mix(i, 5) as i64))),
        ("uint8", Arc::new(prim::<UInt8Type>(6, |i| mix(i, 6) as u8))),
        ("uint16", Arc::new(prim::<UInt16Type>(7, |i| mix(i, 7) as u16))),
        ("uint32", Arc::new(prim::<UInt32Type>(8, |i| mix(i, 8) as u32))),
        ("uint64", Arc::new(prim::<UInt64Type>(9, |i| mix(i, 9)))),
        (
            "float16",
            Arc::new(prim::<Float16Type>(10, |i| half::f16::from_f32(i as f32 * 0.5 - 10.0))),
        ),
        ("float32", Arc::new(prim::<Float32Type>(11, |i| i as f32 / 3.0))),
        ("float64", Arc::new(prim::<Float64Type>(12, |i| (i as f64).sqrt()))),
        (
            "decimal32",
            Arc::new(
                prim::<Decimal32Type>(13, |i| (mix(i, 13) % 1_000_000_000) as i32)
                    .with_precision_and_scale(9, 2)
                    .unwrap(),
            ),
        ),
        (
            "decimal64",
            Arc::new(
                prim::<Decimal64Type>(14, |i| (mix(i, 14) % 1_000_000_000_000_000) as i64 - 5)
                    .with_precision_and_scale(18, 4)
                    .unwrap(),
            ),
        ),
        (
            "decimal128",
            Arc::new(
                prim::<Decimal128Type>(15, |i| mix(i, 15) as i128 * -(i as i128))
                    .with_precision_and_scale(38, 10)
                    .unwrap(),
            ),
        ),
        (
            "decimal256",
            Arc::new(
                prim::<Decimal256Type>(16, |i| {
                    i256::from_i128(mix(i, 16) as i128).wrapping_mul(i256::from_i128(i as i128 - 9))
                })
                .with_precision_and_scale(76, -3)
                .unwrap(),
            ),
        ),
        ("date32", Arc::new(prim::<Date32Type>(17, |i| i as i32 * 100 - 3000))),
        ("date64", Arc::new(prim::<Date64Type>(18, |i| i as i64 * 86_400_000))),
        (
            "time32_s",
            Arc::new(prim::<Time32SecondType>(19, |i| (i * 500 % 86_400) as i32)),
        ),
        (
            "time32_ms",
            Arc::new(prim::<Time32MillisecondType>(20, |i| (i * 500_017 % 86_400_000) as i32)),
        ),
        (
            "time64_us",
            Arc::new(prim::<Time64MicrosecondType>(21, |i| {
                (mix(i, 21) % 86_400_000_000) as i64
            })),
        ),
        (
            "time64_ns",
            Arc::new(prim::<Time64NanosecondType>(22, |i| {
                (mix(i, 22) % 86_400_000_000_000) as i64
            })),
        ),
    ];
    macro_rules! timestamps {
        ($($name:literal, $t:ty, $seed:literal, $tz:expr;)*) => {$(
            let a = prim::<$t>($seed, |i| mix(i, $seed) as i64 >> 20);
            let a: ArrayRef = match $tz {
                Some(tz) => Arc::new(a.with_timezone(tz)),
                None => Arc::new(a),
            };
            out.push(($name, a));
        )*};
    }
    timestamps! {
        "timestamp_s", TimestampSecondType, 23, None::<&str>;
        "timestamp_ms", TimestampMillisecondType, 24, None::<&str>;
        "timestamp_us", TimestampMicrosecondType, 25, None::<&str>;
        "timestamp_ns", TimestampNanosecondType, 26, None::<&str>;
        "timestamp_s_tz", TimestampSecondType, 27, Some("+05:30");
        "timestamp_ms_tz", TimestampMillisecondType, 28, Some("UTC");
        "timestamp_us_tz", TimestampMicrosecondType, 29, Some("Europe/Paris");
        "timestamp_ns_tz", TimestampNanosecondType, 30, Some("-08:00");
    }
    let more: Vec<(&str, ArrayRef)> = vec![
        (
            "duration_s",
            Arc::new(prim::<DurationSecondType>(31, |i| i as i64 - 50)),
        ),
        (
            "duration_ms",
            Arc::new(prim::<DurationMillisecondType>(32, |i| mix(i, 32) as i64)),
        ),
        (
            "duration_us",
            Arc::new(prim::<DurationMicrosecondType>(33, |i| mix(i, 33) as i64)),
        ),
        (
            "duration_ns",
            Arc::new(prim::<DurationNanosecondType>(34, |i| mix(i, 34) as i64)),
        ),
        (
            "interval_year_month",
            Arc::new(prim::<IntervalYearMonthType>(35, |i| i as i32 - 12)),
        ),
        (
            "interval_day_time",
            Arc::new(prim::<IntervalDayTimeType>(36, |i| {
                IntervalDayTime::new(i as i32, -(i as i32) * 1000)
            })),
        ),
        (
            "interval_month_day_nano",
            Arc::new(prim::<IntervalMonthDayNanoType>(37, |i| {
                IntervalMonthDayNano::new(i as i32, 2 - i as i32, mix(i, 37) as i64)
            })),
        ),
        (
            "binary",
            Arc::new(BinaryArray::from_iter(
                strings(38).into_iter().map(|s| s.map(String::into_bytes)),
            )),
        ),
        (
            "large_binary",
            Arc::new(LargeBinaryArray::from_iter(
                strings(39).into_iter().map(|s| s.map(String::into_bytes)),
            )),
        ),
        ("binary_view", Arc::new(view_builder_binary(40))),
        ("utf8", Arc::new(StringArray::from(strings(41)))),
        ("large_utf8", Arc::new(LargeStringArray::from(strings(42)))),
        ("utf8_view", Arc::new(view_builder_strings(43))),
        (
            "fixed_size_binary",
            Arc::new(
                FixedSizeBinaryArray::try_from_sparse_iter_with_size(
                    (0..ROWS).map(|i| valid(i, 44).then(|| mix(i, 44).to_le_bytes()[..5].to_vec())),
                    5,
                )
                .unwrap(),
            ),
        ),
        ("list", Arc::new(list_of_ints(45))),
        ("large_list", Arc::new(large_list_of_strings(46))),
        (
            "list_view",
            Arc::new(list_view::<i32>(Arc::new(prim::<Int32Type>(47, |i| i as i32)), 47)),
        ),
        (
            "large_list_view",
            Arc::new(list_view::<i64>(Arc::new(StringArray::from(strings(48))), 48)),
        ),
        (
            "fixed_size_list_int",
            Arc::new(fixed_size_list(
                Arc::new(
                    (0..ROWS * 3)
                        .map(|i| valid(i, 49).then_some(i as i32))
                        .collect::<Int32Array>(),
                ),
                3,
                50,
            )),
        ),
        (
            "fixed_size_list_utf8",
            Arc::new(fixed_size_list(
                Arc::new(StringArray::from(
                    (0..ROWS * 2)
                        .map(|i| valid(i, 51).then(|| text(i, 51)))
                        .collect::<Vec<_>>(),
                )),
                2,
                52,
            )),
        ),
        ("struct", Arc::new(nested_struct(53))),
        ("map", Arc::new(map(54))),
        ("dense_union", Arc::new(union(true))),
        ("sparse_union", Arc::new(union(false))),
        ("dictionary_int8", dictionary::<Int8Type>(55)),
        ("dictionary_int16", dictionary::<Int16Type>(56)),
        ("dictionary_int32", dictionary::<Int32Type>(57)),
        ("dictionary_int64", dictionary::<Int64Type>(58)),
        ("dictionary_uint8", dictionary::<UInt8Type>(59)),
        ("dictionary_uint16", dictionary::<UInt16Type>(60)),
        ("dictionary_uint32", dictionary::<UInt32Type>(61)),
        ("dictionary_uint64", dictionary::<UInt64Type>(62)),
        ("dictionary_of_lists", {
            let keys: Int32Array = (0..ROWS)
                .map(|i| valid(i, 63).then_some((mix(i, 63) % 30) as i32))
                .collect();
            Arc::new(DictionaryArray::<Int32Type>::try_new(keys, Arc::new(list_of_ints(64).slice(5, 30))).unwrap())
        }),
        ("run_end_encoded_int16", run_end_encoded::<Int16Type>(65)),
        ("run_end_encoded_int32", run_end_encoded::<Int32Type>(66)),
        ("run_end_encoded_int64", run_end_encoded::<Int64Type>(67)),
    ];
    out.extend(more);
    out.into_iter().map(|(n, a)| (n.to_string(), a)).collect()
}

/// Every type of [`every_type`] as a nullable column, with schema and field metadata.
pub fn every_type_batch() -> RecordBatch {
    let (fields, columns): (Vec<Field>, Vec<ArrayRef>) = every_type()
        .into_iter()
        .map(|(name, array)| {
            let meta = HashMap::from([
                ("type".to_string(), array.data_type().to_string()),
                ("origin".to_string(), "corpus".to_string()),
            ]);
            (
                Field::new(name, array.data_type().clone(), true).with_metadata(meta),
                array,
            )
        })
        .unzip();
    let meta = HashMap::from([
        ("producer".to_string(), "arrow-cuda tests".to_string()),
        ("rows".to_string(), ROWS.to_string()),
    ]);
    RecordBatch::try_new(Arc::new(Schema::new(fields).with_metadata(meta)), columns).unwrap()
}

/// `array` sliced at each `(offset, len)` in turn: a slice of a slice of ... .
pub fn sliced(array: &ArrayRef, cuts: &[(usize, usize)]) -> ArrayRef {
    cuts.iter()
        .fold(array.clone(), |a, &(offset, len)| a.slice(offset, len))
}

/// Slices worth testing for an array of `len` rows: offsets that are and are not multiples of 8,
/// zero-length slices at the start, middle and end, and the whole array.
pub fn slice_cuts(len: usize) -> Vec<(usize, usize)> {
    let mut cuts = vec![(0, len), (0, 0), (len, 0), (len / 2, 0)];
    for offset in [1, 3, 7, 8, 9, 13, 16, 31, 64, 65] {
        if offset < len {
            cuts.push((offset, len - offset));
            cuts.push((offset, (len - offset).min(17)));
            cuts.push((offset, 1));
        }
    }
    if len > 2 {
        cuts.push((len - 1, 1));
    }
    cuts
}
