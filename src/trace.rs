//! Opt-in timing of the steps inside a transfer, an export or import of the C Device Data
//! Interface, and an IPC send or receive: where the time of one call goes.
//!
//! A [`Trace`] collects, for each named step, the time spent in it and how often it ran, from the
//! calls made inside [`Trace::record`] on the calling thread. Steps are timed on that thread only
//! (work a call hands to pool threads shows up as the time the caller waits for it); the steps of
//! one call follow each other, so their sum is the call's time less what lies between them. With no
//! trace recording on a thread, a step costs one thread-local read: nothing is timed.
//!
//! ```
//! use arrow_cuda::trace::Trace;
//! # use std::sync::Arc;
//! # use arrow_array::{ArrayRef, Int32Array, RecordBatch};
//! # use arrow_cuda::{Device, Stream, transfer};
//! # fn main() -> arrow_cuda::Result<()> {
//! # let batch = RecordBatch::try_from_iter([("x", Arc::new(Int32Array::from(vec![1, 2])) as ArrayRef)])?;
//! let stream = Stream::shared(Device::Cpu)?;
//! let mut trace = Trace::default();
//! for _ in 0..10 {
//!     trace.record(|| transfer::htod(&batch, Device::Cpu, &stream))?;
//! }
//! for step in trace.steps() {
//!     println!("{}: {:?} per call", step.name, step.total / 10);
//! }
//! # Ok(())
//! # }
//! ```

use std::cell::RefCell;
use std::fmt;
use std::time::{Duration, Instant};

/// The time spent in one named step, summed over every time it ran.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Step {
    /// The step, `operation.step` (`htod.plan`, `import.offsets`, ...).
    pub name: &'static str,
    /// The time spent in it in all.
    pub total: Duration,
    /// How often it ran.
    pub count: u64,
}

/// Times of named steps, gathered by [`Trace::record`]; steps keep the order in which each first
/// ran.
#[derive(Clone, Debug, Default)]
pub struct Trace {
    steps: Vec<Step>,
}

thread_local! {
    /// The trace recording on this thread, while [`Trace::record`] runs.
    static RECORDING: RefCell<Option<Trace>> = const { RefCell::new(None) };
}

/// Puts the trace that recorded back where it came from, also when the call unwinds.
struct Restore<'a> {
    trace: &'a mut Trace,
    outer: Option<Trace>,
}

impl Drop for Restore<'_> {
    fn drop(&mut self) {
        let outer = self.outer.take();
        let recorded = RECORDING.with(|r| std::mem::replace(&mut *r.borrow_mut(), outer));
        *self.trace = recorded.unwrap_or_default();
    }
}

impl Trace {
    /// Runs `f`, adding the steps it runs on this thread to this trace. A trace already recording
    /// on this thread (an outer `record`) sees none of them.
    pub fn record<R>(&mut self, f: impl FnOnce() -> R) -> R {
        let mine = std::mem::take(self);
        let outer = RECORDING.with(|r| r.borrow_mut().replace(mine));
        let _restore = Restore { trace: self, outer };
        f()
    }

    /// Adds `time` to step `name` (for steps timed by the caller, such as the release of an
    /// import, which runs in a drop).
    pub fn add(&mut self, name: &'static str, time: Duration) {
        match self.steps.iter_mut().find(|s| s.name == name) {
            Some(step) => {
                step.total += time;
                step.count += 1;
            }
            None => self.steps.push(Step {
                name,
                total: time,
                count: 1,
            }),
        }
    }

    /// The steps, in the order in which each first ran.
    pub fn steps(&self) -> &[Step] {
        &self.steps
    }

    /// The steps whose names start with `prefix` (an operation, such as `"htod."`), each with its
    /// mean time over `calls` calls, one line each: a form for printing.
    pub fn means(&self, prefix: &str, calls: u64) -> Means<'_> {
        Means {
            steps: self.steps.iter().filter(|s| s.name.starts_with(prefix)).collect(),
            calls: calls.max(1),
        }
    }
}

/// The mean time per call of some steps of a [`Trace`]; see [`Trace::means`]. Displays one
/// `name  mean  (runs per call)` line per step, then their sum.
#[derive(Debug)]
pub struct Means<'a> {
    steps: Vec<&'a Step>,
    calls: u64,
}

impl fmt::Display for Means<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut sum = Duration::ZERO;
        for s in &self.steps {
            let mean = s.total / self.calls as u32;
            sum += mean;
            let runs = s.count as f64 / self.calls as f64;
            writeln!(f, "  {:<28} {:>10.2} µs  ({runs:.2} per call)", s.name, micros(mean))?;
        }
        writeln!(f, "  {:<28} {:>10.2} µs", "(sum of the steps)", micros(sum))
    }
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// The steps of one call, each ending where the next begins: [`Laps::lap`] ends the current one.
/// Does nothing unless a [`Trace`] records on this thread.
pub(crate) struct Laps {
    last: Option<Instant>,
}

impl Laps {
    /// Starts the first step now, if a trace records on this thread.
    pub(crate) fn start() -> Laps {
        Laps::start_or(false)
    }

    /// Starts the first step now, if a trace records on this thread or `always` (for a caller
    /// that also keeps the times itself: see [`Laps::lap`]).
    pub(crate) fn start_or(always: bool) -> Laps {
        let on = always || RECORDING.with(|r| r.borrow().is_some());
        Laps {
            last: on.then(Instant::now),
        }
    }

    /// Ends the current step as `name` and starts the next; returns the step's time, when timed.
    pub(crate) fn lap(&mut self, name: &'static str) -> Option<Duration> {
        let last = self.last?;
        let now = Instant::now();
        RECORDING.with(|r| {
            if let Some(trace) = r.borrow_mut().as_mut() {
                trace.add(name, now - last);
            }
        });
        self.last = Some(now);
        Some(now - last)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_are_recorded_only_inside_record_and_only_by_the_innermost_trace() {
        let lap = |name| {
            let mut laps = Laps::start();
            laps.lap(name);
        };
        lap("outside");
        let mut outer = Trace::default();
        let mut inner = Trace::default();
        outer.record(|| {
            lap("a.first");
            inner.record(|| lap("b.inner"));
            lap("a.second");
            lap("a.first");
        });
        lap("outside");
        let names = |t: &Trace| t.steps().iter().map(|s| (s.name, s.count)).collect::<Vec<_>>();
        assert_eq!(names(&outer), [("a.first", 2), ("a.second", 1)]);
        assert_eq!(names(&inner), [("b.inner", 1)]);
        // Recording again adds to what the trace holds.
        inner.record(|| lap("b.inner"));
        assert_eq!(names(&inner), [("b.inner", 2)]);
        assert_eq!(outer.means("a.", 2).steps.len(), 2);
    }

    #[test]
    fn a_panic_inside_record_leaves_the_trace_and_the_thread_as_they_were() {
        let mut trace = Trace::default();
        trace.add("x.before", Duration::from_micros(1));
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            trace.record(|| {
                Laps::start().lap("x.during");
                panic!("inside");
            })
        }));
        assert!(caught.is_err());
        let names: Vec<_> = trace.steps().iter().map(|s| s.name).collect();
        assert_eq!(names, ["x.before", "x.during"]);
        assert!(RECORDING.with(|r| r.borrow().is_none()));
    }
}
