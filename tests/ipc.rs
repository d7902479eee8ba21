//! Arrow IPC across processes: device messages, handles, zero-copy descriptors and the channel.
//!
//! Every case runs on the CPU device (shared memory stands in for CUDA IPC) and, where a GPU is
//! present, on CUDA. Cross-process cases spawn this test binary as the peer: the `peer` test does
//! what `ARROW_CUDA_IPC_PEER` says and returns at once when it is not set.

mod common;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use arrow_array::{ArrayRef, Int64Array, RecordBatch, StringArray};
use arrow_buffer::Buffer;
use arrow_cuda::ipc::{
    self, BatchDescriptor, BufferLocation, DeviceMessage, IpcMemHandle, Receiver, ReceiverOptions, Sender, SenderEvent,
    SenderOptions, SharedMapping, SharedMemHandle,
};
use arrow_cuda::transfer::{dtoh, htod_async};
use arrow_cuda::{Device, DeviceBuffer, DeviceRecordBatch, Error, Event, MemoryResource, Stream};
use arrow_ipc::writer::{DictionaryTracker, IpcDataGenerator, IpcWriteContext, IpcWriteOptions};
use arrow_schema::{DataType, Field, Schema, SchemaRef};
use common::corpus::{ROWS, every_type_batch};
use common::each_device;
use proptest::prelude::*;

// ---------------------------------------------------------------------------------------------
// Batches.

/// The corpus of every type, without its dictionary columns (which IPC would send as separate
/// dictionary batches).
fn corpus() -> RecordBatch {
    let batch = every_type_batch();
    let keep: Vec<usize> = (0..batch.num_columns())
        .filter(|&i| !matches!(batch.schema().field(i).data_type(), DataType::Dictionary(..)))
        .collect();
    batch.project(&keep).unwrap()
}

/// Memory another process can open.
fn exportable(device: Device) -> MemoryResource {
    ipc::default_message_resource(device)
}

/// `batch` on `device`, in memory of `resource`, once the copy has finished.
fn upload(batch: &RecordBatch, resource: MemoryResource, stream: &Stream) -> DeviceRecordBatch {
    let b = htod_async(batch, resource, stream).unwrap();
    b.ready().synchronize().unwrap();
    b
}

fn check(what: &str, back: &RecordBatch, expected: &RecordBatch) {
    assert_eq!(back.schema(), expected.schema(), "{what}: schema");
    for (i, (b, e)) in back.columns().iter().zip(expected.columns()).enumerate() {
        let name = expected.schema().field(i).name().clone();
        b.to_data()
            .validate_full()
            .unwrap_or_else(|err| panic!("{what}: column {name} is invalid: {err}"));
        assert_eq!(b.as_ref(), e.as_ref(), "{what}: column {name} differs");
    }
    assert_eq!(back, expected, "{what}");
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
            check(&what, &dtoh(&read, stream).unwrap(), &batch);
        }
    });
}

/// The bytes of a message, copied to the host.
fn host_bytes(message: &DeviceMessage, stream: &Stream) -> Vec<u8> {
    message.buffer().to_vec(stream).unwrap()
}

/// Reads an encapsulated message with arrow-ipc's own reader.
fn read_with_arrow_ipc(bytes: &[u8], schema: SchemaRef) -> RecordBatch {
    assert_eq!(&bytes[..4], &[0xff; 4]);
    let meta_len = i32::from_le_bytes(bytes[4..8].try_into().unwrap()) as usize;
    assert_eq!((8 + meta_len) % 8, 0, "the metadata is padded to 8 bytes");
    let message = arrow_ipc::root_as_message(&bytes[8..8 + meta_len]).unwrap();
    let body_len = message.bodyLength() as usize;
    assert_eq!(bytes.len(), 8 + meta_len + body_len);
    let body = Buffer::from(bytes[8 + meta_len..].to_vec());
    let rb = message.header_as_record_batch().unwrap();
    arrow_ipc::reader::read_record_batch(&body, rb, schema, &HashMap::new(), None, &message.version()).unwrap()
}

/// The message arrow-rs writes for `batch` (64-byte alignment, metadata version V5).
fn arrow_rs_message(batch: &RecordBatch) -> Vec<u8> {
    let options = IpcWriteOptions::default();
    let (_, encoded) = IpcDataGenerator::default()
        .encode(
            batch,
            &mut DictionaryTracker::new(false),
            &options,
            &mut IpcWriteContext::default(),
        )
        .unwrap();
    let mut out = Vec::new();
    arrow_ipc::writer::write_message(&mut out, encoded, &options).unwrap();
    out
}

#[test]
fn messages_are_ordinary_arrow_ipc_messages() {
    let batch = corpus();
    each_device(|device, stream| {
        let on_device = upload(&batch, exportable(device), stream);
        let message = ipc::write_message(&on_device, stream).unwrap();
        let bytes = host_bytes(&message, stream);
        check(
            &format!("{device}: arrow-ipc reads the message"),
            &read_with_arrow_ipc(&bytes, batch.schema()),
            &batch,
        );
        assert_eq!(&bytes[8..8 + message.metadata().len()], message.metadata());
        assert!(
            bytes == arrow_rs_message(&batch),
            "{device}: the message differs from arrow-rs's bytes for the batch"
        );
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
            assert!(ipc::needs_normalising(&slice).unwrap(), "{what}");
            let message = ipc::write_message(&slice, stream).unwrap();
            let read = ipc::read_message(message.buffer(), &batch.schema(), stream).unwrap();
            check(&what, &dtoh(&read, stream).unwrap(), &batch.slice(offset, len));
            check(
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
            check(&format!("{device}: empty"), &dtoh(&read, stream).unwrap(), &b);
        }
    });
}

#[test]
fn dictionary_columns_are_unsupported() {
    let batch = every_type_batch();
    let stream = Stream::cpu();
    let on_device = upload(&batch, MemoryResource::SharedHost, &stream);
    assert!(matches!(
        ipc::write_message(&on_device, &stream),
        Err(Error::Unsupported(_))
    ));
    assert!(matches!(
        BatchDescriptor::describe(&on_device),
        Err(Error::Unsupported(_))
    ));
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
        flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in any::<prop::sample::Index>(),
        truncate in any::<bool>(),
    ) {
        let batch = small_batch(rows);
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
    let Some(device) = common::cuda() else { return };
    let o = device.ordinal().unwrap();
    let stream = Stream::new(device).unwrap();
    let pool = DeviceBuffer::alloc(MemoryResource::DevicePool(o), 4096, &stream).unwrap();
    if pool.resource() == MemoryResource::DevicePool(o) {
        let e = IpcMemHandle::export(&pool).unwrap_err();
        assert!(matches!(e, Error::Unsupported(_)), "{e}");
    }
    let plain = DeviceBuffer::alloc(MemoryResource::Device(o), 1 << 20, &stream).unwrap();
    let whole = IpcMemHandle::export(&plain).unwrap();
    assert_eq!(whole.size(), 1 << 20);
    // A slice names the whole base allocation: (handle, offset, length) crosses the boundary.
    let slice = plain.slice(4096, 100).unwrap();
    assert_eq!(IpcMemHandle::export(&slice).unwrap(), whole);
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
    let before = SharedMapping::open_count();
    let m1 = handle.open().unwrap();
    let m2 = again.open().unwrap();
    assert!(m1.same_as(&m2), "one mapping per region and process");
    assert_eq!(SharedMapping::open_count(), before + 1);
    // SAFETY: the mapping is alive for the read and holds `size` bytes.
    let mapped = unsafe { std::slice::from_raw_parts(m1.address() as *const u8, m1.size()) };
    assert_eq!(mapped, b.host_slice().unwrap());
    drop((m1, m2));
    assert_eq!(SharedMapping::open_count(), before);
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
    check("imported", &dtoh(&read, &stream).unwrap(), &batch);
    // The imported buffers are views of the mapped region, not copies.
    let mapped = read.column(1).buffers()[0].clone();
    drop(read);
    assert!(!dropped.load(Ordering::SeqCst), "a view is still alive");
    drop(mapped);
    assert!(dropped.load(Ordering::SeqCst), "the owner drops with the last view");
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
        check("message descriptor", &dtoh(&read, &stream).unwrap(), &expected);
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
    let cases: Vec<(&str, Box<dyn Fn(&mut BatchDescriptor)>)> = vec![
        ("offset past the region", Box::new(|d| d.locations[1].offset = 1 << 40)),
        (
            "end past the region",
            Box::new(|d| d.locations[1].offset = d.regions[0].size() as u64 - 1),
        ),
        ("offset overflow", Box::new(|d| d.locations[1].offset = u64::MAX)),
        ("no such region", Box::new(|d| d.locations[1].region = 7)),
        ("length mismatch", Box::new(|d| d.locations[1].len += 1)),
        ("missing location", Box::new(|d| drop(d.locations.pop()))),
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
        flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
    ) {
        let batch = small_batch(rows);
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

fn tempfile_path(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("arrow-cuda-ipc-{}-{name}", std::process::id()))
}
