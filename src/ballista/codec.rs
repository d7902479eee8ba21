//! The codecs that carry GPU tables and device stages through Ballista's plans: a table travels
//! as its source, a stage as the plan it replaced, and each process stages its own copy.

use std::collections::BTreeMap;
use std::sync::Arc;

use ::datafusion::arrow::datatypes::{Schema, SchemaRef};
use ::datafusion::catalog::TableProvider;
use ::datafusion::common::{DataFusionError, TableReference};
use ::datafusion::datasource::file_format::FileFormatFactory;
use ::datafusion::datasource::source::DataSourceExec;
use ::datafusion::execution::TaskContext;
use ::datafusion::logical_expr::{AggregateUDF, Extension, LogicalPlan, ScalarUDF, WindowUDF};
use ::datafusion::physical_optimizer::PhysicalOptimizerRule;
use ::datafusion::physical_plan::ExecutionPlan;
use ::datafusion::physical_plan::execution_plan::{ChildrenPropertiesMode, ReplaceChildrenOptions};
use arrow_schema::SortOptions;
use ballista_core::serde::{BallistaLogicalExtensionCodec, BallistaPhysicalExtensionCodec};
use datafusion_proto::logical_plan::LogicalExtensionCodec;
use datafusion_proto::logical_plan::from_proto::parse_exprs;
use datafusion_proto::logical_plan::to_proto::serialize_exprs;
use datafusion_proto::physical_plan::{
    PhysicalExtensionCodec, PhysicalPlanDecodeContext, PhysicalProtoConverterExtension,
};
use datafusion_proto::protobuf;
use prost::Message;

use super::cache::GpuTableCache;
use super::one_task::{OneTaskExec, ShareExec, shared_partitions};
use crate::datafusion::{DeviceStageExec, DeviceStageRule, GpuScan, GpuTable, GpuTableSource, LoadOptions};
use crate::device::Device;

type DfResult<T> = Result<T, DataFusionError>;

/// What starts every buffer these codecs write, so that they tell their own from the codecs they
/// wrap (whose protobuf messages never start with it: a field tag of `a` is a 64-bit field).
const MAGIC: &[u8] = b"arrow-cuda/1:";

/// A [`GpuTableSource`] on the wire.
#[derive(Clone, PartialEq, Message)]
struct SourceProto {
    #[prost(string, repeated, tag = "1")]
    locations: Vec<String>,
    #[prost(string, tag = "2")]
    format: String,
    #[prost(btree_map = "string, string", tag = "3")]
    options: BTreeMap<String, String>,
    /// The declared columns, when the table was declared with them.
    #[prost(message, optional, tag = "4")]
    schema: Option<protobuf::Schema>,
    #[prost(string, optional, tag = "5")]
    name: Option<String>,
    #[prost(uint64, optional, tag = "7")]
    memory_limit: Option<u64>,
    #[prost(uint64, optional, tag = "8")]
    streams_per_device: Option<u64>,
    #[prost(uint64, optional, tag = "9")]
    partitions: Option<u64>,
    #[prost(uint64, optional, tag = "10")]
    batch_rows: Option<u64>,
}

/// What a [`GpuTableCache`] keys a table by: its source, without its name, the devices it is
/// staged on and the partitions staged (when not all of them).
#[derive(Clone, PartialEq, Message)]
struct KeyProto {
    #[prost(message, optional, tag = "1")]
    source: Option<SourceProto>,
    #[prost(message, repeated, tag = "2")]
    devices: Vec<DeviceProto>,
    #[prost(uint64, repeated, tag = "3")]
    share: Vec<u64>,
    #[prost(bool, tag = "4")]
    has_share: bool,
}

/// A device, as the C Device Data Interface names it.
#[derive(Clone, PartialEq, Message)]
struct DeviceProto {
    #[prost(int32, tag = "1")]
    device_type: i32,
    #[prost(int64, tag = "2")]
    device_id: i64,
}

/// A GPU scan or a device stage on the wire.
#[derive(Clone, PartialEq, Message)]
struct NodeProto {
    #[prost(oneof = "Node", tags = "1, 2, 3, 4")]
    node: Option<Node>,
}

// One message per plan node, built and dropped at once: boxing the larger variant saves nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, PartialEq, prost::Oneof)]
enum Node {
    #[prost(message, tag = "1")]
    Scan(ScanProto),
    #[prost(message, tag = "2")]
    Stage(StageProto),
    #[prost(message, tag = "3")]
    OneTask(OneTaskProto),
    #[prost(message, tag = "4")]
    Share(ShareProto),
}

/// A [`ShareExec`]: the plan whose partitions it shares; its list of partitions travels as the
/// node's input.
#[derive(Clone, PartialEq, Message)]
struct ShareProto {
    #[prost(message, optional, boxed, tag = "1")]
    inner: Option<Box<protobuf::PhysicalPlanNode>>,
}

/// A [`OneTaskExec`]: nothing but its input, which travels as the node's.
#[derive(Clone, PartialEq, Message)]
struct OneTaskProto {}

/// A [`GpuScan`]: its table's source, and what DataFusion pushed into it.
#[derive(Clone, PartialEq, Message)]
struct ScanProto {
    #[prost(message, optional, tag = "1")]
    source: Option<SourceProto>,
    /// The projected columns, when `has_projection`.
    #[prost(uint64, repeated, tag = "2")]
    projection: Vec<u64>,
    #[prost(bool, tag = "3")]
    has_projection: bool,
    /// The pushed-down filters, as DataFusion's logical expressions.
    #[prost(message, repeated, tag = "4")]
    filters: Vec<protobuf::LogicalExprNode>,
    #[prost(uint64, optional, tag = "5")]
    limit: Option<u64>,
}

/// A [`DeviceStageExec`]: the plan it replaced, which the receiving process lowers again onto its
/// own copy of the table. The stage's children (its joins' build sides) travel as the node's
/// inputs, as Ballista may have cut them into stages of their own.
#[derive(Clone, PartialEq, Message)]
struct StageProto {
    #[prost(message, optional, boxed, tag = "1")]
    original: Option<Box<protobuf::PhysicalPlanNode>>,
    /// The stage's top-k cut, where it has one.
    #[prost(message, optional, tag = "2")]
    top: Option<TopProto>,
}

/// A device stage's top-k cut: the first `k` rows of an order whose first key is output column
/// `column`.
#[derive(Clone, PartialEq, Message)]
struct TopProto {
    #[prost(uint64, tag = "1")]
    column: u64,
    #[prost(uint64, tag = "2")]
    k: u64,
    #[prost(bool, tag = "3")]
    descending: bool,
    #[prost(bool, tag = "4")]
    nulls_first: bool,
}

fn decode_error(what: &str, e: impl std::fmt::Display) -> DataFusionError {
    DataFusionError::Internal(format!("arrow-cuda could not decode {what}: {e}"))
}

fn encode_into(message: &impl Message, buf: &mut Vec<u8>) -> DfResult<()> {
    buf.extend_from_slice(MAGIC);
    message
        .encode(buf)
        .map_err(|e| DataFusionError::Internal(format!("arrow-cuda could not encode a plan node: {e}")))
}

/// `source` on the wire: everything but its devices, which each process chooses for itself.
fn encode_source(source: &GpuTableSource) -> DfResult<SourceProto> {
    let options = source.load_options();
    Ok(SourceProto {
        locations: source.locations().to_vec(),
        format: source.format().to_string(),
        options: source.options().clone(),
        schema: source.schema.as_ref().map(|s| s.as_ref().try_into()).transpose()?,
        name: options.name.clone(),
        memory_limit: options.memory_limit,
        streams_per_device: options.streams_per_device.map(|n| n as u64),
        partitions: options.partitions.map(|n| n as u64),
        batch_rows: options.batch_rows.map(|n| n as u64),
    })
}

/// The key of a table staged from `source` on `devices` in a [`GpuTableCache`], whole or only the
/// partitions `share`.
pub(super) fn source_key(source: &GpuTableSource, devices: &[Device], share: Option<&[usize]>) -> DfResult<Vec<u8>> {
    let mut source = encode_source(source)?;
    source.name = None;
    let devices = devices
        .iter()
        .map(|d| DeviceProto {
            device_type: d.device_type().0,
            device_id: d.device_id(),
        })
        .collect();
    Ok(KeyProto {
        source: Some(source),
        devices,
        share: share.unwrap_or_default().iter().map(|&p| p as u64).collect(),
        has_share: share.is_some(),
    }
    .encode_to_vec())
}

fn decode_source(proto: SourceProto) -> DfResult<GpuTableSource> {
    let mut load = LoadOptions::new();
    load.name = proto.name;
    load.memory_limit = proto.memory_limit;
    load.streams_per_device = proto.streams_per_device.map(|n| n as usize);
    load.partitions = proto.partitions.map(|n| n as usize);
    load.batch_rows = proto.batch_rows.map(|n| n as usize);
    let schema: Option<SchemaRef> = proto
        .schema
        .as_ref()
        .map(|s| Schema::try_from(s).map(Arc::new))
        .transpose()?;
    Ok(GpuTableSource {
        locations: proto.locations,
        format: proto.format,
        options: proto.options,
        schema,
        load,
    })
}

/// The error for a GPU table that has no source to travel as.
fn no_source() -> DataFusionError {
    DataFusionError::Plan(
        "a GPU table staged from batches or another provider has no source: Ballista's executors \
         cannot stage it. Stage it from files (GpuTable::from_parquet, or CREATE EXTERNAL TABLE \
         ... STORED AS GPU)"
            .into(),
    )
}

/// A DataFusion [`LogicalExtensionCodec`] that sends a [`GpuTable`] as its
/// [source](GpuTable::source) (the files, their format and options, and how the table was
/// staged), and everything else through the codec it wraps (Ballista's own by default, so that
/// Ballista's nodes and file formats still travel). The receiving process stages the table from
/// the same files, once, in its [`GpuTableCache`].
///
/// A table without a source (staged from batches or another provider) is a planning error:
/// nothing of it exists outside the process that staged it.
#[derive(Debug)]
pub struct GpuLogicalCodec {
    inner: Arc<dyn LogicalExtensionCodec>,
}

impl GpuLogicalCodec {
    /// A codec that wraps `inner` for everything but GPU tables.
    pub fn new(inner: Arc<dyn LogicalExtensionCodec>) -> Self {
        GpuLogicalCodec { inner }
    }
}

impl Default for GpuLogicalCodec {
    /// Wraps Ballista's [`BallistaLogicalExtensionCodec`].
    fn default() -> Self {
        Self::new(Arc::new(BallistaLogicalExtensionCodec::default()))
    }
}

impl LogicalExtensionCodec for GpuLogicalCodec {
    fn try_decode(&self, buf: &[u8], inputs: &[LogicalPlan], ctx: &TaskContext) -> DfResult<Extension> {
        self.inner.try_decode(buf, inputs, ctx)
    }

    fn try_encode(&self, node: &Extension, buf: &mut Vec<u8>) -> DfResult<()> {
        self.inner.try_encode(node, buf)
    }

    fn try_decode_table_provider(
        &self,
        buf: &[u8],
        table_ref: &TableReference,
        schema: SchemaRef,
        ctx: &TaskContext,
    ) -> DfResult<Arc<dyn TableProvider>> {
        let Some(body) = buf.strip_prefix(MAGIC) else {
            return self.inner.try_decode_table_provider(buf, table_ref, schema, ctx);
        };
        let proto = SourceProto::decode(body).map_err(|e| decode_error("a GPU table", e))?;
        let source = decode_source(proto)?;
        let table = GpuTableCache::of(ctx)?.table(&source, None)?;
        if table.schema_ref().fields() != schema.fields() {
            return Err(DataFusionError::Plan(format!(
                "GPU table {table_ref} staged from {} has the columns {:?} here, not the {:?} it was planned with: \
                 do the machines see the same files?",
                source.locations().join(", "),
                table.schema_ref().fields(),
                schema.fields()
            )));
        }
        Ok(Arc::new(table))
    }

    fn try_encode_table_provider(
        &self,
        table_ref: &TableReference,
        node: Arc<dyn TableProvider>,
        buf: &mut Vec<u8>,
    ) -> DfResult<()> {
        let Some(table) = node.downcast_ref::<GpuTable>() else {
            return self.inner.try_encode_table_provider(table_ref, node, buf);
        };
        let source = table.source().ok_or_else(no_source)?;
        encode_into(&encode_source(source)?, buf)
    }

    fn try_decode_file_format(&self, buf: &[u8], ctx: &TaskContext) -> DfResult<Arc<dyn FileFormatFactory>> {
        self.inner.try_decode_file_format(buf, ctx)
    }

    fn try_encode_file_format(&self, buf: &mut Vec<u8>, node: Arc<dyn FileFormatFactory>) -> DfResult<()> {
        self.inner.try_encode_file_format(buf, node)
    }

    fn try_decode_udf(&self, name: &str, buf: &[u8]) -> DfResult<Arc<ScalarUDF>> {
        self.inner.try_decode_udf(name, buf)
    }

    fn try_encode_udf(&self, node: &ScalarUDF, buf: &mut Vec<u8>) -> DfResult<()> {
        self.inner.try_encode_udf(node, buf)
    }

    fn try_decode_udaf(&self, name: &str, buf: &[u8]) -> DfResult<Arc<AggregateUDF>> {
        self.inner.try_decode_udaf(name, buf)
    }

    fn try_encode_udaf(&self, node: &AggregateUDF, buf: &mut Vec<u8>) -> DfResult<()> {
        self.inner.try_encode_udaf(node, buf)
    }

    fn try_decode_udwf(&self, name: &str, buf: &[u8]) -> DfResult<Arc<WindowUDF>> {
        self.inner.try_decode_udwf(name, buf)
    }

    fn try_encode_udwf(&self, node: &WindowUDF, buf: &mut Vec<u8>) -> DfResult<()> {
        self.inner.try_encode_udwf(node, buf)
    }
}

/// A DataFusion [`PhysicalExtensionCodec`] for the scans of GPU tables ([`GpuScan`] under
/// `DataSourceExec`) and for device stages ([`DeviceStageExec`]), wrapping another codec
/// (Ballista's own by default, so that its shuffle nodes still travel) for every other node.
///
/// - A scan travels as its table's source, its projection, its pushed-down filters (DataFusion's
///   logical expressions, through `datafusion-proto`) and its limit; the receiving process scans
///   its own copy of the table, staged once in its [`GpuTableCache`].
/// - A stage travels as the plan it replaced (DataFusion's nodes and GPU scans, through
///   `datafusion-proto` and this codec), its children (its joins' build sides) as the node's
///   inputs. The receiving process lowers that plan again with [`DeviceStageRule`] onto its own
///   copy of the table and its own device (its CUDA device, or the CPU device's host stages on a
///   machine without a GPU), so no kernel, pointer or device layout crosses the wire. Where the
///   receiving process cannot place the stage (a GPU without NVRTC), the replaced plan runs
///   instead, with the same rows.
/// - The nodes that run a scan or a stage in one Ballista task, or split its partitions between
///   tasks (see [`session_state`](super::session_state)), travel as themselves. Under the one
///   that splits them, the receiving process stages only the task's partitions of the tables
///   (the others are empty in its copy).
#[derive(Debug)]
pub struct GpuPhysicalCodec {
    inner: Arc<dyn PhysicalExtensionCodec>,
    /// While decoding the plan under a [`ShareExec`]: the partitions of its tables to stage.
    share: Option<Vec<usize>>,
}

impl GpuPhysicalCodec {
    /// A codec that wraps `inner` for everything but GPU scans and device stages.
    pub fn new(inner: Arc<dyn PhysicalExtensionCodec>) -> Self {
        GpuPhysicalCodec { inner, share: None }
    }

    fn decode_scan(&self, proto: ScanProto, ctx: &TaskContext) -> DfResult<Arc<dyn ExecutionPlan>> {
        let source = decode_source(proto.source.ok_or_else(|| decode_error("a GPU scan", "no source"))?)?;
        let table = GpuTableCache::of(ctx)?.table(&source, self.share.as_deref())?;
        let projection: Option<Vec<usize>> = proto
            .has_projection
            .then(|| proto.projection.iter().map(|&c| c as usize).collect());
        let filters = parse_exprs(
            &proto.filters,
            ctx,
            &datafusion_proto::logical_plan::DefaultLogicalExtensionCodec {},
        )?;
        table.scan_plan(projection.as_ref(), &filters, proto.limit.map(|l| l as usize))
    }

    fn decode_stage(
        &self,
        proto: StageProto,
        inputs: &[Arc<dyn ExecutionPlan>],
        ctx: &TaskContext,
        converter: &dyn PhysicalProtoConverterExtension,
    ) -> DfResult<Arc<dyn ExecutionPlan>> {
        let original = proto
            .original
            .ok_or_else(|| decode_error("a device stage", "no plan"))?;
        let original = converter.proto_to_execution_plan(&original, &PhysicalPlanDecodeContext::new(ctx, self))?;
        // The sender placed a stage here: place it whatever this process's device.
        let rule = DeviceStageRule::new().with_host_stages(true);
        let lowered = rule.optimize(original.clone(), ctx.session_config().options())?;
        let Some(stage) = lowered.downcast_ref::<DeviceStageExec>() else {
            log::info!("arrow-cuda: a device stage cannot be placed here; DataFusion's plan runs instead");
            return Ok(original);
        };
        let cut = match proto.top {
            Some(t) => {
                let options = SortOptions {
                    descending: t.descending,
                    nulls_first: t.nulls_first,
                };
                match stage.with_top(t.column as usize, t.k as usize, options) {
                    Ok(cut) => Some(Arc::new(cut) as Arc<dyn ExecutionPlan>),
                    // The sort above still orders every row: only the cut is lost.
                    Err(why) => {
                        log::info!("arrow-cuda: a device stage's top-k cut cannot be placed here: {why}");
                        None
                    }
                }
            }
            None => None,
        };
        let lowered = cut.unwrap_or(lowered);
        let stage = lowered
            .downcast_ref::<DeviceStageExec>()
            .ok_or_else(|| decode_error("a device stage", "a cut that is not a stage"))?;
        if stage.children().len() != inputs.len() {
            log::info!("arrow-cuda: a device stage lowers to other joins here; DataFusion's plan runs instead");
            return Ok(original);
        }
        let options = ReplaceChildrenOptions::new(ChildrenPropertiesMode::Recompute);
        lowered.clone().replace_children(inputs.to_vec(), options)
    }

    /// A [`ShareExec`]: its input names the partitions that are this task's, and the plan under
    /// it is decoded staging only those partitions of its tables.
    fn decode_share(
        &self,
        proto: ShareProto,
        inputs: &[Arc<dyn ExecutionPlan>],
        ctx: &TaskContext,
        converter: &dyn PhysicalProtoConverterExtension,
    ) -> DfResult<Arc<dyn ExecutionPlan>> {
        let [shares] = inputs else {
            return Err(decode_error("a ShareExec", format!("{} inputs", inputs.len())));
        };
        let codec = GpuPhysicalCodec {
            inner: self.inner.clone(),
            share: Some(shared_partitions(shares)?),
        };
        let inner = proto.inner.ok_or_else(|| decode_error("a ShareExec", "no plan"))?;
        let inner = converter.proto_to_execution_plan(&inner, &PhysicalPlanDecodeContext::new(ctx, &codec))?;
        Ok(Arc::new(ShareExec::with_shares(inner, shares.clone())?))
    }
}

impl Default for GpuPhysicalCodec {
    /// Wraps Ballista's [`BallistaPhysicalExtensionCodec`].
    fn default() -> Self {
        Self::new(Arc::new(BallistaPhysicalExtensionCodec::default()))
    }
}

impl PhysicalExtensionCodec for GpuPhysicalCodec {
    fn try_decode(
        &self,
        buf: &[u8],
        inputs: &[Arc<dyn ExecutionPlan>],
        ctx: &TaskContext,
        converter: &dyn PhysicalProtoConverterExtension,
    ) -> DfResult<Arc<dyn ExecutionPlan>> {
        let Some(body) = buf.strip_prefix(MAGIC) else {
            return self.inner.try_decode(buf, inputs, ctx, converter);
        };
        let proto = NodeProto::decode(body).map_err(|e| decode_error("a GPU plan node", e))?;
        match proto.node {
            Some(Node::Scan(scan)) => self.decode_scan(scan, ctx),
            Some(Node::Stage(stage)) => self.decode_stage(stage, inputs, ctx, converter),
            Some(Node::OneTask(_)) => match inputs {
                [input] => Ok(Arc::new(OneTaskExec::new(input.clone()))),
                _ => Err(decode_error("a OneTaskExec", format!("{} inputs", inputs.len()))),
            },
            Some(Node::Share(share)) => self.decode_share(share, inputs, ctx, converter),
            None => Err(decode_error("a GPU plan node", "no node")),
        }
    }

    fn try_encode(
        &self,
        node: Arc<dyn ExecutionPlan>,
        buf: &mut Vec<u8>,
        converter: &dyn PhysicalProtoConverterExtension,
    ) -> DfResult<()> {
        let scan = node
            .downcast_ref::<DataSourceExec>()
            .and_then(|exec| exec.data_source().downcast_ref::<GpuScan>());
        let proto = if let Some(scan) = scan {
            let source = scan.table().source.as_ref().ok_or_else(no_source)?;
            let codec = datafusion_proto::logical_plan::DefaultLogicalExtensionCodec {};
            Node::Scan(ScanProto {
                source: Some(encode_source(source)?),
                projection: scan
                    .projection()
                    .unwrap_or_default()
                    .iter()
                    .map(|&c| c as u64)
                    .collect(),
                has_projection: scan.projection().is_some(),
                filters: serialize_exprs(scan.filters(), &codec)?,
                limit: scan.limit().map(|l| l as u64),
            })
        } else if node.downcast_ref::<OneTaskExec>().is_some() {
            Node::OneTask(OneTaskProto {})
        } else if let Some(share) = node.downcast_ref::<ShareExec>() {
            Node::Share(ShareProto {
                inner: Some(Box::new(converter.execution_plan_to_proto(share.inner(), self)?)),
            })
        } else if let Some(stage) = node.downcast_ref::<DeviceStageExec>() {
            Node::Stage(StageProto {
                original: Some(Box::new(converter.execution_plan_to_proto(stage.original(), self)?)),
                top: stage.top().map(|(column, k, options)| TopProto {
                    column: column as u64,
                    k: k as u64,
                    descending: options.descending,
                    nulls_first: options.nulls_first,
                }),
            })
        } else {
            return self.inner.try_encode(node, buf, converter);
        };
        encode_into(&NodeProto { node: Some(proto) }, buf)
    }

    fn try_decode_udf(&self, name: &str, buf: &[u8]) -> DfResult<Arc<ScalarUDF>> {
        self.inner.try_decode_udf(name, buf)
    }

    fn try_encode_udf(&self, node: &ScalarUDF, buf: &mut Vec<u8>) -> DfResult<()> {
        self.inner.try_encode_udf(node, buf)
    }

    fn try_decode_udaf(&self, name: &str, buf: &[u8]) -> DfResult<Arc<AggregateUDF>> {
        self.inner.try_decode_udaf(name, buf)
    }

    fn try_encode_udaf(&self, node: &AggregateUDF, buf: &mut Vec<u8>) -> DfResult<()> {
        self.inner.try_encode_udaf(node, buf)
    }

    fn try_decode_udwf(&self, name: &str, buf: &[u8]) -> DfResult<Arc<WindowUDF>> {
        self.inner.try_decode_udwf(name, buf)
    }

    fn try_encode_udwf(&self, node: &WindowUDF, buf: &mut Vec<u8>) -> DfResult<()> {
        self.inner.try_encode_udwf(node, buf)
    }
}
