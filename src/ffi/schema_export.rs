//! Export of schemas in one block per export, from strings made once per schema.
//!
//! arrow-rs's export of a schema makes every field's format, name and metadata anew, with several
//! allocations per field: for a 100-column batch that was a third of an export and import. Here
//! the strings of a schema are made once, by arrow-rs's own export (so the formats are its), into a
//! [`Template`] that exports share: the last few schemas exported are remembered, by identity (the
//! `SchemaRef` itself, held weakly). Each export then makes one [`Block`]: every C struct below
//! the root and the child pointer arrays, pointing at the template's strings. Each node's
//! `private_data` points at its record in the block; the release of the last node still alive
//! frees it. A consumer may move any child out and release it on its own, as the spec allows.
//!
//! The block also holds the `SchemaRef` exported, so that [`exported_schema`] can import a schema
//! that this crate exported, untouched, without parsing it again.

use std::ffi::{CString, c_char, c_void};
use std::mem::ManuallyDrop;
use std::ops::Range;
use std::ptr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};

use arrow_schema::{Schema, SchemaRef};

use crate::abi::FFI_ArrowSchema;
use crate::error::{Error, Result};
use crate::ffi::export::check_time_zones;
use crate::ffi::guard::no_unwind;

/// The strings and shape of one node of an exported schema.
struct TemplateNode {
    format: CString,
    name: Option<CString>,
    /// Encoded as the spec says (counts and lengths as native `i32`s).
    metadata: Option<Box<[u8]>>,
    flags: i64,
    /// This node's run of [`Template::children`].
    children: Range<usize>,
    /// The node of the dictionary.
    dictionary: Option<usize>,
}

/// The C strings of a schema's every node, in the order of a walk that takes each node, then its
/// children, then its dictionary: the root is node 0.
struct Template {
    nodes: Vec<TemplateNode>,
    /// The nodes that are children, one run per node.
    children: Vec<usize>,
}

/// What the release of one node needs, kept in the block rather than read from the node's C
/// struct (which a consumer may have changed): its `private_data` points here.
struct Record {
    block: *mut Block,
    node: usize,
}

/// Everything one export owns, freed by the release of its last live node.
struct Block {
    /// Nodes, the root included, not yet released.
    live: AtomicUsize,
    template: Arc<Template>,
    schema: SchemaRef,
    /// The C structs of every node but the root (which the consumer holds): node `i` at `i - 1`.
    /// Never dropped as `FFI_ArrowSchema`s: by the time the block is freed each is released or was
    /// moved out.
    nodes: Box<[ManuallyDrop<FFI_ArrowSchema>]>,
    /// Every node's child pointers, in the runs of [`Template::children`].
    children: Box<[*mut FFI_ArrowSchema]>,
    /// One record per node.
    records: Box<[Record]>,
}

/// Templates of the schemas exported last, by the identity of their `SchemaRef`.
static TEMPLATES: Mutex<Vec<(Weak<Schema>, Arc<Template>)>> = Mutex::new(Vec::new());

/// Templates remembered at most: a program exports batches of a few schemas at a time.
const REMEMBERED: usize = 8;

/// The template of `schema`, made (by arrow-rs's export) unless one of the last schemas exported
/// is this very `SchemaRef`.
fn template(schema: &SchemaRef) -> Result<Arc<Template>> {
    let mut cache = TEMPLATES.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(at) = cache.iter().position(|(s, _)| ptr::eq(s.as_ptr(), Arc::as_ptr(schema))) {
        // A live weak reference keeps the address from being reused: this is the same schema.
        if cache[at].0.strong_count() > 0 {
            return Ok(cache[at].1.clone());
        }
    }
    schema
        .fields()
        .iter()
        .try_for_each(|f| check_time_zones(f.data_type()))?;
    let exported = FFI_ArrowSchema::try_from(schema.as_ref())?;
    let mut made = Template {
        nodes: vec![],
        children: vec![],
    };
    // SAFETY: arrow-rs's export is well-formed.
    unsafe { made.add(&exported)? };
    let made = Arc::new(made);
    cache.retain(|(s, _)| s.strong_count() > 0);
    if cache.len() >= REMEMBERED {
        cache.remove(0);
    }
    cache.push((Arc::downgrade(schema), made.clone()));
    Ok(made)
}

impl Template {
    /// Adds `s` and the nodes below it; returns its index.
    ///
    /// # Safety
    /// `s` must be a well-formed, unreleased schema.
    unsafe fn add(&mut self, s: &FFI_ArrowSchema) -> Result<usize> {
        // SAFETY: strings of a well-formed schema are NUL-terminated (or null for name and metadata).
        let string = |p: *const c_char| (!p.is_null()).then(|| unsafe { std::ffi::CStr::from_ptr(p) }.to_owned());
        let format =
            string(s.format).ok_or_else(|| Error::InvalidData("an exported schema without a format".into()))?;
        // SAFETY: as above; the metadata of a well-formed schema is encoded as the spec says.
        let metadata = (!s.metadata.is_null()).then(|| unsafe { encoded_metadata(s.metadata) });
        let at = self.nodes.len();
        let n = usize::try_from(s.n_children).unwrap_or(0);
        self.nodes.push(TemplateNode {
            format,
            name: string(s.name),
            metadata,
            flags: s.flags,
            children: 0..0,
            dictionary: None,
        });
        let mut below = Vec::with_capacity(n);
        for i in 0..n {
            // SAFETY: `n` valid child pointers in a well-formed schema.
            below.push(unsafe { self.add(&**s.children.add(i))? });
        }
        let start = self.children.len();
        self.children.extend(below);
        self.nodes[at].children = start..self.children.len();
        if !s.dictionary.is_null() {
            // SAFETY: a non-null dictionary of a well-formed schema is valid.
            let d = unsafe { self.add(&*s.dictionary)? };
            self.nodes[at].dictionary = Some(d);
        }
        Ok(at)
    }
}

/// A copy of encoded metadata: an `i32` count, then each key and value as an `i32` length and
/// its bytes.
///
/// # Safety
/// `p` must point at metadata encoded that way.
unsafe fn encoded_metadata(p: *const c_char) -> Box<[u8]> {
    let p = p as *const u8;
    // SAFETY: an `i32` at each length's place, per the caller.
    let read = |at: usize| unsafe { (p.add(at) as *const i32).read_unaligned() }.max(0) as usize;
    let mut end = 4;
    for _ in 0..read(0) * 2 {
        end += 4 + read(end);
    }
    // SAFETY: `end` bytes of metadata, per the caller.
    unsafe { std::slice::from_raw_parts(p, end) }.into()
}

/// Exports `schema` (as a struct type, with its metadata) in one block whose strings are shared
/// with the other exports of this `SchemaRef`.
pub(crate) fn export_schema(schema: &SchemaRef) -> Result<FFI_ArrowSchema> {
    let template = template(schema)?;
    let count = template.nodes.len();
    let block = Box::new(Block {
        live: AtomicUsize::new(count),
        nodes: (1..count)
            .map(|_| ManuallyDrop::new(FFI_ArrowSchema::empty()))
            .collect(),
        children: vec![ptr::null_mut(); template.children.len()].into_boxed_slice(),
        records: (0..count)
            .map(|node| Record {
                block: ptr::null_mut(),
                node,
            })
            .collect(),
        template,
        schema: schema.clone(),
    });
    let raw = Box::into_raw(block);
    // SAFETY: just made; only this function uses it until the root is returned.
    let block = unsafe { &mut *raw };
    let node_ptr = |nodes: &mut [ManuallyDrop<FFI_ArrowSchema>], i: usize| &mut *nodes[i - 1] as *mut FFI_ArrowSchema;
    for (slot, &node) in block.children.iter_mut().zip(&block.template.children) {
        *slot = node_ptr(&mut block.nodes, node);
    }
    let mut root = FFI_ArrowSchema::empty();
    for (i, t) in block.template.nodes.iter().enumerate() {
        block.records[i].block = raw;
        let c = FFI_ArrowSchema {
            format: t.format.as_ptr(),
            name: t.name.as_ref().map_or(ptr::null(), |n| n.as_ptr()),
            metadata: t.metadata.as_ref().map_or(ptr::null(), |m| m.as_ptr() as *const c_char),
            flags: t.flags,
            n_children: t.children.len() as i64,
            children: match t.children.is_empty() {
                true => ptr::null_mut(),
                false => block.children[t.children.clone()].as_mut_ptr(),
            },
            dictionary: t.dictionary.map_or(ptr::null_mut(), |d| node_ptr(&mut block.nodes, d)),
            release: Some(release),
            private_data: &mut block.records[i] as *mut Record as *mut c_void,
        };
        match i {
            0 => root = c,
            // Written without dropping the empty struct there (nothing to release).
            _ => *block.nodes[i - 1] = c,
        }
    }
    Ok(root)
}

/// The release callback of every schema node this module exports: releases the node's children
/// and dictionary still in place (one a consumer moved out is released on its own), then the
/// node, exactly once; the last node released frees the [`Block`].
unsafe extern "C" fn release(schema: *mut FFI_ArrowSchema) {
    if schema.is_null() {
        return;
    }
    // SAFETY: the spec hands release a valid pointer to the schema being released.
    let schema = unsafe { &mut *schema };
    if schema.release.is_none() || schema.private_data.is_null() {
        return;
    }
    // SAFETY: `private_data` points at this node's record in the block, which lives while any node
    // is unreleased.
    let record = unsafe { &*(schema.private_data as *const Record) };
    let block = record.block;
    // SAFETY: the block outlives its records; the template is never written after it is made.
    let (template, nodes) = unsafe { (&*(*block).template, (*block).nodes.as_ptr()) };
    let t = &template.nodes[record.node];
    let below = template.children[t.children.clone()].iter().chain(&t.dictionary);
    for &node in below {
        // SAFETY: a node of the block (never the root), alive while this one is; released in place
        // unless a consumer moved it out (then its release is null here).
        let node = unsafe { nodes.add(node - 1) } as *mut FFI_ArrowSchema;
        // SAFETY: as above.
        if let Some(release) = unsafe { (*node).release } {
            // SAFETY: as above.
            unsafe { release(node) };
        }
    }
    schema.release = None;
    schema.private_data = ptr::null_mut();
    // SAFETY: the block outlives every node that points at it; `live` counts them.
    if unsafe { (*block).live.fetch_sub(1, Ordering::AcqRel) } == 1 {
        // SAFETY: made by `Box::into_raw` in `export_schema`; this was its last node, so nothing
        // reaches it any more.
        no_unwind(|| drop(unsafe { Box::from_raw(block) }));
    }
}

/// The schema that `schema` holds, when it is the root of an export of this module that nobody
/// has changed: every node's strings, flags, children and dictionary are still those the export
/// wrote and none was released or moved out. Else `None` (then it is imported by parsing it).
///
/// # Safety
/// `schema` must be a valid, unreleased schema whose pointers are valid per the spec.
pub(crate) unsafe fn exported_schema(schema: &FFI_ArrowSchema) -> Option<SchemaRef> {
    // Our release callback marks our export. The same function may have several addresses (one
    // per codegen unit): a miss only means the schema is parsed. A hit needs a function with this
    // very body, which no one else has.
    let ours = schema
        .release
        .is_some_and(|r| ptr::fn_addr_eq(r, release as unsafe extern "C" fn(*mut FFI_ArrowSchema)));
    if !ours || schema.private_data.is_null() {
        return None;
    }
    // SAFETY: our release callback: `private_data` is a record of a live block.
    let record = unsafe { &*(schema.private_data as *const Record) };
    if record.node != 0 {
        return None;
    }
    // SAFETY: the block lives while its root is unreleased.
    let block = unsafe { &*record.block };
    let intact = block.template.nodes.iter().enumerate().all(|(i, t)| {
        let c: &FFI_ArrowSchema = match i {
            0 => schema,
            _ => &block.nodes[i - 1],
        };
        let children = match t.children.is_empty() {
            true => ptr::null_mut(),
            false => block.children[t.children.clone()].as_ptr() as *mut _,
        };
        let dictionary = t
            .dictionary
            .map_or(ptr::null(), |d| &*block.nodes[d - 1] as *const FFI_ArrowSchema);
        c.release.is_some()
            && ptr::eq(c.private_data as *const Record, &block.records[i])
            && ptr::eq(c.format, t.format.as_ptr())
            && ptr::eq(c.name, t.name.as_ref().map_or(ptr::null(), |n| n.as_ptr()))
            && ptr::eq(
                c.metadata,
                t.metadata.as_ref().map_or(ptr::null(), |m| m.as_ptr() as *const c_char),
            )
            && c.flags == t.flags
            && c.n_children == t.children.len() as i64
            && ptr::eq(c.children, children)
            && ptr::eq(c.dictionary, dictionary)
    });
    // The child pointer arrays may have been rewritten too.
    let linked = block
        .template
        .children
        .iter()
        .zip(block.children.iter())
        .all(|(&node, &p)| ptr::eq(p, &*block.nodes[node - 1]));
    (intact && linked).then(|| block.schema.clone())
}
