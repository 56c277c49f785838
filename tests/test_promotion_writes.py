"""A promoted block is written through only to the tiers below the one it came from: a hit from
the shared tier does not copy the history to the local SSD while the request runs; the tiers
above get it when RAM evicts it, and a tier below its source still gets it at once."""

from __future__ import annotations

from core_helpers import make_slicer
from test_tiers import BLOCK, BLOCK_BYTES, DictTier, tokens

from promptcache.core.cache import PromptCache


def test_promoted_blocks_go_only_below_their_source_then_up_on_eviction():
    a = tokens(3, 40)
    near, far = DictTier("near"), DictTier("far")
    donor = PromptCache("m", block_size=BLOCK, ram_budget=10**6, next_tier=[far])
    donor.save(donor.sequence(a), None, make_slicer(a))
    assert len(far.blocks) == 10 and not near.blocks
    # a new server: the history is found in the far (shared-like) tier and promoted
    budget = 12 * BLOCK_BYTES
    cache = PromptCache("m", block_size=BLOCK, ram_budget=budget, next_tier=[near, far])
    with cache.lookup(cache.sequence(a + [7])) as hit:
        assert hit.num_tokens == 40
    assert far.hits == 1 and not near.blocks  # nothing copied up during the request
    # RAM evicts them for other work: offered to every tier, the near one included
    b = tokens(4, 40)
    cache.save(cache.sequence(b), None, make_slicer(b))
    history = cache.sequence(a)
    a_hashes = {history.block_hash(i) for i in range(10)}
    evicted = a_hashes - {h for h in a_hashes if cache.ram.get(h) is not None}
    assert len(evicted) >= 8
    assert a_hashes & set(near.blocks) == evicted  # exactly the evicted ones went up
    cache.check_integrity()

    # promoted from the near tier: written through to the far one, below it, at once
    near2, far2 = DictTier("near"), DictTier("far")
    donor2 = PromptCache("m", block_size=BLOCK, ram_budget=10**6, next_tier=[near2])
    donor2.save(donor2.sequence(a), None, make_slicer(a))
    cache2 = PromptCache("m", block_size=BLOCK, ram_budget=10**6, next_tier=[near2, far2])
    with cache2.lookup(cache2.sequence(a + [7])) as hit:
        assert hit.num_tokens == 40
    assert set(far2.blocks) == set(near2.blocks)
