//! The sizes an array's buffers and children need for its `offset + len` elements, checked from
//! the lengths alone: nothing here reads device memory.

use arrow_schema::{DataType, UnionMode};

use super::DeviceArrayData;
use crate::error::{Error, Result};

/// Checks that each buffer of `data` and each child it reaches by position (not through offsets)
/// is large enough for `data.offset + data.len` elements. The children's own buffers are the
/// children's concern: [`DeviceArrayData::check`] visits every node.
pub(super) fn check_sizes(data: &DeviceArrayData) -> Result<()> {
    let fault = |what: String| {
        Error::InvalidData(format!(
            "{} array of {} elements at offset {}: {what}",
            data.data_type, data.len, data.offset
        ))
    };
    let end = data
        .offset
        .checked_add(data.len)
        .ok_or_else(|| fault("offset + length overflows".into()))?;
    let needs = |name: &str, size: usize, needed: Option<usize>| match needed {
        None => Err(fault(format!("the size of its {name} buffer overflows"))),
        Some(needed) if size < needed => Err(fault(format!("its {name} buffer has {size} bytes, {needed} needed"))),
        Some(_) => Ok(()),
    };
    if let Some(nulls) = &data.nulls {
        needs("validity", nulls.len(), Some(end.div_ceil(8)))?;
    }
    for (i, buffer) in data.buffers.iter().enumerate() {
        if let Some((name, needed)) = buffer_need(&data.data_type, i, end) {
            needs(name, buffer.len(), needed)?;
        }
    }
    let child_lengths =
        child_lengths(&data.data_type, end).ok_or_else(|| fault("the length of its children overflows".into()))?;
    if let Some(needed) = child_lengths {
        for (i, child) in data.children.iter().enumerate() {
            if child.len < needed {
                return Err(fault(format!(
                    "its child {i} has {} elements, {needed} needed",
                    child.len
                )));
            }
        }
    }
    if let DataType::RunEndEncoded(..) = data.data_type
        && let [run_ends, values] = &data.children[..]
        && run_ends.len != values.len
    {
        return Err(fault(format!("{} run ends but {} values", run_ends.len, values.len)));
    }
    Ok(())
}

/// The name of buffer `i` of a `dt` array and the bytes it needs for `end` elements (`None` where
/// that overflows), or `None` for a buffer whose size only its contents tell (string data, the
/// data buffers of views).
fn buffer_need(dt: &DataType, i: usize, end: usize) -> Option<(&'static str, Option<usize>)> {
    let values = |width: usize| end.checked_mul(width);
    // `end + 1` offsets, or none at all for an array without elements (as arrow-rs allows).
    let offsets = |width: usize| {
        if end == 0 {
            Some(0)
        } else {
            end.checked_add(1).and_then(|n| n.checked_mul(width))
        }
    };
    let need = match (dt, i) {
        (DataType::Boolean, 0) => ("values", Some(end.div_ceil(8))),
        (DataType::Utf8 | DataType::Binary | DataType::List(_) | DataType::Map(..), 0) => ("offsets", offsets(4)),
        (DataType::LargeUtf8 | DataType::LargeBinary | DataType::LargeList(_), 0) => ("offsets", offsets(8)),
        (DataType::ListView(_), 0) => ("offsets", values(4)),
        (DataType::ListView(_), 1) => ("sizes", values(4)),
        (DataType::LargeListView(_), 0) => ("offsets", values(8)),
        (DataType::LargeListView(_), 1) => ("sizes", values(8)),
        (DataType::Utf8View | DataType::BinaryView, 0) => ("views", values(16)),
        // Not negative: `check_type` came first.
        (DataType::FixedSizeBinary(w), 0) => ("values", values(*w as usize)),
        (DataType::Union(..), 0) => ("type ids", values(1)),
        (DataType::Union(_, UnionMode::Dense), 1) => ("offsets", values(4)),
        (DataType::Dictionary(key, _), 0) => ("keys", values(key.primitive_width()?)),
        (dt, 0) => ("values", values(dt.primitive_width()?)),
        _ => return None,
    };
    Some(need)
}

/// The elements each child of a `dt` array of `end` elements needs, where the children are
/// reached by position: `Some(None)` for types whose children are reached through offsets, type
/// ids or keys (or that have none), `None` where the length overflows.
fn child_lengths(dt: &DataType, end: usize) -> Option<Option<usize>> {
    match dt {
        DataType::Struct(_) | DataType::Union(_, UnionMode::Sparse) => Some(Some(end)),
        // Not negative: `check_type` came first.
        DataType::FixedSizeList(_, n) => end.checked_mul(*n as usize).map(Some),
        _ => Some(None),
    }
}
