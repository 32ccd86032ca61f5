"""The scrape wiring on the real control plane: a real Prometheus (Debian's) scrapes the master's /metrics on the
training step's pod, dressed as the KFP pipeline and the Argo template dress it, by the usual annotations and by
docs/observability.md's PodMonitor (its selector and relabelings, as the Prometheus Operator turns them into a
scrape job). A pod serving the same endpoint without that dress is no target.

Debian builds Prometheus without its Kubernetes service discovery, so the pods reach it through file-based discovery
instead, with the labels its `role: pod` discovery gives each target (pod_targets: one per container port, one per
container without ports), made of the pods as the apiserver returns them; the relabelings, the targets and the
scrapes are Prometheus' own. Each pod serves the master's own endpoint (master/health.py, master/observe/metrics.py)
on its own address, port 8080, as a step's master does in a pod."""

from __future__ import annotations

import json
import pathlib
import re
import sys

import pytest
import yaml

from elastic_step.master import health
from tests.infra.kube.harness import wait_for
from tests.infra.prometheus import Prometheus
from tests.kubernetes.pod_security import restricted
from tests.pipeline.test_argo import templates
from tests.pipeline.test_components import kfp_pipeline

pytestmark = pytest.mark.kubernetes

OBSERVABILITY = pathlib.Path(__file__).resolve().parents[2] / "docs" / "observability.md"

# The master's endpoint, alone: served on the pod's address, port 8080 (health.serving: -1 in a pod), until SIGTERM.
SERVE = """
import os, signal, sys, time
from elastic_step.master.health import serving
from elastic_step.master.observe.metrics import JobMetrics
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
with serving(-1, True, os.environ["PROCESS_KUBELET_POD_IP"], JobMetrics().render):
    time.sleep(600)
"""

# The community Helm chart's `kubernetes-pods` job: the prometheus.io annotations say whether, where and what.
ANNOTATIONS_JOB = [
    {"source_labels": ["__meta_kubernetes_pod_annotation_prometheus_io_scrape"], "regex": "true", "action": "keep"},
    {
        "source_labels": ["__meta_kubernetes_pod_annotation_prometheus_io_path"],
        "regex": "(.+)",
        "target_label": "__metrics_path__",
    },
    {
        "source_labels": ["__address__", "__meta_kubernetes_pod_annotation_prometheus_io_port"],
        "regex": r"([^:]+)(?::\d+)?;(\d+)",
        "replacement": "$1:$2",
        "target_label": "__address__",
    },
]


def pod_monitor() -> dict:
    """docs/observability.md's PodMonitor."""
    text = OBSERVABILITY.read_text()
    (monitor,) = [
        doc
        for block in re.findall(r"```yaml\n(.*?)```", text, re.S)
        if (doc := yaml.safe_load(block)) and doc.get("kind") == "PodMonitor"
    ]
    return monitor


def meta(name: str) -> str:
    """A Kubernetes label or annotation key as a Prometheus label name (the discovery's sanitising)."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def pod_targets(pod) -> list[dict]:
    """The target groups Prometheus' Kubernetes discovery (`role: pod`) gives `pod` (a V1Pod), with its documented
    __meta_kubernetes_* labels."""
    m = pod.metadata
    common = {
        "__meta_kubernetes_namespace": m.namespace,
        "__meta_kubernetes_pod_name": m.name,
        "__meta_kubernetes_pod_ip": pod.status.pod_ip,
        "__meta_kubernetes_pod_phase": pod.status.phase,
        **{f"__meta_kubernetes_pod_label_{meta(k)}": v for k, v in (m.labels or {}).items()},
        **{f"__meta_kubernetes_pod_labelpresent_{meta(k)}": "true" for k in m.labels or {}},
        **{f"__meta_kubernetes_pod_annotation_{meta(k)}": v for k, v in (m.annotations or {}).items()},
        **{f"__meta_kubernetes_pod_annotationpresent_{meta(k)}": "true" for k in m.annotations or {}},
    }
    groups = []
    containers = [(c, "false") for c in pod.spec.containers] + [(c, "true") for c in pod.spec.init_containers or []]
    for c, init in containers:
        labels = {
            **common,
            "__meta_kubernetes_pod_container_name": c.name,
            "__meta_kubernetes_pod_container_init": init,
        }
        for port in c.ports or [None]:
            if port is None:
                groups.append({"targets": [pod.status.pod_ip], "labels": labels})
                continue
            port_labels = {
                "__meta_kubernetes_pod_container_port_name": port.name or "",
                "__meta_kubernetes_pod_container_port_number": str(port.container_port),
                "__meta_kubernetes_pod_container_port_protocol": port.protocol or "TCP",
            }
            groups.append({"targets": [f"{pod.status.pod_ip}:{port.container_port}"], "labels": labels | port_labels})
    return groups


def operator_scrape_job(monitor: dict, discovery: dict) -> dict:
    """The scrape job the Prometheus Operator makes of a PodMonitor with one endpoint and no port: keep the pods its
    selector's labels match, then the endpoint's own relabelings."""
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert not {"port", "portNumber", "targetPort"} & set(endpoint), endpoint  # else the operator filters by port
    keep = [
        {
            "source_labels": ["__meta_kubernetes_pod_label_" + meta(k)],
            "regex": v,
            "action": "keep",
        }
        for k, v in monitor["spec"]["selector"]["matchLabels"].items()
    ]
    names = {"sourceLabels": "source_labels", "targetLabel": "target_label"}
    own = [{names.get(k, k): v for k, v in r.items()} for r in endpoint["relabelings"]]
    return {
        "job_name": "podmonitor",
        "honor_labels": endpoint["honorLabels"],
        "metrics_path": endpoint["path"],
        **discovery,
        "relabel_configs": keep + own,
    }


def step_pod(core, namespace: str, name: str, metadata: dict, ports: list | None = None) -> str:
    """A pod dressed with `metadata` (labels, annotations) serving the master's endpoint; its address."""
    container = {"name": "main", "image": "step", "command": [sys.executable, "-c", SERVE]}
    if ports:
        container["ports"] = ports
    body = {
        "metadata": {"name": name, **metadata},
        "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 2, "containers": [container]},
    }
    core.create_namespaced_pod(namespace, restricted(body))
    return wait_for(lambda: core.read_namespaced_pod(name, namespace).status.pod_ip, 60, what=f"pod {name}'s IP")


def test_prometheus_finds_the_masters_metrics_on_the_kfp_and_argo_step_pods(core, node, namespace, tmp_path):
    _, platform = kfp_pipeline()
    (kfp,) = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"].values()
    argo = templates()["elastic-train"]
    ips = {
        "kfp-step": step_pod(core, namespace, "kfp-step", kfp["podMetadata"]),
        "argo-step": step_pod(core, namespace, "argo-step", argo["metadata"], argo["container"]["ports"]),
        "plain": step_pod(core, namespace, "plain", {}),
    }
    pods = tmp_path / "pods.json"
    pods.write_text(json.dumps([g for p in core.list_namespaced_pod(namespace).items for g in pod_targets(p)]))
    discovery = {"file_sd_configs": [{"files": [str(pods)]}]}
    annotations = {"job_name": "annotations", **discovery, "relabel_configs": ANNOTATIONS_JOB}
    jobs = [annotations, operator_scrape_job(pod_monitor(), discovery)]
    prometheus = Prometheus(tmp_path / "prometheus", scrape_configs=jobs)
    try:

        def healthy() -> dict:
            return {
                (t["scrapePool"], t["discoveredLabels"]["__meta_kubernetes_pod_name"]): t["scrapeUrl"]
                for t in prometheus.targets()
                if t["health"] == "up"
            }

        expected = {
            (job, pod): f"http://{ips[pod]}:{health.POD_PORT}{health.METRICS_PATH}"
            for job in ("annotations", "podmonitor")
            for pod in ("kfp-step", "argo-step")
        }
        wait_for(lambda: healthy() == expected, 120, what=f"both step pods scraped by both jobs: {expected}")
        every = {(t["scrapePool"], t["discoveredLabels"]["__meta_kubernetes_pod_name"]) for t in prometheus.targets()}
        assert every == set(expected), every  # the plain pod is no target
        assert prometheus.query('up{job="podmonitor"} == 1') and prometheus.query('up{job="annotations"} == 1')
    finally:
        prometheus.stop()
