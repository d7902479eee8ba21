//! `arrow-cuda`: devices, transfers, queries and IPC from the command line.

mod bench;
mod info;
mod ipc;
mod prompt;
mod query;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Apache Arrow data on NVIDIA GPUs.
#[derive(Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Devices, memory, driver, and the link's bandwidth measured in about a second.
    Info,
    /// Transfer, IPC and TPC-H benchmarks, each beside a comparison, as one table.
    Bench(bench::Args),
    /// The consumer process of `bench`'s IPC rows (started by `bench` itself).
    #[command(hide = true)]
    BenchPeer(bench::PeerArgs),
    /// Stage TPC-H (generated here) or Parquet / CSV files on the GPU and run SQL through DataFusion.
    Query(query::Args),
    /// Send record batches to `recv` processes over a Unix socket; bodies stay on the device.
    Send(ipc::SendArgs),
    /// Receive the batches `send` sends, without copying them through host memory.
    Recv(ipc::RecvArgs),
}

/// Which device a command runs on.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum DeviceArg {
    /// CUDA device 0.
    Cuda,
    /// The CPU device.
    Cpu,
}

impl DeviceArg {
    /// The device, or the reason there is no GPU.
    fn resolve(self) -> arrow_cuda::Result<arrow_cuda::Device> {
        match self {
            DeviceArg::Cpu => Ok(arrow_cuda::Device::Cpu),
            DeviceArg::Cuda => {
                arrow_cuda::device::cuda_device_count()?;
                Ok(arrow_cuda::Device::Cuda(0))
            }
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let outcome = match cli.command {
        // With no command, say what there is (as `cargo` does).
        None => {
            let _ = <Cli as clap::CommandFactory>::command().print_help();
            Ok(())
        }
        Some(Command::Info) => info::run().map_err(|e| e.to_string()),
        Some(Command::Bench(args)) => bench::run(&args).map_err(|e| e.to_string()),
        Some(Command::BenchPeer(args)) => bench::peer(&args).map_err(|e| e.to_string()),
        Some(Command::Query(args)) => query::run(&args).map_err(|e| e.to_string()),
        Some(Command::Send(args)) => ipc::send(&args).map_err(|e| e.to_string()),
        Some(Command::Recv(args)) => ipc::recv(&args).map_err(|e| e.to_string()),
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("arrow-cuda: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Measures `f` over at least `min` seconds of repeats (and 3 runs); returns the best seconds per run.
fn best_time(min: f64, mut f: impl FnMut() -> arrow_cuda::Result<()>) -> arrow_cuda::Result<f64> {
    let start = std::time::Instant::now();
    let mut best = f64::INFINITY;
    let mut runs = 0;
    while runs < 3 || start.elapsed().as_secs_f64() < min {
        let t = std::time::Instant::now();
        f()?;
        best = best.min(t.elapsed().as_secs_f64());
        runs += 1;
    }
    Ok(best)
}
