"""PyTorch/transformers model runner: load, fingerprint, and the model steps on transformers
cache objects (``torch_state`` converts them to and from core payloads)."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache

from promptcache.core.codec import PayloadCodec
from promptcache.core.figures import Series, Snapshot
from promptcache.core.hashing import fingerprint_model
from promptcache.core.worker_threads import add_start_hook
from promptcache.engines.torch.attention import sdpa_backends, use_gqa_attention
from promptcache.engines.torch.batch import (
    DecodeBatch,
    batched_decode,
    can_batch,
    in_place_layers,
    is_full_attention,
    lone_decode,
    state_length,
)
from promptcache.engines.torch.batch_stacked import has_states, held
from promptcache.engines.torch.codec import TorchCodec
from promptcache.engines.torch.fused import fuse_projections
from promptcache.engines.torch.layout_memo import FILE_NAME as LAYOUT_MEMO_FILE
from promptcache.engines.torch.layouts import choose_weight_layouts, unpack_weights
from promptcache.engines.torch.lean import LeanDecoder, make_lean_decoder
from promptcache.engines.torch.onednn import use_onednn_linears
from promptcache.engines.torch.quant import TorchPacker
from promptcache.engines.torch.ragged import (
    RowLayer,
    packed_forward,
    ragged_decode,
    rows_attention,
    use_row_layers,
)
from promptcache.engines.torch.state import (
    compact_views,
    crop_positional,
    describe_layers,
    held_bytes,
    restore_cache,
    slice_positional,
    take_checkpoint,
)
from promptcache.engines.torch.threads import (
    ThreadTuner,
    hold_one_thread,
    thread_figures,
    torch_threads,
)
from promptcache.engines.torch.vision_select import make_vision
from promptcache.engines.torch.warm import warm_up_steps
from promptcache.engines.torch.weights import weights_mode
from promptcache.models import cache_root
from promptcache.serving.block_scheme import BlockScheme
from promptcache.serving.fingerprint import VOLATILE_CONFIG_KEYS, digest_weights
from promptcache.serving.layers import Layout

log = logging.getLogger("promptcache")


class TorchRunner:
    """A transformers causal LM on one device (see ``ModelRunner`` for the contract).
    ``block_scheme``: how positional blocks are stored at rest (part of the fingerprint)."""

    name = "torch"

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        block_scheme: BlockScheme | None = None,
        processor: Any = None,
        threads: ThreadTuner | None = None,
    ) -> None:
        """``processor``: a vision-language model's processor (``AutoProcessor``, or its image
        processor alone): the runner then takes images (``vision``). ``threads``: who sets torch's intra-op threads before
        each forward (None: left as they are)."""
        self.threads = threads
        # where the weight layouts chosen on this machine are kept (None: timed at every start)
        self.layout_memo_file: Path | None = cache_root() / LAYOUT_MEMO_FILE
        if threads is not None:  # every background thread on one torch thread (torch.threads)
            add_start_hook(hold_one_thread)
        # no autograd, wherever the model is called from: a forward outside inference mode
        # would keep every step's graph, and with it each decode step's copy of the cache
        self.model = model.eval().requires_grad_(False)
        use_onednn_linears(model)  # float32 CPU prefill ~2x (torch.onednn); same parameters
        fuse_projections(model)  # q/k/v and gate/up in one matmul each (torch.fused)
        use_gqa_attention(model)  # no repeat_kv copy per prefill chunk (torch.attention)
        self.tokenizer = tokenizer
        # the YaRN settings load_torch_weights applied to reach max_context, or None
        self.rope_scaling: dict[str, Any] | None = getattr(model, "promptcache_rope_scaling", None)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.layout: Layout = describe_layers(DynamicCache(config=model.config))
        self.block_scheme = block_scheme or BlockScheme()
        self.block_scheme.check()
        self.packer = (
            None
            if self.block_scheme.is_default
            else TorchPacker(self.block_scheme, self.device, self.dtype)
        )
        # int8/int4 linear layers compute other numbers: their blocks never mix with float ones
        self.weights = weights_mode(model)
        config = {k: v for k, v in model.config.to_dict().items() if k not in VOLATILE_CONFIG_KEYS}
        self.fingerprint = fingerprint_model(
            config,
            digest_weights(model.state_dict().items(), lambda t: t.detach().float().cpu().numpy()),
            str(self.dtype)
            + self.block_scheme.tag
            + ("" if self.weights == "model" else "+w" + self.weights),
            self.name,
        )
        forward_args = inspect.signature(model.forward).parameters
        self._keep_arg = "logits_to_keep" in forward_args
        self._cache_arg = "cache" if "cache" in forward_args else "past_key_values"
        gen_config = getattr(model, "generation_config", None)
        eos = getattr(gen_config, "eos_token_id", None)
        eos_ids = {eos} if isinstance(eos, int) else set(eos or [])
        if tokenizer.eos_token_id is not None:
            eos_ids.add(tokenizer.eos_token_id)
        self.eos_ids = eos_ids
        self.vocab_size = int(model.get_input_embeddings().num_embeddings)
        text_config = model.config.get_text_config()
        self.model_limit = int(getattr(text_config, "max_position_embeddings", None) or 2048)
        # decode steps batch on full-attention, sliding and linear layouts (torch.batch)
        self._batches = can_batch(self.layout)
        self._grown = in_place_layers(self.layout)  # what a lone decode appends to in place
        self._last_batch: DecodeBatch | None = None  # reused while the same requests decode
        self._step: Any = None  # a compiled decode forward (``enable_compile``), else eager
        # eager decode steps: the lean step where it computes what the model does (torch.lean)
        self._decoder: Any = self.model
        if self._batches:
            self._decoder = make_lean_decoder(model, self._cache_arg, self.layout.kinds) or model
        if isinstance(self._decoder, LeanDecoder):
            rows_attention(self._decoder)  # built now, not in the first step (rows_kernel)
        self.vision: Any = None
        if processor is not None:
            self.vision = make_vision(
                model, processor, tokenizer, self.device, self.dtype, self._cache_arg
            )
        # a 3-D RoPE model's positions (``torch.mrope``): passed explicitly on every forward
        self._positions = getattr(self.vision, "positions", None)

    @property
    def _ragged(self) -> bool:
        """The lean step decodes each request where its state is (torch.ragged): its layers
        grow in place, no padded batch to gather again whenever a request joins or leaves."""
        return isinstance(self._decoder, LeanDecoder)

    def compute_stats(self) -> Snapshot:
        """The threads in force (``threads.thread_figures``) and ``lean_decode``: 1 where decode
        steps run the lean step, 0 where the model's forward (slower: a model it does not cover,
        or one whose check failed at load)."""
        if self.threads is None:  # torch's own default, or OMP_NUM_THREADS
            threads = thread_figures(torch.get_num_threads())
        else:
            threads = self.threads.stats()
        lean = int(self._ragged)
        return Snapshot(
            {**threads.data, "lean_decode": lean},
            (*threads.parts, Series("lean_decode", "gauge", lean)),
        )

    def new_state(self, num_positions: int = 0) -> DynamicCache:
        state = DynamicCache(config=self.model.config)
        return use_row_layers(state, num_positions) if self._ragged else state

    @torch.inference_mode()
    def forward(self, states: Sequence[Any], ids: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        if self.threads is not None:
            self.threads.apply()  # the stepping thread runs every forward: set them there
        with sdpa_backends(self.device):
            return self._forward(states, ids)

    def _forward(self, states: Sequence[Any], ids: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        # one-token steps (decode) on a full-attention model: one forward over the rows of a
        # DecodeBatch, appending in place (a lone request too: DynamicCache's concatenation
        # copies the whole context every token); any other mix one sequence at a time
        # (a one-token prompt's first forward has no keys yet to gather: it runs alone)
        is_decode = all(len(x) == 1 for x in ids) and all(self._has_keys(s) for s in states)
        positions = self._positions
        is_lone_compiled = self._step is not None and len(states) == 1
        if self._ragged and is_decode and not is_lone_compiled:
            return ragged_decode(self._decoder, states, [x[0] for x in ids])
        if self._batches and is_decode:
            logits, self._last_batch = batched_decode(
                self._decoder, self._cache_arg, states, [x[0] for x in ids], self._last_batch,
                self._step if len(states) == 1 else None,
                None if positions is None else partial(positions.decode_rows, states),
                self._grown,
            )  # fmt: skip
            return logits
        if is_decode and len(states) == 1:  # sliding / SSM layouts: in place where it can
            logit, self._last_batch = lone_decode(
                self.model, self._cache_arg, states[0], ids[0][0], self._last_batch, self._grown,
                None if positions is None else positions.text(states[0], 1),
            )  # fmt: skip
            return [logit]
        # a lone forward on a batch member replaces its layers' tensors: DecodeBatch.covers sees
        # that, so the batch is kept across prefill forwards of other requests
        return [
            self._forward_one(state, seq_ids) for state, seq_ids in zip(states, ids, strict=True)
        ]

    def packs(self, states: Sequence[Any]) -> bool:
        """Several requests' prefill pieces and decode tokens run in one lean forward
        (``forward_packed``) on the models the lean step covers (``torch.lean``)."""
        return self._ragged

    @torch.inference_mode()
    def forward_packed(
        self, states: Sequence[Any], ids: Sequence[Sequence[int]]
    ) -> list[torch.Tensor]:
        if self.threads is not None:
            self.threads.apply()
        with sdpa_backends(self.device):
            return packed_forward(self._decoder, states, ids, self.device)

    def _has_keys(self, state: DynamicCache) -> bool:
        """Whether a decode step can append in place: some full-attention layer has keys (a
        batched layout without any: its sliding or linear layers hold a prompt's state)."""
        return bool(self._grown or self._batches) and state_length(state, self._grown) > 0

    def enable_compile(self) -> float:
        """Compile the decode step now (``compiled.py``; full-attention layouts only, others
        keep the eager step): the seconds it took, 0.0 when nothing was compiled."""
        if not is_full_attention(self.layout):
            log.info(
                "--compile: %s layers decode eagerly", "/".join(sorted(set(self.layout.kinds)))
            )
            return 0.0
        from promptcache.engines.torch.compiled import compile_decode, warm_up

        unpack_weights(self.model)  # inductor lowers plain weights only
        self._step = compile_decode(self.model)
        return warm_up(self)

    def warm_up_steps(self, step_tokens: int, max_step_tokens: int) -> int:
        """Each weight in the format its matmuls run fastest in (``torch.layouts``), timed at
        the most torch threads forwards run on (at one, the loading thread's, the bundled
        model's 576-output down projections timed alike stored and packed, and then decoded
        10% slower stored on two); then the step shapes serving runs, once (``torch.warm``):
        the forwards run. A machine's first starts vote on the layouts and later ones run the
        majority untimed (``layout_memo``, in ``layout_memo_file``)."""
        most = self.threads.most_threads if self.threads is not None else torch.get_num_threads()
        with torch_threads(most):
            choose_weight_layouts(self.model, memo_file=self.layout_memo_file)
        return warm_up_steps(self, step_tokens, max_step_tokens)

    def reset_decode(self) -> None:
        """Drop the kept DecodeBatch (its buffers): the next decode step gathers again."""
        self._last_batch = None

    def compact(self, state: Any) -> Any:
        for layer in getattr(state, "layers", ()):
            is_row = isinstance(layer, RowLayer)
            if is_row and layer.is_own():
                # kept as it is, room ahead included (a copy of every finished request's
                # context cost 32 sessions a twentieth of their page faults)
                continue
            compact_views(layer)
            if is_row:
                layer.drop_buffers()  # copied out of a batch's row: its own are stale
        return state

    def device_free_bytes(self) -> int | None:
        if self.device.type != "cuda":
            return None  # a CPU's state is in host RAM (MPS's too: unified memory)
        free, _ = torch.cuda.mem_get_info(self.device)
        unused = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        return int(free + unused)

    def fixed_bytes(self, state: Any) -> int:
        return sum(
            t.nbytes for x in state.layers if has_states(x) for t in held(x) if t is not None
        )

    def held_bytes(self, states: Sequence[Any]) -> int:
        batch = self._last_batch
        return held_bytes([*states, batch.cache] if batch is not None else states)

    def batches_decode(self, states: Sequence[Any]) -> bool:
        return self._batches and len(states) > 1

    @torch.inference_mode()
    def _forward_one(self, state: DynamicCache, ids: Sequence[int]) -> torch.Tensor:
        x = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        kwargs: dict[str, Any] = {"logits_to_keep": 1} if self._keep_arg else {}
        kwargs[self._cache_arg] = state
        if self._positions is not None:  # never the model's shared rope_deltas
            kwargs["position_ids"] = self._positions.text(state, len(ids))
        elif self._grown:  # as batched steps give them (bamba counts from 0 every forward)
            past = state_length(state, self._grown)
            kwargs["position_ids"] = torch.arange(past, past + len(ids), device=self.device)[None]
        out = self.model(input_ids=x, use_cache=True, **kwargs)
        return out.logits[0, -1]

    def slice_block(self, state: DynamicCache, start: int, end: int) -> Any:
        return slice_positional(state, self.layout, start, end, self.packer)

    def take_checkpoint(self, state: DynamicCache) -> Any:
        return take_checkpoint(state, self.layout)

    def restore(
        self, segments: list[tuple[Any, int]], checkpoint: Any, num_positions: int = 0
    ) -> DynamicCache:
        state = self.new_state(num_positions)
        return restore_cache(state, self.layout, segments, checkpoint, self.device, self.packer)

    def crop(self, state: DynamicCache, length: int) -> None:
        crop_positional(state, self.layout, length)
        if self._positions is not None:
            self._positions.crop(state, length)

    def to_numpy(self, logits: torch.Tensor) -> np.ndarray:
        return logits.detach().float().cpu().numpy()

    def codec(self) -> PayloadCodec:
        return TorchCodec(self.device)
