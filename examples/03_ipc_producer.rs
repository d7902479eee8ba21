//! Puts record batches on the GPU and lends them to consumers in other processes, without a copy.
//!
//! Start it, then `04_ipc_consumer` in another terminal (any number of them):
//!
//! ```sh
//! cargo run --example 03_ipc_producer
//! cargo run --example 04_ipc_consumer
//! ```
//!
//! Both meet at `ipc::private_socket_path("arrow-cuda.sock")`, in a directory only this user can
//! enter, unless given another socket path as their argument.
//!
//! Without a GPU it runs on the CPU device, where shared memory stands in for CUDA IPC.

use std::sync::Arc;
use std::time::Duration;

use arrow_array::{ArrayRef, Float64Array, Int64Array, RecordBatch, StringArray};
use arrow_cuda::ipc::{Sender, SenderOptions, private_socket_path};
use arrow_cuda::transfer::htod_async;
use arrow_cuda::{Device, MemoryResource, Stream};

const BATCHES: i64 = 10;
const ROWS: i64 = 1_000_000;

fn batch(n: i64) -> RecordBatch {
    let ids: ArrayRef = Arc::new(Int64Array::from_iter_values((0..ROWS).map(|i| n * ROWS + i)));
    let prices: ArrayRef = Arc::new(Float64Array::from_iter_values(
        (0..ROWS).map(|i| (i % 1000) as f64 * 0.25),
    ));
    let names: ArrayRef = Arc::new(StringArray::from_iter_values(
        (0..ROWS).map(|i| format!("item-{}", i % 97)),
    ));
    RecordBatch::try_from_iter([("id", ids), ("price", prices), ("name", names)]).expect("batch")
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path: std::path::PathBuf = match std::env::args_os().nth(1) {
        Some(path) => path.into(),
        None => private_socket_path("arrow-cuda.sock")?,
    };
    let device = if arrow_cuda::device::cuda_available() {
        Device::Cuda(0)
    } else {
        println!("no CUDA device: using the CPU device, with shared memory standing in for CUDA IPC");
        Device::Cpu
    };
    let schema = batch(0).schema();
    let sender = Sender::bind(&path, schema, SenderOptions::default())?;
    println!("waiting for a consumer on {} (start 04_ipc_consumer)", path.display());
    sender.wait_for_receivers(1, Duration::from_secs(600))?;
    let stream = Stream::new(device)?;
    for n in 0..BATCHES {
        // Memory another process can map and keep (shared device memory, or shared memory on the
        // CPU): the batch is lent as it is, not copied, and stays readable by a consumer that
        // holds it if this process dies.
        let on_device = htod_async(&batch(n), MemoryResource::shared_for(device), &stream)?;
        let id = sender.send(&on_device)?;
        println!(
            "sent batch {id} to {} consumer(s): {} rows, {} bytes on {device}",
            sender.status().receivers,
            on_device.num_rows(),
            on_device.size_in_bytes()
        );
    }
    sender.finish()?;
    println!("waiting for consumers to release the batches");
    sender.wait_idle(Duration::from_secs(600))?;
    println!("done: {:?}", sender.status());
    Ok(())
}
