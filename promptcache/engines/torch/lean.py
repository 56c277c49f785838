"""A decode step for llama-style decoders without transformers' per-module plumbing
(``make_lean_decoder``).

On a CPU a one-token step of a small model is mostly weight streaming plus a fixed cost per
op: on the bundled 135M model ~17 ms of matmuls and ~6 ms of everything else (module calls,
mask and cache bookkeeping, a dozen small ops per norm and RoPE, a copy of every key/value head
for grouped attention). For decoders whose layers are exactly RMSNorm, attention with RoPE
(optionally per-head q/k norms), RMSNorm, gated MLP (llama, mistral, qwen2, qwen3 and their
fine-tunes, dense or mixture-of-experts), and Gemma 3's (its (1 + w) norms after attention and
around the MLP too, RoPE bases per layer type, sliding-window layers beside full ones) this
step calls the model's own weights, rotary module and activation directly, reads grouped KV
heads in place (``enable_gqa``) and writes keys/values through the cache layers' public
``update``. A request's prefill alone stays the
model's forward; several requests' pieces packed into one forward run here too
(``ragged.packed_forward``).

Each decoder is checked at load against the model's forward (``agrees``: a few greedy steps,
same tokens, logits within float noise); a model that does not match runs its own forward.
"""

from __future__ import annotations

import copy
import inspect
import logging
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from transformers import DynamicCache

log = logging.getLogger("promptcache")

# dense or mixture-of-experts MLPs (an MLP without gate/up/down is called as the model's module)
FAMILIES = frozenset(
    {"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma3_text"}
)
WINDOWED = frozenset({"gemma3_text"})  # families whose sliding-window layers the step covers
GATED = ("gate_proj", "up_proj", "down_proj", "act_fn")
OFFSET_NORMS = frozenset({"Gemma3RMSNorm"})  # normalized x * (1 + weight)
TOLERANCE = 1e-3  # of the largest logit: float32 sums in another order, nothing more


class Output(NamedTuple):
    logits: torch.Tensor  # [rows, tokens (or the kept ones), vocab]


class LeanLayer(NamedTuple):
    norm1: Any  # each norm a call x -> normed (``_norm_call``)
    project_qkv: Any  # hidden -> [rows, tokens, heads + 2 * kv_heads, head_dim]
    q_norm: Any  # per-head RMSNorms (qwen3, gemma3) or None
    k_norm: Any
    o_proj: Any
    post_attn: Any  # the attention output's norm before the residual (gemma3) or None
    norm2: Any
    mlp: Any  # hidden -> hidden: a gated MLP's three matmuls, or the model's MoE block
    post_mlp: Any  # the MLP output's norm before the residual (gemma3) or None
    scaling: float
    rope: str | None = None  # the rotary module's layer type (gemma3's bases per type)
    window: int | None = None  # a sliding-window layer's window


class LeanDecoder:
    """Called like the model for decode steps (``input_ids`` [rows, 1], ``position_ids``, an
    optional 2-D ``attention_mask`` over cache + new token, the cache): ``Output.logits``."""

    def __init__(self, model: Any, cache_arg: str) -> None:
        self.config = model.config
        self.model = model
        self.cache_arg = cache_arg
        inner = model.model
        text = model.config.get_text_config()
        self.num_heads, self.num_kv_heads = text.num_attention_heads, text.num_key_value_heads
        self.head_dim = inner.layers[0].self_attn.head_dim
        self.embed, self.rotary, self.norm = inner.embed_tokens, inner.rotary_emb, inner.norm
        typed = "layer_type" in inspect.signature(self.rotary.forward).parameters
        self.layers = [_lean_layer(layer, self.head_dim, typed) for layer in inner.layers]
        self.softcap = getattr(text, "final_logit_softcapping", None)
        # one-row steps fold grouped heads (attend_one); off: the model's own SDPA call (agrees)
        self.fold_gqa = True

    def __call__(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> Output:
        cache = kwargs[self.cache_arg]
        rows = input_ids.shape[0]
        if position_ids is None:
            n = cache.get_seq_length()
            position_ids = torch.full((rows, 1), n, device=input_ids.device)
        mask = None
        if attention_mask is not None and rows > 1:  # one row has no padding to hide
            mask = attention_mask.bool()[:, None, None, :]
        gqa = self.num_heads != self.num_kv_heads

        def attend(
            i: int, layer: LeanLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
        ) -> torch.Tensor:
            keys, values = cache.layers[i].update(k, v)
            if rows == 1:  # a sliding layer hands back its window's keys: all visible
                return attend_one(q, keys, values, layer.scaling, gqa, self.fold_gqa)
            seen = None if mask is None else mask[..., -keys.shape[-2] :]  # a window's tail
            return F.scaled_dot_product_attention(
                q, keys, values, attn_mask=seen, scale=layer.scaling, enable_gqa=gqa
            )

        return self.run_layers(input_ids, position_ids, attend)

    def run_layers(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attend: Any,
        keep: torch.Tensor | None = None,
    ) -> Output:
        """The step with its attention left to ``attend(i, layer, q, k, v)`` (rows x heads x
        tokens x dim each, RoPE applied; returns the attention output, the same shape as ``q``):
        the cache's update and the attention call are the caller's. ``input_ids`` and
        ``position_ids`` are rows x tokens (a decode step: one token a row; a packed forward:
        one row of every sequence's tokens side by side). ``keep``: the token indices whose
        logits are wanted (the lm head over a whole prefill piece is most of a small model's
        work), else every position's."""
        rows, length = input_ids.shape
        h = self.embed(input_ids)
        ropes = {t: self._rope(h, position_ids, t) for t in {x.rope for x in self.layers}}
        heads, kv_heads = self.num_heads, self.num_kv_heads
        for i, layer in enumerate(self.layers):
            cos, signed_sin, half = ropes[layer.rope]
            x = layer.norm1(h)
            qkv = layer.project_qkv(x)
            if layer.q_norm is not None:
                q = layer.q_norm(qkv[:, :, :heads])
                k = layer.k_norm(qkv[:, :, heads : heads + kv_heads])
                qk = torch.cat((q, k), 2).transpose(1, 2)
            else:
                qk = qkv[:, :, : heads + kv_heads].transpose(1, 2)
            qk = qk * cos + qk.roll(half, -1) * signed_sin
            v = qkv[:, :, heads + kv_heads :].transpose(1, 2)
            o = attend(i, layer, qk[:, :heads], qk[:, heads:], v)
            o = layer.o_proj(o.transpose(1, 2).reshape(rows, length, -1))
            h = h + (o if layer.post_attn is None else layer.post_attn(o))
            m = layer.mlp(layer.norm2(h))
            h = h + (m if layer.post_mlp is None else layer.post_mlp(m))
        if keep is not None:
            h = h[:, keep]
        logits = self.model.lm_head(self.norm(h))
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return Output(logits)

    def _rope(self, h: torch.Tensor, position_ids: torch.Tensor, kind: str | None) -> Any:
        """cos, signed sin (rows x 1 (heads) x tokens x dim) and half the dim, for layers of
        rotary type ``kind``: rotate_half(x) * sin == roll(x, half) * signed_sin, two ops
        fewer per layer."""
        if kind is None:
            cos, sin = self.rotary(h, position_ids)
        else:
            cos, sin = self.rotary(h, position_ids, kind)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        half = sin.shape[-1] // 2
        return cos, torch.cat((-sin[..., :half], sin[..., half:]), -1), half


def attend_one(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    gqa: bool,
    fold: bool = True,
) -> torch.Tensor:
    """One sequence's attention (``q``: 1 row); with ``fold``, a single query position over
    grouped KV heads goes in as each group's heads side by side on the query axis (no mask:
    every key is visible), which SDPA's fused CPU kernel takes, where ``enable_gqa`` with one
    query runs the unfused path: the same sums in another order (alone on 2-6K keys: 0.87-0.94x
    its time on one thread, 1.15-1.2x on two; a served decode is even either way)."""
    if fold and gqa and q.shape[2] == 1:
        heads, kv_heads, dim = q.shape[1], keys.shape[1], q.shape[3]
        folded = q.reshape(1, kv_heads, heads // kv_heads, dim)
        out = F.scaled_dot_product_attention(folded, keys, values, scale=scale)
        return out.view(1, heads, 1, dim)
    return F.scaled_dot_product_attention(q, keys, values, scale=scale, enable_gqa=gqa)


def _norm_call(norm: Any) -> Any:
    """``norm`` as a call: float32 through one fused ``rms_norm`` (a (1 + w) norm with its
    weight plus one, taken once), other dtypes the model's own module (it computes in float32
    and casts back); None stays None."""
    if norm is None:
        return None
    eps = getattr(norm, "variance_epsilon", None)
    eps = norm.eps if eps is None else eps
    is_offset = type(norm).__name__ in OFFSET_NORMS
    weight = norm.weight + 1.0 if is_offset else norm.weight

    def run(x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and weight.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), weight, eps)
        return norm(x)

    return run


def _lean_layer(layer: Any, head_dim: int, typed_rope: bool) -> LeanLayer:
    """A decoder layer's parts. Gemma 3's: norms after attention and around the MLP
    (``post_attention_layernorm`` is then the attention output's, not the MLP's input's)."""
    attn, mlp = layer.self_attn, layer.mlp
    pre_mlp = getattr(layer, "pre_feedforward_layernorm", None)
    is_sandwich = pre_mlp is not None
    return LeanLayer(
        _norm_call(layer.input_layernorm),
        _projector(attn.q_proj, attn.k_proj, attn.v_proj, head_dim=head_dim),
        _norm_call(getattr(attn, "q_norm", None)),
        _norm_call(getattr(attn, "k_norm", None)),
        _linear_call(attn.o_proj),
        _norm_call(layer.post_attention_layernorm) if is_sandwich else None,
        _norm_call(pre_mlp if is_sandwich else layer.post_attention_layernorm),
        _gated_mlp(mlp) if all(hasattr(mlp, a) for a in GATED) else _module_call(mlp),
        _norm_call(getattr(layer, "post_feedforward_layernorm", None)),
        float(attn.scaling),
        attn.layer_type if typed_rope else None,
        attn.sliding_window if getattr(attn, "is_sliding", False) else None,
    )


def _gated_mlp(mlp: Any) -> Any:
    project, act, down = _projector(mlp.gate_proj, mlp.up_proj), mlp.act_fn, mlp.down_proj
    down = _linear_call(down)

    def run(x: torch.Tensor) -> torch.Tensor:
        gate, up = project(x)
        return down(act(gate) * up)

    return run


def _module_call(module: Any) -> Any:
    def run(x: torch.Tensor) -> torch.Tensor:
        out = module(x)
        return out[0] if isinstance(out, tuple) else out  # some MoE blocks add router logits

    return run


def _projector(*members: Any, head_dim: int | None = None) -> Any:
    """One call of the siblings' shared ``stack`` (``fused``) where they are all of it, in
    order; else a call each."""
    sizes = [m.out_features for m in members]
    stack = getattr(members[0], "stack", None)
    starts = [getattr(m, "start", None) for m in members]
    if (
        stack is not None
        and all(getattr(m, "stack", None) is stack for m in members)
        and starts == [sum(sizes[:i]) for i in range(len(sizes))]
    ):

        def project(x: torch.Tensor) -> Any:
            out = stack(x)
            return out.view(*x.shape[:-1], -1, head_dim) if head_dim else out.split(sizes, -1)

    else:

        def project(x: torch.Tensor) -> Any:
            outs = [m(x) for m in members]
            if head_dim:
                return torch.cat(outs, -1).view(*x.shape[:-1], -1, head_dim)
            return outs

    return project


def _linear_call(module: Any) -> Any:
    if type(module) is torch.nn.Linear:
        return lambda x: F.linear(x, module.weight, module.bias)
    return module  # oneDNN's, a quantized one: its own forward


def make_lean_decoder(model: Any, cache_arg: str, kinds: tuple[str, ...]) -> LeanDecoder | None:
    """A ``LeanDecoder`` for a model of a family it covers whose every layer is plain full
    attention (``kinds``; or a sliding window, in ``WINDOWED`` families), that agrees with
    the model's forward; None otherwise."""
    config = model.config
    family = getattr(config, "model_type", None)
    if family not in FAMILIES or hasattr(config, "vision_config"):
        return None
    covered = {"DynamicLayer"} | ({"DynamicSlidingWindowLayer"} if family in WINDOWED else set())
    if any(k not in covered for k in kinds) or not _has_parts(model):
        return None
    try:
        decoder = LeanDecoder(model, cache_arg)
        ok = agrees(decoder, model, cache_arg)
    except (AttributeError, RuntimeError, TypeError, ValueError) as exc:
        log.info("lean decode step unavailable (%s): decode runs the model's forward", exc)
        return None
    if not ok:
        log.warning("lean decode step disagrees with the model: decode runs the model's forward")
        return None
    return decoder


def _has_parts(model: Any) -> bool:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not layers or not all(hasattr(inner, a) for a in ("embed_tokens", "rotary_emb", "norm")):
        return False
    if len(layers) != model.config.get_text_config().num_hidden_layers:
        return False
    parts = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
    return all(hasattr(layer, p) for layer in layers for p in parts)


@torch.inference_mode()
def agrees(decoder: LeanDecoder, model: Any, cache_arg: str, num_steps: int = 3) -> bool:
    """Whether ``num_steps`` greedy steps after a short dummy prompt give the model's tokens,
    logits within ``TOLERANCE`` of the largest. The step runs attention through the model's
    own SDPA call: the check is of the step's structure, where the folded kernel's other order
    of sums moves bfloat16 activations (int4/int8 weights) by more than the tolerance."""
    fold, decoder.fold_gqa = decoder.fold_gqa, False
    try:
        return _agrees(decoder, model, cache_arg, num_steps)
    finally:
        decoder.fold_gqa = fold


def _agrees(decoder: LeanDecoder, model: Any, cache_arg: str, num_steps: int) -> bool:
    device = next(model.parameters()).device
    vocab = int(model.get_input_embeddings().num_embeddings)
    prompt = torch.arange(1, 8, device=device).remainder(vocab).view(1, -1)
    cache = DynamicCache(config=model.config)
    model(input_ids=prompt, use_cache=True, **{cache_arg: cache})
    caches = [cache, copy.deepcopy(cache)]  # one prefill: on a large CPU model each is seconds
    token = prompt[:, -1:]
    for step in range(num_steps):
        n = prompt.shape[1] + step
        want = model(input_ids=token, use_cache=True, **{cache_arg: caches[0]}).logits[:, -1]
        position_ids = torch.tensor([[n]], device=device)
        got = decoder(token, position_ids=position_ids, **{cache_arg: caches[1]}).logits[:, -1]
        scale = float(want.abs().max().clamp(min=1.0))
        if float((got - want).abs().max()) > TOLERANCE * scale or bool(
            (got.argmax(-1) != want.argmax(-1)).any()
        ):
            return False
        token = want.argmax(-1, keepdim=True)
    return True
