//! Rust code that runs under a C caller (release callbacks, stream callbacks): a panic must not
//! unwind out of an `extern "C"` function, where it aborts the whole process.

use std::panic::{AssertUnwindSafe, catch_unwind};

/// Runs `f`, stopping a panic there: `None` when it panicked. The panic's payload is leaked rather
/// than dropped, as dropping it could panic again.
pub(crate) fn no_unwind<T>(f: impl FnOnce() -> T) -> Option<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(value) => Some(value),
        Err(payload) => {
            std::mem::forget(payload);
            None
        }
    }
}
