//! Zero-copy import of arrays and batches from the C Device Data Interface.
//!
//! The producer's struct is moved into an owner that every imported buffer shares; its release
//! callback runs exactly once, when the last buffer drops. One walk checks the structure (types,
//! counts, lengths, offsets, pointers), builds the arrays where they end up and notes their buffers; the
//! sizes of string and binary data come from the last offset of each array, read after the
//! producer's event, all of them at once (one gather kernel on a GPU, see `transfer::offsets`)
//! while the buffers' views are made, with one synchronisation. Every imported buffer is a view of
//! one allocation record that spans the address space and owns the producer's struct.

use std::ffi::c_void;

use smallvec::SmallVec;

use arrow_schema::{DataType, SchemaRef, UnionMode};

use crate::abi::{FFI_ArrowArray, FFI_ArrowDeviceArray, FFI_ArrowSchema};
use crate::array::{Buffers, DeviceArrayData, DeviceRecordBatch, check_own_type, has_validity};
use crate::device::{Device, Event, Stream};
use crate::driver::{self, CUevent};
use crate::error::{Error, Result};
use crate::ffi::schema::import_schema_ref;
use crate::memory::{ALIGNMENT, Allocation, DeviceBuffer, stream_for};
use crate::trace::Laps;
use crate::transfer::offsets::start_reading;

/// Nesting deeper than this is refused rather than risking the stack.
pub(crate) const MAX_DEPTH: usize = 64;

/// More children than this in one array or schema are refused.
pub(crate) const MAX_CHILDREN: usize = 65536;

/// More buffers than this in one array are refused.
const MAX_BUFFERS: usize = 4096;

/// The producer's struct, released when dropped.
struct Imported(#[allow(dead_code)] FFI_ArrowDeviceArray);

/// A buffer whose size is an offset still to be read from the device: the child indices from the
/// root to its array, which buffer of the array it is, its address, and the read whose value is
/// its size.
struct Late {
    path: SmallVec<[usize; 4]>,
    buffer: usize,
    ptr: u64,
    read: usize,
}

impl Late {
    /// Puts the buffer, now that `offsets` are read, into its array of `root`.
    fn resolve(&self, root: &mut DeviceArrayData, span: &DeviceBuffer, offsets: &[i64]) -> Result<()> {
        let size = count(offsets[self.read], "last offset")?;
        let mut array = root;
        for &c in &self.path {
            array = &mut array.children[c];
        }
        array.buffers[self.buffer] = view(span, self.ptr, size)?;
        Ok(())
    }
}

/// A buffer as the walk notes it, for [`attach`] to make its view: each array's, in the order of
/// the walk (an array's own, then those of its children).
#[derive(Clone, Copy)]
enum Slot {
    /// The array's validity bitmap.
    Nulls { ptr: u64, size: usize },
    /// Its next buffer.
    Bytes { ptr: u64, size: usize },
    /// Its next buffer, whose size is the value of offset read number `read`.
    LastOffset { ptr: u64, read: usize },
    /// The end of the array's own buffers.
    End,
}

/// Walks a producer's struct, checking it, building its arrays without their buffers and noting
/// those in `slots`, and the offsets to read from the device (string and binary sizes) in `reads`.
struct Walker {
    /// (address, width) of each offset to read.
    reads: Vec<(u64, usize)>,
    slots: Vec<Slot>,
    /// Whether the array being walked has not yet ended its own buffers' slots.
    open: bool,
}

/// An array of `data_type` to be filled in by [`Walker::node`], built where it ends up (a parent's
/// list of children): arrays are large, and a batch has hundreds. The type is cloned here, into
/// its place, rather than assigned later over a placeholder, which cost a drop and a read back of
/// the clone through memory.
fn blank(data_type: &DataType) -> DeviceArrayData {
    DeviceArrayData {
        data_type: data_type.clone(),
        len: 0,
        offset: 0,
        null_count: None,
        nulls: None,
        buffers: Buffers::new(),
        children: Vec::new(),
        trusted: false,
    }
}

/// An [`Error::InvalidData`] about a malformed struct.
pub(super) fn invalid(msg: impl Into<String>) -> Error {
    Error::InvalidData(msg.into())
}

fn count(value: i64, what: &str) -> Result<usize> {
    usize::try_from(value).map_err(|_| invalid(format!("negative {what}: {value}")))
}

/// The size of `n` values of `width` bytes; no buffer holds more than `isize::MAX` bytes.
fn byte_size(n: usize, width: usize) -> Result<usize> {
    n.checked_mul(width)
        .filter(|size| *size <= isize::MAX as usize)
        .ok_or_else(|| invalid(format!("{n} values of {width} bytes: the size overflows")))
}

/// The address just past a buffer of `size` bytes at `ptr`, which must lie in the address space.
fn buffer_end(ptr: u64, size: usize) -> Result<u64> {
    ptr.checked_add(size as u64).ok_or_else(|| {
        invalid(format!(
            "a buffer of {size} bytes at {ptr:#x} passes the end of the address space"
        ))
    })
}

/// One producer's `ArrowArray`, its counts checked, with its buffer and child pointers as slices.
struct Parts<'a> {
    array: &'a FFI_ArrowArray,
    data_type: &'a DataType,
    /// `offset + length`: the elements the buffers must hold.
    end: usize,
    ptrs: &'a [*const c_void],
    kids: &'a [*mut FFI_ArrowArray],
    depth: usize,
}

impl<'a> Parts<'a> {
    /// Checks `a`'s counts and takes its buffer and child pointers, and starts its `node` (a
    /// [`blank`] one: no buffers or children yet).
    ///
    /// # Safety
    /// `a` must be a valid, unreleased `ArrowArray` whose pointers are valid per the spec.
    // Inlined into the walk, for the reason [`view`] is.
    #[inline(always)]
    unsafe fn of(
        a: &'a FFI_ArrowArray,
        dt: &'a DataType,
        depth: usize,
        node: &mut DeviceArrayData,
    ) -> Result<Parts<'a>> {
        if depth > MAX_DEPTH {
            return Err(invalid(format!("nesting deeper than {MAX_DEPTH}")));
        }
        if a.release.is_none() {
            return Err(invalid("a released child array"));
        }
        let len = count(a.length, "length")?;
        let offset = count(a.offset, "offset")?;
        let end = len
            .checked_add(offset)
            .filter(|e| *e <= i64::MAX as usize / 16)
            .ok_or_else(|| invalid("length + offset overflows"))?;
        let null_count = match a.null_count {
            -1 => None,
            n if n >= 0 && n as usize <= len => Some(n as usize),
            n => return Err(invalid(format!("null count {n} for length {len}"))),
        };
        let n_buffers = count(a.n_buffers, "buffer count")?;
        let n_children = count(a.n_children, "child count")?;
        if (n_buffers > 0 && a.buffers.is_null()) || (n_children > 0 && a.children.is_null()) {
            return Err(invalid("null buffers or children array"));
        }
        if n_buffers > MAX_BUFFERS || n_children > MAX_CHILDREN {
            return Err(invalid(format!("{n_buffers} buffers and {n_children} children")));
        }
        let ptrs: &[*const c_void] = match n_buffers {
            0 => &[],
            // SAFETY: a non-null (checked) array of the stated length, valid per the caller.
            n => unsafe { std::slice::from_raw_parts(a.buffers as *const *const c_void, n) },
        };
        let kids: &[*mut FFI_ArrowArray] = match n_children {
            0 => &[],
            // SAFETY: as above.
            n => unsafe { std::slice::from_raw_parts(a.children, n) },
        };
        let parts = Parts {
            array: a,
            data_type: dt,
            end,
            ptrs,
            kids,
            depth,
        };
        node.len = len;
        node.offset = offset;
        node.null_count = null_count;
        Ok(parts)
    }

    /// The validity bitmap of `node`, for types that have a validity slot and a bitmap in it.
    fn validity(&self, node: &mut DeviceArrayData) -> Result<Option<Slot>> {
        let dt = self.data_type;
        if !has_validity(dt) {
            return Ok(None);
        }
        let Some(bitmap) = self.ptrs.first() else {
            return Err(invalid(format!("{dt} array without a validity buffer slot")));
        };
        if bitmap.is_null() {
            if node.null_count.is_some_and(|n| n > 0) {
                return Err(invalid(format!(
                    "{} nulls but no validity bitmap",
                    self.array.null_count
                )));
            }
            node.null_count = Some(0);
            return Ok(None);
        }
        Ok(Some(Slot::Nulls {
            ptr: *bitmap as u64,
            size: self.end.div_ceil(8),
        }))
    }

    /// Checks that the array has `buffers` buffers and `children` children.
    fn expect(&self, buffers: usize, children: usize) -> Result<()> {
        let (n_buffers, n_children) = (self.ptrs.len(), self.kids.len());
        if n_buffers != buffers || n_children != children {
            return Err(invalid(format!(
                "{} array with {n_buffers} buffers and {n_children} children; expected {buffers} and {children}",
                self.data_type
            )));
        }
        Ok(())
    }

    /// Buffer `i`, of `size` bytes.
    fn bytes(&self, i: usize, size: usize) -> Slot {
        Slot::Bytes {
            ptr: self.ptrs[i] as u64,
            size,
        }
    }

    /// Buffer `i`, of one `width`-byte value per element.
    fn values(&self, i: usize, width: usize) -> Result<Slot> {
        Ok(self.bytes(i, byte_size(self.end, width)?))
    }
}

impl Walker {
    /// A walker with room for the slots and reads of `a` when its children are flat (at most four
    /// slots and one read each, as a string column has), so that a batch's walk does not grow them.
    fn sized_for(a: &FFI_ArrowArray) -> Walker {
        let arrays = usize::try_from(a.n_children).unwrap_or(0).min(MAX_CHILDREN) + 1;
        Walker {
            reads: Vec::with_capacity(arrays),
            slots: Vec::with_capacity(4 * arrays),
            open: false,
        }
    }

    /// # Safety
    /// `a` must be a valid, unreleased `ArrowArray` whose pointers are valid per the spec.
    unsafe fn node(
        &mut self,
        a: &FFI_ArrowArray,
        dt: &DataType,
        depth: usize,
        node: &mut DeviceArrayData,
    ) -> Result<()> {
        // Every type nested in the import's is walked here, so each is checked here.
        check_own_type(dt)?;
        // SAFETY: `a` is valid per the caller.
        let p = unsafe { Parts::of(a, dt, depth, node)? };
        self.open = true;
        if let Some(bitmap) = p.validity(node)? {
            self.slots.push(bitmap);
        }
        match dt {
            DataType::List(_)
            | DataType::LargeList(_)
            | DataType::Map(..)
            | DataType::ListView(_)
            | DataType::LargeListView(_)
            | DataType::FixedSizeList(..) => {
                // SAFETY: `p` is `a`'s, valid per the caller.
                unsafe { self.list(&p, node)? }
            }
            DataType::Struct(_) | DataType::Union(..) | DataType::Dictionary(..) | DataType::RunEndEncoded(..) => {
                // SAFETY: as above.
                unsafe { self.composite(&p, node)? }
            }
            _ => {
                // SAFETY: as above.
                unsafe { self.leaf(&p, node)? }
            }
        }
        self.end_slots();
        Ok(())
    }

    /// Ends the slots of the array being walked, once: before the slots of its first child, or
    /// when it has no children.
    fn end_slots(&mut self) {
        if std::mem::take(&mut self.open) {
            self.slots.push(Slot::End);
        }
    }

    /// Walks `a` (of type `dt`, at `depth`) into a new last child of `parent`; returns the child's
    /// length.
    ///
    /// # Safety
    /// As for [`Walker::node`].
    unsafe fn push_node(
        &mut self,
        a: &FFI_ArrowArray,
        dt: &DataType,
        depth: usize,
        parent: &mut DeviceArrayData,
    ) -> Result<usize> {
        self.end_slots();
        parent.children.push(blank(dt));
        let child = parent.children.last_mut().expect("a child was pushed");
        // SAFETY: forwarded from the caller.
        unsafe { self.node(a, dt, depth, child)? };
        Ok(child.len)
    }

    /// Walks child `i` of `p`'s array, of type `dt`, into a new last child of `node`; returns
    /// its length.
    ///
    /// # Safety
    /// `p` must come from a valid array ([`Parts::of`]).
    unsafe fn child(&mut self, p: &Parts<'_>, i: usize, dt: &DataType, node: &mut DeviceArrayData) -> Result<usize> {
        let c = p.kids[i];
        if c.is_null() {
            return Err(invalid(format!("child {i} is null")));
        }
        // SAFETY: a non-null child of a valid array is valid per the caller.
        unsafe { self.push_node(&*c, dt, p.depth + 1, node) }
    }

    /// The buffers of an array without children.
    ///
    /// # Safety
    /// `p` must come from a valid array ([`Parts::of`]).
    unsafe fn leaf(&mut self, p: &Parts<'_>, node: &mut DeviceArrayData) -> Result<()> {
        let (dt, end, ptrs) = (p.data_type, p.end, p.ptrs);
        match dt {
            DataType::Null => {
                p.expect(0, 0)?;
                node.null_count = Some(node.len);
            }
            DataType::Boolean => {
                p.expect(2, 0)?;
                self.slots.push(p.bytes(1, end.div_ceil(8)));
            }
            DataType::FixedSizeBinary(w) => {
                p.expect(2, 0)?;
                // Not negative: `Walker::node` checked the type.
                self.slots.push(p.values(1, *w as usize)?);
            }
            DataType::Utf8 | DataType::Binary | DataType::LargeUtf8 | DataType::LargeBinary => {
                p.expect(3, 0)?;
                let w = if matches!(dt, DataType::Utf8 | DataType::Binary) {
                    4
                } else {
                    8
                };
                let offsets = self.offsets(ptrs[1], end, w)?;
                self.slots.push(offsets);
                let ptr = ptrs[2] as u64;
                self.slots.push(match end == 0 && ptrs[1].is_null() {
                    true => Slot::Bytes { ptr, size: 0 },
                    false => Slot::LastOffset {
                        ptr,
                        read: self.reads.len() - 1,
                    },
                });
            }
            DataType::Utf8View | DataType::BinaryView => {
                let (n_buffers, n_children) = (ptrs.len(), p.kids.len());
                if n_buffers < 3 || n_children != 0 {
                    return Err(invalid(format!(
                        "{dt} array with {n_buffers} buffers and {n_children} children"
                    )));
                }
                let sizes_ptr = ptrs[n_buffers - 1] as *const i64;
                let data_buffers = n_buffers - 3;
                if sizes_ptr.is_null() && data_buffers > 0 {
                    return Err(invalid("view array without its buffer sizes"));
                }
                self.slots.push(p.values(1, 16)?);
                for i in 0..data_buffers {
                    // SAFETY: the last buffer holds one host int64 per data buffer (spec).
                    let size = unsafe { sizes_ptr.add(i).read_unaligned() };
                    self.slots.push(p.bytes(2 + i, count(size, "view buffer size")?));
                }
            }
            dt => {
                let w = dt
                    .primitive_width()
                    .ok_or_else(|| Error::Unsupported(format!("import of {dt}")))?;
                p.expect(2, 0)?;
                self.slots.push(p.values(1, w)?);
            }
        }
        Ok(())
    }

    /// The buffers and child of a list-like array (lists, list views, maps, fixed-size lists).
    ///
    /// # Safety
    /// `p` must come from a valid array ([`Parts::of`]).
    unsafe fn list(&mut self, p: &Parts<'_>, node: &mut DeviceArrayData) -> Result<()> {
        let (dt, end, ptrs) = (p.data_type, p.end, p.ptrs);
        match dt {
            DataType::List(f) | DataType::LargeList(f) | DataType::Map(f, _) => {
                p.expect(2, 1)?;
                let w = if matches!(dt, DataType::LargeList(_)) { 8 } else { 4 };
                let size = match end == 0 && ptrs[1].is_null() {
                    true => 0,
                    false => byte_size(end + 1, w)?,
                };
                self.slots.push(p.bytes(1, size));
                // SAFETY: `p` is valid per the caller.
                unsafe { self.child(p, 0, f.data_type(), node)? };
            }
            DataType::ListView(f) | DataType::LargeListView(f) => {
                p.expect(3, 1)?;
                let w = if matches!(dt, DataType::ListView(_)) { 4 } else { 8 };
                self.slots.push(p.values(1, w)?);
                self.slots.push(p.values(2, w)?);
                // SAFETY: as above.
                unsafe { self.child(p, 0, f.data_type(), node)? };
            }
            DataType::FixedSizeList(f, size) => {
                p.expect(1, 1)?;
                // SAFETY: as above.
                let len = unsafe { self.child(p, 0, f.data_type(), node)? };
                // Not negative: `Walker::node` checked the type.
                let needed = end
                    .checked_mul(*size as usize)
                    .ok_or_else(|| invalid("fixed-size list too long"))?;
                // Counted from the child's own offset, as a struct's children are.
                if len < needed {
                    return Err(invalid(format!(
                        "fixed-size list child has {len} elements, {needed} needed"
                    )));
                }
            }
            _ => unreachable!("`node` passes list types only"),
        }
        Ok(())
    }

    /// The buffers and children of a struct, union, dictionary or run-end encoded array.
    ///
    /// # Safety
    /// `p` must come from a valid array ([`Parts::of`]).
    unsafe fn composite(&mut self, p: &Parts<'_>, node: &mut DeviceArrayData) -> Result<()> {
        let (dt, end) = (p.data_type, p.end);
        match dt {
            DataType::Struct(fields) => {
                p.expect(1, fields.len())?;
                // Arrays are large: a batch's hundreds of columns would be moved at every growth.
                node.children.reserve_exact(fields.len());
                for (i, f) in fields.iter().enumerate() {
                    // SAFETY: `p` is valid per the caller.
                    let len = unsafe { self.child(p, i, f.data_type(), node)? };
                    if len < end {
                        return Err(invalid(format!(
                            "struct child {} has {len} elements, {end} needed",
                            f.name()
                        )));
                    }
                }
            }
            DataType::Union(fields, mode) => {
                let dense = matches!(mode, UnionMode::Dense);
                p.expect(if dense { 2 } else { 1 }, fields.len())?;
                self.slots.push(p.bytes(0, end));
                if dense {
                    self.slots.push(p.values(1, 4)?);
                }
                node.children.reserve_exact(fields.len());
                for (i, (_, f)) in fields.iter().enumerate() {
                    // SAFETY: as above.
                    let len = unsafe { self.child(p, i, f.data_type(), node)? };
                    if !dense && len < end {
                        return Err(invalid(format!(
                            "sparse union child {i} has {len} elements, {end} needed"
                        )));
                    }
                }
            }
            DataType::Dictionary(key, values) => {
                p.expect(2, 0)?;
                let w = key
                    .primitive_width()
                    .filter(|_| key.is_dictionary_key_type())
                    .ok_or_else(|| invalid(format!("dictionary key {key}")))?;
                self.slots.push(p.values(1, w)?);
                let dictionary = p.array.dictionary;
                if dictionary.is_null() {
                    return Err(invalid("dictionary array without a dictionary"));
                }
                // SAFETY: a non-null dictionary of a valid array is valid per the caller.
                unsafe { self.push_node(&*dictionary, values, p.depth + 1, node)? };
            }
            DataType::RunEndEncoded(run_ends, values) => {
                p.expect(0, 2)?;
                // SAFETY: as above.
                unsafe { self.child(p, 0, run_ends.data_type(), node)? };
                // SAFETY: as above.
                unsafe { self.child(p, 1, values.data_type(), node)? };
            }
            _ => unreachable!("`node` passes structs, unions, dictionaries and run-end encoded types only"),
        }
        Ok(())
    }

    /// An offsets buffer of `end + 1` elements of `w` bytes; notes the last one for reading.
    fn offsets(&mut self, ptr: *const c_void, end: usize, w: usize) -> Result<Slot> {
        let ptr = ptr as u64;
        if ptr == 0 {
            return match end {
                0 => Ok(Slot::Bytes { ptr, size: 0 }),
                _ => Err(invalid("null offsets buffer")),
            };
        }
        let size = byte_size(end + 1, w)?;
        let last = buffer_end(ptr, size)? - w as u64;
        self.reads.push((last, w));
        Ok(Slot::Bytes { ptr, size })
    }
}

/// The view of `size` bytes at `ptr` of the import's `span`, which covers every non-null address
/// (producers give empty buffers any address, `0x1` or `0x8` too); an empty buffer with a null
/// pointer views address [`ALIGNMENT`], aligned and non-null as some consumers insist.
///
/// Inlined into its callers: a view returned through memory is read back before the stores that
/// wrote it have landed, a stall on each of a batch's few hundred buffers.
#[inline(always)]
fn view(span: &DeviceBuffer, ptr: u64, size: usize) -> Result<DeviceBuffer> {
    if ptr == 0 {
        return match size {
            0 => span.slice(ALIGNMENT - 1, 0),
            _ => Err(invalid(format!("null buffer where {size} bytes are needed"))),
        };
    }
    buffer_end(ptr, size)?;
    span.slice((ptr - 1) as usize, size)
}

/// Gives `node` and the arrays below it their buffers, views of `span`, from the walk's `slots`
/// (see [`Slot`]); `path` leads from the root to `node`. A buffer whose size is still being read
/// is left empty and noted in `late`.
fn attach(
    node: &mut DeviceArrayData,
    slots: &mut std::slice::Iter<'_, Slot>,
    span: &DeviceBuffer,
    path: &mut SmallVec<[usize; 4]>,
    late: &mut Vec<Late>,
) -> Result<()> {
    for slot in slots.by_ref() {
        match *slot {
            Slot::Nulls { ptr, size } => node.nulls = Some(view(span, ptr, size)?),
            Slot::Bytes { ptr, size } => node.buffers.push(view(span, ptr, size)?),
            Slot::LastOffset { ptr, read } => {
                late.push(Late {
                    path: path.clone(),
                    buffer: node.buffers.len(),
                    ptr,
                    read,
                });
                node.buffers.push(view(span, 0, 0)?);
            }
            Slot::End => break,
        }
    }
    for (i, child) in node.children.iter_mut().enumerate() {
        path.push(i);
        attach(child, slots, span, path, late)?;
        path.pop();
    }
    Ok(())
}

/// Imports an array of `data_type` without copying. Work issued later on `stream` waits for the
/// producer's `sync_event`; the returned event marks that point. On error the struct is released.
///
/// # Safety
/// `array` must follow the C Device Data Interface: its pointers valid, its buffers of the sizes its
/// type and lengths imply, on the device it names.
pub unsafe fn import_array(
    array: FFI_ArrowDeviceArray,
    data_type: &DataType,
    stream: &Stream,
) -> Result<(DeviceArrayData, Event)> {
    let mut laps = Laps::start();
    if array.is_released() {
        return Err(invalid("the array has been released"));
    }
    let device = Device::from_c(array.device_type, array.device_id)?;
    // The device must exist: with a CUDA stream passed in, nothing else would look it up.
    device.context()?;
    let stream = stream_for(stream, device, Device::Cpu)?;
    laps.lap("import.device");
    let ready = wait_for_producer(&array, device, &stream)?;
    laps.lap("import.wait");
    let mut walker = Walker::sized_for(&array.array);
    let mut data = blank(data_type);
    // SAFETY: valid per the caller.
    unsafe { walker.node(&array.array, data_type, 0, &mut data)? };
    laps.lap("import.walk");
    // Only views of the producer's buffers are handed out, wherever in the address space they lie.
    // SAFETY: the producer guarantees each buffer's bytes on `device` until release, which the
    // span's owner defers until the last view drops.
    let span = DeviceBuffer::from_allocation(unsafe {
        Allocation::spanning(1, (u64::MAX - 1) as usize, device, Box::new(Imported(array)))
    });
    // The sizes of string data are read while the views are made. Declared after `span`: if this
    // returns early, the read is waited for before the producer is released.
    // SAFETY: the reads are elements of offsets buffers, valid per the caller until `span` drops.
    let offsets = unsafe { start_reading(&walker.reads, device, &stream)? };
    laps.lap("import.gather");
    let mut late = Vec::with_capacity(walker.reads.len());
    attach(
        &mut data,
        &mut walker.slots.iter(),
        &span,
        &mut SmallVec::new(),
        &mut late,
    )?;
    laps.lap("import.views");
    let offsets = offsets.wait()?;
    laps.lap("import.offsets");
    for l in &late {
        l.resolve(&mut data, &span, &offsets)?;
    }
    laps.lap("import.sizes");
    Ok((data, ready))
}

/// Imports a batch exported as a struct array with its schema.
///
/// # Safety
/// As for [`import_array`]; `schema` as for [`import_schema`](crate::ffi::import_schema).
pub unsafe fn import_batch(
    array: FFI_ArrowDeviceArray,
    schema: &FFI_ArrowSchema,
    stream: &Stream,
) -> Result<DeviceRecordBatch> {
    let mut laps = Laps::start();
    // SAFETY: forwarded from the caller.
    let schema = unsafe { import_schema_ref(schema) }?;
    laps.lap("import.schema");
    // SAFETY: forwarded from the caller.
    unsafe { import_batch_of(array, schema, stream) }
}

/// Imports a batch of `schema` exported as a struct array (the schema imported already, say the
/// schema of a stream).
///
/// # Safety
/// As for [`import_array`].
pub(crate) unsafe fn import_batch_of(
    array: FFI_ArrowDeviceArray,
    schema: SchemaRef,
    stream: &Stream,
) -> Result<DeviceRecordBatch> {
    let data_type = DataType::Struct(schema.fields().clone());
    // SAFETY: forwarded from the caller.
    let (data, ready) = unsafe { import_array(array, &data_type, stream)? };
    let mut laps = Laps::start();
    if data.null_count.is_some_and(|n| n > 0) || (data.null_count.is_none() && data.nulls.is_some()) {
        return Err(invalid("a record batch's struct array has nulls"));
    }
    // Columns that are the struct's whole children are taken as they are, others cut to its window.
    let (offset, len) = (data.offset, data.len);
    let mut columns = data.children;
    for c in &mut columns {
        if offset != 0 || c.len != len {
            *c = c.slice(offset, len)?;
        }
    }
    // The walk built each column from its field, every buffer a view of one span on one device.
    let batch = DeviceRecordBatch::of_columns(schema, columns, len, ready);
    laps.lap("import.batch");
    Ok(batch)
}

/// Makes `stream` wait for the producer's event (the host, for host-accessible memory or the CPU
/// stream), and returns the event that marks that point.
fn wait_for_producer(array: &FFI_ArrowDeviceArray, device: Device, stream: &Stream) -> Result<Event> {
    if array.sync_event.is_null() || device == Device::Cpu {
        return Ok(Event::completed());
    }
    let ctx = device.context()?.ok_or_else(|| invalid("no context"))?;
    ctx.bind_to_thread().map_err(Error::driver("cuCtxSetCurrent"))?;
    // SAFETY: for CUDA devices `sync_event` points to a CUevent (spec), valid until release.
    let event = unsafe { *(array.sync_event as *const CUevent) };
    match stream.cuda() {
        Some(s) if !device.is_host_accessible() => {
            // SAFETY: a valid event and stream.
            unsafe { driver::stream_wait_event(s.cu_stream(), event) }?;
            stream.record()
        }
        _ => {
            // SAFETY: a valid event.
            unsafe { driver::event_synchronize(event) }?;
            Ok(Event::completed())
        }
    }
}
