//! pyarrow interop through the C Device Data Interface: builds the `ffi-helper` C library and runs
//! `tests/pyarrow_interop.py` against it. Without pyarrow the test says `skipped: pyarrow not
//! installed` and passes, except in CI (the `CI` variable set), where it fails.

use std::path::{Path, PathBuf};
use std::process::Command;

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

#[test]
fn pyarrow_round_trips_through_arrow_cuda() {
    if !pyarrow_available() {
        if std::env::var_os("CI").is_some() {
            panic!("pyarrow is not installed, and CI must run this test (`python3 -m pip install pyarrow`)");
        }
        eprintln!("skipped: pyarrow not installed");
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
