"""Regenerate elastic_pb2.py / elastic_pb2_grpc.py from elastic.proto (needs grpcio-tools)."""

from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROTO = "elastic_step/proto/elastic.proto"


def generate(out_dir: pathlib.Path = ROOT) -> None:
    import grpc_tools
    from grpc_tools import protoc  # only a test/dev dependency

    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    rc = protoc.main(
        [
            "protoc",
            f"-I{ROOT}",
            f"-I{include}",
            f"--python_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(ROOT / PROTO),
        ]
    )
    if rc != 0:
        raise SystemExit(f"protoc failed on {PROTO} (exit {rc})")


if __name__ == "__main__":
    generate(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
