"""The step's local inputs, served to instances that do not share its filesystem.

A KFP or Argo step gets its inputs as local files: the prepared data is an artifact unpacked into
the step's pod, the model file may be one too. Worker pods run elsewhere and cannot open those
paths, so the master serves exactly those files, read-only, over HTTP on its pod IP, and leases
name them by URL (fsspec reads ``http://`` with Range requests: a Parquet footer, then a row
group's column chunks). As with a presigned URL, each URL holds an unguessable prefix, made anew
by every master: a file is readable by whoever was given its URL and by no one else. Files on an
object store (gs://, s3://) are not served: instances read them directly.
"""

from __future__ import annotations

import os
import re
import secrets
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import quote

from elastic_step.util.uri import local_path

_RANGE = re.compile(r"bytes=(\d*)-(\d*)$")
CHUNK = 1 << 20


class InputServer:
    """Serves the local files among ``uris`` at URLs under ``address`` (``host:port`` as instances
    reach the master; the port is given by ``start``)."""

    def __init__(self, bind_host: str = "0.0.0.0"):
        self._prefix = secrets.token_urlsafe(24)
        self._files: dict[str, str] = {}  # URL path -> local file
        self._urls: dict[str, str] = {}  # URI as the job names it -> URL path
        self._base = ""
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer((bind_host, 0), _handler(self._lookup))
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self._thread: threading.Thread | None = None

    def start(self, address: Callable[[int], str]) -> InputServer:
        """Serve from now on; ``address(port)`` is ``host:port`` as instances reach the master."""
        self._base = f"http://{address(self.port)}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.1,), name="input-server", daemon=True)
        self._thread.start()
        return self

    def url(self, uri: str) -> str:
        """What an instance opens for ``uri``: its URL if ``uri`` is a local file, else ``uri``. Called for
        every lease: a URI already served is a dict lookup, not a stat."""
        with self._lock:
            rel = self._urls.get(uri)
        if rel is not None:
            return self._base + rel
        path = local_path(uri)
        if path is None or not os.path.isfile(path):
            return uri
        with self._lock:
            rel = self._urls.get(uri)
            if rel is None:
                rel = self._urls[uri] = f"/{self._prefix}/{len(self._urls)}/{quote(os.path.basename(path))}"
                self._files[rel] = os.path.abspath(path)
        return self._base + rel

    def _lookup(self, rel: str) -> str | None:
        with self._lock:
            return self._files.get(rel)

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def _handler(lookup: Callable[[str], str | None]):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: a worker reads many ranges of one shard

        def do_HEAD(self):
            self._serve(body=False)

        def do_GET(self):
            self._serve(body=True)

        def _serve(self, body: bool) -> None:
            path = lookup(self.path.split("?", 1)[0])
            if path is None:
                return self._empty(404)
            try:
                f = open(path, "rb")
            except OSError:
                return self._empty(404)
            with f:
                size = os.fstat(f.fileno()).st_size
                lo, hi, status = 0, size, 200
                m = _RANGE.match(self.headers.get("Range", "").strip())
                if m and (m.group(1) or m.group(2)):
                    if m.group(1):
                        lo = int(m.group(1))
                        hi = min(size, int(m.group(2)) + 1) if m.group(2) else size
                    else:  # bytes=-n: the last n bytes
                        lo = max(0, size - int(m.group(2)))
                    if lo >= hi:
                        self.send_response(416)
                        self.send_header("Content-Range", f"bytes */{size}")
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    status = 206
                self.send_response(status)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("Content-Length", str(hi - lo))
                if status == 206:
                    self.send_header("Content-Range", f"bytes {lo}-{hi - 1}/{size}")
                self.end_headers()
                if body:
                    f.seek(lo)
                    left = hi - lo
                    while left > 0:
                        chunk = f.read(min(CHUNK, left))
                        if not chunk:
                            break
                        self.wfile.write(chunk)
                        left -= len(chunk)

        def _empty(self, status: int) -> None:
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, fmt, *args):  # a request per read: too many for the step's log
            pass

    return Handler
