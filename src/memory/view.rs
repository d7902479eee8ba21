//! [`StridedView`]: a typed, strided, n-dimensional view of a [`DeviceBuffer`], like cuda.core's
//! `StridedMemoryView` or a numba device array.
//!
//! A view is a buffer plus a layout: a byte offset of the first element, a shape, and one stride per
//! axis in bytes. Views are cheap to make and to split; they share the buffer's allocation. Copies
//! between views (and between a view and a host slice in C order) work on every pair of devices: a
//! contiguous layout is one copy, a strided one is a series of 2-D copies (`cuMemcpy2DAsync`) on a
//! CUDA stream, or a loop over rows on the CPU.
//!
//! Strides must be non-negative multiples of the element's alignment. A zero stride (broadcasting
//! one element along an axis) is allowed for reading; a view written to must not have two indices
//! that reach the same bytes.

use std::fmt;
use std::marker::PhantomData;
use std::mem::{align_of, size_of};

use crate::device::{Device, Event, Stream};
use crate::driver::{self, CUstream};
use crate::error::{Error, Result};
use crate::memory::{DeviceBuffer, MemoryResource, copy, stream_for};

mod sealed {
    pub trait Sealed {}
}

/// A plain numeric type a [`StridedView`] can hold: every bit pattern is a valid value and the type
/// has no padding, so its bytes can be copied to and from any memory.
///
/// Sealed: implemented for `i8`..`i64`, `u8`..`u64`, `f32`, `f64` and [`half::f16`].
pub trait Element: sealed::Sealed + Copy + Default + PartialEq + fmt::Debug + Send + Sync + 'static {
    /// The type's name, as Rust spells it.
    const NAME: &'static str;
}

macro_rules! element {
    ($($t:ty => $name:literal),* $(,)?) => {$(
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const NAME: &'static str = $name;
        }
    )*};
}

element!(
    i8 => "i8", i16 => "i16", i32 => "i32", i64 => "i64",
    u8 => "u8", u16 => "u16", u32 => "u32", u64 => "u64",
    f32 => "f32", f64 => "f64", half::f16 => "f16",
);

/// The bytes of a slice of elements.
fn as_bytes<T: Element>(data: &[T]) -> &[u8] {
    // SAFETY: `Element` types are sealed plain numbers without padding, so every byte of the slice is
    // initialised; the byte slice borrows the same memory for the same lifetime.
    unsafe { std::slice::from_raw_parts(data.as_ptr().cast::<u8>(), std::mem::size_of_val(data)) }
}

/// A typed, strided, n-dimensional view of a [`DeviceBuffer`].
///
/// The layout is a byte offset of the element at index `[0, 0, ...]` from the start of the buffer, a
/// shape, and a stride per axis in bytes: element `[i, j, ...]` lives at `offset + i * strides[0] +
/// j * strides[1] + ...`. Every element the layout reaches lies inside the buffer (checked when the
/// view is made).
///
/// Reads work on any view. Writes ([`StridedView::copy_from_host`], the destination of
/// [`StridedView::copy_to`]) need the view's buffer to be mutable ([`DeviceBuffer::is_mutable`]: the
/// only view of its allocation), so views made by [`StridedView::split`] or [`StridedView::slice`]
/// are read-only while their siblings live.
pub struct StridedView<T: Element> {
    buffer: DeviceBuffer,
    offset: usize,
    shape: Vec<usize>,
    strides: Vec<isize>,
    _element: PhantomData<T>,
}

impl<T: Element> Clone for StridedView<T> {
    fn clone(&self) -> Self {
        StridedView {
            buffer: self.buffer.clone(),
            offset: self.offset,
            shape: self.shape.clone(),
            strides: self.strides.clone(),
            _element: PhantomData,
        }
    }
}

impl<T: Element> fmt::Debug for StridedView<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "StridedView<{}>(shape {:?}, strides {:?}, offset {} of {:?})",
            T::NAME,
            self.shape,
            self.strides,
            self.offset,
            self.buffer
        )
    }
}

/// The C-order (row-major) strides, in bytes, of `shape` with elements of `itemsize` bytes.
pub fn c_strides(shape: &[usize], itemsize: usize) -> Vec<isize> {
    let mut strides = vec![0isize; shape.len()];
    let mut step = itemsize;
    for (s, &n) in strides.iter_mut().zip(shape).rev() {
        *s = step as isize;
        step = step.saturating_mul(n);
    }
    strides
}

/// The number of elements of `shape`, or an error when it overflows.
fn element_count(shape: &[usize]) -> Result<usize> {
    shape
        .iter()
        .try_fold(1usize, |acc, &n| acc.checked_mul(n))
        .ok_or_else(|| Error::InvalidArgument(format!("shape {shape:?} has more elements than fit in usize")))
}

impl<T: Element> StridedView<T> {
    /// A C-order (row-major) view of the start of `buffer` with `shape`. The buffer must hold at least
    /// `shape.iter().product() * size_of::<T>()` bytes ([`Error::SizeMismatch`] otherwise); any bytes
    /// beyond are not part of the view.
    pub fn contiguous(buffer: DeviceBuffer, shape: &[usize]) -> Result<Self> {
        let bytes = element_count(shape)?
            .checked_mul(size_of::<T>())
            .ok_or_else(|| Error::InvalidArgument(format!("shape {shape:?} has more bytes than fit in usize")))?;
        if buffer.len() < bytes {
            return Err(Error::SizeMismatch {
                what: "StridedView::contiguous",
                expected: bytes,
                actual: buffer.len(),
            });
        }
        Self::with_layout(buffer, 0, shape, &c_strides(shape, size_of::<T>()))
    }

    /// A view of `buffer` from its first byte with `shape` and `strides` (in bytes).
    ///
    /// Errors: [`Error::InvalidArgument`] when the lengths differ, a stride is negative or not a
    /// multiple of the element's alignment, or the buffer's address is misaligned;
    /// [`Error::OutOfBounds`] when an element the layout reaches is not inside the buffer.
    pub fn with_strides(buffer: DeviceBuffer, shape: &[usize], strides: &[isize]) -> Result<Self> {
        Self::with_layout(buffer, 0, shape, strides)
    }

    /// A view of `buffer` whose first element is `byte_offset` bytes into it, with `shape` and
    /// `strides` (in bytes). Checked as [`StridedView::with_strides`] is; the offset must be a multiple
    /// of the element's alignment too.
    pub fn with_layout(buffer: DeviceBuffer, byte_offset: usize, shape: &[usize], strides: &[isize]) -> Result<Self> {
        let align = align_of::<T>();
        if shape.len() != strides.len() {
            return Err(Error::InvalidArgument(format!(
                "shape {shape:?} has {} axes but strides {strides:?} have {}",
                shape.len(),
                strides.len()
            )));
        }
        if let Some(s) = strides.iter().find(|&&s| s < 0) {
            return Err(Error::InvalidArgument(format!(
                "negative stride {s} in {strides:?} is not supported"
            )));
        }
        if let Some(s) = strides.iter().find(|&&s| !(s as usize).is_multiple_of(align)) {
            return Err(Error::InvalidArgument(format!(
                "stride {s} in {strides:?} is not a multiple of the {}-byte alignment of {}",
                align,
                T::NAME
            )));
        }
        if !(buffer.address() as usize)
            .wrapping_add(byte_offset)
            .is_multiple_of(align)
        {
            return Err(Error::InvalidArgument(format!(
                "address {:#x} + offset {byte_offset} is not aligned to {align} bytes for {}",
                buffer.address(),
                T::NAME
            )));
        }
        let len = element_count(shape)?;
        if len == 0 {
            crate::memory::check_range(byte_offset, 0, buffer.len())?;
        } else {
            // The last byte reached: offset + sum(stride * (n - 1)) + size_of::<T>().
            let end = shape
                .iter()
                .zip(strides)
                .try_fold(byte_offset, |acc, (&n, &s)| {
                    (s as usize).checked_mul(n - 1).and_then(|x| acc.checked_add(x))
                })
                .and_then(|last| last.checked_add(size_of::<T>()));
            match end {
                Some(end) if end <= buffer.len() => {}
                end => {
                    return Err(Error::OutOfBounds {
                        offset: byte_offset,
                        len: end.map_or(usize::MAX, |e| e - byte_offset),
                        size: buffer.len(),
                    });
                }
            }
        }
        Ok(StridedView {
            buffer,
            offset: byte_offset,
            shape: shape.to_vec(),
            strides: strides.to_vec(),
            _element: PhantomData,
        })
    }

    /// A new C-order view holding a copy of `data` (in C order) in memory from `resource`; returns
    /// when the copy is done.
    pub fn from_host(data: &[T], shape: &[usize], resource: MemoryResource, stream: &Stream) -> Result<Self> {
        let n = element_count(shape)?;
        if n != data.len() {
            return Err(Error::SizeMismatch {
                what: "StridedView::from_host",
                expected: n.saturating_mul(size_of::<T>()),
                actual: std::mem::size_of_val(data),
            });
        }
        Self::contiguous(DeviceBuffer::from_host(as_bytes(data), resource, stream)?, shape)
    }

    /// A new C-order view of zeroed memory from `resource`.
    pub fn zeroed(resource: MemoryResource, shape: &[usize], stream: &Stream) -> Result<Self> {
        let bytes = element_count(shape)?
            .checked_mul(size_of::<T>())
            .ok_or_else(|| Error::InvalidArgument(format!("shape {shape:?} has more bytes than fit in usize")))?;
        Self::contiguous(DeviceBuffer::zeroed(resource, bytes, stream)?, shape)
    }

    /// The length of each axis.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The stride of each axis, in bytes.
    pub fn strides(&self) -> &[isize] {
        &self.strides
    }

    /// The number of axes.
    pub fn ndim(&self) -> usize {
        self.shape.len()
    }

    /// The byte offset of the first element in the buffer.
    pub fn byte_offset(&self) -> usize {
        self.offset
    }

    /// The number of elements (the product of the shape; 1 for a 0-dimensional view).
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether the view has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the elements lie in C order (row-major) with no gaps. Axes of length 1 may have any
    /// stride; an empty view is contiguous.
    pub fn is_contiguous(&self) -> bool {
        if self.is_empty() {
            return true;
        }
        let mut expected = size_of::<T>();
        for (&n, &s) in self.shape.iter().zip(&self.strides).rev() {
            if n != 1 && s as usize != expected {
                return false;
            }
            expected *= n;
        }
        true
    }

    /// The buffer the view reads.
    pub fn buffer(&self) -> &DeviceBuffer {
        &self.buffer
    }

    /// The buffer the view reads, giving up the layout.
    pub fn into_buffer(self) -> DeviceBuffer {
        self.buffer
    }

    /// The device the memory belongs to.
    pub fn device(&self) -> Device {
        self.buffer.device()
    }

    /// The address of the first element (a device pointer for device memory).
    pub fn address(&self) -> u64 {
        self.buffer.address() + self.offset as u64
    }

    /// A zero-copy view of `len` indices of axis 0 from `start`, sharing the buffer.
    ///
    /// Errors: [`Error::InvalidArgument`] for a 0-dimensional view; [`Error::OutOfBounds`] when the
    /// range does not lie inside axis 0 (reported in bytes of the C-order array).
    pub fn slice(&self, start: usize, len: usize) -> Result<Self> {
        let Some(&rows) = self.shape.first() else {
            return Err(Error::InvalidArgument(
                "a 0-dimensional view has no axis to slice".into(),
            ));
        };
        if start.checked_add(len).is_none_or(|end| end > rows) {
            let row = self.shape[1..].iter().product::<usize>().saturating_mul(size_of::<T>());
            return Err(Error::OutOfBounds {
                offset: start.saturating_mul(row),
                len: len.saturating_mul(row),
                size: rows.saturating_mul(row),
            });
        }
        Ok(self.sub_view(0, start, len))
    }

    /// Splits axis `axis` into `sections` zero-copy views, the way numpy's `array_split` does: when
    /// the axis length `n` is not a multiple of `sections`, the first `n % sections` views get one
    /// index more than the others (so views may be empty when `sections > n`).
    ///
    /// Errors: [`Error::InvalidArgument`] when `axis` is not an axis of the view or `sections` is 0.
    pub fn split(&self, axis: usize, sections: usize) -> Result<Vec<Self>> {
        let Some(&n) = self.shape.get(axis) else {
            return Err(Error::InvalidArgument(format!(
                "axis {axis} of a {}-dimensional view",
                self.ndim()
            )));
        };
        if sections == 0 {
            return Err(Error::InvalidArgument("cannot split into 0 sections".into()));
        }
        let (base, extra) = (n / sections, n % sections);
        let mut start = 0;
        Ok((0..sections)
            .map(|i| {
                let len = base + usize::from(i < extra);
                let v = self.sub_view(axis, start, len);
                start += len;
                v
            })
            .collect())
    }

    /// The view of indices `start..start + len` of `axis` (in range: checked by the callers).
    fn sub_view(&self, axis: usize, start: usize, len: usize) -> Self {
        let mut shape = self.shape.clone();
        shape[axis] = len;
        // An empty view keeps the offset; it reaches no memory.
        let offset = if len == 0 {
            self.offset
        } else {
            self.offset + start * self.strides[axis] as usize
        };
        StridedView {
            buffer: self.buffer.clone(),
            offset,
            shape,
            strides: self.strides.clone(),
            _element: PhantomData,
        }
    }

    /// Copies the elements, in C order, into a new host vector; returns when the copy is done.
    pub fn copy_to_host(&self, stream: &Stream) -> Result<Vec<T>> {
        let mut out = vec![T::default(); self.len()];
        let stream = stream_for(stream, self.device(), Device::Cpu)?;
        // SAFETY: `out` has exactly `len` elements; the stream is synchronised (also on error) before
        // `out` is touched or dropped.
        unsafe { self.copy_to_slice(&mut out, &stream) }?;
        Ok(out)
    }

    /// Starts copying the elements, in C order, into `dst`, which must have [`StridedView::len`]
    /// elements ([`Error::SizeMismatch`] otherwise), and returns an event for the copy. On error
    /// nothing is left in flight.
    ///
    /// # Safety
    /// `dst` must stay valid and must not be read or written until the event completes, and this
    /// view's memory must not be freed before then.
    pub unsafe fn copy_to_host_async(&self, dst: &mut [T], stream: &Stream) -> Result<Event> {
        self.check_host_len("StridedView::copy_to_host_async", dst.len())?;
        self.buffer.check_readable()?;
        let stream = stream_for(stream, self.device(), Device::Cpu)?;
        let host = Layout::host(dst.as_mut_ptr() as u64, &self.shape, size_of::<T>());
        // SAFETY: both layouts are in bounds (the view was checked, `dst` has `len` elements); the
        // caller keeps `dst` untouched and the memory alive until the event completes.
        unsafe { issue(host, self.layout(), &self.shape, &stream) }?;
        stream.record()
    }

    /// Copies `data` (in C order, [`StridedView::len`] elements) into the view's elements; returns
    /// when the copy is done.
    ///
    /// Errors: [`Error::SizeMismatch`] for a wrong length, [`Error::Unsupported`] when the buffer is
    /// not mutable, [`Error::InvalidArgument`] when two indices of the view reach the same bytes.
    pub fn copy_from_host(&mut self, data: &[T], stream: &Stream) -> Result<()> {
        self.check_writable()?;
        self.check_host_len("StridedView::copy_from_host", data.len())?;
        let stream = stream_for(stream, self.device(), Device::Cpu)?;
        let host = Layout::host(data.as_ptr() as u64, &self.shape, size_of::<T>());
        // SAFETY: both layouts are in bounds; this view is the only one of its allocation and does
        // not overlap itself (checked); the stream is synchronised before `data` is released.
        let issued = unsafe { issue(self.layout(), host, &self.shape, &stream) };
        finish(issued, &stream)
    }

    /// Starts copying `data` (in C order) into the view's elements and returns an event for the copy.
    /// Checked as [`StridedView::copy_from_host`] is. On error nothing is left in flight.
    ///
    /// # Safety
    /// `data` must stay valid and unchanged until the event completes; the view's memory must not be
    /// read on the host or freed before then.
    pub unsafe fn copy_from_host_async(&mut self, data: &[T], stream: &Stream) -> Result<Event> {
        self.check_writable()?;
        self.check_host_len("StridedView::copy_from_host_async", data.len())?;
        let stream = stream_for(stream, self.device(), Device::Cpu)?;
        let host = Layout::host(data.as_ptr() as u64, &self.shape, size_of::<T>());
        // SAFETY: both layouts are in bounds and the destination is a unique, non-overlapping view;
        // the caller keeps `data` alive and unchanged until the event completes.
        unsafe { issue(self.layout(), host, &self.shape, &stream) }?;
        stream.record()
    }

    /// Copies this view's elements into `dst`, a view of the same shape on any device; returns when
    /// the copy is done.
    ///
    /// Errors: [`Error::InvalidArgument`] when the shapes differ or `dst` overlaps itself,
    /// [`Error::Unsupported`] when `dst`'s buffer is not mutable.
    pub fn copy_to(&self, dst: &mut StridedView<T>, stream: &Stream) -> Result<()> {
        dst.check_writable()?;
        self.check_same_shape(dst)?;
        self.buffer.check_readable()?;
        let stream = stream_for(stream, dst.device(), self.device())?;
        // SAFETY: both views are in bounds; `dst` is the only view of its allocation, so it cannot
        // overlap `self`, and does not overlap itself (checked); the stream is synchronised before
        // returning.
        let issued = unsafe { issue(dst.layout(), self.layout(), &self.shape, &stream) };
        finish(issued, &stream)
    }

    /// Starts copying this view's elements into `dst` and returns an event for the copy. Checked as
    /// [`StridedView::copy_to`] is. On error nothing is left in flight.
    ///
    /// # Safety
    /// Neither view's memory may be freed, nor `dst`'s memory read on the host, until the event
    /// completes.
    pub unsafe fn copy_to_async(&self, dst: &mut StridedView<T>, stream: &Stream) -> Result<Event> {
        dst.check_writable()?;
        self.check_same_shape(dst)?;
        self.buffer.check_readable()?;
        let stream = stream_for(stream, dst.device(), self.device())?;
        // SAFETY: in-bounds, non-overlapping views (as in `copy_to`); the caller keeps both alive and
        // `dst` unread until the event completes.
        unsafe { issue(dst.layout(), self.layout(), &self.shape, &stream) }?;
        stream.record()
    }

    /// A C-order copy of this view in new memory from `resource`; returns when the copy is done.
    pub fn to_contiguous(&self, resource: MemoryResource, stream: &Stream) -> Result<StridedView<T>> {
        let bytes = self.len() * size_of::<T>();
        let mut out = Self::contiguous(DeviceBuffer::alloc(resource, bytes, stream)?, &self.shape)?;
        self.copy_to(&mut out, stream)?;
        Ok(out)
    }

    /// Copies into a host slice of `len` elements in C order, then synchronises `stream` (whether or
    /// not the copy was issued whole).
    ///
    /// # Safety
    /// `stream` must be the stream [`stream_for`] picks for this view and the host.
    unsafe fn copy_to_slice(&self, dst: &mut [T], stream: &Stream) -> Result<()> {
        self.check_host_len("StridedView::copy_to_host", dst.len())?;
        self.buffer.check_readable()?;
        let host = Layout::host(dst.as_mut_ptr() as u64, &self.shape, size_of::<T>());
        // SAFETY: both layouts are in bounds; `dst` is borrowed mutably until after the stream is
        // synchronised by `finish`.
        let issued = unsafe { issue(host, self.layout(), &self.shape, stream) };
        finish(issued, stream)
    }

    fn layout(&self) -> Layout {
        Layout {
            address: self.address(),
            device: self.device(),
            strides: self.strides.iter().map(|&s| s as usize).collect(),
            itemsize: size_of::<T>(),
        }
    }

    fn check_host_len(&self, what: &'static str, len: usize) -> Result<()> {
        if len == self.len() {
            Ok(())
        } else {
            Err(Error::SizeMismatch {
                what,
                expected: self.len() * size_of::<T>(),
                actual: len * size_of::<T>(),
            })
        }
    }

    fn check_same_shape(&self, dst: &StridedView<T>) -> Result<()> {
        if self.shape == dst.shape {
            Ok(())
        } else {
            Err(Error::InvalidArgument(format!(
                "cannot copy a view of shape {:?} into one of shape {:?}",
                self.shape, dst.shape
            )))
        }
    }

    fn check_writable(&self) -> Result<()> {
        if !self.buffer.is_mutable() {
            return Err(Error::Unsupported(
                "the view's buffer is not mutable: other views share its allocation, or it is foreign memory".into(),
            ));
        }
        let strides: Vec<usize> = self.strides.iter().map(|&s| s as usize).collect();
        if !is_non_overlapping(&self.shape, &strides, size_of::<T>()) {
            return Err(Error::InvalidArgument(format!(
                "cannot write through a view whose indices overlap (shape {:?}, strides {:?})",
                self.shape, self.strides
            )));
        }
        Ok(())
    }
}

/// Whether no two indices of the layout reach the same bytes. Sufficient, not necessary: axes sorted
/// by stride must each step past everything the smaller axes span.
fn is_non_overlapping(shape: &[usize], strides: &[usize], itemsize: usize) -> bool {
    if shape.contains(&0) {
        return true;
    }
    let mut dims: Vec<(usize, usize)> = shape
        .iter()
        .copied()
        .zip(strides.iter().copied())
        .filter(|&(n, _)| n > 1)
        .collect();
    dims.sort_by_key(|&(_, s)| s);
    let mut span = itemsize;
    for (n, s) in dims {
        if s < span {
            return false;
        }
        span += s * (n - 1);
    }
    true
}

/// One side of a strided copy.
struct Layout {
    address: u64,
    device: Device,
    strides: Vec<usize>,
    itemsize: usize,
}

impl Layout {
    /// A C-order host slice of `shape`.
    fn host(address: u64, shape: &[usize], itemsize: usize) -> Layout {
        let strides = c_strides(shape, itemsize).into_iter().map(|s| s as usize).collect();
        Layout {
            address,
            device: Device::Cpu,
            strides,
            itemsize,
        }
    }
}

/// A strided copy reduced to its simplest form: `outer` loops (outermost first) around 2-D copies of
/// `rows` rows of `width` contiguous bytes, the rows `src_pitch` / `dst_pitch` bytes apart.
#[derive(Debug, PartialEq, Eq)]
struct Plan {
    width: usize,
    rows: usize,
    src_pitch: usize,
    dst_pitch: usize,
    /// (length, source stride, destination stride) of each outer axis.
    outer: Vec<(usize, usize, usize)>,
}

/// Plans a copy of `shape` between two layouts (strides in bytes); `None` when there is nothing to
/// copy. Axes of length 1 are dropped, the innermost axes that both sides store contiguously become
/// the row width, and neighbouring axes that both sides step through evenly are merged.
fn plan(shape: &[usize], src: &[usize], dst: &[usize], itemsize: usize) -> Option<Plan> {
    if shape.contains(&0) {
        return None;
    }
    let mut dims: Vec<(usize, usize, usize)> = shape
        .iter()
        .zip(src)
        .zip(dst)
        .map(|((&n, &s), &d)| (n, s, d))
        .filter(|&(n, _, _)| n != 1)
        .collect();
    let mut width = itemsize;
    while let Some(&(n, s, d)) = dims.last() {
        if s != width || d != width {
            break;
        }
        width *= n;
        dims.pop();
    }
    // Merge, innermost first: an outer axis whose stride is the inner axis's whole span, on both sides.
    let mut merged: Vec<(usize, usize, usize)> = Vec::new();
    for &(n, s, d) in dims.iter().rev() {
        if let Some(inner) = merged.last_mut()
            && inner.0.checked_mul(inner.1) == Some(s)
            && inner.0.checked_mul(inner.2) == Some(d)
        {
            inner.0 *= n;
            continue;
        }
        merged.push((n, s, d));
    }
    let (rows, src_pitch, dst_pitch) = if merged.is_empty() {
        (1, width, width)
    } else {
        merged.remove(0)
    };
    merged.reverse();
    Some(Plan {
        width,
        rows,
        src_pitch,
        dst_pitch,
        outer: merged,
    })
}

/// The largest pitch `cuMemcpy2D` accepts (`CU_DEVICE_ATTRIBUTE_MAX_PITCH` on current GPUs).
const MAX_PITCH: usize = i32::MAX as usize;

/// Issues the copy of `shape` elements from `src` to `dst` on `stream`. Returns once the work is
/// issued (on the CPU stream, once it is done).
///
/// # Safety
/// Every element either layout reaches must be valid memory of its device; `dst` must not overlap
/// `src` or itself; host memory in either must not be accessed by anything else until the stream's
/// work completes. On the CPU stream both sides must be host-accessible.
unsafe fn issue(dst: Layout, src: Layout, shape: &[usize], stream: &Stream) -> Result<()> {
    debug_assert_eq!(dst.itemsize, src.itemsize);
    let itemsize = src.itemsize;
    let Some(plan) = plan(shape, &src.strides, &dst.strides, itemsize) else {
        return Ok(());
    };
    if plan.outer.is_empty() && plan.rows == 1 {
        // Contiguous on both sides: one copy.
        // SAFETY: `width` bytes from each base are in bounds (caller); the rest is the caller's contract.
        return unsafe { copy(dst.address, dst.device, src.address, src.device, plan.width, stream) };
    }
    let raw = match stream.cuda() {
        Some(_) => Some(stream.bind()?),
        None => None,
    };
    let mut index = vec![0usize; plan.outer.len()];
    loop {
        let (mut s, mut d) = (src.address, dst.address);
        for (&i, &(_, ss, ds)) in index.iter().zip(&plan.outer) {
            s += (i * ss) as u64;
            d += (i * ds) as u64;
        }
        match raw {
            // SAFETY: each row lies inside the layouts (caller), host-accessible on the CPU stream.
            None => unsafe { copy_rows_host(d, s, &plan) },
            // SAFETY: as above, on a stream of a bound context.
            Some(raw) => unsafe { copy_rows_cuda(d, s, &plan, raw) }?,
        }
        // Advance the odometer over the outer axes, innermost fastest.
        let mut axis = index.len();
        loop {
            if axis == 0 {
                return Ok(());
            }
            axis -= 1;
            index[axis] += 1;
            if index[axis] < plan.outer[axis].0 {
                break;
            }
            index[axis] = 0;
        }
    }
}

/// Copies one plane of rows on the host.
///
/// # Safety
/// Every row of both sides must be host memory the caller may access; `dst` rows must not overlap.
unsafe fn copy_rows_host(dst: u64, src: u64, plan: &Plan) {
    for r in 0..plan.rows {
        let (s, d) = (src + (r * plan.src_pitch) as u64, dst + (r * plan.dst_pitch) as u64);
        // SAFETY: `width` bytes at each row are valid host memory (caller); `copy` allows overlap.
        unsafe { std::ptr::copy(s as *const u8, d as *mut u8, plan.width) };
    }
}

/// Issues one plane of rows on a CUDA stream: one `cuMemcpy2DAsync` when the pitches allow it, one
/// `cuMemcpyAsync` per row otherwise (a broadcast source, or pitches beyond the driver's limit).
///
/// # Safety
/// Every row of both sides must be valid memory the driver can address; `raw` must be a stream of the
/// context bound to this thread.
unsafe fn copy_rows_cuda(dst: u64, src: u64, plan: &Plan, raw: CUstream) -> Result<()> {
    let pitches_ok = |p: usize| p >= plan.width && p <= MAX_PITCH;
    if plan.rows > 1 && pitches_ok(plan.src_pitch) && pitches_ok(plan.dst_pitch) {
        let (width, rows) = (plan.width, plan.rows);
        // SAFETY: the rows are valid (caller), the pitches at least `width` and within the limit
        // (checked above), in the bound context's stream.
        return unsafe { driver::memcpy_2d_async(dst, plan.dst_pitch, src, plan.src_pitch, width, rows, raw) };
    }
    for r in 0..plan.rows {
        let (s, d) = (src + (r * plan.src_pitch) as u64, dst + (r * plan.dst_pitch) as u64);
        // SAFETY: each row is valid memory (caller), in the bound context's stream.
        unsafe { driver::memcpy_async(d, s, plan.width, raw) }?;
    }
    Ok(())
}

/// Synchronises `stream` after a blocking copy, whether or not it was issued whole, so that nothing
/// is in flight when the caller's memory is released; reports the first error.
fn finish(issued: Result<()>, stream: &Stream) -> Result<()> {
    let synced = stream.synchronize();
    issued?;
    synced
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn c_strides_are_row_major() {
        assert_eq!(c_strides(&[2, 3, 4], 4), vec![48, 16, 4]);
        assert_eq!(c_strides(&[], 8), Vec::<isize>::new());
        assert_eq!(c_strides(&[5], 2), vec![2]);
    }

    #[test]
    fn contiguous_copies_plan_to_one_row() {
        let p = plan(&[4, 3], &[12, 4], &[12, 4], 4).unwrap();
        assert_eq!(
            p,
            Plan {
                width: 48,
                rows: 1,
                src_pitch: 48,
                dst_pitch: 48,
                outer: vec![]
            }
        );
    }

    #[test]
    fn a_column_plans_to_rows_of_one_element() {
        // Column 1 of a 4x3 f32 matrix into a contiguous vector.
        let p = plan(&[4], &[12], &[4], 4).unwrap();
        assert_eq!(
            p,
            Plan {
                width: 4,
                rows: 4,
                src_pitch: 12,
                dst_pitch: 4,
                outer: vec![]
            }
        );
    }

    #[test]
    fn padded_rows_plan_to_one_2d_copy() {
        // A 3x2 block of a 3x5 matrix of u16: rows of 4 bytes, 10 bytes apart.
        let p = plan(&[3, 2], &[10, 2], &[4, 2], 2).unwrap();
        assert_eq!(
            p,
            Plan {
                width: 4,
                rows: 3,
                src_pitch: 10,
                dst_pitch: 4,
                outer: vec![]
            }
        );
    }

    #[test]
    fn evenly_stepped_axes_merge_and_others_loop() {
        // Every other row of a 3-D array whose planes are padded.
        let p = plan(&[2, 3, 4], &[200, 32, 4], &[48, 16, 4], 4).unwrap();
        assert_eq!(
            p,
            Plan {
                width: 16,
                rows: 3,
                src_pitch: 32,
                dst_pitch: 16,
                outer: vec![(2, 200, 48)]
            }
        );
        // Axes of length 1 vanish; two evenly stepped axes become one.
        let p = plan(&[2, 1, 3], &[24, 999, 8], &[12, 5, 4], 4).unwrap();
        assert_eq!(
            p,
            Plan {
                width: 4,
                rows: 6,
                src_pitch: 8,
                dst_pitch: 4,
                outer: vec![]
            }
        );
        assert_eq!(plan(&[3, 0], &[4, 4], &[4, 4], 4), None);
        assert_eq!(plan(&[], &[], &[], 8).unwrap().width, 8);
    }

    #[test]
    fn overlap_is_detected() {
        assert!(is_non_overlapping(&[4, 3], &[12, 4], 4));
        assert!(is_non_overlapping(&[4], &[12], 4));
        assert!(!is_non_overlapping(&[4, 3], &[4, 4], 4));
        assert!(!is_non_overlapping(&[4], &[0], 4));
        assert!(is_non_overlapping(&[1], &[0], 4));
        assert!(is_non_overlapping(&[0, 3], &[0, 0], 4));
    }
}
