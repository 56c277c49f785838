"""Who used a vision-embedding cache entry: tenant folders and session tags, so that deleting a
session or a tenant (issue 18) removes the encoder outputs of its images too.

On disk an entry lives in its tenant's folder (``t<digest of the tenant>``), so a tenant goes
with its folder. Beside each entry file a ``.sessions`` file lists, one per line, a digest of
every session that wrote or read it (appended on first use; never the raw id). In RAM the same
tags live in a dict. A session's deletion removes the entries only it used (all it used with
``force``) and drops its tag from the others.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from promptcache.core.hashing import digest_bytes
from promptcache.core.private_fs import open_private
from promptcache.core.sessions import session_key

SESSIONS_SUFFIX = ".sessions"


def tenant_folder(tenant: str) -> str:
    """The folder name of a tenant's entries (a digest: tenant names never reach the disk)."""
    return "t" + digest_bytes(b"tenant\0" + tenant.encode()).hex()[:24]


def session_tag(tenant: str, session: str) -> str:
    """A session's tag inside its tenant ("" for none): a digest, safe to write to disk."""
    if not session:
        return ""
    return digest_bytes(b"session\0" + session_key(tenant, session).encode()).hex()


def read_tags(entry: Path) -> set[str]:
    try:
        text = entry.with_suffix(SESSIONS_SUFFIX).read_text()
    except OSError:
        return set()
    return {line for line in text.split() if line}


def append_tag(entry: Path, tag: str) -> None:
    """Note ``tag`` beside ``entry`` (a private file; a torn line is ignored on read)."""
    fd = open_private(entry.with_suffix(SESSIONS_SUFFIX), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        os.write(fd, f"{tag}\n".encode())
    finally:
        os.close(fd)


def write_tags(entry: Path, tags: set[str]) -> None:
    path = entry.with_suffix(SESSIONS_SUFFIX)
    if not tags:
        path.unlink(missing_ok=True)
        return
    fd = open_private(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        os.write(fd, "".join(f"{t}\n" for t in sorted(tags)).encode())
    finally:
        os.close(fd)


def remove_entry(entry: Path) -> None:
    entry.unlink(missing_ok=True)
    entry.with_suffix(SESSIONS_SUFFIX).unlink(missing_ok=True)


def is_removable(tags: set[str], tag: str, force: bool) -> bool:
    """A session's deletion removes an entry it used when nobody else did (or with ``force``)."""
    return tag in tags and (force or tags == {tag})


def forget_on_disk(folder: Path, tag: str, force: bool) -> int:
    """Apply a session's deletion to one tenant folder; the number of entries removed."""
    removed = 0
    for entry in folder.glob("*.safetensors"):
        tags = read_tags(entry)
        if is_removable(tags, tag, force):
            remove_entry(entry)
            removed += 1
        elif tag in tags:
            write_tags(entry, tags - {tag})
    return removed


def remove_tenant_folder(folder: Path) -> int:
    """Remove a tenant's whole folder; the number of entries it held."""
    if not folder.is_dir():
        return 0
    num = sum(1 for _ in folder.glob("*.safetensors"))
    shutil.rmtree(folder, ignore_errors=True)
    return num
