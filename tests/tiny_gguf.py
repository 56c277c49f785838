"""A tiny random-weight llama GGUF (float32 tensors, a trained 320-token BPE tokenizer), written
with the ``gguf`` package in the layout llama.cpp's converter writes: what transformers'
GGUF loader (and so ``models.convert_gguf``) reads. Seconds to convert, for tests."""

from __future__ import annotations

import json
from pathlib import Path

_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
          "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}  # fmt: skip


def _gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER[module]}.{kind}"


def write_tiny_gguf(path: Path, seed: int = 0) -> Path:
    import gguf
    import torch
    from transformers import AutoModelForCausalLM

    from promptcache.testing.tiny_models import tiny_config, train_tiny_tokenizer

    fast = train_tiny_tokenizer()
    config = tiny_config("llama")
    config.vocab_size = len(fast)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    vocab = json.loads(fast.backend_tokenizer.to_str())["model"]
    tokens = [tok for tok, _ in sorted(vocab["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in vocab["merges"]]
    specials = set(fast.all_special_tokens) | {"<|im_start|>", "<|im_end|>"}

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_block_count(config.num_hidden_layers)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    w.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_vocab_size(len(tokens))
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in specials else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(fast.bos_token_id)
    w.add_eos_token_id(fast.eos_token_id)
    w.add_pad_token_id(fast.pad_token_id)
    w.add_chat_template(fast.chat_template)
    for name, tensor in model.state_dict().items():
        w.add_tensor(_gguf_name(name), tensor.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
