//! The threads that help pack uploads ([`Crew`]), kept awake for a while between them.
//!
//! An upload cuts its batch into parts as it plans it and hands them over in a [`Handoff`]; the
//! crew's threads pack them while the upload plans the rest. To help with a batch of a millisecond
//! or less, a thread has to be awake when the batch comes: on the GPU machines (virtual machines)
//! the rayon pool's sleeping threads, four woken for an upload, came 10-15 µs after it began for
//! the first and 65-90 µs for the last, by which time a 100-column batch of 1.3 MB had long been
//! packed by the others. So each thread spins for
//! [`SPIN`] after the last upload it helped with before it sleeps: a stream of uploads finds the
//! crew awake, at the cost of up to [`SPIN`] of busy threads after the last one.

use std::cell::Cell;
use std::panic::AssertUnwindSafe;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::thread::Thread;
use std::time::{Duration, Instant};

use super::pack::Handoff;

/// How long a thread spins for the next upload before it sleeps.
const SPIN: Duration = Duration::from_micros(200);
/// Threads in the crew (at most one fewer than the machine's cores). On the H100 and H200
/// machines 8 threads uploaded the 1.3 MB batch no faster than 4 (75-92 µs alike): packing it
/// takes the memory's bandwidth, not the threads', and the more threads pack, the slower the
/// uploading thread plans.
const THREADS: usize = 4;

/// Threads that pack the parts of the uploads [`Crew::help`] is given.
pub(crate) struct Crew {
    /// The handoffs of uploads being planned.
    open: Mutex<Vec<Open>>,
    /// How many handoffs `open` holds, read by spinning threads without the lock.
    count: AtomicUsize,
    /// Threads that are asleep, or about to be.
    sleeping: AtomicUsize,
    threads: OnceLock<Vec<Thread>>,
}

/// A handoff of an upload, its lifetime erased: it stays valid while it is in [`Crew::open`] and
/// until its [`Handoff::helpers`] count falls to zero after that ([`Crew::help`] waits for both).
#[derive(Clone, Copy, PartialEq, Eq)]
struct Open(NonNull<Handoff<'static>>);

// SAFETY: a `Handoff` is `Sync` (slots set once, and atomics); the pointer is only read while the
// handoff is alive (see `Open`).
unsafe impl Send for Open {}

impl Crew {
    /// The crew, its threads started the first time.
    pub fn get() -> &'static Crew {
        static CREW: Crew = Crew {
            open: Mutex::new(Vec::new()),
            count: AtomicUsize::new(0),
            sleeping: AtomicUsize::new(0),
            threads: OnceLock::new(),
        };
        CREW.threads.get_or_init(|| {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            (0..THREADS.min(cores.saturating_sub(1)))
                .map_while(|i| {
                    std::thread::Builder::new()
                        .name(format!("arrow-cuda-pack-{i}"))
                        .spawn(|| CREW.work())
                        .ok()
                })
                .map(|handle| handle.thread().clone())
                .collect()
        });
        &CREW
    }

    /// Runs `work` while the crew packs the parts of `handoff`, waking threads that sleep, until
    /// `work` closes the handoff ([`Help::close`]) or returns. Once `work` returns (or unwinds),
    /// the handoff is closed and no crew thread is in it any more: nothing its parts borrow is
    /// used after this call.
    pub fn help<'a, R>(&'static self, handoff: &Handoff<'a>, work: impl FnOnce(&Help<'_, 'a>) -> R) -> R {
        let open = Open(NonNull::from(handoff).cast());
        self.open.lock().unwrap_or_else(|p| p.into_inner()).push(open);
        self.count.fetch_add(1, Ordering::SeqCst);
        // Read after `count` is raised, as the threads raise `sleeping` before they read `count`:
        // one of the two sees the other's change.
        if self.sleeping.load(Ordering::SeqCst) > 0 {
            self.threads.get().into_iter().flatten().for_each(Thread::unpark);
        }
        // Dropped when `work` returns or unwinds: only then can the handoff go away.
        let help = Help {
            crew: self,
            handoff,
            open: Cell::new(Some(open)),
        };
        work(&help)
    }

    /// A crew thread's loop: helps with open handoffs, spins for [`SPIN`] when there are none,
    /// then sleeps until an upload wakes it.
    fn work(&self) {
        let mut idle_since = Instant::now();
        loop {
            if self.count.load(Ordering::Acquire) > 0 {
                if let Some(handoff) = self.enter() {
                    // SAFETY: `enter` counted this thread among the handoff's helpers while it was
                    // open: the upload waits for the count to fall to zero before the handoff
                    // (and what its parts borrow) goes away.
                    let handoff = unsafe { handoff.0.as_ref() };
                    // A panic leaves a part unpacked, which its upload reports; the thread stays.
                    let _ = std::panic::catch_unwind(AssertUnwindSafe(|| handoff.pack()));
                    // The last use of the handoff.
                    handoff.helpers.fetch_sub(1, Ordering::Release);
                    idle_since = Instant::now();
                }
                continue;
            }
            if idle_since.elapsed() < SPIN {
                std::hint::spin_loop();
                continue;
            }
            self.sleeping.fetch_add(1, Ordering::SeqCst);
            if self.count.load(Ordering::SeqCst) == 0 {
                std::thread::park();
            }
            self.sleeping.fetch_sub(1, Ordering::SeqCst);
            idle_since = Instant::now();
        }
    }

    /// An open handoff (the first with parts queued, else the first), counted as helped by this
    /// thread under the lock, so that its upload cannot miss this thread when it waits for its
    /// helpers.
    fn enter(&self) -> Option<Open> {
        let open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: the handoffs in the list are alive (see `Open`); its lock is held.
        let handoff = |o: &Open| unsafe { o.0.as_ref() };
        let chosen = *open.iter().find(|o| handoff(o).has_queued()).or(open.first())?;
        handoff(&chosen).helpers.fetch_add(1, Ordering::Acquire);
        Some(chosen)
    }
}

/// The crew's help with one upload's [`Handoff`] (see [`Crew::help`]); dropping it closes the
/// handoff and waits for the crew's threads to leave it.
pub(crate) struct Help<'h, 'a> {
    crew: &'static Crew,
    handoff: &'h Handoff<'a>,
    /// The handoff in [`Crew::open`], until it is closed.
    open: Cell<Option<Open>>,
}

impl Help<'_, '_> {
    /// Says that no more parts come and lets no more crew threads join: those in the handoff
    /// pack what is queued and leave.
    pub fn close(&self) {
        self.handoff.close();
        if let Some(open) = self.open.take() {
            let mut list = self.crew.open.lock().unwrap_or_else(|p| p.into_inner());
            list.retain(|o| *o != open);
            self.crew.count.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

impl Drop for Help<'_, '_> {
    fn drop(&mut self) {
        self.close();
        while self.handoff.helpers.load(Ordering::Acquire) > 0 {
            std::hint::spin_loop();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow_array::{ArrayRef, Int64Array, StringArray};
    use arrow_data::ArrayData;

    use super::*;
    use crate::transfer::pack::Cutter;
    use crate::transfer::plan::Plan;

    /// Forty columns of about 200 KB, and the bytes their plan fills.
    fn batch() -> (Vec<ArrayData>, Vec<u8>) {
        let arrays: Vec<ArrayRef> = (0..40i64)
            .map(|c| -> ArrayRef {
                if c % 2 == 0 {
                    Arc::new(Int64Array::from_iter(
                        (0..2000).map(|i| (i % 7 != c % 7).then_some(i * c)),
                    ))
                } else {
                    Arc::new(StringArray::from_iter_values((0..700).map(|i| format!("{c}-{i}"))).slice(c as usize, 500))
                }
            })
            .collect();
        let data: Vec<ArrayData> = arrays.iter().map(|a| a.to_data()).collect();
        let mut plan = Plan::default();
        data.iter().for_each(|d| drop(plan.array(d).unwrap()));
        let mut whole = vec![0xAA; plan.size()];
        plan.fill(0, &mut whole);
        (data, whole)
    }

    /// Plans `data` into `plan`, handing each part of 4 KiB to `handoff` as soon as it is planned,
    /// as an upload does.
    fn hand_off<'a>(data: &'a [ArrayData], plan: &mut Plan<'a>, cutter: &mut Cutter<'a>, handoff: &Handoff<'a>) {
        for d in data {
            plan.array(d).unwrap();
            handoff.push_all(cutter.cut_whole(plan, plan.size()));
        }
        handoff.push_all(cutter.cut(plan, plan.size()));
    }

    /// The staging the crew and the uploading thread pack, cut while planned as an upload cuts
    /// it, holds the bytes of the whole plan: for uploads one after another, on several threads
    /// at once, and after the crew fell asleep.
    #[test]
    fn the_crew_packs_what_uploads_hand_off() {
        let (data, whole) = batch();
        let upload = || {
            let mut staging = vec![0x55; whole.len()];
            let handoff = Handoff::new(whole.len().div_ceil(4096));
            let mut cutter = Cutter::new(&mut staging, 4096, None);
            let mut plan = Plan::default();
            Crew::get().help(&handoff, |help| {
                hand_off(&data, &mut plan, &mut cutter, &handoff);
                help.close();
                while let Some(part) = handoff.take() {
                    part.pack();
                }
                handoff.parts().for_each(|p| p.pack());
                assert!(handoff.parts().all(|p| p.is_packed()));
                assert_eq!(handoff.parts().count(), whole.len().div_ceil(4096));
            });
            drop(handoff);
            staging
        };
        for round in 0..20 {
            assert!(upload() == whole, "round {round}");
            if round % 5 == 4 {
                // Long enough for the crew to fall asleep.
                std::thread::sleep(SPIN * 5);
            }
        }
        std::thread::scope(|s| {
            for _ in 0..3 {
                s.spawn(|| (0..20).for_each(|round| assert!(upload() == whole, "round {round}")));
            }
        });
    }

    /// An upload that ends before it closes its handoff (an error while planning) leaves no crew
    /// thread in it: once `Crew::help` returns, every part is packed whole or untouched.
    #[test]
    fn an_upload_that_fails_leaves_no_thread_behind() {
        let (data, whole) = batch();
        for _ in 0..20 {
            let mut staging = vec![0x55; whole.len()];
            let handoff = Handoff::new(whole.len().div_ceil(4096));
            let mut cutter = Cutter::new(&mut staging, 4096, None);
            let mut plan = Plan::default();
            Crew::get().help(&handoff, |_| hand_off(&data, &mut plan, &mut cutter, &handoff));
            assert_eq!(handoff.helpers.load(Ordering::Acquire), 0);
            let packed: Vec<_> = handoff.parts().map(|p| (p.range(), p.is_packed())).collect();
            drop(handoff);
            for (range, packed) in packed {
                let expected = if packed {
                    &whole[range.clone()]
                } else {
                    &vec![0x55; range.len()][..]
                };
                assert!(staging[range.clone()] == *expected, "{range:?} packed: {packed}");
            }
        }
    }
}
