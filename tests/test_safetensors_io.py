"""Block files written from views of the arrays (``safetensors_io``) are real safetensors:
the official library reads back every tensor, with its dtype and shape, and the metadata."""

import os

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load

from promptcache.core.safetensors_io import encode_parts, num_bytes, write_parts


def arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "k": rng.standard_normal((2, 3, 16, 8)).astype(np.float32),
        "half": rng.standard_normal((4, 5)).astype(np.float16),
        "strided": np.arange(40, dtype=np.int32).reshape(5, 8)[:, ::2],  # not contiguous
        "big_endian": np.arange(6, dtype=">i8"),
        "scalar": np.array(2.5, dtype=np.float64),
        "empty": np.zeros((0, 4), dtype=np.uint8),
        "mask": np.array([True, False, True]),
    }


def test_parts_are_a_safetensors_file_the_library_reads_back(tmp_path):
    want = arrays()
    parts = encode_parts(want, {"format": "x", "n": "3"})
    path = tmp_path / "a.safetensors"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        write_parts(fd, parts)
    finally:
        os.close(fd)
    assert path.stat().st_size == num_bytes(parts)
    got = load(path.read_bytes())
    assert set(got) == set(want)
    for name, arr in want.items():
        assert got[name].shape == arr.shape, name
        assert np.array_equal(got[name], arr), name
    with safe_open(path, "np") as f:
        assert f.metadata() == {"format": "x", "n": "3"}
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    assert header_len % 8 == 0  # tensors start aligned


def test_a_contiguous_array_is_written_from_where_it_is_not_copied():
    arr = np.arange(1024, dtype=np.float32)
    parts = encode_parts({"a": arr}, {})
    assert len(parts) == 2
    view = np.frombuffer(parts[1], dtype=np.float32)
    assert np.shares_memory(view, arr)


def test_a_dtype_without_a_safetensors_name_is_refused():
    with pytest.raises(ValueError, match="complex"):
        encode_parts({"c": np.zeros(2, dtype=np.complex64)}, {})
