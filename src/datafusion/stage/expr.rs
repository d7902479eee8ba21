//! The expression compiler: DataFusion [`PhysicalExpr`] trees over a GPU table's columns become
//! CUDA C statements that compute a value and its validity per row, with DataFusion's types and
//! semantics:
//!
//! - integers wrap at their type's width (DataFusion's `+ - *` default to wrapping), and integer
//!   division or remainder by zero raises the stage's division flag, as DataFusion errors;
//! - `Decimal128` arithmetic is exact 128-bit integer arithmetic with arrow's rescaling and its
//!   overflow checks (an overflow raises the stage's overflow flag: DataFusion errors too);
//! - floats are computed in their own width; comparisons of floats use arrow's total order after
//!   `-0.0` becomes `+0.0`, as the scan's predicates do;
//! - `AND`, `OR`, `NOT`, `IS [NOT] NULL`, `CASE` and `IN` follow SQL's three-valued logic.
//!
//! Literals live in the kernel's literal buffer (see [`Codegen`]), so the source depends only on the
//! expressions' shape and types. Anything else is [`Error::Unsupported`]: the rule then leaves the
//! plan to DataFusion.

use std::sync::Arc;

use ::datafusion::common::ScalarValue;
use ::datafusion::logical_expr::Operator;
use ::datafusion::physical_expr::PhysicalExpr;
use ::datafusion::physical_expr::ScalarFunctionExpr;
use ::datafusion::physical_expr::expressions::{
    BinaryExpr, CaseExpr, CastExpr, Column, InListExpr, IsNotNullExpr, IsNullExpr, LikeExpr, Literal, NegativeExpr,
    NotExpr,
};
use arrow_schema::{DataType, Schema};

use ::datafusion::logical_expr::ColumnarValue;
use ::datafusion::physical_expr::scalar_subquery::ScalarSubqueryExpr;

use super::super::predicate_codegen::{Codegen, LateLiteral, kleene};
use crate::error::{Error, Result};

/// A compiled expression: the names of its value and validity variables, and its type.
#[derive(Clone, Debug)]
pub(crate) struct Val {
    /// The value (for strings: the pointer to the bytes).
    pub(crate) v: String,
    /// Whether the value is valid (not null).
    pub(crate) k: String,
    /// For strings: the length in bytes.
    pub(crate) len: Option<String>,
    /// The DataFusion type.
    pub(crate) dt: DataType,
}

fn unsupported<T>(what: impl std::fmt::Display) -> Result<T> {
    Err(Error::Unsupported(format!("device expression: {what}")))
}

/// The C type a value of `dt` is held in, or `None` when the compiler does not handle `dt`.
pub(crate) fn c_type(dt: &DataType) -> Option<&'static str> {
    use DataType::*;
    Some(match dt {
        Int8 | Int16 | Int32 | Int64 | UInt8 | UInt16 | UInt32 | Date32 | Date64 => "long long",
        Boolean => "bool",
        Float32 => "float",
        Float64 => "double",
        Decimal128(_, s) if *s >= 0 => "i128",
        Utf8 | LargeUtf8 | Utf8View => "const unsigned char*",
        _ => return None,
    })
}

/// The C type that wraps an integer result of `dt` to its width.
pub(crate) fn int_width(dt: &DataType) -> Option<&'static str> {
    use DataType::*;
    Some(match dt {
        Int8 => "signed char",
        Int16 => "short",
        Int32 | Date32 => "int",
        Int64 | Date64 => "long long",
        UInt8 => "unsigned char",
        UInt16 => "unsigned short",
        UInt32 => "unsigned int",
        _ => return None,
    })
}

fn is_int(dt: &DataType) -> bool {
    int_width(dt).is_some() && !matches!(dt, DataType::Date32 | DataType::Date64)
}

fn is_string(dt: &DataType) -> bool {
    matches!(dt, DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View)
}

/// Compiles expressions into the body of a [`Codegen`]; the kernel declares `u64 e<c>` for every
/// column `c` it reads and `bool ovf, dz` (overflow and division by zero of kept rows).
pub(crate) struct ExprCompiler<'c> {
    pub(crate) g: &'c mut Codegen,
    schema: &'c Schema,
}

impl<'c> ExprCompiler<'c> {
    /// A compiler of expressions whose columns index `schema` (the table's schema).
    pub(crate) fn new(g: &'c mut Codegen, schema: &'c Schema) -> Self {
        ExprCompiler { g, schema }
    }

    fn line(&mut self, text: impl AsRef<str>) {
        self.g.body.push_str("    ");
        self.g.body.push_str(text.as_ref());
        self.g.body.push('\n');
    }

    fn fresh(&mut self) -> (String, String) {
        let n = self.g.var();
        (format!("x{n}"), format!("k{n}"))
    }

    /// Declares the result variables of a value of `dt` (assigned later).
    fn declare(&mut self, dt: &DataType) -> Result<Val> {
        let ty = c_type(dt).map_or_else(|| unsupported(dt), Ok)?;
        let (v, k) = self.fresh();
        let len = if is_string(dt) {
            let l = format!("{v}_len");
            self.line(format!("{ty} {v} = 0; u64 {l} = 0; bool {k} = false;"));
            Some(l)
        } else {
            self.line(format!("{ty} {v} = 0; bool {k} = false;"));
            None
        };
        Ok(Val {
            v,
            k,
            len,
            dt: dt.clone(),
        })
    }

    fn assign(&mut self, to: &Val, from: &Val) {
        let mut s = format!("{} = {}; {} = {};", to.v, from.v, to.k, from.k);
        if let (Some(a), Some(b)) = (&to.len, &from.len) {
            s.push_str(&format!(" {a} = {b};"));
        }
        self.line(s);
    }

    /// Compiles `expr`; its statements are appended to the body.
    pub(crate) fn compile(&mut self, expr: &Arc<dyn PhysicalExpr>) -> Result<Val> {
        let dt = expr
            .data_type(self.schema)
            .map_err(|e| Error::Unsupported(format!("device expression type: {e}")))?;
        if let Some(c) = expr.downcast_ref::<Column>() {
            return self.column(c.index());
        }
        if let Some(l) = expr.downcast_ref::<Literal>() {
            return self.literal(l.value());
        }
        if expr.downcast_ref::<ScalarSubqueryExpr>().is_some() {
            return self.late_literal(expr, &dt);
        }
        if let Some(b) = expr.downcast_ref::<BinaryExpr>() {
            return self.binary(b, &dt);
        }
        if let Some(n) = expr.downcast_ref::<NotExpr>() {
            let a = self.compile(n.arg())?;
            if a.dt != DataType::Boolean {
                return unsupported("NOT of a non-boolean");
            }
            let (v, k) = self.fresh();
            self.line(format!("bool {k} = {}; bool {v} = !{};", a.k, a.v));
            return Ok(Val { v, k, len: None, dt });
        }
        if let Some(n) = expr.downcast_ref::<NegativeExpr>() {
            return self.negative(n.arg(), dt);
        }
        if let Some(n) = expr.downcast_ref::<IsNullExpr>() {
            let a = self.compile(n.arg())?;
            let (v, k) = self.fresh();
            self.line(format!("bool {k} = true; bool {v} = !{};", a.k));
            return Ok(Val { v, k, len: None, dt });
        }
        if let Some(n) = expr.downcast_ref::<IsNotNullExpr>() {
            let a = self.compile(n.arg())?;
            let (v, k) = self.fresh();
            self.line(format!("bool {k} = true; bool {v} = {};", a.k));
            return Ok(Val { v, k, len: None, dt });
        }
        if let Some(c) = expr.downcast_ref::<CastExpr>() {
            let a = self.compile(c.expr())?;
            return self.cast(a, c.cast_type());
        }
        if let Some(c) = expr.downcast_ref::<CaseExpr>() {
            return self.case(c, &dt);
        }
        if let Some(i) = expr.downcast_ref::<InListExpr>() {
            return self.in_list(i);
        }
        if let Some(l) = expr.downcast_ref::<LikeExpr>() {
            return self.like(l);
        }
        if let Some(f) = expr.downcast_ref::<ScalarFunctionExpr>() {
            return self.function(f, &dt);
        }
        unsupported(expr)
    }

    /// `-arg`, wrapping as arrow's `neg_wrapping` (which DataFusion's `NegativeExpr` runs):
    /// signed integers at their width, decimals at 128 bits (no precision check), floats.
    fn negative(&mut self, arg: &Arc<dyn PhysicalExpr>, dt: DataType) -> Result<Val> {
        let a = self.compile(arg)?;
        let body = match &a.dt {
            DataType::Int8 | DataType::Int16 | DataType::Int32 | DataType::Int64 => {
                let w = int_width(&a.dt).expect("integer");
                format!("(long long)({w})(0ull - (unsigned long long){})", a.v)
            }
            DataType::Float32 | DataType::Float64 => format!("-{}", a.v),
            DataType::Decimal128(..) => format!("(i128)((unsigned __int128)0 - (unsigned __int128){})", a.v),
            other => return unsupported(format!("negation of {other}")),
        };
        let ty = c_type(&a.dt).map_or_else(|| unsupported(&a.dt), Ok)?;
        let (v, k) = self.fresh();
        self.line(format!("bool {k} = {}; {ty} {v} = {k} ? {body} : 0;", a.k));
        Ok(Val { v, k, len: None, dt })
    }

    /// Column `c`'s value; a dictionary column's is its key's value, of the value type.
    fn column(&mut self, c: usize) -> Result<Val> {
        let dt = self.g.value_type(c).clone();
        if let DataType::Dictionary(..) = self.schema.field(c).data_type()
            && (dt == DataType::Utf8View || c_type(&dt).is_none())
        {
            return unsupported(format!("a dictionary of {dt}"));
        }
        let (v, k) = self.fresh();
        let (src, _, valid) = self.g.column_names(c);
        let e = format!("e{c}");
        self.line(format!("bool {k} = {valid};"));
        if is_string(&dt) {
            let (p, l) = self.g.string_value(c)?;
            return Ok(Val {
                v: p,
                k,
                len: Some(l),
                dt,
            });
        }
        use DataType::*;
        let load = match &dt {
            Int8 => format!("(long long)((const signed char*){src})[{e}]"),
            Int16 => format!("(long long)((const short*){src})[{e}]"),
            Int32 | Date32 => format!("(long long)((const int*){src})[{e}]"),
            Int64 | Date64 => format!("((const long long*){src})[{e}]"),
            UInt8 => format!("(long long)((const unsigned char*){src})[{e}]"),
            UInt16 => format!("(long long)((const unsigned short*){src})[{e}]"),
            UInt32 => format!("(long long)((const unsigned int*){src})[{e}]"),
            Boolean => format!("bit({src}, {e})"),
            Float32 => format!("((const float*){src})[{e}]"),
            Float64 => format!("((const double*){src})[{e}]"),
            Decimal128(_, s) if *s >= 0 => format!("*(const i128*)({src} + 16 * {e})"),
            other => return unsupported(other),
        };
        let ty = c_type(&dt).map_or_else(|| unsupported(&dt), Ok)?;
        self.line(format!("{ty} {v} = {load};"));
        Ok(Val { v, k, len: None, dt })
    }

    fn literal(&mut self, value: &ScalarValue) -> Result<Val> {
        let dt = value.data_type();
        if value.is_null() {
            let out = self.declare(&dt)?;
            return Ok(out);
        }
        let (v, k) = self.fresh();
        if let ScalarValue::Utf8(Some(s)) | ScalarValue::LargeUtf8(Some(s)) | ScalarValue::Utf8View(Some(s)) = value {
            let slot = self.g.string_slot(s.as_bytes())?;
            let l = format!("{v}_len");
            self.line(format!(
                "const unsigned char* {v} = lit + *(const u32*)(lit + {slot}); \
                 u64 {l} = *(const u32*)(lit + {slot} + 4); bool {k} = true;"
            ));
            return Ok(Val { v, k, len: Some(l), dt });
        }
        let slot = self.g.slot(literal_bytes(value)?);
        let (load, read) = literal_read(&dt, slot)?;
        self.line(format!("{load} {v} = {read}; bool {k} = true;"));
        Ok(Val { v, k, len: None, dt })
    }

    /// A value known only when the stage runs (an uncorrelated scalar subquery's): a slot of the
    /// literal buffer for it and one for its validity, which [`late_literals`] fills.
    fn late_literal(&mut self, expr: &Arc<dyn PhysicalExpr>, dt: &DataType) -> Result<Val> {
        let value = self.g.slot([0; 16]);
        let valid = self.g.slot([0; 16]);
        let (load, read) = literal_read(dt, value)?;
        self.g.late.push(LateLiteral {
            value,
            valid,
            expr: expr.clone(),
        });
        let (v, k) = self.fresh();
        self.line(format!(
            "{load} {v} = {read}; bool {k} = *(const long long*)(lit + {valid}) != 0;"
        ));
        Ok(Val {
            v,
            k,
            len: None,
            dt: dt.clone(),
        })
    }

    fn binary(&mut self, b: &BinaryExpr, dt: &DataType) -> Result<Val> {
        let op = *b.op();
        match op {
            Operator::And | Operator::Or => {
                let l = self.compile(b.left())?;
                let r = self.compile(b.right())?;
                let (v, k) = self.fresh();
                self.line(kleene(op == Operator::And, (&v, &k), (&l.v, &l.k), (&r.v, &r.k)));
                Ok(Val {
                    v,
                    k,
                    len: None,
                    dt: DataType::Boolean,
                })
            }
            Operator::Eq | Operator::NotEq | Operator::Lt | Operator::LtEq | Operator::Gt | Operator::GtEq => {
                let l = self.compile(b.left())?;
                let r = self.compile(b.right())?;
                self.compare(op, &l, &r)
            }
            Operator::Plus | Operator::Minus if interval_literal(b.right()).is_some() => {
                let delta = interval_literal(b.right()).expect("an interval");
                self.date_interval(b.left(), op == Operator::Minus, delta?, dt)
            }
            Operator::Plus if interval_literal(b.left()).is_some() => {
                let delta = interval_literal(b.left()).expect("an interval");
                self.date_interval(b.right(), false, delta?, dt)
            }
            Operator::Plus | Operator::Minus | Operator::Multiply | Operator::Divide | Operator::Modulo => {
                let l = self.compile(b.left())?;
                let r = self.compile(b.right())?;
                self.arithmetic(op, &l, &r, dt)
            }
            other => unsupported(format!("operator {other}")),
        }
    }

    /// `date ± interval` for a `Date32` and an interval literal, as arrow computes it (through
    /// chrono: months first with the day clamped to the month's end, then days; a date outside
    /// chrono's range is an error).
    fn date_interval(
        &mut self,
        date: &Arc<dyn PhysicalExpr>,
        minus: bool,
        (months, days, days2): (i64, i64, i64),
        dt: &DataType,
    ) -> Result<Val> {
        let a = self.compile(date)?;
        if a.dt != DataType::Date32 || dt != &DataType::Date32 {
            return unsupported(format!("{} ± interval -> {dt}", a.dt));
        }
        let sign = if minus { -1 } else { 1 };
        let int = |x: i64| {
            let mut b = [0u8; 16];
            b[..8].copy_from_slice(&x.to_le_bytes());
            b
        };
        let slots = [months, days, days2].map(|x| self.g.slot(int(sign * x)));
        let (v, k) = self.fresh();
        let f = format!("ovf{v}");
        let arg = |s: usize| format!("*(const long long*)(lit + {s})");
        self.line(format!(
            "bool {k} = {}; bool {f} = false; long long {v} = {k} ? date_add_interval({}, {}, {}, {}, &{f}) : 0LL; \
             if ({k} && {f}) ovf = true;",
            a.k,
            a.v,
            arg(slots[0]),
            arg(slots[1]),
            arg(slots[2])
        ));
        Ok(Val {
            v,
            k,
            len: None,
            dt: DataType::Date32,
        })
    }

    fn compare(&mut self, op: Operator, l: &Val, r: &Val) -> Result<Val> {
        let c = match op {
            Operator::Eq => "==",
            Operator::NotEq => "!=",
            Operator::Lt => "<",
            Operator::LtEq => "<=",
            Operator::Gt => ">",
            _ => ">=",
        };
        let test = match (&l.dt, &r.dt) {
            (a, b) if is_string(a) && is_string(b) => {
                let (ll, rl) = (l.len.as_ref().expect("string"), r.len.as_ref().expect("string"));
                format!("(str_cmp({}, {ll}, {}, {rl}) {c} 0)", l.v, r.v)
            }
            (DataType::Float32, DataType::Float32) => format!("(fkey32({}) {c} fkey32({}))", l.v, r.v),
            (DataType::Float64, DataType::Float64) => format!("(fkey64({}) {c} fkey64({}))", l.v, r.v),
            (DataType::Decimal128(_, s1), DataType::Decimal128(_, s2)) if s1 == s2 => format!("({} {c} {})", l.v, r.v),
            (a, b) if (is_int(a) && is_int(b)) || (a == b && matches!(a, DataType::Date32 | DataType::Date64)) => {
                format!("({} {c} {})", l.v, r.v)
            }
            (DataType::Boolean, DataType::Boolean) => format!("((int){} {c} (int){})", l.v, r.v),
            (a, b) => return unsupported(format!("comparison of {a} with {b}")),
        };
        let (v, k) = self.fresh();
        self.line(format!("bool {k} = {} && {}; bool {v} = {k} && {test};", l.k, r.k));
        Ok(Val {
            v,
            k,
            len: None,
            dt: DataType::Boolean,
        })
    }

    fn arithmetic(&mut self, op: Operator, l: &Val, r: &Val, dt: &DataType) -> Result<Val> {
        let (v, k) = self.fresh();
        let (a, b) = (&l.v, &r.v);
        let both = format!("{} && {}", l.k, r.k);
        match (&l.dt, &r.dt, dt) {
            (x, y, DataType::Float64) | (x, y, DataType::Float32)
                if x == dt && y == dt && !matches!(op, Operator::Modulo) =>
            {
                let ty = c_type(dt).expect("float");
                let c = arith_c(op);
                self.line(format!("bool {k} = {both}; {ty} {v} = {a} {c} {b};"));
            }
            (x, y, out) if is_int(x) && is_int(y) && is_int(out) && x == out && y == out => {
                let w = int_width(out).expect("integer");
                let expr = match op {
                    Operator::Plus | Operator::Minus | Operator::Multiply => format!(
                        "(long long)({w})((unsigned long long){a} {} (unsigned long long){b})",
                        arith_c(op)
                    ),
                    _ => {
                        // Checked, as arrow's `div` and `rem`: zero divisors and MIN / -1 are errors.
                        let min = match out {
                            DataType::Int8 => "-128LL",
                            DataType::Int16 => "-32768LL",
                            DataType::Int32 => "(-2147483647LL - 1)",
                            DataType::Int64 => "(-9223372036854775807LL - 1)",
                            _ => "1LL",
                        };
                        self.line(format!(
                            "if ({both} && {b} == 0) dz = true; \
                             if ({both} && {b} == -1 && {a} == {min} && {min} != 1LL) ovf = true;"
                        ));
                        format!(
                            "({b} == 0 || ({b} == -1 && {a} == {min})) ? 0LL : (long long)({w})({a} {} {b})",
                            arith_c(op)
                        )
                    }
                };
                self.line(format!("bool {k} = {both}; long long {v} = {expr};"));
            }
            (DataType::Decimal128(p1, s1), DataType::Decimal128(p2, s2), DataType::Decimal128(p, s))
                if *s1 >= 0 && *s2 >= 0 =>
            {
                let (p1, s1, p2, s2) = (*p1 as i32, *s1 as i32, *p2 as i32, *s2 as i32);
                let (want_p, want_s) = match op {
                    Operator::Plus | Operator::Minus => {
                        let rs = s1.max(s2);
                        ((rs + (p1 - s1).max(p2 - s2) + 1).min(38), rs)
                    }
                    Operator::Multiply => ((p1 + p2 + 1).min(38), s1 + s2),
                    Operator::Divide => {
                        let rs = (s1 + 4).min(38);
                        ((rs - s1 + s2 + p1).min(38), rs)
                    }
                    _ => {
                        let rs = s1.max(s2);
                        ((rs + (p1 - s1).min(p2 - s2)).min(38), rs)
                    }
                };
                if (want_p, want_s) != (*p as i32, *s as i32) || want_s > 38 {
                    return unsupported(format!("decimal {op} with result {dt}"));
                }
                let f = format!("ovf{v}");
                let z = format!("dz{v}");
                let expr = match op {
                    Operator::Plus | Operator::Minus => {
                        let rs = s1.max(s2);
                        let name = if op == Operator::Plus {
                            "add_checked"
                        } else {
                            "sub_checked"
                        };
                        if s1 == s2 {
                            format!("{name}({a}, {b}, &{f})")
                        } else {
                            format!(
                                "{name}(mul_checked({a}, pow10_128({}), &{f}), mul_checked({b}, pow10_128({}), &{f}), &{f})",
                                rs - s1,
                                rs - s2
                            )
                        }
                    }
                    Operator::Multiply => format!("mul_checked({a}, {b}, &{f})"),
                    Operator::Divide => {
                        let pow = want_s - s1 + s2;
                        let (lm, rm) = if pow >= 0 { (pow, 0) } else { (0, -pow) };
                        format!(
                            "div_checked(mul_checked({a}, pow10_128({lm}), &{f}), mul_checked({b}, pow10_128({rm}), &{f}), &{f}, &{z})"
                        )
                    }
                    _ => {
                        let rs = s1.max(s2);
                        format!(
                            "rem_checked(mul_checked({a}, pow10_128({}), &{f}), mul_checked({b}, pow10_128({}), &{f}), &{f}, &{z})",
                            rs - s1,
                            rs - s2
                        )
                    }
                };
                self.line(format!(
                    "bool {k} = {both}; bool {f} = false, {z} = false; i128 {v} = {k} ? {expr} : (i128)0; \
                     if ({k} && {f}) ovf = true; if ({k} && {z}) dz = true;"
                ));
            }
            (x, y, out) => return unsupported(format!("{x} {op} {y} -> {out}")),
        }
        Ok(Val {
            v,
            k,
            len: None,
            dt: dt.clone(),
        })
    }

    fn cast(&mut self, a: Val, to: &DataType) -> Result<Val> {
        use DataType::*;
        if &a.dt == to {
            return Ok(a);
        }
        let (v, k) = self.fresh();
        let x = &a.v;
        let ka = &a.k;
        let expr = match (&a.dt, to) {
            (from, out) if is_int(from) && is_int(out) => {
                // Safe = false: a value that does not fit is an error, as arrow's cast reports it.
                let w = int_width(out).expect("integer");
                self.line(format!("if ({ka} && (long long)({w}){x} != {x}) ovf = true;"));
                format!("(long long)({w}){x}")
            }
            (from, Float64) if is_int(from) => format!("(double){x}"),
            (from, Float32) if is_int(from) => format!("(float){x}"),
            (Float32, Float64) => format!("(double){x}"),
            // Round to nearest, out of range to infinity (PTX's cvt.rn.f32.f64), as Rust's `as f32`.
            (Float64, Float32) => format!("(float){x}"),
            (from, Decimal128(p, s)) if is_int(from) && *s >= 0 => {
                let f = format!("ovf{v}");
                self.line(format!(
                    "bool {f} = false; i128 {v}_t = mul_checked((i128){x}, pow10_128({s}), &{f}); \
                     if ({ka} && ({f} || !fits_precision({v}_t, {p}))) ovf = true;"
                ));
                format!("{v}_t")
            }
            (Decimal128(_, s1), Decimal128(p, s2)) if *s1 >= 0 && s2 >= s1 => {
                let f = format!("ovf{v}");
                self.line(format!(
                    "bool {f} = false; i128 {v}_t = mul_checked({x}, pow10_128({}), &{f}); \
                     if ({ka} && ({f} || !fits_precision({v}_t, {p}))) ovf = true;",
                    s2 - s1
                ));
                format!("{v}_t")
            }
            (Decimal128(p1, s1), Decimal128(p2, s2)) if *s2 >= 0 && s1 > s2 => {
                // arrow's downscaling: divide by 10^delta and round half away from zero; the result's
                // precision is checked (an error, as safe = false) unless it cannot exceed it.
                let delta = (*s1 - *s2) as i32;
                let infallible = (*p1 as i32) - delta < *p2 as i32;
                self.line(format!(
                    "i128 {v}_d = pow10_128({delta}), {v}_h = {v}_d / 2; i128 {v}_q = {x} / {v}_d, {v}_r = {x} % {v}_d; \
                     if ({x} >= 0 && {v}_r >= {v}_h) {v}_q += 1; else if ({x} < 0 && {v}_r <= -{v}_h) {v}_q -= 1;"
                ));
                if !infallible {
                    self.line(format!("if ({ka} && !fits_precision({v}_q, {p2})) ovf = true;"));
                }
                format!("{v}_q")
            }
            (Date32, Int32 | Int64) => x.clone(),
            (Float64 | Float32, out) if is_int(out) && !matches!(out, UInt8 | UInt16 | UInt32) => {
                // num-traits' float to int, as arrow's cast: truncation toward zero; out of range or
                // NaN is an error (safe = false).
                let bits = match out {
                    Int8 => 8,
                    Int16 => 16,
                    Int32 => 32,
                    _ => 64,
                };
                let fbits = if a.dt == Float64 { 64 } else { 32 };
                let max_p1 = format!("{:.1}", 2f64.powi(bits - 1));
                let in_range = if fbits > bits {
                    let min_m1 = format!("{:.1}", -(2f64.powi(bits - 1)) - 1.0);
                    format!("({x} > {min_m1} && {x} < {max_p1})")
                } else {
                    format!("({x} >= -{max_p1} && {x} < {max_p1})")
                };
                self.line(format!("if ({ka} && !{in_range}) ovf = true;"));
                format!("{in_range} ? (long long){x} : 0LL")
            }
            (Decimal128(_, s), Float64) if *s >= 0 => format!("(double){x} / (double)pow10_128({s})"),
            (from, out) if is_string(from) && is_string(out) => {
                let l = format!("{v}_len");
                let len = a_len(&a)?;
                self.line(format!(
                    "bool {k} = {ka}; const unsigned char* {v} = {x}; u64 {l} = {len};"
                ));
                return Ok(Val {
                    v,
                    k,
                    len: Some(l),
                    dt: to.clone(),
                });
            }
            (from, to) => return unsupported(format!("CAST({from} AS {to})")),
        };
        let ty = c_type(to).map_or_else(|| unsupported(to), Ok)?;
        self.line(format!("bool {k} = {ka}; {ty} {v} = {expr};"));
        Ok(Val {
            v,
            k,
            len: None,
            dt: to.clone(),
        })
    }

    fn case(&mut self, c: &CaseExpr, dt: &DataType) -> Result<Val> {
        if c.expr().is_some() {
            return unsupported("CASE with a base expression");
        }
        let out = self.declare(dt)?;
        // Each branch is evaluated only where it is taken, so an error in a branch that is not
        // taken is not raised (as DataFusion evaluates branches on the rows that reach them).
        let mut closes = 0;
        for (when, then) in c.when_then_expr() {
            let w = self.compile(when)?;
            self.line(format!("if ({} && {}) {{", w.k, w.v));
            let t = self.compile(then)?;
            if &t.dt != dt {
                return unsupported("CASE branch of another type");
            }
            self.assign(&out, &t);
            self.line("} else {");
            closes += 1;
        }
        if let Some(e) = c.else_expr() {
            let e = self.compile(e)?;
            if &e.dt != dt {
                return unsupported("CASE else of another type");
            }
            self.assign(&out, &e);
        }
        for _ in 0..closes {
            self.line("}");
        }
        Ok(out)
    }

    fn in_list(&mut self, i: &InListExpr) -> Result<Val> {
        let x = self.compile(i.expr())?;
        if matches!(x.dt, DataType::Float32 | DataType::Float64) {
            return unsupported("IN lists of floats");
        }
        let mut tests = Vec::new();
        for item in i.list() {
            let Some(lit) = item.downcast_ref::<Literal>() else {
                return unsupported("IN list of non-literals");
            };
            if lit.value().is_null() {
                return unsupported("IN list with NULL");
            }
            let l = self.literal(lit.value())?;
            let eq = self.compare(Operator::Eq, &x, &l)?;
            tests.push(eq.v);
        }
        let (v, k) = self.fresh();
        let any = if tests.is_empty() {
            "false".to_string()
        } else {
            tests.join(" || ")
        };
        let not = if i.negated() { "!" } else { "" };
        self.line(format!("bool {k} = {}; bool {v} = {k} && {not}({any});", x.k));
        Ok(Val {
            v,
            k,
            len: None,
            dt: DataType::Boolean,
        })
    }

    fn like(&mut self, l: &LikeExpr) -> Result<Val> {
        if l.case_insensitive() {
            return unsupported("ILIKE");
        }
        let Some(pattern) = l.pattern().downcast_ref::<Literal>() else {
            return unsupported("LIKE with a pattern that is not a literal");
        };
        let pattern = match pattern.value() {
            ScalarValue::Utf8(Some(p)) | ScalarValue::LargeUtf8(Some(p)) | ScalarValue::Utf8View(Some(p)) => p.clone(),
            other => return unsupported(format!("LIKE pattern {other:?}")),
        };
        if pattern.contains('\\') {
            return unsupported("LIKE pattern with escapes");
        }
        let x = self.compile(l.expr())?;
        let len = a_len(&x)?;
        let p = self.literal(&ScalarValue::Utf8(Some(pattern)))?;
        let (v, k) = self.fresh();
        let not = if l.negated() { "!" } else { "" };
        self.line(format!(
            "bool {k} = {}; bool {v} = {k} && {not}like_match({}, {len}, {}, {});",
            x.k,
            x.v,
            p.v,
            p.len.as_ref().expect("string")
        ));
        Ok(Val {
            v,
            k,
            len: None,
            dt: DataType::Boolean,
        })
    }

    fn function(&mut self, f: &ScalarFunctionExpr, dt: &DataType) -> Result<Val> {
        match f.name() {
            "date_part" | "extract" => {
                let [part, arg] = f.args() else {
                    return unsupported("date_part arity");
                };
                let part = match part.downcast_ref::<Literal>().map(|l| l.value()) {
                    Some(ScalarValue::Utf8(Some(p))) | Some(ScalarValue::Utf8View(Some(p))) => p.to_ascii_lowercase(),
                    _ => return unsupported("date_part of a non-literal part"),
                };
                let x = self.compile(arg)?;
                if x.dt != DataType::Date32 || !matches!(part.as_str(), "year" | "month") {
                    return unsupported(format!("date_part('{part}', {})", x.dt));
                }
                let (v, k) = self.fresh();
                let ty = c_type(dt).map_or_else(|| unsupported(dt), Ok)?;
                let pick = if part == "year" { "y" } else { "m" };
                self.line(format!(
                    "bool {k} = {}; long long {v}_y = 0, {v}_m = 0; civil_from_days({}, &{v}_y, &{v}_m); \
                     {ty} {v} = ({ty}){v}_{pick};",
                    x.k, x.v
                ));
                if !matches!(dt, DataType::Int32 | DataType::Int64 | DataType::Float64) {
                    return unsupported(format!("date_part returning {dt}"));
                }
                Ok(Val {
                    v,
                    k,
                    len: None,
                    dt: dt.clone(),
                })
            }
            "substr" | "substring" => self.substr(f, dt),
            "abs" => {
                let [arg] = f.args() else {
                    return unsupported("abs arity");
                };
                let a = self.compile(arg)?;
                if &a.dt != dt {
                    return unsupported(format!("abs of {} -> {dt}", a.dt));
                }
                let x = &a.v;
                use DataType::*;
                let expr = match dt {
                    // checked_abs: the minimum is an error.
                    Int8 | Int16 | Int32 | Int64 => {
                        let min = match dt {
                            Int8 => "-128LL",
                            Int16 => "-32768LL",
                            Int32 => "(-2147483647LL - 1)",
                            _ => "(-9223372036854775807LL - 1)",
                        };
                        self.line(format!("if ({} && {x} == {min}) ovf = true;", a.k));
                        format!("{x} == {min} ? {x} : ({x} < 0 ? -{x} : {x})")
                    }
                    UInt8 | UInt16 | UInt32 => x.clone(),
                    // wrapping_abs: no error, no precision check.
                    Decimal128(..) => format!("{x} < 0 ? (i128)((unsigned __int128)0 - (unsigned __int128){x}) : {x}"),
                    Float64 => format!("__longlong_as_double(__double_as_longlong({x}) & 0x7fffffffffffffffLL)"),
                    Float32 => format!("__int_as_float(__float_as_int({x}) & 0x7fffffff)"),
                    other => return unsupported(format!("abs of {other}")),
                };
                let ty = c_type(dt).map_or_else(|| unsupported(dt), Ok)?;
                let (v, k) = self.fresh();
                self.line(format!("bool {k} = {}; {ty} {v} = {expr};", a.k));
                Ok(Val {
                    v,
                    k,
                    len: None,
                    dt: dt.clone(),
                })
            }
            "nullif" => {
                let [l, r] = f.args() else {
                    return unsupported("nullif arity");
                };
                let a = self.compile(l)?;
                let b = self.compile(r)?;
                // Floats compare with arrow's total order in `nullif`, not with the compiler's.
                if &a.dt != dt || a.dt != b.dt || matches!(a.dt, DataType::Float32 | DataType::Float64) {
                    return unsupported(format!("nullif({}, {})", a.dt, b.dt));
                }
                let eq = self.compare(Operator::Eq, &a, &b)?;
                let (v, k) = self.fresh();
                let ty = c_type(dt).map_or_else(|| unsupported(dt), Ok)?;
                let mut line = format!("bool {k} = {} && !({} && {}); {ty} {v} = {};", a.k, eq.k, eq.v, a.v);
                let len = match &a.len {
                    Some(al) => {
                        line.push_str(&format!(" u64 {v}_len = {al};"));
                        Some(format!("{v}_len"))
                    }
                    None => None,
                };
                self.line(line);
                Ok(Val {
                    v,
                    k,
                    len,
                    dt: dt.clone(),
                })
            }
            other => unsupported(format!("function {other}")),
        }
    }

    /// DataFusion's `substr(s, start[, count])` with literal `start` and `count`: 1-based
    /// character positions; a start before 1 shortens the count; a negative count is an error
    /// (left to DataFusion).
    fn substr(&mut self, f: &ScalarFunctionExpr, dt: &DataType) -> Result<Val> {
        let (s, start, count) = match f.args() {
            [s, start] => (s, start, None),
            [s, start, count] => (s, start, Some(count)),
            _ => return unsupported("substr arity"),
        };
        let start = int_literal(start)?;
        let count = count.map(int_literal).transpose()?;
        if count.is_some_and(|c| c < 0) {
            return unsupported("substr with a negative count");
        }
        let Some((from, to)) = substr_range(start, count) else {
            return unsupported("substr start overflow");
        };
        let a = self.compile(s)?;
        if !is_string(&a.dt) || &a.dt != dt {
            return unsupported(format!("substr of {} -> {dt}", a.dt));
        }
        let len = a_len(&a)?;
        let int = |x: i64| {
            let mut b = [0u8; 16];
            b[..8].copy_from_slice(&x.to_le_bytes());
            b
        };
        let (fs, ts) = (self.g.slot(int(from)), self.g.slot(int(to)));
        let (v, k) = self.fresh();
        let l = format!("{v}_len");
        self.line(format!(
            "bool {k} = {}; const unsigned char* {v} = 0; u64 {l} = 0; \
             if ({k}) {{ u64 o = 0; utf8_substr({}, {len}, *(const long long*)(lit + {fs}), \
             *(const long long*)(lit + {ts}), &o, &{l}); {v} = {} + o; }}",
            a.k, a.v, a.v
        ));
        Ok(Val {
            v,
            k,
            len: Some(l),
            dt: dt.clone(),
        })
    }
}

/// The character positions `[from, to)` that `substr(s, start, count)` keeps (`to` -1: the end),
/// clamped at 0 as DataFusion clamps them; `None` when `start - 1` overflows.
pub(crate) fn substr_range(start: i64, count: Option<i64>) -> Option<(i64, i64)> {
    let start0 = start.checked_sub(1)?;
    Some((start0.max(0), count.map_or(-1, |c| start0.saturating_add(c).max(0))))
}

/// The value of an integer literal (a function's argument).
pub(crate) fn int_literal(e: &Arc<dyn PhysicalExpr>) -> Result<i64> {
    match e.downcast_ref::<Literal>().map(|l| l.value()) {
        Some(ScalarValue::Int64(Some(x))) => Ok(*x),
        Some(ScalarValue::Int32(Some(x))) => Ok(*x as i64),
        Some(ScalarValue::Int16(Some(x))) => Ok(*x as i64),
        Some(ScalarValue::Int8(Some(x))) => Ok(*x as i64),
        _ => unsupported(format!("{e} is not an integer literal")),
    }
}

/// An interval literal as (months, days, whole days of its time part), or `None` when `e` is not
/// an interval literal; a time part that is not whole days, or a huge interval, is unsupported.
fn interval_literal(e: &Arc<dyn PhysicalExpr>) -> Option<Result<(i64, i64, i64)>> {
    const DAY_MS: i64 = 86_400_000;
    const DAY_NS: i64 = 86_400_000_000_000;
    let value = e.downcast_ref::<Literal>()?.value();
    let parts = match value {
        ScalarValue::IntervalYearMonth(Some(m)) => (*m as i64, 0, 0, true),
        ScalarValue::IntervalDayTime(Some(d)) => (
            0,
            d.days as i64,
            d.milliseconds as i64 / DAY_MS,
            d.milliseconds as i64 % DAY_MS == 0,
        ),
        ScalarValue::IntervalMonthDayNano(Some(i)) => (
            i.months as i64,
            i.days as i64,
            i.nanoseconds / DAY_NS,
            i.nanoseconds % DAY_NS == 0,
        ),
        ScalarValue::IntervalYearMonth(None)
        | ScalarValue::IntervalDayTime(None)
        | ScalarValue::IntervalMonthDayNano(None) => return Some(unsupported("a null interval")),
        _ => return None,
    };
    let (months, days, days2, whole) = parts;
    Some(if !whole {
        unsupported("an interval with a time part that is not whole days")
    } else if months.abs() > 1_000_000 || days.abs() > 100_000_000 || days2.abs() > 100_000_000 {
        unsupported("an interval beyond a million months or 10^8 days")
    } else {
        Ok((months, days, days2))
    })
}

fn a_len(v: &Val) -> Result<String> {
    v.len
        .clone()
        .map_or_else(|| unsupported(format!("{} is not a string", v.dt)), Ok)
}

fn arith_c(op: Operator) -> &'static str {
    match op {
        Operator::Plus => "+",
        Operator::Minus => "-",
        Operator::Multiply => "*",
        Operator::Divide => "/",
        _ => "%",
    }
}

/// The 16 bytes of a non-null, non-string literal in its slot of the literal buffer.
fn literal_bytes(value: &ScalarValue) -> Result<[u8; 16]> {
    let int = |x: i64| {
        let mut b = [0u8; 16];
        b[..8].copy_from_slice(&x.to_le_bytes());
        b
    };
    Ok(match value {
        ScalarValue::Int8(Some(x)) => int(*x as i64),
        ScalarValue::Int16(Some(x)) => int(*x as i64),
        ScalarValue::Int32(Some(x)) | ScalarValue::Date32(Some(x)) => int(*x as i64),
        ScalarValue::Int64(Some(x)) | ScalarValue::Date64(Some(x)) => int(*x),
        ScalarValue::UInt8(Some(x)) => int(*x as i64),
        ScalarValue::UInt16(Some(x)) => int(*x as i64),
        ScalarValue::UInt32(Some(x)) => int(*x as i64),
        ScalarValue::Boolean(Some(x)) => int(*x as i64),
        ScalarValue::Float32(Some(x)) => int(x.to_bits() as i64),
        ScalarValue::Float64(Some(x)) => int(x.to_bits() as i64),
        ScalarValue::Decimal128(Some(x), _, s) if *s >= 0 => x.to_le_bytes(),
        other => return unsupported(format!("literal {other:?}")),
    })
}

/// The C type of a literal of `dt` and the expression that reads it from `slot`.
fn literal_read(dt: &DataType, slot: usize) -> Result<(&'static str, String)> {
    use DataType::*;
    Ok(match dt {
        Float32 => (
            "float",
            format!("__int_as_float((int)*(const long long*)(lit + {slot}))"),
        ),
        Float64 => (
            "double",
            format!("__longlong_as_double(*(const long long*)(lit + {slot}))"),
        ),
        Boolean => ("bool", format!("*(const long long*)(lit + {slot}) != 0")),
        Decimal128(_, s) if *s >= 0 => ("i128", format!("*(const i128*)(lit + {slot})")),
        Int8 | Int16 | Int32 | Int64 | UInt8 | UInt16 | UInt32 | Date32 | Date64 => {
            ("long long", format!("*(const long long*)(lit + {slot})"))
        }
        other => return unsupported(format!("a literal of {other}")),
    })
}

/// `literals` (a stage's literal buffer) with the values of its late literals written in: the
/// scalar subqueries have run by the time a stage does.
pub(crate) fn late_literals(literals: &[u8], late: &[LateLiteral]) -> Result<Vec<u8>> {
    let mut out = literals.to_vec();
    for l in late {
        let empty = arrow_array::RecordBatch::new_empty(Arc::new(arrow_schema::Schema::empty()));
        let value = match l.expr.evaluate(&empty) {
            Ok(ColumnarValue::Scalar(v)) => v,
            Ok(ColumnarValue::Array(_)) => return unsupported("a scalar subquery of several values"),
            Err(e) => return Err(Error::InvalidData(format!("a scalar subquery's value: {e}"))),
        };
        if !value.is_null() {
            out[l.value..l.value + 16].copy_from_slice(&literal_bytes(&value)?);
            out[l.valid] = 1;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    //! The device helpers behind `substr` and date arithmetic, compiled as C++ on the host and
    //! compared with DataFusion's and arrow's own functions.

    use ::datafusion::functions::unicode::substr::get_true_start_end;
    use arrow_array::types::{Date32Type, IntervalMonthDayNano};

    use crate::datafusion::cuda_as_cpp;
    use crate::datafusion::predicate_codegen::PREDICATE_PRELUDE;

    const MAIN: &str = r#"
int main() {
    char kind[4];
    while (scanf("%3s", kind) == 1) {
        if (kind[0] == 'D') {
            long long date, months, days, days2; bool ovf = false;
            scanf("%lld %lld %lld %lld", &date, &months, &days, &days2);
            long long r = date_add_interval(date, months, days, days2, &ovf);
            printf("%lld %d\n", ovf ? 0 : r, ovf ? 1 : 0);
        } else {
            char hex[512]; long long from, to; unsigned char s[256]; u64 off = 0, len = 0;
            scanf("%511s %lld %lld", hex, &from, &to);
            u64 n = hex[0] == '-' ? 0 : strlen(hex) / 2;  // "-": the empty string
            for (u64 i = 0; i < n; i++) sscanf(hex + 2 * i, "%2hhx", &s[i]);
            utf8_substr(s, n, from, to, &off, &len);
            printf("%llu %llu\n", (unsigned long long)off, (unsigned long long)len);
        }
    }
    return 0;
}
"#;

    /// Runs the stage helpers with `MAIN` on `input`; `None` without a C++ compiler.
    fn run(name: &str, input: &str) -> Option<Vec<String>> {
        let cxx = cuda_as_cpp::compiler()?;
        let stage = include_str!("../kernels/stage.cu");
        let source = format!("{PREDICATE_PRELUDE}\n{stage}\n{MAIN}");
        Some(cuda_as_cpp::run(cxx, name, &source, input))
    }

    fn rng() -> impl FnMut() -> u64 {
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        }
    }

    #[test]
    fn date_add_interval_matches_arrow() {
        const DAY_NS: i64 = 86_400_000_000_000;
        let mut next = rng();
        let mut cases = Vec::new();
        let edges = [
            -96_465_292i64,
            95_026_236,
            -96_465_293,
            95_026_237,
            0,
            59,
            60,
            11_016,
            11_017,
        ];
        for i in 0..20_000 {
            let date = match i % 4 {
                0 => edges[(next() % edges.len() as u64) as usize] + (next() % 5) as i64 - 2,
                1 => (next() % 200_000_000) as i64 - 100_000_000,
                _ => (next() % 40_000) as i64 - 10_000,
            };
            let months = match i % 3 {
                0 => (next() % 2_000_001) as i64 - 1_000_000,
                _ => (next() % 61) as i64 - 30,
            };
            let days = if i % 5 == 0 { (next() % 2_000) as i64 - 1_000 } else { 0 };
            let days2 = if i % 7 == 0 { (next() % 100) as i64 - 50 } else { 0 };
            let minus = i % 2 == 1;
            cases.push((date, months, days, days2, minus));
        }
        let input: String = cases
            .iter()
            .map(|&(d, m, x, y, minus)| {
                let s = if minus { -1 } else { 1 };
                format!("D {d} {} {} {}\n", s * m, s * x, s * y)
            })
            .collect();
        let Some(got) = run("dates", &input) else {
            eprintln!("skipped: no C++ compiler");
            return;
        };
        assert_eq!(got.len(), cases.len());
        for (&(date, months, days, days2, minus), got) in cases.iter().zip(&got) {
            let delta = IntervalMonthDayNano::new(months as i32, days as i32, days2 * DAY_NS);
            let want = if minus {
                Date32Type::subtract_month_day_nano_opt(date as i32, delta)
            } else {
                Date32Type::add_month_day_nano_opt(date as i32, delta)
            };
            let want = match want {
                Some(d) => format!("{d} 0"),
                None => "0 1".to_string(),
            };
            assert_eq!(got, &want, "{date} {} {delta:?}", if minus { "-" } else { "+" });
        }
    }

    #[test]
    fn utf8_substr_matches_datafusion() {
        let words = [
            "",
            "a",
            "abc",
            "hello world",
            "é",
            "aé",
            "日本語テキスト",
            "🌏x🌏",
            "k1",
            "é-accent",
        ];
        let mut cases = Vec::new();
        for w in words {
            for start in [-3i64, -1, 0, 1, 2, 3, 5, 12, i64::MAX] {
                for count in [None, Some(0i64), Some(1), Some(2), Some(4), Some(100), Some(i64::MAX)] {
                    cases.push((w, start, count));
                }
            }
        }
        let input: String = cases
            .iter()
            .map(|&(w, start, count)| {
                let (from, to) = super::substr_range(start, count).unwrap();
                let hex: String = w.bytes().map(|b| format!("{b:02x}")).collect();
                let hex = if hex.is_empty() { "-".to_string() } else { hex };
                format!("S {hex} {from} {to}\n")
            })
            .collect();
        let Some(got) = run("substr", &input) else {
            eprintln!("skipped: no C++ compiler");
            return;
        };
        assert_eq!(got.len(), cases.len());
        for (&(w, start, count), got) in cases.iter().zip(&got) {
            let (a, b) = get_true_start_end(w, start, count, false).unwrap();
            assert_eq!(got, &format!("{a} {}", b - a), "substr({w:?}, {start}, {count:?})");
            if w.is_ascii() {
                assert_eq!(get_true_start_end(w, start, count, true).unwrap(), (a, b));
            }
        }
    }
}
