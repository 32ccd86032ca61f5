"""An exact, seeded shuffle of a data set larger than memory: keys, buckets and two passes.

Every row gets a 64-bit key that only the seed and the row's place in the source decide: the i-th
output of splitmix64 seeded with the seed, where i = (file index << 40) + the row's index among its
file's good rows. (Not the row's index in the whole data set: that needs every earlier file's row
count before a file's keys can be made, so a counting pass or files parsed one after another.
(file, row) is as fixed by the source, and lets every file be parsed on its own.) The keys are
distinct (splitmix64 is a bijection of i), so sorting by key orders the rows one way only.

Pass 1 parses each source file (a process per file, up to the CPUs) and appends its rows, key
first, to one of 2**bits buckets by the key's top bits: Arrow IPC streams in a local folder. Pass 2
takes the buckets in key order, sorts each by key and yields the rows. The order, and so the shards,
depend on the source and the seed only: not on the number of processes, batch sizes or buckets.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import multiprocessing
import os
import resource
from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from elastic_step.data.parse import RESTART, BadRows, NonFinite, SourceFile, conform, file_format, treat_non_finite
from elastic_step.errors import DataError
from elastic_step.util.storage import protocols

# Pass 2 sorts a unit of at most this much at once (held twice: as read and sorted); pass 1 buffers
# as much per process before appending to the bucket files. Together with pyarrow's read-ahead they
# bound memory. The unit is about a 64th of the source, at least MIN_UNIT_BYTES (`unit_bytes`).
SORT_BYTES = 32 << 20
SPILL_BUFFER_BYTES = 32 << 20
MIN_UNIT_BYTES = 8 << 20
MAX_BUCKET_BITS = 10  # <= 1024 buckets; a bucket past the unit is split again in pass 2
# Below this much source, starting processes (~0.5 s each) costs more than it saves.
PARALLEL_MIN_BYTES = 32 << 20
ROW_BITS, FILE_BITS = 40, 24

_GAMMA = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1


def _mix(z):
    """splitmix64's finalizer: a bijection of 64-bit integers (Python ints or uint64 arrays)."""
    if isinstance(z, int):
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        return z ^ (z >> 31)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)  # uint64 arrays wrap mod 2**64
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def row_keys(seed: int, file_index: int, start: int, count: int) -> np.ndarray:
    """The keys of rows [start, start + count) of file `file_index`, as uint64."""
    if not 0 <= file_index < 1 << FILE_BITS or start + count > 1 << ROW_BITS:
        raise DataError(
            f"A source of more than {1 << FILE_BITS} files or {1 << ROW_BITS} rows in one file is "
            "more than data prep handles; split it."
        )
    # The seed is mixed first so that seeds a multiple of the gamma apart do not give shifted keys.
    first = (_mix(seed & _MASK) + ((file_index << ROW_BITS) + start + 1) * _GAMMA) & _MASK
    with np.errstate(over="ignore"):
        z = np.arange(count, dtype=np.uint64) * np.uint64(_GAMMA) + np.uint64(first)
        return _mix(z)


def _in_memory(files: list[tuple[str, int]]) -> int:
    """A guess of the size in memory of [(path, size)]: a CSV's numbers take up to ~2x their text,
    compressed Parquet ~4x. Pass 2 sorts small buckets together and splits big ones, so a wrong guess
    costs time, not memory."""
    return sum(size * (4 if file_format(path) == "parquet" else 2) for path, size in files)


def unit_bytes(files: list[tuple[str, int]]) -> int:
    """The sort unit (and spill buffer) for [(path, size)]: a 64th of the source in memory, between
    MIN_UNIT_BYTES and SORT_BYTES. Every flush appends a batch to every bucket, so the appends grow
    as (source / unit)^2: at 8 MB a 2 GB source made 150,000 and prep ran at 0.41x a plain read; at
    32 MB 9,000, and 0.54x (peak RSS +70 MB). A small source keeps small units: parsing, sorting and
    writing then overlap more (100 MB: 2.1 s at 8 MB, 2.5 s at 32 MB)."""
    return int(min(SORT_BYTES, max(MIN_UNIT_BYTES, _in_memory(files) // 64)))


def bucket_bits(files: list[tuple[str, int]]) -> int:
    """log2 of the bucket count for [(path, size)]: a bucket about a sort unit in memory."""
    # A process keeps a file open per bucket: stay within a quarter of its limit on open files.
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    most = (
        MAX_BUCKET_BITS if limit == resource.RLIM_INFINITY else min(MAX_BUCKET_BITS, int(math.log2(max(limit, 4) / 4)))
    )
    return min(most, max(0, math.ceil(math.log2(max(_in_memory(files), 1) / unit_bytes(files)))))


def _bucket_of(keys: np.ndarray, used: int, bits: int) -> np.ndarray:
    """The `bits` bits of each key after its top `used` bits, as uint16 (numpy sorts those by radix)."""
    if bits == 0:
        return np.zeros(len(keys), dtype=np.uint16)
    top = keys << np.uint64(used) if used else keys
    return (top >> np.uint64(64 - bits)).astype(np.uint16)


class _Buckets:
    """Rows, key first, appended to FOLDER/<bucket>/<pid>.arrow by bits [used, used + bits) of their key.

    A process's rows go to files of its own, through one Arrow IPC stream per bucket left open while
    the file is read (a schema message per flush would outweigh the rows of a wide table), and a new
    stream where a JSON file's chunk changes the schema. `forget` truncates the files back to where
    this source file began; `close` ends the streams."""

    def __init__(self, folder: str, used: int, bits: int, unit: int):
        self.folder, self.used, self.bits = folder, used, bits
        self.buffer_bytes = min(unit, SPILL_BUFFER_BYTES)  # rows held before they are appended
        n = 1 << bits
        self.rows = np.zeros(n, dtype=np.int64)
        self.bytes = np.zeros(n, dtype=np.int64)
        self._pending: list[tuple[pa.Table, np.ndarray]] = []  # (rows, their buckets), not yet written
        self._pending_bytes = 0
        self._started: dict[int, int] = {}  # bucket -> its file's size before this file's rows
        self._streams: dict[int, tuple[pa.NativeFile, ipc.RecordBatchStreamWriter, pa.Schema]] = {}

    def path(self, bucket: int) -> str:
        return os.path.join(self.folder, f"{bucket:04d}", f"{os.getpid()}.arrow")

    def add(self, table: pa.Table, keys: np.ndarray) -> None:
        table = pa.Table.from_arrays([pa.array(keys, pa.uint64())] + table.columns, names=["key"] + table.column_names)
        self._pending.append((table, _bucket_of(keys, self.used, self.bits)))
        self._pending_bytes += table.nbytes
        if self._pending_bytes > self.buffer_bytes:
            self.flush()

    def flush(self) -> None:
        """The pending rows, ordered by bucket in one take, to each bucket's stream as one batch."""
        while self._pending:
            schema = self._pending[0][0].schema  # a JSON file's chunks may differ: a schema at a time
            same = [p for p in self._pending if p[0].schema.equals(schema)]
            self._pending = [p for p in self._pending if not p[0].schema.equals(schema)]
            table = pa.concat_tables([t for t, _ in same])
            buckets = np.concatenate([b for _, b in same])
            counts = np.bincount(buckets, minlength=len(self.rows))
            if self.bits:
                # Indices as an Arrow array: take converts a numpy one slowly (~8x the take itself);
                # so given, it is faster on the chunks than on them combined (a copy) first.
                table = table.take(pa.array(np.argsort(buckets, kind="stable")))
            self.rows += counts
            self.bytes += (counts * (table.nbytes / table.num_rows)).astype(np.int64)
            ends = np.cumsum(counts)
            for b in np.flatnonzero(counts):
                self._stream(b, schema).write_table(table.slice(ends[b] - counts[b], counts[b]))
        self._pending_bytes = 0

    def close(self) -> None:
        self.flush()
        self.end_streams()

    def _stream(self, bucket: int, schema: pa.Schema) -> ipc.RecordBatchStreamWriter:
        entry = self._streams.get(bucket)
        if entry is not None and entry[2].equals(schema):
            return entry[1]
        if entry is not None:
            entry[1].close()
            entry[0].close()
        path = self.path(bucket)
        if bucket not in self._started:
            self._started[bucket] = os.path.getsize(path) if os.path.exists(path) else 0
        f = pa.OSFile(path, "ab")
        writer = ipc.new_stream(f, schema)
        self._streams[bucket] = (f, writer, schema)
        return writer

    def end_streams(self) -> None:
        for f, writer, _ in self._streams.values():
            writer.close()
            f.close()
        self._streams.clear()

    def forget(self) -> None:
        self.end_streams()
        for b, size in self._started.items():
            os.truncate(self.path(b), size)
        self._started.clear()
        self._pending = []
        self._pending_bytes = 0
        self.rows[:] = 0
        self.bytes[:] = 0


# ---------------------------------------------------------------- pass 1


@dataclasses.dataclass
class Spilled:
    """Pass 1's account of one source file."""

    name: str
    schema: pa.Schema
    rows: int
    bucket_bytes: np.ndarray  # in memory, per bucket: how pass 2 groups and splits them
    skipped: int
    bad_rows: list[dict]
    non_finite: NonFinite


@dataclasses.dataclass(frozen=True)
class _Task:
    fs: object
    path: str
    name: str
    index: int
    declared: dict | None
    label: str | None
    skip: bool
    non_finite: str
    seed: int
    folder: str
    bits: int
    unit: int


def _spill_file(task: _Task) -> Spilled:
    bad = BadRows(task.skip)
    source = SourceFile(task.fs, task.path, task.name, task.declared, task.label, bad)
    out = _Buckets(task.folder, 0, task.bits, task.unit)
    non_finite = NonFinite()
    rows = read = 0  # rows kept, rows read
    try:
        for item in source.batches():
            if item is RESTART:
                out.forget()
                non_finite.reset()
                rows = read = 0
            elif item.num_rows:
                if source.lines is not None:
                    non_finite.unit = "line"
                at = source.lines if source.lines is not None else np.arange(read, read + item.num_rows)
                read += item.num_rows
                item = treat_non_finite(item, non_finite.scan(item, at), task.non_finite)
                if item.num_rows:
                    out.add(item, row_keys(task.seed, task.index, rows, item.num_rows))
                    rows += item.num_rows
        out.close()
    finally:
        out.end_streams()  # on a failure: no file left open in a pool process that lives on
    return Spilled(task.name, source.schema, rows, out.bytes, bad.count, bad.first, non_finite)


def spill(
    fs,
    files: list[tuple[str, str]],
    declared,
    label,
    skip: bool,
    non_finite: str,
    seed: int,
    folder: str,
    bits: int,
    unit: int,
    processes: int,
) -> list[Spilled]:
    """Pass 1: every file's rows into the buckets under `folder`, each process buffering up to
    `unit` bytes (at most SPILL_BUFFER_BYTES) between appends; the files' accounts in file order.

    With several processes the error raised is the one of the first file (in order) that fails,
    as when they are read one after another."""
    for b in range(1 << bits):
        os.makedirs(os.path.join(folder, f"{b:04d}"), exist_ok=True)
    tasks = [
        _Task(fs, path, name, i, declared, label, skip, non_finite, seed, folder, bits, unit)
        for i, (path, name) in enumerate(files)
    ]
    if processes <= 1:
        return [_spill_file(t) for t in tasks]
    # forkserver, not fork: the caller may hold threads (pyarrow's, gRPC's) that fork would copy
    # mid-step. As with any such pool, a script calling prepare() needs `if __name__ == "__main__":`.
    # No preload: Python 3.11's forkserver would import it before taking the caller's sys.path.
    context = multiprocessing.get_context("forkserver")
    results: dict[int, Spilled] = {}
    errors: dict[int, BaseException] = {}
    with concurrent.futures.ProcessPoolExecutor(processes, mp_context=context) as pool:
        futures = {pool.submit(_spill_file, t): t.index for t in tasks}
        try:
            for future in concurrent.futures.as_completed(futures):
                i = futures[future]
                if future.cancelled():
                    continue
                error = future.exception()
                if error is None:
                    results[i] = future.result()
                    continue
                errors[i] = error
                for other, j in futures.items():  # later files cannot change which error is raised
                    if j > i:
                        other.cancel()
        except BaseException:
            pool.shutdown(cancel_futures=True)
            raise
    if errors:
        raise errors[min(errors)]
    return [results[i] for i in range(len(tasks))]


def processes_for(files: list[tuple[str, int]], fs) -> int:
    """How many processes pass 1 uses: a file each, up to one for every two CPUs this process may use.

    A process already keeps two CPUs busy: pyarrow parses on its threads while the process buckets
    what it parsed. On 2 CPUs a second process only adds its start (measured, 500 MB of CSV in 8
    files: 6.3 s in one process, 6.8 s in two; Parquet and JSON lines likewise)."""
    if len(files) < 2 or sum(size for _, size in files) < PARALLEL_MIN_BYTES or "memory" in protocols(fs):
        return 1  # memory:// lives in this process only
    return max(1, min(len(files), usable_cpus() // 2))


def usable_cpus() -> int:
    """os.cpu_count(), less what CPU affinity or a cgroup quota (a container's CPU limit) leaves."""
    cpus = os.cpu_count() or 1
    if hasattr(os, "sched_getaffinity"):
        cpus = min(cpus, len(os.sched_getaffinity(0)))
    for quota_file, period_file in (
        ("/sys/fs/cgroup/cpu.max", None),  # cgroup v2: "quota period"
        ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us"),
    ):
        try:
            with open(quota_file) as f:
                values = f.read().split()
            if period_file is not None:
                with open(period_file) as f:
                    values += f.read().split()
            quota, period = values[:2]
            if quota not in ("max", "-1"):
                cpus = min(cpus, max(1, math.ceil(int(quota) / int(period))))
        except (OSError, ValueError):
            pass
    return cpus


# ---------------------------------------------------------------- pass 2


def in_key_order(folder: str, bits: int, bucket_bytes: np.ndarray, schema: pa.Schema, unit: int) -> Iterator[pa.Table]:
    """Pass 2: every row under `folder` in key order, key dropped, as tables of `schema`'s columns.

    Neighbouring buckets are sorted together up to `unit` bytes; a bucket bigger than that (the
    guess of bucket_bits was low) is split by the next bits of its keys first. A bucket's files are
    removed once read, on a thread of their own: unlinking the spill took seconds at the end (0.7 s
    of a 2 GB prep), and frees the disk as pass 2 goes."""
    pa.default_memory_pool().release_unused()  # what pass 1 freed, so that the two do not add up
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="prep-unlink") as remover:
        yield from _in_key_order(folder, bits, bucket_bytes, schema, 0, unit, remover)


def _in_key_order(
    folder: str,
    bits: int,
    bucket_bytes: np.ndarray,
    schema: pa.Schema,
    used: int,
    unit: int,
    remover: concurrent.futures.Executor,
) -> Iterator[pa.Table]:
    group: list[int] = []  # neighbouring buckets sorted together
    group_bytes = 0
    for b in range(1 << bits):
        size = int(bucket_bytes[b])
        if group and group_bytes + size > unit:
            yield _sorted(folder, group, schema, remover)
            group, group_bytes = [], 0
        if size > unit and used + bits < 64:
            yield from _split(folder, b, size, schema, used + bits, unit, remover)
            continue
        group.append(b)
        group_bytes += size
    if group:
        yield _sorted(folder, group, schema, remover)


def _read_bucket(
    folder: str, bucket: int, whole_streams: bool, remover: concurrent.futures.Executor
) -> Iterator[pa.Table]:
    """The tables appended to a bucket: each file holds one IPC stream or more, read whole (one
    Python step per stream, not per batch) or, for a bucket too big to hold, a batch at a time.
    Each file is handed to `remover` once read."""
    sub = os.path.join(folder, f"{bucket:04d}")
    for name in sorted(os.listdir(sub)):
        path = os.path.join(sub, name)
        if not os.path.isfile(path):
            continue  # the folder of a split bucket
        with pa.OSFile(path) as f:
            size = f.size()
            while f.tell() < size:
                reader = ipc.open_stream(f)
                if whole_streams:
                    yield reader.read_all()
                else:
                    for batch in reader:
                        yield pa.Table.from_batches([batch])
        remover.submit(os.remove, path)


def _sorted(folder: str, buckets: list[int], schema: pa.Schema, remover: concurrent.futures.Executor) -> pa.Table:
    parts = []
    for b in buckets:
        for t in _read_bucket(folder, b, True, remover):
            data = pa.Table.from_arrays(t.columns[1:], names=t.column_names[1:])
            parts.append((t.column(0), conform(data, schema)))
    if not parts:
        return schema.empty_table()
    keys = np.concatenate([chunk.to_numpy() for k, _ in parts for chunk in k.chunks])
    table = pa.concat_tables([t for _, t in parts])  # not combined first: take copies it anyway
    del parts
    return table.take(pa.array(np.argsort(keys)))  # Arrow indices: see _Buckets.flush


def _split(
    folder: str, bucket: int, size: int, schema: pa.Schema, used: int, unit: int, remover: concurrent.futures.Executor
) -> Iterator[pa.Table]:
    sub = os.path.join(folder, f"{bucket:04d}", "split")
    bits = min(MAX_BUCKET_BITS, 64 - used, max(1, math.ceil(math.log2(size / unit)) + 1))
    for b in range(1 << bits):
        os.makedirs(os.path.join(sub, f"{b:04d}"), exist_ok=True)
    out = _Buckets(sub, used, bits, unit)
    for t in _read_bucket(folder, bucket, False, remover):
        out.add(pa.Table.from_arrays(t.columns[1:], names=t.column_names[1:]), t.column(0).to_numpy())
    out.close()
    yield from _in_key_order(sub, bits, out.bytes, schema, used, unit, remover)
