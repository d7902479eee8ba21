//! `arrow-cuda bench`: one table of figures with a comparison beside each.
//!
//! - Transfers of a large and a small batch, beside one blocking copy per Arrow buffer.
//! - IPC: the one-way latency of a 100-column batch (from the sender's `send` to the moment the
//!   consumer process's `recv` returns it, `CLOCK_MONOTONIC` read in both processes), and the
//!   throughput of a stream of 1 GiB batches that the consumer reads on the device; both beside the
//!   host path: download, arrow-ipc over a Unix socket, upload in the consumer.
//! - The 22 TPC-H queries over [`GpuTable`](arrow_cuda::datafusion::GpuTable)s with device stages
//!   beside DataFusion's `MemTable` over the same batches, and the geometric mean of the speedups.
//!
//! The workloads are those of the criterion benches (`benches/` of arrow-cuda), from one source:
//! the crate `arrow-cuda-workloads`.
//!
//! The IPC consumers are this binary started again, as the hidden `bench-peer` subcommand.
//! Without a GPU the command fails, unless `ARROW_CUDA_BENCH_CPU` is set: then it runs the IPC and
//! TPC-H rows on the CPU device (shared memory instead of CUDA IPC), to check the plumbing; those
//! figures mean nothing.

use std::io::{BufReader, BufWriter, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arrow_array::RecordBatch;
use arrow_cuda::ipc::{
    Receiver, ReceiverOptions, Sender, SenderOptions, default_message_resource, private_socket_path,
};
use arrow_cuda::transfer::{dtoh, htod, htod_async};
use arrow_cuda::{Device, DeviceBuffer, DeviceRecordBatch, MemoryResource, Result, Stream};
use arrow_cuda_workloads::{buffers, int64_batch, monotonic_ns, small_batch, tpch};
use arrow_ipc::reader::StreamReader;
use arrow_ipc::writer::StreamWriter;
use arrow_schema::SchemaRef;
use datafusion::arrow::util::pretty::pretty_format_batches;
use datafusion::datasource::MemTable;
use datafusion::prelude::{SessionConfig, SessionContext};

/// A result whose error is anything printable.
type BoxResult<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// With this variable set and no GPU, `bench` checks its plumbing on the CPU device.
const CPU_CHECK: &str = "ARROW_CUDA_BENCH_CPU";
/// How long to wait for a consumer process to connect.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(60);
/// How long to wait for a consumer to acknowledge a batch.
const ACK_TIMEOUT: Duration = Duration::from_secs(120);

/// Options of `arrow-cuda bench`.
#[derive(clap::Args)]
pub struct Args {
    /// Seconds to spend on each measurement.
    #[arg(long, default_value_t = 1.0)]
    seconds: f64,
    /// Rows of the large batches: 16 Int64 columns for the transfers, 8 Int64 columns of twice as
    /// many rows for the IPC stream (the default makes 1 GiB each).
    #[arg(long, default_value_t = 8 << 20)]
    rows: usize,
    /// TPC-H scale factor of the query rows.
    #[arg(long, default_value_t = 1.0)]
    sf: f64,
}

/// Options of the hidden `arrow-cuda bench-peer`: the consumer end of `bench`'s IPC rows.
#[derive(clap::Args)]
pub struct PeerArgs {
    /// What the consumer does.
    #[arg(long, value_enum)]
    role: PeerRole,
    /// The Unix socket to connect to.
    #[arg(long)]
    socket: PathBuf,
    /// The device to read on.
    #[arg(long, default_value = "cuda")]
    device: crate::DeviceArg,
}

/// The consumers of `bench`'s IPC rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum PeerRole {
    /// Receives over the channel, keeping its mappings and polling for frames, and writes the moment
    /// each `recv` returned to stdout (8 bytes, little-endian nanoseconds of `CLOCK_MONOTONIC`).
    Retain,
    /// Receives over the channel and copies every buffer into device memory of its own.
    DeviceReader,
    /// Reads arrow-ipc from the socket, uploads each batch to the device, then writes the moment
    /// the upload finished to stdout (which is also the acknowledgement).
    HostReader,
}

/// One line of the table.
struct Row {
    what: String,
    ours: f64,
    theirs: f64,
    unit: &'static str,
}

/// `arrow-cuda bench`: measures every row, then prints the table and the notes under it. A part that
/// fails leaves its rows out and makes the command fail after the table.
pub fn run(args: &Args) -> BoxResult<()> {
    let device = match arrow_cuda::device::cuda_device_count() {
        Ok(_) => Device::Cuda(0),
        Err(_) if std::env::var_os(CPU_CHECK).is_some() => Device::Cpu,
        Err(e) => return Err(e.into()),
    };
    let stream = Stream::new(device)?;
    let mut rows = Vec::new();
    let mut notes = vec![
        "comparison: transfers: one blocking copy per Arrow buffer; IPC: download, arrow-ipc \
         StreamWriter -> Unix socket -> StreamReader, upload in the consumer process"
            .to_string(),
        "latency: from `send` to the consumer's `recv` returning (CLOCK_MONOTONIC in both processes), \
         median; streaming: bytes over the whole run; everything else: the best run"
            .to_string(),
    ];
    let mut failed = Vec::new();
    if device == Device::Cpu {
        notes.push(format!(
            "{CPU_CHECK} is set and there is no GPU: IPC and TPC-H on the CPU device, a plumbing check \
             whose figures mean nothing; no transfer rows"
        ));
    } else {
        eprintln!("bench: transfers");
        if let Err(e) = transfer_rows(args, device, &stream, &mut rows) {
            failed.push(format!("transfers: {e}"));
        }
    }
    eprintln!("bench: IPC");
    if let Err(e) = ipc_rows(args, device, &stream, &mut rows) {
        failed.push(format!("IPC: {e}"));
    }
    if let Err(e) = query_rows(args, device, &mut rows, &mut notes) {
        failed.push(format!("TPC-H: {e}"));
    }

    println!("| what | arrow-cuda | comparison | unit |");
    println!("|---|---:|---:|---|");
    for r in rows {
        println!(
            "| {} | {} | {} | {} |",
            r.what,
            figure(r.ours),
            figure(r.theirs),
            r.unit
        );
    }
    println!();
    for n in notes {
        println!("- {n}");
    }
    match failed.is_empty() {
        true => Ok(()),
        false => Err(failed.join("; ").into()),
    }
}

/// A figure with three significant digits or more.
fn figure(v: f64) -> String {
    match v.abs() {
        a if a < 10.0 => format!("{v:.2}"),
        _ => format!("{v:.1}"),
    }
}

/// Uploads and downloads of a large and a small batch, beside one copy per buffer.
fn transfer_rows(args: &Args, device: Device, stream: &Stream, rows: &mut Vec<Row>) -> Result<()> {
    let large = int64_batch(16, args.rows);
    let small = small_batch();
    let large_name = format!("16 x Int64, {} MiB", (args.rows * 16 * 8) >> 20);
    for (name, batch, unit) in [
        (large_name.as_str(), &large, "GB/s"),
        ("100 cols x 1,000 rows", &small, "µs"),
    ] {
        let bytes = buffers(batch).iter().map(|b| b.len()).sum::<usize>() as f64;
        let figure = |secs: f64| if unit == "GB/s" { bytes / secs / 1e9 } else { secs * 1e6 };
        let mut naive_up = naive(batch, device, stream)?;
        let up = crate::best_time(args.seconds, || htod(batch, device, stream).map(drop))?;
        let nup = crate::best_time(args.seconds, || naive_upload(&mut naive_up, stream))?;
        rows.push(Row {
            what: format!("{name}: host -> device (vs one copy per buffer)"),
            ours: figure(up),
            theirs: figure(nup),
            unit,
        });
        let on_device = htod(batch, device, stream)?;
        let down = crate::best_time(args.seconds, || dtoh(&on_device, stream).map(drop))?;
        let ndown = crate::best_time(args.seconds, || naive_download(&naive_up, stream))?;
        rows.push(Row {
            what: format!("{name}: device -> host (vs one copy per buffer)"),
            ours: figure(down),
            theirs: figure(ndown),
            unit,
        });
    }
    Ok(())
}

/// The IPC latency and streaming rows, each beside the host path.
fn ipc_rows(args: &Args, device: Device, stream: &Stream, rows: &mut Vec<Row>) -> BoxResult<()> {
    let (ours, theirs) = latency(device, stream, args.seconds)?;
    rows.push(Row {
        what: "IPC one-way latency, 100 x Int64 x 1,024 rows, mappings cached, consumer polling (vs arrow-ipc \
               through the host)"
            .into(),
        ours,
        theirs,
        unit: "µs",
    });
    let host = int64_batch(8, 2 * args.rows);
    let mib = (args.rows * 2 * 8 * 8) >> 20;
    let (ours, theirs) = streaming(host, device, stream, args.seconds)?;
    rows.push(Row {
        what: format!(
            "IPC streaming, 8 x Int64, {mib} MiB batches, read on the device by the consumer (vs arrow-ipc through the host)"
        ),
        ours,
        theirs,
        unit: "GB/s",
    });
    Ok(())
}

/// Median one-way latencies in µs of a 100-column batch: over the channel with the consumer's
/// mappings cached, and through the host.
fn latency(device: Device, stream: &Stream, seconds: f64) -> BoxResult<(f64, f64)> {
    let host = int64_batch(100, 1024);
    let batch = upload(&host, device, stream)?;
    let ours = {
        let path = socket_path("latency")?;
        let _file = SocketFile(path.clone());
        let sender = Sender::bind(&path, host.schema(), SenderOptions::default())?;
        let mut peer = Peer::start(PeerRole::Retain, &path, device)?;
        wait_for_peer(&sender, &mut peer)?;
        let us = median_us(seconds, || {
            let sent = monotonic_ns();
            if sender.send(&batch)? == 0 {
                return Err(peer.gone("it left the channel"));
            }
            let at = peer.stamp()?;
            sender.wait_idle(ACK_TIMEOUT)?;
            Ok(at.saturating_sub(sent))
        })?;
        sender.finish()?;
        us
    };
    let mut host_path = HostPath::start("latency-host", &host.schema(), device)?;
    let theirs = median_us(seconds, || {
        let sent = monotonic_ns();
        let at = host_path.send(&batch, stream)?;
        Ok(at.saturating_sub(sent))
    })?;
    Ok((ours, theirs))
}

/// GB/s of batches like `host` streamed to a consumer that reads them on the device: over the
/// channel, and through the host.
fn streaming(host: RecordBatch, device: Device, stream: &Stream, seconds: f64) -> BoxResult<(f64, f64)> {
    let schema = host.schema();
    let batch = upload(&host, device, stream)?;
    drop(host);
    let bytes = batch.size_in_bytes() as f64;
    let ours = {
        let path = socket_path("stream")?;
        let _file = SocketFile(path.clone());
        let options = SenderOptions {
            max_in_flight_bytes: (4u64 << 30).max(2 * batch.size_in_bytes() as u64),
            ..SenderOptions::default()
        };
        let sender = Sender::bind(&path, schema.clone(), options)?;
        let mut peer = Peer::start(PeerRole::DeviceReader, &path, device)?;
        wait_for_peer(&sender, &mut peer)?;
        let gbps = throughput(bytes, seconds, || {
            if sender.send(&batch)? == 0 {
                return Err(peer.gone("it left the channel"));
            }
            sender.wait_idle(ACK_TIMEOUT)?;
            Ok(())
        })?;
        peer.check()?;
        sender.finish()?;
        gbps
    };
    let mut host_path = HostPath::start("stream-host", &schema, device)?;
    let theirs = throughput(bytes, seconds, || host_path.send(&batch, stream).map(drop))?;
    Ok((ours, theirs))
}

/// Calls `f` (which returns nanoseconds) a few times to warm up, then for `seconds` and at least
/// 100 times; returns the median in µs.
fn median_us(seconds: f64, mut f: impl FnMut() -> BoxResult<u64>) -> BoxResult<f64> {
    for _ in 0..10 {
        f()?;
    }
    let start = Instant::now();
    let mut ns = Vec::new();
    while ns.len() < 100 || start.elapsed().as_secs_f64() < seconds {
        ns.push(f()?);
    }
    ns.sort_unstable();
    Ok(ns[ns.len() / 2] as f64 / 1e3)
}

/// Calls `f` (which moves `bytes`) once to warm up, then for `seconds` and at least 3 times;
/// returns GB/s over the whole run.
fn throughput(bytes: f64, seconds: f64, mut f: impl FnMut() -> BoxResult<()>) -> BoxResult<f64> {
    f()?;
    let start = Instant::now();
    let mut n = 0;
    while n < 3 || start.elapsed().as_secs_f64() < seconds {
        f()?;
        n += 1;
    }
    Ok(bytes * n as f64 / start.elapsed().as_secs_f64() / 1e9)
}

/// The host path to a `host-reader` consumer: download, arrow-ipc over a Unix socket, upload there.
struct HostPath {
    // Dropped in this order: the socket closes, the consumer is stopped, the socket file goes.
    writer: StreamWriter<BufWriter<UnixStream>>,
    peer: Peer,
    _file: SocketFile,
}

impl HostPath {
    /// Listens on a new socket named after `name` and starts a consumer for batches of `schema`.
    fn start(name: &str, schema: &SchemaRef, device: Device) -> BoxResult<HostPath> {
        let path = socket_path(name)?;
        let file = SocketFile(path.clone());
        let listener = UnixListener::bind(&path)?;
        listener.set_nonblocking(true)?;
        let mut peer = Peer::start(PeerRole::HostReader, &path, device)?;
        let deadline = Instant::now() + CONNECT_TIMEOUT;
        let socket = loop {
            match listener.accept() {
                Ok((s, _)) => break s,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && Instant::now() < deadline => {
                    peer.check()?;
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(e) => return Err(format!("waiting for the bench peer to connect: {e}").into()),
            }
        };
        socket.set_nonblocking(false)?;
        let writer = StreamWriter::try_new(BufWriter::with_capacity(8 << 20, socket), schema)?;
        Ok(HostPath {
            writer,
            peer,
            _file: file,
        })
    }

    /// Downloads `batch`, writes it to the consumer, and returns the moment its upload there finished.
    fn send(&mut self, batch: &DeviceRecordBatch, stream: &Stream) -> BoxResult<u64> {
        let host = dtoh(batch, stream)?;
        self.writer.write(&host)?;
        self.writer.flush()?;
        self.peer.stamp()
    }
}

/// A consumer process, this binary again as `bench-peer`; killed and reaped when dropped.
struct Peer {
    role: String,
    child: Child,
    stamps: ChildStdout,
}

impl Peer {
    /// Starts the consumer `role` for `socket`.
    fn start(role: PeerRole, socket: &Path, device: Device) -> BoxResult<Peer> {
        let role_name =
            clap::ValueEnum::to_possible_value(&role).map_or_else(String::new, |v| v.get_name().to_string());
        let mut child = Command::new(std::env::current_exe()?)
            .args(["bench-peer", "--role", &role_name, "--socket"])
            .arg(socket)
            .args(["--device", if device == Device::Cpu { "cpu" } else { "cuda" }])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("starting the bench peer: {e}"))?;
        let stamps = child.stdout.take().ok_or("the bench peer has no stdout")?;
        Ok(Peer {
            role: role_name,
            child,
            stamps,
        })
    }

    /// The next moment the consumer wrote.
    fn stamp(&mut self) -> BoxResult<u64> {
        let mut at = [0u8; 8];
        match self.stamps.read_exact(&mut at) {
            Ok(()) => Ok(u64::from_le_bytes(at)),
            Err(e) => Err(self.gone(e)),
        }
    }

    /// An error if the consumer has exited.
    fn check(&mut self) -> BoxResult<()> {
        match self.child.try_wait()? {
            Some(status) => Err(format!("the bench peer ({}) exited: {status}", self.role).into()),
            None => Ok(()),
        }
    }

    /// The error for a consumer that stopped answering (`why`), with its exit status once it has one.
    fn gone(&mut self, why: impl std::fmt::Display) -> Box<dyn std::error::Error> {
        for _ in 0..100 {
            if let Ok(Some(status)) = self.child.try_wait() {
                return format!("the bench peer ({}) exited: {status} ({why})", self.role).into();
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        format!("the bench peer ({}) stopped answering: {why}", self.role).into()
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Waits until `peer` has connected to `sender`, or has exited.
fn wait_for_peer(sender: &Sender, peer: &mut Peer) -> BoxResult<()> {
    let deadline = Instant::now() + CONNECT_TIMEOUT;
    loop {
        match sender.wait_for_receivers(1, Duration::from_millis(100)) {
            Ok(()) => return Ok(()),
            Err(e) if e.io_kind() == Some(std::io::ErrorKind::TimedOut) && Instant::now() < deadline => peer.check()?,
            Err(e) => return Err(e.into()),
        }
    }
}

/// A socket file, removed when this is dropped.
struct SocketFile(PathBuf);

impl Drop for SocketFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A fresh socket path in the temporary directory.
/// A fresh socket path for `name`, in a directory only this user can enter.
fn socket_path(name: &str) -> Result<PathBuf> {
    let p = private_socket_path(&format!("bench-{}-{name}.sock", std::process::id()))?;
    let _ = std::fs::remove_file(&p);
    Ok(p)
}

/// `batch` in memory another process can open, once the copy has finished.
fn upload(batch: &RecordBatch, device: Device, stream: &Stream) -> Result<DeviceRecordBatch> {
    let b = htod_async(batch, default_message_resource(device), stream)?;
    b.ready().synchronize()?;
    Ok(b)
}

/// `arrow-cuda bench-peer`: one consumer of the IPC rows, until the stream ends or it is killed.
pub fn peer(args: &PeerArgs) -> BoxResult<()> {
    let device = args.device.resolve()?;
    let stream = Stream::new(device)?;
    let mut stamps = std::io::stdout().lock();
    if args.role == PeerRole::HostReader {
        let socket = UnixStream::connect(&args.socket)?;
        let reader = StreamReader::try_new(BufReader::with_capacity(8 << 20, socket), None)?;
        for batch in reader {
            let on_device = htod(&batch?, device, &stream)?;
            let at = monotonic_ns();
            drop(on_device);
            stamps.write_all(&at.to_le_bytes())?;
            stamps.flush()?;
        }
        return Ok(());
    }
    let options = ReceiverOptions {
        retain_mappings: true,
        // The latency consumer polls for frames, so that no thread wake-up is timed.
        poll: match args.role {
            PeerRole::Retain => Duration::from_millis(2),
            _ => Duration::ZERO,
        },
        // The bench stops its peer; between two measurements it may send nothing for a while.
        recv_timeout: None,
        ..ReceiverOptions::default()
    };
    let mut receiver = Receiver::connect(&args.socket, options)?;
    let mut scratch: Option<DeviceBuffer> = None;
    while let Some(batch) = receiver.recv()? {
        let at = monotonic_ns();
        match args.role {
            PeerRole::Retain => {
                stamps.write_all(&at.to_le_bytes())?;
                stamps.flush()?;
            }
            _ => {
                // Read every byte on the device: copy each buffer into memory of our own.
                batch.ready().synchronize()?;
                let size = batch.size_in_bytes();
                if scratch.as_ref().is_none_or(|s| s.len() < size) {
                    drop(scratch.take()); // Free the smaller one first.
                    scratch = Some(DeviceBuffer::alloc(MemoryResource::default_for(device), size, &stream)?);
                }
                let out = scratch.as_mut().ok_or("no scratch buffer")?;
                let mut offset = 0;
                for b in batch.columns().iter().flat_map(|c| c.all_buffers()) {
                    out.copy_from(offset, b, &stream)?;
                    offset += b.len();
                }
            }
        }
        // Dropping the batch acknowledges it.
    }
    Ok(())
}

/// The 22 TPC-H queries over the eight tables on the GPU with device stages, beside DataFusion's
/// `MemTable` over the same batches, and their sum.
fn query_rows(args: &Args, device: Device, rows: &mut Vec<Row>, notes: &mut Vec<String>) -> BoxResult<()> {
    let sf = args.sf;
    let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
    eprintln!("bench: generating the TPC-H tables at SF {sf}");
    let config = SessionConfig::new().with_target_partitions(cores);
    let gpu = crate::query::device_session(config.clone(), device);
    let host = SessionContext::new_with_config(config);
    for t in tpch::tables(sf, cores, tpch::BATCH_SIZE)? {
        let (table, _) = crate::query::stage(t.name, t.schema.clone(), t.partitions.clone(), device)?;
        gpu.register_table(t.name, Arc::new(table))?;
        host.register_table(t.name, Arc::new(MemTable::try_new(t.schema, t.partitions)?))?;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let (mut ours_total, mut theirs_total, mut log_ratio) = (0.0, 0.0, 0.0);
    for (q, sql) in tpch::QUERIES {
        let name = q.to_uppercase();
        eprintln!("bench: TPC-H {name}");
        let (ours_out, ours) = runtime.block_on(best_query(&gpu, sql, args.seconds))?;
        let (theirs_out, theirs) = runtime.block_on(best_query(&host, sql, args.seconds))?;
        rows.push(Row {
            what: format!("TPC-H {name}, SF {sf}: GPU tables on {device}, device stages (vs DataFusion MemTable)"),
            ours: ours * 1e3,
            theirs: theirs * 1e3,
            unit: "ms",
        });
        (ours_total, theirs_total) = (ours_total + ours, theirs_total + theirs);
        log_ratio += (theirs / ours).ln();
        if pretty_format_batches(&ours_out)?.to_string() != pretty_format_batches(&theirs_out)?.to_string() {
            notes.push(format!(
                "TPC-H {name}: the GPU tables' result differs from the MemTable's"
            ));
        }
    }
    let n = tpch::QUERIES.len();
    rows.push(Row {
        what: format!("TPC-H, all {n} queries, SF {sf}: the sum of the rows above"),
        ours: ours_total * 1e3,
        theirs: theirs_total * 1e3,
        unit: "ms",
    });
    notes.push(format!(
        "TPC-H: the eight tables on {device} with device stages beside DataFusion's MemTable over the same \
         batches, target_partitions = {cores} for both, the best run after a warm-up; geometric mean of \
         the {n} speedups {:.2}x",
        (log_ratio / n as f64).exp()
    ));
    Ok(())
}

/// Runs `sql` once to warm up, then for `seconds` and at least 3 times; returns the warm-up's
/// result and the best time in seconds.
async fn best_query(
    ctx: &SessionContext,
    sql: &str,
    seconds: f64,
) -> std::result::Result<(Vec<RecordBatch>, f64), datafusion::error::DataFusionError> {
    let out = ctx.sql(sql).await?.collect().await?;
    let start = Instant::now();
    let mut best = f64::INFINITY;
    let mut runs = 0;
    while runs < 3 || start.elapsed().as_secs_f64() < seconds {
        let t = Instant::now();
        ctx.sql(sql).await?.collect().await?;
        best = best.min(t.elapsed().as_secs_f64());
        runs += 1;
    }
    Ok((out, best))
}

/// Device buffers for the naive path: one per arrow buffer.
fn naive(batch: &RecordBatch, device: Device, stream: &Stream) -> Result<Vec<(arrow_buffer::Buffer, DeviceBuffer)>> {
    let ordinal = device.ordinal().unwrap_or(0);
    buffers(batch)
        .into_iter()
        .map(|b| {
            Ok((
                b.clone(),
                DeviceBuffer::alloc(MemoryResource::DevicePool(ordinal), b.len(), stream)?,
            ))
        })
        .collect()
}

/// One blocking copy per arrow buffer, as a caller without this crate would do it.
fn naive_upload(pairs: &mut [(arrow_buffer::Buffer, DeviceBuffer)], stream: &Stream) -> Result<()> {
    for (host, gpu) in pairs {
        gpu.copy_from_host(0, host.as_slice(), stream)?;
    }
    Ok(())
}

/// One blocking copy per buffer back to the host.
fn naive_download(pairs: &[(arrow_buffer::Buffer, DeviceBuffer)], stream: &Stream) -> Result<()> {
    for (_, gpu) in pairs {
        gpu.to_vec(stream)?;
    }
    Ok(())
}
