//! pyarrow (Arrow C++) interop:
//!
//! - through the C Device Data Interface: builds the `ffi-helper` C library (or takes the one
//!   `ARROW_CUDA_FFI_HELPER` names, on a machine without cargo) and runs `tests/pyarrow_interop.py`
//!   against it;
//! - through Arrow IPC: Arrow C++ reads the device messages of every type (dictionaries included),
//!   copied to the host, as it reads arrow-rs's stream of the same batch;
//! - through CUDA IPC: another process (Python with CuPy) reads a serialized handle as Arrow C++'s
//!   `CudaIpcMemHandle::FromBuffer` does, opens the allocation, copies the message out of it, and
//!   pyarrow reads it. It needs a GPU and CuPy; elsewhere it says why it is skipped.
//!
//! Without pyarrow each test says `skipped: pyarrow not installed` and passes, except in CI (the
//! `CI` variable set), where it fails.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use arrow_cuda::ipc::{self, IpcMemHandle};
use arrow_cuda::transfer::htod_async;
use arrow_cuda::{Device, Stream};
use common::corpus::every_type_batch;
use common::each_device;

fn manifest_dir() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Whether `python3` can import pyarrow.
fn pyarrow_available() -> bool {
    Command::new("python3")
        .args(["-c", "import pyarrow"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

/// The `ffi-helper` cdylib: the one `ARROW_CUDA_FFI_HELPER` names (built elsewhere, for a machine
/// without cargo), or else built into this workspace's target directory, at the path cargo reports.
fn build_helper() -> PathBuf {
    if let Some(prebuilt) = std::env::var_os("ARROW_CUDA_FFI_HELPER") {
        return PathBuf::from(prebuilt);
    }
    let output = Command::new(env!("CARGO"))
        .current_dir(manifest_dir())
        .args(["build", "--quiet", "-p", "ffi-helper", "--message-format=json"])
        .output()
        .expect("run cargo");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "cargo build -p ffi-helper failed:\n{}\n{stdout}",
        String::from_utf8_lossy(&output.stderr)
    );
    // One JSON message a line; the helper's artifact names the cdylib among its `filenames`.
    for line in stdout
        .lines()
        .filter(|l| l.contains("\"compiler-artifact\"") && l.contains("\"cdylib\""))
    {
        let Some(start) = line.find("\"filenames\":[") else {
            continue;
        };
        let list = &line[start + "\"filenames\":[".len()..];
        let list = &list[..list.find(']').unwrap_or(list.len())];
        for name in list.split(',').map(|s| s.trim().trim_matches('"')) {
            let name = name.replace("\\\\", "\\");
            if [".so", ".dylib", ".dll"].iter().any(|ext| name.ends_with(ext)) {
                return PathBuf::from(name);
            }
        }
    }
    panic!("cargo built ffi-helper but named no cdylib:\n{stdout}");
}

/// Whether the test can run: pyarrow is there, or (outside CI) it says why it is skipped.
fn needs_pyarrow() -> bool {
    if pyarrow_available() {
        return true;
    }
    if std::env::var_os("CI").is_some() {
        panic!("pyarrow is not installed, and CI must run this test (`python3 -m pip install pyarrow`)");
    }
    eprintln!("skipped: pyarrow not installed");
    false
}

#[test]
fn pyarrow_round_trips_through_arrow_cuda() {
    if !needs_pyarrow() {
        return;
    }
    let library = build_helper();
    assert!(library.exists(), "{} does not exist", library.display());
    let script = manifest_dir().join("tests").join("pyarrow_interop.py");
    let output = Command::new("python3")
        .current_dir(manifest_dir())
        .arg(&script)
        .arg(&library)
        .output()
        .expect("run python3");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    eprintln!("{stdout}{stderr}");
    assert!(
        output.status.success(),
        "{} failed ({}):\n{stdout}\n{stderr}",
        script.display(),
        output.status
    );
    assert!(
        stdout.lines().any(|l| l == "ok"),
        "the script did not finish:\n{stdout}"
    );
}

/// A fresh directory for a test's files.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("arrow-cuda-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// arrow-rs's IPC stream of `batch`, written to `path`.
fn write_reference(batch: &arrow_array::RecordBatch, path: &Path) {
    let file = std::fs::File::create(path).unwrap();
    let mut writer = arrow_ipc::writer::StreamWriter::try_new(file, &batch.schema()).unwrap();
    writer.write(batch).unwrap();
    writer.finish().unwrap();
}

/// Runs a Python script with `args`; panics with its output if it fails, returns its stdout.
fn python(script: &str, args: &[&Path]) -> String {
    let output = Command::new("python3")
        .args(["-c", script])
        .args(args)
        .output()
        .expect("run python3");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "python failed:\n{stdout}\n{stderr}");
    stdout
}

/// Python that reads the stream at argv[1] and requires the batch of the stream at argv[2].
const SAME_AS_REFERENCE: &str = "def same(stream):\n    \
    import sys, pyarrow as pa\n    \
    ours = pa.ipc.open_stream(stream).read_all()\n    \
    ref = pa.ipc.open_stream(sys.argv[2]).read_all()\n    \
    ours.validate(full=True)\n    \
    assert ours.num_rows == ref.num_rows > 0, (ours.num_rows, ref.num_rows)\n    \
    assert ours.schema.equals(ref.schema, check_metadata=True)\n    \
    for name in ref.column_names:\n        \
        assert ours[name].equals(ref[name]), name\n    \
    print(len(ref.column_names), 'columns equal')\n";

/// Arrow C++ reads a stream made of the schema message, the device message's bytes and the
/// end-of-stream marker, and finds the batch arrow-rs's own stream writer writes.
#[test]
fn pyarrow_reads_device_ipc_messages() {
    if !needs_pyarrow() {
        return;
    }
    let batch = every_type_batch();
    let dir = scratch("pyarrow-ipc");
    let reference = dir.join("arrow-rs.arrows");
    write_reference(&batch, &reference);
    each_device(|device, stream| {
        let on_device = htod_async(&batch, ipc::default_message_resource(device), stream).unwrap();
        let message = ipc::write_message(&on_device, stream).unwrap();
        assert!(message.num_dictionaries() > 0, "the corpus has dictionary columns");
        let mut bytes = ipc::encode_schema(&batch.schema());
        bytes.extend_from_slice(&message.buffer().to_vec(stream).unwrap());
        bytes.extend_from_slice(&[0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0]);
        let ours = dir.join(format!("{device}.arrows"));
        std::fs::write(&ours, bytes).unwrap();
        let script = format!("{SAME_AS_REFERENCE}import sys\nsame(sys.argv[1])\n");
        let stdout = python(&script, &[&ours, &reference]);
        eprintln!("{device}: {stdout}");
    });
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Another process opens the allocation of a device message by its serialized CUDA IPC handle,
/// read as Arrow C++ reads one (an `int64` size, then the 64-byte `CUipcMemHandle`), copies the
/// message out, and pyarrow reads it.
#[test]
fn another_process_opens_messages_by_cuda_ipc_handle() {
    if !arrow_cuda::device::cuda_device_count().is_ok_and(|n| n > 0) {
        eprintln!("skipped: no CUDA device");
        return;
    }
    let has_cupy = Command::new("python3")
        .args(["-c", "import cupy, pyarrow"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !has_cupy {
        eprintln!("skipped: CuPy and pyarrow are not installed");
        return;
    }
    let device = Device::Cuda(0);
    let stream = Stream::new(device).unwrap();
    let batch = every_type_batch();
    let on_device = htod_async(&batch, ipc::default_message_resource(device), &stream).unwrap();
    let message = ipc::write_message(&on_device, &stream).unwrap();
    message.ready().synchronize().unwrap();
    let handle = IpcMemHandle::export(message.buffer()).unwrap();
    let dir = scratch("cuda-ipc");
    let (handle_file, schema_file, reference) = (dir.join("handle"), dir.join("schema"), dir.join("arrow-rs.arrows"));
    std::fs::write(&handle_file, handle.serialize()).unwrap();
    std::fs::write(&schema_file, ipc::encode_schema(&batch.schema())).unwrap();
    write_reference(&batch, &reference);
    let (offset, len) = (message.buffer().offset(), message.buffer().len());
    let script = format!(
        "{SAME_AS_REFERENCE}import struct, sys, numpy, cupy\n\
         raw = open(sys.argv[1], 'rb').read()\n\
         assert len(raw) == 72, len(raw)\n\
         size, handle = struct.unpack('<q', raw[:8])[0], raw[8:]\n\
         assert size >= {offset} + {len}, size\n\
         ptr = cupy.cuda.runtime.ipcOpenMemHandle(handle)\n\
         host = numpy.empty({len}, numpy.uint8)\n\
         cupy.cuda.runtime.memcpy(host.ctypes.data, ptr + {offset}, {len}, cupy.cuda.runtime.memcpyDeviceToHost)\n\
         cupy.cuda.runtime.ipcCloseMemHandle(ptr)\n\
         eos = bytes([255, 255, 255, 255, 0, 0, 0, 0])\n\
         same(open(sys.argv[3], 'rb').read() + host.tobytes() + eos)\n"
    );
    let stdout = python(&script, &[&handle_file, &reference, &schema_file]);
    eprintln!("{stdout}");
    assert!(stdout.contains("columns equal"));
    std::fs::remove_dir_all(&dir).unwrap();
}
