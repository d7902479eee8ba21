//! Device to host: [`dtoh`] and its variants, and the [`PendingBatch`] a copy in flight is.
//!
//! The buffers are gathered into one pinned block (see `gather`), whose ranges become the arrow
//! buffers without another copy; the block goes back to the pinned pool when the last arrow buffer
//! drops.

use arrow_array::{ArrayRef, RecordBatch, RecordBatchOptions, make_array};
use arrow_schema::SchemaRef;
use rayon::prelude::*;

use crate::array::{DeviceArrayData, DeviceRecordBatch};
use crate::device::{Event, Stream};
use crate::error::Result;
use crate::memory::DeviceBuffer;
use crate::trace::Laps;

use super::deferred::{Keep, defer_release};
use super::gather::gather;
use super::layout::Layout;

/// Copies `batch` to the host and returns it once the copy has finished and been validated.
pub fn dtoh(batch: &DeviceRecordBatch, stream: &Stream) -> Result<RecordBatch> {
    dtoh_async(batch, stream)?.wait()
}

/// Starts copying `batch` to the host; [`PendingBatch::wait`] finishes the job. The copy waits on
/// the batch's ready event on the device, without blocking the host.
pub fn dtoh_async(batch: &DeviceRecordBatch, stream: &Stream) -> Result<PendingBatch> {
    let gathered = gather(batch.columns(), batch.device(), Some(batch.ready()), stream)?;
    Ok(PendingBatch {
        schema: batch.schema().clone(),
        num_rows: batch.num_rows(),
        copy: Some(InFlight {
            memory: gathered.memory,
            _source: batch.clone(),
        }),
        layouts: gathered.layouts,
        event: gathered.event,
    })
}

/// Copies one array to the host and returns it once the copy has finished and been validated.
pub fn dtoh_array(array: &DeviceArrayData, stream: &Stream) -> Result<ArrayRef> {
    let gathered = gather(std::slice::from_ref(array), array.device(), None, stream)?;
    gathered.event.synchronize()?;
    gathered.layouts[0].to_host_array(&gathered.memory.to_arrow_buffer()?)
}

/// A device-to-host copy in flight. Dropping it without [`PendingBatch::wait`] is safe: what the
/// copy reads and writes is kept until it has finished.
#[derive(Debug)]
pub struct PendingBatch {
    schema: SchemaRef,
    num_rows: usize,
    /// `None` only once `wait` has taken it.
    copy: Option<InFlight>,
    layouts: Vec<Layout>,
    event: Event,
}

/// The two ends of a copy: the host block it writes and the device arrays it reads.
#[derive(Debug)]
struct InFlight {
    memory: DeviceBuffer,
    _source: DeviceRecordBatch,
}

impl Drop for PendingBatch {
    fn drop(&mut self) {
        if let Some(copy) = self.copy.take()
            && !self.event.is_complete().unwrap_or(false)
        {
            defer_release([(Box::new(copy) as Keep, self.event.clone())].into());
        }
    }
}

impl PendingBatch {
    /// The number of rows the batch will have.
    pub fn num_rows(&self) -> usize {
        self.num_rows
    }

    /// The event that completes when the bytes have arrived.
    pub fn event(&self) -> &Event {
        &self.event
    }

    /// Waits for the copy and builds the record batch, validating every array.
    pub fn wait(mut self) -> Result<RecordBatch> {
        let mut laps = Laps::start();
        // Views of the block; until the copy is done, `self` keeps the block (and defers its release
        // if this returns early).
        let memory = self
            .copy
            .as_ref()
            .expect("a pending batch is waited for once")
            .memory
            .to_arrow_buffer()?;
        // Arrays that need none of their bytes to be built (trusted ones of flat types: views of
        // the block, their null counts known) are built while the copy is on its way; the others
        // once it has landed. Validation reads every string: untrusted columns are validated on
        // every core. Trusted ones are built on this thread, which threads would slow down (they
        // would all count references to the one host block).
        let early = self
            .layouts
            .iter()
            .map(|l| l.to_host_array_unread(&memory))
            .collect::<Result<Vec<_>>>()?;
        laps.lap("dtoh.arrays");
        self.event.synchronize()?;
        laps.lap("dtoh.synchronize");
        let build =
            |(l, early): (&Layout, Option<ArrayRef>)| early.map_or_else(|| Ok(make_array(l.to_host(&memory)?)), Ok);
        let columns = match self.layouts.iter().all(|l| l.trusted) {
            true => self.layouts.iter().zip(early).map(build).collect::<Result<Vec<_>>>()?,
            false => self
                .layouts
                .par_iter()
                .zip(early)
                .map(build)
                .collect::<Result<Vec<_>>>()?,
        };
        laps.lap("dtoh.validate");
        // The copy is done: nothing to defer.
        self.copy = None;
        let options = RecordBatchOptions::new().with_row_count(Some(self.num_rows));
        let batch = RecordBatch::try_new_with_options(self.schema.clone(), columns, &options)?;
        laps.lap("dtoh.batch");
        Ok(batch)
    }
}

impl DeviceRecordBatch {
    /// Copies the batch to the host on its device's shared stream.
    pub fn to_record_batch(&self) -> Result<RecordBatch> {
        dtoh(self, &Stream::shared(self.device())?)
    }
}
