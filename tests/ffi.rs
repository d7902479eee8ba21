//! The C Device Data Interface: export and import of every type on every device, release
//! semantics, the header fields, malformed input, interop with arrow-rs's own C Data Interface,
//! and device array streams.

mod common;

use std::cell::Cell;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use arrow_array::*;
use arrow_cuda::abi::{DeviceType, FFI_ArrowArray, FFI_ArrowDeviceArray, FFI_ArrowDeviceArrayStream, FFI_ArrowSchema};
use arrow_cuda::ffi::{
    DeviceArrayStreamReader, export_array, export_batch, export_field, export_stream, import_array, import_batch,
    import_schema,
};
use arrow_cuda::transfer::{dtoh, dtoh_array, htod, htod_array};
use arrow_cuda::{Device, DeviceArrayData, DeviceBuffer, DeviceRecordBatch, Error, Event, Stream};
use arrow_schema::{DataType, Field, Fields, Schema, SchemaRef};
use common::c_schema::CSchema;
use common::corpus::{every_type, every_type_batch, slice_cuts, sliced};
use common::{check_batch, each_device, invalid_data};

// ---------------------------------------------------------------------------------------------
// Helpers.

/// Checks the fields of an exported struct that are not the array: device, id, event, reserved.
fn check_header(what: &str, ffi: &FFI_ArrowDeviceArray, data: &DeviceArrayData) {
    let device = data.device();
    assert!(!ffi.is_released(), "{what}: exported struct is released");
    assert_eq!(ffi.device_type, device.device_type(), "{what}: device type");
    assert_eq!(ffi.device_id, device.device_id(), "{what}: device id");
    assert_eq!(ffi.reserved, [0; 3], "{what}: reserved must be zero");
    match device {
        Device::Cpu => {
            assert_eq!(ffi.device_id, -1, "{what}: CPU exports use device id -1");
            assert!(ffi.sync_event.is_null(), "{what}: CPU exports have no sync event");
        }
        _ => {
            assert!(!ffi.sync_event.is_null(), "{what}: a CUDA export needs a sync event");
            // SAFETY: a CUDA export's `sync_event` points at a `CUevent` that lives until release.
            let event = unsafe { *(ffi.sync_event as *const cudarc::driver::sys::CUevent) };
            assert!(!event.is_null(), "{what}: sync_event points at a null CUevent");
            // SAFETY: a valid event, alive until the struct is released.
            unsafe { cudarc::driver::result::event::synchronize(event) }
                .unwrap_or_else(|e| panic!("{what}: the sync event cannot be waited on: {e}"));
        }
    }
    assert_eq!(ffi.array.length, data.len() as i64, "{what}: length");
    assert_eq!(ffi.array.offset, data.offset() as i64, "{what}: offset");
}

/// Exports `data`, checks the header, imports it back and downloads it.
fn through_ffi(what: &str, data: &DeviceArrayData, stream: &Stream) -> arrow_cuda::Result<ArrayRef> {
    let ffi = export_array(data, &Event::completed(), stream)?;
    check_header(what, &ffi, data);
    // SAFETY: a struct that this crate just exported.
    let (imported, ready) = unsafe { import_array(ffi, data.data_type(), stream)? };
    assert_eq!(imported.data_type(), data.data_type(), "{what}");
    assert_eq!(imported.len(), data.len(), "{what}");
    assert_eq!(imported.offset(), data.offset(), "{what}");
    if imported.all_buffers().next().is_some() {
        assert_eq!(imported.device(), data.device(), "{what}: imported on another device");
    }
    stream.wait(&ready)?;
    dtoh_array(&imported, stream)
}

fn check_array(what: &str, back: &ArrayRef, expected: &ArrayRef) {
    back.to_data()
        .validate_full()
        .unwrap_or_else(|e| panic!("{what}: invalid after the round trip: {e}"));
    assert_eq!(back.data_type(), expected.data_type(), "{what}");
    assert_eq!(back.len(), expected.len(), "{what}");
    assert_eq!(back.logical_null_count(), expected.logical_null_count(), "{what}");
    assert_eq!(
        back.as_ref(),
        expected.as_ref(),
        "{what}: the round trip changed the array"
    );
}

/// Exports a batch, checks the header, imports it with the exported schema and downloads it.
fn batch_through_ffi(what: &str, batch: &DeviceRecordBatch, stream: &Stream) -> RecordBatch {
    let (ffi, schema) = export_batch(batch, stream).unwrap_or_else(|e| panic!("{what}: export_batch: {e}"));
    assert!(ffi.device_type == batch.device().device_type(), "{what}: device type");
    assert_eq!(ffi.reserved, [0; 3], "{what}");
    assert_eq!(ffi.array.length, batch.num_rows() as i64, "{what}");
    assert_eq!(ffi.array.n_children, batch.num_columns() as i64, "{what}");
    assert_eq!(ffi.array.null_count, 0, "{what}: a batch's struct has no nulls");
    // SAFETY: a struct and schema that this crate just exported.
    let imported =
        unsafe { import_batch(ffi, &schema, stream) }.unwrap_or_else(|e| panic!("{what}: import_batch: {e}"));
    assert_eq!(imported.schema(), batch.schema(), "{what}: imported schema");
    assert_eq!(imported.num_rows(), batch.num_rows(), "{what}");
    dtoh(&imported, stream).unwrap_or_else(|e| panic!("{what}: dtoh: {e}"))
}

/// A valid CPU export of `array`, for tests to inspect or corrupt.
fn exported(array: &dyn Array) -> FFI_ArrowDeviceArray {
    let data = htod_array(array, Device::Cpu, &Stream::cpu()).expect("htod_array");
    export_array(&data, &Event::completed(), &Stream::cpu()).expect("export_array")
}

/// Imports on the CPU stream.
fn import(ffi: FFI_ArrowDeviceArray, data_type: &DataType) -> arrow_cuda::Result<DeviceArrayData> {
    // SAFETY: every caller hands a struct whose pointers are valid, however wrong its contents.
    unsafe { import_array(ffi, data_type, &Stream::cpu()) }.map(|(data, _)| data)
}

/// Imports and downloads on the CPU.
fn import_and_download(ffi: FFI_ArrowDeviceArray, data_type: &DataType) -> arrow_cuda::Result<ArrayRef> {
    dtoh_array(&import(ffi, data_type)?, &Stream::cpu())
}

/// Asserts that `result` is an error and returns its message.
#[track_caller]
fn error<T: std::fmt::Debug>(what: &str, result: arrow_cuda::Result<T>) -> String {
    match result {
        Ok(v) => panic!("{what}: expected an error, got {v:?}"),
        Err(e) => {
            eprintln!("{what}: {e}");
            e.to_string()
        }
    }
}

/// The `i`th buffer pointer slot of an exported array.
///
/// # Safety
/// `array` must be unreleased and have more than `i` buffers.
unsafe fn buffer_slot(array: &FFI_ArrowArray, i: usize) -> *mut *const c_void {
    assert!((i as i64) < array.n_buffers);
    // SAFETY: in bounds of the buffers array (checked above), valid per the caller.
    unsafe { array.buffers.add(i) }
}

/// The `i`th child of an exported array.
///
/// # Safety
/// `array` must be unreleased and have more than `i` children.
// The child is a separate allocation reached through a raw pointer, not part of `array`.
#[allow(clippy::mut_from_ref)]
unsafe fn child_mut(array: &FFI_ArrowArray, i: usize) -> &mut FFI_ArrowArray {
    assert!((i as i64) < array.n_children);
    // SAFETY: in bounds, and each child is a live boxed struct owned by the parent.
    unsafe { &mut **array.children.add(i) }
}

// ---------------------------------------------------------------------------------------------
// Release counting: the release callback of each instrumented struct is replaced by one that
// counts and then calls the original.

type ReleaseFn = unsafe extern "C" fn(*mut FFI_ArrowArray);

thread_local! {
    static RELEASES: Cell<usize> = const { Cell::new(0) };
    static ORIGINAL_RELEASE: Cell<Option<ReleaseFn>> = const { Cell::new(None) };
    static STREAM_RELEASES: Cell<usize> = const { Cell::new(0) };
    static ORIGINAL_STREAM_RELEASE: Cell<Option<unsafe extern "C" fn(*mut FFI_ArrowDeviceArrayStream)>> =
        const { Cell::new(None) };
}

unsafe extern "C" fn counting_release(array: *mut FFI_ArrowArray) {
    RELEASES.with(|c| c.set(c.get() + 1));
    if let Some(original) = ORIGINAL_RELEASE.with(Cell::get) {
        // SAFETY: the struct is the producer's, and the original callback releases it once.
        unsafe { original(array) }
    }
}

/// Makes `array`'s release count into [`RELEASES`] (on this thread).
fn instrument(array: &mut FFI_ArrowArray) {
    let original = array.release.expect("an unreleased array");
    if original as usize != counting_release as ReleaseFn as usize {
        // Every array this crate exports has the same callback.
        if let Some(previous) = ORIGINAL_RELEASE.with(Cell::get) {
            assert_eq!(previous as usize, original as usize);
        }
        ORIGINAL_RELEASE.with(|o| o.set(Some(original)));
        array.release = Some(counting_release);
    }
}

fn releases() -> usize {
    RELEASES.with(Cell::get)
}

fn reset_releases() {
    RELEASES.with(|c| c.set(0));
}

unsafe extern "C" fn counting_stream_release(stream: *mut FFI_ArrowDeviceArrayStream) {
    STREAM_RELEASES.with(|c| c.set(c.get() + 1));
    if let Some(original) = ORIGINAL_STREAM_RELEASE.with(Cell::get) {
        // SAFETY: the producer's stream, released once by its own callback.
        unsafe { original(stream) }
    }
}

/// An owner of wrapped memory that counts its drops.
struct CountedOwner<T> {
    _data: T,
    drops: Arc<AtomicUsize>,
}

impl<T> Drop for CountedOwner<T> {
    fn drop(&mut self) {
        self.drops.fetch_add(1, Ordering::SeqCst);
    }
}

/// A CPU buffer over `data`, owned by a counting owner.
fn counted_buffer<T: Copy + Send + Sync + 'static>(data: Vec<T>, drops: &Arc<AtomicUsize>) -> DeviceBuffer {
    let address = data.as_ptr() as u64;
    let len = std::mem::size_of_val(data.as_slice());
    let owner = CountedOwner {
        _data: data,
        drops: drops.clone(),
    };
    // SAFETY: the vector's heap memory does not move when the vector does, and the owner keeps it
    // alive and unwritten.
    unsafe { DeviceBuffer::from_raw_parts(address, len, Device::Cpu, owner) }
}

// ---------------------------------------------------------------------------------------------
// Every type, every device, whole and sliced.

#[test]
fn every_type_round_trips() {
    each_device(|device, stream| {
        for (name, array) in every_type() {
            let on_device = htod_array(array.as_ref(), device, stream).unwrap();
            let what = format!("{name} on {device}");
            let back = through_ffi(&what, &on_device, stream).unwrap_or_else(|e| panic!("{what}: {e}"));
            check_array(&what, &back, &array);
        }
    });
}

#[test]
fn every_type_round_trips_sliced_on_the_device() {
    // Device slices keep their offset (bit offsets included) and lose their null count: both
    // travel through the C interface as they are.
    each_device(|device, stream| {
        for (name, array) in every_type() {
            let on_device = htod_array(array.as_ref(), device, stream).unwrap();
            for (offset, len) in slice_cuts(array.len()) {
                let what = format!("{name}[{offset}..+{len}] on {device}");
                let slice = on_device.slice(offset, len).unwrap();
                let back = through_ffi(&what, &slice, stream).unwrap_or_else(|e| panic!("{what}: {e}"));
                check_array(&what, &back, &array.slice(offset, len));
            }
            let what = format!("{name} sliced twice on {device}");
            let twice = on_device.slice(3, 120).unwrap().slice(5, 77).unwrap();
            let back = through_ffi(&what, &twice, stream).unwrap_or_else(|e| panic!("{what}: {e}"));
            check_array(&what, &back, &sliced(&array, &[(3, 120), (5, 77)]));
        }
    });
}

#[test]
fn every_type_round_trips_sliced_on_the_host() {
    each_device(|device, stream| {
        for (name, array) in every_type() {
            for cut in [(1, 100), (13, 0), (9, 1)] {
                let expected = sliced(&array, &[cut]);
                let what = format!("{name} host slice {cut:?} on {device}");
                let on_device = htod_array(expected.as_ref(), device, stream).unwrap();
                let back = through_ffi(&what, &on_device, stream).unwrap_or_else(|e| panic!("{what}: {e}"));
                check_array(&what, &back, &expected);
            }
        }
    });
}

#[test]
fn every_type_batch_round_trips() {
    let batch = every_type_batch();
    assert!(!batch.schema().metadata().is_empty());
    assert!(batch.schema().fields().iter().all(|f| !f.metadata().is_empty()));
    each_device(|device, stream| {
        let on_device = htod(&batch, device, stream).unwrap();
        let back = batch_through_ffi(&format!("batch on {device}"), &on_device, stream);
        check_batch(&format!("batch on {device}"), &back, &batch);
        for (offset, len) in [(7, 100), (1, 1), (64, 86), (3, 0)] {
            let what = format!("batch[{offset}..+{len}] on {device}");
            let back = batch_through_ffi(&what, &on_device.slice(offset, len).unwrap(), stream);
            check_batch(&what, &back, &batch.slice(offset, len));
        }
    });
}

#[test]
fn empty_and_column_less_batches_round_trip() {
    let full = every_type_batch();
    let meta = HashMap::from([("k".to_string(), "v".to_string())]);
    let no_columns = |rows| {
        let schema = Arc::new(Schema::empty().with_metadata(meta.clone()));
        RecordBatch::try_new_with_options(schema, vec![], &RecordBatchOptions::new().with_row_count(Some(rows)))
            .unwrap()
    };
    let cases = [
        ("empty", full.slice(0, 0)),
        ("empty at the end", full.slice(full.num_rows(), 0)),
        ("new_empty", RecordBatch::new_empty(full.schema())),
        ("no columns, 7 rows", no_columns(7)),
        ("no columns, no rows", no_columns(0)),
    ];
    each_device(|device, stream| {
        for (name, batch) in &cases {
            let what = format!("{name} on {device}");
            let on_device = htod(batch, device, stream).unwrap();
            let back = batch_through_ffi(&what, &on_device, stream);
            check_batch(&what, &back, batch);
        }
    });
}

/// A batch of many string, binary and list columns, each with its own data size, imports with the
/// sizes of all of them read in one pass (one batched copy on a GPU): whole, and sliced on the
/// device so that every last offset sits at another position.
#[test]
fn many_variable_width_columns_import_in_one_pass() {
    let rows = 300;
    let columns = (0..72).map(|c| {
        let text = move |i: usize| (!i.is_multiple_of(c % 5 + 2)).then(|| "x".repeat((i * 7 + c * 13) % 41));
        let array: ArrayRef = match c % 4 {
            0 => Arc::new(StringArray::from_iter((0..rows).map(text))),
            1 => Arc::new(LargeStringArray::from_iter((0..rows).map(text))),
            2 => Arc::new(BinaryArray::from_iter(
                (0..rows).map(|i| text(i).map(String::into_bytes)),
            )),
            _ => Arc::new(ListArray::from_iter_primitive::<types::Int32Type, _, _>((0..rows).map(
                |i| text(i).map(|t| (0..t.len() as i32).map(|v| Some(v * c as i32)).collect::<Vec<_>>()),
            ))),
        };
        (format!("c{c}"), array)
    });
    let batch = RecordBatch::try_from_iter(columns).unwrap();
    each_device(|device, stream| {
        let on_device = htod(&batch, device, stream).unwrap();
        let back = batch_through_ffi(&format!("whole on {device}"), &on_device, stream);
        check_batch(&format!("whole on {device}"), &back, &batch);
        for (offset, len) in [(1, 298), (37, 100), (299, 1), (150, 0)] {
            let what = format!("rows {offset}..+{len} on {device}");
            let back = batch_through_ffi(&what, &on_device.slice(offset, len).unwrap(), stream);
            check_batch(&what, &back, &batch.slice(offset, len));
        }
    });
}

/// One export keeps its memory in one block for the whole tree: the memory stays alive until the
/// last of its structs is released, whichever that is, moved-out children included.
#[test]
fn an_export_lives_until_its_last_struct_is_released() {
    let drops = Arc::new(AtomicUsize::new(0));
    let fields = Fields::from(vec![
        Field::new("a", DataType::Int64, false),
        Field::new("b", DataType::Utf8, false),
    ]);
    let make = || {
        let a = counted_buffer(vec![1i64, 2, 3], &drops);
        let b = counted_buffer(b"abcdef".to_vec(), &drops);
        let offsets = counted_buffer(vec![0i32, 2, 2, 6], &drops);
        let children = vec![
            DeviceArrayData::try_new(DataType::Int64, 3, 0, Some(0), None, vec![a], vec![]).unwrap(),
            DeviceArrayData::try_new(DataType::Utf8, 3, 0, Some(0), None, vec![offsets, b], vec![]).unwrap(),
        ];
        let data = DeviceArrayData::try_new(DataType::Struct(fields.clone()), 3, 0, Some(0), None, vec![], children);
        export_array(&data.unwrap(), &Event::completed(), &Stream::cpu()).unwrap()
    };
    // SAFETY: `parent` is an unreleased export with two children; the slot is marked released
    // after the read, as a consumer that moves a child out does.
    let move_out = |parent: &FFI_ArrowDeviceArray, i: usize| unsafe {
        let slot = child_mut(&parent.array, i);
        let moved = std::ptr::read(slot);
        slot.release = None;
        moved
    };
    // The root first, then the children in either order.
    for order in [[0, 1], [1, 0]] {
        drops.store(0, Ordering::SeqCst);
        let parent = make();
        let mut moved = [Some(move_out(&parent, 0)), Some(move_out(&parent, 1))];
        drop(parent);
        assert_eq!(
            drops.load(Ordering::SeqCst),
            0,
            "{order:?}: the moved children hold the memory"
        );
        drop(moved[order[0]].take());
        assert_eq!(
            drops.load(Ordering::SeqCst),
            0,
            "{order:?}: one moved child still holds it"
        );
        // The last one still reads its values.
        let last = moved[order[1]].take().unwrap();
        assert_eq!(last.length, 3);
        drop(last);
        assert_eq!(
            drops.load(Ordering::SeqCst),
            3,
            "{order:?}: freed once, by the last release"
        );
    }
    // A child first, then the root: the root releases the child left in place.
    drops.store(0, Ordering::SeqCst);
    let parent = make();
    drop(move_out(&parent, 1));
    assert_eq!(drops.load(Ordering::SeqCst), 0, "the root and a child hold the memory");
    drop(parent);
    assert_eq!(drops.load(Ordering::SeqCst), 3);
}

/// A batch's exported schema: well-formed for any reader (arrow-rs parses it back to the schema,
/// dictionaries, nesting and metadata included), alive until its last struct is released, and
/// taken back without parsing only while it is as the export wrote it.
#[test]
fn exported_schemas_read_back_and_live_until_their_last_struct_is_released() {
    let batch = htod(&every_type_batch(), Device::Cpu, &Stream::cpu()).unwrap();
    let schema = batch.schema().clone();
    let held = Arc::strong_count(&schema);
    // SAFETY: `root` is an unreleased schema with children; the slot is marked released after the
    // read, as a consumer that moves a child out does.
    let move_out = |root: &FFI_ArrowSchema, i: usize| unsafe {
        let slot = &mut **root.children.add(i);
        let moved = std::ptr::read(slot);
        slot.release = None;
        moved
    };
    let export = || export_batch(&batch, &Stream::cpu()).unwrap().1;
    for _ in 0..2 {
        let c = export();
        assert_eq!(&Schema::try_from(&c).unwrap(), schema.as_ref(), "parsed by arrow-rs");
        // SAFETY: a schema this crate just exported.
        assert_eq!(&unsafe { import_schema(&c) }.unwrap(), schema.as_ref(), "taken back");
    }
    assert_eq!(Arc::strong_count(&schema), held, "every export released");

    // A child moved out: the root no longer imports (it has a released child); the moved child
    // still reads, and the export lives until both are released, in either order.
    for moved_first in [true, false] {
        let root = export();
        let moved = move_out(&root, 1);
        // SAFETY: a schema this crate exported; its moved-out child is marked released.
        let e = error("a schema with a moved-out child", unsafe { import_schema(&root) });
        assert!(e.contains("released"), "{e}");
        assert_eq!(&Field::try_from(&moved).unwrap(), schema.field(1));
        let (first, second) = match moved_first {
            true => (
                Box::new(moved) as Box<dyn std::any::Any>,
                Box::new(root) as Box<dyn std::any::Any>,
            ),
            false => (
                Box::new(root) as Box<dyn std::any::Any>,
                Box::new(moved) as Box<dyn std::any::Any>,
            ),
        };
        drop(first);
        assert_eq!(
            Arc::strong_count(&schema),
            held + 1,
            "one struct still holds the export"
        );
        drop(second);
        assert_eq!(Arc::strong_count(&schema), held, "freed by the last release");
    }

    // A consumer that rewrites a name gets what it wrote: the struct is parsed again.
    let root = export();
    let renamed = std::ffi::CString::new("renamed").unwrap();
    // SAFETY: child 0 of an unreleased export; the new name outlives the import below.
    unsafe { (**root.children).name = renamed.as_ptr() };
    // SAFETY: a well-formed schema.
    let back = unsafe { import_schema(&root) }.unwrap();
    assert_eq!(back.field(0).name(), "renamed");
    assert_eq!(back.fields()[1..], schema.fields()[1..]);
    drop(root);
    drop(renamed);
    assert_eq!(Arc::strong_count(&schema), held);
}

#[test]
fn export_field_carries_the_type_and_metadata() {
    for (name, array) in every_type() {
        let field = Field::new(&name, array.data_type().clone(), true)
            .with_metadata(HashMap::from([("a".to_string(), "b".to_string())]));
        let schema = export_field(&field).unwrap();
        assert_eq!(Field::try_from(&schema).unwrap(), field, "{name}");
    }
}

#[test]
fn time_zones_with_a_nul_byte_are_refused_by_schema_exports() {
    // A C format string cannot hold the NUL ("tss:a\0b"): arrow-rs's conversion unwraps it.
    let zoned = DataType::Timestamp(arrow_schema::TimeUnit::Second, Some("a\0b".into()));
    let nested = DataType::List(Arc::new(Field::new("item", zoned.clone(), true)));
    for data_type in [zoned, nested] {
        let field = Field::new("t", data_type.clone(), true);
        match export_field(&field) {
            Err(Error::InvalidArgument(message)) => assert!(message.contains("NUL"), "{message}"),
            other => panic!("{data_type}: expected InvalidArgument, got {other:?}"),
        }
        let schema = Arc::new(Schema::new(vec![field]));
        let empty = RecordBatch::new_empty(schema.clone());
        let batch = htod(&empty, Device::Cpu, &Stream::cpu()).unwrap();
        match export_batch(&batch, &Stream::cpu()) {
            Err(Error::InvalidArgument(message)) => assert!(message.contains("NUL"), "{message}"),
            other => panic!(
                "batch of {}: expected InvalidArgument, got {:?}",
                schema.field(0),
                other.err()
            ),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The header: device, id, sync_event, reserved.

#[test]
fn header_fields_follow_the_spec() {
    each_device(|device, stream| {
        let array: ArrayRef = Arc::new(Int32Array::from(vec![Some(1), None, Some(3)]));
        let data = htod_array(array.as_ref(), device, stream).unwrap();
        let ffi = export_array(&data, &Event::completed(), stream).unwrap();
        check_header(&format!("int32 on {device}"), &ffi, &data);
        match device {
            Device::Cpu => assert!(ffi.sync_event.is_null() && ffi.device_id == -1),
            _ => assert!(!ffi.sync_event.is_null() && ffi.device_id == device.device_id()),
        }
        // An event recorded after earlier work: the export waits for it.
        let ready = stream.record().unwrap();
        let ffi2 = export_array(&data, &ready, stream).unwrap();
        check_header(&format!("int32 after an event on {device}"), &ffi2, &data);
        for ffi in [ffi, ffi2] {
            // SAFETY: just exported.
            let (imported, ready) = unsafe { import_array(ffi, &DataType::Int32, stream) }.unwrap();
            stream.wait(&ready).unwrap();
            check_array("header", &dtoh_array(&imported, stream).unwrap(), &array);
        }
    });
}

#[test]
fn cpu_imports_accept_device_id_zero_and_any_reserved() {
    let array: ArrayRef = Arc::new(StringArray::from(vec![Some("a"), None, Some("a longer string")]));
    for (device_id, reserved) in [
        (-1, [0; 3]),
        (0, [0; 3]),
        (-1, [1, -2, i64::MAX]),
        (0, [i64::MIN, 7, 0]),
    ] {
        let mut ffi = exported(array.as_ref());
        ffi.device_id = device_id;
        ffi.reserved = reserved;
        let what = format!("device id {device_id}, reserved {reserved:?}");
        let back = import_and_download(ffi, array.data_type()).unwrap_or_else(|e| panic!("{what}: {e}"));
        check_array(&what, &back, &array);
    }
    let mut ffi = exported(array.as_ref());
    ffi.device_id = 1;
    error("CPU device id 1", import(ffi, array.data_type()));
}

// ---------------------------------------------------------------------------------------------
// Release semantics.

#[test]
fn exported_memory_lives_until_the_last_imported_view_drops() {
    let values_drops = Arc::new(AtomicUsize::new(0));
    let nulls_drops = Arc::new(AtomicUsize::new(0));
    let values = counted_buffer(vec![10i32, 20, 30, 40, 50], &values_drops);
    let nulls = counted_buffer(vec![0b0001_1011u8], &nulls_drops);
    let (values_at, nulls_at) = (values.address(), nulls.address());
    let data = DeviceArrayData::try_new(DataType::Int32, 5, 0, Some(1), Some(nulls), vec![values], vec![]).unwrap();
    let expected: ArrayRef = Arc::new(Int32Array::from(vec![Some(10), Some(20), None, Some(40), Some(50)]));
    let ffi = export_array(&data, &Event::completed(), &Stream::cpu()).unwrap();
    drop(data);
    assert_eq!(values_drops.load(Ordering::SeqCst), 0, "the export keeps the memory");
    let imported = import(ffi, &DataType::Int32).unwrap();
    // The imported buffers are the producer's, each as an allocation of its own: nothing of the
    // memory between them is reachable.
    let (values, nulls) = (&imported.buffers()[0], imported.nulls().unwrap());
    assert_eq!((values.address(), values.len()), (values_at, 20));
    assert_eq!((nulls.address(), nulls.len()), (nulls_at, 1));
    assert!(!values.shares_allocation(nulls));
    for b in [values, nulls] {
        assert!(b.parent().is_none());
        assert_eq!(b.offset(), 0);
    }
    let slice = imported.slice(1, 3).unwrap();
    let clone = imported.clone();
    let host = dtoh_array(&imported, &Stream::cpu()).unwrap();
    check_array("counted", &host, &expected);
    drop(host);
    drop(imported);
    drop(clone);
    assert_eq!(values_drops.load(Ordering::SeqCst), 0, "a slice still views the memory");
    assert_eq!(nulls_drops.load(Ordering::SeqCst), 0);
    check_array(
        "counted slice",
        &dtoh_array(&slice, &Stream::cpu()).unwrap(),
        &expected.slice(1, 3),
    );
    drop(slice);
    assert_eq!(
        values_drops.load(Ordering::SeqCst),
        1,
        "released exactly once after the last view"
    );
    assert_eq!(nulls_drops.load(Ordering::SeqCst), 1);
}

#[test]
fn dropping_an_export_frees_its_memory_once() {
    let drops = Arc::new(AtomicUsize::new(0));
    let a = counted_buffer(vec![1i64, 2, 3], &drops);
    let b = counted_buffer(b"abcdef".to_vec(), &drops);
    let b_offsets = counted_buffer(vec![0i32, 2, 2, 6], &drops);
    let fields = Fields::from(vec![
        Field::new("a", DataType::Int64, false),
        Field::new("b", DataType::Utf8, false),
    ]);
    let child_a = DeviceArrayData::try_new(DataType::Int64, 3, 0, Some(0), None, vec![a], vec![]).unwrap();
    let child_b = DeviceArrayData::try_new(DataType::Utf8, 3, 0, Some(0), None, vec![b_offsets, b], vec![]).unwrap();
    let data = DeviceArrayData::try_new(
        DataType::Struct(fields),
        3,
        0,
        Some(0),
        None,
        vec![],
        vec![child_a, child_b],
    )
    .unwrap();
    // Dropped unimported.
    let ffi = export_array(&data, &Event::completed(), &Stream::cpu()).unwrap();
    drop(ffi);
    assert_eq!(drops.load(Ordering::SeqCst), 0, "the original still holds the memory");
    // Handed to arrow-rs, which releases it when its last buffer drops.
    let ffi = export_array(&data, &Event::completed(), &Stream::cpu()).unwrap();
    let schema = export_field(&Field::new("s", data.data_type().clone(), false)).unwrap();
    drop(data);
    assert_eq!(drops.load(Ordering::SeqCst), 0);
    // SAFETY: a CPU export and its schema.
    let host = make_array(unsafe { arrow_array::ffi::from_ffi(ffi.array, &schema) }.unwrap());
    host.to_data().validate_full().unwrap();
    let s = host.as_any().downcast_ref::<StructArray>().unwrap();
    assert_eq!(
        s.column(1).as_any().downcast_ref::<StringArray>().unwrap().value(2),
        "cdef"
    );
    assert_eq!(drops.load(Ordering::SeqCst), 0);
    drop(host);
    assert_eq!(drops.load(Ordering::SeqCst), 3, "each owner released exactly once");
}

#[test]
fn imports_release_the_producer_exactly_once() {
    for (name, array) in every_type() {
        reset_releases();
        let mut ffi = exported(array.as_ref());
        instrument(&mut ffi.array);
        let mut structs = 1;
        for i in 0..ffi.array.n_children as usize {
            // SAFETY: an unreleased export with that many children.
            instrument(unsafe { child_mut(&ffi.array, i) });
            structs += 1;
        }
        // SAFETY: the dictionary of an unreleased export is a live struct.
        if let Some(dictionary) = unsafe { ffi.array.dictionary.as_mut() } {
            instrument(dictionary);
            structs += 1;
        }
        let imported = import(ffi, array.data_type()).unwrap();
        let clone = imported.clone();
        let slice = imported.slice(1, 5).unwrap();
        let host = dtoh_array(&imported, &Stream::cpu()).unwrap();
        check_array(&name, &host, &array);
        let has_buffers = imported.all_buffers().next().is_some();
        drop(imported);
        drop(clone);
        if has_buffers {
            assert_eq!(releases(), 0, "{name}: released while a slice is alive");
        } else {
            // Nothing to keep alive: released at once.
            assert_eq!(releases(), structs, "{name}: an import without buffers");
        }
        check_array(&name, &dtoh_array(&slice, &Stream::cpu()).unwrap(), &array.slice(1, 5));
        drop(slice);
        assert_eq!(releases(), structs, "{name}: every struct released exactly once");
        // The host copy owns its memory.
        check_array(&name, &host, &array);
    }
}

#[test]
fn batch_imports_release_the_producer_exactly_once() {
    let batch = every_type_batch();
    reset_releases();
    let on_device = htod(&batch, Device::Cpu, &Stream::cpu()).unwrap();
    let (mut ffi, schema) = export_batch(&on_device, &Stream::cpu()).unwrap();
    instrument(&mut ffi.array);
    // SAFETY: just exported.
    let imported = unsafe { import_batch(ffi, &schema, &Stream::cpu()) }.unwrap();
    let column = imported.column(3).clone();
    let back = dtoh(&imported, &Stream::cpu()).unwrap();
    drop(imported);
    assert_eq!(releases(), 0, "a column still views the import");
    drop(column);
    assert_eq!(releases(), 1);
    check_batch("batch", &back, &batch);
}

#[test]
fn children_moved_out_are_released_once() {
    let array = every_type().into_iter().find(|(n, _)| n == "struct").unwrap().1;
    let s = array.as_any().downcast_ref::<StructArray>().unwrap();
    reset_releases();
    let mut parent = exported(array.as_ref());
    assert_eq!(parent.array.n_children, 3);
    instrument(&mut parent.array);
    for i in 0..3 {
        // SAFETY: an unreleased export with three children.
        instrument(unsafe { child_mut(&parent.array, i) });
    }
    // Move child 1 out, as a consumer may (arrow C++ does), leaving a released struct behind.
    // SAFETY: child 1 is a live struct; after the read, its old place is marked released so the
    // parent does not release it again.
    let moved = unsafe {
        let slot = child_mut(&parent.array, 1);
        let moved = std::ptr::read(slot);
        slot.release = None;
        moved
    };
    // Importing the parent now fails (a released child) and releases the parent and the children
    // still in it.
    let parent_type = array.data_type().clone();
    let e = error("parent with a moved-out child", import(parent, &parent_type));
    assert!(e.contains("released"), "{e}");
    assert_eq!(releases(), 3, "parent and the two children left in it");
    // The moved child keeps its memory and imports on its own.
    let moved = FFI_ArrowDeviceArray {
        array: moved,
        device_id: -1,
        device_type: DeviceType::CPU,
        sync_event: std::ptr::null_mut(),
        reserved: [0; 3],
    };
    let child_type = s.column(1).data_type().clone();
    let back = import_and_download(moved, &child_type).unwrap();
    check_array("moved child", &back, s.column(1));
    assert_eq!(releases(), 4, "the moved child released once, by its new owner");
}

#[test]
fn failed_imports_release_once() {
    let array: ArrayRef = Arc::new(Int32Array::from(vec![1, 2, 3]));
    reset_releases();
    let mut ffi = exported(array.as_ref());
    instrument(&mut ffi.array);
    error("Int32 as Utf8", import(ffi, &DataType::Utf8));
    assert_eq!(releases(), 1);
    let mut ffi = exported(array.as_ref());
    instrument(&mut ffi.array);
    ffi.device_type = DeviceType(99);
    error("unknown device", import(ffi, &DataType::Int32));
    assert_eq!(releases(), 2);
}

// ---------------------------------------------------------------------------------------------
// Malformed input: errors, never crashes. Each case corrupts a valid CPU export; its own release
// callback frees it, whatever was changed (it keeps its own copies of every pointer).

#[test]
fn released_structs_are_refused() {
    error("empty", import(FFI_ArrowDeviceArray::empty(), &DataType::Int32));
    let mut ffi = exported(&Int32Array::from(vec![1]));
    // SAFETY: take the array out as a consumer would, leaving a released struct.
    let taken = unsafe { FFI_ArrowDeviceArray::from_raw(&mut ffi) };
    assert!(ffi.is_released());
    error("moved out", import(ffi, &DataType::Int32));
    import(taken, &DataType::Int32).unwrap();
    let schema = FFI_ArrowSchema::try_from(&Schema::new(vec![Field::new("x", DataType::Int32, true)])).unwrap();
    // SAFETY: a released struct; nothing is read past the check.
    error("released batch", unsafe {
        import_batch(FFI_ArrowDeviceArray::empty(), &schema, &Stream::cpu())
    });
}

/// Empty buffers may point anywhere that is not null (Rust producers hand out dangling pointers
/// such as `0x1` and `0x8`); they import as empty views, and a null one takes an aligned address.
#[test]
fn empty_buffers_at_any_address_import() {
    let cases: [(ArrayRef, usize, u64); 3] = [
        (Arc::new(Int64Array::from(Vec::<i64>::new())), 1, 0x8),
        (Arc::new(StringArray::from(Vec::<&str>::new())), 2, 0x1),
        (Arc::new(StringArray::from(Vec::<&str>::new())), 2, 0),
    ];
    for (array, slot, address) in cases {
        let what = format!("{} with buffer {slot} at {address:#x}", array.data_type());
        let ffi = exported(array.as_ref());
        // SAFETY: both types have more than `slot` buffers.
        unsafe { *buffer_slot(&ffi.array, slot) = address as *const c_void };
        let data = import(ffi, array.data_type()).unwrap_or_else(|e| panic!("{what}: {e}"));
        let buffer = &data.buffers()[slot - 1];
        assert!(buffer.is_empty(), "{what}");
        let expected = if address == 0 { 64 } else { address };
        assert_eq!(buffer.address(), expected, "{what}");
        let back = dtoh_array(&data, &Stream::cpu()).unwrap_or_else(|e| panic!("{what}: {e}"));
        check_array(&what, &back, &array);
    }
}

#[test]
fn missing_buffers_are_refused() {
    let int32 = Int32Array::from(vec![1, 2, 3, 4, 5]);
    let ffi = exported(&int32);
    // SAFETY: Int32 has two buffers.
    unsafe { *buffer_slot(&ffi.array, 1) = std::ptr::null() };
    error("Int32 without values", import(ffi, &DataType::Int32));

    // Nulls counted but no bitmap.
    let with_nulls = Int32Array::from(vec![Some(1), None, None]);
    let ffi = exported(&with_nulls);
    // SAFETY: as above.
    unsafe { *buffer_slot(&ffi.array, 0) = std::ptr::null() };
    error("nulls without a bitmap", import(ffi, &DataType::Int32));

    // A null buffers array.
    let mut ffi = exported(&int32);
    ffi.array.buffers = std::ptr::null_mut();
    error("null buffers array", import(ffi, &DataType::Int32));

    let strings = StringArray::from(vec!["abc", "de"]);
    for slot in [1, 2] {
        let ffi = exported(&strings);
        // SAFETY: Utf8 has three buffers.
        unsafe { *buffer_slot(&ffi.array, slot) = std::ptr::null() };
        error(&format!("Utf8 without buffer {slot}"), import(ffi, &DataType::Utf8));
    }

    // A null child, through a children array of our own (the release uses its own copy).
    let s = StructArray::from(vec![(
        Arc::new(Field::new("a", DataType::Int32, false)),
        Arc::new(int32.clone()) as ArrayRef,
    )]);
    let mut ffi = exported(&s);
    let mut children = [std::ptr::null_mut::<FFI_ArrowArray>()];
    ffi.array.children = children.as_mut_ptr();
    error("null child", import(ffi, s.data_type()));
    let mut ffi = exported(&s);
    ffi.array.children = std::ptr::null_mut();
    error("null children array", import(ffi, s.data_type()));

    // A dictionary without its dictionary.
    let dict: DictionaryArray<arrow_array::types::Int32Type> = vec!["a", "b", "a"].into_iter().collect();
    let mut ffi = exported(&dict);
    ffi.array.dictionary = std::ptr::null_mut();
    error("dictionary without values", import(ffi, dict.data_type()));
}

#[test]
fn wrong_buffer_and_child_counts_are_refused() {
    let int32 = Int32Array::from(vec![1, 2, 3, 4, 5]);
    for n in [0, 1] {
        let mut ffi = exported(&int32);
        ffi.array.n_buffers = n;
        error(&format!("Int32 with {n} buffers"), import(ffi, &DataType::Int32));
    }
    // More buffers than the type has, through a buffers array of our own.
    let extra = [0u8; 64];
    let mut ffi = exported(&int32);
    // SAFETY: Int32 has two buffers.
    let mut buffers = unsafe {
        [
            *buffer_slot(&ffi.array, 0),
            *buffer_slot(&ffi.array, 1),
            extra.as_ptr() as *const c_void,
        ]
    };
    ffi.array.buffers = buffers.as_mut_ptr();
    ffi.array.n_buffers = 3;
    error("Int32 with 3 buffers", import(ffi, &DataType::Int32));
    // Children where there are none.
    let mut ffi = exported(&int32);
    ffi.array.n_children = 1;
    let child = exported(&int32);
    let mut children = [&child.array as *const FFI_ArrowArray as *mut FFI_ArrowArray];
    ffi.array.children = children.as_mut_ptr();
    error("Int32 with a child", import(ffi, &DataType::Int32));
    drop(child);

    let s = StructArray::from(vec![
        (
            Arc::new(Field::new("a", DataType::Int32, false)),
            Arc::new(int32.clone()) as ArrayRef,
        ),
        (
            Arc::new(Field::new("b", DataType::Utf8, false)),
            Arc::new(StringArray::from(vec!["x"; 5])) as ArrayRef,
        ),
    ]);
    for n in [0, 1] {
        let mut ffi = exported(&s);
        ffi.array.n_children = n;
        error(&format!("struct with {n} children"), import(ffi, s.data_type()));
    }
    // A child with a wrong buffer count.
    let ffi = exported(&s);
    // SAFETY: the struct has two children.
    unsafe { child_mut(&ffi.array, 1).n_buffers = 2 };
    error("Utf8 child with 2 buffers", import(ffi, s.data_type()));
    // A child shorter than the struct.
    let ffi = exported(&s);
    // SAFETY: as above.
    unsafe { child_mut(&ffi.array, 0).length = 4 };
    error("short struct child", import(ffi, s.data_type()));
    // A view array without its sizes buffer.
    let views = StringViewArray::from(vec!["a string longer than twelve bytes", "short"]);
    let mut ffi = exported(&views);
    ffi.array.n_buffers = 2;
    error("view array with 2 buffers", import(ffi, views.data_type()));
    // Lists without their child.
    let list = ListArray::from_iter_primitive::<arrow_array::types::Int32Type, _, _>(vec![Some(vec![Some(1)])]);
    let mut ffi = exported(&list);
    ffi.array.n_children = 0;
    error("list without a child", import(ffi, list.data_type()));
}

#[test]
fn bad_lengths_offsets_and_null_counts_are_refused() {
    let int32 = Int32Array::from(vec![Some(1), None, Some(3), Some(4), None]);
    type Corrupt = fn(&mut FFI_ArrowArray);
    let cases: [(&str, Corrupt); 11] = [
        ("negative length", |a| a.length = -1),
        ("negative offset", |a| a.offset = -3),
        ("null count below -1", |a| a.null_count = -2),
        ("null count above the length", |a| a.null_count = 6),
        ("negative buffer count", |a| a.n_buffers = -1),
        ("negative child count", |a| a.n_children = -1),
        ("length + offset overflows", |a| {
            a.length = i64::MAX;
            a.offset = i64::MAX;
        }),
        ("length + offset overflows by one", |a| {
            a.length = i64::MAX;
            a.offset = 1;
        }),
        ("huge length", |a| a.length = i64::MAX),
        ("huge offset", |a| a.offset = i64::MAX - 5),
        ("byte size overflows", |a| a.length = 1 << 61),
    ];
    for (what, corrupt) in cases {
        let mut ffi = exported(&int32);
        corrupt(&mut ffi.array);
        error(what, import(ffi, &DataType::Int32));
    }
    // The same on a child.
    let s = StructArray::from(vec![(
        Arc::new(Field::new("a", DataType::Int32, true)),
        Arc::new(int32.clone()) as ArrayRef,
    )]);
    for (what, corrupt) in cases {
        let ffi = exported(&s);
        // SAFETY: the struct has one child.
        corrupt(unsafe { child_mut(&ffi.array, 0) });
        error(&format!("child: {what}"), import(ffi, s.data_type()));
    }
    // Nested deeper than the importer allows.
    let mut deep: ArrayRef = Arc::new(Int32Array::from(vec![1]));
    for _ in 0..80 {
        let f = Arc::new(Field::new("x", deep.data_type().clone(), false));
        deep = Arc::new(StructArray::from(vec![(f, deep)]));
    }
    let ffi = exported(deep.as_ref());
    error("80 levels of structs", import(ffi, deep.data_type()));
}

#[test]
fn a_schema_that_disagrees_with_the_buffers_is_refused() {
    let int32 = Int32Array::from(vec![1, 2, 3, 4, 5]);
    let int_field = Arc::new(Field::new("a", DataType::Int32, true));
    let wrong_types = [
        DataType::Utf8,
        DataType::LargeBinary,
        DataType::Utf8View,
        DataType::Struct(Fields::from(vec![int_field.as_ref().clone()])),
        DataType::List(int_field.clone()),
        DataType::ListView(int_field.clone()),
        DataType::FixedSizeList(int_field.clone(), 1),
        DataType::Dictionary(Box::new(DataType::Int32), Box::new(DataType::Utf8)),
        DataType::Dictionary(Box::new(DataType::Float32), Box::new(DataType::Utf8)),
        DataType::Null,
        DataType::RunEndEncoded(
            Arc::new(Field::new("run_ends", DataType::Int32, false)),
            Arc::new(Field::new("values", DataType::Int32, true)),
        ),
        DataType::Union(
            arrow_schema::UnionFields::try_new(vec![0], vec![int_field.as_ref().clone()]).unwrap(),
            arrow_schema::UnionMode::Sparse,
        ),
    ];
    for dt in wrong_types {
        error(&format!("Int32 as {dt}"), import(exported(&int32), &dt));
    }
    // A string array read as other things.
    let strings = StringArray::from(vec!["abc", "de"]);
    // (As Utf8View it would pass the checks: three buffers, the last read as the sizes of none.)
    for dt in [
        DataType::Int32,
        DataType::Boolean,
        DataType::Struct(Fields::empty()),
        DataType::List(int_field.clone()),
    ] {
        error(&format!("Utf8 as {dt}"), import(exported(&strings), &dt));
    }

    // Batches with a schema that does not match the exported struct.
    let batch = RecordBatch::try_from_iter([("a", Arc::new(int32) as ArrayRef)]).unwrap();
    let on_device = htod(&batch, Device::Cpu, &Stream::cpu()).unwrap();
    let schemas = [
        Schema::new(vec![Field::new("a", DataType::Utf8, true)]),
        Schema::new(vec![
            Field::new("a", DataType::Int32, true),
            Field::new("b", DataType::Int32, true),
        ]),
        Schema::empty(),
    ];
    for schema in schemas {
        let (ffi, _) = export_batch(&on_device, &Stream::cpu()).unwrap();
        let schema_ffi = FFI_ArrowSchema::try_from(&schema).unwrap();
        // SAFETY: a valid export; only its type disagrees.
        error(&format!("batch as {schema}"), unsafe {
            import_batch(ffi, &schema_ffi, &Stream::cpu())
        });
    }
    // A batch whose struct has nulls.
    let (mut ffi, schema) = export_batch(&on_device, &Stream::cpu()).unwrap();
    ffi.array.null_count = 1;
    // SAFETY: a valid export with a corrupt null count.
    error("batch with null rows", unsafe {
        import_batch(ffi, &schema, &Stream::cpu())
    });
}

#[test]
fn unknown_or_absent_devices_are_refused() {
    let int32 = Int32Array::from(vec![1, 2, 3]);
    for device_type in [
        DeviceType(99),
        DeviceType(0),
        DeviceType(-1),
        DeviceType::OPENCL,
        DeviceType::METAL,
        DeviceType::ROCM,
    ] {
        let mut ffi = exported(&int32);
        ffi.device_type = device_type;
        let e = error(&format!("device type {device_type}"), import(ffi, &DataType::Int32));
        assert!(e.contains(&device_type.to_string()), "{e}");
    }
    // CUDA device ids that do not exist (on any machine), and CUDA without a GPU.
    for (device_type, id) in [
        (DeviceType::CUDA, 4096),
        (DeviceType::CUDA, -1),
        (DeviceType::CUDA_HOST, 4096),
        (DeviceType::CUDA_MANAGED, -7),
    ] {
        let mut ffi = exported(&int32);
        ffi.device_type = device_type;
        ffi.device_id = id;
        error(&format!("{device_type} device {id}"), import(ffi, &DataType::Int32));
        // With a CUDA stream too, where there is one.
        if let Some(gpu) = common::cuda() {
            let mut ffi = exported(&int32);
            ffi.device_type = device_type;
            ffi.device_id = id;
            let stream = Stream::new(gpu).unwrap();
            // SAFETY: valid pointers; the device is wrong.
            error(&format!("{device_type} device {id} on a CUDA stream"), unsafe {
                import_array(ffi, &DataType::Int32, &stream)
            });
        }
    }
    if !arrow_cuda::device::cuda_available() {
        let mut ffi = exported(&int32);
        ffi.device_type = DeviceType::CUDA;
        ffi.device_id = 0;
        error("CUDA without a GPU", import(ffi, &DataType::Int32));
    }
}

#[test]
fn offsets_past_the_data_are_errors_not_crashes() {
    // offsets [0, 100, 5] with 5 bytes of data: the last offset fits, the middle one does not.
    let strings = StringArray::from(vec!["ab", "cde"]);
    let offsets = [0i32, 100, 5];
    let ffi = exported(&strings);
    // SAFETY: Utf8 has three buffers; `offsets` outlives the imported array.
    unsafe { *buffer_slot(&ffi.array, 1) = offsets.as_ptr() as *const c_void };
    error("Utf8 offsets [0, 100, 5]", import_and_download(ffi, &DataType::Utf8));

    let large = LargeStringArray::from(vec!["ab", "cde"]);
    let large_offsets = [0i64, 100, 5];
    let ffi = exported(&large);
    // SAFETY: as above.
    unsafe { *buffer_slot(&ffi.array, 1) = large_offsets.as_ptr() as *const c_void };
    error(
        "LargeUtf8 offsets [0, 100, 5]",
        import_and_download(ffi, &DataType::LargeUtf8),
    );

    // Decreasing, and a negative last offset.
    for bad in [[3i32, 1, 5], [0, 2, -1], [-4, 2, 5]] {
        let ffi = exported(&strings);
        // SAFETY: as above.
        unsafe { *buffer_slot(&ffi.array, 1) = bad.as_ptr() as *const c_void };
        error(
            &format!("Utf8 offsets {bad:?}"),
            import_and_download(ffi, &DataType::Utf8),
        );
    }

    // Invalid UTF-8 in a string array.
    let bytes = *b"ab\xffde";
    let ffi = exported(&strings);
    // SAFETY: as above; `bytes` outlives the import.
    unsafe { *buffer_slot(&ffi.array, 2) = bytes.as_ptr() as *const c_void };
    error("invalid UTF-8", import_and_download(ffi, &DataType::Utf8));

    // List offsets past the child.
    let list = ListArray::from_iter_primitive::<arrow_array::types::Int32Type, _, _>(vec![
        Some(vec![Some(1), Some(2)]),
        Some(vec![Some(3)]),
    ]);
    let list_offsets = [0i32, 100, 3];
    let ffi = exported(&list);
    // SAFETY: a list has two buffers.
    unsafe { *buffer_slot(&ffi.array, 1) = list_offsets.as_ptr() as *const c_void };
    error("list offsets [0, 100, 3]", import_and_download(ffi, list.data_type()));

    // Dictionary keys past the dictionary.
    let dict: DictionaryArray<arrow_array::types::Int32Type> = vec!["a", "b", "a"].into_iter().collect();
    let keys = [0i32, 7, 1];
    let ffi = exported(&dict);
    // SAFETY: a dictionary array has two buffers.
    unsafe { *buffer_slot(&ffi.array, 1) = keys.as_ptr() as *const c_void };
    error("dictionary key 7 of 2", import_and_download(ffi, dict.data_type()));

    // Views into data buffers shorter than they claim.
    let views = StringViewArray::from(vec!["a string longer than twelve bytes", "short"]);
    let mut ffi = exported(&views);
    assert_eq!(ffi.array.n_buffers, 4);
    let sizes = [4i64];
    // SAFETY: validity, views, one data buffer and the sizes; `sizes` outlives the import.
    let mut buffers = unsafe {
        [
            *buffer_slot(&ffi.array, 0),
            *buffer_slot(&ffi.array, 1),
            *buffer_slot(&ffi.array, 2),
            sizes.as_ptr() as *const c_void,
        ]
    };
    ffi.array.buffers = buffers.as_mut_ptr();
    error("views past their data", import_and_download(ffi, views.data_type()));

    // A view naming a data buffer that does not exist.
    let mut ffi = exported(&views);
    // SAFETY: as above, with the data buffer dropped from the count.
    let mut buffers = unsafe {
        [
            *buffer_slot(&ffi.array, 0),
            *buffer_slot(&ffi.array, 1),
            *buffer_slot(&ffi.array, 3),
        ]
    };
    ffi.array.buffers = buffers.as_mut_ptr();
    ffi.array.n_buffers = 3;
    error("views of a missing buffer", import_and_download(ffi, views.data_type()));

    // Union type ids that are not in the type.
    let union = every_type().into_iter().find(|(n, _)| n == "sparse_union").unwrap().1;
    let ids = vec![5i8; union.len()];
    let ffi = exported(union.as_ref());
    // SAFETY: a sparse union has one buffer, the type ids; `ids` outlives the import.
    unsafe { *buffer_slot(&ffi.array, 0) = ids.as_ptr() as *const c_void };
    error("union type id 5", import_and_download(ffi, union.data_type()));

    // Dense union offsets past a child.
    let dense = every_type().into_iter().find(|(n, _)| n == "dense_union").unwrap().1;
    let big = vec![1000i32; dense.len()];
    let ffi = exported(dense.as_ref());
    // SAFETY: a dense union has two buffers; `big` outlives the import.
    unsafe { *buffer_slot(&ffi.array, 1) = big.as_ptr() as *const c_void };
    error(
        "dense union offsets past the children",
        import_and_download(ffi, dense.data_type()),
    );
}

/// Imports a valid one-column CPU batch with `schema` in place of its own schema.
fn import_with_schema(schema: &FFI_ArrowSchema) -> arrow_cuda::Result<DeviceRecordBatch> {
    let batch = RecordBatch::try_from_iter([("x", Arc::new(Int32Array::from(vec![1, 2])) as ArrayRef)]).unwrap();
    let (array, _) = export_batch(&htod(&batch, Device::Cpu, &Stream::cpu()).unwrap(), &Stream::cpu()).unwrap();
    // SAFETY: a struct this crate just exported; the schema's pointers are valid, whatever they say.
    unsafe { import_batch(array, schema, &Stream::cpu()) }
}

#[test]
fn negative_fixed_widths_are_refused() {
    // In a schema, as a C producer writes them.
    for format in ["w:-1", "+w:-1"] {
        let mut column = CSchema::named(format, "x", vec![]);
        if format == "+w:-1" {
            column.children.push(Some(CSchema::named("i", "item", vec![])));
        }
        let schema = CSchema::named("+s", "", vec![column]).build();
        let message = invalid_data(format, import_with_schema(schema.root()));
        assert!(message.contains("negative"), "{message}");
    }
    // In the data type of an array import, over a valid export of a positive width.
    let binary = FixedSizeBinaryArray::try_from_iter([[1u8, 2], [3, 4]].into_iter()).unwrap();
    let message = invalid_data(
        "FixedSizeBinary(-1)",
        import(exported(&binary), &DataType::FixedSizeBinary(-1)),
    );
    assert!(message.contains("negative"), "{message}");
    let item = Arc::new(Field::new("item", DataType::Int32, true));
    let list = FixedSizeListArray::new(item.clone(), 2, Arc::new(Int32Array::from(vec![1, 2, 3, 4])), None);
    let message = invalid_data(
        "FixedSizeList(-1)",
        import(exported(&list), &DataType::FixedSizeList(item, -1)),
    );
    assert!(message.contains("negative"), "{message}");
    // Nested: a list of binaries of width 2, imported as a list of width -1.
    let values = FixedSizeBinaryArray::try_from_iter([[1u8, 2], [3, 4]].into_iter()).unwrap();
    let field = |w| Arc::new(Field::new("item", DataType::FixedSizeBinary(w), true));
    let offsets = arrow_buffer::OffsetBuffer::new(vec![0, 2].into());
    let nested = ListArray::new(field(2), offsets, Arc::new(values), None);
    let message = invalid_data(
        "List(FixedSizeBinary(-1))",
        import(exported(&nested), &DataType::List(field(-1))),
    );
    assert!(message.contains("negative"), "{message}");
}

/// A fixed-size list of `n` lists of `k` needs `n * k` child elements from the child's own offset:
/// an offset on the child does not make up for elements it lacks.
#[test]
fn a_fixed_size_list_over_too_short_a_child_is_refused() {
    let item = Arc::new(Field::new("item", DataType::Int32, false));
    let list = FixedSizeListArray::new(item, 2, Arc::new(Int32Array::from(vec![1, 2, 3, 4])), None);
    let ffi = exported(&list);
    // SAFETY: the export has one child, whose buffers hold 4 values: offset 2 + length 2 stays
    // inside them.
    let child = unsafe { child_mut(&ffi.array, 0) };
    child.offset = 2;
    child.length = 2;
    let message = invalid_data("a child of 2 for 2 lists of 2", import(ffi, list.data_type()));
    assert!(
        message.contains("fixed-size list child has 2 elements, 4 needed"),
        "{message}"
    );
}

#[test]
fn buffer_sizes_that_overflow_are_refused() {
    // 2^40 elements of 2^31 - 1 bytes: more bytes than a usize holds.
    let binary = FixedSizeBinaryArray::try_from_iter([[1u8, 2], [3, 4]].into_iter()).unwrap();
    let mut ffi = exported(&binary);
    ffi.array.length = 1 << 40;
    let message = invalid_data(
        "FixedSizeBinary(i32::MAX) of 2^40",
        import(ffi, &DataType::FixedSizeBinary(i32::MAX)),
    );
    assert!(message.contains("overflows"), "{message}");
    // A buffer that would end past the top of the address space.
    let strings = StringArray::from(vec!["ab", "cde"]);
    let ffi = exported(&strings);
    // SAFETY: Utf8 has three buffers; nothing reads through the pointer once it is refused.
    unsafe { *buffer_slot(&ffi.array, 1) = usize::MAX as *const c_void };
    let message = invalid_data("offsets at the top of memory", import(ffi, &DataType::Utf8));
    assert!(message.contains("address space"), "{message}");
}

#[test]
fn malformed_schemas_are_refused() {
    let valid = || CSchema::named("+s", "", vec![CSchema::named("i", "x", vec![])]);
    type Corrupt = fn(&mut CSchema);
    let cases: [(&str, Corrupt); 14] = [
        ("a null format", |s| s.node_mut(1).format = None),
        ("a format that is not UTF-8", |s| {
            s.node_mut(1).format = Some(b"\xff".to_vec())
        }),
        ("a name that is not UTF-8", |s| {
            s.node_mut(1).name = Some(b"x\xc3".to_vec())
        }),
        ("a negative child count", |s| s.n_children = Some(-1)),
        ("a child count past the limit", |s| s.n_children = Some(1 << 40)),
        ("more children than there are", |s| s.n_children = Some(3)),
        ("a null children array", |s| s.null_children = true),
        ("a null child", |s| s.children[0] = None),
        ("a list without its child", |s| {
            *s.node_mut(1) = CSchema::named("+l", "x", vec![])
        }),
        ("a fixed-size list without its child", |s| {
            *s.node_mut(1) = CSchema::named("+w:2", "x", vec![])
        }),
        ("a run-end encoded type with one child", |s| {
            *s.node_mut(1) = CSchema::named("+r", "x", vec![CSchema::named("i", "run_ends", vec![])])
        }),
        ("a released root", |s| s.released = true),
        ("a released child", |s| s.node_mut(1).released = true),
        ("a dictionary that is its own dictionary", |s| {
            s.node_mut(1).dictionary_is_self = true
        }),
    ];
    for (what, corrupt) in cases {
        let mut schema = valid();
        corrupt(&mut schema);
        let built = schema.build();
        invalid_data(what, import_with_schema(built.root()));
    }
    // The valid schema imports.
    let built = valid().build();
    assert_eq!(import_with_schema(built.root()).unwrap().num_rows(), 2);
}

#[test]
fn a_panic_while_releasing_an_array_stays_inside_the_release() {
    struct PanicsOnDrop(#[allow(dead_code)] Vec<i32>);
    impl Drop for PanicsOnDrop {
        fn drop(&mut self) {
            panic!("the owner of an exported buffer panicked");
        }
    }
    let values = vec![1i32, 2, 3];
    let address = values.as_ptr() as u64;
    // SAFETY: the vector's heap memory does not move when it does; the owner keeps it alive.
    let buffer = unsafe { DeviceBuffer::from_raw_parts(address, 12, Device::Cpu, PanicsOnDrop(values)) };
    let data = DeviceArrayData::try_new(DataType::Int32, 3, 0, Some(0), None, vec![buffer], vec![]).unwrap();
    let mut ffi = export_array(&data, &Event::completed(), &Stream::cpu()).unwrap();
    drop(data);
    let release = ffi.array.release.expect("an unreleased export");
    // SAFETY: our export, released once; the panic inside must not unwind out of the callback.
    unsafe { release(&mut ffi.array) };
    assert!(ffi.array.release.is_none(), "released");
    assert!(ffi.array.private_data.is_null());
}

#[test]
fn a_panic_while_releasing_a_stream_stays_inside_the_release() {
    /// A producer that ends at once and panics when dropped.
    struct PanicsOnDrop;
    impl Iterator for PanicsOnDrop {
        type Item = arrow_cuda::Result<DeviceRecordBatch>;
        fn next(&mut self) -> Option<Self::Item> {
            None
        }
    }
    impl Drop for PanicsOnDrop {
        fn drop(&mut self) {
            panic!("the producer panicked when dropped");
        }
    }
    let schema = Arc::new(Schema::new(vec![Field::new("x", DataType::Int32, true)]));
    let mut raw = export_stream(schema, PanicsOnDrop, DeviceType::CPU, Stream::cpu());
    let release = raw.release.expect("an unreleased stream");
    // SAFETY: our stream, released once; the panic inside must not unwind out of the callback.
    unsafe { release(&mut raw) };
    assert!(raw.release.is_none(), "released");
    assert!(raw.private_data.is_null());
}

// ---------------------------------------------------------------------------------------------
// Interop with arrow-rs's C Data Interface, on the CPU.

/// arrow-rs 59 cannot build a struct array whose offset is not zero and which has a struct child
/// (`make_array` panics: apache/arrow-rs#7595, fixed upstream by #10835), though the C Data
/// Interface allows it and arrow C++ exports sliced structs that way. Pushes struct offsets down
/// into the children, as the C Data Interface means them, so that every struct has offset 0.
fn push_down_struct_offsets(data: arrow_data::ArrayData) -> arrow_data::ArrayData {
    if !matches!(data.data_type(), DataType::Struct(_)) {
        return data;
    }
    let (offset, len) = (data.offset(), data.len());
    let children = data
        .child_data()
        .iter()
        .map(|c| push_down_struct_offsets(c_slice(c, offset, len)))
        .collect();
    arrow_data::ArrayData::builder(data.data_type().clone())
        .len(len)
        .nulls(data.nulls().cloned())
        .child_data(children)
        .build()
        .unwrap()
}

/// Slices `data` as the C Data Interface does, where a struct's offset applies to its children.
fn c_slice(data: &arrow_data::ArrayData, offset: usize, len: usize) -> arrow_data::ArrayData {
    if !matches!(data.data_type(), DataType::Struct(_)) {
        return data.slice(offset, len);
    }
    arrow_data::ArrayData::builder(data.data_type().clone())
        .len(len)
        .offset(data.offset() + offset)
        .nulls(data.nulls().map(|n| n.slice(offset, len)))
        .child_data(data.child_data().to_vec())
        .build()
        .unwrap()
}

#[test]
fn our_cpu_exports_import_into_arrow_rs() {
    for (name, array) in every_type() {
        let on_cpu = htod_array(array.as_ref(), Device::Cpu, &Stream::cpu()).unwrap();
        let cases = [
            ("whole", on_cpu.clone(), array.clone()),
            ("sliced", on_cpu.slice(3, 100).unwrap(), array.slice(3, 100)),
            ("sliced at the end", on_cpu.slice(149, 1).unwrap(), array.slice(149, 1)),
        ];
        for (how, data, expected) in cases {
            let what = format!("{name} {how}");
            let ffi = export_array(&data, &Event::completed(), &Stream::cpu()).unwrap();
            check_header(&what, &ffi, &data);
            let schema = export_field(&Field::new("x", data.data_type().clone(), true)).unwrap();
            // SAFETY: a CPU export: its `array` is a valid C Data Interface array.
            let imported = unsafe { arrow_array::ffi::from_ffi(ffi.array, &schema) }
                .unwrap_or_else(|e| panic!("{what}: arrow-rs refused our export: {e}"));
            check_array(&what, &make_array(push_down_struct_offsets(imported)), &expected);
        }
    }
}

#[test]
fn arrow_rs_exports_import_through_us() {
    for (name, array) in every_type() {
        let mut cases = vec![("whole".to_string(), array.clone())];
        for (offset, len) in [(1, 100), (3, 7), (9, 0), (64, 86), (149, 1)] {
            cases.push((format!("[{offset}..+{len}]"), array.slice(offset, len)));
        }
        for (how, expected) in cases {
            let what = format!("{name} {how}");
            let (array, schema) = arrow_array::ffi::to_ffi(&expected.to_data()).unwrap();
            let data_type = Field::try_from(&schema).unwrap().data_type().clone();
            assert_eq!(&data_type, expected.data_type(), "{what}");
            let ffi = FFI_ArrowDeviceArray {
                array,
                device_id: -1,
                device_type: DeviceType::CPU,
                sync_event: std::ptr::null_mut(),
                reserved: [0; 3],
            };
            let back = import_and_download(ffi, &data_type).unwrap_or_else(|e| panic!("{what}: {e}"));
            check_array(&what, &back, &expected);
        }
    }
}

#[test]
fn arrow_rs_batches_import_through_us() {
    let batch = every_type_batch();
    for (offset, len) in [(0, batch.num_rows()), (5, 50), (17, 0)] {
        let expected = batch.slice(offset, len);
        let what = format!("batch[{offset}..+{len}]");
        let s = StructArray::from(expected.clone());
        let (array, _) = arrow_array::ffi::to_ffi(&s.to_data()).unwrap();
        let schema = FFI_ArrowSchema::try_from(expected.schema().as_ref()).unwrap();
        let ffi = FFI_ArrowDeviceArray {
            array,
            device_id: 0,
            device_type: DeviceType::CPU,
            sync_event: std::ptr::null_mut(),
            reserved: [0; 3],
        };
        // SAFETY: arrow-rs's export of a CPU struct array and its schema.
        let imported = unsafe { import_batch(ffi, &schema, &Stream::cpu()) }.unwrap_or_else(|e| panic!("{what}: {e}"));
        check_batch(&what, &dtoh(&imported, &Stream::cpu()).unwrap(), &expected);
    }
}

// ---------------------------------------------------------------------------------------------
// Streams.

fn stream_batches(device: Device, stream: &Stream) -> (Vec<RecordBatch>, Vec<DeviceRecordBatch>) {
    let batch = every_type_batch();
    let host = vec![
        batch.slice(0, 50),
        batch.slice(50, 0),
        batch.slice(50, 99),
        batch.slice(149, 1),
    ];
    let on_device = host.iter().map(|b| htod(b, device, stream).unwrap()).collect();
    (host, on_device)
}

#[test]
fn streams_yield_every_batch_then_end() {
    each_device(|device, stream| {
        let (host, on_device) = stream_batches(device, stream);
        let schema = host[0].schema();
        let mut raw = export_stream(
            schema.clone(),
            on_device.into_iter().map(Ok),
            device.device_type(),
            stream.clone(),
        );
        assert_eq!(raw.device_type, device.device_type());
        // SAFETY: a stream this crate just exported.
        let mut reader = unsafe { DeviceArrayStreamReader::from_raw(&mut raw, stream.clone()) }.unwrap();
        assert!(raw.is_released(), "from_raw moves the stream out");
        assert_eq!(reader.schema(), schema, "schema with metadata");
        assert_eq!(reader.device_type(), device.device_type());
        for (i, expected) in host.iter().enumerate() {
            let what = format!("batch {i} on {device}");
            let batch = reader.next().unwrap_or_else(|| panic!("{what}: ended early")).unwrap();
            check_batch(&what, &dtoh(&batch, stream).unwrap(), expected);
        }
        assert!(reader.next().is_none(), "end of stream");
        assert!(reader.next().is_none(), "still the end");
    });
}

/// Counts how many times the iterator behind a stream is dropped.
struct DropGuard(Arc<AtomicUsize>);

impl Drop for DropGuard {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

fn guarded_stream(
    batches: Vec<arrow_cuda::Result<DeviceRecordBatch>>,
    schema: SchemaRef,
    drops: &Arc<AtomicUsize>,
) -> FFI_ArrowDeviceArrayStream {
    let iter = Guarded {
        batches: batches.into_iter(),
        _guard: DropGuard(drops.clone()),
    };
    export_stream(schema, iter, DeviceType::CPU, Stream::cpu())
}

/// Batches, and a guard that counts when they are dropped.
struct Guarded {
    batches: std::vec::IntoIter<arrow_cuda::Result<DeviceRecordBatch>>,
    _guard: DropGuard,
}

impl Iterator for Guarded {
    type Item = arrow_cuda::Result<DeviceRecordBatch>;

    fn next(&mut self) -> Option<Self::Item> {
        self.batches.next()
    }
}

#[test]
fn stream_errors_surface_with_their_message() {
    let (host, mut on_device) = stream_batches(Device::Cpu, &Stream::cpu());
    let drops = Arc::new(AtomicUsize::new(0));
    let batches = vec![
        Ok(on_device.remove(0)),
        Err(Error::InvalidData("the producer broke on purpose".into())),
        Ok(on_device.remove(0)),
    ];
    let mut raw = guarded_stream(batches, host[0].schema(), &drops);
    // SAFETY: a stream this crate just exported.
    let mut reader = unsafe { DeviceArrayStreamReader::from_raw(&mut raw, Stream::cpu()) }.unwrap();
    let first = reader.next().unwrap().unwrap();
    check_batch("first", &dtoh(&first, &Stream::cpu()).unwrap(), &host[0]);
    let e = error("second", reader.next().unwrap());
    assert!(e.contains("the producer broke on purpose"), "{e}");
    assert!(reader.next().is_none(), "a failed stream ends");
    assert_eq!(drops.load(Ordering::SeqCst), 0);
    drop(reader);
    assert_eq!(drops.load(Ordering::SeqCst), 1);
    drop(first);
}

#[test]
fn get_last_error_reports_the_failure() {
    let (host, _) = stream_batches(Device::Cpu, &Stream::cpu());
    let drops = Arc::new(AtomicUsize::new(0));
    let mut raw = guarded_stream(
        vec![Err(Error::InvalidArgument("bad\0argument".into()))],
        host[0].schema(),
        &drops,
    );
    let get_next = raw.get_next.unwrap();
    let get_last_error = raw.get_last_error.unwrap();
    // SAFETY: our live stream.
    assert!(unsafe { get_last_error(&mut raw) }.is_null(), "no error yet");
    let mut out = FFI_ArrowDeviceArray::empty();
    // SAFETY: our live stream and a destination.
    let code = unsafe { get_next(&mut raw, &mut out) };
    assert_ne!(code, 0);
    assert!(out.is_released(), "nothing written on error");
    // SAFETY: as above; the message lives until the next call.
    let message = unsafe { std::ffi::CStr::from_ptr(get_last_error(&mut raw)) }
        .to_string_lossy()
        .into_owned();
    assert!(message.contains("bad argument"), "{message}");
    // The end of the stream: a released array and code 0.
    // SAFETY: as above.
    assert_eq!(unsafe { get_next(&mut raw, &mut out) }, 0);
    assert!(out.is_released());
    // Null destinations are refused.
    // SAFETY: as above.
    assert_ne!(unsafe { get_next(&mut raw, std::ptr::null_mut()) }, 0);
    // SAFETY: as above.
    assert_ne!(unsafe { (raw.get_schema.unwrap())(&mut raw, std::ptr::null_mut()) }, 0);
    drop(raw);
    assert_eq!(drops.load(Ordering::SeqCst), 1);
}

#[test]
fn panics_in_the_producer_become_errors() {
    let (host, _) = stream_batches(Device::Cpu, &Stream::cpu());
    let iter = std::iter::from_fn(|| -> Option<arrow_cuda::Result<DeviceRecordBatch>> { panic!("producer panicked") });
    let mut raw = export_stream(host[0].schema(), iter, DeviceType::CPU, Stream::cpu());
    // SAFETY: a stream this crate just exported.
    let mut reader = unsafe { DeviceArrayStreamReader::from_raw(&mut raw, Stream::cpu()) }.unwrap();
    let e = error("panicking producer", reader.next().unwrap());
    assert!(e.contains("panic"), "{e}");
    assert!(reader.next().is_none());
}

#[test]
fn streams_are_released_exactly_once() {
    let (host, on_device) = stream_batches(Device::Cpu, &Stream::cpu());
    let schema = host[0].schema();
    let instrument_stream = |raw: &mut FFI_ArrowDeviceArrayStream| {
        ORIGINAL_STREAM_RELEASE.with(|o| o.set(raw.release));
        raw.release = Some(counting_stream_release);
    };
    let stream_releases = || STREAM_RELEASES.with(Cell::get);
    STREAM_RELEASES.with(|c| c.set(0));

    // Read to the end.
    let drops = Arc::new(AtomicUsize::new(0));
    let mut raw = guarded_stream(on_device.iter().cloned().map(Ok).collect(), schema.clone(), &drops);
    instrument_stream(&mut raw);
    // SAFETY: a stream this crate just exported.
    let reader = unsafe { DeviceArrayStreamReader::from_raw(&mut raw, Stream::cpu()) }.unwrap();
    drop(raw);
    assert_eq!(stream_releases(), 0, "moved out: the emptied struct releases nothing");
    let batches: Vec<_> = reader.map(Result::unwrap).collect();
    assert_eq!(batches.len(), host.len());
    assert_eq!(stream_releases(), 1);
    assert_eq!(drops.load(Ordering::SeqCst), 1);
    // The batches outlive the stream.
    for (b, h) in batches.iter().zip(&host) {
        check_batch("after release", &dtoh(b, &Stream::cpu()).unwrap(), h);
    }

    // Dropped half-way.
    let drops = Arc::new(AtomicUsize::new(0));
    let mut raw = guarded_stream(on_device.iter().cloned().map(Ok).collect(), schema.clone(), &drops);
    instrument_stream(&mut raw);
    // SAFETY: as above.
    let mut reader = unsafe { DeviceArrayStreamReader::from_raw(&mut raw, Stream::cpu()) }.unwrap();
    reader.next().unwrap().unwrap();
    drop(reader);
    assert_eq!(stream_releases(), 2);
    assert_eq!(drops.load(Ordering::SeqCst), 1);

    // Never read.
    let drops = Arc::new(AtomicUsize::new(0));
    let mut raw = guarded_stream(vec![], schema.clone(), &drops);
    instrument_stream(&mut raw);
    drop(raw);
    assert_eq!(stream_releases(), 3);
    assert_eq!(drops.load(Ordering::SeqCst), 1);
}

#[test]
fn released_streams_are_refused() {
    let mut raw = FFI_ArrowDeviceArrayStream::empty();
    // SAFETY: a released stream.
    assert!(unsafe { DeviceArrayStreamReader::from_raw(&mut raw, Stream::cpu()) }.is_err());
    // SAFETY: null is checked.
    assert!(unsafe { DeviceArrayStreamReader::from_raw(std::ptr::null_mut(), Stream::cpu()) }.is_err());
}

#[test]
fn batches_of_another_device_type_are_refused() {
    // A CPU batch in a stream that says CUDA: the producer reports it rather than lie.
    let (host, on_device) = stream_batches(Device::Cpu, &Stream::cpu());
    let mut raw = export_stream(
        host[0].schema(),
        on_device.into_iter().map(Ok),
        DeviceType::CUDA,
        Stream::cpu(),
    );
    // SAFETY: a stream this crate just exported.
    let mut reader = unsafe { DeviceArrayStreamReader::from_raw(&mut raw, Stream::cpu()) }.unwrap();
    assert_eq!(reader.device_type(), DeviceType::CUDA);
    let e = error("CPU batch in a CUDA stream", reader.next().unwrap());
    assert!(e.contains("CPU") && e.contains("CUDA"), "{e}");
}

#[test]
fn streams_move_between_threads() {
    let (host, on_device) = stream_batches(Device::Cpu, &Stream::cpu());
    let mut raw = export_stream(
        host[0].schema(),
        on_device.into_iter().map(Ok),
        DeviceType::CPU,
        Stream::cpu(),
    );
    // SAFETY: a stream this crate just exported.
    let reader = unsafe { DeviceArrayStreamReader::from_raw(&mut raw, Stream::cpu()) }.unwrap();
    let back = std::thread::spawn(move || {
        reader
            .map(|b| dtoh(&b.unwrap(), &Stream::cpu()).unwrap())
            .collect::<Vec<_>>()
    })
    .join()
    .unwrap();
    assert_eq!(back.len(), host.len());
    for (b, h) in back.iter().zip(&host) {
        check_batch("on another thread", b, h);
    }
}
