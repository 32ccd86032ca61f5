"""The test control plane itself: real apiserver/scheduler/controller-manager + process kubelet."""
from __future__ import annotations

import json
import sys
import textwrap
import time

import pytest
from kubernetes import client

from kube.harness import wait_for

pytestmark = pytest.mark.kubernetes

POOL = "elastic-step-test/pool"
TAINT = {"key": "elastic-step-test/dedicated", "value": "preemption", "effect": "NoSchedule"}


def py(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def pod_body(name: str, command: list[str], *, env=None, restart="Never", **spec) -> dict:
    container = {"name": "main", "image": "elastic-step:test", "command": command, "env": env or []}
    if "resources" in spec:
        container["resources"] = spec.pop("resources")
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, **spec.pop("metadata", {})},
            "spec": {"restartPolicy": restart, "containers": [container], **spec}}


def read(core, ns, name):
    try:
        return core.read_namespaced_pod(name, ns)
    except client.ApiException as e:
        if e.status == 404:
            return None
        raise


def wait_phase(core, ns, name, phases, timeout=60.0):
    return wait_for(lambda: (p := read(core, ns, name)) is not None and p.status.phase in phases and p,
                    timeout, what=f"pod {ns}/{name} in {phases}")


def wait_gone(core, ns, name, timeout=60.0):
    wait_for(lambda: read(core, ns, name) is None, timeout, what=f"pod {ns}/{name} to disappear")


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
    env = [{"name": n, "valueFrom": {"fieldRef": {"fieldPath": f}}} for n, f in
           [("NAME", "metadata.name"), ("NS", "metadata.namespace"), ("UID", "metadata.uid"),
            ("IP", "status.podIP"), ("NODE", "spec.nodeName")]]
    env += [{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}},
            {"name": "LITERAL", "value": "at-$(IP)"}]
    keys = ["NAME", "NS", "UID", "IP", "NODE", "TOKEN", "LITERAL", "PROCESS_KUBELET_POD_IP"]
    core.create_namespaced_pod(namespace, pod_body("ok", py(
        f"import json, os; print(json.dumps({{k: os.environ.get(k) for k in {keys!r}}}))"), env=env))

    pod = wait_phase(core, namespace, "ok", ("Succeeded", "Failed"))
    assert pod.status.phase == "Succeeded"
    term = pod.status.container_statuses[0].state.terminated
    assert term.exit_code == 0 and term.reason == "Completed"
    assert pod.spec.node_name == "node-1"
    assert pod.status.pod_ip.startswith("127.") and pod.status.pod_ip != "127.0.0.1"
    seen = json.loads(node.log_path(namespace, "ok").read_text().strip().splitlines()[-1])
    assert seen == {"NAME": "ok", "NS": namespace, "UID": pod.metadata.uid, "IP": pod.status.pod_ip,
                    "NODE": "node-1", "TOKEN": "s3cret", "LITERAL": f"at-{pod.status.pod_ip}",
                    "PROCESS_KUBELET_POD_IP": pod.status.pod_ip}


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
    core.create_namespaced_pod(namespace, pod_body("flaky", py(f"""
        import pathlib, sys
        p = pathlib.Path({str(counter)!r})
        n = int(p.read_text()) + 1 if p.exists() else 1
        p.write_text(str(n))
        sys.exit(0 if n >= 2 else 1)
    """), restart="OnFailure"))
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
    wait_for(lambda: coord.read_namespaced_lease("node-1", "kube-node-lease").spec.renew_time > first.renew_time,
             30, what="a lease renewal")


# ---------------------------------------------------------------------------- deletion

def test_deleted_pod_gets_sigterm_and_disappears(core, node, namespace, tmp_path):
    ready, marker = tmp_path / "ready", tmp_path / "sigterm"
    core.create_namespaced_pod(namespace, pod_body("victim", sleeper(
        str(ready), on_term=f"pathlib.Path({str(marker)!r}).write_text('SIGTERM'); sys.exit(0)"),
        terminationGracePeriodSeconds=30))
    wait_phase(core, namespace, "victim", ("Running",))
    wait_for(ready.exists, 30, what="the pod's SIGTERM handler")
    t0 = time.monotonic()
    core.delete_namespaced_pod("victim", namespace)  # graceful: the pod's 30s
    wait_gone(core, namespace, "victim", timeout=25)
    assert marker.read_text() == "SIGTERM"
    assert time.monotonic() - t0 < 25, "the pod should go as soon as its process exits, not after the grace period"


def test_pod_ignoring_sigterm_is_killed_after_grace_period(core, node, namespace, tmp_path):
    ready = tmp_path / "ready"
    core.create_namespaced_pod(namespace, pod_body("stubborn", sleeper(str(ready), on_term="pass"),
                                                   terminationGracePeriodSeconds=2))
    wait_phase(core, namespace, "stubborn", ("Running",))
    wait_for(ready.exists, 30, what="the pod's SIGTERM handler")
    pid = node.running()[f"{namespace}/stubborn"]
    t0 = time.monotonic()
    core.delete_namespaced_pod("stubborn", namespace)
    wait_gone(core, namespace, "stubborn", timeout=30)
    took = time.monotonic() - t0
    assert 1.5 <= took < 20, took
    with pytest.raises(ProcessLookupError):
        import os
        os.kill(pid, 0)


# -------------------------------------------------------------------------- preemption

@pytest.fixture(scope="module")
def small_node(control_plane):
    """Room for exactly two 1-cpu pods; tainted so that only the preemption test uses it."""
    return control_plane.add_node("small-1", cpu="2", memory="4Gi", pods=10, labels={POOL: "preemption"},
                                  taints=[TAINT])


def test_scheduler_preempts_low_priority_pod(control_plane, core, small_node, namespace):
    sched = client.SchedulingV1Api(control_plane.api_client())
    low, high = f"{namespace}-low", f"{namespace}-high"
    sched.create_priority_class({"metadata": {"name": low}, "value": 100, "preemptionPolicy": "Never"})
    sched.create_priority_class({"metadata": {"name": high}, "value": 100000})
    try:
        placement = {"nodeSelector": {POOL: "preemption"},
                     "tolerations": [{**TAINT, "operator": "Equal"}],
                     "terminationGracePeriodSeconds": 3,
                     "resources": {"requests": {"cpu": "1", "memory": "100Mi"}}}
        for i in (1, 2):
            core.create_namespaced_pod(namespace, pod_body(f"low-{i}", sleeper(), priorityClassName=low,
                                                           **json.loads(json.dumps(placement))))
        for i in (1, 2):
            pod = wait_phase(core, namespace, f"low-{i}", ("Running",))
            assert pod.spec.node_name == "small-1" and pod.spec.priority == 100
        # a third low-priority pod does not fit: it stays Pending
        core.create_namespaced_pod(namespace, pod_body("low-3", sleeper(), priorityClassName=low,
                                                       **json.loads(json.dumps(placement))))
        t0 = time.monotonic()
        core.create_namespaced_pod(namespace, pod_body("high", sleeper(), priorityClassName=high,
                                                       **json.loads(json.dumps(placement))))
        pod = wait_phase(core, namespace, "high", ("Running",), timeout=90)
        took = time.monotonic() - t0
        assert pod.spec.node_name == "small-1" and pod.spec.priority == 100000
        remaining = {p.metadata.name: p.status.phase for p in core.list_namespaced_pod(namespace).items}
        low_running = [n for n, ph in remaining.items() if n.startswith("low-") and ph == "Running"]
        assert len(low_running) == 1, remaining
        assert remaining.get("low-3") == "Pending", remaining
        assert len([n for n in ("low-1", "low-2") if n not in remaining]) == 1, remaining
        events = wait_for(lambda: [e for e in core.list_namespaced_event(namespace).items
                                   if e.reason == "Preempted"], 30, what="a Preempted event")
        assert events[0].involved_object.name in ("low-1", "low-2")
        print(f"preemption: high-priority pod running {took:.1f}s after creation")
    finally:
        for pc in (low, high):
            sched.delete_priority_class(pc)


# ---------------------------------------------------------------------- garbage collector

def test_garbage_collector_deletes_dependents_of_deleted_owner(core, node, namespace):
    owner = core.create_namespaced_pod(namespace, pod_body("owner", sleeper(), terminationGracePeriodSeconds=2))
    ref = {"apiVersion": "v1", "kind": "Pod", "name": "owner", "uid": owner.metadata.uid}
    core.create_namespaced_pod(namespace, pod_body("dependent", sleeper(), terminationGracePeriodSeconds=2,
                                                   metadata={"ownerReferences": [ref]}))
    wait_phase(core, namespace, "owner", ("Running",))
    wait_phase(core, namespace, "dependent", ("Running",))
    core.delete_namespaced_pod("owner", namespace)
    wait_gone(core, namespace, "owner")
    wait_gone(core, namespace, "dependent", timeout=90)


# ------------------------------------------------------------------------- authn / authz

def test_rbac_user_without_delete_gets_403(control_plane, core, namespace):
    rbac = client.RbacAuthorizationV1Api(control_plane.api_client())
    user = f"alice-{namespace}"
    rbac.create_namespaced_role(namespace, {"metadata": {"name": "pod-reader"}, "rules": [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch", "create"]}]})
    rbac.create_namespaced_role_binding(namespace, {
        "metadata": {"name": "pod-reader"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pod-reader"},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}]})
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
    rbac = client.RbacAuthorizationV1Api(control_plane.api_client())
    rbac.create_namespaced_role(namespace, {"metadata": {"name": "get-pods"}, "rules": [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}]})
    rbac.create_namespaced_role_binding(namespace, {
        "metadata": {"name": "get-pods"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "get-pods"},
        "subjects": [{"kind": "ServiceAccount", "name": "default", "namespace": namespace}]})
    core.create_namespaced_pod(namespace, pod_body("sa", py("""
        import json, os, ssl, sys, urllib.error, urllib.request
        sa = os.environ["PROCESS_KUBELET_ROOT"] + "/var/run/secrets/kubernetes.io/serviceaccount"
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
    """)))
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
    rbac = client.RbacAuthorizationV1Api(control_plane.api_client())
    rbac.create_namespaced_role(namespace, {"metadata": {"name": "list-pods"}, "rules": [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}]})
    rbac.create_namespaced_role_binding(namespace, {
        "metadata": {"name": "list-pods"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "list-pods"},
        "subjects": [{"kind": "ServiceAccount", "name": "runner", "namespace": namespace}]})
    wait_for(lambda: _ok(lambda: sa.list_namespaced_pod(namespace)), 10, what="the RoleBinding")
    kubeconfig = control_plane.kubeconfig_for(token, user="runner")
    from kubernetes import config
    other = client.CoreV1Api(config.new_client_from_config(str(kubeconfig)))
    assert other.list_namespaced_pod(namespace).items == []
