"""Chained block hashes.

A block's hash covers its parent's hash, its token ids (uint32 little-endian) and any extra
keys (an image digest, ...). The chain's root is a namespace: model fingerprint + tenant + salt,
so two models or two tenants never share a chain. Everything here is a pure function of bytes:
identical across processes and machines (no ``hash()``, no PYTHONHASHSEED).
"""

from __future__ import annotations

import array
import hashlib
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NewType

import numpy as np
import xxhash

BlockHash = NewType("BlockHash", bytes)
HASH_BYTES = 16
TOKEN_DTYPE = np.dtype("<u4")
TOKEN_BYTES = TOKEN_DTYPE.itemsize

# xxh3-128: twice blake2b's speed on block-sized messages (benchmarks/core_bench.py). A hash is
# only an index key: lookups verify every block's tokens and its parent object, so a collision,
# even a forged one, can never serve another sequence's or another tenant's state.
HASH_ALGORITHM = "xxh3-128"


def _blake2b(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=HASH_BYTES).digest()


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()[:HASH_BYTES]


_xxh3 = xxhash.xxh3_128_digest


HASHERS: dict[str, Callable[[bytes], bytes]] = {
    "blake2b-128": _blake2b,
    "sha256-128": _sha256,
    "xxh3-128": _xxh3,
}
_digest = HASHERS[HASH_ALGORITHM]


def digest_bytes(data: bytes) -> bytes:
    """The project's hash of arbitrary bytes (``HASH_BYTES`` long)."""
    return _digest(data)


def tokens_to_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as uint32 little-endian bytes. Raises ValueError on negatives or non-integers."""
    if isinstance(tokens, list):  # the common case; array() is ~3x faster than numpy on lists
        try:
            buf = array.array("I", tokens)
        except (TypeError, OverflowError) as exc:
            raise ValueError(f"token ids must be integers in [0, 2**32): {exc}") from None
        if sys.byteorder != "little":
            buf.byteswap()
        return buf.tobytes()
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"token ids must be a 1-D sequence, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
    if arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
        raise ValueError("token ids must lie in [0, 2**32)")
    return arr.astype(TOKEN_DTYPE, copy=False).tobytes()


def hash_block(parent: BlockHash, token_bytes: bytes, extra: bytes = b"") -> BlockHash:
    """Hash of one block given its parent's hash. ``extra`` is length-prefixed so it can't alias tokens."""
    if extra:
        return BlockHash(_digest(parent + len(extra).to_bytes(4, "little") + extra + token_bytes))
    return BlockHash(_digest(parent + token_bytes))


@dataclass(frozen=True, slots=True)
class Namespace:
    """Where a hash chain starts. Two namespaces that differ in any field never share a block."""

    model_fingerprint: str
    tenant: str = ""
    salt: str = ""

    def root_hash(self) -> BlockHash:
        payload = json.dumps(
            ["promptcache/v1", HASH_ALGORITHM, self.model_fingerprint, self.tenant, self.salt]
        ).encode()
        return BlockHash(_digest(payload))


def fingerprint_model(config: dict[str, Any], weights_digest: str, dtype: str, engine: str) -> str:
    """Stable model fingerprint: architecture config, weights digest, dtype and engine."""
    canonical = json.dumps(
        {"config": config, "weights": weights_digest, "dtype": dtype, "engine": engine},
        sort_keys=True,
        default=str,
    ).encode()
    return digest_bytes(canonical).hex()
