"""One process per SSD cache folder: an exclusive ``flock`` held for the tier's life.

Two servers on one folder would delete each other's in-flight temp files at start-up and race
on the index; the second one refuses instead, naming the folder and the PID that holds it. The
kernel drops the lock when its holder dies, even by kill -9, so a crash never leaves it stale.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from promptcache.core.private_fs import open_private

LOCK_NAME = "lock"


class CacheDirLockedError(RuntimeError):
    """Another process holds the cache folder."""


class CacheDirLock:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.path = folder / LOCK_NAME
        self._fd: int | None = None

    def acquire(self, purpose: str = "serving") -> None:
        """Take the lock or raise CacheDirLockedError; OSError when the folder is unusable."""
        fd = open_private(self.path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            pid = self.holder_pid()
            who = f"PID {pid}" if pid else "another process"
            raise CacheDirLockedError(
                f"cache folder {self.folder} is in use by {who}: stop it or use another "
                f"--cache-dir (only one promptcache process may use a cache folder)"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} {purpose}\n".encode(), 0)
        except OSError:  # a full disk: the lock holds without its note of who holds it
            pass

    def holder_pid(self) -> int | None:
        """The PID written by the holder (None when unknown or not yet written)."""
        try:
            first = self.path.read_text().split()
            return int(first[0]) if first else None
        except (OSError, ValueError):
            return None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
