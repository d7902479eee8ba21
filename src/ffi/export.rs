//! Export of device arrays and batches through the C Device Data Interface.

use std::ffi::c_void;
use std::ptr;

use arrow_data::layout;
use arrow_schema::{DataType, Field, Schema};

use crate::abi::{FFI_ArrowArray, FFI_ArrowDeviceArray, FFI_ArrowSchema};
use crate::array::{DeviceArrayData, DeviceRecordBatch, child_types};
use crate::device::{Event, Stream};
use crate::driver::CUevent;
use crate::error::{Error, Result};
use crate::ffi::guard::no_unwind;
use crate::memory::DeviceBuffer;

/// Everything one exported `ArrowArray` owns; freed by [`release`].
struct PrivateData {
    /// Keeps the memory behind `buffer_ptrs` alive.
    _buffers: Vec<DeviceBuffer>,
    /// The lengths of a view array's data buffers (host memory, as the spec requires).
    _variadic_sizes: Option<Box<[i64]>>,
    buffer_ptrs: Box<[*const c_void]>,
    children: Box<[*mut FFI_ArrowArray]>,
    dictionary: *mut FFI_ArrowArray,
    /// The root's event and the `CUevent` handle that `sync_event` points at.
    _event: Option<(Event, Box<CUevent>)>,
}

/// The release callback of every array this crate exports. Releases children and dictionary
/// (those a consumer moved out are already released), then the private data, exactly once. A
/// panic while dropping (the owner of a wrapped buffer may panic) stops inside.
unsafe extern "C" fn release(array: *mut FFI_ArrowArray) {
    if array.is_null() {
        return;
    }
    // SAFETY: the spec hands release a valid pointer to the array being released.
    let array = unsafe { &mut *array };
    if array.release.is_none() || array.private_data.is_null() {
        return;
    }
    // SAFETY: `private_data` was made by `Box::into_raw` in `export_node` and is freed only here,
    // after which `release` is cleared.
    let private = unsafe { Box::from_raw(array.private_data as *mut PrivateData) };
    for &child in private.children.iter() {
        // SAFETY: each child was made by `Box::into_raw`; dropping the box releases it unless a
        // consumer moved it out (then its release is already null).
        no_unwind(|| drop(unsafe { Box::from_raw(child) }));
    }
    if !private.dictionary.is_null() {
        // SAFETY: as for the children.
        no_unwind(|| drop(unsafe { Box::from_raw(private.dictionary) }));
    }
    no_unwind(|| drop(private));
    array.release = None;
    array.private_data = ptr::null_mut();
}

/// The C struct of `data`, which passed [`DeviceArrayData::check`]: its buffer and child counts
/// are those of its type.
fn export_node(data: &DeviceArrayData, event: Option<(Event, Box<CUevent>)>) -> FFI_ArrowArray {
    let spec = layout(&data.data_type);
    let mut owned: Vec<DeviceBuffer> = Vec::with_capacity(data.buffers.len() + 1);
    let mut ptrs: Vec<*const c_void> = Vec::with_capacity(data.buffers.len() + 2);
    // Zero-length buffers keep their (aligned, non-null) address too: some consumers insist on one.
    let address = |b: &DeviceBuffer| b.address() as *const c_void;
    if spec.can_contain_null_mask {
        ptrs.push(data.nulls.as_ref().map_or(ptr::null(), address));
        owned.extend(data.nulls.iter().cloned());
    }
    for b in &data.buffers {
        ptrs.push(address(b));
        owned.push(b.clone());
    }
    let variadic_sizes = spec
        .variadic
        .then(|| data.buffers[1..].iter().map(|b| b.len() as i64).collect::<Box<[i64]>>());
    if let Some(sizes) = &variadic_sizes {
        ptrs.push(sizes.as_ptr() as *const c_void);
    }
    let (children, dictionary) = match data.data_type {
        DataType::Dictionary(..) => (&[][..], Box::into_raw(Box::new(export_node(&data.children[0], None)))),
        _ => (&data.children[..], ptr::null_mut()),
    };
    let children: Box<[*mut FFI_ArrowArray]> = children
        .iter()
        .map(|c| Box::into_raw(Box::new(export_node(c, None))))
        .collect();
    let null_count = match (&data.data_type, data.null_count) {
        (DataType::Null, _) => data.len as i64,
        (_, Some(n)) => n as i64,
        (_, None) => -1,
    };
    let mut private = Box::new(PrivateData {
        _buffers: owned,
        _variadic_sizes: variadic_sizes,
        buffer_ptrs: ptrs.into_boxed_slice(),
        children,
        dictionary,
        _event: event,
    });
    FFI_ArrowArray {
        length: data.len as i64,
        null_count,
        offset: data.offset as i64,
        n_buffers: private.buffer_ptrs.len() as i64,
        n_children: private.children.len() as i64,
        buffers: private.buffer_ptrs.as_mut_ptr(),
        children: private.children.as_mut_ptr(),
        dictionary,
        release: Some(release),
        private_data: Box::into_raw(private) as *mut c_void,
    }
}

/// Exports an array. Its `sync_event` is recorded on `stream` after `ready`, so a consumer that
/// waits on it sees everything issued so far; it is null for the CPU device. The exported struct
/// owns references to the memory, which stays alive until the consumer releases it. Fails on an
/// array that [`DeviceArrayData::try_new`] would refuse.
pub fn export_array(array: &DeviceArrayData, ready: &Event, stream: &Stream) -> Result<FFI_ArrowDeviceArray> {
    array.check()?;
    let device = array.device();
    let event = match device.ordinal() {
        None => None,
        Some(_) => {
            let stream = crate::memory::stream_for(stream, device, device)?;
            let stream = if stream.cuda().is_some() {
                stream
            } else {
                Stream::shared(device)?
            };
            stream.wait(ready)?;
            let event = stream.record()?;
            let handle = Box::new(event.cuda().map_or(ptr::null_mut(), |e| e.cu_event()));
            Some((event, handle))
        }
    };
    let sync_event = event.as_ref().map_or(ptr::null_mut(), |(_, handle)| {
        &**handle as *const CUevent as *mut c_void
    });
    Ok(FFI_ArrowDeviceArray {
        array: export_node(array, event),
        device_id: device.device_id(),
        device_type: device.device_type(),
        sync_event,
        reserved: [0; 3],
    })
}

/// Exports a batch as a struct array, with its schema (metadata included).
pub fn export_batch(batch: &DeviceRecordBatch, stream: &Stream) -> Result<(FFI_ArrowDeviceArray, FFI_ArrowSchema)> {
    let schema = export_schema(batch.schema())?;
    let array = export_array(&as_struct(batch), batch.ready(), stream)?;
    Ok((array, schema))
}

/// Exports the schema of an array.
pub fn export_field(field: &Field) -> Result<FFI_ArrowSchema> {
    check_time_zones(field.data_type())?;
    Ok(FFI_ArrowSchema::try_from(field)?)
}

/// Exports a schema (as a struct type, with its metadata).
pub(crate) fn export_schema(schema: &Schema) -> Result<FFI_ArrowSchema> {
    schema
        .fields()
        .iter()
        .try_for_each(|f| check_time_zones(f.data_type()))?;
    Ok(FFI_ArrowSchema::try_from(schema)?)
}

/// Fails on a time zone with a NUL byte, which a C format string cannot hold (arrow-rs's export
/// unwraps the error into a panic).
fn check_time_zones(dt: &DataType) -> Result<()> {
    if let DataType::Timestamp(_, Some(tz)) = dt
        && tz.contains('\0')
    {
        return Err(Error::InvalidArgument(format!(
            "time zone {tz:?} has a NUL byte, which a C format string cannot hold"
        )));
    }
    child_types(dt).into_iter().try_for_each(check_time_zones)
}

/// A batch as one struct array without a validity bitmap.
pub(crate) fn as_struct(batch: &DeviceRecordBatch) -> DeviceArrayData {
    DeviceArrayData {
        data_type: DataType::Struct(batch.schema().fields().clone()),
        len: batch.num_rows(),
        offset: 0,
        null_count: Some(0),
        nulls: None,
        buffers: Default::default(),
        children: batch.columns().to_vec(),
        trusted: false,
    }
}
