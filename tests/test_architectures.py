"""Architecture conformance: a tiny random checkpoint of every family we claim, built from the
library's own config class, on every engine that has the family. Four chat turns and an edited
one: greedy replies equal the uncached engine's, reuse per turn within what the layer kinds
allow. Checkpoints are built once per session; engines are in-process (a real server for the
vision-tower checkpoint layout in test_architectures_server.py)."""

import json
import threading
from pathlib import Path

import pytest

from promptcache.engines.base import SamplingParams
from promptcache.errors import ConfigError
from promptcache.testing.conformance import USER_TURNS, format_row, reuse_ok, run_conversation
from promptcache.testing.tiny_families import FAMILY_NAMES, save_family, save_mlx_family

BLOCK, CHUNK = 8, 16
# transformers 5 writes these families' experts in a layout mlx-lm 0.32.2 does not read (mlx
# refuses the HF folder, test below): on mlx they run as an MLX conversion, as users have them
MLX_CONVERTED = ("gpt_oss", "qwen3_5_moe", "qwen3_5_moe-vl")
TORCH_CASES = [("torch", name) for name in FAMILY_NAMES]
MLX_CASES = [("mlx", name) for name in FAMILY_NAMES]
PARAMS = SamplingParams(max_tokens=8)
ROWS: list[str] = []  # the conformance table, printed at the end of the session


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """(layout, family) -> folder, each built on first use."""
    root = tmp_path_factory.mktemp("families")
    built: dict[tuple[str, str], str] = {}

    def get(name: str, layout: str = "hf") -> str:
        if (layout, name) not in built:
            save = save_mlx_family if layout == "mlx" else save_family
            built[layout, name] = str(save(name, root / f"{layout}-{name}"))
        return built[layout, name]

    return get


@pytest.fixture(scope="session")
def loaded(checkpoints):
    """(engine, family) -> (engine class, model, tokenizer), each loaded once per session."""
    models: dict[tuple[str, str], tuple] = {}

    def get(engine: str, name: str):
        if (engine, name) not in models:
            if engine == "torch":
                from promptcache.engines.torch.engine import TorchEngine as cls
            else:
                pytest.importorskip("mlx_lm")
                from promptcache.engines.mlx.engine import MlxEngine as cls
            layout = "mlx" if engine == "mlx" and name in MLX_CONVERTED else "hf"
            models[engine, name] = (cls, *cls.load_weights(checkpoints(name, layout)))
        return models[engine, name]

    return get


def engines_for(loaded, engine, name, **cached_options):
    """(cached, plain, tokenizer) on the family's one loaded model."""
    cls, model, tokenizer = loaded(engine, name)
    opts = dict(block_size=BLOCK, prefill_chunk=CHUNK)
    cached = cls(model, tokenizer, ram_budget=10**8, **opts, **cached_options)
    plain = cls(model, tokenizer, cache_enabled=False, **opts)
    return cached, plain, tokenizer


@pytest.fixture(scope="session", autouse=True)
def conformance_table():
    yield
    if ROWS:
        head = "| engine family (layer kinds) | cached/prompt per turn | equal | edited turn | |"
        print("\n" + "\n".join([head, "|---|---|---|---|---|", *ROWS]))


@pytest.mark.parametrize(("engine", "name"), TORCH_CASES + MLX_CASES)
def test_family_conversation_equals_uncached(engine, name, loaded):
    layout = "mlx" if engine == "mlx" and name in MLX_CONVERTED else "hf"
    cached, plain, tokenizer = engines_for(loaded, engine, name)
    turns = run_conversation(cached, plain, tokenizer)
    kinds = ",".join(sorted(set(cached.layout.kinds)))
    ROWS.append(
        format_row(f"{engine} {name}{' (mlx layout)' * (layout == 'mlx')} ({kinds})", turns)
    )
    for t in turns:
        assert t.is_equal, f"{engine} {name} turn {t.turn}: reply differs from --no-cache"
        assert reuse_ok(t), f"{engine} {name}: {t}"
    cached.cache.check_integrity()


@pytest.mark.parametrize(("engine", "name"), TORCH_CASES + MLX_CASES)
def test_family_restarts_from_the_ssd_tier(engine, name, loaded, tmp_path):
    """Every layer kind's blocks and checkpoints through block files: a new engine on the same
    SSD folder (a restart) continues the chat from the previous turn, equal to --no-cache."""
    first, plain, tokenizer = engines_for(loaded, engine, name, ssd_dir=tmp_path)
    turns = chat_turns(tokenizer)
    reply = list(first.generate(turns[0], PARAMS))[-1].completion_ids
    first.close()
    second, _, _ = engines_for(loaded, engine, name, ssd_dir=tmp_path)
    prompt = turns[0] + reply + turns[1]
    a, b = list(second.generate(prompt, PARAMS)), list(plain.generate(prompt, PARAMS))
    assert a[-1].completion_ids == b[-1].completion_ids
    assert len(turns[0]) + len(reply) <= a[0].cached_tokens < len(prompt)
    assert second.cache.stats().tiers["ssd"]["num_promoted_blocks"] > 0
    second.cache.check_integrity()
    second.close()


@pytest.mark.parametrize(("engine", "name"), TORCH_CASES + MLX_CASES)
def test_family_parallel_requests_equal_one_by_one(engine, name, loaded):
    """Three chats at once (their decode steps batched where the engine batches the family's
    layer kinds) reply as each does alone without the cache."""
    cached, plain, tokenizer = engines_for(loaded, engine, name)
    first = chat_turns(tokenizer)[0]
    prompts = [first + tokenizer.encode(f" {i} " + USER_TURNS[i], add_special_tokens=False)
               for i in range(3)]  # fmt: skip
    want = [list(plain.generate(p, PARAMS))[-1].completion_ids for p in prompts]
    got: list = [None] * len(prompts)
    gate = threading.Barrier(len(prompts))

    def run(i):
        gate.wait()
        got[i] = list(cached.generate(prompts[i], PARAMS))[-1].completion_ids

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == want
    cached.cache.check_integrity()
    stats = cached.cache_stats()
    assert stats["num_pinned_blocks"] == 0
    runner = cached.runner
    if runner.batches_decode([runner.new_state(), runner.new_state()]):
        assert stats["max_batch_rows"] >= 2, stats  # the decodes really shared forwards


BOTH_HF = [n for n in FAMILY_NAMES if n not in MLX_CONVERTED]


@pytest.mark.parametrize("name", [*BOTH_HF, "gemma3-rope"])
def test_both_engines_read_the_same_checkpoint_as_the_same_model(name, checkpoints, tmp_path):
    """The HF folder on torch and on mlx gives the same next-token logits: mlx-lm reads
    transformers 5's config as transformers means it (RoPE per layer type, no-RoPE models,
    tagged infinities, renamed fields). ``gemma3-rope``: non-default RoPE bases per layer type."""
    pytest.importorskip("mlx_lm")
    import numpy as np

    from promptcache.engines.mlx.engine import MlxEngine
    from promptcache.engines.torch.engine import TorchEngine

    folder = Path(checkpoints(name.removesuffix("-rope")))
    if name.endswith("-rope"):
        for item in folder.iterdir():
            (tmp_path / item.name).symlink_to(item)
        config = json.loads((folder / "config.json").read_text())
        config["rope_parameters"] = {
            "full_attention": {"rope_theta": 20000.0, "rope_type": "default"},
            "sliding_attention": {"rope_theta": 500.0, "rope_type": "default"},
        }
        (tmp_path / "config.json").unlink()
        (tmp_path / "config.json").write_text(json.dumps(config))
        folder = tmp_path
    logits = []
    for cls in (TorchEngine, MlxEngine):
        model, tokenizer = cls.load_weights(folder)
        engine = cls(model, tokenizer, cache_enabled=False)
        _, out, _, _ = engine.prefill(chat_turns(tokenizer)[0])
        logits.append(np.asarray(engine.to_numpy(out), dtype=np.float64))
    scale = float(np.abs(logits[0]).max())
    assert float(np.abs(logits[0] - logits[1]).max()) <= 1e-3 * max(scale, 1.0), name


def chat_turns(tokenizer):
    first = f"<|im_start|>user\n{USER_TURNS[0]}<|im_end|>\n<|im_start|>assistant\n"
    nxt = f"<|im_end|>\n<|im_start|>user\n{USER_TURNS[1]}<|im_end|>\n<|im_start|>assistant\n"
    return [tokenizer.encode(t, add_special_tokens=False) for t in (first, nxt)]


@pytest.mark.parametrize("name", ["qwen3_5_moe-vl", "gpt_oss"])
def test_mlx_4bit_conversion_conversation_equals_uncached(name, tmp_path):
    """A 4-bit MLX conversion (bfloat16 scales, the MoE experts quantized too) of the checkpoint
    layout serves the same chat as without the cache."""
    pytest.importorskip("mlx_lm")
    from promptcache.engines.mlx.engine import MlxEngine

    folder = save_mlx_family(name, tmp_path / "q4", bits=4)
    model, tokenizer = MlxEngine.load_weights(folder)
    kinds = {type(m).__name__ for _, m in model.named_modules()}
    assert "QuantizedSwitchLinear" in kinds, kinds  # the experts are 4-bit
    opts = dict(block_size=BLOCK, prefill_chunk=CHUNK)
    cached = MlxEngine(model, tokenizer, ram_budget=10**8, **opts)
    plain = MlxEngine(model, tokenizer, cache_enabled=False, **opts)
    turns = run_conversation(cached, plain, tokenizer)
    ROWS.append(format_row(f"mlx {name} (4-bit mlx layout)", turns))
    assert all(t.is_equal and reuse_ok(t) for t in turns), turns
    cached.cache.check_integrity()


def test_layer_kinds_come_from_the_librarys_cache_objects(loaded):
    """Nemotron-H's blocks: Mamba (snapshot), attention (positional), an MLP whose cache layer
    holds nothing (stored nowhere), Mamba."""
    cached, _, _ = engines_for(loaded, "torch", "nemotron_h")
    assert cached.layout.kinds[2] == "DummyLayer"
    assert (cached.layout.positional, cached.layout.snapshot) == ((1,), (0, 3))


def test_checkpoint_layout_nests_the_decoder(checkpoints):
    """The -vl checkpoints are the real layout: text_config + vision_config, the decoder's
    weights under model.language_model, a vision tower beside them."""
    from safetensors import safe_open

    folder = checkpoints("qwen3_5_moe-vl")
    config = json.loads(Path(folder, "config.json").read_text())
    assert "text_config" in config and "vision_config" in config
    assert config["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    with safe_open(f"{folder}/model.safetensors", "np") as f:
        keys = list(f.keys())
    assert any(k.startswith("model.language_model.layers.") for k in keys)
    assert any(k.startswith("model.visual.") for k in keys)


def test_mlx_refuses_what_mlx_lm_cannot_read_with_what_to_use(checkpoints):
    pytest.importorskip("mlx_lm")
    from promptcache.engines.mlx.runner import load_mlx_weights

    with pytest.raises(ConfigError, match="--engine torch"):
        load_mlx_weights(checkpoints("gpt_oss"))


def test_mlx_moe_in_bfloat16_falls_back_to_float32(checkpoints, caplog):
    """mlx's CPU backend has GatherMM for float32 only: the one-token forward at load finds it
    and the model is cast, said in the log, instead of a 500 on every request."""
    pytest.importorskip("mlx_lm")
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from promptcache.engines.mlx.runner import load_mlx_weights

    if mx.default_device() != mx.cpu:
        pytest.skip("GatherMM is float32-only on mlx's CPU backend")
    with caplog.at_level("WARNING", logger="promptcache"):
        model, _ = load_mlx_weights(checkpoints("qwen3_moe"), dtype="bfloat16")
    assert {v.dtype for _, v in tree_flatten(model.parameters())} == {mx.float32}
    assert "casting the model to float32" in caplog.text


def test_mlx_reads_the_decoders_sizes_from_text_config(checkpoints):
    """mlx-lm keeps a vision-language checkpoint's sizes in text_config: the runner's context,
    vocabulary and head size come from there (the head size checks --kv-group-size)."""
    pytest.importorskip("mlx_lm")
    from promptcache.engines.mlx.runner import MlxRunner, load_mlx_weights

    folder = checkpoints("qwen3_5-vl")
    text_config = json.loads(Path(folder, "config.json").read_text())["text_config"]
    model, tokenizer = load_mlx_weights(folder)
    runner = MlxRunner(model, tokenizer)
    assert (runner.model_limit, runner.vocab_size) == (4096, text_config["vocab_size"])
    with pytest.raises(ConfigError, match="head size 16"):
        MlxRunner(model, tokenizer, kv_bits=4, kv_group_size=32)


@pytest.mark.parametrize("engine", ["torch", "mlx"])
def test_context_extension_of_a_nested_decoder_is_refused_clearly(engine, checkpoints):
    from promptcache.models import ContextExtensionError

    if engine == "mlx":
        pytest.importorskip("mlx_lm")
        from promptcache.engines.mlx.runner import load_mlx_weights as load
    else:
        from promptcache.engines.torch.loading import load_torch_weights as load
    with pytest.raises(
        ContextExtensionError, match="native context of 4096 tokens and cannot be reached"
    ):
        load(checkpoints("qwen3_5-vl"), max_context=8192)


@pytest.mark.parametrize("engine", ["torch", "mlx"])
def test_an_architecture_the_library_lacks_is_a_config_error(engine, checkpoints, tmp_path):
    if engine == "mlx":
        pytest.importorskip("mlx_lm")
        from promptcache.engines.mlx.runner import load_mlx_weights as load
    else:
        from promptcache.engines.torch.loading import load_torch_weights as load
    folder = Path(checkpoints("llama"))
    for item in folder.iterdir():
        (tmp_path / item.name).symlink_to(item)
    config = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "no_such_arch"}))
    with pytest.raises(ConfigError, match="cannot load .*no_such_arch"):
        load(tmp_path)
