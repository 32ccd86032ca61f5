"""Pod Security: the job's pods pass the `restricted` Pod Security Standard, and nothing merged into them may break it.

Every worker and PS pod runs as the image's numeric non-root user, with the runtime's default seccomp profile, no
privilege escalation and no capabilities:

    pod:        runAsNonRoot: true, runAsUser: 1000, runAsGroup: 1000, seccompProfile: {type: RuntimeDefault}
    container:  allowPrivilegeEscalation: false, capabilities: {drop: [ALL]}

`ELASTIC_STEP_POD_SPEC` may change these (a `securityContext`, or one under `containers` by the role's name, is merged
into them), and the pod settings add volumes; the backend checks the pods it would create against the `restricted`
level (https://kubernetes.io/docs/concepts/security/pod-security-standards/) before any pod exists, so an override
that a restricted namespace would refuse is a ConfigError naming the field, not pods refused one by one.
"""

from __future__ import annotations

import copy

RUN_AS_USER = 1000  # the runtime image's user (images/)
POD_SECURITY_CONTEXT = {
    "runAsNonRoot": True,
    "runAsUser": RUN_AS_USER,
    "runAsGroup": RUN_AS_USER,
    "seccompProfile": {"type": "RuntimeDefault"},
}
CONTAINER_SECURITY_CONTEXT = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}

# The restricted level's allowances (Pod Security Standards, v1.34).
VOLUME_KINDS = (
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
)
SECCOMP_TYPES = ("RuntimeDefault", "Localhost")
ADDABLE_CAPABILITIES = ("NET_BIND_SERVICE",)
SAFE_SYSCTLS = (
    "kernel.shm_rmid_forced",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range",
    "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time",
    "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
)
SELINUX_TYPES = ("", "container_t", "container_init_t", "container_kvm_t", "container_engine_t")


def merge(base: dict, over: dict) -> dict:
    """`over` merged into a copy of `base`: objects key by key, anything else (lists included) replaced."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def restricted_violations(spec: dict) -> list[str]:
    """What in a pod spec the `restricted` Pod Security level refuses, each as `field: why`."""
    out = []
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(field):
            out.append(f"spec.{field}: must not be true")
    for i, v in enumerate(spec.get("volumes") or []):
        kinds = [k for k in v if k != "name"]
        if any(k not in VOLUME_KINDS for k in kinds):
            out.append(
                f"spec.volumes[{i}] ({v.get('name')}): a {'/'.join(kinds)} volume (allowed: {', '.join(VOLUME_KINDS)})"
            )
    pod_sc = spec.get("securityContext") or {}
    out += _context_violations("spec.securityContext", pod_sc)
    for name, value in ((s.get("name"), s.get("value")) for s in pod_sc.get("sysctls") or []):
        if name not in SAFE_SYSCTLS:
            out.append(f"spec.securityContext.sysctls: {name}={value} is not a safe sysctl")
    for kind in ("initContainers", "containers", "ephemeralContainers"):
        for c in spec.get(kind) or []:
            where = f"spec.{kind}[{c.get('name')}]"
            sc = c.get("securityContext") or {}
            out += _context_violations(f"{where}.securityContext", sc)
            if sc.get("privileged"):
                out.append(f"{where}.securityContext.privileged: must not be true")
            if sc.get("allowPrivilegeEscalation") is not False:
                out.append(f"{where}.securityContext.allowPrivilegeEscalation: must be false")
            caps = sc.get("capabilities") or {}
            if "ALL" not in (caps.get("drop") or []):
                out.append(f"{where}.securityContext.capabilities.drop: must include ALL")
            added = [c for c in caps.get("add") or [] if c not in ADDABLE_CAPABILITIES]
            if added:
                out.append(f"{where}.securityContext.capabilities.add: {', '.join(added)} (only NET_BIND_SERVICE)")
            if sc.get("procMount", "Default") != "Default":
                out.append(f"{where}.securityContext.procMount: must be Default")
            if not (sc.get("runAsNonRoot") or pod_sc.get("runAsNonRoot") and sc.get("runAsNonRoot") is not False):
                out.append(f"{where}.securityContext.runAsNonRoot: must be true (here or in the pod's)")
            seccomp = (sc.get("seccompProfile") or pod_sc.get("seccompProfile") or {}).get("type")
            if seccomp not in SECCOMP_TYPES:
                out.append(
                    f"{where}.securityContext.seccompProfile: must be {' or '.join(SECCOMP_TYPES)} (here or the pod's)"
                )
            if any(p.get("hostPort") for p in c.get("ports") or []):
                out.append(f"{where}.ports: hostPort must not be set")
    return out


def _context_violations(where: str, sc: dict) -> list[str]:
    out = []
    if sc.get("runAsUser") == 0:
        out.append(f"{where}.runAsUser: must not be 0 (root)")
    if (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
        out.append(f"{where}.seccompProfile: must not be Unconfined")
    if (sc.get("appArmorProfile") or {}).get("type") == "Unconfined":
        out.append(f"{where}.appArmorProfile: must not be Unconfined")
    selinux = sc.get("seLinuxOptions") or {}
    if selinux.get("type", "") not in SELINUX_TYPES or selinux.get("user") or selinux.get("role"):
        out.append(f"{where}.seLinuxOptions: only a container type may be set")
    return out
