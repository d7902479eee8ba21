#![allow(missing_docs)] // criterion_group! generates undocumented functions
//! Record batches to the GPU and back, beside the naive path (one cudarc copy per buffer).
//!
//! `cargo bench --bench transfer`. After each measurement it prints the steps of the call (see
//! `arrow_cuda::trace`), each with its mean time per call. Without a GPU it measures the small
//! batches on the CPU device (the same planning, packing and array building, with `memcpy` for
//! the copies), without the per-buffer comparison.

mod common;

use std::sync::Arc;
use std::time::Duration;

use arrow_array::{ArrayRef, Int64Array, RecordBatch};
use arrow_buffer::ScalarBuffer;
use arrow_cuda::memory::pinned::PinnedPool;
use arrow_cuda::transfer::{dtoh, htod};
use arrow_cuda::{Device, MemoryResource, Stream};
use arrow_cuda_workloads::{buffers, int64_batch, small_batch, tpch};
use criterion::measurement::WallTime;
use criterion::{BenchmarkGroup, BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use cudarc::driver::{CudaSlice, CudaStream};

const GIB_ROWS: usize = (1 << 30) / 16 / 8;

/// 16 Int64 columns, 1 GiB in all, in ordinary (pageable) memory.
fn gib_batch() -> RecordBatch {
    int64_batch(16, GIB_ROWS)
}

/// The same batch with every buffer in pinned memory.
fn pinned_gib_batch(ordinal: usize) -> RecordBatch {
    let pool = PinnedPool::shared(MemoryResource::PinnedHost(ordinal)).unwrap();
    let columns = (0..16).map(|c| {
        let mut block = pool.take(GIB_ROWS * 8).unwrap();
        let out = block.host_slice_mut().unwrap();
        for (i, v) in out.chunks_exact_mut(8).enumerate() {
            v.copy_from_slice(&((i as i64) * 16 + c).to_le_bytes());
        }
        let values = ScalarBuffer::<i64>::new(block.to_arrow_buffer().unwrap(), 0, GIB_ROWS);
        (format!("c{c}"), Arc::new(Int64Array::new(values, None)) as ArrayRef)
    });
    RecordBatch::try_from_iter(columns).unwrap()
}

/// TPC-H lineitem, 1M rows (strings, decimals, dates): the first batch of SF 0.2 (1.2M rows).
fn lineitem() -> RecordBatch {
    let table = tpch::table("lineitem", 0.2, 1, 1_000_000).unwrap();
    table.partitions[0][0].clone()
}

/// The first 100 rows of the small batch: slices of its buffers, 130 KB of the 1.3 MB, below the
/// size that uploads pack on pool threads.
fn small_100x100() -> RecordBatch {
    small_batch().slice(0, 100)
}

fn bytes(batch: &RecordBatch) -> u64 {
    buffers(batch).iter().map(|b| b.len() as u64).sum()
}

/// The naive upload: one cudarc copy per arrow buffer into preallocated device memory.
fn naive_htod(stream: &Arc<CudaStream>, src: &[arrow_buffer::Buffer], dst: &mut [CudaSlice<u8>]) {
    for (s, d) in src.iter().zip(dst.iter_mut()) {
        stream.memcpy_htod(s.as_slice(), d).unwrap();
    }
    stream.synchronize().unwrap();
}

/// The naive download: one cudarc copy per buffer into a new host vector.
fn naive_dtoh(stream: &Arc<CudaStream>, src: &[CudaSlice<u8>]) -> Vec<Vec<u8>> {
    let out = src.iter().map(|s| stream.clone_dtoh(s).unwrap()).collect();
    stream.synchronize().unwrap();
    out
}

/// `htod` and `dtoh` of `batch` on `device`, each followed by the steps of the call (when the
/// filter let criterion run it).
fn arrow_cuda(
    group: &mut BenchmarkGroup<'_, WallTime>,
    name: &str,
    batch: &RecordBatch,
    device: Device,
    stream: &Stream,
) {
    let mut ran = false;
    group.bench_function(BenchmarkId::new("htod", "arrow-cuda"), |b| {
        ran = true;
        b.iter(|| htod(batch, device, stream).unwrap())
    });
    if ran {
        common::print_steps(&format!("{name}/htod on {device}"), &["htod."], |t| {
            t.record(|| htod(batch, device, stream).unwrap());
        });
    }
    let on_device = htod(batch, device, stream).unwrap();
    assert_eq!(&dtoh(&on_device, stream).unwrap(), batch);
    let mut ran = false;
    group.bench_function(BenchmarkId::new("dtoh", "arrow-cuda"), |b| {
        ran = true;
        b.iter(|| dtoh(&on_device, stream).unwrap())
    });
    if ran {
        common::print_steps(&format!("{name}/dtoh on {device}"), &["dtoh."], |t| {
            t.record(|| dtoh(&on_device, stream).unwrap());
        });
    }
}

fn small_cases() -> Vec<(&'static str, RecordBatch)> {
    vec![("small_100x1000", small_batch()), ("small_100x100", small_100x100())]
}

fn group<'c>(c: &'c mut Criterion, name: &str, batch: &RecordBatch) -> BenchmarkGroup<'c, WallTime> {
    let mut group = c.benchmark_group(name);
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3));
    group.throughput(Throughput::Bytes(bytes(batch)));
    group
}

fn transfer(c: &mut Criterion) {
    if arrow_cuda::device::cuda_device_count().is_err() {
        eprintln!("no CUDA device: the small batches on the CPU device, without the per-buffer comparison");
        let stream = Stream::new(Device::Cpu).unwrap();
        for (name, batch) in &small_cases() {
            arrow_cuda(&mut group(c, name, batch), name, batch, Device::Cpu, &stream);
        }
        return;
    }
    let device = Device::Cuda(0);
    let stream = Stream::new(device).unwrap();
    let cuda = stream.cuda().unwrap().clone();
    let mut cases: Vec<(&str, RecordBatch)> = vec![
        ("gib_16xint64_pageable", gib_batch()),
        ("gib_16xint64_pinned", pinned_gib_batch(0)),
    ];
    cases.extend(small_cases());
    cases.push(("tpch_lineitem_1m", lineitem()));
    for (name, batch) in &cases {
        let mut group = group(c, name, batch);
        let host_buffers = buffers(batch);
        let mut device_buffers: Vec<CudaSlice<u8>> =
            // SAFETY: the device memory is written by the first upload before anything reads it.
            host_buffers.iter().map(|b| unsafe { cuda.alloc::<u8>(b.len().max(1)) }.unwrap()).collect();
        arrow_cuda(&mut group, name, batch, device, &stream);
        group.bench_function(BenchmarkId::new("htod", "naive-cudarc-per-buffer"), |b| {
            b.iter(|| naive_htod(&cuda, &host_buffers, &mut device_buffers))
        });
        group.bench_function(BenchmarkId::new("dtoh", "naive-cudarc-per-buffer"), |b| {
            b.iter(|| naive_dtoh(&cuda, &device_buffers))
        });
        group.finish();
    }
}

criterion_group!(benches, transfer);
criterion_main!(benches);
