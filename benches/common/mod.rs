//! What the benches share: the breakdown of a call into its steps (`arrow_cuda::trace`).

use std::time::{Duration, Instant};

use arrow_cuda::trace::Trace;

/// Calls `op` (which records what it times into the trace it is given) until about a second has
/// passed, at least 3 and at most 1,000 times, and prints the mean time per call and, below it,
/// the mean time per call of each step whose name starts with one of `prefixes`. Runs outside
/// criterion's measurements, after them.
pub fn print_steps(label: &str, prefixes: &[&str], mut op: impl FnMut(&mut Trace)) {
    let mut trace = Trace::default();
    let (mut calls, mut spent) = (0u64, Duration::ZERO);
    while calls < 3 || (calls < 1000 && spent < Duration::from_secs(1)) {
        let start = Instant::now();
        op(&mut trace);
        spent += start.elapsed();
        calls += 1;
    }
    let mean = spent.as_secs_f64() * 1e6 / calls as f64;
    println!("steps of {label}: {mean:.2} µs per call, mean of {calls} calls");
    for prefix in prefixes {
        print!("{}", trace.means(prefix, calls));
    }
}
