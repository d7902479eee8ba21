//! Hooks for the crate's own tests, benchmarks and tools: not part of the API, and hidden from its
//! documentation.

use std::io::Write;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::ipc::channel::Frame;
use crate::ipc::descriptor::BatchDescriptor;
use crate::ipc::event::IpcEventHandle;
use crate::ipc::handle::{HANDLE_BYTES, OpenedHandle};
use crate::ipc::wire::{self, FrameReader};
use crate::memory::SharedMapping;
use crate::memory::shared_device::OpenedRegions;

/// The number of peers' CUDA allocations mapped in this process now.
pub fn open_cuda_mappings() -> usize {
    OpenedHandle::open_count()
}

/// The number of peers' regions of shared device memory mapped in this process now.
pub fn open_shared_device_regions() -> usize {
    crate::memory::shared_device::SharedDeviceRegion::mapped_from_peers()
}

/// The number of peers' shared host regions mapped in this process now.
pub fn open_shared_mappings() -> usize {
    SharedMapping::open_count()
}

/// Fences the CPU batches `receiver` receives from now on as CUDA batches are: every read of one
/// fails with [`Error::SenderGone`] once the sender's connection has closed, though on the CPU
/// (shared memory, which outlives its sender) nothing requires it. Tests of the fence use it on
/// machines without a GPU.
pub fn fence_host_batches(receiver: &mut crate::ipc::Receiver) {
    receiver.fence_host_batches();
}

/// The regions of shared device memory `receiver` keeps for its sender between batches: how many,
/// and their bytes.
pub fn kept_regions(receiver: &crate::ipc::Receiver) -> (usize, usize) {
    receiver.kept_regions()
}

/// Whether a download of `array` skips arrow-rs's validation (its bytes are trusted).
pub fn is_trusted(array: &crate::array::DeviceArrayData) -> bool {
    array.is_trusted()
}

/// The channel's frames as the fuzz targets start from them: the payloads of a greeting with
/// `schema` (an IPC schema message), a batch frame carrying `descriptor` (with an IPC event handle
/// when `event`), an end, an abort, an acknowledgement, a detach and an announcement of no
/// regions. The batch frame's descriptors are duplicated into the second part.
pub fn frame_payloads(
    schema: Vec<u8>,
    descriptor: BatchDescriptor,
    event: bool,
) -> std::io::Result<(Vec<Vec<u8>>, Vec<OwnedFd>)> {
    let batch = Frame::Batch {
        id: 7,
        event: event.then_some(IpcEventHandle([0x5a; HANDLE_BYTES])),
        descriptor,
    };
    let (payload, fds) = batch.encode(None);
    let fds = fds
        .iter()
        .map(|fd| fd.try_clone_to_owned())
        .collect::<std::io::Result<Vec<_>>>()?;
    let others = [
        Frame::Hello { schema },
        Frame::End,
        Frame::Abort("stop".into()),
        Frame::Ack(7),
        Frame::Detach,
        Frame::Regions(Vec::new()),
    ];
    let mut payloads = vec![payload];
    payloads.extend(others.iter().map(|f| f.encode(None).0));
    Ok((payloads, fds))
}

/// A frame decoded as a receiver or a sender decodes it.
#[derive(Debug)]
pub enum Decoded {
    /// A greeting, with its schema message.
    Hello(Vec<u8>),
    /// A batch frame: its descriptor.
    Batch(BatchDescriptor),
    /// Any other frame.
    Other,
}

/// Decodes one frame payload with the descriptors that came with it.
pub fn decode_frame(payload: &[u8], fds: Vec<OwnedFd>) -> Result<Decoded> {
    let mut kept = OpenedRegions::default();
    Ok(match Frame::decode(wire::Frame { payload, fds }, Some(&mut kept))? {
        Frame::Hello { schema } => Decoded::Hello(schema),
        Frame::Batch { descriptor, .. } => Decoded::Batch(descriptor),
        Frame::BadBatch { error, .. } => return Err(error),
        _ => Decoded::Other,
    })
}

/// Writes `bytes` into one end of a socket pair and reads length-prefixed frames of at most
/// `max_frame` bytes from the other until the stream ends, as a receiver reads its socket; each
/// frame is decoded. Returns the frames read, or the first error.
pub fn read_wire(bytes: &[u8], max_frame: usize) -> Result<usize> {
    let (ours, theirs) = UnixStream::pair().map_err(|e| Error::io("a socket pair", e))?;
    theirs
        .set_nonblocking(true)
        .map_err(|e| Error::io("configuring a socket pair", e))?;
    // Written from a thread: a stream larger than the socket's buffer would block otherwise.
    let bytes = bytes.to_vec();
    let writer = std::thread::spawn(move || {
        let mut ours = ours;
        let _ = ours.write_all(&bytes);
    });
    let mut reader = FrameReader::new(max_frame);
    let mut frames = 0;
    let out = loop {
        match reader.recv(theirs.as_fd(), Some(Duration::from_secs(10))) {
            Ok(None) => break Ok(frames),
            Ok(Some(frame)) => {
                frames += 1;
                if let Err(e) = Frame::decode(frame, None) {
                    break Err(e);
                }
            }
            Err(e) => break Err(e.into_error()),
        }
    };
    // The writer ends once the reader has gone (its writes then fail).
    drop(theirs);
    let _ = writer.join();
    out
}
