"""`promptcache replay`: a trace file through ``core.replay`` (the real core, a null engine), its
result printed as a table or one JSON object."""

from __future__ import annotations

import argparse
import json
import sys

from promptcache.core.replay import read_trace, replay


def cmd_replay(args: argparse.Namespace) -> int:
    try:
        result = replay(
            read_trace(args.trace),
            args.capacity_tokens,
            policy=args.policy,
            block_size=args.block_size,
            trace_block_tokens=args.trace_block_tokens,
            with_output=args.with_output,
        )
    except (OSError, ValueError) as exc:
        print(f"promptcache replay: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:>16}: {v:.4f}" if isinstance(v, float) else f"{k:>16}: {v}")
    return 0
