//! A host batch packed into pinned staging by the thread that made it, and sent to its GPU later
//! in one copy by another ([`Packed`]): staging packs batches on the threads that decode and
//! prepare them, so that the thread issuing the copies does nothing else.

use arrow_array::{Array, RecordBatch};
use arrow_schema::SchemaRef;

use crate::array::DeviceRecordBatch;
use crate::device::{Device, Stream};
use crate::error::{Error, Result, try_collect};
use crate::memory::pinned::PinnedPool;
use crate::memory::{DeviceBuffer, MemoryResource, copy, stream_for};

use super::deferred::{Keep, defer_release, release_finished};
use super::layout::Layout;
use super::plan::{Plan, column_data};
use super::times::{StagingStep, StagingTimes, timed};

/// A batch's bytes, laid out as its device allocation will hold them, in pinned memory of one GPU.
pub(crate) struct Packed {
    staging: DeviceBuffer,
    layouts: Vec<Layout>,
    schema: SchemaRef,
    num_rows: usize,
    /// Kept with the staging until the copy that reads it has finished.
    hold: Keep,
}

impl Packed {
    /// Plans `batch` and packs it, on this thread, into pinned memory of CUDA device `ordinal`
    /// (taken from its pool); `hold` is kept until the copy from it has finished. The time of the
    /// steps counts in `times`.
    pub(crate) fn new(batch: &RecordBatch, ordinal: usize, hold: Keep, times: Option<&StagingTimes>) -> Result<Packed> {
        let arrays: Vec<&dyn Array> = batch.columns().iter().map(|c| c.as_ref()).collect();
        let data = column_data(&arrays);
        let mut plan = Plan::for_columns(arrays.len());
        let layouts = try_collect(arrays.iter().zip(&data).map(|(a, d)| plan.column(*a, d.as_ref())))?;
        let pool = PinnedPool::shared(MemoryResource::PinnedHost(ordinal))?;
        let mut staging = timed(times, StagingStep::Alloc, || pool.take(plan.size()))?;
        let out = staging
            .host_slice_mut()
            .ok_or_else(|| Error::Unsupported("staging is not host memory".into()))?;
        timed(times, StagingStep::Pack, || plan.fill(0, out));
        Ok(Packed {
            staging,
            layouts,
            schema: batch.schema(),
            num_rows: batch.num_rows(),
            hold,
        })
    }

    /// Copies the packed bytes into one new allocation of `resource` (on the GPU the staging is
    /// pinned for) on `stream`, and returns the device batch; its ready event completes when the
    /// copy has. Issuing the copy is all this thread does.
    pub(crate) fn send(
        self,
        resource: MemoryResource,
        stream: &Stream,
        times: Option<&StagingTimes>,
    ) -> Result<DeviceRecordBatch> {
        let device = resource.device();
        if self.staging.device() != Device::CudaHost(device.ordinal().unwrap_or(usize::MAX)) {
            return Err(Error::InvalidArgument(format!(
                "a batch packed in {} cannot be sent to {device}",
                self.staging.device()
            )));
        }
        release_finished();
        let stream = stream_for(stream, device, Device::Cpu)?;
        stream.bind()?;
        let size = self.staging.len();
        let memory = timed(times, StagingStep::Alloc, || {
            DeviceBuffer::alloc(resource, size, &stream)
        })?;
        let done = timed(times, StagingStep::Copy, || {
            if size > 0 {
                // SAFETY: both ranges are `size` bytes of live allocations; the staging is kept
                // (below) until the event recorded after the copy completes.
                unsafe {
                    copy(
                        memory.address(),
                        device,
                        self.staging.address(),
                        self.staging.device(),
                        size,
                        &stream,
                    )?
                };
            }
            stream.record()
        })?;
        let keep: Keep = Box::new((self.staging, self.hold));
        defer_release([(keep, done.clone())].into());
        let columns = try_collect(self.layouts.iter().map(|l| l.to_device(&memory)))?;
        DeviceRecordBatch::try_new(self.schema, columns, self.num_rows, done)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow_array::builder::{ListBuilder, StringBuilder};
    use arrow_array::{ArrayRef, BooleanArray, Int64Array, StringArray, StructArray};
    use arrow_schema::{DataType, Field};

    use super::*;
    use crate::device::cuda_for_tests as cuda;
    use crate::transfer::dtoh;

    /// Nulls, strings, sliced columns (offsets rebased, bitmaps shifted), a list and a struct.
    fn batch() -> RecordBatch {
        let rows = 3000;
        let strings: ArrayRef = Arc::new(StringArray::from_iter(
            (0..rows + 7).map(|i| (i % 5 != 0).then(|| format!("value {i}"))),
        ));
        let mut list = ListBuilder::new(StringBuilder::new());
        for i in 0..rows {
            for j in 0..i % 3 {
                list.values().append_value(format!("{i}.{j}"));
            }
            list.append(i % 4 != 1);
        }
        let ints: ArrayRef = Arc::new(Int64Array::from_iter(
            (0..rows as i64).map(|i| (i % 3 != 0).then_some(i * i)),
        ));
        let flags: ArrayRef = Arc::new(BooleanArray::from_iter((0..rows + 3).map(|i| Some(i % 2 == 0))));
        let nested: ArrayRef = Arc::new(StructArray::from(vec![
            (Arc::new(Field::new("i", DataType::Int64, true)), ints.clone()),
            (Arc::new(Field::new("s", DataType::Utf8, true)), strings.slice(0, rows)),
        ]));
        RecordBatch::try_from_iter([
            ("ints", ints),
            ("strings", strings.slice(7, rows)),
            ("flags", flags.slice(3, rows)),
            ("list", Arc::new(list.finish()) as ArrayRef),
            ("nested", nested),
        ])
        .unwrap()
    }

    /// A batch packed on one thread and sent from another arrives as it was.
    #[test]
    fn a_batch_packed_on_one_thread_arrives_whole_from_another() {
        let Some(device) = cuda() else { return };
        let batch = batch();
        let packed =
            std::thread::scope(|s| s.spawn(|| Packed::new(&batch, 0, Box::new(()), None)).join().unwrap()).unwrap();
        let stream = Stream::new(device).unwrap();
        let staged = packed.send(MemoryResource::default_for(device), &stream, None).unwrap();
        assert_eq!(dtoh(&staged, &stream).unwrap(), batch);
    }

    /// Staging pinned for one GPU is not sent to another device.
    #[test]
    fn a_batch_packed_for_one_gpu_is_not_sent_to_another_device() {
        if cuda().is_none() {
            return;
        }
        let packed = Packed::new(&batch(), 0, Box::new(()), None).unwrap();
        let e = packed
            .send(MemoryResource::Host, &Stream::cpu(), None)
            .expect_err("sent to the CPU");
        assert!(e.to_string().contains("cannot be sent to cpu"), "{e}");
    }
}
