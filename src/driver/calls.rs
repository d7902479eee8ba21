//! `driver_calls!`: how every wrapper in this module is declared.

/// Declares thin wrappers around CUDA driver entry points, and the list of the entry points they
/// call.
///
/// Each wrapper names its one entry point after `=`. The macro brings that `sys` function (and no
/// other) into scope for the body, turns the body's `DriverError` into [`Error::Driver`] naming the
/// call as the driver's documentation does (`cuMemAlloc`, not `cuMemAlloc_v2`), and records the
/// entry point in the invoking file's `SYMBOLS`, which the probe checks before the first CUDA call.
/// A wrapper cannot be written without its symbol joining the checked list.
///
/// ```ignore
/// driver_calls! {
///     /// Docs, with a `# Safety` section.
///     pub(crate) unsafe fn mem_alloc(size: usize) -> CUdeviceptr = cuMemAlloc_v2 {
///         let mut ptr = 0;
///         // SAFETY: ...
///         unsafe { cuMemAlloc_v2(&mut ptr, size) }.result()?;
///         Ok(ptr)
///     }
/// }
/// ```
///
/// Every wrapper is an `unsafe fn`: each needs at least a loaded driver (see
/// [`available`](super::available)), and most a bound context and live handles.
///
/// [`Error::Driver`]: crate::error::Error::Driver
macro_rules! driver_calls {
    ($(
        $(#[$meta:meta])*
        $vis:vis unsafe fn $name:ident($($arg:ident: $ty:ty),* $(,)?) -> $ret:ty = $sym:ident $body:block
    )*) => {
        $(
            $(#[$meta])*
            $vis unsafe fn $name($($arg: $ty),*) -> $crate::error::Result<$ret> {
                use cudarc::driver::sys::$sym;
                const CALL: &str = $crate::driver::symbols::call_name(stringify!($sym));
                let call = || -> ::std::result::Result<$ret, cudarc::driver::DriverError> { $body };
                call().map_err($crate::error::Error::driver(CALL))
            }
        )*

        /// The driver entry points this file's wrappers call, checked by the probe.
        pub(super) const SYMBOLS: &[&str] = &[$(stringify!($sym)),*];
    };
}
