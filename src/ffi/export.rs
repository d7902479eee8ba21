//! Export of device arrays and batches through the C Device Data Interface.
//!
//! One export makes a fixed handful of allocations, however many arrays it holds: every C struct
//! below the root, every node's buffer and child pointer arrays and the variadic sizes of view
//! arrays live in a few slices of one [`Shared`] block, sized by a counting pass first. Each node's
//! `private_data` points at that block; the release of the last node still alive frees it. A
//! consumer may move any child out and release it on its own, as the spec allows.

use std::ffi::c_void;
use std::mem::ManuallyDrop;
use std::ptr;
use std::sync::atomic::{AtomicUsize, Ordering};

use arrow_schema::{DataType, Field};

use crate::abi::{FFI_ArrowArray, FFI_ArrowDeviceArray, FFI_ArrowSchema};
use crate::array::{DeviceArrayData, DeviceRecordBatch, child_types, has_validity};
use crate::device::{Device, Event, Stream};
use crate::driver::CUevent;
use crate::error::{Error, Result};
use crate::ffi::guard::no_unwind;
use crate::ffi::schema_export::export_schema;
use crate::memory::DeviceBuffer;
use crate::trace::Laps;

/// What keeps an export's memory alive: the batch (its columns are shared, not copied) or the array.
enum Owner {
    Batch(#[allow(dead_code)] DeviceRecordBatch),
    Array(#[allow(dead_code)] DeviceArrayData),
}

/// What the release of one node needs, kept in the block rather than read from the node's C struct
/// (which a consumer may have changed): its `private_data` points here.
struct NodeRecord {
    shared: *mut Shared,
    /// The node's children and dictionary, structs of the block.
    below: *mut [*mut FFI_ArrowArray],
    dictionary: *mut FFI_ArrowArray,
}

/// Everything one export owns, freed by the release of its last live node.
struct Shared {
    /// Nodes, the root included, not yet released.
    live: AtomicUsize,
    /// The C structs of every node but the root (which the consumer holds). Never dropped as
    /// `FFI_ArrowArray`s: by the time the block is freed each is released or was moved out.
    nodes: Box<[ManuallyDrop<FFI_ArrowArray>]>,
    /// Every node's buffer pointers, one run per node.
    ptrs: Box<[*const c_void]>,
    /// Every node's child pointers, one run per node.
    children: Box<[*mut FFI_ArrowArray]>,
    /// The same pointers, for the releases: a consumer may overwrite those it was handed.
    links: Box<[*mut FFI_ArrowArray]>,
    /// The lengths of view arrays' data buffers (host memory, as the spec requires).
    sizes: Box<[i64]>,
    /// One record per node, the root first.
    records: Box<[NodeRecord]>,
    _owner: Owner,
    /// The event recorded after the data's producers, and the handle `sync_event` points at.
    _event: Option<Event>,
    sync: CUevent,
}

/// How many of each part a tree needs.
#[derive(Default)]
struct Counts {
    nodes: usize,
    ptrs: usize,
    children: usize,
    sizes: usize,
}

/// The parts of one node, from a [`DeviceArrayData`] or from a batch (a struct of its columns).
struct NodeRef<'a> {
    data_type: &'a DataType,
    len: usize,
    offset: usize,
    null_count: Option<usize>,
    nulls: Option<&'a DeviceBuffer>,
    buffers: &'a [DeviceBuffer],
    children: &'a [DeviceArrayData],
}

impl<'a> NodeRef<'a> {
    fn of(d: &'a DeviceArrayData) -> Self {
        NodeRef {
            data_type: &d.data_type,
            len: d.len,
            offset: d.offset,
            null_count: d.null_count,
            nulls: d.nulls.as_ref(),
            buffers: &d.buffers,
            children: &d.children,
        }
    }

    /// Whether this node's one child is its dictionary rather than a child.
    fn has_dictionary(&self) -> bool {
        matches!(self.data_type, DataType::Dictionary(..))
    }

    /// Whether the node's buffers end with the sizes of its data buffers (views).
    fn is_variadic(&self) -> bool {
        matches!(self.data_type, DataType::Utf8View | DataType::BinaryView)
    }

    /// The node's buffer pointers: the validity slot where the type has one, the buffers, and the
    /// data buffers' sizes of views.
    fn n_ptrs(&self) -> usize {
        usize::from(has_validity(self.data_type)) + self.buffers.len() + usize::from(self.is_variadic())
    }

    /// Adds what this node and those below it need to `counts` (the node itself not counted).
    fn count(&self, counts: &mut Counts) {
        counts.ptrs += self.n_ptrs();
        if self.is_variadic() {
            counts.sizes += self.buffers.len().saturating_sub(1);
        }
        if !self.has_dictionary() {
            counts.children += self.children.len();
        }
        counts.nodes += self.children.len();
        for c in self.children {
            NodeRef::of(c).count(counts);
        }
    }
}

/// Fills the slices of a [`Shared`] block, node by node.
struct Filler<'s> {
    shared: *mut Shared,
    records: &'s mut [NodeRecord],
    links: &'s mut [*mut FFI_ArrowArray],
    nodes: &'s mut [ManuallyDrop<FFI_ArrowArray>],
    ptrs: &'s mut [*const c_void],
    children: &'s mut [*mut FFI_ArrowArray],
    sizes: &'s mut [i64],
}

impl Filler<'_> {
    /// The C struct of `node`, its pointer runs and the nodes below it written into the block.
    fn node(&mut self, node: &NodeRef<'_>) -> FFI_ArrowArray {
        let (record, rest) = std::mem::take(&mut self.records)
            .split_first_mut()
            .expect("the counting pass made a record for every node");
        self.records = rest;
        let n_ptrs = node.n_ptrs();
        let (ptrs, rest) = std::mem::take(&mut self.ptrs).split_at_mut(n_ptrs);
        self.ptrs = rest;
        // Zero-length buffers keep their (aligned, non-null) address too: some consumers insist on one.
        let address = |b: &DeviceBuffer| b.address() as *const c_void;
        let mut at = ptrs.iter_mut();
        let mut put = |p: *const c_void| {
            if let Some(slot) = at.next() {
                *slot = p;
            }
        };
        if has_validity(node.data_type) {
            put(node.nulls.map_or(ptr::null(), address));
        }
        node.buffers.iter().for_each(|b| put(address(b)));
        if node.is_variadic() {
            let n = node.buffers.len().saturating_sub(1);
            let (sizes, rest) = std::mem::take(&mut self.sizes).split_at_mut(n);
            self.sizes = rest;
            for (s, b) in sizes.iter_mut().zip(&node.buffers[1..]) {
                *s = b.len() as i64;
            }
            put(sizes.as_ptr() as *const c_void);
        }
        // The nodes below this one take the next slots, in order; their own children come later.
        let (below, rest) = std::mem::take(&mut self.nodes).split_at_mut(node.children.len());
        self.nodes = rest;
        let (kids, links, dictionary): (&mut [*mut FFI_ArrowArray], &mut [*mut FFI_ArrowArray], _) =
            if node.has_dictionary() {
                (
                    &mut [],
                    &mut [],
                    below.first_mut().map_or(ptr::null_mut(), |d| &mut **d as *mut _),
                )
            } else {
                let n = node.children.len();
                let (kids, rest) = std::mem::take(&mut self.children).split_at_mut(n);
                self.children = rest;
                let (links, rest) = std::mem::take(&mut self.links).split_at_mut(n);
                self.links = rest;
                for ((k, l), slot) in kids.iter_mut().zip(links.iter_mut()).zip(below.iter_mut()) {
                    *k = &mut **slot as *mut FFI_ArrowArray;
                    *l = *k;
                }
                (kids, links, ptr::null_mut())
            };
        *record = NodeRecord {
            shared: self.shared,
            below: links as *mut [*mut FFI_ArrowArray],
            dictionary,
        };
        for (c, slot) in node.children.iter().zip(below.iter_mut()) {
            **slot = self.node(&NodeRef::of(c));
        }
        let null_count = match (node.data_type, node.null_count) {
            (DataType::Null, _) => node.len as i64,
            (_, Some(n)) => n as i64,
            (_, None) => -1,
        };
        FFI_ArrowArray {
            length: node.len as i64,
            null_count,
            offset: node.offset as i64,
            n_buffers: n_ptrs as i64,
            n_children: kids.len() as i64,
            buffers: ptrs.as_mut_ptr(),
            children: kids.as_mut_ptr(),
            dictionary,
            release: Some(release),
            private_data: record as *mut NodeRecord as *mut c_void,
        }
    }
}

/// The release callback of every node this crate exports: releases the node's children and
/// dictionary that are still in place (a child a consumer moved out is released on its own), then
/// the node, exactly once; the last node released frees the [`Shared`] block. A panic while
/// dropping (the owner of a wrapped buffer may panic) stops inside.
unsafe extern "C" fn release(array: *mut FFI_ArrowArray) {
    if array.is_null() {
        return;
    }
    // SAFETY: the spec hands release a valid pointer to the array being released.
    let array = unsafe { &mut *array };
    if array.release.is_none() || array.private_data.is_null() {
        return;
    }
    // SAFETY: `private_data` points at this node's record in the block, which lives while any
    // node is unreleased.
    let record = unsafe { &*(array.private_data as *const NodeRecord) };
    // SAFETY: the record's pointers are the block's, alive as the record is.
    let below = unsafe { &*record.below }.iter().copied().chain(Some(record.dictionary));
    for node in below.filter(|n| !n.is_null()) {
        // SAFETY: a node of the block, alive while this one is; released in place unless a
        // consumer moved it out (then its release is null here).
        if let Some(release) = unsafe { (*node).release } {
            // SAFETY: as above.
            unsafe { release(node) };
        }
    }
    let shared = record.shared;
    array.release = None;
    array.private_data = ptr::null_mut();
    // SAFETY: the block outlives every node that points at it; `live` counts them.
    if unsafe { (*shared).live.fetch_sub(1, Ordering::AcqRel) } == 1 {
        // SAFETY: made by `Box::into_raw` in `export_tree`; this was its last node, so nothing
        // reaches it any more.
        no_unwind(|| drop(unsafe { Box::from_raw(shared) }));
    }
}

/// Exports the tree below `root` (which must have passed [`DeviceArrayData::check`]) in one
/// [`Shared`] block kept alive by `owner`, with `sync_event` recorded on `stream` after `ready`
/// (null for the CPU device).
fn export_tree(
    root: &NodeRef<'_>,
    owner: Owner,
    device: Device,
    ready: &Event,
    stream: &Stream,
) -> Result<FFI_ArrowDeviceArray> {
    let mut laps = Laps::start();
    let event = match device.ordinal() {
        None => None,
        Some(_) => {
            let stream = crate::memory::stream_for(stream, device, device)?;
            let stream = if stream.cuda().is_some() {
                stream
            } else {
                Stream::shared(device)?
            };
            stream.wait(ready)?;
            Some(stream.record()?)
        }
    };
    laps.lap("export.event");
    let mut counts = Counts::default();
    root.count(&mut counts);
    let shared = Box::new(Shared {
        live: AtomicUsize::new(counts.nodes + 1),
        nodes: (0..counts.nodes)
            .map(|_| ManuallyDrop::new(FFI_ArrowArray::empty()))
            .collect(),
        ptrs: vec![ptr::null(); counts.ptrs].into_boxed_slice(),
        children: vec![ptr::null_mut(); counts.children].into_boxed_slice(),
        links: vec![ptr::null_mut(); counts.children].into_boxed_slice(),
        sizes: vec![0; counts.sizes].into_boxed_slice(),
        records: (0..=counts.nodes)
            .map(|_| NodeRecord {
                shared: ptr::null_mut(),
                below: &mut [] as *mut [*mut FFI_ArrowArray],
                dictionary: ptr::null_mut(),
            })
            .collect(),
        sync: event
            .as_ref()
            .and_then(Event::cuda)
            .map_or(ptr::null_mut(), |e| e.cu_event()),
        _event: event,
        _owner: owner,
    });
    let raw = Box::into_raw(shared);
    laps.lap("export.block");
    // SAFETY: just made; only this function uses it until the array is returned (the nodes
    // written below store `raw` but nothing reads through it before release).
    let block = unsafe { &mut *raw };
    let mut filler = Filler {
        shared: raw,
        records: &mut block.records,
        links: &mut block.links,
        nodes: &mut block.nodes,
        ptrs: &mut block.ptrs,
        children: &mut block.children,
        sizes: &mut block.sizes,
    };
    let array = filler.node(root);
    let sync_event = match block.sync.is_null() {
        true => ptr::null_mut(),
        false => &mut block.sync as *mut CUevent as *mut c_void,
    };
    laps.lap("export.fill");
    Ok(FFI_ArrowDeviceArray {
        array,
        device_id: device.device_id(),
        device_type: device.device_type(),
        sync_event,
        reserved: [0; 3],
    })
}

/// Exports an array. Its `sync_event` is recorded on `stream` after `ready`, so a consumer that
/// waits on it sees everything issued so far; it is null for the CPU device. The exported struct
/// owns references to the memory, which stays alive until the consumer releases it. Fails on an
/// array that [`DeviceArrayData::try_new`] would refuse, and on one whose memory another process
/// lent and no longer keeps ([`DeviceArrayData::check_readable`]); memory that process lets go
/// after the export is beyond reach: the consumer holds the pointers.
pub fn export_array(array: &DeviceArrayData, ready: &Event, stream: &Stream) -> Result<FFI_ArrowDeviceArray> {
    array.check()?;
    array.check_readable()?;
    let owner = Owner::Array(array.clone());
    export_tree(&NodeRef::of(array), owner, array.device(), ready, stream)
}

/// Exports a batch as a struct array, with its schema (metadata included). The columns are shared
/// with the batch, not copied. Checked as [`export_array`] is.
pub fn export_batch(batch: &DeviceRecordBatch, stream: &Stream) -> Result<(FFI_ArrowDeviceArray, FFI_ArrowSchema)> {
    let mut laps = Laps::start();
    let schema = export_schema(batch.schema())?;
    laps.lap("export.schema");
    batch.columns().iter().try_for_each(DeviceArrayData::check)?;
    batch.check_readable()?;
    laps.lap("export.check");
    let data_type = DataType::Struct(batch.schema().fields().clone());
    let root = NodeRef {
        data_type: &data_type,
        len: batch.num_rows(),
        offset: 0,
        null_count: Some(0),
        nulls: None,
        buffers: &[],
        children: batch.columns(),
    };
    let array = export_tree(
        &root,
        Owner::Batch(batch.clone()),
        batch.device(),
        batch.ready(),
        stream,
    )?;
    Ok((array, schema))
}

/// Exports the schema of an array.
pub fn export_field(field: &Field) -> Result<FFI_ArrowSchema> {
    check_time_zones(field.data_type())?;
    Ok(FFI_ArrowSchema::try_from(field)?)
}

/// Fails on a time zone with a NUL byte, which a C format string cannot hold (arrow-rs's export
/// unwraps the error into a panic).
pub(super) fn check_time_zones(dt: &DataType) -> Result<()> {
    if let DataType::Timestamp(_, Some(tz)) = dt
        && tz.contains('\0')
    {
        return Err(Error::InvalidArgument(format!(
            "time zone {tz:?} has a NUL byte, which a C format string cannot hold"
        )));
    }
    child_types(dt).into_iter().try_for_each(check_time_zones)
}
