//! The `arrow-cuda` binary as a new user meets it: help, clear messages without a GPU, a query on
//! the CPU device, and the benchmark table (on the CPU device through `ARROW_CUDA_BENCH_CPU` when
//! there is no GPU; on a GPU machine the real one).

use std::process::{Command, Output};

fn arrow_cuda(args: &[&str], envs: &[(&str, &str)]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_arrow-cuda"));
    c.args(args).env_remove("ARROW_CUDA_BENCH_CPU");
    for (k, v) in envs {
        c.env(k, v);
    }
    c.output().expect("run arrow-cuda")
}

/// `arrow-cuda ARGS` with `input` on its stdin (a pipe: not a terminal).
fn arrow_cuda_with_input(args: &[&str], input: &str) -> Output {
    use std::io::Write;
    let mut child = Command::new(env!("CARGO_BIN_EXE_arrow-cuda"))
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run arrow-cuda");
    let mut stdin = child.stdin.take().expect("stdin");
    stdin.write_all(input.as_bytes()).expect("write stdin");
    drop(stdin);
    child.wait_with_output().expect("wait for arrow-cuda")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn gpu() -> bool {
    arrow_cuda::device::cuda_available()
}

#[test]
fn help_lists_every_command() {
    let o = arrow_cuda(&[], &[]);
    assert!(o.status.success(), "{}", text(&o));
    for command in ["info", "bench", "query", "send", "recv"] {
        assert!(text(&o).contains(command), "{command}: {}", text(&o));
    }
}

/// `info` and `bench` need a GPU: without one they say so in one line and fail.
#[test]
fn gpu_commands_without_a_gpu_fail_in_one_line() {
    if gpu() {
        eprintln!("skipped: this machine has a GPU");
        return;
    }
    for args in [&["info"][..], &["bench"]] {
        let o = arrow_cuda(args, &[]);
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{args:?}: {}", text(&o));
        assert_eq!(stderr.trim().lines().count(), 1, "{args:?}: {stderr}");
        assert!(stderr.contains("CUDA"), "{args:?}: {stderr}");
    }
}

/// `query` runs TPC-H Q6 and Q13 (customer and orders: every TPC-H table is there) on the CPU
/// device (on a GPU too, with `--device cpu`), beside MemTable.
#[test]
fn query_runs_on_the_cpu_device() {
    let o = arrow_cuda(
        &[
            "query",
            "--tpch",
            "0.01",
            "--device",
            "cpu",
            "--compare",
            "--runs",
            "1",
            "q6",
            "Q13",
        ],
        &[],
    );
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    assert!(out.contains("staged lineitem"), "{out}");
    assert!(out.contains("revenue"), "{out}");
    assert!(out.contains("custdist"), "{out}");
    assert!(out.contains("MemTable"), "{out}");
}

/// `query` writes results as CSV, JSON lines or an Arrow IPC stream, to stdout or one file per
/// query; a failing query prints its error, the others still run, and the exit status says so.
#[test]
fn query_writes_formats_and_goes_on_after_a_failure() {
    let dir = std::env::temp_dir().join(format!("arrow-cuda-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let base = ["query", "--tpch", "0.01", "--device", "cpu", "--runs", "1"];
    let q = "select n_nationkey, n_name from nation where n_nationkey < 3 order by n_nationkey";
    let csv = arrow_cuda(&[&base[..], &["--format", "csv", q]].concat(), &[]);
    assert!(csv.status.success(), "{}", text(&csv));
    assert_eq!(
        String::from_utf8_lossy(&csv.stdout),
        "n_nationkey,n_name\n0,ALGERIA\n1,ARGENTINA\n2,BRAZIL\n"
    );
    let out = dir.join("r.json");
    let json = arrow_cuda(
        &[
            &base[..],
            &["--format", "json", "--output", out.to_str().unwrap(), q, "q6"],
        ]
        .concat(),
        &[],
    );
    assert!(json.status.success(), "{}", text(&json));
    let first = std::fs::read_to_string(dir.join("r-1.json"));
    assert!(first.is_ok_and(|t| t.starts_with(r#"{"n_nationkey":0,"n_name":"ALGERIA"}"#)));
    assert!(
        std::fs::read_to_string(dir.join("r-q6.json"))
            .unwrap()
            .contains("revenue")
    );
    let arrow = dir.join("q6.arrows");
    let o = arrow_cuda(
        &[
            &base[..],
            &["--format", "arrow", "--output", arrow.to_str().unwrap(), "q6"],
        ]
        .concat(),
        &[],
    );
    assert!(o.status.success(), "{}", text(&o));
    let reader = arrow_ipc::reader::StreamReader::try_new(std::fs::File::open(&arrow).unwrap(), None).unwrap();
    let batches: Vec<_> = reader.map(Result::unwrap).collect();
    assert_eq!(batches.iter().map(|b| b.num_rows()).sum::<usize>(), 1);
    assert_eq!(batches[0].schema().field(0).name(), "revenue");
    let o = arrow_cuda(&[&base[..], &["select * from nowhere", "q6"]].concat(), &[]);
    assert!(!o.status.success(), "{}", text(&o));
    let out = text(&o);
    assert!(
        out.contains("select * from nowhere: error:") && out.contains("revenue"),
        "{out}"
    );
    assert!(out.contains("1 of 2 queries failed"), "{out}");
    // A directory of CSV files as one table named on the command line.
    let files = dir.join("files");
    std::fs::create_dir_all(&files).unwrap();
    std::fs::write(files.join("a.csv"), "k,v\n1,10\n2,20\n").unwrap();
    std::fs::write(files.join("b.csv"), "k,v\n3,30\n").unwrap();
    let table = format!("people={}", files.to_str().unwrap());
    let o = arrow_cuda(
        &[
            "query",
            "--device",
            "cpu",
            "--runs",
            "1",
            "--format",
            "csv",
            "--csv",
            &table,
            "select sum(v) as s from people",
        ],
        &[],
    );
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(String::from_utf8_lossy(&o.stdout), "s\n60\n");
    // DataFusion's regex, array, hash and math functions are there.
    let sql = "select regexp_like('abc', 'b') as r, array_length(make_array(1, 2, 3)) as n, md5('a') as h, \
               gcd(12, 18) as g from people limit 1";
    let o = arrow_cuda(
        &[
            "query", "--device", "cpu", "--runs", "1", "--format", "csv", "--csv", &table, sql,
        ],
        &[],
    );
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(
        String::from_utf8_lossy(&o.stdout),
        "r,n,h,g\ntrue,3,0cc175b9c0f1b6a831c399e269772661,6\n"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `query` stages Parquet files given with `--parquet` (and compares with DataFusion's read of
/// them), and files named by `CREATE EXTERNAL TABLE ... STORED AS GPU` in the queries, which run
/// once however many runs the queries get; a bad location fails that statement only.
#[test]
fn query_stages_files_from_the_command_line_and_from_sql() {
    use std::sync::Arc;
    let dir = std::env::temp_dir().join(format!("arrow-cuda-cli-files-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let csv = dir.join("people.csv");
    std::fs::write(&csv, "k,v\n1,10\n2,20\n3,30\n").unwrap();
    let parquet = dir.join("numbers.parquet");
    let values: arrow_array::ArrayRef = Arc::new(arrow_array::Int64Array::from_iter_values(0..1000));
    let batch = arrow_array::RecordBatch::try_from_iter([("x", values)]).unwrap();
    let mut w = datafusion::parquet::arrow::ArrowWriter::try_new(
        std::fs::File::create(&parquet).unwrap(),
        batch.schema(),
        None,
    )
    .unwrap();
    w.write(&batch).unwrap();
    w.close().unwrap();
    let create = format!(
        "create external table people stored as gpu location '{}' options ('has_header' 'true')",
        csv.display()
    );
    let missing = format!(
        "create external table nothing stored as gpu location '{}/nothing.parquet'",
        dir.display()
    );
    let base = ["query", "--device", "cpu", "--runs", "2", "--format", "csv"];
    let table = parquet.to_str().unwrap();
    let sum = "select sum(x) as s from numbers";
    let o = arrow_cuda(&[&base[..], &["--compare", "--parquet", table, sum]].concat(), &[]);
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    assert_eq!(String::from_utf8_lossy(&o.stdout), "s\n499500\n", "{out}");
    assert!(out.contains("staged numbers: 1000 rows"), "{out}");
    let sql = [create.as_str(), "select sum(v) as t from people", &missing];
    let o = arrow_cuda(&[&base[..], &sql].concat(), &[]);
    let out = text(&o);
    assert!(!o.status.success(), "{out}");
    assert_eq!(String::from_utf8_lossy(&o.stdout), "t\n60\n", "{out}");
    assert!(
        out.contains("does not exist") && out.contains("1 of 3 queries failed"),
        "{out}"
    );
    // A table made in SQL is staged as `--parquet` tables are: with its bar and its line.
    assert!(out.contains("staged people: 3 rows"), "{out}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// With no query and stdin not a terminal, `query` runs the statements it reads there as the
/// prompt would: statements over several lines ending at `;` (not at one in a string or comment),
/// `CREATE EXTERNAL TABLE ... STORED AS GPU`, `\d` and `\d NAME`, `\timing`; a failing statement
/// prints its error, the others still run, and the exit status says so. `--help` tells of it.
#[test]
fn query_reads_statements_from_stdin() {
    let o = arrow_cuda(&["query", "--help"], &[]);
    assert!(o.status.success(), "{}", text(&o));
    for words in ["interactive prompt", "\\d NAME", "\\timing", "\\q", "history"] {
        assert!(text(&o).contains(words), "{words}: {}", text(&o));
    }
    let dir = std::env::temp_dir().join(format!("arrow-cuda-cli-script-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let csv = dir.join("people.csv");
    std::fs::write(&csv, "k,name\n1,ann\n2,bob;\n3,cy\n").unwrap();
    let script = format!(
        "create external table people stored as gpu location '{}'
    options ('has_header' 'true');
\\d
\\d people
-- a comment; not a statement
select k, name -- the names; one has a ';'
from people
where name <> 'x;y'
order by k;
select * from nowhere;
\\timing
select count(*) as n from people; select max(k) as m
  from people
",
        csv.display()
    );
    let o = arrow_cuda_with_input(&["query", "--device", "cpu", "--format", "csv"], &script);
    let (stdout, stderr) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(!o.status.success(), "{}", text(&o));
    // `\d` lists the table with its rows and bytes (however many alignment takes).
    let (listing, rest) = stdout.split_at(stdout.find("column_name").unwrap_or(0));
    assert!(
        listing.starts_with("name,type,rows,bytes\npeople,GPU table on cpu,3,"),
        "{stdout}"
    );
    assert_eq!(
        rest,
        "column_name,data_type,is_nullable\nk,Int64,YES\nname,Utf8,YES\n\
         k,name\n1,ann\n2,bob;\n3,cy\n\
         n\n3\n\
         m\n3\n",
        "{stderr}"
    );
    // Times until `\timing` turns them off; the error of the failing statement; the count.
    assert!(stderr.contains("staged people: 3 rows"), "{stderr}");
    assert!(stderr.contains("3 rows in "), "{stderr}");
    assert!(!stderr.contains("1 row in "), "{stderr}");
    assert!(stderr.contains("error: ") && stderr.contains("nowhere"), "{stderr}");
    assert!(stderr.contains("timing is off"), "{stderr}");
    assert!(stderr.contains("1 of 8 statements failed"), "{stderr}");
    // Without the failing statement it succeeds; `\q` ends the script.
    let o = arrow_cuda_with_input(
        &[
            "query",
            "--device",
            "cpu",
            "--format",
            "csv",
            "--csv",
            csv.to_str().unwrap(),
        ],
        "select count(*) as n from people;\n\\q\nselect * from nowhere;\n",
    );
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(String::from_utf8_lossy(&o.stdout), "n\n3\n");
    let o = arrow_cuda_with_input(&["query", "--device", "cpu"], "\\d nowhere\n\\nothing\n");
    assert!(!o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("unknown command `\\nothing`"), "{}", text(&o));
    assert!(text(&o).contains("2 of 2 statements failed"), "{}", text(&o));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--compare` compares tables made by `CREATE EXTERNAL TABLE ... STORED AS GPU` too: MemTable
/// reads the same files, so both engines answer; rows that differ fail the query.
#[test]
fn compare_reads_tables_created_in_sql() {
    let dir = std::env::temp_dir().join(format!("arrow-cuda-cli-compare-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let csv = dir.join("t.csv");
    std::fs::write(&csv, "k,v\n1,10\n2,20\n3,30\n").unwrap();
    let create = format!(
        "create external table t stored as gpu location '{}' options ('has_header' 'true')",
        csv.display()
    );
    let base = [
        "query",
        "--device",
        "cpu",
        "--compare",
        "--runs",
        "1",
        "--format",
        "csv",
    ];
    let o = arrow_cuda(
        &[&base[..], &[&create, "select k, v from t where v > 10"]].concat(),
        &[],
    );
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    assert_eq!(String::from_utf8_lossy(&o.stdout), "k,v\n2,20\n3,30\n", "{out}");
    assert!(out.contains("2 rows in ") && out.contains("on MemTable"), "{out}");
    // The same from stdin, and a result no two runs share: a difference is an error.
    let o = arrow_cuda_with_input(
        &base,
        &format!("{create};\nselect sum(v) as s from t;\nselect random() as r;\n"),
    );
    let out = text(&o);
    assert!(!o.status.success(), "{out}");
    assert!(String::from_utf8_lossy(&o.stdout).starts_with("s\n60\n"), "{out}");
    assert!(
        out.contains("rows differ from MemTable's") && out.contains("1 of 3 statements failed"),
        "{out}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `bench` prints one table with transfer (GPU only), IPC and TPC-H rows (every query).
#[test]
fn bench_prints_one_table() {
    let mut args = vec!["bench", "--seconds", "0.05", "--sf", "0.01"];
    if !gpu() {
        args.extend(["--rows", "4096"]);
    }
    let o = arrow_cuda(&args, &[("ARROW_CUDA_BENCH_CPU", "1")]);
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        stdout.starts_with("| what | arrow-cuda | comparison | unit |"),
        "{stdout}"
    );
    let rows: Vec<&str> = stdout
        .lines()
        .filter(|l| l.starts_with("| ") && !l.starts_with("| what"))
        .collect();
    // Transfers (GPU only), two IPC rows, the 22 TPC-H queries and their sum.
    let expected = if gpu() { 4 + 2 + 23 } else { 2 + 23 };
    assert_eq!(rows.len(), expected, "{stdout}");
    for label in [
        "IPC one-way latency",
        "IPC streaming",
        "TPC-H Q1,",
        "TPC-H Q22,",
        "all 22 queries",
    ] {
        assert!(rows.iter().any(|r| r.contains(label)), "{label}: {stdout}");
    }
    assert!(stdout.contains("geometric mean"), "{stdout}");
    assert!(!stdout.contains("differs"), "{stdout}");
}

/// `recv` gives up on a sender that sends nothing: after `--timeout` seconds (60 unless set, as
/// `--help` says) it fails with a timeout in one line instead of waiting without end.
#[test]
fn recv_times_out_on_a_silent_sender() {
    let o = arrow_cuda(&["recv", "--help"], &[]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("--timeout") && text(&o).contains("[default: 60]"),
        "{}",
        text(&o)
    );
    let socket = std::env::temp_dir().join(format!("arrow-cuda-cli-{}-silent.sock", std::process::id()));
    let _ = std::fs::remove_file(&socket);
    let schema = std::sync::Arc::new(arrow_schema::Schema::new(vec![arrow_schema::Field::new(
        "x",
        arrow_schema::DataType::Int64,
        false,
    )]));
    let sender = arrow_cuda::ipc::Sender::bind(&socket, schema, Default::default()).unwrap();
    let o = arrow_cuda(&["recv", "--socket", socket.to_str().unwrap(), "--timeout", "1"], &[]);
    drop(sender);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{}", text(&o));
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("none came within 1s") && stderr.contains("--timeout"),
        "{stderr}"
    );
}

/// Without `--socket`, `send` and `recv` meet in a directory only this user can enter: made with
/// mode 0700 under `XDG_RUNTIME_DIR`, and refused when others can enter it (another user may have
/// made it first).
#[test]
fn the_default_socket_is_in_a_private_directory() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let o = arrow_cuda(&["recv", "--help"], &[]);
    assert!(text(&o).contains("XDG_RUNTIME_DIR"), "{}", text(&o));
    let runtime = std::env::temp_dir().join(format!("arrow-cuda-cli-{}-runtime", std::process::id()));
    let _ = std::fs::remove_dir_all(&runtime);
    std::fs::create_dir_all(&runtime).unwrap();
    let send = [
        "send",
        "--device",
        "cpu",
        "--batches",
        "1",
        "--rows",
        "10",
        "--wait",
        "1",
    ];
    let env = [("XDG_RUNTIME_DIR", runtime.to_str().unwrap())];
    // No receiver comes, so it fails after a second, having listened in the private directory.
    let o = arrow_cuda(&send, &env);
    assert!(!o.status.success(), "{}", text(&o));
    let dir = runtime.join("arrow-cuda");
    let socket = dir.join("arrow-cuda.sock");
    assert!(text(&o).contains(&format!("on {}", socket.display())), "{}", text(&o));
    assert_eq!(std::fs::metadata(&dir).unwrap().mode() & 0o777, 0o700);
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    let o = arrow_cuda(&send, &env);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{}", text(&o));
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(stderr.contains("mode is 777"), "{stderr}");
    std::fs::remove_dir_all(&runtime).unwrap();
}
