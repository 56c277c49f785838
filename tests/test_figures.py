"""Typed figures (``core/figures.py``): each stats object's JSON and its ``/metrics`` series come
from the same values, every number is shown with a declared kind, and the exposition is one a
Prometheus scraper reads."""

from __future__ import annotations

from core_helpers import make_slicer
from exposition import read_exposition

from promptcache.core.cache import PromptCache
from promptcache.core.figures import Series, Snapshot, render_series
from promptcache.core.tiers.factory import build_tiers

BLOCK = 4
NOT_SHOWN = {
    "block_size",
    "ram_ttl_s",
    "reload_bytes_per_s",
    "last_error",
}  # settings, rates, texts


def tokens(seed: int, n: int) -> list[int]:
    return [(seed * 31 + i * 7) % 200 + 3 for i in range(n)]


def numbers(values: dict, prefix: str = "") -> dict[str, float]:
    """Every number of a JSON stats object (bools are flags, not figures)."""
    out = {}
    for k, v in values.items():
        if isinstance(v, bool) or k in NOT_SHOWN:
            continue
        if isinstance(v, int | float):
            out[prefix + k] = v
    return out


def test_cache_stats_json_and_series_agree(tmp_path):
    tiers = build_tiers(fingerprint="f" * 32, ssd_dir=tmp_path, ssd_budget="1MB")
    cache = PromptCache("f" * 32, block_size=BLOCK, ram_budget=10**6, next_tier=tiers)
    for seed in (1, 2, 1, 3, 1):
        a = tokens(seed, 13)
        seq = cache.sequence(a)
        with cache.lookup(seq):
            pass
        cache.save(seq, None, make_slicer(a))
    cache.tiers.settle()
    cache.check_integrity()
    stats = cache.stats()
    values = stats.to_dict()
    series = {s.name: s for s in stats.series()}
    # every top-level number and every tier's number is a series with the same value
    shown = numbers(values)
    for tier, snap in values["tiers"].items():
        shown.update(numbers(snap, f"{tier}_"))
    missing = [k for k in shown if k not in series]
    assert not missing, missing
    for name, value in shown.items():  # a histogram's JSON number is its sum of observations
        s = series[name]
        assert (s.total if s.kind == "histogram" else s.value) == value, name
    # kinds are declared, not read from the name: num_blocks is a level, num_hits only grows
    assert series["num_blocks"].kind == "gauge" and series["num_hits"].kind == "counter"
    assert (
        series["ssd_bytes_written"].kind == "counter" and series["ssd_used_bytes"].kind == "gauge"
    )
    assert series["hits_by_kind"].label == "kind" and series["bytes_by_tier"].label == "tier"
    assert series["ssd_reload_seconds"].kind == "histogram"
    assert values["num_hits"] >= 2 and values["tiers"]["ssd"]["num_writes"] > 0
    families = read_exposition("\n".join(render_series(stats.series(), "promptcache_cache_")))
    assert families["promptcache_cache_ssd_num_writes"]["kind"] == "counter"
    assert families["promptcache_cache_policy_leader"]["samples"] == {
        ("promptcache_cache_policy_leader", "policy", values["policy_leader"]): 1.0
    }
    cache.close()


def test_series_render_labels_and_histograms():
    lines = render_series(
        [
            Series("by_tier", "gauge", {"ram": 3, "ssd": 4}, "tier"),
            Series("rtt", "histogram", {"0.1": 2, "1.0": 1, "+Inf": 1}, total=2.5),
            Series("rate", "gauge", 0.25),
        ],
        "p_",
    )
    families = read_exposition("\n".join(lines))
    assert families["p_by_tier"]["samples"][("p_by_tier", "tier", "ssd")] == 4
    rtt = families["p_rtt"]["samples"]
    # Prometheus buckets count everything up to their bound: 2, 3, 4
    assert [rtt[("p_rtt_bucket", "le", b)] for b in ("0.1", "1.0", "+Inf")] == [2, 3, 4]
    assert rtt[("p_rtt_sum", None, None)] == 2.5 and rtt[("p_rtt_count", None, None)] == 4
    assert "p_rate 0.25" in lines


def test_snapshot_reads_as_a_mapping():
    snap = Snapshot({"a": 1}, (Series("a", "counter", 1),))
    assert snap["a"] == 1 and dict(snap) == {"a": 1} and snap.to_dict() == {"a": 1}
    assert not Snapshot({}) and [s.name for s in snap.series()] == ["a"]
