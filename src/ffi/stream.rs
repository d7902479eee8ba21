//! `ArrowDeviceArrayStream`: sequences of device batches across the C interface.

use std::ffi::{CStr, CString, c_char};

use arrow_schema::SchemaRef;

use crate::abi::{DeviceType, FFI_ArrowDeviceArray, FFI_ArrowDeviceArrayStream, FFI_ArrowSchema};
use crate::array::DeviceRecordBatch;
use crate::device::Stream;
use crate::error::{Error, Result};
use crate::ffi::export_batch;
use crate::ffi::guard::no_unwind;
use crate::ffi::import::import_batch_of;
use crate::ffi::schema::import_schema_ref;
use crate::ffi::schema_export::export_schema;

const EINVAL: i32 = 22;
const EIO: i32 = 5;

/// A boxed source of batches.
type Batches = Box<dyn Iterator<Item = Result<DeviceRecordBatch>> + Send>;

struct StreamPrivate {
    schema: SchemaRef,
    batches: Batches,
    device_type: DeviceType,
    stream: Stream,
    last_error: Option<CString>,
}

/// Exports `batches`, all of `device_type` and of `schema`, as a stream. Each batch's `sync_event`
/// is recorded on `stream`.
pub fn export_stream(
    schema: SchemaRef,
    batches: impl Iterator<Item = Result<DeviceRecordBatch>> + Send + 'static,
    device_type: DeviceType,
    stream: Stream,
) -> FFI_ArrowDeviceArrayStream {
    let private = Box::new(StreamPrivate {
        schema,
        batches: Box::new(batches),
        device_type,
        stream,
        last_error: None,
    });
    FFI_ArrowDeviceArrayStream {
        device_type,
        get_schema: Some(get_schema),
        get_next: Some(get_next),
        get_last_error: Some(get_last_error),
        release: Some(release_stream),
        private_data: Box::into_raw(private) as *mut std::ffi::c_void,
    }
}

/// The private data of a live stream.
///
/// # Safety
/// `s` must be a stream made by [`export_stream`] that has not been released.
unsafe fn private<'a>(s: *mut FFI_ArrowDeviceArrayStream) -> Option<&'a mut StreamPrivate> {
    // SAFETY: per the caller, `private_data` is our box, alive until release.
    unsafe { s.as_ref().and_then(|s| (s.private_data as *mut StreamPrivate).as_mut()) }
}

/// Runs `f`, turning errors and panics into an errno and a stored message.
fn guarded(p: &mut StreamPrivate, f: impl FnOnce(&mut StreamPrivate) -> Result<()>) -> i32 {
    let (code, message) = match no_unwind(|| f(p)) {
        Some(Ok(())) => return 0,
        Some(Err(e @ Error::InvalidArgument(_))) => (EINVAL, e.to_string()),
        Some(Err(e)) => (EIO, e.to_string()),
        None => (EIO, "panic while producing the next batch".to_string()),
    };
    p.last_error = CString::new(message.replace('\0', " ")).ok();
    code
}

unsafe extern "C" fn get_schema(s: *mut FFI_ArrowDeviceArrayStream, out: *mut FFI_ArrowSchema) -> i32 {
    // SAFETY: the consumer calls this on our live stream.
    let Some(p) = (unsafe { private(s) }) else {
        return EINVAL;
    };
    if out.is_null() {
        return EINVAL;
    }
    guarded(p, |p| {
        let schema = export_schema(&p.schema)?;
        // SAFETY: `out` is a valid destination (spec); it is overwritten without being released.
        unsafe { std::ptr::write(out, schema) };
        Ok(())
    })
}

unsafe extern "C" fn get_next(s: *mut FFI_ArrowDeviceArrayStream, out: *mut FFI_ArrowDeviceArray) -> i32 {
    // SAFETY: the consumer calls this on our live stream.
    let Some(p) = (unsafe { private(s) }) else {
        return EINVAL;
    };
    if out.is_null() {
        return EINVAL;
    }
    guarded(p, |p| {
        let array = match p.batches.next() {
            None => FFI_ArrowDeviceArray::empty(),
            Some(batch) => {
                let batch = batch?;
                if batch.device().device_type() != p.device_type && batch.num_columns() > 0 {
                    return Err(Error::InvalidData(format!(
                        "a {} batch in a {} stream",
                        batch.device().device_type(),
                        p.device_type
                    )));
                }
                export_batch(&batch, &p.stream)?.0
            }
        };
        // SAFETY: `out` is a valid destination (spec).
        unsafe { std::ptr::write(out, array) };
        Ok(())
    })
}

unsafe extern "C" fn get_last_error(s: *mut FFI_ArrowDeviceArrayStream) -> *const c_char {
    // SAFETY: the consumer calls this on our live stream.
    match unsafe { private(s) } {
        Some(StreamPrivate {
            last_error: Some(e), ..
        }) => e.as_ptr(),
        _ => std::ptr::null(),
    }
}

/// Drops the producer's iterator (a panic in its `Drop` stops here) and marks the stream released.
unsafe extern "C" fn release_stream(s: *mut FFI_ArrowDeviceArrayStream) {
    // SAFETY: the consumer releases our stream once.
    let Some(stream) = (unsafe { s.as_mut() }) else { return };
    if !stream.private_data.is_null() {
        // SAFETY: made by `Box::into_raw` in `export_stream`, freed only here.
        let private = unsafe { Box::from_raw(stream.private_data as *mut StreamPrivate) };
        no_unwind(|| drop(private));
    }
    // Overwritten without dropping the old value: its `Drop` would call this release again.
    // SAFETY: `s` is valid (non-null, checked above) and the old value needs no other drop.
    unsafe { std::ptr::write(s, FFI_ArrowDeviceArrayStream::empty()) };
}

/// Imports an `ArrowDeviceArrayStream` as an iterator of device batches.
pub struct DeviceArrayStreamReader {
    raw: FFI_ArrowDeviceArrayStream,
    schema: SchemaRef,
    stream: Stream,
    done: bool,
}

impl DeviceArrayStreamReader {
    /// Takes the stream out of `raw` (leaving it released) and reads its schema. Batches are
    /// imported on `stream`.
    ///
    /// # Safety
    /// `raw` must point to a valid stream that follows the spec.
    pub unsafe fn from_raw(raw: *mut FFI_ArrowDeviceArrayStream, stream: Stream) -> Result<Self> {
        if raw.is_null() {
            return Err(Error::InvalidData("null stream".into()));
        }
        // SAFETY: valid per the caller; moved out so that we release it exactly once.
        let mut raw = unsafe { FFI_ArrowDeviceArrayStream::from_raw(raw) };
        let get_schema = match (raw.release, raw.get_schema, raw.get_next) {
            (Some(_), Some(get_schema), Some(_)) => get_schema,
            _ => return Err(Error::InvalidData("released stream or missing callbacks".into())),
        };
        let mut schema = FFI_ArrowSchema::empty();
        // SAFETY: calling the producer's callback as the spec says.
        let code = unsafe { get_schema(&mut raw, &mut schema) };
        if code != 0 {
            return Err(Error::InvalidData(format!(
                "get_schema failed ({code}): {}",
                last_error(&mut raw)
            )));
        }
        // SAFETY: the producer filled `schema` (code 0), per the spec.
        let schema = unsafe { import_schema_ref(&schema) }?;
        Ok(DeviceArrayStreamReader {
            raw,
            schema,
            stream,
            done: false,
        })
    }

    /// The schema of every batch.
    pub fn schema(&self) -> SchemaRef {
        self.schema.clone()
    }

    /// The device type the producer declared.
    pub fn device_type(&self) -> DeviceType {
        self.raw.device_type
    }
}

fn last_error(raw: &mut FFI_ArrowDeviceArrayStream) -> String {
    let Some(f) = raw.get_last_error else {
        return "no message".into();
    };
    // SAFETY: the producer's callback, on its live stream.
    let p = unsafe { f(raw) };
    if p.is_null() {
        return "no message".into();
    }
    // SAFETY: a NUL-terminated string valid until the next call (spec).
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

impl Iterator for DeviceArrayStreamReader {
    type Item = Result<DeviceRecordBatch>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        let get_next = self.raw.get_next?;
        let mut array = FFI_ArrowDeviceArray::empty();
        // SAFETY: the producer's callback, on its live stream.
        let code = unsafe { get_next(&mut self.raw, &mut array) };
        if code != 0 {
            self.done = true;
            return Some(Err(Error::InvalidData(format!(
                "get_next failed ({code}): {}",
                last_error(&mut self.raw)
            ))));
        }
        if array.is_released() {
            self.done = true;
            return None;
        }
        // Every batch of a stream has the stream's schema (spec).
        // SAFETY: the producer follows the spec (the caller of `from_raw` vouched for it).
        Some(unsafe { import_batch_of(array, self.schema.clone(), &self.stream) })
    }
}
