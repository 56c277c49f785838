"""A failure inside the stepping thread is never silent: the requests it held end with a 5xx in
their API's error shape, it is logged once with its traceback and counted, the cache's books
are checked before the next step, and the thread keeps serving."""

import logging

import pytest

torch = pytest.importorskip("torch")

from promptcache.engines.base import SamplingParams  # noqa: E402
from promptcache.engines.torch.engine import TorchEngine  # noqa: E402
from promptcache.serving.scheduler import StepFailure  # noqa: E402
from promptcache.testing.tiny_models import ByteTokenizer, tiny_model  # noqa: E402

PROMPT = list(range(3, 40))


def make_engine():
    return TorchEngine(tiny_model("llama"), ByteTokenizer(), block_size=8, ram_budget="8MB")


def text_of(engine, prompt):
    """The greedy reply's token ids."""
    events = list(engine.generate(prompt, SamplingParams(max_tokens=4)))
    return events[-1].completion_ids


class FailOnce:
    """Wraps a callable: raises ``exc`` on its first call, then behaves."""

    def __init__(self, fn, exc):
        self.fn, self.exc, self.num_calls = fn, exc, 0

    def __call__(self, *args, **kw):
        self.num_calls += 1
        if self.num_calls == 1:
            raise self.exc
        return self.fn(*args, **kw)


def test_a_bug_in_a_step_ends_its_requests_logs_once_and_checks_the_books(monkeypatch, caplog):
    engine = make_engine()
    expected = text_of(engine, PROMPT)
    checks = FailOnce(engine.cache.check_integrity, AssertionError("never raised: first call"))
    checks.num_calls = 1  # count the checks only
    engine.scheduler.check_state = checks
    monkeypatch.setattr(engine.cache, "lookup", FailOnce(engine.cache.lookup, KeyError("boom")))
    with caplog.at_level(logging.ERROR, logger="promptcache"), pytest.raises(StepFailure) as info:
        list(engine.generate(PROMPT, SamplingParams(max_tokens=4)))
    assert isinstance(info.value.__cause__, KeyError)
    logged = [r for r in caplog.records if "engine step failed" in r.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info is not None
    assert engine.cache_stats()["num_step_failures"] == 1
    # the next request runs, after the books were checked once, and is served as before
    assert text_of(engine, PROMPT) == expected
    assert checks.num_calls == 2
    assert engine.cache_stats()["num_integrity_failures"] == 0
    assert engine.cache.stats().num_pinned_blocks == 0


def test_damage_found_after_a_failed_step_is_counted(monkeypatch):
    engine = make_engine()
    text_of(engine, PROMPT)

    def damaged():
        raise AssertionError("accounted 1 != held 2")

    engine.scheduler.check_state = damaged
    monkeypatch.setattr(engine.cache, "lookup", FailOnce(engine.cache.lookup, RuntimeError("x")))
    with pytest.raises(StepFailure):
        list(engine.generate(PROMPT, SamplingParams(max_tokens=4)))
    text_of(engine, PROMPT)
    stats = engine.cache_stats()
    assert stats["num_step_failures"] == 1 and stats["num_integrity_failures"] == 1


def test_a_failing_release_does_not_kill_the_stepping_thread(monkeypatch, caplog):
    engine = make_engine()
    text_of(engine, PROMPT)
    real = engine.cache._release
    monkeypatch.setattr(engine.cache, "_release", FailOnce(real, KeyError("books")))
    with caplog.at_level(logging.ERROR, logger="promptcache"):
        first = text_of(engine, PROMPT)  # its reply is whole: the release comes after it
        second = text_of(engine, PROMPT)
    assert first == second
    assert engine.cache_stats()["num_step_failures"] == 1
    assert not [r for r in caplog.records if "Exception in thread" in r.getMessage()]


@pytest.mark.parametrize(
    ("path", "body", "shape"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "openai"),
        ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}]}, "anthropic"),
        ("/api/chat", {"messages": [{"role": "user", "content": "hi"}], "stream": False}, "ollama"),
    ],
)
def test_unexpected_errors_come_back_in_the_apis_error_shape(monkeypatch, path, body, shape):
    from fastapi.testclient import TestClient

    from promptcache.server.app import create_app
    from promptcache.server.state import Limits, ServerState

    engine = make_engine()
    app = create_app(ServerState(engine, limits=Limits(loopback_only=False)))
    body = {"model": "m", "max_tokens": 4, **body}
    with TestClient(app, raise_server_exceptions=False) as client:
        # a bug outside the engine: the handler itself raises something no handler maps
        monkeypatch.setattr(engine, "encode_chat", FailOnce(engine.encode_chat, KeyError("k")))
        r = client.post(path, json=body)
        assert r.status_code == 500
        assert r.headers["content-type"].startswith("application/json")
        error = r.json()
        if shape == "openai":
            assert error["error"]["type"] == "api_error" and "KeyError" in error["error"]["message"]
        elif shape == "anthropic":
            assert error["type"] == "error" and error["error"]["type"] == "api_error"
        else:
            assert "KeyError" in error["error"]
        # a bug inside a step: a 500 in the same shape, then the server serves again
        monkeypatch.setattr(engine.cache, "lookup", FailOnce(engine.cache.lookup, KeyError("s")))
        r = client.post(path, json=body)
        assert r.status_code == 500 and r.headers["content-type"].startswith("application/json")
        assert client.post(path, json=body).status_code == 200
        metrics = client.get("/metrics").text
        assert "promptcache_cache_num_step_failures_total 1" in metrics or (
            "promptcache_cache_num_step_failures 1" in metrics
        )
