//! The safe constructors of device arrays and batches: what they refuse (buffers on two devices, a
//! layout that disagrees with the type) and that everything they accept exports without a panic.

mod common;

use std::sync::Arc;

use arrow_array::{Array, Int32Array, StringViewArray};
use arrow_cuda::ffi::{export_array, import_array};
use arrow_cuda::transfer::{dtoh, dtoh_array, htod_array};
use arrow_cuda::{Device, DeviceArrayData, DeviceBuffer, DeviceRecordBatch, Event, MemoryResource, Stream};
use arrow_schema::{DataType, Field, Fields, Schema, UnionFields, UnionMode};
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

#[test]
fn arrays_whose_layout_disagrees_with_their_type_are_refused() {
    let stream = Stream::cpu();
    let buffer = |bytes: &[u8]| DeviceBuffer::from_host(bytes, MemoryResource::Host, &stream).unwrap();
    let ints = || buffer(&[0; 16]);
    let int32 = || DeviceArrayData::try_new(DataType::Int32, 4, 0, Some(0), None, vec![ints()], vec![]).unwrap();
    let try_new = |dt: DataType, buffers: Vec<DeviceBuffer>, children: Vec<DeviceArrayData>| {
        DeviceArrayData::try_new(dt, 4, 0, Some(0), None, buffers, children)
    };
    let views = DataType::Utf8View;
    let dictionary = DataType::Dictionary(Box::new(DataType::Int32), Box::new(DataType::Int32));
    let list = DataType::List(Arc::new(Field::new("item", DataType::Int32, true)));
    let pair = DataType::Struct(Fields::from(vec![
        Field::new("a", DataType::Int32, true),
        Field::new("b", DataType::Int32, true),
    ]));
    let cases: Vec<(&str, arrow_cuda::Result<DeviceArrayData>)> = vec![
        ("Int32 without buffers", try_new(DataType::Int32, vec![], vec![])),
        (
            "Int32 with two buffers",
            try_new(DataType::Int32, vec![ints(), ints()], vec![]),
        ),
        (
            "Int32 with a child",
            try_new(DataType::Int32, vec![ints()], vec![int32()]),
        ),
        ("a view array without buffers", try_new(views, vec![], vec![])),
        (
            "a dictionary without values",
            try_new(dictionary.clone(), vec![ints()], vec![]),
        ),
        (
            "a dictionary with Utf8 values for Int32",
            try_new(dictionary, vec![ints()], vec![empty_strings()]),
        ),
        ("a list without a child", try_new(list, vec![buffer(&[0; 20])], vec![])),
        (
            "a struct with one child of two",
            try_new(pair.clone(), vec![], vec![int32()]),
        ),
        (
            "a struct with a Utf8 child for Int32",
            try_new(pair, vec![], vec![int32(), empty_strings()]),
        ),
        (
            "FixedSizeBinary(-1)",
            try_new(DataType::FixedSizeBinary(-1), vec![ints()], vec![]),
        ),
        (
            "FixedSizeList(-1)",
            try_new(
                DataType::FixedSizeList(Arc::new(Field::new("item", DataType::Int32, true)), -1),
                vec![],
                vec![int32()],
            ),
        ),
        (
            "a Null array with a validity bitmap",
            DeviceArrayData::try_new(DataType::Null, 4, 0, None, Some(buffer(&[0])), vec![], vec![]),
        ),
    ];
    for (what, result) in cases {
        invalid_data(what, result);
    }
}

/// An empty Utf8 array on the CPU.
fn empty_strings() -> DeviceArrayData {
    let offsets = DeviceBuffer::from_host(&[0; 4], MemoryResource::Host, &Stream::cpu()).unwrap();
    let values = DeviceBuffer::from_host(&[], MemoryResource::Host, &Stream::cpu()).unwrap();
    DeviceArrayData::try_new(DataType::Utf8, 0, 0, Some(0), None, vec![offsets, values], vec![]).unwrap()
}

#[test]
fn assembled_arrays_export_and_come_back() {
    // Parts taken from uploaded arrays and assembled again pass `try_new`, export and import.
    let stream = Stream::cpu();
    for array in [
        Arc::new(Int32Array::from(vec![Some(1), None, Some(3)])) as Arc<dyn Array>,
        Arc::new(StringViewArray::from(vec![
            "a string longer than twelve bytes",
            "short",
        ])),
    ] {
        let up = htod_array(array.as_ref(), Device::Cpu, &stream).unwrap();
        let assembled = DeviceArrayData::try_new(
            up.data_type().clone(),
            up.len(),
            up.offset(),
            up.null_count(),
            up.nulls().cloned(),
            up.buffers().to_vec(),
            up.children().to_vec(),
        )
        .unwrap();
        let ffi = export_array(&assembled, &Event::completed(), &stream).unwrap();
        // SAFETY: a struct this crate just exported.
        let (back, _) = unsafe { import_array(ffi, array.data_type(), &stream) }.unwrap();
        assert_eq!(dtoh_array(&back, &stream).unwrap().as_ref(), array.as_ref());
    }
}

#[test]
fn arrays_whose_buffers_are_too_small_are_refused() {
    // Each case is one byte (or one element) short of what `offset + len` elements need; the
    // message names the buffer. Exported, any of them would send a C consumer out of bounds.
    let stream = Stream::cpu();
    let buffer = |n: usize| DeviceBuffer::from_host(&vec![0; n], MemoryResource::Host, &stream).unwrap();
    let array =
        |dt: DataType, len: usize, offset: usize, buffers: Vec<DeviceBuffer>, children: Vec<DeviceArrayData>| {
            DeviceArrayData::try_new(dt, len, offset, None, None, buffers, children)
        };
    let int32 = |len: usize| array(DataType::Int32, len, 0, vec![buffer(4 * len)], vec![]).unwrap();
    let item = Arc::new(Field::new("item", DataType::Int32, true));
    let pair = Fields::from(vec![
        Field::new("a", DataType::Int32, true),
        Field::new("b", DataType::Int32, true),
    ]);
    let union_fields = UnionFields::try_new(vec![0, 1], pair.iter().map(|f| f.as_ref().clone())).unwrap();
    let run_ends = Arc::new(Field::new("run_ends", DataType::Int32, false));
    let values = Arc::new(Field::new("values", DataType::Int32, true));
    let cases: Vec<(&str, &str, arrow_cuda::Result<DeviceArrayData>)> = vec![
        (
            "Int32 of 4 in 15 bytes",
            "values",
            array(DataType::Int32, 4, 0, vec![buffer(15)], vec![]),
        ),
        (
            "Int32 of 2 at offset 2 in 12 bytes",
            "values",
            array(DataType::Int32, 2, 2, vec![buffer(12)], vec![]),
        ),
        (
            "Decimal128 of 4 in 63 bytes",
            "values",
            array(DataType::Decimal128(38, 2), 4, 0, vec![buffer(63)], vec![]),
        ),
        (
            "a validity bitmap of 8 bits for 9 elements",
            "validity",
            DeviceArrayData::try_new(DataType::Int32, 9, 0, None, Some(buffer(1)), vec![buffer(36)], vec![]),
        ),
        (
            "Boolean of 9 in 1 byte",
            "values",
            array(DataType::Boolean, 9, 0, vec![buffer(1)], vec![]),
        ),
        (
            "FixedSizeBinary(3) of 4 in 11 bytes",
            "values",
            array(DataType::FixedSizeBinary(3), 4, 0, vec![buffer(11)], vec![]),
        ),
        (
            "Utf8 of 4 with 4 offsets",
            "offsets",
            array(DataType::Utf8, 4, 0, vec![buffer(16), buffer(0)], vec![]),
        ),
        (
            "Utf8 of 1 at offset 3 with 4 offsets",
            "offsets",
            array(DataType::Utf8, 1, 3, vec![buffer(16), buffer(0)], vec![]),
        ),
        (
            "Utf8 of 0 at offset 1 without offsets",
            "offsets",
            array(DataType::Utf8, 0, 1, vec![buffer(0), buffer(0)], vec![]),
        ),
        (
            "LargeBinary of 4 with 4 offsets",
            "offsets",
            array(DataType::LargeBinary, 4, 0, vec![buffer(32), buffer(0)], vec![]),
        ),
        (
            "Utf8View of 4 with 3 views",
            "views",
            array(DataType::Utf8View, 4, 0, vec![buffer(48), buffer(0)], vec![]),
        ),
        (
            "List of 4 with 4 offsets",
            "offsets",
            array(DataType::List(item.clone()), 4, 0, vec![buffer(16)], vec![int32(0)]),
        ),
        (
            "ListView of 4 with 3 sizes",
            "sizes",
            array(
                DataType::ListView(item.clone()),
                4,
                0,
                vec![buffer(16), buffer(12)],
                vec![int32(0)],
            ),
        ),
        (
            "FixedSizeList(2) of 4 over 7 values",
            "child",
            array(DataType::FixedSizeList(item.clone(), 2), 4, 0, vec![], vec![int32(7)]),
        ),
        (
            "a struct of 3 at offset 1 over a child of 3",
            "child",
            array(DataType::Struct(pair.clone()), 3, 1, vec![], vec![int32(4), int32(3)]),
        ),
        (
            "a sparse union of 4 with 3 type ids",
            "type ids",
            array(
                DataType::Union(union_fields.clone(), UnionMode::Sparse),
                4,
                0,
                vec![buffer(3)],
                vec![int32(4), int32(4)],
            ),
        ),
        (
            "a sparse union of 4 over a child of 3",
            "child",
            array(
                DataType::Union(union_fields.clone(), UnionMode::Sparse),
                4,
                0,
                vec![buffer(4)],
                vec![int32(4), int32(3)],
            ),
        ),
        (
            "a dense union of 4 with 3 offsets",
            "offsets",
            array(
                DataType::Union(union_fields, UnionMode::Dense),
                4,
                0,
                vec![buffer(4), buffer(12)],
                vec![int32(0), int32(0)],
            ),
        ),
        (
            "a dictionary of 4 with 3 Int16 keys",
            "keys",
            array(
                DataType::Dictionary(Box::new(DataType::Int16), Box::new(DataType::Int32)),
                4,
                0,
                vec![buffer(6)],
                vec![int32(1)],
            ),
        ),
        (
            "run-end encoded with 2 run ends and 1 value",
            "values",
            array(
                DataType::RunEndEncoded(run_ends, values),
                2,
                0,
                vec![],
                vec![int32(2), int32(1)],
            ),
        ),
        (
            "Int32 whose offset + length overflows",
            "overflow",
            array(DataType::Int32, usize::MAX, 1, vec![buffer(0)], vec![]),
        ),
        (
            "FixedSizeBinary(i32::MAX) whose size overflows",
            "overflow",
            array(
                DataType::FixedSizeBinary(i32::MAX),
                usize::MAX / 4,
                0,
                vec![buffer(0)],
                vec![],
            ),
        ),
    ];
    for (what, names, result) in cases {
        let message = invalid_data(what, result);
        assert!(message.contains(names), "{what}: {message:?} does not name the {names}");
    }
}

#[test]
fn arrays_whose_buffers_are_just_large_enough_are_accepted() {
    let stream = Stream::cpu();
    let buffer = |n: usize| DeviceBuffer::from_host(&vec![0; n], MemoryResource::Host, &stream).unwrap();
    let item = Arc::new(Field::new("item", DataType::Int32, true));
    let int32 =
        |len: usize| DeviceArrayData::try_new(DataType::Int32, len, 0, None, None, vec![buffer(4 * len)], vec![]);
    let arrays = vec![
        int32(4),
        DeviceArrayData::try_new(
            DataType::Int32,
            2,
            2,
            Some(0),
            Some(buffer(1)),
            vec![buffer(16)],
            vec![],
        ),
        DeviceArrayData::try_new(DataType::Boolean, 9, 0, None, None, vec![buffer(2)], vec![]),
        DeviceArrayData::try_new(DataType::Utf8, 1, 3, None, None, vec![buffer(20), buffer(0)], vec![]),
        // An empty array may leave its offsets out, as arrow-rs allows.
        DeviceArrayData::try_new(DataType::Utf8, 0, 0, None, None, vec![buffer(0), buffer(0)], vec![]),
        DeviceArrayData::try_new(
            DataType::List(item.clone()),
            0,
            0,
            None,
            None,
            vec![buffer(0)],
            vec![int32(0).unwrap()],
        ),
        DeviceArrayData::try_new(
            DataType::FixedSizeList(item, 2),
            3,
            1,
            None,
            None,
            vec![],
            vec![int32(8).unwrap()],
        ),
        DeviceArrayData::try_new(DataType::FixedSizeBinary(0), 4, 0, None, None, vec![buffer(0)], vec![]),
    ];
    for (i, array) in arrays.into_iter().enumerate() {
        let array = array.unwrap_or_else(|e| panic!("array {i}: {e}"));
        export_array(&array, &Event::completed(), &stream).unwrap_or_else(|e| panic!("array {i}: {e}"));
    }
}
