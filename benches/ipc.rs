//! Device record batches between processes.
//!
//! - `ipc_latency/lent_100_columns`: one-way latency, from a sender's `send` of the 100-column
//!   batch with nulls and strings (`small_batch`: 1,000 rows, about 300 buffers, 1.3 MB) to the
//!   consumer process's `recv` returning it (one clock, `CLOCK_MONOTONIC`, read in both
//!   processes). The batch is in the memory the channel lends as it is
//!   (`MemoryResource::shared_for`: shared device memory on a GPU that has it), and the consumer
//!   keeps its mapping, so this is the protocol's cost.
//! - `ipc_latency/lent_100_columns_polling`: the same with a consumer that polls its socket for
//!   up to 2 ms before it sleeps (`ReceiverOptions::poll`) and a producer that waits for the
//!   receive time and the acknowledgement on a busy core, so no thread wake-up is timed on either
//!   side (as MPI and UCX latency benchmarks measure).
//! - `ipc_latency/copied_100_columns_polling`: the batch in the device's default (pool) memory,
//!   which no other process can open: the sender copies it into a message of shared device memory
//!   each time (the channel's default; the producer reuses the regions of acknowledged messages,
//!   and the consumer keeps its mappings by their ids); `copied_100_columns_polling_cuda_ipc`
//!   beside it writes the messages into new CUDA IPC memory each time instead
//!   (`SenderOptions::message_resource`), which the consumer opens and closes.
//! - `ipc_latency/host_ipc_100_columns` and `host_ipc_100_columns_polling`: the same batch the
//!   way a producer without this crate's channel sends it, through the host: downloaded
//!   (`transfer::dtoh`), written with arrow-ipc to a Unix socket, read by the consumer and uploaded
//!   to its device (`transfer::htod`, which returns once the batch is there); one way ends when the
//!   upload returns. The consumer sleeps in its reads, or (`_polling`) polls the socket on a busy
//!   core while the producer polls for the receive time and the acknowledgement.
//! - `ipc_latency/lent_100_columns_new_region_polling` (printed after the latency cases, not
//!   measured by criterion, as each region is opened once): the polling case with every batch in a
//!   region of shared device memory the consumer has not mapped yet, mean of 64 batches (the
//!   consumer polls for up to 50 ms, as the sender makes each region between batches);
//!   `lent_100_columns_new_region_announced_polling` beside it: the same with the regions announced
//!   as they are made (`SenderOptions::announce_regions`), which the consumer maps while it waits,
//!   as the producer fills them.
//! - `stream_1024MiB/device_ipc_lent`, `stream_1024MiB/device_ipc_copied` and
//!   `stream_1024MiB/host_ipc`: a producer streams one 1 GiB batch over and over to a consumer process
//!   that reads it on the device (a device-to-device copy of every buffer): lent from memory other
//!   processes can map (`MemoryResource::shared_for`), copied from device memory into a message of
//!   such memory (what the channel does with a batch in memory it cannot lend, and with CUDA IPC
//!   memory where the GPU has shared device memory), and through the host: device to host,
//!   arrow-ipc over a Unix socket, host to device.
//!
//! After each latency measurement the producer prints the steps of `send` and, as it ends, the
//! consumer those of `recv` (see `arrow_cuda::trace`), each with its mean time per call; the
//! consumer's `recv.wait` counts from the call, so it holds the time before the batch was sent.
//! The producer also splits the one-way time: its `send`; from `send`'s return to the consumer's
//! call of `recv`, when it called it later; from then to the consumer having read the frame; the
//! consumer's `recv` after that (the consumer reports its call and that time with each receive
//! time). Through the host, `send` is the download and the write, the frame is the arrow-ipc
//! message (read and decoded), and what follows it the upload.
//!
//! Consumers are this binary started again with `ARROW_CUDA_IPC_BENCH` naming their part.
//! `cargo bench --bench ipc`; without a CUDA device it prints `skipped: no CUDA device` and returns
//! (`ARROW_CUDA_IPC_BENCH_CPU=1` runs it on the CPU device instead, with shared memory and smaller
//! batches, to check the plumbing).

mod common;

use std::io::{BufReader, BufWriter, Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::Duration;

use arrow_array::RecordBatch;
use arrow_cuda::ipc::{Receiver, ReceiverOptions, Sender, SenderOptions, default_message_resource};
use arrow_cuda::trace::Trace;
use arrow_cuda::transfer::{dtoh, htod, htod_async};
use arrow_cuda::{Device, DeviceBuffer, DeviceRecordBatch, MemoryResource, Stream};
use arrow_cuda_workloads::{int64_batch, monotonic_ns, small_batch};
use arrow_ipc::reader::StreamReader;
use arrow_ipc::writer::StreamWriter;
use criterion::{Criterion, SamplingMode, Throughput};

const ROLE: &str = "ARROW_CUDA_IPC_BENCH";
const SOCKET: &str = "ARROW_CUDA_IPC_BENCH_SOCKET";
const DEVICE: &str = "ARROW_CUDA_IPC_BENCH_DEVICE";
/// How long the polling consumers poll before they sleep.
const POLL: Duration = Duration::from_millis(2);
/// How long the consumer of [`first_opens`] polls: longer than the sender takes to make a new
/// region and upload the next batch into it, so that no thread wake-up is timed.
const POLL_FIRST_OPENS: Duration = Duration::from_millis(50);

fn upload(batch: &RecordBatch, resource: MemoryResource, stream: &Stream) -> DeviceRecordBatch {
    let b = htod_async(batch, resource, stream).expect("upload");
    b.ready().synchronize().expect("upload finished");
    b
}

fn socket(name: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("acipc-bench-{}-{name}.sock", std::process::id()));
    let _ = std::fs::remove_file(&p);
    p
}

/// This binary again, as the consumer `role`.
fn consumer(role: &str, path: &Path, device: Device) -> Child {
    Command::new(std::env::current_exe().expect("current exe"))
        .env(ROLE, role)
        .env(SOCKET, path)
        .env(DEVICE, if device == Device::Cpu { "cpu" } else { "cuda" })
        .stdout(Stdio::piped())
        .spawn()
        .expect("consumer process")
}

/// Ends a consumer: lets it finish on its own (and print its steps) for up to two seconds once its
/// stream has ended, then kills it.
fn stop(mut child: Child) {
    let start = std::time::Instant::now();
    while matches!(child.try_wait(), Ok(None)) && start.elapsed() < Duration::from_secs(2) {
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// One-way latency: from the sender's `send` call to the moment the consumer's `recv` returns the
/// batch, read from one clock in both processes. The consumer writes that moment to its stdout;
/// each iteration then waits for the acknowledgement (not timed) before the next send. Returns
/// whether any case ran.
fn latency(c: &mut Criterion, device: Device, stream: &Stream) -> bool {
    let template = small_batch();
    let mut g = c.benchmark_group("ipc_latency");
    g.measurement_time(Duration::from_secs(3));
    let (lent, pool) = (MemoryResource::shared_for(device), MemoryResource::default_for(device));
    let cuda_ipc = Some(default_message_resource(device));
    let mut any_ran = false;
    // (name, consumer, the batch's memory, the messages' memory)
    for (name, role, resource, messages) in [
        ("lent_100_columns", "retain", lent, None),
        ("lent_100_columns_polling", "retain-poll", lent, None),
        ("copied_100_columns_polling", "drop-poll", pool, None),
        ("copied_100_columns_polling_cuda_ipc", "drop-poll", pool, cuda_ipc),
    ] {
        let path = socket(name);
        let options = SenderOptions {
            message_resource: messages,
            ..SenderOptions::default()
        };
        let sender = Sender::bind(&path, template.schema(), options).expect("bind");
        let mut child = consumer(role, &path, device);
        let mut stamps = child.stdout.take().expect("consumer stdout");
        sender.wait_for_receivers(1, Duration::from_secs(60)).expect("consumer");
        let on_device = upload(&template, resource, stream);
        // With a polling consumer this side waits on a busy core too, as a producer with the next
        // batch at hand would be: no thread wake-up is timed on either side.
        let busy = role.ends_with("-poll");
        let mut one_way = |b: &DeviceRecordBatch| {
            let sent = monotonic_ns();
            sender.send(b).expect("send");
            let returned = monotonic_ns();
            let received = stamp(&mut stamps, busy);
            match busy {
                true => {
                    while sender.status().in_flight_batches > 0 {
                        std::hint::spin_loop();
                    }
                }
                false => sender.wait_idle(Duration::from_secs(60)).expect("acknowledged"),
            }
            OneWay::of(sent, returned, received)
        };
        one_way(&on_device);
        let mut ran = false;
        g.bench_function(name, |b| {
            ran = true;
            b.iter_custom(|iters| (0..iters).map(|_| one_way(&on_device).total()).sum())
        });
        any_ran |= ran;
        if ran {
            // The whole call here: send, the consumer's receive time, the acknowledgement.
            let (mut split, mut calls) = (OneWay::default(), 0);
            common::print_steps(&format!("{name} (send to acknowledgement)"), &["send."], |t| {
                split += t.record(|| one_way(&on_device));
                calls += 1;
            });
            println!("{}", split.means(calls));
        }
        sender.finish().expect("finish");
        drop(sender);
        stop(child);
    }
    // The naive way, through the host.
    let on_device = upload(&template, pool, stream);
    for (name, busy) in [("host_ipc_100_columns", false), ("host_ipc_100_columns_polling", true)] {
        let role = if busy {
            "host-reader-stamp-poll"
        } else {
            "host-reader-stamp"
        };
        let mut host = HostPath::start(name, role, device, &template);
        let mut stamps = host.child.stdout.take().expect("consumer stdout");
        let mut one_way = || {
            let sent = monotonic_ns();
            host.send(&on_device, stream);
            let returned = monotonic_ns();
            let received = stamp(&mut stamps, busy);
            host.wait_ack(busy);
            OneWay::of(sent, returned, received)
        };
        one_way();
        let (mut ran, mut split, mut calls) = (false, OneWay::default(), 0);
        g.bench_function(name, |b| {
            ran = true;
            b.iter_custom(|iters| {
                (0..iters)
                    .map(|_| {
                        let w = one_way();
                        split += w;
                        calls += 1;
                        w.total()
                    })
                    .sum()
            })
        });
        if ran {
            println!("{}", split.means(calls));
        }
        host.finish();
    }
    g.finish();
    any_ran
}

/// The way through the host, what a producer without this crate's channel does: each batch
/// downloaded (`dtoh`), written with arrow-ipc to a Unix socket, read by the consumer (`role`,
/// one of the `host-reader` roles) and uploaded to its device, which acknowledges it with a byte.
struct HostPath {
    writer: StreamWriter<BufWriter<UnixStream>>,
    acks: UnixStream,
    path: PathBuf,
    child: Child,
}

impl HostPath {
    fn start(name: &str, role: &str, device: Device, template: &RecordBatch) -> HostPath {
        let path = socket(name);
        let listener = UnixListener::bind(&path).expect("bind");
        let child = consumer(role, &path, device);
        let (socket, _) = listener.accept().expect("consumer");
        let acks = socket.try_clone().expect("socket");
        let writer =
            StreamWriter::try_new(BufWriter::with_capacity(8 << 20, socket), &template.schema()).expect("writer");
        HostPath {
            writer,
            acks,
            path,
            child,
        }
    }

    /// Downloads `batch` and writes it to the socket.
    fn send(&mut self, batch: &DeviceRecordBatch, stream: &Stream) {
        let host = dtoh(batch, stream).expect("download");
        self.writer.write(&host).expect("write");
        self.writer.flush().expect("flush");
    }

    /// Waits for the consumer's acknowledgement, polling the socket when `busy`.
    fn wait_ack(&mut self, busy: bool) {
        if busy {
            wait_readable(self.acks.as_fd());
        }
        self.acks.read_exact(&mut [0u8; 1]).expect("acknowledged");
    }

    /// Ends the stream and the consumer.
    fn finish(mut self) {
        self.writer.finish().expect("finish");
        drop(self.writer);
        let _ = std::fs::remove_file(&self.path);
        stop(self.child);
    }
}

/// One-way latency of batches lent from regions the consumer has not mapped yet: each of
/// [`FIRST_OPENS`] batches is uploaded (untimed) into a region of its own, all kept to the end so
/// that none is reused, and sent to a polling consumer; with `announce_regions`, each region is
/// announced as it is made, and the consumer maps it as the batch is uploaded into it. Printed
/// with the sender's steps (the consumer prints its own as it ends, `recv.open` and `recv.ahead`
/// among them), not measured by criterion: each region is opened once.
fn first_opens(device: Device, stream: &Stream, announce_regions: bool) {
    let template = small_batch();
    let path = socket("first-opens");
    let options = SenderOptions {
        announce_regions,
        ..SenderOptions::default()
    };
    let sender = Sender::bind(&path, template.schema(), options).expect("bind");
    let mut child = consumer("retain-first-opens", &path, device);
    let mut stamps = child.stdout.take().expect("consumer stdout");
    sender.wait_for_receivers(1, Duration::from_secs(60)).expect("consumer");
    let mut trace = Trace::default();
    let mut kept = Vec::with_capacity(FIRST_OPENS);
    let mut split = OneWay::default();
    for _ in 0..FIRST_OPENS {
        let batch = upload(&template, MemoryResource::shared_for(device), stream);
        let sent = monotonic_ns();
        trace.record(|| sender.send(&batch)).expect("send");
        let returned = monotonic_ns();
        split += OneWay::of(sent, returned, stamp(&mut stamps, true));
        while sender.status().in_flight_batches > 0 {
            std::hint::spin_loop();
        }
        kept.push(batch);
    }
    let (name, how) = match announce_regions {
        true => ("new_region_announced", "announced as it is made"),
        false => ("new_region", "that the consumer maps first"),
    };
    println!(
        "ipc_latency/lent_100_columns_{name}_polling: {:.1} µs one way, mean of {FIRST_OPENS} \
         batches, each in a region {how}\n{}\n{}",
        split.total().as_secs_f64() * 1e6 / FIRST_OPENS as f64,
        split.means(FIRST_OPENS as u32),
        trace.means("send.", FIRST_OPENS as u64)
    );
    sender.finish().expect("finish");
    drop(sender);
    stop(child);
}

/// Where the time of one-way latencies went.
#[derive(Clone, Copy, Default)]
struct OneWay {
    /// The sender's `send`.
    send: Duration,
    /// From `send`'s return to the consumer's call of `recv` (when it called it later).
    late: Duration,
    /// From then to the consumer having read the frame: the frame on its way, and noticed.
    between: Duration,
    /// The consumer's `recv` after it read the frame.
    receive: Duration,
}

impl OneWay {
    /// A batch sent at `sent` (from `CLOCK_MONOTONIC`), its `send` returning at `returned`, and
    /// `received` as the consumer stamped it.
    fn of(sent: u64, returned: u64, received: Stamp) -> OneWay {
        let ns = Duration::from_nanos;
        let read = received.at.saturating_sub(received.handling);
        let waiting = returned.max(received.called);
        OneWay {
            send: ns(returned.saturating_sub(sent)),
            late: ns(waiting.saturating_sub(returned)),
            between: ns(read.saturating_sub(waiting)),
            receive: ns(received.handling),
        }
    }

    fn total(&self) -> Duration {
        self.send + self.late + self.between + self.receive
    }

    /// Its parts' means over `calls`, one line.
    fn means(&self, calls: u32) -> String {
        let us = |d: Duration| d.as_secs_f64() * 1e6 / calls.max(1) as f64;
        format!(
            "  one way, mean of {calls}: send {:.2} µs, until the consumer called recv {:.2} µs, the \
             frame on its way and noticed {:.2} µs, recv after reading it {:.2} µs",
            us(self.send),
            us(self.late),
            us(self.between),
            us(self.receive)
        )
    }
}

impl std::ops::AddAssign for OneWay {
    fn add_assign(&mut self, other: OneWay) {
        self.send += other.send;
        self.late += other.late;
        self.between += other.between;
        self.receive += other.receive;
    }
}

/// The batches [`first_opens`] sends, each in a new region.
const FIRST_OPENS: usize = 64;

/// The time a `recv` of the consumer spent in its steps after it read the batch's frame (all but
/// `recv.wait` and `recv.ahead`, the mapping of regions announced before it), summed over its
/// calls so far.
fn handled(trace: &Trace) -> Duration {
    trace
        .steps()
        .iter()
        .filter(|s| s.name != "recv.wait" && s.name != "recv.ahead")
        .map(|s| s.total)
        .sum()
}

/// When the consumer received a batch, as it wrote it: the moment its `recv` returned and the
/// nanoseconds that call spent after it had read the frame.
struct Stamp {
    at: u64,
    handling: u64,
    /// When the consumer called that `recv`.
    called: u64,
}

/// The next [`Stamp`] the consumer wrote, read by polling the pipe when `busy`.
fn stamp(stamps: &mut ChildStdout, busy: bool) -> Stamp {
    let mut at = [0u8; 24];
    let mut got = 0;
    while got < at.len() {
        if busy {
            wait_readable(stamps.as_fd());
        }
        got += match stamps.read(&mut at[got..]).expect("receive time") {
            0 => panic!("the consumer ended"),
            n => n,
        };
    }
    let [at, handling, called] =
        [&at[..8], &at[8..16], &at[16..]].map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")));
    Stamp { at, handling, called }
}

/// Spins until `fd` has bytes to read.
fn wait_readable(fd: BorrowedFd<'_>) {
    let mut poll = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd for each call; a zero timeout never blocks.
    while unsafe { libc::poll(&mut poll, 1, 0) } == 0 {
        std::hint::spin_loop();
    }
}

fn streaming(c: &mut Criterion, device: Device, stream: &Stream, bytes: usize) {
    let columns = 8;
    let template = int64_batch(columns, bytes / 8 / columns);
    let mut g = c.benchmark_group(format!("stream_{}MiB", bytes >> 20));
    g.throughput(Throughput::Bytes(bytes as u64));
    g.sampling_mode(SamplingMode::Flat);
    g.sample_size(10);
    g.warm_up_time(Duration::from_millis(500));
    g.measurement_time(Duration::from_secs(5));

    // Between the processes' device memory: the body never leaves the device.
    let lendable = upload(&template, MemoryResource::shared_for(device), stream);
    let on_device = upload(&template, default_message_resource(device), stream);
    for (name, batch) in [("device_ipc_lent", &lendable), ("device_ipc_copied", &on_device)] {
        let path = socket(&format!("stream-{name}"));
        let sender = Sender::bind(&path, template.schema(), SenderOptions::default()).expect("bind");
        let child = consumer("device-reader", &path, device);
        sender.wait_for_receivers(1, Duration::from_secs(60)).expect("consumer");
        g.bench_function(name, |b| {
            b.iter(|| {
                sender.send(batch).expect("send");
                sender.wait_idle(Duration::from_secs(120)).expect("acknowledged");
            })
        });
        sender.finish().expect("finish");
        drop(sender);
        stop(child);
    }
    drop(lendable);

    // Through the host: device to host, arrow-ipc over a socket, host to device.
    let mut host = HostPath::start("stream-host", "host-reader", device, &template);
    g.bench_function("host_ipc", |b| {
        b.iter(|| {
            host.send(&on_device, stream);
            host.wait_ack(false);
        })
    });
    host.finish();
    g.finish();
}

/// The consumer process.
fn consume(role: &str) {
    let path = PathBuf::from(std::env::var(SOCKET).expect("socket"));
    let device = match std::env::var(DEVICE).as_deref() {
        Ok("cpu") => Device::Cpu,
        _ => Device::Cuda(0),
    };
    let stream = Stream::new(device).expect("stream");
    if let Some(how) = role.strip_prefix("host-reader") {
        return read_through_host(&path, device, &stream, how);
    }
    let options = ReceiverOptions {
        retain_mappings: role.starts_with("retain"),
        poll: match role {
            "retain-first-opens" => POLL_FIRST_OPENS,
            r if r.ends_with("-poll") => POLL,
            _ => Duration::ZERO,
        },
        ..ReceiverOptions::default()
    };
    let mut receiver = Receiver::connect(&path, options).expect("connect");
    let mut scratch: Option<DeviceBuffer> = None;
    let mut stamps = std::io::stdout().lock();
    let mut trace = Trace::default();
    let mut received = 0;
    loop {
        let handled_before = handled(&trace);
        let called = monotonic_ns();
        let Some(batch) = trace.record(|| receiver.recv()).expect("receive") else {
            break;
        };
        let arrived = monotonic_ns();
        received += 1;
        if role != "device-reader" {
            // The moment the batch arrived and the time `recv` took once it had read the frame,
            // for the latency benchmark.
            let handling = (handled(&trace) - handled_before).as_nanos() as u64;
            stamps.write_all(&arrived.to_le_bytes()).expect("stamp");
            stamps.write_all(&handling.to_le_bytes()).expect("stamp");
            stamps.write_all(&called.to_le_bytes()).expect("stamp");
            stamps.flush().expect("stamp");
        }
        if role == "device-reader" {
            // Read every byte on the device: copy each buffer into memory of our own.
            batch.ready().synchronize().expect("ready");
            let size = batch.size_in_bytes();
            if scratch.as_ref().is_none_or(|s| s.len() < size) {
                scratch =
                    Some(DeviceBuffer::alloc(MemoryResource::default_for(device), size, &stream).expect("scratch"));
            }
            let out = scratch.as_mut().expect("scratch");
            let mut at = 0;
            for b in batch.columns().iter().flat_map(|c| c.all_buffers()) {
                out.copy_from(at, b, &stream).expect("device copy");
                at += b.len();
            }
        }
    }
    if role != "device-reader" {
        eprint!(
            "steps of the consumer's recv ({role}), mean of {received} batches:\n{}",
            trace.means("recv.", received)
        );
    }
}

/// The consumer of a [`HostPath`]: reads each batch from the socket and uploads it to `device`,
/// then acknowledges it. `how` is the rest of its role: `-stamp` writes each batch's [`Stamp`] to
/// stdout (the upload being what follows the frame), and `-stamp-poll` also polls the socket.
fn read_through_host(path: &Path, device: Device, stream: &Stream, how: &str) {
    let socket = UnixStream::connect(path).expect("connect");
    let mut acks = socket.try_clone().expect("socket");
    let polled = Polled {
        socket,
        busy: how.ends_with("-poll"),
    };
    let mut reader = StreamReader::try_new(BufReader::with_capacity(8 << 20, polled), None).expect("reader");
    let mut stamps = std::io::stdout().lock();
    loop {
        let called = monotonic_ns();
        let Some(batch) = reader.next() else { break };
        let read = monotonic_ns();
        let on_device = htod(&batch.expect("batch"), device, stream).expect("upload");
        let arrived = monotonic_ns();
        drop(on_device);
        if how.starts_with("-stamp") {
            for v in [arrived, arrived - read, called] {
                stamps.write_all(&v.to_le_bytes()).expect("stamp");
            }
            stamps.flush().expect("stamp");
        }
        acks.write_all(&[1]).expect("ack");
    }
}

/// A socket whose reads poll it on a busy core first when `busy`.
struct Polled {
    socket: UnixStream,
    busy: bool,
}

impl Read for Polled {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.busy {
            wait_readable(self.socket.as_fd());
        }
        self.socket.read(buf)
    }
}

fn main() {
    if let Ok(role) = std::env::var(ROLE) {
        return consume(&role);
    }
    let on_cpu = std::env::var_os("ARROW_CUDA_IPC_BENCH_CPU").is_some();
    let device = match arrow_cuda::device::cuda_device_count() {
        Ok(_) => Device::Cuda(0),
        Err(_) if on_cpu => Device::Cpu,
        Err(e) => {
            println!("skipped: no CUDA device ({e})");
            return;
        }
    };
    let stream = Stream::new(device).expect("stream");
    let mut c = Criterion::default().configure_from_args();
    if latency(&mut c, device, &stream) {
        first_opens(device, &stream, false);
        first_opens(device, &stream, true);
    }
    streaming(
        &mut c,
        device,
        &stream,
        if device == Device::Cpu { 64 << 20 } else { 1 << 30 },
    );
    c.final_summary();
}
