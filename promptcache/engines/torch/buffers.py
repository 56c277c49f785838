"""KV buffers in mappings of their own: reused by size, released exactly.

Why: in glibc's heap a freed KV buffer is a hole between live ones. Requests start, grow and
finish in every order under many sessions, so the heap keeps hundreds of MB of such holes
resident that no trim can give back (a live buffer shares their pages), and a lower threshold
for mapping them faults every page in anew at each request. Here each buffer from
``MIN_POOLED_BYTES`` up (a row's layers, a restored hit) is an anonymous mapping of a size
class; a freed one serves the next buffer of its class or one or two below as it is, or grown
or cut (``mremap``: its resident pages move, only new ones fault) for any other. Free ones are
kept up to an eighth of the bytes lent (256 MiB at least), within what the RAM tier's budget
leaves unused (``memory.share_spare``), ``max_free_bytes`` at least; past that, and whenever
``release_free`` is called (a heap trim), a mapping is unmapped whole. CPU only; a buffer's storage is its whole
mapping. Past a share of the system's mapping limit (``vm.max_map_count``), or where a mapping
fails, buffers come from the heap as before.
"""

from __future__ import annotations

import functools
import math
import mmap
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from promptcache.serving.memory import add_pool

MIN_POOLED_BYTES = 64 << 10  # below this, the heap's own reuse is good enough
STEPS_PER_DOUBLING = 8  # size classes: at most 1/8 of a buffer mapped past its bytes
REUSE_CLASSES_ABOVE = 2  # a free buffer up to ~1/4 bigger serves (its pages are resident)
MAX_FREE_BYTES = 32 << 20  # kept free at least
FREE_SHARE = 8  # more: up to 1/8 of the bytes lent, within the RAM budget's unused part,
FREE_BYTES = 256 << 20  # and this much where lent is less (4 sessions: a finished request's)
MAP_LIMIT_SHARE = 4  # at most 1/4 of vm.max_map_count: malloc, threads and files map too
RESERVE_MAP_BYTES = 512 << 10  # a reserved mapping: grown in place for a bigger buffer (mremap)


_PRIVATE = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS  # mmap's default for -1 is shared (shmem)


def _max_maps() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read()) // MAP_LIMIT_SHARE
    except (OSError, ValueError):
        return 65530 // MAP_LIMIT_SHARE


def size_class(nbytes: int) -> int:
    """The mapping size a buffer of ``nbytes`` gets: whole pages, STEPS_PER_DOUBLING classes
    between powers of two."""
    page = mmap.PAGESIZE
    if nbytes <= page:
        return page
    step = max(page, (1 << ((nbytes - 1).bit_length() - 1)) // STEPS_PER_DOUBLING)
    return -(-nbytes // step) * step


@functools.lru_cache(maxsize=4096)
def _fits(size: int) -> tuple[int, ...]:
    """``size``'s class and the REUSE_CLASSES_ABOVE above it, smallest first."""
    fits = [size]
    for _ in range(REUSE_CLASSES_ABOVE):
        fits.append(size_class(fits[-1] + 1))
    return tuple(fits)


class _Lease(np.ndarray):
    """The array a pooled tensor's storage keeps alive: when the last view of it goes, its
    mapping goes back to the pool (``_home`` set right after the view is made)."""

    _home: tuple[BufferPool, mmap.mmap]

    def __del__(self) -> None:
        home = self.__dict__.get("_home")
        if home is not None:
            home[0]._give_back(home[1])


class BufferPool:
    """Invariant (``check_integrity``): ``num_mapped_bytes`` == ``num_lent_bytes`` +
    ``num_free_bytes``; ``num_free_bytes`` <= ``max_free_bytes``, or the bound at the last
    give-back (1/FREE_SHARE of the bytes lent or ``share_floor_bytes``, within ``spare()``:
    the RAM budget's unused part); at most ``max_maps`` mappings.
    Safe from any thread; a buffer is given back from whichever thread drops its last view."""

    def __init__(
        self,
        max_free_bytes: int = MAX_FREE_BYTES,
        max_maps: int | None = None,
        share_floor_bytes: int = FREE_BYTES,
    ) -> None:
        self.max_free_bytes = max_free_bytes
        self.share_floor_bytes = share_floor_bytes
        self.min_bytes = MIN_POOLED_BYTES  # smaller buffers come from the heap
        self.spare: Callable[[], int] | None = None  # more room for free ones (memory.share_spare)
        self._limit = max_free_bytes  # the bound at the last give-back
        self.max_maps = _max_maps() if max_maps is None else max_maps
        self.num_lent_bytes = 0
        self.num_free_bytes = 0
        self.reserve_bytes = 0  # free bytes an idle trim keeps (``reserve``)
        self.num_maps = 0  # mappings made (a reuse is not one)
        self._num_live_maps = 0  # lent or free
        self._free: dict[int, list[mmap.mmap]] = {}
        self._lock = threading.RLock()  # a give-back can run inside a take (a collection)

    @property
    def num_mapped_bytes(self) -> int:
        return self.num_lent_bytes + self.num_free_bytes

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised CPU tensor of ``shape``: a pooled mapping from ``min_bytes`` up,
        else (or past the mapping limit) from the heap (``torch.empty``)."""
        nbytes = math.prod(shape) * dtype.itemsize
        mm = self._take(size_class(nbytes)) if nbytes >= self.min_bytes and nbytes else None
        if mm is None:
            return torch.empty(shape, dtype=dtype)
        lease = np.frombuffer(mm, dtype=np.uint8).view(_Lease)
        lease._home = (self, mm)
        return torch.from_numpy(lease)[:nbytes].view(dtype).view(shape)

    def empty_like(self, like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """``like.new_empty(shape)``, pooled where ``like`` is on a CPU."""
        if like.device.type != "cpu":
            return like.new_empty(shape)
        return self.empty(shape, like.dtype)

    def release_free(self, keep_bytes: int = 0) -> int:
        """Unmap the buffers waiting in the pool, smallest first, until at most ``keep_bytes``
        of them are left: the bytes given back to the system. Safe to call twice (the second
        gives back nothing)."""
        with self._lock:
            freed = 0
            while self._free and self.num_free_bytes > keep_bytes:
                freed += self._drop_smallest()
        return freed

    def reserve(self, nbytes: int) -> int:
        """Keep about ``nbytes`` of free buffers touched, through idle trims (``reserve_bytes``):
        map and fault in what is missing, within the bound on free bytes (the RAM budget's
        unused part). A first touch of memory can cost far more than a copy: on a VM whose host
        backs a page at its first touch (~14 us a page against ~2 on a page the guest reused),
        restoring a 745-token hit into fresh buffers took 120 ms against 20 into free ones, and
        16 sessions' first turns waited 1.5 s on it. The bytes newly mapped; safe to call
        twice."""
        room = self.spare() if self.spare is not None else None
        with self._lock:
            share = self.share_floor_bytes
            limit = min(share, room) if room is not None else share  # no floor: within budget
            self._limit = max(self._limit, limit)  # the bound checked: at least this one
            self.reserve_bytes = want = min(nbytes, limit)
            num = max(0, min((want - self.num_free_bytes) // RESERVE_MAP_BYTES,
                             self.max_maps - self._num_live_maps))  # fmt: skip
            self._num_live_maps += num
        maps = []
        for _ in range(num):
            try:
                mm = mmap.mmap(-1, RESERVE_MAP_BYTES, flags=_PRIVATE)
            except (OSError, ValueError):
                break
            np.frombuffer(mm, dtype=np.uint8)[:: mmap.PAGESIZE] = 0  # each page faulted in now
            maps.append(mm)
        with self._lock:
            self._num_live_maps -= num - len(maps)
            if maps:  # never an empty class: release_free takes the smallest class's last
                self._free.setdefault(RESERVE_MAP_BYTES, []).extend(maps)
            self.num_free_bytes += len(maps) * RESERVE_MAP_BYTES
            self.num_maps += len(maps)
        return len(maps) * RESERVE_MAP_BYTES

    def check_integrity(self) -> None:
        with self._lock:
            free = sum(len(mm) for maps in self._free.values() for mm in maps)
            assert free == self.num_free_bytes, f"free {free} != accounted {self.num_free_bytes}"
            assert self.num_free_bytes <= max(self.max_free_bytes, self._limit), "past bound"
            assert self.num_lent_bytes >= 0 and self._num_live_maps <= self.max_maps

    def describe(self) -> dict[str, Any]:
        return {
            "lent_bytes": self.num_lent_bytes,
            "free_bytes": self.num_free_bytes,
            "maps": self.num_maps,
        }

    def _take(self, size: int) -> mmap.mmap | None:
        with self._lock:
            mm = self._reuse(size)
            if mm is not None:
                return mm
            if self._num_live_maps >= self.max_maps:
                return None
            self._num_live_maps += 1  # before the call: another thread sees the limit
        try:
            mm = mmap.mmap(-1, size, flags=_PRIVATE)
        except (OSError, ValueError):
            with self._lock:
                self._num_live_maps -= 1
            return None
        with self._lock:
            self.num_lent_bytes += size
            self.num_maps += 1
        return mm

    def _reuse(self, size: int) -> mmap.mmap | None:
        """A free mapping for ``size`` (lock held): of its class or up to two above as it is,
        else the nearest one below grown (``mremap``: its pages move, only the new ones fault;
        a session's next turn needs a bigger buffer than any its last turn freed), else the
        nearest above cut down."""
        sizes = [fit for fit in _fits(size) if self._free.get(fit)]
        if not sizes:
            below = [k for k, maps in self._free.items() if maps and k < size]
            above = [k for k, maps in self._free.items() if maps and k > size]
            sizes = [max(below)] if below else [min(above)] if above else []
        if not sizes:
            return None
        have = sizes[0]
        mm = self._free[have].pop()
        if not self._free[have]:
            del self._free[have]
        self.num_free_bytes -= have
        if have not in _fits(size):
            try:
                mm.resize(size)
            except (BufferError, OSError, ValueError, SystemError):
                self._free.setdefault(have, []).append(mm)  # its last view is still going
                self.num_free_bytes += have
                return None
        self.num_lent_bytes += len(mm)
        return mm

    def _give_back(self, mm: mmap.mmap) -> None:
        size, spare = len(mm), self.spare
        room = spare() if spare is not None else None  # not under the lock: it reads the tiers
        with self._lock:
            self.num_lent_bytes -= size
            # free ones: an eighth of what is lent (FREE_BYTES at least), within the RAM
            # budget's unused part
            share = max(self.num_lent_bytes // FREE_SHARE, self.share_floor_bytes)
            limit = min(share, room) if room is not None else share
            self._limit = limit = max(self.max_free_bytes, limit)
            if self.num_free_bytes + size <= limit:
                self._free.setdefault(size, []).append(mm)
                self.num_free_bytes += size
            else:
                self._num_live_maps -= 1  # unmapped once the caller's array lets go
            while self.num_free_bytes > limit:  # the bound fell with the bytes lent
                self._drop_smallest()

    def _drop_smallest(self) -> int:
        """Unmap one free buffer of the smallest class (lock held, some free); its bytes."""
        smallest = min(self._free)
        self._free[smallest].pop()
        if not self._free[smallest]:
            del self._free[smallest]
        self.num_free_bytes -= smallest
        self._num_live_maps -= 1
        return smallest


POOL = BufferPool()  # the process's: buffers freed by one engine serve the next
add_pool(POOL)  # a heap trim unmaps the free ones too
