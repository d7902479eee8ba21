//! polars-arrow interoperability (feature `polars`).
//!
//! polars-arrow arrays and record batches convert to arrow-rs ones and back through the Arrow C
//! Data Interface, without copying on the host: the exporter's C structs are moved to the other
//! crate's importer, whose buffers then point at (and keep alive) the exporter's memory. Device
//! transfers go through arrow-rs: [`to_device`] converts zero-copy and then uploads with
//! [`crate::transfer`]; [`from_device`] downloads and then converts zero-copy.
//!
//! ```text
//! polars-arrow --C Data Interface--> arrow-rs --transfer::htod--> DeviceArrayData / DeviceRecordBatch
//! polars-arrow <--C Data Interface-- arrow-rs <--transfer::dtoh--
//! ```
//!
//! # Types
//!
//! Every polars-arrow type that has an Arrow C Data Interface format converts, nested ones
//! included, with these exceptions and adjustments:
//!
//! - polars' `Int128` and `UInt128` have no Arrow type (polars exports them with its private
//!   formats `_pli128` / `_plu128`, which arrow-rs rejects). They travel as `FixedSizeBinary(16)`
//!   (the same bytes: little-endian 16-byte values) marked with the extension name
//!   [`INT128_EXTENSION`] or [`UINT128_EXTENSION`] in the field metadata, and come back as
//!   `Int128` / `UInt128` wherever a field carries that metadata (batch columns, struct, list, map
//!   and union children). A bare array has no field, and arrow-rs keeps no metadata for dictionary
//!   values: convert those back with [`array_from_arrow_as`] / [`from_device_as`] and the polars
//!   type (otherwise they come back as `FixedSizeBinary(16)`). The same holds for polars extension
//!   types, which also travel as field metadata. A 128-bit integer inside a polars extension type
//!   is not supported.
//! - A union's type ids always cross the interface: polars' `ids: None` comes back as
//!   `Some([0, 1, ...])`, which means the same.
//! - polars-arrow 0.55's C Data Interface code has no case for the physical types of `Decimal256`
//!   and `Interval(DayTime)` (export and import) and `Interval(MonthDayNano)` (export): it would
//!   panic. Such arrays are refused with [`Error::Unsupported`], in either direction where polars
//!   cannot handle them. (polars-arrow cannot compare such arrays either: its `equal` panics too.)
//! - `Interval(MonthDayMillis)` and `Unknown` have no C Data Interface format; `Time32` with micro-
//!   or nanoseconds and `Time64` with seconds or milliseconds are invalid; dictionaries with
//!   128-bit keys have no Arrow equivalent; a union needs at least one field and as many type ids
//!   as fields. These are refused with [`Error::Unsupported`] (polars-arrow's exporter would panic
//!   on them, as on a NUL byte in a name or time zone, which is refused too).
//! - arrow-rs types polars-arrow has no type for (`ListView`, `LargeListView`, `RunEndEncoded`)
//!   are refused with [`Error::Unsupported`].
//! - polars-arrow 0.55 exports a `Null` array with one (NULL) buffer where the spec and arrow-rs
//!   expect none, and the offsets of a sliced `Utf8` / `Binary` array (32- or 64-bit offsets)
//!   from the slice's start while also reporting its offset, which a reader applies twice (a
//!   wrong result and a read past the buffer). The conversion corrects both in the exported C
//!   structs; the second only if a probe finds polars-arrow still behaving that way.

use std::ffi::c_void;
use std::mem::ManuallyDrop;
use std::ptr;
use std::sync::{Arc, OnceLock};

use arrow_array::ffi::{FFI_ArrowArray, FFI_ArrowSchema, from_ffi_and_data_type};
use arrow_array::{Array as _, ArrayRef, RecordBatch, RecordBatchOptions, make_array};
use arrow_data::ArrayData;
use arrow_schema::{DataType, Schema};
use polars_arrow::array::{Array as PolarsArray, BinaryArray, Utf8Array};
use polars_arrow::datatypes::{
    ArrowDataType, ArrowSchema as PolarsSchema, ExtensionType, Field as PolarsField, IntegerType, IntervalUnit,
    TimeUnit,
};
use polars_arrow::ffi as pffi;
use polars_arrow::record_batch::RecordBatchT;

use crate::array::{DeviceArrayData, DeviceRecordBatch};
use crate::device::{Device, Stream};
use crate::error::{Error, Result};
use crate::transfer;

/// A polars-arrow record batch of boxed arrays (polars-arrow's own `RecordBatch` alias).
pub type PolarsBatch = RecordBatchT<Box<dyn PolarsArray>>;

/// Extension name that marks a `FixedSizeBinary(16)` field holding polars `Int128` values.
pub const INT128_EXTENSION: &str = "arrow_cuda.polars.int128";
/// Extension name that marks a `FixedSizeBinary(16)` field holding polars `UInt128` values.
pub const UINT128_EXTENSION: &str = "arrow_cuda.polars.uint128";

// The two crates' C structs must be the same; they are `#[repr(C)]` copies of the spec's
// `ArrowArray` (80 bytes) and `ArrowSchema` (72 bytes), of plain integers, raw pointers and an
// optional `extern "C"` function pointer. Checked at compile time, and field by field in the tests.
const _: () =
    assert!(size_of::<pffi::ArrowArray>() == size_of::<FFI_ArrowArray>() && size_of::<FFI_ArrowArray>() == 80);
const _: () =
    assert!(size_of::<pffi::ArrowSchema>() == size_of::<FFI_ArrowSchema>() && size_of::<FFI_ArrowSchema>() == 72);
const _: () = assert!(align_of::<pffi::ArrowArray>() == align_of::<FFI_ArrowArray>());
const _: () = assert!(align_of::<pffi::ArrowSchema>() == align_of::<FFI_ArrowSchema>());

// ---- moving C structs between the two crates ----

/// Moves a polars-arrow `ArrowArray` into an arrow-rs [`FFI_ArrowArray`]; the release callback
/// moves with it.
fn array_to_arrow_ffi(mut array: pffi::ArrowArray) -> FFI_ArrowArray {
    // SAFETY: both types are `#[repr(C)]` definitions of the C Data Interface's `ArrowArray`, with
    // identical fields (asserted above and in the tests). `from_raw` reads the struct out and
    // writes an empty arrow-rs struct (release = NULL) in its place, which `array`'s `Drop` then
    // reads as released: ownership moves exactly once.
    unsafe { FFI_ArrowArray::from_raw((&raw mut array).cast()) }
}

/// Moves an arrow-rs [`FFI_ArrowArray`] into a polars-arrow `ArrowArray`.
fn array_from_arrow_ffi(array: FFI_ArrowArray) -> pffi::ArrowArray {
    let array = ManuallyDrop::new(array);
    // SAFETY: identical `#[repr(C)]` layouts (see above); the source is never dropped, so the
    // release callback is owned by the returned struct alone.
    unsafe { ptr::read((&raw const *array).cast::<pffi::ArrowArray>()) }
}

/// Moves a polars-arrow `ArrowSchema` into an arrow-rs [`FFI_ArrowSchema`].
fn schema_to_arrow_ffi(mut schema: pffi::ArrowSchema) -> FFI_ArrowSchema {
    // SAFETY: as for `array_to_arrow_ffi`, with the spec's `ArrowSchema`.
    unsafe { FFI_ArrowSchema::from_raw((&raw mut schema).cast()) }
}

/// Moves an arrow-rs [`FFI_ArrowSchema`] into a polars-arrow `ArrowSchema`.
fn schema_from_arrow_ffi(schema: FFI_ArrowSchema) -> pffi::ArrowSchema {
    let schema = ManuallyDrop::new(schema);
    // SAFETY: as for `array_from_arrow_ffi`, with the spec's `ArrowSchema`.
    unsafe { ptr::read((&raw const *schema).cast::<pffi::ArrowSchema>()) }
}

// ---- fields and types ----

/// Refuses polars types that polars-arrow's C exporter cannot write (it would panic).
fn check_exportable(dtype: &ArrowDataType) -> Result<()> {
    use ArrowDataType as T;
    let unsupported = |what: &str| Err(Error::Unsupported(format!("polars type {dtype:?}: {what}")));
    match dtype {
        T::Unknown => unsupported("no Arrow equivalent"),
        T::Interval(IntervalUnit::MonthDayMillis) => unsupported("no C Data Interface format"),
        T::Time32(TimeUnit::Microsecond | TimeUnit::Nanosecond)
        | T::Time64(TimeUnit::Second | TimeUnit::Millisecond) => unsupported("invalid time unit"),
        T::Decimal256(..) | T::Interval(IntervalUnit::DayTime | IntervalUnit::MonthDayNano) => {
            unsupported("polars-arrow's C Data Interface exporter has no case for its physical type")
        }
        T::Dictionary(IntegerType::Int128 | IntegerType::UInt128, ..) => unsupported("128-bit dictionary keys"),
        T::Dictionary(_, values, _) => check_exportable(values),
        T::Timestamp(_, Some(tz)) if tz.as_bytes().contains(&0) => unsupported("a time zone with a NUL byte"),
        T::Union(u) if u.fields.is_empty() => unsupported("a union without fields"),
        T::Union(u) if u.ids.as_ref().is_some_and(|ids| ids.len() != u.fields.len()) => {
            unsupported("union type ids do not match its fields")
        }
        T::Union(u) => u.fields.iter().try_for_each(check_field),
        T::List(f) | T::LargeList(f) | T::FixedSizeList(f, _) | T::Map(f, _) => check_field(f),
        T::Struct(fields) => fields.iter().try_for_each(check_field),
        T::Extension(ext) if matches!(ext.inner, T::Int128 | T::UInt128) => {
            unsupported("a 128-bit integer inside an extension type")
        }
        T::Extension(ext) => check_exportable(&ext.inner),
        _ => Ok(()),
    }
}

/// Refuses polars types that polars-arrow's C importer cannot read (it would panic).
fn check_importable(dtype: &ArrowDataType) -> Result<()> {
    use ArrowDataType as T;
    match dtype {
        T::Decimal256(..) | T::Interval(IntervalUnit::DayTime) => Err(Error::Unsupported(format!(
            "polars type {dtype:?}: polars-arrow's C Data Interface importer has no case for its physical type"
        ))),
        T::List(f) | T::LargeList(f) | T::FixedSizeList(f, _) | T::Map(f, _) => check_importable(&f.dtype),
        T::Struct(fields) => fields.iter().try_for_each(|f| check_importable(&f.dtype)),
        T::Union(u) => u.fields.iter().try_for_each(|f| check_importable(&f.dtype)),
        T::Dictionary(_, values, _) => check_importable(values),
        T::Extension(ext) => check_importable(&ext.inner),
        _ => Ok(()),
    }
}

fn check_field(field: &PolarsField) -> Result<()> {
    if field.name.as_bytes().contains(&0) {
        return Err(Error::InvalidArgument(format!(
            "field name {:?} contains a NUL byte",
            field.name
        )));
    }
    check_exportable(&field.dtype)
}

/// Replaces polars' 128-bit integers by marked `FixedSizeBinary(16)` extension types.
fn encode_dtype(dtype: &ArrowDataType) -> ArrowDataType {
    use ArrowDataType as T;
    let marked = |name: &'static str| {
        T::Extension(Box::new(ExtensionType {
            name: name.into(),
            inner: T::FixedSizeBinary(16),
            metadata: None,
        }))
    };
    map_children(dtype, encode_field, encode_dtype).unwrap_or_else(|| match dtype {
        T::Int128 => marked(INT128_EXTENSION),
        T::UInt128 => marked(UINT128_EXTENSION),
        other => other.clone(),
    })
}

fn encode_field(field: &PolarsField) -> PolarsField {
    field.with_dtype(encode_dtype(&field.dtype))
}

/// Undoes [`encode_dtype`].
fn decode_dtype(dtype: &ArrowDataType) -> ArrowDataType {
    use ArrowDataType as T;
    map_children(dtype, decode_field, decode_dtype).unwrap_or_else(|| match dtype {
        T::Extension(ext) if ext.inner == T::FixedSizeBinary(16) && ext.name == INT128_EXTENSION => T::Int128,
        T::Extension(ext) if ext.inner == T::FixedSizeBinary(16) && ext.name == UINT128_EXTENSION => T::UInt128,
        other => other.clone(),
    })
}

fn decode_field(field: &PolarsField) -> PolarsField {
    field.with_dtype(decode_dtype(&field.dtype))
}

/// Rebuilds a nested type with `f` applied to its child fields and `t` to dictionary values;
/// `None` for a type without children.
fn map_children(
    dtype: &ArrowDataType,
    f: fn(&PolarsField) -> PolarsField,
    t: fn(&ArrowDataType) -> ArrowDataType,
) -> Option<ArrowDataType> {
    use ArrowDataType as T;
    Some(match dtype {
        T::List(c) => T::List(Box::new(f(c))),
        T::LargeList(c) => T::LargeList(Box::new(f(c))),
        T::FixedSizeList(c, n) => T::FixedSizeList(Box::new(f(c)), *n),
        T::Map(c, sorted) => T::Map(Box::new(f(c)), *sorted),
        T::Struct(fields) => T::Struct(fields.iter().map(f).collect()),
        T::Union(u) => {
            let mut u = u.as_ref().clone();
            u.fields = u.fields.iter().map(f).collect();
            T::Union(Box::new(u))
        }
        T::Dictionary(key, values, ordered) => T::Dictionary(*key, Box::new(t(values)), *ordered),
        _ => return None,
    })
}

/// Converts a polars-arrow field to an arrow-rs field (name, type, nullability, metadata).
pub fn field_to_arrow(field: &PolarsField) -> Result<arrow_schema::Field> {
    check_field(field)?;
    let schema = schema_to_arrow_ffi(pffi::export_field_to_c(&encode_field(field)));
    arrow_schema::Field::try_from(&schema).map_err(|e| Error::Unsupported(format!("polars field {field:?}: {e}")))
}

/// Converts an arrow-rs field to a polars-arrow field.
pub fn field_from_arrow(field: &arrow_schema::Field) -> Result<PolarsField> {
    let schema = schema_from_arrow_ffi(crate::ffi::export_field(field)?);
    // SAFETY: `schema` was just exported by arrow-rs and is valid by the C Data Interface.
    let imported = unsafe { pffi::import_field_from_c(&schema) };
    imported
        .map(|f| decode_field(&f))
        .map_err(|e| Error::Unsupported(format!("arrow-rs field {field}: {e}")))
}

// ---- arrays ----

/// The C Data Interface's `ArrowArray`, with fields this module can name (both crates keep
/// theirs private). Used only to correct polars' exports (see [`fix_export`]).
#[repr(C)]
struct RawArray {
    length: i64,
    null_count: i64,
    offset: i64,
    n_buffers: i64,
    n_children: i64,
    buffers: *mut *const c_void,
    children: *mut *mut RawArray,
    dictionary: *mut RawArray,
    release: Option<unsafe extern "C" fn(*mut RawArray)>,
    private_data: *mut c_void,
}

const _: () = assert!(size_of::<RawArray>() == size_of::<FFI_ArrowArray>());

/// Whether polars-arrow exports the offsets buffer of a sliced `Utf8Array` / `BinaryArray` from
/// the slice's first offset while also reporting the slice's offset, so that a reader applies the
/// offset twice (reading past the buffer's end). polars-arrow 0.55's `utf8/ffi.rs` and
/// `binary/ffi.rs` use `as_ptr()` where every other array uses `storage_ptr()`. Probed once, on a
/// small array, so that a polars-arrow with the bug fixed is left alone.
fn slice_start_offsets(binary: bool) -> bool {
    static UTF8: OnceLock<bool> = OnceLock::new();
    static BINARY: OnceLock<bool> = OnceLock::new();
    let probe = || {
        let (array, slice_start) = if binary {
            let a = BinaryArray::<i32>::from_slice([b"a", b"b", b"c"]).sliced(1, 2);
            let start = a.offsets().buffer().as_ptr().cast::<c_void>();
            (a.boxed(), start)
        } else {
            let a = Utf8Array::<i32>::from_slice(["a", "b", "c"]).sliced(1, 2);
            let start = a.offsets().buffer().as_ptr().cast::<c_void>();
            (a.boxed(), start)
        };
        let mut exported = pffi::export_array_to_c(array);
        let raw = (&raw mut exported).cast::<RawArray>();
        // SAFETY: `exported` is a live `ArrowArray` (the layout of `RawArray`) of a Utf8 or Binary
        // array, which has three buffers: validity, offsets, values.
        unsafe { (*raw).n_buffers == 3 && (*raw).offset == 1 && *(*raw).buffers.add(1) == slice_start }
    };
    *if binary { &BINARY } else { &UTF8 }.get_or_init(probe)
}

/// Corrects two departures of polars-arrow's exporter from the C Data Interface, throughout the
/// tree: a `Null` array comes with one (NULL) buffer where the spec and arrow-rs expect none, and
/// the offsets of a sliced `Utf8`, `LargeUtf8`, `Binary` or `LargeBinary` array may point at the
/// slice's start (see [`slice_start_offsets`]): they are moved back by the array's offset.
///
/// # Safety
/// `array` points to a live, unreleased C array that polars-arrow exported for `dtype`, and that
/// nothing else accesses during the call.
unsafe fn fix_export(array: *mut RawArray, dtype: &DataType) {
    // SAFETY (for every dereference below): `array` and, through it, its buffers array, children
    // and dictionary are valid and writable by the caller's contract (they live in the exporter's
    // private data, which the C struct owns). The exporter frees them through `private_data`,
    // never through `n_buffers` or the buffer pointers.
    match dtype {
        // SAFETY: see above.
        DataType::Null => unsafe { (*array).n_buffers = 0 },
        DataType::Utf8 | DataType::LargeUtf8 | DataType::Binary | DataType::LargeBinary => {
            let binary = matches!(dtype, DataType::Binary | DataType::LargeBinary);
            let width = if matches!(dtype, DataType::Utf8 | DataType::Binary) {
                4
            } else {
                8
            };
            // SAFETY: see above.
            let (offset, n_buffers, buffers) = unsafe { ((*array).offset, (*array).n_buffers, (*array).buffers) };
            if offset > 0 && n_buffers == 3 && slice_start_offsets(binary) {
                let offset = usize::try_from(offset).unwrap_or(0);
                // SAFETY: with the behaviour probed, this pointer is the offsets storage's start
                // plus `offset` offsets (polars-arrow reports the storage offset as the array's
                // offset), so moving it back by as many offsets stays inside the storage.
                unsafe { *buffers.add(1) = (*buffers.add(1)).cast::<u8>().sub(offset * width).cast() };
            }
        }
        DataType::Dictionary(_, values) => {
            // SAFETY: see above.
            let dictionary = unsafe { (*array).dictionary };
            if !dictionary.is_null() {
                // SAFETY: the dictionary is a valid array of type `values`, exported with `array`.
                unsafe { fix_export(dictionary, values) };
            }
        }
        _ => {
            let children: Vec<&DataType> = match dtype {
                DataType::List(f) | DataType::LargeList(f) | DataType::FixedSizeList(f, _) | DataType::Map(f, _) => {
                    vec![f.data_type()]
                }
                DataType::Struct(fields) => fields.iter().map(|f| f.data_type()).collect(),
                DataType::Union(fields, _) => fields.iter().map(|(_, f)| f.data_type()).collect(),
                _ => return,
            };
            // SAFETY: see above.
            let (n, ptrs) = unsafe { ((*array).n_children, (*array).children) };
            for (i, child) in children.into_iter().enumerate().take(usize::try_from(n).unwrap_or(0)) {
                // SAFETY: `children` holds `n_children` valid pointers to arrays exported with
                // `array`, whose types are the type's child types in order.
                unsafe { fix_export(*ptrs.add(i), child) };
            }
        }
    }
}

/// Exports `array` (described by `field`) from polars-arrow and imports it into arrow-rs.
fn export(array: &dyn PolarsArray, field: &PolarsField) -> Result<(arrow_schema::Field, ArrayData)> {
    if array.dtype() != field.dtype() {
        return Err(Error::InvalidData(format!(
            "polars array of type {:?} under field {:?} of type {:?}",
            array.dtype(),
            field.name,
            field.dtype()
        )));
    }
    let arrow_field = field_to_arrow(field)?;
    let mut c_array = pffi::export_array_to_c(array.to_boxed());
    // SAFETY: `c_array` is polars' fresh export of `array`, of the type `arrow_field` describes,
    // and this function holds it alone.
    unsafe { fix_export((&raw mut c_array).cast(), arrow_field.data_type()) };
    let c_array = array_to_arrow_ffi(c_array);
    // SAFETY: `c_array` was exported by polars-arrow from `array`, whose type is the one
    // `arrow_field` was made from (with 128-bit integers as 16-byte fixed-size binaries, the same
    // layout). The import reads only lengths and, for variable-size layouts, the last offset.
    let data = unsafe { from_ffi_and_data_type(c_array, arrow_field.data_type().clone()) }?;
    // Cheap structural checks (buffer counts and sizes), no pass over the values.
    data.validate()?;
    Ok((arrow_field, data))
}

/// Exports arrow-rs `data` and imports it into polars-arrow as `dtype`, which must describe it.
fn import(data: &ArrayData, dtype: ArrowDataType) -> Result<Box<dyn PolarsArray>> {
    check_importable(&dtype)?;
    let c_array = array_from_arrow_ffi(FFI_ArrowArray::new(data));
    // SAFETY: `c_array` is a valid C Data Interface array exported by arrow-rs; the callers check
    // that `dtype` converts to the arrow-rs type of `data`.
    unsafe { pffi::import_array_from_c(c_array, dtype) }
        .map_err(|e| Error::InvalidData(format!("polars-arrow refused an arrow-rs array: {e}")))
}

/// Converts a polars-arrow array to an arrow-rs array, zero-copy. 128-bit integers become
/// `FixedSizeBinary(16)` (see the [module docs](self)).
pub fn array_to_arrow(array: &dyn PolarsArray) -> Result<ArrayRef> {
    let field = PolarsField::new("".into(), array.dtype().clone(), true);
    Ok(make_array(export(array, &field)?.1))
}

/// Converts an arrow-rs array to a polars-arrow array, zero-copy, with the polars type that
/// corresponds to its type.
pub fn array_from_arrow(array: &dyn arrow_array::Array) -> Result<Box<dyn PolarsArray>> {
    let field = arrow_schema::Field::new("", array.data_type().clone(), true);
    import(&array.to_data(), field_from_arrow(&field)?.dtype)
}

/// Converts an arrow-rs array to a polars-arrow array of type `dtype`, zero-copy: for types that
/// are not recovered from the arrow-rs type alone (`Int128` / `UInt128` from
/// `FixedSizeBinary(16)`). Fails unless `dtype` converts to the array's arrow-rs type.
pub fn array_from_arrow_as(array: &dyn arrow_array::Array, dtype: &ArrowDataType) -> Result<Box<dyn PolarsArray>> {
    let expected = field_to_arrow(&PolarsField::new("".into(), dtype.clone(), true))?;
    if !expected.data_type().equals_datatype(array.data_type()) {
        return Err(Error::InvalidArgument(format!(
            "polars type {dtype:?} converts to {}, not {}",
            expected.data_type(),
            array.data_type()
        )));
    }
    import(&array.to_data(), dtype.clone())
}

// ---- record batches ----

/// Converts a polars-arrow record batch to an arrow-rs one, zero-copy, keeping field names,
/// nullability and metadata and the schema's metadata.
pub fn batch_to_arrow(batch: &PolarsBatch) -> Result<RecordBatch> {
    let (fields, columns): (Vec<_>, Vec<_>) = batch
        .schema()
        .iter_values()
        .zip(batch.arrays())
        .map(|(field, array)| export(array.as_ref(), field).map(|(f, data)| (f, make_array(data))))
        .collect::<Result<Vec<_>>>()?
        .into_iter()
        .unzip();
    let metadata = batch
        .schema()
        .metadata()
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let schema = Arc::new(Schema::new_with_metadata(fields, metadata));
    let options = RecordBatchOptions::new().with_row_count(Some(batch.height()));
    Ok(RecordBatch::try_new_with_options(schema, columns, &options)?)
}

/// Converts an arrow-rs record batch to a polars-arrow one, zero-copy. Fails on duplicate column
/// names, which a polars schema cannot hold.
pub fn batch_from_arrow(batch: &RecordBatch) -> Result<PolarsBatch> {
    let schema = batch.schema();
    let mut fields = Vec::with_capacity(batch.num_columns());
    let mut columns = Vec::with_capacity(batch.num_columns());
    for (field, column) in schema.fields().iter().zip(batch.columns()) {
        let field = field_from_arrow(field)?;
        columns.push(import(&column.to_data(), field.dtype.clone())?);
        fields.push(field);
    }
    let mut polars_schema = PolarsSchema::from_iter_check_duplicates(fields)
        .map_err(|e| Error::Unsupported(format!("arrow-rs schema as a polars schema: {e}")))?;
    polars_schema.metadata_mut().extend(
        schema
            .metadata()
            .iter()
            .map(|(k, v)| (k.as_str().into(), v.as_str().into())),
    );
    RecordBatchT::try_new(batch.num_rows(), Arc::new(polars_schema), columns)
        .map_err(|e| Error::InvalidData(format!("polars record batch: {e}")))
}

// ---- devices ----

/// Copies a polars-arrow array to `device` (through arrow-rs, without a host copy) and returns
/// when the copy has finished.
pub fn to_device(array: &dyn PolarsArray, device: Device, stream: &Stream) -> Result<DeviceArrayData> {
    transfer::htod_array(array_to_arrow(array)?.as_ref(), device, stream)
}

/// Copies a device array to the host as a polars-arrow array (see [`array_from_arrow`]).
pub fn from_device(array: &DeviceArrayData, stream: &Stream) -> Result<Box<dyn PolarsArray>> {
    array_from_arrow(transfer::dtoh_array(array, stream)?.as_ref())
}

/// Copies a device array to the host as a polars-arrow array of type `dtype` (see
/// [`array_from_arrow_as`]).
pub fn from_device_as(array: &DeviceArrayData, dtype: &ArrowDataType, stream: &Stream) -> Result<Box<dyn PolarsArray>> {
    array_from_arrow_as(transfer::dtoh_array(array, stream)?.as_ref(), dtype)
}

/// Copies a polars-arrow record batch to `device` (through arrow-rs, without a host copy) and
/// returns when the copy has finished.
pub fn batch_to_device(batch: &PolarsBatch, device: Device, stream: &Stream) -> Result<DeviceRecordBatch> {
    transfer::htod(&batch_to_arrow(batch)?, device, stream)
}

/// Copies a device record batch to the host as a polars-arrow record batch.
pub fn batch_from_device(batch: &DeviceRecordBatch, stream: &Stream) -> Result<PolarsBatch> {
    batch_from_arrow(&transfer::dtoh(batch, stream)?)
}

#[cfg(test)]
mod tests {
    use std::mem::offset_of;

    use super::*;

    /// The C structs of both crates have the spec's size, alignment and field offsets. Private
    /// fields cannot be named, so the offsets are checked through values written by the exporter.
    #[test]
    fn c_struct_layouts_match() {
        assert_eq!(size_of::<pffi::ArrowArray>(), 80);
        assert_eq!(size_of::<FFI_ArrowArray>(), 80);
        assert_eq!(size_of::<pffi::ArrowSchema>(), 72);
        assert_eq!(size_of::<FFI_ArrowSchema>(), 72);
        assert_eq!(align_of::<pffi::ArrowArray>(), 8);
        assert_eq!(align_of::<FFI_ArrowArray>(), 8);

        assert_eq!(offset_of!(RawArray, n_children), 32);
        assert_eq!(offset_of!(RawArray, release), 64);
        assert_eq!(offset_of!(RawArray, private_data), 72);

        // Where polars writes each field, arrow-rs reads it.
        let values = polars_arrow::array::PrimitiveArray::<i32>::from([Some(1), None, Some(3), Some(4)]);
        let sliced = values.sliced(1, 3);
        let mut exported = pffi::export_array_to_c(sliced.to_boxed());
        let raw = (&raw mut exported).cast::<RawArray>();
        // SAFETY: `exported` is a live `ArrowArray`, of the layout of `RawArray`.
        let (length, null_count, offset, n_buffers) =
            unsafe { ((*raw).length, (*raw).null_count, (*raw).offset, (*raw).n_buffers) };
        assert_eq!((length, null_count, offset, n_buffers), (3, 1, 1, 2));
        // SAFETY: as above.
        assert!(unsafe { (*raw).release.is_some() && !(*raw).private_data.is_null() });
        let c = array_to_arrow_ffi(exported);
        assert_eq!(
            (c.len(), c.null_count(), c.offset(), c.num_buffers(), c.num_children()),
            (3, 1, 1, 2, 0)
        );
        assert!(!c.is_released());
        let back = array_from_arrow_ffi(c);
        // SAFETY: `back` holds the struct polars exported for an Int32 array.
        let imported = unsafe { pffi::import_array_from_c(back, ArrowDataType::Int32) }.unwrap();
        assert_eq!(imported.as_ref(), &sliced as &dyn PolarsArray);

        let field = PolarsField::new("x".into(), ArrowDataType::Int64, false);
        let schema = schema_to_arrow_ffi(pffi::export_field_to_c(&field));
        assert_eq!(
            (schema.format(), schema.name(), schema.nullable()),
            ("l", Some("x"), false)
        );
    }

    /// polars-arrow 0.55.2 exports sliced Utf8 / Binary offsets from the slice's start. Should an
    /// upgrade fix that, the probe turns the correction off and this test says so.
    #[test]
    fn probe_finds_polars_slice_start_offsets() {
        assert!(
            slice_start_offsets(false),
            "polars-arrow no longer exports Utf8 offsets from the slice start"
        );
        assert!(
            slice_start_offsets(true),
            "polars-arrow no longer exports Binary offsets from the slice start"
        );
    }

    #[test]
    fn refuses_what_polars_cannot_export() {
        for dtype in [
            ArrowDataType::Unknown,
            ArrowDataType::Interval(IntervalUnit::MonthDayMillis),
            ArrowDataType::Time32(TimeUnit::Nanosecond),
            ArrowDataType::Time64(TimeUnit::Second),
            ArrowDataType::Dictionary(IntegerType::Int128, Box::new(ArrowDataType::Utf8View), false),
        ] {
            let err = field_to_arrow(&PolarsField::new("a".into(), dtype.clone(), true)).unwrap_err();
            assert!(matches!(err, Error::Unsupported(_)), "{dtype:?}: {err}");
        }
    }

    #[test]
    fn int128_fields_round_trip() {
        let dtype = ArrowDataType::Struct(vec![
            PolarsField::new("i".into(), ArrowDataType::Int128, true),
            PolarsField::new("u".into(), ArrowDataType::UInt128, false),
        ]);
        let field = PolarsField::new("s".into(), dtype, true);
        let arrow = field_to_arrow(&field).unwrap();
        let DataType::Struct(children) = arrow.data_type() else {
            panic!("{arrow}")
        };
        assert_eq!(children[0].data_type(), &DataType::FixedSizeBinary(16));
        assert_eq!(children[0].metadata()["ARROW:extension:name"], INT128_EXTENSION);
        assert_eq!(field_from_arrow(&arrow).unwrap(), field);
    }
}
