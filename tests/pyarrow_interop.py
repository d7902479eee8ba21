"""pyarrow <-> arrow-cuda through the Arrow C Device Data Interface.

Run by tests/pyarrow_interop.rs as `python3 tests/pyarrow_interop.py <path to the ffi-helper cdylib>`.
Sends a pyarrow array of every type pyarrow can build (with nulls, sliced, empty) through
`arrow_cuda_roundtrip_array` (our importer, our transfer engine on every device, our exporter)
and back, and whole record batches through `arrow_cuda_roundtrip_batch`; imports batches and
arrays that arrow-cuda built and exported. Exits non-zero on the first difference.
"""

import ctypes
import datetime
import decimal
import struct
import sys

import pyarrow as pa

ARROW_DEVICE_ARRAY_SIZE = 128
ARROW_SCHEMA_SIZE = 72
ARROW_DEVICE_CPU = 1
N = 23  # rows of every array: not a multiple of 8, so slices cross byte boundaries


def new_device_array():
    """Zeroed, 8-byte aligned room for a struct ArrowDeviceArray."""
    return (ctypes.c_uint64 * (ARROW_DEVICE_ARRAY_SIZE // 8))()


def new_schema():
    """Zeroed, 8-byte aligned room for a struct ArrowSchema."""
    return (ctypes.c_uint64 * (ARROW_SCHEMA_SIZE // 8))()


def addr(buf):
    return ctypes.addressof(buf)


def release_callback(buf, offset):
    """The release pointer at `offset` (a released struct has none)."""
    return struct.unpack_from("<Q", bytes(buf), offset)[0]


class Helper:
    def __init__(self, path):
        lib = ctypes.CDLL(path)
        p = ctypes.c_void_p
        for name in ("arrow_cuda_roundtrip_array", "arrow_cuda_roundtrip_batch"):
            getattr(lib, name).argtypes = [p, p, p, p]
            getattr(lib, name).restype = ctypes.c_int
        lib.arrow_cuda_export_sample_batch.argtypes = [ctypes.c_int64, ctypes.c_int64, p, p]
        lib.arrow_cuda_export_sample_batch.restype = ctypes.c_int
        lib.arrow_cuda_export_sample_column.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, p, p]
        lib.arrow_cuda_export_sample_column.restype = ctypes.c_int
        lib.arrow_cuda_ffi_last_error.argtypes = []
        lib.arrow_cuda_ffi_last_error.restype = ctypes.c_char_p
        lib.arrow_cuda_ffi_cuda_available.argtypes = []
        lib.arrow_cuda_ffi_cuda_available.restype = ctypes.c_int
        self.lib = lib

    def check(self, code, what):
        if code != 0:
            message = self.lib.arrow_cuda_ffi_last_error().decode("utf-8", "replace")
            raise AssertionError(f"{what}: arrow-cuda returned {code}: {message}")

    def roundtrip(self, obj, what):
        """Exports `obj` (an Array or RecordBatch) with pyarrow, sends it through arrow-cuda and
        imports what comes back with pyarrow."""
        is_batch = isinstance(obj, pa.RecordBatch)
        in_array, in_schema = new_device_array(), new_schema()
        out_array, out_schema = new_device_array(), new_schema()
        obj._export_to_c_device(addr(in_array), addr(in_schema))
        f = self.lib.arrow_cuda_roundtrip_batch if is_batch else self.lib.arrow_cuda_roundtrip_array
        code = f(addr(in_array), addr(in_schema), addr(out_array), addr(out_schema))
        # The inputs were moved out of, whatever happened.
        assert release_callback(in_array, 64) == 0, f"{what}: input array not moved out of"
        assert release_callback(in_schema, 56) == 0, f"{what}: input schema not moved out of"
        self.check(code, what)
        check_header(out_array, what)
        cls = pa.RecordBatch if is_batch else pa.Array
        return cls._import_from_c_device(addr(out_array), addr(out_schema))

    def sample_batch(self, offset, length):
        out_array, out_schema = new_device_array(), new_schema()
        self.check(
            self.lib.arrow_cuda_export_sample_batch(offset, length, addr(out_array), addr(out_schema)),
            f"sample batch [{offset}, +{length}]",
        )
        check_header(out_array, "sample batch")
        return pa.RecordBatch._import_from_c_device(addr(out_array), addr(out_schema))

    def sample_column(self, column, offset, length):
        out_array, out_schema = new_device_array(), new_schema()
        self.check(
            self.lib.arrow_cuda_export_sample_column(column, offset, length, addr(out_array), addr(out_schema)),
            f"sample column {column} [{offset}, +{length}]",
        )
        check_header(out_array, "sample column")
        return pa.Array._import_from_c_device(addr(out_array), addr(out_schema))


def check_header(buf, what):
    """Our exports are CPU arrays: device type CPU, id -1, no sync event, reserved zero."""
    device_id, device_type, sync_event, r0, r1, r2 = struct.unpack_from("<qi4xQqqq", bytes(buf), 80)
    assert device_type == ARROW_DEVICE_CPU, f"{what}: device type {device_type}"
    assert device_id == -1, f"{what}: device id {device_id}"
    assert sync_event == 0, f"{what}: sync event {sync_event:#x} on a CPU array"
    assert (r0, r1, r2) == (0, 0, 0), f"{what}: reserved {(r0, r1, r2)}"


# ----------------------------------------------------------------------------------------------
# Every type pyarrow can build, N rows each, with nulls.


def valid(i, seed=0):
    return (i * 7 + seed * 3) % 5 != 1


def values(f, seed=0):
    return [f(i) if valid(i, seed) else None for i in range(N)]


def text(i):
    return ("abcdefghijklmnopqrstuvwxyz" * 3)[i % 7 : i % 7 + (i * 5) % 31]


def float16_array():
    # pyarrow converts Python floats to half floats only through numpy; build the buffers directly.
    data = struct.pack(f"<{N}e", *[i * 0.5 - 3 for i in range(N)])
    validity = pa.array([valid(i, 4) for i in range(N)], pa.bool_()).buffers()[1]
    return pa.Array.from_buffers(pa.float16(), N, [validity, pa.py_buffer(data)])


def arrays():
    """(name, array) for every type."""
    out = []

    def add(name, make):
        try:
            out.append((name, make()))
        except (pa.ArrowNotImplementedError, NotImplementedError, TypeError) as e:
            # Only where pyarrow itself cannot build the array; say so.
            print(f"skipped {name}: pyarrow cannot build it ({e})")

    add("null", lambda: pa.nulls(N))
    add("bool", lambda: pa.array(values(lambda i: i % 3 == 0, 1), pa.bool_()))
    for t, lo in [
        (pa.int8(), -100),
        (pa.int16(), -30000),
        (pa.int32(), -(2**31)),
        (pa.int64(), -(2**63)),
        (pa.uint8(), 0),
        (pa.uint16(), 0),
        (pa.uint32(), 0),
        (pa.uint64(), 0),
    ]:
        add(str(t), lambda t=t, lo=lo: pa.array(values(lambda i: lo + i * 3, 2), t))
    add("float16", float16_array)
    add("float32", lambda: pa.array(values(lambda i: i / 4, 5), pa.float32()))
    add("float64", lambda: pa.array(values(lambda i: i / 3, 6), pa.float64()))
    for name, t, scale in [
        ("decimal32", getattr(pa, "decimal32", None), 2),
        ("decimal64", getattr(pa, "decimal64", None), 4),
        ("decimal128", pa.decimal128, 10),
        ("decimal256", pa.decimal256, 3),
    ]:
        if t is None:
            print(f"skipped {name}: this pyarrow has no such type")
            continue
        precision = {"decimal32": 9, "decimal64": 18, "decimal128": 38, "decimal256": 76}[name]
        add(
            name,
            lambda t=t, precision=precision, scale=scale: pa.array(
                values(lambda i: decimal.Decimal(i * 1234 - 5000).scaleb(-scale), 7), t(precision, scale)
            ),
        )
    add("date32", lambda: pa.array(values(lambda i: datetime.date(1970, 1, 1) + datetime.timedelta(days=i * 400 - 3000), 8), pa.date32()))
    add("date64", lambda: pa.array(values(lambda i: datetime.date(2000, 1, 1) + datetime.timedelta(days=i * 37), 9), pa.date64()))
    add("time32[s]", lambda: pa.array(values(lambda i: i * 3000, 10), pa.time32("s")))
    add("time32[ms]", lambda: pa.array(values(lambda i: i * 3_000_017, 11), pa.time32("ms")))
    add("time64[us]", lambda: pa.array(values(lambda i: i * 3_000_000_017, 12), pa.time64("us")))
    add("time64[ns]", lambda: pa.array(values(lambda i: i * 3_000_000_000_017, 13), pa.time64("ns")))
    for unit in ("s", "ms", "us", "ns"):
        for tz in (None, "UTC", "+05:30", "America/New_York"):
            add(f"timestamp[{unit}, {tz}]", lambda unit=unit, tz=tz: pa.array(values(lambda i: i * 1_000_003 - 7, 14), pa.timestamp(unit, tz)))
        add(f"duration[{unit}]", lambda unit=unit: pa.array(values(lambda i: i * 999 - 5000, 15), pa.duration(unit)))
    add(
        "month_day_nano_interval",
        lambda: pa.array(values(lambda i: (i, -i, i * 1_000_000_007), 16), pa.month_day_nano_interval()),
    )
    add("binary", lambda: pa.array(values(lambda i: text(i).encode(), 17), pa.binary()))
    add("large_binary", lambda: pa.array(values(lambda i: text(i).encode(), 18), pa.large_binary()))
    add("binary_view", lambda: pa.array(values(lambda i: text(i).encode(), 19), pa.binary_view()))
    add("string", lambda: pa.array(values(text, 20), pa.string()))
    add("large_string", lambda: pa.array(values(text, 21), pa.large_string()))
    add("string_view", lambda: pa.array(values(text, 22), pa.string_view()))
    add("fixed_size_binary", lambda: pa.array(values(lambda i: bytes([i, i + 1, i + 2, 255 - i]), 23), pa.binary(4)))
    int_lists = values(lambda i: [j if valid(i + j, 3) else None for j in range(i % 4)], 24)
    add("list<int32>", lambda: pa.array(int_lists, pa.list_(pa.int32())))
    add("large_list<string>", lambda: pa.array(values(lambda i: [text(i + j) for j in range(i % 3)], 25), pa.large_list(pa.string())))
    add("fixed_size_list<int32, 3>", lambda: pa.array(values(lambda i: [i, None if i % 4 == 0 else i + 1, i + 2], 26), pa.list_(pa.int32(), 3)))
    add("list_view<int32>", lambda: pa.array(int_lists, pa.list_view(pa.int32())))
    add("large_list_view<string>", lambda: pa.array(values(lambda i: [text(i + j) for j in range(i % 3)], 27), pa.large_list_view(pa.string())))
    inner = pa.struct([("x", pa.string()), ("y", pa.float64())])
    add(
        "list<struct>",
        lambda: pa.array(values(lambda i: [{"x": text(i + j), "y": None if j == 1 else j / 2} for j in range(i % 3)], 28), pa.list_(inner)),
    )
    nested = pa.struct([("a", pa.int32()), ("b", pa.string()), ("c", pa.struct([("d", pa.bool_()), ("e", pa.int16())]))])
    add(
        "struct",
        lambda: pa.array(
            values(lambda i: {"a": i if i % 3 else None, "b": text(i), "c": None if i % 6 == 0 else {"d": i % 2 == 0, "e": i}}, 29),
            nested,
        ),
    )
    add("map<string, int32>", lambda: pa.array(values(lambda i: [(f"k{i}-{j}", None if j == 1 else i * j) for j in range(i % 4)], 30), pa.map_(pa.string(), pa.int32())))
    add("dense_union", dense_union)
    add("sparse_union", sparse_union)
    dictionary = pa.array(["red", "green", None, "a longer dictionary value"], pa.string())
    for index in (pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.uint8(), pa.uint16(), pa.uint32(), pa.uint64()):
        add(
            f"dictionary<{index}, string>",
            lambda index=index: pa.DictionaryArray.from_arrays(pa.array(values(lambda i: i % 4, 31), index), dictionary),
        )
    add(
        "dictionary<int32, list<int32>>",
        lambda: pa.DictionaryArray.from_arrays(pa.array(values(lambda i: i % 5, 32), pa.int32()), pa.array(int_lists[:5], pa.list_(pa.int32()))),
    )
    for run_end in (pa.int16(), pa.int32(), pa.int64()):
        add(f"run_end_encoded<{run_end}, string>", lambda run_end=run_end: run_end_encoded(run_end))
    # Extension types travel as their storage with metadata on the field.
    if hasattr(pa, "uuid"):
        add("extension<uuid>", lambda: pa.array(values(lambda i: bytes(range(i, i + 16)), 33), pa.uuid()))
    if hasattr(pa, "json_"):
        add("extension<json>", lambda: pa.array(values(lambda i: f'{{"i": {i}}}', 34), pa.json_()))
    if hasattr(pa, "bool8"):
        add("extension<bool8>", lambda: pa.ExtensionArray.from_storage(pa.bool8(), pa.array(values(lambda i: i % 3, 35), pa.int8())))
    if hasattr(pa, "fixed_shape_tensor"):
        add(
            "extension<fixed_shape_tensor>",
            lambda: pa.ExtensionArray.from_storage(
                pa.fixed_shape_tensor(pa.int32(), [2, 2]), pa.array(values(lambda i: [i, i + 1, i + 2, i + 3], 36), pa.list_(pa.int32(), 4))
            ),
        )
    return out


def dense_union():
    types = pa.array([i % 3 for i in range(N)], pa.int8())
    counts = [0, 0, 0]
    offsets = []
    for i in range(N):
        offsets.append(counts[i % 3])
        counts[i % 3] += 1
    children = [
        pa.array([i if valid(i, 40) else None for i in range(counts[0])], pa.int32()),
        pa.array([text(i) if valid(i, 41) else None for i in range(counts[1])], pa.string()),
        pa.array([[i, i] if valid(i, 42) else None for i in range(counts[2])], pa.list_(pa.int64())),
    ]
    return pa.UnionArray.from_dense(types, pa.array(offsets, pa.int32()), children, ["i", "s", "l"], [0, 1, 2])


def sparse_union():
    # Type codes that are not 0..n.
    types = pa.array([[3, 7, 11][i % 3] for i in range(N)], pa.int8())
    children = [
        pa.array(values(lambda i: i, 43), pa.int32()),
        pa.array(values(text, 44), pa.string()),
        pa.array(values(lambda i: i / 8, 45), pa.float64()),
    ]
    return pa.UnionArray.from_sparse(types, children, ["i", "s", "f"], [3, 7, 11])


def run_end_encoded(run_end_type):
    ends = []
    end = 0
    while end < N:
        end = min(N, end + 1 + (end * 7) % 4)
        ends.append(end)
    run_values = pa.array([text(i) if valid(i, 46) else None for i in range(len(ends))], pa.string())
    return pa.RunEndEncodedArray.from_arrays(pa.array(ends, run_end_type), run_values)


# ----------------------------------------------------------------------------------------------
# The checks.


def pyarrow_imports_empty_view_slices():
    """Whether pyarrow can import its own export of an empty string view slice at an offset.

    pyarrow 26 cannot: it imports the views buffer of a zero-length array as null, and then its
    validation wants `offset * 16` bytes of it ("View buffer size (bytes): 0 isn't large enough for
    length: 0 and offset: 10")."""
    a = pa.array(["a string longer than twelve"] * 10, pa.string_view()).slice(10, 0)
    array, schema = new_device_array(), new_schema()
    a._export_to_c_device(addr(array), addr(schema))
    try:
        pa.Array._import_from_c_device(addr(array), addr(schema)).validate(full=True)
        return True
    except pa.ArrowInvalid:
        return False


PYARROW_IMPORTS_EMPTY_VIEW_SLICES = pyarrow_imports_empty_view_slices()


def has_views(t):
    if t in (pa.string_view(), pa.binary_view()):
        return True
    if isinstance(t, pa.ExtensionType):
        return has_views(t.storage_type)
    return any(has_views(t.field(i).type) for i in range(t.num_fields))


def validate(array, what):
    if len(array) == 0 and array.offset > 0 and has_views(array.type) and not PYARROW_IMPORTS_EMPTY_VIEW_SLICES:
        print(f"{what}: not validated (pyarrow's own empty view slices fail its validation)")
        return
    array.validate(full=True)


def assert_same(back, expected, what):
    assert back.type == expected.type, f"{what}: type {back.type} != {expected.type}"
    assert len(back) == len(expected), f"{what}: length {len(back)} != {len(expected)}"
    assert back.null_count == expected.null_count, f"{what}: null count {back.null_count} != {expected.null_count}"
    validate(back, what)
    assert back.equals(expected), f"{what}: values differ\n  got {back.to_pylist()}\n  expected {expected.to_pylist()}"


def built_empty(array):
    """An empty array of `array`'s type built from nothing (pyarrow may leave its buffers null)."""
    try:
        return pa.array([], array.type)
    except (pa.ArrowNotImplementedError, pa.ArrowInvalid, TypeError):
        return array.take(pa.array([], pa.int32()))


def slices(length):
    cuts = [(0, length), (1, length - 2), (3, 2), (8, 9), (9, length - 9), (length - 1, 1), (0, 0), (length, 0), (5, 0)]
    return [(o, n) for o, n in cuts if 0 <= o <= length and n >= 0 and o + n <= length]


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: pyarrow_interop.py <path to libarrow_cuda_ffi_helper>")
    helper = Helper(sys.argv[1])
    print(f"pyarrow {pa.__version__}; CUDA round trips: {'yes' if helper.lib.arrow_cuda_ffi_cuda_available() else 'no'}")
    every = arrays()
    assert len(every) > 60, f"only {len(every)} arrays"

    # Every type, whole, sliced (byte and bit offsets), empty, and a slice of a slice.
    checked = 0
    for name, array in every:
        assert len(array) == N, name
        array.validate(full=True)
        assert array.null_count > 0 or name.startswith(("dense_union", "sparse_union", "run_end")), f"{name} has no nulls"
        for offset, length in slices(N):
            expected = array.slice(offset, length)
            back = helper.roundtrip(expected, f"{name}[{offset}:+{length}]")
            assert_same(back, expected, f"{name}[{offset}:+{length}]")
            checked += 1
        twice = array.slice(2, 19).slice(5, 9)
        assert_same(helper.roundtrip(twice, f"{name} sliced twice"), twice, f"{name} sliced twice")
        empty = built_empty(array)
        assert_same(helper.roundtrip(empty, f"{name} built empty"), empty, f"{name} built empty")
        checked += 2
    print(f"{checked} arrays of {len(every)} types round-tripped")

    # Whole batches, with schema and field metadata, sliced and empty.
    fields = [pa.field(name, array.type, metadata={"type": str(array.type)}) for name, array in every]
    schema = pa.schema(fields, metadata={"producer": "pyarrow", "rows": str(N)})
    batch = pa.RecordBatch.from_arrays([array for _, array in every], schema=schema)
    for offset, length in [(0, N), (3, 11), (9, 0), (N - 1, 1)]:
        expected = batch.slice(offset, length)
        what = f"batch[{offset}:+{length}]"
        back = helper.roundtrip(expected, what)
        assert back.schema.equals(expected.schema, check_metadata=True), f"{what}: schema\n{back.schema}\n!=\n{expected.schema}"
        assert back.num_rows == expected.num_rows, what
        back.validate(full=True)
        for i, (name, _) in enumerate(every):
            assert_same(back.column(i), expected.column(i), f"{what} column {name}")
        assert back.equals(expected), what
    no_columns = pa.RecordBatch.from_arrays([], schema=pa.schema([], metadata={"k": "v"}))
    back = helper.roundtrip(no_columns, "batch without columns")
    assert back.num_columns == 0 and back.num_rows == 0 and back.schema.metadata == {b"k": b"v"}
    print("batches round-tripped")

    # Arrays and batches that arrow-cuda built and exported (sliced on its side: offsets in the export).
    expected = sample_batch()
    for offset, length in [(0, 10), (0, 0), (3, 5), (9, 1), (10, 0)]:
        what = f"arrow-cuda's batch[{offset}:+{length}]"
        got = helper.sample_batch(offset, length)
        want = expected.slice(offset, length)
        assert got.schema.equals(want.schema, check_metadata=True), f"{what}: schema\n{got.schema}\n!=\n{want.schema}"
        for i in range(want.num_columns):
            assert_same(got.column(i), want.column(i), f"{what} column {want.schema.field(i).name}")
        for i in range(want.num_columns):
            column = helper.sample_column(i, offset, length)
            assert_same(column, want.column(i), f"arrow-cuda's column {i}[{offset}:+{length}]")
    print("arrow-cuda's exports imported")

    # Errors come back as errors: a batch whose struct has nulls is not a batch.
    in_array, in_schema = new_device_array(), new_schema()
    pa.array([{"a": 1}, None], pa.struct([("a", pa.int64())]))._export_to_c_device(addr(in_array), addr(in_schema))
    out_array, out_schema = new_device_array(), new_schema()
    code = helper.lib.arrow_cuda_roundtrip_batch(addr(in_array), addr(in_schema), addr(out_array), addr(out_schema))
    assert code != 0, "a struct with null rows imported as a batch"
    message = helper.lib.arrow_cuda_ffi_last_error().decode()
    assert "null" in message, message
    assert release_callback(out_array, 64) == 0, "output written on error"
    print(f"errors reported: {message}")
    print("ok")


def sample_batch():
    """The batch that ffi-helper's `sample_batch` builds in Rust."""
    x = [None if i % 3 == 0 else i * 0.5 for i in range(10)]
    y = [None if i % 4 == 2 else i % 2 == 0 for i in range(10)]
    structs = pa.StructArray.from_arrays(
        [pa.array(x, pa.float64()), pa.array(y, pa.bool_())],
        fields=[pa.field("x", pa.float64()), pa.field("y", pa.bool_())],
        mask=pa.array([i == 5 for i in range(10)]),
    )
    lists = []
    for i in range(10):
        lists.append(None if i % 4 == 1 else [None if j == 1 else i * 10 + j for j in range(i % 3)])
    columns = {
        "i": pa.array([1, None, 3, -4, None, 6, 7, 2**31 - 1, -(2**31), 10], pa.int32()),
        "s": pa.array(["a", "bb", None, "", "a string longer than twelve bytes", "é", None, "x", "yz", "last"], pa.string()),
        "l": pa.array(lists, pa.list_(pa.int64())),
        "st": structs,
        "d": pa.DictionaryArray.from_arrays(
            pa.array([0, 1, None, 2, 0, 0, 1, None, 2, 1], pa.int8()), pa.array(["red", "green", "blue"])
        ),
        "v": pa.array([None if i % 3 == 2 else f"view number {i} of the sample batch" for i in range(10)], pa.string_view()),
        "ts": pa.array([None if i == 3 else 1_700_000_000_000_000 + i for i in range(10)], pa.timestamp("us", "UTC")),
        "dec": pa.array(
            [None if i == 7 else decimal.Decimal(i * 12345 - 50_000).scaleb(-2) for i in range(10)], pa.decimal128(10, 2)
        ),
    }
    schema = pa.schema([pa.field(n, a.type) for n, a in columns.items()], metadata={"producer": "arrow-cuda"})
    return pa.RecordBatch.from_arrays(list(columns.values()), schema=schema)


if __name__ == "__main__":
    main()
