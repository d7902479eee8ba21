#![allow(missing_docs)] // criterion_group! generates undocumented functions

//! The cost of exporting a 100-column device batch through the C Device Data Interface and
//! importing it back (zero-copy both ways), on the GPU when there is one, else on the CPU device:
//! the export alone (its release not timed), and export, import and release together. After each
//! measurement it prints the steps of the calls (see `arrow_cuda::trace`), each with its mean time
//! per call; `release` is the drop of the imported batch, which releases the exported structs.
//!
//! On the GPU, beside them, the naive way to the sizes an import needs from device memory: the end
//! offset of each string column of the exported batch read with its own synchronous copy
//! (`cuMemcpyDtoH`), where the import reads them all with one gather kernel.
//!
//! `cargo bench --bench ffi`.

mod common;

use std::time::{Duration, Instant};

use arrow_cuda::ffi::{export_batch, import_batch};
use arrow_cuda::{Device, Stream, transfer};
use arrow_cuda_workloads::small_batch;
use arrow_data::ffi::FFI_ArrowArray;
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
    if device != Device::Cpu {
        let (array, _schema) = export_batch(&batch, &stream).unwrap();
        let ends = string_ends(&array.array);
        let context = cudarc::driver::CudaContext::new(0).unwrap();
        context.bind_to_thread().unwrap();
        group.bench_function(format!("end_offsets_one_copy_each/{device}"), |b| {
            b.iter(|| {
                ends.iter()
                    .map(|&at| {
                        let mut end = [0i32];
                        // SAFETY: `at` is the last offset of a string column of the exported
                        // batch, alive until `array` is released (after the bench); the context
                        // is bound to this thread.
                        unsafe { cudarc::driver::result::memcpy_dtoh_sync(&mut end, at) }.unwrap();
                        end[0] as i64
                    })
                    .sum::<i64>()
            })
        });
    }
    group.finish();
}

/// The device address of the last offset of each string column of an exported batch.
fn string_ends(array: &FFI_ArrowArray) -> Vec<u64> {
    (0..array.num_children())
        .map(|i| array.child(i))
        .filter(|c| c.num_buffers() == 3)
        .map(|c| c.buffer(1) as u64 + ((c.offset() + c.len()) * 4) as u64)
        .collect()
}

criterion_group!(benches, ffi);
criterion_main!(benches);
