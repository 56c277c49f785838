"""Reads of the shared tier: one round trip, each value verified as soon as it arrives.

A promotion reads a whole history (32 blocks of ~3 MB for 2K tokens of the bundled model). A
plain pipeline would take every value in before verifying the first, and its parser copies each
value twice on the way; instead every command is written at once on one connection, each value
received straight into its own buffer (``stream``) and verified as it is read while the
server keeps writing the next ones. No thread hand-off: measured on a busy 2-core machine,
reader threads cost more than they overlapped. Cluster mode (values on several primaries) uses
one pipeline.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from promptcache.core.block import BlockMeta
from promptcache.core.block_file import CorruptBlockError, decode_block, verify_identity
from promptcache.core.hashing import BlockHash
from promptcache.core.sequence import TokenSeq
from promptcache.core.tiers.base import ReadResult, StoredBlock
from promptcache.core.tiers.shared.context import SharedContext
from promptcache.core.tiers.shared.index import (
    FoundIndex,
    SharedEntry,
    kid_field,
    lookup_args,
    parse_lookup,
    unpack_meta,
    walk,
)
from promptcache.core.tiers.shared.scripts import LOOKUP_LUA
from promptcache.core.tiers.shared.stream import RespStream

log = logging.getLogger("promptcache.shared")


class SharedBlockMissingError(CorruptBlockError):
    """The value expired, was evicted or the server is unreachable: the hit ends; not damage."""

    is_damage = False


class SharedBlockRaceError(SharedBlockMissingError):
    """The right block, but rewritten (a checkpoint added) since the lookup: the hit ends."""


class SharedReader:
    """The shared tier's ``lookup``/``read`` half (touches go through the writer's queue), over its
    context: lookups and reads on the request path, bounded by the socket timeout, never
    raising."""

    def __init__(self, ctx: SharedContext, lookup_mode: str) -> None:
        if lookup_mode not in ("lua", "pipeline"):
            raise ValueError(f"lookup_mode must be 'lua' or 'pipeline', got {lookup_mode!r}")
        self.ctx = ctx
        self.lookup_mode = lookup_mode
        self.keys, self.link, self.stats = ctx.keys, ctx.link, ctx.stats

    def lookup(
        self, seq: TokenSeq, start: int, parent: BlockHash, requires_checkpoint: bool = False
    ) -> list[StoredBlock]:
        if self.ctx.is_closed or not self.link.is_up or start * seq.block_size >= seq.num_tokens:
            return []
        hashes, toks = lookup_args(seq, start, parent)
        if self.lookup_mode == "lua":
            m, c, _ = self.keys.index(seq.root)
            reply = self.link.call(
                lambda cl: self.ctx.eval(cl, LOOKUP_LUA, [m, c], [parent, hashes, toks])
            )
            if reply is None:
                found: list[SharedEntry] = []
            else:
                chain, kids = parse_lookup(reply, seq.root)
                found = walk(FoundIndex([*chain, *kids]), seq, start, parent, requires_checkpoint)
        else:
            found = self._lookup_pipelined(seq, start, parent, hashes, toks, requires_checkpoint)
        self.stats.add(num_lookups=1, num_found=int(bool(found)))
        self.ctx.note_roots(e.meta for e in found)
        return [e.stored() for e in found]

    def _lookup_pipelined(
        self, seq: TokenSeq, start: int, parent: BlockHash, hashes: bytes, toks: bytes, rc: bool
    ) -> list[SharedEntry]:
        """Round trip 1: every expected entry and every possible child list; then the entries
        of each child list the walk asks for."""
        m, c, _ = self.keys.index(seq.root)
        hl = [hashes[i : i + 16] for i in range(0, len(hashes), 16)]
        parents = [parent, *hl]
        keys = [(BlockHash(parents[i]), int.from_bytes(toks[4 * i : 4 * i + 4], "little"))
                for i in range(len(toks) // 4)]  # fmt: skip
        fields = [kid_field(p, t) for p, t in keys]

        def first(cl: Any) -> Any:
            p = cl.pipeline(transaction=False)
            if hl:
                p.hmget(m, hl)
            if fields:
                p.hmget(c, fields)
            return p.execute()

        reply = self.link.call(first)
        if reply is None:
            return []
        entries, kid_lists = (reply[0], reply[1] if fields else []) if hl else ([], reply[0])
        lists = dict(zip(keys, kid_lists, strict=False))
        chain: list[SharedEntry] = []
        for h, e in zip(hl, entries, strict=True):
            meta = unpack_meta(h, seq.root, e) if e else None
            if meta is None:
                break
            chain.append(meta)

        def more(p: BlockHash, t: int) -> list[SharedEntry]:
            kids = lists.get((p, t))
            if not kids:
                return []
            ks = [kids[i : i + 16] for i in range(0, len(kids), 16)]
            got = self.link.call(lambda cl: cl.hmget(m, ks))
            found = [unpack_meta(k, seq.root, e) for k, e in zip(ks, got or [], strict=False) if e]
            return [x for x in found if x is not None]

        return walk(FoundIndex(chain, more), seq, start, parent, rc)

    def note_miss(self, failed: bool) -> None:
        self.stats.add(**{"promotion_failures" if failed else "num_misses": 1})

    def _refresh_cmds(self, metas: list[BlockMeta], now: int) -> list[tuple[Any, ...]]:
        """The entries' recency and the index keys' TTL, refreshed by a read."""
        cmds: list[tuple[Any, ...]] = [
            ("ZADD", self.keys.index(x.root)[2], "XX", now, x.block_hash) for x in metas
        ]
        for root in {x.root for x in metas}:
            cmds += [
                ("PEXPIRE", k, self.ctx.ttl_ms) for k in dict.fromkeys(self.keys.namespace(root))
            ]
        return cmds

    def _fetch(self, metas: list[BlockMeta], now: int) -> list[Any] | None:
        """Cluster mode (values spread over the primaries): one pipelined round trip."""

        def run(cl: Any) -> Any:
            p = cl.pipeline(transaction=False)
            for x in metas:
                p.getex(self.keys.data(x.block_hash), px=self.ctx.ttl_ms)
            for cmd in self._refresh_cmds(metas, now):
                p.execute_command(*cmd)
            return p.execute()[: len(metas)]

        return self.link.call(run)

    def _stream(self, metas: list[BlockMeta], now: int, take: Callable[[Any], None]) -> bool:
        """Standalone: every command written at once on one pooled connection, each value
        received into its own buffer (``stream``) and handed to ``take`` as soon as it
        is in (verified while the next ones arrive); False when the link failed (``take`` has
        had the values before the failure)."""

        def run(cl: Any) -> bool:
            pool = cl.connection_pool
            conn = pool.get_connection("GETEX")
            done = False
            try:
                cmds = [
                    ("GETEX", self.keys.data(x.block_hash), "PX", self.ctx.ttl_ms) for x in metas
                ]
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
        if not self.link.is_up or self.ctx.is_closed:
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
                out.append(self.verify(b, v))
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
        if self.ctx.evictions is not None:
            for x in missing:  # the server evicted or expired it: a miss can say so
                self.ctx.evictions.note(x.block_hash, x.parent_hash, self.ctx.name)
        if bad or missing:
            self.ctx.delete(bad + missing, data=bool(bad))
        return out

    def verify(self, block: StoredBlock, value: bytes | np.ndarray) -> tuple[Any, Any]:
        # no copy: the value is a fresh buffer owned by this read alone, so tensors may view it
        # (writable when it came off the socket directly; read-only views of a bytes object)
        info, payload, checkpoint = decode_block(value, self.ctx.codec)
        verify_identity(info, block.meta.block_hash.hex())
        if info.model != self.ctx.model or info.meta.root != block.meta.root:
            raise CorruptBlockError("value of another model or namespace")
        if info.meta != block.meta:
            raise CorruptBlockError("value does not match its index entry")
        if (info.has_checkpoint, info.payload_nbytes) != (block.has_checkpoint, block.nbytes):
            # the right block, rewritten since the lookup (a checkpoint added): not damage
            raise SharedBlockRaceError("value rewritten since the lookup")
        return payload, checkpoint
