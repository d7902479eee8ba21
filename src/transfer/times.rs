//! [`StagingTimes`]: where staging spends its time, when asked. Its steps are timed as the laps
//! of a [`Trace`](crate::trace::Trace) are (`trace::Laps`): one clock serves both.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::trace::Laps;

/// A step of staging tables on a device, as [`StagingTimes`] counts it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum StagingStep {
    /// Before the first batch is made: sizing the load, checking each device's room, cutting the
    /// load into device batches, reading Parquet metadata.
    Setup,
    /// Making host batches: decoding Parquet row groups (nothing for batches already in memory).
    Decode,
    /// Preparing a device batch's worth of host batches: compacting view columns, computing
    /// statistics, and concatenating them where the device cannot.
    Prepare,
    /// A decoding thread waiting for the copying thread to take its prepared batch (the queue
    /// between them is full: copying is behind).
    Handoff,
    /// The copying thread waiting for a prepared batch (decoding is behind).
    Idle,
    /// The copying thread in a batch's upload, from its plan to its last copy issued.
    Upload,
    /// Taking pinned staging and device memory for an upload.
    Alloc,
    /// Writing a batch's bytes into pinned staging (or, on host-accessible memory, into place).
    Pack,
    /// Issuing copies to the device (the calls, not the transfers, which run asynchronously).
    Copy,
    /// Waiting for copies to finish: for staging to reuse, or at the end of the load.
    Wait,
    /// Concatenating a device batch's host batches on the device once they are copied, with the
    /// wait for their copies.
    Gather,
    /// Finding the column extremes of device batches on their GPU: starting the kernels once a
    /// batch is there, and reading their results (the oldest as more are started, the rest at
    /// the end of the load).
    Extremes,
    /// Freeing host batches once they are on the device (on a thread of their own).
    Release,
    /// After the last copy was issued: waiting for the copies and building the table.
    Finish,
}

impl StagingStep {
    /// Every step, in the order above.
    pub const ALL: [StagingStep; 14] = [
        StagingStep::Setup,
        StagingStep::Decode,
        StagingStep::Prepare,
        StagingStep::Handoff,
        StagingStep::Idle,
        StagingStep::Upload,
        StagingStep::Alloc,
        StagingStep::Pack,
        StagingStep::Copy,
        StagingStep::Wait,
        StagingStep::Gather,
        StagingStep::Extremes,
        StagingStep::Release,
        StagingStep::Finish,
    ];

    /// The step's name in a [`Trace`](crate::trace::Trace): `staging.` and its name.
    fn trace_name(self) -> &'static str {
        match self {
            StagingStep::Setup => "staging.setup",
            StagingStep::Decode => "staging.decode",
            StagingStep::Prepare => "staging.prepare",
            StagingStep::Handoff => "staging.handoff",
            StagingStep::Idle => "staging.idle",
            StagingStep::Upload => "staging.upload",
            StagingStep::Alloc => "staging.alloc",
            StagingStep::Pack => "staging.pack",
            StagingStep::Copy => "staging.copy",
            StagingStep::Wait => "staging.wait",
            StagingStep::Gather => "staging.gather",
            StagingStep::Extremes => "staging.extremes",
            StagingStep::Release => "staging.release",
            StagingStep::Finish => "staging.finish",
        }
    }

    /// The step's name, in lower case.
    pub fn name(self) -> &'static str {
        match self {
            StagingStep::Setup => "setup",
            StagingStep::Decode => "decode",
            StagingStep::Prepare => "prepare",
            StagingStep::Handoff => "handoff",
            StagingStep::Idle => "idle",
            StagingStep::Upload => "upload",
            StagingStep::Alloc => "alloc",
            StagingStep::Pack => "pack",
            StagingStep::Copy => "copy",
            StagingStep::Wait => "wait",
            StagingStep::Gather => "gather",
            StagingStep::Extremes => "extremes",
            StagingStep::Release => "release",
            StagingStep::Finish => "finish",
        }
    }
}

/// The wall time spent in each [`StagingStep`] of staging, summed over the threads that ran it (a step run
/// on 16 threads at once for a second counts 16 s), so that a benchmark can say where a load's time
/// goes. Opt-in: a load counts its steps only when its `LoadOptions::with_staging_times` names one of
/// these (share it between loads to add them up).
#[derive(Debug, Default)]
pub struct StagingTimes {
    nanos: [AtomicU64; StagingStep::ALL.len()],
}

impl StagingTimes {
    /// No time in any step yet.
    #[cfg_attr(not(feature = "datafusion"), allow(dead_code))]
    pub fn new() -> Self {
        Self::default()
    }

    /// The time counted in `step` so far.
    pub fn get(&self, step: StagingStep) -> Duration {
        Duration::from_nanos(self.nanos[step as usize].load(Ordering::Relaxed))
    }

    /// Counts `elapsed` more in `step`.
    pub(crate) fn add(&self, step: StagingStep, elapsed: Duration) {
        let nanos = u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX);
        self.nanos[step as usize].fetch_add(nanos, Ordering::Relaxed);
    }
}

/// Runs `f`, counting its wall time in `step` of `times` when there are times to count, and as
/// the step `staging.<step>` of the [`Trace`](crate::trace::Trace) recording on this thread, if
/// any: staging's times are laps of the same clock as a trace's steps.
pub(crate) fn timed<T>(times: Option<&StagingTimes>, step: StagingStep, f: impl FnOnce() -> T) -> T {
    let mut laps = Laps::start_or(times.is_some());
    let out = f();
    if let (Some(elapsed), Some(times)) = (laps.lap(step.trace_name()), times) {
        times.add(step, elapsed);
    }
    out
}

impl fmt::Display for StagingTimes {
    /// `decode 1.234 s, prepare 0.456 s, ...`: every step, in seconds.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, step) in StagingStep::ALL.into_iter().enumerate() {
            let sep = if i == 0 { "" } else { ", " };
            write!(f, "{sep}{} {:.3} s", step.name(), self.get(step).as_secs_f64())?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_step_adds_up_on_its_own() {
        let times = StagingTimes::new();
        times.add(StagingStep::Pack, Duration::from_millis(3));
        times.add(StagingStep::Pack, Duration::from_millis(4));
        times.add(StagingStep::Wait, Duration::from_micros(5));
        assert_eq!(times.get(StagingStep::Pack), Duration::from_millis(7));
        assert_eq!(times.get(StagingStep::Wait), Duration::from_micros(5));
        assert_eq!(times.get(StagingStep::Decode), Duration::ZERO);
        assert_eq!(timed(None, StagingStep::Copy, || 7), 7);
        assert!(timed(Some(&times), StagingStep::Copy, || 8) == 8);
        let text = times.to_string();
        assert!(
            text.starts_with("setup 0.000 s, decode 0.000 s, prepare 0.000 s,"),
            "{text}"
        );
        assert!(
            text.contains("pack 0.007 s, copy 0.000 s, wait 0.000 s,") && text.ends_with("finish 0.000 s"),
            "{text}"
        );
    }

    #[test]
    fn timed_steps_are_steps_of_a_recording_trace_too() {
        let times = StagingTimes::new();
        let mut trace = crate::trace::Trace::default();
        trace.record(|| {
            timed(Some(&times), StagingStep::Alloc, || {
                std::thread::sleep(Duration::from_millis(2))
            });
            timed(None, StagingStep::Copy, || ());
        });
        let steps: Vec<_> = trace.steps().iter().map(|s| (s.name, s.count)).collect();
        assert_eq!(steps, [("staging.alloc", 1), ("staging.copy", 1)]);
        // The one lap went to both.
        assert_eq!(times.get(StagingStep::Alloc), trace.steps()[0].total);
        assert!(times.get(StagingStep::Alloc) >= Duration::from_millis(2));
        assert_eq!(times.get(StagingStep::Copy), Duration::ZERO);
    }
}
