"""The engine split: runners take several sequences, layer kinds come from a registry, errors
say whose fault they are (client 4xx, server 5xx, configuration: a clean CLI exit)."""

import pytest

torch = pytest.importorskip("torch")

from promptcache.engines.base import (  # noqa: E402
    CacheSaveError,
    ConfigError,
    EngineFailure,
    RequestError,
    SamplingParams,
)
from promptcache.engines.torch.engine import TorchEngine  # noqa: E402
from promptcache.testing.tiny_models import ByteTokenizer, tiny_model  # noqa: E402


def test_error_families():
    assert issubclass(RequestError, ValueError)  # callers validating input still catch it
    assert not issubclass(EngineFailure, ValueError) and not issubclass(ConfigError, ValueError)
    assert not issubclass(ConfigError, SystemExit)


def test_runner_forward_takes_several_sequences():
    engine = TorchEngine(tiny_model("llama"), ByteTokenizer(), cache_enabled=False)
    runner = engine.runner
    a, b = [5, 6, 7, 8], [9, 10]
    both = runner.forward([runner.new_state(), runner.new_state()], [a, b])
    alone = [runner.forward([runner.new_state()], [ids])[0] for ids in (a, b)]
    assert len(both) == 2
    for got, want in zip(both, alone, strict=True):
        assert (got - want).abs().max().item() == 0


def test_layer_registry_classifies_and_unknown_kinds_are_snapshots():
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    from promptcache.engines.torch.state import FULL_ATTENTION, LAYERS, SNAPSHOT, TorchLayer
    from promptcache.serving.layers import AdapterRegistry

    assert LAYERS.lookup(DynamicLayer()) is FULL_ATTENTION
    assert LAYERS.lookup(DynamicSlidingWindowLayer(sliding_window=4)) is SNAPSHOT

    class NewLayer(DynamicLayer):  # a subclass may hold more state: snapshot until registered
        pass

    assert LAYERS.lookup(NewLayer()) is SNAPSHOT
    registry: AdapterRegistry[TorchLayer] = AdapterRegistry(default=SNAPSHOT)
    registry.register(NewLayer, FULL_ATTENTION)
    assert registry.lookup(NewLayer()) is FULL_ATTENTION


def test_a_cache_refusing_a_save_is_a_server_failure_not_a_bad_request():
    # 2 KB of RAM: the first block of the tiny model's K/V does not fit the whole budget
    engine = TorchEngine(tiny_model("llama"), ByteTokenizer(), block_size=8, ram_budget=2000)
    with pytest.raises(CacheSaveError, match="RAM budget") as info:
        list(engine.generate(list(range(3, 40)), SamplingParams(max_tokens=2)))
    assert not isinstance(info.value, ValueError)
    assert engine.cache.stats().num_pinned_blocks == 0

    from fastapi.testclient import TestClient

    from promptcache.server.app import create_app
    from promptcache.server.state import Limits, ServerState

    app = create_app(ServerState(engine, limits=Limits(loopback_only=False)))
    with TestClient(app, raise_server_exceptions=False) as client:
        body = {"model": "m", "prompt": list(range(3, 40)), "max_tokens": 2}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 500 and r.json()["error"]["type"] == "api_error"
        r = client.post("/v1/completions", json={**body, "prompt": []})
        assert r.status_code == 400  # the client's mistakes stay 4xx


def test_bad_configuration_is_a_config_error_and_a_clean_cli_exit(capsys):
    from promptcache.cli.main import main
    from promptcache.engines.factory import build_engine, engine_class

    with pytest.raises(ConfigError, match="unknown engine"):
        engine_class("tpu")
    with pytest.raises(ConfigError, match="--kv-bits needs --engine mlx"):
        build_engine("torch", kv_bits=4)
    with pytest.raises(ConfigError, match="prefill_chunk"):
        TorchEngine(tiny_model("llama"), ByteTokenizer(), prefill_chunk=0)
    with pytest.raises(ConfigError, match="not a size"):
        TorchEngine(tiny_model("llama"), ByteTokenizer(), ram_budget="lots")
    assert main(["serve", "--engine", "tpu", "--no-ssd"]) == 2
    err = capsys.readouterr().err
    assert "promptcache: unknown engine 'tpu'" in err and "Traceback" not in err


def test_scheduler_interleaves_a_short_request_into_a_long_prefill():
    """A short request that arrives during a long prefill is served between its chunks (it
    joins the running batch at the next step, its chunk first), not after it."""
    import threading
    import time

    engine = TorchEngine(tiny_model("llama"), ByteTokenizer(), cache_enabled=False, prefill_chunk=8)
    steps: list[int] = []
    advance = engine.batcher.advance_batch

    def logged(reqs):
        steps.extend(len(r.prompt) for r in reqs)
        return advance(reqs)

    engine.batcher.advance_batch = logged  # type: ignore[method-assign]  (looked up per step)
    long_prompt = [3 + i % 200 for i in range(400)]  # 50 chunks
    done = threading.Event()

    def long_request():
        list(engine.generate(long_prompt, SamplingParams(max_tokens=1)))
        done.set()

    t = threading.Thread(target=long_request)
    t.start()
    while steps.count(400) < 3:
        time.sleep(0.001)
    events = list(engine.generate([5, 6, 7, 8], SamplingParams(max_tokens=2)))
    long_steps_meanwhile = steps.count(400)
    t.join()
    assert events[-1].reason in ("length", "stop") and done.is_set()
    assert long_steps_meanwhile < 20, long_steps_meanwhile  # of 50 prefill chunks
    assert steps.count(4) >= 2  # begin, the prompt's one chunk (+ a token)


def test_mlx_layer_registry():
    pytest.importorskip("mlx_lm")
    from mlx_lm.models.cache import ArraysCache, CacheList, ChunkedKVCache, KVCache

    from promptcache.engines.mlx.state import LAYERS, SNAPSHOT, describe_cache

    assert LAYERS.lookup(KVCache()).num_arrays == 2 and LAYERS.lookup(KVCache()).positional
    assert LAYERS.lookup(ArraysCache(2)) is SNAPSHOT
    assert LAYERS.lookup(ChunkedKVCache(8)) is SNAPSHOT  # unregistered: the safe default
    layout = describe_cache([CacheList(ArraysCache(2), KVCache()), KVCache()])
    assert layout.kinds == ("ArraysCache", "KVCache", "KVCache")
    assert [tuple(s) for s in layout.positional] == [(0, 1), (1, -1)]
    assert [tuple(s) for s in layout.snapshot] == [(0, 0)]
