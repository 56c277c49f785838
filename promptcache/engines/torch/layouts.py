"""Each float32 weight in the memory format its decode matmuls run fastest in
(``choose_weight_layouts``): as stored, transposed, or packed in oneDNN's blocked format.

A decode step multiplies one row, or one per running request, by every weight: it is bound by
how fast the weights stream from memory and by how well the kernel uses each row it reads.
oneDNN runs ``x @ W.T`` with ``W`` stored [out, in] (PyTorch's order) as one dot product per
output, and parallelises over the outputs only when they are many: on an AMD EPYC a 576-output
projection ran on one of two threads, ~22 GB/s, where the same weight stored [in, out] (a
transposed view of it as the parameter) ran both, ~30 GB/s. On a Sapphire Rapids Xeon neither
helps a batch of rows: the weights packed once into oneDNN's blocked format (what its matmul
reorders them to anyway) took 24 ms a step for 4 rows where as stored took 33-42 ms, and 34
against 43 ms for 16 (the bundled model's 425 MB of layer weights, 2 threads). It depends on the
CPU and the shapes, so each class of weights with one shape is timed in each format, at 1 and at
``BATCH_ROWS`` rows, over enough of its weights to stream from memory rather than cache; the
format with the least time relative to the fastest, summed over both, is kept where it beats
as stored by ``MARGIN``.

Transposed keeps values, shapes, state-dict keys (only strides differ). A packed weight is an
opaque oneDNN tensor (the parameter keeps its shape; a stack's siblings keep theirs on the meta
device): the runner takes the model's fingerprint before, and ``unpack_weights`` gives plain
weights back (``--compile``). Results differ by float32 summation order only.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from promptcache.engines.torch.fused import StackedLinear, StackedWeights
from promptcache.engines.torch.layout_memo import LayoutMemo, machine_key, shape_name
from promptcache.engines.torch.onednn import OneDnnLinear, onednn_linear
from promptcache.serving.memory import trim_heap, tune_malloc

log = logging.getLogger("promptcache")

MIN_CLASS_BYTES = 16 << 20  # a class that fits the caches is not worth a layout
TIMED_BYTES = 96 << 20  # timed over at least this much (more than a CPU's last-level cache)
MARGIN = 0.95  # another format must score under 95% of as stored: noise does not flip one
BATCH_ROWS = 16  # the decode batch a format is also timed at (beside one row)
PACK_ROWS = 32  # the row count oneDNN packs for (the packed format barely depends on it)
FORMATS = ("stored", "transposed", "packed")
TIMED_PASSES = 5  # per format and row count, formats in turn: the median is kept


def weight_owners(model: Any) -> list[Any]:
    """Every object that owns a oneDNN float32 weight: a plain ``OneDnnLinear`` or the
    ``StackedWeights`` of a group; the output embedding only where it is not tied to the input
    one (an embedding lookup reads the plain weight)."""
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if output is not None and not is_tied(model, output):
        output = None
    owners: dict[int, Any] = {}
    for module in model.modules():
        if isinstance(module, StackedLinear):
            owners.setdefault(id(module.stack), module.stack)
        elif type(module) is OneDnnLinear and module is not output:
            owners.setdefault(id(module), module)
    return list(owners.values())


def is_tied(model: Any, output: Any) -> bool:
    """Whether ``output`` (the output embedding) shares its weight's memory with the input
    embedding, or cannot be told apart from it."""
    found = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    weight = getattr(found, "weight", None)
    if weight is None or getattr(output, "weight", None) is None:
        return True
    if output.weight.is_mkldnn:  # packed here: it was not tied
        return False
    return bool(weight.data_ptr() == output.weight.data_ptr())


def weight_format(owner: Any) -> str:
    """The format of ``owner``'s weight: "packed" (an opaque oneDNN tensor), "transposed" (stored
    [in, out]) or "stored"."""
    weight = owner.weight
    if weight.is_mkldnn:
        return "packed"
    if weight.dim() == 2 and weight.stride() == (1, weight.shape[0]):
        return "transposed"
    return "stored"


def can_pack() -> bool:
    """This torch build can pack a float32 weight for oneDNN's matmul."""
    return torch.backends.mkldnn.is_available() and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )


def formatted(weight: torch.Tensor, fmt: str) -> torch.Tensor:
    """``weight`` (plain) in format ``fmt``: a new tensor, same values."""
    if fmt == "transposed":
        return weight.t().contiguous().t()
    if fmt == "packed":
        return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS)
    return weight.contiguous()


def set_weight_format(model: Any, owners: list[Any], fmt: str) -> None:
    """Store each owner's weight in ``fmt`` (from any format), one copy at a time; a stack's
    siblings get views of the new storage (plain), or meta placeholders of their shape (packed:
    only the stack computes)."""
    siblings: dict[int, list[StackedLinear]] = defaultdict(list)
    for module in model.modules():
        if isinstance(module, StackedLinear):
            siblings[id(module.stack)].append(module)
    with torch.no_grad():
        for owner in owners:
            if weight_format(owner) == fmt:
                continue
            plain = owner.weight.to_dense() if owner.weight.is_mkldnn else owner.weight
            weight = formatted(plain, fmt)
            del plain
            if isinstance(owner, StackedWeights):
                owner.weight = weight
                for member in siblings[id(owner)]:
                    stop = member.start + member.out_features
                    rows = (
                        torch.empty((member.out_features, weight.shape[1]), device="meta")
                        if fmt == "packed"
                        else weight[member.start : stop]
                    )
                    member.weight = nn.Parameter(rows, requires_grad=False)
            else:
                owner.weight = nn.Parameter(weight, requires_grad=False)


def unpack_weights(model: Any) -> int:
    """Give every packed weight back as a plain one (as stored); how many were packed."""
    packed = [o for o in weight_owners(model) if weight_format(o) == "packed"]
    set_weight_format(model, packed, "stored")
    model.__dict__.get("promptcache_layouts", {}).clear()
    return len(packed)


def choose_weight_layouts(
    model: Any,
    *,
    min_class_bytes: int = MIN_CLASS_BYTES,
    clock: Callable[[], float] = time.perf_counter,
    formats: tuple[str, ...] = FORMATS,
    memo_file: Path | None = None,
) -> int:
    """Time each shape class of weights (at least ``min_class_bytes`` in all) in each of
    ``formats`` at one row and at ``BATCH_ROWS``, and store the class in the format whose times,
    each relative to the fastest at its row count, sum least, where that beats as stored by
    ``MARGIN``. In place, idempotent (a class decided is not timed again); returns how many
    weights changed format. With a ``memo_file`` (``layout_memo``), a class this machine has
    timed ``VOTES`` times takes their majority untimed; a class timed votes there."""
    decided: dict[tuple[int, ...], str] = model.__dict__.setdefault("promptcache_layouts", {})
    if "packed" in formats and not can_pack():
        formats = tuple(f for f in formats if f != "packed")
    memo = LayoutMemo(memo_file, machine_key(formats)) if memo_file is not None else None
    classes: dict[tuple[int, ...], list[Any]] = defaultdict(list)
    for owner in weight_owners(model):
        if weight_format(owner) == "stored":
            classes[tuple(owner.weight.shape)].append(owner)
    num_changed = 0
    timed_now: dict[tuple[int, ...], str] = {}
    for shape, owners in classes.items():
        if shape in decided:
            continue
        size = owners[0].weight.numel() * owners[0].weight.element_size()
        if size * len(owners) < min_class_bytes:
            continue
        kept = memo.get(shape, formats) if memo is not None else None
        if kept is not None:
            decided[shape] = kept
            if kept != "stored":
                set_weight_format(model, owners, kept)
                num_changed += len(owners)
            log.info("weights %s x%d: %s (as most timed starts on this machine)",
                     shape_name(shape), len(owners), kept)  # fmt: skip
            continue
        timed = [o.weight for o in owners[: max(1, -(-TIMED_BYTES // size))]]
        if size > TIMED_BYTES:  # one weight past it (an untied output embedding): its first rows
            timed = [timed[0][: max(1, TIMED_BYTES // (size // shape[0]))]]
        seconds = _time_formats(timed, formats, shape[1], clock)
        best = [min(t[i] for t in seconds.values()) for i in range(2)]
        score = {f: sum(t[i] / best[i] for i in range(2)) for f, t in seconds.items()}
        choice = min(score, key=score.__getitem__)
        if score[choice] >= MARGIN * score["stored"]:
            choice = "stored"
        decided[shape] = timed_now[shape] = choice
        if choice != "stored":
            set_weight_format(model, owners, choice)
            num_changed += len(owners)
        log.info(
            "weights %s x%d: matmul at 1 / %d rows (us per weight) %s: %s",
            shape_name(shape), len(owners), BATCH_ROWS,
            ", ".join(f"{f} {t[0] / len(timed) * 1e6:.0f} / {t[1] / len(timed) * 1e6:.0f}"
                      for f, t in seconds.items()),
            choice,
        )  # fmt: skip
    if timed_now:
        if memo is not None:
            memo.put(timed_now)
        tune_malloc()  # as serving will (``serving.memory``): what lets the trim reach the heap
        trim_heap()  # the formats' timed copies (~0.2 GB on the bundled model) out of RSS
    return num_changed


@torch.inference_mode()
def _time_formats(
    timed: list[torch.Tensor], formats: tuple[str, ...], width: int, clock: Callable[[], float]
) -> dict[str, list[float]]:
    """Per format, the median seconds of one pass of matmuls over ``timed`` at 1 row and at
    ``BATCH_ROWS``. The formats take turns pass by pass (after a warm pass each), so a slow
    moment of the machine falls on each alike rather than on whichever ran then (a near-tie
    then went either way from process to process: 2 of 8 fresh processes chose another format
    for one class and decoded 1-2% slower)."""
    weights = {f: timed if f == "stored" else [formatted(w, f) for w in timed] for f in formats}
    inputs = [torch.randn(rows, width, dtype=torch.float32) for rows in (1, BATCH_ROWS)]
    passes: dict[tuple[str, int], list[float]] = defaultdict(list)
    for rep in range(TIMED_PASSES + 1):
        for fmt, ws in weights.items():
            for i, x in enumerate(inputs):
                t0 = clock()
                for w in ws:
                    onednn_linear(x, w, None)
                if rep:  # the first pass warms (the packed weights' first use, the caches)
                    passes[fmt, i].append(clock() - t0)
    return {f: [statistics.median(passes[f, i]) for i in range(len(inputs))] for f in formats}
