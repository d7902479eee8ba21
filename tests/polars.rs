//! polars-arrow arrays and record batches to arrow-rs and back, and to a device and back: every
//! type polars-arrow has, with nulls, slices, whole batches and metadata. Each case runs on the
//! CPU device and, where a GPU exists, on CUDA.
//!
//! Types polars-arrow has that do not convert (see `arrow_cuda::polars`), checked in `refused` and
//! `refused_by_polars_ffi`: `Decimal256`, `Interval(DayTime)` and `Interval(MonthDayNano)`
//! (polars-arrow 0.55's C Data Interface code panics on their physical types; it imports
//! `MonthDayNano` but cannot export or even compare it), `Interval(MonthDayMillis)` and `Unknown`
//! (no C Data Interface format), dictionaries with 128-bit keys (no Arrow equivalent).
//! `Int128` / `UInt128` convert as `FixedSizeBinary(16)` marked with an extension name.
#![cfg(feature = "polars")]

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;

use arrow_array::Array as _;
use arrow_cuda::polars::{
    INT128_EXTENSION, PolarsBatch, array_from_arrow, array_from_arrow_as, array_to_arrow, batch_from_arrow,
    batch_from_device, batch_to_arrow, batch_to_device, field_from_arrow, field_to_arrow, from_device, from_device_as,
    to_device,
};
use arrow_cuda::{Device, Error, Stream};
use arrow_schema::DataType;
use common::each_device;
use polars_arrow::array::{
    Array, BinaryArray, BinaryViewArray, BooleanArray, DictionaryArray, DictionaryKey, FixedSizeBinaryArray,
    FixedSizeListArray, ListArray, MapArray, NullArray, PrimitiveArray, StructArray, UnionArray, Utf8Array,
    Utf8ViewArray,
};
use polars_arrow::bitmap::Bitmap;
use polars_arrow::datatypes::{
    ArrowDataType as T, ArrowSchema, ExtensionType, Field, IntegerType, IntervalUnit, TimeUnit, UnionMode, UnionType,
};
use polars_arrow::offset::OffsetsBuffer;
use polars_arrow::record_batch::RecordBatchT;
use polars_arrow::types::{NativeType, days_ms, i256, months_days_ns};

/// Rows of every case.
const N: usize = 40;

fn valid(i: usize, seed: usize) -> bool {
    (i * 7 + seed * 3) % 5 != 1
}

fn validity(len: usize, seed: usize) -> Bitmap {
    (0..len).map(|i| valid(i, seed)).collect()
}

/// A primitive array of logical type `dtype` with values `f(i)` and nulls.
fn prim<V: NativeType>(dtype: T, seed: usize, f: impl Fn(usize) -> V) -> Box<dyn Array> {
    let values: Vec<Option<V>> = (0..N).map(|i| valid(i, seed).then(|| f(i))).collect();
    PrimitiveArray::<V>::from(values).to(dtype).boxed()
}

fn field(name: &str, dtype: T, nullable: bool) -> Field {
    Field::new(name.into(), dtype, nullable)
}

/// Strings of 0 to 39 bytes: inline (up to 12) and out of line in view arrays.
fn text(i: usize) -> String {
    let s = format!("row {i}: {}", "abcdefghijklmnopqrstuvwxyz".repeat(2));
    s[..(i * 7) % 40].to_string()
}

fn strings(seed: usize) -> Vec<Option<String>> {
    (0..N).map(|i| valid(i, seed).then(|| text(i))).collect()
}

fn int32s(len: usize, seed: usize) -> Box<dyn Array> {
    PrimitiveArray::<i32>::from(
        (0..len)
            .map(|i| valid(i, seed).then_some(i as i32 * 3 - 50))
            .collect::<Vec<_>>(),
    )
    .boxed()
}

/// Offsets for `N` lists of 0 to 3 elements; returns them and the number of elements.
fn list_offsets<O: polars_arrow::offset::Offset>() -> (OffsetsBuffer<O>, usize) {
    let mut offsets = vec![O::zero()];
    let mut total = 0usize;
    for i in 0..N {
        total += i % 4;
        offsets.push(O::from_as_usize(total));
    }
    (offsets.try_into().unwrap(), total)
}

fn dictionary<K: DictionaryKey>(values: Box<dyn Array>, seed: usize) -> Box<dyn Array> {
    let n = values.len();
    let keys: PrimitiveArray<K> = (0..N)
        .map(|i| valid(i, seed).then(|| K::try_from((i * 5) % n).ok().expect("key fits")))
        .collect::<Vec<Option<K>>>()
        .into();
    DictionaryArray::try_from_keys(keys, values, false).unwrap().boxed()
}

fn union(mode: UnionMode, ids: Option<Vec<i32>>) -> Box<dyn Array> {
    let fields = vec![field("i", T::Int32, true), field("s", T::Utf8View, true)];
    let dtype = T::Union(Box::new(UnionType {
        fields,
        ids: ids.clone(),
        mode,
    }));
    let ids = ids.unwrap_or(vec![0, 1]);
    let types: Vec<i8> = (0..N).map(|i| ids[i % 3 % 2] as i8).collect();
    match mode {
        UnionMode::Sparse => {
            let children = vec![int32s(N, 1), Utf8ViewArray::from_slice(strings(2)).boxed()];
            UnionArray::new(dtype, types.into(), children, None).boxed()
        }
        UnionMode::Dense => {
            let (mut next_i, mut next_s) = (0i32, 0i32);
            let offsets: Vec<i32> = (0..N)
                .map(|i| {
                    let counter = if i % 3 % 2 == 0 { &mut next_i } else { &mut next_s };
                    *counter += 1;
                    *counter - 1
                })
                .collect();
            let children = vec![
                int32s(next_i as usize, 1),
                Utf8ViewArray::from_slice(&strings(2)[..next_s as usize]).boxed(),
            ];
            UnionArray::new(dtype, types.into(), children, Some(offsets.into())).boxed()
        }
    }
}

fn int128s(seed: usize) -> Box<dyn Array> {
    prim(T::Int128, seed, |i| (i as i128 - 20) * (i128::MAX / 64))
}

fn uint128s(seed: usize) -> Box<dyn Array> {
    prim(T::UInt128, seed, |i| u128::MAX - i as u128 * 0x1_0000_0000_0000_0001)
}

/// A struct of `len` rows with nulls: int32, utf8view, null, 128-bit integer, utf8 and large
/// binary children.
fn struct_array(len: usize, seed: usize) -> Box<dyn Array> {
    let children = vec![
        field("a", T::Int32, true),
        field("b", T::Utf8View, true),
        field("n", T::Null, true),
        field("i", T::Int128, true),
        field("u", T::UInt128, false),
        field("s", T::Utf8, true),
        field("lb", T::LargeBinary, true),
    ];
    let values = vec![
        int32s(len, seed),
        Utf8ViewArray::from_slice(
            (0..len)
                .map(|i| valid(i, seed + 1).then(|| text(i)))
                .collect::<Vec<_>>(),
        )
        .boxed(),
        NullArray::new(T::Null, len).boxed(),
        PrimitiveArray::<i128>::from(
            (0..len)
                .map(|i| valid(i, seed + 2).then_some(-(i as i128) << 90))
                .collect::<Vec<_>>(),
        )
        .to(T::Int128)
        .boxed(),
        PrimitiveArray::<u128>::from_vec((0..len as u128).map(|i| i << 100).collect())
            .to(T::UInt128)
            .boxed(),
        Utf8Array::<i32>::from_iter((0..len).map(|i| valid(i, seed + 4).then(|| text(i)))).boxed(),
        BinaryArray::<i64>::from_iter((0..len).map(|i| valid(i, seed + 5).then(|| text(i + 1).into_bytes()))).boxed(),
    ];
    StructArray::new(T::Struct(children), len, values, Some(validity(len, seed + 3))).boxed()
}

/// One polars-arrow array of every type, with nulls wherever the type has a validity bitmap.
fn every_type() -> Vec<(&'static str, Box<dyn Array>)> {
    let mut out: Vec<(&'static str, Box<dyn Array>)> = vec![
        ("null", NullArray::new(T::Null, N).boxed()),
        (
            "boolean",
            BooleanArray::from((0..N).map(|i| valid(i, 0).then_some(i % 3 == 0)).collect::<Vec<_>>()).boxed(),
        ),
        ("int8", prim(T::Int8, 1, |i| i as i8 - 20)),
        ("int16", prim(T::Int16, 2, |i| i as i16 * -300)),
        ("int32", prim(T::Int32, 3, |i| i as i32 * 100_000)),
        ("int64", prim(T::Int64, 4, |i| i as i64 * -(1 << 40))),
        ("int128", int128s(5)),
        ("uint8", prim(T::UInt8, 6, |i| 250 - i as u8)),
        ("uint16", prim(T::UInt16, 7, |i| 65_000 - i as u16)),
        ("uint32", prim(T::UInt32, 8, |i| u32::MAX - i as u32)),
        ("uint64", prim(T::UInt64, 9, |i| u64::MAX - i as u64)),
        ("uint128", uint128s(10)),
        ("float32", prim(T::Float32, 11, |i| i as f32 * 0.25 - 3.0)),
        ("float64", prim(T::Float64, 12, |i| i as f64 * 1e100)),
        (
            "decimal128",
            prim(T::Decimal(38, 5), 13, |i| (i as i128 - 7) * 10i128.pow(30)),
        ),
        ("decimal32", prim(T::Decimal32(9, 2), 14, |i| i as i32 * 12_345)),
        ("decimal64", prim(T::Decimal64(18, 3), 15, |i| i as i64 * -123_456_789)),
        ("date32", prim(T::Date32, 17, |i| i as i32 * 365 - 2000)),
        ("date64", prim(T::Date64, 18, |i| i as i64 * 86_400_000)),
        ("time32 s", prim(T::Time32(TimeUnit::Second), 19, |i| i as i32 * 2000)),
        (
            "time32 ms",
            prim(T::Time32(TimeUnit::Millisecond), 20, |i| i as i32 * 2_000_000),
        ),
        (
            "time64 us",
            prim(T::Time64(TimeUnit::Microsecond), 21, |i| i as i64 * 2_000_000_000),
        ),
        (
            "time64 ns",
            prim(T::Time64(TimeUnit::Nanosecond), 22, |i| i as i64 * 2_000_000_000_000),
        ),
        (
            "timestamp s",
            prim(T::Timestamp(TimeUnit::Second, None), 23, |i| i as i64 * 1_000_000),
        ),
        (
            "timestamp ms utc",
            prim(T::Timestamp(TimeUnit::Millisecond, Some("UTC".into())), 24, |i| {
                i as i64 * 1_000_000_000
            }),
        ),
        (
            "timestamp us tz",
            prim(
                T::Timestamp(TimeUnit::Microsecond, Some("Europe/Paris".into())),
                25,
                |i| (i as i64) << 40,
            ),
        ),
        (
            "timestamp ns offset",
            prim(T::Timestamp(TimeUnit::Nanosecond, Some("+05:30".into())), 26, |i| {
                (i as i64) << 50
            }),
        ),
        ("duration s", prim(T::Duration(TimeUnit::Second), 27, |i| i as i64 - 9)),
        (
            "duration ms",
            prim(T::Duration(TimeUnit::Millisecond), 28, |i| i as i64 * 1000),
        ),
        (
            "duration us",
            prim(T::Duration(TimeUnit::Microsecond), 29, |i| i as i64 * -1_000_000),
        ),
        (
            "duration ns",
            prim(T::Duration(TimeUnit::Nanosecond), 30, |i| (i as i64) << 33),
        ),
        (
            "interval year-month",
            prim(T::Interval(IntervalUnit::YearMonth), 31, |i| i as i32 - 12),
        ),
        ("utf8view", Utf8ViewArray::from_slice(strings(34)).boxed()),
        (
            "binaryview",
            BinaryViewArray::from_slice(
                (0..N)
                    .map(|i| valid(i, 35).then(|| text(i).into_bytes().repeat(i % 3)))
                    .collect::<Vec<_>>(),
            )
            .boxed(),
        ),
        ("utf8", Utf8Array::<i32>::from_iter(strings(36)).boxed()),
        ("large utf8", Utf8Array::<i64>::from_iter(strings(37)).boxed()),
        (
            "binary",
            BinaryArray::<i32>::from_iter(strings(38).into_iter().map(|s| s.map(String::into_bytes))).boxed(),
        ),
        (
            "large binary",
            BinaryArray::<i64>::from_iter(strings(39).into_iter().map(|s| s.map(String::into_bytes))).boxed(),
        ),
        (
            "fixed size binary",
            FixedSizeBinaryArray::from_iter((0..N).map(|i| valid(i, 40).then_some([i as u8; 5])), 5).boxed(),
        ),
    ];

    // Lists.
    let (offsets, total) = list_offsets::<i64>();
    let dtype = T::LargeList(Box::new(field("item", T::Utf8View, true)));
    let values = Utf8ViewArray::from_slice((0..total).map(|i| valid(i, 41).then(|| text(i))).collect::<Vec<_>>());
    out.push((
        "large list of utf8view",
        ListArray::<i64>::new(dtype, offsets, values.boxed(), Some(validity(N, 42))).boxed(),
    ));
    let (offsets, total) = list_offsets::<i32>();
    let dtype = T::List(Box::new(field("item", T::Int32, true)));
    out.push((
        "list of int32",
        ListArray::<i32>::new(dtype, offsets, int32s(total, 43), Some(validity(N, 44))).boxed(),
    ));
    let dtype = T::FixedSizeList(Box::new(field("item", T::Float64, true)), 3);
    let values = PrimitiveArray::<f64>::from(
        (0..3 * N)
            .map(|i| valid(i, 45).then_some(i as f64 / 8.0))
            .collect::<Vec<_>>(),
    );
    out.push((
        "fixed size list",
        FixedSizeListArray::new(dtype, N, values.boxed(), Some(validity(N, 46))).boxed(),
    ));

    // Struct of several types, a null column and 128-bit integers among them.
    out.push(("struct", struct_array(N, 47)));

    // A large list of structs.
    let (offsets, total) = list_offsets::<i64>();
    let inner = struct_array(total, 48);
    let dtype = T::LargeList(Box::new(field("item", inner.dtype().clone(), true)));
    out.push((
        "large list of struct",
        ListArray::<i64>::new(dtype, offsets, inner, Some(validity(N, 51))).boxed(),
    ));

    // Map: utf8view keys (not null) to int64 values.
    let (offsets, total) = list_offsets::<i32>();
    let entries = T::Struct(vec![field("key", T::Utf8View, false), field("value", T::Int64, true)]);
    let keys = Utf8ViewArray::from_slice_values((0..total).map(text).collect::<Vec<_>>());
    let vals = PrimitiveArray::<i64>::from((0..total).map(|i| valid(i, 52).then_some(i as i64)).collect::<Vec<_>>());
    let entry_array = StructArray::new(entries.clone(), total, vec![keys.boxed(), vals.boxed()], None);
    let dtype = T::Map(Box::new(field("entries", entries, false)), false);
    out.push((
        "map",
        MapArray::new(dtype, offsets, entry_array.boxed(), Some(validity(N, 53))).boxed(),
    ));

    // Dictionaries with keys of each width and several value types.
    let words = Utf8ViewArray::from_slice_values((0..7).map(|i| text(i * 3)).collect::<Vec<_>>()).boxed();
    out.push(("dictionary u32 -> utf8view", dictionary::<u32>(words.clone(), 54)));
    out.push((
        "dictionary i8 -> large utf8",
        dictionary::<i8>(Utf8Array::<i64>::from_iter(strings(55)).boxed(), 56),
    ));
    out.push(("dictionary u8 -> utf8view", dictionary::<u8>(words, 57)));
    out.push((
        "dictionary i16 -> int64",
        dictionary::<i16>(prim(T::Int64, 58, |i| i as i64), 59),
    ));
    out.push((
        "dictionary u16 -> float64",
        dictionary::<u16>(prim(T::Float64, 60, |i| i as f64), 61),
    ));
    out.push((
        "dictionary i32 -> binaryview",
        dictionary::<i32>(
            BinaryViewArray::from_slice_values([b"x".as_slice(), b"a longer binary value"]).boxed(),
            62,
        ),
    ));
    out.push(("dictionary i64 -> int128", dictionary::<i64>(int128s(63), 64)));
    out.push((
        "dictionary u64 -> date32",
        dictionary::<u64>(prim(T::Date32, 65, |i| i as i32), 66),
    ));

    // Unions.
    out.push(("sparse union", union(UnionMode::Sparse, None)));
    out.push(("dense union", union(UnionMode::Dense, None)));
    out.push(("sparse union with ids", union(UnionMode::Sparse, Some(vec![3, 7]))));
    out.push(("dense union with ids", union(UnionMode::Dense, Some(vec![5, 2]))));

    // An extension type: travels as field metadata.
    let ext = T::Extension(Box::new(ExtensionType {
        name: "my.uuid".into(),
        inner: T::FixedSizeBinary(16),
        metadata: Some("v4".into()),
    }));
    let uuids = FixedSizeBinaryArray::from_iter((0..N).map(|i| valid(i, 67).then_some([i as u8; 16])), 16).to(ext);
    out.push(("extension", uuids.boxed()));
    out
}

/// Float16 values, which polars-arrow keeps in a type of polars-utils: built by arrow-rs and
/// converted once.
fn float16s() -> Box<dyn Array> {
    let values: arrow_array::Float16Array = (0..N)
        .map(|i| valid(i, 68).then(|| half::f16::from_f32(i as f32 * 0.5 - 4.0)))
        .collect();
    let array = array_from_arrow(&values).unwrap();
    assert_eq!(array.dtype(), &T::Float16);
    array
}

fn every_type_and_float16() -> Vec<(&'static str, Box<dyn Array>)> {
    let mut out = every_type();
    out.push(("float16", float16s()));
    out
}

/// Cuts of each array: the whole, a middle part, an empty slice, the last row, a slice starting at
/// a bit offset that is not a multiple of 8.
fn cuts(len: usize) -> Vec<(usize, usize)> {
    vec![(0, len), (3, len - 7), (len / 2, 0), (len - 1, 1), (13, 11)]
}

/// Asserts `got` equals `expected` by polars-arrow's `equal`, except for dictionaries, whose keys
/// and values are compared instead: polars-arrow compares dictionaries through scalars, and has no
/// scalar comparison for `BinaryView`, `Binary` or `Utf8` (32-bit offsets) values (it panics).
fn assert_same(what: &str, got: &dyn Array, expected: &dyn Array) {
    assert_eq!(got.dtype(), expected.dtype(), "{what}: type");
    if let T::Dictionary(key, ..) = expected.dtype() {
        polars_arrow::match_integer_type!(key, |$K| {
            let got = got.as_any().downcast_ref::<DictionaryArray<$K>>().unwrap();
            let expected = expected.as_any().downcast_ref::<DictionaryArray<$K>>().unwrap();
            assert_eq!(got.keys(), expected.keys(), "{what}: dictionary keys");
            assert!(got.values() == expected.values(), "{what}: dictionary values");
        });
    } else {
        assert!(got == expected, "{what}:\n got      {got:?}\n expected {expected:?}");
    }
}

fn assert_same_batch(what: &str, got: &PolarsBatch, expected: &PolarsBatch) {
    assert_eq!(
        got.schema().metadata(),
        expected.schema().metadata(),
        "{what}: schema metadata"
    );
    assert_eq!(got.schema().len(), expected.schema().len(), "{what}: fields");
    for (g, e) in got.schema().iter_values().zip(expected.schema().iter_values()) {
        assert_eq!(g, e, "{what}: field");
    }
    assert_eq!(got.height(), expected.height(), "{what}: rows");
    assert_eq!(got.width(), expected.width(), "{what}: columns");
    for (name, (g, e)) in expected
        .schema()
        .iter_names()
        .zip(got.arrays().iter().zip(expected.arrays()))
    {
        assert_same(&format!("{what}, column {name}"), g.as_ref(), e.as_ref());
    }
}

/// Whether the arrow-rs type alone gives back the polars type: not for 128-bit integers and
/// extension types, at the top or as dictionary values, which only a field's metadata carries, nor
/// for a union without type ids (`ids: None`), which comes back with `Some([0, 1, ...])`.
fn arrow_type_suffices(dtype: &T) -> bool {
    match dtype {
        T::Int128 | T::UInt128 | T::Extension(_) => false,
        T::Union(u) => u.ids.is_some(),
        T::Dictionary(_, values, _) => arrow_type_suffices(values),
        _ => true,
    }
}

/// polars -> arrow-rs -> polars and polars -> device -> polars, each equal to `array`.
fn round_trip(name: &str, array: &dyn Array, device: Device, stream: &Stream) {
    let arrow = array_to_arrow(array).unwrap_or_else(|e| panic!("{name}: to arrow-rs: {e}"));
    arrow
        .to_data()
        .validate_full()
        .unwrap_or_else(|e| panic!("{name}: invalid arrow-rs array: {e}"));
    assert_eq!(arrow.len(), array.len(), "{name}");
    if array.dtype() != &T::Null {
        // arrow-rs counts no nulls in a NullArray (only logical ones); polars counts them all.
        assert_eq!(arrow.null_count(), array.null_count(), "{name}");
    }
    let back =
        array_from_arrow_as(arrow.as_ref(), array.dtype()).unwrap_or_else(|e| panic!("{name}: from arrow-rs: {e}"));
    assert_same(&format!("{name}: polars -> arrow-rs -> polars"), back.as_ref(), array);
    if arrow_type_suffices(array.dtype()) {
        let back = array_from_arrow(arrow.as_ref()).unwrap_or_else(|e| panic!("{name}: from arrow-rs: {e}"));
        assert_same(
            &format!("{name}: polars -> arrow-rs -> polars, inferred type"),
            back.as_ref(),
            array,
        );
    }

    let on_device = to_device(array, device, stream).unwrap_or_else(|e| panic!("{name}: to {device}: {e}"));
    assert_eq!(on_device.len(), array.len(), "{name}");
    assert_eq!(on_device.data_type(), arrow.data_type(), "{name}");
    for b in on_device.all_buffers() {
        assert_eq!(b.device(), device, "{name}: a buffer on the wrong device");
    }
    let back =
        from_device_as(&on_device, array.dtype(), stream).unwrap_or_else(|e| panic!("{name}: from {device}: {e}"));
    assert_same(&format!("{name}: polars -> {device} -> polars"), back.as_ref(), array);
    if arrow_type_suffices(array.dtype()) {
        let back = from_device(&on_device, stream).unwrap_or_else(|e| panic!("{name}: from {device}: {e}"));
        assert_same(
            &format!("{name}: polars -> {device} -> polars, inferred type"),
            back.as_ref(),
            array,
        );
    }
}

#[test]
fn every_type_round_trips() {
    let cases = every_type_and_float16();
    each_device(|device, stream| {
        for (name, array) in &cases {
            for (offset, len) in cuts(array.len()) {
                let sliced = array.sliced(offset, len);
                round_trip(&format!("{name} [{offset}; {len}]"), sliced.as_ref(), device, stream);
            }
        }
    });
}

/// A slice of a slice, and slices of a struct's and a list's children, keep their offsets.
#[test]
fn nested_slices_round_trip() {
    let cases = every_type();
    each_device(|device, stream| {
        for (name, array) in &cases {
            let twice = array.sliced(2, 30).sliced(5, 20);
            round_trip(&format!("{name} sliced twice"), twice.as_ref(), device, stream);
        }
    });
}

fn every_type_batch(cases: &[(&'static str, Box<dyn Array>)]) -> PolarsBatch {
    let mut schema: ArrowSchema = cases
        .iter()
        .enumerate()
        .map(|(i, (name, array))| {
            let f = field(name, array.dtype().clone(), i % 4 != 0 || array.null_count() > 0);
            if i % 3 == 0 {
                f.with_metadata(BTreeMap::from([("col".into(), i.to_string().as_str().into())]))
            } else {
                f
            }
        })
        .collect();
    schema.metadata_mut().insert("source".into(), "arrow-cuda tests".into());
    let arrays = cases.iter().map(|(_, a)| a.clone()).collect();
    RecordBatchT::try_new(N, Arc::new(schema), arrays).unwrap()
}

fn arrow_type_suffices_in_field(dtype: &T) -> bool {
    match dtype {
        T::Dictionary(_, values, _) => arrow_type_suffices(values),
        T::Union(u) => u.ids.is_some(),
        _ => true,
    }
}

fn slice_batch(batch: &PolarsBatch, offset: usize, len: usize) -> PolarsBatch {
    let arrays = batch.arrays().iter().map(|a| a.sliced(offset, len)).collect();
    RecordBatchT::try_new(len, Arc::new(batch.schema().clone()), arrays).unwrap()
}

#[test]
fn batches_round_trip_with_metadata() {
    // arrow-rs has no field (so no metadata) for dictionary values: a dictionary of 128-bit
    // integers comes back with `FixedSizeBinary(16)` values (`dictionary_of_int128_in_a_batch`);
    // a union without type ids comes back with ids 0, 1, ... (`union_ids_become_explicit`).
    let cases: Vec<_> = every_type_and_float16()
        .into_iter()
        .filter(|(_, a)| arrow_type_suffices_in_field(a.dtype()))
        .collect();
    let batch = every_type_batch(&cases);
    each_device(|device, stream| {
        for (offset, len) in cuts(N) {
            let batch = slice_batch(&batch, offset, len);
            let what = format!("batch [{offset}; {len}]");

            let arrow = batch_to_arrow(&batch).unwrap_or_else(|e| panic!("{what}: to arrow-rs: {e}"));
            assert_eq!(arrow.num_rows(), len);
            assert_eq!(arrow.schema().metadata()["source"], "arrow-cuda tests");
            assert_eq!(arrow.schema().field(0).metadata()["col"], "0");
            let int128 = arrow.schema().field_with_name("int128").unwrap().clone();
            assert_eq!(int128.data_type(), &DataType::FixedSizeBinary(16));
            assert_eq!(int128.metadata()["ARROW:extension:name"], INT128_EXTENSION);
            let back = batch_from_arrow(&arrow).unwrap_or_else(|e| panic!("{what}: from arrow-rs: {e}"));
            assert_same_batch(&format!("{what}: polars -> arrow-rs -> polars"), &back, &batch);

            let on_device =
                batch_to_device(&batch, device, stream).unwrap_or_else(|e| panic!("{what}: to {device}: {e}"));
            assert_eq!((on_device.num_rows(), on_device.num_columns()), (len, cases.len()));
            assert_eq!(on_device.schema(), &arrow.schema());
            let back = batch_from_device(&on_device, stream).unwrap_or_else(|e| panic!("{what}: from {device}: {e}"));
            assert_same_batch(&format!("{what}: polars -> {device} -> polars"), &back, &batch);
        }
    });
}

/// The host conversion shares memory: no buffer is copied either way.
#[test]
fn host_conversion_is_zero_copy() {
    let values = PrimitiveArray::<i64>::from_vec((0..1000).collect()).sliced(10, 900);
    let arrow = array_to_arrow(&values).unwrap();
    let arrow_values = arrow.to_data().buffers()[0].as_ptr();
    assert_eq!(
        arrow_values,
        values.values().as_ptr().cast(),
        "polars -> arrow-rs copied the values"
    );
    let back = array_from_arrow(arrow.as_ref()).unwrap();
    let back = back.as_any().downcast_ref::<PrimitiveArray<i64>>().unwrap();
    assert_eq!(
        back.values().as_ptr(),
        values.values().as_ptr(),
        "arrow-rs -> polars copied the values"
    );

    let strings = Utf8ViewArray::from_slice_values((0..100).map(text).collect::<Vec<_>>());
    let arrow = array_to_arrow(&strings).unwrap();
    assert_eq!(
        arrow.to_data().buffers()[1].as_ptr(),
        strings.data_buffers()[0].as_ptr(),
        "string data copied"
    );

    // A sliced utf8 array: offsets and values shared, the offset carried.
    let strings = Utf8Array::<i64>::from_iter((0..100).map(|i| Some(text(i)))).sliced(30, 50);
    let arrow = array_to_arrow(&strings).unwrap();
    let data = arrow.to_data();
    assert_eq!(
        data.buffers()[0].as_ptr(),
        strings.offsets().buffer().as_ptr().cast(),
        "offsets copied"
    );
    assert_eq!(
        data.buffers()[1].as_ptr(),
        strings.values().as_ptr(),
        "string data copied"
    );
    let arrow = arrow.as_any().downcast_ref::<arrow_array::LargeStringArray>().unwrap();
    assert_eq!(arrow.value(0), text(30));
    assert_eq!(arrow.value(49), text(79));
}

/// Arrays outlive the structs and arrays they came from, in both directions.
#[test]
fn conversions_keep_memory_alive() {
    let arrow = {
        let polars = Utf8ViewArray::from_slice(strings(3));
        array_to_arrow(&polars).unwrap()
    };
    let expected: Vec<Option<String>> = strings(3);
    let got: Vec<Option<String>> = arrow
        .as_any()
        .downcast_ref::<arrow_array::StringViewArray>()
        .unwrap()
        .iter()
        .map(|s| s.map(str::to_string))
        .collect();
    assert_eq!(got, expected);
    let polars = {
        let arrow: arrow_array::StringViewArray = strings(4).into_iter().collect();
        array_from_arrow(&arrow).unwrap()
    };
    assert_eq!(polars.as_ref(), &Utf8ViewArray::from_slice(strings(4)) as &dyn Array);
}

/// Types polars-arrow has but cannot export, and arrow-rs types it cannot import, are errors.
#[test]
fn refused() {
    for dtype in [
        T::Unknown,
        T::Interval(IntervalUnit::MonthDayMillis),
        T::Dictionary(IntegerType::UInt128, Box::new(T::Utf8View), false),
        T::Struct(vec![field("bad", T::Time32(TimeUnit::Nanosecond), true)]),
    ] {
        let err = field_to_arrow(&field("x", dtype.clone(), true)).unwrap_err();
        assert!(matches!(err, Error::Unsupported(_)), "{dtype:?}: {err}");
    }
    // An array whose type disagrees with its batch field.
    let schema: ArrowSchema = [field("a", T::Int64, true)].into_iter().collect();
    let batch = RecordBatchT::try_new(N, Arc::new(schema), vec![int32s(N, 0)]).unwrap();
    assert!(matches!(batch_to_arrow(&batch), Err(Error::InvalidData(_))));
    // A type that does not describe the array.
    let arrow = array_to_arrow(int32s(N, 0).as_ref()).unwrap();
    assert!(matches!(
        array_from_arrow_as(arrow.as_ref(), &T::Int64),
        Err(Error::InvalidArgument(_))
    ));
    // arrow-rs run-end encoding has no polars-arrow type.
    let run_ends = arrow_array::Int32Array::from(vec![2, 5]);
    let ree = arrow_array::RunArray::try_new(&run_ends, &arrow_array::Int64Array::from(vec![1, 2])).unwrap();
    assert!(matches!(array_from_arrow(&ree), Err(Error::Unsupported(_))));
    // Duplicate column names have no polars schema.
    let a: arrow_array::ArrayRef = Arc::new(arrow_array::Int32Array::from(vec![1]));
    let dup = arrow_array::RecordBatch::try_from_iter([("x", a.clone()), ("x", a)]).unwrap();
    assert!(matches!(batch_from_arrow(&dup), Err(Error::Unsupported(_))));
}

/// polars-arrow 0.55's C Data Interface code panics on the physical types of these; the
/// conversions refuse them instead, in the directions polars cannot handle.
#[test]
fn refused_by_polars_ffi() {
    let decimal256 = prim(T::Decimal256(76, 10), 0, |i| {
        i256::from_words(i as i128 - 3, i as i128 * 77)
    });
    let day_time = prim(T::Interval(IntervalUnit::DayTime), 0, |i| {
        days_ms(i as i32, -(i as i32) * 1000)
    });
    let month_day_nano = prim(T::Interval(IntervalUnit::MonthDayNano), 0, |i| {
        months_days_ns(i as i32, 2 * i as i32, (i as i64) << 35)
    });
    each_device(|device, stream| {
        for array in [&decimal256, &day_time, &month_day_nano] {
            let name = format!("{:?}", array.dtype());
            assert!(
                matches!(array_to_arrow(array.as_ref()), Err(Error::Unsupported(_))),
                "{name}"
            );
            assert!(
                matches!(to_device(array.as_ref(), device, stream), Err(Error::Unsupported(_))),
                "{name}"
            );
            let column = field("c", array.dtype().clone(), true);
            let struct_type = T::Struct(vec![column.clone()]);
            let nested = StructArray::new(struct_type, N, vec![array.clone()], None);
            assert!(
                matches!(array_to_arrow(&nested), Err(Error::Unsupported(_))),
                "struct of {name}"
            );
            let batch =
                RecordBatchT::try_new(N, Arc::new([column].into_iter().collect()), vec![array.clone()]).unwrap();
            assert!(
                matches!(batch_to_device(&batch, device, stream), Err(Error::Unsupported(_))),
                "{name}"
            );
        }
    });

    // From arrow-rs: Decimal256 and DayTime are refused, MonthDayNano imports.
    let d256 = arrow_array::Decimal256Array::from(vec![Some(arrow_buffer::i256::from_i128(5)), None]);
    assert!(matches!(array_from_arrow(&d256), Err(Error::Unsupported(_))));
    let dt = arrow_array::IntervalDayTimeArray::from(vec![Some(arrow_buffer::IntervalDayTime::new(1, 2)), None]);
    assert!(matches!(array_from_arrow(&dt), Err(Error::Unsupported(_))));
    let values: Vec<Option<arrow_buffer::IntervalMonthDayNano>> =
        vec![Some(arrow_buffer::IntervalMonthDayNano::new(1, -2, 3 << 40)), None];
    let mdn = arrow_array::IntervalMonthDayNanoArray::from(values);
    let imported = array_from_arrow(&mdn).unwrap();
    let imported = imported
        .as_any()
        .downcast_ref::<PrimitiveArray<months_days_ns>>()
        .unwrap();
    assert_eq!(imported.value(0), months_days_ns(1, -2, 3 << 40));
    assert!(imported.is_valid(0) && !imported.is_valid(1));
}

/// arrow-rs keeps no metadata for dictionary values, so a batch column of a dictionary of 128-bit
/// integers comes back with `FixedSizeBinary(16)` values: the same bytes, another type.
#[test]
fn dictionary_of_int128_in_a_batch() {
    let column = dictionary::<i64>(int128s(0), 1);
    let schema: ArrowSchema = [field("d", column.dtype().clone(), true)].into_iter().collect();
    let batch = RecordBatchT::try_new(N, Arc::new(schema), vec![column.clone()]).unwrap();
    each_device(|device, stream| {
        let back = batch_from_device(&batch_to_device(&batch, device, stream).unwrap(), stream).unwrap();
        let got = back.schema().get_at_index(0).unwrap().1;
        assert_eq!(
            got.dtype(),
            &T::Dictionary(IntegerType::Int64, Box::new(T::FixedSizeBinary(16)), false)
        );
        // With the polars type given, the column converts back exactly.
        let arrow = batch_to_arrow(&batch).unwrap();
        let exact = array_from_arrow_as(arrow.column(0).as_ref(), column.dtype()).unwrap();
        assert_same("dictionary of int128", exact.as_ref(), column.as_ref());
    });
}

/// The C Data Interface always spells out a union's type ids: polars' `ids: None` comes back as
/// `Some([0, 1, ...])`, which means the same.
#[test]
fn union_ids_become_explicit() {
    let array = union(UnionMode::Dense, None);
    let back = array_from_arrow(array_to_arrow(array.as_ref()).unwrap().as_ref()).unwrap();
    let T::Union(u) = back.dtype() else {
        panic!("{:?}", back.dtype())
    };
    assert_eq!(u.ids, Some(vec![0, 1]));
    assert_same(
        "union",
        back.as_ref(),
        union(UnionMode::Dense, Some(vec![0, 1])).as_ref(),
    );
}

#[test]
fn a_time_zone_with_a_nul_byte_is_an_error() {
    // The conversion goes through a C schema, whose format string cannot hold the NUL.
    let zoned = DataType::Timestamp(arrow_schema::TimeUnit::Second, Some("a\0b".into()));
    match field_from_arrow(&arrow_schema::Field::new("t", zoned, true)) {
        Err(Error::InvalidArgument(message)) => assert!(message.contains("NUL"), "{message}"),
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}
