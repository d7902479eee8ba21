//! [`GpuTableCache`]: the GPU tables a Ballista process has staged, kept across queries.

use std::sync::{Arc, Mutex, PoisonError};

use ::datafusion::common::DataFusionError;
use ::datafusion::execution::TaskContext;
use ::datafusion::prelude::SessionConfig;

use super::codec::source_key;
use crate::datafusion::{GpuTable, GpuTableSource, default_device};
use crate::device::Device;

type DfResult<T> = Result<T, DataFusionError>;

/// The GPU tables a Ballista executor (or scheduler, or client) has staged, by their source, kept
/// across queries and shared by every task of the process.
///
/// A plan that reaches the process names its GPU tables by their [`GpuTableSource`]; the first
/// task that needs one stages it, on this process's devices (where the table lives is each
/// process's choice, not the client's: see [`GpuTableCache::with_devices`]), and later tasks and
/// queries find it here. Tables are keyed by everything that makes them differ: files, format,
/// format options, declared columns, partition count, batch rows, streams and devices (not their
/// name).
///
/// The cache holds at most [`GpuTableCache::new`]'s limit of device memory (as
/// [`GpuTable::size_in_bytes`] counts it, over all its devices): staging a table evicts the
/// tables used least recently until the new one fits, and a table larger than the limit is a
/// `ResourcesExhausted` error. An evicted table's memory is freed once the queries still running
/// over it finish.
///
/// It lives in the session config's extensions ([`SessionConfig::with_extension`]), where
/// [`session_state`](super::session_state), [`scheduler_config`](super::scheduler_config) and
/// [`executor_config`](super::executor_config) put it and where the codecs look for it.
#[derive(Debug)]
pub struct GpuTableCache {
    limit: u64,
    devices: Option<Vec<Device>>,
    entries: Mutex<Entries>,
    /// Held while a table is staged: two tasks that want the same table stage it once.
    staging: Mutex<()>,
}

#[derive(Debug, Default)]
struct Entries {
    tables: Vec<Entry>,
    /// Incremented on every use: an entry's `used` orders it for eviction.
    clock: u64,
}

#[derive(Debug)]
struct Entry {
    key: Vec<u8>,
    table: GpuTable,
    /// The partitions staged, when not all of them.
    share: Option<Vec<usize>>,
    bytes: u64,
    used: u64,
}

/// A table a [`GpuTableCache`] holds ([`GpuTableCache::tables`]).
#[derive(Debug, Clone)]
pub struct CachedTable {
    /// Where it was staged from.
    pub source: Option<GpuTableSource>,
    /// The table's partition count.
    pub partition_count: usize,
    /// The partitions staged, in order, when not all of them: a Ballista executor stages the
    /// partitions its tasks read, and the others are empty in its copy.
    pub partitions: Option<Vec<usize>>,
    /// The bytes of device memory it takes.
    pub bytes: u64,
}

impl Entries {
    fn get(&mut self, key: &[u8]) -> Option<GpuTable> {
        self.clock += 1;
        let clock = self.clock;
        let entry = self.tables.iter_mut().find(|e| e.key == key)?;
        entry.used = clock;
        Some(entry.table.clone())
    }

    fn bytes(&self) -> u64 {
        self.tables.iter().map(|e| e.bytes).sum()
    }
}

impl GpuTableCache {
    /// A cache of at most `limit` bytes of device memory, staging tables on this process's first
    /// GPU, or the CPU device on a machine without one.
    pub fn new(limit: u64) -> Self {
        GpuTableCache {
            limit,
            devices: None,
            entries: Mutex::default(),
            staging: Mutex::new(()),
        }
    }

    /// Stages every table on these devices instead, partitions round-robin (an executor that
    /// owns the second GPU of its machine: `[Device::Cuda(1)]`, though `CUDA_VISIBLE_DEVICES` is
    /// the usual way to give each executor its own; a scheduler or client, which only plan:
    /// `[Device::Cpu]`).
    pub fn with_devices(mut self, devices: impl IntoIterator<Item = Device>) -> Self {
        self.devices = Some(devices.into_iter().collect());
        self
    }

    /// The devices the cache stages tables on.
    pub(crate) fn devices(&self) -> Vec<Device> {
        match &self.devices {
            Some(d) if !d.is_empty() => d.clone(),
            _ => vec![default_device()],
        }
    }

    /// The most bytes of device memory the cache holds.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// The number of tables held.
    pub fn len(&self) -> usize {
        self.lock().tables.len()
    }

    /// Whether no table is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes of device memory the tables held take.
    pub fn bytes(&self) -> u64 {
        self.lock().bytes()
    }

    /// The tables held, least recently used first.
    pub fn tables(&self) -> Vec<CachedTable> {
        let entries = self.lock();
        let mut tables: Vec<&Entry> = entries.tables.iter().collect();
        tables.sort_by_key(|e| e.used);
        tables
            .into_iter()
            .map(|e| CachedTable {
                source: e.table.source().cloned(),
                partition_count: e.table.partitions().len(),
                partitions: e.share.clone(),
                bytes: e.bytes,
            })
            .collect()
    }

    /// The cache of the session `context` belongs to, or an error saying how to install one.
    pub(crate) fn of(context: &TaskContext) -> DfResult<Arc<GpuTableCache>> {
        Self::of_config(context.session_config())
    }

    /// The cache in `config`'s extensions, or an error saying how to install one.
    pub(crate) fn of_config(config: &SessionConfig) -> DfResult<Arc<GpuTableCache>> {
        config.get_extension::<GpuTableCache>().ok_or_else(|| {
            DataFusionError::Configuration(
                "this Ballista process has no GpuTableCache in its session config: configure it with \
                 arrow_cuda::ballista::session_state, scheduler_config or executor_config"
                    .into(),
            )
        })
    }

    /// The table staged from `source` on this process's devices, whole or, with `share`, only
    /// those of its partitions (the others empty): the one held, or a new one, staged now
    /// (blocking the calling thread, off the async runtime's workers where it can) and kept,
    /// evicting the least recently used tables until it fits.
    pub(crate) fn table(&self, source: &GpuTableSource, share: Option<&[usize]>) -> DfResult<GpuTable> {
        let devices = self.devices();
        let share = share.and_then(|s| partial_share(s, source.load_options().partitions));
        let key = source_key(source, &devices, share.as_deref())?;
        let options = source.load_options().clone().with_devices(devices);
        if let Some(table) = self.lock().get(&key) {
            return Ok(table);
        }
        let _staging = self.staging.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(table) = self.lock().get(&key) {
            return Ok(table);
        }
        let limit = options.memory_limit.map_or(self.limit, |l| l.min(self.limit));
        let table = block_on(source.stage(options.with_memory_limit(limit), share.clone()))?;
        self.keep(key, &table, share)?;
        Ok(table)
    }

    /// Keeps `table` (staged from its source here, by a `CREATE EXTERNAL TABLE` of this
    /// process), so that plans naming its source find it; a table without a source, or staged
    /// on other devices than the cache's, is not kept.
    pub(crate) fn insert(&self, table: &GpuTable) -> DfResult<()> {
        let Some(source) = table.source() else {
            return Ok(());
        };
        let devices = self.devices();
        if source.load_options().devices() != devices {
            return Ok(());
        }
        let key = source_key(source, &devices, None)?;
        let _staging = self.staging.lock().unwrap_or_else(PoisonError::into_inner);
        if self.lock().get(&key).is_some() {
            return Ok(());
        }
        self.keep(key, table, None)
    }

    /// Makes room for `table` (of the partitions `share`, or all) and keeps it under `key`.
    fn keep(&self, key: Vec<u8>, table: &GpuTable, share: Option<Vec<usize>>) -> DfResult<()> {
        let bytes = table.size_in_bytes() as u64;
        if bytes > self.limit {
            let name = table
                .source()
                .and_then(|s| s.locations().first().cloned())
                .unwrap_or_default();
            return Err(DataFusionError::ResourcesExhausted(format!(
                "GPU table {name} takes {bytes} bytes of device memory, more than the cache's limit of {}",
                self.limit
            )));
        }
        let mut entries = self.lock();
        while entries.bytes() + bytes > self.limit {
            let Some(oldest) = (0..entries.tables.len()).min_by_key(|&i| entries.tables[i].used) else {
                break;
            };
            let evicted = entries.tables.swap_remove(oldest);
            log::info!(
                "arrow-cuda: the GPU table cache evicts a table of {} bytes",
                evicted.bytes
            );
        }
        entries.clock += 1;
        let used = entries.clock;
        entries.tables.push(Entry {
            key,
            table: table.clone(),
            share,
            bytes,
            used,
        });
        Ok(())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Entries> {
        self.entries.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// `share`, sorted and without repeats, unless it names every one of `partitions` (the table is
/// then staged whole, and shares the whole table's entry).
fn partial_share(share: &[usize], partitions: Option<usize>) -> Option<Vec<usize>> {
    let mut share = share.to_vec();
    share.sort_unstable();
    share.dedup();
    let whole = partitions.is_some_and(|n| share.len() == n && share.iter().enumerate().all(|(i, &p)| i == p));
    (!whole).then_some(share)
}

/// Runs `future` to completion from synchronous code (a codec's decoding) that may be running on
/// an async runtime's worker: in place on a multi-threaded tokio runtime (the worker's other tasks
/// move to other threads meanwhile), on this thread otherwise.
fn block_on<F: Future>(future: F) -> F::Output {
    match tokio::runtime::Handle::try_current() {
        Ok(handle) if handle.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(|| handle.block_on(future))
        }
        _ => futures::executor::block_on(future),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::Arc;

    use super::*;
    use crate::datafusion::LoadOptions;

    /// A CSV file of `rows` rows in a fresh directory, as a source staged on the CPU device.
    fn csv_source(case: &str, rows: usize) -> GpuTableSource {
        let dir = std::env::temp_dir().join(format!("arrow-cuda-cache-{case}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("t.csv");
        let body: String = (0..rows).map(|i| format!("{i},name {i}\n")).collect();
        std::fs::write(&path, format!("id,name\n{body}")).expect("csv");
        GpuTableSource {
            locations: vec![path.display().to_string()],
            format: "CSV".into(),
            options: BTreeMap::from([("format.has_header".to_string(), "true".to_string())]),
            schema: None,
            load: LoadOptions::new().with_device(Device::Cpu),
        }
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("tokio runtime")
    }

    /// A table is staged once and found again; staging one that does not fit evicts the least
    /// recently used.
    #[test]
    fn tables_are_kept_and_the_least_recently_used_evicted() {
        let rt = runtime();
        let sources: Vec<_> = ["a", "b", "c"].iter().map(|c| csv_source(c, 1000)).collect();
        let bytes = {
            let probe = GpuTableCache::new(u64::MAX);
            rt.block_on(async { probe.table(&sources[0], None) })
                .expect("stage")
                .size_in_bytes() as u64
        };
        assert!(bytes > 0);
        // Room for two of the three tables.
        let cache = GpuTableCache::new(2 * bytes + bytes / 2);
        rt.block_on(async {
            let a = cache.table(&sources[0], None).expect("stage a");
            let again = cache.table(&sources[0], None).expect("find a");
            assert!(Arc::ptr_eq(&a.data, &again.data), "a second use finds the staged table");
            cache.table(&sources[1], None).expect("stage b");
            assert_eq!((cache.len(), cache.bytes()), (2, 2 * bytes));
            // a is used after b: b is the least recently used when c comes.
            cache.table(&sources[0], None).expect("find a");
            cache.table(&sources[2], None).expect("stage c");
            assert_eq!((cache.len(), cache.bytes()), (2, 2 * bytes));
            let a_again = cache.table(&sources[0], None).expect("find a");
            assert!(Arc::ptr_eq(&a.data, &a_again.data), "a stays");
            assert_eq!(cache.len(), 2, "a was held");
        });
        let b = rt
            .block_on(async { cache.table(&sources[1], None) })
            .expect("stage b again");
        assert_eq!(b.num_rows(), 1000);
        assert_eq!(cache.len(), 2, "b comes back in place of the least recently used");
    }

    /// Shares of a Parquet table's partitions, staged apart (as executors stage them), hold its
    /// rows once between them, and only their own partitions; a share of every partition is the
    /// whole table's entry.
    #[test]
    fn shares_of_a_table_split_its_rows() {
        use ::datafusion::parquet::arrow::ArrowWriter;
        use arrow_array::Int64Array;

        let dir = std::env::temp_dir().join(format!("arrow-cuda-cache-share-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("t.parquet");
        let batch = arrow_array::RecordBatch::try_from_iter([(
            "id",
            Arc::new(Int64Array::from_iter_values(0..10_000)) as arrow_array::ArrayRef,
        )])
        .expect("batch");
        let props = ::datafusion::parquet::file::properties::WriterProperties::builder()
            .set_max_row_group_row_count(Some(500))
            .build();
        let mut writer = ArrowWriter::try_new(std::fs::File::create(&path).expect("file"), batch.schema(), Some(props))
            .expect("writer");
        writer.write(&batch).expect("write");
        writer.close().expect("close");
        let source = GpuTableSource {
            locations: vec![path.display().to_string()],
            format: "PARQUET".into(),
            options: BTreeMap::new(),
            schema: None,
            load: LoadOptions::new().with_partitions(3).with_batch_rows(1000),
        };
        let rt = runtime();
        let cache = GpuTableCache::new(u64::MAX).with_devices([Device::Cpu]);
        let rows = |t: &GpuTable, p: usize| t.partitions()[p].iter().map(|b| b.num_rows()).sum::<usize>();
        rt.block_on(async {
            let a = cache.table(&source, Some(&[1])).expect("share [1]");
            let b = cache.table(&source, Some(&[2, 0])).expect("share [0, 2]");
            assert_eq!(a.partitions().len(), 3);
            assert_eq!(
                (rows(&a, 0), rows(&a, 2), rows(&b, 1)),
                (0, 0, 0),
                "only a share's partitions"
            );
            assert!(rows(&a, 1) > 0 && rows(&b, 0) > 0 && rows(&b, 2) > 0);
            assert_eq!(a.num_rows() + b.num_rows(), 10_000, "the shares hold every row once");
            let whole = cache.table(&source, Some(&[0, 1, 2])).expect("every partition");
            assert_eq!(whole.num_rows(), 10_000);
            let shares: Vec<_> = cache.tables().into_iter().map(|t| t.partitions).collect();
            assert_eq!(shares, [Some(vec![1]), Some(vec![0, 2]), None]);
        });
    }

    /// A table larger than the cache's limit is an error, and nothing is kept.
    #[test]
    fn a_table_larger_than_the_limit_is_an_error() {
        let rt = runtime();
        let cache = GpuTableCache::new(1024);
        let err = rt
            .block_on(async { cache.table(&csv_source("big", 10_000), None) })
            .expect_err("too large");
        assert!(matches!(err, DataFusionError::ResourcesExhausted(_)), "{err}");
        assert!(cache.is_empty());
    }

    /// Without a cache in the session config, the codecs' error says how to install one.
    #[test]
    fn a_session_without_a_cache_is_told_how_to_get_one() {
        let err = GpuTableCache::of_config(&SessionConfig::new()).expect_err("no cache");
        assert!(err.to_string().contains("executor_config"), "{err}");
    }
}
