//! Reading scattered offsets from device memory, all at once (the sizes of string and binary data
//! that a C Device import or a concatenation on the device needs): directly for host memory; on a
//! GPU with one launch of a gather kernel that writes them into mapped pinned memory, or, where
//! NVRTC is missing or cannot compile the kernel, with one batched copy; then one wait.
//!
//! The kernel is compiled once per device, on the first read there (tens of milliseconds;
//! `crate::driver` keeps the module), and launched through a one-node graph
//! ([`KernelGraph`]), which costs the calling thread about half of what `cuLaunchKernel` does;
//! the batched copy paid a few hundred nanoseconds per offset. The kernel also sets a flag in the
//! pinned memory once its values are there, and the wait spins on it: on the H200s the host sees
//! a one-thread kernel done 3.8-4.1 µs after its launch returned that way, 5.2-5.3 µs through
//! `cuStreamSynchronize` (`scripts/probes/driver_calls.c`).

use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use cudarc::driver::CudaFunction;

use crate::device::{self, Device, Stream};
use crate::driver::{self, KernelGraph};
use crate::error::{Error, Result};
use crate::memory::pinned::PinnedPool;
use crate::memory::{DeviceBuffer, MemoryResource, copy};

/// The gather kernel.
const KERNEL: &str = include_str!("kernels/gather_offsets.cu");

/// Threads per block of the gather.
const BLOCK: u32 = 256;

/// Marks an 8-byte offset in the addresses the kernel reads (user addresses stay below 2^57 on
/// every platform CUDA runs on).
const WIDE: u64 = 1 << 63;

/// How long a wait spins on the gather's flags before it synchronises with the stream instead,
/// which also reports a kernel that failed: a gather queued behind other work takes longer.
const SPIN: Duration = Duration::from_micros(100);

/// Starts reading the offsets at `(address, width)` in `device`'s memory (4 or 8 bytes,
/// little-endian, signed): directly for host-accessible memory, else in the order of `stream`
/// (after what it waits on) into pinned memory, with one wait once the caller
/// [`OffsetsRead::wait`]s (having done other work meanwhile).
///
/// # Safety
/// Each address is an offset of its width in `device`'s memory, valid until the result is waited
/// for or dropped.
pub(crate) unsafe fn start_reading(reads: &[(u64, usize)], device: Device, stream: &Stream) -> Result<OffsetsRead> {
    if reads.is_empty() {
        return Ok(OffsetsRead::done(vec![]));
    }
    if device.is_host_accessible() {
        // SAFETY: each address is an offset of `w` bytes in host-accessible memory (caller).
        return Ok(OffsetsRead::done(
            reads
                .iter()
                .map(|&(p, w)| decode(unsafe { std::slice::from_raw_parts(p as *const u8, w) }))
                .collect(),
        ));
    }
    let kernel = match stream.device() == device {
        true => gather_kernel(device)?,
        false => None,
    };
    let issued = match kernel {
        // SAFETY: as for this function.
        Some(f) => unsafe { gather(&f, reads, device, stream) },
        // SAFETY: as above.
        None => unsafe { copy_offsets(reads, device, stream) },
    };
    if issued.is_err() {
        // Part of the work may be on its way: the block it writes goes back to the pool on return.
        let _ = stream.synchronize();
    }
    issued
}

/// Offsets read from device memory (see [`start_reading`]).
pub(crate) struct OffsetsRead {
    /// Their values, once read.
    values: Vec<i64>,
    /// The work that reads them, until it is waited for.
    pending: Option<Pending>,
}

/// Offsets on their way into `block` from byte `at`, eight bytes each, of which the first of
/// `widths` hold the value, in the order of `stream`; then the gather's `flags` (four bytes each,
/// none for a batched copy), each set once its part of the values is there.
struct Pending {
    block: DeviceBuffer,
    at: usize,
    widths: Vec<usize>,
    stream: Stream,
    flags: usize,
    /// The gather's graph, given back once the gather is done.
    graph: Option<KernelGraph>,
}

impl Pending {
    /// Waits until the values are in `block` and nothing writes it any more: for up to [`SPIN`]
    /// on the gather's flags, then (or without flags) by synchronising with the stream.
    fn finish(&mut self) -> Result<()> {
        let done = match self.flags > 0 && self.flags_set() {
            true => Ok(()),
            false => self.stream.synchronize(),
        };
        if done.is_ok()
            && let Some(graph) = self.graph.take()
        {
            give_back(graph);
        }
        done
    }

    /// Whether the flags, after the values, were all seen set within [`SPIN`].
    fn flags_set(&self) -> bool {
        let at = self.at + 8 * self.widths.len();
        let flags = (self.block.address() + at as u64) as *mut u32;
        let start = Instant::now();
        let mut seen = 0;
        while seen < self.flags {
            // SAFETY: flag `seen` is an aligned `u32` of the pinned block (host memory, `at` a
            // multiple of 8), alive as long as `self`; the device writes it, so it is read
            // atomically, and only through this pointer until the flags are all set.
            let flag = unsafe { AtomicU32::from_ptr(flags.add(seen)) };
            // Acquire: the values, which the kernel made visible before the flag, are read after.
            if flag.load(Ordering::Acquire) != 0 {
                seen += 1;
            } else if start.elapsed() > SPIN {
                return false;
            } else {
                std::hint::spin_loop();
            }
        }
        true
    }
}

impl OffsetsRead {
    fn done(values: Vec<i64>) -> Self {
        OffsetsRead { values, pending: None }
    }

    fn pending(
        block: DeviceBuffer,
        at: usize,
        widths: Vec<usize>,
        stream: &Stream,
        flags: usize,
        graph: Option<KernelGraph>,
    ) -> Self {
        let stream = stream.clone();
        OffsetsRead {
            values: vec![],
            pending: Some(Pending {
                block,
                at,
                widths,
                stream,
                flags,
                graph,
            }),
        }
    }

    /// Waits for the offsets and returns their values, in the order they were asked for.
    pub(crate) fn wait(mut self) -> Result<Vec<i64>> {
        let Some(pending) = &mut self.pending else {
            return Ok(std::mem::take(&mut self.values));
        };
        pending.finish()?;
        // Waited for: nothing to wait for when `self` drops.
        let Pending { block, at, widths, .. } = self.pending.take().expect("pending above");
        let bytes = block
            .host_slice()
            .ok_or_else(|| Error::Unsupported("pinned staging block is not host memory".into()))?;
        Ok(bytes[at..]
            .chunks_exact(8)
            .zip(widths)
            .map(|(v, w)| decode(&v[..w]))
            .collect())
    }
}

impl Drop for OffsetsRead {
    /// Unread offsets are waited for: the block they land in goes back to the pool, and the
    /// memory they are read from may be freed, once this returns.
    fn drop(&mut self) {
        if let Some(pending) = &mut self.pending {
            let _ = pending.finish();
        }
    }
}

/// A little-endian signed offset of 4 or 8 bytes.
fn decode(b: &[u8]) -> i64 {
    match b.len() {
        4 => i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as i64,
        _ => i64::from_le_bytes(b[..8].try_into().unwrap_or_default()),
    }
}

/// A block of mapped pinned memory of `len` bytes for `device`.
fn pinned(device: Device, len: usize) -> Result<DeviceBuffer> {
    PinnedPool::shared(MemoryResource::PinnedHost(device.ordinal().unwrap_or(0)))?.take(len)
}

/// The gather kernel of a CUDA device (compiled on first use, then cached by the driver layer), or
/// `None` where NVRTC is missing or fails.
fn gather_kernel(device: Device) -> Result<Option<CudaFunction>> {
    let ctx = device::context(device.ordinal().unwrap_or(0))?;
    Ok(driver::function(&ctx, KERNEL, "gather_offsets").ok())
}

/// One launch of the gather on `stream` (a stream of `device`): the addresses go in, and the values
/// and one flag per block of threads come back, through one block of mapped pinned memory.
///
/// # Safety
/// As for [`start_reading`].
unsafe fn gather(f: &CudaFunction, reads: &[(u64, usize)], device: Device, stream: &Stream) -> Result<OffsetsRead> {
    let n = reads.len();
    let blocks = n.div_ceil(BLOCK as usize);
    let cuda = stream
        .cuda()
        .ok_or_else(|| Error::Unsupported("the offsets gather needs a CUDA stream".into()))?;
    // The addresses, the values, the flags (four bytes each).
    let mut block = pinned(device, n * 16 + blocks * 4)?;
    let bytes = block
        .host_slice_mut()
        .ok_or_else(|| Error::Unsupported("pinned staging block is shared".into()))?;
    let (addresses, rest) = bytes.split_at_mut(n * 8);
    for (slot, &(p, w)) in addresses.chunks_exact_mut(8).zip(reads) {
        slot.copy_from_slice(&if w == 8 { p | WIDE } else { p }.to_le_bytes());
    }
    // The pool's blocks hold what their last use left.
    rest[n * 8..].fill(0);
    let addresses = block.device_pointer()?;
    let values = addresses + 8 * n as u64;
    let flags = values + 8 * n as u64;
    // `gather_offsets` reads the `n` addresses and writes the `n` values and `blocks` flags of
    // `block` (mapped, kept until the read is waited for), and reads each offset, valid per the
    // caller, a byte at a time.
    let mut graph = take_graph(device, f)?;
    // SAFETY: as above; `gather_offsets` takes these four 8-byte parameters.
    unsafe { graph.launch(cuda, blocks as u64, &[addresses, values, n as u64, flags]) }?;
    // The kernel writes each value sign-extended to eight bytes.
    Ok(OffsetsRead::pending(
        block,
        8 * n,
        vec![8; n],
        stream,
        blocks,
        Some(graph),
    ))
}

/// The gather's graphs that no read holds, with their device ordinals. A read takes one (the first
/// reads on a device make theirs: `cuLaunchKernel` costs about twice what setting and launching a
/// graph does) and gives it back once the gather is done, so that the launches of one graph, which
/// run one after another, never wait for another read's stream.
static GRAPHS: Mutex<Vec<KernelGraph>> = Mutex::new(Vec::new());

/// A graph of the gather kernel `f` of `device`.
fn take_graph(device: Device, f: &CudaFunction) -> Result<KernelGraph> {
    let ordinal = device.ordinal().unwrap_or(0);
    let mut free = GRAPHS.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(at) = free.iter().position(|g| g.ordinal() == ordinal) {
        return Ok(free.swap_remove(at));
    }
    drop(free);
    KernelGraph::new(&device::context(ordinal)?, f, BLOCK, 4)
}

fn give_back(graph: KernelGraph) {
    GRAPHS.lock().unwrap_or_else(|p| p.into_inner()).push(graph);
}

/// The offsets read into pinned memory with one batched copy (one copy each where the driver has
/// no batched copies).
///
/// # Safety
/// As for [`start_reading`].
unsafe fn copy_offsets(reads: &[(u64, usize)], device: Device, stream: &Stream) -> Result<OffsetsRead> {
    let out = pinned(device, reads.len() * 8)?;
    if driver::memcpy_batch_available() {
        let dsts: Vec<u64> = (0..reads.len()).map(|i| out.address() + (i * 8) as u64).collect();
        let srcs: Vec<u64> = reads.iter().map(|&(p, _)| p).collect();
        let sizes: Vec<usize> = reads.iter().map(|&(_, w)| w).collect();
        let raw = stream.bind()?;
        // SAFETY: the batch call exists (checked); the slices have one non-zero length; each
        // source is an offsets element on the device (valid per the caller) and each destination
        // a slot of `out`, kept until the read is waited for; `raw` is a created stream.
        unsafe { driver::memcpy_batch_async(&dsts, &srcs, &sizes, raw)? };
    } else {
        for (i, &(p, w)) in reads.iter().enumerate() {
            // SAFETY: the source is an offsets element on the device (valid per the caller) and
            // the destination a slot of `out`, kept until the read is waited for.
            unsafe { copy(out.address() + (i * 8) as u64, out.device(), p, device, w, stream)? };
        }
    }
    Ok(OffsetsRead::pending(
        out,
        0,
        reads.iter().map(|&(_, w)| w).collect(),
        stream,
        0,
        None,
    ))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow_array::builder::{GenericListBuilder, LargeBinaryBuilder, MapBuilder, StringBuilder};
    use arrow_array::types::Int32Type;
    use arrow_array::*;
    use arrow_schema::{DataType, Field};

    use super::*;
    use crate::array::DeviceArrayData;
    use crate::transfer::htod_array;

    use crate::device::cuda_for_tests as cuda;

    /// The last offset of every string, binary, list and map array of `data`'s tree whose offsets
    /// buffer holds one.
    fn last_offsets(data: &DeviceArrayData, reads: &mut Vec<(u64, usize)>) {
        let width = match data.data_type {
            DataType::Utf8 | DataType::Binary | DataType::List(_) | DataType::Map(..) => 4,
            DataType::LargeUtf8 | DataType::LargeBinary | DataType::LargeList(_) => 8,
            _ => 0,
        };
        if let Some(offsets) = data.buffers.first().filter(|_| width > 0) {
            let at = (data.offset + data.len) * width;
            if at + width <= offsets.len() {
                reads.push((offsets.address() + at as u64, width));
            }
        }
        for c in &data.children {
            last_offsets(c, reads);
        }
    }

    /// A GPU, a stream of it and its gather kernel, where there is one.
    fn gpu() -> Option<(Device, Stream, CudaFunction)> {
        let device = cuda()?;
        let kernel = gather_kernel(device).unwrap().expect("NVRTC compiles the gather");
        Some((device, Stream::new(device).unwrap(), kernel))
    }

    fn text(i: usize) -> Option<String> {
        (i % 7 != 3).then(|| "é".repeat(i % 11))
    }

    /// Strings, binaries, lists, large lists, maps and their nestings.
    fn arrays(rows: usize) -> Vec<ArrayRef> {
        let strings = StringArray::from_iter((0..rows).map(text));
        let mut large_list = GenericListBuilder::<i64, _>::new(StringBuilder::new());
        let mut map = MapBuilder::new(None, StringBuilder::new(), LargeBinaryBuilder::new());
        for i in 0..rows {
            for j in 0..i % 4 {
                large_list.values().append_option(text(i + j));
                map.keys().append_value(format!("k{j}"));
                map.values().append_option(text(i * j).map(String::into_bytes));
            }
            large_list.append(i % 5 != 1);
            map.append(i % 6 != 2).unwrap();
        }
        let list = ListArray::from_iter_primitive::<Int32Type, _, _>(
            (0..rows).map(|i| (i % 3 != 0).then(|| (0..i as i32 % 9).map(Some).collect::<Vec<_>>())),
        );
        let list_of_strings: ArrayRef = Arc::new(ListArray::new(
            Arc::new(Field::new_list_field(DataType::Utf8, true)),
            arrow_buffer::OffsetBuffer::from_lengths((0..rows).map(|i| i % 2)),
            Arc::new(StringArray::from_iter((0..rows).map(|i| text(i + 1))).slice(0, rows / 2)),
            None,
        ));
        vec![
            Arc::new(strings.clone()),
            Arc::new(LargeStringArray::from_iter((0..rows).map(text))),
            Arc::new(BinaryArray::from_iter(
                (0..rows).map(|i| text(i).map(String::into_bytes)),
            )),
            Arc::new(LargeBinaryArray::from_iter(
                (0..rows).map(|i| text(i).map(String::into_bytes)),
            )),
            Arc::new(list),
            Arc::new(large_list.finish()),
            Arc::new(map.finish()),
            Arc::new(StructArray::from(vec![
                (
                    Arc::new(Field::new("s", DataType::Utf8, true)),
                    Arc::new(strings) as ArrayRef,
                ),
                (
                    Arc::new(Field::new("l", list_of_strings.data_type().clone(), true)),
                    list_of_strings,
                ),
            ])),
        ]
    }

    /// The gather reads what the batched copy reads: the last offsets of every array of every
    /// variable-width type, whole, sliced on the device (offsets at every position) and empty.
    #[test]
    fn the_gather_reads_what_the_batched_copy_reads() {
        let Some((device, stream, kernel)) = gpu() else {
            return;
        };
        let (mut reads, mut arrays_on_device) = (vec![], vec![]);
        for rows in [0, 1, 200] {
            for array in arrays(rows) {
                let on_device = htod_array(array.as_ref(), device, &stream).unwrap();
                last_offsets(&on_device, &mut reads);
                // Windows of up to 13 rows at every 7th row and at the end (empty), and a wide one.
                let cuts = (0..=rows).step_by(7).chain([rows]).map(|o| (o, (rows - o).min(13)));
                for (offset, len) in cuts.chain([(rows / 3, rows / 2)]) {
                    last_offsets(&on_device.slice(offset, len).unwrap(), &mut reads);
                }
                // The reads point into it: it lives to the end.
                arrays_on_device.push(on_device);
            }
        }
        assert!(reads.len() > BLOCK as usize, "{} reads fit in one block", reads.len());
        assert!(reads.iter().any(|r| r.1 == 4) && reads.iter().any(|r| r.1 == 8));
        // SAFETY: each read is an element of an offsets buffer of `arrays_on_device`.
        let (gathered, copied, dispatched) = unsafe {
            (
                gather(&kernel, &reads, device, &stream).unwrap().wait().unwrap(),
                copy_offsets(&reads, device, &stream).unwrap().wait().unwrap(),
                start_reading(&reads, device, &stream).unwrap().wait().unwrap(),
            )
        };
        assert_eq!(gathered, copied);
        assert_eq!(dispatched, copied);
        // SAFETY: nothing to read.
        let nothing = unsafe { start_reading(&[], device, &stream) };
        assert!(nothing.unwrap().wait().unwrap().is_empty());
    }

    /// A gather queued behind work that outlasts the wait's spinning on its flags (milliseconds
    /// of copies on the same stream) is waited for through the stream, and reads what the host
    /// wrote.
    #[test]
    fn a_gather_behind_other_work_is_waited_for() {
        let Some((device, stream, kernel)) = gpu() else {
            return;
        };
        let expected: Vec<i64> = (0..600).map(|i| i * 1_000_003 - 7).collect();
        let on_device = htod_array(&Int64Array::from(expected.clone()), device, &stream).unwrap();
        let base = on_device.buffers[0].address();
        let reads: Vec<(u64, usize)> = (0..expected.len()).map(|i| (base + 8 * i as u64, 8)).collect();
        let resource = MemoryResource::default_for(device);
        let (from, to) = (
            DeviceBuffer::alloc(resource, 256 << 20, &stream).unwrap(),
            DeviceBuffer::alloc(resource, 256 << 20, &stream).unwrap(),
        );
        for _ in 0..16 {
            // SAFETY: both are 256 MiB of `device`'s memory, alive until the stream is waited for.
            unsafe { copy(to.address(), device, from.address(), device, from.len(), &stream) }.unwrap();
        }
        let copies = stream.record().unwrap();
        // SAFETY: every read lies in `on_device`'s values, which live to the end.
        let read = unsafe { gather(&kernel, &reads, device, &stream) }.unwrap();
        // compute-sanitizer runs the work on a stream one piece at a time: nothing is queued
        // behind anything there.
        if !crate::device::under_sanitizer() {
            assert!(
                !copies.is_complete().unwrap(),
                "4 GiB of copies were still on their way"
            );
        }
        assert_eq!(read.wait().unwrap(), expected);
        assert!(copies.is_complete().unwrap());
    }

    /// Offsets of both widths at every byte position, negative ones included, read as their bytes
    /// on the host say.
    #[test]
    fn the_gather_reads_unaligned_and_negative_offsets() {
        let Some((device, stream, kernel)) = gpu() else {
            return;
        };
        let bytes: Vec<u8> = (0..400u32).map(|i| (i * 97 % 256) as u8).collect();
        let on_device = htod_array(&UInt8Array::from(bytes.clone()), device, &stream).unwrap();
        let base = on_device.buffers[0].address();
        let (mut reads, mut expected) = (vec![], vec![]);
        for at in 0..bytes.len() - 8 {
            for width in [4, 8] {
                reads.push((base + at as u64, width));
                expected.push(decode(&bytes[at..at + width]));
            }
        }
        assert!(expected.iter().any(|v| *v < 0));
        // SAFETY: every read lies in `on_device`'s values, which live to the end.
        let gathered = unsafe { gather(&kernel, &reads, device, &stream) }
            .unwrap()
            .wait()
            .unwrap();
        assert_eq!(gathered, expected);
    }
}
