"""`promptcache cache stats|ls|verify|clear|delete --cache-dir DIR`: inspect and maintain the
SSD tier (its ``TierAdmin`` command; the shared tier's is ``cli.shared``).

Works on the files and the SQLite index directly, no model needed. ``stats`` and ``ls`` only
read, so they run beside a server; ``verify``, ``clear`` and ``delete`` move and delete files, so
they take each model folder's lock and refuse while a server holds it (a running server deletes
through ``DELETE /v1/cache/sessions/{id}`` instead).
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

from promptcache.cli.serve import default_cache_dir
from promptcache.core.block_file import CorruptBlockError, EncryptedBlockError, OldFormatError
from promptcache.core.cipher import BlockCipher, make_cipher
from promptcache.core.private_fs import make_private_dirs
from promptcache.core.sessions import session_key, split_session_key
from promptcache.core.tiers.ssd.index import SsdIndex
from promptcache.core.tiers.ssd.lock import CacheDirLock, CacheDirLockedError
from promptcache.core.tiers.ssd.reconcile import check_file, matches_row
from promptcache.core.tiers.ssd.sessions import remove_rows


class KeyMismatchError(Exception):
    """The index was written under another key (or none) than the one given."""


def open_index(d: Path, cipher: BlockCipher | None = None) -> SsdIndex:
    """The folder's index as it is (never emptied); with ``cipher`` the key must be the one
    the rows were written under (KeyMismatchError otherwise: nothing would decrypt)."""
    index = SsdIndex(d / "index.sqlite", cipher, adopt_key=False)
    stored = index.stored_key_id()
    if cipher is not None and stored != cipher.key_id:
        index.close()
        raise KeyMismatchError(
            f"{d.name}: the index was written "
            + ("without encryption" if not stored else "under another key")
        )
    return index


def model_dirs(cache_dir: Path) -> list[Path]:
    return (
        sorted(p for p in cache_dir.iterdir() if (p / "index.sqlite").exists())
        if cache_dir.is_dir()
        else []
    )


def cmd_stats(cache_dir: Path) -> int:
    dirs = model_dirs(cache_dir)
    if not dirs:
        print(f"no SSD cache under {cache_dir}")
        return 0
    print(f"{'model':<18} {'blocks':>8} {'bytes':>14} {'tenants':>8} {'quarantined':>12}")
    for d in dirs:
        index = open_index(d)
        n, used = index.totals()
        quarantined = len(list((d / "quarantine").glob("*"))) if (d / "quarantine").is_dir() else 0
        print(f"{d.name:<18} {n:>8} {used:>14,} {len(index.tenants()):>8} {quarantined:>12}")
        index.close()
    return 0


def cmd_sessions(cache_dir: Path) -> int:
    """The sessions tagged in each model folder (ids as stored: keyed digests when encrypted)."""
    dirs = model_dirs(cache_dir)
    if not dirs:
        print(f"no SSD cache under {cache_dir}")
        return 0
    for d in dirs:
        index = open_index(d)
        rows = index.session_totals()
        index.close()
        print(f"# model {d.name}: {len(rows)} session(s)")
        if rows:
            print(f"{'session':<34} {'tenant':<16} {'blocks':>8} {'bytes':>14} {'ttl_s':>8}")
        for key, root_tenant, n, used, ttl in rows:
            tenant, session = split_session_key(key)
            tenant = tenant or root_tenant
            ttl_text = f"{ttl:.0f}" if ttl is not None else "-"
            print(f"{session:<34} {tenant or '-':<16} {n:>8} {used:>14,} {ttl_text:>8}")
    return 0


def cmd_ls(cache_dir: Path, limit: int) -> int:
    for d in model_dirs(cache_dir):
        index = open_index(d)
        tenants = index.tenants()
        rows = sorted(index.all_rows(), key=lambda r: -r.last_access)
        print(f"# model {d.name}: {len(rows)} blocks")
        print(
            f"{'hash':<34} {'tenant':<12} {'depth':>7} {'tokens':>6} {'bytes':>10} {'ckpt':>4}  last access"
        )
        for r in rows[:limit]:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.last_access))
            tenant = tenants.get(r.meta.root, "?") or "(default)"
            print(
                f"{r.block_hash.hex():<34} {tenant:<12.12} {r.meta.depth:>7} {r.meta.num_tokens:>6} {r.file_bytes:>10,} {'yes' if r.has_checkpoint else '':>4}  {when}"
            )
        index.close()
    return 0


@contextlib.contextmanager
def locked(dirs: list[Path], purpose: str) -> Iterator[None]:
    """Hold every model folder's lock (raises CacheDirLockedError when a server holds one)."""
    locks: list[CacheDirLock] = []
    try:
        for d in dirs:
            lock = CacheDirLock(d)
            lock.acquire(purpose)
            locks.append(lock)
        yield
    finally:
        for lock in locks:
            lock.release()


def cmd_verify(cache_dir: Path, cipher: BlockCipher | None = None) -> int:
    from tqdm import tqdm

    bad = total = skipped = 0
    for d in model_dirs(cache_dir):
        index = open_index(d, cipher)
        rows = index.all_rows()
        for r in tqdm(rows, desc=f"verifying {d.name}", unit="block"):
            total += 1
            path = d / r.path
            try:
                # the same checks as start-up re-indexing, plus: the file is what its row says
                info = check_file(path, path.read_bytes(), model=None, cipher=cipher)
                if not info.model.startswith(d.name) or not matches_row(info, r):
                    raise CorruptBlockError("file does not hold the indexed block")
            except EncryptedBlockError:
                skipped += 1  # not damage: verifying needs the key (--encrypt-key-file)
            except OldFormatError as exc:
                bad += 1
                print(f"old format: {r.path}: {exc}")
                path.unlink(missing_ok=True)
                index.delete([r.block_hash])
            except (OSError, CorruptBlockError) as exc:
                bad += 1
                print(f"bad: {r.path}: {exc}")
                if path.exists():
                    make_private_dirs(d / "quarantine")
                    shutil.move(
                        str(path), d / "quarantine" / f"{path.name}.{int(time.time() * 1000)}"
                    )
                index.delete([r.block_hash])
        index.close()
    print(f"{total} blocks checked, {bad} bad (quarantined or removed)")
    if skipped:
        print(f"{skipped} encrypted blocks not verified: give --encrypt-key-file")
    return 1 if bad else 0


def cmd_clear(cache_dir: Path) -> int:
    dirs = model_dirs(cache_dir)
    for d in dirs:
        shutil.rmtree(d)
    print(f"cleared {len(dirs)} model cache(s) under {cache_dir}")
    return 0


def cmd_delete(
    cache_dir: Path, session: str | None, tenant: str, force: bool, cipher: BlockCipher | None
) -> int:
    """A session's blocks (those only it uses, unless ``force``) with what hangs below them, or
    with no session the whole tenant's: files and index rows, in every model folder."""
    blocks = nbytes = kept = 0
    for d in model_dirs(cache_dir):
        index = open_index(d, cipher)  # session ids are keyed digests under a key
        try:
            if session is not None and cipher is None and index.stored_key_id():
                raise KeyMismatchError(f"{d.name}: encrypted; give --encrypt-key-file")
            if session is None:
                roots = [r for r, name in index.tenants().items() if name == tenant]
                rows = [row for r in roots for row in index.rows_of_root(r)]
            else:
                key = session_key(tenant, session)
                tagged = index.session_blocks(key)
                shared = [h for h, is_shared in tagged.items() if is_shared]
                targets = list(tagged) if force else [h for h in tagged if h not in shared]
                kept += 0 if force else len(shared)
                rows = index.subtree(targets)
                index.forget_session(key)
            nbytes += remove_rows(d, index, rows)
            blocks += len(rows)
        finally:
            index.close()
    what = f"session {session!r}" if session is not None else "every session"
    print(
        f"deleted {blocks} blocks ({nbytes:,} bytes) of {what} of tenant {tenant or '(default)'!r}"
        f"; {kept} shared blocks kept"
    )
    return 0


def run_cache_command(args: argparse.Namespace) -> int:
    """The SSD tier's offline command (``TierAdmin``): ``args.cache_dir`` None is the default."""
    cache_dir = Path(args.cache_dir or default_cache_dir())
    try:
        cipher = make_cipher(getattr(args, "encrypt_key_file", None))
    except (OSError, ValueError) as exc:
        print(f"promptcache cache {args.action}: --encrypt-key-file: {exc}")
        return 2
    try:
        return _run(args, cache_dir, cipher)
    except KeyMismatchError as exc:
        print(f"promptcache cache {args.action}: refused: {exc}")
        return 2


def _run(args: argparse.Namespace, cache_dir: Path, cipher: BlockCipher | None) -> int:
    if args.action == "stats":
        return cmd_stats(cache_dir)
    if args.action == "ls":
        return cmd_ls(cache_dir, args.limit)
    if args.action == "sessions":
        return cmd_sessions(cache_dir)
    try:
        with locked(model_dirs(cache_dir), f"cache {args.action}"):
            if args.action == "delete":
                if args.session is None and args.tenant is None:
                    print("promptcache cache delete: give --session ID and/or --tenant NAME")
                    return 2
                return cmd_delete(cache_dir, args.session, args.tenant or "", args.force, cipher)
            return (
                cmd_verify(cache_dir, cipher) if args.action == "verify" else cmd_clear(cache_dir)
            )
    except CacheDirLockedError as exc:
        print(f"promptcache cache {args.action}: refused: {exc}")
        return 2
