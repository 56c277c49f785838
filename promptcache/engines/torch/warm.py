"""The step shapes serving runs, once at start (``TorchRunner.warm_up_steps``).

Why: oneDNN builds a primitive for each row count a matmul runs at and keeps it (``onednn``:
64 entries, ~0.6 MB each), and a step's activations stay in the heap for the next. Built while
requests run, that memory is in no account: RSS went ~100 MB past the engine's books on a 32 MB
RAM tier and stayed there idle (``benchmarks/memory_bench.py``). Built here, before the engine
takes the process's RSS "at start" (``MemoryBooks``), it is the model's working set, as vLLM's
profile run makes it; and the first requests do not wait for the builds.

Each forward runs on a fresh throwaway state, through the path serving takes (the packed step
where the runner packs); nothing touches a cache. Their KV buffers go back to the system after.
"""

from __future__ import annotations

from typing import Any

import torch

from promptcache.engines.torch.buffers import POOL
from promptcache.engines.torch.onednn import SMALL_ROWS, padded_rows


def warm_row_counts(step_tokens: int, max_step_tokens: int) -> list[int]:
    """The token counts of the warm-up forwards: every padded count a small matmul runs at
    (decode batches), then prefill steps from the base budget to the largest, largest first
    (its activations are the heap's peak)."""
    small = sorted({padded_rows(n) for n in range(1, SMALL_ROWS + 1)})
    big = sorted({max_step_tokens, (step_tokens + max_step_tokens) // 2, step_tokens}, reverse=True)
    return big + [n for n in small if n not in big]


@torch.inference_mode()
def warm_up_steps(runner: Any, step_tokens: int, max_step_tokens: int) -> int:
    """One forward of each of ``warm_row_counts`` tokens on a fresh state of ``runner`` (a
    ``TorchRunner``; ids past its vocabulary never drawn); the number of forwards run. Call on
    a thread set up as the stepping thread is: primitives are kept per thread count."""
    limit = max(1, runner.model_limit)  # a prompt longer than the model serves never runs
    counts = [n for n in warm_row_counts(step_tokens, max_step_tokens) if n <= limit]
    vocab = max(1, runner.vocab_size)
    for n in counts:
        state = runner.new_state()
        ids = [[(7 + 31 * j) % vocab for j in range(n)]]
        if runner.packs([state]):
            runner.forward_packed([state], ids)
        else:
            runner.forward([state], ids)
    runner.reset_decode()
    POOL.release_free()  # the throwaway states' KV buffers: not the model's
    return len(counts)
