"""Loopback ports for the servers tests and benchmarks start as child processes (the
promptcache server, vLLM, valkey-server), and the race a free port leaves open."""

from __future__ import annotations

import socket
from collections.abc import Callable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_claiming_port(
    start_once: Callable[[], bool], move_to: Callable[[int], None], what: str, attempts: int = 3
) -> None:
    """Start a server on a port from ``free_port``, which hands the port back before the child
    binds it: another process may take it first. ``start_once`` returns True once its own child
    answers (a server's answer that is not the child's does not count), False when the child
    exited after another answered there (it lost the port); then ``move_to`` a new port, again."""
    for _ in range(attempts):
        if start_once():
            return
        move_to(free_port())
    raise RuntimeError(f"another process took {what}'s port {attempts} times")
