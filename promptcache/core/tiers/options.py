"""What a tier registers (``registry``): its name, its place behind RAM, the options its build
reads (``EngineOptions.tier_options``, ``build_tiers`` keywords), the command-line flags that set
them, and the build itself. Plain data: the CLI turns the flags into argparse flags."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from promptcache.core.cipher import BlockCipher
from promptcache.core.codec import PayloadCodec
from promptcache.core.evictions import EvictionLog
from promptcache.core.tiers.base import BlockStore

__all__ = ["TierAdmin", "TierContext", "TierEntry", "TierFlag"]


@dataclass(frozen=True, slots=True)
class TierFlag:
    """A ``serve``/``bench`` flag: ``--NAME`` with its ``PROMPTCACHE_NAME`` environment
    variable (``cli.flags.add_flag``); ``switch``: a store_true flag (``add_switch``)."""

    name: str  # without the dashes: "ssd-budget" (its value under "ssd_budget")
    default: Any
    help: str
    type: Callable[[str], Any] = str
    switch: bool = False

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")


@dataclass(frozen=True, slots=True)
class TierContext:
    """What every tier's build gets besides its own options."""

    fingerprint: str  # the model's: a tier keeps one model's blocks apart from another's
    codec: PayloadCodec | None = None
    evictions: EvictionLog | None = None  # where it notes its evictions (a miss says so)
    cipher: BlockCipher | None = None  # encryption at rest, for tiers that write files


@dataclass(frozen=True, slots=True)
class TierAdmin:
    """The tier's offline command, ``promptcache cache ACTION`` (stats, ls, sessions, verify,
    clear, delete) with no server running. ``flag`` picks the tier (``--flag VALUE``; the
    default tier needs none); ``command``: ``"module:function"``, the function taking the parsed
    arguments (the flag's value under its dest) and returning the exit code, imported only when
    the tier is picked."""

    flag: str
    help: str
    command: str
    is_default: bool = False


@dataclass(frozen=True, slots=True)
class TierEntry:
    """One tier, registered once. ``order``: its place behind RAM (lower is nearer: SSD 10,
    shared 20). ``options``: the option names its build reads, with their defaults.
    ``from_flags``: the parsed flag values (by dest) and the user cache folder -> its options.
    ``build``: its options (defaults filled in) and the context -> the tier, or None when
    the options do not ask for it; raises ValueError on a bad setting. ``admin``: its offline
    command, if it has one."""

    name: str
    order: int
    options: Mapping[str, Any]
    flags: tuple[TierFlag, ...]
    from_flags: Callable[[Mapping[str, Any], Path], dict[str, Any]]
    build: Callable[[Mapping[str, Any], TierContext], BlockStore | None]
    admin: TierAdmin | None = None
