"""How positional K/V blocks are stored at rest: full precision, a narrower float, or quantized.

The scheme is decided once per engine (``--cache-kv-bits``, ``--cache-kv-group``,
``--cache-kv-min-tokens``, ``--cache-dtype``) and is part of the model fingerprint, so it is
part of every chain's root hash: blocks of two schemes never share a chain, a RAM tree, an SSD
model folder or a file. Inside one scheme, whether a block is quantized is a pure function of
where it starts (``start >= min_tokens``), so a given chain position is always stored the same
way: the first ``min_tokens`` tokens of every chain (the system prompt and tools most requests
share, and the attention-sink tokens whose error every later token sees) stay full precision,
and a prompt shorter than ``min_tokens`` has only full-precision blocks.

Payloads describe themselves (a plain array, or a dict of quantized arrays), so ``unpack`` needs
no position. Checkpoints (SSM state, sliding-window rings) are never packed: they are valid at
one position only and their error would compound through the recurrence.

Quantization happens in the runner, where a block is sliced (``slice_block``) and where a hit is
restored (``restore``): every tier, RAM included, holds the packed arrays and sizes them from
shape x dtype like any other payload.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Protocol

from promptcache.core.figures import Series, Snapshot
from promptcache.errors import ConfigError
from promptcache.serving.layers import Layout

CACHE_KV_BITS = (8, 4)
CACHE_DTYPES = ("bfloat16",)


@dataclass(frozen=True, slots=True)
class BlockScheme:
    """``bits``: quantize positional K/V blocks to 8 or 4 bits (None: keep their dtype) in groups
    of ``group`` along the head dimension (one scale and minimum per group); blocks starting
    before ``min_tokens`` stay unquantized. ``dtype``: store unquantized float32 blocks in this
    narrower float ("bfloat16"); the model still runs in its own dtype."""

    bits: int | None = None
    group: int = 64
    min_tokens: int = 0
    dtype: str | None = None

    def check(self) -> None:
        if self.bits is not None and self.bits not in CACHE_KV_BITS:
            raise ConfigError("cache_kv_bits must be 8 or 4")
        if self.group <= 0 or self.group % 2:
            raise ConfigError("cache_kv_group must be a positive even number")
        if self.min_tokens < 0:
            raise ConfigError("cache_kv_min_tokens must be >= 0")
        if self.dtype is not None and self.dtype not in CACHE_DTYPES:
            raise ConfigError(f"cache_dtype must be one of {', '.join(CACHE_DTYPES)}")

    @property
    def is_default(self) -> bool:
        return self.bits is None and self.dtype is None

    @property
    def tag(self) -> str:
        """Appended to the fingerprint's dtype field; empty for the default, so the blocks of an
        engine without these options keep the identity (and the SSD folder) they always had."""
        parts = []
        if self.bits is not None:
            parts.append(f"kv{self.bits}g{self.group}m{self.min_tokens}")
        if self.dtype is not None:
            parts.append(f"store-{self.dtype}")
        return "".join(f":{p}" for p in parts)

    def quantizes(self, start: int) -> bool:
        """True when a block starting at position ``start`` is stored quantized."""
        return self.bits is not None and start >= self.min_tokens


class PackStats:
    """Bytes of the blocks a packer stored (their model-dtype size and their stored size).
    Written inside a step, read by the stats endpoint: a lock keeps the pairs consistent."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.num_blocks = 0
        self.num_packed_blocks = 0  # narrower than the model's dtype (quantized or bfloat16)
        self.raw_bytes = 0
        self.stored_bytes = 0

    def add(self, raw: int, stored: int) -> None:
        with self._lock:
            self.num_blocks += 1
            self.num_packed_blocks += stored < raw
            self.raw_bytes += raw
            self.stored_bytes += stored

    def to_dict(self, scheme: BlockScheme) -> dict[str, Any]:
        with self._lock:
            raw, stored = self.raw_bytes, self.stored_bytes
            out: dict[str, Any] = {
                "num_quant_blocks": self.num_packed_blocks,
                "quant_raw_bytes": raw,
                "quant_stored_bytes": stored,
                "quant_bytes_saved": raw - stored,
            }
        out["quant_ratio"] = round(raw / stored, 4) if stored else 1.0
        out["quant_kv_bits"] = scheme.bits or 0
        return out


class BlockPacker(Protocol):
    """One library's block storage under a ``BlockScheme``. Contract: ``unpack(pack(x, s))`` has
    ``x``'s shape and dtype, its values within the scheme's error (exact for a full-precision
    block); ``unpack`` accepts every form ``pack`` produces under any position, and a plain array
    unchanged; both are pure (no state but the byte counters) and cheap next to a forward."""

    scheme: BlockScheme
    stats: PackStats

    def pack(self, block: Any, start: int) -> Any:
        """The stored form of one block's positional arrays (a stacked array or a tuple of
        them) for a block starting at position ``start``."""

    def unpack(self, stored: Any) -> Any:
        """The positional arrays back in the model's dtype, the shapes ``pack`` was given."""


class ArrayPacker(ABC):
    """The ``BlockPacker`` rule every library shares, its array operations left to the library:
    a block the scheme quantizes at ``start`` is quantized where the library can (``quantize``
    gives None where it cannot), else a float32 block is narrowed to the scheme's ``dtype``;
    the stats count every block's raw and stored bytes. ``dtype``: the model's."""

    def __init__(self, scheme: BlockScheme, dtype: Any) -> None:
        self.scheme = scheme
        self.stats = PackStats()
        self.dtype = dtype  # blocks stored narrower come back in it

    def pack(self, block: Any, start: int) -> Any:
        if isinstance(block, tuple):
            return tuple(self._pack_one(b, start) for b in block)
        return self._pack_one(block, start)

    def _pack_one(self, x: Any, start: int) -> Any:
        s = self.scheme
        stored, size = x, self.nbytes(x)
        quantized = self.quantize(x) if s.quantizes(start) else None
        if quantized is not None:
            stored = quantized
            size = sum(self.nbytes(v) for v in quantized.values() if self.is_array(v))
        elif s.dtype is not None and self.is_float32(x):
            stored = self.narrow(x, s.dtype)
            size = self.nbytes(stored)
        self.stats.add(self.nbytes(x), size)
        return stored

    def unpack(self, stored: Any) -> Any:
        if isinstance(stored, tuple):
            return tuple(self.unpack(s) for s in stored)
        if isinstance(stored, dict):
            return self.dequantize(stored)
        return self.widen(stored)

    @abstractmethod
    def nbytes(self, x: Any) -> int:
        """The bytes of array ``x``."""

    @abstractmethod
    def is_array(self, x: Any) -> bool:
        """Whether ``x`` (a value of a quantized dict) is an array."""

    @abstractmethod
    def is_float32(self, x: Any) -> bool: ...

    @abstractmethod
    def quantize(self, x: Any) -> dict[str, Any] | None:
        """``x`` quantized under the scheme (bits, group), or None when it cannot be."""

    @abstractmethod
    def dequantize(self, stored: dict[str, Any]) -> Any:
        """A quantized dict back to an array in its original dtype, on the model's device."""

    @abstractmethod
    def narrow(self, x: Any, dtype: str) -> Any:
        """``x`` stored in the narrower float ``dtype`` ("bfloat16")."""

    @abstractmethod
    def widen(self, stored: Any) -> Any:
        """A stored plain array back in the model's dtype (unchanged when it already is)."""


SCHEME_OPTIONS = {
    "cache_kv_bits": "bits",
    "cache_kv_group": "group",
    "cache_kv_min_tokens": "min_tokens",
    "cache_dtype": "dtype",
}


def pop_block_scheme(options: dict[str, Any]) -> BlockScheme:
    """The ``BlockScheme`` an engine's keyword options ask for (those keys removed): the engines
    take them beside ``EngineOptions`` because the runner, built first, needs the scheme."""
    given = {field: options.pop(key) for key, field in SCHEME_OPTIONS.items() if key in options}
    scheme = BlockScheme(**{k: v for k, v in given.items() if v is not None})
    scheme.check()
    return scheme


def quant_stats(packer: BlockPacker | None, ram_bytes: int) -> Snapshot:
    """For ``/v1/cache/stats`` and ``/metrics``: bytes the packer saved on the blocks it stored
    (counters), and what the RAM tier's blocks would take unpacked, estimated (gauges)."""
    if packer is None:
        return Snapshot({})
    counts = packer.stats.to_dict(packer.scheme)
    gauges = {
        "quant_ratio": counts.pop("quant_ratio"),
        "quant_kv_bits": counts.pop("quant_kv_bits"),
    }
    gauges["quant_ram_bytes_saved"] = int(ram_bytes * (gauges["quant_ratio"] - 1))
    series = [Series(k, "counter", v) for k, v in counts.items()]
    series += [Series(k, "gauge", v) for k, v in gauges.items()]
    return Snapshot({**counts, **gauges}, tuple(series))


def unpack_hit(
    layout: Layout,
    segments: list[tuple[Any, int]],
    checkpoint: Any,
    packer: BlockPacker | None,
) -> list[tuple[Any, int]]:
    """A hit's block segments (payload, tokens used) in the model's arrays, ready to restore;
    raises ValueError for a layout with snapshot layers and no ``checkpoint`` (never packed)."""
    if layout.snapshot and checkpoint is None:
        raise ValueError("a hit on a model with snapshot layers needs a checkpoint")
    if packer is None:
        return segments
    return [(packer.unpack(p), n) for p, n in segments]
