"""How much of the offline optimum an online eviction policy can reach on a hash-id trace.

Run: .venv/bin/python benchmarks/policy_ceiling.py --trace DATA_DIR/mooncake/conversation_trace.jsonl

Replays the trace through the real core (as `promptcache replay` does) with LRU, frecency, and
three policies that are told the future, so the gap can be attributed:
- ``oracle-new``: frecency, but new blocks that are never used again go first;
- ``oracle-all``: frecency, but any block at its last use goes first;
- ``belady``: evict the block whose next use is furthest away (the offline optimum).
It also prints what an online policy can observe about reuse: the chance a block is used again
given how often it was used so far, and when new blocks are first reused (their age in blocks
inserted since), which is what separates the three oracles.
"""

from __future__ import annotations

import argparse
import bisect
import json
from collections import Counter, defaultdict
from typing import Any

from promptcache.core.block import Block
from promptcache.core.policies.frecency import FrecencyPolicy
from promptcache.core.policy import make_policy
from promptcache.core.replay import TraceRequest, read_trace, replay

NEVER = 1 << 60


class Future:
    """The request being served and, for each trace hash id, the requests that contain it."""

    def __init__(self, requests: list[TraceRequest], trace_block_tokens: int) -> None:
        self.requests = requests
        self.block_tokens = trace_block_tokens
        self.uses: dict[int, list[int]] = defaultdict(list)
        for i, req in enumerate(requests):
            for h in dict.fromkeys(req.hash_ids):
                self.uses[h].append(i)
        self.current = 0

    def set_current(self, index: int, req: TraceRequest) -> None:
        self.current = index

    def trace_id(self, block: Block) -> int:
        """The trace hash id of ``block``, a block of the current request."""
        return self.requests[self.current].hash_ids[block.depth // self.block_tokens]

    def next_use(self, trace_id: int) -> int:
        """Index of the next request after the current one that uses ``trace_id``."""
        uses = self.uses.get(trace_id, ())
        k = bisect.bisect_right(uses, self.current)
        return uses[k] if k < len(uses) else NEVER


class HashFuture:
    """Like ``Future``, but keyed by the cache's own block hashes, so it holds for any trace
    format (session turns whose prompts accumulate history too). A partial block (a prompt's
    tail) is used by a later request whose tokens at its place start with the same tokens."""

    def __init__(
        self,
        requests: list[TraceRequest],
        block_size: int,
        trace_block_tokens: int,
        with_output: bool = False,
    ) -> None:
        import numpy as np

        from promptcache.core.cache import PromptCache
        from promptcache.core.replay import output_tokens, prompt_tokens

        cache = PromptCache("replay", block_size=block_size, ram_budget=1 << 20)
        b = self.block_size = block_size
        self.uses: dict[bytes, list[int]] = defaultdict(list)
        tails: dict[bytes, set[int]] = defaultdict(set)  # parent hash -> tail lengths under it
        for i, req in enumerate(requests):
            toks = prompt_tokens(req, trace_block_tokens)
            if with_output and req.output_length:
                seed = req.reply_seed if req.reply_seed >= 0 else i
                toks = np.concatenate([toks, output_tokens(seed, req.output_length)])
            seq = cache.sequence(toks)
            hashes = seq.full_hashes()
            used = dict.fromkeys(hashes)
            for j in range(len(hashes) + 1):
                for m in tails.get(seq.root if j == 0 else hashes[j - 1], ()):
                    if j * b + m <= seq.num_tokens:
                        used[seq.partial_hash(j * b + m)] = None
            if seq.num_tokens % b:
                used[seq.partial_hash(seq.num_tokens)] = None
                tails[seq.parent_hash(len(hashes))].add(seq.num_tokens % b)
            for h in used:
                self.uses[h].append(i)
        self.current = 0

    def set_current(self, index: int, req: TraceRequest) -> None:
        self.current = index

    def trace_id(self, block: Block) -> bytes:
        return block.block_hash

    def next_use(self, key: bytes) -> int:
        uses = self.uses.get(key, ())
        k = bisect.bisect_right(uses, self.current)
        return uses[k] if k < len(uses) else NEVER


class OraclePolicy(FrecencyPolicy):
    """Frecency ordering, corrected with knowledge of each block's next use (see module doc).
    A block's priority is computed when it becomes evictable or is used while evictable, which
    is exactly when its next use can change."""

    def __init__(self, future: Future | HashFuture, mode: str) -> None:
        super().__init__()
        self.future = future
        self.mode = mode
        self.name = mode
        self._trace_id: dict[Block, Any] = {}

    def on_insert(self, block: Block) -> None:
        self._trace_id[block] = self.future.trace_id(block)
        super().on_insert(block)

    def on_evict(self, block: Block) -> None:
        self._trace_id.pop(block, None)
        super().on_evict(block)

    def _priority(self, block: Block, last: int, freq: int) -> float:
        nxt = self.future.next_use(self._trace_id[block])
        if self.mode == "belady":
            return -float(nxt)  # the heap pops the smallest: the furthest next use goes first
        base = super()._priority(block, last, freq)
        is_dead = nxt == NEVER and (self.mode == "oracle-all" or freq == 1)
        return base - 1e18 if is_dead else base


def reuse_profile(requests: list[TraceRequest]) -> tuple[list[dict], list[dict]]:
    """(P(used again | uses so far), first-reuse hazard by age) from the trace ids alone."""
    remaining: Counter[int] = Counter(h for r in requests for h in set(r.hash_ids))
    uses: Counter[int] = Counter()
    again: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    born: dict[int, int] = {}
    first_gap: list[int] = []
    clock = 0
    for r in requests:
        for h in dict.fromkeys(r.hash_ids):
            if h not in born:
                clock += 1
                born[h] = clock
            elif uses[h] == 1:
                first_gap.append(clock - born[h])
            uses[h] += 1
            remaining[h] -= 1
            row = again[min(uses[h], 8)]
            row[0] += 1
            row[1] += remaining[h] > 0
    by_uses = [
        {"uses": k if k < 8 else "8+", "accesses": n, "p_used_again": round(a / n, 3)}
        for k, (n, a) in sorted(again.items())
    ]
    first_gap.sort()
    alive, lo, hazard = len(born), 0, []
    for hi in [1 << k for k in range(9, 18)] + [NEVER]:
        n = bisect.bisect_left(first_gap, hi) - bisect.bisect_left(first_gap, lo)
        hazard.append(
            {
                "age_blocks": f"{lo}-{hi if hi != NEVER else 'inf'}",
                "first_reuses": n,
                "share_of_new_blocks": round(n / len(born), 4),
                "hazard": round(n / alive, 4) if alive else 0.0,
            }
        )
        alive -= n
        lo = hi
    return by_uses, hazard


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--trace", required=True)
    ap.add_argument("--capacity-tokens", type=int, nargs="+", default=[3_100_000])
    ap.add_argument("--trace-block-tokens", type=int, default=512)
    ap.add_argument("--json", help="also write results here")
    args = ap.parse_args()
    requests = list(read_trace(args.trace))
    future = Future(requests, args.trace_block_tokens)
    rows = []
    print("| capacity (tokens) | lru | frecency | oracle-new | oracle-all | belady | replay s |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for cap in args.capacity_tokens:
        row: dict = {"capacity_tokens": cap}
        seconds = []
        for label in ("lru", "frecency", "oracle-new", "oracle-all", "belady"):
            if label in ("lru", "frecency"):
                policy = make_policy(label)
            else:
                policy = OraclePolicy(future, label)
            r = replay(
                requests,
                cap,
                policy=policy,
                block_size=args.trace_block_tokens,
                trace_block_tokens=args.trace_block_tokens,
                before_request=future.set_current,
            )
            row[label] = round(r["hit_rate"], 4)
            seconds.append(r["seconds"])
        rows.append(row)
        cells = " | ".join(f"{row[k]:.4f}" for k in list(row)[1:])
        print(f"| {cap:,} | {cells} | {max(seconds):.0f} |", flush=True)
    by_uses, hazard = reuse_profile(requests)
    print("\nP(a block is used again | its uses so far):")
    for d in by_uses:
        print(f"  uses {d['uses']!s:>2}: {d['p_used_again']:.3f}  ({d['accesses']:,} accesses)")
    print("\nFirst reuse of a new block, by its age in blocks inserted since:")
    for d in hazard:
        print(
            f"  {d['age_blocks']:>13}: {d['share_of_new_blocks']:.4f} of new blocks,"
            f" hazard {d['hazard']:.4f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "by_uses": by_uses, "first_reuse": hazard}, f, indent=2)


if __name__ == "__main__":
    main()
