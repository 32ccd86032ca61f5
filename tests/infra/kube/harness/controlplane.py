"""A real Kubernetes control plane on loopback, for tests.

``ControlPlane`` starts etcd, kube-apiserver (TLS, token authentication, ``Node,RBAC``
authorization, the ``Priority``, ``ServiceAccount`` and ``PodSecurity`` admission plugins, service-account
token signing), kube-scheduler and kube-controller-manager (garbage collector, token and
service-account controllers, node lifecycle) on 127.0.0.1 with free ports, in a temporary
directory; writes an admin kubeconfig; and stops everything on exit. Nodes are added with
:meth:`ControlPlane.add_node`, which starts a :class:`~tests.infra.kube.harness.kubelet.ProcessKubelet`.

Binaries come from ``scripts/build-control-plane`` (built once per Kubernetes version into
``${ELASTIC_STEP_CACHE:-~/.cache/elastic-step}/kube-<version>/bin``).

Users: the admin token (group ``system:masters``) is in the ``--token-auth-file``; more
users are added with :meth:`ControlPlane.add_token`, before start (into the token file) or
at any time (served by a small TokenReview webhook in this process, since the apiserver
never re-reads its token file). Kubelets authenticate as ``system:node:<name>`` in
``system:nodes``, so the Node authorizer and the NodeRestriction admission plugin apply.

Set ``ELASTIC_STEP_KEEP_KUBE=1`` to keep the work directory (logs, certificates,
kubeconfigs, etcd data) after the control plane stops.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import datetime as _dt
import http.server
import ipaddress
import json
import logging
import os
import secrets
import shutil
import ssl
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from .process import REPO, Service, free_port, http_ok, popen, run_build, stop_process

if TYPE_CHECKING:  # the kubelet imports this module's neighbours; a name for annotations only
    from .kubelet import ProcessKubelet

log = logging.getLogger("tests.infra.kube.harness")

BUILD_SCRIPT = REPO / "scripts" / "build-control-plane"
SERVICE_CIDR = "10.0.0.0/24"
SERVICE_IP = "10.0.0.1"
SA_ISSUER = "https://kubernetes.default.svc.cluster.local"
POD_SECURITY_LABEL = "pod-security.kubernetes.io/enforce"  # the level a namespace's pods must pass


class ControlPlaneError(RuntimeError):
    pass


def build_control_plane(env: dict | None = None) -> Path:
    """Run scripts/build-control-plane (a no-op when the binaries exist); returns bin dir."""
    return run_build(BUILD_SCRIPT, override_env="ELASTIC_STEP_KUBE_BIN", error=ControlPlaneError, env=env)


def _tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


# --------------------------------------------------------------------------- certificates


def _write_pki(d: Path) -> None:
    """ca.crt/ca.key, server.crt/server.key (127.0.0.1, localhost, kubernetes.default...),
    sa.key/sa.pub (service-account token signing)."""
    d.mkdir(parents=True, exist_ok=True)
    ips = ["127.0.0.1", SERVICE_IP]
    dns = [
        "localhost",
        "kubernetes",
        "kubernetes.default",
        "kubernetes.default.svc",
        "kubernetes.default.svc.cluster.local",
    ]
    try:
        import cryptography  # noqa: F401
    except ImportError:
        _write_pki_openssl(d, ips, dns)
        return
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec, rsa
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    def pem_key(key) -> bytes:
        return key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

    now = _dt.datetime.now(_dt.timezone.utc) - _dt.timedelta(minutes=5)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "elastic-step-test-ca")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + _dt.timedelta(days=3650))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    san = [x509.IPAddress(ipaddress.ip_address(i)) for i in ips] + [x509.DNSName(n) for n in dns]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + _dt.timedelta(days=3650))
        .add_extension(x509.SubjectAlternativeName(san), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    sa = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    (d / "ca.key").write_bytes(pem_key(ca_key))
    (d / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (d / "server.key").write_bytes(pem_key(key))
    (d / "server.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (d / "sa.key").write_bytes(pem_key(sa))
    (d / "sa.pub").write_bytes(
        sa.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )


def _write_pki_openssl(d: Path, ips: list[str], dns: list[str]) -> None:
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    run("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", "ca.key")
    run(
        "req", "-x509", "-new", "-key", "ca.key", "-subj", "/CN=elastic-step-test-ca", "-days", "3650", "-out", "ca.crt"
    )
    run("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", "server.key")
    run("req", "-new", "-key", "server.key", "-subj", "/CN=kube-apiserver", "-out", "server.csr")
    san = ",".join([f"IP:{i}" for i in ips] + [f"DNS:{n}" for n in dns])
    (d / "server.ext").write_text(
        f"subjectAltName={san}\nbasicConstraints=critical,CA:FALSE\nextendedKeyUsage=serverAuth,clientAuth\n"
    )
    run(
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "3650",
        "-sha256",
        "-extfile",
        "server.ext",
        "-out",
        "server.crt",
    )
    run("genrsa", "-out", "sa.key", "2048")
    run("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub")


# --------------------------------------------------------------------------- token webhook


class _TokenWebhook:
    """Answers the apiserver's TokenReviews from a dict, so users can be added at runtime."""

    def __init__(self, tokens: dict, lock: threading.Lock, cert: Path, key: Path):
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                token = (body.get("spec") or {}).get("token", "")
                with outer.lock:
                    user = outer.tokens.get(token)
                status = {"authenticated": False}
                if user is not None:
                    status = {
                        "authenticated": True,
                        "user": {"username": user["user"], "uid": user["uid"], "groups": list(user["groups"])},
                    }
                reply = json.dumps(
                    {
                        "apiVersion": body.get("apiVersion", "authentication.k8s.io/v1"),
                        "kind": "TokenReview",
                        "status": status,
                    }
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.tokens, self.lock = tokens, lock
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(str(cert), str(key))
        self.server.socket = ctx.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, name="token-webhook", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# --------------------------------------------------------------------------- control plane

_live: weakref.WeakSet[ControlPlane] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for cp in list(_live):
        with contextlib.suppress(Exception):
            cp.stop()


class ControlPlane(Service):
    """etcd + kube-apiserver + kube-scheduler + kube-controller-manager on loopback.

    Use as a context manager (or call :meth:`start`/:meth:`stop`). Attributes once started:
    ``server`` (https URL), ``port``, ``ca_path``, ``kubeconfig_path`` (admin),
    ``admin_token``, ``workdir``, ``timings`` (seconds per start phase), ``nodes``.
    """

    def __init__(
        self,
        bin_dir: str | Path | None = None,
        workdir: str | Path | None = None,
        *,
        verbosity: int = 1,
        extra_args: dict[str, list[str]] | None = None,
        keep_workdir: bool | None = None,
        start_timeout: float = 120.0,
        node_defaults: dict | None = None,
    ):
        self.bin_dir = Path(bin_dir) if bin_dir else None
        # ProcessKubelet's arguments for every node add_node starts, under the ones it is given (images, oci_images,
        # shared_paths: what the nodes run a test's images as)
        self.node_defaults = dict(node_defaults or {})
        self._own_workdir = workdir is None
        self.workdir = Path(workdir) if workdir else None
        self.verbosity = verbosity
        self.extra_args = extra_args or {}
        self.keep_workdir = os.environ.get("ELASTIC_STEP_KEEP_KUBE") == "1" if keep_workdir is None else keep_workdir
        self.start_timeout = start_timeout
        self.admin_token = secrets.token_hex(16)
        self._tokens: dict[str, dict] = {}
        self._tokens_lock = threading.Lock()
        self._procs: dict[str, subprocess.Popen] = {}
        self._webhook: _TokenWebhook | None = None
        self._etcd_dir: Path | None = None
        self._clients: list = []
        self.nodes: dict[str, ProcessKubelet] = {}
        self.timings: dict[str, float] = {}
        self.server = ""
        self.port = 0
        self.started = False

    # ---- lifecycle -------------------------------------------------------------------
    def start(self) -> ControlPlane:
        if self.started:
            return self
        t_all = time.monotonic()
        if self.bin_dir is None:
            t = time.monotonic()
            self.bin_dir = build_control_plane()
            self.timings["build"] = time.monotonic() - t
        for b in ("etcd", "kube-apiserver", "kube-scheduler", "kube-controller-manager"):
            if not os.access(self.bin_dir / b, os.X_OK):
                raise ControlPlaneError(f"{self.bin_dir / b} missing; run {BUILD_SCRIPT}")
        _sweep_stale()
        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix=f"elastic-step-kube-{os.getpid()}-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.logs = self.workdir / "logs"
        self.logs.mkdir(exist_ok=True)
        _live.add(self)
        self.started = True  # from here on stop() cleans up
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        self.timings["start"] = time.monotonic() - t_all - self.timings.get("build", 0.0)
        log.info(
            "control plane up at %s in %.1fs (%s)",
            self.server,
            self.timings["start"],
            ", ".join(f"{k} {v:.1f}s" for k, v in self.timings.items()),
        )
        return self

    def _start(self) -> None:
        w = self.workdir
        t = time.monotonic()
        pki = w / "pki"
        _write_pki(pki)
        self.ca_path = pki / "ca.crt"
        self.timings["pki"] = time.monotonic() - t

        # tokens: admin + anything added before start go to the static token file
        with self._tokens_lock:
            self._tokens[self.admin_token] = {"user": "admin", "uid": "admin", "groups": ("system:masters",)}
            lines = [_token_line(tok, u) for tok, u in self._tokens.items()]
        (w / "tokens.csv").write_text("\n".join(lines) + "\n")
        self._webhook = _TokenWebhook(self._tokens, self._tokens_lock, pki / "server.crt", pki / "server.key")
        _write_kubeconfig(
            w / "token-webhook.kubeconfig",
            f"https://127.0.0.1:{self._webhook.port}/authenticate",
            self.ca_path,
            token=None,
        )

        # etcd: data in /dev/shm when there is one (fsync is what makes etcd slow on disks)
        t = time.monotonic()
        shm = Path("/dev/shm")
        self._etcd_dir = Path(
            tempfile.mkdtemp(
                prefix=f"elastic-step-etcd-{os.getpid()}-",
                dir=str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else str(w),
            )
        )
        ec, ep = free_port(), free_port()
        self.etcd_url = f"http://127.0.0.1:{ec}"
        self._spawn(
            "etcd",
            [
                str(self.bin_dir / "etcd"),
                "--name=default",
                f"--data-dir={self._etcd_dir}",
                f"--listen-client-urls={self.etcd_url}",
                f"--advertise-client-urls={self.etcd_url}",
                f"--listen-peer-urls=http://127.0.0.1:{ep}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{ep}",
                f"--initial-cluster=default=http://127.0.0.1:{ep}",
                "--log-level=warn",
                # one member: campaign after 0.25s instead of 1s
                "--heartbeat-interval=50",
                "--election-timeout=250",
                "--quota-backend-bytes=2147483648",
                *self.extra_args.get("etcd", []),
            ],
        )
        self._wait("etcd", lambda: http_ok(f"{self.etcd_url}/health"))
        self.timings["etcd"] = time.monotonic() - t

        # kube-apiserver
        t = time.monotonic()
        self.port = free_port()
        self.server = f"https://127.0.0.1:{self.port}"
        v = f"--v={self.verbosity}"
        self._spawn(
            "kube-apiserver",
            [
                str(self.bin_dir / "kube-apiserver"),
                f"--etcd-servers={self.etcd_url}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={self.port}",
                f"--cert-dir={w / 'apiserver'}",
                f"--tls-cert-file={pki / 'server.crt'}",
                f"--tls-private-key-file={pki / 'server.key'}",
                f"--client-ca-file={self.ca_path}",
                f"--token-auth-file={w / 'tokens.csv'}",
                f"--authentication-token-webhook-config-file={w / 'token-webhook.kubeconfig'}",
                "--authentication-token-webhook-version=v1",
                "--authentication-token-webhook-cache-ttl=10s",
                "--authorization-mode=Node,RBAC",
                "--enable-admission-plugins=NamespaceLifecycle,LimitRanger,ServiceAccount,Priority,"
                "DefaultTolerationSeconds,ResourceQuota,NodeRestriction,PodSecurity,MutatingAdmissionWebhook,"
                "ValidatingAdmissionWebhook",
                f"--service-account-key-file={pki / 'sa.pub'}",
                f"--service-account-signing-key-file={pki / 'sa.key'}",
                f"--service-account-issuer={SA_ISSUER}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--endpoint-reconciler-type=none",  # 127.0.0.1 is not a valid Endpoints address
                "--allow-privileged=true",
                "--profiling=false",
                "--event-ttl=1h",
                v,
                *self.extra_args.get("kube-apiserver", []),
            ],
        )
        self._wait("kube-apiserver", lambda: self._readyz())
        self.timings["kube-apiserver"] = time.monotonic() - t
        self.kubeconfig_path = w / "admin.kubeconfig"
        _write_kubeconfig(self.kubeconfig_path, self.server, self.ca_path, self.admin_token, user="admin")

        # kube-scheduler and kube-controller-manager, both with the admin kubeconfig
        t = time.monotonic()
        kc = str(self.kubeconfig_path)
        common = [
            f"--kubeconfig={kc}",
            f"--authentication-kubeconfig={kc}",
            f"--authorization-kubeconfig={kc}",
            "--bind-address=127.0.0.1",
            "--leader-elect=false",
            v,
        ]
        sport, cport = free_port(), free_port()
        self._spawn(
            "kube-scheduler",
            [
                str(self.bin_dir / "kube-scheduler"),
                *common,
                f"--secure-port={sport}",
                f"--cert-dir={w / 'scheduler'}",
                *self.extra_args.get("kube-scheduler", []),
            ],
        )
        self._spawn(
            "kube-controller-manager",
            [
                str(self.bin_dir / "kube-controller-manager"),
                *common,
                f"--secure-port={cport}",
                f"--cert-dir={w / 'controller-manager'}",
                f"--service-account-private-key-file={pki / 'sa.key'}",
                f"--root-ca-file={self.ca_path}",
                "--use-service-account-credentials=false",
                "--cluster-name=elastic-step-test",
                "--enable-garbage-collector=true",
                "--node-monitor-period=2s",
                *self.extra_args.get("kube-controller-manager", []),
            ],
        )
        self._wait("kube-scheduler", lambda: http_ok(f"https://127.0.0.1:{sport}/healthz", insecure=True))
        self._wait("kube-controller-manager", lambda: http_ok(f"https://127.0.0.1:{cport}/healthz", insecure=True))
        # ready for pods: the service-account and root-CA controllers have done the default namespace
        self._wait("kube-controller-manager (default service account)", lambda: self._namespace_ready("default"))
        self.timings["scheduler+controller-manager"] = time.monotonic() - t

    def stop(self) -> None:
        if not self.started:
            return
        self.started = False
        for kubelet in list(self.nodes.values()):
            with contextlib.suppress(Exception):
                kubelet.stop()
        for name in ("kube-controller-manager", "kube-scheduler", "kube-apiserver", "etcd"):
            proc = self._procs.pop(name, None)
            if proc is not None:
                stop_process(proc)
        for c in self._clients:
            with contextlib.suppress(Exception):
                c.close()
        self._clients.clear()
        if self._webhook:
            self._webhook.close()
            self._webhook = None
        if self._etcd_dir:
            shutil.rmtree(self._etcd_dir, ignore_errors=True)
        if self.workdir and self._own_workdir and not self.keep_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        elif self.workdir:
            log.info("control plane files kept in %s", self.workdir)
        _live.discard(self)

    def processes(self) -> dict[str, subprocess.Popen]:
        return dict(self._procs)

    # ---- users and clients -----------------------------------------------------------
    def add_token(self, user: str, groups: Iterable[str] = (), token: str | None = None, uid: str | None = None) -> str:
        """Register a bearer token for ``user`` in ``groups``; returns the token.

        Works before start (static token file) and while running (token webhook; the
        apiserver caches a review for 10s). ``system:authenticated`` is added by the
        apiserver itself."""
        token = token or secrets.token_hex(16)
        with self._tokens_lock:
            self._tokens[token] = {"user": user, "uid": uid or user, "groups": tuple(groups)}
        return token

    def kubeconfig_for(self, token: str, path: str | Path | None = None, user: str = "user") -> Path:
        """Write a kubeconfig that authenticates with ``token``; returns its path."""
        if path is None:
            path = self.workdir / "kubeconfigs" / f"{user}-{token[:8]}.kubeconfig"
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_kubeconfig(path, self.server, self.ca_path, token, user=user)
        return path

    def service_account_token(
        self, namespace: str, name: str, *, create: bool = True, seconds: int = 3600, audiences: list[str] | None = None
    ) -> str:
        """A TokenRequest token for service account ``namespace/name`` (created if missing),
        e.g. to run a process outside any pod with exactly the rights bound to that account."""
        import kubernetes.client

        core = kubernetes.client.CoreV1Api(self.api_client())
        if create:
            try:
                core.create_namespaced_service_account(namespace, {"metadata": {"name": name}})
            except kubernetes.client.ApiException as e:
                if e.status != 409:
                    raise
        spec: dict = {"expirationSeconds": seconds}
        if audiences:
            spec["audiences"] = audiences
        resp = core.create_namespaced_service_account_token(name, namespace, {"spec": spec}, _preload_content=False)
        return json.loads(resp.data)["status"]["token"]

    def api_client(self, token: str | None = None):
        """A kubernetes.client.ApiClient for the admin (or for ``token``)."""
        import kubernetes.client

        cfg = kubernetes.client.Configuration()
        cfg.host = self.server
        cfg.ssl_ca_cert = str(self.ca_path)
        cfg.verify_ssl = True
        cfg.connection_pool_maxsize = 32  # kubelets patch from one thread per pod
        cfg.api_key = {"authorization": token or self.admin_token}
        cfg.api_key_prefix = {"authorization": "Bearer"}
        client = kubernetes.client.ApiClient(cfg)
        self._clients.append(client)
        return client

    # ---- nodes and namespaces ----------------------------------------------------------
    def add_node(self, name: str, *, wait: bool = True, **kwargs) -> ProcessKubelet:
        """Start a ProcessKubelet registering Node ``name``, of the shape ``kwargs`` give (``cpu``,
        ``memory``, ``pods``, ``labels``, ...: ProcessKubelet's arguments, over ``node_defaults``); it stops with the
        control plane.

        The kubelet authenticates as ``system:node:<name>``. With ``wait`` this returns once
        the node is Ready and has no not-ready taint, i.e. schedulable."""
        from .kubelet import ProcessKubelet

        if name in self.nodes:
            raise ValueError(f"node {name} exists")
        token = self.add_token(f"system:node:{name}", ["system:nodes"])
        kubelet = ProcessKubelet(
            self.api_client(token),
            name,
            workdir=self.workdir / "kubelets" / name,
            api_host="127.0.0.1",
            api_port=self.port,
            **{**self.node_defaults, **kwargs},
        )
        kubelet.start()
        self.nodes[name] = kubelet
        if wait:
            self.wait_node_schedulable(name)
        return kubelet

    def remove_node(self, name: str, delete: bool = True) -> None:
        kubelet = self.nodes.pop(name)
        kubelet.stop()
        if delete:
            import kubernetes.client

            with contextlib.suppress(kubernetes.client.ApiException):
                kubernetes.client.CoreV1Api(self.api_client()).delete_node(name)

    def taint_node(self, name: str, key: str, value: str = "", effect: str = "NoExecute") -> None:
        """Add (or change) the taint ``key`` with ``effect`` on Node ``name`` (its taints of other effects stay). A
        NoExecute taint makes kube-controller-manager's taint-eviction controller delete the pods on the node that do
        not tolerate it (after their ``tolerationSeconds``, if any), as a spot node's coming reclaim does."""
        taint = {"key": key, **({"value": value} if value else {}), "effect": effect}
        self._patch_taints(
            name, lambda taints: [t for t in taints if (t.get("key"), t.get("effect")) != (key, effect)] + [taint]
        )

    def untaint_node(self, name: str, key: str, effect: str | None = None) -> None:
        """Remove the taint ``key`` (of ``effect`` only, or of every effect) from Node ``name``."""
        self._patch_taints(
            name, lambda taints: [t for t in taints if t.get("key") != key or effect not in (None, t.get("effect"))]
        )

    def cordon_node(self, name: str, unschedulable: bool = True) -> None:
        """Mark Node ``name`` unschedulable (``False``: uncordon), as ``kubectl cordon`` does."""
        import kubernetes.client

        kubernetes.client.CoreV1Api(self.api_client()).patch_node(name, {"spec": {"unschedulable": unschedulable}})

    def drain_node(self, name: str, timeout: float = 60.0) -> list[str]:
        """``kubectl drain``: cordon Node ``name``, then evict each of its pods through the Eviction API (which
        honours PodDisruptionBudgets: a refused eviction is retried until ``timeout``) and wait until they are gone
        from the API. Returns the evicted pods (``namespace/name``); raises ControlPlaneError naming those a budget
        kept."""
        import kubernetes.client

        core = kubernetes.client.CoreV1Api(self.api_client())
        self.cordon_node(name)
        deadline = time.monotonic() + timeout
        evicted: set[str] = set()

        def ref(p) -> str:
            return f"{p.metadata.namespace}/{p.metadata.name}"

        while True:
            on_node = core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={name}").items
            pods = [p for p in on_node if p.status.phase not in ("Succeeded", "Failed")]
            # An evicted pod's processes can be over before the kubelet has removed it from the API: as kubectl
            # drain does, wait until it is gone.
            leaving = evicted & {ref(p) for p in on_node}
            refused = []
            for p in pods:
                if p.metadata.deletion_timestamp is not None:
                    continue
                body = {
                    "apiVersion": "policy/v1",
                    "kind": "Eviction",
                    "metadata": {"name": p.metadata.name, "namespace": p.metadata.namespace},
                }
                try:
                    core.create_namespaced_pod_eviction(p.metadata.name, p.metadata.namespace, body)
                    evicted.add(ref(p))
                except kubernetes.client.ApiException as e:
                    if e.status == 429:  # a PodDisruptionBudget allows no disruption now
                        refused.append(ref(p))
                    elif e.status != 404:
                        raise
            if not pods and not leaving:
                return sorted(evicted)
            if time.monotonic() > deadline:
                raise ControlPlaneError(
                    f"drain of node {name}: not done after {timeout}s; evictions refused by a "
                    f"PodDisruptionBudget: {refused or 'none'}; still there: "
                    f"{sorted(leaving | {ref(p) for p in pods})}"
                )
            time.sleep(0.2)

    def _patch_taints(self, name: str, change) -> None:
        import kubernetes.client

        api = self.api_client()
        core = kubernetes.client.CoreV1Api(api)
        for attempt in range(20):  # optimistic concurrency: the node lifecycle controller edits taints too
            node = core.read_node(name)
            taints = [api.sanitize_for_serialization(t) for t in node.spec.taints or []]
            try:
                core.patch_node(
                    name,
                    [
                        {"op": "test", "path": "/metadata/resourceVersion", "value": node.metadata.resource_version},
                        {"op": "add", "path": "/spec/taints", "value": change(taints)},
                    ],
                )
                return
            except kubernetes.client.ApiException as e:
                if e.status not in (409, 422) or attempt == 19:
                    raise

    def wait_node_schedulable(self, name: str, timeout: float = 60.0) -> None:
        """Wait until the node is Ready and untainted. The TaintNodesByCondition admission
        gives every new node a not-ready:NoSchedule taint that the node lifecycle controller
        removes within --node-monitor-period; we remove it ourselves (the node is Ready)."""
        import kubernetes.client

        core = kubernetes.client.CoreV1Api(self.api_client())
        deadline = time.monotonic() + timeout
        while True:
            node = core.read_node(name)
            taints = node.spec.taints or []
            ready = any(c.type == "Ready" and c.status == "True" for c in (node.status.conditions or []))
            bad = [t for t in taints if t.key in ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")]
            if ready and not bad:
                return
            if ready and bad and all(t.effect == "NoSchedule" for t in bad):
                keep = [t.to_dict() for t in taints if t not in bad]
                with contextlib.suppress(kubernetes.client.ApiException):
                    core.patch_node(
                        name,
                        [
                            {
                                "op": "test",
                                "path": "/metadata/resourceVersion",
                                "value": node.metadata.resource_version,
                            },
                            {"op": "replace", "path": "/spec/taints", "value": keep},
                        ],
                    )
            if time.monotonic() > deadline:
                raise ControlPlaneError(f"node {name} not schedulable after {timeout}s: ready={ready} taints={taints}")
            time.sleep(0.2)

    def create_namespace(self, name: str, timeout: float = 60.0, pod_security: str | None = None) -> None:
        """Create a namespace and wait until pods can be created in it (its ``default``
        service account and ``kube-root-ca.crt`` exist). ``pod_security``: the Pod Security level its pods must
        pass (``restricted``, ``baseline``; the PodSecurity admission plugin enforces it), else none (privileged)."""
        import kubernetes.client

        core = kubernetes.client.CoreV1Api(self.api_client())
        labels = {POD_SECURITY_LABEL: pod_security} if pod_security else {}
        try:
            core.create_namespace({"metadata": {"name": name, "labels": labels}})
        except kubernetes.client.ApiException as e:
            if e.status != 409:
                raise
        self._wait(f"namespace {name}", lambda: self._namespace_ready(name), timeout)

    # ---- internals ---------------------------------------------------------------------
    def _spawn(self, name: str, argv: list[str]) -> None:
        lp = self.logs / f"{name}.log"
        with open(lp, "ab") as f:
            f.write(("$ " + " ".join(argv) + "\n").encode())
        self._procs[name] = popen(argv, log_path=lp, cwd=str(self.workdir))

    def _wait(self, what: str, ready, timeout: float | None = None) -> None:
        deadline = time.monotonic() + (timeout or self.start_timeout)
        delay = 0.05
        while True:
            for name, proc in self._procs.items():
                if proc.poll() is not None:
                    raise ControlPlaneError(
                        f"{name} exited with {proc.returncode} while waiting for {what}; "
                        f"log {self.logs / (name + '.log')}:\n{_tail(self.logs / (name + '.log'))}"
                    )
            try:
                if ready():
                    return
            except Exception as e:  # noqa: BLE001 - not ready yet
                last = e
            else:
                last = None
            if time.monotonic() > deadline:
                raise ControlPlaneError(
                    f"timed out after {timeout or self.start_timeout}s waiting for {what}"
                    f" (last error: {last!r}); logs in {self.logs}"
                )
            time.sleep(delay)
            delay = min(delay * 1.5, 0.5)

    def _readyz(self) -> bool:
        ctx = ssl.create_default_context(cafile=str(self.ca_path))
        req = urllib.request.Request(f"{self.server}/readyz", headers={"Authorization": f"Bearer {self.admin_token}"})
        try:
            with urllib.request.urlopen(req, context=ctx, timeout=5) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError, ssl.SSLError):
            return False

    def _namespace_ready(self, ns: str) -> bool:
        import kubernetes.client

        if not hasattr(self, "_admin_core"):
            self._admin_core = kubernetes.client.CoreV1Api(self.api_client())
        try:
            self._admin_core.read_namespaced_service_account("default", ns)
            self._admin_core.read_namespaced_config_map("kube-root-ca.crt", ns)
            return True
        except kubernetes.client.ApiException as e:
            if e.status == 404:
                return False
            raise


def _sweep_stale() -> None:
    """Remove work/etcd dirs left by control planes whose process was killed (SIGKILL leaves
    no chance to clean up; the etcd data lives in /dev/shm, i.e. memory)."""
    import re as _re

    for base in {Path(tempfile.gettempdir()), Path("/dev/shm")}:
        if not base.is_dir():
            continue
        for d in base.glob("elastic-step-*-*-*"):
            m = _re.fullmatch(r"elastic-step-(?:kube|etcd)-(\d+)-\w+", d.name)
            if not m or int(m.group(1)) == os.getpid():
                continue
            try:
                os.kill(int(m.group(1)), 0)
            except ProcessLookupError:
                shutil.rmtree(d, ignore_errors=True)
            except PermissionError:
                pass


def _token_line(token: str, u: dict) -> str:
    groups = ",".join(u["groups"])
    return f'{token},{u["user"]},{u["uid"]},"{groups}"' if groups else f"{token},{u['user']},{u['uid']}"


def _write_kubeconfig(path: Path, server: str, ca: Path, token: str | None, user: str = "user") -> None:
    user_entry: dict = {"name": user, "user": {"token": token} if token else {}}
    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "elastic-step-test",
                "cluster": {
                    "server": server,
                    "certificate-authority-data": base64.b64encode(Path(ca).read_bytes()).decode(),
                },
            }
        ],
        "users": [user_entry],
        "contexts": [{"name": "default", "context": {"cluster": "elastic-step-test", "user": user}}],
        "current-context": "default",
    }
    path.write_text(json.dumps(cfg, indent=2))
    os.chmod(path, 0o600)
