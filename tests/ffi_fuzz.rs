//! Fuzz targets for the C Device Data Interface import, on stable Rust through proptest: C schema
//! import (every field of `ArrowSchema`) and C array import (every field of `ArrowArray` and of the
//! `ArrowDeviceArray` header). Each case starts from a valid CPU export of a corpus type and mutates
//! it; the import must return, `Ok` or an error, without a panic or a crash.
//!
//! The mutations stay inside the import's safety contract, which a consumer cannot check: every
//! pointer stays readable for what the struct then claims. Lengths and offsets only shrink inside
//! the exported range or jump past the limits the import checks first; replaced buffers point at a
//! block of zeros larger than anything the corpus implies; pointer arrays that grow are padded;
//! device types name no device that exists. An array's `private_data` is left alone (only its
//! producer's release reads it). A mutation that marks a struct released leaks that struct.
//!
//! CI runs 256 cases per target. For a longer run on demand, set `PROPTEST_CASES`:
//!
//! ```sh
//! PROPTEST_CASES=200000 cargo test --release --all-features --test ffi_fuzz
//! ```
//!
//! proptest shrinks a failure to a minimal case and records its seed in
//! `tests/ffi_fuzz.proptest-regressions`, replayed first on every run; each crash found also
//! becomes a named test in `tests/ffi.rs` (the malformed-input section).

mod common;

use std::ffi::c_void;
use std::sync::OnceLock;

use arrow_array::ArrayRef;
use arrow_cuda::Stream;
use arrow_cuda::abi::{DeviceType, FFI_ArrowArray, FFI_ArrowDeviceArray, FFI_ArrowSchema};
use arrow_cuda::ffi::{export_array, import_array, import_field, import_schema};
use arrow_cuda::transfer::htod_array;
use arrow_schema::Schema;
use common::c_schema::CSchema;
use common::corpus::{every_type, every_type_batch};
use common::fuzz::config;
use proptest::prelude::*;

// ---------------------------------------------------------------------------------------------
// Schemas.

/// Format strings worth trying: every valid kind, and the edges of the parameterised ones.
const FORMATS: &[&str] = &[
    "n",
    "b",
    "c",
    "C",
    "s",
    "S",
    "i",
    "I",
    "l",
    "L",
    "e",
    "f",
    "g",
    "z",
    "Z",
    "vz",
    "u",
    "U",
    "vu",
    "tdD",
    "tdm",
    "tts",
    "ttm",
    "ttu",
    "ttn",
    "tss:",
    "tsn:UTC",
    "tDs",
    "tiM",
    "tiD",
    "tin",
    "+l",
    "+L",
    "+vl",
    "+vL",
    "+s",
    "+m",
    "+r",
    "w:0",
    "w:16",
    "w:-1",
    "w:2147483647",
    "w:-2147483648",
    "w:",
    "w:x",
    "+w:0",
    "+w:3",
    "+w:-1",
    "+w:2147483647",
    "+w:",
    "d:38,10",
    "d:76,0,256",
    "d:9,2,32",
    "d:1,1,7",
    "d:",
    "+ud:0,1",
    "+us:0,1",
    "+us:0",
    "+ud:",
    "+us:-1,127",
    "+ud:128",
    "",
    "+",
    ":",
    "i:",
    "+s:",
];

#[derive(Clone, Debug)]
enum SchemaMutation {
    Format(Option<Vec<u8>>),
    Name(Option<Vec<u8>>),
    /// Well-formed metadata with these entries (keys and values need not be UTF-8).
    Metadata(Vec<(Vec<u8>, Vec<u8>)>),
    /// Metadata whose count (`true`) or first key length (`false`) is negative.
    NegativeMetadata(bool),
    NullMetadata,
    Flags(i64),
    NChildren(i64),
    NullChildren,
    NullChild(usize),
    Dictionary(Option<&'static str>),
    DictionaryIsSelf,
    Released,
}

/// Bytes without a NUL (the strings are NUL-terminated), often not UTF-8.
fn text() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(1u8..=255, 0..12)
}

fn schema_mutation() -> impl Strategy<Value = SchemaMutation> {
    use SchemaMutation::*;
    prop_oneof![
        4 => prop::sample::select(FORMATS).prop_map(|f| Format(Some(f.as_bytes().to_vec()))),
        1 => text().prop_map(|t| Format(Some(t))),
        1 => Just(Format(None)),
        1 => prop::option::of(text()).prop_map(Name),
        1 => prop::collection::vec((text(), text()), 0..3).prop_map(Metadata),
        1 => any::<bool>().prop_map(NegativeMetadata),
        1 => Just(NullMetadata),
        1 => any::<i64>().prop_map(Flags),
        2 => prop_oneof![-3i64..6, Just(1 << 40), Just(i64::MIN)].prop_map(NChildren),
        1 => Just(NullChildren),
        1 => any::<usize>().prop_map(NullChild),
        1 => prop::option::of(prop::sample::select(&["i", "u", "+l", "w:-1"][..])).prop_map(Dictionary),
        1 => Just(DictionaryIsSelf),
        1 => Just(Released),
    ]
}

/// Metadata encoded as the spec says: a count, then length-prefixed keys and values.
fn encode(entries: &[(Vec<u8>, Vec<u8>)]) -> Vec<u8> {
    let mut out = (entries.len() as i32).to_ne_bytes().to_vec();
    for (k, v) in entries {
        for bytes in [k, v] {
            out.extend((bytes.len() as i32).to_ne_bytes());
            out.extend(bytes);
        }
    }
    out
}

fn apply_to_schema(node: &mut CSchema, m: &SchemaMutation) {
    use SchemaMutation::*;
    match m {
        Format(f) => node.format = f.clone(),
        Name(n) => node.name = n.clone(),
        Metadata(entries) => node.metadata = Some(encode(entries)),
        // The reader stops at the negative number, inside these 8 bytes.
        NegativeMetadata(count) => {
            let (n, key) = if *count { (-1i32, 0i32) } else { (1, -1) };
            node.metadata = Some([n.to_ne_bytes(), key.to_ne_bytes()].concat());
        }
        NullMetadata => node.metadata = None,
        Flags(f) => node.flags = *f,
        NChildren(n) => node.n_children = Some(*n),
        NullChildren => node.null_children = true,
        NullChild(i) => {
            if !node.children.is_empty() {
                let n = node.children.len();
                node.children[i % n] = None;
            }
        }
        Dictionary(d) => node.dictionary = d.map(|f| Box::new(CSchema::new(f))),
        DictionaryIsSelf => node.dictionary_is_self = true,
        Released => node.released = true,
    }
}

/// The schema of the corpus batch, as arrow-rs exports it.
fn corpus_schema() -> &'static CSchema {
    static SCHEMA: OnceLock<CSchema> = OnceLock::new();
    SCHEMA.get_or_init(|| {
        let ffi = FFI_ArrowSchema::try_from(every_type_batch().schema().as_ref()).unwrap();
        // SAFETY: a valid schema arrow-rs just exported.
        unsafe { CSchema::read(&ffi) }
    })
}

proptest! {
    #![proptest_config(config())]

    /// Mutated schemas import as a schema and as a field, or fail with an error; whatever imports
    /// exports again.
    #[test]
    fn schema_import_survives_mutation(mutations in prop::collection::vec((any::<usize>(), schema_mutation()), 1..4)) {
        let mut schema = corpus_schema().clone();
        for (node, m) in &mutations {
            apply_to_schema(schema.node_mut(*node), m);
        }
        let built = schema.build();
        // SAFETY: every pointer in `built` is readable for what it claims (see the module docs).
        if let Ok(s) = unsafe { import_schema(built.root()) } {
            FFI_ArrowSchema::try_from(&s).unwrap();
        }
        // SAFETY: as above.
        if let Ok(f) = unsafe { import_field(built.root()) } {
            FFI_ArrowSchema::try_from(&f).unwrap();
        }
    }
}

#[test]
fn the_corpus_schema_imports_unmutated() {
    let built = corpus_schema().build();
    // SAFETY: a copy of a valid schema.
    let schema: Schema = unsafe { import_schema(built.root()) }.unwrap();
    assert_eq!(&schema, every_type_batch().schema().as_ref());
}

// ---------------------------------------------------------------------------------------------
// Arrays.

/// Zeros enough for any buffer the corpus implies (offsets and view sizes are read from it).
fn zeros() -> *const c_void {
    static ZEROS: OnceLock<usize> = OnceLock::new();
    *ZEROS.get_or_init(|| Box::leak(vec![0u64; 1 << 17].into_boxed_slice()).as_ptr() as usize) as *const c_void
}

/// A value for a length or an offset.
#[derive(Clone, Debug)]
enum Count {
    Negative(i64),
    /// Inside the exported range (taken modulo what fits).
    Inside(u64),
    /// Past the limit that the import checks before reading anything.
    Huge(i64),
}

fn count() -> impl Strategy<Value = Count> {
    prop_oneof![
        1 => (i64::MIN..0).prop_map(Count::Negative),
        3 => any::<u64>().prop_map(Count::Inside),
        1 => (i64::MAX / 16 + 1..=i64::MAX).prop_map(Count::Huge),
    ]
}

#[derive(Clone, Debug)]
enum ArrayMutation {
    Length(Count),
    Offset(Count),
    NullCount(i64),
    NBuffers(i64),
    NullBuffers,
    /// Buffer slot `.0` becomes null (`false`) or the block of zeros (`true`).
    Buffer(usize, bool),
    NChildren(i64),
    NullChildren,
    NullChild(usize),
    NullDictionary,
    DictionaryIsSelf,
    Released,
}

/// A mutation of the device header.
#[derive(Clone, Debug)]
enum HeaderMutation {
    /// A device type and id that name no usable device, or the CPU with any id.
    Device(i32, i64),
    SyncEvent(usize),
    Reserved(usize, i64),
}

fn array_mutation() -> impl Strategy<Value = ArrayMutation> {
    use ArrayMutation::*;
    prop_oneof![
        2 => count().prop_map(Length),
        2 => count().prop_map(Offset),
        1 => any::<i64>().prop_map(NullCount),
        2 => prop_oneof![-2i64..8, Just(1 << 40)].prop_map(NBuffers),
        1 => Just(NullBuffers),
        2 => (any::<usize>(), any::<bool>()).prop_map(|(i, z)| Buffer(i, z)),
        1 => prop_oneof![-2i64..6, Just(1 << 40)].prop_map(NChildren),
        1 => Just(NullChildren),
        1 => any::<usize>().prop_map(NullChild),
        1 => Just(NullDictionary),
        1 => Just(DictionaryIsSelf),
        1 => Just(Released),
    ]
}

fn header_mutation() -> impl Strategy<Value = HeaderMutation> {
    use HeaderMutation::*;
    let device = prop_oneof![
        any::<i64>().prop_map(|id| (DeviceType::CPU.0, id)),
        prop_oneof![
            Just(DeviceType::CUDA.0),
            Just(DeviceType::CUDA_HOST.0),
            Just(DeviceType::CUDA_MANAGED.0)
        ]
        .prop_flat_map(|t| prop_oneof![i64::MIN..0, 1_000_000i64..=i64::MAX].prop_map(move |id| (t, id))),
        (
            prop_oneof![Just(0), Just(4), Just(7), Just(16), Just(17), Just(-1), Just(i32::MAX)],
            any::<i64>()
        ),
    ];
    prop_oneof![
        device.prop_map(|(t, id)| Device(t, id)),
        (1usize..).prop_map(SyncEvent),
        (0usize..3, any::<i64>()).prop_map(|(i, v)| Reserved(i, v)),
    ]
}

/// One struct of an export and what it held before any mutation.
struct Node {
    array: *mut FFI_ArrowArray,
    /// `offset + length` as exported: lengths and offsets stay inside it.
    end: u64,
    length: u64,
}

/// Every struct of an export, root first (children, then the dictionary).
///
/// # Safety
/// `a` must be a valid, unreleased array.
unsafe fn nodes(a: *mut FFI_ArrowArray, out: &mut Vec<Node>) {
    // SAFETY: valid per the caller.
    let r = unsafe { &*a };
    out.push(Node {
        array: a,
        end: (r.offset + r.length) as u64,
        length: r.length as u64,
    });
    for i in 0..r.n_children as usize {
        // SAFETY: a valid array has `n_children` valid children.
        unsafe { nodes(*r.children.add(i), out) };
    }
    if !r.dictionary.is_null() {
        // SAFETY: as above.
        unsafe { nodes(r.dictionary, out) };
    }
}

/// Pointer arrays the mutations made; they outlive the import.
#[derive(Default)]
struct Keep {
    buffers: Vec<Vec<*const c_void>>,
    children: Vec<Vec<*mut FFI_ArrowArray>>,
}

/// A copy of `len` pointers from `p` (none when null), grown with `pad` to at least `to`.
///
/// # Safety
/// `p` must be null or hold `len` pointers.
unsafe fn copied<T: Copy>(p: *const T, len: i64, to: usize, pad: T) -> Vec<T> {
    let len = usize::try_from(len).unwrap_or(0).min(1024);
    let mut out = if p.is_null() {
        vec![]
    } else {
        // SAFETY: per the caller.
        unsafe { std::slice::from_raw_parts(p, len) }.to_vec()
    };
    if out.len() < to {
        out.resize(to, pad);
    }
    out
}

/// Applies `m` to `node`.
///
/// # Safety
/// `node.array` must be a live struct of the export, its pointer arrays readable for their counts.
unsafe fn apply_to_array(node: &Node, m: &ArrayMutation, keep: &mut Keep) {
    // SAFETY: per the caller.
    let a = unsafe { &mut *node.array };
    let room = |from: i64| {
        node.end
            .saturating_sub(u64::try_from(from).unwrap_or(node.end - node.length))
            + 1
    };
    let value = |c: &Count, room: u64| match c {
        Count::Negative(n) | Count::Huge(n) => *n,
        Count::Inside(x) => (x % room) as i64,
    };
    match m {
        ArrayMutation::Length(c) => a.length = value(c, room(a.offset)),
        ArrayMutation::Offset(c) => a.offset = value(c, room(a.length)),
        ArrayMutation::NullCount(n) => a.null_count = *n,
        ArrayMutation::NBuffers(n) => {
            let to = usize::try_from(*n).unwrap_or(0).min(1024);
            // SAFETY: the current array holds `n_buffers` pointers (per the caller).
            let mut b = unsafe { copied(a.buffers as *const *const c_void, a.n_buffers, to, zeros()) };
            a.buffers = b.as_mut_ptr();
            a.n_buffers = *n;
            keep.buffers.push(b);
        }
        ArrayMutation::NullBuffers => a.buffers = std::ptr::null_mut(),
        ArrayMutation::Buffer(i, to_zeros) => {
            // SAFETY: as above.
            let mut b = unsafe { copied(a.buffers as *const *const c_void, a.n_buffers, 0, zeros()) };
            if !b.is_empty() {
                let n = b.len();
                b[i % n] = if *to_zeros { zeros() } else { std::ptr::null() };
                a.buffers = b.as_mut_ptr();
                keep.buffers.push(b);
            }
        }
        ArrayMutation::NChildren(n) => {
            let to = usize::try_from(*n).unwrap_or(0).min(1024);
            // SAFETY: the current array holds `n_children` pointers (per the caller).
            let mut c = unsafe {
                copied(
                    a.children as *const *mut FFI_ArrowArray,
                    a.n_children,
                    to,
                    std::ptr::null_mut(),
                )
            };
            a.children = c.as_mut_ptr();
            a.n_children = *n;
            keep.children.push(c);
        }
        ArrayMutation::NullChildren => a.children = std::ptr::null_mut(),
        ArrayMutation::NullChild(i) => {
            // SAFETY: as above.
            let mut c = unsafe {
                copied(
                    a.children as *const *mut FFI_ArrowArray,
                    a.n_children,
                    0,
                    std::ptr::null_mut(),
                )
            };
            if !c.is_empty() {
                let n = c.len();
                c[i % n] = std::ptr::null_mut();
                a.children = c.as_mut_ptr();
                keep.children.push(c);
            }
        }
        ArrayMutation::NullDictionary => a.dictionary = std::ptr::null_mut(),
        ArrayMutation::DictionaryIsSelf => a.dictionary = node.array,
        ArrayMutation::Released => a.release = None,
    }
}

fn apply_to_header(d: &mut FFI_ArrowDeviceArray, m: &HeaderMutation) {
    match m {
        HeaderMutation::Device(t, id) => {
            d.device_type = DeviceType(*t);
            d.device_id = *id;
        }
        HeaderMutation::SyncEvent(p) => d.sync_event = *p as *mut c_void,
        HeaderMutation::Reserved(i, v) => d.reserved[*i] = *v,
    }
}

/// The corpus arrays, once.
fn corpus() -> &'static [(String, ArrayRef)] {
    static CORPUS: OnceLock<Vec<(String, ArrayRef)>> = OnceLock::new();
    CORPUS.get_or_init(every_type)
}

proptest! {
    #![proptest_config(config())]

    /// Mutated arrays of every type import or fail with an error.
    #[test]
    fn array_import_survives_mutation(
        which in any::<usize>(),
        mutations in prop::collection::vec((any::<usize>(), array_mutation()), 0..4),
        header in prop::option::of(header_mutation()),
    ) {
        let (name, array) = &corpus()[which % corpus().len()];
        let stream = Stream::cpu();
        let data = htod_array(array.as_ref(), arrow_cuda::Device::Cpu, &stream).unwrap();
        let mut ffi = export_array(&data, &arrow_cuda::Event::completed(), &stream).unwrap();
        drop(data);
        let mut found = vec![];
        // SAFETY: a valid export.
        unsafe { nodes(&mut ffi.array, &mut found) };
        let mut keep = Keep::default();
        for (node, m) in &mutations {
            // SAFETY: the nodes are live until the import releases the export; pointer arrays
            // that mutations replace live in `keep`.
            unsafe { apply_to_array(&found[node % found.len()], m, &mut keep) };
        }
        if let Some(h) = &header {
            apply_to_header(&mut ffi, h);
        }
        // SAFETY: every pointer stays readable for what the struct claims (see the module docs).
        let result = unsafe { import_array(ffi, array.data_type(), &stream) };
        if mutations.is_empty() && header.is_none() {
            prop_assert!(result.is_ok(), "{name}: {:?}", result.err());
        }
        drop(result);
        drop(keep);
    }
}

#[test]
fn zeros_cover_the_corpus() {
    // The block of zeros must be larger than any buffer the corpus implies.
    let largest = corpus()
        .iter()
        .map(|(_, a)| htod_array(a.as_ref(), arrow_cuda::Device::Cpu, &Stream::cpu()).unwrap())
        .flat_map(|d| d.all_buffers().map(|b| b.len()).collect::<Vec<_>>())
        .max()
        .unwrap();
    assert!(largest <= 8 << 17, "{largest}");
}
