"""Pods inside the runtime image under runc (tests.infra.kube.harness.oci): the image scripts/build-image builds, its
user, its Python and its packages, the pod's environment, volumes, security context and address; and nothing of the
host's."""

from __future__ import annotations

import contextlib
import json
import pathlib
import re
import textwrap

import pytest
from kubernetes import client

from elastic_step.pipelines.argo import IMAGE
from tests.infra.kube.harness import wait_for
from tests.infra.kube.harness.process import alive
from tests.kubernetes.test_control_plane import deleted, pod_body, wait_phase

# The image runtime's self-tests: plain pods that exercise runc under the kubelet (a root container refused, hostPath
# volumes), so their namespaces enforce no Pod Security level; the project's pods are checked at the restricted
# level in tests/kubernetes/test_pod_security.py.
pytestmark = [pytest.mark.kubernetes, pytest.mark.pod_security("privileged")]

REPORT = """
    import json, os, pathlib, socket, sys
    out = {"uid": os.getuid(), "gid": os.getgid(), "groups": sorted(os.getgroups()), "python": sys.executable,
           "hostname": socket.gethostname(), "image": json.load(open("/opt/elastic-step/image.json"))["version"]}
    status = dict(l.split(":", 1) for l in open("/proc/self/status").read().splitlines())
    out["caps"], out["no_new_privs"] = status["CapEff"].strip(), status["NoNewPrivs"].strip()
    import elastic_step
    out["package"] = elastic_step.__file__
    out["env"] = {k: os.environ.get(k) for k in ("GREETING", "POD_IP", "VIRTUAL_ENV", "PYTEST_CURRENT_TEST")}
    out["secret"] = open("/etc/greeting/word").read()
    out["token"] = bool(open("/var/run/secrets/kubernetes.io/serviceaccount/token").read())
    out["shm"] = [l.split()[2] for l in open("/proc/mounts") if l.split()[1] == "/dev/shm"]
    s = socket.socket()
    s.bind((os.environ["POD_IP"], 0))
    out["bound"] = s.getsockname()[0]
    for where in ("/work/written", "/home/elastic/written"):
        try:
            pathlib.Path(where).write_text("x")
            out[where] = "written"
        except OSError as e:
            out[where] = e.strerror
    print(json.dumps(out))
"""


def image_pod(name: str, command: list[str], **spec) -> dict:
    body = pod_body(
        name,
        command,
        env=[
            {"name": "GREETING", "value": "hello"},
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        ],
        **spec,
    )
    container = body["spec"]["containers"][0]
    container["image"] = IMAGE
    container["volumeMounts"] = [
        {"name": "work", "mountPath": "/work"},
        {"name": "greeting", "mountPath": "/etc/greeting", "readOnly": True},
    ]
    body["spec"]["volumes"] = [
        {"name": "work", "emptyDir": {}},
        {"name": "greeting", "secret": {"secretName": "greeting"}},
    ]
    return body


def report(node, namespace: str, name: str) -> dict:
    return json.loads(node.log_path(namespace, name).read_text().strip().splitlines()[-1])


def test_a_pod_runs_inside_the_image_under_runc_as_the_images_user_with_its_volumes_and_address(
    core, image_node, namespace
):
    core.create_namespaced_secret(namespace, {"metadata": {"name": "greeting"}, "stringData": {"word": "secret"}})
    command = ["python", "-c", textwrap.dedent(REPORT)]
    core.create_namespaced_pod(namespace, image_pod("plain", command))
    locked = image_pod(
        "locked",
        command,
        securityContext={"runAsUser": 2000, "runAsGroup": 3000, "fsGroup": 4000, "runAsNonRoot": True},
    )
    locked["spec"]["containers"][0]["securityContext"] = {
        "readOnlyRootFilesystem": True,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
    }
    core.create_namespaced_pod(namespace, locked)
    root = image_pod("root", command, securityContext={"runAsUser": 0, "runAsNonRoot": True})
    core.create_namespaced_pod(namespace, root)

    plain = wait_phase(core, namespace, "plain", ("Succeeded", "Failed"), timeout=180)
    assert plain.status.phase == "Succeeded", image_node.log_path(namespace, "plain").read_text()
    out = report(image_node, namespace, "plain")
    assert (out["uid"], out["gid"]) == (1000, 1000)  # the image's numeric user
    assert out["python"] == "/opt/elastic-step/bin/python"
    assert out["package"].startswith("/opt/elastic-step/lib/python3.11/site-packages/elastic_step/")
    assert out["image"] == IMAGE.rsplit(":", 1)[1]
    assert out["hostname"] == "plain"
    assert out["env"] == {
        "GREETING": "hello",
        "POD_IP": plain.status.pod_ip,
        "VIRTUAL_ENV": None,
        "PYTEST_CURRENT_TEST": None,
    }  # the pod's environment, none of the host's
    assert out["secret"] == "secret" and out["token"] and out["shm"] == ["tmpfs"]
    assert out["bound"] == plain.status.pod_ip
    assert out["/work/written"] == out["/home/elastic/written"] == "written"  # emptyDir; its own writable layer
    assert out["caps"] == "0000000000000000" and out["no_new_privs"] == "0"  # a non-root user keeps no capability

    wait_phase(core, namespace, "locked", ("Succeeded", "Failed"), timeout=180)
    out = report(image_node, namespace, "locked")
    assert (out["uid"], out["gid"], out["groups"]) == (2000, 3000, [4000])
    assert out["/work/written"] == "written" and out["/home/elastic/written"] == "Read-only file system"
    assert out["no_new_privs"] == "1"

    waiting = wait_for(
        lambda: (s := core.read_namespaced_pod("root", namespace).status.container_statuses) and s[0].state.waiting,
        60,
        what="the root pod refused",
    )
    assert waiting.reason == "CreateContainerConfigError" and "runAsNonRoot" in waiting.message


def test_a_worker_importing_what_the_image_lacks_fails_as_on_a_cluster(core, image_node, namespace):
    """The model module imports a package of the tests' environment that the image does not hold: the worker's
    loading of it fails inside the image, though the host could import it."""
    core.create_namespaced_config_map(
        namespace, {"metadata": {"name": "model"}, "data": {"model.py": "import hypothesis\n"}}
    )
    body = pod_body(
        "worker",
        ["python", "-c", "from elastic_step.model_def import load_model_def; load_model_def('/models/model.py')"],
    )
    container = body["spec"]["containers"][0]
    container["image"] = IMAGE
    container["volumeMounts"] = [{"name": "model", "mountPath": "/models"}]
    body["spec"]["volumes"] = [{"name": "model", "configMap": {"name": "model"}}]
    core.create_namespaced_pod(namespace, body)
    pod = wait_phase(core, namespace, "worker", ("Succeeded", "Failed"), timeout=180)
    assert pod.status.phase == "Failed"
    assert pod.status.container_statuses[0].state.terminated.exit_code == 1
    assert "No module named 'hypothesis'" in image_node.log_path(namespace, "worker").read_text()


def test_a_deleted_image_pod_that_ignores_sigterm_is_killed_at_the_end_of_its_grace_period(core, image_node, namespace):
    code = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(600)"
    )
    body = pod_body("stubborn", ["python", "-c", code], terminationGracePeriodSeconds=2)
    body["spec"]["containers"][0]["image"] = IMAGE
    core.create_namespaced_pod(namespace, body)
    since = wait_phase(core, namespace, "stubborn", ("Running",), timeout=120).metadata.resource_version
    wait_for(lambda: "up" in image_node.log_path(namespace, "stubborn").read_text(), 60, what="the container up")
    pids = image_node.processes(namespace, "stubborn")
    assert len(pids) >= 2  # runc and the container's process
    core.delete_namespaced_pod("stubborn", namespace)
    last = deleted(core, namespace, "stubborn", since)
    term = last.status.container_statuses[0].state.terminated
    assert term.exit_code == 137, term
    assert not image_node.processes(namespace, "stubborn")
    try:
        core.read_namespaced_pod("stubborn", namespace)
        raise AssertionError("the pod is still there")
    except client.ApiException as e:
        assert e.status == 404


def test_the_projects_programs_are_forked_in_the_image_from_its_own_zygote_as_the_containers_user(
    core, image_node, namespace
):
    """`python -m elastic_step.*` in the image runs forked from a zygote that runs inside the image (the image's
    Python, which imported the image's TensorFlow once): in the container's PID namespace, as the container's user,
    with the container's output and exit status. Deleted, the pod takes it along."""
    usage = pod_body("usage", ["python", "-m", "elastic_step.cli", "train"])
    usage["spec"]["containers"][0]["image"] = IMAGE
    core.create_namespaced_pod(namespace, usage)
    argv = ["python", "-m", "elastic_step.worker", "--master", "127.0.0.1:9", "--index", "0", "--model-def", "none.py"]
    worker = pod_body("worker", [*argv, "--num-ps", "0"], env=[{"name": "ELASTIC_STEP_TOKEN", "value": "t"}])
    worker["spec"]["containers"][0]["image"] = IMAGE
    core.create_namespaced_pod(namespace, worker)
    done = wait_phase(core, namespace, "usage", ("Succeeded", "Failed"), timeout=180)
    assert done.status.container_statuses[0].state.terminated.exit_code == 2
    assert "error: the following arguments are required" in image_node.log_path(namespace, "usage").read_text()

    def forked() -> dict[int, str]:
        found = {}
        for pid in image_node.processes(namespace, "worker"):
            with contextlib.suppress(OSError):
                if b"/mnt/zygote.py" in pathlib.Path(f"/proc/{pid}/cmdline").read_bytes():
                    status = pathlib.Path(f"/proc/{pid}/status").read_text()
                    found[pid] = re.search(r"(?m)^Uid:\s+(\d+)", status).group(1)
        return found

    wait_phase(core, namespace, "worker", ("Running",), timeout=120)
    ((instance, uid),) = wait_for(forked, 120, what="the worker forked from the image's zygote").items()
    assert uid == "1000"
    core.delete_namespaced_pod("worker", namespace, grace_period_seconds=0)
    wait_for(lambda: not alive(instance), 60, what="the forked worker gone with its pod")


def test_the_image_holds_the_pinned_extras_the_docs_promise_and_no_build_tools(project_image):
    """What image.json records and the root filesystem holds: the project at its version, TensorFlow, Keras, kfp,
    gcsfs and s3fs at constraints.txt's pins, TensorBoard's event writer (TensorFlow's tf.summary); no pip, no
    compiler, no pip cache; the numeric user and the CLI as entrypoint."""
    from packaging.utils import canonicalize_name

    from tests.unit.test_image import VERSION, pins

    rootfs = project_image.rootfs
    record = json.loads((rootfs / "opt" / "elastic-step" / "image.json").read_text())
    installed = {canonicalize_name(n): v for n, v in (p.split("==", 1) for p in record["python"])}
    pinned = pins()
    assert (record["version"], record["variant"], installed["elastic-step"]) == (VERSION, "cpu", VERSION)
    for name in ("tensorflow-cpu", "keras", "kfp", "gcsfs", "s3fs", "fsspec", "pyarrow", "kubernetes", "hera"):
        assert installed[name] == pinned[name], name
    site = rootfs / "opt" / "elastic-step" / "lib" / "python3.11" / "site-packages"
    assert (site / "tensorflow" / "python" / "ops" / "summary_ops_v2.py").exists()  # tf.summary's writer
    assert "pip" not in installed and not (rootfs / "opt" / "elastic-step" / "bin" / "pip").exists()
    assert not any((rootfs / "usr" / "bin" / tool).exists() for tool in ("gcc", "cc", "g++", "make"))
    assert not (rootfs / "root" / ".cache").exists()
    assert any(p.startswith("python3.11=") for p in record["debian"])
    assert project_image.user() == (1000, 1000)
    assert project_image.process["args"] == ["elastic-step"]
