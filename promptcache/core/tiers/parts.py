"""A block store composed of explicit parts: a reader, a writer and a sessions part.

``PartsTier`` is what SSD and the shared tier have in common: each protocol call goes to the one
part that owns it. A backend builds its parts over the state they share (the SSD tier's folder,
the shared tier's context) and adds what is its own (``touch``, stats, checks, close).
"""

from __future__ import annotations

from typing import Any, Protocol

from promptcache.core.hashing import BlockHash
from promptcache.core.sequence import TokenSeq
from promptcache.core.sessions import BlockUse
from promptcache.core.tiers.base import BlockRecord, ReadResult, StoredBlock
from promptcache.core.tiers.write_behind import WriteBehind

__all__ = ["PartsTier", "Reader", "SessionsPart", "Writer"]


class Reader(Protocol):
    def lookup(
        self, seq: TokenSeq, start: int, parent: BlockHash, requires_checkpoint: bool = False
    ) -> list[StoredBlock]: ...

    def read(self, blocks: list[StoredBlock]) -> list[ReadResult]: ...

    def note_miss(self, failed: bool) -> None: ...


class Writer(Protocol):
    queue: WriteBehind[Any]  # its write-behind queue (``QueuesWrites`` reads and bounds it)

    def put(self, record: BlockRecord) -> bool: ...

    def flush(self, timeout: float = 30.0) -> bool: ...


class SessionsPart(Protocol):
    def tag(
        self, hashes: list[BlockHash], use: BlockUse, now: float, root: BlockHash | None = None
    ) -> None: ...

    def session_blocks(self, session: str) -> dict[BlockHash, bool]: ...

    def forget_session(self, session: str) -> None: ...

    def delete_blocks(self, hashes: list[BlockHash]) -> tuple[int, int]: ...

    def delete_namespace(self, root: BlockHash) -> tuple[int, int]: ...

    def expire(self, now: float) -> int: ...


class PartsTier:
    """The protocol calls, each handed to its part (set by the backend's ``__init__``)."""

    reader: Reader
    writer: Writer
    sessions: SessionsPart

    # -- BlockStore: lookup, read, put, flush --------------------------------------------------

    def lookup(
        self, seq: TokenSeq, start: int, parent: BlockHash, requires_checkpoint: bool = False
    ) -> list[StoredBlock]:
        return self.reader.lookup(seq, start, parent, requires_checkpoint)

    def read(self, blocks: list[StoredBlock]) -> list[ReadResult]:
        return self.reader.read(blocks)

    def note_miss(self, failed: bool) -> None:
        self.reader.note_miss(failed)

    def put(self, record: BlockRecord) -> bool:
        return self.writer.put(record)

    def flush(self, timeout: float = 30.0) -> bool:
        return self.writer.flush(timeout)

    # -- QueuesWrites: the writer's queue --------------------------------------------------------

    def queued_bytes(self) -> int:
        return self.writer.queue.num_queued_bytes

    def limit_queued_bytes(self, nbytes: int) -> None:
        self.writer.queue.max_bytes = nbytes

    # -- BlockStore.delete_blocks and SessionAdmin: the sessions part ---------------------------

    def tag(
        self, hashes: list[BlockHash], use: BlockUse, now: float, root: BlockHash | None = None
    ) -> None:
        self.sessions.tag(hashes, use, now, root)

    def session_blocks(self, session: str) -> dict[BlockHash, bool]:
        return self.sessions.session_blocks(session)

    def forget_session(self, session: str) -> None:
        self.sessions.forget_session(session)

    def delete_blocks(self, hashes: list[BlockHash]) -> tuple[int, int]:
        return self.sessions.delete_blocks(hashes)

    def delete_namespace(self, root: BlockHash) -> tuple[int, int]:
        return self.sessions.delete_namespace(root)

    def expire(self, now: float) -> int:
        return self.sessions.expire(now)
