//! Moves a polars-arrow record batch to the GPU and back.
//!
//! The batch converts to arrow-rs through the Arrow C Data Interface without a host copy, travels
//! to the device in one packed upload, and comes back the same way. Without a GPU it uses the CPU
//! device, which runs the same code with `memcpy`.
//!
//! Run with `cargo run --example 05_polars --features polars`.

use std::sync::Arc;

use arrow_cuda::polars::{batch_from_device, batch_to_device};
use arrow_cuda::{Device, Stream};
use polars_arrow::array::{Array, PrimitiveArray, StructArray, Utf8ViewArray};
use polars_arrow::datatypes::{ArrowDataType, ArrowSchema, Field, TimeUnit};
use polars_arrow::record_batch::RecordBatchT;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let rows = 100_000;
    let ids = PrimitiveArray::<i64>::from_vec((0..rows as i64).collect());
    let names = Utf8ViewArray::from_slice(
        (0..rows)
            .map(|i| (i % 10 != 3).then(|| format!("customer number {i}")))
            .collect::<Vec<_>>(),
    );
    let when = PrimitiveArray::<i64>::from_vec((0..rows as i64).map(|i| 1_700_000_000_000 + i * 1000).collect())
        .to(ArrowDataType::Timestamp(TimeUnit::Millisecond, Some("UTC".into())));
    let point_type = ArrowDataType::Struct(vec![
        Field::new("x".into(), ArrowDataType::Float64, false),
        Field::new("y".into(), ArrowDataType::Float64, false),
    ]);
    let xs = PrimitiveArray::<f64>::from_vec((0..rows).map(|i| i as f64 * 0.5).collect());
    let ys = PrimitiveArray::<f64>::from_vec((0..rows).map(|i| -(i as f64)).collect());
    let points = StructArray::new(point_type.clone(), rows, vec![xs.boxed(), ys.boxed()], None);

    let schema: ArrowSchema = [
        Field::new("id".into(), ArrowDataType::Int64, false),
        Field::new("name".into(), ArrowDataType::Utf8View, true),
        Field::new("when".into(), when.dtype().clone(), false),
        Field::new("point".into(), point_type, false),
    ]
    .into_iter()
    .collect();
    let columns: Vec<Box<dyn Array>> = vec![ids.boxed(), names.boxed(), when.boxed(), points.boxed()];
    let batch = RecordBatchT::try_new(rows, Arc::new(schema), columns)?;

    let device = match arrow_cuda::device::cuda_device_count() {
        Ok(n) if n > 0 => Device::Cuda(0),
        _ => {
            println!("no CUDA device: using the CPU device instead");
            Device::Cpu
        }
    };
    let stream = Stream::new(device)?;

    let on_device = batch_to_device(&batch, device, &stream)?;
    println!(
        "moved a polars-arrow batch of {} rows x {} columns to {}: {} bytes there",
        on_device.num_rows(),
        on_device.num_columns(),
        on_device.device(),
        on_device.size_in_bytes()
    );
    for (field, column) in on_device.schema().fields().iter().zip(on_device.columns()) {
        println!(
            "  {:<6} {:>9} bytes  {}",
            field.name(),
            column.size_in_bytes(),
            column.data_type()
        );
    }

    let back = batch_from_device(&on_device, &stream)?;
    println!(
        "copied it back to the host as a polars-arrow batch of {} rows",
        back.height()
    );
    if back != batch {
        return Err("the batch changed on the way".into());
    }
    println!("the batch that came back equals the original");
    Ok(())
}
