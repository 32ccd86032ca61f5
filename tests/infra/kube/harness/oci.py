"""Containers of the process kubelet run inside a real image under runc, as a node's container runtime runs them.

``OciImage.unpacked(layout, tag)`` unpacks an OCI image layout (what ``scripts/build-image`` writes) once into a
cache beside it: its root filesystem, shared read-only by every container, and its configuration (user, env,
entrypoint, cmd, working directory). A kubelet given ``oci_images={repository: image}`` runs every container whose
image is of that repository under ``runc`` (``RuncContainer``):

* its root is the image's, with a writable layer of its own (overlayfs, mounted in a mount namespace of the
  container's start, so nothing is left mounted on the host when it ends), read-only under
  ``readOnlyRootFilesystem``;
* its process is the pod's ``command``/``args`` over the image's entrypoint and cmd, as Kubernetes combines them;
  its environment the image's, then the pod's (never the host's); its user, group and supplementary groups from
  the ``securityContext`` (container over pod) or the image's user; its capabilities containerd's default set, less
  ``drop`` plus ``add``; ``allowPrivilegeEscalation: false`` sets no_new_privs; ``runAsNonRoot`` refuses root;
* its mounts: /proc, /dev, /dev/pts, a 64 MiB /dev/shm, /dev/mqueue, a read-only /sys, and the pod's volumes at
  their mount paths (emptyDir, secret, configMap, downwardAPI, projected, hostPath: pod.py makes them);
* namespaces of its own for PIDs, IPC, UTS (its hostname the pod's name) and mounts, and the host's network:
  the pod's loopback address (pod.py) is then the container's, as in process mode.

The runc process is the container's process as the kubelet sees it: the container's PID 1 is its one child
(mounts.namespace_init finds it), so SIGTERM at deletion, SIGKILL at the grace period's end, freezing and the exit
code work as for a process container. Needs root (runc's rootful mode) and Debian's runc.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from .mounts import DEV_SHM_OPTIONS, Mount

# containerd's default capabilities (and Docker's): what a container has unless its securityContext says otherwise.
DEFAULT_CAPABILITIES = (
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FSETID",
    "CAP_FOWNER",
    "CAP_MKNOD",
    "CAP_NET_RAW",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETFCAP",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
    "CAP_KILL",
    "CAP_AUDIT_WRITE",
)


class ContainerConfigError(Exception):
    """The container cannot run as its spec asks (root under runAsNonRoot, no command): CreateContainerConfigError."""


def runc() -> str:
    path = shutil.which("runc", path="/usr/sbin:/usr/bin:/sbin:/bin")
    if path is None:
        raise RuntimeError("the process kubelet runs image containers with runc: apt-get install runc")
    return path


@dataclass(frozen=True)
class OciImage:
    """An image unpacked here: ``rootfs`` (shared, never written) and the runtime configuration umoci derived from
    the image's (``process``: user, env, args = entrypoint + cmd, cwd)."""

    rootfs: Path
    process: dict

    @classmethod
    def unpacked(cls, layout: str | Path, tag: str) -> OciImage:
        """The image ``layout:tag``, unpacked once (umoci, under a lock) into ``<layout>.unpacked/``."""
        layout = Path(layout)
        bundle = layout.with_name(f"{layout.name}.unpacked")
        with open(layout.with_name(f"{layout.name}.unpack.lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (bundle / ".complete").exists():
                shutil.rmtree(bundle, ignore_errors=True)
                bundle.mkdir()
                image = f"{layout}:{tag}"
                # raw: the layers applied, without the digest of every file umoci keeps to repack a bundle
                for argv in (
                    ["umoci", "raw", "unpack", "--image", image, str(bundle / "rootfs")],
                    [
                        "umoci",
                        "raw",
                        "runtime-config",
                        "--image",
                        image,
                        "--rootfs",
                        str(bundle / "rootfs"),
                        str(bundle / "config.json"),
                    ],
                ):
                    subprocess.run(["nice", *argv], check=True, stdout=subprocess.DEVNULL)
                (bundle / ".complete").touch()
        config = json.loads((bundle / "config.json").read_text())
        return cls(bundle / "rootfs", config["process"])

    def user(self) -> tuple[int, int]:
        u = self.process.get("user") or {}
        return int(u.get("uid", 0)), int(u.get("gid", 0))

    def env(self) -> dict[str, str]:
        return dict(e.split("=", 1) for e in self.process.get("env") or [])


class RuncContainer:
    """One start of a container under runc: ``argv()`` is the command the kubelet runs as the container's process,
    ``cleanup()`` removes what runc keeps of it once that process has ended."""

    def __init__(self, image: OciImage, bundle: Path, container_id: str, state: Path):
        self.image, self.bundle, self.id, self.state = image, bundle, container_id, state

    def configure(
        self, pod: dict, spec: dict, argv: list[str], env: dict[str, str], mounts: list[Mount], hostname: str
    ) -> None:
        """Write the bundle's config.json for the container ``spec`` of ``pod``: its process ``argv`` (its
        ``process_args``, expanded), with ``env`` (the pod's, over the image's) and the pod's ``mounts``."""
        sc = {**(pod["spec"].get("securityContext") or {}), **(spec.get("securityContext") or {})}
        uid, gid = self.image.user()
        uid = int(sc.get("runAsUser", uid))
        gid = int(sc.get("runAsGroup", gid))
        if sc.get("runAsNonRoot") and uid == 0:
            raise ContainerConfigError("container has runAsNonRoot and image will run as root")
        groups = {int(g) for g in sc.get("supplementalGroups") or []}
        if "fsGroup" in sc:
            groups.add(int(sc["fsGroup"]))
        groups = sorted(groups - {gid})
        caps = sc.get("capabilities") or {}
        drop = {("CAP_" + c).replace("CAP_CAP_", "CAP_") for c in caps.get("drop") or []}
        add = {("CAP_" + c).replace("CAP_CAP_", "CAP_") for c in caps.get("add") or []}
        have = set() if "CAP_ALL" in drop else set(DEFAULT_CAPABILITIES) - drop
        have = sorted(have | add)
        read_only = bool(sc.get("readOnlyRootFilesystem"))
        config = {
            "ociVersion": "1.0.2",
            "process": {
                "terminal": False,
                "user": {"uid": uid, "gid": gid, **({"additionalGids": groups} if groups else {})},
                "args": argv,
                "env": [f"{k}={v}" for k, v in env.items()],
                "cwd": spec.get("workingDir") or self.image.process.get("cwd") or "/",
                "capabilities": dict.fromkeys(("bounding", "effective", "permitted"), have),
                "noNewPrivileges": sc.get("allowPrivilegeEscalation") is False,
            },
            # An overlay even when read-only: runc makes the volumes' mount points in its upper layer, not the image's.
            "root": {"path": str(self.bundle / "rootfs"), "readonly": read_only},
            # the kubelet's: a pod name longer than a hostname may be is cut to 63 characters
            "hostname": hostname[:63].rstrip("-."),
            "mounts": [
                {"destination": "/proc", "type": "proc", "source": "proc"},
                {
                    "destination": "/dev",
                    "type": "tmpfs",
                    "source": "tmpfs",
                    "options": ["nosuid", "strictatime", "mode=755", "size=65536k"],
                },
                {
                    "destination": "/dev/pts",
                    "type": "devpts",
                    "source": "devpts",
                    "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"],
                },
                {"destination": "/dev/shm", "type": "tmpfs", "source": "shm", "options": DEV_SHM_OPTIONS.split(",")},
                {
                    "destination": "/dev/mqueue",
                    "type": "mqueue",
                    "source": "mqueue",
                    "options": ["nosuid", "noexec", "nodev"],
                },
                {
                    "destination": "/sys",
                    "type": "sysfs",
                    "source": "sysfs",
                    "options": ["nosuid", "noexec", "nodev", "ro"],
                },
                *(
                    {
                        "destination": m.target,
                        "type": "bind",
                        "source": m.source,
                        "options": ["rbind", "rprivate", *(["ro"] if "ro" in m.options.split(",") else [])],
                    }
                    for m in mounts
                    if m.fstype == "bind"
                ),
            ],
            "linux": {
                "namespaces": [{"type": t} for t in ("pid", "ipc", "uts", "mount")],
                "maskedPaths": ["/proc/kcore", "/proc/keys", "/proc/timer_list", "/sys/firmware"],
                "readonlyPaths": ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"],
            },
        }
        self.bundle.mkdir(parents=True, exist_ok=True)
        (self.bundle / "config.json").write_text(json.dumps(config, indent=1))

    def process_args(self, spec: dict) -> list[str]:
        """Kubernetes' rule: ``command`` replaces the image's entrypoint (and then its cmd too), ``args`` its cmd
        ($(VAR) not yet expanded)."""
        entry_cmd = self.image.process.get("args") or []
        if spec.get("command"):
            argv = [*spec["command"], *(spec.get("args") or [])]
        elif spec.get("args"):
            # umoci's config holds entrypoint + cmd together; the image's entrypoint is its first word here.
            argv = [*entry_cmd[:1], *spec["args"]]
        else:
            argv = list(entry_cmd)
        if not argv:
            raise ContainerConfigError("no command specified: neither the pod nor the image gives one")
        return argv

    def argv(self) -> list[str]:
        """The runc process, in a mount namespace of its own that holds the container's writable layer: the overlay
        goes away with it, whatever ends it."""
        run = [runc(), "--root", str(self.state), "run", "--bundle", str(self.bundle), self.id]
        for d in ("rootfs", "upper", "work"):
            (self.bundle / d).mkdir(exist_ok=True)
        q = shlex.quote
        overlay = f"lowerdir={self.image.rootfs},upperdir={self.bundle / 'upper'},workdir={self.bundle / 'work'}"
        script = f'mount -t overlay overlay -o {q(overlay)} {q(str(self.bundle / "rootfs"))} && exec "$@"'
        return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script, "runc", *run]

    def cleanup(self) -> None:
        """What runc keeps of an ended container (its state, its cgroup)."""
        with contextlib.suppress(OSError):
            subprocess.run(
                [runc(), "--root", str(self.state), "delete", "--force", self.id],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=30,
            )
        shutil.rmtree(self.bundle, ignore_errors=True)


def container_env(image: OciImage, pod_env: dict[str, str]) -> dict[str, str]:
    """The container's environment: the image's, then what the kubelet and the pod set (``pod_env``)."""
    return {**image.env(), **pod_env}


def unpacked_image(layout: str | Path, tag: str | None = None) -> OciImage:
    """``OciImage.unpacked`` of the layout's one tag when ``tag`` is not given."""
    layout = Path(layout)
    if tag is None:
        index = json.loads((layout / "index.json").read_text())
        tags = [m.get("annotations", {}).get("org.opencontainers.image.ref.name") for m in index["manifests"]]
        if len(tags) != 1 or not tags[0]:
            raise ValueError(f"{layout}: expected one tagged image, found {tags}; pass the tag")
        tag = tags[0]
    return OciImage.unpacked(layout, tag)


# ---------------------------------------------------------------------------------- the image's zygote
# Where an image's containers see the zygote's files (read-only): a directory every Debian image has, so that runc
# makes no mount point in the image's shared root (the zygote's container has no writable layer).
HARNESS = "/mnt"


def forks_in_image(argv: list[str]) -> bool:
    """Whether `argv`, a container's process in the project's image, is a program its zygote forks: `python -m
    elastic_step.<module> ...` with the image's Python (found on the image's PATH)."""
    python = os.path.basename(argv[0]) if argv else ""
    return (
        len(argv) >= 3
        and python in ("python", "python3", "python3.11")
        and argv[1] == "-m"
        and argv[2].startswith("elastic_step.")
        and os.environ.get("ELASTIC_STEP_TEST_ZYGOTE") != "0"
    )


class ImageZygote:
    """tests/infra/zygote.py's zygote run inside an image under runc: the image's Python imports the image's
    TensorFlow once, and each of the image's containers whose process ``forks_in_image`` runs a client instead, the
    program forked in that container's namespaces as its user. So a pod's program is the image's code on the image's
    files, seen through the container's own root and volumes, without importing TensorFlow afresh.

    The zygote's container shares the host's PID namespace (it finds its clients' namespaces by their host PIDs) and
    holds the capabilities to enter them; its root is the image's, read-only."""

    def __init__(self, image: OciImage, workdir: Path):
        self.image, self.workdir = image, workdir

    def client(self, argv: list[str]) -> tuple[list[str], Mount]:
        """The container's process that runs `argv` forked from this zygote, and the mount that shows it the client."""
        from tests.infra.zygote import CLIENT, _started

        name = _started(str(self.image.rootfs), self._command)
        return ["python", "-I", "-S", f"{HARNESS}/{CLIENT.name}", name, "--", *argv], Mount(
            f"{HARNESS}/{CLIENT.name}", "bind", str(CLIENT), "ro"
        )

    def _command(self, listener: int, alive: int) -> list[str]:
        from tests.infra import zygote

        bundle = self.workdir / f"zygote-{os.getpid()}"
        bundle.mkdir(parents=True, exist_ok=True)
        caps = [
            "CAP_SYS_ADMIN", "CAP_SYS_PTRACE", "CAP_SYS_CHROOT", "CAP_SETUID", "CAP_SETGID", "CAP_KILL",
            "CAP_DAC_OVERRIDE", "CAP_DAC_READ_SEARCH",
        ]  # fmt: skip
        config = {
            "ociVersion": "1.0.2",
            "process": {
                "terminal": False,
                "user": {"uid": 0, "gid": 0},
                "args": ["python", f"{HARNESS}/{Path(zygote.__file__).name}", "3", "4"],
                "env": [f"{k}={v}" for k, v in self.image.env().items()],
                "cwd": "/",
                "capabilities": dict.fromkeys(("bounding", "effective", "permitted"), caps),
            },
            "root": {"path": str(self.image.rootfs), "readonly": True},
            "hostname": "zygote",
            "mounts": [
                {"destination": "/proc", "type": "proc", "source": "proc"},
                {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "mode=755"]},
                {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "nodev"]},
                {
                    "destination": HARNESS,
                    "type": "bind",
                    "source": str(Path(zygote.__file__).parent),
                    "options": ["rbind", "ro"],
                },
            ],
            "linux": {"namespaces": [{"type": "mount"}, {"type": "uts"}]},  # the host's PIDs, network and IPC
        }
        (bundle / "config.json").write_text(json.dumps(config, indent=1))
        run = [runc(), "--root", str(self.workdir / "runc"), "run", "--preserve-fds", "2", "--bundle", str(bundle)]
        # runc passes descriptors 3 and 4 on: the listener and the pipe whose EOF ends the zygote
        bash = shutil.which("bash", path="/usr/bin:/bin")  # sh may not take descriptors above 9
        return [bash, "-c", f'exec "$@" 3<&{listener} 4<&{alive}', "bash", *run, f"zygote-{os.getpid()}"]
