"""What the benches share: `elastic-step` command lines and runs (train, data prep) with the real CLI, the small
job the recovery, chaos and durability benches disturb, the digits records the PS benches train on, and an earlier
revision of the project to run beside this one (`revision_tree`)."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator

from elastic_step.spec import cli_args

ROOT = pathlib.Path(__file__).resolve().parents[1]

CLI = [sys.executable, "-m", "elastic_step.cli"]  # `elastic-step`, run by this interpreter from ROOT


def train_command(*flags: str, **values) -> list[str]:
    """`elastic-step train` with these parameter values (flags as the spec spells them, `progress` off unless
    given), then `flags`: the ones that are not parameters (`--prepared`, `--chaos`), literal."""
    return [*CLI, "train", *cli_args(**{"progress": "off", **values}), *flags]


def run_cli(cmd: list[str], root: pathlib.Path = ROOT, **kw) -> subprocess.CompletedProcess:
    """An `elastic-step` command line (CLI + arguments) run from `root` (ROOT, or a `revision_tree`: its package,
    with this venv), its output captured as text."""
    if root != ROOT:
        kw["env"] = {**(kw.get("env") or os.environ), "PYTHONPATH": str(root)}
    return subprocess.run(cmd, cwd=root, capture_output=True, text=True, **kw)


@contextlib.contextmanager
def revision_tree(rev: str) -> Iterator[pathlib.Path]:
    """A checkout of this repository at `rev` (a git worktree in a temporary folder, removed at the end), for a
    bench to run an earlier revision's `elastic-step` beside this one's in the same invocation (`run_cli(root=)`)."""
    with tempfile.TemporaryDirectory(prefix="bench-revision-") as tmp:
        tree = pathlib.Path(tmp) / "tree"
        git = ["git", "-C", str(ROOT)]
        subprocess.run([*git, "worktree", "add", "--detach", "--quiet", str(tree), rev], check=True)
        try:
            yield tree
        finally:
            subprocess.run([*git, "worktree", "remove", "--force", str(tree)], check=False)


def summary(out: pathlib.Path | str) -> dict:
    """The summary.json a training wrote to its output `out`."""
    return json.loads((pathlib.Path(out) / "summary.json").read_text())


def train(out: pathlib.Path, *flags: str, env: dict | None = None, root: pathlib.Path = ROOT, **values) -> dict:
    """`elastic-step train` (train_command) into `out`, which must succeed, in environment `env` (None: this
    process's), from `root` (run_cli); its summary."""
    proc = run_cli(train_command(*flags, output=str(out), **values), root=root, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"elastic-step train failed:\n{proc.stderr[-3000:]}")
    return summary(out)


def splits(data: pathlib.Path) -> dict:
    """A prepared directory's train and eval manifests, as train_command's values."""
    return {"train_data": str(data / "train"), "eval_data": str(data / "eval")}


def small_job(data: pathlib.Path, epochs: int, model_def: str = "samples/digits/model.py") -> dict:
    """The values of the small job that the recovery, chaos and durability benches disturb: `model_def` (digits)
    on the prepared `data`, up to 2 workers, minibatches of 32, tasks of 128 records."""
    return {
        "model_def": model_def,
        **splits(data),
        "epochs": epochs,
        "minibatch_size": 32,
        "records_per_task": 128,
        "max_workers": 2,
    }


def prepare(source: str, out: pathlib.Path, label: str = "label") -> pathlib.Path:
    """`elastic-step data prep` of `source` into `out` (train/ and eval/ manifests); returns `out`."""
    run_cli([*CLI, "data", "prep", *cli_args(source_uri=source, label=label, output=str(out))], check=True)
    return out


def digits_prepared(rows: int, out: pathlib.Path) -> pathlib.Path:
    """The digits sample prepared into `out` (train/ and eval/), its train split repeated to `rows` records
    in one shard, shuffled; the eval split kept apart, as held-out records."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from elastic_step.data.manifest import Manifest, Shard, load_manifest

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


def free_ports(n: int) -> list[int]:
    """n loopback ports free now (for the peers' TF_CONFIG clusters)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
