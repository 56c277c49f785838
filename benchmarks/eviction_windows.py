"""Hit rate per window of requests on one eviction shape: fixed policies, the default, and
hand-over schedules with no race, to see when the default's hand-overs pay.

A schedule ``s3fifo@300,frecency@1600`` starts on the default's first candidate and hands the
live cache to S3-FIFO before request 300 and to frecency before request 1,600, as the race would
(``AdaptivePolicy.hand_over``), with the what-if simulations detached. ``--miniatures`` adds the
default's candidate miniatures per window: their hits over their sampled lookup blocks.

    .venv/bin/python benchmarks/eviction_windows.py "mooncake (held out)" 3100000 \\
        --mooncake DATA_DIR/mooncake/conversation_trace.jsonl --window 400 --miniatures \\
        --schedule s3fifo@300,frecency@1600 s3fifo@300,frecency@2400

``--switches`` logs each hand-over the default made (request, leaders, the race's lead and its
significance); ``--name`` replays the default under another cache namespace, another sample.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from eviction_shapes import shapes  # noqa: E402

from promptcache.core.cache import PromptCache  # noqa: E402
from promptcache.core.policies import DEFAULT_POLICY  # noqa: E402
from promptcache.core.policies.adaptive import CANDIDATES, AdaptivePolicy  # noqa: E402
from promptcache.core.race import Decayed  # noqa: E402
from promptcache.core.replay import null_slicer, prompt_tokens  # noqa: E402
from promptcache.core.whatif import WhatIf  # noqa: E402

Hits = list[tuple[float, float]]  # per request: (hit tokens, prompt tokens)


def parse_schedule(text: str, names: tuple[str, ...]) -> dict[int, int]:
    """``policy@request,...`` -> {request index: candidate index}."""
    out = {}
    for part in filter(None, text.split(",")):
        name, _, at = part.partition("@")
        if name not in names:
            raise SystemExit(f"{name!r} is not a candidate ({', '.join(names)})")
        out[int(at)] = names.index(name)
    return out


def run(
    requests: list[Any],
    block: int,
    capacity: int,
    policy: str,
    name: str = "replay",
    schedule: dict[int, int] | None = None,
    counter: list[int] | None = None,
    switches: list[str] | None = None,
) -> Hits:
    """Per request (hit tokens, prompt tokens); ``counter[0]``: the request being served;
    ``switches``: gets a line per live hand-over of the race."""
    cache = PromptCache(name, block_size=block, ram_budget=capacity, policy=policy)
    if switches is not None and cache.whatif is not None:
        log_switches(cache.whatif, switches, counter or [0])
    adaptive: AdaptivePolicy | None = None
    if schedule is not None:
        assert isinstance(cache.ram.policy, AdaptivePolicy)
        adaptive = cache.ram.policy
        cache.whatif = None  # the schedule, not the race, picks
    out: Hits = []
    for i, req in enumerate(requests):
        if counter is not None:
            counter[0] = i
        if adaptive is not None and schedule and i in schedule:
            adaptive.hand_over(schedule[i])
        seq = cache.sequence(prompt_tokens(req, block))
        with cache.lookup(seq) as hit:
            out.append((hit.num_tokens, seq.num_tokens))
        cache.save(seq, None, null_slicer)
    return out


def log_switches(whatif: WhatIf, out: list[str], counter: list[int]) -> None:
    """Each hand-over: the request, the old and new leader, and the view of the race the live
    cache follows (``follow.py``: the fast one, or the slow one): the new leader's lead in
    sampled blocks and as a share of the race's volume, that lead over its noise, the volume in
    miniature cache-fulls."""
    hand_over = whatif.on_switch
    assert hand_over is not None
    was = [whatif.leader]

    def logged(new: int) -> None:
        old, was[0] = was[0], new
        names, live, following = whatif.policy_names, whatif.live, whatif.following
        assert live is not None and live.race is not None and following is not None
        race, sim = following.slow.race if following.is_slow else live.race, live.sims[0]
        lead = race.hits[new] - race.hits[old]
        out.append(
            f"request {counter[0]:,}: {names[old]} -> {names[new]}, lead {lead:.1f} blocks"
            f" ({lead / race.volume:.4f}), {race.significance(new, old):.2f}x its noise, after"
            f" {race.volume * sim.unit / sim.budget:.2f} cache-fulls, race"
            f" {'slow' if following.is_slow else 'fast'}"
        )
        hand_over(new)

    whatif.on_switch = logged


def watch_miniatures(window: int, counter: list[int]) -> dict[int, list[float]]:
    """Per window: each race candidate's miniature hits, then the sampled lookup blocks."""
    acc: dict[int, list[float]] = {}
    lookup = Decayed.lookup

    def counted(self: Decayed, chain: Any, tail: float = 0.0) -> list[float]:
        got = lookup(self, chain, tail)
        if self.race is not None:  # the candidates' miniatures, not the curve's
            row = acc.setdefault(counter[0] // window, [0.0] * (len(got) + 1))
            for j, h in enumerate(got):
                row[j] += h
            row[-1] += len(chain) - (1.0 - tail if tail else 0.0)
        return got

    Decayed.lookup = counted  # type: ignore[method-assign]  # our own class, this process only
    return acc


def rate(hits: Hits) -> float:
    total = sum(n for _, n in hits)
    return sum(h for h, _ in hits) / total if total else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("shape", help="a shape of eviction_shapes.py")
    ap.add_argument("capacity", type=int, help="RAM budget in tokens")
    ap.add_argument("--mooncake", help="a Mooncake-format trace, for the held-out shape")
    ap.add_argument("--window", type=int, default=400, help="requests per window")
    ap.add_argument("--policies", nargs="*", default=["frecency", "lru", "s3fifo"])
    ap.add_argument("--schedule", nargs="*", default=[], help="policy@request,... (see above)")
    ap.add_argument("--miniatures", action="store_true", help="also the default's miniatures")
    ap.add_argument("--rows", type=int, default=0, help="print only the first N windows")
    ap.add_argument(
        "--name", default="replay", help="the default's cache namespace (another: another sample)"
    )
    ap.add_argument("--switches", action="store_true", help="also log the default's hand-overs")
    args = ap.parse_args()
    found = [s for s in shapes(argparse.Namespace(shapes=[args.shape], mooncake=args.mooncake))]
    if not found:
        raise SystemExit(f"no shape {args.shape!r} (the held-out one needs --mooncake)")
    shape = found[0]
    requests = shape.load()
    names = CANDIDATES
    cols: dict[str, Hits] = {p: run(requests, shape.block, args.capacity, p) for p in args.policies}
    counter = [0]
    minis = watch_miniatures(args.window, counter) if args.miniatures else {}
    switches: list[str] | None = [] if args.switches else None
    cols["default"] = run(
        requests, shape.block, args.capacity, DEFAULT_POLICY, args.name, None, counter, switches
    )
    for text in args.schedule:
        sched = parse_schedule(text, names)
        cols[text] = run(
            requests, shape.block, args.capacity, DEFAULT_POLICY, args.name, schedule=sched
        )
    print(f"{shape.name} at {args.capacity:,} tokens, {len(requests):,} requests")
    print(
        "| requests | "
        + " | ".join(cols)
        + (" | miniatures " + " / ".join(names) if minis else "")
        + " |"
    )
    print("|---" * (len(cols) + 1 + bool(minis)) + "|")
    print(
        "| all | "
        + " | ".join(f"{rate(h):.4f}" for h in cols.values())
        + (" | |" if minis else " |")
    )
    num_windows = -(-len(requests) // args.window)
    for w in range(min(num_windows, args.rows) if args.rows else num_windows):
        lo = w * args.window
        row = [f"{rate(h[lo : lo + args.window]):.4f}" for h in cols.values()]
        mini = minis.get(w)
        if minis:
            row.append(" / ".join(f"{x / mini[-1]:.3f}" for x in mini[:-1]) if mini else "-")
        print(f"| {lo:,} | " + " | ".join(row) + " |")
    if switches is not None:
        print(f"\nthe default's hand-overs ({args.name}):" if switches else "\nno hand-over")
        for line in switches:
            print("- " + line)


if __name__ == "__main__":
    main()
