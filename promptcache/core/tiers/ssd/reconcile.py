"""Start-up recovery of the SSD tier: make the index and the files agree after any crash.

Rows without files are dropped; valid files without rows are indexed again (header, checksum
over metadata and tensors, and the chained hash recomputed from parent + tokens + extra keys);
temp files left by an interrupted write are removed; files of an older format are removed (not
damage, but never served); anything else that fails a check is quarantined, never served.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from promptcache.core.block_file import (
    SUFFIX,
    TMP_PREFIX,
    BlockFileInfo,
    CorruptBlockError,
    OldFormatError,
    check_block,
    unseal_file,
    verify_identity,
)
from promptcache.core.cipher import BlockCipher
from promptcache.core.tiers.ssd.index import Row, SsdIndex

if TYPE_CHECKING:
    from promptcache.core.tiers.ssd.folder import SsdFolder

log = logging.getLogger("promptcache.ssd")


def check_file(
    path: Path, data: bytes, model: str | None, cipher: BlockCipher | None = None
) -> BlockFileInfo:
    """Everything a file must satisfy to be indexed (of ``model`` unless None); raises
    CorruptBlockError (OldFormatError for an older format; a file that does not decrypt under
    ``cipher`` is corrupt)."""
    info = check_block(unseal_file(data, cipher, path.stem))
    if model is not None and info.model != model:
        raise CorruptBlockError("file belongs to another model")
    verify_identity(info, path.stem)
    return info


def matches_row(info: BlockFileInfo, row: Row) -> bool:
    """The file holds exactly the block its index row describes."""
    return info.meta == row.meta


def reconcile_dir(folder: SsdFolder, index: SsdIndex) -> None:
    """Drop rows without files, index valid files without rows, remove temp and old-format
    files, quarantine files that fail a check, prune namespace records without blocks."""
    t0 = time.perf_counter()
    old_before = folder.stats.get("num_old_format_removed")
    rows = {r.path: r for r in index.all_rows()}
    on_disk: set[str] = set()
    for path in folder.root_dir.rglob("*"):
        if (
            not path.is_file()
            or folder.quarantine_dir in path.parents
            or path.parent == folder.root_dir
        ):
            continue
        if path.name.startswith(TMP_PREFIX):
            path.unlink(missing_ok=True)
            folder.stats.add(num_temp_removed=1)
            continue
        if path.suffix != SUFFIX:
            continue
        rel = str(path.relative_to(folder.root_dir))
        on_disk.add(rel)
        if rel not in rows:
            _reindex(folder, index, path, rel)
    missing = [r for p, r in rows.items() if p not in on_disk]
    if missing:
        index.delete(r.block_hash for r in missing)
        folder.stats.add(num_rows_dropped=len(missing))
    index.prune_namespaces()
    folder.stats.set(reconcile_s=time.perf_counter() - t0)
    if old := folder.stats.get("num_old_format_removed") - old_before:
        log.warning("removed %d block files of an older format from %s", old, folder.root_dir)


def _reindex(folder: SsdFolder, index: SsdIndex, path: Path, rel: str) -> None:
    try:
        data = path.read_bytes()
        info = check_file(path, data, folder.model, folder.cipher)
    except OldFormatError:
        path.unlink(missing_ok=True)
        folder.stats.add(num_old_format_removed=1)
        return
    except (OSError, CorruptBlockError) as exc:
        folder.quarantine(path, None, str(exc))
        return
    now = time.time()
    # the tenant's name only survives in the folder name ("<tenant>-<root>"): enough for display
    ns_dir = Path(rel).parts[0]
    tenant = ns_dir.rsplit("-", 1)[0] if "-" in ns_dir else ""
    index.upsert(
        Row(
            info.meta,
            rel,
            len(data),
            info.payload_nbytes,
            info.has_checkpoint,
            info.is_seq_end,
            now,
            now,
        ),
        "" if tenant == "default" else tenant,
    )
    folder.stats.add(num_reindexed=1)
