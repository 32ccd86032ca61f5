"""Checkpoints of a job's state at one consistent cut: when they are cut, and what a resumed job, a
lost PS or a ring that lost every member goes back to. Where they live and their layout is
master/durability/store.py's.

A checkpoint is the model's whole state plus the master's ledger at one cut. PS mode: every shard's
state, taken while no push is in flight (the barrier lives in the coordinator: workers finish and
report their pushes, then hold). allreduce: one member's weights and optimizer variables (identical
on every member) at the last committed step, taken while no further step may commit.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable

from elastic_step.fault_hooks import NO_FAULTS, JobFaults
from elastic_step.master.durability.store import CheckpointError, CheckpointStore, fingerprint, parse_interval
from elastic_step.util.atomic import atomic_write_bytes
from elastic_step.util.json_text import write_json
from elastic_step.util.phases import phase
from elastic_step.util.uri import local_path

log = logging.getLogger("elastic_step.master")

WATERMARK_EVERY_S = 5.0  # often enough to count what a lost master's successor trains again; cheap on object stores
LAST_CUT_S = 15.0  # the last checkpoint of a terminated step: well inside Kubernetes's 30 s grace period


class Checkpointer:
    """Cuts checkpoints on the master's pump, without stopping it: `tick` starts the barrier when one
    is due, takes the cut once the barrier holds (or gives up after `HOLD_TIMEOUT_S`, if a worker
    holding a lease never gets there, and tries again later), releases the workers, then writes it.
    `parts(ckpt_id)` takes the model's state from its holders (the PS Save RPCs) and returns a function
    that writes it and returns the parts' names; `state()` is the ledger's cut and the job's counters,
    taken under the coordinator's lock. Both are taken while the workers are held, so they are at the
    same pushes; the files are written once the workers go on, so that no worker waits on the store (the
    barrier's cost: docs/benchmarks.md, Durability). `parts_lost(error)` says whether an error of `parts`
    means the state's holder was lost (a PS shard by default): then the checkpoint is abandoned and tried
    again an interval later. `faults`: the job's hook points (a kill mid-checkpoint)."""

    HOLD_TIMEOUT_S = 60.0

    def __init__(
        self,
        store: CheckpointStore,
        every: tuple[str, float],
        coord,
        parts,
        state,
        first_id: int = 1,
        faults: JobFaults = NO_FAULTS,
        parts_lost=None,
    ):
        from elastic_step.ps.client import shards_moved

        self.store, self.every, self.coord = store, every, coord
        self._parts, self._state = parts, state
        self.parts_lost = parts_lost or shards_moved
        self.next_id = first_id
        self.faults = faults
        self._holding_since: float | None = None
        self._last_at = time.time()
        self._last_records = 0
        self.written: list[dict] = []  # per checkpoint: id, records, seconds to reach the hold, held, to write
        self.abandoned = 0
        self.last = False  # the step is ending: cut now, and keep the workers held after

    @property
    def holding(self) -> bool:
        """A barrier is up: the workers are held for a cut."""
        return self._holding_since is not None

    def restart_from(self, records: int, now: float) -> None:
        """Count the next interval from here (a resumed job's start)."""
        self._last_at, self._last_records = now, records

    def due(self, committed: int, now: float) -> bool:
        if self.last:
            return True
        kind, amount = self.every
        return (now - self._last_at >= amount) if kind == "seconds" else (committed - self._last_records >= amount)

    def write_now(self) -> None:
        """A checkpoint with no worker running: nothing can be in flight, no barrier needed."""
        self._holding_since = time.time()
        try:
            self._write(self._holding_since)
        finally:
            self._holding_since = None

    def abandon(self) -> None:
        """Stop a barrier in progress (a PS was lost meanwhile)."""
        if self._holding_since is not None:
            self.coord.end_hold()
            self._holding_since = None

    def tick(self, committed: int, now: float) -> None:
        if not self.coord.state_to_cut():
            return
        if self._holding_since is None:
            if self.due(committed, now) and not self.coord.finished.is_set():
                self.coord.begin_hold()
                self._holding_since = now
            return
        if self.coord.hold_reached():
            try:
                self._write(now, release=self._release)
            except Exception as e:
                if not self.parts_lost(e):
                    raise
                # The state's holder died before the master learned of it (its pod's end is reported
                # later): that loss is handled first, then cuts go on.
                log.warning(
                    "checkpoint %d abandoned: the model's state is unreachable (%s); trying again later",
                    self.next_id,
                    str(e.details() if hasattr(e, "details") else e)[:200],
                )
                self._last_at, self._last_records = now, committed  # the next one an interval later
                self.abandoned += 1
            finally:
                self._release()  # also when the cut failed (once more, harmless, when it was taken)
                self._holding_since = None
        elif now - self._holding_since > self.HOLD_TIMEOUT_S:
            log.warning(
                "checkpoint %d abandoned: workers %s did not hold within %.0f s; trying again later",
                self.next_id,
                self.coord.waiting_for_hold(),
                self.HOLD_TIMEOUT_S,
            )
            self.coord.end_hold()
            self._holding_since, self._last_at = None, now
            self.abandoned += 1

    def _release(self) -> None:
        """The workers go on, the cut taken (the last cut keeps them held: whatever they trained after it would be
        lost with the step)."""
        if not self.last:
            self.coord.end_hold()

    def _write(self, hold_reached_at: float, release=lambda: None) -> None:
        ckpt_id, t0 = self.next_id, time.time()
        with phase("master: take a checkpoint's cut (the workers held)"):
            write_parts = self._parts(ckpt_id)
            state = self._state()
        held = time.time() - hold_reached_at
        release()
        with phase("master: write a checkpoint (the workers going on)"):
            self._write_parts(ckpt_id, t0, hold_reached_at, held, write_parts, state)

    def _write_parts(self, ckpt_id: int, t0: float, hold_reached_at: float, held: float, write_parts, state) -> None:
        files = write_parts()
        write_json(self.store.part(ckpt_id, "ledger.json"), state, indent=None)
        self.faults.checkpoint_written(ckpt_id)
        records = state["ledger_records_committed"]
        self.store.commit(ckpt_id, [*files, "ledger.json"], records_committed=records, epoch=state["ledger"]["epoch"])
        took = time.time() - t0
        self.written.append(
            {
                "id": ckpt_id,
                "records_committed": records,
                "hold_s": round(hold_reached_at - self._holding_since, 4),
                "held_s": round(held, 4),  # the workers waited this long once all held (the cut taken)
                "write_s": round(took, 4),
                "bytes": self.store.size(ckpt_id),
            }
        )
        self.coord.timeline.record(
            "checkpoint",
            "",
            f"checkpoint {ckpt_id} at {records} records "
            f"(barrier {hold_reached_at - self._holding_since:.3f} s, held {held:.3f} s, write {took:.3f} s)",
        )
        log.info(
            "checkpoint %d written at %d committed records (barrier %.3f s, held %.3f s, write %.3f s) to %s",
            ckpt_id,
            records,
            hold_reached_at - self._holding_since,
            held,
            took,
            self.store.root,
            extra={"event": "checkpoint"},
        )
        self.next_id += 1
        self._last_at, self._last_records = time.time(), records

    def summary(self) -> dict:
        return {
            "every": f"{self.every[1]:g} {self.every[0]}",
            "root": self.store.root,
            "written": len(self.written),
            "abandoned": self.abandoned,
            "checkpoints": self.written[-20:],
        }


class JobCheckpoints:
    """A training job's durability: where its checkpoints go, what it resumed from, and the cutting.

    PS mode: a checkpoint is every shard's Save plus the ledger's cut, at the barrier. A resumed job
    restores the ledger at once (before any lease) and every shard once they have registered, before
    any worker starts: shards and ledger are back at the same cut, and what was committed after it
    is trained again.

    allreduce: a checkpoint is rank 0's state at the last committed step (PullState), while no step
    may commit, plus the ledger's cut. A resumed job restores the ledger, starts the rendezvous at the
    checkpoint's step, and serves the checkpoint's state (`member_state`) to the members of its first
    version, which all load it."""

    def __init__(
        self,
        cfg,
        job_id: str,
        root: str,
        model_def,
        coord,
        token: Callable[[], str],
        faults: JobFaults = NO_FAULTS,
    ):
        """`root`: the job's checkpoint folder (master/plan.py checkpoint_root). `token()`: the job's token, which
        its backend gives: a resumed job's ledger goes back to its cut before the backend starts anything, and no
        checkpoint is cut, nor state pulled, before it has."""
        self.cfg, self.coord, self.ledger = cfg, coord, coord.ledger
        self.token = token
        self.store = CheckpointStore(root, fingerprint(cfg, job_id, model_def, coord.ledger))
        every = parse_interval(cfg.checkpoint_every)
        self.allreduce = cfg.strategy == "allreduce"
        self.member_state = None  # allreduce: the MemberState newcomers load (resumed, or every member lost)
        if every:
            self.store.check_writable()
        self.resumed = self.store.latest() if cfg.resume == "auto" else None
        self.state = self.store.read_json(self.resumed, "ledger.json") if self.resumed else {}
        self.restarts: list[dict] = list(self.state.get("restarts", []))
        if self.resumed:
            self._resume(job_id)
        self._last_members: tuple | None = None  # allreduce: (id, ledger cut, member state) of the last cut
        self._cut_members: tuple | None = None  # allreduce: (id, member state) pulled for the cut in progress
        if self.allreduce and every and self.resumed:
            self._last_members = (self.resumed["id"], self.state, self.member_state)
        self.cutter = (
            Checkpointer(
                self.store,
                every,
                coord,
                self._save_members if self.allreduce else self._save_shards,
                self._cut,
                first_id=(self.resumed or {}).get("id", 0) + 1,
                faults=faults,
                parts_lost=self._rank0_unreachable if self.allreduce else None,
            )
            if every
            else None
        )
        if self.cutter:
            self.cutter.restart_from(self.ledger.records_committed_total(), time.time())
        self.eval_history: list[dict] = list(self.state.get("eval_history", []))
        self.ps_restores: list[dict] = []
        self._watermark = (0.0, -1)  # (written at, records) of the last watermark
        self._last_cut: tuple[float, int] | None = None  # (asked at, the id it must reach), once terminated
        self._cut_shards = None  # the cuts' client of the shards (KeptClient), once one is cut

    def _resume(self, job_id: str) -> None:
        """A resumed job: the ledger back at the checkpoint's cut (allreduce: the state the ring starts from), and
        the restart on the record, its figures closed by the first commit."""
        self.ledger.restore(self.state["ledger"])
        if self.allreduce:
            self.member_state = self.store.read_members(self.resumed)
            self.coord.rendezvous.restore(self.member_state.step, self.resumed["id"])  # before any member joined
        self.coord.duplicates_suppressed = self.state.get("duplicates_suppressed", 0)
        started = time.time()
        before = self.store.watermark()
        self.restarts.append(
            {
                "at": started,
                "from_checkpoint": self.resumed["id"],
                "records_committed_at_checkpoint": self.resumed["records_committed"],
                # at least: the watermark is up to WATERMARK_EVERY_S behind the lost master
                "records_trained_again": None if before is None else max(0, before - self.resumed["records_committed"]),
            }
        )
        entry = self.restarts[-1]
        self.coord.pace.until_next_commit(entry, "start_to_first_commit_s", started)
        log.info(
            "resuming job %s from checkpoint %d under %s: %d records committed in epoch %d; the %s "
            "records the previous master committed after it are trained again",
            job_id,
            self.resumed["id"],
            self.store.root,
            self.resumed["records_committed"],
            self.ledger.epoch,
            "(unknown number of)" if before is None else entry["records_trained_again"],
        )
        self.coord.timeline.record(
            "resumed", "", f"from checkpoint {self.resumed['id']} at {self.resumed['records_committed']} records"
        )

    @staticmethod
    def _rank0_unreachable(error: Exception) -> bool:
        """allreduce: rank 0 lost, or a new version formed, while its state was being pulled."""
        import grpc

        return isinstance(error, grpc.RpcError)

    def members_lost(self) -> bool:
        """allreduce, every member gone (lock held): the ledger goes back to the last checkpoint's cut, and
        the newcomers load its state from the master, instead of everything being trained again. False when
        there is no checkpoint to go back to."""
        if self._last_members is None:
            return False
        ckpt_id, state, member = self._last_members
        again = self.ledger.restore(state["ledger"])
        self.member_state = member
        self.coord.rendezvous.restore_locked(member.step, ckpt_id)
        self.coord.timeline.record(
            "rewound", "", f"every member lost: to checkpoint {ckpt_id}, {again} records to train again"
        )
        log.warning(
            "every allreduce member was lost, and the trained weights with them: the ledger goes back to "
            "checkpoint %d, whose state the newcomers load; the %d records committed since are trained again",
            ckpt_id,
            again,
        )
        return True

    def _save_members(self, ckpt_id: int):
        """Rank 0's state at the last committed step (no step commits meanwhile), written by the master (by the
        function returned)."""
        from elastic_step.instance.collective_client import pull_state

        rdv = self.coord.rendezvous
        with self.coord.lock:
            step, (_, address) = rdv.committed_step, rdv.members[0]
        state = pull_state(address, self.token(), step)
        self._cut_members = (ckpt_id, state)
        return lambda: [self.store.write_members(ckpt_id, state)]

    def _kept_shards(self):
        """One client for every cut and restore (a new one cost the held workers its channels' set-up each time)."""
        from elastic_step.ps.client import KeptClient

        if self._cut_shards is None:
            self._cut_shards = KeptClient(self.coord.shard_addresses, self.token())
        return self._cut_shards

    def close(self) -> None:
        if self._cut_shards is not None:
            self._cut_shards.close()

    def _save_shards(self, ckpt_id: int):
        """Each shard keeps a copy of its state while the workers are held (the held workers learn its version);
        the function returned, called once they go on, has the copies sent and writes them: the master writes
        the files, so a PS pod needs no access to the step's output."""
        with self._kept_shards().use() as shards:
            self.coord.cut_taken(shards.take(ckpt_id))

        def write() -> list[str]:
            with self._kept_shards().use() as shards:
                states = shards.send(ckpt_id)
            names = [f"ps-{i}.npz" for i in range(len(states))]
            for name, npz in zip(names, states):
                atomic_write_bytes(self.store.part(ckpt_id, name), npz)
            return names

        return write

    def restore_shards(self, manifest: dict | None = None, generation: int = 0) -> None:
        """Every shard back to a checkpoint (the resumed one by default), as `generation`; called once
        they have all registered."""
        manifest = manifest or self.resumed
        if not manifest:
            return
        import grpc

        try:
            states = [self.store.read_part(manifest, f"ps-{i}.npz") for i in range(len(self.coord.ps_addresses))]
            with self._kept_shards().use() as shards:
                shards.restore(states, generation)
        except (grpc.RpcError, KeyError, OSError) as e:
            detail = e.details() if isinstance(e, grpc.RpcError) else f"{type(e).__name__}: {e}"
            raise CheckpointError(
                f"Cannot restore the parameter servers from checkpoint {manifest['id']} "
                f"under {self.store.root}: {detail}. Delete {self.store.root} to start over, "
                "or pass --resume never."
            ) from None

    def shards_ready(self) -> None:
        """Every shard has registered, before any worker may push. A resumed job restores them; a new one
        cuts a first checkpoint (no barrier needed), so that a PS lost before the first periodic one
        still has a cut to go back to."""
        if self.resumed and self.coord.ps_generation == 0:
            self.restore_shards()
        # A generation past 0: a shard was lost while they registered, and its rewind restored them all
        # (as that generation, which restoring as 0 here would undo: every push refused from then on).
        if self.cutter is not None and not self.resumed:
            self.cutter.write_now()

    def can_restore(self) -> bool:
        return self.cutter is not None and bool(self.cutter.written or self.resumed)

    def rewind(self, lost_ps: int, lost_at: float) -> tuple[dict, int]:
        """A PS was lost: the ledger goes back to the last checkpoint at once, and, until
        `rewound(generation)`, no lease is handed out, no report commits and no worker learns the
        shards' addresses. Returns (the checkpoint's manifest, the generation to restore the shards as)."""
        manifest = self.store.latest()
        state = self.store.read_json(manifest, "ledger.json")
        if self.cutter is not None:
            self.cutter.abandon()
        coord = self.coord
        with coord.lock:
            coord.rewinding = True
            coord.ps_ready.clear()
            coord.ps_addresses[lost_ps] = ""
            again = self.ledger.restore(state["ledger"])
            coord.duplicates_suppressed = state.get("duplicates_suppressed", 0)
            generation = coord.ps_generation + 1
        entry = {"at": lost_at, "ps": lost_ps, "from_checkpoint": manifest["id"], "records_trained_again": again}
        self.ps_restores.append(entry)
        with coord.lock:
            coord.pace.until_next_commit(entry, "loss_to_first_commit_s", lost_at)
        coord.timeline.record(
            "rewound", f"ps-{lost_ps}", f"to checkpoint {manifest['id']}: {again} records to train again"
        )
        log.warning(
            "ps-%d lost: every shard and the ledger go back to checkpoint %d (%d committed records); "
            "the %d records committed since are trained again",
            lost_ps,
            manifest["id"],
            manifest["records_committed"],
            again,
        )
        return manifest, generation

    def rewound(self, generation: int) -> None:
        with self.coord.lock:
            self.coord.ps_generation = generation
            self.coord.rewinding = False

    def _cut(self) -> dict:
        with self.coord.lock:
            rdv = self.coord.rendezvous
            state = {
                "ledger": self.ledger.cut(),
                "ledger_records_committed": self.ledger.records_committed_total(),
                **({"allreduce_step": rdv.committed_step} if rdv is not None else {}),
                "duplicates_suppressed": self.coord.duplicates_suppressed,
                "restarts": self.restarts,
                "eval_history": list(self.eval_history),
            }
            if rdv is not None:  # what every member lost goes back to (kept in memory: the state is in hand)
                ckpt_id, member = self._cut_members
                self._last_members = (ckpt_id, state, member)
            return state

    @property
    def cutting(self) -> bool:
        """A checkpoint is being cut (its barrier is up)."""
        return self.cutter is not None and self.cutter.holding

    def tick(self, committed: int, now: float) -> None:
        if self.cutter is None:
            return
        self.cutter.tick(committed, now)
        at, records = self._watermark
        if now - at >= WATERMARK_EVERY_S and committed != records and not self.coord.rewinding:
            self.store.write_watermark(committed)
            self._watermark = (now, committed)

    def last_cut(self, committed: int, now: float) -> bool:
        """The step is being terminated (SIGTERM: its pod evicted or preempted, the run stopped): cut
        one more checkpoint, and keep the workers held after it, so that a retried step trains nothing
        again. Called on every pump until it returns True: written, not possible now (no checkpoints,
        no shards to cut, a PS being restored), or not done within LAST_CUT_S."""
        c = self.cutter
        if c is None or not self.coord.state_to_cut():
            return True
        if self._last_cut is None:
            self._last_cut = (now, c.next_id)  # the next checkpoint (a barrier already begun ends in it too)
            c.last = True
            log.info("terminated: cutting a last checkpoint so that a retried step resumes where this one stopped")
        asked_at, target = self._last_cut
        c.tick(committed, now)
        if c.next_id > target:
            return True
        if now - asked_at > LAST_CUT_S:
            log.warning(
                "terminated: no last checkpoint within %.0f s (workers %s never held); the retried step "
                "resumes from checkpoint %d",
                LAST_CUT_S,
                self.coord.waiting_for_hold(),
                c.next_id - 1,
            )
            c.abandon()
            return True
        return False

    def resume_note(self) -> str:
        """What a retry of this step (same job id and output) will do, for a person."""
        last = self.cutter.written[-1] if self.cutter and self.cutter.written else None
        if last is None and not self.resumed:
            return "No checkpoint was written: a retried step starts over."
        ckpt_id, records = (
            (last["id"], last["records_committed"]) if last else (self.resumed["id"], self.resumed["records_committed"])
        )
        return (
            f"A retried step (same job id and output) resumes from checkpoint {ckpt_id} at {records} committed "
            f"records, under {self.store.root}."
        )

    def finished(self) -> None:
        """The job succeeded: its model is the output, and a rerun of this job id starts over. The default
        root (OUTPUT/checkpoints) goes too once no other job's checkpoints are left in it, so that a model
        folder holds no empty checkpoints/ (a bucket has no empty folders)."""
        try:
            self.store.fs.rm(self.store.path, recursive=True)
        except FileNotFoundError:
            pass
        root = local_path(os.path.dirname(self.store.root.rstrip("/")))
        if not self.cfg.checkpoint_uri and root is not None:
            with contextlib.suppress(OSError):  # not empty, or already gone
                os.rmdir(root)

    def summary(self) -> dict:
        return {
            **(self.cutter.summary() if self.cutter else {"every": "never"}),
            "restarts": self.restarts,
            "ps_restores": self.ps_restores,
            **({"resumed_from": self.resumed["id"]} if self.resumed else {}),
        }
