//! Packing an upload: how each planned operation writes its destination bytes from its source
//! ([`PackOp`]), filling a range of the allocation's image in staging ([`fill_part`]), and the
//! parts of an upload, cut as it is planned ([`Cutter`]), which the crew's threads and the
//! planning thread pack ([`Part`], [`Handoff`]).

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock, TryLockError};

use arrow_buffer::Buffer;
use crossbeam_utils::CachePadded;

use super::plan::Plan;
use super::times::{StagingStep, StagingTimes, timed};

/// How an operation's destination bytes are made from its source.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Transform {
    /// A plain copy.
    Copy,
    /// A bitmap of `bits` bits whose first bit is bit `shift` (1..=7) of the first source byte,
    /// moved to bit 0. The bits past the last are zeroed, as arrow-rs zeroes them when it shifts a
    /// bitmap.
    ShiftBits { shift: u8, bits: usize },
    /// Little-endian `i32` offsets minus a base.
    Rebase32(i32),
    /// Little-endian `i64` offsets minus a base.
    Rebase64(i64),
}

/// Produces `dst..dst + len` of the destination from `src`.
#[derive(Clone, Debug)]
pub(crate) struct PackOp<'a> {
    pub src: &'a [u8],
    pub dst: usize,
    pub len: usize,
    pub transform: Transform,
    /// The arrow buffer `src` lies in, for plain copies: kept alive while a DMA reads it directly.
    pub owner: Option<&'a Buffer>,
}

impl PackOp<'_> {
    /// Writes destination bytes `dst + at .. dst + at + out.len()` of this operation into `out`.
    /// `at` is a multiple of the element size (so of 64, or 0). Plain copies are `streamed` as
    /// [`copy`] says.
    fn write(&self, at: usize, out: &mut [u8], streamed: bool) {
        let src = &self.src[at.min(self.src.len())..];
        match self.transform {
            Transform::Copy => copy(out, &src[..out.len()], streamed),
            Transform::ShiftBits { shift, bits } => {
                for (j, o) in out.iter_mut().enumerate() {
                    let lo = src[j] >> shift;
                    let hi = src.get(j + 1).map_or(0, |h| h << (8 - shift));
                    *o = lo | hi;
                }
                let tail = bits % 8;
                if tail != 0
                    && at + out.len() == self.len
                    && let Some(last) = out.last_mut()
                {
                    *last &= (1u8 << tail) - 1;
                }
            }
            Transform::Rebase32(base) => {
                for (o, s) in out.chunks_exact_mut(4).zip(src.chunks_exact(4)) {
                    let v = i32::from_le_bytes([s[0], s[1], s[2], s[3]]).wrapping_sub(base);
                    o.copy_from_slice(&v.to_le_bytes());
                }
            }
            Transform::Rebase64(base) => {
                for (o, s) in out.chunks_exact_mut(8).zip(src.chunks_exact(8)) {
                    let v = i64::from_le_bytes(s.try_into().unwrap_or_default()).wrapping_sub(base);
                    o.copy_from_slice(&v.to_le_bytes());
                }
            }
        }
    }
}

/// Copies `src` into `out` (of the same length). When `streamed`, from [`STREAMED`] bytes on (on
/// x86-64), the bulk is written with non-temporal stores: staging is written once and read next
/// by a DMA, so reading its lines into the cache before writing them (what ordinary stores do)
/// only takes memory bandwidth from the other packing threads and the copies. On the GPU machines
/// (H200), a 1.3 MB batch of 234 buffers of 128 bytes to 20 KB packed on one thread in 69-92 µs
/// that way against 107-114 µs with ordinary stores, and on the caller with three threads beside
/// it, each part sent as it was packed, in 50-55 µs against 86-93 µs (ordinary stores did not get
/// faster with more threads); the batches just decoded from lineitem SF10's Parquet files packed
/// in 15-20% less CPU time. A batch that fits in a core's cache with its staging ([`CACHED_MAX`])
/// is better written with ordinary stores: the lines are there, and the DMA reads them from it (a
/// 130 KB batch packed in 46 µs streamed, 21 µs not).
fn copy(out: &mut [u8], src: &[u8], streamed: bool) {
    #[cfg(target_arch = "x86_64")]
    if streamed && out.len() >= STREAMED {
        return copy_streamed(out, src);
    }
    out.copy_from_slice(src);
}

/// The size from which [`copy`] streams its bulk past the cache: below it, a copy is little more
/// than the one or two lines at its ends, which ordinary stores write.
const STREAMED: usize = 256;

/// Plans of at most this many bytes are packed with ordinary stores (see [`copy`]).
pub(crate) const CACHED_MAX: usize = 256 << 10;

#[cfg(target_arch = "x86_64")]
fn copy_streamed(out: &mut [u8], src: &[u8]) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
    assert_eq!(out.len(), src.len());
    // Ordinary copies up to the first 16-byte aligned destination byte, and after the last whole
    // 64-byte block.
    let head = out.as_ptr().align_offset(16).min(out.len());
    let body = (out.len() - head) / 64 * 64;
    out[..head].copy_from_slice(&src[..head]);
    // SAFETY: SSE2 is part of x86-64. Every load reads `src[head + i .. head + i + 64]` and every
    // store writes `out[head + i .. head + i + 64]` for `i + 64 <= body`, within both slices
    // (same length, checked above); the stores' addresses are 16-byte aligned (`head`). The fence
    // orders the streamed stores before whatever this thread does next (handing the staging to
    // the thread that copies it).
    unsafe {
        let (s, d) = (src.as_ptr().add(head), out.as_mut_ptr().add(head));
        for i in (0..body).step_by(64) {
            let v = [0, 16, 32, 48].map(|k| _mm_loadu_si128(s.add(i + k).cast::<__m128i>()));
            for (k, v) in [0, 16, 32, 48].into_iter().zip(v) {
                _mm_stream_si128(d.add(i + k).cast::<__m128i>(), v);
            }
        }
        _mm_sfence();
    }
    out[head + body..].copy_from_slice(&src[head + body..]);
}

/// A range of a planned upload, packed into its share of the staging by whichever thread gets to
/// it first: a crew thread it was handed to, or the planning thread once it needs it. Parts are
/// cut from uploads too large for the cache, so they are packed with non-temporal stores (see
/// [`copy`]).
pub(crate) struct Part<'a> {
    range: Range<usize>,
    /// The plan's operations that write some of the range (a copy: the plan may still grow).
    ops: Vec<PackOp<'a>>,
    /// Where the part goes, until a thread takes it to pack it there.
    out: Mutex<Option<&'a mut [u8]>>,
    /// Set once the bytes are written (not from the lock: another thread may hold it to find the
    /// part packed already).
    packed: AtomicBool,
    /// Where packing it counts as [`StagingStep::Pack`], if anywhere.
    times: Option<&'a StagingTimes>,
}

/// Cuts a plan into [`Part`]s of one size, in order, each to be packed into its share of one
/// staging block, while the plan is being made: the bytes below a plan's [`Plan::size`] are final
/// (a buffer planned later lies past them), so they can be packed while the rest is planned.
pub(crate) struct Cutter<'a> {
    /// The staging past the parts cut so far.
    staging: &'a mut [u8],
    /// Where the next part starts.
    at: usize,
    /// The first of the plan's operations that may write the next part.
    op: usize,
    segment: usize,
    times: Option<&'a StagingTimes>,
}

impl<'a> Cutter<'a> {
    /// Cuts parts of `segment` bytes (a multiple of [`ALIGNMENT`](crate::memory::ALIGNMENT)) from
    /// the start of a plan into `staging`, their packing time counted in `times`.
    pub fn new(staging: &'a mut [u8], segment: usize, times: Option<&'a StagingTimes>) -> Self {
        Cutter {
            staging,
            at: 0,
            op: 0,
            segment,
            times,
        }
    }

    /// Where the parts cut so far end.
    pub fn at(&self) -> usize {
        self.at
    }

    /// The parts of `plan` from where the last cut ended up to `end` (at most the plan's size and
    /// the staging's), of `segment` bytes but the last, which ends at `end`.
    pub fn cut(&mut self, plan: &Plan<'a>, end: usize) -> Vec<Part<'a>> {
        let mut parts = Vec::new();
        while self.at < end {
            let range = self.at..end.min(self.at + self.segment);
            let (out, rest) = std::mem::take(&mut self.staging).split_at_mut(range.len());
            self.staging = rest;
            self.at = range.end;
            parts.push(Part {
                ops: plan.ops_in(range.clone(), &mut self.op).to_vec(),
                range,
                out: Mutex::new(Some(out)),
                packed: AtomicBool::new(false),
                times: self.times,
            });
        }
        parts
    }

    /// [`Cutter::cut`] up to the last whole segment before `end`.
    pub fn cut_whole(&mut self, plan: &Plan<'a>, end: usize) -> Vec<Part<'a>> {
        self.cut(plan, end / self.segment * self.segment)
    }
}

impl<'a> Part<'a> {
    /// The part's range of the allocation.
    pub fn range(&self) -> Range<usize> {
        self.range.clone()
    }

    /// Packs the part unless that was done; spins while another thread packs it (for some
    /// microseconds: sleeping and being woken would take longer).
    pub fn pack(&self) {
        loop {
            let mut out = match self.out.try_lock() {
                Ok(out) => out,
                Err(TryLockError::Poisoned(p)) => p.into_inner(),
                Err(TryLockError::WouldBlock) => {
                    std::hint::spin_loop();
                    continue;
                }
            };
            if let Some(out) = out.take() {
                timed(self.times, StagingStep::Pack, || {
                    fill_part(&self.ops, self.range.start, out, true)
                });
                self.packed.store(true, Ordering::Release);
            }
            return;
        }
    }

    /// Whether a thread has packed the part; its bytes are then visible to this thread (and to a
    /// DMA it issues).
    pub fn is_packed(&self) -> bool {
        self.packed.load(Ordering::Acquire)
    }
}

/// Parts on their way from the planning thread, which cuts them as the batch is planned, to the
/// crew's threads that pack them.
///
/// Each thread keeps to cache lines of its own where it can: crew threads spin on [`Published`],
/// a line the planning thread writes once for each column that cut parts and once when it closes
/// the handoff; they take parts by raising `claimed`, a line the planning thread never writes, and
/// read them from slots written before they were published; they leave by lowering `helpers`,
/// which the upload waits on. (With a locked queue and these counters on one line, an upload of
/// 100 columns waited 3.7-4.9 µs for the crew to leave on an H200 machine, against 0.9-1.7 µs.)
pub(crate) struct Handoff<'a> {
    /// The parts handed over, in order: those below `published.count` may be taken. Each on lines
    /// of its own: the planning thread writes the next slot while a crew thread packs the part in
    /// the one before (locking it, marking it packed).
    slots: Box<[CachePadded<OnceLock<Part<'a>>>]>,
    published: CachePadded<Published>,
    /// How many parts crew threads have taken.
    claimed: CachePadded<AtomicUsize>,
    /// Crew threads packing its parts (see `crew`).
    pub(super) helpers: CachePadded<AtomicUsize>,
}

/// How many parts the planning thread has handed over, and whether more will come.
#[derive(Default)]
struct Published {
    count: AtomicUsize,
    closed: AtomicBool,
}

impl<'a> Handoff<'a> {
    /// A handoff of up to `capacity` parts.
    pub fn new(capacity: usize) -> Self {
        Handoff {
            slots: (0..capacity).map(|_| CachePadded::new(OnceLock::new())).collect(),
            published: Default::default(),
            claimed: Default::default(),
            helpers: Default::default(),
        }
    }

    /// Hands each of `cut` over, in order. Parts past the handoff's capacity are dropped unpacked
    /// (the upload finds them missing from [`Handoff::parts`]).
    pub fn push_all(&self, cut: Vec<Part<'a>>) {
        // Only this thread writes the count.
        let published = self.published.count.load(Ordering::Relaxed);
        let mut count = published;
        for part in cut {
            match self.slots.get(count).map(|slot| slot.set(part)) {
                Some(Ok(())) => count += 1,
                _ => break,
            }
        }
        if count > published {
            self.published.count.store(count, Ordering::Release);
        }
    }

    /// The parts handed over so far, in order.
    pub fn parts(&self) -> impl Iterator<Item = &Part<'a>> {
        let published = self.published.count.load(Ordering::Acquire);
        self.slots[..published].iter().filter_map(|slot| slot.get())
    }

    /// Whether parts wait for a thread.
    pub fn has_queued(&self) -> bool {
        self.claimed.load(Ordering::Relaxed) < self.published.count.load(Ordering::Acquire)
    }

    /// The next part no thread has taken, if any.
    pub fn take(&self) -> Option<&Part<'a>> {
        let mut claimed = self.claimed.load(Ordering::Relaxed);
        loop {
            if claimed >= self.published.count.load(Ordering::Acquire) {
                return None;
            }
            match self
                .claimed
                .compare_exchange_weak(claimed, claimed + 1, Ordering::Relaxed, Ordering::Relaxed)
            {
                // Published, so set: slots are set before the count that covers them is stored.
                Ok(_) => return self.slots[claimed].get(),
                Err(now) => claimed = now,
            }
        }
    }

    /// Says that no more parts will come: [`Handoff::pack`] returns once every part is taken.
    pub fn close(&self) {
        self.published.closed.store(true, Ordering::Release);
    }

    /// A crew thread's job: packs parts as they come until the handoff is closed and every part
    /// taken, spinning until they come (the batch is being planned, and waking a sleeping thread
    /// when a part is cut would take longer).
    pub fn pack(&self) {
        loop {
            // Read first: once closed, every part pushed is published.
            let closed = self.published.closed.load(Ordering::Acquire);
            if let Some(part) = self.take() {
                part.pack();
                continue;
            }
            if closed {
                return;
            }
            std::hint::spin_loop();
        }
    }
}

/// Writes destination bytes `start..start + out.len()` with `ops` (those of the range, or more),
/// zeroing the gaps between buffers, plain copies `streamed` as [`copy`] says. `start` must be a
/// multiple of [`ALIGNMENT`].
pub(crate) fn fill_part(ops: &[PackOp<'_>], start: usize, out: &mut [u8], streamed: bool) {
    let end = start + out.len();
    let first = ops.partition_point(|op| op.dst + op.len <= start);
    let mut cursor = start;
    for op in ops[first..].iter().take_while(|op| op.dst < end) {
        let from = op.dst.max(start);
        let to = (op.dst + op.len).min(end);
        out[cursor - start..from - start].fill(0);
        op.write(from - op.dst, &mut out[from - start..to - start], streamed);
        cursor = to;
    }
    out[cursor - start..].fill(0);
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow_array::{Array, ArrayRef, BooleanArray, Int32Array, StringArray};
    use arrow_data::ArrayData;

    use super::*;

    /// Copies of every length around the streaming threshold, from and to every alignment, write
    /// exactly the source's bytes and nothing around them.
    #[test]
    fn copies_write_exactly_their_bytes() {
        let src: Vec<u8> = (0..STREAMED * 2 + 300).map(|i| (i * 131 % 251) as u8).collect();
        let mut out = vec![0xEEu8; src.len() + 64];
        for len in [
            0,
            1,
            63,
            STREAMED - 1,
            STREAMED,
            STREAMED + 1,
            STREAMED + 77,
            STREAMED * 2 + 5,
        ] {
            for (from, to) in [(0, 0), (1, 3), (7, 16), (13, 60)] {
                out.fill(0xEE);
                copy(&mut out[to..to + len], &src[from..from + len], true);
                assert_eq!(&out[to..to + len], &src[from..from + len], "{len} {from} {to}");
                assert!(
                    out[..to].iter().chain(&out[to + len..]).all(|&b| b == 0xEE),
                    "{len} {from} {to}"
                );
            }
        }
    }

    /// Parts of a plan at any multiple of 64 bytes (cutting bitmaps, rebased offsets and copies
    /// anywhere), each packed into its own staging, hold exactly the bytes the whole plan fills,
    /// the gaps between buffers included; so do parts cut while the plan is being made.
    #[test]
    fn parts_pack_what_the_whole_plan_fills() {
        let strings: ArrayRef = Arc::new(StringArray::from_iter(
            (0..3000).map(|i| (i % 7 != 0).then(|| format!("v{i}"))),
        ));
        let arrays: Vec<ArrayRef> = vec![
            Arc::new(Int32Array::from_iter((0..1000).map(|i| (i % 3 != 0).then_some(i)))),
            strings.slice(13, 2000),
            Arc::new(BooleanArray::from_iter((0..999).map(|i| Some(i % 2 == 0))).slice(3, 900)),
            strings.slice(1, 5),
            Arc::new(Int32Array::from(Vec::<i32>::new())),
        ];
        let data: Vec<ArrayData> = arrays.iter().map(|a| a.to_data()).collect();
        let mut plan = Plan::default();
        for d in &data {
            plan.array(d).unwrap();
        }
        let mut whole = vec![0xAAu8; plan.size()];
        plan.fill(0, &mut whole);
        for segment in [64, 128, 192, 640, 4096] {
            let mut staging = vec![0x55u8; plan.size()];
            let parts = Cutter::new(&mut staging, segment, None).cut(&plan, plan.size());
            for (i, part) in parts.iter().enumerate() {
                assert_eq!(part.range(), i * segment..plan.size().min((i + 1) * segment));
                assert!(!part.is_packed());
                part.pack();
            }
            drop(parts);
            assert!(staging == whole, "parts of {segment} bytes");
        }
        // Cut while the plan is made, whole parts after each array, the last once it is planned.
        let mut staging = vec![0x55u8; plan.size()];
        let mut growing = Plan::default();
        let mut cutter = Cutter::new(&mut staging, 256, None);
        let mut parts = vec![];
        for d in &data {
            growing.array(d).unwrap();
            parts.extend(cutter.cut_whole(&growing, growing.size()));
            assert_eq!(cutter.at() % 256, 0);
            assert!(cutter.at() <= growing.size());
        }
        parts.extend(cutter.cut(&growing, growing.size()));
        assert_eq!(cutter.at(), plan.size());
        assert_eq!(parts.len(), plan.size().div_ceil(256));
        // A packed part stays packed while another thread holds it to find it packed (an upload
        // once read such a moment as "not packed" and left the part unsent).
        parts[0].pack();
        let done = AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                (0..100_000).for_each(|_| parts[0].pack());
                done.store(true, Ordering::Release);
            });
            while !done.load(Ordering::Acquire) {
                assert!(parts[0].is_packed());
            }
        });
        // Two threads pack what is handed off; this one packs what they have not started on, as an
        // upload does.
        let handoff = Handoff::new(parts.len());
        let count = parts.len();
        std::thread::scope(|s| {
            for _ in 0..2 {
                s.spawn(|| handoff.pack());
            }
            for part in parts {
                handoff.push_all(vec![part]);
            }
            handoff.close();
            for part in handoff.parts() {
                part.pack();
                assert!(part.is_packed());
            }
        });
        assert_eq!(handoff.parts().count(), count);
        drop(handoff);
        assert_eq!(staging, whole);
        // Parts past a handoff's capacity are not handed over.
        let mut staging = vec![0x55u8; plan.size()];
        let handoff = Handoff::new(2);
        handoff.push_all(Cutter::new(&mut staging, 256, None).cut(&plan, 3 * 256));
        let ranges: Vec<_> = handoff.parts().map(Part::range).collect();
        assert_eq!(ranges, [0..256, 256..512]);
    }
}
