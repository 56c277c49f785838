"""MLX K/V blocks at rest (``BlockPacker`` for mlx).

8-bit is symmetric, as torch's (``torch_quant``): one scale per group (largest magnitude / 127,
rounded up), int8 levels, every value within half a step; 8.25 bits per value at group 64.
4-bit goes through ``mx.quantize``/``mx.dequantize`` (affine: scale + bias, 4.5 bits), which
anchors a group's bias at its larger-magnitude end, so its error reaches one step (measured
0.937 -> 0.939 with float16 scales). Groups are 32, 64 or 128 values along the last axis (what
``mx.quantize`` takes); an array whose head dimension has none of those (up to the requested
group) is stored unquantized. A float32 model's scales and biases are stored as float16 (as
torch's are). Arrays that are not floating point (an ``--kv-bits`` live cache's packed words)
are never re-quantized.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from promptcache.serving.block_scheme import ArrayPacker, BlockScheme

MLX_GROUPS = (128, 64, 32)
_FLOATS = (mx.float32, mx.float16, mx.bfloat16)


def mlx_group(dim: int, group: int) -> int | None:
    """The largest group ``mx.quantize`` takes that divides ``dim`` and is at most ``group``."""
    return next((g for g in MLX_GROUPS if g <= group and dim % g == 0), None)


def _nbytes(x: mx.array) -> int:
    return int(x.size) * x.dtype.size


class MlxPacker(ArrayPacker):
    """``BlockPacker`` on MLX arrays (see ``block_scheme``)."""

    def __init__(self, scheme: BlockScheme, dtype: Any = mx.float32) -> None:
        super().__init__(scheme, dtype)

    def pack(self, block: Any, start: int) -> Any:
        out = super().pack(block, start)
        mx.eval(out)  # the slice's copy is already evaluated: keep no lazy graph in the cache
        return out

    def nbytes(self, x: mx.array) -> int:
        return _nbytes(x)

    def is_array(self, x: Any) -> bool:
        return isinstance(x, mx.array)

    def is_float32(self, x: mx.array) -> bool:
        return x.dtype == mx.float32

    def quantize(self, x: mx.array) -> dict[str, Any] | None:
        group = mlx_group(x.shape[-1], self.scheme.group)
        if x.dtype not in _FLOATS or group is None:
            return None
        if self.scheme.bits == 8:
            return _quantize_int8(x, group)
        return _quantize_affine(x, group, self.scheme.bits or 4)

    def dequantize(self, stored: dict[str, Any]) -> mx.array:
        dtype = getattr(mx, stored["dtype"])
        if "bias" not in stored:
            return _dequantize_int8(stored, dtype)
        return mx.dequantize(
            stored["q"],
            stored["scale"].astype(dtype),
            stored["bias"].astype(dtype),
            group_size=stored["group"],
            bits=stored["bits"],
        ).astype(dtype)

    def narrow(self, x: mx.array, dtype: str) -> mx.array:
        return x.astype(getattr(mx, dtype))

    def widen(self, stored: mx.array) -> mx.array:
        if stored.dtype in _FLOATS and stored.dtype != self.dtype:  # stored as bfloat16
            return stored.astype(self.dtype)
        return stored


def _scale_dtype(x: mx.array) -> Any:
    return mx.float16 if x.dtype == mx.float32 else x.dtype


def _quantize_int8(x: mx.array, group: int) -> dict[str, Any]:
    xg = x.astype(mx.float32).reshape(*x.shape[:-1], x.shape[-1] // group, group)
    scale = mx.maximum(mx.abs(xg).max(axis=-1, keepdims=True) / 127, 1e-8)
    sdtype = _scale_dtype(x)
    scale_s = scale.astype(sdtype)
    # round the stored scale up so no level clips (a float16 scale may round below the value)
    low = scale_s.astype(mx.float32) < scale
    scale_s = mx.where(low, (scale * (1 + 2**-10)).astype(sdtype), scale_s)
    q = mx.clip(mx.round(xg / scale_s.astype(mx.float32)), -127, 127).astype(mx.int8)
    return {"q": q, "scale": scale_s, "bits": 8, "group": group, "dtype": _dtype_name(x)}


def _dequantize_int8(stored: dict[str, Any], dtype: Any) -> mx.array:
    x = stored["q"].astype(mx.float32) * stored["scale"].astype(mx.float32)
    return x.reshape(*x.shape[:-2], -1).astype(dtype)


def _dtype_name(x: mx.array) -> str:
    return str(x.dtype).removeprefix("mlx.core.")


def _quantize_affine(x: mx.array, group: int, bits: int) -> dict[str, Any]:
    wq, scales, biases = mx.quantize(x, group_size=group, bits=bits)
    sdtype = _scale_dtype(x)
    return {
        "q": wq,
        "scale": scales.astype(sdtype),
        "bias": biases.astype(sdtype),
        "bits": bits,
        "group": group,
        "dtype": _dtype_name(x),
    }
