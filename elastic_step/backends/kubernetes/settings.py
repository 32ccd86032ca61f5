"""Pod settings: what dresses each role's pods beyond the backend's own fields, from the job's parameters.

Per role (`worker_*`, `ps_*`): CPU and memory (requests = limits, through the instance's spec), accelerators
(extended resources such as `nvidia.com/gpu`, in limits and requests), tolerations, a node selector and an
affinity. For both roles: the service account, environment variables (`env`, `env_from_secrets`) and volumes.
`spot_nodes` names the spot (preemptible) nodes: workers tolerate their NoSchedule taint and prefer them, the
parameter servers prefer other nodes and do not tolerate the taint (a NoExecute taint still moves workers off).

Every value is parsed here, once, when the job's configuration is validated: a bad one is a ConfigError naming
the parameter, the value and a good example, before any pod exists. The strings are what pipeline UIs can give;
empty means unset. Merge order into a pod: backend defaults < ELASTIC_STEP_POD_SPEC < these < the backend's own
fields (containers, the labels it finds its pods by).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re

from elastic_step.errors import ConfigError

ROLES = ("worker", "ps")
EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
OPERATORS = ("Exists", "Equal")
# The well-known labels (and taints) of spot nodes: GKE, Karpenter, AKS, EKS managed node groups.
SPOT_AUTO = (
    ("cloud.google.com/gke-spot", "true"),
    ("karpenter.sh/capacity-type", "spot"),
    ("kubernetes.azure.com/scalesetpriority", "spot"),
    ("eks.amazonaws.com/capacityType", "SPOT"),
)
SPOT_WEIGHT = 100  # preferredDuringScheduling weight of the spot preference (the highest)

# Kubernetes' quantity grammar (k8s.io/apimachinery resource.Quantity), unsigned: requests cannot be negative.
_QUANTITY = re.compile(r"(\d+(\.\d*)?|\.\d+)(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|[eE][+-]?\d+)?")
_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_SUBDOMAIN = re.compile(rf"{_DNS_LABEL}(\.{_DNS_LABEL})*")
_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"  # a qualified name's name part
_LABEL_KEY = re.compile(rf"({_DNS_LABEL}(\.{_DNS_LABEL})*/)?{_NAME}")
_LABEL_VALUE = re.compile(rf"({_NAME})?")
_ENV_NAME = re.compile(r"[-._a-zA-Z][-._a-zA-Z0-9]*")
_AFFINITY_KINDS = ("nodeAffinity", "podAffinity", "podAntiAffinity")
_REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"
_PREFERRED = "preferredDuringSchedulingIgnoredDuringExecution"


def _bad(param: str, value: str, why: str, example: str) -> ConfigError:
    return ConfigError(f"{param} {value!r}: {why}; e.g. {param}={example}")


def _json(param: str, value: str, kind: type, example: str):
    try:
        out = json.loads(value)
    except ValueError as e:
        raise _bad(param, value, f"not valid JSON ({e})", example) from None
    if not isinstance(out, kind):
        raise _bad(param, value, f"a JSON {kind.__name__} is expected, not a {type(out).__name__}", example)
    return out


def _items(value: str) -> list[str]:
    return [part.strip() for part in value.split(",")]


def quantity(param: str, value: str, example: str = "500m") -> str:
    """A resource quantity in Kubernetes' grammar (1, 500m, 1.5, 2Gi, 1e3), as given."""
    if not _QUANTITY.fullmatch(value):
        raise _bad(
            param,
            value,
            "not a Kubernetes quantity (a non-negative number with an optional suffix: m, k, M, G, Ki, Mi, Gi, "
            "... or an exponent such as e3)",
            example,
        )
    return value


def accelerators(param: str, value: str) -> dict[str, str]:
    """`nvidia.com/gpu=1[,name=count]` -> {extended resource: count}."""
    example = "nvidia.com/gpu=1"
    out = {}
    for item in _items(value) if value else []:
        name, eq, count = item.partition("=")
        domain, slash, _ = name.partition("/")
        if not (eq and slash and _LABEL_KEY.fullmatch(name) and _DNS_SUBDOMAIN.fullmatch(domain)):
            raise _bad(param, value, f"{item!r} is not <extended resource name, domain/name>=<count>", example)
        if domain == "kubernetes.io" or domain.endswith(".kubernetes.io"):
            raise _bad(param, value, f"{name} is not an extended resource (kubernetes.io is Kubernetes' own)", example)
        if not count.isdigit() or int(count) < 1:
            raise _bad(param, value, f"the count of {name} must be a whole number >= 1, not {count!r}", example)
        out[name] = count
    return out


def tolerations(param: str, value: str) -> list[dict]:
    """kubectl's taint syntax, `key[=value]:Effect[,...]` (`key:Effect`: any value), or a JSON list of
    Toleration objects."""
    example = "dedicated=training:NoSchedule"
    if value.lstrip().startswith("["):
        out = _json(param, value, list, '[{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}]')
        for t in out:
            if not isinstance(t, dict) or set(t) - {"key", "operator", "value", "effect", "tolerationSeconds"}:
                raise _bad(param, value, f"{t!r} is not a Toleration (key, operator, value, effect)", example)
            if t.get("effect", "") not in (*EFFECTS, ""):
                raise _bad(param, value, f"unknown effect {t['effect']!r} (one of {', '.join(EFFECTS)})", example)
            if t.get("operator", "Equal") not in OPERATORS:
                raise _bad(param, value, f"unknown operator {t['operator']!r} (Exists or Equal)", example)
        return out
    out = []
    for item in _items(value) if value else []:
        taint, colon, effect = item.rpartition(":")
        key, eq, val = taint.partition("=")
        if not colon or not key:
            raise _bad(param, value, f"{item!r} is not key[=value]:Effect", example)
        if effect not in EFFECTS:
            raise _bad(param, value, f"unknown effect {effect!r} in {item!r} (one of {', '.join(EFFECTS)})", example)
        if not _LABEL_KEY.fullmatch(key) or not _LABEL_VALUE.fullmatch(val):
            raise _bad(param, value, f"{item!r}: {key!r}={val!r} is not a taint's key and value", example)
        t = {"key": key, "operator": "Equal", "value": val} if eq else {"key": key, "operator": "Exists"}
        out.append({**t, "effect": effect})
    return out


def labels(param: str, value: str) -> dict[str, str]:
    """`key=value[,...]` or a JSON object of strings (a node selector, the spot labels)."""
    example = "pool=training"
    if value.lstrip().startswith("{"):
        out = _json(param, value, dict, '{"pool": "training"}')
        pairs = list(out.items())
    else:
        items = _items(value) if value else []
        if any("=" not in item for item in items):
            raise _bad(param, value, "every item is key=value", example)
        pairs = [tuple(item.split("=", 1)) for item in items]
    for k, v in pairs:
        if not (isinstance(k, str) and isinstance(v, str) and _LABEL_KEY.fullmatch(k) and _LABEL_VALUE.fullmatch(v)):
            raise _bad(param, value, f"{k!r}={v!r} is not a label's key and value", example)
    return dict(pairs)


def affinity(param: str, value: str) -> dict:
    """A JSON Affinity object (nodeAffinity, podAffinity, podAntiAffinity)."""
    example = '{"nodeAffinity": {"' + _PREFERRED + '": [...]}}'
    out = _json(param, value, dict, example) if value else {}
    unknown = set(out) - set(_AFFINITY_KINDS)
    if unknown or not all(isinstance(v, dict) for v in out.values()):
        raise _bad(param, value, f"an Affinity has only objects {', '.join(_AFFINITY_KINDS)}", example)
    return out


def env(param: str, value: str) -> list[dict]:
    """`NAME=value[,...]` or a JSON list of EnvVar objects (value or valueFrom)."""
    example = "LOG_LEVEL=info"
    if value.lstrip().startswith("["):
        out = _json(param, value, list, '[{"name": "LOG_LEVEL", "value": "info"}]')
    else:
        out = []
        for item in _items(value) if value else []:
            name, eq, val = item.partition("=")
            if not eq:
                raise _bad(param, value, f"{item!r} is not NAME=value", example)
            out.append({"name": name, "value": val})
    for e in out:
        if not (isinstance(e, dict) and isinstance(e.get("name"), str) and _ENV_NAME.fullmatch(e["name"])):
            raise _bad(param, value, f"{e!r} is not an environment variable (a name, a value)", example)
    return out


def secrets_env(param: str, value: str) -> tuple[list[dict], list[dict]]:
    """`SECRET` (all its keys as variables) or `NAME=SECRET/key` (one key) -> (env, envFrom)."""
    example = "aws-creds,DB_PASSWORD=db/password"
    variables, sources = [], []
    for item in _items(value) if value else []:
        name, eq, ref = item.partition("=")
        secret, slash, key = ref.partition("/")
        if eq and slash and _ENV_NAME.fullmatch(name) and _DNS_SUBDOMAIN.fullmatch(secret) and key:
            variables.append({"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}})
        elif not eq and _DNS_SUBDOMAIN.fullmatch(item):
            sources.append({"secretRef": {"name": item}})
        else:
            raise _bad(param, value, f"{item!r} is neither a Secret's name nor NAME=secret/key", example)
    return variables, sources


_VOLUME_KINDS = {
    "pvc": lambda name: {"persistentVolumeClaim": {"claimName": name}},
    "secret": lambda name: {"secret": {"secretName": name}},
    "configmap": lambda name: {"configMap": {"name": name}},
    "emptydir": lambda name: {"emptyDir": {}},
}


def volumes(param: str, value: str) -> tuple[list[dict], list[dict]]:
    """`kind:NAME:/path[:ro][,...]` (kind: pvc, secret, configmap, emptydir) or a JSON object
    `{"volumes": [...], "volumeMounts": [...]}` -> (volumes, volumeMounts)."""
    example = "pvc:datasets:/data:ro"
    if value.lstrip().startswith("{"):
        out = _json(param, value, dict, '{"volumes": [...], "volumeMounts": [...]}')
        vols, mounts = out.get("volumes") or [], out.get("volumeMounts") or []
        if set(out) - {"volumes", "volumeMounts"} or not isinstance(vols, list) or not isinstance(mounts, list):
            raise _bad(param, value, "the JSON form is {volumes: [Volume], volumeMounts: [VolumeMount]}", example)
        known = {v.get("name") for v in vols if isinstance(v, dict)}
        for m in mounts:
            if not (isinstance(m, dict) and m.get("name") in known and str(m.get("mountPath", "")).startswith("/")):
                raise _bad(param, value, f"{m!r} does not mount one of the volumes at an absolute path", example)
        return vols, mounts
    vols, mounts = [], []
    for item in _items(value) if value else []:
        kind, _, rest = item.partition(":")
        name, _, rest = rest.partition(":")
        path, _, mode = rest.partition(":")
        if kind not in _VOLUME_KINDS:
            raise _bad(
                param, value, f"unknown volume kind {kind!r} in {item!r} (one of {', '.join(_VOLUME_KINDS)})", example
            )
        if not (_DNS_SUBDOMAIN.fullmatch(name) and path.startswith("/") and mode in ("", "ro")):
            raise _bad(param, value, f"{item!r} is not {kind}:NAME:/absolute/path[:ro]", example)
        volume = f"{kind}-{name}"[:63].rstrip("-.")
        vols.append({"name": volume, **_VOLUME_KINDS[kind](name)})
        mounts.append({"name": volume, "mountPath": path, **({"readOnly": True} if mode else {})})
    return vols, mounts


def spot_labels(param: str, value: str) -> tuple[tuple[str, str], ...]:
    """`auto` (the well-known spot labels), `none`, or `key=value[,...]`."""
    if value == "auto":
        return SPOT_AUTO
    if value in ("none", ""):
        return ()
    return tuple(labels(param, value).items())


def merge_affinity(a: dict, b: dict) -> dict:
    """Both affinities at once: required node terms ANDed (each term of one with each of the other), the
    preferred terms and pod (anti-)affinity terms of both."""
    out = copy.deepcopy(a)
    for kind, spec in b.items():
        mine = out.setdefault(kind, {})
        for key, terms in spec.items():
            if kind == "nodeAffinity" and key == _REQUIRED:
                theirs = terms.get("nodeSelectorTerms") or []
                ours = (mine.get(_REQUIRED) or {}).get("nodeSelectorTerms")
                if ours:
                    theirs = [
                        {
                            k: x.get(k, []) + y.get(k, [])
                            for k in ("matchExpressions", "matchFields")
                            if k in x or k in y
                        }
                        for x in ours
                        for y in theirs
                    ]
                mine[_REQUIRED] = {"nodeSelectorTerms": copy.deepcopy(theirs)}
            else:
                mine[key] = (mine.get(key) or []) + copy.deepcopy(terms)
    return out


@dataclasses.dataclass(frozen=True)
class RoleSettings:
    """What dresses one role's pods."""

    accelerators: dict[str, str] = dataclasses.field(default_factory=dict)  # extended resource -> count
    tolerations: tuple[dict, ...] = ()
    node_selector: dict[str, str] = dataclasses.field(default_factory=dict)
    affinity: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class PodSettings:
    """What dresses the job's pods, by role and for all (see the module)."""

    roles: dict[str, RoleSettings] = dataclasses.field(default_factory=dict)
    service_account: str = ""
    env: tuple[dict, ...] = ()
    env_from: tuple[dict, ...] = ()
    volumes: tuple[dict, ...] = ()
    volume_mounts: tuple[dict, ...] = ()
    spot: tuple[tuple[str, str], ...] = ()  # the spot nodes' labels (spot_nodes)

    def describe(self) -> str:
        """One line for the master's log: what dresses the pods beyond the defaults, and why they go where."""
        parts = []
        for role in ROLES:
            r = self.role(role)
            what = [f"{k}={v}" for k, v in r.accelerators.items()]
            what += [f"node selector {','.join(f'{k}={v}' for k, v in r.node_selector.items())}"] * bool(
                r.node_selector
            )
            what += [f"{len(r.tolerations)} toleration(s)"] * bool(r.tolerations)
            what += ["affinity"] * bool(r.affinity)
            parts.append(f"{role}: {', '.join(what) or 'no extras'}")
        shared = [f"service account {self.service_account}"] * bool(self.service_account)
        shared += [f"{len(self.env) + len(self.env_from)} env source(s)"] * bool(self.env or self.env_from)
        shared += [f"{len(self.volumes)} volume(s)"] * bool(self.volumes)
        spot = ", ".join(f"{k}={v}" for k, v in self.spot)
        parts.append(
            f"spot nodes ({spot}): workers tolerate their NoSchedule taint and prefer them, the PS avoid them"
            if spot
            else "no spot handling (spot_nodes=none)"
        )
        return "; ".join(parts + shared)

    def role(self, role: str) -> RoleSettings:
        return self.roles.get(role) or RoleSettings()

    @classmethod
    def from_train_config(cls, cfg) -> PodSettings:
        """The settings of a TrainConfig, every value checked (ConfigError naming the parameter)."""
        for param, example in (("worker_cpu", "500m"), ("worker_memory", "2Gi"), ("ps_cpu", "1"), ("ps_memory", "2Gi")):
            if getattr(cfg, param):
                quantity(param, getattr(cfg, param), example)
        spot = spot_labels("spot_nodes", cfg.spot_nodes)
        roles = {}
        for role in ROLES:
            tols = tolerations(f"{role}_tolerations", getattr(cfg, f"{role}_tolerations"))
            aff = affinity(f"{role}_affinity", getattr(cfg, f"{role}_affinity"))
            if spot and role == "worker":
                tols += [{"key": k, "operator": "Equal", "value": v, "effect": "NoSchedule"} for k, v in spot]
                prefer = [{"weight": SPOT_WEIGHT, "preference": {"matchExpressions": [_is(k, v)]}} for k, v in spot]
                aff = merge_affinity(aff, {"nodeAffinity": {_PREFERRED: prefer}})
            elif spot:
                avoid = {"matchExpressions": [{**_is(k, v), "operator": "NotIn"} for k, v in spot]}
                aff = merge_affinity(
                    aff, {"nodeAffinity": {_PREFERRED: [{"weight": SPOT_WEIGHT, "preference": avoid}]}}
                )
            roles[role] = RoleSettings(
                accelerators=accelerators(f"{role}_accelerators", getattr(cfg, f"{role}_accelerators")),
                tolerations=tuple(tols),
                node_selector=labels(f"{role}_node_selector", getattr(cfg, f"{role}_node_selector")),
                affinity=aff,
            )
        if cfg.job_service_account and not _DNS_SUBDOMAIN.fullmatch(cfg.job_service_account):
            raise _bad("job_service_account", cfg.job_service_account, "not a ServiceAccount's name", "training-sa")
        secret_env, env_from = secrets_env("env_from_secrets", cfg.env_from_secrets)
        vols, mounts = volumes("volumes", cfg.volumes)
        return cls(
            roles=roles,
            service_account=cfg.job_service_account,
            env=tuple(env("env", cfg.env) + secret_env),
            env_from=tuple(env_from),
            volumes=tuple(vols),
            volume_mounts=tuple(mounts),
            spot=spot,
        )

    def dress(self, role: str, pod_spec: dict, container: dict) -> None:
        """Put this role's settings on a pod spec (already holding ELASTIC_STEP_POD_SPEC's fields, which these
        extend) and its container (the backend's own env names win)."""
        mine = self.role(role)
        if mine.accelerators:
            resources = container.setdefault("resources", {})
            for part in ("requests", "limits"):  # extended resources: requests = limits, as Kubernetes requires
                resources[part] = {**resources.get(part, {}), **mine.accelerators}
        if mine.tolerations:
            pod_spec["tolerations"] = [*pod_spec.get("tolerations", []), *copy.deepcopy(mine.tolerations)]
        if mine.node_selector:
            pod_spec["nodeSelector"] = {**pod_spec.get("nodeSelector", {}), **mine.node_selector}
        if mine.affinity:
            pod_spec["affinity"] = merge_affinity(pod_spec.get("affinity") or {}, mine.affinity)
        if self.service_account:
            pod_spec["serviceAccountName"] = self.service_account
        if self.volumes:
            pod_spec["volumes"] = [*pod_spec.get("volumes", []), *copy.deepcopy(self.volumes)]
            container["volumeMounts"] = copy.deepcopy(list(self.volume_mounts))
        if self.env_from:
            container["envFrom"] = copy.deepcopy(list(self.env_from))
        own = {e["name"] for e in container.get("env", [])}
        container["env"] = [*(copy.deepcopy(e) for e in self.env if e["name"] not in own), *container.get("env", [])]


def _is(key: str, value: str) -> dict:
    return {"key": key, "operator": "In", "values": [value]}


def from_task_config(task_config, values: dict) -> dict:
    """The training parameters `values` with a KFP TaskConfig's fields folded in (docs/kfp.md): resources dress
    the workers (their limits, else requests, take the place of worker_cpu, worker_memory and the accelerators
    they name); tolerations, node selector and affinity are added to the workers'; env and volumes to every
    pod's. `task_config`: KFP's dsl.TaskConfig as its executor gives it (None, or empty, off a cluster)."""
    if task_config is None:
        return values
    out = dict(values)

    def given(name: str) -> str:
        return out.get(name) or ""

    resources = task_config.resources or {}
    limits, requests = resources.get("limits") or {}, resources.get("requests") or {}
    for name in ("cpu", "memory"):
        if limits.get(name) or requests.get(name):
            out[f"worker_{name}"] = str(limits.get(name) or requests.get(name))
    extended = {k: str(v) for k, v in {**requests, **limits}.items() if "/" in k}
    if extended:
        merged = {**accelerators("worker_accelerators", given("worker_accelerators")), **extended}
        out["worker_accelerators"] = ",".join(f"{k}={v}" for k, v in merged.items())
    if task_config.tolerations:
        out["worker_tolerations"] = json.dumps(
            tolerations("worker_tolerations", given("worker_tolerations")) + list(task_config.tolerations)
        )
    if task_config.node_selector:
        mine = labels("worker_node_selector", given("worker_node_selector"))
        out["worker_node_selector"] = json.dumps({**mine, **task_config.node_selector})
    if task_config.affinity:
        mine = affinity("worker_affinity", given("worker_affinity"))
        out["worker_affinity"] = json.dumps(merge_affinity(mine, task_config.affinity))
    if task_config.env:
        out["env"] = json.dumps(env("env", given("env")) + list(task_config.env))
    if task_config.volumes:
        vols, mounts = volumes("volumes", given("volumes"))
        out["volumes"] = json.dumps(
            {
                "volumes": vols + list(task_config.volumes),
                "volumeMounts": mounts + list(task_config.volume_mounts or []),
            }
        )
    return out
