//! Stages TPC-H `lineitem` on the GPU as a DataFusion table and runs TPC-H Q6 on it, timed.
//!
//! The scan evaluates Q6's filters on the device and copies only the selected rows of the two
//! columns the query reads to the host. Without a GPU the table lives on the CPU device, which
//! runs the same plan with arrow-rs kernels.
//!
//! The data comes from tpchgen-arrow and the query from `workloads/tpch/q6.sql`, through the
//! workspace's `arrow-cuda-workloads` crate.
//!
//! Run with `cargo run --release --example 06_datafusion_sql --features datafusion [scale factor]`
//! (default 0.1).

use std::sync::Arc;
use std::time::Instant;

use arrow_cuda::datafusion::{GpuTable, LoadOptions, default_device};
use arrow_cuda_workloads::tpch;
use datafusion::arrow::util::pretty::pretty_format_batches;
use datafusion::prelude::{SessionConfig, SessionContext};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let sf: f64 = std::env::args().nth(1).map(|s| s.parse()).transpose()?.unwrap_or(0.1);
    let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
    let device = default_device();
    if !arrow_cuda::device::cuda_available() {
        println!("no CUDA device: the table lives on the CPU device");
    }

    // Generate lineitem in one partition per core.
    let t = Instant::now();
    let lineitem = tpch::table("lineitem", sf, cores, 65536)?;
    println!(
        "generated lineitem at SF {sf}: {} rows in {:.2?}",
        lineitem.rows(),
        t.elapsed()
    );

    let t = Instant::now();
    let options = LoadOptions::new().with_device(device);
    let table = GpuTable::try_new(lineitem.schema, lineitem.partitions, &options)?;
    let staged = t.elapsed();
    println!(
        "staged {:.1} MB on {device} in {staged:.2?} ({:.1} GB/s)",
        table.size_in_bytes() as f64 / 1e6,
        table.size_in_bytes() as f64 / staged.as_secs_f64() / 1e9
    );

    let ctx = SessionContext::new_with_config(SessionConfig::new().with_target_partitions(cores));
    ctx.register_table("lineitem", Arc::new(table))?;
    let q6 = tpch::query("q6").ok_or("no TPC-H Q6")?;
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async {
        let plan = ctx.sql(&format!("explain {q6}")).await?.collect().await?;
        println!("{}", pretty_format_batches(&plan)?);
        for run in 1..=3 {
            let t = Instant::now();
            let out = ctx.sql(q6).await?.collect().await?;
            let took = t.elapsed();
            if run == 1 {
                println!("{}", pretty_format_batches(&out)?);
            }
            println!("Q6 run {run}: {took:.2?}");
        }
        Ok::<_, Box<dyn std::error::Error>>(())
    })
}
