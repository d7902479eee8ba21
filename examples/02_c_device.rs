//! Exports a device batch through the Arrow C Device Data Interface and imports it back, as any
//! consumer (cudf, Arrow C++, nanoarrow, pyarrow) would receive it; then streams a few batches
//! through an `ArrowDeviceArrayStream`.
//!
//! `cargo run --release --example 02_c_device`. Without a GPU it runs on the CPU device.

use std::sync::Arc;

use arrow_array::{ArrayRef, Int32Array, ListArray, RecordBatch, StringArray, types::Int32Type};
use arrow_cuda::ffi::{DeviceArrayStreamReader, export_batch, export_stream, import_batch};
use arrow_cuda::{Device, DeviceRecordBatch, Stream};

fn main() -> arrow_cuda::Result<()> {
    let device = if arrow_cuda::device::cuda_available() {
        Device::Cuda(0)
    } else {
        Device::Cpu
    };
    println!("device: {device}");
    let batch = RecordBatch::try_from_iter([
        ("id", Arc::new(Int32Array::from(vec![1, 2, 3])) as ArrayRef),
        (
            "tag",
            Arc::new(StringArray::from(vec![Some("x"), None, Some("z")])) as ArrayRef,
        ),
        (
            "values",
            Arc::new(ListArray::from_iter_primitive::<Int32Type, _, _>([
                Some(vec![Some(1)]),
                None,
                Some(vec![]),
            ])) as ArrayRef,
        ),
    ])?;
    let stream = Stream::new(device)?;
    let on_device = DeviceRecordBatch::from_record_batch(&batch, device)?;

    // Export: a 128-byte ArrowDeviceArray and an ArrowSchema that own references to the memory.
    let (array, schema) = export_batch(&on_device, &stream)?;
    println!(
        "exported: device_type {}, device_id {}, sync_event {}, {} children",
        array.device_type,
        array.device_id,
        if array.sync_event.is_null() { "null" } else { "set" },
        array.array.n_children
    );
    // Import: zero-copy; the producer's release runs when the last imported view drops.
    // SAFETY: the struct comes from our own exporter, which follows the spec.
    let imported = unsafe { import_batch(array, &schema, &stream)? };
    assert_eq!(imported.to_record_batch()?, batch);
    println!("imported and copied back: equal to the original");

    // A stream of batches.
    let batches: Vec<_> = (0..3).map(|i| on_device.slice(i, 1)).collect();
    let mut raw = export_stream(
        on_device.schema().clone(),
        batches.into_iter(),
        device.device_type(),
        stream.clone(),
    );
    // SAFETY: `raw` was just made by our own exporter.
    let reader = unsafe { DeviceArrayStreamReader::from_raw(&mut raw, stream)? };
    let rows: usize = reader
        .map(|b| b.map(|b| b.num_rows()))
        .sum::<arrow_cuda::Result<usize>>()?;
    println!("read {rows} rows through an ArrowDeviceArrayStream");
    Ok(())
}
