//! Predicates a GPU table evaluates itself: recognised from DataFusion logical expressions, and
//! evaluated on the host with arrow-rs kernels (the CPU device) or turned into CUDA C
//! (`super::predicate_codegen`).

use std::collections::BTreeSet;
use std::sync::Arc;

use ::datafusion::common::ScalarValue;
use ::datafusion::common::utils::{normalize_float_zero, normalize_float_zero_scalar};
use ::datafusion::logical_expr::{Between, BinaryExpr, Expr, Like, Operator};
use ::datafusion::physical_expr::PhysicalExpr;
use ::datafusion::physical_expr::expressions::{self as phys, Column, IsNotNullExpr, IsNullExpr, Literal, NotExpr};
use arrow_array::{Array, ArrayRef, BooleanArray, RecordBatch, Scalar};
use arrow_schema::{ArrowError, DataType, Schema};

/// A comparison operator, with the column on the left.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum CmpOp {
    Eq,
    NotEq,
    Lt,
    LtEq,
    Gt,
    GtEq,
}

impl CmpOp {
    fn from_operator(op: Operator) -> Option<CmpOp> {
        Some(match op {
            Operator::Eq => CmpOp::Eq,
            Operator::NotEq => CmpOp::NotEq,
            Operator::Lt => CmpOp::Lt,
            Operator::LtEq => CmpOp::LtEq,
            Operator::Gt => CmpOp::Gt,
            Operator::GtEq => CmpOp::GtEq,
            _ => return None,
        })
    }

    /// The operator with its operands swapped (`5 < a` is `a > 5`).
    fn swapped(self) -> CmpOp {
        match self {
            CmpOp::Lt => CmpOp::Gt,
            CmpOp::LtEq => CmpOp::GtEq,
            CmpOp::Gt => CmpOp::Lt,
            CmpOp::GtEq => CmpOp::LtEq,
            other => other,
        }
    }

    /// The C operator.
    pub(crate) fn c(self) -> &'static str {
        match self {
            CmpOp::Eq => "==",
            CmpOp::NotEq => "!=",
            CmpOp::Lt => "<",
            CmpOp::LtEq => "<=",
            CmpOp::Gt => ">",
            CmpOp::GtEq => ">=",
        }
    }
}

/// A predicate over the columns of a table (indices into the table's schema), with SQL's
/// three-valued logic.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Predicate {
    And(Box<Predicate>, Box<Predicate>),
    Or(Box<Predicate>, Box<Predicate>),
    Not(Box<Predicate>),
    /// `column op literal`; the literal has the column's type and is not null.
    Cmp {
        col: usize,
        op: CmpOp,
        lit: ScalarValue,
    },
    /// `column IN (literals)`; the literals have the column's type and are not null.
    InList {
        col: usize,
        list: Vec<ScalarValue>,
    },
    /// `column IS NULL`.
    IsNull {
        col: usize,
    },
    /// `starts_with(column, prefix)` on a string column.
    StartsWith {
        col: usize,
        prefix: String,
    },
    /// `column LIKE pattern` on a string column: `%` any characters, `_` one, no escapes.
    Like {
        col: usize,
        pattern: String,
    },
    /// A boolean column on its own.
    Column {
        col: usize,
    },
}

/// Whether a GPU table over `schema` evaluates `expr` completely (and so reports it `Exact`).
pub fn supports_filter(expr: &Expr, schema: &Schema) -> bool {
    Predicate::from_expr(expr, schema).is_some()
}

/// The kind of column types, as far as predicates care.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// Integers, floats, decimals, dates, timestamps, booleans: every comparison.
    Ordered,
    /// Strings: equality and prefix matches.
    String,
}

fn kind(dt: &DataType) -> Option<Kind> {
    use DataType::*;
    match dt {
        Int8 | Int16 | Int32 | Int64 | UInt8 | UInt16 | UInt32 | UInt64 | Float32 | Float64 | Decimal128(..)
        | Date32 | Date64 | Timestamp(..) | Boolean => Some(Kind::Ordered),
        Utf8 | LargeUtf8 | Utf8View => Some(Kind::String),
        _ => None,
    }
}

/// The literal as a non-null value of `dt`, when it converts there and back unchanged.
fn coerce(lit: &ScalarValue, dt: &DataType) -> Option<ScalarValue> {
    if lit.is_null() {
        return None;
    }
    if &lit.data_type() == dt {
        return Some(lit.clone());
    }
    let cast = lit.cast_to(dt).ok()?;
    if cast.is_null() {
        return None;
    }
    let back = cast.cast_to(&lit.data_type()).ok()?;
    (&back == lit).then_some(cast)
}

fn physical_literal(e: &Arc<dyn PhysicalExpr>) -> Option<&ScalarValue> {
    e.downcast_ref::<Literal>().map(Literal::value)
}

fn literal(e: &Expr) -> Option<&ScalarValue> {
    match e {
        Expr::Literal(v, _) => Some(v),
        _ => None,
    }
}

impl Predicate {
    /// Recognises `expr`, or `None` when the device cannot evaluate it completely.
    pub(crate) fn from_expr(expr: &Expr, schema: &Schema) -> Option<Predicate> {
        let column = |e: &Expr| -> Option<(usize, &DataType, Kind)> {
            let Expr::Column(c) = e else {
                return None;
            };
            let i = schema.index_of(&c.name).ok()?;
            let dt = schema.field(i).data_type();
            Some((i, dt, kind(dt)?))
        };
        match expr {
            Expr::BinaryExpr(BinaryExpr { left, op, right }) => match op {
                Operator::And | Operator::Or => {
                    let l = Box::new(Self::from_expr(left, schema)?);
                    let r = Box::new(Self::from_expr(right, schema)?);
                    Some(if *op == Operator::And {
                        Predicate::And(l, r)
                    } else {
                        Predicate::Or(l, r)
                    })
                }
                _ => {
                    let cmp = CmpOp::from_operator(*op)?;
                    let (col, lit, cmp) = match (column(left), literal(right), column(right), literal(left)) {
                        (Some(c), Some(l), _, _) => (c, l, cmp),
                        (_, _, Some(c), Some(l)) => (c, l, cmp.swapped()),
                        _ => return None,
                    };
                    let (i, dt, k) = col;
                    if k == Kind::String && !matches!(cmp, CmpOp::Eq | CmpOp::NotEq) {
                        return None;
                    }
                    Some(Predicate::Cmp {
                        col: i,
                        op: cmp,
                        lit: coerce(lit, dt)?,
                    })
                }
            },
            Expr::Not(e) => Some(Predicate::Not(Box::new(Self::from_expr(e, schema)?))),
            Expr::IsNull(e) => Some(Predicate::IsNull { col: column(e)?.0 }),
            Expr::IsNotNull(e) => Some(Predicate::Not(Box::new(Predicate::IsNull { col: column(e)?.0 }))),
            Expr::Between(Between {
                expr,
                negated,
                low,
                high,
            }) => {
                let (i, dt, k) = column(expr)?;
                if k != Kind::Ordered {
                    return None;
                }
                let lo = coerce(literal(low)?, dt)?;
                let hi = coerce(literal(high)?, dt)?;
                let p = Predicate::And(
                    Box::new(Predicate::Cmp {
                        col: i,
                        op: CmpOp::GtEq,
                        lit: lo,
                    }),
                    Box::new(Predicate::Cmp {
                        col: i,
                        op: CmpOp::LtEq,
                        lit: hi,
                    }),
                );
                Some(if *negated { Predicate::Not(Box::new(p)) } else { p })
            }
            Expr::InList(l) => {
                let (i, dt, _) = column(&l.expr)?;
                // DataFusion's IN on floats does not treat -0.0 as 0.0 the way its comparisons
                // do; those lists stay with DataFusion.
                if l.list.is_empty() || matches!(dt, DataType::Float32 | DataType::Float64) {
                    return None;
                }
                let list = l
                    .list
                    .iter()
                    .map(|e| coerce(literal(e)?, dt))
                    .collect::<Option<Vec<_>>>()?;
                let p = Predicate::InList { col: i, list };
                Some(if l.negated { Predicate::Not(Box::new(p)) } else { p })
            }
            Expr::Like(Like {
                negated,
                expr,
                pattern,
                escape_char,
                case_insensitive,
            }) => {
                if *case_insensitive || escape_char.is_some_and(|c| c != '\\') {
                    return None;
                }
                let (i, _, k) = column(expr)?;
                if k != Kind::String {
                    return None;
                }
                let pattern = match literal(pattern)? {
                    ScalarValue::Utf8(Some(s)) | ScalarValue::LargeUtf8(Some(s)) | ScalarValue::Utf8View(Some(s)) => s,
                    _ => return None,
                };
                if pattern.contains('\\') {
                    return None;
                }
                let p = match pattern.strip_suffix('%') {
                    Some(prefix) if !prefix.contains(['%', '_']) => Predicate::StartsWith {
                        col: i,
                        prefix: prefix.to_string(),
                    },
                    _ => Predicate::Like {
                        col: i,
                        pattern: pattern.clone(),
                    },
                };
                Some(if *negated { Predicate::Not(Box::new(p)) } else { p })
            }
            Expr::ScalarFunction(f) if f.name() == "starts_with" && f.args.len() == 2 => {
                let (i, _, k) = column(&f.args[0])?;
                if k != Kind::String {
                    return None;
                }
                let prefix = match literal(&f.args[1])? {
                    ScalarValue::Utf8(Some(s)) | ScalarValue::LargeUtf8(Some(s)) | ScalarValue::Utf8View(Some(s)) => s,
                    _ => return None,
                };
                Some(Predicate::StartsWith {
                    col: i,
                    prefix: prefix.clone(),
                })
            }
            Expr::Column(_) => {
                let (i, dt, _) = column(expr)?;
                (dt == &DataType::Boolean).then_some(Predicate::Column { col: i })
            }
            _ => None,
        }
    }

    /// Recognises a physical expression over the columns of `schema` (comparisons of a column
    /// with a literal, `AND`, `OR`, `NOT`, `IS [NOT] NULL`), or `None` when it is anything else.
    pub(crate) fn from_physical(expr: &Arc<dyn PhysicalExpr>, schema: &Schema) -> Option<Predicate> {
        let column = |e: &Arc<dyn PhysicalExpr>| -> Option<(usize, &DataType, Kind)> {
            let c = e.downcast_ref::<Column>()?;
            let dt = schema.fields().get(c.index())?.data_type();
            Some((c.index(), dt, kind(dt)?))
        };
        if let Some(b) = expr.downcast_ref::<phys::BinaryExpr>() {
            let (left, right) = (b.left(), b.right());
            return match b.op() {
                Operator::And | Operator::Or => {
                    let l = Box::new(Self::from_physical(left, schema)?);
                    let r = Box::new(Self::from_physical(right, schema)?);
                    Some(if *b.op() == Operator::And {
                        Predicate::And(l, r)
                    } else {
                        Predicate::Or(l, r)
                    })
                }
                op => {
                    let cmp = CmpOp::from_operator(*op)?;
                    let ((col, dt, k), lit, op) = match (
                        column(left),
                        physical_literal(right),
                        column(right),
                        physical_literal(left),
                    ) {
                        (Some(c), Some(l), _, _) => (c, l, cmp),
                        (_, _, Some(c), Some(l)) => (c, l, cmp.swapped()),
                        _ => return None,
                    };
                    if k == Kind::String && !matches!(op, CmpOp::Eq | CmpOp::NotEq) {
                        return None;
                    }
                    Some(Predicate::Cmp {
                        col,
                        op,
                        lit: coerce(lit, dt)?,
                    })
                }
            };
        }
        if let Some(n) = expr.downcast_ref::<NotExpr>() {
            return Some(Predicate::Not(Box::new(Self::from_physical(n.arg(), schema)?)));
        }
        if let Some(n) = expr.downcast_ref::<IsNullExpr>() {
            return Some(Predicate::IsNull {
                col: column(n.arg())?.0,
            });
        }
        if let Some(n) = expr.downcast_ref::<IsNotNullExpr>() {
            let col = column(n.arg())?.0;
            return Some(Predicate::Not(Box::new(Predicate::IsNull { col })));
        }
        None
    }

    /// Joins predicates with `AND` (`None` for none).
    pub(crate) fn conjunction(ps: Vec<Predicate>) -> Option<Predicate> {
        ps.into_iter().reduce(|a, b| Predicate::And(Box::new(a), Box::new(b)))
    }

    /// The predicate with each column `c` replaced by `at(c)`.
    pub(crate) fn remapped(&self, at: &dyn Fn(usize) -> usize) -> Predicate {
        let boxed = |p: &Predicate| Box::new(p.remapped(at));
        match self {
            Predicate::And(a, b) => Predicate::And(boxed(a), boxed(b)),
            Predicate::Or(a, b) => Predicate::Or(boxed(a), boxed(b)),
            Predicate::Not(a) => Predicate::Not(boxed(a)),
            Predicate::Cmp { col, op, lit } => Predicate::Cmp {
                col: at(*col),
                op: *op,
                lit: lit.clone(),
            },
            Predicate::InList { col, list } => Predicate::InList {
                col: at(*col),
                list: list.clone(),
            },
            Predicate::IsNull { col } => Predicate::IsNull { col: at(*col) },
            Predicate::StartsWith { col, prefix } => Predicate::StartsWith {
                col: at(*col),
                prefix: prefix.clone(),
            },
            Predicate::Like { col, pattern } => Predicate::Like {
                col: at(*col),
                pattern: pattern.clone(),
            },
            Predicate::Column { col } => Predicate::Column { col: at(*col) },
        }
    }

    /// The table columns the predicate reads.
    pub(crate) fn columns(&self, out: &mut BTreeSet<usize>) {
        match self {
            Predicate::And(a, b) | Predicate::Or(a, b) => {
                a.columns(out);
                b.columns(out);
            }
            Predicate::Not(a) => a.columns(out),
            Predicate::Cmp { col, .. }
            | Predicate::InList { col, .. }
            | Predicate::IsNull { col }
            | Predicate::StartsWith { col, .. }
            | Predicate::Like { col, .. }
            | Predicate::Column { col } => {
                out.insert(*col);
            }
        }
    }

    /// Evaluates the predicate over a host batch whose column `position(c)` holds table column
    /// `c`; the result is null where SQL's answer is unknown.
    pub(crate) fn evaluate(
        &self,
        batch: &RecordBatch,
        position: &dyn Fn(usize) -> usize,
    ) -> Result<BooleanArray, ArrowError> {
        let column = |c: usize| -> &ArrayRef { batch.column(position(c)) };
        let scalar = |v: &ScalarValue| -> Result<Scalar<ArrayRef>, ArrowError> {
            v.to_scalar().map_err(|e| ArrowError::ComputeError(e.to_string()))
        };
        match self {
            Predicate::And(a, b) => {
                arrow_arith::boolean::and_kleene(&a.evaluate(batch, position)?, &b.evaluate(batch, position)?)
            }
            Predicate::Or(a, b) => {
                arrow_arith::boolean::or_kleene(&a.evaluate(batch, position)?, &b.evaluate(batch, position)?)
            }
            Predicate::Not(a) => arrow_arith::boolean::not(&a.evaluate(batch, position)?),
            Predicate::Cmp { col, op, lit } => {
                // As DataFusion compares: floats in arrow's total order once -0.0 is made +0.0.
                let a = &normalize_float_zero(column(*col));
                let s = scalar(&normalize_float_zero_scalar(lit.clone()))?;
                use arrow_ord::cmp;
                match op {
                    CmpOp::Eq => cmp::eq(a, &s),
                    CmpOp::NotEq => cmp::neq(a, &s),
                    CmpOp::Lt => cmp::lt(a, &s),
                    CmpOp::LtEq => cmp::lt_eq(a, &s),
                    CmpOp::Gt => cmp::gt(a, &s),
                    CmpOp::GtEq => cmp::gt_eq(a, &s),
                }
            }
            Predicate::InList { col, list } => {
                let a = column(*col);
                let mut acc: Option<BooleanArray> = None;
                for v in list {
                    let e = arrow_ord::cmp::eq(a, &scalar(v)?)?;
                    acc = Some(match acc {
                        None => e,
                        Some(prev) => arrow_arith::boolean::or_kleene(&prev, &e)?,
                    });
                }
                acc.ok_or_else(|| ArrowError::ComputeError("empty IN list".into()))
            }
            Predicate::IsNull { col } => arrow_arith::boolean::is_null(column(*col).as_ref()),
            Predicate::StartsWith { col: c, prefix: p } | Predicate::Like { col: c, pattern: p } => {
                let a = column(*c);
                let p = ScalarValue::Utf8(Some(p.clone()))
                    .cast_to(a.data_type())
                    .map_err(|e| ArrowError::ComputeError(e.to_string()))?;
                if matches!(self, Predicate::Like { .. }) {
                    arrow_string::like::like(a, &scalar(&p)?)
                } else {
                    arrow_string::like::starts_with(a, &scalar(&p)?)
                }
            }
            Predicate::Column { col } => {
                let a = column(*col);
                a.as_any()
                    .downcast_ref::<BooleanArray>()
                    .cloned()
                    .ok_or_else(|| ArrowError::ComputeError(format!("column {col} is not boolean")))
            }
        }
    }
}
