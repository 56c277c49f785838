"""float32 linear layers through oneDNN on CPU (``use_onednn_linears``).

torch's CPU build sends a float32 ``nn.Linear`` to MKL's sgemm, which runs a generic code path
on non-Intel CPUs: on the AMD EPYC we measure on it reaches ~100 GFLOP/s per core, and less as
the rows grow (a prefill chunk), where oneDNN's matmul (shipped in the same build, used by
``torch.ops.mkldnn``) reaches ~250 on the model's own weights, no copy or repacking. Both are
IEEE float32: only the order of the sums differs (~1e-6 relative), as between chunk sizes.

The swap keeps the modules' parameters (the same tensors: ``state_dict``, tied embeddings and the
fingerprint are unchanged) and is refused, leaving ``nn.Linear``, where the kernel is missing or
disagrees with ``F.linear`` on a probe.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

log = logging.getLogger("promptcache")
PROBE_TOLERANCE = 1e-4  # relative: float32 sums in another order, nothing more


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


def use_onednn_linears(model: Any) -> int:
    """Swap every plain ``nn.Linear`` of a float32 CPU model for ``OneDnnLinear`` (in place,
    idempotent; quantized or other linear kinds are left alone). Returns how many were swapped."""
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
