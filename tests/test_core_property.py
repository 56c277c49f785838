"""Property tests of the core against brute force, with check_integrity() after every step."""

import numpy as np
import pytest
from core_helpers import assert_restores, checkpoint_for, make_slicer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from promptcache.core.cache import PromptCache
from promptcache.core.policies import policy_names

BLOCK = 4
token_lists = st.lists(st.integers(1, 3), min_size=1, max_size=18)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("save"), token_lists, st.floats(0.05, 1.0), st.booleans()),
        st.tuples(st.just("lookup"), token_lists, st.booleans()),
        st.tuples(st.just("release"), st.integers(0, 5)),
    ),
    min_size=1,
    max_size=40,
)


def lcp(a, b):
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def resident_paths(cache):
    """Every resident block's full token path from its root, with the block."""
    out = []
    for blk in cache.ram.tree.index.values():
        chain, node = [], blk
        while node.parent is not None:
            chain.append(np.frombuffer(node.token_bytes, dtype="<u4").tolist())
            node = node.parent
        out.append((blk, [t for part in reversed(chain) for t in part]))
    return out


def brute_force_resident(cache, query, requires_checkpoint):
    n = len(query)
    best = 0
    for blk, path in resident_paths(cache):
        if requires_checkpoint:
            if blk.checkpoint is not None and len(path) <= n - 1 and query[: len(path)] == path:
                best = max(best, len(path))
        else:
            best = max(best, min(lcp(query, path), n - 1))
    return best


def brute_force_saved(saved, query, requires_checkpoint):
    n = len(query)
    best = 0
    for tokens, m, with_ckpt in saved:
        if requires_checkpoint:
            if with_ckpt and m <= n - 1 and query[:m] == tokens[:m]:
                best = max(best, m)
        else:
            best = max(best, min(lcp(query, tokens[:m]), n - 1))
    return best


def run_ops(operations, requires_checkpoint, budget, policy=None):
    cache = PromptCache(
        "prop",
        block_size=BLOCK,
        ram_budget=budget,
        requires_checkpoint=requires_checkpoint,
        policy=policy,
    )
    saved, leases = [], []
    for op in operations:
        if op[0] == "save":
            _, tokens, frac, with_ckpt = op
            m = max(1, round(len(tokens) * frac))
            seq = cache.sequence(tokens)
            ckpt = checkpoint_for(tokens, m) if with_ckpt else None
            cache.save(seq, m, make_slicer(tokens), ckpt)
            saved.append((tokens, m, with_ckpt))
        elif op[0] == "lookup":
            _, query, keep = op
            expected_resident = brute_force_resident(cache, query, requires_checkpoint)
            lease = cache.lookup(cache.sequence(query))
            assert lease.num_tokens == expected_resident
            assert lease.num_tokens <= brute_force_saved(saved, query, requires_checkpoint)
            assert_restores(lease, query)
            if requires_checkpoint and lease.num_tokens:
                assert lease.checkpoint is not None
                assert lease.checkpoint.tolist() == checkpoint_for(query, lease.num_tokens).tolist()
            if unlimited(budget):
                assert lease.num_tokens == brute_force_saved(saved, query, requires_checkpoint)
            if keep:
                leases.append(lease)
            else:
                lease.release()
        else:
            if leases:
                lease = leases.pop(op[1] % len(leases))
                lease.release()
                lease.release()  # idempotent
        cache.check_integrity()
        for lease in leases:  # pinned blocks never leave
            for blk in lease.blocks:
                assert cache.ram.get(blk.block_hash) is blk
    for lease in leases:
        lease.release()
    cache.check_integrity()
    assert all(b.ref_count == 0 for b in cache.ram.tree.index.values())


def unlimited(budget):
    return budget >= 10**9


SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(ops)
def test_positional_matches_brute_force(operations):
    run_ops(operations, requires_checkpoint=False, budget=10**9)


@SETTINGS
@given(ops)
def test_checkpoints_match_brute_force(operations):
    run_ops(operations, requires_checkpoint=True, budget=10**9)


@pytest.mark.parametrize("policy", policy_names())
@SETTINGS
@given(operations=ops, num_blocks=st.integers(1, 12))
def test_under_eviction_pressure(policy, operations, num_blocks):
    # a full block payload is BLOCK rows x 2 int64 = 64 bytes; checkpoints 16 bytes
    run_ops(operations, requires_checkpoint=False, budget=64 * num_blocks + 16, policy=policy)


@SETTINGS
@given(ops, st.integers(1, 12))
def test_checkpoints_under_eviction_pressure(operations, num_blocks):
    run_ops(operations, requires_checkpoint=True, budget=80 * num_blocks)
