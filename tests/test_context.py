"""--max-context above the model's native context: YaRN RoPE scaling where the model has plain
RoPE, a start-up refusal with the reason where it has not, never a silent cap."""

import os
import random
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from engine_checks import token_ids  # noqa: E402

from promptcache.engines.base import Finished, PromptTooLongError, SamplingParams  # noqa: E402
from promptcache.engines.torch.engine import TorchEngine  # noqa: E402
from promptcache.errors import ConfigError  # noqa: E402
from promptcache.models import ContextExtensionError, rope_scaling_for  # noqa: E402
from promptcache.testing.tiny_models import save_tiny_model  # noqa: E402

NATIVE = 4096  # the tiny models' max_position_embeddings
CHUNK, BLOCK = 512, 64


def prompt(n, seed=0):
    rng = random.Random(seed)
    return [rng.randrange(5, 300) for _ in range(n)]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("context")
    return {kind: save_tiny_model(kind, str(root / kind)) for kind in ("llama", "mamba")}


@pytest.fixture(scope="module")
def engines(folders):
    def load(**kw):
        return TorchEngine.load(folders["llama"], prefill_chunk=CHUNK, block_size=BLOCK, **kw)

    return {
        "native": load(cache_enabled=False),
        "plain": load(max_context=2 * NATIVE, cache_enabled=False),
        "cached": load(max_context=2 * NATIVE, ram_budget=10**8),
    }


# -- the helper --------------------------------------------------------------------------------


def test_rope_scaling_for_plain_rope_in_both_config_layouts():
    new = {
        "max_position_embeddings": 8192,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e5},
    }
    old = {"max_position_embeddings": 8192, "rope_theta": 1e5, "rope_scaling": None}
    want = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192,
            "rope_theta": 1e5}  # fmt: skip
    assert rope_scaling_for(new, 32768) == want
    assert rope_scaling_for(old, 32768) == want
    assert rope_scaling_for(new, 8192) is None and rope_scaling_for(old, 4000) is None
    assert rope_scaling_for(new, None) is None


@pytest.mark.parametrize(
    "config, reason",
    [
        ({"model_type": "mamba"}, "no rotary position embeddings"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}, "rope_theta": 1e4}, "already scaled"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "yarn"),
        (
            {
                "rope_parameters": {
                    "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                }
            },
            "per layer type",
        ),
    ],  # fmt: skip
)
def test_rope_scaling_for_refuses_what_it_cannot_extend(config, reason):
    with pytest.raises(ContextExtensionError, match=reason) as info:
        rope_scaling_for({"max_position_embeddings": NATIVE, **config}, 3 * NATIVE)
    assert isinstance(info.value, ConfigError)  # serve and bench exit with the message
    assert f"native context of {NATIVE}" in str(info.value) and str(3 * NATIVE) in str(info.value)


# -- torch engine ------------------------------------------------------------------------------


@pytest.mark.torch
def test_torch_scaled_llama_serves_past_its_native_context(engines):
    engine = engines["plain"]
    assert engine.max_context == 2 * NATIVE
    assert engine.rope_scaling == {"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0,
                                   "original_max_position_embeddings": NATIVE}  # fmt: skip
    assert engine.model.config.max_position_embeddings == 2 * NATIVE
    events = list(engine.generate(prompt(5000), SamplingParams(max_tokens=4)))
    done = events[-1]
    assert isinstance(done, Finished) and done.prompt_tokens == 5000 and done.reason != "context"
    assert done.completion_tokens >= 1


@pytest.mark.torch
def test_torch_scaling_changes_the_model_and_its_cache_keys(engines):
    native, scaled = engines["native"], engines["plain"]
    assert native.rope_scaling is None and native.max_context == NATIVE
    ids = prompt(3000, seed=1)  # fits both contexts
    diff = (native.forward(native.new_state(), ids) - scaled.forward(scaled.new_state(), ids)).abs()
    # the same weights and the same ops give bitwise-equal logits: any difference is the scaling
    assert diff.max().item() > 1e-5, "the YaRN settings did not reach the rotary embedding"
    assert native.fingerprint != scaled.fingerprint  # cached blocks never cross the two


@pytest.mark.torch
def test_torch_scaled_greedy_cache_on_equals_cache_off(engines):
    cached, plain = engines["cached"], engines["plain"]
    history = prompt(4500, seed=2)
    params = SamplingParams(max_tokens=6)
    for turn in range(2):
        a = list(cached.generate(history, params))
        b = list(plain.generate(history, params))
        assert token_ids(a) == token_ids(b), f"turn {turn}"
        if turn:
            assert a[0].cached_tokens >= 4500, "the second turn reuses the first"
        history = history + b[-1].completion_ids + prompt(400, seed=3)
    cached.cache.check_integrity()


@pytest.mark.torch
def test_torch_max_context_below_native_just_limits(folders, engines):
    engine = TorchEngine.load(folders["llama"], max_context=1000, cache_enabled=False)
    assert engine.max_context == 1000 and engine.rope_scaling is None
    assert engine.fingerprint == engines["native"].fingerprint  # the same model
    with pytest.raises(PromptTooLongError):
        list(engine.generate(prompt(1000), SamplingParams(max_tokens=1)))


@pytest.mark.torch
def test_torch_mamba_above_native_is_refused_with_the_reason(folders):
    with pytest.raises(ContextExtensionError, match="mamba has no rotary position embeddings"):
        TorchEngine.load(folders["mamba"], max_context=2 * NATIVE)
    assert TorchEngine.load(folders["mamba"], max_context=NATIVE).max_context == NATIVE


@pytest.mark.torch
def test_cli_serve_exits_with_the_reason(folders, tmp_path):
    cmd = [sys.executable, "-m", "promptcache.cli", "serve", "--model", folders["mamba"],
           "--max-context", "99999", "--engine", "torch", "--no-ssd"]  # fmt: skip
    env = {**os.environ, "PROMPTCACHE_HOME": str(tmp_path)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert f"--max-context 99999 is above the model's native context of {NATIVE}" in proc.stderr
    assert "no rotary position embeddings" in proc.stderr and "Traceback" not in proc.stderr


# -- MLX engine --------------------------------------------------------------------------------


@pytest.mark.mlx
def test_mlx_scaled_llama_serves_past_its_native_context(tmp_path):
    pytest.importorskip("mlx_lm")
    from promptcache.engines.mlx.engine import MlxEngine
    from promptcache.testing.tiny_models import save_mlx_tiny_model

    path = save_mlx_tiny_model("llama", str(tmp_path / "llama"))
    opts = dict(prefill_chunk=CHUNK, block_size=BLOCK)
    native = MlxEngine.load(path, cache_enabled=False, **opts)
    plain = MlxEngine.load(path, max_context=2 * NATIVE, cache_enabled=False, **opts)
    cached = MlxEngine.load(path, max_context=2 * NATIVE, ram_budget=10**8, **opts)
    assert native.rope_scaling is None and native.max_context == NATIVE
    assert plain.max_context == cached.max_context == 2 * NATIVE
    assert plain.rope_scaling["factor"] == 2.0
    assert type(plain.model.model.layers[0].self_attn.rope).__name__ == "YarnRoPE"
    assert native.fingerprint != plain.fingerprint
    ids = prompt(1000, seed=1)
    diff = abs(native.to_numpy(native.forward(native.new_state(), ids))
               - plain.to_numpy(plain.forward(plain.new_state(), ids))).max()  # fmt: skip
    assert diff > 1e-5  # the scaling reached the rotary embedding
    history, params = prompt(4500, seed=2), SamplingParams(max_tokens=4)
    for turn in range(2):
        a = list(cached.generate(history, params))
        b = list(plain.generate(history, params))
        assert token_ids(a) == token_ids(b), f"turn {turn}"
        assert b[-1].prompt_tokens == len(history) and b[-1].reason != "context"
        history = history + b[-1].completion_ids + prompt(400, seed=3)
    assert a[0].cached_tokens >= 4500


@pytest.mark.mlx
def test_mlx_model_without_rope_scaling_is_refused(tmp_path):
    pytest.importorskip("mlx_lm")
    from promptcache.engines.mlx.engine import MlxEngine
    from promptcache.testing.tiny_models import save_mlx_tiny_model

    path = save_mlx_tiny_model("mamba2", str(tmp_path / "mamba2"))
    with pytest.raises(ContextExtensionError, match="mamba2 model takes no RoPE scaling"):
        MlxEngine.load(path, max_context=99999)
