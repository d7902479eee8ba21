//! A C `ArrowSchema` tree that a test owns field by field, so it can write any value into any field
//! (the malformed-schema cases and the import fuzz target). Its release callback frees nothing: the
//! tree's memory belongs to [`Built`].

use std::ffi::c_char;

use arrow_cuda::abi::FFI_ArrowSchema;

/// One node of a C schema; `None` strings are null pointers.
#[derive(Clone, Debug, Default)]
pub struct CSchema {
    /// The format string's bytes, without the terminating NUL.
    pub format: Option<Vec<u8>>,
    /// The name's bytes, without the terminating NUL.
    pub name: Option<Vec<u8>>,
    /// The metadata, encoded as the spec says (the encoding carries its own lengths).
    pub metadata: Option<Vec<u8>>,
    /// The flags field.
    pub flags: i64,
    /// The children; `None` is a null child pointer.
    pub children: Vec<Option<CSchema>>,
    /// Written into `n_children` in place of the number of children. The children array is padded
    /// with null pointers up to it (at most 1024), so a reader that trusts it stays inside.
    pub n_children: Option<i64>,
    /// A null children array, whatever `n_children` says.
    pub null_children: bool,
    /// The dictionary's schema.
    pub dictionary: Option<Box<CSchema>>,
    /// Points `dictionary` at the node itself (a cycle).
    pub dictionary_is_self: bool,
    /// A null release callback: a released struct.
    pub released: bool,
}

impl CSchema {
    /// A node with this format, no name and no children.
    pub fn new(format: &str) -> CSchema {
        CSchema {
            format: Some(format.as_bytes().to_vec()),
            ..CSchema::default()
        }
    }

    /// A node with this format, the name `name` and these children.
    pub fn named(format: &str, name: &str, children: Vec<CSchema>) -> CSchema {
        CSchema {
            name: Some(name.as_bytes().to_vec()),
            children: children.into_iter().map(Some).collect(),
            ..CSchema::new(format)
        }
    }

    /// A copy of a valid schema, field by field.
    ///
    /// # Safety
    /// `s` must be a valid, unreleased `ArrowSchema`.
    pub unsafe fn read(s: &FFI_ArrowSchema) -> CSchema {
        let string = |p: *const c_char| {
            // SAFETY: the strings of a valid schema are NUL-terminated.
            (!p.is_null()).then(|| unsafe { std::ffi::CStr::from_ptr(p) }.to_bytes().to_vec())
        };
        let children = (0..s.n_children as usize)
            // SAFETY: a valid schema has `n_children` valid children.
            .map(|i| Some(unsafe { CSchema::read(&**s.children.add(i)) }))
            .collect();
        CSchema {
            format: string(s.format),
            name: string(s.name),
            // SAFETY: the metadata of a valid schema is well formed.
            metadata: (!s.metadata.is_null()).then(|| unsafe { metadata_bytes(s.metadata as *const u8) }),
            flags: s.flags,
            children,
            n_children: None,
            null_children: false,
            // SAFETY: as for the children.
            dictionary: (!s.dictionary.is_null()).then(|| Box::new(unsafe { CSchema::read(&*s.dictionary) })),
            dictionary_is_self: false,
            released: s.release.is_none(),
        }
    }

    /// The number of nodes in the tree (this one, its children and dictionaries, recursively).
    pub fn nodes(&self) -> usize {
        1 + self.children.iter().flatten().map(CSchema::nodes).sum::<usize>()
            + self.dictionary.as_ref().map_or(0, |d| d.nodes())
    }

    /// Node `i` in pre-order (`i` taken modulo [`CSchema::nodes`]).
    pub fn node_mut(&mut self, i: usize) -> &mut CSchema {
        let i = i % self.nodes();
        self.nth(i)
            .unwrap_or_else(|_| unreachable!("i is below the node count"))
    }

    fn nth(&mut self, i: usize) -> Result<&mut CSchema, usize> {
        if i == 0 {
            return Ok(self);
        }
        let mut left = i - 1;
        let dictionary = self.dictionary.as_deref_mut();
        for node in self.children.iter_mut().flatten().chain(dictionary) {
            match node.nth(left) {
                Ok(found) => return Ok(found),
                Err(rest) => left = rest,
            }
        }
        Err(left)
    }

    /// Lays the tree out as C structs.
    pub fn build(&self) -> Built {
        let mut built = Built {
            nodes: vec![],
            strings: vec![],
            arrays: vec![],
        };
        let root = built.node(self);
        built.nodes.insert(0, root);
        built
    }
}

/// The encoded length of metadata, read from its own counts.
///
/// # Safety
/// `p` must point to well-formed metadata.
unsafe fn metadata_bytes(p: *const u8) -> Vec<u8> {
    // SAFETY: each read lies inside well-formed metadata (per the caller).
    let int = |at: usize| i32::from_ne_bytes(unsafe { std::ptr::read_unaligned(p.add(at) as *const [u8; 4]) });
    let mut at = 4;
    for _ in 0..int(0) {
        at += 4 + int(at) as usize;
        at += 4 + int(at) as usize;
    }
    // SAFETY: `at` bytes of well-formed metadata.
    unsafe { std::slice::from_raw_parts(p, at) }.to_vec()
}

/// The C structs of a [`CSchema`], and the memory they point to.
pub struct Built {
    /// Every node; the root first.
    nodes: Vec<*mut FFI_ArrowSchema>,
    strings: Vec<Vec<u8>>,
    arrays: Vec<Vec<*mut FFI_ArrowSchema>>,
}

/// Marks the struct released and frees nothing.
unsafe extern "C" fn release(s: *mut FFI_ArrowSchema) {
    // SAFETY: called on a node of a live `Built`.
    unsafe { (*s).release = None };
}

impl Built {
    /// The root schema.
    pub fn root(&self) -> &FFI_ArrowSchema {
        // SAFETY: the root lives as long as `self`.
        unsafe { &*self.nodes[0] }
    }

    fn string(&mut self, bytes: &Option<Vec<u8>>, nul: bool) -> *const c_char {
        let Some(bytes) = bytes else {
            return std::ptr::null();
        };
        let mut owned = bytes.clone();
        if nul {
            owned.push(0);
        }
        let p = owned.as_ptr() as *const c_char;
        self.strings.push(owned);
        p
    }

    fn node(&mut self, s: &CSchema) -> *mut FFI_ArrowSchema {
        let node = Box::into_raw(Box::new(FFI_ArrowSchema::empty()));
        let mut children: Vec<*mut FFI_ArrowSchema> = s
            .children
            .iter()
            .map(|c| match c {
                Some(c) => {
                    let child = self.node(c);
                    self.nodes.push(child);
                    child
                }
                None => std::ptr::null_mut(),
            })
            .collect();
        let n_children = s.n_children.unwrap_or(children.len() as i64);
        let padded = usize::try_from(n_children).unwrap_or(0).min(1024);
        if children.len() < padded {
            children.resize(padded, std::ptr::null_mut());
        }
        let dictionary = match (&s.dictionary, s.dictionary_is_self) {
            (_, true) => node,
            (Some(d), false) => {
                let d = self.node(d);
                self.nodes.push(d);
                d
            }
            (None, false) => std::ptr::null_mut(),
        };
        let format = self.string(&s.format, true);
        let name = self.string(&s.name, true);
        let metadata = self.string(&s.metadata, false);
        let children_ptr = if s.null_children || children.is_empty() {
            std::ptr::null_mut()
        } else {
            children.as_mut_ptr()
        };
        self.arrays.push(children);
        // SAFETY: `node` was just boxed; nothing else refers to it yet.
        let n = unsafe { &mut *node };
        n.format = format;
        n.name = name;
        n.metadata = metadata;
        n.flags = s.flags;
        n.n_children = n_children;
        n.children = children_ptr;
        n.dictionary = dictionary;
        n.release = (!s.released).then_some(release as unsafe extern "C" fn(*mut FFI_ArrowSchema));
        node
    }
}

impl Drop for Built {
    fn drop(&mut self) {
        for &node in &self.nodes {
            // SAFETY: each node was boxed in `node` and is freed once, here; its release frees nothing.
            drop(unsafe { Box::from_raw(node) });
        }
    }
}
