//! Encapsulated Arrow IPC messages whose bytes live in one device allocation, as Arrow C++'s
//! `arrow::cuda::SerializeRecordBatch` writes them and `arrow::cuda::ReadRecordBatch` reads them.
//!
//! A message is the continuation marker `0xFFFFFFFF`, the `int32` metadata length, the flatbuffer
//! `Message` with a `RecordBatch` header padded with zeros so that the body starts 64 bytes in (a
//! multiple of the 8 the format asks for), then the body: every buffer at a multiple of 64 bytes,
//! padded with zeros. The bytes are those arrow-rs's IPC writer produces for the same batch.
//!
//! Writing copies the batch's buffers into the message on the device (device-to-device copies on a
//! stream; runs of buffers that lie in one allocation as they will in the body are copied at once);
//! only the metadata is built on the host. Reading copies only the prefix and the metadata to the
//! host and builds the arrays as views of the body.
//!
//! Slow path: arrays with an offset or an unknown null count (slices) have no IPC layout as they
//! stand. Such a batch is copied to the host ([`crate::transfer::dtoh`]), encoded there by arrow-rs
//! (which cuts every buffer to the slice) and the message uploaded in one copy: a round trip
//! through host memory.
//!
//! Dictionary-encoded columns: their values travel as `DictionaryBatch` messages, one per
//! dictionary, written into the same allocation before the `RecordBatch` message, in the order an
//! Arrow IPC stream lists them. Reading takes them first. (Arrow C++'s `ReadRecordBatch` reads one
//! `RecordBatch` message and has no dictionaries to resolve its keys with.)
//!
//! Schemas travel as ordinary host IPC schema messages ([`encode_schema`], [`decode_schema`]).

use std::sync::Arc;

use arrow_ipc::writer::{DictionaryTracker, IpcDataGenerator, IpcWriteContext, IpcWriteOptions};
use arrow_schema::{Schema, SchemaRef};

use crate::array::DeviceRecordBatch;
use crate::device::{Device, Event, Stream};
use crate::error::{Error, Result};
use crate::ipc::decode;
use crate::ipc::layout::{BodyLayout, CONTINUATION, encapsulate, needs_normalising};
use crate::memory::{DeviceBuffer, MemoryResource, copy, stream_for};

/// An encapsulated IPC message in one allocation: a batch's `RecordBatch` message, preceded by a
/// `DictionaryBatch` message for each dictionary it has.
#[derive(Debug)]
pub struct DeviceMessage {
    buffer: DeviceBuffer,
    /// The messages in the buffer: the dictionaries', then the batch's.
    parts: Vec<Part>,
    ready: Event,
    /// The source batch, kept until the message drops because copies from it may still be running.
    _sources: Option<DeviceRecordBatch>,
}

/// One encapsulated message in a [`DeviceMessage`]'s buffer.
#[derive(Debug)]
pub(crate) struct Part {
    /// Where the message starts in the buffer.
    start: usize,
    /// The prefix, metadata and padding, as uploaded (kept while the upload may be running).
    head: Vec<u8>,
    metadata_len: usize,
}

impl Part {
    fn new(start: usize, metadata: &[u8]) -> Part {
        Part {
            start,
            head: encapsulate(metadata),
            metadata_len: metadata.len(),
        }
    }

    /// The flatbuffer `Message`.
    pub fn metadata(&self) -> &[u8] {
        &self.head[8..8 + self.metadata_len]
    }

    /// Where the body starts in the buffer (a multiple of 64).
    pub fn body_offset(&self) -> usize {
        self.start + self.head.len()
    }
}

impl DeviceMessage {
    /// The whole message: prefix, metadata, padding and body (after the messages of the
    /// dictionaries, if the batch has any).
    pub fn buffer(&self) -> &DeviceBuffer {
        &self.buffer
    }

    /// The flatbuffer `Message` of the batch (a host copy of the metadata in the buffer, without
    /// the prefix).
    pub fn metadata(&self) -> &[u8] {
        self.batch_part().metadata()
    }

    /// Where the batch's body starts in [`DeviceMessage::buffer`] (a multiple of 64).
    pub fn body_offset(&self) -> usize {
        self.batch_part().body_offset()
    }

    /// The number of dictionaries written before the batch.
    pub fn num_dictionaries(&self) -> usize {
        self.parts.len() - 1
    }

    /// Every message in the buffer: the dictionaries', then the batch's.
    pub(crate) fn parts(&self) -> &[Part] {
        &self.parts
    }

    fn batch_part(&self) -> &Part {
        self.parts.last().expect("a message holds a batch")
    }

    /// The body.
    pub fn body(&self) -> DeviceBuffer {
        let len = self.buffer.len() - self.body_offset();
        self.buffer
            .slice(self.body_offset(), len)
            .expect("the body lies inside the message")
    }

    /// The event that completes when every byte of the message is in place.
    pub fn ready(&self) -> &Event {
        &self.ready
    }
}

/// The resource a message for a batch on `device` is written to by default: memory another
/// process can open ([`MemoryResource::Device`] on a GPU, [`MemoryResource::SharedHost`] on the CPU).
pub fn default_message_resource(device: Device) -> MemoryResource {
    match device.ordinal() {
        Some(o) => MemoryResource::Device(o),
        None => MemoryResource::SharedHost,
    }
}

/// Writes `batch` as one encapsulated IPC message into new memory of the default resource for its
/// device ([`default_message_resource`]).
pub fn write_message(batch: &DeviceRecordBatch, stream: &Stream) -> Result<DeviceMessage> {
    write_message_to(batch, default_message_resource(batch.device()), stream)
}

/// Writes `batch` as one encapsulated IPC message into new memory of `resource`. The copies wait
/// on the batch's ready event and run on `stream`; the message's [`DeviceMessage::ready`] event
/// completes when they are done. A batch whose memory another process lent and no longer keeps is
/// an error ([`DeviceRecordBatch::check_readable`]).
pub fn write_message_to(batch: &DeviceRecordBatch, resource: MemoryResource, stream: &Stream) -> Result<DeviceMessage> {
    batch.check_readable()?;
    if needs_normalising(batch) {
        return write_through_host(batch, resource, stream);
    }
    let layouts = BodyLayout::of(batch)?;
    let mut parts = Vec::with_capacity(layouts.len());
    let mut size = 0;
    for layout in &layouts {
        let part = Part::new(size, &layout.metadata());
        size = part.body_offset() + layout.body_len;
        parts.push(part);
    }
    let stream = stream_for(stream, resource.device(), batch.device())?;
    stream.wait(batch.ready())?;
    let out = DeviceBuffer::alloc(resource, size, &stream)?;
    let (dst, dst_device) = (out.address(), out.device());
    let zeroed = matches!(resource, MemoryResource::Host | MemoryResource::SharedHost);
    // Zeroes bytes `from..to` of the new allocation (the padding between runs), unless the memory
    // came zeroed.
    let pad = |from: usize, to: usize| match zeroed {
        true => Ok(()),
        // SAFETY: `from..to` lies inside the new allocation.
        false => unsafe { zero(dst + from as u64, dst_device, to - from, &stream) },
    };
    for (layout, part) in layouts.iter().zip(&parts) {
        let head = &part.head;
        // SAFETY: `head` fits at the part's start in the new allocation, which nothing else sees
        // yet; it is kept by the message, which callers keep until its ready event completes.
        unsafe {
            copy(
                dst + part.start as u64,
                dst_device,
                head.as_ptr() as u64,
                Device::Cpu,
                head.len(),
                &stream,
            )?
        };
        let body = part.body_offset();
        let mut written = body;
        for run in runs(layout) {
            pad(written, body + run.dst)?;
            // SAFETY: the run lies inside one live allocation of the batch (its buffers view it,
            // and the batch is kept by the message until it drops) and inside the new allocation.
            unsafe {
                copy(
                    dst + (body + run.dst) as u64,
                    dst_device,
                    run.src,
                    run.device,
                    run.len,
                    &stream,
                )?
            };
            written = body + run.dst + run.len;
        }
        pad(written, body + layout.body_len)?;
    }
    let ready = stream.record()?;
    let sources = stream.cuda().is_some().then(|| batch.clone());
    Ok(DeviceMessage {
        buffer: out,
        parts,
        ready,
        _sources: sources,
    })
}

/// The slow path for batches with slices: copy to the host, encode there, upload in one copy.
fn write_through_host(batch: &DeviceRecordBatch, resource: MemoryResource, stream: &Stream) -> Result<DeviceMessage> {
    let mut host = crate::transfer::dtoh(batch, stream)?;
    if host.num_rows() == 0 {
        // arrow-rs 59 cannot encode an empty slice of a run-end encoded array (it makes a run end
        // of 0); empty arrays of the same types say the same.
        host = arrow_array::RecordBatch::new_empty(host.schema());
    }
    let generator = IpcDataGenerator::default();
    let options = IpcWriteOptions::default();
    // Writing the schema numbers its dictionaries, as `encode_schema` does.
    let mut tracker = DictionaryTracker::new(false);
    generator.schema_to_bytes_with_dictionary_tracker(&host.schema(), &mut tracker, &options);
    let (dictionaries, encoded) = generator.encode(&host, &mut tracker, &options, &mut IpcWriteContext::default())?;
    // The messages one after another, each body padded to the length its metadata gives.
    let mut bytes = Vec::new();
    let mut parts = Vec::with_capacity(dictionaries.len() + 1);
    for e in dictionaries.iter().chain([&encoded]) {
        let part = Part::new(bytes.len(), &e.ipc_message);
        let body_len = usize::try_from(decode::parse(&e.ipc_message)?.bodyLength())
            .ok()
            .filter(|n| *n >= e.arrow_data.len())
            .ok_or_else(|| Error::InvalidData("arrow-ipc wrote a body longer than its metadata says".into()))?;
        bytes.extend_from_slice(&part.head);
        bytes.extend_from_slice(&e.arrow_data);
        bytes.resize(part.body_offset() + body_len, 0);
        parts.push(part);
    }
    let stream = stream_for(stream, resource.device(), Device::Cpu)?;
    let buffer = DeviceBuffer::from_host(&bytes, resource, &stream)?;
    Ok(DeviceMessage {
        buffer,
        parts,
        ready: Event::completed(),
        _sources: None,
    })
}

/// A run of body bytes copied in one piece.
struct Run {
    src: u64,
    device: Device,
    dst: usize,
    len: usize,
}

/// The copies that fill a body: consecutive buffers that lie in one allocation at the same distance
/// apart as in the body are one copy (a batch uploaded by [`crate::transfer`] is laid out so).
fn runs(layout: &BodyLayout<'_>) -> Vec<Run> {
    let mut runs: Vec<Run> = Vec::new();
    let mut last: Option<&DeviceBuffer> = None;
    for b in &layout.buffers {
        let Some(src) = b.source else { continue };
        if let (Some(prev), Some(run)) = (last, runs.last_mut())
            && src.shares_allocation(prev)
            && src.address() >= run.src
            && src.address() - run.src == (b.offset - run.dst) as u64
        {
            run.len = b.offset + b.len - run.dst;
        } else {
            runs.push(Run {
                src: src.address(),
                device: src.device(),
                dst: b.offset,
                len: b.len,
            });
        }
        last = Some(src);
    }
    runs
}

/// Sets `len` bytes at `address` to zero in the order of `stream`.
///
/// # Safety
/// The range must be valid memory of `device` that nothing else accesses until the stream's work
/// completes.
unsafe fn zero(address: u64, device: Device, len: usize, stream: &Stream) -> Result<()> {
    if len == 0 {
        return Ok(());
    }
    match stream.cuda() {
        None => {
            debug_assert!(device.is_host_accessible());
            // SAFETY: host-accessible memory of `len` bytes (caller).
            unsafe { std::ptr::write_bytes(address as *mut u8, 0, len) };
            Ok(())
        }
        Some(_) => {
            let raw = stream.bind()?;
            // SAFETY: `len` bytes of memory the driver knows, in this stream's context (caller).
            unsafe { crate::driver::memset_d8_async(address, 0, len, raw) }
        }
    }
}

/// Reads the encapsulated IPC message at the start of `buffer` as a batch of `schema` whose
/// buffers are views of the body: only each message's prefix and then its metadata are copied to
/// the host (small copies on `stream`, which must be ordered after the message's writer); no byte
/// of a body is. `DictionaryBatch` messages before the `RecordBatch` message give the values of
/// its dictionary-encoded columns. Malformed messages are [`Error::InvalidData`]; compressed bodies
/// and delta dictionaries are [`Error::Unsupported`]. The legacy encapsulation without the
/// continuation marker is read too.
pub fn read_message(buffer: &DeviceBuffer, schema: &SchemaRef, stream: &Stream) -> Result<DeviceRecordBatch> {
    let mut dictionaries = decode::Dictionaries::new();
    let mut start = 0;
    loop {
        let (host, meta_start, body_start) = read_part(buffer, start, stream)?;
        let message = decode::parse(&host[meta_start..])?;
        let header = decode::header(&message)?;
        let body = buffer.slice(body_start, header.body_len).map_err(|_| {
            Error::InvalidData(format!(
                "an IPC body of {} bytes overruns a message of {} bytes",
                header.body_len,
                buffer.len()
            ))
        })?;
        let resolve = Body(&body);
        if header.dictionary.is_none() {
            let stream = stream_for(stream, buffer.device(), buffer.device())?;
            let ready = stream.record()?;
            return decode::batch(schema, &header, buffer.device(), &resolve, 0, &dictionaries, ready);
        }
        decode::dictionary(schema, &header, buffer.device(), &resolve, 0, &mut dictionaries)?;
        start = body_start + header.body_len;
    }
}

/// Copies the prefix and metadata of the message at `start` of `buffer` to the host: returns them,
/// where the metadata starts in them and where the body starts in `buffer`.
fn read_part(buffer: &DeviceBuffer, start: usize, stream: &Stream) -> Result<(Vec<u8>, usize, usize)> {
    let mut host = vec![0u8; buffer.len().saturating_sub(start).min(8)];
    buffer.copy_to_host(start, &mut host, stream)?;
    let (prefix, meta_len) = prefix(&host)?;
    let meta_end = prefix
        .checked_add(meta_len)
        .filter(|end| start + *end <= buffer.len())
        .ok_or_else(|| {
            Error::InvalidData(format!(
                "IPC metadata of {meta_len} bytes at {start} overruns a message of {} bytes",
                buffer.len()
            ))
        })?;
    if meta_end > host.len() {
        let at = host.len();
        host.resize(meta_end, 0);
        buffer.copy_to_host(start + at, &mut host[at..], stream)?;
    }
    Ok((host, prefix, start + meta_end))
}

/// The prefix length and metadata length of an encapsulated message starting with `head`.
fn prefix(head: &[u8]) -> Result<(usize, usize)> {
    let word = |at: usize| {
        head.get(at..at + 4)
            .map(|b| i32::from_le_bytes(b.try_into().expect("4 bytes")))
    };
    let (prefix, len) = match (head.get(..4), word(4)) {
        (Some(marker), Some(len)) if marker == CONTINUATION => (8, len),
        (Some(_), _) if head[..4] != CONTINUATION => (4, word(0).expect("4 bytes")),
        _ => {
            return Err(Error::InvalidData(format!(
                "an IPC message of {} bytes has no prefix",
                head.len()
            )));
        }
    };
    match len {
        0 => Err(Error::InvalidData("an IPC end-of-stream marker, not a message".into())),
        n if n < 0 => Err(Error::InvalidData(format!("IPC metadata length {n}"))),
        n => Ok((prefix, n as usize)),
    }
}

/// The IPC buffers of a message: ranges of its body.
struct Body<'a>(&'a DeviceBuffer);

impl decode::Resolve for Body<'_> {
    #[inline]
    fn check(&self, index: usize, offset: usize, len: usize) -> Result<(&DeviceBuffer, usize)> {
        match offset.checked_add(len) {
            Some(end) if end <= self.0.len() => Ok((self.0, offset)),
            _ => Err(Error::InvalidData(format!(
                "IPC buffer {index} ({offset}..+{len}) overruns a body of {} bytes",
                self.0.len()
            ))),
        }
    }
}

/// The schema as an encapsulated IPC schema message (host bytes).
pub fn encode_schema(schema: &Schema) -> Vec<u8> {
    let encoded = IpcDataGenerator::default().schema_to_bytes_with_dictionary_tracker(
        schema,
        &mut DictionaryTracker::new(false),
        &IpcWriteOptions::default(),
    );
    encapsulate(&encoded.ipc_message)
}

/// Reads an encapsulated IPC schema message. Malformed bytes are [`Error::InvalidData`] (arrow-ipc
/// panics on some malformed schemas; the panic is caught here).
pub fn decode_schema(bytes: &[u8]) -> Result<SchemaRef> {
    let decoded = std::panic::catch_unwind(|| arrow_ipc::convert::try_schema_from_ipc_buffer(bytes));
    match decoded {
        Ok(Ok(schema)) => Ok(Arc::new(schema)),
        Ok(Err(e)) => Err(Error::InvalidData(format!("a malformed IPC schema message: {e}"))),
        Err(_) => Err(Error::InvalidData(
            "a malformed IPC schema message (arrow-ipc panicked reading it)".into(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes() {
        assert_eq!(prefix(&[0xff, 0xff, 0xff, 0xff, 56, 0, 0, 0]).unwrap(), (8, 56));
        assert_eq!(prefix(&[16, 0, 0, 0, 1, 2]).unwrap(), (4, 16));
        assert!(prefix(&[0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0]).is_err());
        assert!(prefix(&[0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0x80]).is_err());
        assert!(prefix(&[0xff, 0xff, 0xff, 0xff]).is_err());
        assert!(prefix(&[1, 2]).is_err());
    }
}
