"""What the generated trace shapes are made of: growing prompts, fresh hash ids, the file."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

Record = dict[str, object]


class History:
    """One prompt that grows: full blocks keep their ids, the partial last block is renamed."""

    def __init__(self, ids: list[int], num_tokens: int, alloc: Callable[[], int]) -> None:
        self.ids = list(ids)
        self.num_tokens = num_tokens
        self.alloc = alloc

    def extend(self, new_tokens: int, block: int) -> None:
        total = self.num_tokens + new_tokens
        self.ids = self.ids[: self.num_tokens // block]
        while len(self.ids) * block < total:
            self.ids.append(self.alloc())
        self.num_tokens = total

    def record(self, t_ms: int, output_length: int) -> Record:
        return {
            "timestamp": t_ms,
            "input_length": self.num_tokens,
            "output_length": output_length,
            "hash_ids": list(self.ids),
        }


class Ids:
    def __init__(self, start: int = 1_000_000) -> None:
        self.next = start

    def __call__(self) -> int:
        self.next += 1
        return self.next

    def run(self, n: int) -> list[int]:
        return [self() for _ in range(n)]


def write(records: list[Record], path: str | Path) -> None:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
