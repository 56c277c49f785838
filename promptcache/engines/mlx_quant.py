"""MLX K/V blocks at rest through ``mx.quantize``/``mx.dequantize`` (``BlockPacker`` for mlx).

``mx.quantize`` takes groups of 32, 64 or 128 along the last axis; an array whose head dimension
has none of those (up to the requested group) is stored unquantized. ``mx.quantize`` anchors a
group's bias at its larger-magnitude end, so its error reaches one step (torch's quantizer: half a
step). A float32 model's scales and biases are stored as float16 (as torch's are): the capacity
targets need their half-size; their rounding adds up to ``2**bits * 2**-11`` steps (measured:
8-bit max error 0.996 -> 1.10 steps, 4-bit 0.937 -> 0.939). Arrays that are not floating point
(an ``--kv-bits`` live cache's packed words) are never re-quantized.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from promptcache.engines.block_scheme import BlockScheme, PackStats

MLX_GROUPS = (128, 64, 32)
_FLOATS = (mx.float32, mx.float16, mx.bfloat16)


def mlx_group(dim: int, group: int) -> int | None:
    """The largest group ``mx.quantize`` takes that divides ``dim`` and is at most ``group``."""
    return next((g for g in MLX_GROUPS if g <= group and dim % g == 0), None)


def _nbytes(x: mx.array) -> int:
    return int(x.size) * x.dtype.size


class MlxPacker:
    """``BlockPacker`` on MLX arrays (see ``block_scheme``)."""

    def __init__(self, scheme: BlockScheme, dtype: Any = mx.float32) -> None:
        self.scheme = scheme
        self.stats = PackStats()
        self.dtype = dtype  # the model's: blocks stored narrower come back in it

    def pack(self, block: Any, start: int) -> Any:
        if isinstance(block, tuple):
            out: Any = tuple(self._pack_one(b, start) for b in block)
        else:
            out = self._pack_one(block, start)
        mx.eval(out)  # the slice's copy is already evaluated: keep no lazy graph in the cache
        return out

    def _pack_one(self, x: mx.array, start: int) -> Any:
        s = self.scheme
        stored: Any = x
        size = _nbytes(x)
        group = mlx_group(x.shape[-1], s.group)
        if s.quantizes(start) and x.dtype in _FLOATS and group is not None:
            wq, scales, biases = mx.quantize(x, group_size=group, bits=s.bits or 8)
            sdtype = mx.float16 if x.dtype == mx.float32 else x.dtype
            stored = {
                "q": wq,
                "scale": scales.astype(sdtype),
                "bias": biases.astype(sdtype),
                "bits": s.bits or 8,
                "group": group,
                "dtype": str(x.dtype).removeprefix("mlx.core."),
            }
            size = sum(_nbytes(v) for v in stored.values() if isinstance(v, mx.array))
        elif s.dtype is not None and x.dtype == mx.float32:
            stored = x.astype(getattr(mx, s.dtype))
            size = _nbytes(stored)
        self.stats.add(_nbytes(x), size)
        return stored

    def unpack(self, stored: Any) -> Any:
        if isinstance(stored, tuple):
            return tuple(self.unpack(s) for s in stored)
        if isinstance(stored, dict):
            dtype = getattr(mx, stored["dtype"])
            return mx.dequantize(
                stored["q"],
                stored["scale"].astype(dtype),
                stored["bias"].astype(dtype),
                group_size=stored["group"],
                bits=stored["bits"],
            ).astype(dtype)
        if stored.dtype in _FLOATS and stored.dtype != self.dtype:  # stored as bfloat16
            return stored.astype(self.dtype)
        return stored
