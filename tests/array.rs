//! The safe constructors of device arrays and batches: what they refuse.

mod common;

use std::sync::Arc;

use arrow_cuda::transfer::dtoh;
use arrow_cuda::{Device, DeviceArrayData, DeviceBuffer, DeviceRecordBatch, Event, MemoryResource, Stream};
use arrow_schema::{DataType, Field, Schema};
use common::invalid_data;

/// An empty Int32 array whose (zero-length) buffer belongs to `device`. A zero-length buffer needs
/// no allocation, so this works for a CUDA device on a machine without a GPU.
fn empty_int32_on(device: Device) -> DeviceArrayData {
    let values = DeviceBuffer::alloc(MemoryResource::default_for(device), 0, &Stream::cpu()).unwrap();
    assert_eq!(values.device(), device);
    DeviceArrayData::try_new(DataType::Int32, 0, 0, Some(0), None, vec![values], vec![]).unwrap()
}

#[test]
fn batches_with_columns_on_two_devices_are_refused() {
    let schema = Arc::new(Schema::new(vec![
        Field::new("a", DataType::Int32, true),
        Field::new("b", DataType::Int32, true),
    ]));
    let cpu = empty_int32_on(Device::Cpu);
    let cuda = empty_int32_on(Device::Cuda(0));
    let message = invalid_data(
        "a CPU and a CUDA column",
        DeviceRecordBatch::try_new(schema.clone(), vec![cpu.clone(), cuda], 0, Event::completed()),
    );
    assert!(message.contains("cpu") && message.contains("cuda:0"), "{message}");
    // Pinned host memory is another device too, though the CPU can read it.
    let pinned = empty_int32_on(Device::CudaHost(0));
    invalid_data(
        "a CPU and a CUDA_HOST column",
        DeviceRecordBatch::try_new(schema.clone(), vec![pinned, cpu.clone()], 0, Event::completed()),
    );
    // One device is fine, and so is a column without buffers beside any device.
    let batch = DeviceRecordBatch::try_new(schema, vec![cpu.clone(), cpu], 0, Event::completed()).unwrap();
    assert_eq!(dtoh(&batch, &Stream::cpu()).unwrap().num_rows(), 0);
    let nulls = DeviceArrayData::try_new(DataType::Null, 0, 0, Some(0), None, vec![], vec![]).unwrap();
    let schema = Arc::new(Schema::new(vec![
        Field::new("n", DataType::Null, true),
        Field::new("b", DataType::Int32, true),
    ]));
    let batch = DeviceRecordBatch::try_new(
        schema,
        vec![nulls, empty_int32_on(Device::Cuda(0))],
        0,
        Event::completed(),
    );
    assert_eq!(batch.unwrap().device(), Device::Cuda(0));
}
