// What the reference counts of a batch's buffer views cost: making 300 views of one allocation,
// each a reference-counted pointer with an offset and a length (as `DeviceBuffer` is), against the
// same 300 views holding a plain pointer, and dropping them.
//
//   rustc -O -o /tmp/refcounts scripts/probes/refcounts.rs && /tmp/refcounts
use std::sync::Arc;
use std::time::Instant;

#[derive(Clone)]
struct Counted {
    _alloc: Arc<[u8; 64]>,
    _offset: usize,
    _len: usize,
}

struct Plain {
    _alloc: *const [u8; 64],
    _offset: usize,
    _len: usize,
}

#[inline(never)]
fn counted(alloc: &Arc<[u8; 64]>, out: &mut Vec<Counted>, n: usize) {
    for i in 0..n {
        out.push(Counted {
            _alloc: alloc.clone(),
            _offset: i * 64,
            _len: std::hint::black_box(i),
        });
    }
}

#[inline(never)]
fn plain(alloc: &Arc<[u8; 64]>, out: &mut Vec<Plain>, n: usize) {
    for i in 0..n {
        out.push(Plain {
            _alloc: Arc::as_ptr(alloc),
            _offset: i * 64,
            _len: std::hint::black_box(i),
        });
    }
}

fn main() {
    let alloc = Arc::new([0u8; 64]);
    let (n, rounds) = (300, 20_000);
    for _ in 0..3 {
        let mut views = Vec::with_capacity(n);
        let (mut made, mut dropped) = (0u128, 0u128);
        for _ in 0..rounds {
            let t = Instant::now();
            counted(&alloc, &mut views, n);
            made += t.elapsed().as_nanos();
            let t = Instant::now();
            views.clear();
            dropped += t.elapsed().as_nanos();
        }
        let mut raw = Vec::with_capacity(n);
        let t = Instant::now();
        for _ in 0..rounds {
            raw.clear();
            plain(&alloc, &mut raw, n);
        }
        let per = |ns: u128| ns as f64 / rounds as f64;
        println!(
            "{n} views: counted {:.0} ns to make, {:.0} ns to drop; plain {:.0} ns to make",
            per(made),
            per(dropped),
            per(t.elapsed().as_nanos())
        );
    }
}
