"""Each float32 weight in the memory order its one-row matmul streams fastest
(``choose_weight_layouts``).

A decode step multiplies one row by every weight: it is bound by how fast the weights stream
from memory. oneDNN runs ``x @ W.T`` with ``W`` stored [out, in] (PyTorch's order) as one dot
product per output, and parallelises over the outputs only when they are many: on the CPU we
measure, a 576-output projection (attention output, MLP down) ran on one of two threads, ~22 GB/s,
where the same weight stored [in, out] (a transposed view of it as the parameter) ran both,
~30 GB/s; a 3072-output one was faster as stored. It depends on the CPU and the shapes, so each
class of weights with one shape is timed both ways at load, over enough of its weights to
stream from memory rather than cache, and the faster kept. Values, shapes and state-dict keys
are unchanged (only the strides differ); results differ by float32 summation order.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from promptcache.engines.torch.fused import StackedLinear, StackedWeights
from promptcache.engines.torch.onednn import OneDnnLinear

log = logging.getLogger("promptcache")

MIN_CLASS_BYTES = 16 << 20  # a class that fits the caches is not worth a layout
TIMED_BYTES = 96 << 20  # timed over at least this much (more than a CPU's last-level cache)
MARGIN = 0.93  # transposed must take under 93% of the time: noise does not flip a layout


def weight_owners(model: Any) -> list[Any]:
    """Every object that owns a oneDNN float32 weight: a plain ``OneDnnLinear`` or the
    ``StackedWeights`` of a group; the output embedding (often tied) is left out."""
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    owners: dict[int, Any] = {}
    for module in model.modules():
        if isinstance(module, StackedLinear):
            owners.setdefault(id(module.stack), module.stack)
        elif type(module) is OneDnnLinear and module is not output:
            owners.setdefault(id(module), module)
    return list(owners.values())


def is_transposed(owner: Any) -> bool:
    weight = owner.weight
    return weight.dim() == 2 and weight.stride() == (1, weight.shape[0])


def transpose_weights(model: Any, owners: list[Any]) -> None:
    """Store each owner's weight [in, out] (its ``weight`` a transposed view: same values and
    shape); a stack's siblings get views of the new storage. One copy at a time."""
    siblings: dict[int, list[StackedLinear]] = defaultdict(list)
    for module in model.modules():
        if isinstance(module, StackedLinear):
            siblings[id(module.stack)].append(module)
    with torch.no_grad():
        for owner in owners:
            if is_transposed(owner):
                continue
            weight = owner.weight.t().contiguous().t()
            if isinstance(owner, StackedWeights):
                owner.weight = weight
                for member in siblings[id(owner)]:
                    rows = weight[member.start : member.start + member.out_features]
                    member.weight = nn.Parameter(rows, requires_grad=False)
            else:
                owner.weight = nn.Parameter(weight, requires_grad=False)


def choose_weight_layouts(
    model: Any,
    *,
    min_class_bytes: int = MIN_CLASS_BYTES,
    clock: Callable[[], float] = time.perf_counter,
) -> int:
    """Time each shape class of weights (at least ``min_class_bytes`` in all) as stored and
    transposed with a one-row input, transpose the class where that is faster. In place,
    idempotent (a class decided is not timed again); returns how many weights were transposed."""
    decided: dict[tuple[int, ...], bool] = model.__dict__.setdefault("promptcache_layouts", {})
    classes: dict[tuple[int, ...], list[Any]] = defaultdict(list)
    for owner in weight_owners(model):
        if not is_transposed(owner):
            classes[tuple(owner.weight.shape)].append(owner)
    num_transposed = 0
    for shape, owners in classes.items():
        if shape in decided:
            continue
        size = owners[0].weight.numel() * owners[0].weight.element_size()
        if size * len(owners) < min_class_bytes:
            continue
        timed = owners[: max(1, -(-TIMED_BYTES // size))]
        as_stored = [o.weight for o in timed]
        transposed = [w.t().contiguous().t() for w in as_stored]
        x = torch.randn(1, shape[1], dtype=as_stored[0].dtype, device=as_stored[0].device)
        t_stored, t_transposed = (_time_pass(x, ws, clock) for ws in (as_stored, transposed))
        del transposed
        decided[shape] = t_transposed < MARGIN * t_stored
        if decided[shape]:
            transpose_weights(model, owners)
            num_transposed += len(owners)
        log.info(
            "weights %s x%d: one-row matmul %.0f us stored, %.0f us transposed: %s",
            "x".join(map(str, shape)), len(owners), t_stored / len(timed) * 1e6,
            t_transposed / len(timed) * 1e6,
            "transposed" if decided[shape] else "as stored",
        )  # fmt: skip
    return num_transposed


@torch.inference_mode()
def _time_pass(x: torch.Tensor, weights: list[torch.Tensor], clock: Callable[[], float]) -> float:
    """Median seconds of one pass of one-row matmuls over ``weights`` (after a warm pass)."""
    seconds = []
    for _ in range(4):
        t0 = clock()
        for w in weights:
            torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
        seconds.append(clock() - t0)
    return statistics.median(seconds[1:])
