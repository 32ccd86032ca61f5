"""Local backend: every instance is a process on this machine, started by the master.

A thread per process waits on it, so a kill is an event the moment the kernel reaps the child,
not after a heartbeat timeout. Logs go to one file per launch under `log_dir`. With `preload`, the
package's own instances are forked from a preloader that has imported TensorFlow once (preloaded.py):
a launch or relaunch then costs milliseconds, not seconds of CPU.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import threading

from elastic_step.backends.api import Backend, EventKind, InstanceEvent, InstanceId, InstanceSpec
from elastic_step.backends.preloaded import PreloadedProcess, Preloader, preloadable
from elastic_step.util.process import PARENT_ENV


class LocalBackend(Backend):
    name = "local"
    can_freeze = True

    def __init__(self, log_dir: str | os.PathLike, env: dict[str, str] | None = None, preload: bool = False):
        super().__init__()
        self.log_dir = pathlib.Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._env = dict(env or {})
        self._procs: dict[InstanceId, subprocess.Popen | PreloadedProcess] = {}
        self._launches: dict[InstanceId, int] = {}
        self._lock = threading.Lock()
        self._preloader = Preloader(self.log_dir / "preloader.log") if preload else None

    def start(self, spec: InstanceSpec) -> None:
        with self._lock:
            if spec.id in self._procs:
                raise RuntimeError(f"{spec.id} is already running")
            n = self._launches.get(spec.id, 0) + 1
            self._launches[spec.id] = n
            log_path = self.log_dir / f"{spec.id}.{n}.log"
            env = {**os.environ, **self._env, **spec.env, PARENT_ENV: str(os.getpid())}
            if self._preloader is not None and self._preloader.alive() and preloadable(spec.argv):
                proc = self._preloader.start(spec.argv, env, log_path)
            else:
                with open(log_path, "ab") as log:
                    proc = subprocess.Popen(
                        spec.argv,
                        env=env,
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )  # a Ctrl-C reaches the master only
            self._procs[spec.id] = proc
        self.emit(InstanceEvent(EventKind.STARTED, spec.id, detail=f"pid {proc.pid}"))
        self.emit(InstanceEvent(EventKind.RUNNING, spec.id, detail=f"pid {proc.pid}"))
        threading.Thread(target=self._wait, args=(spec.id, proc), daemon=True, name=f"wait-{spec.id}").start()

    def _wait(self, inst: InstanceId, proc: subprocess.Popen) -> None:
        code = proc.wait()
        with self._lock:
            if self._procs.get(inst) is proc:
                del self._procs[inst]
        if code < 0:
            sig = signal.Signals(-code).name
            self.emit(InstanceEvent(EventKind.LOST, inst, exit_code=code, detail=f"killed by {sig}"))
        else:
            self.emit(InstanceEvent(EventKind.EXITED, inst, exit_code=code))

    def _signal(self, inst: InstanceId, sig: int) -> subprocess.Popen | None:
        with self._lock:
            proc = self._procs.get(inst)
        if proc is not None and proc.poll() is None:
            try:
                proc.send_signal(sig)
            except ProcessLookupError:
                pass
        return proc

    def stop(self, instance: InstanceId, grace_s: float = 10.0) -> None:
        proc = self._signal(instance, signal.SIGTERM)
        if proc is None:
            return
        self._signal(instance, signal.SIGCONT)  # a frozen process (chaos) takes its SIGTERM now, not after grace_s
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.kill(instance)
            proc.wait()

    def kill(self, instance: InstanceId) -> None:
        self._signal(instance, signal.SIGKILL)

    def freeze(self, instance: InstanceId) -> None:
        self._signal(instance, signal.SIGSTOP)

    def thaw(self, instance: InstanceId) -> None:
        self._signal(instance, signal.SIGCONT)

    def pid(self, instance: InstanceId) -> int | None:
        with self._lock:
            proc = self._procs.get(instance)
        return proc.pid if proc else None

    def alive(self) -> set[InstanceId]:
        with self._lock:
            return {i for i, p in self._procs.items() if p.poll() is None}

    def master_address(self, port: int) -> str:
        return f"127.0.0.1:{port}"

    def log_path(self, instance: InstanceId) -> pathlib.Path:
        return self.log_dir / f"{instance}.{self._launches.get(instance, 1)}.log"

    def close(self, grace_s: float = 10.0) -> None:
        # Signal everyone first, then wait: shutdown takes one grace period, not one per instance.
        alive = sorted(self.alive())
        for inst in alive:
            self._signal(inst, signal.SIGTERM)
            self._signal(inst, signal.SIGCONT)
        for inst in alive:
            self.stop(inst, grace_s)
        if self._preloader is not None:
            self._preloader.close()
