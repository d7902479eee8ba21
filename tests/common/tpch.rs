//! TPC-H for the tests and benches: the 22 queries of `workloads/tpch/` and the 8 tables, generated
//! with tpchgen and converted to Arrow with tpchgen-arrow.

use arrow_array::{RecordBatch, RecordBatchReader};
use arrow_schema::SchemaRef;
use tpchgen::generators::{
    CustomerGenerator, LineItemGenerator, NationGenerator, OrderGenerator, PartGenerator, PartSuppGenerator,
    RegionGenerator, SupplierGenerator,
};
use tpchgen_arrow::{
    CustomerArrow, LineItemArrow, NationArrow, OrderArrow, PartArrow, PartSuppArrow, RegionArrow, SupplierArrow,
};

/// The 22 TPC-H queries by name (`q1` ... `q22`), with the specification's validation parameters,
/// in SQL that DataFusion accepts. Q15 uses a common table expression instead of a view.
pub const QUERIES: [(&str, &str); 22] = [
    ("q1", include_str!("../../workloads/tpch/q1.sql")),
    ("q2", include_str!("../../workloads/tpch/q2.sql")),
    ("q3", include_str!("../../workloads/tpch/q3.sql")),
    ("q4", include_str!("../../workloads/tpch/q4.sql")),
    ("q5", include_str!("../../workloads/tpch/q5.sql")),
    ("q6", include_str!("../../workloads/tpch/q6.sql")),
    ("q7", include_str!("../../workloads/tpch/q7.sql")),
    ("q8", include_str!("../../workloads/tpch/q8.sql")),
    ("q9", include_str!("../../workloads/tpch/q9.sql")),
    ("q10", include_str!("../../workloads/tpch/q10.sql")),
    ("q11", include_str!("../../workloads/tpch/q11.sql")),
    ("q12", include_str!("../../workloads/tpch/q12.sql")),
    ("q13", include_str!("../../workloads/tpch/q13.sql")),
    ("q14", include_str!("../../workloads/tpch/q14.sql")),
    ("q15", include_str!("../../workloads/tpch/q15.sql")),
    ("q16", include_str!("../../workloads/tpch/q16.sql")),
    ("q17", include_str!("../../workloads/tpch/q17.sql")),
    ("q18", include_str!("../../workloads/tpch/q18.sql")),
    ("q19", include_str!("../../workloads/tpch/q19.sql")),
    ("q20", include_str!("../../workloads/tpch/q20.sql")),
    ("q21", include_str!("../../workloads/tpch/q21.sql")),
    ("q22", include_str!("../../workloads/tpch/q22.sql")),
];

/// The rows per generated batch.
pub const BATCH_SIZE: usize = 8192;

/// One TPC-H table: its name, schema and batches, in partitions.
#[derive(Clone)]
pub struct Table {
    /// The table's name (`lineitem`, `orders`, ...).
    pub name: &'static str,
    /// The schema tpchgen-arrow gives it (keys Int64, money Decimal128(15, 2), text Utf8View).
    pub schema: SchemaRef,
    /// The batches of each partition.
    pub partitions: Vec<Vec<RecordBatch>>,
}

impl Table {
    /// The number of rows over all partitions.
    pub fn rows(&self) -> usize {
        self.partitions.iter().flatten().map(RecordBatch::num_rows).sum()
    }
}

/// Generates one table in `parts` partitions, each on its own thread; `make(part, parts)` gives
/// the reader of partition `part` (1-based, as tpchgen counts them).
fn generate<R: RecordBatchReader>(name: &'static str, parts: usize, make: impl Fn(i32, i32) -> R + Sync) -> Table {
    let parts_i32 = i32::try_from(parts).expect("partition count fits in i32");
    let schema = make(1, parts_i32).schema();
    let partitions = std::thread::scope(|s| {
        let handles: Vec<_> = (1..=parts_i32)
            .map(|part| {
                let make = &make;
                s.spawn(move || {
                    make(part, parts_i32)
                        .collect::<Result<Vec<_>, _>>()
                        .unwrap_or_else(|e| panic!("generating {name} part {part}: {e}"))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("generator thread"))
            .collect()
    });
    Table {
        name,
        schema,
        partitions,
    }
}

/// All 8 TPC-H tables at scale factor `sf` (0.01: lineitem has 60,175 rows), each in `partitions`
/// partitions, except nation (25 rows) and region (5 rows): their generators ignore the partition
/// arguments, so they come as one partition.
pub fn tables(sf: f64, partitions: usize) -> Vec<Table> {
    assert!(partitions > 0, "at least one partition");
    macro_rules! table {
        ($name:literal, $gen:ident, $arrow:ident, $parts:expr) => {
            generate($name, $parts, |part, parts| {
                $arrow::new($gen::new(sf, part, parts)).with_batch_size(BATCH_SIZE)
            })
        };
    }
    vec![
        table!("lineitem", LineItemGenerator, LineItemArrow, partitions),
        table!("orders", OrderGenerator, OrderArrow, partitions),
        table!("customer", CustomerGenerator, CustomerArrow, partitions),
        table!("part", PartGenerator, PartArrow, partitions),
        table!("partsupp", PartSuppGenerator, PartSuppArrow, partitions),
        table!("supplier", SupplierGenerator, SupplierArrow, partitions),
        table!("nation", NationGenerator, NationArrow, 1),
        table!("region", RegionGenerator, RegionArrow, 1),
    ]
}
