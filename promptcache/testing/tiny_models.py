"""Tiny random-weight models built from a config, one per cache type, for tests and demos.

2 layers, hidden 64, float32 by default. Deterministic for a given seed.
"""

from __future__ import annotations

from typing import Any

TINY_KINDS = ("llama", "gemma3", "mamba", "jamba", "bamba")


def tiny_config(kind: str) -> Any:
    from transformers import BambaConfig, Gemma3TextConfig, JambaConfig, LlamaConfig, MambaConfig

    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)  # fmt: skip
    if kind == "llama":
        return LlamaConfig(**common)
    if kind == "gemma3":  # one sliding-window layer (window 16) and one full-attention layer
        return Gemma3TextConfig(
            **common,
            head_dim=16,
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention"],
        )
    if kind == "mamba":  # pure SSM
        return MambaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, state_size=8, expand=2,
                           max_position_embeddings=4096)  # fmt: skip
    if kind == "jamba":  # hybrid: a Mamba layer then an attention layer
        return JambaConfig(**common, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                           expert_layer_offset=1, num_experts=2, mamba_d_state=8, mamba_expand=2, mamba_dt_rank=8)  # fmt: skip
    if kind == "bamba":  # Mamba2 + attention
        return BambaConfig(**common, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=32, mamba_d_state=8,
                           mamba_n_groups=1, mamba_chunk_size=16)  # fmt: skip
    raise ValueError(f"unknown tiny model kind {kind!r}; known: {', '.join(TINY_KINDS)}")


def tiny_model(kind: str, seed: int = 0, dtype: str = "float32") -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(kind))
    return model.to(getattr(torch, dtype)).eval()


MLX_TINY_KINDS = ("llama", "gemma3", "mamba2", "falcon_h1")


def mlx_tiny_config(kind: str) -> dict[str, Any]:
    """mlx-lm model configs: KVCache, RotatingKVCache + KVCache, ArraysCache, and a hybrid whose
    every layer is a CacheList(ArraysCache, KVCache)."""
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                  max_position_embeddings=4096)  # fmt: skip
    if kind == "llama":
        return dict(model_type="llama", **common, tie_word_embeddings=False)
    if kind == "gemma3":  # one sliding-window layer (window 16) and one full-attention layer
        return dict(model_type="gemma3_text", **common, head_dim=16, sliding_window=16,
                    sliding_window_pattern=2, query_pre_attn_scalar=16)  # fmt: skip
    if kind == "mamba2":  # pure SSM
        return dict(model_type="mamba2", vocab_size=256, hidden_size=64, intermediate_size=128,
                    num_hidden_layers=2, state_size=8, num_heads=4, head_dim=32, n_groups=1,
                    conv_kernel=4, layer_norm_epsilon=1e-5, use_bias=False, use_conv_bias=True,
                    time_step_limit=(0.0, float("inf")), time_step_rank="auto",
                    tie_word_embeddings=True)  # fmt: skip
    if kind == "falcon_h1":  # hybrid: Mamba2 and attention side by side in every layer
        return dict(model_type="falcon_h1", **common, head_dim=16, mamba_d_ssm=128, mamba_n_heads=4,
                    mamba_d_head=32, mamba_d_state=8, mamba_chunk_size=16)  # fmt: skip
    raise ValueError(f"unknown tiny MLX model kind {kind!r}; known: {', '.join(MLX_TINY_KINDS)}")


def mlx_tiny_model(kind: str, seed: int = 0, **overrides: Any) -> Any:
    import importlib

    import mlx.core as mx

    config = {**mlx_tiny_config(kind), **overrides}
    arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(seed)
    model = arch.Model(arch.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    return model


class ByteTokenizer:
    """A tokenizer for tiny models: one token per byte, ids 3.. ; 0 pad, 1 bos, 2 eos.

    Enough for the engine and server paths: encode, decode, a chat template.
    """

    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2
    eos_token = "</s>"

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [b + 3 for b in text.encode()]}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [b + 3 for b in text.encode()]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i - 3 for i in ids if 3 <= i < 259).decode("utf-8", errors="replace")

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: Any = None,
        add_generation_prompt: bool = True,
        tokenize: bool = False,
    ) -> str:
        parts = []
        if tools:
            parts.append("<tools>" + repr(tools) + "</tools>\n")
        for m in messages:
            if m.get("role") not in ("system", "user", "assistant", "tool"):
                raise ValueError(f"unknown role {m.get('role')!r}")
            content = m.get("content") or ""
            if not isinstance(content, str):
                content = "".join(p.get("text", "") for p in content)
            parts.append(f"<{m['role']}>{content}</{m['role']}>\n")
        if add_generation_prompt:
            parts.append("<assistant>")
        return "".join(parts)


CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if tools %}<|im_start|>tools\n{{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. A prompt cache keeps the state it computed.",
    "You are a helpful assistant. Answer the user's question about flights, bookings and refunds.",
    "def add(a, b):\n    return a + b\n# tool call: search_flights(origin='SFO', destination='JFK')",
]


def train_tiny_tokenizer(extra_specials: tuple[str, ...] = (), template: str | None = None) -> Any:
    """A small trained byte-level BPE tokenizer with ChatML markers (plus ``extra_specials``,
    e.g. an image token) and ``template`` (default: ChatML) as its chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", *extra_specials]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="<|im_end|>"
    )
    fast.chat_template = template or CHATML_TEMPLATE
    return fast


def bundled_tokenizer() -> Any:
    """The bundled model's real tokenizer (SmolLM2's 49K BPE vocabulary and ChatML template),
    read from its GGUF: real token counts for a tiny model (the scripted agent-client tests)."""
    from transformers import AutoTokenizer

    from promptcache.models import bundled_gguf

    gguf = bundled_gguf()
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def save_tiny_tokenizer(folder: str) -> Any:
    """``train_tiny_tokenizer``'s ChatML tokenizer, saved to ``folder``."""
    fast = train_tiny_tokenizer()
    fast.save_pretrained(folder)
    return fast


def save_tiny_model(
    kind: str, folder: str, seed: int = 0, tokenizer: Any = None, max_context: int | None = None
) -> str:
    """Write a tiny random-weight transformers model with ``save_tiny_tokenizer``'s tokenizer (or
    ``tokenizer``, e.g. ``bundled_tokenizer()``; the vocabulary follows it): an HF-format folder
    that ``promptcache serve --model`` loads like any other."""
    import torch
    from transformers import AutoModelForCausalLM

    if tokenizer is None:
        fast = save_tiny_tokenizer(folder)
    else:
        fast = tokenizer
        fast.save_pretrained(folder)
    config = tiny_config(kind)
    config.vocab_size = len(fast)
    config.eos_token_id = fast.eos_token_id
    if max_context:
        config.max_position_embeddings = max_context
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(folder)
    return folder


def save_mlx_tiny_model(kind: str, folder: str, seed: int = 0, tokenizer: Any = None) -> str:
    """Write a tiny random-weight mlx-lm model (weights in MLX layout) with the same tokenizer
    (or ``tokenizer``, as for ``save_tiny_model``): a folder that ``mlx_lm.load``,
    ``mlx_lm.server`` and ``promptcache serve --engine mlx`` read."""
    import json
    from pathlib import Path

    import mlx.core as mx
    from mlx.utils import tree_flatten

    if tokenizer is None:
        fast = save_tiny_tokenizer(folder)
    else:
        fast = tokenizer
        fast.save_pretrained(folder)
    model = mlx_tiny_model(kind, seed, vocab_size=len(fast))
    mx.save_safetensors(
        str(Path(folder) / "model.safetensors"), dict(tree_flatten(model.parameters()))
    )
    config = {**mlx_tiny_config(kind), "vocab_size": len(fast), "eos_token_id": fast.eos_token_id}
    (Path(folder) / "config.json").write_text(json.dumps(config, indent=2))
    return folder
