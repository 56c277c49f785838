"""float32 linear layers through oneDNN on CPU (``use_onednn_linears``).

torch's CPU build sends a float32 ``nn.Linear`` to MKL's sgemm, which runs a generic code path
on non-Intel CPUs: on the AMD EPYC we measure on it reaches ~100 GFLOP/s per core, and less as
the rows grow (a prefill chunk), where oneDNN's matmul (shipped in the same build, used by
``torch.ops.mkldnn``) reaches ~250 on the model's own weights, no copy or repacking. Both are
IEEE float32: only the order of the sums differs (~1e-6 relative), as between chunk sizes.

oneDNN keeps every primitive it builds, one per weight shape and row count (each decode batch
size, each prefill piece's length), up to 1,024 by default, and torch's ideep layer keeps as many
of its own per-shape computations: after 32 concurrent sessions the primitives held ~170 MB that
no trim gives back. ``bound_primitive_cache`` lowers both to ``PRIMITIVE_CACHE_CAPACITY``
(``ONEDNN_PRIMITIVE_CACHE_CAPACITY``, ``LRU_CACHE_CAPACITY``) where the user has not set them.

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
# a rebuilt primitive costs ~0.1 ms beside a 20-60 ms step; 128 hold a decode batch's
# every row count for a model's few distinct weight shapes (memory_bench: +~130 MB, not +270)
PRIMITIVE_CACHE_CAPACITY = 128


class OneDnnLinear(nn.Linear):
    """An ``nn.Linear`` (same parameters, same state-dict keys) computed by oneDNN."""

    def __init__(self, linear: nn.Linear) -> None:
        nn.Module.__init__(self)  # not nn.Linear's: it would allocate fresh weights
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


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
