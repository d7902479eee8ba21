//! Copies a record batch to the GPU and back, and checks it came back bit for bit.
//!
//! `cargo run --release --example 01_round_trip`. Without a GPU it runs on the CPU device.

use std::sync::Arc;
use std::time::Instant;

use arrow_array::{ArrayRef, Float64Array, Int64Array, RecordBatch, StringArray};
use arrow_cuda::{Device, Stream, transfer};

fn main() -> arrow_cuda::Result<()> {
    let device = match arrow_cuda::device::cuda_device_count() {
        Ok(_) => Device::Cuda(0),
        Err(e) => {
            println!("no GPU ({e}); using the CPU device");
            Device::Cpu
        }
    };
    let rows = 1_000_000;
    let batch = RecordBatch::try_from_iter([
        ("id", Arc::new(Int64Array::from_iter_values(0..rows)) as ArrayRef),
        (
            "score",
            Arc::new(Float64Array::from_iter(
                (0..rows).map(|i| (i % 10 != 0).then_some(i as f64 / 7.0)),
            )) as ArrayRef,
        ),
        (
            "name",
            Arc::new(StringArray::from_iter_values((0..rows).map(|i| format!("name-{i}")))) as ArrayRef,
        ),
    ])?;
    let stream = Stream::new(device)?;

    let t = Instant::now();
    let on_device = transfer::htod(&batch, device, &stream)?;
    println!(
        "to {device}: {} rows, {:.1} MB in {:.2?}",
        on_device.num_rows(),
        on_device.size_in_bytes() as f64 / 1e6,
        t.elapsed()
    );

    // A slice copies only the rows it views.
    let slice = transfer::htod(&batch.slice(500_000, 10), device, &stream)?;
    println!("a 10-row slice takes {} bytes on {device}", slice.size_in_bytes());

    let t = Instant::now();
    let back = transfer::dtoh(&on_device, &stream)?;
    println!(
        "back to the host in {:.2?}; equal to the original: {}",
        t.elapsed(),
        back == batch
    );
    assert_eq!(back, batch);
    Ok(())
}
