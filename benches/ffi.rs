#![allow(missing_docs)] // criterion_group! generates undocumented functions

//! The cost of exporting a 100-column device batch through the C Device Data Interface and
//! importing it back (zero-copy both ways), on the GPU when there is one, else on the CPU device.
//!
//! `cargo bench --bench ffi`.

use std::sync::Arc;
use std::time::Duration;

use arrow_array::{ArrayRef, Float64Array, Int64Array, RecordBatch, StringArray};
use arrow_cuda::ffi::{export_batch, import_batch};
use arrow_cuda::{Device, Stream, transfer};
use criterion::{Criterion, criterion_group, criterion_main};

fn hundred_columns() -> RecordBatch {
    let columns = (0..100).map(|c| {
        let array: ArrayRef = match c % 3 {
            0 => Arc::new(Int64Array::from_iter((0..1000).map(|i| (i % 7 != 0).then_some(i * c)))),
            1 => Arc::new(Float64Array::from_iter(
                (0..1000).map(|i| (i % 5 != 0).then_some(i as f64)),
            )),
            _ => Arc::new(StringArray::from_iter(
                (0..1000).map(|i| (i % 11 != 0).then(|| format!("row {i}"))),
            )),
        };
        (format!("c{c}"), array)
    });
    RecordBatch::try_from_iter(columns).unwrap()
}

fn ffi(c: &mut Criterion) {
    let device = if arrow_cuda::device::cuda_available() {
        Device::Cuda(0)
    } else {
        Device::Cpu
    };
    let stream = Stream::new(device).unwrap();
    let batch = transfer::htod(&hundred_columns(), device, &stream).unwrap();
    let mut group = c.benchmark_group("c_device_100_columns");
    group.measurement_time(Duration::from_secs(3));
    group.bench_function(format!("export+import/{device}"), |b| {
        b.iter(|| {
            let (array, schema) = export_batch(&batch, &stream).unwrap();
            // SAFETY: the struct comes from our own exporter.
            unsafe { import_batch(array, &schema, &stream) }.unwrap()
        })
    });
    group.bench_function(format!("export/{device}"), |b| {
        b.iter(|| export_batch(&batch, &stream).unwrap())
    });
    group.finish();
}

criterion_group!(benches, ffi);
criterion_main!(benches);
