//! Arrow IPC across processes: device messages, handles, zero-copy descriptors and the channel.
//!
//! Every case runs on the CPU device (shared memory stands in for CUDA IPC) and, where a GPU is
//! present, on CUDA. Cross-process cases spawn this test binary as the peer: the `peer` test does
//! what `ARROW_CUDA_IPC_PEER` says and returns at once when it is not set.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, PoisonError, RwLock, RwLockReadGuard, mpsc};
use std::time::{Duration, Instant};

use arrow_array::types::Int16Type;
use arrow_array::{
    Array, ArrayRef, DictionaryArray, Int16Array, Int32Array, Int64Array, ListArray, RecordBatch, StringArray,
    StructArray,
};
use arrow_cuda::device::DeviceUuid;
use arrow_cuda::ipc::{
    self, BatchDescriptor, BufferLocation, DeviceMessage, IpcMemHandle, Receiver, ReceiverOptions, Sender, SenderEvent,
    SenderOptions,
};
use arrow_cuda::memory::{SharedMemHandle, StridedView};
use arrow_cuda::transfer::{dtoh, dtoh_array, dtoh_async, htod_async};
use arrow_cuda::{Device, DeviceBuffer, DeviceRecordBatch, Error, Event, MemoryResource, Stream};
use arrow_ipc::writer::{DictionaryTracker, IpcDataGenerator, IpcWriteContext, IpcWriteOptions};
use arrow_schema::{DataType, Field, Fields, Schema, SchemaRef};
use common::corpus::{ROWS, every_type_batch};
use common::{Gate, check_batch};
use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Held for reading by every case of this binary that may use a GPU, and for writing by the fault
/// runs while they measure the device's free memory: no other case allocates meanwhile.
static DEVICE_MEMORY: RwLock<()> = RwLock::new(());

fn using_devices() -> RwLockReadGuard<'static, ()> {
    DEVICE_MEMORY.read().unwrap_or_else(PoisonError::into_inner)
}

/// [`common::each_device`], holding [`DEVICE_MEMORY`] for reading.
fn each_device(case: impl FnMut(Device, &Stream)) {
    let _devices = using_devices();
    common::each_device(case)
}

// ---------------------------------------------------------------------------------------------
// Batches.

/// The corpus of every type (its dictionary columns travel as dictionary batches).
fn corpus() -> RecordBatch {
    every_type_batch()
}

/// Memory another process can open: what messages are written into (on a GPU CUDA IPC memory,
/// which Arrow C++ reads).
fn exportable(device: Device) -> MemoryResource {
    ipc::default_message_resource(device)
}

/// Memory the channel lends without a copy (on a GPU shared device memory, where it has it).
fn lendable(device: Device) -> MemoryResource {
    MemoryResource::shared_for(device)
}

/// `batch` on `device`, in memory of `resource`, once the copy has finished.
fn upload(batch: &RecordBatch, resource: MemoryResource, stream: &Stream) -> DeviceRecordBatch {
    let b = htod_async(batch, resource, stream).unwrap();
    b.ready().synchronize().unwrap();
    b
}

fn is_invalid_data(e: &Error) -> bool {
    matches!(e, Error::InvalidData(_))
}

// ---------------------------------------------------------------------------------------------
// Messages in device memory.

#[test]
fn messages_round_trip_every_type() {
    let batch = corpus();
    each_device(|device, stream| {
        for resource in [MemoryResource::default_for(device), exportable(device)] {
            let what = format!("{device} from {resource:?}");
            let on_device = upload(&batch, resource, stream);
            let message = ipc::write_message(&on_device, stream).unwrap();
            assert_eq!(message.buffer().device(), device, "{what}");
            assert_eq!(message.buffer().resource(), exportable(device), "{what}");
            assert_eq!(message.body_offset() % 64, 0, "{what}");
            let read = ipc::read_message(message.buffer(), &batch.schema(), stream).unwrap();
            assert_eq!(read.num_rows(), batch.num_rows());
            for b in read.columns().iter().flat_map(|c| c.all_buffers()) {
                assert!(
                    b.shares_allocation(message.buffer()),
                    "{what}: a buffer that is not a view of the message"
                );
            }
            check_batch(&what, &dtoh(&read, stream).unwrap(), &batch);
        }
    });
}

/// The bytes of a message, copied to the host.
fn host_bytes(message: &DeviceMessage, stream: &Stream) -> Vec<u8> {
    message.buffer().to_vec(stream).unwrap()
}

/// Where each encapsulated message in `bytes` starts; requires that the last ends where the bytes
/// end.
fn message_starts(bytes: &[u8]) -> Vec<usize> {
    let mut starts = vec![];
    let mut start = 0;
    while start < bytes.len() {
        starts.push(start);
        assert_eq!(&bytes[start..start + 4], &[0xff; 4]);
        let meta_len = i32::from_le_bytes(bytes[start + 4..start + 8].try_into().unwrap()) as usize;
        assert_eq!((8 + meta_len) % 8, 0, "the metadata is padded to 8 bytes");
        let message = arrow_ipc::root_as_message(&bytes[start + 8..start + 8 + meta_len]).unwrap();
        start += 8 + meta_len + message.bodyLength() as usize;
    }
    assert_eq!(start, bytes.len(), "the last message ends where the bytes end");
    starts
}

/// Reads the messages of one batch (its dictionaries', then its own) with arrow-ipc's stream
/// reader, after the schema message.
fn read_with_arrow_ipc(bytes: &[u8], schema: SchemaRef) -> RecordBatch {
    message_starts(bytes);
    let mut stream = ipc::encode_schema(&schema);
    stream.extend_from_slice(bytes);
    stream.extend_from_slice(&[0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0]);
    let mut reader = arrow_ipc::reader::StreamReader::try_new(std::io::Cursor::new(stream), None).unwrap();
    let batch = reader.next().unwrap().unwrap();
    assert!(reader.next().is_none(), "one batch");
    batch
}

/// The messages arrow-rs writes for `batch`, its dictionaries' first (64-byte alignment, metadata
/// version V5).
fn arrow_rs_message(batch: &RecordBatch) -> Vec<u8> {
    let options = IpcWriteOptions::default();
    let generator = IpcDataGenerator::default();
    let mut tracker = DictionaryTracker::new(false);
    generator.schema_to_bytes_with_dictionary_tracker(&batch.schema(), &mut tracker, &options);
    let (dictionaries, encoded) = generator
        .encode(batch, &mut tracker, &options, &mut IpcWriteContext::default())
        .unwrap();
    let mut out = Vec::new();
    for e in dictionaries.into_iter().chain([encoded]) {
        arrow_ipc::writer::write_message(&mut out, e, &options).unwrap();
    }
    out
}

/// Requires the same messages, byte for byte, in `ours` and `theirs`.
fn same_messages(what: &str, ours: &[u8], theirs: &[u8]) {
    let starts = message_starts(ours);
    assert_eq!(starts, message_starts(theirs), "{what}: where the messages start");
    for (i, &s) in starts.iter().enumerate() {
        let end = starts.get(i + 1).copied().unwrap_or(ours.len());
        let meta_len = i32::from_le_bytes(ours[s + 4..s + 8].try_into().unwrap()) as usize;
        assert!(
            ours[s..s + 8 + meta_len] == theirs[s..s + 8 + meta_len],
            "{what}: the metadata of message {i} differs from arrow-rs's"
        );
        let diff: Vec<_> = (s..end)
            .filter(|&j| ours[j] != theirs[j])
            .map(|j| (j - s, ours[j], theirs[j]))
            .take(10)
            .collect();
        assert!(
            ours[s..end] == theirs[s..end],
            "{what}: the body of message {i} differs from arrow-rs's {diff:?}"
        );
    }
    assert_eq!(ours.len(), theirs.len());
}

#[test]
fn messages_are_ordinary_arrow_ipc_messages() {
    let batch = corpus();
    each_device(|device, stream| {
        let on_device = upload(&batch, exportable(device), stream);
        let message = ipc::write_message(&on_device, stream).unwrap();
        let bytes = host_bytes(&message, stream);
        check_batch(
            &format!("{device}: arrow-ipc reads the message"),
            &read_with_arrow_ipc(&bytes, batch.schema()),
            &batch,
        );
        let at = message_starts(&bytes).last().unwrap() + 8;
        assert_eq!(&bytes[at..at + message.metadata().len()], message.metadata());
        same_messages(&format!("{device}"), &bytes, &arrow_rs_message(&batch));
    });
}

#[test]
fn sliced_batches_take_the_host_path() {
    let batch = corpus();
    each_device(|device, stream| {
        let on_device = upload(&batch, exportable(device), stream);
        for (offset, len) in [(1, ROWS - 1), (7, 100), (64, 3), (ROWS, 0)] {
            let what = format!("{device}: slice {offset}..+{len}");
            let slice = on_device.slice(offset, len).unwrap();
            assert!(ipc::needs_normalising(&slice), "{what}");
            let message = ipc::write_message(&slice, stream).unwrap();
            let read = ipc::read_message(message.buffer(), &batch.schema(), stream).unwrap();
            check_batch(&what, &dtoh(&read, stream).unwrap(), &batch.slice(offset, len));
            check_batch(
                &what,
                &read_with_arrow_ipc(&host_bytes(&message, stream), batch.schema()),
                &batch.slice(offset, len),
            );
        }
    });
}

#[test]
fn empty_batches_round_trip() {
    let batch = corpus();
    each_device(|device, stream| {
        for b in [batch.slice(0, 0), RecordBatch::new_empty(Arc::new(Schema::empty()))] {
            let on_device = upload(&b, exportable(device), stream);
            let message = ipc::write_message(&on_device, stream).unwrap();
            let read = ipc::read_message(message.buffer(), &b.schema(), stream).unwrap();
            check_batch(&format!("{device}: empty"), &dtoh(&read, stream).unwrap(), &b);
        }
    });
}

/// Dictionaries inside a struct and a list, a dictionary whose values hold another, two
/// dictionaries in one struct, and a plain column between them.
fn nested_dictionaries(rows: usize) -> RecordBatch {
    let words = |n: usize, seed: usize| -> ArrayRef {
        Arc::new(StringArray::from_iter(
            (0..n).map(|i| (i % 5 != seed % 5).then(|| format!("w{}", i * seed))),
        ))
    };
    let keys = |n: usize, of: usize| {
        Int16Array::from_iter((0..rows).map(|i| (i % 7 != 3).then_some(((i * 3 + n) % of) as i16)))
    };
    let dict = |n: usize, values: ArrayRef| -> ArrayRef {
        let of = values.len();
        Arc::new(DictionaryArray::<Int16Type>::try_new(keys(n, of), values).unwrap())
    };
    let field = |name: &str, a: &ArrayRef| Arc::new(Field::new(name, a.data_type().clone(), true));
    let (a, b) = (dict(1, words(6, 1)), dict(2, words(4, 2)));
    let pair = StructArray::from(vec![(field("a", &a), a), (field("b", &b), b)]);
    let inner = dict(3, words(9, 3));
    // Values that hold a dictionary: structs of 11 keys into 9 words (arrow-rs's IPC writer
    // cannot describe a dictionary directly inside another's values).
    let keyed: ArrayRef = Arc::new(
        DictionaryArray::<Int16Type>::try_new(
            Int16Array::from_iter((0..11).map(|i| Some((i % 9) as i16))),
            words(9, 4),
        )
        .unwrap(),
    );
    let middle: ArrayRef = Arc::new(StructArray::from(vec![(field("x", &keyed), keyed)]));
    let outer = dict(4, middle);
    let offsets = arrow_buffer::OffsetBuffer::from_lengths((0..rows).map(|i| i % 3));
    let list_values = dict(5, words(5, 5));
    let total = offsets.last().copied().unwrap_or(0) as usize;
    let list = ListArray::new(
        Arc::new(Field::new_list_field(list_values.data_type().clone(), true)),
        offsets,
        list_values.slice(0, total),
        None,
    );
    let plain: ArrayRef = Arc::new(Int64Array::from_iter_values((0..rows as i64).map(|i| i * 11)));
    RecordBatch::try_from_iter([
        ("pair", Arc::new(pair) as ArrayRef),
        ("plain", plain),
        ("inner", inner),
        ("outer", outer),
        ("list", Arc::new(list) as ArrayRef),
    ])
    .unwrap()
}

#[test]
fn dictionaries_travel_as_dictionary_batches() {
    let batch = nested_dictionaries(40);
    each_device(|device, stream| {
        let on_device = upload(&batch, exportable(device), stream);
        let message = ipc::write_message(&on_device, stream).unwrap();
        // pair.a, pair.b, inner, the dictionary in outer's values, outer, the list's values.
        assert_eq!(message.num_dictionaries(), 6, "{device}");
        let read = ipc::read_message(message.buffer(), &batch.schema(), stream).unwrap();
        check_batch(&format!("{device}: read"), &dtoh(&read, stream).unwrap(), &batch);
        let bytes = host_bytes(&message, stream);
        same_messages(&format!("{device}"), &bytes, &arrow_rs_message(&batch));
        check_batch(
            &format!("{device}: arrow-ipc reads the messages"),
            &read_with_arrow_ipc(&bytes, batch.schema()),
            &batch,
        );
        for d in [
            BatchDescriptor::describe(&on_device).unwrap(),
            BatchDescriptor::of_message(&message).unwrap(),
        ] {
            if device != Device::Cpu {
                // Descriptors of CUDA memory are opened by other processes (see the channel tests).
                continue;
            }
            assert_eq!(d.dictionaries.len(), 6);
            let read = through_bytes(&d)
                .import(&batch.schema(), Event::completed(), ())
                .unwrap();
            check_batch("descriptor", &dtoh(&read, stream).unwrap(), &batch);
        }
        // A slice takes the host path, dictionaries and all.
        let slice = on_device.slice(5, 20).unwrap();
        let message = ipc::write_message(&slice, stream).unwrap();
        let read = ipc::read_message(message.buffer(), &batch.schema(), stream).unwrap();
        check_batch(
            &format!("{device}: slice"),
            &dtoh(&read, stream).unwrap(),
            &batch.slice(5, 20),
        );
    });
}

#[test]
fn missing_or_delta_dictionaries_are_errors() {
    let batch = nested_dictionaries(10);
    let schema = batch.schema();
    let (bytes, _) = host_message(&batch);
    read_host(&bytes, &schema).unwrap();
    // Only the record batch message: its dictionaries were never sent.
    let batch_start = *message_starts(&bytes).last().unwrap();
    let e = read_host(&bytes[batch_start..], &schema).unwrap_err();
    assert!(is_invalid_data(&e), "{e}");
    assert!(e.to_string().contains("was not sent"), "{e}");
    // A dictionary message alone.
    let e = read_host(&bytes[..batch_start], &schema).unwrap_err();
    assert!(is_invalid_data(&e), "{e}");
    // Dictionaries that a schema without dictionary columns has no place for.
    let plain = Arc::new(Schema::new(vec![Field::new("plain", DataType::Int64, false)]));
    let e = read_host(&bytes, &plain).unwrap_err();
    assert!(e.to_string().contains("no such dictionary"), "{e}");
    // A delta dictionary: arrow-rs writes one when a dictionary grows.
    let column = |values: Vec<&str>| -> RecordBatch {
        let keys = Int16Array::from_iter_values((0..values.len() as i16).rev());
        let dict: ArrayRef =
            Arc::new(DictionaryArray::<Int16Type>::try_new(keys, Arc::new(StringArray::from(values))).unwrap());
        RecordBatch::try_from_iter([("d", dict)]).unwrap()
    };
    let (first, grown) = (column(vec!["a", "b"]), column(vec!["a", "b", "c"]));
    let schema = first.schema();
    let options = IpcWriteOptions::default().with_dictionary_handling(arrow_ipc::writer::DictionaryHandling::Delta);
    let generator = IpcDataGenerator::default();
    let mut tracker = DictionaryTracker::new(false);
    generator.schema_to_bytes_with_dictionary_tracker(&schema, &mut tracker, &options);
    let mut out = Vec::new();
    for b in [&first, &grown] {
        let (dictionaries, encoded) = generator
            .encode(b, &mut tracker, &options, &mut IpcWriteContext::default())
            .unwrap();
        out.clear();
        for e in dictionaries.into_iter().chain([encoded]) {
            arrow_ipc::writer::write_message(&mut out, e, &options).unwrap();
        }
    }
    let delta = arrow_ipc::root_as_message(&out[8..]).unwrap();
    assert!(
        delta.header_as_dictionary_batch().unwrap().isDelta(),
        "arrow-rs wrote a delta"
    );
    assert!(matches!(read_host(&out, &schema).unwrap_err(), Error::Unsupported(_)));
}

#[test]
fn schemas_travel_as_host_messages() {
    let schema = every_type_batch().schema();
    let bytes = ipc::encode_schema(&schema);
    assert_eq!(ipc::decode_schema(&bytes).unwrap(), schema);
    assert!(is_invalid_data(
        &ipc::decode_schema(&bytes[..bytes.len() / 2]).unwrap_err()
    ));
    assert!(is_invalid_data(
        &ipc::decode_schema(b"not a schema at all").unwrap_err()
    ));
}

/// A valid message of `batch` in host memory, with its metadata range.
fn host_message(batch: &RecordBatch) -> (Vec<u8>, usize) {
    let stream = Stream::cpu();
    let on_device = upload(batch, MemoryResource::Host, &stream);
    let message = ipc::write_message_to(&on_device, MemoryResource::Host, &stream).unwrap();
    (host_bytes(&message, &stream), message.body_offset())
}

fn read_host(bytes: &[u8], schema: &SchemaRef) -> arrow_cuda::Result<DeviceRecordBatch> {
    let stream = Stream::cpu();
    let buffer = DeviceBuffer::from_host(bytes, MemoryResource::Host, &stream).unwrap();
    ipc::read_message(&buffer, schema, &stream)
}

fn small_batch(rows: usize) -> RecordBatch {
    let ints: ArrayRef = Arc::new(Int64Array::from_iter(
        (0..rows as i64).map(|i| (i % 3 != 0).then_some(i * 7)),
    ));
    let strings: ArrayRef = Arc::new(StringArray::from_iter(
        (0..rows).map(|i| (i % 4 != 1).then(|| format!("s{i}"))),
    ));
    RecordBatch::try_from_iter([("ints", ints), ("strings", strings)]).unwrap()
}

#[test]
fn malformed_messages_are_errors() {
    let batch = small_batch(100);
    let schema = batch.schema();
    let (bytes, body_offset) = host_message(&batch);
    read_host(&bytes, &schema).unwrap();
    // Truncated anywhere: in the prefix, the metadata, the body.
    for cut in [0, 3, 7, 8, 20, body_offset - 1, body_offset, bytes.len() - 1] {
        let e = read_host(&bytes[..cut], &schema).unwrap_err();
        assert!(is_invalid_data(&e), "cut at {cut}: {e}");
    }
    // An end-of-stream marker, a negative metadata length, one past the end.
    let mut b = bytes.clone();
    b[4..8].copy_from_slice(&0i32.to_le_bytes());
    assert!(is_invalid_data(&read_host(&b, &schema).unwrap_err()));
    b[4..8].copy_from_slice(&(-8i32).to_le_bytes());
    assert!(is_invalid_data(&read_host(&b, &schema).unwrap_err()));
    b[4..8].copy_from_slice(&(bytes.len() as i32).to_le_bytes());
    assert!(is_invalid_data(&read_host(&b, &schema).unwrap_err()));
    // Garbage metadata.
    let mut b = bytes.clone();
    b[8..body_offset].iter_mut().for_each(|x| *x = 0x5a);
    assert!(is_invalid_data(&read_host(&b, &schema).unwrap_err()));
    // A schema with another shape.
    let other = Arc::new(Schema::new(vec![Field::new("ints", DataType::Int64, true)]));
    assert!(is_invalid_data(&read_host(&bytes, &other).unwrap_err()));
    let wider = Arc::new(Schema::new(vec![
        Field::new("ints", DataType::Int64, true),
        Field::new("strings", DataType::Utf8, true),
        Field::new("more", DataType::Int32, true),
    ]));
    assert!(is_invalid_data(&read_host(&bytes, &wider).unwrap_err()));
    let wrong_width = Arc::new(Schema::new(vec![
        Field::new("ints", DataType::Decimal256(40, 2), true),
        Field::new("strings", DataType::Utf8, true),
    ]));
    assert!(is_invalid_data(&read_host(&bytes, &wrong_width).unwrap_err()));
    // A schema message where a record batch belongs.
    let mut schema_message = ipc::encode_schema(&schema);
    schema_message.extend_from_slice(&[0; 64]);
    assert!(is_invalid_data(&read_host(&schema_message, &schema).unwrap_err()));
}

/// A message read with a schema whose types `DeviceArrayData::try_new` refuses (here a map whose
/// entries have three fields, laid out as a list of such structs is) is refused on receipt, as an
/// array assembled from the same parts by hand would be: decoding checks the schema's types as
/// `try_new` does (and debug builds assert that every array it builds passes all of its checks).
#[test]
fn received_arrays_pass_the_checks_of_try_new() {
    let entries = Fields::from(vec![
        Field::new("key", DataType::Int32, false),
        Field::new("value", DataType::Int32, true),
        Field::new("extra", DataType::Int32, true),
    ]);
    let columns: Vec<ArrayRef> = (0..3)
        .map(|i| Arc::new(Int32Array::from_iter_values((0..6).map(|x| x * 10 + i))) as ArrayRef)
        .collect();
    let structs = StructArray::new(entries.clone(), columns, None);
    let entry = Arc::new(Field::new("entries", DataType::Struct(entries), false));
    let offsets = arrow_buffer::OffsetBuffer::from_lengths([2, 0, 4]);
    let list: ArrayRef = Arc::new(ListArray::new(entry.clone(), offsets, Arc::new(structs), None));
    let batch = RecordBatch::try_from_iter([("m", list)]).unwrap();
    let (bytes, _) = host_message(&batch);
    read_host(&bytes, &batch.schema()).expect("the list reads");
    let as_map = Arc::new(Schema::new(vec![Field::new("m", DataType::Map(entry, false), true)]));
    let e = read_host(&bytes, &as_map).unwrap_err();
    assert!(is_invalid_data(&e), "{e}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes_are_not_messages(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
        let schema = small_batch(1).schema();
        let _ = read_host(&bytes, &schema);
        let mut prefixed = vec![0xff, 0xff, 0xff, 0xff];
        prefixed.extend_from_slice(&((bytes.len() as i32).to_le_bytes()));
        prefixed.extend_from_slice(&bytes);
        let _ = read_host(&prefixed, &schema);
    }

    #[test]
    fn mutated_messages_are_read_or_refused(
        rows in 0usize..40,
        dictionaries in any::<bool>(),
        flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in any::<prop::sample::Index>(),
        truncate in any::<bool>(),
    ) {
        let batch = if dictionaries { nested_dictionaries(rows) } else { small_batch(rows) };
        let (mut bytes, body_offset) = host_message(&batch);
        for (at, value) in flips {
            // Mostly the metadata, where the structure is.
            let i = at.index(body_offset.min(bytes.len()));
            bytes[i] = value;
        }
        if truncate {
            bytes.truncate(cut.index(bytes.len() + 1));
        }
        if let Ok(read) = read_host(&bytes, &batch.schema()) {
            // Whatever was accepted lies inside the message; copying it out validates it fully.
            let _ = dtoh(&read, &Stream::cpu());
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Handles.

#[test]
fn cuda_ipc_handles_serialize_as_arrow_cpp_does() {
    let bytes: [u8; 64] = std::array::from_fn(|i| (i * 3) as u8);
    let handle = IpcMemHandle::from_parts(1 << 33, bytes);
    let s = handle.serialize();
    assert_eq!(s.len(), IpcMemHandle::SERIALIZED_LEN);
    assert_eq!(&s[..8], &(1i64 << 33).to_le_bytes());
    assert_eq!(&s[8..], &bytes);
    assert_eq!(IpcMemHandle::deserialize(&s).unwrap(), handle);
    assert!(is_invalid_data(&IpcMemHandle::deserialize(&s[..71]).unwrap_err()));
    let mut negative = s;
    negative[7] = 0x80;
    assert!(is_invalid_data(&IpcMemHandle::deserialize(&negative).unwrap_err()));
}

#[test]
fn only_plain_device_memory_exports_through_cuda_ipc() {
    let stream = Stream::cpu();
    for resource in [MemoryResource::Host, MemoryResource::SharedHost] {
        let b = DeviceBuffer::alloc(resource, 256, &stream).unwrap();
        assert!(matches!(IpcMemHandle::export(&b), Err(Error::Unsupported(_))));
    }
    let _devices = using_devices();
    let Some(device) = common::cuda() else { return };
    let o = device.ordinal().unwrap();
    let stream = Stream::new(device).unwrap();
    let pool = DeviceBuffer::alloc(MemoryResource::DevicePool(o), 4096, &stream).unwrap();
    if pool.resource() == MemoryResource::DevicePool(o) {
        let e = IpcMemHandle::export(&pool).unwrap_err();
        assert!(matches!(e, Error::Unsupported(_)), "{e}");
    }
    if let shared @ MemoryResource::SharedDevice(_) = MemoryResource::shared_for(device) {
        // It travels by file descriptor.
        let b = DeviceBuffer::alloc(shared, 4096, &stream).unwrap();
        let e = IpcMemHandle::export(&b).unwrap_err();
        assert!(matches!(e, Error::Unsupported(_)), "{e}");
    }
    let plain = DeviceBuffer::alloc(MemoryResource::Device(o), 1 << 20, &stream).unwrap();
    let whole = IpcMemHandle::export(&plain).unwrap();
    assert_eq!(whole.size(), 1 << 20);
    // A slice names the whole base allocation: (handle, offset, length) crosses the boundary.
    let slice = plain.slice(4096, 100).unwrap();
    assert_eq!(IpcMemHandle::export(&slice).unwrap().size(), 1 << 20);
    assert_eq!(slice.offset(), 4096);
}

#[test]
fn shared_host_memory_is_a_sealed_memfd_mapped_once_per_process() {
    let stream = Stream::cpu();
    let mut b = DeviceBuffer::alloc(MemoryResource::SharedHost, 10_000, &stream).unwrap();
    assert_eq!(b.device(), Device::Cpu);
    assert!(
        b.host_slice().unwrap().iter().all(|&x| x == 0),
        "shared memory starts zeroed"
    );
    b.host_slice_mut()
        .unwrap()
        .iter_mut()
        .enumerate()
        .for_each(|(i, x)| *x = i as u8);
    let slice = b.slice(100, 50).unwrap();
    let (handle, offset) = SharedMemHandle::export(&slice).unwrap();
    assert_eq!((offset, handle.size()), (100, 10_000));
    let (again, _) = SharedMemHandle::export(&b).unwrap();
    let m1 = handle.open().unwrap();
    let m2 = again.open().unwrap();
    // (The number of open mappings is checked in a peer process, where no other test runs.)
    assert!(m1.same_as(&m2), "one mapping per region and process");
    // SAFETY: the mapping is alive for the read and holds `size` bytes.
    let mapped = unsafe { std::slice::from_raw_parts(m1.address() as *const u8, m1.size()) };
    assert_eq!(mapped, b.host_slice().unwrap());
    drop((m1, m2));
    let plain = DeviceBuffer::alloc(MemoryResource::Host, 64, &stream).unwrap();
    assert!(matches!(SharedMemHandle::export(&plain), Err(Error::Unsupported(_))));
}

#[test]
fn descriptors_that_are_not_sealed_memfds_are_refused() {
    let file = tempfile_path("not-a-memfd");
    std::fs::write(&file, vec![0u8; 4096]).unwrap();
    let fd = std::fs::File::open(&file).unwrap().into();
    let e = SharedMemHandle::from_fd(fd, 4096).open().unwrap_err();
    assert!(is_invalid_data(&e), "{e}");
    let _ = std::fs::remove_file(&file);
    // A real region announced with the wrong size.
    let b = DeviceBuffer::alloc(MemoryResource::SharedHost, 4096, &Stream::cpu()).unwrap();
    let (h, _) = SharedMemHandle::export(&b).unwrap();
    let fd = h.fd().try_clone_to_owned().unwrap();
    assert!(is_invalid_data(&SharedMemHandle::from_fd(fd, 8192).open().unwrap_err()));
}

// ---------------------------------------------------------------------------------------------
// Descriptors (zero copy).

/// Sends a descriptor through its byte form, duplicating the descriptors as a socket would.
fn through_bytes(d: &BatchDescriptor) -> BatchDescriptor {
    let (bytes, fds) = d.to_bytes();
    let fds = fds.iter().map(|f| f.try_clone_to_owned().unwrap()).collect();
    BatchDescriptor::from_bytes(&bytes, fds).unwrap()
}

/// Sets a flag when dropped.
struct DropFlag(Arc<AtomicBool>);

impl Drop for DropFlag {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

#[test]
fn descriptors_describe_batches_without_a_copy() {
    let batch = corpus();
    let stream = Stream::cpu();
    let on_device = upload(&batch, MemoryResource::SharedHost, &stream);
    let d = BatchDescriptor::describe(&on_device).unwrap();
    assert_eq!(d.regions.len(), 1, "one upload, one allocation, one region");
    let received = through_bytes(&d);
    let dropped = Arc::new(AtomicBool::new(false));
    let read = received
        .import(&batch.schema(), Event::completed(), DropFlag(dropped.clone()))
        .unwrap();
    check_batch("imported", &dtoh(&read, &stream).unwrap(), &batch);
    // The imported buffers are views of the mapped region, not copies.
    let mapped = read.column(1).buffers()[0].clone();
    drop(read);
    assert!(!dropped.load(Ordering::SeqCst), "a view is still alive");
    drop(mapped);
    assert!(dropped.load(Ordering::SeqCst), "the owner drops with the last view");
}

/// Memory lent from [`MemoryResource::shared_for`] (shared device memory on a GPU that has it,
/// shared host memory on the CPU) is kept by whoever maps it: a batch imported from its descriptor
/// is a mapping of its own, reads intact after the creator's batch and memory were dropped, and
/// can be described again without a copy.
#[test]
fn shared_memory_outlives_its_creator() {
    each_device(|device, stream| {
        let resource = MemoryResource::shared_for(device);
        if resource == MemoryResource::Device(device.ordinal().unwrap_or(0)) {
            eprintln!("skipped on {device}: the GPU has no shared device memory");
            return;
        }
        let batch = corpus();
        let created = upload(&batch, resource, stream);
        let d = BatchDescriptor::describe(&created).unwrap();
        match (&d.regions[..], device) {
            ([ipc::RegionHandle::Host(_)], Device::Cpu) => {}
            ([ipc::RegionHandle::SharedCuda { ordinal, .. }], Device::Cuda(o)) => assert_eq!(*ordinal, o),
            (other, _) => panic!("{device}: regions {other:?}"),
        }
        let read = through_bytes(&d)
            .import(&batch.schema(), created.ready().clone(), ())
            .unwrap();
        let (theirs, ours) = (&created.column(1).buffers()[0], &read.column(1).buffers()[0]);
        assert_ne!(theirs.address(), ours.address(), "{device}: a mapping of its own");
        drop((d, created));
        check_batch(
            &format!("{device}: after its creator was dropped"),
            &dtoh(&read, stream).unwrap(),
            &batch,
        );
        let again = through_bytes(&BatchDescriptor::describe(&read).unwrap())
            .import(&batch.schema(), read.ready().clone(), ())
            .unwrap();
        drop(read);
        check_batch(
            &format!("{device}: described again"),
            &dtoh(&again, stream).unwrap(),
            &batch,
        );
    });
}

#[test]
fn descriptors_of_messages_and_their_refusals() {
    let batch = corpus();
    let stream = Stream::cpu();
    let plain = upload(&batch, MemoryResource::Host, &stream);
    assert!(matches!(BatchDescriptor::describe(&plain), Err(Error::Unsupported(_))));
    let shared = upload(&batch, MemoryResource::SharedHost, &stream);
    assert!(matches!(
        BatchDescriptor::describe(&shared.slice(3, 10).unwrap()),
        Err(Error::Unsupported(_))
    ));
    for source in [&plain, &shared.slice(3, 10).unwrap()] {
        let message = ipc::write_message(source, &stream).unwrap();
        let d = BatchDescriptor::of_message(&message).unwrap();
        assert_eq!(d.regions.len(), 1);
        let read = through_bytes(&d)
            .import(&batch.schema(), Event::completed(), ())
            .unwrap();
        let expected = if source.num_rows() == ROWS {
            batch.clone()
        } else {
            batch.slice(3, 10)
        };
        check_batch("message descriptor", &dtoh(&read, &stream).unwrap(), &expected);
    }
}

#[test]
fn malformed_descriptors_are_errors() {
    let batch = small_batch(100);
    let stream = Stream::cpu();
    let on_device = upload(&batch, MemoryResource::SharedHost, &stream);
    let import = |edit: &dyn Fn(&mut BatchDescriptor)| {
        let mut d = through_bytes(&BatchDescriptor::describe(&on_device).unwrap());
        edit(&mut d);
        d.import(&batch.schema(), Event::completed(), ())
    };
    import(&|_| {}).unwrap();
    type Edit = Box<dyn Fn(&mut BatchDescriptor)>;
    let cases: Vec<(&str, Edit)> = vec![
        ("offset past the region", Box::new(|d| d.locations[1].offset = 1 << 40)),
        (
            "end past the region",
            Box::new(|d| d.locations[1].offset = d.regions[0].size() as u64 - 1),
        ),
        ("offset overflow", Box::new(|d| d.locations[1].offset = u64::MAX)),
        ("no such region", Box::new(|d| d.locations[1].region = 7)),
        ("length mismatch", Box::new(|d| d.locations[1].len += 1)),
        (
            "missing location",
            Box::new(|d| d.locations.truncate(d.locations.len() - 1)),
        ),
        ("extra location", Box::new(|d| d.locations.push(BufferLocation::EMPTY))),
        (
            "garbage metadata",
            Box::new(|d| d.metadata.iter_mut().for_each(|b| *b ^= 0x55)),
        ),
        ("CUDA device", Box::new(|d| d.device = Device::Cuda(0))),
    ];
    for (what, edit) in cases {
        let e = import(&*edit).unwrap_err();
        assert!(is_invalid_data(&e), "{what}: {e}");
    }
    // Byte forms: truncated, with trailing bytes, with descriptors missing or extra.
    let d = BatchDescriptor::describe(&on_device).unwrap();
    let (bytes, fds) = d.to_bytes();
    let owned = || fds.iter().map(|f| f.try_clone_to_owned().unwrap()).collect::<Vec<_>>();
    for cut in [0, 1, 12, bytes.len() / 2, bytes.len() - 1] {
        assert!(
            is_invalid_data(&BatchDescriptor::from_bytes(&bytes[..cut], owned()).unwrap_err()),
            "cut {cut}"
        );
    }
    let mut longer = bytes.clone();
    longer.push(0);
    assert!(is_invalid_data(
        &BatchDescriptor::from_bytes(&longer, owned()).unwrap_err()
    ));
    assert!(is_invalid_data(
        &BatchDescriptor::from_bytes(&bytes, vec![]).unwrap_err()
    ));
    let mut more = owned();
    more.extend(owned());
    assert!(is_invalid_data(&BatchDescriptor::from_bytes(&bytes, more).unwrap_err()));
}

/// A UUID of no device (almost surely not one of this machine's).
const NOWHERE: DeviceUuid = DeviceUuid([0xa5; 16]);

/// Devices travel by UUID: a descriptor that names a GPU this process does not see (through its
/// batch's device or a region's) is refused with [`Error::UnknownDevice`], naming it; other
/// versions of the encoding are refused.
#[test]
fn descriptors_name_devices_by_uuid_and_refuse_unknown_ones() {
    let batch = small_batch(10);
    let on_device = upload(&batch, MemoryResource::SharedHost, &Stream::cpu());
    let d = BatchDescriptor::describe(&on_device).unwrap();
    assert_eq!(d.device_uuid, None);
    let (bytes, fds) = d.to_bytes();
    let owned = || fds.iter().map(|f| f.try_clone_to_owned().unwrap()).collect::<Vec<_>>();
    assert_eq!(&bytes[..4], b"ACD\x02", "a tag, and version 2");
    assert!(through_bytes(&d).device_uuid.is_none());
    // The tag (4 bytes), the device type (4), the exporter's device id (8), the UUID (16).
    let with_device = |device_type: u32, id: i64, uuid: DeviceUuid| {
        let mut b = bytes.clone();
        b[4..8].copy_from_slice(&device_type.to_le_bytes());
        b[8..16].copy_from_slice(&id.to_le_bytes());
        b[16..32].copy_from_slice(&uuid.0);
        b
    };
    let refused = |what: &str, e: Error, uuid: DeviceUuid| {
        eprintln!("{what}: {e}");
        assert!(
            matches!(e, Error::UnknownDevice { uuid: u, .. } if u == uuid),
            "{what}: {e:?}"
        );
        let message = e.to_string();
        assert!(message.contains(&uuid.to_string()), "{what}: {message}");
    };
    for (device_type, name) in [(2, "CUDA"), (3, "CUDA_HOST"), (13, "CUDA_MANAGED")] {
        let e = BatchDescriptor::from_bytes(&with_device(device_type, 3, NOWHERE), owned()).unwrap_err();
        assert!(
            e.to_string().contains("GPU-a5a5a5a5-a5a5-a5a5-a5a5-a5a5a5a5a5a5"),
            "{e}"
        );
        assert!(e.to_string().contains("the sending process has it as cuda"), "{e}");
        refused(name, e, NOWHERE);
    }
    // A CPU batch that names a device is malformed.
    let e = BatchDescriptor::from_bytes(&with_device(1, -1, NOWHERE), owned()).unwrap_err();
    assert!(is_invalid_data(&e), "{e}");
    // Another version, and version 1 (no tag, devices by ordinal): refused.
    let mut next = bytes.clone();
    next[3] = 3;
    let e = BatchDescriptor::from_bytes(&next, owned()).unwrap_err();
    assert!(matches!(e, Error::Unsupported(_)), "{e}");
    let version1: Vec<u8> = bytes[4..16].iter().chain(&bytes[32..]).copied().collect();
    assert!(is_invalid_data(
        &BatchDescriptor::from_bytes(&version1, owned()).unwrap_err()
    ));
    // A batch in GPU memory, as a GPU process describes one: its device and its region's by UUID.
    let on_gpu = |device_uuid: DeviceUuid, region_uuid: DeviceUuid| {
        let described = BatchDescriptor {
            device: Device::Cuda(5),
            device_uuid: Some(device_uuid),
            dictionaries: vec![],
            metadata: d.metadata.clone(),
            regions: vec![ipc::RegionHandle::Cuda {
                ordinal: 5,
                uuid: region_uuid,
                handle: IpcMemHandle::from_parts(4096, [7; ipc::HANDLE_BYTES]),
            }],
            locations: d.locations.clone(),
        };
        BatchDescriptor::from_bytes(&described.to_bytes().0, vec![])
    };
    refused("a GPU batch", on_gpu(NOWHERE, NOWHERE).unwrap_err(), NOWHERE);
    if let Some(device) = common::cuda() {
        let here = DeviceUuid::of(device.ordinal().unwrap()).unwrap();
        refused("a region of another GPU", on_gpu(here, NOWHERE).unwrap_err(), NOWHERE);
        // Both found: the received descriptor names the device by this process's ordinal.
        let received = on_gpu(here, here).unwrap();
        assert_eq!((received.device, received.device_uuid), (device, Some(here)));
        assert!(matches!(
            received.regions[..],
            [ipc::RegionHandle::Cuda { ordinal, uuid, .. }] if Some(ordinal) == device.ordinal() && uuid == here
        ));
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn random_descriptor_bytes_are_refused_or_read(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
        let schema = small_batch(1).schema();
        if let Ok(d) = BatchDescriptor::from_bytes(&bytes, vec![]) {
            let _ = d.import(&schema, Event::completed(), ());
        }
    }

    #[test]
    fn mutated_descriptors_are_refused_or_read(
        rows in 0usize..40,
        dictionaries in any::<bool>(),
        flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
    ) {
        let batch = if dictionaries { nested_dictionaries(rows) } else { small_batch(rows) };
        let stream = Stream::cpu();
        let on_device = upload(&batch, MemoryResource::SharedHost, &stream);
        let d = BatchDescriptor::describe(&on_device).unwrap();
        let (mut bytes, fds) = d.to_bytes();
        for (at, value) in flips {
            let i = at.index(bytes.len());
            bytes[i] = value;
        }
        let fds = fds.iter().map(|f| f.try_clone_to_owned().unwrap()).collect();
        if let Ok(d) = BatchDescriptor::from_bytes(&bytes, fds)
            && let Ok(read) = d.import(&batch.schema(), Event::completed(), ())
        {
            let _ = dtoh(&read, &stream);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Memory lent to other processes.

/// What a receiver holding a region's descriptor tries, to change its bytes: each must fail.
fn write_attempts(fd: std::os::fd::BorrowedFd<'_>, size: usize) -> Vec<(&'static str, std::io::Result<()>)> {
    use std::os::fd::AsRawFd;
    let raw = fd.as_raw_fd();
    let check = |r: i64| match r {
        r if r < 0 => Err(std::io::Error::last_os_error()),
        _ => Ok(()),
    };
    let mut out = Vec::new();
    // SAFETY: writes one byte from a live local to a descriptor we hold.
    out.push((
        "pwrite",
        check(unsafe { libc::pwrite(raw, [7u8].as_ptr().cast(), 1, 0) } as i64),
    ));
    // SAFETY: the descriptor is held; a mapping, if one is made, is unmapped below unused.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            size,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            raw,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        out.push(("mmap writable", Err(std::io::Error::last_os_error())));
    } else {
        // SAFETY: the mapping just made, of `size` bytes, never used.
        unsafe { libc::munmap(p, size) };
        out.push(("mmap writable", Ok(())));
    }
    // SAFETY: as above, read-only this time.
    let p = unsafe { libc::mmap(std::ptr::null_mut(), size, libc::PROT_READ, libc::MAP_SHARED, raw, 0) };
    assert_ne!(p, libc::MAP_FAILED, "a receiver maps the region read-only");
    // SAFETY: changes the protection of our own mapping, unmapped right after.
    out.push((
        "mprotect",
        check(unsafe { libc::mprotect(p, size, libc::PROT_READ | libc::PROT_WRITE) } as i64),
    ));
    // SAFETY: the mapping made above, unmapped once.
    unsafe { libc::munmap(p, size) };
    let punch = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
    // SAFETY: fallocate on a descriptor we hold.
    out.push((
        "punch a hole",
        check(unsafe { libc::fallocate(raw, punch, 0, 4096) } as i64),
    ));
    // A second open of the same file, for writing.
    let reopened = std::fs::OpenOptions::new()
        .write(true)
        .open(format!("/proc/self/fd/{raw}"))
        .and_then(|mut f| f.write_all(&[7]));
    out.push(("reopen for writing", reopened));
    out
}

/// A receiver of shared host memory gets it read-only: whatever it does with the descriptor, it
/// cannot change the sender's bytes (the memfd is sealed with `F_SEAL_FUTURE_WRITE` once the
/// sender's own mapping is made).
#[test]
fn receivers_of_shared_host_memory_cannot_write_it() {
    let batch = small_batch(100);
    let stream = Stream::cpu();
    let on_device = upload(&batch, MemoryResource::SharedHost, &stream);
    let received = through_bytes(&BatchDescriptor::describe(&on_device).unwrap());
    let ipc::RegionHandle::Host(region) = &received.regions[0] else {
        panic!("a CPU batch travels as shared memory")
    };
    for (what, result) in write_attempts(region.fd(), region.size()) {
        let e = result.expect_err(what);
        assert!(
            matches!(e.raw_os_error(), Some(libc::EPERM | libc::EACCES)),
            "{what}: {e}"
        );
    }
    // The sender's bytes are as they were, and so is what the receiver reads.
    check_batch("sender", &dtoh(&on_device, &stream).unwrap(), &batch);
    let read = received.import(&batch.schema(), Event::completed(), ()).unwrap();
    check_batch("receiver", &dtoh(&read, &stream).unwrap(), &batch);
}

/// An uploaded batch is trusted (its download skips validation) until its memory is handed to
/// another process, which on a GPU can write it; a batch sent as a copy stays trusted.
#[test]
fn batches_lent_to_other_processes_are_no_longer_trusted() {
    each_device(|device, stream| {
        let batch = small_batch(100);
        let trusted = |b: &DeviceRecordBatch| b.columns().iter().all(ipc::testing::is_trusted);
        let described = upload(&batch, exportable(device), stream);
        assert!(trusted(&described), "{device}: an upload is trusted");
        let _descriptor = BatchDescriptor::describe(&described).unwrap();
        assert!(!trusted(&described), "{device}: described for another process");
        // A clone made before or after shares the memory, and so the distrust.
        let slice = described.slice(1, 10).unwrap();
        assert!(!trusted(&slice), "{device}: a view of lent memory");

        let path = socket_path(&format!("trust-{}", device_name(device)));
        let copied = upload(&batch, lendable(device), stream);
        let lent = upload(&batch, lendable(device), stream);
        let copying = SenderOptions {
            zero_copy: false,
            ..SenderOptions::default()
        };
        for (options, b, kept) in [(copying, &copied, true), (SenderOptions::default(), &lent, false)] {
            let _ = std::fs::remove_file(&path);
            let sender = Sender::bind(&path, batch.schema(), options).unwrap();
            let peer = Peer::spawn("drain", &path, device, 1);
            sender.wait_for_receivers(1, Duration::from_secs(60)).unwrap();
            assert_ne!(sender.send(b).unwrap(), 0);
            assert_eq!(trusted(b), kept, "{device}: zero copy {}", !kept);
            sender.finish().unwrap();
            peer.passed();
        }
    });
}

/// What a receiver on a GPU can do through its read-write mapping (here: written through the
/// sender's own mapping of shared host memory, the one mapping that stays writable): rewrite a
/// lent batch's offsets. The sender's next download validates them and fails, rather than reading
/// past its buffers.
#[test]
fn a_rewritten_lent_batch_fails_its_download() {
    let batch = small_batch(100);
    let stream = Stream::cpu();
    let lent = upload(&batch, MemoryResource::SharedHost, &stream);
    let _descriptor = BatchDescriptor::describe(&lent).unwrap();
    let offsets = &lent.column(1).buffers()[0];
    assert_eq!(offsets.len(), 101 * 4);
    // SAFETY: the offsets' bytes are live shared memory, writable through the sender's mapping;
    // nothing reads them while they are written (no reference to them is alive).
    unsafe { std::ptr::write_unaligned((offsets.address() + 100 * 4) as *mut i32, 1 << 30) };
    let e = dtoh(&lent, &stream).unwrap_err();
    assert!(e.to_string().contains("offset"), "{e}");
}

fn tempfile_path(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("arrow-cuda-ipc-{}-{name}", std::process::id()))
}

// ---------------------------------------------------------------------------------------------
// The channel: peers in other processes.

/// What the peer process does (unset: the `peer` test returns at once).
const PEER: &str = "ARROW_CUDA_IPC_PEER";
const PEER_SOCKET: &str = "ARROW_CUDA_IPC_SOCKET";
const PEER_DEVICE: &str = "ARROW_CUDA_IPC_DEVICE";
const PEER_COUNT: &str = "ARROW_CUDA_IPC_COUNT";
/// The UUID the `unknown-device` peer expects its errors to name.
const PEER_UUID: &str = "ARROW_CUDA_IPC_UUID";

/// Batches in a stream: the corpus, sliced differently each time.
const STREAM: usize = 6;

fn stream_batch(i: usize) -> RecordBatch {
    corpus().slice(i, ROWS - 2 * i)
}

/// Batch `i` as a sender holds it: in memory the channel lends (on a GPU shared device memory
/// where it has it, sent without a copy), in the device's default memory (copied into a message),
/// a slice on the device (encoded through the host), or in CUDA IPC memory on a GPU (copied into
/// shared device memory where the GPU has it, else lent).
fn device_stream_batch(i: usize, device: Device, stream: &Stream) -> DeviceRecordBatch {
    match i % 4 {
        0 => upload(&stream_batch(i), lendable(device), stream),
        1 => upload(&stream_batch(i), MemoryResource::default_for(device), stream),
        2 => upload(&corpus(), lendable(device), stream)
            .slice(i, ROWS - 2 * i)
            .unwrap(),
        _ => upload(&stream_batch(i), exportable(device), stream),
    }
}

/// Whether the batches of [`device_stream_batch`], once received, still read intact after their
/// sender died: on the CPU every batch does (shared memory outlives its creator); on a GPU every
/// batch does where it has shared device memory (the channel lends or copies into nothing else),
/// none where it lacks it (then they are lent through CUDA IPC, or copied into CUDA IPC memory,
/// and fenced).
fn outlive_their_sender(device: Device) -> bool {
    device == Device::Cpu || matches!(MemoryResource::shared_for(device), MemoryResource::SharedDevice(_))
}

/// A socket path of this process, unique to each call (tests run in parallel).
fn socket_path(name: &str) -> PathBuf {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let path = std::env::temp_dir().join(format!("acipc-{}-{n}-{name}.sock", std::process::id()));
    let _ = std::fs::remove_file(&path);
    path
}

fn device_name(device: Device) -> String {
    match device {
        Device::Cuda(o) => format!("cuda:{o}"),
        _ => "cpu".into(),
    }
}

fn parse_device(name: &str) -> Device {
    match name.strip_prefix("cuda:") {
        Some(o) => Device::Cuda(o.parse().unwrap()),
        None => Device::Cpu,
    }
}

fn patient() -> ReceiverOptions {
    ReceiverOptions {
        connect_timeout: Duration::from_secs(60),
        recv_timeout: Some(Duration::from_secs(60)),
        ..ReceiverOptions::default()
    }
}

/// This test binary, running the `peer` test in another process.
struct Peer {
    child: Child,
    stdout: BufReader<std::process::ChildStdout>,
}

impl Peer {
    fn spawn(role: &str, socket: &std::path::Path, device: Device, count: usize) -> Peer {
        Peer::spawn_with(role, socket, device, count, &[])
    }

    /// [`Peer::spawn`], with more variables in the peer's environment (`CUDA_VISIBLE_DEVICES`).
    fn spawn_with(role: &str, socket: &std::path::Path, device: Device, count: usize, env: &[(&str, &str)]) -> Peer {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "peer", "--nocapture", "--test-threads", "1"])
            .envs(env.iter().copied())
            .env(PEER, role)
            .env(PEER_SOCKET, socket)
            .env(PEER_DEVICE, device_name(device))
            .env(PEER_COUNT, count.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        Peer { child, stdout }
    }

    /// Reads the peer's output until it says `PEER <what>`.
    fn wait_for(&mut self, what: &str) {
        while self.said(what) != what {}
    }

    /// Reads the peer's output until it says `PEER <prefix>...`, and returns what it said after
    /// `PEER `.
    fn said(&mut self, prefix: &str) -> String {
        let mut line = String::new();
        loop {
            line.clear();
            let n = self.stdout.read_line(&mut line).unwrap();
            assert!(
                n > 0,
                "the peer ended before saying {prefix:?}: {:?}",
                self.child.try_wait()
            );
            // libtest prints `test peer ... ` on the same line first.
            if let Some((_, said)) = line.trim_end().rsplit_once("PEER ")
                && said.starts_with(prefix)
            {
                return said.to_string();
            }
        }
    }

    /// Waits for the peer to finish and checks that it passed.
    fn passed(mut self) {
        drop(self.child.stdin.take());
        let status = self.child.wait().unwrap();
        assert!(status.success(), "the peer failed: {status}");
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Blocks until the parent closes our stdin (or dies).
fn until_parent_lets_go() {
    let _ = std::io::stdin().read_to_end(&mut Vec::new());
}

fn say(what: &str) {
    println!("PEER {what}");
    std::io::stdout().flush().unwrap();
}

/// The other process of the cross-process tests.
#[test]
fn peer() {
    let Ok(role) = std::env::var(PEER) else { return };
    let socket = PathBuf::from(std::env::var(PEER_SOCKET).unwrap());
    let device = parse_device(&std::env::var(PEER_DEVICE).unwrap());
    let count: usize = std::env::var(PEER_COUNT).unwrap().parse().unwrap();
    let stream = Stream::new(device).unwrap();
    match role.as_str() {
        "verify" | "verify-polling" => {
            let poll = match role.as_str() {
                "verify-polling" => Duration::from_millis(5),
                _ => Duration::ZERO,
            };
            let mut r = Receiver::connect(&socket, ReceiverOptions { poll, ..patient() }).unwrap();
            assert_eq!(r.schema(), &corpus().schema());
            for i in 0..count {
                let batch = r.recv().unwrap().expect("a batch");
                assert_eq!(batch.device(), device);
                check_batch(&format!("batch {i}"), &dtoh(&batch, &stream).unwrap(), &stream_batch(i));
            }
            assert!(r.recv().unwrap().is_none(), "the end of the stream");
            assert!(r.recv().unwrap().is_none(), "the end stays the end");
            say("done");
        }
        "same-region" => {
            let mut r = Receiver::connect(&socket, patient()).unwrap();
            let a = r.recv().unwrap().unwrap();
            let b = r.recv().unwrap().unwrap();
            let (ba, bb) = (&a.column(1).buffers()[0], &b.column(1).buffers()[0]);
            assert_eq!(ba.address(), bb.address(), "the same allocation is mapped once");
            let open = || match (device, lendable(device)) {
                (Device::Cpu, _) => ipc::testing::open_shared_mappings(),
                (_, MemoryResource::SharedDevice(_)) => ipc::testing::open_shared_device_regions(),
                _ => ipc::testing::open_cuda_mappings(),
            };
            // One mapping: the region is known by its memfd's identity on the CPU, by the id the
            // sender gave it for shared device memory, and by its handle for CUDA IPC memory (the
            // sender exports an allocation's handle once: the driver may hand out new bytes for
            // each export).
            assert_eq!(open(), 1, "mappings");
            check_batch("shared", &dtoh(&a, &stream).unwrap(), &stream_batch(0));
            drop((a, b));
            // Closed with the last view, but for shared device memory, which the receiver keeps
            // mapped for the sender's next use of it until it drops.
            let kept = usize::from(matches!(lendable(device), MemoryResource::SharedDevice(_)));
            assert_eq!(open(), kept, "after the last view");
            say("done");
        }
        "ahead" => {
            // Waits in `recv`, 50 ms at a time, until the region the sender announced is mapped,
            // says so, then takes the batch lent from it: built on that mapping, none made for it.
            let options = ReceiverOptions {
                recv_timeout: Some(Duration::from_millis(50)),
                ..patient()
            };
            let mut r = Receiver::connect(&socket, options).unwrap();
            let deadline = Instant::now() + Duration::from_secs(60);
            let mut mapped = false;
            let batch = loop {
                match r.recv() {
                    Ok(Some(batch)) => break batch,
                    Err(e) if e.io_kind() == Some(std::io::ErrorKind::TimedOut) => {
                        assert!(Instant::now() < deadline, "no region announced within 60 s");
                        if !mapped && ipc::testing::open_shared_device_regions() == 1 {
                            mapped = true;
                            say("mapped");
                        }
                    }
                    other => panic!("{other:?}"),
                }
            };
            assert!(mapped, "the batch came before its region was announced");
            assert_eq!(ipc::testing::open_shared_device_regions(), 1, "mapped once, ahead");
            check_batch("the batch", &dtoh(&batch, &stream).unwrap(), &ahead_batch());
            drop(batch);
            assert!(r.recv().unwrap().is_none(), "the end of the stream");
        }
        "keep" => {
            // `count` batches, each in a region of its own (all of one size), then the first two
            // again. Regions of shared device memory are kept up to the sender's 256 MiB; shared
            // host memory travels with each batch. Every assertion below holds for regions of any
            // one size.
            let mut r = Receiver::connect(&socket, patient()).unwrap();
            let shared = matches!(lendable(device), MemoryResource::SharedDevice(_));
            let mut most = 0;
            for i in 0..count + 2 {
                let batch = r.recv().unwrap().expect("a batch");
                check_batch(
                    &format!("batch {i}"),
                    &dtoh(&batch, &stream).unwrap(),
                    &keep_batch(i % count),
                );
                drop(batch);
                let (kept, bytes) = ipc::testing::kept_regions(&r);
                most = match shared {
                    true => (256 << 20) / (bytes / kept),
                    false => 0,
                };
                assert!(
                    !shared || most < count,
                    "{count} regions of {} bytes fit the budget",
                    bytes / kept
                );
                assert_eq!(kept, (i + 1).min(most), "regions kept after batch {i}");
                if device != Device::Cpu {
                    assert_eq!(
                        ipc::testing::open_shared_device_regions(),
                        kept,
                        "regions mapped after batch {i}"
                    );
                }
            }
            // The sender dropped every batch: more regions than its idle pool holds, the first
            // dropped (sent again last) freed to make room for the others. The next batch lets
            // those go.
            let batch = r.recv().unwrap().expect("a batch");
            check_batch("the last batch", &dtoh(&batch, &stream).unwrap(), &keep_batch(2));
            drop(batch);
            let (kept, _) = ipc::testing::kept_regions(&r);
            assert!(
                kept < most || !shared,
                "{kept} regions kept of {most} once some were freed"
            );
            assert_eq!(ipc::testing::open_shared_device_regions(), kept);
            assert!(r.recv().unwrap().is_none(), "the end of the stream");
            drop(r);
            assert_eq!(
                ipc::testing::open_shared_device_regions(),
                0,
                "regions mapped once it dropped"
            );
            say("done");
        }
        "drain" => {
            // The fault runs may kill it from here on, during its connection and greeting.
            say("connecting");
            let mut r = Receiver::connect(&socket, patient()).unwrap();
            while r.recv().unwrap().is_some() {}
            say("done");
        }
        "hold" => {
            let mut r = Receiver::connect(&socket, patient()).unwrap();
            let held: Vec<_> = (0..count).map(|_| r.recv().unwrap().unwrap()).collect();
            say("held");
            until_parent_lets_go();
            drop(held);
        }
        "unknown-device" => {
            // Its CUDA_VISIBLE_DEVICES leaves out the sender's GPU: each batch is refused, naming
            // the device, and the stream goes on to its end.
            let uuid = std::env::var(PEER_UUID).unwrap();
            let mut r = Receiver::connect(&socket, patient()).unwrap();
            for i in 0..count {
                match r.recv() {
                    Err(e @ Error::UnknownDevice { uuid: named, .. }) => {
                        assert_eq!(named.to_string(), uuid, "batch {i}: {e}");
                        assert!(e.to_string().contains(&uuid), "batch {i}: {e}");
                        eprintln!("batch {i}: {e}");
                    }
                    other => panic!("batch {i}: expected UnknownDevice({uuid}), got {other:?}"),
                }
            }
            assert!(r.recv().unwrap().is_none(), "the end of the stream");
            say("done");
        }
        "stream" => {
            // Sends the batches of `device_stream_batch` (0, 1, 2, 3, 0, ...) until it is killed, or
            // nobody receives them any more.
            let options = SenderOptions {
                send_timeout: fault_timeout(),
                ..SenderOptions::default()
            };
            let sender = Sender::bind(&socket, corpus().schema(), options).unwrap();
            // The fault runs may kill it from here on, while it greets its receiver.
            say("bound");
            sender.wait_for_receivers(1, fault_timeout()).unwrap();
            let batches: Vec<_> = (0..4).map(|i| device_stream_batch(i, device, &stream)).collect();
            let start = Instant::now();
            let mut i = 0;
            while sender.send(&batches[i % 4]).unwrap() > 0 && start.elapsed() < Duration::from_secs(60) {
                i += 1;
            }
            say("nobody left");
        }
        "send" => {
            let sender = Sender::bind(&socket, corpus().schema(), SenderOptions::default()).unwrap();
            sender.wait_for_receivers(1, Duration::from_secs(60)).unwrap();
            for i in 0..count {
                assert_ne!(sender.send(&device_stream_batch(i, device, &stream)).unwrap(), 0);
            }
            say("sent");
            until_parent_lets_go();
        }
        "send-pending" => {
            // Sends one batch still being written (a gate that stays closed for 20 seconds, past
            // the kill, holds the stream before its upload), so that it goes with an
            // interprocess event, says whether it still was once sent, and waits to be killed.
            let sender = Sender::bind(&socket, corpus().schema(), SenderOptions::default()).unwrap();
            sender.wait_for_receivers(1, Duration::from_secs(60)).unwrap();
            // An upload first, so that the one below finds its staging in the pinned pool:
            // allocating pinned memory can wait for the device, which would wait for the gate.
            drop(upload(&stream_batch(0), MemoryResource::default_for(device), &stream));
            let _gate = Gate::close(&stream, Duration::from_secs(20));
            let batch = htod_async(&stream_batch(0), MemoryResource::default_for(device), &stream).unwrap();
            assert_ne!(sender.send(&batch).unwrap(), 0);
            say(match batch.ready().is_complete().unwrap() {
                false => "sent pending",
                true => "sent complete",
            });
            until_parent_lets_go();
        }
        "send-and-end" => {
            // Sends its batches, ends the stream and drops the sender, then lives on until let go
            // (or killed): what it lent stays lent until acknowledged.
            let sender = Sender::bind(&socket, corpus().schema(), SenderOptions::default()).unwrap();
            sender.wait_for_receivers(1, Duration::from_secs(60)).unwrap();
            for i in 0..count {
                assert_ne!(sender.send(&device_stream_batch(i, device, &stream)).unwrap(), 0);
            }
            sender.finish().unwrap();
            drop(sender);
            say("ended");
            until_parent_lets_go();
        }
        other => panic!("unknown peer role {other}"),
    }
}

/// A batch still being written when it was sent comes with its sender's interprocess event, which
/// dies with the sender: once the sender is killed, receiving that batch fails as the end of the
/// connection does (`UnexpectedEof`), rather than waiting on the dead event, and keeps failing;
/// the receiving process's device goes on working.
#[test]
fn a_batch_whose_event_died_with_its_sender_is_not_received() {
    let _devices = using_devices();
    let Some(device) = common::cuda() else { return };
    let stream = Stream::new(device).unwrap();
    let path = socket_path("dead-event");
    let mut peer = Peer::spawn("send-pending", &path, device, 1);
    let mut r = Receiver::connect(&path, patient()).unwrap();
    assert_eq!(
        peer.said("sent"),
        "sent pending",
        "the batch was written before it was sent, so it had no event"
    );
    peer.child.kill().unwrap();
    peer.child.wait().unwrap();
    let e = r.recv().expect_err("a batch whose event died with its sender");
    assert_eq!(e.io_kind(), Some(std::io::ErrorKind::UnexpectedEof), "{e}");
    assert!(r.recv().is_err(), "a broken receiver stays broken");
    drop(r);
    let _ = std::fs::remove_file(&path);
    let batch = stream_batch(1);
    check_batch(
        "after",
        &dtoh(&upload(&batch, MemoryResource::default_for(device), &stream), &stream).unwrap(),
        &batch,
    );
}

#[test]
fn batches_cross_processes() {
    for role in ["verify", "verify-polling"] {
        cross_processes(role);
    }
}

/// A stream of batches to a `role` peer (a receiver that sleeps in reads, or one that polls).
fn cross_processes(role: &str) {
    each_device(|device, stream| {
        let path = socket_path(&format!("cross-{role}-{}", device_name(device)));
        let sender = Sender::bind(&path, corpus().schema(), SenderOptions::default()).unwrap();
        let peer = Peer::spawn(role, &path, device, STREAM);
        sender.wait_for_receivers(1, Duration::from_secs(60)).unwrap();
        for i in 0..STREAM {
            assert_ne!(
                sender.send(&device_stream_batch(i, device, stream)).unwrap(),
                0,
                "{device}: batch {i}"
            );
        }
        sender.finish().unwrap();
        peer.passed();
        sender.wait_idle(Duration::from_secs(30)).unwrap();
        let status = sender.status();
        assert_eq!(
            (status.sent, status.lost, status.in_flight_bytes),
            (STREAM as u64, 0, 0),
            "{device}: {status:?}"
        );
    });
}

/// An upload of [`stream_batch`] 0 into memory the channel lends, still queued on `stream` behind
/// 8 GiB of copies when this returns, and the two buffers of 1 GiB those copies read and write:
/// keep them until the stream is synchronised.
fn unfinished_upload(device: Device, stream: &Stream) -> (DeviceRecordBatch, [DeviceBuffer; 2]) {
    let busy = 1 << 30;
    let from = DeviceBuffer::alloc(MemoryResource::default_for(device), busy, stream).unwrap();
    let mut to = DeviceBuffer::alloc(MemoryResource::default_for(device), busy, stream).unwrap();
    // An upload first, so that the one below finds its staging in the pinned pool: allocating
    // pinned memory can wait for the device, which would let the copies below finish.
    drop(upload(&stream_batch(0), lendable(device), stream));
    // Another test's device-wide synchronisation (freeing memory, say) can let them finish early:
    // then the upload is done before it is sent, and this tries again.
    (0..5)
        .find_map(|_| {
            for _ in 0..8 {
                // SAFETY: both buffers outlive the copies (the caller synchronises the stream).
                unsafe { to.copy_from_async(0, &from, stream) }.unwrap();
            }
            let batch = htod_async(&stream_batch(0), lendable(device), stream).unwrap();
            (!batch.ready().is_complete().unwrap()).then_some(batch)
        })
        .map(|batch| (batch, [from, to]))
        .expect("an upload still queued behind the copies")
}

/// A batch the device is still writing when it is sent travels with an IPC event, which the
/// receiver's reads wait on (a sender whose writes are done sends none).
#[test]
fn batches_still_being_written_are_ordered_by_an_ipc_event() {
    let _devices = using_devices();
    let Some(device) = common::cuda() else { return };
    let stream = Stream::new(device).unwrap();
    let path = socket_path("unfinished");
    let sender = Sender::bind(&path, corpus().schema(), SenderOptions::default()).unwrap();
    let peer = Peer::spawn("verify", &path, device, 1);
    sender.wait_for_receivers(1, Duration::from_secs(60)).unwrap();
    let (batch, _busy) = unfinished_upload(device, &stream);
    assert_ne!(sender.send(&batch).unwrap(), 0);
    sender.finish().unwrap();
    peer.passed();
    stream.synchronize().unwrap();
}

/// A receiver in the sender's own process gets a batch still being written intact: CUDA opens no
/// interprocess event in the process that made it, so the receiver's stream waits on the sender's
/// event, found by its handle in the process.
#[test]
fn a_receiver_in_the_senders_process_gets_batches_still_being_written() {
    let _devices = using_devices();
    let Some(device) = common::cuda() else { return };
    let stream = Stream::new(device).unwrap();
    let path = socket_path("unfinished-here");
    let sender = Sender::bind(&path, corpus().schema(), SenderOptions::default()).unwrap();
    let mut r = connected(&path);
    sender.wait_for_receivers(1, Duration::from_secs(30)).unwrap();
    let (batch, _busy) = unfinished_upload(device, &stream);
    assert_ne!(sender.send(&batch).unwrap(), 0);
    let got = r.recv().unwrap().unwrap();
    check_batch("received", &dtoh(&got, &stream).unwrap(), &stream_batch(0));
    stream.synchronize().unwrap();
}

#[test]
fn one_allocation_is_opened_once_per_process() {
    each_device(|device, stream| {
        let path = socket_path(&format!("same-{}", device_name(device)));
        let sender = Sender::bind(&path, corpus().schema(), SenderOptions::default()).unwrap();
        let peer = Peer::spawn("same-region", &path, device, 2);
        sender.wait_for_receivers(1, Duration::from_secs(60)).unwrap();
        let batch = upload(&stream_batch(0), lendable(device), stream);
        sender.send(&batch).unwrap();
        sender.send(&batch).unwrap();
        sender.finish().unwrap();
        peer.passed();
        sender.wait_idle(Duration::from_secs(30)).unwrap();
    });
}

/// A receiver keeps the sender's most recently used regions of shared device memory mapped, up to
/// the sender's budget, and the sender names them by id alone: batches read intact as regions are
/// let go of and sent again, the receiver maps only what it keeps, and it lets go of regions the
/// sender freed.
/// Batch `i` of `receivers_keep_the_senders_most_recent_regions`: small enough that its region is
/// the device's smallest, so that every batch's region has one size.
fn keep_batch(i: usize) -> RecordBatch {
    let ints: ArrayRef = Arc::new(Int64Array::from_iter_values(i as i64..i as i64 + 10));
    RecordBatch::try_from_iter([("ints", ints)]).unwrap()
}

#[test]
fn receivers_keep_the_senders_most_recent_regions() {
    const REGIONS: usize = 130;
    each_device(|device, stream| {
        let path = socket_path(&format!("keep-{}", device_name(device)));
        let sender = Sender::bind(&path, keep_batch(0).schema(), SenderOptions::default()).unwrap();
        let peer = Peer::spawn("keep", &path, device, REGIONS);
        sender.wait_for_receivers(1, Duration::from_secs(60)).unwrap();
        let batches: Vec<_> = (0..REGIONS)
            .map(|i| upload(&keep_batch(i), lendable(device), stream))
            .collect();
        for batch in batches.iter().chain(&batches[..2]) {
            sender.send(batch).unwrap();
        }
        // Regions beyond the idle pool's 256 MiB are freed (the first dropped): the receiver is
        // told so.
        sender.wait_idle(Duration::from_secs(30)).unwrap();
        drop(batches);
        sender.send(&upload(&keep_batch(2), lendable(device), stream)).unwrap();
        sender.finish().unwrap();
        peer.passed();
        sender.wait_idle(Duration::from_secs(30)).unwrap();
    });
}

/// The batch of [`receivers_map_announced_regions_ahead_of_their_batches`]: 5 MB, in a region of
/// a size (6 MiB) no other case of this binary makes.
fn ahead_batch() -> RecordBatch {
    let ints: ArrayRef = Arc::new(Int64Array::from_iter_values(0..640_000));
    RecordBatch::try_from_iter([("ints", ints)]).unwrap()
}

/// With [`SenderOptions::announce_regions`], a region of shared device memory is announced to the
/// receivers as it is made, and a receiver waiting for batches maps it then: the batch later lent
/// from it is built on that mapping (the peer checks), and reads intact.
#[test]
fn receivers_map_announced_regions_ahead_of_their_batches() {
    // Alone: the sender announces every region its process makes, so no other case may make one.
    let _alone = DEVICE_MEMORY.write().unwrap_or_else(PoisonError::into_inner);
    let Some(device) = common::cuda() else { return };
    if !matches!(lendable(device), MemoryResource::SharedDevice(_)) {
        eprintln!("skipped on {device}: the GPU has no shared device memory");
        return;
    }
    let stream = Stream::new(device).unwrap();
    let path = socket_path("ahead");
    let options = SenderOptions {
        announce_regions: true,
        ..SenderOptions::default()
    };
    let sender = Sender::bind(&path, ahead_batch().schema(), options).unwrap();
    let mut peer = Peer::spawn("ahead", &path, device, 1);
    sender.wait_for_receivers(1, Duration::from_secs(60)).unwrap();
    let batch = upload(&ahead_batch(), lendable(device), &stream);
    peer.wait_for("mapped");
    sender.send(&batch).unwrap();
    sender.finish().unwrap();
    peer.passed();
    sender.wait_idle(Duration::from_secs(30)).unwrap();
}

#[test]
fn two_receivers_get_every_batch() {
    each_device(|device, stream| {
        let path = socket_path(&format!("two-{}", device_name(device)));
        let sender = Sender::bind(&path, corpus().schema(), SenderOptions::default()).unwrap();
        let peers = [
            Peer::spawn("verify", &path, device, STREAM),
            Peer::spawn("verify", &path, device, STREAM),
        ];
        sender.wait_for_receivers(2, Duration::from_secs(60)).unwrap();
        for i in 0..STREAM {
            sender.send(&device_stream_batch(i, device, stream)).unwrap();
        }
        sender.finish().unwrap();
        peers.into_iter().for_each(Peer::passed);
        sender.wait_idle(Duration::from_secs(30)).unwrap();
        assert_eq!(sender.status().lost, 0);
    });
}

#[test]
fn a_killed_receiver_is_reclaimed_within_a_second() {
    each_device(|device, stream| {
        let path = socket_path(&format!("kill-r-{}", device_name(device)));
        let sender = Sender::bind(&path, corpus().schema(), SenderOptions::default()).unwrap();
        let mut peer = Peer::spawn("hold", &path, device, 3);
        sender.wait_for_receivers(1, Duration::from_secs(60)).unwrap();
        // Unsliced, so that they travel without a copy: the sender lends this very memory.
        let batches: Vec<_> = (0..3).map(|_| upload(&corpus(), lendable(device), stream)).collect();
        let whole: Vec<DeviceBuffer> = batches
            .iter()
            .map(|b| b.column(1).buffers()[0].parent().unwrap())
            .collect();
        for b in &batches {
            sender.send(b).unwrap();
        }
        drop(batches);
        peer.wait_for("held");
        let status = sender.status();
        assert_eq!(status.in_flight_batches, 3, "{device}: {status:?}");
        assert!(
            whole.iter().all(|w| !w.is_mutable()),
            "{device}: the sender keeps lent memory"
        );
        let _ = sender.take_events();
        peer.child.kill().unwrap();
        let killed = Instant::now();
        while sender.status().in_flight_batches > 0 && killed.elapsed() < Duration::from_secs(1) {
            std::thread::sleep(Duration::from_millis(5));
        }
        let status = sender.status();
        assert_eq!(
            (
                status.in_flight_batches,
                status.in_flight_bytes,
                status.lost,
                status.receivers
            ),
            (0, 0, 1, 0),
            "{device}: not reclaimed within a second of the kill: {status:?}"
        );
        assert!(
            whole.iter().all(DeviceBuffer::is_mutable),
            "{device}: the memory was given back"
        );
        let events = sender.take_events();
        assert!(
            events
                .iter()
                .any(|e| matches!(e, SenderEvent::Lost { reclaimed: 3, .. })),
            "{device}: {events:?}"
        );
        // With nobody listening, a batch goes nowhere.
        assert_eq!(
            sender
                .send(&upload(&stream_batch(0), exportable(device), stream))
                .unwrap(),
            0
        );
    });
}

/// Timeouts past what `Instant` can hold (`Duration::MAX`) are no limit, not a panic: a receiver
/// that connects and receives with them, and a sender that waits for its receiver, for credit and
/// for the acknowledgement with them.
#[test]
fn timeouts_past_the_end_of_time_are_no_limit() {
    let _devices = using_devices();
    let stream = Stream::cpu();
    let path = socket_path("forever");
    let batch = stream_batch(1);
    let options = SenderOptions {
        send_timeout: Duration::MAX,
        ..SenderOptions::default()
    };
    let sender = Sender::bind(&path, batch.schema(), options).unwrap();
    let receiver = std::thread::spawn({
        let path = path.clone();
        move || {
            let options = ReceiverOptions {
                connect_timeout: Duration::MAX,
                recv_timeout: Some(Duration::MAX),
                ..ReceiverOptions::default()
            };
            let mut r = Receiver::connect(&path, options).unwrap();
            let rows = r.recv().unwrap().expect("a batch").num_rows();
            assert!(r.recv().unwrap().is_none(), "the end of the stream");
            rows
        }
    });
    sender.wait_for_receivers(1, Duration::MAX).unwrap();
    sender.send(&upload(&batch, lendable(Device::Cpu), &stream)).unwrap();
    sender.wait_idle(Duration::MAX).unwrap();
    sender.finish().unwrap();
    assert_eq!(receiver.join().unwrap(), batch.num_rows());
}

#[test]
fn a_killed_sender_makes_the_receiver_fail() {
    each_device(|device, stream| {
        let path = socket_path(&format!("kill-s-{}", device_name(device)));
        let mut peer = Peer::spawn("send", &path, device, 2);
        let mut r = Receiver::connect(&path, patient()).unwrap();
        let got: Vec<_> = (0..2).map(|_| r.recv().unwrap().unwrap()).collect();
        peer.wait_for("sent");
        peer.child.kill().unwrap();
        peer.child.wait().unwrap();
        let e = r.recv().unwrap_err();
        assert_eq!(e.io_kind(), Some(std::io::ErrorKind::UnexpectedEof), "{device}: {e}");
        assert!(r.recv().is_err(), "{device}: a broken receiver stays broken");
        // The killed sender could not remove its socket file.
        let _ = std::fs::remove_file(&path);
        // Shared memory outlives its creator; the rest is the fence's (the test below).
        if outlive_their_sender(device) {
            for (i, b) in got.iter().enumerate() {
                check_batch("after the sender died", &dtoh(b, stream).unwrap(), &stream_batch(i));
            }
        }
    });
}

/// Issue #23, finding 5: batches still held after their sender died. While the sender's process
/// lives they read intact, also once it has ended its stream and dropped its `Sender` (it keeps
/// what it lent until acknowledged). After it is killed, batches in shared memory still read
/// intact: on the CPU every batch, on a GPU with shared device memory every batch too (the channel
/// lends that memory or copies into it), which the receiver's mapping keeps. Batches in CUDA IPC
/// memory (on a GPU without shared device memory) are fenced: every read path fails with
/// `Error::SenderGone`, naming the sender's socket and process, and never reads the freed memory.
/// On the CPU the same fence runs through the test hook that fences CPU batches as CUDA IPC
/// batches are.
#[test]
fn batches_held_after_their_sender_died_read_intact_or_are_fenced() {
    each_device(|device, stream| {
        let hooks: &[bool] = match device {
            Device::Cpu => &[false, true],
            _ => &[false],
        };
        for &hook in hooks {
            let path = socket_path(&format!("fence-{}-{hook}", device_name(device)));
            let mut peer = Peer::spawn("send-and-end", &path, device, 4);
            let mut r = Receiver::connect(&path, patient()).unwrap();
            if hook {
                ipc::testing::fence_host_batches(&mut r);
            }
            let held: Vec<_> = (0..4).map(|_| r.recv().unwrap().unwrap()).collect();
            assert!(r.recv().unwrap().is_none(), "{device}: the end of the stream");
            peer.wait_for("ended");
            for (i, b) in held.iter().enumerate() {
                b.check_readable().unwrap();
                check_batch(
                    &format!("{device}, batch {i}"),
                    &dtoh(b, stream).unwrap(),
                    &stream_batch(i),
                );
            }
            let pid = peer.child.id();
            peer.child.kill().unwrap();
            peer.child.wait().unwrap();
            // The killed sender could not remove its socket file.
            let _ = std::fs::remove_file(&path);
            let mut intact = 0;
            for (i, b) in held.iter().enumerate() {
                let fenced = hook || !outlive_their_sender(device);
                let what = format!("{device}, batch {i}, fenced: {fenced}");
                if !fenced {
                    intact += 1;
                    b.check_readable().unwrap();
                    check_batch(&what, &dtoh(b, stream).unwrap(), &stream_batch(i));
                    continue;
                }
                let gone = |read: &str, outcome: arrow_cuda::Result<()>| match outcome {
                    Err(e @ Error::SenderGone { .. }) => {
                        let message = e.to_string();
                        assert!(
                            message.contains(&path.display().to_string()) && message.contains(&format!("pid {pid}")),
                            "{what}, batch {i}, {read}: {message}"
                        );
                    }
                    other => panic!("{what}, batch {i}, {read}: expected SenderGone, got {other:?}"),
                };
                let column = b.column(1);
                let buffer = &column.buffers()[0];
                gone("check_readable", b.check_readable());
                gone("check_readable of a column", column.check_readable());
                gone("dtoh", dtoh(b, stream).map(drop));
                gone("dtoh_async", dtoh_async(b, stream).map(drop));
                gone("dtoh_array", dtoh_array(column, stream).map(drop));
                gone("to_record_batch", b.to_record_batch().map(drop));
                gone("export_batch", arrow_cuda::ffi::export_batch(b, stream).map(drop));
                gone(
                    "export_array",
                    arrow_cuda::ffi::export_array(column, b.ready(), stream).map(drop),
                );
                // SAFETY: nothing reads the result's buffers (there is none).
                gone(
                    "to_array_data_unchecked",
                    unsafe { column.to_array_data_unchecked() }.map(drop),
                );
                gone("write_message", ipc::write_message(b, stream).map(drop));
                gone("describe", BatchDescriptor::describe(b).map(drop));
                gone("to_vec", buffer.to_vec(stream).map(drop));
                gone(
                    "copy_to",
                    buffer.copy_to(MemoryResource::default_for(device), stream).map(drop),
                );
                gone("device_pointer", buffer.device_pointer().map(drop));
                let view = StridedView::<u8>::contiguous(buffer.clone(), &[buffer.len()]).unwrap();
                gone("a strided view's copy_to_host", view.copy_to_host(stream).map(drop));
                if device == Device::Cpu {
                    gone("to_arrow_buffer", buffer.to_arrow_buffer().map(drop));
                    assert!(buffer.host_slice().is_none(), "{what}: host_slice");
                }
            }
            eprintln!("{device}, test hook {hook}: {intact} of 4 batches read intact after their sender died");
            // Dropping what it cannot read is safe.
            drop((held, r));
        }
    });
}

/// A receiver whose `CUDA_VISIBLE_DEVICES` numbers the GPUs otherwise finds the sender's GPU by its
/// UUID (with a second GPU, it sees that one first: the sender's device 0 is its device 1); one
/// that does not see the sender's GPU refuses every batch with an error that names it, and the
/// stream goes on to its end.
#[test]
fn receivers_find_the_senders_gpu_by_uuid() {
    let _devices = using_devices();
    let Some(device) = common::cuda() else { return };
    let stream = Stream::new(device).unwrap();
    let ours = DeviceUuid::of(device.ordinal().unwrap()).unwrap();
    let other = (0..arrow_cuda::device::cuda_device_count().unwrap())
        .filter(|&o| Some(o) != device.ordinal())
        .map(|o| DeviceUuid::of(o).unwrap())
        .next();
    let (visible, theirs) = match other {
        Some(other) => (format!("{other},{ours}"), Device::Cuda(1)),
        None => (ours.to_string(), Device::Cuda(0)),
    };
    // Without another GPU, the receiver that cannot see ours sees none.
    let blind = other.map_or_else(|| "-1".to_string(), |o| o.to_string());
    let runs = [("verify", visible, theirs), ("unknown-device", blind, Device::Cpu)];
    for (role, visible, theirs) in runs {
        eprintln!(
            "{role}: the receiver runs with CUDA_VISIBLE_DEVICES={visible} and reads the batches of our {device} on its {theirs}"
        );
        let path = socket_path(&format!("uuid-{role}"));
        let sender = Sender::bind(&path, corpus().schema(), SenderOptions::default()).unwrap();
        let uuid = ours.to_string();
        let env = [("CUDA_VISIBLE_DEVICES", visible.as_str()), (PEER_UUID, uuid.as_str())];
        let peer = Peer::spawn_with(role, &path, theirs, STREAM, &env);
        sender.wait_for_receivers(1, Duration::from_secs(60)).unwrap();
        for i in 0..STREAM {
            // The batch's id: 0 only when no receiver was connected.
            assert_ne!(
                sender.send(&device_stream_batch(i, device, &stream)).unwrap(),
                0,
                "{role}: batch {i}"
            );
        }
        sender.finish().unwrap();
        peer.passed();
        // Refused batches are acknowledged too.
        sender.wait_idle(Duration::from_secs(30)).unwrap();
        let status = sender.status();
        assert_eq!((status.sent, status.lost), (STREAM as u64, 0), "{role}: {status:?}");
    }
}

/// How long a survivor of the fault runs may wait for its peer (to connect, to send, to take a
/// batch): a survivor that waits longer hangs. 5 seconds; 60 under compute-sanitizer, whose
/// processes (peers included) start and run many times slower.
fn fault_timeout() -> Duration {
    match common::under_sanitizer() {
        true => Duration::from_secs(60),
        false => Duration::from_secs(5),
    }
}

/// How many times the fault runs kill each kind of peer (`ARROW_CUDA_FAULT_RUNS`, 100 unless set),
/// and the seed of their random points (`ARROW_CUDA_FAULT_SEED`, from the clock unless set).
fn fault_runs() -> (usize, u64) {
    let var = |name: &str| std::env::var(name).ok().map(|v| v.parse::<u64>().unwrap());
    let runs = var("ARROW_CUDA_FAULT_RUNS").unwrap_or(100) as usize;
    let clock = || std::time::SystemTime::UNIX_EPOCH.elapsed().unwrap().as_nanos() as u64;
    (runs, var("ARROW_CUDA_FAULT_SEED").unwrap_or_else(clock))
}

/// Says, when the test fails, how to replay it: `.0` is updated as the runs go.
struct Replay(String);

impl Drop for Replay {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let _ = writeln!(std::io::stderr(), "fault runs failed at {}", self.0);
        }
    }
}

/// A random point of a peer's life at which the fault runs kill it: one run in four during its
/// connection (`after` 0: `delay` after it says it is about to connect, or, for a sender, that it
/// is bound and about to greet), the others in the stream (after the `after`-th signal of the
/// survivor, whose first comes once it is connected and the next with each batch, and `delay`
/// more).
struct KillPoint {
    after: usize,
    delay: Duration,
}

impl KillPoint {
    fn random(rng: &mut StdRng) -> KillPoint {
        match rng.random_bool(0.25) {
            // A connection and its greeting take a few hundred microseconds.
            true => KillPoint {
                after: 0,
                delay: Duration::from_micros(rng.random_range(0..400)),
            },
            false => KillPoint {
                after: rng.random_range(1..=16),
                delay: Duration::from_micros(rng.random_range(0..3000)),
            },
        }
    }

    /// Whether the kill comes during the connection, before the stream.
    fn in_connection(&self) -> bool {
        self.after == 0
    }

    /// Kills `peer` with SIGKILL at this point of the signals from `signals` (at once should they
    /// stop), reaps it and returns how it ended and when it was killed.
    fn kill(
        self,
        mut peer: Peer,
        signals: mpsc::Receiver<()>,
    ) -> std::thread::JoinHandle<(std::process::ExitStatus, Instant)> {
        std::thread::spawn(move || {
            for _ in 0..self.after {
                if signals.recv().is_err() {
                    break;
                }
            }
            std::thread::sleep(self.delay);
            let _ = peer.child.kill();
            let killed = Instant::now();
            (peer.child.wait().unwrap(), killed)
        })
    }
}

/// The free memory of CUDA device `ordinal`, once it is back within 1 MiB of `start` (the driver
/// frees a killed process's memory as it tears the process down): fails after 10 seconds (60
/// under compute-sanitizer, see [`fault_timeout`]).
fn free_memory_returns_to(ordinal: usize, start: usize, what: &str) {
    let free = || arrow_cuda::device::cuda_devices().unwrap()[ordinal].free_memory;
    let limit = fault_timeout().max(Duration::from_secs(10));
    let since = Instant::now();
    let mut now = free();
    while now + (1 << 20) < start && since.elapsed() < limit {
        std::thread::sleep(Duration::from_millis(20));
        now = free();
    }
    eprintln!("{what}: {now} bytes free, {start} at the start");
    assert!(
        now + (1 << 20) >= start,
        "{what}: free device memory did not return within {limit:?}: {} bytes short",
        start - now
    );
}

/// The devices the fault runs go through, with [`DEVICE_MEMORY`] held for writing on a GPU (they
/// measure the device's free memory).
fn for_fault_runs(mut runs: impl FnMut(Device, &Stream)) {
    for device in common::devices() {
        let _alone = (device != Device::Cpu).then(|| DEVICE_MEMORY.write().unwrap_or_else(PoisonError::into_inner));
        eprintln!("device {device}");
        runs(device, &Stream::new(device).unwrap());
    }
}

/// Issue #23's repeated fault runs, senders' side: a sender killed (SIGKILL) at a random point of
/// its life, 100 times per device: a quarter of the runs while the receiver connects to it and
/// takes its greeting, the others in its stream. The receiver's connection fails with an I/O
/// error or succeeds, and then its next receive fails at once (`UnexpectedEof`), never waits out
/// its timeout, and stays failed. Batches it still holds: on the CPU they read intact, or, in every
/// other run, are fenced by the test hook; on a GPU they read intact where it has shared device
/// memory and are fenced where it lacks it. A fenced batch's download fails with
/// `Error::SenderGone`. On a GPU the device's free memory returns to where it was.
#[test]
fn senders_killed_at_random_points_never_hang_their_receivers() {
    let (runs, seed) = fault_runs();
    let mut replay = Replay(format!("seed {seed} (ARROW_CUDA_FAULT_SEED={seed} replays it)"));
    let mut rng = StdRng::seed_from_u64(seed);
    let options = ReceiverOptions {
        connect_timeout: fault_timeout(),
        recv_timeout: Some(fault_timeout()),
        ..ReceiverOptions::default()
    };
    // The sender is bound already: only its death keeps a connection from being taken.
    let connecting = ReceiverOptions {
        connect_timeout: fault_timeout() / 5,
        ..options.clone()
    };
    let started = Instant::now();
    for_fault_runs(|device, stream| {
        let mut baseline = None;
        let (mut received, mut in_connection, mut refused) = (0, 0, 0);
        for run in 0..runs {
            let what = format!("{device}, run {run}, seed {seed}");
            replay.0 = format!("{what} (ARROW_CUDA_FAULT_SEED={seed} replays it)");
            let path = socket_path(&format!("fault-s-{}", device_name(device)));
            let point = KillPoint::random(&mut rng);
            let mut peer = Peer::spawn("stream", &path, device, 0);
            let early = point.in_connection();
            if early {
                in_connection += 1;
                peer.wait_for("bound");
            }
            let (signal, signals) = mpsc::channel();
            let killer = point.kill(peer, signals);
            let waited = Instant::now();
            let connected = Receiver::connect(&path, if early { connecting.clone() } else { options.clone() });
            assert!(
                waited.elapsed() < fault_timeout(),
                "{what}: connecting hung: {connected:?}"
            );
            let mut r = match connected {
                Ok(r) => r,
                Err(e) if early => {
                    assert!(e.io_kind().is_some(), "{what}: not an I/O error: {e}");
                    let (status, _) = killer.join().unwrap();
                    assert_eq!(
                        status.signal(),
                        Some(libc::SIGKILL),
                        "{what}: the sender ended on its own"
                    );
                    let _ = std::fs::remove_file(&path);
                    refused += 1;
                    check_free_memory(device, &mut baseline, run + 1 == runs, &what);
                    continue;
                }
                Err(e) => panic!("{what}: {e}"),
            };
            // Half the runs on the CPU fence what they hold as CUDA IPC memory is fenced.
            let hook = device == Device::Cpu && run % 2 == 1;
            if hook {
                ipc::testing::fence_host_batches(&mut r);
            }
            let _ = signal.send(());
            let mut held = Vec::new();
            let mut n = 0;
            let error = loop {
                let waited = Instant::now();
                let outcome = r.recv();
                assert!(
                    waited.elapsed() < fault_timeout(),
                    "{what}: a receive hung: {outcome:?}"
                );
                match outcome {
                    Ok(Some(batch)) => {
                        if held.len() < 4 && rng.random_bool(0.3) {
                            held.push((n % 4, batch));
                        }
                        n += 1;
                        let _ = signal.send(());
                    }
                    Ok(None) => panic!("{what}: the stream ended"),
                    Err(e) => break e,
                }
            };
            drop(signal);
            let (status, _) = killer.join().unwrap();
            assert_eq!(
                status.signal(),
                Some(libc::SIGKILL),
                "{what}: the sender ended before it was killed"
            );
            assert_eq!(
                error.io_kind(),
                Some(std::io::ErrorKind::UnexpectedEof),
                "{what}: {error}"
            );
            assert!(r.recv().is_err(), "{what}: a broken receiver stays broken");
            let _ = std::fs::remove_file(&path);
            for (i, b) in &held {
                let fenced = hook || !outlive_their_sender(device);
                match dtoh(b, stream) {
                    // Shared memory outlives its creator.
                    Ok(got) if !fenced => check_batch(&what, &got, &stream_batch(*i)),
                    Err(Error::SenderGone { .. }) if fenced => {}
                    other => panic!("{what}: a held batch (fenced: {fenced}) read {other:?}"),
                }
            }
            drop((held, r));
            received += n;
            check_free_memory(device, &mut baseline, run + 1 == runs, &what);
        }
        eprintln!(
            "{device}: {runs} senders killed ({in_connection} while a receiver connected, {refused} of \
             those before it was greeted), {received} batches received"
        );
    });
    eprintln!("fault runs took {:?}", started.elapsed());
}

/// After each fault run on a GPU: the first run's free device memory is the baseline (it leaves
/// what stays for the process, streams and pools, in place); after the last, free memory must
/// return to it.
fn check_free_memory(device: Device, baseline: &mut Option<usize>, last: bool, what: &str) {
    let Some(o) = device.ordinal() else { return };
    match *baseline {
        None => *baseline = Some(arrow_cuda::device::cuda_devices().unwrap()[o].free_memory),
        Some(start) if last => free_memory_returns_to(o, start, what),
        Some(_) => {}
    }
}

/// Issue #23's repeated fault runs, receivers' side: a receiver killed (SIGKILL) at a random
/// point of its life, 100 times per device: a quarter of the runs while it connects and takes its
/// greeting, the others in the stream. No send waits out its timeout; the receiver is forgotten
/// (lost if it had been registered), everything it held is reclaimed (the memory the sender's
/// again) and the sender finishes; on a GPU the device's free memory returns to where it was.
#[test]
fn receivers_killed_at_random_points_are_always_reclaimed() {
    let (runs, seed) = fault_runs();
    let mut replay = Replay(format!("seed {seed} (ARROW_CUDA_FAULT_SEED={seed} replays it)"));
    let mut rng = StdRng::seed_from_u64(seed);
    let options = SenderOptions {
        send_timeout: fault_timeout(),
        ..SenderOptions::default()
    };
    let started = Instant::now();
    for_fault_runs(|device, stream| {
        // Copied into a message, encoded through the host; a batch lent as it is comes new with
        // each run (below).
        let copied: Vec<_> = (1..3).map(|i| device_stream_batch(i, device, stream)).collect();
        let mut baseline = None;
        let mut slowest = Duration::ZERO;
        let (mut in_connection, mut registered) = (0, 0);
        for run in 0..runs {
            let what = format!("{device}, run {run}, seed {seed}");
            replay.0 = format!("{what} (ARROW_CUDA_FAULT_SEED={seed} replays it)");
            let path = socket_path(&format!("fault-r-{}", device_name(device)));
            let sender = Sender::bind(&path, corpus().schema(), options.clone()).unwrap();
            let lent = device_stream_batch(0, device, stream);
            let memory = lent.column(1).buffers()[0].parent().unwrap();
            let batches = [&lent, &copied[0], &copied[1]];
            let point = KillPoint::random(&mut rng);
            let early = point.in_connection();
            let mut peer = Peer::spawn("drain", &path, device, 0);
            match early {
                true => {
                    in_connection += 1;
                    peer.wait_for("connecting");
                }
                false => sender.wait_for_receivers(1, fault_timeout()).unwrap(),
            }
            let (signal, signals) = mpsc::channel();
            let killer = point.kill(peer, signals);
            let _ = signal.send(());
            // Sends until nobody receives them and the receiver is dead: in a connection's runs
            // the first sends may find nobody yet.
            for i in 0.. {
                let waited = Instant::now();
                let sent = sender.send(batches[i % 3]);
                assert!(waited.elapsed() < fault_timeout(), "{what}: a send hung: {sent:?}");
                match sent.unwrap() {
                    0 if killer.is_finished() => break,
                    0 => std::thread::sleep(Duration::from_millis(1)),
                    _ => {
                        let _ = signal.send(());
                    }
                }
            }
            drop(signal);
            let (status, killed) = killer.join().unwrap();
            assert_eq!(
                status.signal(),
                Some(libc::SIGKILL),
                "{what}: the receiver ended before it was killed"
            );
            // A receiver killed before the sender registered it was never counted; one registered
            // and killed is lost.
            let reclaimed = |s: &ipc::SenderStatus| {
                (s.in_flight_batches, s.in_flight_bytes, s.receivers) == (0, 0, 0)
                    && s.lost == s.joined
                    && (early || s.lost == 1)
            };
            while !reclaimed(&sender.status()) && killed.elapsed() < fault_timeout() {
                std::thread::sleep(Duration::from_millis(1));
            }
            slowest = slowest.max(killed.elapsed());
            let status = sender.status();
            assert!(reclaimed(&status), "{what}: not reclaimed: {status:?}");
            registered += status.joined;
            drop(lent);
            assert!(memory.is_mutable(), "{what}: the lent memory was not given back");
            let finishing = Instant::now();
            sender.finish().unwrap();
            drop(sender);
            assert!(finishing.elapsed() < fault_timeout(), "{what}: finishing hung");
            check_free_memory(device, &mut baseline, run + 1 == runs, &what);
        }
        eprintln!(
            "{device}: {runs} receivers killed ({in_connection} while connecting, {registered} of all \
             registered first), all reclaimed within {slowest:?} of the kill"
        );
    });
    eprintln!("fault runs took {:?}", started.elapsed());
}

// ---------------------------------------------------------------------------------------------
// The channel in one process (CPU): acknowledgements, back-pressure, late joiners.

fn quick(max_in_flight_bytes: u64) -> SenderOptions {
    SenderOptions {
        max_in_flight_bytes,
        send_timeout: Duration::from_millis(300),
        ..SenderOptions::default()
    }
}

fn connected(path: &std::path::Path) -> Receiver {
    Receiver::connect(
        path,
        ReceiverOptions {
            recv_timeout: Some(Duration::from_secs(30)),
            ..ReceiverOptions::default()
        },
    )
    .unwrap()
}

/// Batch `i` of [`messages_in_shared_device_memory_reuse_their_regions`]: its messages take more
/// than 8 MiB, a region size that no other case of this binary makes (theirs take 2 MiB). Idle
/// regions serve every sender of the process: other cases, running meanwhile, take the idle regions
/// of their size, and would take that case's between two of its batches.
fn reused_region_batch(i: usize) -> RecordBatch {
    let n = 1 << 20;
    let ints: ArrayRef = Arc::new(Int64Array::from_iter_values((0..n).map(|v| v * (i as i64 + 1))));
    let strings: ArrayRef = Arc::new(StringArray::from_iter(
        (0..n).map(|v| (v < 1000 && v % 7 != 0).then(|| format!("batch {i} value {v}"))),
    ));
    RecordBatch::try_from_iter([("ints", ints), ("strings", strings)]).unwrap()
}

/// On a GPU with shared device memory, the messages a sender copies batches into reuse the regions
/// of acknowledged ones, and the receiver maps each region once: every batch arrives at the same
/// address, intact. A batch that a receiver still holds keeps its region from being reused.
#[test]
fn messages_in_shared_device_memory_reuse_their_regions() {
    let _devices = using_devices();
    let Some(device) = common::cuda() else { return };
    if !matches!(MemoryResource::shared_for(device), MemoryResource::SharedDevice(_)) {
        eprintln!("skipped on {device}: the GPU has no shared device memory");
        return;
    }
    let stream = Stream::new(device).unwrap();
    let path = socket_path("shared-reuse");
    let sender = Sender::bind(&path, reused_region_batch(0).schema(), SenderOptions::default()).unwrap();
    let mut r = connected(&path);
    sender.wait_for_receivers(1, Duration::from_secs(30)).unwrap();
    // In pool memory, which no other process can open: copied into a message each time.
    let batches: Vec<_> = (0..4)
        .map(|i| upload(&reused_region_batch(i), MemoryResource::default_for(device), &stream))
        .collect();
    // Where the region behind a received batch starts in this process.
    let address = |b: &DeviceRecordBatch| {
        let buffer = &b.column(1).buffers()[0];
        buffer.address() - buffer.offset() as u64
    };
    let mut addresses = Vec::new();
    for (i, batch) in batches.iter().enumerate() {
        assert_ne!(sender.send(batch).unwrap(), 0);
        let got = r.recv().unwrap().unwrap();
        check_batch(
            &format!("message {i}"),
            &dtoh(&got, &stream).unwrap(),
            &reused_region_batch(i),
        );
        addresses.push(address(&got));
        drop(got);
        sender.wait_idle(Duration::from_secs(30)).unwrap();
    }
    assert!(
        addresses.windows(2).all(|w| w[0] == w[1]),
        "one region, mapped once: {addresses:?}"
    );
    // Held, the first is not reused for the second.
    sender.send(&batches[0]).unwrap();
    let held = r.recv().unwrap().unwrap();
    sender.send(&batches[1]).unwrap();
    let next = r.recv().unwrap().unwrap();
    assert_ne!(address(&held), address(&next), "a held region is not reused");
    check_batch("held", &dtoh(&held, &stream).unwrap(), &reused_region_batch(0));
    check_batch("next", &dtoh(&next, &stream).unwrap(), &reused_region_batch(1));
}

/// A receiver's acknowledgements give its credit back: with one byte of credit, each batch waits
/// for the last to be released (its last view dropped), and the memory is the sender's again.
#[test]
fn acknowledgements_free_room_for_more() {
    let stream = Stream::cpu();
    let batch = small_batch(1000);
    let path = socket_path("acks");
    let options = SenderOptions {
        send_timeout: Duration::from_secs(60),
        ..quick(1)
    };
    let sender = Sender::bind(&path, batch.schema(), options).unwrap();
    let mut r = connected(&path);
    sender.wait_for_receivers(1, Duration::from_secs(10)).unwrap();
    let shared = upload(&batch, MemoryResource::SharedHost, &stream);
    let whole = shared.column(0).buffers()[0].parent().unwrap();
    sender.send(&shared).unwrap();
    drop(shared);
    let got = r.recv().unwrap().unwrap();
    check_batch("received", &dtoh(&got, &stream).unwrap(), &batch);
    assert_eq!(sender.status().in_flight_batches, 1);
    // A view of one column keeps the whole batch lent.
    let column = got.column(1).clone();
    drop(got);
    assert!(
        sender.wait_idle(Duration::from_millis(200)).is_err(),
        "a view is still alive"
    );
    assert!(!whole.is_mutable());
    // Only one byte may be in flight: the next batch waits until the view drops.
    let other = upload(&batch, MemoryResource::SharedHost, &stream);
    std::thread::scope(|scope| {
        let sending = scope.spawn(|| sender.send(&other));
        drop(column);
        assert_ne!(sending.join().unwrap().unwrap(), 0);
    });
    assert!(whole.is_mutable(), "acknowledged memory is the sender's again");
    // A batch in ordinary host memory goes as a copy, reclaimed the same way.
    let plain = upload(&batch, MemoryResource::Host, &stream);
    let got = r.recv().unwrap().unwrap();
    drop(got);
    sender.wait_idle(Duration::from_secs(10)).unwrap();
    sender.send(&plain).unwrap();
    let got = r.recv().unwrap().unwrap();
    check_batch("copied", &dtoh(&got, &stream).unwrap(), &batch);
    drop(got);
    sender.wait_idle(Duration::from_secs(10)).unwrap();
    sender.finish().unwrap();
    assert!(r.recv().unwrap().is_none());
    assert_eq!(sender.status().sent, 3);
    assert!(
        sender
            .take_events()
            .iter()
            .all(|e| !matches!(e, SenderEvent::Dropped { .. }))
    );
}

/// A receiver that never acknowledges holds up a send only until the send timeout: then it is
/// dropped (its next receive fails) and the stream goes on to the others. What it holds stays lent
/// until it lets go.
#[test]
fn a_receiver_that_never_acknowledges_is_dropped_and_the_others_go_on() {
    let stream = Stream::cpu();
    let batch = small_batch(1000);
    let path = socket_path("silent");
    let sender = Sender::bind(&path, batch.schema(), quick(1)).unwrap();
    let mut silent = connected(&path);
    let mut good = connected(&path);
    sender.wait_for_receivers(2, Duration::from_secs(10)).unwrap();
    let send = || {
        sender
            .send(&upload(&batch, MemoryResource::SharedHost, &stream))
            .unwrap()
    };
    let lent = upload(&batch, MemoryResource::SharedHost, &stream);
    let whole = lent.column(0).buffers()[0].parent().unwrap();
    let first = sender.send(&lent).unwrap();
    drop(lent);
    let held = silent.recv().unwrap().unwrap();
    drop(good.recv().unwrap().unwrap());
    // The silent receiver has no credit left: this send waits for it, then drops it.
    let second = send();
    assert_ne!(second, 0);
    let events = sender.take_events();
    assert!(
        events
            .iter()
            .any(|e| matches!(e, SenderEvent::Dropped { held: 1, reason, .. } if reason.contains("credit"))),
        "{events:?}"
    );
    check_batch("good", &dtoh(&good.recv().unwrap().unwrap(), &stream).unwrap(), &batch);
    // The others no longer wait for it.
    for _ in 0..3 {
        send();
        drop(good.recv().unwrap().unwrap());
    }
    let e = silent.recv().unwrap_err();
    assert_eq!(e.io_kind(), Some(std::io::ErrorKind::UnexpectedEof), "{e}");
    // Its batch is still lent, and intact, until it lets go.
    assert_eq!(sender.status().lost, 1);
    assert!(!whole.is_mutable(), "the sender keeps what the dropped receiver holds");
    check_batch("held", &dtoh(&held, &stream).unwrap(), &batch);
    drop(held);
    sender.wait_idle(Duration::from_secs(10)).unwrap();
    assert!(whole.is_mutable(), "released once acknowledged");
    assert!(first < second);
}

/// At most `max_receivers` connections at once: one more is told so and refused.
#[test]
fn connections_past_the_limit_are_refused() {
    let batch = small_batch(10);
    let path = socket_path("limit");
    let options = SenderOptions {
        max_receivers: 1,
        ..SenderOptions::default()
    };
    let sender = Sender::bind(&path, batch.schema(), options).unwrap();
    let first = connected(&path);
    sender.wait_for_receivers(1, Duration::from_secs(10)).unwrap();
    let e = Receiver::connect(&path, ReceiverOptions::default()).unwrap_err();
    assert_eq!(e.io_kind(), Some(std::io::ErrorKind::PermissionDenied), "{e}");
    assert!(e.to_string().contains("too many receivers"), "{e}");
    let events = sender.take_events();
    assert!(
        events.iter().any(|e| matches!(e, SenderEvent::Refused { .. })),
        "{events:?}"
    );
    // Once the first has gone, another may come (its connection closes a moment after the drop).
    drop(first);
    let deadline = Instant::now() + Duration::from_secs(10);
    let again = loop {
        match Receiver::connect(&path, ReceiverOptions::default()) {
            Ok(r) => break r,
            Err(e) if Instant::now() < deadline => assert!(e.to_string().contains("too many"), "{e}"),
            Err(e) => panic!("no room after the first receiver left: {e}"),
        }
    };
    assert_eq!(again.schema(), &batch.schema());
}

/// Greetings happen outside the sender's lock and off its accepting thread: a process that
/// connects and never reads a greeting too large for the socket's buffer holds up nobody.
#[test]
fn a_process_that_never_reads_its_greeting_holds_up_nobody() {
    let fields: Vec<Field> = (0..20_000)
        .map(|i| Field::new(format!("a_column_with_a_long_name_{i:06}"), DataType::Int8, true))
        .collect();
    let schema = Arc::new(Schema::new(fields));
    assert!(
        ipc::encode_schema(&schema).len() > 1 << 20,
        "larger than a socket's buffer"
    );
    let path = socket_path("greeting");
    let options = SenderOptions {
        send_timeout: Duration::from_secs(600),
        ..SenderOptions::default()
    };
    let sender = Sender::bind(&path, schema.clone(), options).unwrap();
    let mut stuck = UnixStream::connect(&path).unwrap();
    // The greeting has started once its first bytes are there; the rest is never read.
    let mut first = [0u8; 4];
    stuck.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    stuck.read_exact(&mut first).unwrap();
    let other = Receiver::connect(
        &path,
        ReceiverOptions {
            connect_timeout: Duration::from_secs(30),
            ..ReceiverOptions::default()
        },
    )
    .unwrap();
    assert_eq!(other.schema(), &schema);
    sender.wait_for_receivers(1, Duration::from_secs(10)).unwrap();
    assert_eq!(sender.status().receivers, 1, "the stuck one is not registered");
    drop(stuck);
}

/// Frames go through the shared-memory ring unless they carry descriptors (CPU regions) or are too
/// large for it; then they go on the socket, announced in the ring. One stream mixing all three
/// arrives in order.
#[test]
fn frames_through_the_ring_and_the_socket_keep_their_order() {
    let stream = Stream::cpu();
    let batch = small_batch(300);
    let path = socket_path("ring-order");
    let sender = Sender::bind(&path, batch.schema(), SenderOptions::default()).unwrap();
    let mut r = connected(&path);
    sender.wait_for_receivers(1, Duration::from_secs(10)).unwrap();
    let empty = upload(&batch.slice(0, 0), MemoryResource::SharedHost, &stream);
    let shared = upload(&batch, MemoryResource::SharedHost, &stream);
    // Empty batches have no regions: ring entries, about 300 bytes each, so 10,000 of them go round
    // the 1 MiB ring about three times. Every thousandth batch has a region: on the socket.
    let rounds = 10_000;
    std::thread::scope(|scope| {
        let sender = &sender;
        let (empty, shared) = (&empty, &shared);
        scope.spawn(move || {
            for i in 0..rounds {
                sender.send(if i % 1000 == 500 { shared } else { empty }).unwrap();
            }
            // A reason over a quarter of the ring (and over the socket's buffer): on the socket.
            sender.abort(&"why ".repeat(100_000)).unwrap();
        });
        for i in 0..rounds {
            let got = r.recv().unwrap().unwrap();
            match i % 1000 == 500 {
                true => check_batch("from the socket", &dtoh(&got, &stream).unwrap(), &batch),
                false => assert_eq!(got.num_rows(), 0, "batch {i}"),
            }
        }
        let e = r.recv().unwrap_err();
        assert!(
            matches!(&e, Error::Arrow(arrow_schema::ArrowError::IpcError(m)) if m.len() > 400_000 && m.ends_with("why ")),
            "the long abort: {}",
            e.to_string().chars().take(200).collect::<String>()
        );
    });
    sender.wait_idle(Duration::from_secs(10)).unwrap();
}

#[test]
fn two_receivers_release_a_batch_when_both_are_done() {
    let stream = Stream::cpu();
    let batch = small_batch(500);
    let path = socket_path("both");
    let sender = Sender::bind(&path, batch.schema(), SenderOptions::default()).unwrap();
    let (mut r1, mut r2) = (connected(&path), connected(&path));
    sender.wait_for_receivers(2, Duration::from_secs(10)).unwrap();
    let shared = upload(&batch, MemoryResource::SharedHost, &stream);
    let whole = shared.column(0).buffers()[0].parent().unwrap();
    sender.send(&shared).unwrap();
    drop(shared);
    let (g1, g2) = (r1.recv().unwrap().unwrap(), r2.recv().unwrap().unwrap());
    check_batch("first", &dtoh(&g1, &stream).unwrap(), &batch);
    check_batch("second", &dtoh(&g2, &stream).unwrap(), &batch);
    drop(g1);
    assert!(
        sender.wait_idle(Duration::from_millis(200)).is_err(),
        "the second receiver still holds it"
    );
    assert!(!whole.is_mutable());
    drop(g2);
    sender.wait_idle(Duration::from_secs(10)).unwrap();
    assert!(whole.is_mutable());
    // A receiver that goes away cleanly is reported as having left.
    drop(r1);
    let deadline = Instant::now() + Duration::from_secs(10);
    while sender.status().left < 1 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!((sender.status().left, sender.status().lost), (1, 0));
    sender
        .send(&upload(&batch, MemoryResource::SharedHost, &stream))
        .unwrap();
    drop(r2.recv().unwrap().unwrap());
    sender.wait_idle(Duration::from_secs(10)).unwrap();
}

#[test]
fn late_receivers_start_with_the_next_batch_and_still_see_the_end() {
    let stream = Stream::cpu();
    let batch = small_batch(10);
    let path = socket_path("late");
    let sender = Sender::bind(&path, batch.schema(), SenderOptions::default()).unwrap();
    assert_eq!(
        sender
            .send(&upload(&batch, MemoryResource::SharedHost, &stream))
            .unwrap(),
        0,
        "no receiver yet"
    );
    let mut r = connected(&path);
    sender.wait_for_receivers(1, Duration::from_secs(10)).unwrap();
    let second = small_batch(20);
    sender
        .send(&upload(&second, MemoryResource::SharedHost, &stream))
        .unwrap();
    check_batch("second", &dtoh(&r.recv().unwrap().unwrap(), &stream).unwrap(), &second);
    sender.finish().unwrap();
    assert!(
        sender
            .send(&upload(&batch, MemoryResource::SharedHost, &stream))
            .is_err(),
        "the stream has ended"
    );
    let mut late = connected(&path);
    assert!(late.recv().unwrap().is_none());
    assert!(r.recv().unwrap().is_none());
    let wrong = RecordBatch::try_from_iter([("x", Arc::new(Int64Array::from(vec![1])) as ArrayRef)]).unwrap();
    assert!(matches!(
        sender.send(&upload(&wrong, MemoryResource::SharedHost, &stream)),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
fn a_dropped_sender_aborts_the_stream_and_a_stale_socket_is_replaced() {
    let batch = small_batch(10);
    let path = socket_path("drop");
    // A socket file nobody listens on any more.
    drop(UnixListener::bind(&path).unwrap());
    let sender = Sender::bind(&path, batch.schema(), SenderOptions::default()).unwrap();
    assert!(
        Sender::bind(&path, batch.schema(), SenderOptions::default()).is_err(),
        "a live socket is kept"
    );
    let mut r = connected(&path);
    sender.wait_for_receivers(1, Duration::from_secs(10)).unwrap();
    drop(sender);
    let e = r.recv().unwrap_err();
    assert!(
        matches!(&e, Error::Arrow(arrow_schema::ArrowError::IpcError(m)) if m.contains("aborted")),
        "{e}"
    );
    assert!(!path.exists(), "the socket file is removed");
}

// ---------------------------------------------------------------------------------------------
// Corrupt frames.

fn raw_frame(payload: &[u8]) -> Vec<u8> {
    let mut out = (payload.len() as u32).to_le_bytes().to_vec();
    out.extend_from_slice(payload);
    out
}

fn hello(magic: &[u8; 8], version: u32, schema: &Schema) -> Vec<u8> {
    let schema = ipc::encode_schema(schema);
    let mut p = vec![1u8];
    p.extend_from_slice(magic);
    p.extend_from_slice(&version.to_le_bytes());
    p.extend_from_slice(&(schema.len() as u32).to_le_bytes());
    p.extend_from_slice(&schema);
    raw_frame(&p)
}

/// The channel protocol's version (`src/ipc/channel/protocol.rs`).
const PROTOCOL: u32 = 7;

/// A fake sender: accepts one receiver, writes `greeting`, then runs `script` on the socket in a
/// thread of its own while the receiver is returned.
fn with_fake_sender(
    name: &str,
    greeting: Vec<u8>,
    script: impl FnOnce(UnixStream) + Send + 'static,
) -> (arrow_cuda::Result<Receiver>, std::thread::JoinHandle<()>) {
    let path = socket_path(name);
    let listener = UnixListener::bind(&path).unwrap();
    let fake = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        s.write_all(&greeting).unwrap();
        script(s);
    });
    let options = ReceiverOptions {
        recv_timeout: Some(Duration::from_secs(10)),
        ..ReceiverOptions::default()
    };
    let r = Receiver::connect(&path, options);
    let _ = std::fs::remove_file(&path);
    (r, fake)
}

/// The receiver a fake sender connected, once its script has run.
fn fake_sender(
    name: &str,
    greeting: Vec<u8>,
    script: impl FnOnce(UnixStream) + Send + 'static,
) -> arrow_cuda::Result<Receiver> {
    let (r, fake) = with_fake_sender(name, greeting, script);
    fake.join().unwrap();
    r
}

#[test]
fn corrupt_frames_from_a_sender_are_errors() {
    let schema = small_batch(1).schema();
    let good = || hello(b"ACUDAIPC", PROTOCOL, &schema);
    let e = fake_sender("bad-magic", hello(b"NOTARROW", PROTOCOL, &schema), |_| {}).unwrap_err();
    assert!(is_invalid_data(&e), "{e}");
    let e = fake_sender("bad-version", hello(b"ACUDAIPC", 99, &schema), |_| {}).unwrap_err();
    assert!(matches!(e, Error::Unsupported(_)), "{e}");
    let e = fake_sender(
        "bad-schema",
        raw_frame(&[
            1,
            b'A',
            b'C',
            b'U',
            b'D',
            b'A',
            b'I',
            b'P',
            b'C',
            PROTOCOL as u8,
            0,
            0,
            0,
            3,
            0,
            0,
            0,
            1,
            2,
            3,
        ]),
        |_| {},
    )
    .unwrap_err();
    assert!(is_invalid_data(&e), "{e}");

    // A greeting without the ring, or with a ring frame that lacks its descriptors. (Corrupt
    // frames after the greeting are tested in `src/ipc/channel/receiver.rs`: they go through the
    // shared-memory ring.)
    let e = fake_sender("no-ring", good(), |_| {}).unwrap_err();
    assert_eq!(e.io_kind(), Some(std::io::ErrorKind::UnexpectedEof), "{e}");
    let mut ring = vec![5u8];
    ring.extend_from_slice(&(1u64 << 20).to_le_bytes());
    let e = fake_sender("ring-without-fds", [good(), raw_frame(&ring)].concat(), |_| {}).unwrap_err();
    assert!(is_invalid_data(&e), "{e}");
    let e = fake_sender("end-for-ring", [good(), raw_frame(&[3])].concat(), |_| {}).unwrap_err();
    assert!(is_invalid_data(&e), "{e}");
}

#[test]
fn corrupt_frames_from_a_receiver_cost_only_that_receiver() {
    let stream = Stream::cpu();
    let batch = small_batch(100);
    let path = socket_path("bad-receivers");
    let sender = Sender::bind(&path, batch.schema(), SenderOptions::default()).unwrap();
    let mut good = connected(&path);
    let fake = |then: &[u8]| {
        let mut s = UnixStream::connect(&path).unwrap();
        // The greeting: the schema, then the ring (its descriptors are dropped unread).
        for _ in 0..2 {
            let mut len = [0u8; 4];
            s.read_exact(&mut len).unwrap();
            let mut frame = vec![0u8; u32::from_le_bytes(len) as usize];
            s.read_exact(&mut frame).unwrap();
        }
        s.write_all(then).unwrap();
        s
    };
    let wait_for = |what: &dyn Fn(&ipc::SenderStatus) -> bool| {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !what(&sender.status()) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        sender.status()
    };
    let _unknown = fake(&raw_frame(&[99]));
    let _oversized = fake(&u32::MAX.to_le_bytes());
    let _truncated_ack = fake(&raw_frame(&[16, 1, 2]));
    let status = wait_for(&|s| s.lost == 3);
    assert_eq!((status.lost, status.receivers), (3, 1), "{status:?}");
    // Acknowledging what it never got changes nothing; detaching and closing is a clean exit.
    let mut stray = vec![16u8];
    stray.extend_from_slice(&12345u64.to_le_bytes());
    let mut polite = raw_frame(&stray);
    polite.extend_from_slice(&raw_frame(&[17]));
    drop(fake(&polite));
    let status = wait_for(&|s| s.left == 1);
    assert_eq!((status.left, status.lost), (1, 3), "{status:?}");
    let events = sender.take_events();
    assert_eq!(
        events
            .iter()
            .filter(|e| matches!(e, SenderEvent::Lost { reason, .. } if !reason.is_empty()))
            .count(),
        3
    );
    // The good receiver never noticed.
    sender
        .send(&upload(&batch, MemoryResource::SharedHost, &stream))
        .unwrap();
    check_batch("good", &dtoh(&good.recv().unwrap().unwrap(), &stream).unwrap(), &batch);
    sender.wait_idle(Duration::from_secs(10)).unwrap();
}

/// A sender that goes silent does not hold a receiver forever: a receive times out by default, with
/// an error that says what it waited for and how long, and the receiver can try again.
#[test]
fn a_silent_sender_times_a_receive_out() {
    let default = ReceiverOptions::default().recv_timeout;
    assert!(
        default.is_some_and(|t| t > Duration::ZERO && t <= Duration::from_secs(600)),
        "{default:?}"
    );
    let stream = Stream::cpu();
    let batch = small_batch(10);
    let path = socket_path("silent");
    let sender = Sender::bind(&path, batch.schema(), SenderOptions::default()).unwrap();
    let options = ReceiverOptions {
        recv_timeout: Some(Duration::from_millis(200)),
        ..ReceiverOptions::default()
    };
    let mut r = Receiver::connect(&path, options).unwrap();
    sender.wait_for_receivers(1, Duration::from_secs(10)).unwrap();
    let e = r.recv().unwrap_err();
    assert_eq!(e.io_kind(), Some(std::io::ErrorKind::TimedOut), "{e}");
    assert!(
        e.to_string().contains("waiting for a batch: none came within 200ms"),
        "{e}"
    );
    sender
        .send(&upload(&batch, MemoryResource::SharedHost, &stream))
        .unwrap();
    let got = r.recv().unwrap().unwrap();
    check_batch("after a timeout", &dtoh(&got, &stream).unwrap(), &batch);
    drop(got);
    sender.finish().unwrap();
    assert!(r.recv().unwrap().is_none());
}

/// This process's user id, as the owner of a file it creates.
fn own_uid(path: &std::path::Path) -> u32 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).unwrap().uid()
}

/// Each end checks the other's user (`SO_PEERCRED`): only this user's processes unless
/// `allowed_uids` names others. Here the allowed user is another one, so this process's own peer
/// is refused, by the sender (which tells the receiver why and reports it) and by the receiver.
#[test]
fn peers_of_users_not_allowed_are_refused() {
    let batch = small_batch(10);
    let path = socket_path("peer-uid");
    let sender = Sender::bind(&path, batch.schema(), SenderOptions::default()).unwrap();
    let me = own_uid(&path);
    let stranger = me.wrapping_add(1);
    let wary = ReceiverOptions {
        allowed_uids: Some(vec![stranger]),
        ..ReceiverOptions::default()
    };
    let e = Receiver::connect(&path, wary).unwrap_err();
    assert_eq!(e.io_kind(), Some(std::io::ErrorKind::PermissionDenied), "{e}");
    assert!(e.to_string().contains(&format!("uid {me}")), "{e}");
    // Allowed by name, this user is accepted.
    let named = ReceiverOptions {
        allowed_uids: Some(vec![stranger, me]),
        ..ReceiverOptions::default()
    };
    drop(Receiver::connect(&path, named).unwrap());
    drop(sender);

    let path = socket_path("peer-uid-sender");
    let options = SenderOptions {
        allowed_uids: Some(vec![stranger]),
        ..SenderOptions::default()
    };
    let sender = Sender::bind(&path, batch.schema(), options).unwrap();
    let e = Receiver::connect(&path, ReceiverOptions::default()).unwrap_err();
    assert_eq!(e.io_kind(), Some(std::io::ErrorKind::PermissionDenied), "{e}");
    assert!(e.to_string().contains("refused"), "{e}");
    assert_eq!(sender.status().joined, 0);
    let events = sender.take_events();
    assert!(
        events
            .iter()
            .any(|e| matches!(e, SenderEvent::Refused { reason } if reason.contains(&format!("uid {me}")))),
        "{events:?}"
    );
}

/// A socket file that another user owns is neither replaced nor reused by a sender. Root can make
/// such a file; as another user the case is skipped.
#[test]
fn a_socket_path_of_another_user_is_refused() {
    use std::os::unix::fs::MetadataExt;
    let path = socket_path("other-owner");
    drop(UnixListener::bind(&path).unwrap());
    if std::os::unix::fs::chown(&path, Some(65534), Some(65534)).is_err() {
        eprintln!("skipped: only root can give a file to another user");
        return;
    }
    let e = Sender::bind(&path, small_batch(1).schema(), SenderOptions::default()).unwrap_err();
    assert_eq!(e.io_kind(), Some(std::io::ErrorKind::PermissionDenied), "{e}");
    assert!(e.to_string().contains("uid 65534"), "{e}");
    assert_eq!(std::fs::metadata(&path).unwrap().uid(), 65534, "the file is left alone");
    std::fs::remove_file(&path).unwrap();
}
