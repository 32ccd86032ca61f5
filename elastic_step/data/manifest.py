"""The manifest: what a prep step writes and a training step reads.

A manifest lists Parquet shards (paths relative to the manifest, so a KFP artifact can be
moved), their row counts and the schema. Training cuts shards into record-range tasks.
"""

from __future__ import annotations

import dataclasses
import json
import posixpath
from typing import Any

import fsspec

from elastic_step.errors import DataError
from elastic_step.util.atomic import atomic_write_text
from elastic_step.util.json_text import dumps

MANIFEST_FORMAT = "elastic-step/manifest/v1"
MANIFEST_NAME = "manifest.json"


@dataclasses.dataclass(frozen=True)
class Field:
    name: str
    type: str  # arrow type name: "int64", "double", "string", ...


@dataclasses.dataclass(frozen=True)
class Shard:
    path: str  # relative to the manifest's folder, or an absolute URI
    rows: int


@dataclasses.dataclass
class Manifest:
    split: str
    shards: list[Shard]
    schema: list[Field]
    label: str | None = None
    weight_column: str | None = None  # each record's sample weight in training and evaluation (None: 1)
    source: str = ""
    skipped_rows: int = 0
    bad_rows: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # first few skipped
    # NaN, infinite and empty numeric cells, dropped or set to 0 at prep: {"policy", "rows", "columns"}
    non_finite: dict[str, Any] = dataclasses.field(default_factory=dict)
    # The label's values in this split, for the check at train start: {"type", "min", "max"} and, for an
    # integer or bool label with few values, "distinct" (their count). Empty without a numeric label, and
    # in a manifest written before prep recorded it.
    label_summary: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Per-column statistics of this split (data/column_stats.py); empty in a manifest written before prep kept them.
    statistics: dict[str, dict] = dataclasses.field(default_factory=dict)
    uri: str = ""  # where this manifest was read from (not serialised)

    @property
    def total_rows(self) -> int:
        return sum(s.rows for s in self.shards)

    @property
    def columns(self) -> list[str]:
        return [f.name for f in self.schema]

    def shard_uri(self, shard: Shard) -> str:
        if "://" in shard.path or shard.path.startswith("/"):
            return shard.path
        return posixpath.join(posixpath.dirname(self.uri), shard.path)

    def to_json(self) -> str:
        return dumps(
            {
                "format": MANIFEST_FORMAT,
                "split": self.split,
                "label": self.label,
                "weight_column": self.weight_column,
                "source": self.source,
                "total_rows": self.total_rows,
                "skipped_rows": self.skipped_rows,
                "bad_rows": self.bad_rows,
                "non_finite": self.non_finite,
                "label_summary": self.label_summary,
                "statistics": self.statistics,
                "schema": {"fields": [dataclasses.asdict(f) for f in self.schema]},
                "shards": [dataclasses.asdict(s) for s in self.shards],
            },
            indent=2,
        )

    def save(self, uri: str) -> None:
        atomic_write_text(uri, self.to_json())
        self.uri = uri


def schema_differences(train: Manifest, eval: Manifest) -> list[str]:
    """How the eval data's columns differ from the training data's, said for a person ([] when they match)."""
    a, b = {f.name: f.type for f in train.schema}, {f.name: f.type for f in eval.schema}
    out = []
    if train.label != eval.label:
        out.append(f"the label column is {train.label!r} in the training data but {eval.label!r} in the eval data")
    missing, extra = [c for c in a if c not in b], [c for c in b if c not in a]
    if missing:
        out.append(f"the eval data lacks {', '.join(map(repr, missing))}")
    if extra:
        out.append(f"only the eval data has {', '.join(map(repr, extra))}")
    out += [f"{c!r} is {a[c]} in the training data but {b[c]} in the eval data" for c in a if c in b and a[c] != b[c]]
    return out


def manifest_uri(path_or_dir: str) -> str:
    """Accept a manifest file or the folder holding `manifest.json` (a KFP Dataset artifact)."""
    fs, path = fsspec.core.url_to_fs(path_or_dir)
    if fs.isdir(path):
        return posixpath.join(path_or_dir.rstrip("/"), MANIFEST_NAME)
    return path_or_dir


def load_manifest(path_or_dir: str) -> Manifest:
    uri = manifest_uri(path_or_dir)
    try:
        with fsspec.open(uri, "r") as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise DataError(
            f"No manifest at {uri}: pass the manifest.json (or its folder) written by `elastic-step data prep`."
        ) from None
    except json.JSONDecodeError as e:
        raise DataError(f"The manifest {uri} is not valid JSON ({e}); re-run `elastic-step data prep`.") from None
    except OSError as e:
        raise DataError(f"Cannot read the manifest {uri}: {e}. Check the URI and credentials.") from None
    if not isinstance(raw, dict) or raw.get("format") != MANIFEST_FORMAT:
        raise DataError(
            f"{uri} is not an elastic-step manifest (expected format {MANIFEST_FORMAT!r}); "
            "re-run `elastic-step data prep` on the source data."
        )
    try:
        return Manifest(
            split=raw["split"],
            label=raw.get("label"),
            weight_column=raw.get("weight_column"),
            source=raw.get("source", ""),
            skipped_rows=int(raw.get("skipped_rows", 0)),
            bad_rows=list(raw.get("bad_rows", [])),
            non_finite=dict(raw.get("non_finite") or {}),
            label_summary=dict(raw.get("label_summary") or {}),
            statistics=dict(raw.get("statistics") or {}),
            schema=[Field(**f) for f in raw["schema"]["fields"]],
            shards=[Shard(path=s["path"], rows=int(s["rows"])) for s in raw["shards"]],
            uri=uri,
        )
    except (KeyError, TypeError) as e:
        raise DataError(f"The manifest {uri} lacks field {e}; re-run `elastic-step data prep`.") from None
