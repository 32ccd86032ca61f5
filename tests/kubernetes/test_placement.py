"""Spot nodes and GPUs on the real control plane, with the real kube-scheduler placing every pod: the workers ask for a
GPU each (`worker_accelerators`), tolerate and prefer the spot pool (`spot_nodes`, by default the well-known spot
labels), and the parameter server stays on an on-demand node. A node advertising 2 GPUs runs exactly 2 of 4 workers
while the others wait, Pending; a second GPU node lets them in; the spot node drained through the Eviction API moves
its workers to a third. Every record is still applied exactly once, by the tally weights and the audit.

The master takes the image from its step's pod, and gives the GPU workers that image's GPU variant (TensorFlow's CUDA
build), as a role with accelerators does when no worker_image is set; the PS runs the step's image. No GPU backs the
nodes' `nvidia.com/gpu`, so each worker falls back to its CPU and says why: TensorFlow itself reports a CUDA build
that found no GPU, which the CPU image could not."""

from __future__ import annotations

import contextlib

import pytest

from tests.infra.kube.harness import wait_for
from tests.kubernetes.jobs import EPOCHS_HELD, STEP_IMAGE, registrations, run_held, step_pod_env
from tests.kubernetes.test_backend import job_pods, priority_classes, sa_kubeconfig, sleeper_pod  # noqa: F401
from tests.models.witness import assert_audit_exact, assert_each_record_applied_exactly

SPOT = ("cloud.google.com/gke-spot", "true")  # GKE's spot label and taint: one of spot_nodes' well-known ones
GPU = "nvidia.com/gpu"


def gpu_node(control_plane, name: str, spot: bool):
    labels = {SPOT[0]: SPOT[1]} if spot else {}
    taints = [{"key": SPOT[0], "value": SPOT[1], "effect": "NoSchedule"}] if spot else []
    return control_plane.add_node(
        name, cpu="4", memory="8Gi", pods=20, labels=labels, taints=taints, extended={GPU: "2"}
    )


def placement(core, namespace: str, job: str) -> dict[str, str]:
    """{pod: its node, or "pending: <the scheduler's reason>"} of the job's live pods."""
    out = {}
    for p in job_pods(core, namespace, job):
        if p.metadata.deletion_timestamp:
            continue
        if p.spec.node_name:
            out[p.metadata.name] = p.spec.node_name
        else:
            scheduled = next((c for c in p.status.conditions or [] if c.type == "PodScheduled"), None)
            out[p.metadata.name] = f"pending: {scheduled.message if scheduled else ''}"
    return out


@pytest.mark.gpu_image
def test_gpu_workers_wait_for_gpus_prefer_spot_and_move_when_the_spot_node_is_drained(
    control_plane, core, node, namespace, tally_data, priority_classes, sa_kubeconfig, tmp_path
):
    job, added = "gpus", []
    step = sleeper_pod(core, namespace, "step", image=STEP_IMAGE)  # the pod the step's master would run in
    images = {}
    try:
        added.append(gpu_node(control_plane, "spot-gpu", spot=True).name)

        def steps(master, log):
            # 2 GPUs: kube-scheduler runs two workers, on the spot node they prefer; two wait for a GPU.
            def two_and_two() -> bool:
                where = placement(core, namespace, job)
                workers = [v for k, v in where.items() if "-worker-" in k]
                return (workers.count("spot-gpu") == 2 and sum(v.startswith("pending") for v in workers) == 2) or (
                    master.poll() is not None
                )

            wait_for(lambda: two_and_two() and registrations(log) >= 2, 300, what="two workers on GPUs, two waiting")
            where = placement(core, namespace, job)
            pending = [v for k, v in where.items() if "-worker-" in k and v.startswith("pending")]
            assert all(f"Insufficient {GPU}" in v for v in pending), where  # the scheduler's own reason
            assert where[f"{job}-ps-0"] not in ("spot-gpu",) and not where[f"{job}-ps-0"].startswith("pending"), where
            # A second GPU node (on-demand) joins: the two waiting workers start there and join the job.
            added.append(gpu_node(control_plane, "gpu-2", spot=False).name)
            wait_for(lambda: registrations(log) >= 4 or master.poll() is not None, 240, what="all four workers")
            where = placement(core, namespace, job)
            assert sorted(v for k, v in where.items() if "-worker-" in k) == ["gpu-2"] * 2 + ["spot-gpu"] * 2, where
            # The spot node is reclaimed: drained, its workers evicted; a third GPU node takes their replacements.
            added.append(gpu_node(control_plane, "gpu-3", spot=False).name)
            evicted = control_plane.drain_node("spot-gpu")  # cordon, then the Eviction API (honours PDBs)
            assert len([p for p in evicted if "-worker-" in p]) == 2, evicted
            wait_for(lambda: registrations(log) >= 6 or master.poll() is not None, 240, what="the replacements")
            where = placement(core, namespace, job)
            assert sorted(v for k, v in where.items() if "-worker-" in k) == ["gpu-2"] * 2 + ["gpu-3"] * 2, where
            images.update({p.metadata.name: p.spec.containers[0].image for p in job_pods(core, namespace, job)})

        summary, text, out = run_held(
            sa_kubeconfig,
            namespace,
            tmp_path,
            tally_data,
            job,
            steps,
            max_workers=4,
            worker_memory="1Gi",
            worker_accelerators=f"{GPU}=1",
            worker_image="",
            env=step_pod_env(step),
        )
    finally:
        for name in added:
            with contextlib.suppress(Exception):
                control_plane.remove_node(name)
    lost = [e for e in summary["events"] if e["kind"] == "lost"]
    assert len(lost) == 2 and all("EvictionByEvictionAPI" in e["detail"] for e in lost), lost
    assert images[f"{job}-ps-0"] == STEP_IMAGE, images
    assert {i for p, i in images.items() if "-worker-" in p} == {f"{STEP_IMAGE}-gpu"}, images
    # Every launch trained in the GPU image, on its CPU: TensorFlow's CUDA build, with no GPU to see.
    devices = summary["workers"]["devices"]
    assert len(devices) == 6 and {d["device"] for d in devices} == {"CPU (no GPU visible)"}, devices
    assert_each_record_applied_exactly(out, tally_data, EPOCHS_HELD)
    assert_audit_exact(summary, "ps")
