//! Import of C `ArrowSchema`s. arrow-rs's conversion trusts the struct: it panics on a null or
//! non-UTF-8 format or name and on a missing child, reads a negative child count as a huge one, and
//! recurses without a bound (a dictionary that is its own dictionary overflows the stack). So the
//! struct is checked first, and the type that arrow-rs builds from it afterwards.

use std::ffi::{CStr, c_char};
use std::sync::Arc;

use arrow_schema::{DataType, Field, Schema, SchemaRef};

use crate::abi::FFI_ArrowSchema;
use crate::array::check_type;
use crate::error::Result;
use crate::ffi::import::{MAX_CHILDREN, MAX_DEPTH, invalid};
use crate::ffi::schema_export::exported_schema;

/// Imports a schema: the fields of a struct type, with its metadata. A schema that this crate
/// exported, untouched since, is taken from the export without being parsed again.
///
/// # Safety
/// `schema` must be an `ArrowSchema` whose pointers are valid for what it claims: NUL-terminated
/// strings, well-formed metadata, `n_children` child pointers (each null or valid), a dictionary
/// that is null or valid.
pub unsafe fn import_schema(schema: &FFI_ArrowSchema) -> Result<Schema> {
    // SAFETY: forwarded from the caller.
    Ok(unsafe { import_schema_ref(schema) }?.as_ref().clone())
}

/// [`import_schema`], shared.
///
/// # Safety
/// As for [`import_schema`].
pub(crate) unsafe fn import_schema_ref(schema: &FFI_ArrowSchema) -> Result<SchemaRef> {
    if schema.release.is_none() {
        return Err(invalid("a released schema"));
    }
    // SAFETY: forwarded from the caller.
    if let Some(exported) = unsafe { exported_schema(schema) } {
        return Ok(exported);
    }
    // SAFETY: forwarded from the caller.
    unsafe { check(schema, 0)? };
    let schema = Schema::try_from(schema)?;
    check_type(&DataType::Struct(schema.fields().clone()))?;
    Ok(Arc::new(schema))
}

/// Imports a field: the schema of one array, which gives the data type of an
/// [`import_array`](crate::ffi::import_array).
///
/// # Safety
/// As for [`import_schema`].
pub unsafe fn import_field(schema: &FFI_ArrowSchema) -> Result<Field> {
    // SAFETY: forwarded from the caller.
    unsafe { check(schema, 0)? };
    let field = Field::try_from(schema)?;
    check_type(field.data_type())?;
    Ok(field)
}

/// A NUL-terminated string of the schema, which must be UTF-8.
///
/// # Safety
/// `p` must be null or a NUL-terminated string.
unsafe fn text<'a>(p: *const c_char, what: &str) -> Result<Option<&'a str>> {
    if p.is_null() {
        return Ok(None);
    }
    // SAFETY: NUL-terminated, per the caller.
    let s = unsafe { CStr::from_ptr(p) };
    s.to_str()
        .map(Some)
        .map_err(|_| invalid(format!("a {what} that is not UTF-8: {s:?}")))
}

/// The number of children that a nested format must have, where it is fixed.
fn fixed_children(format: &str) -> Option<usize> {
    match format {
        "+l" | "+L" | "+vl" | "+vL" | "+m" => Some(1),
        "+r" => Some(2),
        f if f.starts_with("+w:") => Some(1),
        _ => None,
    }
}

/// Checks the fields that arrow-rs's conversion trusts, recursively.
///
/// # Safety
/// As for [`import_schema`].
unsafe fn check(s: &FFI_ArrowSchema, depth: usize) -> Result<()> {
    if depth > MAX_DEPTH {
        return Err(invalid(format!("a schema nested deeper than {MAX_DEPTH}")));
    }
    if s.release.is_none() {
        return Err(invalid("a released schema"));
    }
    // SAFETY: strings are NUL-terminated, per the caller.
    let format = unsafe { text(s.format, "format")? }.ok_or_else(|| invalid("a schema without a format"))?;
    // SAFETY: as above.
    let name = unsafe { text(s.name, "name")? }.unwrap_or("");
    let n = usize::try_from(s.n_children)
        .ok()
        .filter(|n| *n <= MAX_CHILDREN)
        .ok_or_else(|| invalid(format!("{format} field {name:?} with {} children", s.n_children)))?;
    let expected = fixed_children(format).or((!format.starts_with('+')).then_some(0));
    if expected.is_some_and(|e| e != n) {
        return Err(invalid(format!(
            "{format} field {name:?} with {n} children; expected {}",
            expected.unwrap_or_default()
        )));
    }
    if n > 0 && s.children.is_null() {
        return Err(invalid(format!("{format} field {name:?} without its children array")));
    }
    for i in 0..n {
        // SAFETY: `n` child pointers, per the caller.
        let child = unsafe { *s.children.add(i) };
        if child.is_null() {
            return Err(invalid(format!("child {i} of {format} field {name:?} is null")));
        }
        // SAFETY: a non-null child is valid, per the caller.
        unsafe { check(&*child, depth + 1)? };
    }
    if !s.dictionary.is_null() {
        // SAFETY: as for the children.
        unsafe { check(&*s.dictionary, depth + 1)? };
    }
    Ok(())
}
