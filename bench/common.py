"""What the benches share: preparing a source into train and eval manifests with the real CLI, and the
digits records the PS benches train on."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def prepare(source: str, out: pathlib.Path, label: str = "label") -> pathlib.Path:
    """`elastic-step data prep` of `source` into `out` (train/ and eval/ manifests); returns `out`."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "elastic_step.cli",
            "data",
            "prep",
            "--source",
            source,
            "--label",
            label,
            "--output",
            str(out),
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    return out


def digits_prepared(rows: int, out: pathlib.Path) -> pathlib.Path:
    """The digits sample prepared into `out` (train/ and eval/), its train split repeated to `rows` records
    in one shard, shuffled; the eval split kept apart, as held-out records."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from elastic_step.data.api import Manifest, Shard, load_manifest

    prepared = prepare(str(ROOT / "samples" / "digits" / "digits.csv"), out)
    train = load_manifest(str(prepared / "train"))
    table = pa.concat_tables([pq.read_table(train.shard_uri(s)) for s in train.shards])
    table = pa.concat_tables([table] * -(-rows // table.num_rows)).slice(0, rows)
    table = table.take(np.random.default_rng(0).permutation(rows))
    for s in train.shards:
        os.remove(train.shard_uri(s))
    pq.write_table(table, prepared / "train" / "part-00000.parquet", row_group_size=1024)
    Manifest(split="train", label=train.label, shards=[Shard("part-00000.parquet", rows)], schema=train.schema).save(
        str(prepared / "train" / "manifest.json")
    )
    return prepared
