"""Group-wise affine quantization of torch K/V blocks (``BlockPacker`` for the torch engine).

Per group of ``group`` values along the last (head) dimension:

- 8-bit is symmetric: one float16 scale (the group's largest magnitude / 127, rounded up), the
  values as int8 levels in [-127, 127]: 8.25 bits per value at group 64, so 1.94x the blocks of
  16-bit storage (an affine scale + minimum would cost 8.5 bits: 1.88x).
- 4-bit is affine: a float16 scale and minimum, two levels in [0, 15] per byte (4.5 bits); at
  4 bits a minimum halves the error of groups that are not centred on zero.

Scales are rounded up (and the minimum down) before the levels are computed from the rounded
values, so every value is within half a step (``scale / 2``) of its dequantized value and no
level is clipped. Groups whose range float16 cannot hold keep float32 scales (``scale``'s dtype).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from promptcache.serving.block_scheme import ArrayPacker, BlockScheme

_F16_SAFE = 60000.0  # below float16's max (65504) with room for the rounding nudges


def effective_group(dim: int, group: int) -> int:
    """``group`` when it divides the head dimension, else the largest even divisor of ``dim``
    not above it (a head of 16 with group 64 uses groups of 16)."""
    if dim % group == 0:
        return group
    g = math.gcd(dim, group)
    return g if g % 2 == 0 else dim


def _round_up(scale: torch.Tensor, sdtype: torch.dtype) -> torch.Tensor:
    """``scale`` in ``sdtype``, never below the float32 value (so no level clips)."""
    scale_s = scale.to(sdtype)
    up = scale_s.new_tensor(math.inf)
    return torch.where(scale_s.float() < scale, torch.nextafter(scale_s, up), scale_s)


def quantize(x: torch.Tensor, bits: int, group: int) -> dict[str, Any]:
    """``x`` (any float dtype, last dim divisible into even groups) -> stored dict."""
    dim = x.shape[-1]
    g = effective_group(dim, group)
    xg = x.float().reshape(*x.shape[:-1], dim // g, g)
    out: dict[str, Any] = {"bits": bits, "dtype": str(x.dtype).removeprefix("torch.")}
    if bits == 8:
        peak = xg.abs().amax(-1, keepdim=True)
        sdtype = (
            torch.float16 if (x.numel() == 0 or bool(peak.max() < _F16_SAFE)) else torch.float32
        )
        scale_s = _round_up((peak / 127).clamp_min(1e-8), sdtype)
        q = (xg / scale_s.float()).round_().clamp_(-127, 127).to(torch.int8)
        out.update(q=q, scale=scale_s)
        return out
    levels = (1 << bits) - 1
    lo = xg.amin(-1, keepdim=True)
    hi = xg.amax(-1, keepdim=True)
    small = bool(torch.maximum(lo.abs(), hi.abs()).max() < _F16_SAFE) if x.numel() else True
    sdtype = torch.float16 if small else torch.float32
    lo_s = lo.to(sdtype)
    lo_s = torch.where(lo_s.float() > lo, torch.nextafter(lo_s, lo_s.new_tensor(-math.inf)), lo_s)
    lo_f = lo_s.float()
    scale_s = _round_up(((hi - lo_f) / levels).clamp_min(1e-6), sdtype)
    q = ((xg - lo_f) / scale_s.float()).round_().clamp_(0, levels).to(torch.uint8)
    if bits == 4:
        q = q[..., 0::2] | (q[..., 1::2] << 4)
    out.update(q=q, scale=scale_s, min=lo_s)
    return out


def dequantize(d: dict[str, Any]) -> torch.Tensor:
    """A stored dict back to an array of its original dtype. A dict without ``min`` is symmetric
    (int8 levels); one with ``min`` is affine (8-bit files of earlier versions are, too)."""
    q = d["q"]
    if d["bits"] == 4:
        q = torch.stack([q & 0x0F, q >> 4], dim=-1).flatten(-2)
    x = q.float() * d["scale"].float()
    if "min" in d:
        x = x + d["min"].float()
    return x.flatten(-2).to(getattr(torch, d["dtype"]))


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


class TorchPacker(ArrayPacker):
    """``BlockPacker`` on torch tensors (see ``block_scheme``)."""

    def __init__(
        self, scheme: BlockScheme, device: torch.device | str = "cpu", dtype: Any = torch.float32
    ) -> None:
        super().__init__(scheme, dtype)
        self.device = torch.device(device)

    def nbytes(self, x: torch.Tensor) -> int:
        return _nbytes(x)

    def is_array(self, x: Any) -> bool:
        return torch.is_tensor(x)

    def is_float32(self, x: torch.Tensor) -> bool:
        return x.dtype == torch.float32

    def quantize(self, x: torch.Tensor) -> dict[str, Any] | None:
        if not x.is_floating_point() or x.shape[-1] % 2:
            return None
        return quantize(x, self.scheme.bits or 8, self.scheme.group)

    def dequantize(self, stored: dict[str, Any]) -> torch.Tensor:
        return dequantize(stored).to(self.device)

    def narrow(self, x: torch.Tensor, dtype: str) -> torch.Tensor:
        return x.to(getattr(torch, dtype))

    def widen(self, stored: torch.Tensor) -> torch.Tensor:
        if stored.is_floating_point() and stored.dtype != self.dtype:  # stored as bfloat16
            return stored.to(self.dtype)
        return stored
