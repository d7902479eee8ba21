//! TPC-H: the 22 queries of `workloads/tpch/` and the 8 tables, generated in process with tpchgen
//! and converted to Arrow with tpchgen-arrow.

use arrow_array::{RecordBatch, RecordBatchReader};
use arrow_schema::{ArrowError, SchemaRef};
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
    ("q1", include_str!("../tpch/q1.sql")),
    ("q2", include_str!("../tpch/q2.sql")),
    ("q3", include_str!("../tpch/q3.sql")),
    ("q4", include_str!("../tpch/q4.sql")),
    ("q5", include_str!("../tpch/q5.sql")),
    ("q6", include_str!("../tpch/q6.sql")),
    ("q7", include_str!("../tpch/q7.sql")),
    ("q8", include_str!("../tpch/q8.sql")),
    ("q9", include_str!("../tpch/q9.sql")),
    ("q10", include_str!("../tpch/q10.sql")),
    ("q11", include_str!("../tpch/q11.sql")),
    ("q12", include_str!("../tpch/q12.sql")),
    ("q13", include_str!("../tpch/q13.sql")),
    ("q14", include_str!("../tpch/q14.sql")),
    ("q15", include_str!("../tpch/q15.sql")),
    ("q16", include_str!("../tpch/q16.sql")),
    ("q17", include_str!("../tpch/q17.sql")),
    ("q18", include_str!("../tpch/q18.sql")),
    ("q19", include_str!("../tpch/q19.sql")),
    ("q20", include_str!("../tpch/q20.sql")),
    ("q21", include_str!("../tpch/q21.sql")),
    ("q22", include_str!("../tpch/q22.sql")),
];

/// The SQL of the TPC-H query `name` (`q1` ... `q22`, any case), or `None` for another name.
pub fn query(name: &str) -> Option<&'static str> {
    QUERIES
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case(name))
        .map(|(_, sql)| *sql)
}

/// The names of the 8 tables, largest first, in the order [`tables`] gives them.
pub const TABLES: [&str; 8] = [
    "lineitem", "orders", "customer", "part", "partsupp", "supplier", "nation", "region",
];

/// Rows per generated batch for the tests: tpchgen-arrow's and DataFusion's default.
pub const BATCH_SIZE: usize = 8192;

/// Rows per generated batch for the benchmarks and the command-line tool (131,072): fewer, larger
/// batches for large scale factors.
pub const LARGE_BATCH_SIZE: usize = 1 << 17;

/// One TPC-H table: its name, schema and batches, in partitions.
#[derive(Clone, Debug)]
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
fn generate<R: RecordBatchReader>(
    name: &'static str,
    parts: usize,
    make: impl Fn(i32, i32) -> R + Sync,
) -> Result<Table, ArrowError> {
    let parts = i32::try_from(parts)
        .map_err(|_| ArrowError::InvalidArgumentError(format!("{parts} partitions of TPC-H {name}: too many")))?;
    let schema = make(1, parts).schema();
    let partitions = std::thread::scope(|s| {
        let handles: Vec<_> = (1..=parts)
            .map(|part| {
                let make = &make;
                s.spawn(move || make(part, parts).collect::<Result<Vec<_>, _>>())
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic)))
            .collect::<Result<Vec<_>, _>>()
    })?;
    Ok(Table {
        name,
        schema,
        partitions,
    })
}

/// The TPC-H table `name` (one of [`TABLES`]) at scale factor `sf` (0.01: lineitem has 60,175
/// rows), in `partitions` partitions (at least one) generated on as many threads, in batches of
/// `batch_size` rows. Nation (25 rows) and region (5 rows) come as one partition: their generators
/// ignore the partition arguments.
pub fn table(name: &str, sf: f64, partitions: usize, batch_size: usize) -> Result<Table, ArrowError> {
    let parts = partitions.max(1);
    macro_rules! table {
        ($name:literal, $gen:ident, $arrow:ident, $parts:expr) => {
            generate($name, $parts, |part, parts| {
                $arrow::new($gen::new(sf, part, parts)).with_batch_size(batch_size)
            })
        };
    }
    match name {
        "lineitem" => table!("lineitem", LineItemGenerator, LineItemArrow, parts),
        "orders" => table!("orders", OrderGenerator, OrderArrow, parts),
        "customer" => table!("customer", CustomerGenerator, CustomerArrow, parts),
        "part" => table!("part", PartGenerator, PartArrow, parts),
        "partsupp" => table!("partsupp", PartSuppGenerator, PartSuppArrow, parts),
        "supplier" => table!("supplier", SupplierGenerator, SupplierArrow, parts),
        "nation" => table!("nation", NationGenerator, NationArrow, 1),
        "region" => table!("region", RegionGenerator, RegionArrow, 1),
        _ => Err(ArrowError::InvalidArgumentError(format!(
            "no TPC-H table is named {name}: the tables are {}",
            TABLES.join(", ")
        ))),
    }
}

/// All 8 TPC-H tables, in the order of [`TABLES`], as [`table`] makes each.
pub fn tables(sf: f64, partitions: usize, batch_size: usize) -> Result<Vec<Table>, ArrowError> {
    TABLES
        .iter()
        .map(|name| table(name, sf, partitions, batch_size))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queries_by_name() {
        for (i, (name, sql)) in QUERIES.iter().enumerate() {
            assert_eq!(*name, format!("q{}", i + 1));
            assert!(sql.contains("select"), "{name}");
            assert_eq!(query(&name.to_uppercase()), Some(*sql));
        }
        assert_eq!(query("q23"), None);
    }

    #[test]
    fn tables_at_a_small_scale() {
        let tables = tables(0.001, 2, 1000).expect("generate");
        let names: Vec<_> = tables.iter().map(|t| t.name).collect();
        assert_eq!(names, TABLES);
        for t in &tables {
            let parts = if matches!(t.name, "nation" | "region") { 1 } else { 2 };
            assert_eq!(t.partitions.len(), parts, "{}", t.name);
            assert!(
                t.partitions
                    .iter()
                    .flatten()
                    .all(|b| b.num_rows() <= 1000 && b.schema() == t.schema)
            );
        }
        assert_eq!(tables[6].rows(), 25);
        assert_eq!(tables[7].rows(), 5);
        assert!(table("lineitems", 0.001, 1, BATCH_SIZE).is_err());
    }
}
