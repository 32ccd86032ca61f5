"""Per-column statistics of a split, gathered while prep writes it (the same streaming pass, memory flat): for
numbers (and bools) the count, mean, variance, min and max; for strings and integer ids the vocabulary, most
frequent first, with each value's count, up to MAX_VOCABULARY values. What Keras's structured-data guides `adapt`
`Normalization` and `StringLookup` on, so a model() taking one argument can build them without reading the data.

Rows are taken in blocks of BLOCK_ROWS, whatever tables prep hands over (their sizes follow its sort units and
buffers): the same rows in the same order give the same statistics, bit for bit, as they give the same shards.
Means and variances merge block by block (Chan et al.'s pairwise update, in float64). A vocabulary stops taking
new values at its cap (and says so: `complete` false); the values it holds keep counting. Prep writes rows
shuffled, so the values it holds are those of a random sample, the frequent ones first.
"""

from __future__ import annotations

import math

import pyarrow as pa
import pyarrow.compute as pc

from elastic_step.data.tables import compact
from elastic_step.errors import DataError

MAX_VOCABULARY = 10_000  # values per column
BLOCK_ROWS = 1 << 16  # rows a block: bounds the memory of a block's value counts too


class _Moments:
    __slots__ = ("count", "mean", "m2", "min", "max")

    def __init__(self):
        self.count, self.mean, self.m2, self.min, self.max = 0, 0.0, 0.0, math.inf, -math.inf

    def add(self, column: pa.ChunkedArray) -> None:
        values = pc.cast(column.drop_null(), pa.float64())
        n = len(values)
        if not n:
            return
        mean = pc.mean(values).as_py()
        m2 = pc.variance(values, ddof=0).as_py() * n
        low, high = pc.min_max(values).values()
        total = self.count + n
        delta = mean - self.mean
        self.mean += delta * n / total
        self.m2 += m2 + delta * delta * self.count * n / total
        self.count = total
        self.min, self.max = min(self.min, low.as_py()), max(self.max, high.as_py())

    def result(self) -> dict:
        return {
            "count": self.count,
            "mean": self.mean,
            "variance": self.m2 / self.count,
            "min": self.min,
            "max": self.max,
        }


class _Vocabulary:
    __slots__ = ("counts", "complete")

    def __init__(self):
        self.counts: dict = {}
        self.complete = True

    def add(self, column: pa.ChunkedArray) -> None:
        counted = pc.value_counts(column.drop_null())
        for value, n in zip(counted.field("values").to_pylist(), counted.field("counts").to_pylist()):
            if value in self.counts:
                self.counts[value] += n
            elif len(self.counts) < MAX_VOCABULARY:
                self.counts[value] = n
            else:
                self.complete = False

    def result(self) -> dict:
        ordered = sorted(self.counts.items(), key=lambda kv: (-kv[1], str(kv[0])))
        return {"vocabulary": [v for v, _ in ordered], "counts": [n for _, n in ordered], "complete": self.complete}


class ColumnStatistics:
    """One split's statistics, table by table as prep writes them."""

    def __init__(self):
        self._moments: dict[str, _Moments] = {}
        self._vocabularies: dict[str, _Vocabulary] = {}
        self._pending: pa.Table | None = None  # the rows of the block not yet full: a copy, holding no sort unit

    def add(self, table: pa.Table) -> None:
        rows = table if self._pending is None else pa.concat_tables([self._pending, table])
        start = 0
        while rows.num_rows - start >= BLOCK_ROWS:
            self._add_block(rows.slice(start, BLOCK_ROWS))
            start += BLOCK_ROWS
        rest = rows.slice(start)
        self._pending = compact(rest) if rest.num_rows else None

    def _add_block(self, table: pa.Table) -> None:
        for name, column in zip(table.column_names, table.columns):
            t = column.type
            if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t):
                self._moments.setdefault(name, _Moments()).add(column)
            if pa.types.is_integer(t) or pa.types.is_string(t) or pa.types.is_large_string(t):
                self._vocabularies.setdefault(name, _Vocabulary()).add(column)

    def result(self) -> dict[str, dict]:
        """{column: {"count", "mean", "variance", "min", "max"} and/or {"vocabulary", "counts", "complete"}}."""
        if self._pending is not None:
            self._add_block(self._pending)
            self._pending = None
        out: dict[str, dict] = {}
        for name, moments in self._moments.items():
            if moments.count:
                out[name] = moments.result()
        for name, vocabulary in self._vocabularies.items():
            out.setdefault(name, {}).update(vocabulary.result())
        return out


def read_statistics(uri: str) -> dict[str, dict]:
    """The statistics prep recorded in the manifest at `uri` (a manifest.json or its folder)."""
    from elastic_step.data.manifest import load_manifest

    manifest = load_manifest(uri)
    if not manifest.statistics:
        raise DataError(
            f"The manifest {manifest.uri} holds no column statistics: it was prepared before prep recorded them. "
            "Re-run `elastic-step data prep` on its source."
        )
    return manifest.statistics
