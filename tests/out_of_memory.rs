//! Device memory that runs out while this process keeps memory for reuse: the allocation gets that
//! memory back and succeeds (the memory pool's from the driver, idle regions of shared device
//! memory from this crate). One test in a binary of its own: it takes nearly all of the GPU's
//! memory, which tests running beside it would miss.

mod common;

use std::sync::Arc;

use arrow_cuda::ipc::{Sender, SenderOptions, private_socket_path};
use arrow_cuda::{Device, DeviceBuffer, Error, MemoryResource, Stream};
use arrow_schema::Schema;

const MIB: usize = 1 << 20;
/// What the process keeps for reuse in each case.
const KEPT: usize = 1024 * MIB;

fn free_memory() -> usize {
    arrow_cuda::device::cuda_devices().expect("devices")[0].free_memory
}

/// Takes device memory (not of a pool) until at most `left` bytes are free, and returns it.
fn fill(ordinal: usize, left: usize, stream: &Stream) -> Vec<DeviceBuffer> {
    let mut taken = Vec::new();
    let mut chunk = 16 << 30;
    while chunk >= 2 * MIB {
        let free = free_memory();
        if free <= left {
            break;
        }
        match DeviceBuffer::alloc(MemoryResource::Device(ordinal), chunk.min(free - left), stream) {
            Ok(b) => taken.push(b),
            Err(Error::OutOfMemory { .. }) => chunk /= 2,
            Err(e) => panic!("filling the device: {e}"),
        }
    }
    assert!(free_memory() <= left, "filled to {} bytes free", free_memory());
    taken
}

/// With `kept` holding memory the process keeps for reuse (and nothing else free), an allocation
/// of `resource` larger than what is free succeeds.
fn case(what: &str, ordinal: usize, resource: MemoryResource, keep: impl FnOnce(&Stream), stream: &Stream) {
    keep(stream);
    let want = KEPT / 2 + 256 * MIB;
    let filler = fill(ordinal, KEPT / 4, stream);
    let free = free_memory();
    assert!(
        free < want,
        "{what}: {free} bytes still free, the allocation would fit anyway"
    );
    let got = DeviceBuffer::alloc(resource, want, stream);
    assert!(
        got.is_ok(),
        "{what}: {} bytes of {resource:?} with {free} free and {KEPT} kept for reuse: {:?}",
        want,
        got.err()
    );
    drop((got, filler));
    stream.synchronize().expect("synchronize");
}

#[test]
fn allocations_that_run_out_get_back_what_the_process_keeps_for_reuse() {
    let Some(device @ Device::Cuda(o)) = common::cuda() else {
        return;
    };
    if common::under_sanitizer() {
        eprintln!("skipped under compute-sanitizer: the failed allocations are deliberate");
        return;
    }
    let stream = Stream::new(device).expect("stream");
    let shared = MemoryResource::shared_for(device) == MemoryResource::SharedDevice(o);

    // Pool memory freed into the device's default pool, which keeps it (its release threshold is
    // raised): the driver gives it back to other allocations that need it.
    let pool_memory_kept = |s: &Stream| {
        let pool = DeviceBuffer::alloc(MemoryResource::DevicePool(o), KEPT, s).expect("pool memory");
        drop(pool);
        s.synchronize().expect("synchronize");
    };
    case(
        "pool memory kept",
        o,
        MemoryResource::Device(o),
        pool_memory_kept,
        &stream,
    );
    if !shared {
        eprintln!("skipped: no shared device memory on this GPU");
        return;
    }
    case(
        "pool memory kept",
        o,
        MemoryResource::SharedDevice(o),
        pool_memory_kept,
        &stream,
    );

    // A region of shared device memory kept idle while a sender lives: it serves only its own size.
    let path = private_socket_path(&format!("out-of-memory-{}", std::process::id())).expect("path");
    let sender = Sender::bind(&path, Arc::new(Schema::empty()), SenderOptions::default()).expect("sender");
    case(
        "an idle region kept",
        o,
        MemoryResource::SharedDevice(o),
        |s| drop(DeviceBuffer::alloc(MemoryResource::SharedDevice(o), KEPT, s).expect("shared device memory")),
        &stream,
    );
    drop(sender);
}
