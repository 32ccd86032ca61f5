"""Where a job's checkpoints live and how they are laid out, through fsspec (a local path, gs://,
s3://). What a checkpoint holds and when it is cut is master/durability/checkpoint.py's.

Under `<checkpoint_uri or output/checkpoints>/<job id>/` (master/plan.py checkpoint_root):

    ckpt-000007/ps-0.npz ...    each shard's values, optimizer variables, applied keys and records
    ckpt-000007/members.npz     allreduce: the members' state, and the records it holds
    ckpt-000007/ledger.json     the ledger at the cut, and the job's counters
    checkpoint.json             the commit point: names the complete checkpoint and its files
    watermark.json              the records committed so far (every few seconds): what a master
                                restarted after a loss trains again is counted from it
    chaos.json                  tests and benches only: the chaos signals fired so far

The part files are written first, then `checkpoint.json` in one atomic write. A checkpoint whose
manifest was never written is never loaded, and the previous one is deleted only after the new
manifest is in place. The manifest also carries the job's fingerprint (job id, model, data,
configuration): a checkpoint of another job is not resumed, and one of the same job with another
model, data set or configuration is refused, naming the difference.
"""

from __future__ import annotations

import io
import json
import logging
import posixpath
import time

import fsspec

from elastic_step.errors import ConfigError
from elastic_step.util.atomic import atomic_write_bytes
from elastic_step.util.json_text import write_json
from elastic_step.util.storage import check_writable

log = logging.getLogger("elastic_step.master")

FORMAT = "elastic-step/checkpoint/v1"
MANIFEST = "checkpoint.json"
WATERMARK = "watermark.json"
MEMBERS = "members.npz"


class CheckpointError(ConfigError):
    """A checkpoint cannot be written, or the one found cannot be resumed."""


class CheckpointStore:
    def __init__(self, root: str, fingerprint: dict):
        self.root = root.rstrip("/")
        self.fingerprint = fingerprint
        self.fs, self.path = fsspec.core.url_to_fs(self.root)

    def uri(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts)

    def check_writable(self) -> None:
        """At the job's start, not at its first checkpoint."""
        check_writable(
            self.root,
            "write checkpoints under",
            CheckpointError,
            "Or pass --checkpoint-every 0 to train without checkpoints (a lost master or PS then "
            "loses the job's progress).",
        )

    def latest(self) -> dict | None:
        """The last complete checkpoint's manifest, or None. A corrupt manifest is an error; one of
        another job is None (logged); one of this job with another model, data or configuration is an
        error naming the difference."""
        try:
            with self.fs.open(posixpath.join(self.path, MANIFEST), "r") as f:
                text = f.read()
        except FileNotFoundError:
            return None
        try:
            manifest = json.loads(text)
            if manifest.get("format") != FORMAT:
                raise ValueError(f"format {manifest.get('format')!r}, expected {FORMAT!r}")
            fingerprint, files = manifest["fingerprint"], manifest["files"]
            if not isinstance(files, dict):
                raise ValueError("'files' is not a mapping")
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(
                f"The checkpoint manifest {self.uri(MANIFEST)} is corrupt ({e}). Delete {self.root} to start "
                "over, or pass --resume never."
            ) from None
        if fingerprint.get("job_id") != self.fingerprint["job_id"]:
            log.info(
                "found a checkpoint of job %s under %s, not of this job (%s): not resuming; this job's "
                "checkpoints will replace it",
                fingerprint.get("job_id"),
                self.root,
                self.fingerprint["job_id"],
            )
            return None
        differences = [
            f"{k}: checkpoint {fingerprint.get(k)!r}, this job {v!r}"
            for k, v in self.fingerprint.items()
            if fingerprint.get(k) != v
        ]
        if differences:
            raise CheckpointError(
                f"The checkpoint under {self.root} is of job {self.fingerprint['job_id']} but with another "
                f"{', '.join(d.split(':')[0] for d in differences)} ({'; '.join(differences)}). Resume with "
                "the same model, data and configuration, or pass --resume never to start over."
            )
        return manifest

    def read_json(self, manifest: dict, name: str) -> dict:
        try:
            return json.loads(self.read_part(manifest, name))
        except (OSError, ValueError, KeyError) as e:
            raise CheckpointError(
                f"The checkpoint {manifest.get('id')} under {self.root} is missing or has a "
                f"corrupt {name} ({type(e).__name__}: {e}). Delete {self.root} to start over, "
                "or pass --resume never."
            ) from None

    def write_watermark(self, records_committed: int) -> None:
        write_json(
            self.uri(WATERMARK),
            {"job_id": self.fingerprint["job_id"], "records_committed": records_committed, "at": time.time()},
            indent=None,
        )

    def watermark(self) -> int | None:
        """The records the job's last master had committed, as it last wrote them; None if unknown."""
        try:
            with self.fs.open(posixpath.join(self.path, WATERMARK), "r") as f:
                mark = json.load(f)
            return int(mark["records_committed"]) if mark.get("job_id") == self.fingerprint["job_id"] else None
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def read_part(self, manifest: dict, name: str) -> bytes:
        with self.fs.open(posixpath.join(self.path, manifest["files"][name]), "rb") as f:
            return f.read()

    def write_members(self, ckpt_id: int, state) -> str:
        """allreduce: a member's state (tensors.MemberState) as checkpoint `ckpt_id`'s part."""
        import numpy as np

        from elastic_step.data.accounting import AppliedRecords

        buf = io.BytesIO()
        np.savez(
            buf,
            step=np.array(state.step, np.int64),
            num_model=np.array(state.num_model, np.int64),
            **{f"values/{i}": v for i, v in enumerate(state.values)},
            **AppliedRecords.of(state.applied).npz(),
        )
        atomic_write_bytes(self.part(ckpt_id, MEMBERS), buf.getvalue())
        return MEMBERS

    def read_members(self, manifest: dict):
        """allreduce: the members' state (tensors.MemberState) of a checkpoint."""
        import numpy as np

        from elastic_step.data.accounting import AppliedRecords
        from elastic_step.proto.tensors import MemberState

        try:
            saved = dict(np.load(io.BytesIO(self.read_part(manifest, MEMBERS)), allow_pickle=False))
            values = [saved[f"values/{i}"] for i in range(sum(k.startswith("values/") for k in saved))]
            return MemberState(
                int(saved["step"]), int(saved["num_model"]), values, AppliedRecords.of_npz(saved).arrays()
            )
        except (KeyError, OSError, ValueError) as e:
            raise CheckpointError(
                f"Cannot read the allreduce members' state of checkpoint {manifest['id']} under "
                f"{self.root} ({type(e).__name__}: {e}). Delete {self.root} to start over, "
                "or pass --resume never."
            ) from None

    def part(self, ckpt_id: int, name: str) -> str:
        """Where a part of checkpoint `ckpt_id` goes."""
        return self.uri(f"ckpt-{ckpt_id:06d}", name)

    def size(self, ckpt_id: int) -> int:
        """The bytes checkpoint `ckpt_id`'s parts take in the store."""
        return int(self.fs.du(posixpath.join(self.path, f"ckpt-{ckpt_id:06d}"), total=True))

    def commit(self, ckpt_id: int, files: list[str], **meta) -> dict:
        """The commit point: the manifest naming the complete checkpoint; then older ones go."""
        manifest = {
            "format": FORMAT,
            "id": ckpt_id,
            "written_at": time.time(),
            "fingerprint": self.fingerprint,
            "files": {name: f"ckpt-{ckpt_id:06d}/{name}" for name in files},
            **meta,
        }
        write_json(self.uri(MANIFEST), manifest, indent=1)
        for old in self.fs.glob(posixpath.join(self.path, "ckpt-*")):
            if posixpath.basename(old) != f"ckpt-{ckpt_id:06d}":
                self.fs.rm(old, recursive=True)
        return manifest


def parse_interval(text: str) -> tuple[str, float] | None:
    """`--checkpoint-every`: "60s", "5m", "1h" (time), "50000" or "50000records" (records committed),
    "0" (never). Returns ("seconds" | "records", amount), or None for never."""
    t = str(text).strip().lower()
    units = {"s": 1, "m": 60, "h": 3600}
    try:
        if t.endswith("records"):
            kind, amount = "records", float(t[: -len("records")])
        elif t and t[-1] in units:
            kind, amount = "seconds", float(t[:-1]) * units[t[-1]]
        else:
            kind, amount = "records", float(t)
    except ValueError:
        raise ConfigError(
            f"--checkpoint-every {text!r} is neither a time (60s, 5m, 1h) nor a number of "
            "records (50000): use one of those, or 0 for no checkpoints."
        ) from None
    if amount < 0:
        raise ConfigError(f"--checkpoint-every {text!r} is negative: use a time (60s), records (50000) or 0.")
    return None if amount == 0 else (kind, amount)


def fingerprint(cfg, job_id: str, model_def, ledger) -> dict:
    """What a checkpoint must share with the job resuming it."""
    import hashlib
    import inspect

    try:
        source = open(inspect.getsourcefile(model_def.module), "rb").read()
    except (OSError, TypeError):
        source = cfg.model_def.encode()
    return {
        "job_id": job_id,
        "model": hashlib.sha256(source).hexdigest()[:16],
        "data": [[s.uri.rsplit("/", 1)[-1], s.rows] for s in ledger.shards],
        "epochs": cfg.epochs,
        "minibatch_size": cfg.minibatch_size,
        "records_per_task": ledger.records_per_task,
        "num_ps": cfg.num_ps,
        "strategy": cfg.strategy,
        "seed": cfg.seed,
    }
