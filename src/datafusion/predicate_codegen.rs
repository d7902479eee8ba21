//! The predicate compiler: a [`Predicate`] tree becomes the CUDA C source of a kernel that writes
//! one selection byte per row, with the literals in a separate buffer so that the source depends
//! only on the predicate's shape and the column types (each shape compiles once per context).

use std::fmt::Write as _;

use ::datafusion::common::ScalarValue;
use arrow_schema::DataType;

use super::predicate::{CmpOp, Predicate};
use crate::array::DeviceRecordBatch;
use crate::error::{Error, Result};

/// Helpers the generated predicate kernels share; the generated kernel follows them.
pub(crate) const PREDICATE_PRELUDE: &str = include_str!("kernels/predicate_prelude.cu");

/// How a column's values are read and compared in a generated kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ValueKind {
    /// Widened to `long long` (signed integers, dates, timestamps, booleans, float keys).
    Signed,
    /// Widened to `unsigned long long`.
    Unsigned,
    /// 16-byte little-endian two's complement.
    Decimal128,
    /// Bytes with `i32` offsets.
    Utf8,
    /// Bytes with `i64` offsets.
    LargeUtf8,
    /// 16-byte views.
    Utf8View,
}

/// A generated predicate kernel and what to launch it with.
pub(crate) struct Generated {
    pub(crate) source: String,
    /// The literal buffer: 16-byte slots, then the bytes of string literals.
    pub(crate) literals: Vec<u8>,
}

/// How values of `dt` are read and compared.
fn kind_of(dt: &DataType) -> Result<ValueKind> {
    use DataType::*;
    Ok(match dt {
        Int8 | Int16 | Int32 | Int64 | Float32 | Float64 | Date32 | Date64 | Timestamp(..) | Boolean => {
            ValueKind::Signed
        }
        UInt8 | UInt16 | UInt32 | UInt64 => ValueKind::Unsigned,
        Decimal128(..) => ValueKind::Decimal128,
        Utf8 => ValueKind::Utf8,
        LargeUtf8 => ValueKind::LargeUtf8,
        Utf8View => ValueKind::Utf8View,
        other => return Err(Error::Unsupported(format!("GPU predicate over {other}"))),
    })
}

pub(crate) struct Codegen {
    /// The type of each column.
    types: Vec<DataType>,
    /// Per column read at another row than the kernel's row `i`: the variable holding that row
    /// (a stage's hash join match, `NO_MATCH` without one).
    rows: Vec<Option<String>>,
    /// The statements emitted so far.
    pub(crate) body: String,
    next: usize,
    slots: Vec<[u8; 16]>,
    strings: Vec<u8>,
    /// Slots holding string literals: their offsets are rebased once the slot count is known.
    string_slots: Vec<usize>,
    /// Literals whose values are known only when the kernels run.
    pub(crate) late: Vec<LateLiteral>,
}

/// A literal whose value is known only when the kernels run (an uncorrelated scalar subquery's):
/// the offsets of its slot and of its validity slot (non-zero: valid) in the literal buffer.
#[derive(Clone, Debug)]
pub(crate) struct LateLiteral {
    pub(crate) value: usize,
    pub(crate) valid: usize,
    pub(crate) expr: std::sync::Arc<dyn ::datafusion::physical_expr::PhysicalExpr>,
}

/// CUDA C declaring the booleans `(v, k)` (value, known) of `a AND b` (or `a OR b`, `and` false)
/// under SQL's three-valued logic, from those of `a` and `b`: a false side decides an `AND` and a
/// true side an `OR` even where the other side is null.
pub(crate) fn kleene(and: bool, (v, k): (&str, &str), (va, ka): (&str, &str), (vb, kb): (&str, &str)) -> String {
    if and {
        format!(
            "bool {k} = ({ka} && {kb}) || ({ka} && !{va}) || ({kb} && !{vb}); \
             bool {v} = {ka} && {va} && {kb} && {vb};"
        )
    } else {
        format!(
            "bool {k} = ({ka} && {kb}) || ({ka} && {va}) || ({kb} && {vb}); \
             bool {v} = ({ka} && {va}) || ({kb} && {vb});"
        )
    }
}

impl Codegen {
    /// A generator for kernels over `batch`'s columns (only their types are read).
    pub(crate) fn new(batch: &DeviceRecordBatch) -> Self {
        Self::over(batch.columns().iter().map(|c| c.data_type().clone()).collect())
    }

    /// A generator for kernels over columns of these types.
    pub(crate) fn over(types: Vec<DataType>) -> Self {
        Codegen {
            rows: vec![None; types.len()],
            types,
            body: String::new(),
            next: 0,
            slots: vec![],
            strings: vec![],
            string_slots: vec![],
            late: vec![],
        }
    }

    /// The kernel parameters of column `c`: values, data (string bytes, the view buffers'
    /// addresses, or a dictionary's values: see `device_filter::column_args`), validity and
    /// offset.
    pub(crate) fn column_params(c: usize) -> String {
        format!(", const unsigned char* c{c}_v, const unsigned char* c{c}_d, const unsigned char* c{c}_n, u64 c{c}_o")
    }

    /// The declarations that give row `i` of column `c` its element `e<c>`. A dictionary
    /// column's element is its key's value element (0 under a null key), in the values' buffers
    /// `c<c>_dv`, `c<c>_dd` and `c<c>_dn`; `c<c>_kv` says whether the key is valid.
    pub(crate) fn column_decl(&self, c: usize) -> Result<String> {
        let row = match &self.rows[c] {
            Some(j) => format!("({j} == NO_MATCH ? 0 : (u64){j})"),
            None => "i".to_string(),
        };
        let DataType::Dictionary(key, _) = &self.types[c] else {
            return Ok(format!("    u64 e{c} = c{c}_o + {row};\n"));
        };
        let k = match key.as_ref() {
            DataType::Int8 => "signed char",
            DataType::Int16 => "short",
            DataType::Int32 => "int",
            DataType::Int64 => "long long",
            DataType::UInt8 => "unsigned char",
            DataType::UInt16 => "unsigned short",
            DataType::UInt32 => "unsigned int",
            DataType::UInt64 => "u64",
            other => return Err(Error::Unsupported(format!("dictionary keys of {other}"))),
        };
        Ok(format!(
            "    const u64* t{c} = (const u64*)c{c}_d; const unsigned char* c{c}_dv = (const unsigned char*)t{c}[0]; \
             const unsigned char* c{c}_dd = (const unsigned char*)t{c}[1]; \
             const unsigned char* c{c}_dn = (const unsigned char*)t{c}[2];\n\
             \x20   bool c{c}_kv = valid(c{c}_n, c{c}_o + {row}); \
             u64 e{c} = c{c}_kv ? t{c}[3] + (u64)((const {k}*)c{c}_v)[c{c}_o + {row}] : 0;\n"
        ))
    }

    /// Reads column `c` at the row in variable `row` (see [`column_decl`](Self::column_decl)):
    /// element 0 and null where it holds `NO_MATCH`; `None`: at the kernel's row `i`.
    pub(crate) fn read_at(&mut self, c: usize, row: Option<&str>) {
        self.rows[c] = row.map(str::to_string);
    }

    /// The type of column `c`'s values (a dictionary's value type).
    pub(crate) fn value_type(&self, c: usize) -> &DataType {
        match &self.types[c] {
            DataType::Dictionary(_, v) => v,
            dt => dt,
        }
    }

    /// The C names of column `c`'s values and data buffers, and the C expression of element
    /// `e<c>`'s validity (a dictionary's key and value validity).
    pub(crate) fn column_names(&self, c: usize) -> (String, String, String) {
        let (v, d, valid) = if matches!(self.types[c], DataType::Dictionary(..)) {
            (
                format!("c{c}_dv"),
                format!("c{c}_dd"),
                format!("(c{c}_kv && valid(c{c}_dn, e{c}))"),
            )
        } else {
            (format!("c{c}_v"), format!("c{c}_d"), format!("valid(c{c}_n, e{c})"))
        };
        match &self.rows[c] {
            Some(j) => (v, d, format!("({j} != NO_MATCH && {valid})")),
            None => (v, d, valid),
        }
    }

    /// The literal buffer: slots, then string bytes; string slots hold offsets from the buffer start.
    pub(crate) fn literal_buffer(&mut self) -> Result<Vec<u8>> {
        let base = self.slots.len() * 16;
        for &s in &self.string_slots {
            let rel = u32::from_le_bytes(self.slots[s][..4].try_into().expect("4 bytes"));
            let abs =
                u32::try_from(base + rel as usize).map_err(|_| Error::InvalidArgument("literals over 4 GiB".into()))?;
            self.slots[s][..4].copy_from_slice(&abs.to_le_bytes());
        }
        self.string_slots.clear();
        let mut literals: Vec<u8> = self.slots.iter().flatten().copied().collect();
        literals.extend_from_slice(&self.strings);
        if literals.is_empty() {
            literals.resize(16, 0);
        }
        Ok(literals)
    }

    pub(crate) fn var(&mut self) -> usize {
        self.next += 1;
        self.next
    }

    pub(crate) fn slot(&mut self, bytes: [u8; 16]) -> usize {
        self.slots.push(bytes);
        (self.slots.len() - 1) * 16
    }

    pub(crate) fn string_slot(&mut self, s: &[u8]) -> Result<usize> {
        let rel = u32::try_from(self.strings.len())
            .map_err(|_| Error::InvalidArgument("string literals over 4 GiB".into()))?;
        let len = u32::try_from(s.len()).map_err(|_| Error::InvalidArgument("string literal over 4 GiB".into()))?;
        self.strings.extend_from_slice(s);
        let mut b = [0u8; 16];
        b[..4].copy_from_slice(&rel.to_le_bytes());
        b[4..8].copy_from_slice(&len.to_le_bytes());
        self.string_slots.push(self.slots.len());
        Ok(self.slot(b))
    }

    fn kind(&self, col: usize) -> Result<ValueKind> {
        kind_of(&self.types[col])
    }

    /// A C expression of column `col`'s value at element `e` in the domain it is compared in.
    fn load(&self, col: usize) -> Result<String> {
        use DataType::*;
        let v = format!("c{col}_v");
        Ok(match &self.types[col] {
            Int8 => format!("(long long)((const signed char*){v})[e{col}]"),
            Int16 => format!("(long long)((const short*){v})[e{col}]"),
            Int32 | Date32 => format!("(long long)((const int*){v})[e{col}]"),
            Int64 | Date64 | Timestamp(..) => format!("((const long long*){v})[e{col}]"),
            UInt8 => format!("(u64)((const unsigned char*){v})[e{col}]"),
            UInt16 => format!("(u64)((const unsigned short*){v})[e{col}]"),
            UInt32 => format!("(u64)((const unsigned int*){v})[e{col}]"),
            UInt64 => format!("((const u64*){v})[e{col}]"),
            Float32 => format!("fkey32(((const float*){v})[e{col}])"),
            Float64 => format!("fkey64(((const double*){v})[e{col}])"),
            Boolean => format!("(long long)bit({v}, e{col})"),
            Decimal128(..) => format!("({v} + 16 * e{col})"),
            other => return Err(Error::Unsupported(format!("GPU comparison over {other}"))),
        })
    }

    /// Stores a literal in a slot: integers as 8 bytes (floats as their total-order key),
    /// decimals as 16, strings as (offset, length).
    fn literal(&mut self, v: &ScalarValue) -> Result<usize> {
        let int = |x: i64| {
            let mut b = [0u8; 16];
            b[..8].copy_from_slice(&x.to_le_bytes());
            b
        };
        let uint = |x: u64| {
            let mut b = [0u8; 16];
            b[..8].copy_from_slice(&x.to_le_bytes());
            b
        };
        let bytes = match v {
            ScalarValue::Int8(Some(x)) => int(*x as i64),
            ScalarValue::Int16(Some(x)) => int(*x as i64),
            ScalarValue::Int32(Some(x)) | ScalarValue::Date32(Some(x)) => int(*x as i64),
            ScalarValue::Int64(Some(x))
            | ScalarValue::Date64(Some(x))
            | ScalarValue::TimestampSecond(Some(x), _)
            | ScalarValue::TimestampMillisecond(Some(x), _)
            | ScalarValue::TimestampMicrosecond(Some(x), _)
            | ScalarValue::TimestampNanosecond(Some(x), _) => int(*x),
            ScalarValue::UInt8(Some(x)) => uint(*x as u64),
            ScalarValue::UInt16(Some(x)) => uint(*x as u64),
            ScalarValue::UInt32(Some(x)) => uint(*x as u64),
            ScalarValue::UInt64(Some(x)) => uint(*x),
            ScalarValue::Boolean(Some(x)) => int(*x as i64),
            ScalarValue::Float32(Some(x)) => {
                let x = if *x == 0.0 { 0.0f32 } else { *x };
                let b = x.to_bits() as i32;
                int((b ^ ((((b >> 31) as u32) >> 1) as i32)) as i64)
            }
            ScalarValue::Float64(Some(x)) => {
                let x = if *x == 0.0 { 0.0f64 } else { *x };
                let b = x.to_bits() as i64;
                int(b ^ ((((b >> 63) as u64) >> 1) as i64))
            }
            ScalarValue::Decimal128(Some(x), ..) => x.to_le_bytes(),
            ScalarValue::Utf8(Some(s)) | ScalarValue::LargeUtf8(Some(s)) | ScalarValue::Utf8View(Some(s)) => {
                return self.string_slot(s.as_bytes());
            }
            other => return Err(Error::Unsupported(format!("GPU literal {other:?}"))),
        };
        Ok(self.slot(bytes))
    }

    /// Emits the statements that compute a string column's pointer and length at element `e`.
    pub(crate) fn string_value(&mut self, col: usize) -> Result<(String, String)> {
        let n = self.var();
        let (p, l) = (format!("sp{n}"), format!("sl{n}"));
        let (v, d, valid) = self.column_names(col);
        // Only valid slots are read: a null view's length and buffer index may be anything.
        let read = match kind_of(self.value_type(col))? {
            ValueKind::Utf8 => format!(
                "const int* so{n} = (const int*){v}; {p} = {d} + so{n}[e{col}]; \
                 {l} = (u64)(so{n}[e{col} + 1] - so{n}[e{col}]);"
            ),
            ValueKind::LargeUtf8 => format!(
                "const long long* so{n} = (const long long*){v}; {p} = {d} + so{n}[e{col}]; \
                 {l} = (u64)(so{n}[e{col} + 1] - so{n}[e{col}]);"
            ),
            ValueKind::Utf8View => format!(
                "const unsigned char* vw{n} = {v} + 16 * e{col}; {l} = *(const u32*)vw{n}; \
                 {p} = {l} <= 12 ? vw{n} + 4 : \
                 (const unsigned char*)(((const u64*){d})[*(const u32*)(vw{n} + 8)]) + *(const u32*)(vw{n} + 12);"
            ),
            _ => return Err(Error::Unsupported(format!("column {col} is not a string"))),
        };
        writeln!(
            self.body,
            "    const unsigned char* {p} = 0; u64 {l} = 0;\n    if ({valid}) {{ {read} }}"
        )
        .map_err(|_| Error::InvalidArgument("formatting a kernel".into()))?;
        Ok((p, l))
    }

    /// An equality (or other comparison) test of column `col` against the literal in `slot`.
    fn compare(&mut self, col: usize, op: CmpOp, lit: &ScalarValue) -> Result<String> {
        let kind = self.kind(col)?;
        let slot = self.literal(lit)?;
        Ok(match kind {
            ValueKind::Signed => format!("({} {} *(const long long*)(lit + {slot}))", self.load(col)?, op.c()),
            ValueKind::Unsigned => format!("({} {} *(const u64*)(lit + {slot}))", self.load(col)?, op.c()),
            ValueKind::Decimal128 => format!("(cmp128({}, lit + {slot}) {} 0)", self.load(col)?, op.c()),
            ValueKind::Utf8 | ValueKind::LargeUtf8 | ValueKind::Utf8View => {
                let (p, l) = self.string_value(col)?;
                match op {
                    CmpOp::Eq => format!("str_eq({p}, {l}, lit, {slot})"),
                    CmpOp::NotEq => format!("!str_eq({p}, {l}, lit, {slot})"),
                    _ => return Err(Error::Unsupported("ordering comparisons of strings".into())),
                }
            }
        })
    }

    /// Emits code for `p`; returns the names of its (value, known) booleans.
    pub(crate) fn emit(&mut self, p: &Predicate) -> Result<(String, String)> {
        let n = self.var();
        let (v, k) = (format!("v{n}"), format!("k{n}"));
        let line = |s: &mut String, text: String| {
            s.push_str("    ");
            s.push_str(&text);
            s.push('\n');
        };
        match p {
            Predicate::And(a, b) | Predicate::Or(a, b) => {
                let (va, ka) = self.emit(a)?;
                let (vb, kb) = self.emit(b)?;
                let and = matches!(p, Predicate::And(..));
                line(&mut self.body, kleene(and, (&v, &k), (&va, &ka), (&vb, &kb)));
            }
            Predicate::Not(a) => {
                let (va, ka) = self.emit(a)?;
                line(&mut self.body, format!("bool {k} = {ka}; bool {v} = !{va};"));
            }
            Predicate::Cmp { col, op, lit } => {
                let test = self.compare(*col, *op, lit)?;
                line(
                    &mut self.body,
                    format!("bool {k} = valid(c{col}_n, e{col}); bool {v} = {k} && {test};"),
                );
            }
            Predicate::InList { col, list } => {
                let mut tests = Vec::with_capacity(list.len());
                for item in list {
                    tests.push(self.compare(*col, CmpOp::Eq, item)?);
                }
                line(
                    &mut self.body,
                    format!(
                        "bool {k} = valid(c{col}_n, e{col}); bool {v} = {k} && ({});",
                        tests.join(" || ")
                    ),
                );
            }
            Predicate::IsNull { col } => {
                line(
                    &mut self.body,
                    format!("bool {k} = true; bool {v} = !valid(c{col}_n, e{col});"),
                );
            }
            Predicate::StartsWith { col, prefix } => {
                let slot = self.string_slot(prefix.as_bytes())?;
                let (sp, sl) = self.string_value(*col)?;
                line(
                    &mut self.body,
                    format!(
                        "bool {k} = valid(c{col}_n, e{col}); bool {v} = {k} && str_prefix({sp}, {sl}, lit, {slot});"
                    ),
                );
            }
            Predicate::Like { col, pattern } => {
                let slot = self.string_slot(pattern.as_bytes())?;
                let (sp, sl) = self.string_value(*col)?;
                line(
                    &mut self.body,
                    format!("bool {k} = valid(c{col}_n, e{col}); bool {v} = {k} && str_like({sp}, {sl}, lit, {slot});"),
                );
            }
            Predicate::Column { col } => {
                line(
                    &mut self.body,
                    format!("bool {k} = valid(c{col}_n, e{col}); bool {v} = {k} && bit(c{col}_v, e{col});"),
                );
            }
        }
        Ok((v, k))
    }
}

/// Generates the predicate kernel `pred(n, sel, lit, c<i>_v, c<i>_d, c<i>_n, c<i>_o ...)` for the
/// columns `cols` (ascending), with its literal buffer.
pub(crate) fn generate(predicate: &Predicate, batch: &DeviceRecordBatch, cols: &[usize]) -> Result<Generated> {
    let mut g = Codegen::new(batch);
    for &c in cols {
        let decl = g.column_decl(c)?;
        g.body.push_str(&decl);
    }
    let (v, k) = g.emit(predicate)?;
    let mut source = String::from(PREDICATE_PRELUDE);
    source.push_str("extern \"C\" __global__ void pred(u64 n, unsigned char* sel, const unsigned char* lit");
    for &c in cols {
        source.push_str(&Codegen::column_params(c));
    }
    source.push_str(") {\n    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;\n    if (i >= n) return;\n");
    source.push_str(&g.body);
    source.push_str(&format!("    sel[i] = ({k} && {v}) ? 1 : 0;\n}}\n"));
    let literals = g.literal_buffer()?;
    Ok(Generated { source, literals })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow_array::{
        ArrayRef, BooleanArray, Date32Array, Decimal128Array, Float32Array, Int8Array, LargeStringArray, RecordBatch,
        StringArray, StringViewArray, UInt16Array,
    };

    use std::collections::BTreeSet;

    use super::*;
    use crate::datafusion::cuda_as_cpp;
    use crate::datafusion::device_filter::SCAN_KERNELS;
    use crate::device::{Device, Stream};

    fn batch() -> DeviceRecordBatch {
        let columns: Vec<(&str, ArrayRef)> = vec![
            ("i8", Arc::new(Int8Array::from(vec![Some(1), None]))),
            ("u16", Arc::new(UInt16Array::from(vec![1, 2]))),
            ("f32", Arc::new(Float32Array::from(vec![1.0, f32::NAN]))),
            (
                "dec",
                Arc::new(
                    Decimal128Array::from(vec![1, 2])
                        .with_precision_and_scale(10, 2)
                        .unwrap(),
                ),
            ),
            ("date", Arc::new(Date32Array::from(vec![1, 2]))),
            ("flag", Arc::new(BooleanArray::from(vec![Some(true), None]))),
            ("s", Arc::new(StringArray::from(vec!["a", "b"]))),
            ("l", Arc::new(LargeStringArray::from(vec!["a", "b"]))),
            ("v", Arc::new(StringViewArray::from(vec!["a", "a long string of text"]))),
        ];
        let b = RecordBatch::try_from_iter(columns).unwrap();
        crate::transfer::htod(&b, Device::Cpu, &Stream::cpu()).unwrap()
    }

    fn predicate() -> Predicate {
        let cmp = |col, op, lit| Box::new(Predicate::Cmp { col, op, lit });
        let and = |a, b| Box::new(Predicate::And(a, b));
        let or = |a, b| Box::new(Predicate::Or(a, b));
        *and(
            or(
                cmp(0, CmpOp::Gt, ScalarValue::Int8(Some(-3))),
                cmp(1, CmpOp::LtEq, ScalarValue::UInt16(Some(7))),
            ),
            and(
                and(
                    cmp(2, CmpOp::NotEq, ScalarValue::Float32(Some(-0.0))),
                    cmp(3, CmpOp::GtEq, ScalarValue::Decimal128(Some(-12345), 10, 2)),
                ),
                and(
                    or(
                        Box::new(Predicate::InList {
                            col: 4,
                            list: vec![ScalarValue::Date32(Some(1)), ScalarValue::Date32(Some(9))],
                        }),
                        Box::new(Predicate::Not(Box::new(Predicate::Column { col: 5 }))),
                    ),
                    and(
                        or(
                            cmp(6, CmpOp::Eq, ScalarValue::Utf8(Some("abc".into()))),
                            Box::new(Predicate::StartsWith {
                                col: 7,
                                prefix: "ab".into(),
                            }),
                        ),
                        or(
                            Box::new(Predicate::InList {
                                col: 8,
                                list: vec![
                                    ScalarValue::Utf8View(Some("x".into())),
                                    ScalarValue::Utf8View(Some("a long literal string".into())),
                                ],
                            }),
                            Box::new(Predicate::IsNull { col: 8 }),
                        ),
                    ),
                ),
            ),
        )
    }

    #[test]
    fn literals_are_laid_out_in_slots() {
        let b = batch();
        let p = predicate();
        let mut cols = BTreeSet::new();
        p.columns(&mut cols);
        let cols: Vec<usize> = cols.into_iter().collect();
        let g = generate(&p, &b, &cols).unwrap();
        if std::env::var_os("SHOW_KERNEL").is_some() {
            println!("{}", g.source);
        }
        // Slots of 16 bytes, then "abc", "ab", "x", "a long literal string".
        let strings = b"abcabxa long literal string";
        assert!(g.literals.ends_with(strings));
        let base = g.literals.len() - strings.len();
        assert_eq!(base % 16, 0);
        // The string slots point into the tail with their lengths.
        let slots: Vec<(u32, u32)> = g.literals[..base]
            .chunks(16)
            .map(|s| {
                (
                    u32::from_le_bytes(s[..4].try_into().unwrap()),
                    u32::from_le_bytes(s[4..8].try_into().unwrap()),
                )
            })
            .filter(|&(o, l)| o as usize >= base && o as usize + l as usize <= g.literals.len())
            .collect();
        assert_eq!(
            slots,
            vec![
                (base as u32, 3),
                (base as u32 + 3, 2),
                (base as u32 + 5, 1),
                (base as u32 + 6, 21)
            ]
        );
        // -0.0 is compared as +0.0; -123.45 is stored as a 16-byte integer.
        assert!(g.source.contains("fkey32"));
        assert!(g.literals.chunks(16).any(|s| s == (-12345i128).to_le_bytes()));
        // The same shape with other literals compiles to the same source.
        let mut q = p.clone();
        if let Predicate::And(a, _) = &mut q
            && let Predicate::Or(x, _) = a.as_mut()
        {
            **x = Predicate::Cmp {
                col: 0,
                op: CmpOp::Gt,
                lit: ScalarValue::Int8(Some(100)),
            };
        }
        let g2 = generate(&q, &b, &cols).unwrap();
        assert_eq!(g.source, g2.source);
        assert_ne!(g.literals, g2.literals);
    }

    /// The CUDA sources are valid C++ for a host compiler given a few CUDA declarations (a
    /// syntax check for machines without NVRTC; the GPU run compiles them for real).
    #[test]
    fn cuda_sources_parse_as_cpp() {
        let Some(cxx) = cuda_as_cpp::compiler() else {
            eprintln!("skipped: no C++ compiler");
            return;
        };
        let b = batch();
        let p = predicate();
        let mut cols = BTreeSet::new();
        p.columns(&mut cols);
        let cols: Vec<usize> = cols.into_iter().collect();
        let g = generate(&p, &b, &cols).unwrap();
        for (name, src) in [("scan", SCAN_KERNELS), ("pred", g.source.as_str())] {
            if let Err(e) = cuda_as_cpp::check_syntax(cxx, name, src) {
                panic!("{name}:\n{e}\n{src}");
            }
        }
    }

    #[test]
    fn entry_points_fail_cleanly_without_a_gpu() {
        if crate::datafusion::nvrtc::gpu_kernels_available() {
            return;
        }
        let b = batch();
        let r = crate::datafusion::device_filter::filter_compact(&b, &predicate(), &[0], 10, &Stream::cpu());
        assert!(r.is_err());
    }
}
