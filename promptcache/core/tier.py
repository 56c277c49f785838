"""What a RAM tier hands to the tier behind it, and the null tier that drops everything."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

from promptcache.core.block import Block, BlockMeta
from promptcache.core.hashing import BlockHash


class BlockRecord(NamedTuple):
    """A block as it leaves a tier: its identity plus this copy's data and state."""

    meta: BlockMeta
    payload: Any
    checkpoint: Any
    nbytes: int  # payload + checkpoint bytes
    is_seq_end: bool

    @property
    def block_hash(self) -> BlockHash:
        return self.meta.block_hash

    @classmethod
    def from_block(cls, block: Block) -> BlockRecord:
        assert block.parent is not None
        return cls(block.meta, block.payload, block.checkpoint, block.nbytes, block.is_seq_end)


class Tier(Protocol):
    """A lower tier that takes the blocks a RAM tier evicts."""

    name: str
    write_through: bool  # True: the RAM tier also puts every new block, not only evicted ones

    def put(self, record: BlockRecord) -> bool:
        """Accept a block (evicted, or new when ``write_through``). Must not block the caller: it may queue the write or drop the
        block (returning False). Putting the same hash twice is harmless."""

    def used_bytes(self) -> int:
        """Bytes this tier holds now."""

    def check_integrity(self) -> None:
        """Raise AssertionError unless bytes accounted == bytes held <= budget."""

    def close(self) -> None:
        """Flush what is pending and release resources; safe to call twice."""


class NullTier:
    """Drops every block: eviction from RAM is final."""

    name = "null"
    write_through = False

    def put(self, record: BlockRecord) -> bool:
        return False

    def used_bytes(self) -> int:
        return 0

    def check_integrity(self) -> None:
        pass

    def close(self) -> None:
        pass


_TIERS: dict[str, Callable[..., Tier]] = {"null": NullTier}


def register_tier(name: str, factory: Callable[..., Tier]) -> None:
    _TIERS[name] = factory


def make_tier(name: str, **kwargs: Any) -> Tier:
    if name not in _TIERS:
        raise ValueError(f"unknown tier {name!r}; known: {', '.join(sorted(_TIERS))}")
    return _TIERS[name](**kwargs)
