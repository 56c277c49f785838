"""Which race the live cache follows: the fast race until its hand-overs cost more than standing
still on the slow race's pick, judged by two miniatures that follow each, hand-overs and all."""

from promptcache.core.follow import START_AFTER_SWITCHES, Following
from promptcache.core.minisim import MiniCache
from promptcache.core.policies import make_policy
from promptcache.core.race import RACE_FULLS, Decayed, Race

ROOT = b"\0" * 16
NAMES = ("lru", "s3fifo")
CAPACITY = 20  # sampled blocks in a miniature
LOOP = 26  # one-block prompts visited in turn: LRU never hits, S3-FIFO keeps some


def run(following: Following, race: Race, schedule: list[list[float]], rounds: int) -> None:
    """Each lookup: the candidates' race sees ``schedule``'s hits, in turn; the followers'
    miniatures see the loop's next prompt."""
    n = 0
    for _ in range(rounds):
        for got in schedule:
            chain = [(n % LOOP + 1).to_bytes(16, "little")]
            n += 1
            race.add(got, 1.0)
            if race.volume:
                following.lookup(chain, 0.0, got, CAPACITY, 100)
            following.save(ROOT, chain, 0.0)


def make() -> tuple[Following, Race]:
    race = Race(len(NAMES), RACE_FULLS * CAPACITY, rate=1)
    return Following(race, NAMES, CAPACITY, rate=1), race


def test_a_race_that_keeps_changing_its_mind_gives_way_to_the_slow_one():
    following, race = make()
    # S3-FIFO ahead over every 400 lookups, LRU ahead in bursts of 150 that turn the fast race
    swings = [[1.0, 0.0]] * 150 + [[0.0, 1.0]] * 250
    run(following, race, swings, rounds=2)
    assert following.fast.num_switches >= START_AFTER_SWITCHES and len(following.sims) == 2
    run(following, race, swings, rounds=40)
    fast, slow = following.fast, following.slow
    assert fast.num_switches > 20 and slow.num_switches <= 3
    # the fast follower lost its hits to the LRU spells and the hand-overs; the slow one, on
    # S3-FIFO throughout, hit more, and the live cache follows it
    judge = following.judge
    assert judge.hits[1] > judge.hits[0] * 1.05
    assert following.is_slow and following.pick == NAMES.index("s3fifo") == slow.pick


def block(i: int) -> list[bytes]:
    return [i.to_bytes(16, "little")]


def loop(start: int, n: int) -> list[list[bytes]]:
    """``n`` one-block prompts over a loop just above the cache: S3-FIFO keeps some, LRU none."""
    return [block(start + i % LOOP) for i in range(n)]


def reuse_once(start: int, n: int) -> list[list[bytes]]:
    """New prompts each asked again 8 prompts later: LRU keeps them, S3-FIFO's small queue
    has let them go."""
    out = []
    for i in range(n // 2):
        out.append(block(start + i))
        if i >= 8:
            out.append(block(start + i - 8))
    return out


def test_the_fast_race_keeps_the_lead_where_following_it_pays():
    # long phases, each won by another policy, measured by the candidates' own miniatures
    sims = [MiniCache(make_policy(p), CAPACITY, 100) for p in NAMES]
    live = Decayed(sims, 32.0 * CAPACITY, RACE_FULLS * CAPACITY, rate=1)
    assert live.race is not None
    following = Following(live.race, NAMES, CAPACITY, rate=1)
    phases = [loop(10_000 * k, 3000) if k % 2 else reuse_once(10_000 * k, 3000) for k in range(6)]
    for chain in (c for phase in phases for c in phase):
        got = live.lookup(chain)
        if live.race.volume:
            following.lookup(chain, 0.0, got, CAPACITY, 100)
        live.save(ROOT, chain)
        following.save(ROOT, chain, 0.0)
    assert following.fast.num_switches >= 4 and len(following.sims) == 2
    judge = following.judge
    assert judge.volume > 0 and judge.hits[0] > judge.hits[1]
    assert not following.is_slow and following.pick == following.fast.pick


def test_a_race_that_picked_once_never_starts_the_followers():
    following, race = make()
    run(following, race, [[0.0, 1.0]], rounds=3000)
    assert following.fast.num_switches == 1 and following.pick == 1
    assert following.sims == [] and following.judge.volume == 0
