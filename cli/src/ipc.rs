//! `arrow-cuda send` / `recv`: the IPC channel between two terminals.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arrow_array::{ArrayRef, Int64Array, RecordBatch, StringArray};
use arrow_cuda::ipc::{Receiver, ReceiverOptions, Sender, SenderOptions, private_socket_path};
use arrow_cuda::{DeviceRecordBatch, Error, Result, Stream};

/// The socket both ends use by default, in a directory only this user can enter.
const DEFAULT_SOCKET: &str = "arrow-cuda.sock";

/// What `--help` says of the default socket.
const SOCKET_HELP: &str = "The Unix socket [default: $XDG_RUNTIME_DIR/arrow-cuda/arrow-cuda.sock, or \
    arrow-cuda-UID/arrow-cuda.sock in the temporary directory without XDG_RUNTIME_DIR; the directory \
    is made with mode 0700, and one that another user owns or can enter is refused]";

/// `socket`, or the default in a private directory.
fn socket_path(socket: &Option<PathBuf>) -> Result<PathBuf> {
    match socket {
        Some(path) => Ok(path.clone()),
        None => private_socket_path(DEFAULT_SOCKET),
    }
}

/// Options of `arrow-cuda send`.
#[derive(clap::Args)]
pub struct SendArgs {
    #[arg(long, help = SOCKET_HELP)]
    socket: Option<PathBuf>,
    /// How many batches to send.
    #[arg(long, default_value_t = 10)]
    batches: usize,
    /// Rows per batch (an Int64 and a string column each).
    #[arg(long, default_value_t = 1 << 20)]
    rows: usize,
    /// `cuda` (the default: bodies travel as CUDA IPC handles) or `cpu` (shared memory).
    #[arg(long, default_value = "cuda")]
    device: crate::DeviceArg,
    /// Seconds to wait for a receiver.
    #[arg(long, default_value_t = 60)]
    wait: u64,
}

/// Options of `arrow-cuda recv`.
#[derive(clap::Args)]
pub struct RecvArgs {
    #[arg(long, help = SOCKET_HELP)]
    socket: Option<PathBuf>,
    /// Seconds to wait for each batch before giving up with a timeout error, so that a sender
    /// that goes silent cannot hold `recv` forever (0: wait without end).
    #[arg(long, value_name = "SECONDS", default_value_t = 60)]
    timeout: u64,
}

pub fn send(args: &SendArgs) -> Result<()> {
    let device = args.device.resolve()?;
    let stream = Stream::new(device)?;
    let host = sample(args.rows);
    let batch = arrow_cuda::transfer::htod(&host, device, &stream)?;
    let socket = socket_path(&args.socket)?;
    let sender = Sender::bind(&socket, batch.schema().clone(), SenderOptions::default())?;
    println!(
        "sending {} batches of {} rows from {device}; waiting for a receiver on {}",
        args.batches,
        args.rows,
        socket.display()
    );
    sender.wait_for_receivers(1, Duration::from_secs(args.wait))?;
    let start = Instant::now();
    for _ in 0..args.batches {
        sender.send(&batch)?;
    }
    sender.finish()?;
    sender.wait_idle(Duration::from_secs(args.wait))?;
    let secs = start.elapsed().as_secs_f64();
    let bytes = batch.size_in_bytes() as f64 * args.batches as f64;
    println!(
        "sent {} batches ({:.1} MB) in {:.3} s: {:.1} GB/s, every one acknowledged",
        args.batches,
        bytes / 1e6,
        secs,
        bytes / secs / 1e9
    );
    Ok(())
}

pub fn recv(args: &RecvArgs) -> Result<()> {
    let options = ReceiverOptions {
        recv_timeout: (args.timeout > 0).then(|| Duration::from_secs(args.timeout)),
        ..ReceiverOptions::default()
    };
    let socket = socket_path(&args.socket)?;
    let mut receiver = Receiver::connect(&socket, options)?;
    println!(
        "connected to {}: {} columns",
        socket.display(),
        receiver.schema().fields().len()
    );
    let (mut batches, mut rows, mut bytes) = (0usize, 0usize, 0usize);
    let start = Instant::now();
    while let Some(batch) = receiver.recv().map_err(name_the_timeout)? {
        batches += 1;
        rows += batch.num_rows();
        bytes += batch.size_in_bytes();
        if batches == 1 {
            print_first(&batch)?;
        }
    }
    let secs = start.elapsed().as_secs_f64();
    println!(
        "received {batches} batches ({}), {:.1} MB in {secs:.3} s",
        describe(batches, rows),
        bytes as f64 / 1e6
    );
    Ok(())
}

/// A receive that timed out, with the option that sets the limit.
fn name_the_timeout(e: Error) -> Error {
    match e {
        Error::Io { context, source } if source.kind() == std::io::ErrorKind::TimedOut => Error::Io {
            context: format!("{context} (--timeout sets the limit; 0 waits without end)"),
            source,
        },
        other => other,
    }
}

fn describe(batches: usize, rows: usize) -> String {
    rows.checked_div(batches)
        .map_or("nothing".into(), |r| format!("{r} rows a batch"))
}

/// Copies the first rows of the first batch to the host and prints them.
fn print_first(batch: &DeviceRecordBatch) -> Result<()> {
    let head = batch.slice(0, batch.num_rows().min(3))?.to_record_batch()?;
    println!(
        "first batch: {} rows on {}; first rows: {:?}",
        batch.num_rows(),
        batch.device(),
        head.columns()
    );
    Ok(())
}

fn sample(rows: usize) -> RecordBatch {
    let ids: ArrayRef = Arc::new(Int64Array::from_iter_values(0..rows as i64));
    let names: ArrayRef = Arc::new(StringArray::from_iter_values((0..rows).map(|i| format!("row {i}"))));
    RecordBatch::try_from_iter([("id", ids), ("name", names)]).expect("valid batch")
}
