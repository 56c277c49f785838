"""Grouped-query attention without repeat_kv: the same logits, bitwise, as transformers' sdpa
for chunks after cached tokens, and only where it applies."""

import copy

import pytest

torch = pytest.importorskip("torch")

from transformers import DynamicCache  # noqa: E402

from promptcache.engines.torch.attention import NAME, sdpa_backends, use_gqa_attention  # noqa: E402
from promptcache.testing.tiny_models import tiny_model  # noqa: E402

pytestmark = pytest.mark.torch


@torch.inference_mode()
def chunked_logits(model, ids, pieces):
    cache, out, start = DynamicCache(config=model.config), [], 0
    for end in pieces:
        logits = model(input_ids=ids[:, start:end], cache=cache, use_cache=True).logits
        out.append(logits)
        start = end
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("kind", ["llama", "gemma3", "bamba"])
def test_chunks_after_a_prefix_are_bitwise_sdpa(kind):
    plain = tiny_model(kind)
    model = copy.deepcopy(plain)
    assert plain.config._attn_implementation == "sdpa"
    assert use_gqa_attention(model) and model.config._attn_implementation == NAME
    ids = torch.randint(3, 256, (1, 70), generator=torch.Generator().manual_seed(3))
    pieces = [16, 41, 42, 70]  # masked multi-token chunks, a one-token one, past a window of 16
    assert torch.equal(chunked_logits(plain, ids, pieces), chunked_logits(model, ids, pieces))


def test_left_alone_without_grouped_heads_or_sdpa():
    from transformers import AutoModelForCausalLM

    from promptcache.testing.tiny_models import tiny_config

    config = tiny_config("llama")
    config.num_key_value_heads = config.num_attention_heads  # no grouping: nothing to save
    assert not use_gqa_attention(AutoModelForCausalLM.from_config(config))
    eager = tiny_model("llama")
    eager.set_attn_implementation("eager")
    assert not use_gqa_attention(eager)
    assert eager.config._attn_implementation == "eager"
    assert not use_gqa_attention(tiny_model("mamba"))  # no attention at all


def test_cuda_forwards_leave_out_cudnn_attention_and_restore_the_switches():
    """On CUDA a runner's forwards run SDPA without cuDNN's kernel (it plans each new key length
    on the CPU: 3.5x slower bfloat16 decode on an H200); the process-wide switches are as they
    were afterwards, also after an error; a CPU device changes nothing."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    with sdpa_backends(torch.device("cuda")):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
    with pytest.raises(RuntimeError), sdpa_backends(torch.device("cuda")):
        raise RuntimeError("a failed forward")
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
    with sdpa_backends(torch.device("cpu")):
        assert torch.backends.cuda.cudnn_sdp_enabled() == before
