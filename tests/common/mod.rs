//! Shared by the integration tests: the devices each case runs on.
#![allow(dead_code)]

pub mod c_schema;
pub mod corpus;
pub mod fuzz;
pub mod tables;

use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use arrow_array::RecordBatch;
use arrow_cuda::{Device, Stream};

/// Whether this machine has an NVIDIA GPU, whatever the driver says: on such a machine CUDA cases
/// must run, never skip.
fn gpu_machine() -> bool {
    std::path::Path::new("/dev/nvidia0").exists() || std::env::var_os("ARROW_CUDA_REQUIRE_GPU").is_some()
}

/// The devices every case runs on: the CPU always, CUDA device 0 when a GPU is present. Without a
/// GPU the CUDA case prints `skipped: no CUDA device`; on a GPU machine whose driver fails, it panics.
pub fn devices() -> Vec<Device> {
    let mut out = vec![Device::Cpu];
    match arrow_cuda::device::cuda_device_count() {
        Ok(_) => out.push(Device::Cuda(0)),
        Err(e) if gpu_machine() => panic!("this machine has a GPU but CUDA is unusable: {e}"),
        Err(_) => eprintln!("skipped: no CUDA device"),
    }
    out
}

/// Runs `case` on every device with a fresh stream, naming the device when it fails.
pub fn each_device(mut case: impl FnMut(Device, &Stream)) {
    for device in devices() {
        let stream = Stream::new(device).expect("stream");
        eprintln!("device {device}");
        case(device, &stream);
    }
}

/// The CUDA device, or `None` (printing `skipped: no CUDA device`) on a machine without a GPU.
pub fn cuda() -> Option<Device> {
    devices().into_iter().find(|d| matches!(d, Device::Cuda(_)))
}

/// The tokio runtime the DataFusion tests block on (four workers).
#[cfg(feature = "datafusion")]
pub fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: std::sync::OnceLock<tokio::runtime::Runtime> = std::sync::OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(4)
            .enable_all()
            .build()
            .expect("tokio runtime")
    })
}

/// The rows of a result as text lines, cells trimmed (so that rows compare across results whose
/// columns have other widths); sorted unless the order matters.
#[cfg(feature = "datafusion")]
pub fn rows(batches: &[RecordBatch], ordered: bool) -> Vec<String> {
    let text = datafusion::arrow::util::pretty::pretty_format_batches(batches)
        .expect("format")
        .to_string();
    let lines: Vec<String> = text.lines().map(str::to_string).collect();
    // Border, header, border, rows..., border.
    let mut body: Vec<String> = if lines.len() > 4 {
        lines[3..lines.len() - 1]
            .iter()
            .map(|l| l.split('|').map(str::trim).collect::<Vec<_>>().join("|"))
            .collect()
    } else {
        vec![]
    };
    if !ordered {
        body.sort();
    }
    body
}

/// Whether the tests run under compute-sanitizer (the GPU run sets `ARROW_CUDA_SANITIZER`), which
/// counts every failed driver call as an error: cases that provoke one on purpose skip there and
/// run in the plain pass.
pub fn under_sanitizer() -> bool {
    std::env::var_os("ARROW_CUDA_SANITIZER").is_some()
}

/// Checks that `back` equals `expected` (schema and metadata included) and that every column
/// passes arrow-rs's full validation.
pub fn check_batch(what: &str, back: &RecordBatch, expected: &RecordBatch) {
    assert_eq!(back.num_rows(), expected.num_rows(), "{what}: rows");
    assert_eq!(back.schema(), expected.schema(), "{what}: schema");
    assert_eq!(
        back.schema().metadata(),
        expected.schema().metadata(),
        "{what}: schema metadata"
    );
    for (i, (b, e)) in back.columns().iter().zip(expected.columns()).enumerate() {
        let name = expected.schema().field(i).name().clone();
        b.to_data()
            .validate_full()
            .unwrap_or_else(|err| panic!("{what}: column {name} is invalid: {err}"));
        assert_eq!(b.as_ref(), e.as_ref(), "{what}: column {name} differs");
    }
    assert_eq!(back, expected, "{what}");
}

/// The message of an [`arrow_cuda::Error::InvalidData`], failing on any other outcome.
#[track_caller]
pub fn invalid_data<T: std::fmt::Debug>(what: &str, result: arrow_cuda::Result<T>) -> String {
    match result {
        Err(arrow_cuda::Error::InvalidData(message)) => {
            eprintln!("{what}: {message}");
            message
        }
        other => panic!("{what}: expected InvalidData, got {other:?}"),
    }
}

/// A host function queued on a CUDA stream that holds the work queued after it until the gate
/// opens: when [`Gate::open`] is called, when the gate drops, or once `limit` has passed, so that a
/// test that fails while it is closed still ends. Work behind a closed gate is still queued,
/// whatever the load on the machine.
pub struct Gate(Arc<GateState>);

struct GateState {
    open: Mutex<bool>,
    opened: Condvar,
    limit: Duration,
}

impl Gate {
    /// Closes a gate on `stream` (a CUDA stream). The driver runs host functions on a thread of its
    /// own: allocating pinned memory can wait for the device, and so for the gate.
    pub fn close(stream: &Stream, limit: Duration) -> Gate {
        unsafe extern "C" fn hold(data: *mut std::ffi::c_void) {
            // SAFETY: `data` is the reference `close` leaked for this call, taken back once.
            let state = unsafe { Arc::from_raw(data as *const GateState) };
            let open = state.open.lock().unwrap_or_else(|p| p.into_inner());
            drop(state.opened.wait_timeout_while(open, state.limit, |open| !*open));
        }
        let state = Arc::new(GateState {
            open: Mutex::new(false),
            opened: Condvar::new(),
            limit,
        });
        let raw = stream.cuda().expect("a CUDA stream").cu_stream();
        let data = Arc::into_raw(state.clone()) as *mut std::ffi::c_void;
        // SAFETY: a live stream; `hold` makes no CUDA call and takes back the reference it is given.
        unsafe { cudarc::driver::result::stream::launch_host_function(raw, hold, data) }.unwrap();
        Gate(state)
    }

    /// Lets the work behind the gate run.
    pub fn open(&self) {
        *self.0.open.lock().unwrap_or_else(|p| p.into_inner()) = true;
        self.0.opened.notify_all();
    }

    /// Opens the gate from another thread once `delay` has passed.
    pub fn open_after(self, delay: Duration) -> std::thread::JoinHandle<()> {
        std::thread::spawn(move || {
            std::thread::sleep(delay);
            self.open();
        })
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        self.open();
    }
}
