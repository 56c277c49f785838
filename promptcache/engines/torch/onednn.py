"""float32 linear layers through oneDNN on CPU (``use_onednn_linears``).

torch's CPU build sends a float32 ``nn.Linear`` to MKL's sgemm, which runs a generic code path
on non-Intel CPUs: on the AMD EPYC we measure on it reaches ~100 GFLOP/s per core, and less as
the rows grow (a prefill chunk), where oneDNN's matmul (shipped in the same build, used by
``torch.ops.mkldnn``) reaches ~250 on the model's own weights, no copy or repacking. Both are
IEEE float32: only the order of the sums differs (~1e-6 relative), as between chunk sizes.

oneDNN builds a primitive per weight shape and row count (each decode batch size, each prefill
piece's length): ~1-1.7 ms to build, ~0.6 MB of heap kept (with torch's ideep layer's own
entry). It keeps up to 1,024 by default: after 32 concurrent sessions ~170 MB that no trim gives
back. So a matmul of up to ``SMALL_ROWS`` rows runs at a few row counts (``padded_rows``: zero rows
appended, memory-bound there, so nearly free), whose primitives stay built, and
``bound_primitive_cache`` lowers both caches to ``PRIMITIVE_CACHE_CAPACITY``
(``ONEDNN_PRIMITIVE_CACHE_CAPACITY``, ``LRU_CACHE_CAPACITY``) where the user has not set them: a
longer prefill piece may rebuild its primitives, a millisecond beside its step.

The swap keeps the modules' parameters (the same tensors: ``state_dict``, tied embeddings and the
fingerprint are unchanged) and is refused, leaving ``nn.Linear``, where the kernel is missing or
disagrees with ``F.linear`` on a probe.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch import nn

log = logging.getLogger("promptcache")
PROBE_TOLERANCE = 1e-4  # relative: float32 sums in another order, nothing more
# the padded row counts (11) for a model's few weight shapes (~5), and room for prefill pieces
PRIMITIVE_CACHE_CAPACITY = 64
SMALL_ROWS = 64  # up to this a matmul reads its weights more than it computes


def padded_rows(rows: int) -> int:
    """The row count a matmul of ``rows`` rows runs at: a power of two up to 8, a multiple of
    8 up to ``SMALL_ROWS``, ``rows`` itself past that."""
    if rows <= 8:
        return 1 << (rows - 1).bit_length() if rows > 1 else rows
    return -(-rows // 8) * 8 if rows <= SMALL_ROWS else rows


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` by oneDNN, at ``padded_rows`` rows (the extra rows are
    zeros, their outputs dropped: each row's sums are its own)."""
    width = x.shape[-1]
    rows = x.numel() // width if width else 0
    padded = padded_rows(rows)
    if padded == rows:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    buf = x.new_zeros((padded, width))
    buf[:rows] = x.reshape(rows, width)
    out = torch.ops.mkldnn._linear_pointwise(buf, weight, bias, "none", [], "")
    return out[:rows].view(*x.shape[:-1], out.shape[-1])


class OneDnnLinear(nn.Linear):
    """An ``nn.Linear`` (same parameters, same state-dict keys) computed by oneDNN."""

    def __init__(self, linear: nn.Linear) -> None:
        nn.Module.__init__(self)  # not nn.Linear's: it would allocate fresh weights
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return onednn_linear(x, self.weight, self.bias)


def can_use_onednn(model: Any) -> bool:
    """A float32 model on CPU, a torch with oneDNN's linear op, agreeing with F.linear."""
    try:
        param = next(model.parameters())
    except (StopIteration, AttributeError):
        return False
    if param.device.type != "cpu" or param.dtype != torch.float32:
        return False
    if not torch.backends.mkldnn.is_available() or not hasattr(
        torch.ops.mkldnn, "_linear_pointwise"
    ):
        return False
    gen = torch.Generator().manual_seed(0)
    w, b, x = (torch.randn(s, generator=gen) for s in ((48, 40), (48,), (3, 7, 40)))
    try:
        with torch.inference_mode():
            got = torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
            want = nn.functional.linear(x, w, b)
    except (RuntimeError, NotImplementedError) as exc:  # a build without the kernel
        log.info("oneDNN linear unavailable (%s): float32 linears stay on torch's default", exc)
        return False
    return bool(torch.allclose(got, want, rtol=PROBE_TOLERANCE, atol=PROBE_TOLERANCE))


def bound_primitive_cache() -> None:
    """Set oneDNN's and ideep's cache capacities where the user has not. Each is read once,
    at the process's first primitive: a no-op after that (safe to call again)."""
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        if not os.environ.get(name):
            os.environ[name] = str(PRIMITIVE_CACHE_CAPACITY)


def use_onednn_linears(model: Any) -> int:
    """Swap every plain ``nn.Linear`` of a float32 CPU model for ``OneDnnLinear`` (in place,
    idempotent; quantized or other linear kinds are left alone). Returns how many were swapped."""
    bound_primitive_cache()  # before the probe builds what may be the process's first primitive
    if not can_use_onednn(model):
        return 0
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
    ]
    for parent, name, child in swaps:
        setattr(parent, name, OneDnnLinear(child))
    return len(swaps)
