//! A small C library over arrow-cuda's C Device Data Interface, for tests written in other
//! languages: `tests/pyarrow_interop.py` loads it with ctypes and hands pyarrow arrays through it.
//!
//! Every function returns 0 on success and non-zero on failure, with a message that
//! [`arrow_cuda_ffi_last_error`] returns. Input structs are always moved out of (and released);
//! output structs are written only on success. Nothing panics across the C boundary.

use std::cell::RefCell;
use std::ffi::{CString, c_char};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

use arrow_array::builder::{Int64Builder, ListBuilder, StringViewBuilder};
use arrow_array::types::Int8Type;
use arrow_array::{
    ArrayRef, BooleanArray, Decimal128Array, DictionaryArray, Float64Array, Int8Array, Int32Array, RecordBatch,
    StringArray, StructArray, TimestampMicrosecondArray,
};
use arrow_cuda::abi::{FFI_ArrowDeviceArray, FFI_ArrowSchema};
use arrow_cuda::ffi::{export_array, export_batch, export_field, import_array, import_batch};
use arrow_cuda::transfer::{dtoh, dtoh_array, htod, htod_array};
use arrow_cuda::{Device, DeviceArrayData, DeviceRecordBatch, Event, Stream};
use arrow_schema::{DataType, Field, Fields, Schema};

type Result<T> = std::result::Result<T, String>;

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// Runs `f`, turning an error or a panic into a return code and a message.
fn guarded(f: impl FnOnce() -> Result<()>) -> i32 {
    let (code, message) = match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => return 0,
        Ok(Err(e)) => (1, e),
        Err(panic) => {
            let what = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            (2, format!("panic: {what}"))
        }
    };
    let message = CString::new(message.replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|e| *e.borrow_mut() = message);
    code
}

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// The message of the last failure on this thread (empty when there was none), valid until the
/// next call of this library on the thread.
#[unsafe(no_mangle)]
pub extern "C" fn arrow_cuda_ffi_last_error() -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}

/// Whether a CUDA device is in use: round trips then pass through device 0 as well.
#[unsafe(no_mangle)]
pub extern "C" fn arrow_cuda_ffi_cuda_available() -> i32 {
    arrow_cuda::device::cuda_available() as i32
}

/// Moves the producer's structs out of `array` and `schema`.
///
/// # Safety
/// Both must be null or valid structs.
unsafe fn take_input(
    array: *mut FFI_ArrowDeviceArray,
    schema: *mut FFI_ArrowSchema,
) -> Result<(FFI_ArrowDeviceArray, FFI_ArrowSchema)> {
    if array.is_null() || schema.is_null() {
        return Err("null input pointer".into());
    }
    // SAFETY: valid per the caller; both are left released, so the caller frees nothing twice.
    unsafe { Ok((FFI_ArrowDeviceArray::from_raw(array), FFI_ArrowSchema::from_raw(schema))) }
}

/// Writes the exported structs into the consumer's places (which hold nothing to release).
///
/// # Safety
/// Both must be null or valid places for the structs.
unsafe fn write_output(
    out_array: *mut FFI_ArrowDeviceArray,
    out_schema: *mut FFI_ArrowSchema,
    array: FFI_ArrowDeviceArray,
    schema: FFI_ArrowSchema,
) -> Result<()> {
    if out_array.is_null() || out_schema.is_null() {
        return Err("null output pointer".into());
    }
    // SAFETY: valid places per the caller; they are overwritten without being dropped.
    unsafe {
        std::ptr::write(out_array, array);
        std::ptr::write(out_schema, schema);
    }
    Ok(())
}

/// Exports `data`, imports the export again and returns the import: one more trip through the
/// interface, on whatever device `data` is on.
fn reimport(data: &DeviceArrayData, stream: &Stream) -> Result<DeviceArrayData> {
    let ffi = export_array(data, &Event::completed(), stream).map_err(err)?;
    // SAFETY: a struct this crate just exported.
    let (data, ready) = unsafe { import_array(ffi, data.data_type(), stream) }.map_err(err)?;
    stream.wait(&ready).map_err(err)?;
    Ok(data)
}

/// Copies a host array through every device (each copy exported and imported once more) and
/// returns the CPU copy to export.
fn through_devices(array: &ArrayRef) -> Result<DeviceArrayData> {
    let mut host = array.clone();
    if arrow_cuda::device::cuda_available() {
        let gpu = Device::Cuda(0);
        let stream = Stream::new(gpu).map_err(err)?;
        let on_gpu = htod_array(host.as_ref(), gpu, &stream).map_err(err)?;
        let again = reimport(&on_gpu, &stream)?;
        host = dtoh_array(&again, &stream).map_err(err)?;
    }
    let cpu = Stream::cpu();
    let on_cpu = htod_array(host.as_ref(), Device::Cpu, &cpu).map_err(err)?;
    reimport(&on_cpu, &cpu)
}

/// Imports an array (with the schema of its type), copies it through the transfer engine on every
/// device and exports the CPU copy with the same schema. Both inputs are moved out of.
///
/// # Safety
/// The inputs must be valid C Device Data Interface structs; the outputs valid places for them.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn arrow_cuda_roundtrip_array(
    in_array: *mut FFI_ArrowDeviceArray,
    in_schema: *mut FFI_ArrowSchema,
    out_array: *mut FFI_ArrowDeviceArray,
    out_schema: *mut FFI_ArrowSchema,
) -> i32 {
    guarded(|| {
        // SAFETY: forwarded from the caller.
        let (array, schema) = unsafe { take_input(in_array, in_schema)? };
        let field = Field::try_from(&schema).map_err(err)?;
        let cpu = Stream::cpu();
        // SAFETY: the caller vouches for the struct.
        let (imported, ready) = unsafe { import_array(array, field.data_type(), &cpu) }.map_err(err)?;
        ready.synchronize().map_err(err)?;
        let host = dtoh_array(&imported, &cpu).map_err(err)?;
        drop(imported);
        let out = through_devices(&host)?;
        let exported = export_array(&out, &Event::completed(), &cpu).map_err(err)?;
        let schema = export_field(&field).map_err(err)?;
        // SAFETY: forwarded from the caller.
        unsafe { write_output(out_array, out_schema, exported, schema) }
    })
}

/// Imports a record batch (a struct array with its schema), copies it through the transfer engine
/// on every device and exports the CPU copy, schema metadata included.
///
/// # Safety
/// As for [`arrow_cuda_roundtrip_array`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn arrow_cuda_roundtrip_batch(
    in_array: *mut FFI_ArrowDeviceArray,
    in_schema: *mut FFI_ArrowSchema,
    out_array: *mut FFI_ArrowDeviceArray,
    out_schema: *mut FFI_ArrowSchema,
) -> i32 {
    guarded(|| {
        // SAFETY: forwarded from the caller.
        let (array, schema) = unsafe { take_input(in_array, in_schema)? };
        let cpu = Stream::cpu();
        // SAFETY: the caller vouches for the structs.
        let imported = unsafe { import_batch(array, &schema, &cpu) }.map_err(err)?;
        let mut host = dtoh(&imported, &cpu).map_err(err)?;
        drop(imported);
        if arrow_cuda::device::cuda_available() {
            let gpu = Device::Cuda(0);
            let stream = Stream::new(gpu).map_err(err)?;
            let on_gpu = htod(&host, gpu, &stream).map_err(err)?;
            let (ffi, schema) = export_batch(&on_gpu, &stream).map_err(err)?;
            // SAFETY: structs this crate just exported.
            let again = unsafe { import_batch(ffi, &schema, &stream) }.map_err(err)?;
            host = dtoh(&again, &stream).map_err(err)?;
        }
        let on_cpu = htod(&host, Device::Cpu, &cpu).map_err(err)?;
        let (exported, schema) = export_batch(&on_cpu, &cpu).map_err(err)?;
        // SAFETY: forwarded from the caller.
        unsafe { write_output(out_array, out_schema, exported, schema) }
    })
}

/// The batch that [`arrow_cuda_export_sample_batch`] exports; `tests/pyarrow_interop.py` builds
/// the same one with pyarrow.
fn sample_batch() -> Result<RecordBatch> {
    let ints: ArrayRef = Arc::new(Int32Array::from(vec![
        Some(1),
        None,
        Some(3),
        Some(-4),
        None,
        Some(6),
        Some(7),
        Some(i32::MAX),
        Some(i32::MIN),
        Some(10),
    ]));
    let strings: ArrayRef = Arc::new(StringArray::from(vec![
        Some("a"),
        Some("bb"),
        None,
        Some(""),
        Some("a string longer than twelve bytes"),
        Some("é"),
        None,
        Some("x"),
        Some("yz"),
        Some("last"),
    ]));
    let mut lists = ListBuilder::new(Int64Builder::new());
    for i in 0..10i64 {
        if i % 4 == 1 {
            lists.append(false);
        } else {
            for j in 0..i % 3 {
                lists.values().append_option((j != 1).then_some(i * 10 + j));
            }
            lists.append(true);
        }
    }
    let lists: ArrayRef = Arc::new(lists.finish());
    let x: ArrayRef = Arc::new(Float64Array::from(
        (0..10)
            .map(|i| (i % 3 != 0).then_some(i as f64 * 0.5))
            .collect::<Vec<_>>(),
    ));
    let y: ArrayRef = Arc::new(BooleanArray::from(
        (0..10).map(|i| (i % 4 != 2).then_some(i % 2 == 0)).collect::<Vec<_>>(),
    ));
    let struct_fields = Fields::from(vec![
        Field::new("x", DataType::Float64, true),
        Field::new("y", DataType::Boolean, true),
    ]);
    let nulls = arrow_buffer::NullBuffer::from((0..10).map(|i| i != 5).collect::<Vec<_>>());
    let structs: ArrayRef = Arc::new(StructArray::try_new(struct_fields, vec![x, y], Some(nulls)).map_err(err)?);
    let keys = Int8Array::from(vec![
        Some(0),
        Some(1),
        None,
        Some(2),
        Some(0),
        Some(0),
        Some(1),
        None,
        Some(2),
        Some(1),
    ]);
    let dictionary: ArrayRef = Arc::new(
        DictionaryArray::<Int8Type>::try_new(keys, Arc::new(StringArray::from(vec!["red", "green", "blue"])))
            .map_err(err)?,
    );
    let mut views = StringViewBuilder::new();
    for i in 0..10 {
        views.append_option((i % 3 != 2).then(|| format!("view number {i} of the sample batch")));
    }
    let views: ArrayRef = Arc::new(views.finish());
    let timestamps: ArrayRef = Arc::new(
        TimestampMicrosecondArray::from(
            (0..10)
                .map(|i| (i != 3).then_some(1_700_000_000_000_000 + i))
                .collect::<Vec<_>>(),
        )
        .with_timezone("UTC"),
    );
    let decimals: ArrayRef = Arc::new(
        Decimal128Array::from(
            (0..10)
                .map(|i| (i != 7).then_some(i as i128 * 12345 - 50_000))
                .collect::<Vec<_>>(),
        )
        .with_precision_and_scale(10, 2)
        .map_err(err)?,
    );
    let columns = vec![
        ("i", ints),
        ("s", strings),
        ("l", lists),
        ("st", structs),
        ("d", dictionary),
        ("v", views),
        ("ts", timestamps),
        ("dec", decimals),
    ];
    let fields: Vec<Field> = columns
        .iter()
        .map(|(n, a)| Field::new(*n, a.data_type().clone(), true))
        .collect();
    let metadata = [("producer".to_string(), "arrow-cuda".to_string())].into();
    let schema = Arc::new(Schema::new(fields).with_metadata(metadata));
    RecordBatch::try_new(schema, columns.into_iter().map(|(_, a)| a).collect()).map_err(err)
}

/// Exports rows `offset..offset + len` of a sample batch built in Rust, sliced on the device
/// without copying (so the exported columns have that offset).
///
/// # Safety
/// The outputs must be valid places for the structs.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn arrow_cuda_export_sample_batch(
    offset: i64,
    len: i64,
    out_array: *mut FFI_ArrowDeviceArray,
    out_schema: *mut FFI_ArrowSchema,
) -> i32 {
    guarded(|| {
        let batch = sample_batch()?;
        let cpu = Stream::cpu();
        let on_cpu: DeviceRecordBatch = htod(&batch, Device::Cpu, &cpu).map_err(err)?;
        let (offset, len) = (
            usize::try_from(offset).map_err(err)?,
            usize::try_from(len).map_err(err)?,
        );
        let sliced = on_cpu.slice(offset, len).map_err(err)?;
        let (array, schema) = export_batch(&sliced, &cpu).map_err(err)?;
        // SAFETY: forwarded from the caller.
        unsafe { write_output(out_array, out_schema, array, schema) }
    })
}

/// Exports rows `offset..offset + len` of column `column` of the sample batch as an array, sliced
/// on the device: the export carries the offset and an unknown null count.
///
/// # Safety
/// The outputs must be valid places for the structs.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn arrow_cuda_export_sample_column(
    column: i64,
    offset: i64,
    len: i64,
    out_array: *mut FFI_ArrowDeviceArray,
    out_schema: *mut FFI_ArrowSchema,
) -> i32 {
    guarded(|| {
        let batch = sample_batch()?;
        let column = usize::try_from(column).map_err(err)?;
        if column >= batch.num_columns() {
            return Err(format!("no column {column}"));
        }
        let cpu = Stream::cpu();
        let on_cpu = htod_array(batch.column(column).as_ref(), Device::Cpu, &cpu).map_err(err)?;
        let (offset, len) = (
            usize::try_from(offset).map_err(err)?,
            usize::try_from(len).map_err(err)?,
        );
        let sliced = on_cpu.slice(offset, len).map_err(err)?;
        let array = export_array(&sliced, &Event::completed(), &cpu).map_err(err)?;
        let schema = export_field(batch.schema().field(column)).map_err(err)?;
        // SAFETY: forwarded from the caller.
        unsafe { write_output(out_array, out_schema, array, schema) }
    })
}
