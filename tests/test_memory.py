"""Memory the server can account for: the running requests' model state next to the RAM tier
and the resident set, and ``max_live_bytes`` queueing a newcomer instead of growing past it."""

import subprocess
import sys
import threading
import time

import pytest

torch = pytest.importorskip("torch")

from promptcache.engines.base import SamplingParams  # noqa: E402
from promptcache.engines.torch.buffers import REUSE_CLASSES_ABOVE, size_class  # noqa: E402
from promptcache.engines.torch.engine import TorchEngine  # noqa: E402
from promptcache.engines.torch.ragged import ROOM  # noqa: E402
from promptcache.engines.torch.state import held_bytes  # noqa: E402
from promptcache.serving import memory_books  # noqa: E402
from promptcache.serving.memory import HeapTrim, rss_bytes  # noqa: E402
from promptcache.testing.tiny_models import ByteTokenizer, tiny_model  # noqa: E402

PROMPTS = [[3 + (7 * i + j) % 200 for j in range(60 + 9 * i)] for i in range(4)]


def reply(engine, prompt):
    return list(engine.generate(prompt, SamplingParams(max_tokens=12)))[-1].completion_ids


def run_concurrently(engine, prompts=PROMPTS):
    out = [None] * len(prompts)

    def one(i):
        out[i] = reply(engine, prompts[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_held_bytes_counts_a_shared_buffer_once_and_a_view_whole():
    from transformers import DynamicCache

    buf = torch.zeros(2, 2, 10, 4)
    a, b = DynamicCache(), DynamicCache()
    a.update(buf[:1], buf[:1], 0)  # a new tensor per update (concatenation): own buffers
    b.layers = a.layers
    assert held_bytes([a]) == held_bytes([a, b]) == 2 * buf[:1].nbytes
    a.layers[0].keys = buf[0:1, :, :3]  # a view: keeps all of buf
    assert held_bytes([a]) == buf.nbytes + buf[:1].nbytes


def test_memory_stats_show_the_live_state_while_requests_run():
    engine = TorchEngine(tiny_model("llama"), ByteTokenizer(), block_size=8, ram_budget="4MB")
    seen = []
    real_forward = engine.runner.forward

    def forward(states, ids):
        seen.append(engine.memory_stats())
        return real_forward(states, ids)

    engine.runner.forward = forward
    reply(engine, PROMPTS[0])
    assert max(s["live_state_bytes"] for s in seen) > 0
    assert max(s["live_requests"] for s in seen) == 1
    idle = engine.cache_stats()["memory"]
    assert idle["live_requests"] == 0
    # the resident set, read when the stats were taken (allocations since move it a little)
    assert idle["rss_bytes"] > 0 and abs(idle["rss_bytes"] - rss_bytes()) < 64 * 2**20
    # what the cache holds, against its budget, and the process before any request
    assert 0 < idle["ram_held_bytes"] == engine.cache.ram.held_bytes <= idle["ram_budget_bytes"]
    assert idle["ram_budget_bytes"] == 4_000_000  # "4MB"
    assert 0 < idle["rss_at_start_bytes"] <= idle["rss_bytes"] + 64 * 2**20


def test_max_live_bytes_queues_newcomers_and_replies_stay_the_same():
    plain = TorchEngine(tiny_model("llama"), ByteTokenizer(), block_size=8, cache_enabled=False)
    expected = [reply(plain, p) for p in PROMPTS]
    # room for one running request at a time: every newcomer waits for the one before it
    engine = TorchEngine(
        tiny_model("llama"), ByteTokenizer(), block_size=8, ram_budget="4MB", max_live_bytes=1
    )
    assert run_concurrently(engine) == expected
    stats = engine.cache_stats()
    assert stats["num_admission_waits"] > 0
    assert stats["max_batch_rows"] <= 1
    assert stats["memory"]["max_live_bytes"] == 1
    roomy = TorchEngine(
        tiny_model("llama"), ByteTokenizer(), block_size=8, ram_budget="4MB", max_live_bytes="1GB"
    )
    # a fresh engine has a first bytes-per-token rate (a throwaway prompt's): the first
    # requests are admitted together
    assert roomy.admission.bytes_per_token > 0
    assert run_concurrently(roomy) == expected
    assert roomy.cache_stats()["num_admission_waits"] == 0
    assert roomy.cache_stats()["max_batch_rows"] > 1


def test_by_default_the_running_state_is_capped_by_the_memory_left(monkeypatch):
    plain = TorchEngine(tiny_model("llama"), ByteTokenizer(), block_size=8, cache_enabled=False)
    expected = [reply(plain, p) for p in PROMPTS]
    # plenty left: a cap below what is left, and nobody waits
    roomy = TorchEngine(tiny_model("llama"), ByteTokenizer(), block_size=8, ram_budget="4MB")
    cap = roomy.cache_stats()["memory"]["max_live_bytes"]
    assert 0 < cap <= memory_books.available_ram_bytes()
    assert run_concurrently(roomy) == expected
    assert roomy.cache_stats()["num_admission_waits"] == 0
    # a machine (or a container) whose memory is all but taken: what the RAM tier's budget
    # may still take aside, room for about one prompt's state; newcomers queue
    left = 0
    monkeypatch.setattr(memory_books, "available_ram_bytes", lambda: 4_000_000 + left)
    tight = TorchEngine(tiny_model("llama"), ByteTokenizer(), block_size=8, ram_budget="4MB")
    # a budget that takes it all still leaves the running requests a share of the RAM
    assert tight.max_live_bytes == int(4_000_000 * memory_books.MIN_LIVE_SHARE)
    monkeypatch.setattr(memory_books, "MIN_LIVE_SHARE", 0)
    rate = tight.admission.bytes_per_token
    left = int(rate * len(PROMPTS[-1]) / memory_books.LIVE_SHARE)  # read at the next start
    tight = TorchEngine(tiny_model("llama"), ByteTokenizer(), block_size=8, ram_budget="4MB")
    assert tight.max_live_bytes == pytest.approx(rate * len(PROMPTS[-1]), abs=2)
    assert run_concurrently(tight) == expected
    assert tight.cache_stats()["num_admission_waits"] > 0
    # "off": no cap at all, however little is left
    free = TorchEngine(
        tiny_model("llama"), ByteTokenizer(), block_size=8, ram_budget="4MB", max_live_bytes="off"
    )
    assert free.max_live_bytes is None and free.cache_stats()["memory"]["max_live_bytes"] == 0
    assert run_concurrently(free) == expected
    assert free.cache_stats()["num_admission_waits"] == 0


@pytest.mark.parametrize("kind", ["mamba", "jamba", "llama"])
def test_admission_counts_ssm_state_once_per_request_not_per_token(kind):
    """SSM / linear-attention state is the same size at any context length: the probe at
    start splits it off (per request) from the state that grows (per token), so long prompts
    on a Mamba model are not taken for many times their size."""
    from promptcache.engines.torch.batch_stacked import has_states, held

    engine = TorchEngine(tiny_model(kind), ByteTokenizer(), block_size=8, max_live_bytes="1GB")
    runner, admission = engine.runner, engine.admission
    state = runner.new_state()
    runner.forward([state], [list(range(3, 40))])
    ssm = sum(t.nbytes for x in state.layers if has_states(x) for t in held(x))
    assert admission.bytes_per_request == ssm and (ssm > 0) == (kind != "llama")
    keys = [t for x in state.layers if not has_states(x) for t in (x.keys, x.values)]
    per_token = sum(t.nbytes for t in keys) / 37  # 8-byte length counters aside
    assert admission.bytes_per_token == pytest.approx(per_token, abs=1) or kind == "llama"
    if kind != "mamba":
        return
    # four 300-token prompts under a cap of about 1.5x their fixed state: all run at once
    # (by the probe's bytes per token alone each would look 300 / 64 times as big)
    prompts = [[3 + (5 * i + j) % 200 for j in range(300)] for i in range(4)]
    plain = TorchEngine(tiny_model(kind), ByteTokenizer(), block_size=8, cache_enabled=False)
    expected = [reply(plain, p) for p in prompts]
    cap = int(1.5 * len(prompts) * ssm)
    assert 300 * (ssm / 64) * len(prompts) > cap
    engine = TorchEngine(tiny_model(kind), ByteTokenizer(), block_size=8, max_live_bytes=cap)
    assert run_concurrently(engine, prompts) == expected
    stats = engine.cache_stats()
    assert stats["num_admission_waits"] == 0 and stats["max_batch_rows"] >= 2, stats


def largest_fit(nbytes: int) -> int:
    """The largest pooled mapping that may serve a buffer of ``nbytes`` (a free one is reused
    up to REUSE_CLASSES_ABOVE size classes above its own)."""
    size = size_class(nbytes)
    for _ in range(REUSE_CLASSES_ABOVE):
        size = size_class(size + 1)
    return size


def test_the_state_kept_for_the_next_turn_holds_only_its_own_positions():
    engine = TorchEngine(tiny_model("llama"), ByteTokenizer(), block_size=8, ram_budget="4MB")
    replies = run_concurrently(engine)  # decoded together, several rows a step
    assert engine.cache_stats()["max_batch_rows"] > 1 or pytest.skip("no batch formed")
    state, seq = engine.steps.live
    # each layer's own positions and at most a RowLayer's room ahead, in the largest pooled
    # buffer that may serve it: never a buffer of rows
    n = seq.num_tokens
    tensors = [t for layer in state.layers for t in (layer.keys, layer.values)]
    own = sum(t.nbytes for t in tensors)
    most = sum(largest_fit((n + max(ROOM, n // 4)) * (t.nbytes // n)) for t in tensors)
    assert own <= held_bytes([state]) <= most
    # and the next turn of that conversation still reuses it, with the same reply as uncached
    i = next(k for k, p in enumerate(PROMPTS) if seq.num_tokens == len(p) + len(replies[k]))
    follow = PROMPTS[i] + replies[i] + [5, 6, 7]
    plain = TorchEngine(tiny_model("llama"), ByteTokenizer(), block_size=8, cache_enabled=False)
    assert reply(engine, follow) == reply(plain, follow)


FREED_HEAP_BUFFERS = """
import torch
from promptcache.serving.memory import rss_bytes, trim_heap, tune_malloc
if not tune_malloc():
    raise SystemExit(77)  # not glibc: no thresholds to set, nothing to trim
# 2 MiB buffers (under the mmap threshold: heap) with others between them, big enough to come
# after them rather than from an older hole: the freed ones are holes free() cannot hand back;
# only a trim returns their pages
big, small = [], []
for _ in range(150):
    big.append(torch.ones(2**19))  # 2 MiB, every page touched
    small.append(torch.ones(2**16))  # 256 KiB
held = rss_bytes()
big.clear()
assert rss_bytes() > held - 100 * 2**20, "not resident after free: heap holes expected"
assert trim_heap()
assert rss_bytes() < held - 200 * 2**20, "the trim gave nothing back"
assert len(small) == 150
"""


def test_freed_heap_buffers_leave_when_the_heap_is_trimmed():
    # in a process of its own: an engine of another test in this worker trims the heap when it
    # goes idle, which would hand the holes back between the free and the first check
    run = subprocess.run([sys.executable, "-c", FREED_HEAP_BUFFERS], capture_output=True, text=True)
    if run.returncode == 77:
        pytest.skip("not glibc: no thresholds to set, nothing to trim")
    assert run.returncode == 0, run.stderr


def test_the_engine_trims_the_heap_once_a_load_is_over():
    engine = TorchEngine(tiny_model("llama"), ByteTokenizer(), block_size=8, ram_budget="4MB")
    heap = engine.heap
    assert engine.scheduler.on_idle == heap.on_idle and heap.num_trims == 0
    heap.idle_s = 0.05  # the engine's own hook, sooner
    replies = run_concurrently(engine)
    deadline = time.monotonic() + 10
    while heap.num_trims == 0 and time.monotonic() < deadline:  # the stepping thread ends, then
        time.sleep(0.01)
    assert heap.num_trims >= 1
    assert run_concurrently(engine) == replies  # and the engine serves on after it


def test_under_load_the_heap_is_trimmed_when_rss_passes_the_allowance(monkeypatch):
    engine = TorchEngine(tiny_model("llama"), ByteTokenizer(), block_size=8, ram_budget="4MB")
    heap = engine.heap
    heap.idle_s = 3600  # only the allowance trims here
    heap.check_s = 0
    # what the engine accounts for: the process at start, the 4 MB budget, the live state
    assert heap.allowance() > rss_bytes()
    assert heap.floor() <= heap.allowance()  # the floor: without the live state, no walk
    # with room to spare a tiny model stays within it (its freed heap pages alone can pass the
    # few MiB of slack the engine allows by default, and then a trim is right)
    monkeypatch.setattr(memory_books, "RSS_SLACK_BYTES", 64 << 20)
    asked = []
    allowance = heap.allowance
    heap.allowance = lambda: asked.append(1) or allowance()
    replies = run_concurrently(engine)
    assert heap.num_trims == 0
    assert not asked  # RSS stayed below the floor: the live state was never walked
    heap.floor = lambda: 0
    engine.heap.allowance = lambda: 0  # an RSS past the allowance: every step trims
    assert run_concurrently(engine) == replies
    assert heap.num_trims > 0


def test_an_idle_trim_waits_for_the_engine_to_stay_idle():
    busy = HeapTrim(lambda: False, idle_s=0.01)
    idle = HeapTrim(lambda: True, idle_s=0.01)
    for hook in (busy.on_idle, idle.on_idle, idle.on_idle):  # twice in a row: the wait restarts
        hook()
    time.sleep(0.3)
    assert busy.num_trims == 0
    assert idle.num_trims == 1
    busy.after_step()  # no allowance given: never trims under load
    assert busy.num_trims == 0
