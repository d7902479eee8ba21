#![allow(missing_docs)] // criterion_group! generates undocumented functions

//! The cost of exporting a 100-column device batch through the C Device Data Interface and
//! importing it back (zero-copy both ways), on the GPU when there is one, else on the CPU device:
//! the export alone (its release not timed), and export, import and release together.
//!
//! `cargo bench --bench ffi`.

use std::time::Duration;

use arrow_cuda::ffi::{export_batch, import_batch};
use arrow_cuda::{Device, Stream, transfer};
use arrow_cuda_workloads::small_batch;
use criterion::{Criterion, criterion_group, criterion_main};

fn ffi(c: &mut Criterion) {
    let device = if arrow_cuda::device::cuda_available() {
        Device::Cuda(0)
    } else {
        Device::Cpu
    };
    let stream = Stream::new(device).unwrap();
    let batch = transfer::htod(&small_batch(), device, &stream).unwrap();
    let mut group = c.benchmark_group("c_device_100_columns");
    group.measurement_time(Duration::from_secs(3));
    group.bench_function(format!("export+import+release/{device}"), |b| {
        b.iter(|| {
            let (array, schema) = export_batch(&batch, &stream).unwrap();
            // SAFETY: the struct comes from our own exporter.
            drop(unsafe { import_batch(array, &schema, &stream) }.unwrap())
        })
    });
    group.bench_function(format!("export/{device}"), |b| {
        b.iter_with_large_drop(|| export_batch(&batch, &stream).unwrap())
    });
    group.finish();
}

criterion_group!(benches, ffi);
criterion_main!(benches);
