//! GPU tables and device stages in [Apache DataFusion Ballista](https://datafusion.apache.org/ballista/)
//! 55: a scheduler splits a query into stages, executors on GPU machines run them over GPU tables
//! that each stages itself.
//!
//! # How a query travels
//!
//! - The client sends its logical plan to the scheduler; a [`GpuTable`]
//!   in it travels as its [source](crate::datafusion::GpuTable::source) (files, format, format
//!   options, partition count, batch rows), never as device memory, through
//!   [`GpuLogicalCodec`]. A table staged from batches has no source and cannot travel (a planning
//!   error says so).
//! - The scheduler stages the table too (on its device: the CPU device where it has no GPU), plans
//!   the query with [`DeviceStageRule`] among its physical
//!   optimizer rules (placing stages whatever its own device), and splits the plan into Ballista
//!   stages at its shuffles.
//! - Each executor decodes its tasks' plans through [`GpuPhysicalCodec`]: a GPU scan names its
//!   table's source, and the executor stages that table once, on its own device, in its
//!   [`GpuTableCache`], where later tasks and queries find it; a device stage travels as the plan
//!   it replaced and is lowered again onto the executor's copy of the table, for its device (CUDA
//!   kernels on a GPU, the host implementation on a machine without one).
//!
//! Every process must see the table's files at the same paths (a shared file system, or the same
//! files copied to each machine). Both codecs wrap Ballista's own, so its shuffle nodes still
//! travel.
//!
//! # Sessions
//!
//! [`session_state`] makes the state of a client session (and, in standalone mode, of the
//! in-process scheduler and executor): Ballista's session config with both codecs, the cache in
//! its extensions, the device stage rule, and `CREATE EXTERNAL TABLE ... STORED AS GPU`
//! ([`with_gpu_tables`](crate::datafusion::with_gpu_tables)), whose tables go into the cache so
//! that a standalone executor does not stage them twice:
//!
//! ```no_run
//! # async fn run() -> datafusion::error::Result<()> {
//! use std::sync::Arc;
//! use arrow_cuda::ballista::{GpuTableCache, session_state};
//! use ballista::prelude::SessionContextExt;
//! use ballista::prelude::SessionConfigExt;
//! use datafusion::prelude::{SessionConfig, SessionContext};
//!
//! let cache = Arc::new(GpuTableCache::new(8 << 30));
//! let state = session_state(SessionConfig::new_with_ballista(), cache);
//! let ctx = SessionContext::standalone_with_state(state).await?;
//! ctx.sql("CREATE EXTERNAL TABLE lineitem STORED AS GPU LOCATION 'tpch/lineitem/'").await?;
//! ctx.sql("SELECT l_returnflag, count(*) FROM lineitem GROUP BY l_returnflag").await?.show().await?;
//! # Ok(())
//! # }
//! ```
//!
//! On a cluster, the scheduler and executor processes are programs of your own that start
//! Ballista's with [`scheduler_config`] and [`executor_config`] (see `docs/ballista.md`), and
//! clients connect with `SessionContext::remote_with_state(url, session_state(config, cache))`.
//!
//! The session config turns off Ballista's adaptive query planner (it re-plans stages with a rule
//! list of its own, without the device stage rule) and turns DataFusion's hash joins back on
//! (Ballista prefers sort-merge joins, which spill; a stage runs hash joins, and GPU tables are in
//! memory anyway).
//!
//! # What runs where
//!
//! Ballista runs each stage of its plan as tasks over shares of the stage's partitions, and
//! narrows each task's copy of the plan to its share by rewriting the scans it knows. It does not
//! know GPU scans and device stages, so the session's last physical optimizer rule puts each of
//! them under a node that Ballista can narrow:
//!
//! - A GPU scan over Parquet files, and a device stage over one whose plan works partition by
//!   partition (filters, projections, a partial aggregate), split their partitions between the
//!   tasks of their Ballista stage (`ShareExec` in `EXPLAIN`). A device stage that would finish
//!   such an aggregation itself (TPC-H Q1, Q6) is split in two first: a stage of the partial
//!   aggregate, shared so, and DataFusion's final aggregate after Ballista's shuffle. The
//!   executor of a task stages only that task's partitions of the table (the others are empty in
//!   its copy), so a table's partitions are split between the executors, each on its own device,
//!   and each keeps its share in its cache ([`GpuTableCache::tables`] lists them). Which rows make
//!   each partition is a function of the files, the batch rows and the partition count, the same
//!   on every executor.
//! - Any other GPU scan or device stage (a stage with joins, which reads their build sides whole;
//!   a table staged from CSV) runs in one task (`OneTaskExec`), on one executor, which stages
//!   every partition of the tables it reads (a copy of its own, beside any share it holds), and
//!   is repartitioned above as before: a hash repartitioning becomes Ballista's shuffle, which
//!   spreads the rows over the executors for the rest of the plan.

mod cache;
mod codec;
mod one_task;

use std::sync::Arc;

use ::datafusion::catalog::{Session, TableProvider, TableProviderFactory};
use ::datafusion::common::DataFusionError;
use ::datafusion::execution::{SessionState, SessionStateBuilder};
use ::datafusion::logical_expr::CreateExternalTable;
use ::datafusion::prelude::SessionConfig;
use async_trait::async_trait;
use ballista_core::extension::SessionConfigExt;
use ballista_executor::executor_process::ExecutorProcessConfig;
use ballista_scheduler::config::SchedulerConfig;

pub use cache::{CachedTable, GpuTableCache};
pub use codec::{GpuLogicalCodec, GpuPhysicalCodec};
use one_task::OneTaskRule;

use crate::datafusion::{DeviceStageRule, GPU_FILE_TYPE, GpuTable, GpuTableFactory, LoadOptions};

/// The state of a Ballista client session of `config` (`SessionConfig::new_with_ballista()`, with
/// settings of your own) with GPU tables and device stages, keeping its tables in `cache`: pass it
/// to `SessionContext::standalone_with_state` (which runs the scheduler and an executor in this
/// process, with this state and its cache) or `SessionContext::remote_with_state`.
pub fn session_state(config: SessionConfig, cache: Arc<GpuTableCache>) -> SessionState {
    state(session_config(config, cache))
}

/// `config` with what GPU tables need in Ballista: both codecs, `cache` in its extensions, the
/// adaptive planner off and hash joins on.
fn session_config(config: SessionConfig, cache: Arc<GpuTableCache>) -> SessionConfig {
    config
        .with_ballista_logical_extension_codec(Arc::new(GpuLogicalCodec::default()))
        .with_ballista_physical_extension_codec(Arc::new(GpuPhysicalCodec::default()))
        .with_ballista_adaptive_query_planner(false)
        .set_bool("datafusion.optimizer.prefer_hash_join", true)
        .with_extension(cache)
}

/// A session state of `config` with DataFusion's defaults, the device stage rule (placing stages
/// whatever this process's device: the executors lower them again for theirs) and GPU tables from
/// SQL, kept in the config's cache.
fn state(config: SessionConfig) -> SessionState {
    let rule = DeviceStageRule::new().with_host_stages(true);
    // `CREATE EXTERNAL TABLE` stages where the cache does, so that the cache keeps the table.
    let devices = config.get_extension::<GpuTableCache>().map(|c| c.devices());
    let options = LoadOptions::new().with_devices(devices.unwrap_or_default());
    let factory = CachedTableFactory {
        inner: GpuTableFactory::new(options),
    };
    SessionStateBuilder::new()
        .with_default_features()
        .with_config(config)
        .with_physical_optimizer_rule(Arc::new(rule))
        .with_physical_optimizer_rule(Arc::new(OneTaskRule))
        .with_table_factory(GPU_FILE_TYPE.to_string(), Arc::new(factory))
        .build()
}

/// `config` for a scheduler process that plans queries over GPU tables: sessions built by
/// [`session_state`]'s rules (their config from the client's settings), both codecs, and
/// `cache` for the tables it stages to plan them.
pub fn scheduler_config(mut config: SchedulerConfig, cache: Arc<GpuTableCache>) -> SchedulerConfig {
    let producer_cache = cache.clone();
    config.override_config_producer = Some(Arc::new(move || {
        session_config(SessionConfig::new_with_ballista(), producer_cache.clone())
    }));
    config.override_session_builder = Some(Arc::new(move |c| Ok(state(session_config(c, cache.clone())))));
    config.override_logical_codec = Some(Arc::new(GpuLogicalCodec::default()));
    config.override_physical_codec = Some(Arc::new(GpuPhysicalCodec::default()));
    config
}

/// `config` for an executor process that runs tasks over GPU tables, staging them in `cache`
/// (on the devices [`GpuTableCache::with_devices`] names, or its first GPU, or the CPU device on
/// a machine without one).
pub fn executor_config(mut config: ExecutorProcessConfig, cache: Arc<GpuTableCache>) -> ExecutorProcessConfig {
    config.override_config_producer = Some(Arc::new(move || {
        session_config(SessionConfig::new_with_ballista(), cache.clone())
    }));
    config.override_logical_codec = Some(Arc::new(GpuLogicalCodec::default()));
    config.override_physical_codec = Some(Arc::new(GpuPhysicalCodec::default()));
    config
}

/// [`GpuTableFactory`], keeping each table it stages in the session's [`GpuTableCache`], where
/// the plans that name the table's source find it.
#[derive(Debug)]
struct CachedTableFactory {
    inner: GpuTableFactory,
}

#[async_trait]
impl TableProviderFactory for CachedTableFactory {
    async fn create(
        &self,
        state: &dyn Session,
        cmd: &CreateExternalTable,
    ) -> Result<Arc<dyn TableProvider>, DataFusionError> {
        let table = self.inner.create(state, cmd).await?;
        if let Some(gpu) = table.downcast_ref::<GpuTable>() {
            GpuTableCache::of_config(state.config())?.insert(gpu)?;
        }
        Ok(table)
    }
}
