//! Memory that an asynchronous copy may still read or write, kept past its owner's drop until the
//! copy's event completes: the staging of an upload, the arrow buffers a DMA reads directly, the
//! host block and source arrays of a download whose [`PendingBatch`](super::PendingBatch) was
//! dropped unwaited.

use std::collections::VecDeque;
use std::sync::Mutex;

use crate::device::Event;

/// Something that must outlive an in-flight copy.
pub(crate) type Keep = Box<dyn std::any::Any + Send + Sync>;

/// Memory that a DMA may still be reading, kept until its event completes.
static DEFERRED: Mutex<Vec<(Keep, Event)>> = Mutex::new(Vec::new());

/// Keeps each item until its event completes (checked by [`release_finished`]).
pub(crate) fn defer_release(items: VecDeque<(Keep, Event)>) {
    let mut deferred = DEFERRED.lock().unwrap_or_else(|p| p.into_inner());
    deferred.extend(items);
}

/// Drops what finished copies no longer need (staging goes back to its pool).
pub(crate) fn release_finished() {
    let mut deferred = DEFERRED.lock().unwrap_or_else(|p| p.into_inner());
    // An event that cannot be queried is kept: freeing memory a DMA may still read is worse.
    deferred.retain(|(_, e)| !e.is_complete().unwrap_or(false));
}
