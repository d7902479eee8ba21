//! Fuzz targets for what another process hands the `ipc` layer, on stable Rust through proptest:
//! encapsulated IPC messages, zero-copy batch descriptors, the channel's frame payloads and the
//! byte stream of frames on its socket. Each case starts from a valid encoding of a batch of every
//! type (sliced to a few rows) and mutates it: bytes flipped, 4- and 8-byte words replaced by edge
//! values (the flatbuffer's field nodes and buffers, the descriptors' offsets and lengths and the
//! frames' length prefixes are such words), the input cut short. Decoding must return, `Ok` or an
//! error, without a panic or a read out of bounds; whatever is accepted is copied to the host,
//! which validates it fully (and reads every byte a buffer claims). Descriptors that name a GPU by
//! a UUID this process does not see are refused, naming it, whatever else they hold.
//!
//! CI runs 256 cases per target. For a longer run on demand, set `PROPTEST_CASES`:
//!
//! ```sh
//! PROPTEST_CASES=100000 cargo test --release --test ipc_fuzz
//! ```
//!
//! proptest shrinks a failure to a minimal case and records its seed in
//! `tests/ipc_fuzz.proptest-regressions`, replayed first on every run; each crash found also
//! becomes a named test in `tests/ipc.rs`.

mod common;

use std::os::fd::OwnedFd;
use std::sync::OnceLock;

use arrow_array::RecordBatch;
use arrow_cuda::device::DeviceUuid;
use arrow_cuda::ipc::testing::{Decoded, decode_frame, frame_payloads, read_wire};
use arrow_cuda::ipc::{self, BatchDescriptor};
use arrow_cuda::transfer::{dtoh, htod_async};
use arrow_cuda::{DeviceBuffer, DeviceRecordBatch, Error, Event, MemoryResource, Stream};
use common::corpus::every_type_batch;
use common::fuzz::config;
use proptest::prelude::*;
use proptest::sample::Index;

/// The first `rows` rows of the corpus, with every type.
fn batch(rows: usize) -> RecordBatch {
    static CORPUS: OnceLock<RecordBatch> = OnceLock::new();
    CORPUS.get_or_init(every_type_batch).slice(0, rows)
}

/// A batch in shared host memory, as a sender lends it.
fn shared(rows: usize) -> DeviceRecordBatch {
    let b = htod_async(&batch(rows), MemoryResource::SharedHost, &Stream::cpu()).unwrap();
    b.ready().synchronize().unwrap();
    b
}

/// Copies an accepted batch to the host, which validates every array: an error is fine, a panic
/// or a stray read is not.
fn download(read: &DeviceRecordBatch) {
    let _ = dtoh(read, &Stream::cpu());
}

/// One change to an encoding.
#[derive(Clone, Debug)]
enum Mutation {
    /// A byte replaced.
    Byte(Index, u8),
    /// An aligned little-endian `u32` replaced.
    Word32(Index, u32),
    /// An aligned little-endian `i64` replaced.
    Word64(Index, i64),
    /// The input cut at a point.
    Truncate(Index),
}

/// Edge values for lengths, offsets and counts, and any value.
fn edge64() -> impl Strategy<Value = i64> {
    prop_oneof![
        Just(0),
        Just(1),
        Just(-1),
        Just(8),
        Just(i64::MAX),
        Just(i64::MIN),
        Just(1 << 32),
        Just(u32::MAX as i64),
        0i64..4096,
        any::<i64>(),
    ]
}

fn edge32() -> impl Strategy<Value = u32> {
    prop_oneof![
        Just(0),
        Just(1),
        Just(u32::MAX),
        Just(1 << 31),
        0u32..4096,
        any::<u32>()
    ]
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        3 => (any::<Index>(), any::<u8>()).prop_map(|(i, v)| Mutation::Byte(i, v)),
        2 => (any::<Index>(), edge32()).prop_map(|(i, v)| Mutation::Word32(i, v)),
        3 => (any::<Index>(), edge64()).prop_map(|(i, v)| Mutation::Word64(i, v)),
        1 => any::<Index>().prop_map(Mutation::Truncate),
    ]
}

fn mutations() -> impl Strategy<Value = Vec<Mutation>> {
    proptest::collection::vec(mutation(), 1..6)
}

/// Applies `mutations` to `bytes[from..]` (words at offsets aligned from `from`); a cut shortens the
/// whole input.
fn mutate(bytes: &mut Vec<u8>, from: usize, mutations: &[Mutation]) {
    for m in mutations {
        let span = bytes.len().saturating_sub(from);
        let mut put = |width: usize, at: &Index, value: &[u8]| {
            if span >= width {
                let at = from + at.index(span / width) * width;
                bytes[at..at + width].copy_from_slice(value);
            }
        };
        match m {
            Mutation::Byte(at, v) => put(1, at, &[*v]),
            Mutation::Word32(at, v) => put(4, at, &v.to_le_bytes()),
            Mutation::Word64(at, v) => put(8, at, &v.to_le_bytes()),
            Mutation::Truncate(at) => {
                let cut = from + at.index(span + 1);
                bytes.truncate(cut);
            }
        }
    }
}

/// Duplicates descriptors, as passing them over a socket does.
fn dup(fds: &[std::os::fd::BorrowedFd<'_>]) -> Vec<OwnedFd> {
    fds.iter().map(|f| f.try_clone_to_owned().unwrap()).collect()
}

proptest! {
    #![proptest_config(config())]

    /// An encapsulated IPC message in host memory, read as `read_message` reads one in device
    /// memory: mostly its metadata is changed, where the structure is, sometimes its body.
    #[test]
    fn messages(rows in 0usize..12, in_body in any::<bool>(), changes in mutations()) {
        let stream = Stream::cpu();
        let b = batch(rows);
        let on_device = htod_async(&b, MemoryResource::Host, &stream).unwrap();
        let message = ipc::write_message_to(&on_device, MemoryResource::Host, &stream).unwrap();
        let mut bytes = message.buffer().to_vec(&stream).unwrap();
        let from = if in_body { message.body_offset() } else { 0 };
        mutate(&mut bytes, from, &changes);
        let buffer = DeviceBuffer::from_host(&bytes, MemoryResource::Host, &stream).unwrap();
        if let Ok(read) = ipc::read_message(&buffer, &b.schema(), &stream) {
            download(&read);
        }
    }

    /// A zero-copy descriptor's bytes, with its shared memory attached: regions, metadata, and the
    /// locations (region, offset, length) of every buffer, which take its last bytes.
    #[test]
    fn descriptors(rows in 0usize..12, locations in any::<bool>(), changes in mutations()) {
        let on_device = shared(rows);
        let d = BatchDescriptor::describe(&on_device).unwrap();
        let (mut bytes, fds) = d.to_bytes();
        // The locations are 20 bytes each, after their count: words there align from their start.
        let from = match locations {
            true => bytes.len() - 20 * d.locations.len(),
            false => 0,
        };
        mutate(&mut bytes, from, &changes);
        if let Ok(received) = BatchDescriptor::from_bytes(&bytes, dup(&fds))
            && let Ok(read) = received.import(&on_device.schema().clone(), Event::completed(), ())
        {
            download(&read);
        }
    }

    /// A descriptor whose batch is on a GPU of any id and UUID (not one of this machine's), its
    /// regions, metadata and locations mutated as above: refused with `UnknownDevice`, naming the
    /// UUID (the device is found before anything else is read).
    #[test]
    fn devices(
        rows in 0usize..12,
        device_type in prop_oneof![Just(2u32), Just(3), Just(13)],
        id in edge64(),
        uuid in any::<[u8; 16]>(),
        changes in mutations(),
    ) {
        let uuid = DeviceUuid(uuid);
        prop_assume!(uuid.ordinal().is_err(), "a device of this machine");
        let on_device = shared(rows);
        let d = BatchDescriptor::describe(&on_device).unwrap();
        let (mut bytes, fds) = d.to_bytes();
        // The header: a tag (4 bytes), the device type (4), its id (8) and its UUID (16).
        mutate(&mut bytes, 32, &changes);
        bytes[4..8].copy_from_slice(&device_type.to_le_bytes());
        bytes[8..16].copy_from_slice(&id.to_le_bytes());
        bytes[16..32].copy_from_slice(&uuid.0);
        match BatchDescriptor::from_bytes(&bytes, dup(&fds)) {
            Err(Error::UnknownDevice { uuid: named, .. }) => prop_assert_eq!(named, uuid),
            // A negative id is no CUDA ordinal: refused before the UUID is read.
            Err(Error::InvalidData(m)) if id < 0 => prop_assert!(m.contains("device id"), "{}", m),
            other => prop_assert!(false, "{:?}", other),
        }
    }

    /// One of the channel's frame payloads (a greeting, a batch with or without an event, an end,
    /// an abort, an acknowledgement, a detach), decoded as its receiver decodes it; a greeting's
    /// schema and a batch's descriptor are then read as the receiver reads them.
    #[test]
    fn frames(rows in 0usize..8, event in any::<bool>(), which in any::<Index>(), changes in mutations()) {
        let on_device = shared(rows);
        let schema = on_device.schema().clone();
        let d = BatchDescriptor::describe(&on_device).unwrap();
        let (payloads, fds) = frame_payloads(ipc::encode_schema(&schema), d, event).unwrap();
        let i = which.index(payloads.len());
        let mut bytes = payloads[i].clone();
        mutate(&mut bytes, 0, &changes);
        // Only the batch frame (the first) carries descriptors.
        let fds = if i == 0 { fds } else { Vec::new() };
        match decode_frame(&bytes, fds) {
            Ok(Decoded::Hello(message)) => {
                let _ = ipc::decode_schema(&message);
            }
            Ok(Decoded::Batch(received)) => {
                if let Ok(read) = received.import(&schema, Event::completed(), ()) {
                    download(&read);
                }
            }
            Ok(Decoded::Other) | Err(_) => {}
        }
    }

    /// The socket's byte stream: length-prefixed frames back to back (a greeting, a batch frame
    /// without descriptors, an end), with their length prefixes and contents changed, read by a
    /// receiver's frame reader with a frame limit.
    #[test]
    fn wire(rows in 0usize..8, max_frame in prop_oneof![Just(64usize), Just(1 << 20)], changes in mutations()) {
        let on_device = htod_async(&batch(rows), MemoryResource::Host, &Stream::cpu()).unwrap();
        let message = ipc::write_message_to(&on_device, MemoryResource::SharedHost, &Stream::cpu()).unwrap();
        let d = BatchDescriptor::of_message(&message).unwrap();
        let (payloads, _fds) = frame_payloads(ipc::encode_schema(on_device.schema()), d, false).unwrap();
        let mut stream = Vec::new();
        for p in [&payloads[1], &payloads[0], &payloads[2]] {
            stream.extend_from_slice(&(p.len() as u32).to_le_bytes());
            stream.extend_from_slice(p);
        }
        mutate(&mut stream, 0, &changes);
        let _ = read_wire(&stream, max_frame);
    }
}
