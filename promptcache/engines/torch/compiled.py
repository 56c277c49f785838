"""Opt-in ``torch.compile`` of the decode step (``--compile``, torch engine).

At 135M parameters a CPU decode step is mostly per-op cost: ~30 layers of a dozen small ops,
each a Python module call and an eager dispatch. Inductor fuses the elementwise work (norms,
RoPE, residuals, activations, the bfloat16 casts of ``--weights``) into C++ kernels and runs
the rest from one generated wrapper. The compiled forward serves one-token steps over a
``DecodeBatch`` whose buffers keep a static shape (``batch._static_step``): the token is written
at a position tensor and a prepared 4-D mask hides what is not written yet, so one compile
(dynamic lengths) covers every context length. It serves a lone request's steps: a batch of
several runs eager (another compile, minutes on a small CPU, would stall serving). Prefill stays
eager.

Fused kernels round differently from eager ones: the tokens stay those of eager decoding on the
tests' models but logits differ by float noise, hence opt-in. The compile happens at start-up
(``warm_up``: a few tokens on a dummy prompt; logged with its duration).
"""

from __future__ import annotations

import copy
import itertools
import logging
import time
from typing import Any

import torch
from torch import nn

from promptcache.engines.torch.onednn import OneDnnLinear

log = logging.getLogger("promptcache")

# kernels follow torch's thread count (the adaptive --threads) instead of recompiling
OPTIONS = {"cpp.dynamic_threads": True}


def compile_decode(model: Any) -> Any:
    """The model's forward for one-token steps, compiled lazily (``warm_up`` triggers it)."""
    return torch.compile(plain_twin(model), dynamic=True, options=OPTIONS)


def plain_twin(model: Any) -> Any:
    """The model's modules again over the very same tensors (no weight is copied), with every
    ``OneDnnLinear`` a plain ``nn.Linear``: inductor lowers those itself, and cannot lower
    oneDNN's op on unpacked weights; the eager model (prefill) keeps oneDNN."""
    memo = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    twin = copy.deepcopy(model, memo)
    for name, module in list(twin.named_modules()):
        if isinstance(module, OneDnnLinear):
            linear = nn.Linear.__new__(nn.Linear)
            nn.Module.__init__(linear)  # not nn.Linear's: it would allocate fresh weights
            linear.in_features, linear.out_features = module.in_features, module.out_features
            linear.weight, linear.bias = module.weight, module.bias
            twin.set_submodule(name, linear)
    return twin


def warm_up(runner: Any, num_tokens: int = 4, rows: tuple[int, ...] = (1,)) -> float:
    """Compile the decode step now, by decoding ``num_tokens`` on dummy prompts with each
    number of ``rows`` (a shape first seen while serving would stall it); seconds taken."""
    t0 = time.perf_counter()
    log.info("--compile: compiling the decode step (inductor; a minute or more on a small CPU)")
    for n in rows:
        states = [runner.new_state() for _ in range(n)]
        prompts = [[1 + i] * (4 + i) for i in range(n)]
        logits = runner.forward(states, prompts)
        for _ in range(num_tokens):
            tokens = [[int(x.argmax())] for x in logits]
            logits = runner.forward(states, tokens)
        log.info("--compile: %d-row decode step ready (%.0f s so far)", n, time.perf_counter() - t0)
    runner.reset_decode()
    seconds = time.perf_counter() - t0
    log.info("--compile: decode step compiled in %.1f s", seconds)
    return seconds
