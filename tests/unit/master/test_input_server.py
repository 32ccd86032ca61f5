"""The master serves a step's local files to pods over real HTTP, read back through fsspec's own
HTTP filesystem and the worker's ShardReader, as a pod reads them."""

from __future__ import annotations

import urllib.error
import urllib.request

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from elastic_step.data.reader import ShardReader
from elastic_step.master.input_server import InputServer


@pytest.fixture
def server():
    s = InputServer("127.0.0.1").start(lambda port: f"127.0.0.1:{port}")
    yield s
    s.stop()


def get(url: str, headers: dict | None = None) -> tuple[int, bytes, dict]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {})) as r:
            return r.status, r.read(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, b"", dict(e.headers)


def test_a_shard_is_read_through_its_url_row_group_by_row_group(server, tmp_path):
    path = tmp_path / "shard-00000.parquet"
    pq.write_table(pa.table({"id": np.arange(10_000), "x": np.arange(10_000) * 0.5}), path, row_group_size=1000)
    url = server.url(str(path))
    assert url.startswith(f"http://127.0.0.1:{server.port}/") and url.endswith("/shard-00000.parquet")
    assert get(server.url(f"file://{path}"))[1] == path.read_bytes()  # a file:// URI: the same file
    reader = ShardReader(url)
    try:
        assert reader.num_rows == 10_000
        got = reader.read(2_500, 4_200)
        assert got["id"].tolist() == list(range(2_500, 4_200)) and got["x"][0] == 1_250.0
    finally:
        reader.close()


def test_ranges_as_http_defines_them(server, tmp_path):
    path = tmp_path / "model.py"
    path.write_bytes(bytes(range(256)) * 4)
    url = server.url(str(path))
    assert get(url)[:2] == (200, path.read_bytes())
    status, body, headers = get(url, {"Range": "bytes=10-19"})
    assert (status, body, headers["Content-Range"]) == (206, bytes(range(10, 20)), "bytes 10-19/1024")
    assert get(url, {"Range": "bytes=1020-"})[1] == bytes(range(252, 256))
    assert get(url, {"Range": "bytes=-3"})[1] == bytes(range(253, 256))
    assert get(url, {"Range": "bytes=2000-"})[0] == 416


def test_only_the_files_given_are_served(server, tmp_path):
    (tmp_path / "secret").write_text("not for pods")
    url = server.url(str(tmp_path / "secret"))
    assert get(url)[0] == 200
    base = url.rsplit("/", 2)[0]
    prefix = base.rsplit("/", 1)[1]
    assert get(url.replace(prefix, "x" * len(prefix)))[0] == 404  # a guessed prefix
    assert get(f"{base}/0/../../etc/passwd")[0] == 404
    assert get(f"http://127.0.0.1:{server.port}/")[0] == 404


def test_what_instances_can_open_themselves_is_left_alone(server, tmp_path):
    assert server.url("gs://bucket/train/shard-00000.parquet") == "gs://bucket/train/shard-00000.parquet"
    assert server.url("samples.digits.model") == "samples.digits.model"  # a module, not a file
    assert server.url(str(tmp_path)) == str(tmp_path)  # a folder is not served
    assert server._files == {}  # nothing to serve
