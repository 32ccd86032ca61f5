"""The test control plane itself: real apiserver/scheduler/controller-manager + process kubelet."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
import textwrap

import pytest
from kubernetes import client, watch

from tests.infra.kube.harness import ControlPlaneError, wait_for
from tests.infra.kube.harness.pod import Image
from tests.infra.kube.harness.process import alive, stopped

# The harness's self-tests: plain pods that exercise the process kubelet (hostPath volumes among them), not the
# project's pods, so their namespaces enforce no Pod Security level; tests/kubernetes/test_pod_security.py checks
# the restricted level itself.
pytestmark = [
    pytest.mark.kubernetes,
    pytest.mark.pod_security("privileged"),
    pytest.mark.process_pods("the harness's own self-tests: their pods run the host's programs"),
]

POOL = "elastic-step-test/pool"
TAINT = {"key": "elastic-step-test/dedicated", "value": "preemption", "effect": "NoSchedule"}


def py(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def pod_body(name: str, command: list[str], *, env=None, restart="Never", **spec) -> dict:
    container = {"name": "main", "image": "elastic-step:test", "command": command, "env": env or []}
    if "resources" in spec:
        container["resources"] = spec.pop("resources")
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, **spec.pop("metadata", {})},
        "spec": {"restartPolicy": restart, "containers": [container], **spec},
    }


def read(core, ns, name):
    try:
        return core.read_namespaced_pod(name, ns)
    except client.ApiException as e:
        if e.status == 404:
            return None
        raise


def wait_phase(core, ns, name, phases, timeout=60.0):
    return wait_for(
        lambda: (p := read(core, ns, name)) is not None and p.status.phase in phases and p,
        timeout,
        what=f"pod {ns}/{name} in {phases}",
    )


def wait_gone(core, ns, name, timeout=60.0):
    wait_for(lambda: read(core, ns, name) is None, timeout, what=f"pod {ns}/{name} to disappear")


def deleted(core, ns, name, since: str, timeout: int = 60) -> client.V1Pod:
    """The pod as it was when it went away (its last status), watched from resourceVersion `since`."""
    w = watch.Watch()
    for ev in w.stream(
        core.list_namespaced_pod,
        ns,
        field_selector=f"metadata.name={name}",
        resource_version=since,
        timeout_seconds=timeout,
    ):
        if ev["type"] == "DELETED":
            w.stop()
            return ev["object"]
    raise AssertionError(f"pod {ns}/{name} still there after {timeout}s")


SLEEPER = """
    import pathlib, signal, sys, time
    def term(*_):
        {on_term}
    signal.signal(signal.SIGTERM, term)
    pathlib.Path({ready!r}).touch() if {ready!r} else None
    time.sleep(600)
"""


def sleeper(ready: str = "", on_term: str = "sys.exit(0)") -> list[str]:
    return py(SLEEPER.format(ready=ready, on_term=on_term))


# ------------------------------------------------------------------------------------ pods


def test_pod_succeeds_with_downward_api_and_secret_env(core, node, namespace):
    core.create_namespaced_secret(namespace, {"metadata": {"name": "creds"}, "stringData": {"token": "s3cret"}})
    env = [
        {"name": n, "valueFrom": {"fieldRef": {"fieldPath": f}}}
        for n, f in [
            ("NAME", "metadata.name"),
            ("NS", "metadata.namespace"),
            ("UID", "metadata.uid"),
            ("IP", "status.podIP"),
            ("NODE", "spec.nodeName"),
        ]
    ]
    env += [
        {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}},
        {"name": "LITERAL", "value": "at-$(IP)"},
    ]
    keys = ["NAME", "NS", "UID", "IP", "NODE", "TOKEN", "LITERAL", "PROCESS_KUBELET_POD_IP"]
    core.create_namespaced_pod(
        namespace,
        pod_body("ok", py(f"import json, os; print(json.dumps({{k: os.environ.get(k) for k in {keys!r}}}))"), env=env),
    )

    pod = wait_phase(core, namespace, "ok", ("Succeeded", "Failed"))
    assert pod.status.phase == "Succeeded"
    term = pod.status.container_statuses[0].state.terminated
    assert term.exit_code == 0 and term.reason == "Completed"
    assert pod.spec.node_name == "node-1"
    assert pod.status.pod_ip.startswith("127.") and pod.status.pod_ip != "127.0.0.1"
    seen = json.loads(node.log_path(namespace, "ok").read_text().strip().splitlines()[-1])
    assert seen == {
        "NAME": "ok",
        "NS": namespace,
        "UID": pod.metadata.uid,
        "IP": pod.status.pod_ip,
        "NODE": "node-1",
        "TOKEN": "s3cret",
        "LITERAL": f"at-{pod.status.pod_ip}",
        "PROCESS_KUBELET_POD_IP": pod.status.pod_ip,
    }


def test_pod_fails_with_its_exit_code(core, node, namespace):
    core.create_namespaced_pod(namespace, pod_body("bad", py("import sys; print('bye'); sys.exit(3)")))
    pod = wait_phase(core, namespace, "bad", ("Succeeded", "Failed"))
    assert pod.status.phase == "Failed"
    term = pod.status.container_statuses[0].state.terminated
    assert term.exit_code == 3 and term.reason == "Error"


def test_running_pod_reports_running(core, node, namespace, tmp_path):
    ready = tmp_path / "ready"
    core.create_namespaced_pod(namespace, pod_body("run", sleeper(str(ready))))
    pod = wait_phase(core, namespace, "run", ("Running",))
    cs = pod.status.container_statuses[0]
    assert cs.state.running is not None and cs.started and cs.ready
    assert {c.type: c.status for c in pod.status.conditions}["Ready"] == "True"
    core.delete_namespaced_pod("run", namespace, grace_period_seconds=0)
    wait_gone(core, namespace, "run")


def test_on_failure_pod_is_restarted(core, node, namespace, tmp_path):
    counter = tmp_path / "runs"
    core.create_namespaced_pod(
        namespace,
        pod_body(
            "flaky",
            py(f"""
        import pathlib, sys
        p = pathlib.Path({str(counter)!r})
        n = int(p.read_text()) + 1 if p.exists() else 1
        p.write_text(str(n))
        sys.exit(0 if n >= 2 else 1)
    """),
            restart="OnFailure",
        ),
    )
    pod = wait_phase(core, namespace, "flaky", ("Succeeded", "Failed"))
    cs = pod.status.container_statuses[0]
    assert pod.status.phase == "Succeeded" and cs.restart_count == 1
    assert cs.state.terminated.exit_code == 0 and counter.read_text() == "2"


def test_node_is_ready_and_renews_its_lease(control_plane, node):
    core = client.CoreV1Api(control_plane.api_client())
    n = core.read_node("node-1")
    assert n.status.capacity == {"cpu": "8", "memory": "16Gi", "pods": "50", "ephemeral-storage": "100Gi"}
    assert {c.type: c.status for c in n.status.conditions}["Ready"] == "True"
    assert not [t for t in n.spec.taints or [] if t.key.startswith("node.kubernetes.io/")]
    coord = client.CoordinationV1Api(control_plane.api_client())
    first = coord.read_namespaced_lease("node-1", "kube-node-lease").spec
    assert first.holder_identity == "node-1" and first.lease_duration_seconds == 40
    wait_for(
        lambda: coord.read_namespaced_lease("node-1", "kube-node-lease").spec.renew_time > first.renew_time,
        30,
        what="a lease renewal",
    )


# ------------------------------------------------------- init containers, containers, volumes

SHARED = "/var/run/elastic-step-test/shared"  # a real path, seen only inside the pod's containers


def test_init_containers_in_order_then_every_container_at_once_with_volumes_at_their_paths(core, node, namespace):
    core.create_namespaced_config_map(namespace, {"metadata": {"name": "conf"}, "data": {"greeting": "hello"}})
    shared = {"name": "shared", "mountPath": SHARED}
    greeting = {
        "name": "conf",
        "mountPath": "/var/run/elastic-step-test/greeting.txt",
        "subPath": "greeting",
        "readOnly": True,
    }

    def container(name, code, mounts=(shared,)):
        return {"name": name, "image": "elastic-step:test", "command": py(code), "volumeMounts": list(mounts)}

    append = "open(%r, 'a').write('{}\\n')" % (SHARED + "/order")
    # main and side each wait for the other's file: both must run at once.
    handshake = """
        import os, pathlib, sys, time
        pathlib.Path("{shared}/{me}").touch()
        while not os.path.exists("{shared}/{other}"):
            time.sleep(0.05)
        print(open("{shared}/order").read().split(), open("/var/run/elastic-step-test/greeting.txt").read())
        try:
            open("/var/run/elastic-step-test/greeting.txt", "w")
        except OSError as e:
            print("read-only:", e.errno)
        sys.exit({code})
    """
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "multi"},
        "spec": {
            "restartPolicy": "Never",
            "volumes": [{"name": "shared", "emptyDir": {}}, {"name": "conf", "configMap": {"name": "conf"}}],
            "initContainers": [
                container("first", append.format("first")),
                container("second", append.format("second")),
            ],
            "containers": [
                container("main", handshake.format(shared=SHARED, me="main", other="side", code=0), (shared, greeting)),
                container("side", handshake.format(shared=SHARED, me="side", other="main", code=3), (shared, greeting)),
            ],
        },
    }
    core.create_namespaced_pod(namespace, body)
    pod = wait_phase(core, namespace, "multi", ("Succeeded", "Failed"))
    logs = {c: node.log_path(namespace, "multi", c).read_text() for c in ("first", "second", "main", "side")}
    assert pod.status.phase == "Failed", logs  # one container failed
    assert [(c.name, c.state.terminated.exit_code) for c in pod.status.init_container_statuses] == [
        ("first", 0),
        ("second", 0),
    ], logs
    assert {c.name: c.state.terminated.exit_code for c in pod.status.container_statuses} == {"main": 0, "side": 3}
    for c in ("main", "side"):
        assert "['first', 'second'] hello" in logs[c] and "read-only: 30" in logs[c], logs[c]  # EROFS
    assert node.log_path(namespace, "multi") == node.log_path(namespace, "multi", "main")
    assert not os.path.exists(SHARED + "/order")  # the volume was never the host's


def test_a_failed_init_container_fails_the_pod_and_no_container_starts(core, node, namespace):
    body = pod_body("init-fails", py("print('main ran')"))
    body["spec"]["initContainers"] = [
        {"name": "setup", "image": "elastic-step:test", "command": py("raise SystemExit(4)")}
    ]
    core.create_namespaced_pod(namespace, body)
    pod = wait_phase(core, namespace, "init-fails", ("Succeeded", "Failed"))
    assert pod.status.phase == "Failed"
    assert pod.status.init_container_statuses[0].state.terminated.exit_code == 4
    assert pod.status.container_statuses[0].state.waiting.reason == "PodInitializing"
    assert not node.log_path(namespace, "init-fails", "main").exists()


def test_each_container_has_its_own_pid_namespace_under_an_init(core, node, namespace):
    """As in a real pod, a container sees only its own processes: a signal to every process it may
    signal (kill(-1), as Argo's executor sends one) stays inside it. Its command is not PID 1 (an init
    is, as with `docker run --init`), so it can still signal itself."""
    core.create_namespaced_pod(
        namespace,
        pod_body(
            "pids",
            py("""
        import os
        pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
        print("pid", os.getpid(), "sees", pids, "init", open("/proc/1/cmdline").read().split("\\0")[0])
    """),
        ),
    )
    assert wait_phase(core, namespace, "pids", ("Succeeded", "Failed")).status.phase == "Succeeded"
    out = node.log_path(namespace, "pids").read_text()
    pid = re.search(r"pid (\d+) sees", out).group(1)
    assert pid != "1" and f"pid {pid} sees [1, {pid}] init {shutil.which('bash')}" in out, out


def test_a_failed_containers_last_lines_are_its_termination_message_when_asked(core, node, namespace):
    """terminationMessagePolicy FallbackToLogsOnError: a failed container's status message is its
    output's tail (what Argo shows as a failed step's message); a container that succeeded, or one
    with the default policy, gets none."""
    fail = py("""
        import sys
        print("noise " * 20)
        print("line", 1)
        sys.exit("the cause, named")
    """)
    for name, policy, command in (
        ("fails", "FallbackToLogsOnError", fail),
        ("default", None, fail),
        ("succeeds", "FallbackToLogsOnError", py("print('fine')")),
    ):
        body = pod_body(name, command)
        if policy:
            body["spec"]["containers"][0]["terminationMessagePolicy"] = policy
        core.create_namespaced_pod(namespace, body)
    terminated = {
        name: wait_phase(core, namespace, name, ("Succeeded", "Failed")).status.container_statuses[0].state.terminated
        for name in ("fails", "default", "succeeds")
    }
    assert terminated["fails"].exit_code == 1
    assert terminated["fails"].message.endswith("line 1\nthe cause, named"), terminated["fails"].message
    assert terminated["default"].message is None and terminated["succeeds"].message is None


def test_an_image_runs_the_programs_the_kubelet_maps_it_to(core, node, namespace, tmp_path):
    tool = tmp_path / "bin" / "greet"
    tool.parent.mkdir()
    tool.write_text("#!/bin/sh\necho greeted from the image\n")
    tool.chmod(0o755)
    node.images["example.org/tools"] = Image((tool.parent,))
    try:
        for name, image in (("mapped", "example.org/tools:1.0"), ("unmapped", "example.org/other:1.0")):
            body = pod_body(name, ["greet"])
            body["spec"]["containers"][0]["image"] = image
            core.create_namespaced_pod(namespace, body)
        assert wait_phase(core, namespace, "mapped", ("Succeeded", "Failed")).status.phase == "Succeeded"
        assert "greeted from the image" in node.log_path(namespace, "mapped").read_text()
        unmapped = wait_phase(core, namespace, "unmapped", ("Succeeded", "Failed"))
        assert unmapped.status.container_statuses[0].state.terminated.reason == "StartError"
    finally:
        del node.images["example.org/tools"]


# ---------------------------------------------------------------------------- deletion


def test_deleted_pod_gets_sigterm_and_disappears(core, node, namespace, tmp_path):
    """The pod goes when its process exits on SIGTERM, not at the end of its grace period: the
    grace period is an hour, far longer than the test may take."""
    ready, marker = tmp_path / "ready", tmp_path / "sigterm"
    core.create_namespaced_pod(
        namespace,
        pod_body(
            "victim",
            sleeper(str(ready), on_term=f"pathlib.Path({str(marker)!r}).write_text('SIGTERM'); sys.exit(0)"),
            terminationGracePeriodSeconds=3600,
        ),
    )
    since = wait_phase(core, namespace, "victim", ("Running",)).metadata.resource_version
    wait_for(ready.exists, 30, what="the pod's SIGTERM handler")
    core.delete_namespaced_pod("victim", namespace)  # graceful: the pod's hour
    last = deleted(core, namespace, "victim", since)
    assert marker.read_text() == "SIGTERM"
    term = last.status.container_statuses[0].state.terminated
    assert (last.status.phase, term.exit_code, term.reason, term.signal) == ("Succeeded", 0, "Completed", None)


def test_pod_ignoring_sigterm_is_killed_after_grace_period(core, node, namespace, tmp_path):
    """SIGTERM ignored: the process lives on within its grace period (an hour, here) until the test
    lets it show so, then a second deletion shortens the grace period to 1 s and it is SIGKILLed."""
    ready, termed, alive, release = (tmp_path / n for n in ("ready", "termed", "alive", "release"))
    core.create_namespaced_pod(
        namespace,
        pod_body(
            "stubborn",
            py(f"""
        import pathlib, signal, time
        signal.signal(signal.SIGTERM, lambda *_: pathlib.Path({str(termed)!r}).touch())
        pathlib.Path({str(ready)!r}).touch()
        while not pathlib.Path({str(release)!r}).exists():
            time.sleep(0.05)
        pathlib.Path({str(alive)!r}).touch()    # released after SIGTERM: still alive
        time.sleep(600)
    """),
            terminationGracePeriodSeconds=3600,
        ),
    )
    since = wait_phase(core, namespace, "stubborn", ("Running",)).metadata.resource_version
    wait_for(ready.exists, 30, what="the pod's SIGTERM handler")
    pid = node.running()[f"{namespace}/stubborn"]
    core.delete_namespaced_pod("stubborn", namespace)
    wait_for(termed.exists, 30, what="SIGTERM to the pod")
    release.touch()
    wait_for(alive.exists, 30, what="the pod living on in its grace period")
    assert read(core, namespace, "stubborn").metadata.deletion_timestamp is not None
    core.delete_namespaced_pod("stubborn", namespace, grace_period_seconds=1)
    last = deleted(core, namespace, "stubborn", since)
    term = last.status.container_statuses[0].state.terminated
    assert (last.status.phase, term.exit_code, term.signal) == ("Failed", 137, 9), term
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_frozen_pod_stays_running_to_the_api_resumes_and_dies_when_deleted(core, node, namespace, tmp_path):
    """freeze() stops every process of the pod, one in a session of its own too (outside the container's process
    group); the API still calls the pod Running. resume() lets them go on. A frozen pod deleted with grace 0 is
    gone, and so is every one of its processes: SIGKILL reaches a stopped process."""
    ticks = tmp_path / "ticks"
    core.create_namespaced_pod(
        namespace,
        pod_body(
            "frozen",
            py(f"""
        import os, subprocess, sys, time
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
        while True:
            with open({str(ticks)!r}, "a") as f:
                f.write("tick\\n")
            time.sleep(0.05)
    """),
            terminationGracePeriodSeconds=3600,
        ),
    )
    wait_phase(core, namespace, "frozen", ("Running",))
    wait_for(lambda: ticks.exists() and len(node.processes(namespace, "frozen")) >= 4, 30, what="its child")
    frozen = node.freeze(namespace, "frozen")
    assert len(frozen) >= 4, frozen  # the wrapper, the init, the command, its child in a session of its own
    assert [pid for pid in frozen if not stopped(pid)] == []
    seen = ticks.read_text().count("tick")
    assert read(core, namespace, "frozen").status.phase == "Running"
    assert node.resume(namespace, "frozen") == frozen
    wait_for(lambda: ticks.read_text().count("tick") > seen + 2, 30, what="ticks after resume")
    assert [pid for pid in frozen if stopped(pid)] == []
    assert node.freeze(namespace, "frozen") == frozen
    core.delete_namespaced_pod("frozen", namespace, grace_period_seconds=0)
    wait_gone(core, namespace, "frozen")
    wait_for(lambda: not any(alive(pid) for pid in frozen), 30, what="every frozen process killed")
    with pytest.raises(LookupError, match="has no running process"):
        node.freeze(namespace, "frozen")


def test_the_projects_programs_are_forked_preloaded_in_their_containers_namespaces(core, node, namespace):
    """`python -m elastic_step.*` with this interpreter runs forked from the zygote (tests/infra/zygote.py), which
    imported TensorFlow once: its process is the zygote's (its command line), in the container's PID namespace
    (among the pod's processes, which a freeze stops), with the container's stdout and stderr (the CLI's usage
    error in the pod's log) and its exit status (2) as the pod's. Deleted, the pod takes it along."""
    m = [sys.executable, "-m"]
    core.create_namespaced_pod(namespace, pod_body("usage", [*m, "elastic_step.cli", "train"]))
    worker = [*m, "elastic_step.worker", "--master", "127.0.0.1:9", "--index", "0", "--model-def", "none.py"]
    token = [{"name": "ELASTIC_STEP_TOKEN", "value": "t"}]  # its master never answers: it keeps asking
    core.create_namespaced_pod(namespace, pod_body("worker", [*worker, "--num-ps", "0"], env=token))
    usage = wait_phase(core, namespace, "usage", ("Succeeded", "Failed"), timeout=120)
    assert usage.status.container_statuses[0].state.terminated.exit_code == 2
    assert "error: the following arguments are required" in node.log_path(namespace, "usage").read_text()

    def forked() -> set[int]:
        found = set()
        for pid in node.processes(namespace, "worker"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"tests/infra/zygote.py" in f.read():
                    found.add(pid)
        return found

    wait_phase(core, namespace, "worker", ("Running",))
    (instance,) = wait_for(forked, 60, what="the worker forked from the zygote")
    core.delete_namespaced_pod("worker", namespace, grace_period_seconds=0)
    wait_gone(core, namespace, "worker")
    wait_for(lambda: not alive(instance), 30, what="the forked worker gone with its pod")


def test_a_pod_whose_kill_is_held_lives_on_after_its_deletion_until_released(core, node, namespace, tmp_path):
    """hold_kill(): the pod deleted with grace 0 is gone from the API at once, and its processes, frozen, live on (a
    node cut off from the apiserver); resumed, they run (a zombie); release_kill() kills them."""
    ticks = tmp_path / "ticks"
    core.create_namespaced_pod(
        namespace,
        pod_body(
            "held",
            py(f"""
        import time
        while True:
            with open({str(ticks)!r}, "a") as f:
                f.write("tick\\n")
            time.sleep(0.05)
    """),
        ),
    )
    wait_phase(core, namespace, "held", ("Running",))
    wait_for(ticks.exists, 30, what="its first tick")
    frozen = node.freeze(namespace, "held")
    node.hold_kill(namespace, "held")
    core.delete_namespaced_pod("held", namespace, grace_period_seconds=0)
    wait_gone(core, namespace, "held")
    assert node.processes(namespace, "held") == frozen and all(stopped(pid) for pid in frozen)
    seen = ticks.read_text().count("tick")
    assert node.resume(namespace, "held") == frozen
    wait_for(lambda: ticks.read_text().count("tick") > seen + 2, 30, what="the zombie's ticks")
    node.release_kill(namespace, "held")
    wait_for(lambda: not any(alive(pid) for pid in frozen), 30, what="the zombie killed")
    assert node.processes(namespace, "held") == set()
    with pytest.raises(LookupError, match="no kill held"):
        node.release_kill(namespace, "held")


# ----------------------------------------------------------------------------- /dev/shm


def test_each_pod_has_its_own_dev_shm(core, node, namespace, tmp_path):
    """As on nodes: a pod's shared memory works (multiprocessing's, a 64 MiB tmpfs like a container
    runtime's) and is its own: neither another pod nor the host sees it, nor it theirs."""
    host_file = f"/dev/shm/elastic-step-test-host-{namespace}"
    open(host_file, "w").close()
    made, release = tmp_path / "made", tmp_path / "release"
    try:
        core.create_namespaced_pod(
            namespace,
            pod_body(
                "maker",
                py(f"""
            import os, pathlib, time
            from multiprocessing import shared_memory
            seg = shared_memory.SharedMemory(create=True, size=1 << 20)
            seg.buf[:5] = b"hello"
            mine = sorted(os.listdir("/dev/shm"))
            st = os.statvfs("/dev/shm")
            pathlib.Path({str(made)!r}).write_text(seg.name)
            print("maker", mine, st.f_blocks * st.f_frsize, os.path.exists({host_file!r}), flush=True)
            while not pathlib.Path({str(release)!r}).exists():
                time.sleep(0.05)
            assert bytes(seg.buf[:5]) == b"hello"
            seg.close(); seg.unlink()
        """),
            ),
        )
        name = wait_for(lambda: made.exists() and made.read_text(), 60, what="the maker's segment")
        assert not os.path.exists(f"/dev/shm/{name}")  # not on the host
        core.create_namespaced_pod(
            namespace,
            pod_body(
                "other",
                py(f"""
            import os
            from multiprocessing import shared_memory
            try:
                shared_memory.SharedMemory(name={name!r})
                print("other opened", {name!r})
            except FileNotFoundError:
                print("other cannot open", {name!r}, sorted(os.listdir("/dev/shm")))
        """),
            ),
        )
        other = wait_phase(core, namespace, "other", ("Succeeded", "Failed"))
        other_log = node.log_path(namespace, "other").read_text()
        assert other.status.phase == "Succeeded", other_log
        assert f"other cannot open {name} []" in other_log, other_log
        release.touch()
        maker = wait_phase(core, namespace, "maker", ("Succeeded", "Failed"))
        maker_log = node.log_path(namespace, "maker").read_text()
        assert maker.status.phase == "Succeeded", maker_log
        assert f"maker {[name]} {64 << 20} False" in maker_log, maker_log
    finally:
        os.unlink(host_file)


# -------------------------------------------------------------------------- preemption


@pytest.fixture(scope="module")
def small_node(control_plane):
    """Room for exactly two 1-cpu pods; tainted so that only the preemption test uses it."""
    return control_plane.add_node(
        "small-1", cpu="2", memory="4Gi", pods=10, labels={POOL: "preemption"}, taints=[TAINT]
    )


def test_scheduler_preempts_low_priority_pod(control_plane, core, small_node, namespace):
    sched = client.SchedulingV1Api(control_plane.api_client())
    low, high = f"{namespace}-low", f"{namespace}-high"
    sched.create_priority_class({"metadata": {"name": low}, "value": 100, "preemptionPolicy": "Never"})
    sched.create_priority_class({"metadata": {"name": high}, "value": 100000})
    try:
        placement = {
            "nodeSelector": {POOL: "preemption"},
            "tolerations": [{**TAINT, "operator": "Equal"}],
            "terminationGracePeriodSeconds": 3,
            "resources": {"requests": {"cpu": "1", "memory": "100Mi"}},
        }
        for i in (1, 2):
            core.create_namespaced_pod(
                namespace, pod_body(f"low-{i}", sleeper(), priorityClassName=low, **json.loads(json.dumps(placement)))
            )
        for i in (1, 2):
            pod = wait_phase(core, namespace, f"low-{i}", ("Running",))
            assert pod.spec.node_name == "small-1" and pod.spec.priority == 100
        # a third low-priority pod does not fit: it stays Pending
        core.create_namespaced_pod(
            namespace, pod_body("low-3", sleeper(), priorityClassName=low, **json.loads(json.dumps(placement)))
        )
        core.create_namespaced_pod(
            namespace, pod_body("high", sleeper(), priorityClassName=high, **json.loads(json.dumps(placement)))
        )
        pod = wait_phase(core, namespace, "high", ("Running",), timeout=90)
        assert pod.spec.node_name == "small-1" and pod.spec.priority == 100000
        remaining = {p.metadata.name: p.status.phase for p in core.list_namespaced_pod(namespace).items}
        low_running = [n for n, ph in remaining.items() if n.startswith("low-") and ph == "Running"]
        assert len(low_running) == 1, remaining
        assert remaining.get("low-3") == "Pending", remaining
        assert len([n for n in ("low-1", "low-2") if n not in remaining]) == 1, remaining
        events = wait_for(
            lambda: [e for e in core.list_namespaced_event(namespace).items if e.reason == "Preempted"],
            30,
            what="a Preempted event",
        )
        assert events[0].involved_object.name in ("low-1", "low-2")
    finally:
        for pc in (low, high):
            sched.delete_priority_class(pc)


# ------------------------------------------------------------- node shapes: spot, GPUs, taints, drain

SPOT = {"key": "cloud.google.com/gke-spot", "value": "true"}


def unschedulable_message(core, ns, name) -> str:
    """The scheduler's message once it found no node for the pod ("" until then)."""
    p = read(core, ns, name)
    cond = next((c for c in p.status.conditions or [] if c.type == "PodScheduled"), None)
    return cond.message if cond is not None and cond.reason == "Unschedulable" else ""


def test_a_spot_node_with_gpus_takes_only_pods_that_tolerate_it_and_counts_its_gpus(control_plane, core, namespace):
    name = f"gpu-{namespace[-20:]}".strip("-")
    control_plane.add_node(
        name,
        cpu="4",
        labels={SPOT["key"]: "true"},
        taints=[{**SPOT, "effect": "NoSchedule"}],
        extended={"nvidia.com/gpu": "2"},
    )
    try:
        assert core.read_node(name).status.allocatable["nvidia.com/gpu"] == "2"
        tolerate = [{**SPOT, "operator": "Equal", "effect": "NoSchedule"}]

        def gpu_pod(pod_name: str, gpus: str, tolerations: list) -> dict:
            limits = {"nvidia.com/gpu": gpus}
            return pod_body(pod_name, sleeper(), tolerations=tolerations, resources={"limits": limits})

        core.create_namespaced_pod(namespace, gpu_pod("both-gpus", "2", tolerate))
        assert wait_phase(core, namespace, "both-gpus", ("Running",)).spec.node_name == name
        core.create_namespaced_pod(namespace, gpu_pod("one-more", "1", tolerate))
        core.create_namespaced_pod(namespace, gpu_pod("untolerated", "1", []))
        msg = wait_for(lambda: unschedulable_message(core, namespace, "one-more"), 30, what="one-more unschedulable")
        assert "Insufficient nvidia.com/gpu" in msg, msg
        msg = wait_for(lambda: unschedulable_message(core, namespace, "untolerated"), 30, what="untolerated refused")
        assert "untolerated taint" in msg, msg
    finally:
        core.delete_collection_namespaced_pod(namespace, grace_period_seconds=0)
        control_plane.remove_node(name)


def test_a_noexecute_taint_evicts_pods_that_do_not_tolerate_it_and_a_drain_honours_budgets(
    control_plane, core, namespace
):
    name = f"spot-{namespace[-20:]}".strip("-")
    control_plane.add_node(name, cpu="4", labels={SPOT["key"]: "true"}, taints=[{**SPOT, "effect": "NoSchedule"}])
    try:
        placement = {"nodeSelector": {SPOT["key"]: "true"}, "terminationGracePeriodSeconds": 1}
        no_schedule_only = [{**SPOT, "operator": "Equal", "effect": "NoSchedule"}]
        core.create_namespaced_pod(namespace, pod_body("movable", sleeper(), tolerations=no_schedule_only, **placement))
        everything = [{"key": SPOT["key"], "operator": "Exists"}]
        core.create_namespaced_pod(
            namespace,
            pod_body("stays", sleeper(), tolerations=everything, metadata={"labels": {"app": "stays"}}, **placement),
        )
        for n in ("movable", "stays"):
            wait_phase(core, namespace, n, ("Running",))

        control_plane.taint_node(name, SPOT["key"], "true", "NoExecute")
        wait_gone(core, namespace, "movable", timeout=30)
        assert read(core, namespace, "stays").status.phase == "Running"
        assert {(t.key, t.effect) for t in core.read_node(name).spec.taints} == {
            (SPOT["key"], "NoSchedule"),
            (SPOT["key"], "NoExecute"),
        }

        policy = client.PolicyV1Api(control_plane.api_client())
        pdb = {"metadata": {"name": "keep"}, "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "stays"}}}}
        policy.create_namespaced_pod_disruption_budget(namespace, pdb)
        with pytest.raises(ControlPlaneError, match=f"{namespace}/stays"):
            control_plane.drain_node(name, timeout=2)
        assert core.read_node(name).spec.unschedulable is True
        assert read(core, namespace, "stays").metadata.deletion_timestamp is None
        policy.delete_namespaced_pod_disruption_budget("keep", namespace)
        assert control_plane.drain_node(name, timeout=30) == [f"{namespace}/stays"]
        assert read(core, namespace, "stays") is None
    finally:
        core.delete_collection_namespaced_pod(namespace, grace_period_seconds=0)
        control_plane.remove_node(name)


# ---------------------------------------------------------------------- garbage collector


def test_garbage_collector_deletes_dependents_of_deleted_owner(core, node, namespace):
    owner = core.create_namespaced_pod(namespace, pod_body("owner", sleeper(), terminationGracePeriodSeconds=2))
    ref = {"apiVersion": "v1", "kind": "Pod", "name": "owner", "uid": owner.metadata.uid}
    core.create_namespaced_pod(
        namespace,
        pod_body("dependent", sleeper(), terminationGracePeriodSeconds=2, metadata={"ownerReferences": [ref]}),
    )
    wait_phase(core, namespace, "owner", ("Running",))
    wait_phase(core, namespace, "dependent", ("Running",))
    core.delete_namespaced_pod("owner", namespace)
    wait_gone(core, namespace, "owner")
    wait_gone(core, namespace, "dependent", timeout=90)


# ------------------------------------------------------------------------- authn / authz


def grant_pods(control_plane, namespace: str, role: str, verbs: list[str], subject: dict) -> None:
    """Role `role`, `verbs` on pods, bound to `subject` (a RoleBinding's subject: a user, a service account)."""
    rbac = client.RbacAuthorizationV1Api(control_plane.api_client())
    rbac.create_namespaced_role(
        namespace, {"metadata": {"name": role}, "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": verbs}]}
    )
    rbac.create_namespaced_role_binding(
        namespace,
        {
            "metadata": {"name": role},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role},
            "subjects": [subject],
        },
    )


def test_rbac_user_without_delete_gets_403(control_plane, core, namespace):
    user = f"alice-{namespace}"
    grant_pods(
        control_plane,
        namespace,
        "pod-reader",
        ["get", "list", "watch", "create"],
        {"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user},
    )
    token = control_plane.add_token(user, ["elastic-step-testers"])
    alice = client.CoreV1Api(control_plane.api_client(token))
    # RBAC bindings reach the authorizer's cache asynchronously
    wait_for(lambda: _ok(lambda: alice.list_namespaced_pod(namespace)), 10, what="alice's RoleBinding")
    alice.create_namespaced_pod(namespace, pod_body("alices", py("pass")))
    with pytest.raises(client.ApiException) as e:
        alice.delete_namespaced_pod("alices", namespace)
    assert e.value.status == 403
    assert 'cannot delete resource "pods"' in json.loads(e.value.body)["message"]
    with pytest.raises(client.ApiException) as e:
        alice.list_namespaced_pod("default")
    assert e.value.status == 403
    with pytest.raises(client.ApiException) as e:
        client.CoreV1Api(control_plane.api_client("not-a-token")).list_namespaced_pod(namespace)
    assert e.value.status == 401


def _ok(call) -> bool:
    try:
        call()
        return True
    except client.ApiException as e:
        if e.status == 403:
            return False
        raise


def test_pod_uses_its_service_account_token(control_plane, core, node, namespace):
    grant_pods(
        control_plane,
        namespace,
        "get-pods",
        ["get"],
        {"kind": "ServiceAccount", "name": "default", "namespace": namespace},
    )
    core.create_namespaced_pod(
        namespace,
        pod_body(
            "sa",
            py("""
        import json, os, ssl, sys, urllib.error, urllib.request
        sa = "/var/run/secrets/kubernetes.io/serviceaccount"  # at its real path
        token, ns = open(sa + "/token").read(), open(sa + "/namespace").read()
        ctx = ssl.create_default_context(cafile=sa + "/ca.crt")
        url = "https://%s:%s/api/v1/namespaces/%s/pods/%s" % (os.environ["KUBERNETES_SERVICE_HOST"],
              os.environ["KUBERNETES_SERVICE_PORT"], ns, os.environ["HOSTNAME"])
        def call(method):
            req = urllib.request.Request(url, method=method, headers={"Authorization": "Bearer " + token})
            try:
                with urllib.request.urlopen(req, context=ctx) as r:
                    return r.status, json.load(r)
            except urllib.error.HTTPError as e:
                return e.code, json.load(e)
        status, body = call("GET")
        print("GET", status, body.get("spec", {}).get("serviceAccountName"))
        status2, body2 = call("DELETE")
        print("DELETE", status2, body2.get("message"))
        sys.exit(0 if (status, status2) == (200, 403) else 1)
    """),
        ),
    )
    pod = wait_phase(core, namespace, "sa", ("Succeeded", "Failed"))
    out = node.log_path(namespace, "sa").read_text()
    assert pod.status.phase == "Succeeded", out
    assert "GET 200 default" in out and "system:serviceaccount:" + namespace + ":default" in out


def test_service_account_token_from_outside_a_pod(control_plane, namespace):
    token = control_plane.service_account_token(namespace, "runner")
    sa = client.CoreV1Api(control_plane.api_client(token))
    with pytest.raises(client.ApiException) as e:
        sa.list_namespaced_pod(namespace)
    assert e.value.status == 403
    assert f"system:serviceaccount:{namespace}:runner" in json.loads(e.value.body)["message"]
    grant_pods(
        control_plane,
        namespace,
        "list-pods",
        ["list"],
        {"kind": "ServiceAccount", "name": "runner", "namespace": namespace},
    )
    wait_for(lambda: _ok(lambda: sa.list_namespaced_pod(namespace)), 10, what="the RoleBinding")
    kubeconfig = control_plane.kubeconfig_for(token, user="runner")
    from kubernetes import config

    other = client.CoreV1Api(config.new_client_from_config(str(kubeconfig)))
    assert other.list_namespaced_pod(namespace).items == []


# ------------------------------------------------------------------------------ probes (probes.py)
PROBED = """
import http.server, os, sys

flag = sys.argv[1]


class Answer(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # /live, /ready: 500 while the test's flag file for that path exists
        self.send_response(500 if os.path.exists(flag + self.path.replace("/", "-")) else 200)
        self.end_headers()

    def log_message(self, *args):
        pass


http.server.HTTPServer((os.environ["PROCESS_KUBELET_POD_IP"], 8080), Answer).serve_forever()
"""


def test_liveness_and_readiness_probes_fire_as_a_kubelet_s(core, node, namespace, tmp_path):
    """Readiness holds the pod not Ready until it passes, and takes Ready away when it fails; a failing liveness
    probe kills the container, which restarts under the pod's restartPolicy (its restartCount counted), with the
    kubelet's Events. The flags, not time, say when each probe fails."""
    flag = str(tmp_path / "flag")
    probe = {"periodSeconds": 1, "timeoutSeconds": 1}
    body = pod_body(
        "probed",
        [sys.executable, "-c", PROBED, flag],
        restart="Always",
        terminationGracePeriodSeconds=2,
    )
    body["spec"]["containers"][0].update(
        ports=[{"name": "health", "containerPort": 8080}],
        livenessProbe={"httpGet": {"path": "/live", "port": "health"}, "failureThreshold": 2, **probe},
        readinessProbe={"httpGet": {"path": "/ready", "port": 8080}, "failureThreshold": 1, **probe},
    )
    open(flag + "-ready", "w").close()  # not ready from the start
    core.create_namespaced_pod(namespace, body)

    def ready() -> bool:
        pod = read(core, namespace, "probed")
        conditions = {c.type: c.status for c in (pod.status.conditions or [])} if pod else {}
        return conditions.get("Ready") == "True"

    def status():
        return read(core, namespace, "probed").status.container_statuses[0]

    wait_phase(core, namespace, "probed", ("Running",))
    wait_for(lambda: status().state.running is not None, 60, what="the server running")
    assert not ready() and not status().ready
    os.unlink(flag + "-ready")
    wait_for(ready, 30, what="Ready once the readiness probe passes")
    open(flag + "-ready", "w").close()
    wait_for(lambda: not ready(), 30, what="not Ready once the readiness probe fails")
    os.unlink(flag + "-ready")
    wait_for(ready, 30, what="Ready again")
    assert status().restart_count == 0
    open(flag + "-live", "w").close()
    wait_for(lambda: status().restart_count == 1, 60, what="the container restarted by its liveness probe")
    os.unlink(flag + "-live")
    wait_for(ready, 60, what="the restarted container Ready")
    assert status().restart_count == 1 and status().last_state.terminated is not None
    events = core.list_namespaced_event(namespace, field_selector="involvedObject.name=probed").items
    said = {(e.reason, e.message) for e in events}
    assert ("Unhealthy", "Liveness probe failed: HTTP probe failed with statuscode: 500") in said, said
    assert ("Unhealthy", "Readiness probe failed: HTTP probe failed with statuscode: 500") in said, said
    assert ("Killing", "Container main failed liveness probe, will be restarted") in said, said
