//! Device lanes: a few streams per device behind a semaphore, so that a device's concurrency is
//! bounded whatever DataFusion's `target_partitions` is.

use std::sync::Mutex;

use ::datafusion::common::DataFusionError;
use tokio::sync::Semaphore;

use super::error::DfResult;
use crate::device::{Device, Stream};
use crate::error::Error;

/// A small pool of streams on one device, with a semaphore bounding its concurrent users.
#[derive(Debug)]
pub(crate) struct DeviceLane {
    device: Device,
    permits: Semaphore,
    streams: Mutex<Vec<Stream>>,
}

impl DeviceLane {
    pub(crate) fn new(device: Device, streams: usize) -> Result<Self, Error> {
        let pool = (0..streams)
            .map(|_| Stream::new(device))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(DeviceLane {
            device,
            permits: Semaphore::new(streams),
            streams: Mutex::new(pool),
        })
    }

    /// Waits for a free stream of this device.
    pub(crate) async fn acquire(&self) -> DfResult<StreamLease<'_>> {
        let permit = self
            .permits
            .acquire()
            .await
            .map_err(|e| DataFusionError::Execution(format!("device lane closed: {e}")))?;
        let stream = self.streams.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let stream = match stream {
            Some(s) => s,
            None => Stream::new(self.device)?,
        };
        Ok(StreamLease {
            lane: self,
            stream: Some(stream),
            _permit: permit,
        })
    }
}

/// A stream borrowed from a [`DeviceLane`]; it goes back to the pool when dropped.
pub(crate) struct StreamLease<'a> {
    lane: &'a DeviceLane,
    stream: Option<Stream>,
    _permit: tokio::sync::SemaphorePermit<'a>,
}

impl StreamLease<'_> {
    pub(crate) fn stream(&self) -> &Stream {
        self.stream.as_ref().expect("a lease holds its stream until dropped")
    }
}

impl Drop for StreamLease<'_> {
    fn drop(&mut self) {
        if let Some(s) = self.stream.take() {
            self.lane.streams.lock().unwrap_or_else(|p| p.into_inner()).push(s);
        }
    }
}
