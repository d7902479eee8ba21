//! Joins that keep rows without a match on their build side (left and full outer joins) or mark
//! rows by whether they have one (mark joins), as two joins whose rows together are the join's:
//! the matched rows, and the rows without a match, by an anti join. A stage's joins keep (or
//! drop) only the rows of the side it scans, so each half becomes a stage of its own: the first
//! scans the probe side, the second the build side and hashes the probe side. Their partial
//! aggregates' states (or rows) are the join's, unioned.
//!
//! | join | matched rows | rows without a match |
//! |---|---|---|
//! | left outer | inner join | left anti join, the right columns null |
//! | full outer | right outer join | left anti join, the right columns null |
//! | left mark | left semi join, mark `true` | left anti join, mark `false` |
//! | right mark | right semi join, mark `true` | right anti join, mark `false` |
//!
//! (DataFusion's mark joins never mark `NULL`: the mark is whether a match exists.)

use std::sync::Arc;

use ::datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use ::datafusion::common::{JoinType, ScalarValue};
use ::datafusion::physical_expr::PhysicalExpr;
use ::datafusion::physical_expr::expressions::{Column, Literal};
use ::datafusion::physical_plan::ExecutionPlan;
use ::datafusion::physical_plan::joins::HashJoinExec;
use ::datafusion::physical_plan::projection::ProjectionExec;

use super::super::error::DfResult;

/// The first join under `plan` that keeps or marks rows without a match, and `plan` with it
/// replaced by each of its two halves (matched rows, then rows without a match).
pub(super) fn split(plan: &Arc<dyn ExecutionPlan>) -> Result<[Arc<dyn ExecutionPlan>; 2], String> {
    let mut found = None;
    plan.apply(|node| {
        if let Some(j) = node.downcast_ref::<HashJoinExec>()
            && matches!(
                j.join_type(),
                JoinType::Left | JoinType::Full | JoinType::LeftMark | JoinType::RightMark
            )
        {
            found = Some(node.clone());
            return Ok(TreeNodeRecursion::Stop);
        }
        Ok(TreeNodeRecursion::Continue)
    })
    .map_err(|e| e.to_string())?;
    let node = found.ok_or("no outer or mark join")?;
    let j = node.downcast_ref::<HashJoinExec>().expect("a hash join");
    if j.null_aware || j.fetch().is_some() {
        return Err("a null-aware join or a join with a limit".into());
    }
    let [matched, unmatched] = halves(j).map_err(|e| e.to_string())?;
    let replaced = |half: Arc<dyn ExecutionPlan>| -> Result<Arc<dyn ExecutionPlan>, String> {
        let out = plan
            .clone()
            .transform_down(|n| {
                Ok(if Arc::ptr_eq(&n, &node) {
                    Transformed::new(half.clone(), true, TreeNodeRecursion::Jump)
                } else {
                    Transformed::no(n)
                })
            })
            .map_err(|e| e.to_string())?;
        Ok(out.data)
    };
    Ok([replaced(matched)?, replaced(unmatched)?])
}

/// The two halves of `j` (see the [module docs](self)), each with `j`'s output schema.
fn halves(j: &HashJoinExec) -> DfResult<[Arc<dyn ExecutionPlan>; 2]> {
    let like = |join_type: JoinType, projection: Option<Vec<usize>>| -> DfResult<Arc<dyn ExecutionPlan>> {
        Ok(Arc::new(HashJoinExec::try_new(
            j.left().clone(),
            j.right().clone(),
            j.on().to_vec(),
            j.filter().cloned(),
            &join_type,
            projection,
            *j.partition_mode(),
            j.null_equality(),
            false,
        )?))
    };
    // The join's columns before its projection: the side it keeps, then the other side's or the mark.
    let all = like(*j.join_type(), None)?.schema();
    let kept = match j.join_type() {
        JoinType::RightMark => j.right().schema(),
        _ => j.left().schema(),
    };
    // `base` (the kept side's rows) padded to the join's columns: the other side's columns null
    // or the mark, then the join's projection.
    let padded = |base: Arc<dyn ExecutionPlan>, mark: bool| -> DfResult<Arc<dyn ExecutionPlan>> {
        let exprs: Vec<(Arc<dyn PhysicalExpr>, String)> = all
            .fields()
            .iter()
            .enumerate()
            .map(|(i, f)| {
                let e: Arc<dyn PhysicalExpr> = if i < kept.fields().len() {
                    Arc::new(Column::new(f.name(), i))
                } else if matches!(j.join_type(), JoinType::LeftMark | JoinType::RightMark) {
                    Arc::new(Literal::new(ScalarValue::Boolean(Some(mark))))
                } else {
                    Arc::new(Literal::new(ScalarValue::try_from(f.data_type())?))
                };
                Ok((e, f.name().clone()))
            })
            .collect::<DfResult<_>>()?;
        let exprs = match &j.projection {
            Some(p) => p.iter().map(|&i| exprs[i].clone()).collect(),
            None => exprs,
        };
        Ok(Arc::new(ProjectionExec::try_new(exprs, base)?))
    };
    let projection = j.projection.as_deref().map(<[usize]>::to_vec);
    Ok(match j.join_type() {
        JoinType::Left => [
            like(JoinType::Inner, projection)?,
            padded(like(JoinType::LeftAnti, None)?, false)?,
        ],
        JoinType::Full => [
            like(JoinType::Right, projection)?,
            padded(like(JoinType::LeftAnti, None)?, false)?,
        ],
        JoinType::LeftMark => [
            padded(like(JoinType::LeftSemi, None)?, true)?,
            padded(like(JoinType::LeftAnti, None)?, false)?,
        ],
        JoinType::RightMark => [
            padded(like(JoinType::RightSemi, None)?, true)?,
            padded(like(JoinType::RightAnti, None)?, false)?,
        ],
        other => {
            return Err(::datafusion::common::DataFusionError::Internal(format!(
                "no halves of a {other} join"
            )));
        }
    })
}
