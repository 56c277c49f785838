"""The model runner: one loaded model of one library and the model steps on its cache objects.

A runner knows nothing of requests, the prompt cache's protocol or scheduling: it loads weights,
says what identifies them (the fingerprint), and runs, slices, checkpoints, restores and crops
per-request model state (``state``, the library's own cache object). ``torch_runner`` and
``mlx_runner`` implement it; ``CachedEngine`` is built on one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from promptcache.core.codec import PayloadCodec
from promptcache.core.figures import Snapshot
from promptcache.serving.block_scheme import BlockPacker
from promptcache.serving.layers import Layout


class ModelRunner(Protocol):
    """Contract: every method but ``forward`` is cheap bookkeeping or a copy; none is
    thread-safe (the scheduler runs one step at a time). Payloads and checkpoints are owning
    copies: the cache keeps them while ``state`` goes on changing."""

    name: str  # the library ("torch", "mlx"): part of the fingerprint
    model: Any
    tokenizer: Any
    fingerprint: str  # what identifies the weights, dtype and cache format in cache keys
    layout: Layout  # which layers are positional and which are snapshot state
    model_limit: int  # the context the loaded weights serve (RoPE scaling applied)
    eos_ids: set[int]
    vocab_size: int  # token ids are in [0, vocab_size)
    rope_scaling: dict[str, Any] | None  # the YaRN settings applied at load, or None

    @property
    def packer(self) -> BlockPacker | None:
        """How positional blocks are stored at rest (``block_scheme``; None: as they are)."""

    def new_state(self, num_positions: int = 0) -> Any:
        """An empty per-request model cache. ``num_positions``: how many it will hold at least
        (the prompt), a hint a runner may size buffers by up front; 0 for none."""

    def forward(self, states: Sequence[Any], ids: Sequence[Sequence[int]]) -> list[Any]:
        """Run ``ids[i]`` through the model on top of ``states[i]`` (appending to it), for every
        sequence i; each sequence's last-position logits. The sequences are independent: a runner
        may batch them or loop over them, with the same results (batched logits may differ in
        the last float bits: padded attention reduces in another order)."""

    def batches_decode(self, states: Sequence[Any]) -> bool:
        """True when ``forward`` runs one-token steps on these states in one batched forward
        (else it loops over them: same results, no batching gain)."""

    def slice_block(self, state: Any, start: int, end: int) -> Any:
        """An owning copy of the positional state for positions [start, end)."""

    def take_checkpoint(self, state: Any) -> Any:
        """A copy of the snapshot state at the current position; None without snapshot layers."""

    def restore(
        self, segments: list[tuple[Any, int]], checkpoint: Any, num_positions: int = 0
    ) -> Any:
        """A fresh state holding a hit: block payloads (with tokens used) and the checkpoint;
        ``num_positions`` as for ``new_state``."""

    def crop(self, state: Any, length: int) -> None:
        """Cut the positional state back to ``length`` (only called without snapshot layers)."""

    def compact(self, state: Any) -> Any:
        """``state`` holding only its own positions (a decode batch's row copied out of the
        batch buffer), for a state kept after its request ended; may return ``state`` itself."""

    def held_bytes(self, states: Sequence[Any]) -> int:
        """Bytes of model state ``states`` keep alive, with the runner's own decode buffers:
        each distinct buffer once, whole (a view of a batch buffer holds all of it)."""

    def to_numpy(self, logits: Any) -> np.ndarray:
        """One sequence's logits as float32 numpy (for sampling and grammar masks)."""

    def codec(self) -> PayloadCodec:
        """How this runner's payloads travel to block files."""


@runtime_checkable
class PackedRunner(Protocol):
    """An optional capability of a runner (checked by protocol, never by class): several
    sequences' new tokens in one forward whatever their lengths (prefill pieces of several
    requests, and decode tokens beside them), so the weights are read once for all of them.
    ``forward`` runs a mix of lengths one sequence at a time."""

    def packs(self, states: Sequence[Any]) -> bool:
        """True when ``forward_packed`` runs these states together (else ``forward``)."""

    def forward_packed(self, states: Sequence[Any], ids: Sequence[Sequence[int]]) -> list[Any]:
        """What ``forward(states, ids)`` returns (each sequence's last-position logits, every
        state appended to), in one forward; results within float noise of ``forward``'s. A
        failure may leave any of the states part-written: their requests fail together."""


@runtime_checkable
class WarmsUp(Protocol):
    """An optional capability of a runner (checked by protocol): the step shapes serving runs,
    once before the first request, so what the kernels keep per shape and a step's buffers are
    part of the process "at start" (``MemoryBooks``) and the first requests do not build them."""

    def warm_up_steps(self, step_tokens: int, max_step_tokens: int) -> int:
        """Forwards on throwaway states at the token counts steps of ``step_tokens`` up to
        ``max_step_tokens`` run (and decode batches); the number run. Touches no cache; leaves
        no state behind. Call on a thread set up as the stepping thread."""


@runtime_checkable
class DeviceMemory(Protocol):
    """An optional capability of a runner (checked by protocol) whose model state may live
    outside host RAM (a GPU): what the device has left, for the default cap on the running
    requests' state (``memory_books.default_live_cap``)."""

    def device_free_bytes(self) -> int | None:
        """Bytes the device can still give this process's tensors (free, and kept by the
        library's allocator unused); None where the state is in host RAM."""


@runtime_checkable
class FixedState(Protocol):
    """An optional capability of a runner whose states hold some that does not grow with the
    context (SSM / linear-attention state): admission counts it per request, not per token
    (``admission.Admission``)."""

    def fixed_bytes(self, state: Any) -> int:
        """Bytes of ``state`` that stay the same whatever its length (its own, not a batch
        buffer's it may view)."""


@runtime_checkable
class ComputeFigures(Protocol):
    """An optional capability of a runner: how its forwards use the machine (the ``compute``
    family of ``/v1/cache/stats`` and ``/metrics``), so a slow step can be told from a step
    that gave a core up to another process."""

    def compute_stats(self) -> Snapshot:
        """Counts taken now; cheap (no forward, no lock held long)."""
