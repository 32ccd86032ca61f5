"""The pod settings of each role: every parser, every error (before any pod: master/plan.py checked), what
pod_body makes of them per role, the spot defaults, and KFP's TaskConfig as its driver injects it (no cluster)."""

import json

import pytest

from elastic_step.backends.kubernetes import settings as s
from elastic_step.backends.kubernetes.settings import PodSettings, from_task_config
from elastic_step.errors import ConfigError
from elastic_step.master.api import TrainConfig
from elastic_step.master.plan import checked
from tests.unit.backends.pods import job_pod

GPU = "nvidia.com/gpu"
SPOT = "cloud.google.com/gke-spot"


def config(**kw) -> TrainConfig:
    return TrainConfig(model_def="m.py", train_data="t", output="o", **kw)


def body(role: str, cfg: TrainConfig | None = None, pod_spec: dict | None = None, **spec) -> dict:
    settings = PodSettings.from_train_config(cfg or config())
    return job_pod(role, spec={"env": {"A": "1"}, **spec}, pod_spec=pod_spec or {}, settings=settings)


# ---------------------------------------------------------------- quantities
@pytest.mark.parametrize("good", ["1", "500m", "1.5", "2Gi", "1e3", "0.5", ".5", "100Mi", "2E", "1E-3", "10k"])
def test_quantities_in_kubernetes_grammar(good):
    assert s.quantity("ps_cpu", good) == good


@pytest.mark.parametrize("bad", ["2GB", "-1", "", "1.5.2", "Gi", "1 Gi", "one", "1gi", "+-1"])
def test_a_quantity_that_does_not_parse_names_the_parameter_the_value_and_a_good_one(bad):
    with pytest.raises(ConfigError) as e:
        s.quantity("ps_memory", bad, "2Gi")
    assert f"ps_memory {bad!r}: not a Kubernetes quantity" in str(e.value) and "ps_memory=2Gi" in str(e.value)


@pytest.mark.parametrize("param", ["worker_cpu", "worker_memory", "ps_cpu", "ps_memory"])
def test_train_config_checks_every_quantity(param):
    with pytest.raises(ConfigError, match=f"{param} '2GB'"):
        checked(config(**{param: "2GB"}))


# ---------------------------------------------------------------- accelerators
def test_accelerators():
    assert s.accelerators("worker_accelerators", "nvidia.com/gpu=1, amd.com/gpu=2") == {GPU: "1", "amd.com/gpu": "2"}
    assert s.accelerators("worker_accelerators", "") == {}


@pytest.mark.parametrize(
    "bad, why",
    [
        ("gpu=1", "not <extended resource name, domain/name>=<count>"),
        ("nvidia.com/gpu", "not <extended resource name, domain/name>=<count>"),
        ("Nvidia_com/gpu=1", "not <extended resource name, domain/name>=<count>"),
        ("kubernetes.io/gpu=1", "not an extended resource"),
        ("nvidia.com/gpu=0", "whole number >= 1"),
        ("nvidia.com/gpu=1.5", "whole number >= 1"),
        ("nvidia.com/gpu=1,", "not <extended resource name"),
    ],
)
def test_bad_accelerators(bad, why):
    with pytest.raises(ConfigError) as e:
        checked(config(ps_accelerators=bad))
    assert f"ps_accelerators {bad!r}" in str(e.value) and why in str(e.value)
    assert "ps_accelerators=nvidia.com/gpu=1" in str(e.value)


# ---------------------------------------------------------------- tolerations
def test_tolerations_in_kubectl_taint_syntax_and_json():
    assert s.tolerations("worker_tolerations", "dedicated=ml:NoSchedule,gpu:NoExecute") == [
        {"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"},
        {"key": "gpu", "operator": "Exists", "effect": "NoExecute"},
    ]
    given = [{"key": "k", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 60}, {"operator": "Exists"}]
    assert s.tolerations("worker_tolerations", json.dumps(given)) == given


@pytest.mark.parametrize(
    "bad, why",
    [
        ("dedicated=ml:NoSchedul", "unknown effect 'NoSchedul'"),
        ("dedicated=ml", "not key[=value]:Effect"),
        (":NoSchedule", "not key[=value]:Effect"),
        ("bad key:NoSchedule", "is not a taint's key and value"),
        ('[{"key": "k", "effect": "Never"}]', "unknown effect 'Never'"),
        ('[{"key": "k", "operator": "In"}]', "unknown operator 'In'"),
        ('[{"key": "k", "tolerate": true}]', "is not a Toleration"),
        ('[{"key": "k"', "not valid JSON"),
        ('["k"]', "is not a Toleration"),
    ],
)
def test_bad_tolerations(bad, why):
    with pytest.raises(ConfigError) as e:
        checked(config(worker_tolerations=bad))
    assert f"worker_tolerations {bad!r}" in str(e.value) and why in str(e.value)
    assert "e.g. worker_tolerations=" in str(e.value)


# ---------------------------------------------------------------- node selector, affinity
def test_node_selectors():
    assert s.labels("ps_node_selector", "pool=core, zone=a") == {"pool": "core", "zone": "a"}
    assert s.labels("ps_node_selector", '{"example.com/pool": "core"}') == {"example.com/pool": "core"}


@pytest.mark.parametrize(
    "bad, why",
    [
        ("pool", "every item is key=value"),
        ('{"pool": 1}', "is not a label"),
        ('{"pool"', "not valid JSON"),
        ("a b=c", "is not a label"),
    ],
)
def test_bad_node_selectors(bad, why):
    with pytest.raises(ConfigError) as e:
        checked(config(ps_node_selector=bad))
    assert f"ps_node_selector {bad!r}" in str(e.value) and why in str(e.value) and "ps_node_selector=" in str(e.value)


@pytest.mark.parametrize(
    "bad, why",
    [
        ("nodeAffinity", "not valid JSON"),
        ('[{"nodeAffinity": {}}]', "a JSON dict is expected, not a list"),
        ('{"nodeAfinity": {}}', "an Affinity has only objects nodeAffinity, podAffinity, podAntiAffinity"),
    ],
)
def test_bad_affinity(bad, why):
    with pytest.raises(ConfigError) as e:
        checked(config(worker_affinity=bad))
    assert f"worker_affinity {bad!r}" in str(e.value) and why in str(e.value)


def test_affinities_merge_as_both_at_once():
    def required(*exprs):
        return {"nodeSelectorTerms": [{"matchExpressions": [e]} for e in exprs]}

    a, b, c = ({"key": k, "operator": "Exists"} for k in "abc")
    merged = s.merge_affinity(
        {"nodeAffinity": {s._REQUIRED: required(a, b)}, "podAntiAffinity": {s._PREFERRED: [1]}},
        {"nodeAffinity": {s._REQUIRED: required(c), s._PREFERRED: [2]}, "podAntiAffinity": {s._PREFERRED: [3]}},
    )
    # (a or b) and c = (a and c) or (b and c)
    assert merged["nodeAffinity"][s._REQUIRED] == {
        "nodeSelectorTerms": [{"matchExpressions": [a, c]}, {"matchExpressions": [b, c]}]
    }
    assert merged["nodeAffinity"][s._PREFERRED] == [2] and merged["podAntiAffinity"][s._PREFERRED] == [1, 3]


# ---------------------------------------------------------------- env, Secrets, volumes, service account
def test_env_and_secrets():
    assert s.env("env", "A=1,B=x=y") == [{"name": "A", "value": "1"}, {"name": "B", "value": "x=y"}]
    assert s.secrets_env("env_from_secrets", "aws-creds, DB_PASSWORD=db/password") == (
        [{"name": "DB_PASSWORD", "valueFrom": {"secretKeyRef": {"name": "db", "key": "password"}}}],
        [{"secretRef": {"name": "aws-creds"}}],
    )


@pytest.mark.parametrize(
    "param, bad, why",
    [
        ("env", "A", "is not NAME=value"),
        ("env", "1 A=b", "is not an environment variable"),
        ("env", '[{"value": "b"}]', "is not an environment variable"),
        ("env_from_secrets", "DB=db", "neither a Secret's name nor NAME=secret/key"),
        ("env_from_secrets", "Creds", "neither a Secret's name nor NAME=secret/key"),
        ("volumes", "nfs:share:/data", "unknown volume kind 'nfs'"),
        ("volumes", "pvc:data:data", "is not pvc:NAME:/absolute/path[:ro]"),
        ("volumes", "pvc:data:/data:rw", "is not pvc:NAME:/absolute/path[:ro]"),
        ("volumes", '{"volumes": []', "not valid JSON"),
        ("volumes", '{"volumes": [], "volumeMounts": [{"name": "x", "mountPath": "/x"}]}', "does not mount one"),
        ("volumes", '{"volume": []}', "the JSON form is {volumes: [Volume], volumeMounts: [VolumeMount]}"),
        ("job_service_account", "Training SA", "not a ServiceAccount's name"),
        ("spot_nodes", "spot", "every item is key=value"),
    ],
)
def test_bad_env_secrets_volumes_service_account_spot(param, bad, why):
    with pytest.raises(ConfigError) as e:
        checked(config(**{param: bad}))
    assert f"{param} {bad!r}" in str(e.value) and why in str(e.value) and f"e.g. {param}=" in str(e.value)


def test_volumes_of_each_kind():
    vols, mounts = s.volumes("volumes", "pvc:data:/data:ro,secret:creds:/creds,configmap:cfg:/cfg,emptydir:tmp:/tmp")
    assert vols == [
        {"name": "pvc-data", "persistentVolumeClaim": {"claimName": "data"}},
        {"name": "secret-creds", "secret": {"secretName": "creds"}},
        {"name": "configmap-cfg", "configMap": {"name": "cfg"}},
        {"name": "emptydir-tmp", "emptyDir": {}},
    ]
    assert mounts[0] == {"name": "pvc-data", "mountPath": "/data", "readOnly": True}
    assert [m["mountPath"] for m in mounts] == ["/data", "/creds", "/cfg", "/tmp"]


# ---------------------------------------------------------------- pod_body per role
def test_defaults_dress_nothing_but_the_spot_preference():
    worker, ps = body("worker"), body("ps")
    assert worker["spec"]["tolerations"] == [
        {"key": k, "operator": "Equal", "value": v, "effect": "NoSchedule"} for k, v in s.SPOT_AUTO
    ]
    prefer = worker["spec"]["affinity"]["nodeAffinity"][s._PREFERRED]
    assert [p["preference"]["matchExpressions"] for p in prefer] == [
        [{"key": k, "operator": "In", "values": [v]}] for k, v in s.SPOT_AUTO
    ]
    assert "tolerations" not in ps["spec"]  # a PS never lands on a tainted spot pool
    (avoid,) = ps["spec"]["affinity"]["nodeAffinity"][s._PREFERRED]
    assert avoid["preference"]["matchExpressions"] == [
        {"key": k, "operator": "NotIn", "values": [v]} for k, v in s.SPOT_AUTO
    ]
    for pod in (worker, ps):
        assert not {"nodeSelector", "volumes", "serviceAccountName"} & set(pod["spec"])
        assert "envFrom" not in pod["spec"]["containers"][0] and pod["spec"]["automountServiceAccountToken"] is False


def test_spot_none_and_own_labels():
    assert "affinity" not in body("worker", config(spot_nodes="none"))["spec"]
    worker = body("worker", config(spot_nodes="pool=spot"))
    assert worker["spec"]["tolerations"] == [
        {"key": "pool", "operator": "Equal", "value": "spot", "effect": "NoSchedule"}
    ]


def test_each_role_gets_its_own_settings_and_both_the_shared_ones():
    cfg = checked(
        config(
            worker_accelerators="nvidia.com/gpu=1",
            ps_cpu="2",
            ps_memory="4Gi",
            worker_tolerations="gpu:NoSchedule",
            ps_tolerations="core=yes:NoExecute",
            worker_node_selector="pool=gpu",
            ps_node_selector='{"pool": "core"}',
            ps_affinity=json.dumps({"podAntiAffinity": {s._PREFERRED: [{"weight": 1}]}}),
            job_service_account="training",
            env="LOG=info,A=shadowed",
            env_from_secrets="aws,DB_PASSWORD=db/password",
            volumes="pvc:data:/data:ro",
            spot_nodes="none",
        )
    )
    worker = body("worker", cfg, cpu="1", memory="2Gi")
    ps = body("ps", cfg, cpu=cfg.ps_cpu, memory=cfg.ps_memory)
    wc, pc = worker["spec"]["containers"][0], ps["spec"]["containers"][0]
    assert wc["resources"] == {
        "requests": {"cpu": "1", "memory": "2Gi", GPU: "1"},
        "limits": {"cpu": "1", "memory": "2Gi", GPU: "1"},
    }
    assert pc["resources"] == {"requests": {"cpu": "2", "memory": "4Gi"}, "limits": {"cpu": "2", "memory": "4Gi"}}
    assert worker["spec"]["tolerations"] == [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert ps["spec"]["tolerations"] == [{"key": "core", "operator": "Equal", "value": "yes", "effect": "NoExecute"}]
    assert (worker["spec"]["nodeSelector"], ps["spec"]["nodeSelector"]) == ({"pool": "gpu"}, {"pool": "core"})
    assert "affinity" not in worker["spec"] and ps["spec"]["affinity"] == {
        "podAntiAffinity": {s._PREFERRED: [{"weight": 1}]}
    }
    for pod, c in ((worker, wc), (ps, pc)):
        assert pod["spec"]["serviceAccountName"] == "training" and pod["spec"]["automountServiceAccountToken"] is False
        assert pod["spec"]["volumes"] == [{"name": "pvc-data", "persistentVolumeClaim": {"claimName": "data"}}]
        assert c["volumeMounts"] == [{"name": "pvc-data", "mountPath": "/data", "readOnly": True}]
        assert c["envFrom"] == [{"secretRef": {"name": "aws"}}]
        env = {e["name"]: e for e in c["env"]}
        assert env["LOG"] == {"name": "LOG", "value": "info"}
        assert env["DB_PASSWORD"]["valueFrom"] == {"secretKeyRef": {"name": "db", "key": "password"}}
        assert env["ELASTIC_STEP_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "j-token"


def test_the_instance_and_the_backend_win_over_the_settings_env():
    c = body("worker", config(env="A=mine,ELASTIC_STEP_JOB_ID=other"))["spec"]["containers"][0]
    assert [e for e in c["env"] if e["name"] in ("A", "ELASTIC_STEP_JOB_ID")] == [
        {"name": "ELASTIC_STEP_JOB_ID", "value": "j"},
        {"name": "A", "value": "1"},
    ]


def test_the_settings_extend_the_pod_spec_escape_hatch():
    escape = {
        "nodeSelector": {"zone": "a", "pool": "any"},
        "tolerations": [{"key": "x", "operator": "Exists"}],
        "imagePullSecrets": [{"name": "reg"}],
        "volumes": [{"name": "v", "emptyDir": {}}],
    }
    pod = body(
        "worker", config(worker_node_selector="pool=gpu", volumes="emptydir:tmp:/tmp", spot_nodes="none"), escape
    )
    assert pod["spec"]["nodeSelector"] == {"zone": "a", "pool": "gpu"}
    assert pod["spec"]["tolerations"] == [{"key": "x", "operator": "Exists"}]
    assert pod["spec"]["imagePullSecrets"] == [{"name": "reg"}]
    assert [v["name"] for v in pod["spec"]["volumes"]] == ["v", "emptydir-tmp"]
    assert escape["nodeSelector"]["pool"] == "any"  # the escape hatch itself is not changed


# ---------------------------------------------------------------- KFP TaskConfig
# What KFP 2.17's driver injects as the TASK_CONFIG input (its Go struct: no omitempty), for a task that set
# resources, a GPU, env, a toleration, a node selector, a node affinity and a PVC mount.
INJECTED = {
    "affinity": {
        "nodeAffinity": {
            s._REQUIRED: {
                "nodeSelectorTerms": [{"matchExpressions": [{"key": "disktype", "operator": "In", "values": ["ssd"]}]}]
            }
        }
    },
    "tolerations": [{"key": "example-key", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 3600}],
    "nodeSelector": {"disktype": "ssd"},
    "env": [{"name": "ENV1", "value": "val1"}],
    "volumes": [{"name": "v", "persistentVolumeClaim": {"claimName": "v"}}],
    "volumeMounts": [{"mountPath": "/data", "name": "v"}],
    "resources": {
        "limits": {"cpu": "100m", "memory": "100Mi", GPU: "1"},
        "requests": {"cpu": "100m", "memory": "100Mi"},
    },
}


def task_config(tmp_path, injected):
    """The TaskConfig a component's function receives from KFP's executor for this injected value."""
    from kfp import dsl
    from kfp.dsl.executor import Executor

    got = []

    def take(task_config: dsl.TaskConfig = None):
        got.append(task_config)

    executor_input = {"inputs": {"parameterValues": {"task_config": injected} if injected is not None else {}}}
    Executor({**executor_input, "outputs": {"outputFile": str(tmp_path / "out.json")}}, take).execute()
    return got[0]


def test_the_task_config_as_kfp_injects_it_dresses_the_workers_and_every_pod(tmp_path):
    given = {
        "worker_cpu": "1",
        "worker_memory": "2Gi",
        "worker_tolerations": "own:NoSchedule",
        "volumes": "emptydir:tmp:/tmp",
    }
    values = from_task_config(task_config(tmp_path, INJECTED), {**given, "spot_nodes": "none"})
    assert (values["worker_cpu"], values["worker_memory"], values["worker_accelerators"]) == (
        "100m",
        "100Mi",
        f"{GPU}=1",
    )
    cfg = checked(config(**values))
    worker = body("worker", cfg, cpu=cfg.worker_cpu, memory=cfg.worker_memory)
    ps = body("ps", cfg)
    assert worker["spec"]["containers"][0]["resources"]["limits"] == {"cpu": "100m", "memory": "100Mi", GPU: "1"}
    assert worker["spec"]["tolerations"] == [
        {"key": "own", "operator": "Exists", "effect": "NoSchedule"},
        *INJECTED["tolerations"],
    ]
    assert worker["spec"]["nodeSelector"] == {"disktype": "ssd"}
    assert worker["spec"]["affinity"] == INJECTED["affinity"]
    assert not {"tolerations", "nodeSelector", "affinity"} & set(ps["spec"])  # placement is the workers'
    assert "resources" not in ps["spec"]["containers"][0]
    for pod in (worker, ps):
        c = pod["spec"]["containers"][0]
        assert {"name": "ENV1", "value": "val1"} in c["env"]
        assert [v["name"] for v in pod["spec"]["volumes"]] == ["emptydir-tmp", "v"]
        assert c["volumeMounts"] == [{"name": "emptydir-tmp", "mountPath": "/tmp"}, {"mountPath": "/data", "name": "v"}]


def test_without_a_task_config_the_parameters_stand(tmp_path):
    """kfp.local passes none; a cluster task that sets nothing gets KFP's empty struct (nulls, resources {})."""
    values = {"worker_cpu": "1", "worker_memory": "2Gi", "env": "A=1"}
    assert from_task_config(None, values) == values
    assert from_task_config(task_config(tmp_path, None), values) == values
    empty = dict.fromkeys(INJECTED) | {"resources": {}}
    assert from_task_config(task_config(tmp_path, empty), values) == values


def test_the_log_line_says_what_dresses_the_pods_and_why():
    line = PodSettings.from_train_config(config(worker_accelerators="nvidia.com/gpu=1", volumes="pvc:d:/d")).describe()
    assert line.startswith("worker: nvidia.com/gpu=1, 4 toleration(s), affinity; ps: affinity; spot nodes (")
    assert "workers tolerate their NoSchedule taint and prefer them, the PS avoid them; 1 volume(s)" in line
    assert "no spot handling (spot_nodes=none)" in PodSettings.from_train_config(config(spot_nodes="none")).describe()
