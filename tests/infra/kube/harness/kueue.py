"""Kueue's real manager beside the test control plane: quota, admission and preemption of plain pods.

    from tests.infra.kube.harness.kueue import Kueue

    with Kueue(control_plane) as kueue:              # builds once (scripts/build-kueue), CRDs, manager, webhooks
        kueue.opt_in("job-ns")                      # Kueue manages pods of this namespace (a label on it)
        kueue.resource_flavor("default")
        kueue.cluster_queue("team-a", quotas={"cpu": "2"})
        kueue.local_queue("job-ns", "team-a", "team-a")
        # pods: label kueue.x-k8s.io/queue-name: team-a -> gated until Kueue admits them
        kueue.workloads("job-ns")                   # [Workload(name, pod, state, reason, message), ...]

The manager (``sigs.k8s.io/kueue/cmd/kueue``, version in tests/infra/kube/kueue/VERSION) runs as a local process
with the admin kubeconfig: leader election off, Kueue's own certificate management off, the webhook server on
127.0.0.1 and a free port serving the control plane's own server certificate (IP SAN 127.0.0.1), metrics off,
the ``pod`` integration only, and only in namespaces labelled ``elastic-step.test/kueue: "true"``
(``managedJobsNamespaceSelector`` and the pod webhooks' ``namespaceSelector``), so no other test's pod ever
calls it. Feature gates off: VisibilityOnDemand (its extension apiserver wants certificates under
/visibility and exits without them) and TopologyAwareScheduling (else each pod gets a second scheduling gate,
``kueue.x-k8s.io/topology``).

The manager reads a metrics certificate from the hard-coded /etc/kueue/metrics/certs/tls.{crt,key} at start,
metrics off or not, and exits without it. It therefore runs in a mount namespace of its own whose /etc is an
overlay on the host's, the pair written in the overlay's upper directory (in the work directory): nothing is
written to the host's /etc.

The webhook configurations point at ``https://127.0.0.1:<port>/...`` with the control plane's CA, and exist only
while the manager runs (their failure policy is Fail). On stop they go first, then the manager, then Kueue's
finalizers on the pods and Workloads left (a managed pod keeps ``kueue.x-k8s.io/managed`` until Kueue removes it,
so without Kueue it would stay Terminating for ever). The tests speak v1beta2, and this release stores v1beta1: the
CRDs that Kueue's own install converts (``CONVERTED``) call the manager's conversion webhook on the same port, as
its config/components/crd patches set it up (without it a v1beta2 field renamed in v1beta1, such as a
ClusterQueue's ``cohortName``, is dropped on the way to storage).

Logs: ``<control plane workdir>/logs/kueue.log``; files in ``<control plane workdir>/kueue/`` (kept with the
control plane's under ``ELASTIC_STEP_KEEP_KUBE=1``).
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from .mounts import mount_namespace_mode
from .process import KUBE, REPO, Service, free_port, http_ok, popen, run_build, stop_process, wait_for

log = logging.getLogger("tests.infra.kube.harness.kueue")

BUILD_SCRIPT = REPO / "scripts" / "build-kueue"
VERSION = (KUBE / "kueue" / "VERSION").read_text().strip()
GROUP, API_VERSION = "kueue.x-k8s.io", "v1beta2"
OPT_IN = {"elastic-step.test/kueue": "true"}  # the namespace label Kueue acts upon
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
ADMISSION_GATE = "kueue.x-k8s.io/admission"
FINALIZER = "kueue.x-k8s.io/managed"  # on managed pods
# The CRDs Kueue's config/components/crd/kustomization.yaml gives a conversion webhook (its webhook_in_* patches).
CONVERTED = ("localqueues", "clusterqueues", "cohorts", "workloads", "multikueueclusters")
WEBHOOKS = "elastic-step-kueue"  # name of both webhook configurations
PROBE_NAMESPACE = "kueue-probe"  # opted in, never holds a pod: dry runs there prove the webhooks are called


class KueueError(RuntimeError):
    pass


def build_kueue() -> Path:
    """The bin directory holding ``kueue`` (scripts/build-kueue: a no-op when built); the CRDs are in ``../crd``."""
    return run_build(BUILD_SCRIPT, override_env="ELASTIC_STEP_KUEUE_BIN", error=KueueError)


def manager_config(*, webhook_port: int, cert_dir: Path, health_port: int) -> dict:
    """The manager's Configuration (config.kueue.x-k8s.io/v1beta2) for a loopback, single-process Kueue."""
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": "kueue-system",
        "manageJobsWithoutQueueName": False,
        "managedJobsNamespaceSelector": {"matchLabels": dict(OPT_IN)},
        "internalCertManagement": {"enable": False},
        "webhook": {"host": "127.0.0.1", "port": webhook_port, "certDir": str(cert_dir)},
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "metrics": {"bindAddress": "0"},
        "leaderElection": {"leaderElect": False},
        "integrations": {"frameworks": ["pod"]},
        "featureGates": {"VisibilityOnDemand": False, "TopologyAwareScheduling": False},
    }


def _webhook(name: str, path: str, rules: list[dict], url: str, ca: str, **extra) -> dict:
    return {
        "name": name,
        "clientConfig": {"url": url + path, "caBundle": ca},
        "rules": rules,
        "failurePolicy": "Fail",
        "sideEffects": "None",
        "admissionReviewVersions": ["v1"],
        "timeoutSeconds": 10,
        **extra,
    }


def _ca_bundle(ca_pem: bytes) -> str:
    return base64.b64encode(ca_pem).decode()


def crd_conversion(url: str, ca_pem: bytes) -> dict:
    """The conversion of the CRDs of ``CONVERTED``, as Kueue's webhook_in_* patches have it, with a URL on loopback
    and our CA."""
    client = {"url": url + "/convert", "caBundle": _ca_bundle(ca_pem)}
    return {"strategy": "Webhook", "webhook": {"clientConfig": client, "conversionReviewVersions": ["v1"]}}


def webhook_configurations(url: str, ca_pem: bytes) -> tuple[dict, dict]:
    """The Mutating and Validating webhook configurations of the pod integration and of Kueue's own objects, as
    Kueue's config/components/webhook/manifests.yaml has them, with a URL on loopback and our CA; the pod webhooks
    only in opted-in namespaces."""
    ca = _ca_bundle(ca_pem)
    pods = {"namespaceSelector": {"matchLabels": dict(OPT_IN)}}

    def rule(resources: list[str], ops: list[str], group: str = GROUP, version: str = API_VERSION) -> list[dict]:
        return [{"apiGroups": [group], "apiVersions": [version], "operations": ops, "resources": resources}]

    def kueue_path(verb: str, kind: str) -> str:
        return f"/{verb}-kueue-x-k8s-io-{API_VERSION}-{kind}"

    mutating = [
        _webhook("mpod.kb.io", "/mutate--v1-pod", rule(["pods"], ["CREATE"], "", "v1"), url, ca, **pods),
        *(
            _webhook(f"m{k}.kb.io", kueue_path("mutate", k), rule([f"{k}s"], ["CREATE"]), url, ca)
            for k in ("clusterqueue", "resourceflavor", "workload")
        ),
    ]
    validating = [
        _webhook("vpod.kb.io", "/validate--v1-pod", rule(["pods"], ["CREATE", "UPDATE"], "", "v1"), url, ca, **pods),
        *(
            _webhook(f"v{k}.kb.io", kueue_path("validate", k), rule([f"{k}s"], ["CREATE", "UPDATE"]), url, ca)
            for k in ("clusterqueue", "cohort", "resourceflavor")
        ),
        _webhook(
            "vworkload.kb.io",
            kueue_path("validate", "workload"),
            rule(["workloads", "workloads/status"], ["CREATE", "UPDATE"]),
            url,
            ca,
        ),
    ]
    meta = {"name": WEBHOOKS}
    return (
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "MutatingWebhookConfiguration",
            "metadata": meta,
            "webhooks": mutating,
        },
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingWebhookConfiguration",
            "metadata": meta,
            "webhooks": validating,
        },
    )


@dataclass(frozen=True)
class Workload:
    """A Workload as a test reads it: ``state`` is ``admitted``, ``pending`` (no quota reserved yet), ``evicted``
    or ``finished``; ``reason``/``message`` are those of the condition that says so."""

    name: str
    pod: str | None  # the owning pod (single-pod workloads), if any
    state: str
    reason: str
    message: str
    priority: int | None

    @property
    def admitted(self) -> bool:
        return self.state == "admitted"


def workload_state(obj: dict) -> Workload:
    conds = {c["type"]: c for c in (obj.get("status") or {}).get("conditions") or []}

    def true(t: str) -> bool:
        return conds.get(t, {}).get("status") == "True"

    state, cond = "pending", conds.get("QuotaReserved", {})
    for t, s in (("Finished", "finished"), ("Evicted", "evicted"), ("Admitted", "admitted")):
        if true(t):
            state, cond = s, conds[t]
            break
    owners = [o["name"] for o in obj["metadata"].get("ownerReferences") or [] if o.get("kind") == "Pod"]
    return Workload(
        name=obj["metadata"]["name"],
        pod=owners[0] if owners else None,
        state=state,
        reason=cond.get("reason", ""),
        message=cond.get("message", ""),
        priority=(obj.get("spec") or {}).get("priority"),
    )


class Kueue(Service):
    """Kueue's manager running against ``control_plane`` (a started ControlPlane), with its CRDs and webhooks."""

    def __init__(self, control_plane, *, log_level: int = 2, start_timeout: float = 120.0):
        self.cp = control_plane
        self.log_level, self.start_timeout = log_level, start_timeout
        self.workdir = control_plane.workdir / "kueue"
        self.log_path = control_plane.workdir / "logs" / "kueue.log"
        self.proc: subprocess.Popen | None = None
        self.timings: dict[str, float] = {}
        self.webhook_port = self.health_port = 0
        self._api = None
        self.cluster_objects: list[tuple[str, str]] = []  # (plural, name) of what tests made, for delete_since()

    # ---- lifecycle -------------------------------------------------------------------
    def start(self) -> Kueue:
        import kubernetes.client

        t = time.monotonic()
        bin_dir = build_kueue()
        self.timings["build"] = time.monotonic() - t
        t0 = time.monotonic()
        self._api = self.cp.api_client()
        self.custom = kubernetes.client.CustomObjectsApi(self._api)
        self.core = kubernetes.client.CoreV1Api(self._api)
        self.webhook_port, self.health_port = free_port(), free_port()
        try:
            self._install_crds(bin_dir.parent / "crd")
            self.timings["crds"] = time.monotonic() - t0
            t = time.monotonic()
            self._run_manager(bin_dir / "kueue")
            self.timings["manager"] = time.monotonic() - t
            t = time.monotonic()
            self._register_webhooks()
            self.timings["webhooks"] = time.monotonic() - t
        except BaseException:
            self.stop()
            raise
        self.timings["start"] = time.monotonic() - t0
        log.info("kueue %s up in %.1fs (%s)", VERSION, self.timings["start"], self.timings)
        return self

    def stop(self) -> None:
        """Webhooks first (pods in opted-in namespaces can be created and updated again), then the manager, then
        Kueue's finalizers on what is left, so no namespace or pod waits on a Kueue that is gone."""
        if self._api is None:
            return
        import kubernetes.client

        adm = kubernetes.client.AdmissionregistrationV1Api(self._api)
        for delete in (adm.delete_mutating_webhook_configuration, adm.delete_validating_webhook_configuration):
            with contextlib.suppress(Exception):  # gone, or the control plane stopped first: the manager stops anyway
                delete(WEBHOOKS)
        if self.proc is not None:
            stop_process(self.proc)
            self.proc = None
        with contextlib.suppress(Exception):
            self._strip_finalizers()
        self._api = None
        if not self.cp.keep_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    @property
    def _webhook_url(self) -> str:
        return f"https://127.0.0.1:{self.webhook_port}"

    def _install_crds(self, crd_dir: Path) -> None:
        """The 11 CRDs of the module (MultiKueue and the others are watched even when unused), those of ``CONVERTED``
        converted by this manager's webhook; waits until each is Established. Idempotent: a CRD already there (an
        earlier Kueue on this control plane) is kept, its conversion pointed at this manager."""
        import kubernetes.client

        ext = kubernetes.client.ApiextensionsV1Api(self._api)
        conversion = crd_conversion(self._webhook_url, self.cp.ca_path.read_bytes())
        files = sorted(crd_dir.glob("*.yaml"))
        if not files:
            raise KueueError(f"no CRDs in {crd_dir}; remove {crd_dir.parent} and run {BUILD_SCRIPT} again")
        names = []
        for f in files:
            doc = yaml.safe_load(f.read_text())
            name = doc["metadata"]["name"]
            names.append(name)
            converted = name.split(".")[0] in CONVERTED
            if converted:
                doc["spec"]["conversion"] = conversion
            try:  # the raw answer: the workloads CRD alone is 19k lines of schema to deserialize otherwise
                ext.create_custom_resource_definition(doc, _preload_content=False)
            except kubernetes.client.ApiException as e:
                if e.status != 409:
                    raise
                if converted:
                    patch = {"spec": {"conversion": conversion}}
                    ext.patch_custom_resource_definition(name, patch, _preload_content=False)

        def established(name: str) -> bool:
            crd = json.loads(ext.read_custom_resource_definition(name, _preload_content=False).data)
            return any(
                c["type"] == "Established" and c["status"] == "True"
                for c in (crd.get("status") or {}).get("conditions") or []
            )

        for name in names:
            wait_for(lambda name=name: established(name), 60, interval=0.1, what=f"CRD {name} established")

    def _run_manager(self, binary: Path) -> None:
        pki = self.cp.workdir / "pki"  # server.crt: IP SAN 127.0.0.1, serverAuth, signed by the control plane's CA
        certs = self.workdir / "certs"
        upper, overlay_work = self.workdir / "etc-upper", self.workdir / "etc-work"
        metrics = upper / "kueue" / "metrics" / "certs"  # /etc/kueue/metrics/certs inside the manager's namespace
        for d in (certs, metrics, overlay_work):
            d.mkdir(parents=True, exist_ok=True)
        for d in (certs, metrics):
            shutil.copy(pki / "server.crt", d / "tls.crt")
            shutil.copy(pki / "server.key", d / "tls.key")
        config = self.workdir / "config.yaml"
        config.write_text(
            yaml.safe_dump(manager_config(webhook_port=self.webhook_port, cert_dir=certs, health_port=self.health_port))
        )
        argv = [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            *(["--map-root-user"] if mount_namespace_mode() else []),
            "sh",
            "-c",
            'mount -t overlay overlay -o "lowerdir=/etc,upperdir=$1,workdir=$2" /etc && shift 2 && exec "$@"',
            "kueue",
            str(upper),
            str(overlay_work),
            str(binary),
            f"--config={config}",
            f"--kubeconfig={self.cp.kubeconfig_path}",
            f"--zap-log-level={self.log_level}",
        ]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as f:
            f.write(("$ " + " ".join(argv) + "\n").encode())
        self.proc = popen(argv, log_path=self.log_path)
        ready = f"http://127.0.0.1:{self.health_port}/readyz"  # 200 once the webhook server listens
        deadline = time.monotonic() + self.start_timeout
        while not http_ok(ready):
            if self.proc.poll() is not None:
                raise KueueError(f"kueue exited with {self.proc.returncode}; log {self.log_path}:\n{self._tail()}")
            if time.monotonic() > deadline:
                raise KueueError(f"kueue not ready after {self.start_timeout}s; log {self.log_path}:\n{self._tail()}")
            time.sleep(0.1)

    def _register_webhooks(self) -> None:
        """Create both configurations, then wait until the apiserver calls them (it loads them asynchronously): a
        dry-run pod with a queue name in an opted-in namespace comes back gated, and a ResourceFlavor with an
        invalid node label is refused by Kueue's validating webhook."""
        import kubernetes.client

        adm = kubernetes.client.AdmissionregistrationV1Api(self._api)
        mutating, validating = webhook_configurations(self._webhook_url, self.cp.ca_path.read_bytes())
        for create, replace, body in (
            (adm.create_mutating_webhook_configuration, adm.replace_mutating_webhook_configuration, mutating),
            (adm.create_validating_webhook_configuration, adm.replace_validating_webhook_configuration, validating),
        ):
            try:
                create(body)
            except kubernetes.client.ApiException as e:
                if e.status != 409:
                    raise
                replace(WEBHOOKS, body)
        self.cp.create_namespace(PROBE_NAMESPACE)
        self.opt_in(PROBE_NAMESPACE)
        probe = {
            "metadata": {"name": "probe", "labels": {QUEUE_LABEL: "probe"}},
            "spec": {"containers": [{"name": "c", "image": "none", "command": ["true"]}]},
        }

        def gated() -> bool:
            pod = self.core.create_namespaced_pod(PROBE_NAMESPACE, probe, dry_run="All")
            return any(g.name == ADMISSION_GATE for g in pod.spec.scheduling_gates or [])

        wait_for(gated, 30, interval=0.1, what="Kueue's pod webhook called by the apiserver")

        def refused() -> bool:
            bad = {
                "apiVersion": f"{GROUP}/{API_VERSION}",
                "kind": "ResourceFlavor",
                "metadata": {"name": "probe"},
                "spec": {"nodeLabels": {"-not a label-": "x"}},
            }
            try:
                self.custom.create_cluster_custom_object(GROUP, API_VERSION, "resourceflavors", bad, dry_run="All")
            except kubernetes.client.ApiException as e:
                return e.status in (400, 403, 422) and "vresourceflavor.kb.io" in (e.body or "")
            return False

        wait_for(refused, 30, interval=0.1, what="Kueue's validating webhook called by the apiserver")

    def _strip_finalizers(self) -> None:
        for pod in self.core.list_pod_for_all_namespaces(label_selector="kueue.x-k8s.io/managed=true").items:
            if FINALIZER in (pod.metadata.finalizers or []):
                self._drop_finalizers(
                    lambda body, p=pod: self.core.patch_namespaced_pod(p.metadata.name, p.metadata.namespace, body),
                    pod.metadata.finalizers,
                    pod.metadata.resource_version,
                    lambda f: f == FINALIZER,
                )
        for wl in self.custom.list_cluster_custom_object(GROUP, API_VERSION, "workloads")["items"]:
            meta = wl["metadata"]
            if any(f.startswith("kueue.x-k8s.io/") for f in meta.get("finalizers") or []):
                self._drop_finalizers(
                    lambda body, m=meta: self.custom.patch_namespaced_custom_object(
                        GROUP, API_VERSION, m["namespace"], "workloads", m["name"], body
                    ),
                    meta["finalizers"],
                    meta["resourceVersion"],
                    lambda f: f.startswith("kueue.x-k8s.io/"),
                )

    @staticmethod
    def _drop_finalizers(patch, finalizers: list[str], resource_version: str, ours) -> None:
        import kubernetes.client

        keep = [f for f in finalizers if not ours(f)]
        with contextlib.suppress(kubernetes.client.ApiException):  # gone or changed meanwhile: nothing to strip
            patch({"metadata": {"finalizers": keep or None, "resourceVersion": resource_version}})

    def _tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    # ---- Kueue's objects (plain dict bodies, v1beta2) -----------------------------------------
    def opt_in(self, namespace: str) -> None:
        """Let Kueue manage the pods of ``namespace`` (from their creation on: a pod made before is not)."""
        self.core.patch_namespace(namespace, {"metadata": {"labels": dict(OPT_IN)}})

    def _create(self, plural: str, body: dict, namespace: str | None = None) -> dict:
        body = {"apiVersion": f"{GROUP}/{API_VERSION}", **body}
        if namespace is None:
            made = self.custom.create_cluster_custom_object(GROUP, API_VERSION, plural, body)
            self.cluster_objects.append((plural, body["metadata"]["name"]))
            return made
        return self.custom.create_namespaced_custom_object(GROUP, API_VERSION, namespace, plural, body)

    def resource_flavor(self, name: str, node_labels: dict | None = None, tolerations: list | None = None) -> dict:
        """A ResourceFlavor. With ``node_labels`` Kueue adds them as a *required* nodeSelector to the pods it admits
        under it (and its ``tolerations``)."""
        spec: dict = {}
        if node_labels:
            spec["nodeLabels"] = dict(node_labels)
        if tolerations:
            spec["tolerations"] = list(tolerations)
        return self._create("resourceflavors", {"kind": "ResourceFlavor", "metadata": {"name": name}, "spec": spec})

    def cluster_queue(
        self,
        name: str,
        quotas: dict[str, str],
        *,
        cohort: str | None = None,
        preemption: dict | None = None,
        borrowing_limit: dict[str, str] | None = None,
        flavor: str = "default",
        namespace_selector: dict | None = None,
    ) -> dict:
        """A ClusterQueue of one resource group and one flavor: ``quotas`` resource -> nominalQuota (every resource a
        pod requests must be here, or its workload is inadmissible); ``borrowing_limit`` resource -> limit;
        ``preemption`` as in the API (e.g. ``{"withinClusterQueue": "LowerPriority"}``); all namespaces unless
        ``namespace_selector``."""
        resources = [
            {
                "name": r,
                "nominalQuota": str(q),
                **({"borrowingLimit": str(borrowing_limit[r])} if r in (borrowing_limit or {}) else {}),
            }
            for r, q in quotas.items()
        ]
        spec: dict = {
            "namespaceSelector": namespace_selector if namespace_selector is not None else {},
            "resourceGroups": [
                {"coveredResources": list(quotas), "flavors": [{"name": flavor, "resources": resources}]}
            ],
        }
        if cohort:
            spec["cohortName"] = cohort
        if preemption:
            spec["preemption"] = dict(preemption)
        return self._create("clusterqueues", {"kind": "ClusterQueue", "metadata": {"name": name}, "spec": spec})

    def set_quota(self, cluster_queue: str, resource: str, value: str, flavor: str | None = None) -> dict:
        """Change one nominalQuota of a ClusterQueue (of ``flavor``, or wherever ``resource`` is)."""
        cq = self.custom.get_cluster_custom_object(GROUP, API_VERSION, "clusterqueues", cluster_queue)
        found = False
        for group in cq["spec"]["resourceGroups"]:
            for fl in group["flavors"]:
                if flavor not in (None, fl["name"]):
                    continue
                for r in fl["resources"]:
                    if r["name"] == resource:
                        r["nominalQuota"], found = str(value), True
        if not found:
            raise KeyError(
                f"ClusterQueue {cluster_queue} has no quota of {resource}" + (f" in {flavor}" if flavor else "")
            )
        return self.custom.replace_cluster_custom_object(GROUP, API_VERSION, "clusterqueues", cluster_queue, cq)

    def local_queue(self, namespace: str, name: str, cluster_queue: str) -> dict:
        """A LocalQueue: what pods name in their ``kueue.x-k8s.io/queue-name`` label."""
        body = {"kind": "LocalQueue", "metadata": {"name": name}, "spec": {"clusterQueue": cluster_queue}}
        return self._create("localqueues", body, namespace)

    def workload_priority_class(self, name: str, value: int) -> dict:
        """A WorkloadPriorityClass: pods name it in their ``kueue.x-k8s.io/priority-class`` label (else Kueue takes
        the priority of their PriorityClass)."""
        return self._create(
            "workloadpriorityclasses",
            {"kind": "WorkloadPriorityClass", "metadata": {"name": name}, "value": int(value)},
        )

    def delete(self, plural: str, name: str, namespace: str | None = None) -> None:
        """Delete one of Kueue's objects (``plural``: clusterqueues, resourceflavors, ...); gone already is fine."""
        import kubernetes.client

        try:
            if namespace is None:
                self.custom.delete_cluster_custom_object(GROUP, API_VERSION, plural, name)
            else:
                self.custom.delete_namespaced_custom_object(GROUP, API_VERSION, namespace, plural, name)
        except kubernetes.client.ApiException as e:
            if e.status != 404:
                raise

    def delete_since(self, mark: int) -> None:
        """Delete the cluster-scoped objects made since ``len(cluster_objects)`` was ``mark``, newest first: a
        namespace's deletion takes its LocalQueues, not the ClusterQueues and flavors a test made for it."""
        while len(self.cluster_objects) > mark:
            self.delete(*self.cluster_objects.pop())

    def preempted_pods(self, namespace: str, preemptor_pod_uid: str) -> list[str]:
        """The pods whose Workloads Kueue preempted to admit the workload of the pod ``preemptor_pod_uid``, by
        Kueue's own Events (reason Preempted, "... JobUID: <uid>) ..."); a pod's Workload is ``pod-<pod>-<hash>``."""
        events = self.core.list_namespaced_event(namespace, field_selector="reason=Preempted").items
        return sorted(
            {
                re.sub(r"^pod-(.+)-[0-9a-f]{5}$", r"\1", e.involved_object.name)
                for e in events
                if e.involved_object.kind == "Workload" and f"JobUID: {preemptor_pod_uid})" in (e.message or "")
            }
        )

    def workload_lifetimes(self, namespace: str) -> dict[str, list[float | None]]:
        """Kueue's own log on the Workloads of ``namespace``: when each one's create and delete events reached Kueue
        (seconds since the epoch; None when not seen), by Workload name."""
        lives: dict[str, list[float | None]] = {}
        events = {"Workload create event": 0, "Workload delete event": 1}
        for line in self._tail(10**6).splitlines():
            if namespace not in line or '"Workload ' not in line:
                continue
            with contextlib.suppress(ValueError, KeyError, TypeError):
                entry = json.loads(line)
                which = events.get(entry["msg"])
                if which is not None and entry["workload"]["namespace"] == namespace:
                    day, _, fraction = entry["ts"].rstrip("Z").partition(".")
                    when = time.mktime(time.strptime(day, "%Y-%m-%dT%H:%M:%S")) + float(f"0.{fraction or 0}")
                    lives.setdefault(entry["workload"]["name"], [None, None])[which] = when
        return lives

    def describe(self, namespace: str, cluster_queues: tuple[str, ...] = ()) -> str:
        """What Kueue and the API hold for ``namespace`` now, as a person would read it with kubectl when a test
        fails: every Workload with all its conditions and requeue state, the ClusterQueues' status, and the pods
        with their phase, gates, finalizers and deletion."""
        lines = ["--- Kueue's Workloads:"]
        items = self.custom.list_namespaced_custom_object(GROUP, API_VERSION, namespace, "workloads")["items"]
        for o in sorted(items, key=lambda o: o["metadata"]["creationTimestamp"]):
            meta, status = o["metadata"], o.get("status") or {}
            owners = ",".join(r["name"] for r in meta.get("ownerReferences") or [])
            lines.append(
                f"{meta['name']} (pod {owners}, priority {(o.get('spec') or {}).get('priority')}, "
                f"deleting {meta.get('deletionTimestamp')}, finalizers {meta.get('finalizers')}, "
                f"requeueState {status.get('requeueState')})"
            )
            lines += [
                f"    {c['type']}={c['status']} {c.get('reason', '')}: {c.get('message', '')}"
                f" ({c.get('lastTransitionTime')})"
                for c in status.get("conditions") or []
            ]
        for cq in cluster_queues:
            try:
                got = self.custom.get_cluster_custom_object(GROUP, API_VERSION, "clusterqueues", cq)
            except Exception as e:  # noqa: BLE001 - a dump for a failing test: say what went wrong and go on
                lines.append(f"--- ClusterQueue {cq}: {e}")
                continue
            lines.append(f"--- ClusterQueue {cq}: spec {json.dumps(got.get('spec'))}")
            lines.append(f"    status {json.dumps(got.get('status'))}")
        lines.append("--- pods:")
        for p in self.core.list_namespaced_pod(namespace).items:
            gates = [g.name for g in p.spec.scheduling_gates or []]
            lines.append(
                f"{p.metadata.name}: {p.status.phase} node={p.spec.node_name} gates={gates} "
                f"finalizers={p.metadata.finalizers} deleting={p.metadata.deletion_timestamp} "
                f"conditions={[(c.type, c.status, c.reason) for c in p.status.conditions or []]}"
            )
        # What Kueue itself decided about them (requeues, scheduling attempts, deletions), from its own log.
        about = [line for line in self._tail(20000).splitlines() if namespace in line]
        lines.append(f"--- Kueue's log on {namespace} (last {min(len(about), 300)} of {len(about)} lines):")
        lines += about[-300:]
        return "\n".join(lines)

    def workloads(self, namespace: str) -> list[Workload]:
        """The Workloads of ``namespace``, oldest first."""
        items = self.custom.list_namespaced_custom_object(GROUP, API_VERSION, namespace, "workloads")["items"]
        items.sort(key=lambda o: (o["metadata"]["creationTimestamp"], o["metadata"]["name"]))
        return [workload_state(o) for o in items]
