"""Payload builders whose content proves which positions and tokens a hit restored."""

import numpy as np


def make_slicer(tokens):
    """Positional payload for [s, e): rows of (token id, position)."""
    arr = np.asarray(tokens, dtype=np.int64)

    def slice_positional(start, end):
        return np.stack([arr[start:end], np.arange(start, end)], axis=1)

    return slice_positional


def checkpoint_for(tokens, n):
    """Snapshot state at n: depends on every token before n, like an SSM state."""
    acc = 0
    for t in tokens[:n]:
        acc = (acc * 1_000_003 + int(t) + 1) % (2**61 - 1)
    return np.array([acc, n], dtype=np.int64)


def restored_rows(lease):
    parts = [payload[:count] for payload, count in lease.segments()]
    return np.concatenate(parts) if parts else np.zeros((0, 2), dtype=np.int64)


def assert_restores(lease, query):
    """The lease's positional payloads are exactly (query[i], i) for i < num_tokens."""
    rows = restored_rows(lease)
    p = lease.num_tokens
    assert rows.shape[0] == p
    if p:
        assert rows[:, 0].tolist() == list(query[:p])
        assert rows[:, 1].tolist() == list(range(p))


def conversation(k):
    """A shared system prompt, then turns of its own: shared blocks and new ones."""
    return list(range(1, 21)) + [(k * 7919 + i * 31) % 50_000 + 100 for i in range(44)]


def churn_conversations(cache, rng, steps, check_every):
    """Six growing conversations looked up and saved at random points, some leases held for a
    while; every hit must restore exactly its tokens and ``check_integrity()`` must hold."""
    convs = [[rng.randrange(1, 6) for _ in range(8)] for _ in range(6)]
    leases = []
    for step in range(steps):
        k = rng.randrange(len(convs))
        convs[k] += [rng.randrange(1, 9) for _ in range(rng.randrange(1, 7))]
        if len(convs[k]) > 60:
            convs[k] = convs[k][:8]
        toks = convs[k]
        lease = cache.lookup(cache.sequence(toks))
        assert_restores(lease, toks)
        (leases.append(lease) if rng.random() < 0.2 else lease.release())
        if leases and rng.random() < 0.3:
            leases.pop(rng.randrange(len(leases))).release()
        cache.save(cache.sequence(toks), rng.randrange(1, len(toks) + 1), make_slicer(toks))
        if step % check_every == 0:
            cache.check_integrity()
    for lease in leases:
        lease.release()
    cache.check_integrity()


def serve_schedule(policy, schedule, capacity_blocks, block=8):
    """Each prompt (a list of trace ids, one block each) looked up, then saved, on a cache of
    ``capacity_blocks`` blocks under ``policy``; the tokens each one hit."""
    from promptcache.core.cache import PromptCache
    from promptcache.core.replay import TraceRequest, null_slicer, prompt_tokens

    cache = PromptCache("t", block_size=block, ram_budget=capacity_blocks * block, policy=policy)
    hits = []
    for i, ids in enumerate(schedule):
        seq = cache.sequence(prompt_tokens(TraceRequest(i, len(ids) * block, 0, list(ids)), block))
        with cache.lookup(seq) as hit:
            hits.append(hit.num_tokens)
        cache.save(seq, None, null_slicer)
        cache.check_integrity()
    return hits
