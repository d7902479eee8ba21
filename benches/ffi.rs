#![allow(missing_docs)] // criterion_group! generates undocumented functions

//! The cost of exporting a 100-column device batch through the C Device Data Interface and
//! importing it back (zero-copy both ways), on the GPU when there is one, else on the CPU device:
//! the export alone (its release not timed), and export, import and release together. After each
//! measurement it prints the steps of the calls (see `arrow_cuda::trace`), each with its mean time
//! per call; `release` is the drop of the imported batch, which releases the exported structs.
//!
//! `cargo bench --bench ffi`.

mod common;

use std::time::{Duration, Instant};

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
    let mut ran = false;
    group.bench_function(format!("export+import+release/{device}"), |b| {
        ran = true;
        b.iter(|| {
            let (array, schema) = export_batch(&batch, &stream).unwrap();
            // SAFETY: the struct comes from our own exporter.
            drop(unsafe { import_batch(array, &schema, &stream) }.unwrap())
        })
    });
    if ran {
        let label = format!("export+import+release on {device}");
        common::print_steps(&label, &["export.", "import.", "release"], |t| {
            let imported = t.record(|| {
                let (array, schema) = export_batch(&batch, &stream).unwrap();
                // SAFETY: as above.
                unsafe { import_batch(array, &schema, &stream) }.unwrap()
            });
            let start = Instant::now();
            drop(imported);
            t.add("release", start.elapsed());
        });
    }
    let mut ran = false;
    group.bench_function(format!("export/{device}"), |b| {
        ran = true;
        b.iter_with_large_drop(|| export_batch(&batch, &stream).unwrap())
    });
    if ran {
        common::print_steps(
            &format!("export (and release) on {device}"),
            &["export.", "release"],
            |t| {
                let exported = t.record(|| export_batch(&batch, &stream).unwrap());
                let start = Instant::now();
                drop(exported);
                t.add("release", start.elapsed());
            },
        );
    }
    group.finish();
}

criterion_group!(benches, ffi);
criterion_main!(benches);
