"""The vision-embedding cache: an image encoder's output, kept so the same image is encoded once.

Keyed by ``VisionKey``: the model fingerprint (the weights that encoded it), the processor
settings that shaped the pixels the encoder saw (size, normalisation, feature layer...), the
pixel digest and the tenant (as prompt blocks: a tenant's TTFT never tells whether another
tenant sent an image). Payloads are opaque library arrays, sized from shape x dtype. A RAM tier with a
byte budget (least recently used first out) and, optionally, an SSD folder of safetensors files
(one per entry, checksummed; a bad file is deleted and counted, never served), in one folder
per tenant, with the sessions that used each entry (``vision_tags``): deleting a session or a
tenant removes its images' encoder outputs too. Thread-safe.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from promptcache.core.block import payload_nbytes
from promptcache.core.block_file import write_atomic
from promptcache.core.codec import PayloadCodec
from promptcache.core.figures import Series, Snapshot
from promptcache.core.hashing import digest_bytes
from promptcache.core.private_fs import make_private_dirs
from promptcache.core.vision_tags import (
    append_tag,
    forget_on_disk,
    is_removable,
    read_tags,
    remove_entry,
    remove_tenant_folder,
    session_tag,
    tenant_folder,
    write_tags,
)

log = logging.getLogger("promptcache")

FOLDER = "vision-embeddings"  # beside the SSD tier's model folders (no index.sqlite: not one)
FORMAT = "1"


@dataclass(frozen=True, slots=True)
class VisionKey:
    fingerprint: str  # the model's (runner.fingerprint)
    settings: str  # the vision half's processor settings (VisionModel.settings_key)
    digest: bytes  # ImageInput.digest
    tenant: str = ""

    @property
    def name(self) -> str:
        """A file-name-safe digest of the whole key."""
        raw = f"{self.fingerprint}\0{self.settings}\0{self.tenant}\0".encode() + self.digest
        return digest_bytes(raw).hex()


class VisionCache:
    """``budget_bytes`` of encoder outputs in RAM; with ``ssd_dir`` and ``codec`` also on disk
    (``ssd_budget_bytes``, oldest files removed first)."""

    def __init__(
        self,
        budget_bytes: int,
        ssd_dir: str | Path | None = None,
        codec: PayloadCodec | None = None,
        ssd_budget_bytes: int = 2 * 2**30,
    ) -> None:
        self.budget_bytes = int(budget_bytes)
        self.codec = codec
        self.folder = Path(ssd_dir) / FOLDER if ssd_dir is not None and codec else None
        self.ssd_budget_bytes = ssd_budget_bytes
        self._lock = threading.Lock()
        self._ram: OrderedDict[str, tuple[Any, int]] = OrderedDict()  # name -> (payload, bytes)
        self._owner: dict[str, str] = {}  # name -> tenant, for every RAM entry
        self._tags: dict[str, set[str]] = {}  # name -> session tags, for every RAM entry
        self.used_bytes = 0
        self.num_hits = self.num_ssd_hits = self.num_misses = 0
        self.num_puts = self.num_evictions = self.num_too_large = 0
        self.num_ssd_writes = self.num_ssd_errors = self.num_bad_files = 0
        if self.folder is not None:
            make_private_dirs(self.folder)

    # -- use ------------------------------------------------------------------------------------

    def get(self, key: VisionKey, session: str = "") -> Any | None:
        """The cached encoder output for ``key`` (RAM, then SSD), or None (a miss, counted);
        a hit tags the entry with ``session``."""
        name = key.name
        with self._lock:
            entry = self._ram.get(name)
            if entry is not None:
                self._ram.move_to_end(name)
                self.num_hits += 1
                self._tag(key, name, session)
                return entry[0]
        payload = self._read(key)
        with self._lock:
            if payload is None:
                self.num_misses += 1
                return None
            self.num_ssd_hits += 1
            tags = read_tags(self._path(key)) if self.folder is not None else set()
            self._insert(name, payload, key.tenant, tags)
            self._tag(key, name, session)
        return payload

    def put(self, key: VisionKey, payload: Any, session: str = "") -> None:
        """Keep ``payload`` (an owning array or tree of arrays) for ``key``, used by ``session``;
        written to the SSD folder too when there is one (synchronously: an encoder run just cost
        far more)."""
        name = key.name
        tag = session_tag(key.tenant, session)
        with self._lock:
            self.num_puts += 1
            self._insert(name, payload, key.tenant, {tag} - {""})
        self._write(key, payload, {tag} - {""})

    def _insert(self, name: str, payload: Any, tenant: str, tags: set[str]) -> None:
        nbytes = payload_nbytes(payload)
        self._drop(name)
        if nbytes > self.budget_bytes:
            self.num_too_large += 1
            return
        while self._ram and self.used_bytes + nbytes > self.budget_bytes:
            self._drop(next(iter(self._ram)))
            self.num_evictions += 1
        self._ram[name] = (payload, nbytes)
        self._owner[name], self._tags[name] = tenant, tags
        self.used_bytes += nbytes

    def _drop(self, name: str) -> None:
        old = self._ram.pop(name, None)
        if old is not None:
            self.used_bytes -= old[1]
            del self._owner[name], self._tags[name]

    def _tag(self, key: VisionKey, name: str, session: str) -> None:
        """Note a session's use of a RAM entry (and beside its file); caller holds the lock."""
        tag = session_tag(key.tenant, session)
        tags = self._tags.get(name)
        if not tag or tags is None or tag in tags:
            return
        tags.add(tag)
        if self.folder is not None and self._path(key).exists():
            try:
                append_tag(self._path(key), tag)
            except OSError as exc:
                log.warning("vision cache: cannot tag %s: %s", name, exc)

    # -- sessions and tenants (issue 18) --------------------------------------------------------

    def forget_session(self, tenant: str, session: str, force: bool = False) -> int:
        """Remove the entries only ``session`` of ``tenant`` used (every one it used with
        ``force``), in RAM and on disk; untag the rest. Returns the number of entries removed."""
        tag = session_tag(tenant, session)
        if not tag:
            return 0
        with self._lock:
            names = [n for n, t in self._owner.items() if t == tenant and tag in self._tags[n]]
            gone = {n for n in names if is_removable(self._tags[n], tag, force)}
            for n in names:
                if n in gone:
                    self._drop(n)
                else:
                    self._tags[n].discard(tag)
            on_disk = 0
            if self.folder is not None:
                on_disk = forget_on_disk(self.folder / tenant_folder(tenant), tag, force)
        return max(len(gone), on_disk)

    def forget_tenant(self, tenant: str) -> int:
        """Remove every entry of ``tenant``, in RAM and on disk; the number removed."""
        with self._lock:
            names = [n for n, t in self._owner.items() if t == tenant]
            for n in names:
                self._drop(n)
            on_disk = 0
            if self.folder is not None:
                on_disk = remove_tenant_folder(self.folder / tenant_folder(tenant))
        return max(len(names), on_disk)

    # -- disk -----------------------------------------------------------------------------------

    def _path(self, key: VisionKey) -> Path:
        assert self.folder is not None
        return self.folder / tenant_folder(key.tenant) / f"{key.name}.safetensors"

    def _write(self, key: VisionKey, payload: Any, tags: set[str]) -> None:
        if self.folder is None or self.codec is None:
            return
        from safetensors.numpy import save

        name, path = key.name, self._path(key)
        try:
            arrays, structure = self.codec.to_arrays(payload, None)
            meta = {"format": FORMAT, "key": name, "structure": structure}
            meta["checksum"] = _checksum(meta, arrays)
            make_private_dirs(path.parent)
            write_tags(path, tags)
            write_atomic(path, save(arrays, metadata=meta))
            self._trim_ssd()
        except (OSError, TypeError, ValueError) as exc:
            with self._lock:
                self.num_ssd_errors += 1
            log.warning("vision cache: cannot write an entry to %s: %s", self.folder, exc)
            return
        with self._lock:
            self.num_ssd_writes += 1

    def _read(self, key: VisionKey) -> Any | None:
        if self.folder is None or self.codec is None:
            return None
        name, path = key.name, self._path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError:
            return None
        try:
            arrays, meta = _load(data)
            if meta.get("key") != name or meta.get("checksum") != _checksum(meta, arrays):
                raise ValueError("checksum or key mismatch")
            payload, _ = self.codec.from_arrays(arrays, meta["structure"])
        except Exception as exc:  # any damage: delete, count, recompute
            with self._lock:
                self.num_bad_files += 1
            log.warning("vision cache: %s is damaged (%s): removed", path.name, exc)
            remove_entry(path)
            return None
        path.touch(exist_ok=True)  # its mtime orders the SSD trim (least recently used first)
        return payload

    def _trim_ssd(self) -> None:
        assert self.folder is not None
        files = [
            (p.stat().st_mtime, p.stat().st_size, p) for p in self.folder.glob("*/*.safetensors")
        ]
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files, key=lambda f: f[0]):
            if total <= self.ssd_budget_bytes:
                break
            remove_entry(path)
            total -= size

    # -- report ---------------------------------------------------------------------------------

    def stats(self) -> Snapshot:
        with self._lock:
            lookups = self.num_hits + self.num_ssd_hits + self.num_misses
            gauges = {"entries": len(self._ram), "bytes": self.used_bytes,
                      "budget_bytes": self.budget_bytes,
                      "hit_rate": (self.num_hits + self.num_ssd_hits) / lookups if lookups else 0.0}  # fmt: skip
            counts = {"hits": self.num_hits, "ssd_hits": self.num_ssd_hits,
                      "misses": self.num_misses, "puts": self.num_puts,
                      "evictions": self.num_evictions, "too_large": self.num_too_large,
                      "ssd_writes": self.num_ssd_writes, "ssd_errors": self.num_ssd_errors,
                      "bad_files": self.num_bad_files}  # fmt: skip
        series = [Series(k, "gauge", v) for k, v in gauges.items()]
        series += [Series(k, "counter", v) for k, v in counts.items()]
        return Snapshot({**gauges, **counts}, tuple(series))

    def check_integrity(self) -> None:
        """Raise AssertionError unless the RAM accounting holds and every SSD file verifies."""
        with self._lock:
            held = sum(n for _, n in self._ram.values())
            assert self._owner.keys() == self._tags.keys() == self._ram.keys(), "stray tags"
            assert held == self.used_bytes, f"accounted {self.used_bytes} != held {held}"
            assert self.used_bytes <= self.budget_bytes, "over budget"
            for payload, nbytes in self._ram.values():
                assert nbytes == payload_nbytes(payload)
        if self.folder is None:
            return
        for path in self.folder.glob("*/*.safetensors"):
            arrays, meta = _load(path.read_bytes())
            assert meta.get("key") == path.stem, f"{path.name}: key mismatch"
            assert meta.get("checksum") == _checksum(meta, arrays), f"{path.name}: bad checksum"


def _checksum(meta: dict[str, str], arrays: dict[str, np.ndarray]) -> str:
    parts = [meta["format"], meta["key"], meta["structure"]]
    raw = b"\0".join(p.encode() for p in parts)
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        raw += name.encode() + str(a.dtype).encode() + str(a.shape).encode() + a.tobytes()
    return digest_bytes(raw).hex()


def _load(data: bytes) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    import json

    from safetensors.numpy import load

    # the header's metadata: safetensors' numpy loader returns tensors only
    size = int.from_bytes(data[:8], "little")
    meta = json.loads(data[8 : 8 + size]).get("__metadata__") or {}
    return load(data), meta
