"""The RAM tier's bookkeeping under every interleaving of lookup, promotion, save, pin, unpin,
deletion and expiry: several threads on one real cache (RAM + SSD tier, a budget of a few
blocks), and the same operations as a hypothesis state machine. ``check_integrity()`` (bytes,
tree, pins, and the policy holding exactly the evictable blocks) after every step."""

import random
import threading

import pytest
from core_helpers import assert_restores, make_slicer
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from promptcache.core.cache import PromptCache
from promptcache.core.policies import policy_names
from promptcache.core.tiers.ssd.tier import SsdTier

BLOCK = 4
BUDGET = 64 * 6 + 16  # six 4-token blocks (4 rows x 2 int64) and a little: eviction never stops
NUM_CONVS = 5


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_cache(policy: str, folder, clock: FakeClock, budget: int = BUDGET) -> PromptCache:
    return PromptCache(
        "model-a",
        block_size=BLOCK,
        ram_budget=budget,
        policy=policy,
        next_tier=SsdTier(folder, "model-a", clock=clock),
        clock=clock,
    )


def hand_over(cache: PromptCache, index: int) -> None:
    """Switch the adaptive policy's leader, as its what-if race does: between tier operations."""
    with cache._lock:
        cache.ram.policy.hand_over(index % len(cache.ram.policy.candidate_names))


def release_from_two_threads(lease) -> None:
    """The stepping thread and the request's consumer may both release a finished request."""
    gate = threading.Barrier(2)

    def release() -> None:
        gate.wait()
        lease.release()

    other = threading.Thread(target=release)
    other.start()
    release()
    other.join()


def run_worker(cache, policy, clock, convs, held, held_lock, seed, steps, errors) -> None:
    rng = random.Random(seed)
    try:
        for _ in range(steps):
            k = rng.randrange(NUM_CONVS)
            toks = convs[k] + [rng.randrange(1, 6) for _ in range(rng.randrange(0, 9))]
            session = f"s{k}"
            op = rng.random()
            if op < 0.4:
                seq = cache.sequence(toks, session=session, ttl_s=rng.choice([None, 5.0]))
                lease = cache.lookup(seq)
                assert_restores(lease, toks)
                if rng.random() < 0.3:
                    with held_lock:
                        held.append(lease)
                elif rng.random() < 0.3:
                    release_from_two_threads(lease)
                else:
                    lease.release()
            elif op < 0.75:
                n = rng.randrange(1, len(toks) + 1)
                cache.save(cache.sequence(toks, session=session), n, make_slicer(toks))
            elif op < 0.85:
                with held_lock:
                    lease = held.pop(rng.randrange(len(held))) if held else None
                if lease is not None:  # often released by a thread that did not take it
                    lease.release()
            elif op < 0.88:
                cache.delete_session(session, force=rng.random() < 0.5)
            elif op < 0.91:
                clock.now += rng.choice([0.5, 3.0, 10.0])
                cache.expire()
            elif op < 0.95 and policy == "adaptive":
                hand_over(cache, rng.randrange(3))
            else:
                cache.tiers.flush()
            cache.check_integrity()
    except BaseException as exc:  # reported by the test's thread
        errors.append(exc)


@pytest.mark.parametrize("policy", policy_names())
def test_threads_on_a_tiny_budget_keep_the_books(tmp_path, policy):
    clock = FakeClock()
    cache = make_cache(policy, tmp_path / "cache", clock)
    rng = random.Random(policy)
    convs = [[rng.randrange(1, 4) for _ in range(6)] for _ in range(NUM_CONVS)]
    held: list = []
    held_lock = threading.Lock()
    errors: list[BaseException] = []
    for round_ in range(4):
        threads = [
            threading.Thread(
                target=run_worker,
                args=(cache, policy, clock, convs, held, held_lock, 100 * round_ + i, 150, errors),
            )
            for i in range(4)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
    for lease in held:
        lease.release()
    cache.check_integrity()
    assert all(b.ref_count == 0 for b in cache.ram.tree.index.values())
    cache.close()


class RamTierMachine(RuleBasedStateMachine):
    """One thread, the same operations: hypothesis shrinks a failure to its shortest story."""

    def __init__(self) -> None:
        super().__init__()
        self.cache: PromptCache | None = None
        self.leases: list = []

    @initialize(
        policy=st.sampled_from(policy_names()),
        num_blocks=st.integers(3, 4),
        convs=st.lists(st.lists(st.integers(1, 2), min_size=8, max_size=11), min_size=2,
                       max_size=NUM_CONVS),
    )  # fmt: skip
    def start(self, policy, num_blocks, convs):
        import tempfile

        self.folder = tempfile.TemporaryDirectory()
        self.clock = FakeClock()
        self.policy = policy
        self.convs = convs
        self.cache = make_cache(policy, self.folder.name, self.clock, 64 * num_blocks + 16)
        self.trunk = (convs[0] * 5)[:13]

    def _lookup(self, toks, session, keep):
        lease = self.cache.lookup(self.cache.sequence(toks, session=session))
        assert_restores(lease, toks)
        if keep:
            self.leases.append(lease)
        else:
            lease.release()

    def _save(self, toks, n, session):
        self.cache.save(self.cache.sequence(toks, session=session), n, make_slicer(toks))

    @rule(k=st.integers(0, 9), tail=st.lists(st.integers(1, 3), max_size=8), keep=st.booleans())
    def lookup(self, k, tail, keep):
        self._lookup(self.convs[k % len(self.convs)] + tail, f"s{k % 3}", keep)

    @rule(k=st.integers(0, 9), tail=st.lists(st.integers(1, 3), max_size=8), frac=st.floats(0, 1))
    def save(self, k, tail, frac):
        toks = self.convs[k % len(self.convs)] + tail
        self._save(toks, max(1, round(len(toks) * frac)), f"s{k % 3}")

    @rule(n=st.integers(2, 13), keep=st.booleans())
    def lookup_trunk(self, n, keep):
        """Prefixes of one long sequence: partial blocks beside whole ones, in RAM and on SSD."""
        self._lookup(self.trunk[:n], "s0", keep)

    @rule(n=st.integers(1, 13))
    def save_trunk(self, n):
        self._save(self.trunk, n, "s0")

    @rule(k=st.integers(0, 9))
    def save_and_hold(self, k):
        """A running request: its prompt saved and its blocks pinned (RAM left to the others)."""
        toks = self.convs[k % len(self.convs)]
        self._save(toks, len(toks), f"s{k % 3}")
        self._lookup(toks + [3], f"s{k % 3}", keep=True)

    @rule(i=st.integers(0, 20))
    def release(self, i):
        if self.leases:
            lease = self.leases.pop(i % len(self.leases))
            lease.release()
            lease.release()  # idempotent

    @rule(k=st.integers(0, 2), force=st.booleans())
    def delete_session(self, k, force):
        self.cache.delete_session(f"s{k}", force=force)

    @rule(dt=st.sampled_from([0.5, 3.0, 10.0]), ttl=st.sampled_from([None, 2.0]))
    def expire(self, dt, ttl):
        if ttl is not None:  # a hint on the first conversation puts a TTL in play
            lease = self.cache.lookup(self.cache.sequence(self.convs[0], ttl_s=ttl))
            lease.release()
        self.clock.now += dt
        self.cache.expire()

    @rule(i=st.integers(0, 2))
    def switch_leader(self, i):
        if self.policy == "adaptive":
            hand_over(self.cache, i)

    @rule()
    def flush(self):
        self.cache.tiers.flush()

    @rule(num_blocks=st.integers(1, 4))
    def evict(self, num_blocks):
        """Memory pressure from elsewhere: leaves go (spilled to the SSD tier)."""
        with self.cache._lock:
            self.cache.ram.evict_bytes(64 * num_blocks)

    @invariant()
    def books_balance(self):
        if self.cache is not None:
            self.cache.check_integrity()
            for lease in self.leases:  # pinned blocks never leave
                for blk in lease.blocks:
                    assert self.cache.ram.get(blk.block_hash) is blk

    def teardown(self):
        if self.cache is not None:
            for lease in self.leases:
                lease.release()
            self.cache.check_integrity()
            assert all(b.ref_count == 0 for b in self.cache.ram.tree.index.values())
            self.cache.close()
            self.folder.cleanup()


RamTierMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=50,
    derandomize=True,  # the same exploration every run: CI never flakes on a lucky draw
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_ram_tier_state_machine = RamTierMachine.TestCase
