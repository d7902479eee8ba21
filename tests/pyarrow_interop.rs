//! pyarrow (Arrow C++) interop:
//!
//! - through the C Device Data Interface: builds the `ffi-helper` C library and runs
//!   `tests/pyarrow_interop.py` against it;
//! - through Arrow IPC: Arrow C++ reads the device messages of every type (dictionaries included),
//!   copied to the host, as it reads arrow-rs's stream of the same batch.
//!
//! Without pyarrow each test says `skipped: pyarrow not installed` and passes, except in CI (the
//! `CI` variable set), where it fails.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use arrow_cuda::ipc;
use arrow_cuda::transfer::htod_async;
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

/// Builds `ffi-helper` into this workspace's target directory and returns the path of the cdylib,
/// as cargo reports it.
fn build_helper() -> PathBuf {
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

/// Arrow C++ reads a stream made of the schema message, the device message's bytes and the
/// end-of-stream marker, and finds the batch arrow-rs's own stream writer writes.
#[test]
fn pyarrow_reads_device_ipc_messages() {
    if !needs_pyarrow() {
        return;
    }
    let batch = every_type_batch();
    let dir = std::env::temp_dir().join(format!("arrow-cuda-pyarrow-ipc-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let reference = dir.join("arrow-rs.arrows");
    let mut writer =
        arrow_ipc::writer::StreamWriter::try_new(std::fs::File::create(&reference).unwrap(), &batch.schema()).unwrap();
    writer.write(&batch).unwrap();
    writer.finish().unwrap();
    each_device(|device, stream| {
        let on_device = htod_async(&batch, ipc::default_message_resource(device), stream).unwrap();
        let message = ipc::write_message(&on_device, stream).unwrap();
        assert!(message.dictionaries() > 0, "the corpus has dictionary columns");
        let mut bytes = ipc::encode_schema(&batch.schema());
        bytes.extend_from_slice(&message.buffer().to_vec(stream).unwrap());
        bytes.extend_from_slice(&[0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0]);
        let ours = dir.join(format!("{device}.arrows"));
        std::fs::write(&ours, bytes).unwrap();
        let script = "import sys, pyarrow as pa\n\
            ours = pa.ipc.open_stream(sys.argv[1]).read_all()\n\
            ref = pa.ipc.open_stream(sys.argv[2]).read_all()\n\
            ours.validate(full=True)\n\
            assert ours.num_rows == ref.num_rows > 0, (ours.num_rows, ref.num_rows)\n\
            assert ours.schema.equals(ref.schema, check_metadata=True)\n\
            for name in ref.column_names:\n    \
                assert ours[name].equals(ref[name]), name\n\
            print(len(ref.column_names), 'columns equal')\n";
        let output = Command::new("python3")
            .args(["-c", script])
            .arg(&ours)
            .arg(&reference)
            .output()
            .expect("run python3");
        let stdout = String::from_utf8_lossy(&output.stdout);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(output.status.success(), "{device}: pyarrow failed:\n{stdout}\n{stderr}");
        eprintln!("{device}: {stdout}");
    });
    std::fs::remove_dir_all(&dir).unwrap();
}
