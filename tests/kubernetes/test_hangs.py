"""A hung worker on the real control plane, in both strategies: every process of one worker pod frozen (SIGSTOP, by
the process kubelet, as a deadlock or a hung read leaves a pod: Running to the API, its node heartbeating, so no node
controller eviction ever comes). The master (the real CLI, with the shipped Role's rights only) must find it by its
missing progress alone, declare it hung within its --hang-timeout, fence its launch, delete its pod through the
backend (grace 0), requeue its work and replace it. The frozen pod's node holds that kill (cut off from the
apiserver), and its processes are resumed once the master has fenced them, beside their replacement: a zombie. It
must apply nothing (ps: its pushes refused by the PS shard; allreduce: its calls by the master) and exit by itself
with the fenced exit code; then the node's kill lands, and no second pod of that worker is left. Every record is
still applied exactly once, by the tally weights and the audit. (That a grace-0 deletion kills a frozen pod's
processes, SIGKILL reaching a stopped process, is the process kubelet's own test, in test_control_plane.py.)

In ps mode, later in the same job, the parameter server's pod is frozen too: the master's probe finds it silent,
declares it hung within the same --hang-timeout, deletes its pod (grace 0: its frozen processes are killed, and no
second pod of it is ever beside the first), relaunches it and restores every shard from the last checkpoint as a
new generation; the workers whose pushes waited on it wait for that generation instead of crashing.

The freezes fire on training progress: the frozen worker's own model writes a marker once it has fed a set number
of records, and holds its work while the test freezes its pod. The PS runs no model: once the zombie is over, the
test arms a second marker, which the next worker to feed a batch writes, holding its lease (so the job cannot end
meanwhile) while the test freezes the PS's pod. The product cannot freeze a pod (it cannot exec into
one): chaos `stop:` is refused on this backend, so the harness does it. The resume waits on the master's logged
fence, not on time. The bound is asserted as the master's recorded decision (summary.json's events), never as a
duration."""

from __future__ import annotations

import contextlib
import json
import textwrap
from pathlib import Path

import pytest

from elastic_step.instance.api import EXIT_FENCED
from tests.infra.kube.harness import wait_for
from tests.infra.kube.harness.process import alive, started, stopped
from tests.integration.harness import LEASES_OUTLAST_A_KILL
from tests.kubernetes.jobs import start_train, tally_job, train
from tests.kubernetes.test_backend import job_pods, priority_classes, sa_kubeconfig, secret_exists  # noqa: F401
from tests.models.witness import TALLY_MODEL, assert_audit_exact, assert_each_record_applied_exactly

EPOCHS = 12  # the job must still train when the zombie comes back (the tally trains an epoch in ~0.5 s)
FENCED = "worker-1 launch 1 fenced"  # the master's log, as it fences the frozen launch
# Seconds. Wide enough that a healthy worker of a suite that runs beside other jobs on two cores is never held that
# long between commits; far below the node controller's 300 s eviction, which a frozen pod on a live node never gets.
HANG_TIMEOUT = 10
EVICTION_S = 300
HOLD_S = 3  # the marked worker holds its work this long after its marker, for the test to freeze it (or the PS) there
PACE_S = 3

# The tally model, whose worker-1 (its first pod only: not the master's evaluation, not its replacement) writes a
# marker once it has fed AT records, then holds its work until frozen; and whose worker pods, once the test has
# armed the PS's marker, write that one at the next lease they feed (the first to do so only) and hold it. A worker
# feeds a whole lease at once, ahead of training it; the markers count records fed. Between the two marks, in ps,
# they feed a lease every PACE_S at most: far inside the bound, and slow enough that the job still trains once the
# zombie is over, whatever the machine's load (at full speed it may have ended by then).
MARKED = """
import time

_fed = 0


def feed(batch):
    global _fed
    host = os.environ.get("HOSTNAME", "")
    if host == {pod!r}:
        _fed += len(batch["id"])
        if _fed >= {at} and not os.path.exists({marker!r}):
            with open({marker!r}, "w") as f:
                f.write(str(os.getpid()))
            time.sleep({hold})
    elif host.startswith({workers!r}):
        if os.path.exists({ps_armed!r}):
            try:
                fd = os.open({ps_marker!r}, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                pass
            else:
                os.write(fd, host.encode())
                os.close(fd)
                time.sleep({hold})
        elif {pace} and os.path.exists({marker!r}):
            time.sleep({pace})
    return tally_feed(batch)
"""


def marked_tally(tmp_path: Path, pod: str, at: int, marker: Path, workers: str, ps: tuple[Path, Path] | None) -> str:
    """`workers`: the prefix of the job's worker pods' names; `ps`: the file the test writes to arm the PS's
    marker, and that marker (None: no PS to freeze)."""
    path = tmp_path / "marked_tally.py"
    source = open(TALLY_MODEL).read().replace("def feed(", "def tally_feed(")
    ps_armed, ps_marker = ps or (path.with_name("never"), path.with_name("never"))
    marks = {"ps_armed": str(ps_armed), "ps_marker": str(ps_marker), "workers": workers, "pace": PACE_S if ps else 0}
    path.write_text(source + textwrap.dedent(MARKED.format(pod=pod, at=at, marker=str(marker), hold=HOLD_S, **marks)))
    return str(path)


def instance_pods(core, namespace: str, job: str, index: int, role: str = "worker") -> list[str]:
    """The names of the pods of `role` `index` of the job that the API holds now."""
    selector = f"elastic-step/job={job},elastic-step/role={role},elastic-step/index={index}"
    return sorted(p.metadata.name for p in core.list_namespaced_pod(namespace, label_selector=selector).items)


@pytest.mark.parametrize("strategy", ["ps", "allreduce"])
def test_a_frozen_worker_pod_is_declared_hung_fenced_replaced_and_refused_when_it_comes_back(
    control_plane, core, node, namespace, tally_data, priority_classes, sa_kubeconfig, tmp_path, strategy
):
    """The frozen pod's kill is held (a node cut off from the apiserver: the pod is gone from the API, its processes
    are not), and it is resumed once the master has fenced it, as when the node's network returns: a zombie beside
    its replacement. It applies nothing (ps: the PS refuses its pushes; allreduce: the master refuses its calls, the
    ring its frames) and exits by itself, fenced; then the node's kill lands."""
    job, out, log, marker = f"hang-{strategy}", tmp_path / "out", tmp_path / "master.log", tmp_path / "marked"
    ps_armed, ps_marker = tmp_path / "ps-armed", tmp_path / "ps-marked"
    frozen_pod = f"{job}-worker-1"  # its first launch; its replacement is {job}-worker-1-2
    rows = tally_data["rows"]
    # Mid-epoch 2 of the job: worker-1 feeds about half of each epoch, far from an epoch's evaluation.
    ps = (ps_armed, ps_marker) if strategy == "ps" else None
    model = marked_tally(tmp_path, frozen_pod, rows * 3 // 4, marker, f"{job}-worker-", ps)
    # ps: a checkpoint every two epochs' records, the last of them to go back to once the PS is frozen. Not every
    # epoch's: a cut's barrier then comes about when worker-1 is frozen, and the zombie's first call may be the
    # barrier's (refused by the master) rather than a push.
    ps_settings = LEASES_OUTLAST_A_KILL | {"checkpoint_every": str(rows * 2)}
    settings = {"global_batch": "fixed"} if strategy == "allreduce" else ps_settings  # the tally: lr 1
    # Both workers before the first lease: an epoch takes about a second, and worker-0 alone could train the job
    # while worker-1's pod still imports TensorFlow, so worker-1 would never reach its mark.
    settings = settings | {"min_workers": 2}
    params = tally_job(job, tally_data, out, EPOCHS, strategy=strategy, hang_timeout=HANG_TIMEOUT, **settings)
    master = start_train(sa_kubeconfig, namespace, log, **(params | {"model_def": model}))
    held = False
    try:
        wait_for(lambda: marker.exists() or master.poll() is not None, 300, interval=0.05, what="worker-1's mark")
        assert marker.exists(), f"worker-1 never reached its mark: the test proved nothing\n{log.read_text()[-3000:]}"
        frozen = node.freeze(namespace, frozen_pod)
        assert frozen and all(stopped(pid) for pid in frozen), frozen
        frozen_since = {pid: started(pid) for pid in frozen}  # PIDs are reused: each one's start names it
        node.hold_kill(namespace, frozen_pod)
        held = True

        # The master's decision, as it makes it: worker-1's launch fenced, then its pod deleted (the kill held).
        def decided() -> bool:
            text = log.read_text()
            return (FENCED in text and f"pod {frozen_pod} deleted with grace 0" in text) or master.poll() is not None

        wait_for(decided, 240, interval=0.1, what="the master to fence worker-1 and delete its pod")
        assert master.poll() is None, f"the job ended before worker-1 was fenced\n{log.read_text()[-4000:]}"
        assert node.processes(namespace, frozen_pod) == frozen, "the frozen pod's kill was not held"
        # Gone from the API at once, its processes not: the API holds its replacement at most, never both.
        assert (pods := instance_pods(core, namespace, job, 1)) in ([], [f"{frozen_pod}-2"]), pods
        # Its node's network returns: the zombie runs on beside its replacement. It may apply nothing, and exits by
        # itself once refused.
        node.resume(namespace, frozen_pod)
        # Its end as its node records it (a moment after its process is gone).
        exit_codes = wait_for(lambda: node.exit_codes(namespace, frozen_pod), 120, what="the zombie's own exit")
        assert not node.processes(namespace, frozen_pod)
        assert (pods := instance_pods(core, namespace, job, 1)) in ([], [f"{frozen_pod}-2"]), pods
        zombie_log = node.log_path(namespace, frozen_pod).read_text()
        assert exit_codes == {"worker": EXIT_FENCED}, (exit_codes, zombie_log[-3000:])
        assert "fenced: worker-1 launch 1" in zombie_log, zombie_log[-3000:]
        node.release_kill(namespace, frozen_pod)  # the node acts on the deletion it held: nothing is left to kill
        held = False
        if strategy == "ps":
            frozen_ps = freeze_the_ps(core, node, namespace, job, master, log, ps_armed, ps_marker)
        master.wait(timeout=400)
    finally:
        if held:
            with contextlib.suppress(LookupError):
                node.release_kill(namespace, frozen_pod)
        if master.poll() is None:
            master.kill()
    text = log.read_text()
    assert master.returncode == 0, text[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["backend"] == "kubernetes"

    # The master's decision: worker-1 (and, in ps, the PS after it) and only them, declared hung past its
    # --hang-timeout, far below an eviction: not the workers whose pushes waited on the frozen PS.
    events = summary["events"]
    hung = [e for e in events if e["kind"] == "hung"]
    expected = [("worker-1", HANG_TIMEOUT)] + ([("ps-0", HANG_TIMEOUT)] if strategy == "ps" else [])
    assert [(e["instance"], e["bound_s"]) for e in hung] == expected, hung
    assert hung[0]["idle_s"] >= HANG_TIMEOUT and HANG_TIMEOUT < EVICTION_S, hung
    assert "worker-1: no progress for" in text and "declared hung" in text, text[-3000:]
    after = [e for e in events if e["t"] >= hung[0]["t"] and e["instance"] == "worker-1"]
    # Fenced (its first launch) before its lease was requeued: the timeline's order, not its clock.
    fenced = [e for e in events if e["kind"] == "fenced" and e["instance"] == "worker-1"]
    assert [e["launch"] for e in fenced] == [1] and "declared hung" in fenced[0]["detail"], fenced
    requeued = [i for i, e in enumerate(events) if e["kind"] == "requeued" and e["instance"] == "worker-1"]
    assert all(events.index(fenced[0]) < i for i in requeued), events
    assert any(e["kind"] == "lost" and "declared hung" in e["detail"] for e in after), after
    assert any(e["kind"] == "decision" and e["detail"].startswith("relaunch:") for e in after), after
    assert any(e["kind"] == "running" for e in after), after  # the replacement pod ran
    if strategy == "ps":  # its leases' remainder went back to the queue
        assert any(e["kind"] == "requeued" for e in after), after
    assert summary["workers"]["lost"] == 1 and summary["workers"]["relaunched"] == 1, summary["workers"]
    # No worker whose push waited on the frozen PS crashed: the only decisions are worker-1's, and the PS's restore.
    decided = [(e["instance"], e["detail"].split(":")[0]) for e in events if e["kind"] == "decision"]
    assert decided == [("worker-1", "relaunch")] + ([("ps-0", "restore")] if strategy == "ps" else []), decided
    if strategy == "ps":
        assert_the_ps_was_restored(summary, text, job)

    # The zombie's work was refused where it went, each by its own witness.
    refused_calls = summary["fencing"]["fenced"]["worker-1"]["refused"]
    if strategy == "ps":  # the PS shard's own log (its first pod's: the relaunched one counts afresh)
        ps_log = node.log_path(namespace, f"{job}-ps-0").read_text()
        refused_pushes = ps_log.count("refused a push of worker-1 launch 1")
        assert refused_pushes >= 1, (ps_log[-2000:], zombie_log[-3000:])
    else:  # the master's (its step reports, ring membership), and the first refusal on the timeline
        assert refused_calls >= 1 and any(e["kind"] == "fence_refused" for e in after), summary["fencing"]

    # Its pod deleted with grace 0 (the node held that kill until the zombie had ended by itself), and no second pod
    # of worker-1 beside its replacement.
    assert not any(alive(pid, since) for pid, since in frozen_since.items()), sorted(frozen)
    assert f"pod {frozen_pod} deleted with grace 0" in text, text[-3000:]
    assert instance_pods(core, namespace, job, 1) == [] and job_pods(core, namespace, job) == []
    if strategy == "ps":
        assert not any(alive(pid, since) for pid, since in frozen_ps.items()), frozen_ps

    assert_each_record_applied_exactly(out, tally_data, EPOCHS)
    assert_audit_exact(summary, strategy)


def freeze_the_ps(core, node, namespace: str, job: str, master, log: Path, armed: Path, marker: Path) -> dict:
    """Once a checkpoint was cut mid-job, arm the PS's marker; freeze the PS's pod at the marker, and follow the
    master's handling of it to its relaunched pod: declared hung, its pod deleted with grace 0 (the frozen processes
    killed), its successor created only then. The API never holds two pods of ps-0 at once. Returns the frozen
    processes' PIDs, each with its start."""
    ps_pod = f"{job}-ps-0"
    # The first checkpoint is the start's, at 0 records; the next is the first one the job's records cut.
    wait_for(lambda: "checkpoint 2 written" in log.read_text() or master.poll() is not None, 120, what="a checkpoint")
    armed.write_text("")
    wait_for(lambda: marker.exists() or master.poll() is not None, 120, interval=0.05, what="the PS's mark")
    assert marker.exists(), f"no worker reached the PS's mark: the PS freeze never fired\n{log.read_text()[-3000:]}"
    frozen = node.freeze(namespace, ps_pod)
    assert frozen and all(stopped(pid) for pid in frozen), frozen
    frozen = {pid: started(pid) for pid in frozen}
    seen: list[list[str]] = []

    def relaunched() -> bool:
        seen.append(instance_pods(core, namespace, job, 0, role="ps"))
        return bool(node.processes(namespace, f"{ps_pod}-2")) or master.poll() is not None

    wait_for(relaunched, 240, interval=0.1, what="the master to declare ps-0 hung and relaunch its pod")
    assert master.poll() is None, f"the job ended before ps-0 was relaunched\n{log.read_text()[-4000:]}"
    assert all(len(pods) <= 1 for pods in seen), [pods for pods in seen if len(pods) > 1]
    assert [ps_pod] in seen and [f"{ps_pod}-2"] in seen, seen  # the frozen pod, then its successor alone
    # Killed by its node as it saw the deletion, beside the successor's start: on its own thread, so it may land a
    # moment after the successor runs, never much later.
    wait_for(lambda: not any(alive(p, t) for p, t in frozen.items()), 30, what="the frozen PS's end after its deletion")
    return frozen


def assert_the_ps_was_restored(summary: dict, text: str, job: str) -> None:
    """ps-0 was declared hung for its silence and killed (its pod deleted with grace 0), then handled as a lost PS:
    relaunched, and every shard back to the last checkpoint cut before it froze."""
    events = summary["events"]
    (ps_hung,) = [e for e in events if e["kind"] == "hung" and e["instance"] == "ps-0"]
    assert ps_hung["idle_s"] >= HANG_TIMEOUT and "no answer for" in ps_hung["detail"], ps_hung
    assert "ps-0: no answer for" in text, text[-3000:]
    after = [e for e in events if e["t"] >= ps_hung["t"] and e["instance"] == "ps-0"]
    assert any(e["kind"] == "lost" and "declared hung" in e["detail"] for e in after), after
    assert f"pod {job}-ps-0 deleted with grace 0" in text, text[-3000:]
    # Restored from the last checkpoint written before it was declared hung (none is cut while a shard is silent),
    # one the job's records cut: not the start's.
    (restore,) = summary["checkpoints"]["ps_restores"]
    cuts = [e for e in events if e["kind"] == "checkpoint" and e["t"] <= ps_hung["t"]]
    last = int(cuts[-1]["detail"].split()[1]) if cuts else None
    assert restore["ps"] == 0 and restore["from_checkpoint"] == last and last >= 2, (restore, cuts)
    assert any(e["kind"] == "rewound" for e in after), after


def test_chaos_stop_is_refused_at_the_jobs_start(core, node, namespace, tally_data, sa_kubeconfig, tmp_path):
    """The master cannot freeze a pod: a `stop` fails the job before anything trains, with why and what to do,
    and leaves nothing behind (no pod, no token Secret)."""
    params = tally_job("stop-refused", tally_data, tmp_path / "out", 1)
    proc, _ = train(sa_kubeconfig, namespace, "--chaos", "stop:worker-1@100", timeout=300, **params)
    assert proc.returncode != 0
    assert "--chaos stop: the kubernetes backend cannot freeze an instance" in proc.stderr, proc.stderr[-3000:]
    assert "Use --backend local" in proc.stderr
    assert job_pods(core, namespace, "stop-refused") == []
    assert not secret_exists(core, namespace, "stop-refused-token")
