//! `arrow-cuda bench`: one table of figures with the comparison beside each.

use std::sync::Arc;

use arrow_array::{ArrayRef, Float64Array, Int64Array, RecordBatch, StringArray};
use arrow_cuda::transfer::{dtoh, htod};
use arrow_cuda::{Device, DeviceBuffer, MemoryResource, Result, Stream};
use arrow_data::ArrayData;

/// Options of `arrow-cuda bench`.
#[derive(clap::Args)]
pub struct Args {
    /// Seconds to spend on each measurement.
    #[arg(long, default_value_t = 1.0)]
    seconds: f64,
    /// Rows of the large batch (16 Int64 columns; the default makes 1 GiB).
    #[arg(long, default_value_t = 8 << 20)]
    rows: usize,
}

struct Row {
    what: String,
    ours: f64,
    naive: f64,
    unit: &'static str,
}

pub fn run(args: &Args) -> Result<()> {
    arrow_cuda::device::cuda_device_count()?;
    let device = Device::Cuda(0);
    let stream = Stream::new(device)?;
    let mut rows = Vec::new();
    let large = int64_batch(args.rows);
    let small = small_batch();
    for (name, batch, unit) in [("16 x Int64", &large, "GB/s"), ("100 cols x 1,000 rows", &small, "µs")] {
        let bytes = buffers(batch).iter().map(|b| b.len()).sum::<usize>() as f64;
        let figure = |secs: f64| if unit == "GB/s" { bytes / secs / 1e9 } else { secs * 1e6 };
        let mut naive_up = naive(batch, device, &stream)?;
        let up = crate::best_time(args.seconds, || htod(batch, device, &stream).map(drop))?;
        let nup = crate::best_time(args.seconds, || naive_upload(&mut naive_up, &stream))?;
        rows.push(Row {
            what: format!("{name}: host -> device"),
            ours: figure(up),
            naive: figure(nup),
            unit,
        });
        let on_device = htod(batch, device, &stream)?;
        let down = crate::best_time(args.seconds, || dtoh(&on_device, &stream).map(drop))?;
        let ndown = crate::best_time(args.seconds, || naive_download(&naive_up, &stream))?;
        rows.push(Row {
            what: format!("{name}: device -> host"),
            ours: figure(down),
            naive: figure(ndown),
            unit,
        });
    }
    println!("| what | arrow-cuda | one copy per buffer | unit |");
    println!("|---|---:|---:|---|");
    for r in rows {
        println!("| {} | {:.1} | {:.1} | {} |", r.what, r.ours, r.naive, r.unit);
    }
    Ok(())
}

fn int64_batch(rows: usize) -> RecordBatch {
    let columns = (0..16).map(|c| {
        (
            format!("c{c}"),
            Arc::new(Int64Array::from_iter_values((0..rows as i64).map(|i| i ^ c))) as ArrayRef,
        )
    });
    RecordBatch::try_from_iter(columns).expect("valid batch")
}

fn small_batch() -> RecordBatch {
    let columns = (0..100).map(|c| {
        let array: ArrayRef = match c % 3 {
            0 => Arc::new(Int64Array::from_iter((0..1000).map(|i| (i % 7 != 0).then_some(i * c)))),
            1 => Arc::new(Float64Array::from_iter(
                (0..1000).map(|i| (i % 5 != 0).then_some(i as f64)),
            )),
            _ => Arc::new(StringArray::from_iter(
                (0..1000).map(|i| (i % 11 != 0).then(|| format!("row {i}"))),
            )),
        };
        (format!("c{c}"), array)
    });
    RecordBatch::try_from_iter(columns).expect("valid batch")
}

fn buffers(batch: &RecordBatch) -> Vec<arrow_buffer::Buffer> {
    fn walk(d: &ArrayData, out: &mut Vec<arrow_buffer::Buffer>) {
        out.extend(d.nulls().map(|n| n.buffer().clone()));
        out.extend(d.buffers().iter().cloned());
        d.child_data().iter().for_each(|c| walk(c, out));
    }
    let mut out = vec![];
    batch.columns().iter().for_each(|c| walk(&c.to_data(), &mut out));
    out
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

fn naive_download(pairs: &[(arrow_buffer::Buffer, DeviceBuffer)], stream: &Stream) -> Result<()> {
    for (_, gpu) in pairs {
        gpu.to_vec(stream)?;
    }
    Ok(())
}
