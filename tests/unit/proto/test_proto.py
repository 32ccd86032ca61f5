"""Wire protocol: the generated modules are current, and tensors survive the wire exactly."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import numpy as np
import pytest

from elastic_step.proto import elastic_pb2 as pb
from elastic_step.proto import generate, tensors

PROTO_DIR = pathlib.Path(generate.__file__).resolve().parent


def _normalised(path: pathlib.Path) -> list[str]:
    return [line.rstrip() for line in path.read_text().rstrip().splitlines()]


@pytest.mark.parametrize("name", ["elastic_pb2.py", "elastic_pb2_grpc.py"])
def test_generated_modules_are_current(tmp_path, name):
    # In a subprocess: protoc's C++ runtime in a process that already loaded TensorFlow's segfaults.
    subprocess.run([sys.executable, "-m", "elastic_step.proto.generate", str(tmp_path)], check=True)
    fresh = tmp_path / "elastic_step" / "proto" / name
    assert fresh.is_file(), f"protoc did not write {name}"
    assert _normalised(fresh) == _normalised(PROTO_DIR / name), (
        f"elastic_step/proto/{name} is stale: run `python -m elastic_step.proto.generate` and commit"
    )


# ---------------------------------------------------------------------------- tensors

DTYPES = ["float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool"]

# () first: a 0-d scalar (a scalar model variable or its gradient) must keep its shape on the wire.
SHAPES = [(), (0,), (3,), (2, 3), (4, 0, 2), (2, 1, 3, 1)]


def _sample(dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    rng = np.random.default_rng(sum(shape) + len(dtype))
    if dtype == "bool":
        return rng.integers(0, 2, size=shape).astype(bool)
    if dtype.startswith("float"):
        return rng.normal(size=shape).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_encode_decode_round_trip(dtype, shape):
    a = _sample(dtype, shape)
    t = tensors.encode(a)
    assert t.dtype == dtype and tuple(t.shape) == shape
    assert len(t.data) == a.size * a.dtype.itemsize
    # Through the real serialisation, as on the wire.
    wire = pb.Tensor.FromString(t.SerializeToString())
    b = tensors.decode(wire)
    assert b.dtype == a.dtype and b.shape == a.shape
    np.testing.assert_array_equal(b, a)


def test_zero_d_scalar_round_trips():
    t = tensors.encode(np.float32(2.5))
    assert list(t.shape) == [] and t.dtype == "float32"
    b = tensors.decode(t)
    assert b.shape == () and b == np.float32(2.5)


def test_extreme_values_round_trip_bit_exact():
    a = np.array([np.inf, -np.inf, np.nan, -0.0, np.finfo(np.float64).tiny, np.finfo(np.float64).max])
    np.testing.assert_array_equal(tensors.decode(tensors.encode(a)).view(np.uint64), a.view(np.uint64))


def test_non_contiguous_and_big_endian_inputs_are_sent_as_c_order_little_endian():
    a = np.arange(12, dtype=np.int32).reshape(3, 4)
    view = a.T[::2]  # strided, Fortran-ish
    np.testing.assert_array_equal(tensors.decode(tensors.encode(view)), view)
    big = np.arange(6, dtype=">f8").reshape(2, 3)
    t = tensors.encode(big)
    assert t.dtype == "float64"
    assert t.data == np.arange(6, dtype="<f8").tobytes()
    np.testing.assert_array_equal(tensors.decode(t), big)


def test_encode_into_an_existing_message():
    rows = pb.EmbeddingRows(name="emb")
    tensors.encode(np.ones((2, 2), np.float32), out=rows.values)
    np.testing.assert_array_equal(tensors.decode(rows.values), np.ones((2, 2), np.float32))
    # Re-encoding replaces the shape instead of appending to it.
    tensors.encode(np.zeros(3, np.int64), out=rows.values)
    assert list(rows.values.shape) == [3]
    np.testing.assert_array_equal(tensors.decode(rows.values), np.zeros(3, np.int64))


@pytest.mark.parametrize("shape, values", [((3,), 2), ((3,), 4), ((2, 2), 3), ((), 0), ((), 2), ((0,), 1), ((2, 0), 1)])
def test_decode_rejects_a_payload_that_does_not_match_the_shape(shape, values):
    t = pb.Tensor(dtype="float32", shape=shape, data=np.zeros(values, np.float32).tobytes())
    with pytest.raises(ValueError):
        tensors.decode(t)


def test_decode_rejects_a_payload_that_is_not_a_whole_number_of_values():
    t = pb.Tensor(dtype="int32", shape=[2], data=b"\x00" * 7)
    with pytest.raises(ValueError):
        tensors.decode(t)


@pytest.mark.parametrize("dtype", ["object", "O", "complex64", "str", "<U3", "V8", "float32 ", "", "int"])
def test_decode_rejects_an_unsupported_dtype(dtype):
    t = pb.Tensor(dtype=dtype, shape=[1], data=b"\x00" * 8)
    with pytest.raises(ValueError, match="unsupported dtype"):
        tensors.decode(t)


@pytest.mark.parametrize(
    "value",
    [np.array(["a", "b"]), np.array([1 + 2j]), np.array([object()]), np.array(["2024-01-01"], dtype="datetime64[D]")],
)
def test_encode_rejects_an_unsupported_dtype(value):
    with pytest.raises(TypeError):
        tensors.encode(value)
