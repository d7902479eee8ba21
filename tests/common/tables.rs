//! Tables for the DataFusion tests: a schema with its batches in partitions, and TPC-H's.

use arrow_array::RecordBatch;
use arrow_cuda_workloads::tpch;
use arrow_schema::SchemaRef;

/// A table's schema and its batches, in partitions.
#[derive(Clone)]
pub struct Data {
    pub schema: SchemaRef,
    pub partitions: Vec<Vec<RecordBatch>>,
}

impl Data {
    /// A table of these partitions, the schema of their first batch.
    pub fn new(partitions: Vec<Vec<RecordBatch>>) -> Data {
        Data {
            schema: partitions[0][0].schema(),
            partitions,
        }
    }

    /// The rows of every partition.
    pub fn rows(&self) -> usize {
        self.partitions.iter().flatten().map(RecordBatch::num_rows).sum()
    }
}

impl From<tpch::Table> for Data {
    fn from(t: tpch::Table) -> Data {
        Data {
            schema: t.schema,
            partitions: t.partitions,
        }
    }
}

/// The TPC-H tables most tests query.
pub struct Tpch {
    pub lineitem: Data,
    pub orders: Data,
    pub part: Data,
}

impl Tpch {
    /// lineitem, orders and part at scale factor `sf`, each in `partitions` partitions of
    /// `batch_rows`-row batches.
    pub fn generate(sf: f64, partitions: usize, batch_rows: usize) -> Tpch {
        let table = |name| Data::from(tpch::table(name, sf, partitions, batch_rows).expect("generate"));
        Tpch {
            lineitem: table("lineitem"),
            orders: table("orders"),
            part: table("part"),
        }
    }
}

/// The SQL of TPC-H query `name`.
pub fn tpch_query(name: &str) -> &'static str {
    tpch::query(name).expect("a TPC-H query")
}
