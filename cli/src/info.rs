//! `arrow-cuda info`.

use arrow_cuda::memory::pinned::PinnedPool;
use arrow_cuda::{Device, DeviceBuffer, MemoryResource, Result, Stream, device};

const GIB: f64 = (1u64 << 30) as f64;

pub fn run() -> Result<()> {
    println!("arrow-cuda {}", env!("CARGO_PKG_VERSION"));
    println!(
        "device cpu: host memory ({} threads)",
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    let gpus = device::cuda_devices()?;
    let (major, minor) = device::driver_version()?;
    println!("driver: CUDA {major}.{minor}");
    for d in gpus {
        println!(
            "device cuda:{}: {}, {}, compute {}.{}, {:.1} GiB total, {:.1} GiB free, PCI {}, memory pools: {}",
            d.ordinal,
            d.name,
            d.uuid,
            d.compute_capability.0,
            d.compute_capability.1,
            d.total_memory as f64 / GIB,
            d.free_memory as f64 / GIB,
            d.pci_bus_id,
            if d.memory_pools { "yes" } else { "no" }
        );
        let (htod, dtoh) = link_bandwidth(d.ordinal)?;
        println!("  link, pinned 256 MiB copies: host->device {htod:.1} GB/s, device->host {dtoh:.1} GB/s");
    }
    Ok(())
}

/// Best of repeated 256 MiB copies between pinned host memory and the device, about 0.5 s each way.
fn link_bandwidth(ordinal: usize) -> Result<(f64, f64)> {
    const LEN: usize = 256 << 20;
    let stream = Stream::new(Device::Cuda(ordinal))?;
    let mut host = PinnedPool::shared(MemoryResource::PinnedHost(ordinal))?.take(LEN)?;
    let mut gpu = DeviceBuffer::alloc(MemoryResource::DevicePool(ordinal), LEN, &stream)?;
    let htod = crate::best_time(0.5, || gpu.copy_from(0, &host, &stream))?;
    let dtoh = crate::best_time(0.5, || host.copy_from(0, &gpu, &stream))?;
    Ok((LEN as f64 / htod / 1e9, LEN as f64 / dtoh / 1e9))
}
