"""Replies of a pipelined read taken straight off the socket: each value lands in its own buffer.

A client's parser copies a reply several times (socket -> parser buffer -> bytes object); for
the shared tier's values (megabytes each) those copies cost about as much as the verification
that follows. ``RespStream`` reads the RESP replies of commands already sent on a connection
(``valkey-py`` ``Connection``, after ``connect``: AUTH, SELECT and TLS are its business) and
receives each bulk value directly into a fresh numpy byte buffer, writable, that tensors then
view without a copy. It understands what a read pipeline gets back: bulk strings, nulls,
integers, simple strings and errors.
"""

from __future__ import annotations

import socket

import numpy as np

_SCRATCH = 1 << 16


class RespError(Exception):
    """The server answered an error to one of the commands (the connection stays in sync)."""


class RespStream:
    """Sequential reader of replies on ``sock``; not thread-safe (one per read)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.pos = 0

    def _fill(self) -> None:
        if self.pos:
            del self.buf[: self.pos]
            self.pos = 0
        chunk = self.sock.recv(_SCRATCH)
        if not chunk:
            raise ConnectionError("shared tier: connection closed mid-reply")
        self.buf += chunk

    def _line(self) -> bytes:
        while True:
            end = self.buf.find(b"\r\n", self.pos)
            if end >= 0:
                line = bytes(self.buf[self.pos : end])
                self.pos = end + 2
                return line
            self._fill()

    def _exact(self, out: memoryview) -> None:
        """Fill ``out``: first from what is buffered, then straight from the socket."""
        have = min(len(self.buf) - self.pos, len(out))
        out[:have] = self.buf[self.pos : self.pos + have]
        self.pos += have
        got = have
        while got < len(out):
            n = self.sock.recv_into(out[got:])
            if not n:
                raise ConnectionError("shared tier: connection closed mid-value")
            got += n

    def reply(self) -> np.ndarray | int | bytes | None:
        """The next reply: a bulk string as a uint8 array, None for a null, an int, or a simple
        string as bytes; raises RespError for an error reply."""
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            value = np.empty(n, dtype=np.uint8)
            self._exact(value.data)
            self._exact(memoryview(bytearray(2)))  # the trailing CRLF
            return value
        if kind == b":":
            return int(rest)
        if kind == b"+":
            return rest
        if kind == b"_":  # RESP3 null
            return None
        if kind == b"-":
            raise RespError(rest.decode(errors="replace"))
        raise ConnectionError(f"shared tier: unexpected reply type {kind!r}")
