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
//! through host memory. Dictionary-encoded columns are refused ([`Error::Unsupported`]): their
//! dictionaries would travel as separate `DictionaryBatch` messages.
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

/// An encapsulated IPC message in one allocation.
#[derive(Debug)]
pub struct DeviceMessage {
    buffer: DeviceBuffer,
    /// The prefix, metadata and padding, as uploaded (kept while the upload may be running).
    head: Vec<u8>,
    metadata_len: usize,
    ready: Event,
    /// The source batch, kept until the message drops because copies from it may still be running.
    _sources: Option<DeviceRecordBatch>,
}

impl DeviceMessage {
    /// The whole message: prefix, metadata, padding and body.
    pub fn buffer(&self) -> &DeviceBuffer {
        &self.buffer
    }

    /// The flatbuffer `Message` (a host copy of the metadata in the buffer, without the prefix).
    pub fn metadata(&self) -> &[u8] {
        &self.head[8..8 + self.metadata_len]
    }

    /// Where the body starts in [`DeviceMessage::buffer`] (a multiple of 64).
    pub fn body_offset(&self) -> usize {
        self.head.len()
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
/// completes when they are done.
pub fn write_message_to(batch: &DeviceRecordBatch, resource: MemoryResource, stream: &Stream) -> Result<DeviceMessage> {
    if needs_normalising(batch)? {
        return write_through_host(batch, resource, stream);
    }
    let layout = BodyLayout::of(batch)?;
    let metadata = layout.metadata();
    let head = encapsulate(&metadata);
    let body_offset = head.len();
    let stream = stream_for(stream, resource.device(), batch.device())?;
    stream.wait(batch.ready())?;
    let out = DeviceBuffer::alloc(resource, body_offset + layout.body_len, &stream)?;
    let (dst, dst_device) = (out.address(), out.device());
    // SAFETY: `head` fits at the start of the new allocation, which nothing else sees yet; it is
    // kept by the message, which callers keep until its ready event completes.
    unsafe { copy(dst, dst_device, head.as_ptr() as u64, Device::Cpu, head.len(), &stream)? };
    let zeroed = matches!(resource, MemoryResource::Host | MemoryResource::SharedHost);
    // Zeroes body bytes `from..to` (the padding between runs), unless the memory came zeroed.
    let pad = |from: usize, to: usize| match zeroed {
        true => Ok(()),
        // SAFETY: `from..to` lies inside the new allocation's body.
        false => unsafe { zero(dst + (body_offset + from) as u64, dst_device, to - from, &stream) },
    };
    let mut written = 0;
    for run in runs(&layout) {
        pad(written, run.dst)?;
        // SAFETY: the run lies inside one live allocation of the batch (its buffers view it, and
        // the batch is kept by the message until it drops) and inside the new allocation.
        unsafe {
            copy(
                dst + (body_offset + run.dst) as u64,
                dst_device,
                run.src,
                run.device,
                run.len,
                &stream,
            )?
        };
        written = run.dst + run.len;
    }
    pad(written, layout.body_len)?;
    let ready = stream.record()?;
    let sources = stream.cuda().is_some().then(|| batch.clone());
    Ok(DeviceMessage {
        buffer: out,
        metadata_len: metadata.len(),
        head,
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
    let (_, encoded) = IpcDataGenerator::default().encode(
        &host,
        &mut DictionaryTracker::new(false),
        &IpcWriteOptions::default(),
        &mut IpcWriteContext::default(),
    )?;
    let head = encapsulate(&encoded.ipc_message);
    let stream = stream_for(stream, resource.device(), Device::Cpu)?;
    let mut buffer = DeviceBuffer::alloc(resource, head.len() + encoded.arrow_data.len(), &stream)?;
    buffer.copy_from_host(0, &head, &stream)?;
    buffer.copy_from_host(head.len(), &encoded.arrow_data, &stream)?;
    Ok(DeviceMessage {
        buffer,
        metadata_len: encoded.ipc_message.len(),
        head,
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
            unsafe { cudarc::driver::result::memset_d8_async(address, 0, len, raw) }
                .map_err(Error::driver("cuMemsetD8Async"))
        }
    }
}

/// Reads the encapsulated IPC message at the start of `buffer` as a batch of `schema` whose
/// buffers are views of the body: only the prefix and then the metadata are copied to the host
/// (two small copies on `stream`, which must be ordered after the message's writer); no byte of
/// the body is. Malformed messages are
/// [`Error::InvalidData`]; compressed bodies and dictionary batches are [`Error::Unsupported`]. The
/// legacy encapsulation without the continuation marker is read too.
pub fn read_message(buffer: &DeviceBuffer, schema: &SchemaRef, stream: &Stream) -> Result<DeviceRecordBatch> {
    let mut host = vec![0u8; buffer.len().min(8)];
    buffer.copy_to_host(0, &mut host, stream)?;
    let (prefix, meta_len) = prefix(&host)?;
    let meta_end = prefix
        .checked_add(meta_len)
        .filter(|end| *end <= buffer.len())
        .ok_or_else(|| {
            Error::InvalidData(format!(
                "IPC metadata of {meta_len} bytes overruns a message of {} bytes",
                buffer.len()
            ))
        })?;
    if meta_end > host.len() {
        let start = host.len();
        host.resize(meta_end, 0);
        buffer.copy_to_host(start, &mut host[start..], stream)?;
    }
    let message = decode::parse(&host[prefix..meta_end])?;
    let header = decode::header(&message)?;
    let body = meta_end
        .checked_add(header.body_len)
        .filter(|end| *end <= buffer.len())
        .map(|_| buffer.slice(meta_end, header.body_len))
        .ok_or_else(|| {
            Error::InvalidData(format!(
                "an IPC body of {} bytes overruns a message of {} bytes",
                header.body_len,
                buffer.len()
            ))
        })??;
    let mut resolve = |index: usize, offset: usize, len: usize| {
        offset
            .checked_add(len)
            .filter(|end| *end <= body.len())
            .map(|_| body.slice(offset, len))
            .ok_or_else(|| {
                Error::InvalidData(format!(
                    "IPC buffer {index} ({offset}..+{len}) overruns a body of {} bytes",
                    body.len()
                ))
            })?
    };
    let stream = stream_for(stream, buffer.device(), buffer.device())?;
    decode::batch(schema, &header, buffer.device(), &mut resolve, stream.record()?)
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
