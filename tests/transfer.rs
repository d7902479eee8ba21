//! Record batches to a device and back: every type, slices, whole batches, events, and random
//! schemas. Each case runs on the CPU device and, where a GPU exists, on CUDA.

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use arrow_array::builder::{Int32Builder, ListBuilder, StringBuilder};
use arrow_array::types::{Int16Type, Int32Type, UInt8Type};
use arrow_array::*;
use arrow_buffer::{NullBuffer, OffsetBuffer, ScalarBuffer};
use arrow_cuda::transfer::{dtoh, dtoh_array, dtoh_async, htod, htod_array, htod_async};
use arrow_cuda::{Device, DeviceArrayData, DeviceRecordBatch, MemoryResource, Stream};
use arrow_schema::{DataType, Field, FieldRef, Fields, Schema};
use common::corpus::{ROWS, every_type, every_type_batch, slice_cuts, sliced};
use common::{Gate, check_batch, each_device};
use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Uploads `array`, checks what the device holds, downloads it and checks it equals `array`.
fn round_trip_array(name: &str, array: &ArrayRef, device: Device, stream: &Stream) {
    let on_device = htod_array(array.as_ref(), device, stream).unwrap_or_else(|e| panic!("{name}: htod_array: {e}"));
    check_device_array(name, &on_device, array, device);
    let back = dtoh_array(&on_device, stream).unwrap_or_else(|e| panic!("{name}: dtoh_array: {e}"));
    back.to_data()
        .validate_full()
        .unwrap_or_else(|e| panic!("{name}: invalid after the round trip: {e}"));
    assert_eq!(back.data_type(), array.data_type(), "{name}");
    assert_eq!(back.len(), array.len(), "{name}");
    assert_eq!(back.logical_null_count(), array.logical_null_count(), "{name}");
    assert_eq!(
        back.as_ref(),
        array.as_ref(),
        "{name}: the round trip changed the array"
    );
}

fn check_device_array(name: &str, on_device: &DeviceArrayData, array: &ArrayRef, device: Device) {
    assert_eq!(on_device.data_type(), array.data_type(), "{name}");
    assert_eq!(on_device.len(), array.len(), "{name}");
    // A planned array knows its null count: the one the host array has.
    assert_eq!(
        on_device.null_count(),
        Some(array.null_count()),
        "{name}: null count on the device"
    );
    if on_device.all_buffers().next().is_some() {
        assert_eq!(on_device.device(), device, "{name}: buffers on the wrong device");
    }
    for b in on_device.all_buffers() {
        assert_eq!(b.device(), device, "{name}: a buffer on the wrong device");
    }
}

/// Uploads a batch, checks the device batch, downloads it and checks it equals `batch`,
/// metadata included.
fn round_trip_batch(what: &str, batch: &RecordBatch, device: Device, stream: &Stream) -> DeviceRecordBatch {
    let on_device = htod(batch, device, stream).unwrap_or_else(|e| panic!("{what}: htod: {e}"));
    assert_eq!(on_device.num_rows(), batch.num_rows(), "{what}");
    assert_eq!(on_device.num_columns(), batch.num_columns(), "{what}");
    assert_eq!(on_device.schema(), &batch.schema(), "{what}: schema");
    if on_device.columns().iter().any(|c| c.all_buffers().next().is_some()) {
        assert_eq!(on_device.device(), device, "{what}");
    }
    assert!(
        on_device.ready().is_complete().unwrap(),
        "{what}: htod returned before the copy finished"
    );
    let back = dtoh(&on_device, stream).unwrap_or_else(|e| panic!("{what}: dtoh: {e}"));
    check_batch(what, &back, batch);
    on_device
}

// ---------------------------------------------------------------------------------------------
// Every type, alone and sliced.

/// A name and a test for one family of types.
type TypeCheck = (&'static str, fn(&DataType) -> bool);

#[test]
fn corpus_covers_every_type() {
    let corpus = every_type();
    let has = |p: &dyn Fn(&DataType) -> bool| corpus.iter().any(|(_, a)| p(a.data_type()));
    for t in [
        DataType::Null,
        DataType::Boolean,
        DataType::Int8,
        DataType::Int16,
        DataType::Int32,
        DataType::Int64,
        DataType::UInt8,
        DataType::UInt16,
        DataType::UInt32,
        DataType::UInt64,
        DataType::Float16,
        DataType::Float32,
        DataType::Float64,
        DataType::Date32,
        DataType::Date64,
        DataType::Binary,
        DataType::LargeBinary,
        DataType::BinaryView,
        DataType::Utf8,
        DataType::LargeUtf8,
        DataType::Utf8View,
    ] {
        assert!(has(&|d| *d == t), "corpus lacks {t}");
    }
    let kinds: [TypeCheck; 19] = [
        ("decimal32", |d| matches!(d, DataType::Decimal32(..))),
        ("decimal64", |d| matches!(d, DataType::Decimal64(..))),
        ("decimal128", |d| matches!(d, DataType::Decimal128(..))),
        ("decimal256", |d| matches!(d, DataType::Decimal256(..))),
        ("time32", |d| matches!(d, DataType::Time32(_))),
        ("time64", |d| matches!(d, DataType::Time64(_))),
        ("timestamp with zone", |d| matches!(d, DataType::Timestamp(_, Some(_)))),
        ("duration", |d| matches!(d, DataType::Duration(_))),
        ("interval", |d| matches!(d, DataType::Interval(_))),
        ("fixed size binary", |d| matches!(d, DataType::FixedSizeBinary(_))),
        ("list", |d| matches!(d, DataType::List(_))),
        ("large list", |d| matches!(d, DataType::LargeList(_))),
        ("list view", |d| matches!(d, DataType::ListView(_))),
        ("large list view", |d| matches!(d, DataType::LargeListView(_))),
        ("fixed size list", |d| matches!(d, DataType::FixedSizeList(..))),
        ("struct", |d| matches!(d, DataType::Struct(_))),
        ("map", |d| matches!(d, DataType::Map(..))),
        ("union", |d| matches!(d, DataType::Union(..))),
        ("run end encoded", |d| matches!(d, DataType::RunEndEncoded(..))),
    ];
    for (what, p) in kinds {
        assert!(has(&p), "corpus lacks {what}");
    }
    assert_eq!(
        corpus
            .iter()
            .filter(|(_, a)| matches!(a.data_type(), DataType::Timestamp(..)))
            .count(),
        8
    );
    assert_eq!(
        corpus
            .iter()
            .filter(|(_, a)| matches!(a.data_type(), DataType::Duration(_)))
            .count(),
        4
    );
    assert_eq!(
        corpus
            .iter()
            .filter(|(_, a)| matches!(a.data_type(), DataType::Interval(_)))
            .count(),
        3
    );
    assert_eq!(
        corpus
            .iter()
            .filter(|(_, a)| matches!(a.data_type(), DataType::Dictionary(..)))
            .count(),
        9
    );
    assert_eq!(
        corpus
            .iter()
            .filter(|(_, a)| matches!(a.data_type(), DataType::RunEndEncoded(..)))
            .count(),
        3
    );
    for (name, array) in &corpus {
        assert_eq!(array.len(), ROWS, "{name}");
        array
            .to_data()
            .validate_full()
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        if !matches!(
            array.data_type(),
            DataType::Null | DataType::Union(..) | DataType::RunEndEncoded(..)
        ) {
            assert!(array.null_count() > 0, "{name} has no nulls");
        }
    }
    // The view arrays use several data buffers.
    for (name, array) in &corpus {
        if matches!(array.data_type(), DataType::Utf8View | DataType::BinaryView) {
            assert!(array.to_data().buffers().len() > 3, "{name} has too few data buffers");
        }
    }
}

#[test]
fn every_type_round_trips() {
    let corpus = every_type();
    each_device(|device, stream| {
        for (name, array) in &corpus {
            round_trip_array(name, array, device, stream);
        }
    });
}

#[test]
fn every_type_round_trips_sliced() {
    let corpus = every_type();
    each_device(|device, stream| {
        for (name, array) in &corpus {
            for (offset, len) in slice_cuts(array.len()) {
                let s = array.slice(offset, len);
                round_trip_array(&format!("{name}[{offset}..+{len}]"), &s, device, stream);
            }
        }
    });
}

#[test]
fn every_type_round_trips_sliced_twice() {
    let corpus = every_type();
    let cuts: [&[(usize, usize)]; 5] = [
        &[(3, 140), (5, 100)],
        &[(9, 130), (7, 0)],
        &[(1, 148), (1, 146), (1, 144)],
        &[(17, 120), (13, 21), (3, 5)],
        &[(64, 80), (63, 17)],
    ];
    each_device(|device, stream| {
        for (name, array) in &corpus {
            for c in cuts {
                round_trip_array(&format!("{name}{c:?}"), &sliced(array, c), device, stream);
            }
        }
    });
}

/// A device array sliced on the device downloads as the same slice of the host array.
#[test]
fn every_type_sliced_on_the_device() {
    let corpus = every_type();
    each_device(|device, stream| {
        for (name, array) in &corpus {
            let on_device = htod_array(array.as_ref(), device, stream).unwrap();
            for (offset, len) in slice_cuts(array.len()) {
                let what = format!("{name} sliced on {device} at {offset}..+{len}");
                let s = on_device.slice(offset, len).unwrap_or_else(|e| panic!("{what}: {e}"));
                assert_eq!(s.len(), len);
                let back = dtoh_array(&s, stream).unwrap_or_else(|e| panic!("{what}: {e}"));
                back.to_data().validate_full().unwrap_or_else(|e| panic!("{what}: {e}"));
                assert_eq!(back.as_ref(), array.slice(offset, len).as_ref(), "{what}");
                // And again, on top of that.
                if len > 4 {
                    let back2 = dtoh_array(&s.slice(3, len - 4).unwrap(), stream).unwrap();
                    assert_eq!(
                        back2.as_ref(),
                        array.slice(offset + 3, len - 4).as_ref(),
                        "{what}, sliced again"
                    );
                }
            }
            assert!(on_device.slice(array.len(), 1).is_err(), "{name}: a slice past the end");
            assert!(on_device.slice(usize::MAX, 2).is_err(), "{name}: an overflowing slice");
        }
    });
}

/// Struct offsets apply to the children, down to grandchildren, in both directions.
#[test]
fn nested_struct_slices() {
    let inner = StructArray::from(vec![(
        Arc::new(Field::new("g", DataType::Int32, true)),
        Arc::new(Int32Array::from(
            (0..40).map(|i| (i % 3 != 0).then_some(i)).collect::<Vec<_>>(),
        )) as ArrayRef,
    )]);
    let middle = StructArray::new(
        Fields::from(vec![Field::new("inner", inner.data_type().clone(), true)]),
        vec![Arc::new(inner) as ArrayRef],
        Some(NullBuffer::from((0..40).map(|i| i % 4 != 1).collect::<Vec<_>>())),
    );
    let outer: ArrayRef = Arc::new(StructArray::new(
        Fields::from(vec![Field::new("middle", middle.data_type().clone(), true)]),
        vec![Arc::new(middle) as ArrayRef],
        Some(NullBuffer::from((0..40).map(|i| i % 5 != 2).collect::<Vec<_>>())),
    ));
    each_device(|device, stream| {
        for (offset, len) in [(0, 40), (3, 30), (9, 11), (17, 0), (39, 1)] {
            let host_slice = outer.slice(offset, len);
            round_trip_array("struct of struct", &host_slice, device, stream);
            let on_device = htod_array(outer.as_ref(), device, stream)
                .unwrap()
                .slice(offset, len)
                .unwrap();
            let back = dtoh_array(&on_device, stream).unwrap();
            back.to_data().validate_full().unwrap();
            assert_eq!(back.as_ref(), host_slice.as_ref(), "device slice {offset}..+{len}");
            let inner = back.as_any().downcast_ref::<StructArray>().unwrap().column(0);
            let inner = inner.as_any().downcast_ref::<StructArray>().unwrap().column(0);
            let g = inner.as_any().downcast_ref::<StructArray>().unwrap().column(0);
            let expected = Int32Array::from(
                (offset..offset + len)
                    .map(|i| (i % 3 != 0).then_some(i as i32))
                    .collect::<Vec<_>>(),
            );
            assert_eq!(
                g.as_ref(),
                &expected as &dyn Array,
                "grandchild of the device slice {offset}..+{len}"
            );
        }
    });
}

// ---------------------------------------------------------------------------------------------
// Whole batches.

#[test]
fn every_type_batch_round_trips() {
    let batch = every_type_batch();
    assert!(!batch.schema().metadata().is_empty());
    assert!(
        batch
            .schema()
            .fields()
            .iter()
            .all(|f| f.is_nullable() && !f.metadata().is_empty())
    );
    each_device(|device, stream| {
        let on_device = round_trip_batch("every type", &batch, device, stream);
        for (i, field) in batch.schema().fields().iter().enumerate() {
            assert_eq!(
                on_device.schema().field(i).metadata(),
                field.metadata(),
                "field metadata of {}",
                field.name()
            );
            assert_eq!(
                on_device.column(i).null_count(),
                Some(batch.column(i).null_count()),
                "{}",
                field.name()
            );
        }
    });
}

#[test]
fn every_type_batch_round_trips_sliced() {
    let batch = every_type_batch();
    each_device(|device, stream| {
        for (offset, len) in slice_cuts(batch.num_rows()) {
            round_trip_batch(
                &format!("every type [{offset}..+{len}]"),
                &batch.slice(offset, len),
                device,
                stream,
            );
        }
        let twice = batch.slice(5, 120).slice(11, 50);
        round_trip_batch("every type, sliced twice", &twice, device, stream);
    });
}

#[test]
fn empty_batches_round_trip() {
    let batch = every_type_batch();
    each_device(|device, stream| {
        round_trip_batch("every type, sliced to 0 rows", &batch.slice(0, 0), device, stream);
        round_trip_batch(
            "every type, sliced to 0 rows at the end",
            &batch.slice(batch.num_rows(), 0),
            device,
            stream,
        );
        let empty = RecordBatch::new_empty(batch.schema());
        let on_device = round_trip_batch("every type, new_empty", &empty, device, stream);
        assert_eq!(on_device.num_rows(), 0);
    });
}

#[test]
fn batch_without_columns_keeps_its_rows() {
    let options = RecordBatchOptions::new().with_row_count(Some(42));
    let meta = HashMap::from([("k".to_string(), "v".to_string())]);
    let batch =
        RecordBatch::try_new_with_options(Arc::new(Schema::empty().with_metadata(meta)), vec![], &options).unwrap();
    each_device(|device, stream| {
        let on_device = round_trip_batch("no columns", &batch, device, stream);
        assert_eq!(on_device.num_rows(), 42);
        assert_eq!(on_device.size_in_bytes(), 0);
        let s = on_device.slice(10, 7).unwrap();
        assert_eq!(dtoh(&s, stream).unwrap().num_rows(), 7);
        assert_eq!(on_device.project(&[]).unwrap().num_rows(), 42);
    });
}

#[test]
fn async_copies_complete_through_events() {
    let expected = every_type_batch();
    each_device(|device, stream| {
        let on_device = {
            // The source may be dropped as soon as htod_async returns.
            let batch = every_type_batch();
            htod_async(&batch, MemoryResource::default_for(device), stream).unwrap()
        };
        assert_eq!(on_device.num_rows(), expected.num_rows());
        on_device.ready().synchronize().unwrap();
        assert!(on_device.ready().is_complete().unwrap());
        // Download on another stream: it must wait on the ready event by itself.
        let other = Stream::new(device).unwrap();
        let pending = dtoh_async(&on_device, &other).unwrap();
        pending.event().synchronize().unwrap();
        assert!(pending.event().is_complete().unwrap());
        check_batch("async", &pending.wait().unwrap(), &expected);

        // Without synchronising anything by hand: the download orders itself after the upload.
        let on_device = htod_async(&expected, MemoryResource::default_for(device), stream).unwrap();
        let back = dtoh_async(&on_device, &Stream::new(device).unwrap())
            .unwrap()
            .wait()
            .unwrap();
        check_batch("async, unsynchronised", &back, &expected);

        // A slice of an async upload.
        let on_device = htod_async(&expected.slice(7, 61), MemoryResource::default_for(device), stream).unwrap();
        let back = dtoh_async(&on_device, stream).unwrap().wait().unwrap();
        check_batch("async slice", &back, &expected.slice(7, 61));
    });
}

#[test]
fn downloads_outlive_the_device_batch() {
    let batch = every_type_batch();
    each_device(|device, stream| {
        let on_device = htod(&batch.slice(3, 100), device, stream).unwrap();
        let pending = dtoh_async(&on_device, stream).unwrap();
        drop(on_device);
        let back = pending.wait().unwrap();
        let array = {
            let on_device = htod_array(batch.column(0).as_ref(), device, stream).unwrap();
            dtoh_array(&on_device, stream).unwrap()
        };
        // Uploads and downloads in between reuse pooled memory; the results must not change.
        for _ in 0..3 {
            let again = htod(&batch, device, stream).unwrap();
            drop(dtoh(&again, stream).unwrap());
        }
        check_batch("after the device batch dropped", &back, &batch.slice(3, 100));
        assert_eq!(array.as_ref(), batch.column(0).as_ref());
    });
}

/// A batch dropped while its upload is still queued (behind a [`Gate`]) lets go of its
/// device memory only once the device is done with it, in every kind of device memory: the stream
/// then finishes without a fault, and the device goes on working.
#[test]
fn batches_dropped_before_their_upload_finished_wait_for_it() {
    let batch = every_type_batch();
    each_device(|device, stream| {
        let Device::Cuda(o) = device else { return };
        let mut resources = vec![MemoryResource::DevicePool(o), MemoryResource::Device(o)];
        if MemoryResource::shared_for(device) == MemoryResource::SharedDevice(o) {
            resources.push(MemoryResource::SharedDevice(o));
        }
        for resource in resources {
            // A round trip first, so that the upload behind the gate finds its staging in the
            // pinned pool (allocating pinned memory can wait for the device, and so for the gate).
            let back = dtoh(&htod_async(&batch, resource, stream).unwrap(), stream).unwrap();
            check_batch(&format!("{resource:?}"), &back, &batch);
            // Each upload is dropped while its copies wait behind a closed gate, which another
            // thread opens soon after: a drop that frees the memory at once must wait for them
            // until then. A driver call of another test that waits for the whole device (freeing
            // memory does) can hold this upload's calls until the gate opens by itself: then
            // the upload is found done when it returns, and this tries again (once in a run of
            // this binary under compute-sanitizer on an H200).
            let held = (0..5).position(|_| {
                let gate = Gate::close(stream, Duration::from_secs(5));
                let on_device = htod_async(&batch, resource, stream).unwrap();
                let queued = !on_device.ready().is_complete().unwrap();
                let opener = gate.open_after(Duration::from_millis(20));
                drop(on_device);
                opener.join().unwrap();
                queued
            });
            let Some(tries) = held else {
                panic!("{resource:?}: every upload behind a closed gate finished before it returned")
            };
            if tries > 0 {
                eprintln!("{resource:?}: an upload held behind the gate at try {}", tries + 1);
            }
            stream.synchronize().unwrap();
            let back = dtoh(&htod_async(&batch, resource, stream).unwrap(), stream).unwrap();
            check_batch(&format!("{resource:?}, after a batch dropped early"), &back, &batch);
        }
    });
}

#[test]
fn from_and_to_record_batch() {
    let batch = every_type_batch();
    each_device(|device, _| {
        let on_device = DeviceRecordBatch::from_record_batch(&batch, device).unwrap();
        assert_eq!(on_device.device(), device);
        assert_eq!(on_device.schema(), &batch.schema());
        check_batch("from_record_batch", &on_device.to_record_batch().unwrap(), &batch);
        let s = batch.slice(33, 44);
        let on_device = DeviceRecordBatch::from_record_batch(&s, device).unwrap();
        check_batch(
            "from_record_batch of a slice",
            &on_device.to_record_batch().unwrap(),
            &s,
        );
    });
}

#[test]
fn device_slice_and_project_match_the_host() {
    let batch = every_type_batch();
    let n = batch.num_columns();
    each_device(|device, stream| {
        let on_device = htod(&batch, device, stream).unwrap();
        for (offset, len) in slice_cuts(batch.num_rows()) {
            let what = format!("device slice {offset}..+{len}");
            let s = on_device.slice(offset, len).unwrap();
            assert_eq!(s.num_rows(), len);
            assert_eq!(s.schema(), on_device.schema());
            check_batch(&what, &dtoh(&s, stream).unwrap(), &batch.slice(offset, len));
        }
        let twice = on_device.slice(5, 120).unwrap().slice(11, 50).unwrap();
        check_batch(
            "device slice of a slice",
            &dtoh(&twice, stream).unwrap(),
            &batch.slice(16, 50),
        );
        assert!(on_device.slice(100, 51).is_err());

        for indices in [
            vec![],
            vec![0],
            vec![n - 1, 0, 3],
            (0..n).rev().collect::<Vec<_>>(),
            vec![2, 2],
        ] {
            let what = format!("project {indices:?}");
            let p = on_device.project(&indices).unwrap();
            assert_eq!(p.num_columns(), indices.len());
            assert_eq!(p.num_rows(), batch.num_rows());
            check_batch(&what, &dtoh(&p, stream).unwrap(), &batch.project(&indices).unwrap());
        }
        assert!(on_device.project(&[n]).is_err());

        let both = on_device.slice(9, 77).unwrap().project(&[40, 1, 5]).unwrap();
        check_batch(
            "slice then project",
            &dtoh(&both, stream).unwrap(),
            &batch.slice(9, 77).project(&[40, 1, 5]).unwrap(),
        );
        let both = on_device.project(&[40, 1, 5]).unwrap().slice(9, 77).unwrap();
        check_batch(
            "project then slice",
            &dtoh(&both, stream).unwrap(),
            &batch.project(&[40, 1, 5]).unwrap().slice(9, 77),
        );

        // A device slice copied again: it uploads the slice only.
        let host = dtoh(&on_device.slice(13, 29).unwrap(), stream).unwrap();
        round_trip_batch("re-upload of a device slice", &host, device, stream);
    });
}

/// Pinned and managed memory as targets, where a GPU exists.
#[test]
fn host_visible_cuda_memory_round_trips() {
    let Some(Device::Cuda(ordinal)) = common::cuda() else {
        return;
    };
    let batch = every_type_batch();
    let stream = Stream::new(Device::Cuda(ordinal)).unwrap();
    for resource in [
        MemoryResource::PinnedHost(ordinal),
        MemoryResource::Managed(ordinal),
        MemoryResource::Device(ordinal),
    ] {
        let on_device = htod_async(&batch, resource, &stream).unwrap();
        assert_eq!(on_device.device(), resource.device());
        let back = dtoh(&on_device, &stream).unwrap();
        check_batch(&format!("{resource:?}"), &back, &batch);
        let back = dtoh(&on_device.slice(3, 71).unwrap(), &Stream::cpu()).unwrap();
        check_batch(&format!("{resource:?}, sliced, CPU stream"), &back, &batch.slice(3, 71));
    }
}

// ---------------------------------------------------------------------------------------------
// Bytes copied in proportion to the slice.

fn big_batch(rows: usize) -> RecordBatch {
    let ints: ArrayRef = Arc::new(Int64Array::from_iter_values(0..rows as i64));
    let strings: ArrayRef = Arc::new(StringArray::from_iter_values(
        (0..rows).map(|i| format!("row number {i}")),
    ));
    let mut lists = ListBuilder::with_capacity(Int32Builder::with_capacity(rows * 3), rows);
    for i in 0..rows {
        lists.values().append_slice(&[i as i32, 1, 2][..i % 4 % 3 + 1]);
        lists.append(i % 10 != 3);
    }
    let lists: ArrayRef = Arc::new(lists.finish());
    RecordBatch::try_from_iter([("ints", ints), ("strings", strings), ("lists", lists)]).unwrap()
}

#[test]
fn slices_copy_bytes_in_proportion() {
    const ROWS: usize = 1_000_000;
    let batch = big_batch(ROWS);
    each_device(|device, stream| {
        for offset in [0, 499_997, ROWS - 10] {
            let s = batch.slice(offset, 10);
            let on_device = htod(&s, device, stream).unwrap();
            assert!(
                on_device.size_in_bytes() < 64 << 10,
                "10 rows at {offset} took {} bytes on {device}",
                on_device.size_in_bytes()
            );
            for c in on_device.columns() {
                for b in c.all_buffers() {
                    assert!(b.len() <= 1024, "a buffer of {} bytes for 10 rows", b.len());
                }
            }
            check_batch("10 rows of a million", &dtoh(&on_device, stream).unwrap(), &s);
            for (i, column) in s.columns().iter().enumerate() {
                let a = htod_array(column.as_ref(), device, stream).unwrap();
                assert!(a.size_in_bytes() < 16 << 10, "column {i}: {} bytes", a.size_in_bytes());
            }
        }
        // The whole batch does take its size: the figure above means something.
        // Larger than one staging chunk: uploads and downloads in several pieces.
        let whole = htod(&batch, device, stream).unwrap();
        assert!(whole.size_in_bytes() > 32 << 20, "{}", whole.size_in_bytes());
        check_batch("a million rows", &dtoh(&whole, stream).unwrap(), &batch);
        let s = dtoh(&whole.slice(123_457, 33).unwrap(), stream).unwrap();
        check_batch("device slice of a million", &s, &batch.slice(123_457, 33));
    });
}

/// `n` mid-sized columns of mixed kinds, sliced so that offsets are rebased and bitmaps shifted.
fn mid_columns(n: usize, rows: usize) -> Vec<(String, ArrayRef)> {
    (0..n)
        .map(|c| {
            let array: ArrayRef = match c % 3 {
                0 => Arc::new(Int64Array::from_iter(
                    (0..rows as i64 + 5).map(|i| (i % 7 != 0).then_some(i * c as i64)),
                )),
                1 => Arc::new(StringArray::from_iter(
                    (0..rows + 5).map(|i| (i % 11 != 0).then(|| format!("{c}-{i}"))),
                )),
                _ => Arc::new(BooleanArray::from_iter(
                    (0..rows + 5).map(|i| (i % 5 != 0).then_some(i % 3 == 0)),
                )),
            };
            (format!("mid{c}"), array.slice(3, rows))
        })
        .collect()
}

/// Batches that take every road of an upload: a couple of hundred KiB of mid-sized columns
/// (packed on the calling thread, in pieces sent one by one), a few MiB of them (packed by pool
/// threads part by part while the batch is planned), the same followed by a column too large for
/// that (packed in chunks after it), and that column in pinned memory (copied straight from it).
#[test]
fn uploads_in_parts_and_chunks_round_trip() {
    const ROWS: usize = 6_000;
    const WIDTH: usize = 1024;
    let mid = mid_columns(60, ROWS);
    let bytes: Vec<u8> = (0..ROWS * WIDTH).map(|i| (i % 251) as u8).collect();
    let big =
        |values: arrow_buffer::Buffer| -> ArrayRef { Arc::new(FixedSizeBinaryArray::new(WIDTH as i32, values, None)) };
    let parts = RecordBatch::try_from_iter(mid.clone()).unwrap();
    let pieces = RecordBatch::try_from_iter(mid_columns(8, ROWS / 2)).unwrap();
    let bytes_of = |b: &RecordBatch| b.get_array_memory_size();
    assert!(
        (128 << 10..256 << 10).contains(&bytes_of(&pieces)),
        "{}",
        bytes_of(&pieces)
    );
    assert!(bytes_of(&parts) > 2 << 20, "{}", bytes_of(&parts));
    let with_big = |values: arrow_buffer::Buffer| {
        let mut columns = mid.clone();
        columns.push(("big".into(), big(values)));
        columns.extend(mid_columns(5, ROWS).into_iter().map(|(n, a)| (format!("after-{n}"), a)));
        RecordBatch::try_from_iter(columns).unwrap()
    };
    let mixed = with_big(arrow_buffer::Buffer::from(bytes.clone()));
    each_device(|device, stream| {
        let back = dtoh(&htod(&pieces, device, stream).unwrap(), stream).unwrap();
        check_batch("pieces", &back, &pieces);
        let back = dtoh(&htod(&parts, device, stream).unwrap(), stream).unwrap();
        check_batch("parts", &back, &parts);
        let back = dtoh(&htod(&mixed, device, stream).unwrap(), stream).unwrap();
        check_batch("parts and chunks", &back, &mixed);
        let Some(ordinal) = device.ordinal() else { return };
        let pool = arrow_cuda::memory::pinned::PinnedPool::shared(MemoryResource::PinnedHost(ordinal)).unwrap();
        let mut block = pool.take(bytes.len()).unwrap();
        block.host_slice_mut().unwrap().copy_from_slice(&bytes);
        let direct = with_big(block.to_arrow_buffer().unwrap());
        let back = dtoh(&htod(&direct, device, stream).unwrap(), stream).unwrap();
        check_batch("parts, chunks and a pinned column", &back, &mixed);
    });
}

/// Uploads of a MiB or more from several threads at once, each on its own stream: the packing
/// threads pack parts of several uploads at a time, each into its own staging, and every batch
/// arrives whole.
#[test]
fn uploads_from_several_threads_at_once_round_trip() {
    const ROWS: usize = 6_000;
    let batches: Vec<RecordBatch> = (0..4)
        .map(|t| {
            let columns = mid_columns(40 + 10 * t, ROWS - 500 * t);
            RecordBatch::try_from_iter(columns).unwrap()
        })
        .collect();
    for b in &batches {
        // Well above what the calling thread packs alone (256 KiB).
        assert!(b.get_array_memory_size() > 1 << 20, "{}", b.get_array_memory_size());
    }
    each_device(|device, _| {
        std::thread::scope(|s| {
            for (t, batch) in batches.iter().enumerate() {
                s.spawn(move || {
                    let stream = Stream::new(device).unwrap();
                    for round in 0..10 {
                        let back = dtoh(&htod(batch, device, &stream).unwrap(), &stream).unwrap();
                        check_batch(&format!("thread {t}, round {round}"), &back, batch);
                    }
                });
            }
        });
    });
}

/// A column that cannot be planned (offsets that run backwards), after megabytes that pool threads
/// are already packing, or after a small batch's other columns: the upload fails with an error,
/// and returns.
#[test]
fn a_column_that_cannot_be_planned_fails_the_upload() {
    const ROWS: usize = 6_000;
    let mut offsets = vec![5i32; ROWS + 1];
    offsets[ROWS] = 2;
    // SAFETY: deliberately invalid offsets; the array is only handed to the upload, which checks
    // them, and never read as strings.
    let bad = unsafe {
        StringArray::new_unchecked(
            OffsetBuffer::new_unchecked(ScalarBuffer::from(offsets)),
            arrow_buffer::Buffer::from(vec![b'x'; 5]),
            None,
        )
    };
    let bad: ArrayRef = Arc::new(bad);
    for before in [60, 3] {
        let mut columns = mid_columns(before, ROWS);
        columns.push(("bad".into(), bad.clone()));
        let batch = RecordBatch::try_from_iter(columns).unwrap();
        each_device(|device, stream| {
            let e = htod(&batch, device, stream).unwrap_err();
            assert!(
                e.to_string().contains("offsets run from 5 to 2"),
                "{device}: {before}: {e}"
            );
        });
    }
}

// ---------------------------------------------------------------------------------------------
// Edge cases built by hand.

#[test]
fn odd_arrays_round_trip() {
    let mut cases: Vec<(&str, ArrayRef)> = vec![
        (
            "empty utf8 without offsets",
            make_array(arrow_data::ArrayData::new_empty(&DataType::Utf8)),
        ),
        (
            "empty list",
            make_array(arrow_data::ArrayData::new_empty(&DataType::List(item(DataType::Int8)))),
        ),
        ("all-null int32", Arc::new(Int32Array::new_null(77))),
        ("all-null utf8", Arc::new(StringArray::new_null(13))),
        (
            "all-null struct",
            new_null_array(
                &every_type_batch()
                    .schema()
                    .field_with_name("struct")
                    .unwrap()
                    .data_type()
                    .clone(),
                19,
            ),
        ),
        (
            "boolean without nulls",
            Arc::new(BooleanArray::from((0..101).map(|i| i % 3 == 0).collect::<Vec<_>>())),
        ),
        (
            "one row",
            Arc::new(StringArray::from(vec!["just one value, longer than twelve bytes"])),
        ),
    ];
    // A list whose offsets do not start at zero (as after a slice in another library).
    let values = Int32Array::from_iter_values(0..50);
    let list = ListArray::new(
        item(DataType::Int32),
        OffsetBuffer::new(ScalarBuffer::from(vec![10, 12, 12, 20, 31])),
        Arc::new(values),
        Some(NullBuffer::from(vec![true, false, true, true])),
    );
    cases.push(("list with offsets from 10", Arc::new(list)));
    // Strings whose values buffer has bytes past the last offset.
    let strings = StringArray::new(
        OffsetBuffer::new(ScalarBuffer::from(vec![3, 5, 9])),
        arrow_buffer::Buffer::from(b"xxxabcdefghijklmnop".to_vec()),
        None,
    );
    cases.push(("utf8 with offsets from 3", Arc::new(strings)));
    // Dictionaries of other key widths with nested values.
    let keys = PrimitiveArray::<UInt8Type>::from(vec![Some(2), None, Some(0), Some(1), Some(2)]);
    let mut b = ListBuilder::new(StringBuilder::new());
    b.append_value([Some("a"), None]);
    b.append_null();
    b.append_value([Some("a rather long string value")]);
    cases.push((
        "dictionary<uint8, list<utf8>>",
        Arc::new(DictionaryArray::try_new(keys, Arc::new(b.finish())).unwrap()),
    ));
    let run_ends = PrimitiveArray::<Int16Type>::from(vec![3, 4, 10]);
    let ree = RunArray::try_new(&run_ends, &Int32Array::from(vec![Some(1), None, Some(3)])).unwrap();
    cases.push(("ree sliced", Arc::new(ree.slice(2, 6))));
    let ree = RunArray::try_new(
        &PrimitiveArray::<Int32Type>::from(vec![1, 2]),
        &BooleanArray::from(vec![true, false]),
    )
    .unwrap();
    cases.push(("ree sliced to nothing", Arc::new(ree.slice(2, 0))));
    each_device(|device, stream| {
        for (name, array) in &cases {
            round_trip_array(name, array, device, stream);
            for (offset, len) in slice_cuts(array.len()) {
                round_trip_array(
                    &format!("{name}[{offset}..+{len}]"),
                    &array.slice(offset, len),
                    device,
                    stream,
                );
            }
        }
    });
}

fn item(data_type: DataType) -> FieldRef {
    Arc::new(Field::new("item", data_type, true))
}

// ---------------------------------------------------------------------------------------------
// Random schemas.

/// A random type: the shape of a column and whether each level may hold nulls.
#[derive(Clone, Debug)]
struct Spec {
    kind: Kind,
    nullable: bool,
}

#[derive(Clone, Debug)]
enum Kind {
    Boolean,
    Int8,
    Int32,
    Int64,
    Float64,
    Decimal128,
    Utf8,
    LargeBinary,
    Utf8View,
    List(Box<Spec>),
    LargeList(Box<Spec>),
    ListView(Box<Spec>),
    FixedSizeList(Box<Spec>, i32),
    Struct(Vec<Spec>),
    Dictionary(Box<Spec>),
}

fn spec_strategy() -> impl Strategy<Value = Spec> {
    let leaf = prop_oneof![
        Just(Kind::Boolean),
        Just(Kind::Int8),
        Just(Kind::Int32),
        Just(Kind::Int64),
        Just(Kind::Float64),
        Just(Kind::Decimal128),
        Just(Kind::Utf8),
        Just(Kind::LargeBinary),
        Just(Kind::Utf8View),
    ];
    let leaf = (leaf, any::<bool>()).prop_map(|(kind, nullable)| Spec { kind, nullable });
    leaf.prop_recursive(3, 16, 3, |inner| {
        let kind = prop_oneof![
            inner.clone().prop_map(|s| Kind::List(Box::new(s))),
            inner.clone().prop_map(|s| Kind::LargeList(Box::new(s))),
            inner.clone().prop_map(|s| Kind::ListView(Box::new(s))),
            (inner.clone(), 1..4i32).prop_map(|(s, n)| Kind::FixedSizeList(Box::new(s), n)),
            prop::collection::vec(inner.clone(), 1..4).prop_map(Kind::Struct),
            inner.prop_map(|s| Kind::Dictionary(Box::new(s))),
        ];
        (kind, any::<bool>()).prop_map(|(kind, nullable)| Spec { kind, nullable })
    })
}

impl Spec {
    fn data_type(&self) -> DataType {
        match &self.kind {
            Kind::Boolean => DataType::Boolean,
            Kind::Int8 => DataType::Int8,
            Kind::Int32 => DataType::Int32,
            Kind::Int64 => DataType::Int64,
            Kind::Float64 => DataType::Float64,
            Kind::Decimal128 => DataType::Decimal128(20, 3),
            Kind::Utf8 => DataType::Utf8,
            Kind::LargeBinary => DataType::LargeBinary,
            Kind::Utf8View => DataType::Utf8View,
            Kind::List(c) => DataType::List(c.field("item")),
            Kind::LargeList(c) => DataType::LargeList(c.field("item")),
            Kind::ListView(c) => DataType::ListView(c.field("item")),
            Kind::FixedSizeList(c, n) => DataType::FixedSizeList(c.field("item"), *n),
            Kind::Struct(cs) => DataType::Struct(Self::fields(cs)),
            Kind::Dictionary(v) => DataType::Dictionary(Box::new(DataType::Int16), Box::new(v.data_type())),
        }
    }

    fn field(&self, name: &str) -> FieldRef {
        Arc::new(Field::new(name, self.data_type(), self.nullable))
    }

    fn fields(cs: &[Spec]) -> Fields {
        cs.iter().enumerate().map(|(i, c)| c.field(&format!("f{i}"))).collect()
    }

    /// A random array of this type and `len` rows.
    fn array(&self, len: usize, rng: &mut StdRng) -> ArrayRef {
        let nulls = self.nullable.then(|| {
            let p = [0.0, 0.1, 0.5, 1.0][rng.random_range(0..4)];
            NullBuffer::from((0..len).map(|_| !rng.random_bool(p)).collect::<Vec<_>>())
        });
        let nulls = nulls.filter(|_| !matches!(self.kind, Kind::Dictionary(_)));
        let text = |rng: &mut StdRng| -> String {
            let n = [0, 3, 12, 13, 40][rng.random_range(0..5)];
            (0..n).map(|_| rng.random_range(b'a'..=b'z') as char).collect()
        };
        match &self.kind {
            Kind::Boolean => Arc::new(BooleanArray::new(
                (0..len).map(|_| rng.random_bool(0.5)).collect(),
                nulls,
            )),
            Kind::Int8 => Arc::new(Int8Array::new((0..len).map(|_| rng.random()).collect(), nulls)),
            Kind::Int32 => Arc::new(Int32Array::new((0..len).map(|_| rng.random()).collect(), nulls)),
            Kind::Int64 => Arc::new(Int64Array::new((0..len).map(|_| rng.random()).collect(), nulls)),
            Kind::Float64 => Arc::new(Float64Array::new(
                (0..len).map(|_| rng.random_range(-1e6..1e6)).collect(),
                nulls,
            )),
            Kind::Decimal128 => Arc::new(
                Decimal128Array::new(
                    (0..len)
                        .map(|_| rng.random_range(-10i128.pow(19)..10i128.pow(19)))
                        .collect(),
                    nulls,
                )
                .with_precision_and_scale(20, 3)
                .unwrap(),
            ),
            Kind::Utf8 => {
                let values: Vec<String> = (0..len).map(|_| text(rng)).collect();
                Arc::new(StringArray::new(
                    OffsetBuffer::from_lengths(values.iter().map(String::len)),
                    arrow_buffer::Buffer::from_vec(values.concat().into_bytes()),
                    nulls,
                ))
            }
            Kind::LargeBinary => {
                let values: Vec<String> = (0..len).map(|_| text(rng)).collect();
                Arc::new(LargeBinaryArray::new(
                    OffsetBuffer::from_lengths(values.iter().map(String::len)),
                    arrow_buffer::Buffer::from_vec(values.concat().into_bytes()),
                    nulls,
                ))
            }
            Kind::Utf8View => {
                let values: Vec<Option<String>> = (0..len)
                    .map(|i| nulls.as_ref().is_none_or(|n| n.is_valid(i)).then(|| text(rng)))
                    .collect();
                let mut b = arrow_array::builder::StringViewBuilder::new().with_fixed_block_size(64);
                for v in values {
                    b.append_option(v);
                }
                Arc::new(b.finish())
            }
            Kind::List(c) | Kind::LargeList(c) => {
                let lengths: Vec<usize> = (0..len).map(|_| rng.random_range(0..4)).collect();
                let values = c.array(lengths.iter().sum(), rng);
                if matches!(self.kind, Kind::List(_)) {
                    Arc::new(ListArray::new(
                        c.field("item"),
                        OffsetBuffer::from_lengths(lengths),
                        values,
                        nulls,
                    ))
                } else {
                    Arc::new(LargeListArray::new(
                        c.field("item"),
                        OffsetBuffer::from_lengths(lengths),
                        values,
                        nulls,
                    ))
                }
            }
            Kind::ListView(c) => {
                let child = rng.random_range(0..2 * len + 3);
                let values = c.array(child, rng);
                let mut offsets = vec![];
                let mut sizes = vec![];
                for _ in 0..len {
                    let size = rng.random_range(0..=child.min(4));
                    offsets.push(rng.random_range(0..=child - size) as i32);
                    sizes.push(size as i32);
                }
                Arc::new(ListViewArray::new(
                    c.field("item"),
                    ScalarBuffer::from(offsets),
                    ScalarBuffer::from(sizes),
                    values,
                    nulls,
                ))
            }
            Kind::FixedSizeList(c, n) => {
                let values = c.array(len * *n as usize, rng);
                Arc::new(FixedSizeListArray::new(c.field("item"), *n, values, nulls))
            }
            Kind::Struct(cs) => {
                let children = cs.iter().map(|c| c.array(len, rng)).collect();
                Arc::new(StructArray::new(Self::fields(cs), children, nulls))
            }
            Kind::Dictionary(v) => {
                // A dictionary's logical nulls include null values: without nulls, the values have none.
                let values = Spec {
                    kind: v.kind.clone(),
                    nullable: v.nullable && self.nullable,
                };
                let values = values.array(rng.random_range(1..8), rng);
                let keys: PrimitiveArray<Int16Type> = (0..len)
                    .map(|_| (!self.nullable || rng.random_bool(0.8)).then(|| rng.random_range(0..values.len() as i16)))
                    .collect();
                Arc::new(DictionaryArray::try_new(keys, values).unwrap())
            }
        }
    }
}

/// A random batch: its columns, rows and seed, and two nested slices of it.
type Case = (Vec<Spec>, usize, u64, (usize, usize), (usize, usize));

fn case_strategy() -> impl Strategy<Value = Case> {
    (
        prop::collection::vec(spec_strategy(), 1..5),
        0..300usize,
        any::<u64>(),
        any::<(usize, usize)>(),
        any::<(usize, usize)>(),
    )
}

fn cut(len: usize, (a, b): (usize, usize)) -> (usize, usize) {
    let offset = a % (len + 1);
    (offset, b % (len - offset + 1))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn random_batches_round_trip((specs, rows, seed, first, second) in case_strategy()) {
        let mut rng = StdRng::seed_from_u64(seed);
        let fields: Vec<FieldRef> = specs.iter().enumerate().map(|(i, s)| s.field(&format!("c{i}"))).collect();
        let columns: Vec<ArrayRef> = specs.iter().map(|s| s.array(rows, &mut rng)).collect();
        let batch = RecordBatch::try_new(Arc::new(Schema::new(fields)), columns).unwrap();
        batch.columns().iter().for_each(|c| c.to_data().validate_full().unwrap());
        let (o1, l1) = cut(rows, first);
        let (o2, l2) = cut(l1, second);
        let once = batch.slice(o1, l1);
        let twice = once.slice(o2, l2);
        each_device(|device, stream| {
            round_trip_batch("random batch", &batch, device, stream);
            let on_device = round_trip_batch("random slice", &once, device, stream);
            round_trip_batch("random slice of a slice", &twice, device, stream);
            let back = dtoh(&on_device.slice(o2, l2).unwrap(), stream).unwrap();
            check_batch("random device slice of a slice", &back, &twice);
            for (i, column) in twice.columns().iter().enumerate() {
                round_trip_array(&format!("column {i}"), column, device, stream);
            }
        });
    }
}
