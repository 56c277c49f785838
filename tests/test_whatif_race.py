"""The race that picks the adaptive default's leader: nothing counted before a miniature
evicts, a small lead switching only when its sign is consistent, an early lead fading within the
race's horizon, and the what-if's leader following the race on a real cache."""

import os
import sys

from promptcache.core.cache import PromptCache
from promptcache.core.minisim import MiniCache
from promptcache.core.policies import make_policy
from promptcache.core.race import (
    MARGIN_Z_PER_SWITCH,
    RACE_FULLS,
    SWITCH_MARGIN,
    SWITCH_Z,
    Decayed,
    Race,
)
from promptcache.core.replay import TraceRequest, null_slicer, prompt_tokens

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from make_traces import SHAPES  # noqa: E402


def hashes(*ids):
    return [i.to_bytes(16, "little") for i in ids]


def test_lookups_before_any_miniature_evicts_are_not_counted():
    sims = [MiniCache(make_policy(p), 4, 100) for p in ("lru", "s3fifo")]
    d = Decayed(sims, 1e6, 1e6)
    root = b"\0" * 16
    for chain in (hashes(1, 2), hashes(1, 2, 3), hashes(1, 2, 3, 4)):
        d.lookup(chain)
        d.save(root, chain)
    # the lookups came while 4 blocks still fitted in 4: all policies held the same
    assert d.volume > 0 and d.race is not None and d.race.volume == 0
    d.lookup(hashes(1, 2))  # now full: the next new block evicts, and lookups tell policies apart
    assert d.race.volume == 2


def feed(race, diffs, num_blocks):
    """Lookups where candidate 1 hit ``d`` more sampled blocks than candidate 0."""
    for d in diffs:
        race.add([max(0, -d), max(0, d)], num_blocks)


def test_a_big_lead_switches_a_small_one_only_when_consistent():
    race = Race(2, 1e12, rate=4)
    feed(race, [1] * 10, 100)  # lead 0.01 of the volume, z = sqrt(10)
    assert race.challenger(0) == 1 and race.challenger(1) is None

    lucky = Race(2, 1e12, rate=4)
    feed(lucky, [1] * 3, 10)  # the same lead, but three blocks of it: luck
    assert lucky.challenger(0) is None
    feed(lucky, [1] * 6, 10)  # nine
    assert lucky.challenger(0) == 1

    consistent = Race(2, 1e12, rate=4)
    feed(consistent, [1] * 30, 333)  # lead 0.003: under the margin, but z = sqrt(30)
    lead = 30 / (30 * 333)
    assert 0.002 < lead < SWITCH_MARGIN
    assert consistent.significance(1, 0) > SWITCH_Z and consistent.challenger(0) == 1

    noisy = Race(2, 1e12, rate=4)
    feed(noisy, [1] * 100 + [-1] * 70, 10_000 // 170)  # the same lead, as a coin's luck
    assert noisy.significance(1, 0) < SWITCH_Z
    assert noisy.challenger(0) is None

    tiny = Race(2, 1e12, rate=4)
    feed(tiny, [1] * 200, 1000)  # z = 14, but a lead of 0.001 is not worth a hand-over
    assert tiny.challenger(0) is None

    dense = Race(2, 1e12, rate=2)  # a sampled block is 2 live ones: the lead must be 32 of those
    feed(dense, [1] * 9, 10)
    assert dense.challenger(0) is None
    feed(dense, [1] * 8, 10)  # seventeen
    assert dense.challenger(0) == 1


def test_each_hand_over_makes_a_lead_won_in_one_lookup_need_more_significance():
    """One lookup of 30 blocks that only candidate 1 hit, then 20 where candidate 0 hit one
    more: the lead passes the margin but is a third of its noise. A fresh race takes it; a race
    that has already changed hands often (an agent's lookups swinging it) does not, while a
    lead as large that holds lookup after lookup still switches it."""

    def one_big_win():
        race = Race(2, 1e12, rate=4)
        feed(race, [30] + [-1] * 20, 50)
        return race

    race = one_big_win()
    assert (race.hits[1] - race.hits[0]) / race.volume > SWITCH_MARGIN
    z = race.significance(1, 0)
    assert 0 < z < 1
    assert race.challenger(0) == 1 and race.challenger(0, num_switches=1) == 1
    many = round(1 / MARGIN_Z_PER_SWITCH)
    assert one_big_win().challenger(0, num_switches=many) is None

    steady = Race(2, 1e12, rate=4)
    feed(steady, [1] * 10, 100)  # the same margin, z = sqrt(10)
    assert steady.challenger(0, num_switches=many) == 1


def test_an_early_lead_fades_within_the_race_horizon():
    """Candidate 1 wins the first cache-fulls (a cold start), candidate 0 the steady state:
    the race hands back within a few horizons; a decay as long as the curve's would not."""
    cap = 100
    short, long = Race(2, RACE_FULLS * cap, 4), Race(2, 32 * RACE_FULLS * cap, 4)
    for race in (short, long):
        feed(race, [1] * 200, 10)  # 2,000 sampled blocks of candidate 1 leading by 10%
    for race in (short, long):
        feed(race, [-1] * 150, 10)  # then candidate 0 leads by 10% for 1,500
    assert short.challenger(1) == 0
    assert long.challenger(1) is None


def test_the_leader_follows_the_race_on_a_real_cache():
    """A loop a little longer than the cache: LRU and frecency hit little, S3-FIFO keeps part
    of it. The race counts nothing before the miniatures fill; the default then hands the live
    cache to S3-FIFO, and the tier stays consistent."""
    block, cap = 8, 600
    cache = PromptCache("t", block_size=block, ram_budget=cap * block, policy="adaptive")
    whatif = cache.whatif
    volumes = []
    for i, d in enumerate(SHAPES["loop"](1, 0.5, block)):
        req = TraceRequest(i, d["input_length"], 0, d["hash_ids"])
        seq = cache.sequence(prompt_tokens(req, block))
        cache.lookup(seq).release()
        cache.save(seq, None, null_slicer)
        if whatif.live is not None and whatif.live.race is not None:
            volumes.append((whatif.live.race.volume, whatif.num_switches))
        if i % 200 == 0:
            cache.check_integrity()
    assert volumes[0] == (0, 0) and volumes[-1][0] > 0
    assert all(n == 0 for v, n in volumes if v == 0)  # no switch before the race counts
    assert whatif.policy_names[whatif.leader] == "s3fifo"
    assert cache.ram.policy.policy.name == "s3fifo"  # the live cache follows it
