"""The safetensors layout written straight from the arrays: an 8-byte header length, the JSON
header (padded to 8 bytes), then each tensor's bytes in header order, no gaps.

Why: ``safetensors.numpy.save`` returns one ``bytes`` built from copies of the tensors, so
every block file was copied whole in memory before a byte reached the disk. Here the header is
the only new buffer: the tensors are written from where they are (``write_parts``).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Sequence

import numpy as np

# safetensors' dtype names (little-endian, as the format requires)
DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1",
          "U64": "<u8", "U32": "<u4", "U16": "<u2", "U8": "u1", "BOOL": "?"}  # fmt: skip
_NAMES = {np.dtype(v): k for k, v in DTYPES.items()}

Part = bytes | memoryview


def encode_parts(arrays: dict[str, np.ndarray], metadata: dict[str, str]) -> list[Part]:
    """The file as parts to write in order: the header, then a view of each tensor (sorted by
    name; a non-contiguous or big-endian one is copied). Raises ValueError for a dtype the
    format has no name for."""
    header: dict[str, object] = {"__metadata__": metadata}
    views: list[Part] = []
    at = 0
    for name in sorted(arrays):
        shape = list(arrays[name].shape)  # ascontiguousarray makes a 0-d array 1-d
        arr = np.ascontiguousarray(arrays[name], dtype=arrays[name].dtype.newbyteorder("<"))
        kind = _NAMES.get(arr.dtype)
        if kind is None:
            raise ValueError(f"safetensors has no dtype for {arr.dtype} ({name!r})")
        header[name] = {
            "dtype": kind,
            "shape": shape,
            "data_offsets": [at, at + arr.nbytes],
        }
        views.append(arr.reshape(-1).data.cast("B"))
        at += arr.nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # tensors start 8-byte aligned
    return [struct.pack("<Q", len(head)) + head, *views]


def num_bytes(parts: Sequence[Part]) -> int:
    return sum(memoryview(p).nbytes for p in parts)


def write_parts(fd: int, parts: Sequence[Part]) -> None:
    """Write every part, in order, to ``fd`` (a short write goes on where it stopped)."""
    for part in parts:
        view = memoryview(part).cast("B")
        while view.nbytes:
            view = view[os.write(fd, view) :]
