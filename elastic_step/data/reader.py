"""Read exactly a record range of a Parquet shard, touching only the row groups it spans."""

from __future__ import annotations

import bisect
import threading

import fsspec
import numpy as np
import pyarrow.parquet as pq

from elastic_step.errors import DataError


class ShardReader:
    """Reads record ranges of one Parquet shard through fsspec.

    Keeps the file open and the row-group offsets cached, because a worker reads one
    task's range as many consecutive minibatches.
    """

    def __init__(self, uri: str, columns: list[str] | None = None):
        self.uri = uri
        self.columns = columns
        try:
            # No read-ahead cache (s3fs's would fetch most of a shard to read one row group), and the
            # ranges a row group's column chunks span fetched together: one GET per read, not one per column.
            fs, path = fsspec.core.url_to_fs(uri)
            self._file = fs.open(path, "rb", cache_type="none")
            self._pq = pq.ParquetFile(self._file, pre_buffer=True)
        except (OSError, ValueError) as e:
            raise DataError(
                f"Cannot open the data shard {uri}: {e}. Check that the manifest's shards "
                "are where the manifest says (re-run `elastic-step data prep`)."
            ) from None
        md = self._pq.metadata
        self._starts = [0]
        for i in range(md.num_row_groups):
            self._starts.append(self._starts[-1] + md.row_group(i).num_rows)
        self.num_rows = self._starts[-1]
        self._lock = threading.Lock()
        self._cache: tuple[int, int, dict[str, np.ndarray]] | None = None  # (first, last_excl, cols)

    def read(self, start: int, end: int) -> dict[str, np.ndarray]:
        """Records [start, end) as column name -> numpy array."""
        if not 0 <= start <= end <= self.num_rows:
            raise DataError(f"Record range [{start}, {end}) is outside {self.uri} ({self.num_rows} rows).")
        with self._lock:
            c = self._cache
            if c is None or not (c[0] <= start and end <= c[1]):
                # clamp: an empty range at the very end still needs one row group for the columns
                first = min(bisect.bisect_right(self._starts, start) - 1, len(self._starts) - 2)
                last = bisect.bisect_left(self._starts, end)  # row groups [first, last)
                table = self._pq.read_row_groups(list(range(first, max(last, first + 1))), columns=self.columns)
                cols = {name: table.column(name).to_numpy(zero_copy_only=False) for name in table.column_names}
                c = self._cache = (self._starts[first], self._starts[first] + table.num_rows, cols)
            lo, hi = start - c[0], end - c[0]
            return {k: v[lo:hi] for k, v in c[2].items()}

    def close(self) -> None:
        self._file.close()


def read_all(manifest) -> dict[str, np.ndarray]:
    """Every record of a manifest (a Manifest or its URI), in order, as columns: for data that one
    process holds whole (a plain Keras baseline, a test), never for a worker's leases."""
    from elastic_step.data.manifest import load_manifest

    if isinstance(manifest, str):
        manifest = load_manifest(manifest)
    parts = []
    for shard in manifest.shards:
        reader = ShardReader(manifest.shard_uri(shard))
        try:
            parts.append(reader.read(0, reader.num_rows))
        finally:
            reader.close()
    return {c: np.concatenate([p[c] for p in parts]) for c in parts[0]}


class ReaderPool:
    """One ShardReader per shard URI, opened on first use."""

    def __init__(self, columns: list[str] | None = None):
        self._columns = columns
        self._readers: dict[str, ShardReader] = {}

    def read(self, uri: str, start: int, end: int) -> dict[str, np.ndarray]:
        r = self._readers.get(uri)
        if r is None:
            r = self._readers[uri] = ShardReader(uri, self._columns)
        return r.read(start, end)

    def close(self) -> None:
        for r in self._readers.values():
            r.close()
        self._readers.clear()
