"""Reads of the shared tier: one round trip, each value verified as soon as it arrives.

A promotion reads a whole history (32 blocks of ~3 MB for 2K tokens of the bundled model). A
plain pipeline would take every value in before verifying the first, and its parser copies each
value twice on the way; instead every command is written at once on one connection, each value
received straight into its own buffer (``valkey_stream``) and verified as it is read while the
server keeps writing the next ones. No thread hand-off: measured on a busy 2-core machine,
reader threads cost more than they overlapped. Cluster mode (values on several primaries) uses
one pipeline.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from promptcache.core.block import BlockMeta
from promptcache.core.block_file import CorruptBlockError, decode_block, verify_identity
from promptcache.core.codec import PayloadCodec
from promptcache.core.evictions import EvictionLog
from promptcache.core.tiers.base import ReadResult, StoredBlock
from promptcache.core.tiers.shared.index import Keys
from promptcache.core.tiers.shared.link import SharedStats, ValkeyLink
from promptcache.core.tiers.shared.stream import RespStream

log = logging.getLogger("promptcache.shared")


class SharedBlockMissingError(CorruptBlockError):
    """The value expired, was evicted or the server is unreachable: the hit ends; not damage."""

    is_damage = False


class SharedBlockRaceError(SharedBlockMissingError):
    """The right block, but rewritten (a checkpoint added) since the lookup: the hit ends."""


class SharedReads:
    """The read half of ``ValkeyStore`` (a mixin: the store owns the state below)."""

    name: str
    model: str
    keys: Keys
    codec: PayloadCodec
    link: ValkeyLink
    stats: SharedStats
    ttl_ms: int
    evictions: EvictionLog | None
    _closed: bool
    _lock: threading.Lock

    def delete(self, metas: list[BlockMeta], data: bool = True) -> None:
        raise NotImplementedError

    def _refresh_cmds(self, metas: list[BlockMeta], now: int) -> list[tuple[Any, ...]]:
        """The entries' recency and the index keys' TTL, refreshed by a read."""
        cmds: list[tuple[Any, ...]] = [
            ("ZADD", self.keys.index(x.root)[2], "XX", now, x.block_hash) for x in metas
        ]
        for root in {x.root for x in metas}:
            cmds += [("PEXPIRE", k, self.ttl_ms) for k in dict.fromkeys(self.keys.namespace(root))]
        return cmds

    def _fetch(self, metas: list[BlockMeta], now: int) -> list[Any] | None:
        """Cluster mode (values spread over the primaries): one pipelined round trip."""

        def run(cl: Any) -> Any:
            p = cl.pipeline(transaction=False)
            for x in metas:
                p.getex(self.keys.data(x.block_hash), px=self.ttl_ms)
            for cmd in self._refresh_cmds(metas, now):
                p.execute_command(*cmd)
            return p.execute()[: len(metas)]

        return self.link.call(run)

    def _stream(self, metas: list[BlockMeta], now: int, take: Callable[[Any], None]) -> bool:
        """Standalone: every command written at once on one pooled connection, each value
        received into its own buffer (``valkey_stream``) and handed to ``take`` as soon as it
        is in (verified while the next ones arrive); False when the link failed (``take`` has
        had the values before the failure)."""

        def run(cl: Any) -> bool:
            pool = cl.connection_pool
            conn = pool.get_connection("GETEX")
            done = False
            try:
                cmds = [("GETEX", self.keys.data(x.block_hash), "PX", self.ttl_ms) for x in metas]
                refresh = self._refresh_cmds(metas, now)
                conn.send_packed_command(conn.pack_commands(cmds + refresh))
                sock = getattr(conn, "_sock", None)
                if sock is not None:
                    stream = RespStream(sock)
                    for _ in metas:
                        take(stream.reply())
                    for _ in refresh:
                        stream.reply()
                    # the parser never saw these replies, and nothing is left unread
                    done = stream.pos == len(stream.buf)
                else:  # no socket to read from directly: the client's own parser
                    for _ in metas:
                        take(conn.read_response())
                    for _ in refresh:
                        conn.read_response()
                    done = True
            finally:
                if not done:  # replies left unread: the connection cannot be reused
                    conn.disconnect()
                pool.release(conn)
            return True

        return bool(self.link.call(run))

    def read(self, blocks: list[StoredBlock]) -> list[ReadResult]:
        if not blocks:
            return []
        if not self.link.is_up or self._closed:
            return [SharedBlockMissingError("shared tier unreachable")] * len(blocks)
        now = int(time.time() * 1000)
        t0 = time.perf_counter()
        out: list[ReadResult] = []
        bad: list[BlockMeta] = []
        missing: list[BlockMeta] = []
        nbytes = races = 0

        def take(v: Any) -> None:
            nonlocal nbytes, races
            b = blocks[len(out)]
            x = b.meta
            if v is None:
                missing.append(x)
                out.append(SharedBlockMissingError(f"{x.block_hash.hex()} expired or evicted"))
                return
            try:
                out.append(self._verify(b, v))
                nbytes += v.nbytes if isinstance(v, np.ndarray) else len(v)
            except SharedBlockRaceError as exc:
                races += 1
                out.append(exc)
            except CorruptBlockError as exc:
                log.warning("shared tier: bad value %s deleted: %s", x.block_hash.hex(), exc)
                bad.append(x)
                out.append(exc)

        metas = [b.meta for b in blocks]
        if self.link.cluster:
            for v in self._fetch(metas, now) or ():
                take(v)
        else:
            self._stream(metas, now, take)
        # the link failed part way: the rest is unreachable (not missing: nothing to clean)
        out += [SharedBlockMissingError("shared tier unreachable")] * (len(blocks) - len(out))
        self.stats.observe_read(time.perf_counter() - t0, nbytes)
        num_read = sum(1 for x in out if not isinstance(x, Exception))
        self.stats.add(num_blocks_read=num_read, num_corrupt=len(bad), num_missing=len(missing),
                       num_read_races=races)  # fmt: skip
        if self.evictions is not None:
            for x in missing:  # the server evicted or expired it: a miss can say so
                self.evictions.note(x.block_hash, x.parent_hash, self.name)
        if bad or missing:
            self.delete(bad + missing, data=bool(bad))
        return out

    def _verify(self, block: StoredBlock, value: bytes | np.ndarray) -> tuple[Any, Any]:
        # no copy: the value is a fresh buffer owned by this read alone, so tensors may view it
        # (writable when it came off the socket directly; read-only views of a bytes object)
        info, payload, checkpoint = decode_block(value, self.codec)
        verify_identity(info, block.meta.block_hash.hex())
        if info.model != self.model or info.meta.root != block.meta.root:
            raise CorruptBlockError("value of another model or namespace")
        if info.meta != block.meta:
            raise CorruptBlockError("value does not match its index entry")
        if (info.has_checkpoint, info.payload_nbytes) != (block.has_checkpoint, block.nbytes):
            # the right block, rewritten since the lookup (a checkpoint added): not damage
            raise SharedBlockRaceError("value rewritten since the lookup")
        return payload, checkpoint
