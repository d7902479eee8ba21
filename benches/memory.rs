//! Host <-> device copies of one 1 GiB buffer, from pinned and from pageable memory, through
//! `DeviceBuffer` beside the same copies through cudarc directly.
//!
//! `cargo bench --bench memory`; on a machine without a CUDA device it prints
//! `skipped: no CUDA device` and returns.

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use arrow_cuda::memory::pinned::PinnedPool;
use arrow_cuda::{Device, DeviceBuffer, MemoryResource, Stream};
use criterion::{BenchmarkGroup, Criterion, SamplingMode, Throughput, measurement::WallTime};
use cudarc::driver::{CudaSlice, CudaStream, PinnedHostSlice};

const LEN: usize = 1 << 30;

fn group<'a>(c: &'a mut Criterion, name: &str) -> BenchmarkGroup<'a, WallTime> {
    let mut g = c.benchmark_group(name);
    g.throughput(Throughput::Bytes(LEN as u64));
    // Pageable device-to-host copies take most of a second each: flat sampling keeps the run short.
    g.sampling_mode(SamplingMode::Flat);
    g.sample_size(10);
    g.warm_up_time(Duration::from_millis(500));
    g.measurement_time(Duration::from_secs(2));
    g
}

/// Pinned memory from the shared pool, filled with a pattern.
fn pinned(resource: MemoryResource, stream: &Stream) -> DeviceBuffer {
    let pool = PinnedPool::shared(resource).expect("pinned pool");
    let mut b = pool.take(LEN).expect("pinned buffer");
    b.fill(0x5a, stream).expect("fill");
    b
}

fn through_device_buffer(c: &mut Criterion, ordinal: usize) {
    let stream = Stream::new(Device::Cuda(ordinal)).expect("stream");
    let mut device = DeviceBuffer::zeroed(MemoryResource::DevicePool(ordinal), LEN, &stream).expect("device buffer");
    let mut pinned_src = pinned(MemoryResource::PinnedHost(ordinal), &stream);
    let wc_src = pinned(MemoryResource::WriteCombinedHost(ordinal), &stream);
    let mut pageable = vec![0x5au8; LEN];

    let mut g = group(c, "htod_1GiB");
    g.bench_function("DeviceBuffer/pinned", |b| {
        b.iter(|| device.copy_from(0, &pinned_src, &stream).expect("copy"))
    });
    g.bench_function("DeviceBuffer/write_combined", |b| {
        b.iter(|| device.copy_from(0, &wc_src, &stream).expect("copy"))
    });
    g.bench_function("DeviceBuffer/pageable", |b| {
        b.iter(|| device.copy_from_host(0, &pageable, &stream).expect("copy"))
    });
    g.finish();

    let mut g = group(c, "dtoh_1GiB");
    g.bench_function("DeviceBuffer/pinned", |b| {
        b.iter(|| pinned_src.copy_from(0, &device, &stream).expect("copy"))
    });
    g.bench_function("DeviceBuffer/pageable", |b| {
        b.iter(|| device.copy_to_host(0, black_box(&mut pageable), &stream).expect("copy"))
    });
    g.finish();
}

fn through_cudarc(c: &mut Criterion, ordinal: usize) {
    let ctx = arrow_cuda::device::context(ordinal).expect("context");
    let stream: Arc<CudaStream> = ctx.new_stream().expect("stream");
    let mut device: CudaSlice<u8> = stream.alloc_zeros(LEN).expect("device slice");
    // SAFETY: the memory is written (filled) before it is read.
    let mut wc: PinnedHostSlice<u8> = unsafe { ctx.alloc_pinned(LEN) }.expect("write-combined pinned");
    // SAFETY: as above; flags 0 is plain page-locked memory, the right target of downloads.
    let mut plain: PinnedHostSlice<u8> = unsafe { ctx.alloc_pinned_with_flags(LEN, 0) }.expect("pinned");
    wc.as_mut_slice().expect("wc slice").fill(0x5a);
    plain.as_mut_slice().expect("pinned slice").fill(0x5a);
    let mut pageable = vec![0x5au8; LEN];

    let mut g = group(c, "htod_1GiB");
    g.bench_function("cudarc/write_combined", |b| {
        b.iter(|| {
            stream.memcpy_htod(&wc, &mut device).expect("copy");
            stream.synchronize().expect("sync");
        })
    });
    g.bench_function("cudarc/pageable", |b| {
        b.iter(|| {
            stream.memcpy_htod(&pageable, &mut device).expect("copy");
            stream.synchronize().expect("sync");
        })
    });
    g.finish();

    let mut g = group(c, "dtoh_1GiB");
    g.bench_function("cudarc/pinned", |b| {
        b.iter(|| {
            stream.memcpy_dtoh(&device, &mut plain).expect("copy");
            stream.synchronize().expect("sync");
        })
    });
    g.bench_function("cudarc/pageable", |b| {
        b.iter(|| {
            stream.memcpy_dtoh(&device, black_box(&mut pageable)).expect("copy");
            stream.synchronize().expect("sync");
        })
    });
    g.finish();
}

fn main() {
    if let Err(e) = arrow_cuda::device::cuda_device_count() {
        println!("skipped: no CUDA device ({e})");
        return;
    }
    let mut c = Criterion::default().configure_from_args();
    through_device_buffer(&mut c, 0);
    through_cudarc(&mut c, 0);
    c.final_summary();
}
