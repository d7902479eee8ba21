//! Device stages; see the [`datafusion`](super) module docs for what they run and where the rule sits.

mod build;
mod codegen;
mod device;
mod emit;
mod exec;
mod expr;
mod host;
mod layout;
mod narrow;
mod outcome;
mod outer;
mod output;
mod rule;
#[cfg(test)]
mod tests;

pub use exec::DeviceStageExec;
pub(crate) use outcome::{Outcome, StageResult};
pub use rule::{DeviceStageRule, with_device_stages};
