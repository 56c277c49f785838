"""Quantized / narrower cache blocks at rest (``--cache-kv-bits``, ``--cache-dtype``): round-trip
error bounds, hits within a stated logit tolerance of uncached runs with the same greedy tokens,
sizes counted as stored, identity per scheme, and SSD restarts of quantized blocks."""

import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from engine_checks import greedy_turns, hit_results, token_ids  # noqa: E402

from promptcache.core.block import payload_nbytes  # noqa: E402
from promptcache.core.figures import render_series  # noqa: E402
from promptcache.engines.base import SamplingParams  # noqa: E402
from promptcache.engines.torch.engine import TorchEngine  # noqa: E402
from promptcache.engines.torch.quant import TorchPacker, dequantize, quantize  # noqa: E402
from promptcache.errors import ConfigError  # noqa: E402
from promptcache.serving.block_scheme import BlockScheme, pop_block_scheme  # noqa: E402
from promptcache.testing.tiny_models import ByteTokenizer, tiny_model  # noqa: E402

CHUNK, BLOCK = 16, 8
SCHEMES = {
    "kv8": dict(cache_kv_bits=8),
    "kv4": dict(cache_kv_bits=4),
    "bf16": dict(cache_dtype="bfloat16"),
}
# max |cached - uncached| logit difference on the tiny random models (their logits span about
# +-0.45 on torch, +-1.7 on mlx); measured: torch 7e-4 / 1e-2 / 2e-4, mlx 4e-3 / 8e-2 / 2e-3
TORCH_TOL = {"kv8": 2e-3, "kv4": 3e-2, "bf16": 1e-3}
MLX_TOL = {"kv8": 1.5e-2, "kv4": 0.2, "bf16": 5e-3}
# SmolLM2-135M's K/V block: 30 layers x (K, V), 3 KV heads, 64 positions, head dim 64
REAL_SHAPE = (60, 1, 3, 64, 64)


def _groups(x, g):
    return x.reshape(*x.shape[:-1], x.shape[-1] // g, g)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torch_round_trip_is_within_half_a_step(bits, dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(REAL_SHAPE, generator=gen) * 2
    x[..., 3] *= 20  # an outlier channel, as keys have
    x = x.to(getattr(torch, dtype))
    stored = quantize(x, bits, 64)
    y = dequantize(stored)
    assert y.shape == x.shape and y.dtype == x.dtype
    xg = _groups(x.float(), 64)
    # 8-bit is symmetric (a step is the group's largest magnitude / 127), 4-bit affine (range / 15)
    peak, span = xg.abs().amax(-1), xg.amax(-1) - xg.amin(-1)
    step = peak / 127 if bits == 8 else span / ((1 << bits) - 1)
    err = _groups((y.float() - x.float()).abs(), 64).amax(-1)
    slack = 0.0 if dtype == "float32" else 2**-8 * xg.abs().amax(-1)  # bf16 output rounding
    assert bool((err <= step * 0.5 * (1 + 2**-9) + slack + 1e-6).all())
    # 8-bit: 64 B of levels + a 2 B float16 scale per 64 values (8.25 bits: 1.94x 16-bit);
    # 4-bit: 32 B + 4 B of float16 scale and minimum (4.5 bits: 3.56x)
    per_group = {8: 66, 4: 36}[bits]
    assert payload_nbytes(stored) == x.numel() // 64 * per_group
    assert 16 * x.numel() / (8 * payload_nbytes(stored)) >= {8: 1.9, 4: 3.5}[bits]


def test_torch_bf16_round_trip_and_sizes():
    x = torch.randn(REAL_SHAPE)
    packer = TorchPacker(BlockScheme(dtype="bfloat16"))
    stored = packer.pack(x, 0)
    assert stored.dtype == torch.bfloat16 and payload_nbytes(stored) * 2 == payload_nbytes(x)
    y = packer.unpack(stored)
    assert y.dtype == torch.float32
    assert bool(((y - x).abs() <= x.abs() * 2**-8 + 1e-30).all())
    assert packer.stats.to_dict(packer.scheme)["quant_ratio"] == 2.0


def test_min_tokens_keeps_the_first_blocks_full_precision():
    packer = TorchPacker(BlockScheme(bits=8, min_tokens=64))
    x = torch.randn(4, 1, 2, 8, 16)
    assert torch.equal(packer.pack(x, 0), x) and torch.equal(packer.pack(x, 56), x)
    assert isinstance(packer.pack(x, 64), dict)
    assert packer.unpack(x) is x  # a full-precision block passes through


def test_scheme_options_and_identity():
    assert BlockScheme().tag == "" and BlockScheme().is_default
    opts = {"cache_kv_bits": 4, "cache_kv_group": 32, "cache_kv_min_tokens": None, "x": 1}
    assert pop_block_scheme(opts) == BlockScheme(bits=4, group=32) and opts == {"x": 1}
    with pytest.raises(ConfigError):
        pop_block_scheme({"cache_kv_bits": 3})
    with pytest.raises(ConfigError):
        pop_block_scheme({"cache_dtype": "float16"})
    model = tiny_model("llama")
    prints = {
        name: TorchEngine(model, ByteTokenizer(), cache_enabled=False, **opts).fingerprint
        for name, opts in {
            "full": {},
            **SCHEMES,
            "kv8m64": dict(cache_kv_bits=8, cache_kv_min_tokens=64),
        }.items()
    }
    assert len(set(prints.values())) == len(prints)  # every scheme roots its own chains
    assert prints["full"] == TorchEngine(model, ByteTokenizer(), cache_enabled=False).fingerprint


def _logits_of(engine, prompt):
    _, logits, lease, _ = engine.prefill(prompt)
    cached = (lease.num_tokens, lease.kind) if lease is not None else (0, "off")
    if lease is not None:
        lease.release()
    return np.asarray(engine.to_numpy(logits)), cached


def _max_diff(a, b):
    return float(np.abs(a - b).max())


def _check_engine(cached, plain, tol, scheme):
    for name, num_cached, hit_kind, diff, same_argmax in hit_results(
        cached, plain, _logits_of, _max_diff
    ):
        assert num_cached > 0 and hit_kind == name
        assert diff <= tol, f"{scheme} {name}: max logit diff {diff}"
        assert bool(same_argmax), f"{scheme} {name}"
    for turn, a, b, prev_len in greedy_turns(cached, plain, SamplingParams(max_tokens=10)):
        assert token_ids(a) == token_ids(b), f"{scheme} turn {turn}"
        if turn:
            assert a[0].cached_tokens >= prev_len
    cached.cache.check_integrity()


@pytest.mark.torch
@pytest.mark.parametrize("kind", ["llama", "gemma3"])
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_torch_hits_on_packed_blocks_match_uncached(kind, scheme):
    model = tiny_model(kind)
    cached = TorchEngine(
        model, ByteTokenizer(), block_size=BLOCK, ram_budget=10**8, prefill_chunk=CHUNK,
        **SCHEMES[scheme],
    )  # fmt: skip
    plain = TorchEngine(model, ByteTokenizer(), cache_enabled=False, prefill_chunk=CHUNK)
    _check_engine(cached, plain, TORCH_TOL[scheme], scheme)
    # every stored block is the packed form: RAM bytes are the packed payloads' bytes
    blocks = list(cached.cache.ram.tree.index.values())
    assert blocks
    for blk in blocks:
        if scheme == "bf16":
            assert blk.payload.dtype == torch.bfloat16
        else:
            assert (
                isinstance(blk.payload, dict)
                and blk.payload["bits"] == SCHEMES[scheme]["cache_kv_bits"]
            )
    stats = cached.cache_stats()
    assert stats["quant_bytes_saved"] > 0 and stats["quant_ratio"] > 1.5
    metrics = "\n".join(render_series(cached.cache_series(), "promptcache_"))
    assert f"promptcache_cache_quant_bytes_saved {stats['quant_bytes_saved']}" in metrics
    if kind == "gemma3":  # sliding-window rings travel in checkpoints, at full precision
        ckpts = [b.checkpoint for b in blocks if b.checkpoint is not None]
        assert ckpts and cached.layout.requires_checkpoint
        for ckpt in ckpts:
            tensors = [v for state in ckpt.values() for v in state.values() if torch.is_tensor(v)]
            assert tensors and all(
                t.dtype == torch.float32 for t in tensors if t.is_floating_point()
            )


@pytest.mark.torch
@pytest.mark.parametrize("scheme", ["kv8", "kv4"])
def test_ram_bytes_are_the_quantized_bytes(scheme):
    model = tiny_model("llama")
    rng = random.Random(3)
    prompt = [rng.randrange(3, 256) for _ in range(64)]
    used = {}
    for name, opts in {"full": {}, scheme: SCHEMES[scheme]}.items():
        engine = TorchEngine(
            model, ByteTokenizer(), block_size=BLOCK, ram_budget=10**8, prefill_chunk=CHUNK, **opts
        )
        _, _, lease, _ = engine.prefill(prompt)
        lease.release()
        engine.cache.check_integrity()  # used bytes == sum of payload_nbytes of what is held
        used[name] = engine.cache.stats().bytes_by_tier["ram"]
        if name != "full":
            stats = engine.cache_stats()
            assert stats["quant_stored_bytes"] == used[name]
            assert stats["quant_raw_bytes"] == used["full"]
    # head dim 16 = one group: 16 float32 values (64 B) -> 16 B of levels + a 2 B scale (8-bit)
    # or 8 B of levels + a 4 B scale and minimum (4-bit)
    assert used[scheme] * 64 == used["full"] * {"kv8": 18, "kv4": 12}[scheme]


@pytest.mark.torch
@pytest.mark.parametrize("scheme", ["kv8", "kv4"])
def test_ssd_restart_on_quantized_blocks_hits_and_replies_equal(scheme, tmp_path):
    model = tiny_model("llama")
    kwargs = dict(
        block_size=BLOCK, prefill_chunk=CHUNK, ssd_dir=tmp_path / "ssd", **SCHEMES[scheme]
    )
    rng = random.Random(5)
    prompt = [rng.randrange(3, 256) for _ in range(50)]
    params = SamplingParams(max_tokens=8)
    first = TorchEngine(model, ByteTokenizer(), ram_budget=10**8, **kwargs)
    want = token_ids(list(first.generate(prompt, params)))
    first.close()
    second = TorchEngine(model, ByteTokenizer(), ram_budget=10**8, **kwargs)
    events = list(second.generate(prompt, params))
    assert events[0].cached_tokens >= 48 and token_ids(events) == want
    second.cache.check_integrity()
    second.close()
    # a full-precision engine on the same folder never serves those files (another chain root)
    other = TorchEngine(
        model, ByteTokenizer(), ram_budget=10**8, block_size=BLOCK, prefill_chunk=CHUNK,
        ssd_dir=tmp_path / "ssd",
    )  # fmt: skip
    assert list(other.generate(prompt, params))[0].cached_tokens == 0
    other.close()


@pytest.mark.mlx
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_mlx_hits_on_packed_blocks_match_uncached(scheme):
    pytest.importorskip("mlx_lm")
    from promptcache.engines.mlx.engine import MlxEngine
    from promptcache.testing.tiny_models import mlx_tiny_model

    model = mlx_tiny_model("llama", head_dim=32)  # mx.quantize's smallest group is 32
    cached = MlxEngine(
        model, ByteTokenizer(), block_size=BLOCK, ram_budget=10**8, prefill_chunk=CHUNK,
        cache_kv_group=32, **SCHEMES[scheme],
    )  # fmt: skip
    plain = MlxEngine(model, ByteTokenizer(), cache_enabled=False, prefill_chunk=CHUNK)
    _check_engine(cached, plain, MLX_TOL[scheme], scheme)
    assert cached.cache_stats()["quant_ratio"] > 1.5
    with pytest.raises(ConfigError):
        MlxEngine(model, ByteTokenizer(), kv_bits=8, kv_group_size=32, cache_kv_bits=8)


@pytest.mark.mlx
def test_mlx_ssd_restart_on_quantized_blocks(tmp_path):
    pytest.importorskip("mlx_lm")
    from promptcache.engines.mlx.engine import MlxEngine
    from promptcache.testing.tiny_models import mlx_tiny_model

    model = mlx_tiny_model("llama", head_dim=32)
    kwargs = dict(
        block_size=BLOCK, prefill_chunk=CHUNK, ram_budget=10**8, ssd_dir=tmp_path / "ssd",
        cache_kv_bits=4, cache_kv_group=32,
    )  # fmt: skip
    rng = random.Random(6)
    prompt = [rng.randrange(3, 256) for _ in range(50)]
    params = SamplingParams(max_tokens=8)
    first = MlxEngine(model, ByteTokenizer(), **kwargs)
    want = token_ids(list(first.generate(prompt, params)))
    first.close()
    second = MlxEngine(model, ByteTokenizer(), **kwargs)
    events = list(second.generate(prompt, params))
    assert events[0].cached_tokens >= 48 and token_ids(events) == want
    second.cache.check_integrity()
    second.close()


@pytest.mark.mlx
@pytest.mark.parametrize("bits", [8, 4])
def test_mlx_round_trip_error_bounds(bits):
    pytest.importorskip("mlx_lm")
    import mlx.core as mx

    from promptcache.engines.mlx.quant import MlxPacker

    x = mx.random.normal(REAL_SHAPE, key=mx.random.key(0)) * 2
    packer = MlxPacker(BlockScheme(bits=bits))
    stored = packer.pack(x, 0)
    y = packer.unpack(stored)
    assert y.shape == x.shape and y.dtype == x.dtype
    xn, yn = np.asarray(x), np.asarray(y)
    xg = _groups(torch.from_numpy(xn), 64)
    err = _groups(torch.from_numpy(np.abs(yn - xn)), 64).amax(-1).numpy()
    peak = xg.abs().amax(-1).numpy()
    if bits == 8:  # symmetric int8: within half a step of largest magnitude / 127
        bound = peak / 127 * 0.5 * (1 + 2**-9) + 1e-6
    else:
        # mx.quantize anchors its bias at the group's larger-magnitude end: errors up to a step
        # (measured 0.937); float16 scales and biases add up to 2**bits * 2**-11 steps
        step = ((xg.amax(-1) - xg.amin(-1)) / ((1 << bits) - 1)).numpy()
        bound = step * (1.0 + (1 << bits) * 2**-11) + peak * 2**-10 + 1e-6
    assert bool((err <= bound).all())
    assert payload_nbytes(stored) == x.size // 64 * {8: 66, 4: 36}[bits]


@pytest.mark.torch
def test_cli_flags_reach_the_engine(tiny_llama_dir):
    from promptcache.cli.main import build_parser
    from promptcache.cli.serve import engine_from_args

    args = build_parser().parse_args(
        ["serve", "--engine", "torch", "--model", str(tiny_llama_dir), "--no-ssd"]
        + ["--cache-kv-bits", "4", "--cache-kv-group", "32", "--cache-kv-min-tokens", "64"]
    )
    engine = engine_from_args(args)
    assert engine.runner.block_scheme == BlockScheme(bits=4, group=32, min_tokens=64)
    assert engine.cache_stats()["quant_kv_bits"] == 4
    engine.close()
