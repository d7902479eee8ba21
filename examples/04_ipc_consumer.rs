//! Receives record batches that `03_ipc_producer` put on the GPU, as views of its memory: the
//! bodies never pass through host memory. Each batch is given back to the producer when dropped.
//!
//! ```sh
//! cargo run --example 04_ipc_consumer
//! ```
//!
//! It connects to `ipc::private_socket_path("arrow-cuda.sock")`, where `03_ipc_producer` listens,
//! unless given another socket path as its argument.

use std::time::Duration;

use arrow_cuda::ipc::{Receiver, ReceiverOptions, private_socket_path};
use arrow_cuda::{Device, Stream};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path: std::path::PathBuf = match std::env::args_os().nth(1) {
        Some(path) => path.into(),
        None => private_socket_path("arrow-cuda.sock")?,
    };
    if !arrow_cuda::device::cuda_available() {
        println!("no CUDA device: batches arrive on the CPU device, in shared memory");
    }
    let options = ReceiverOptions {
        connect_timeout: Duration::from_secs(600),
        ..ReceiverOptions::default()
    };
    let mut receiver = Receiver::connect(&path, options)?;
    println!("connected to {}; schema: {}", path.display(), receiver.schema());
    let mut rows = 0;
    while let Some(batch) = receiver.recv()? {
        let device = batch.device();
        let stream = if device == Device::Cpu {
            Stream::cpu()
        } else {
            Stream::shared(device)?
        };
        stream.wait(batch.ready())?;
        // Eight bytes, to show a value: the first id of the batch.
        let ids = &batch.column(0).buffers()[0];
        let first = i64::from_le_bytes(ids.slice(0, 8)?.to_vec(&stream)?.try_into().expect("8 bytes"));
        println!(
            "batch of {} rows on {device} at {:#x}, first id {first}",
            batch.num_rows(),
            ids.address()
        );
        rows += batch.num_rows();
    }
    println!("end of stream after {rows} rows");
    Ok(())
}
