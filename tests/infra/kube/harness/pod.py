"""One pod on the process kubelet: its volumes, its init containers in order, then all its containers
at once, each a local process with its own status, log and exit code; and its deletion.

A pod's volumes are made once, under ``<pod dir>/volumes/<name>`` (emptyDir, secret, configMap,
downwardAPI, projected ones including the service-account token, hostPath as the host's path), and
every container sees them at their real ``mountPath`` (``subPath`` and ``readOnly`` honoured), in a
mount namespace of its own, with its own tmpfs on ``/dev/shm`` (mounts.py).

An image runs the host's programs: the kubelet's ``images`` map an image repository
(``quay.io/argoproj/argoexec``, without tag) to an ``Image``: the directories put first on the
container's PATH, and the directories holding the image's files, which its containers still see
where a volume is mounted above them (an emptyDir on /work must not hide a checkout under /work).
A container needs a ``command`` (the image's entrypoint is not known here).
"""

from __future__ import annotations

import base64
import contextlib
import datetime as _dt
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from tests.infra.zygote import client_argv

from .mounts import Mount, in_namespaces, namespace_init, namespace_pids, private_dev_shm
from .oci import ContainerConfigError, ImageZygote, RuncContainer, container_env, forks_in_image
from .probes import start_probes
from .process import alive, die_with_parent, stopped, wait_for

TERMINAL = ("Succeeded", "Failed")


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def now_micro() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.\-]*)\)")


def expand(s: str, env: dict) -> str:
    """Kubernetes' $(VAR) expansion: $(VAR) -> value when defined, $$ -> $."""

    def sub(m):
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _VAR.sub(sub, s)


def image_repository(image: str) -> str:
    """``registry/name`` of ``registry/name:tag@digest``."""
    image = image.split("@", 1)[0]
    head, _, tail = image.rpartition("/")
    return f"{head}/{tail.split(':', 1)[0]}" if head else tail.split(":", 1)[0]


def oci_image(oci_images: dict, image: str):
    """The entry of ``oci_images`` for ``image``: its ``repository:tag`` first (a variant such as ``:1.0-gpu``),
    else its repository's."""
    repository = image_repository(image)
    tag = image.split("@", 1)[0].rpartition("/")[2].partition(":")[2]
    return oci_images.get(f"{repository}:{tag}") or oci_images.get(repository)


@dataclass(frozen=True)
class Image:
    """What an image is on this host: ``path``, directories first on its containers' PATH;
    ``files``, directories of its own files (a venv, a checkout) kept visible under any volume."""

    path: tuple[Path, ...]
    files: tuple[Path, ...] = ()


class PodConfigError(Exception):
    """The pod references something missing (secret, key...); retried like the kubelet does."""


class Container:
    """One container of a pod: its process, restarts and status (``containerStatuses`` entry)."""

    def __init__(self, pod: PodWorker, spec: dict, init: bool, waiting: str):
        self.pod, self.spec, self.init = pod, spec, init
        self.name = spec.get("name", "main")
        self.log_file = pod.dir / f"{self.name}.log"
        self.proc: subprocess.Popen | None = None
        self.container_id: str | None = None
        self.state: dict = {"waiting": {"reason": waiting}}
        self.restarts = 0
        self.last_state: dict = {}
        self.ready = self.started = False
        self.term_sent = False
        self.thread: threading.Thread | None = None
        self.runc: RuncContainer | None = None  # the start under runc, in an image (oci.py)

    @property
    def terminated(self) -> dict | None:
        return self.state.get("terminated")

    def status(self) -> dict:
        cs = {
            "name": self.name,
            "image": self.spec.get("image", ""),
            "imageID": "",
            "ready": self.ready,
            "started": self.started,
            "restartCount": self.restarts,
            "state": self.state,
            "lastState": self.last_state,
        }
        if self.container_id:
            cs["containerID"] = self.container_id
        return cs

    def run(self) -> dict:
        """Run until the process ends for good (restart policy) or the pod is deleted; its
        ``terminated`` state, or a StartError's."""
        pod, k = self.pod, self.pod.k
        policy = pod.pod["spec"].get("restartPolicy", "Always")
        if self.init and policy == "Always":
            policy = "OnFailure"  # an init container runs to completion
        oci = oci_image(k.oci_images, self.spec.get("image", ""))
        env = container_env(oci, pod.env(self.spec, host=False)) if oci else pod.env(self.spec)
        mounts = pod.mounts(self.spec)
        while True:
            argv = [expand(a, env) for a in (self.spec.get("command") or [])] + [
                expand(a, env) for a in (self.spec.get("args") or [])
            ]
            started = now_iso()
            self.runc = None
            try:
                if oci:  # inside the image, under runc (oci.py)
                    self.runc = RuncContainer(
                        oci,
                        pod.dir / f"{self.name}.{self.restarts}.bundle",
                        f"{pod.uid}-{self.name}-{self.restarts}",
                        k.workdir / "runc",
                    )
                    argv = [expand(a, env) for a in self.runc.process_args(self.spec)]
                    process, extra = argv, [Mount(p, "bind", p) for p in k.shared_paths]
                    if forks_in_image(argv):  # forked from the image's own zygote, preloaded
                        process, client = ImageZygote(oci, k.workdir).client(argv)
                        extra.append(client)
                    mounts_in_order = sorted([*extra, *mounts], key=lambda m: m.target.count("/"))  # parents first
                    self.runc.configure(pod.pod, self.spec, process, env, mounts_in_order, pod.pod_name)
                    wrapped, popen_env, popen_cwd = self.runc.argv(), {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}, None
                else:
                    if not self.spec.get("command"):
                        raise FileNotFoundError("the process kubelet ignores images: the container needs a command")
                    # Found before wrapping, so a missing program is a StartError as with a runtime,
                    # not the wrapper's exit code 127. A path under a mount is looked for in the volume.
                    program = argv[0] if "/" not in argv[0] else _host_path(argv[0], mounts)
                    found = shutil.which(program, path=env.get("PATH", os.defpath))
                    if found is None:
                        raise FileNotFoundError(f"executable file not found: {argv[0]}")
                    # the project's programs forked, preloaded: `python` found on the image's PATH is this interpreter
                    resolved = argv if "/" in argv[0] else [found, *argv[1:]]
                    command = client_argv(resolved, k.map_root_user)
                    wrapped = in_namespaces(
                        argv if command is resolved else command,
                        mounts,
                        map_root_user=k.map_root_user,
                        cwd=self.spec.get("workingDir"),
                    )
                    popen_env, popen_cwd = env, k.cwd
                with open(self.log_file, "ab") as out:
                    log_start = out.tell()
                    self.proc = subprocess.Popen(
                        wrapped,
                        env=popen_env,
                        cwd=popen_cwd,
                        stdin=subprocess.DEVNULL,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                        preexec_fn=die_with_parent,
                    )
            except ContainerConfigError as e:
                k.log.warning("%s: %s: %s", pod.ref, self.name, e)
                self.state = {"waiting": {"reason": "CreateContainerConfigError", "message": str(e)}}
                pod.publish()
                if pod.wait_deleting(2.0):
                    return {"exitCode": 128, "reason": "CreateContainerConfigError", "message": str(e)}
                continue
            except OSError as e:
                with open(self.log_file, "ab") as out:
                    out.write(f"[process kubelet] cannot start {argv}: {e}\n".encode())
                k.log.warning("%s: %s: cannot start %s: %s", pod.ref, self.name, argv, e)
                code, reason, message = 128, "StartError", str(e)
            else:
                k.log.info("%s: %s: started pid %d: %s", pod.ref, self.name, self.proc.pid, argv)
                self.container_id = f"process://{k.name}/{self.proc.pid}"
                self.state = {"running": {"startedAt": started}}
                self.ready = self.started = not self.init
                probes = start_probes(self)  # probes.py: a readiness probe holds it not ready until it passes
                pod.publish()
                code = self._wait()
                if probes is not None:
                    probes.stop()
                if self.runc is not None:
                    self.runc.cleanup()
                reason, message = ("Completed" if code == 0 else "Error"), None
                if code != 0 and self.spec.get("terminationMessagePolicy") == "FallbackToLogsOnError":
                    message = self._log_tail(log_start)
                k.log.info("%s: %s: pid %d exited with %d", pod.ref, self.name, self.proc.pid, code)
            terminated = {
                "exitCode": code,
                "reason": reason,
                "startedAt": started,
                "finishedAt": now_iso(),
                "containerID": self.container_id,
            }
            if message:
                terminated["message"] = message
            if self.proc is not None and self.proc.returncode is not None and self.proc.returncode < 0:
                terminated["signal"] = -self.proc.returncode
            self.ready = False
            restart = not pod.deleting and (policy == "Always" or (policy == "OnFailure" and code != 0))
            if not restart:
                self.state = {"terminated": terminated}
                return terminated
            self.restarts += 1
            self.last_state = {"terminated": terminated}
            self.state = {"waiting": {"reason": "CrashLoopBackOff" if code else "Completed"}}
            pod.publish()
            if pod.wait_deleting(min(10.0, 0.5 * 2 ** min(self.restarts, 5))):
                self.state = {"terminated": terminated}
                return terminated

    def _log_tail(self, since: int) -> str | None:
        """The termination message FallbackToLogsOnError gives a failed container: the last 80 lines
        of this start's output, at most 2048 bytes (the kubelet's limits). The process kubelet gives
        no /dev/termination-log file, so the policy "File" leaves no message."""
        with open(self.log_file, "rb") as f:
            f.seek(since)
            lines = f.read().splitlines()[-80:]
        return b"\n".join(lines)[-2048:].decode(errors="replace") or None

    def _wait(self) -> int:
        """Wait for the process; on deletion SIGTERM it, SIGKILL the group at the deadline."""
        p, pod = self.proc, self.pod
        while True:
            try:
                rc = p.wait(0.1)
                break
            except subprocess.TimeoutExpired:
                pass
            deleting, deadline = pod.deletion()
            if deleting and not self.term_sent and (init := namespace_init(p.pid)) is not None:
                self.term_sent = True  # to the container's init, which passes it on (the wrapper ignores it)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(init, signal.SIGTERM)
                pod.k.log.info("%s: %s: SIGTERM pid %d", pod.ref, self.name, init)
            if deleting and deadline is not None and time.monotonic() >= deadline:
                pod.k.log.info("%s: %s: grace period over, SIGKILL", pod.ref, self.name)
                self.kill()
                rc = p.wait()
                break
        self.kill()  # what the container left behind
        return 128 - rc if rc < 0 else rc  # -SIG -> 128+SIG, as container runtimes report it

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the container: its PID namespace's first process, which takes every other one of the namespace with
        it (under runc the runc process, the wrapper, is not its parent's only way to it), then the wrapper's group."""
        if self.proc is not None:
            if self.proc.poll() is None and (init := namespace_init(self.proc.pid)) is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(init, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)


def _host_path(path: str, mounts: list[Mount]) -> str:
    """Where the host holds ``path`` as the container will see it: under the deepest bind mount."""
    best = None
    for m in mounts:
        if m.fstype == "bind" and (path == m.target or path.startswith(m.target.rstrip("/") + "/")):
            if best is None or len(m.target) > len(best.target):
                best = m
    return path if best is None else best.source + path[len(best.target.rstrip("/")) :]


class PodWorker(threading.Thread):
    """Runs one pod: volumes, init containers, containers; reports its status; deletes it."""

    def __init__(self, kubelet, pod: dict):
        meta = pod["metadata"]
        super().__init__(name=f"pod-{meta['namespace']}/{meta['name']}", daemon=True)
        self.k, self.pod = kubelet, pod
        self.uid, self.namespace, self.pod_name = meta["uid"], meta["namespace"], meta["name"]
        self.ref = f"{self.namespace}/{self.pod_name}"
        self.dir = kubelet.workdir / "pods" / f"{self.namespace}_{self.pod_name}_{self.uid}"
        self.volumes_dir = self.dir / "volumes"
        spec = pod["spec"]
        self.inits = [Container(self, c, True, "PodInitializing") for c in spec.get("initContainers") or []]
        self.containers = [
            Container(self, c, False, "PodInitializing" if self.inits else "ContainerCreating")
            for c in spec.get("containers") or [{}]
        ]
        self.ip: str | None = None
        self.initialized = not self.inits
        self._volumes: dict[str, str] = {}  # volume name -> its directory on the host
        self._host_volumes: set[str] = set()  # hostPath ones: the host's own directories
        self._status_lock = threading.Lock()
        self._cv = threading.Condition()
        self._deleting = False
        self._deadline: float | None = None  # SIGKILL at
        self._report = True
        self._delete_sent = False
        self._done = False  # set (under _cv) once deletion requests are no longer acted upon
        self._holding = False  # hold_kill(): deletions are seen, and acted upon only at release_kill()
        self._held: tuple[str, int | bool] | None = None  # what to do then: ("delete", grace) or ("kill", report)

    @property
    def primary(self) -> Container:
        """The container tests mean by "the pod's process": ``main`` (Argo's) if any, else the first."""
        return next((c for c in self.containers if c.name == "main"), self.containers[0])

    # -- called from the watch thread
    def request_delete(self, grace: int) -> bool:
        """False when the worker is past the point of acting on it (caller deletes)."""
        with self._cv:
            if self._done:
                return False
            if self._holding:
                if self._held is None:
                    self._held = ("delete", grace)
                    self.k.log.info("%s: deletion requested, grace %ss: held", self.ref, grace)
                return True
            deadline = time.monotonic() + max(0, grace)
            if self._deadline is None or deadline < self._deadline:
                self._deadline = deadline
            if not self._deleting:
                self.k.log.info("%s: deletion requested, grace %ss", self.ref, grace)
            self._deleting = True
            self._cv.notify_all()
            return True

    def kill(self, report: bool) -> None:
        with self._cv:
            if self._holding:
                self._held = ("kill", report)
                self.k.log.info("%s: kill held", self.ref)
                return
            self._deleting = True
            self._report = report
            self._deadline = time.monotonic()
            self._cv.notify_all()

    # -- called from tests (ProcessKubelet.hold_kill / release_kill)
    def hold_kill(self) -> None:
        """From now on the pod's deletion is seen but not acted upon: its processes live on, as on a node cut off
        from the apiserver (or a pod in a long grace period) after the pod was deleted."""
        with self._cv:
            self._holding = True

    def release_kill(self) -> None:
        """Act upon the deletion held since hold_kill(), if any, as a node whose network returns does."""
        with self._cv:
            self._holding, held, self._held = False, self._held, None
        if held is not None:
            self.k.log.info("%s: released: %s", self.ref, held[0])
            if held[0] == "kill":
                self.kill(bool(held[1]))
            elif not self.request_delete(int(held[1])):
                self.k.delete_now(self.namespace, self.pod_name, self.uid)

    # -- called from tests (ProcessKubelet.freeze / resume)
    def processes(self) -> set[int]:
        """The host PIDs of every process of the pod's running containers (their PID namespaces, wrappers included)."""
        return {pid for c in self.inits + self.containers if c.running() for pid in namespace_pids(c.proc.pid)}

    def freeze(self) -> set[int]:
        """SIGSTOP every process of the pod, as a deadlock, a hung read or a frozen node leaves one: alive to the
        API and to this kubelet, silent to its peers. Repeated until a pass finds no process it had not stopped
        (one may fork while the others are being stopped). The stopped PIDs."""
        signalled: set[int] = set()
        while pids := self.processes() - signalled:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
            signalled |= pids
        # A stop lands when each process next runs (a busy one on a loaded machine, one in a system call): until then
        # it may still send a frame.
        wait_for(
            lambda: all(stopped(pid) or not alive(pid) for pid in signalled),
            30,
            interval=0.01,
            what=f"{self.ref}'s processes {sorted(signalled)} stopped",
        )
        self.k.log.info("%s: froze %d processes: %s", self.ref, len(signalled), sorted(signalled))
        return signalled

    def resume(self) -> set[int]:
        """SIGCONT every process of the pod (a frozen one, or a node whose network returns). The PIDs."""
        pids = self.processes()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        self.k.log.info("%s: resumed %d processes", self.ref, len(pids))
        return pids

    # -- called from the containers' threads
    @property
    def deleting(self) -> bool:
        with self._cv:
            return self._deleting

    def deletion(self) -> tuple[bool, float | None]:
        with self._cv:
            return self._deleting, self._deadline

    def wait_deleting(self, timeout: float) -> bool:
        with self._cv:
            self._cv.wait_for(lambda: self._deleting, timeout)
            return self._deleting

    # -- the pod's thread
    def run(self) -> None:
        try:
            self._run()
        except Exception:
            self.k.log.exception("%s: worker failed", self.ref)
        finally:
            for c in self.inits + self.containers:
                c.kill()
            if self.ip:
                self.k.ips.release(self.ip)
            with self._cv:  # a deletion that arrived after _finish looked: act on it here
                self._done = True
                pending = self._deleting and self._report and not self._delete_sent
            if pending:
                self._delete_sent = True
                self.k.delete_now(self.namespace, self.pod_name, self.uid)

    def _run(self) -> None:
        k = self.k
        self.dir.mkdir(parents=True, exist_ok=True)
        self.ip = k.ips.allocate()
        self.pod.setdefault("status", {})["podIP"] = self.ip
        self._patch(
            {
                "phase": "Pending",
                "hostIP": "127.0.0.1",
                "hostIPs": [{"ip": "127.0.0.1"}],
                "podIP": self.ip,
                "podIPs": [{"ip": self.ip}],
                "startTime": now_iso(),
            }
        )
        self.publish()
        k.log.info("%s: pod ip %s", self.ref, self.ip)

        while True:  # missing secrets/config maps are retried as the kubelet does
            try:
                self._make_volumes()
                for c in self.inits + self.containers:
                    self.env(c.spec)
                break
            except PodConfigError as e:
                for c in self.inits + self.containers:
                    c.state = {"waiting": {"reason": "CreateContainerConfigError", "message": str(e)}}
                self.publish()
                k.log.info("%s: %s; retrying", self.ref, e)
                if self.wait_deleting(2.0):
                    return self._finish(deleted=True)
        if self.deleting:
            return self._finish(deleted=True)

        for c in self.inits:
            terminated = c.run()
            self.publish()
            if terminated["exitCode"] != 0 or self.deleting:
                for other in self.containers:
                    other.state = {"waiting": {"reason": "PodInitializing"}}
                return self._finish(deleted=self.deleting, failed=terminated["exitCode"] != 0)
        self.initialized = True
        for c in self.containers:
            c.state = {"waiting": {"reason": "ContainerCreating"}}
            c.thread = threading.Thread(
                target=self._run_container, args=(c,), daemon=True, name=f"{self.name}/{c.name}"
            )
            c.thread.start()
        for c in self.containers:
            c.thread.join()
        return self._finish(deleted=self.deleting)

    def _run_container(self, c: Container) -> None:
        try:
            c.run()
        except Exception as e:
            self.k.log.exception("%s: %s failed", self.ref, c.name)
            c.state = {
                "terminated": {"exitCode": 128, "reason": "StartError", "message": repr(e), "finishedAt": now_iso()}
            }
        if not all(o.terminated for o in self.containers):
            self.publish()

    def _finish(self, deleted: bool, failed: bool = False) -> None:
        if not self._report:
            return
        self.publish(final=True, failed=failed or deleted)
        with self._cv:
            self._done = True
            deleted = deleted or self._deleting
        if deleted and self._report:
            self._delete_sent = True
            self.k.delete_now(self.namespace, self.pod_name, self.uid)

    # -- status
    def publish(self, final: bool = False, failed: bool = False) -> None:
        """Patch the pod's status from its containers' (serialised: containers report from their threads)."""
        with self._status_lock:
            cs = [c.status() for c in self.containers]
            ended = [c.terminated for c in self.containers]
            if final and all(ended):
                phase = "Succeeded" if all(t["exitCode"] == 0 for t in ended) else "Failed"
            elif final:
                phase = "Failed" if failed else "Succeeded"
            elif self.initialized and any(c.started or c.terminated for c in self.containers):
                phase = "Running"
            else:
                phase = "Pending"
            ready = self.initialized and all(c.ready for c in self.containers)
            done_reason = "PodCompleted" if phase in TERMINAL else "ContainersNotReady"
            status = {
                "phase": phase,
                "conditions": [
                    self._cond("PodReadyToStartContainers", "True"),
                    self._cond(
                        "Initialized",
                        "True" if self.initialized else "False",
                        None if self.initialized else "ContainersNotInitialized",
                    ),
                    self._cond("ContainersReady", "True" if ready else "False", None if ready else done_reason),
                    self._cond("Ready", "True" if ready else "False", None if ready else done_reason),
                ],
                "containerStatuses": cs,
            }
            if self.inits:
                status["initContainerStatuses"] = [c.status() for c in self.inits]
            self._patch(status)

    def _cond(self, type_: str, status: str, reason: str | None = None) -> dict:
        c = {"type": type_, "status": status, "lastTransitionTime": now_iso(), "lastProbeTime": None}
        if reason:
            c["reason"] = reason
        return c

    def _patch(self, status: dict) -> None:
        if not self._report:
            return
        try:
            self.k.core.patch_namespaced_pod_status(self.pod_name, self.namespace, {"status": status})
        except self.k.ApiException as e:
            if e.status == 404:
                self._report = False
            else:
                self.k.log.warning("%s: status patch failed: %s %s", self.ref, e.status, e.body)

    # -- environment
    def env(self, spec: dict, host: bool = True) -> dict:
        """The container's environment: with ``host``, this process's (``base_env``) and the image's PATH under it;
        then what the kubelet sets, then the container's ``envFrom`` and ``env``."""
        k = self.k
        env = dict(k.base_env) if host else {}
        image = k.images.get(image_repository(spec.get("image", "")))
        if image and host:
            env["PATH"] = os.pathsep.join([*map(str, image.path), env.get("PATH", os.defpath)])
        env.update(
            {
                "HOSTNAME": self.pod_name,
                "KUBERNETES_SERVICE_HOST": k.api_host,
                "KUBERNETES_SERVICE_PORT": str(k.api_port),
                "KUBERNETES_SERVICE_PORT_HTTPS": str(k.api_port),
                "KUBERNETES_PORT": f"tcp://{k.api_host}:{k.api_port}",
                "PROCESS_KUBELET_POD_IP": self.ip,
            }
        )
        for src in spec.get("envFrom") or []:
            prefix = src.get("prefix", "")
            for kind, key in (("secret", "secretRef"), ("configmap", "configMapRef")):
                if key in src:
                    data = self._read(kind, src[key]["name"], src[key].get("optional", False)) or {}
                    env.update({prefix + k_: v.decode() for k_, v in data.items()})
        for e in spec.get("env") or []:
            name = e["name"]
            if "valueFrom" not in e:
                env[name] = expand(e.get("value", ""), env)
                continue
            vf = e["valueFrom"]
            if "fieldRef" in vf:
                env[name] = self._field(vf["fieldRef"]["fieldPath"])
            elif "secretKeyRef" in vf or "configMapKeyRef" in vf:
                kind, ref = (
                    ("secret", vf["secretKeyRef"]) if "secretKeyRef" in vf else ("configmap", vf["configMapKeyRef"])
                )
                data = self._read(kind, ref["name"], ref.get("optional", False))
                if data is None or ref["key"] not in data:
                    if ref.get("optional"):
                        continue
                    raise PodConfigError(f"{kind} {self.namespace}/{ref['name']} has no key {ref['key']}")
                env[name] = data[ref["key"]].decode()
            elif "resourceFieldRef" in vf:
                env[name] = "0"  # no resources are enforced here
            else:
                k.log.warning("%s: env %s: unsupported valueFrom %s", self.ref, name, list(vf))
        return env

    def _field(self, path: str) -> str:
        pod, meta = self.pod, self.pod["metadata"]
        m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
        if m:
            return (meta.get(m.group(1)) or {}).get(m.group(2), "")
        return {
            "metadata.name": meta["name"],
            "metadata.namespace": meta["namespace"],
            "metadata.uid": meta["uid"],
            "spec.nodeName": self.k.name,
            "spec.serviceAccountName": pod["spec"].get("serviceAccountName", ""),
            "status.podIP": self.ip,
            "status.podIPs": self.ip,
            "status.hostIP": "127.0.0.1",
            "status.hostIPs": "127.0.0.1",
        }.get(path, "")

    # -- volumes
    def mounts(self, spec: dict) -> list[Mount]:
        """The container's view: its own /dev/shm, then its volumes at their mount paths and its
        image's files where a volume hides them, shallowest first."""
        binds = []
        for m in spec.get("volumeMounts") or []:
            source = self._volumes.get(m["name"])
            if source is None:
                self.k.log.warning("%s: mount of unknown or unsupported volume %s", self.ref, m["name"])
                continue
            if m.get("subPath"):
                source = os.path.join(source, m["subPath"])
                if m["name"] not in self._host_volumes and not os.path.exists(source):
                    os.makedirs(source)  # as the kubelet makes a missing subPath
            binds.append(Mount(m["mountPath"].rstrip("/") or "/", "bind", source, "ro" if m.get("readOnly") else ""))
        ref = spec.get("image", "")
        # an image run under runc (oci_images) has files of its own: none of the host's are shown to it
        image = None if oci_image(self.k.oci_images, ref) else self.k.images.get(image_repository(ref))
        for files in image.files if image else ():
            if any(str(files).startswith(b.target.rstrip("/") + "/") for b in binds):
                binds.append(Mount(str(files), "bind", str(files)))
        return [private_dev_shm(), *sorted(binds, key=lambda m: m.target.count("/"))]

    def _make_volumes(self) -> None:
        for v in self.pod["spec"].get("volumes") or []:
            name = v["name"]
            if "hostPath" in v:
                self._volumes[name] = v["hostPath"]["path"]
                self._host_volumes.add(name)
                continue
            target = self.volumes_dir / name
            target.mkdir(parents=True, exist_ok=True)
            files: dict[str, bytes] = {}
            if "emptyDir" in v:
                target.chmod(0o777)  # as the kubelet makes it: writable by any user the containers run as
            elif "secret" in v:
                files = self._items("secret", v["secret"].get("secretName"), v["secret"])
            elif "configMap" in v:
                files = self._items("configmap", v["configMap"]["name"], v["configMap"])
            elif "downwardAPI" in v:
                files = self._downward(v["downwardAPI"].get("items") or [])
            elif "projected" in v:
                for src in v["projected"].get("sources") or []:
                    if "serviceAccountToken" in src:
                        t = src["serviceAccountToken"]
                        files[t["path"]] = self._token(t.get("audience"), t.get("expirationSeconds", 3600)).encode()
                    elif "secret" in src:
                        files.update(self._items("secret", src["secret"]["name"], src["secret"]))
                    elif "configMap" in src:
                        files.update(self._items("configmap", src["configMap"]["name"], src["configMap"]))
                    elif "downwardAPI" in src:
                        files.update(self._downward(src["downwardAPI"].get("items") or []))
            else:
                self.k.log.warning("%s: volume %s: unsupported type", self.ref, name)
                continue
            for rel, data in files.items():
                f = target / rel
                f.parent.mkdir(parents=True, exist_ok=True)
                f.write_bytes(data)
            self._volumes[name] = str(target)

    def _read(self, kind: str, name: str, optional: bool):
        """Secret or ConfigMap data (decoded to str), None if optional and missing."""
        read = self.k.core.read_namespaced_secret if kind == "secret" else self.k.core.read_namespaced_config_map
        try:
            data = json.loads(self._as_node(lambda: read(name, self.namespace, _preload_content=False)).data)
        except self.k.ApiException as e:
            if e.status == 404 and optional:
                return None
            raise PodConfigError(f"{kind} {self.namespace}/{name}: {e.status} {e.reason}") from e
        out = {}
        for key, value in (data.get("data") or {}).items():
            out[key] = base64.b64decode(value) if kind == "secret" else value.encode()
        for key, value in (data.get("binaryData") or {}).items():
            out[key] = base64.b64decode(value)
        return out

    def _items(self, kind: str, name: str, src: dict) -> dict[str, bytes]:
        data = self._read(kind, name, src.get("optional", False)) or {}
        if src.get("items"):
            return {it["path"]: data[it["key"]] for it in src["items"] if it["key"] in data}
        return data

    def _downward(self, items: list) -> dict[str, bytes]:
        return {it["path"]: self._field(it["fieldRef"]["fieldPath"]).encode() for it in items if "fieldRef" in it}

    def _token(self, audience: str | None, seconds: int) -> str:
        sa = self.pod["spec"].get("serviceAccountName") or "default"
        spec = {
            "expirationSeconds": max(600, int(seconds)),
            "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": self.pod_name, "uid": self.uid},
        }
        if audience:
            spec["audiences"] = [audience]
        try:
            resp = self._as_node(
                lambda: self.k.core.create_namespaced_service_account_token(
                    sa, self.namespace, {"spec": spec}, _preload_content=False
                )
            )
        except self.k.ApiException as e:
            raise PodConfigError(f"token for service account {self.namespace}/{sa}: {e.status} {e.reason}") from e
        return json.loads(resp.data)["status"]["token"]

    def _as_node(self, call, within: float = 5.0):
        """``call()``, retried on 403 for ``within`` seconds: right after binding, the Node authorizer's
        graph may not have seen the pod yet, so the node may not read what the pod references."""
        deadline = time.monotonic() + within
        while True:
            try:
                return call()
            except self.k.ApiException as e:
                if e.status != 403 or time.monotonic() >= deadline:
                    raise
                time.sleep(0.2)


def log_files(workdir: Path, namespace: str, name: str, container: str | None) -> list[Path]:
    """The log files this kubelet kept for a pod's container (any container if None), oldest first."""
    pattern = f"pods/{namespace}_{name}_*/{container or '*'}.log"
    return sorted(workdir.glob(pattern), key=lambda p: p.stat().st_mtime)
