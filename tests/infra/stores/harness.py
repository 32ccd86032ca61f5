"""Real object-store servers for tests, on loopback: fake-gcs-server (the emulator gcsfs's own CI runs
against) for gs://, moto's S3 server (the one s3fs's own suite uses) for s3://.

    from tests.infra.stores.harness import GcsServer, S3Server

    with GcsServer() as gcs:                 # built by scripts/build-fake-gcs when missing
        os.environ.update(gcs.env)           # what a step's process needs to reach it
        gcs.bucket("data")                   # -> "gs://data"

S3ServerWithIam checks credentials and permissions too (fake-gcs-server checks neither).

Each server's `env` is what gcsfs / s3fs read from the environment, so the CLI, workers and PS started
as subprocesses reach the same server, as a step's pods reach a real store.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
BUILD_FAKE_GCS = REPO / "scripts" / "build-fake-gcs"


class StoreError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    name = ""
    env: dict[str, str]

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix=f"{self.name}-", suffix=".log", delete=False)
        self.proc: subprocess.Popen | None = None

    def argv(self) -> list[str]:
        raise NotImplementedError

    def ready_path(self) -> str:
        raise NotImplementedError

    def start(self) -> _Server:
        self.proc = subprocess.Popen(
            self.argv(),
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **getattr(self, "server_env", {})},
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise StoreError(f"{self.name} exited with {self.proc.returncode}: {self.tail()}")
            try:
                with urllib.request.urlopen(self.url + self.ready_path(), timeout=2):
                    return self
            except OSError:
                time.sleep(0.2)
        raise StoreError(f"{self.name} did not answer on {self.url} within 60 s: {self.tail()}")

    def tail(self) -> str:
        return Path(self.log.name).read_text(errors="replace")[-2000:]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        os.unlink(self.log.name)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def filesystem(self):
        import fsspec

        return fsspec.filesystem(self.protocol, **self.storage_options)

    def bucket(self, name: str) -> str:
        """Create a bucket; returns its URI."""
        self.filesystem().mkdir(name)
        return f"{self.protocol}://{name}"


def build_fake_gcs() -> Path:
    proc = subprocess.run([str(BUILD_FAKE_GCS)], stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise StoreError(f"{BUILD_FAKE_GCS} failed with exit code {proc.returncode}")
    return Path(proc.stdout.strip().splitlines()[-1]) / "fake-gcs-server"


class GcsServer(_Server):
    name = "fake-gcs-server"
    protocol = "gs"

    def __init__(self) -> None:
        super().__init__()
        self.binary = build_fake_gcs()
        self.env = {
            "STORAGE_EMULATOR_HOST": self.url,
            # gcsfs's experimental bucket-type lookup goes over gRPC with TLS, which an emulator on plain
            # HTTP cannot answer: 60 s of retries per file. gcsfs's own CI turns it off the same way.
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
            "GOOGLE_CLOUD_PROJECT": "elastic-step-test",
            "NO_GCE_CHECK": "true",  # not on GCE: do not wait for a metadata server
        }
        self.storage_options = {"token": "anon", "project": "elastic-step-test", "endpoint_url": self.url}

    def argv(self) -> list[str]:
        return [
            str(self.binary),
            "-scheme",
            "http",
            "-host",
            "127.0.0.1",
            "-port",
            str(self.port),
            "-backend",
            "memory",
            "-public-host",
            f"127.0.0.1:{self.port}",
            "-external-url",
            self.url,
            "-log-level",
            "warn",
        ]

    def ready_path(self) -> str:
        return "/storage/v1/b"


class S3Server(_Server):
    name = "moto-s3"
    protocol = "s3"

    def __init__(self) -> None:
        super().__init__()
        self.env = {
            "AWS_ENDPOINT_URL": self.url,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        self.storage_options = {"key": "testing", "secret": "testing", "endpoint_url": self.url}

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]

    def ready_path(self) -> str:
        return "/moto-api/"

    @contextlib.contextmanager
    def mounted(self, bucket: str):
        """The bucket as a local folder, through s3fs-fuse (Debian's `s3fs`): for a tool that only writes
        local paths, as Vertex AI's pipelines see gs:// at /gcs/ through gcsfuse. Unmounted on exit."""
        folder = tempfile.mkdtemp(prefix=f"{bucket}-mounted-")
        with tempfile.NamedTemporaryFile("w", prefix="s3fs-passwd-", delete=False) as f:
            f.write(f"{self.storage_options['key']}:{self.storage_options['secret']}\n")
        os.chmod(f.name, 0o600)
        proc = subprocess.run(
            [
                "s3fs",
                bucket,
                folder,
                "-o",
                f"url={self.url}",
                "-o",
                "use_path_request_style",
                "-o",
                "endpoint=us-east-1",
                "-o",
                f"passwd_file={f.name}",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        os.unlink(f.name)
        if proc.returncode != 0:
            raise StoreError(f"s3fs could not mount s3://{bucket} at {folder}: {proc.stderr.strip()}")
        try:
            yield folder
        finally:
            subprocess.run(["umount", folder], check=False, timeout=60)
            os.rmdir(folder)


class S3ServerWithIam(S3Server):
    """A moto S3 server that checks every request against IAM, as AWS does: unknown keys are refused
    (InvalidAccessKeyId) and a user's policy decides what it may do (AccessDenied).

    Moto enforces IAM once its first INITIAL_NO_AUTH_ACTION_COUNT requests are done: exactly the set-up
    below (a bucket, and a user allowed only to read it, with its key), so nothing after it goes unchecked.

        with S3ServerWithIam("data") as s3:
            s3.reader_env                     # the read-only user's credentials, for a step's process
    """

    name = "moto-s3-iam"
    SETUP_ACTIONS = 4
    READ_ONLY = {
        "Version": "2012-10-17",
        "Statement": [{"Effect": "Allow", "Action": ["s3:GetObject", "s3:ListBucket"], "Resource": "*"}],
    }

    def __init__(self, bucket: str) -> None:
        super().__init__()
        self.bucket_name = bucket
        self.server_env = {"INITIAL_NO_AUTH_ACTION_COUNT": str(self.SETUP_ACTIONS)}
        self.reader_env: dict[str, str] = {}

    def start(self) -> S3ServerWithIam:
        import json

        import boto3

        super().start()
        kw = {
            "endpoint_url": self.url,
            "aws_access_key_id": "testing",
            "aws_secret_access_key": "testing",
            "region_name": "us-east-1",
        }
        boto3.client("s3", **kw).create_bucket(Bucket=self.bucket_name)
        iam = boto3.client("iam", **kw)
        iam.create_user(UserName="reader")
        iam.put_user_policy(UserName="reader", PolicyName="read-only", PolicyDocument=json.dumps(self.READ_ONLY))
        key = iam.create_access_key(UserName="reader")["AccessKey"]
        self.reader_env = {
            **self.env,
            "AWS_ACCESS_KEY_ID": key["AccessKeyId"],
            "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"],
        }
        return self
