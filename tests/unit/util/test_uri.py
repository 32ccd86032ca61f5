"""util/uri.py: what a URI names."""

from elastic_step.util.uri import local_path


def test_local_paths_and_uris():
    assert local_path("/data/x") == "/data/x" and local_path("file:///data/x") == "/data/x"
    assert local_path("gs://b/x") is None and local_path("memory://x") is None
