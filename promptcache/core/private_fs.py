"""Private cache folders: 0700 folders and 0600 files, whatever the umask.

Block files and the index hold prompt token ids and tenant names in clear, so nobody but the
server's user may list or read them. Modes are set explicitly (a umask can only remove bits).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

DIR_MODE = 0o700
FILE_MODE = 0o600


def make_private_dirs(path: Path) -> None:
    """Create ``path`` and any missing parents, each new one 0700 (existing ones untouched)."""
    missing: list[Path] = []
    p = path
    while not p.is_dir():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, DIR_MODE)
        except FileExistsError:
            if not d.is_dir():
                raise
            continue
        os.chmod(d, DIR_MODE)


def open_private(path: Path, flags: int) -> int:
    """``os.open`` creating ``path`` 0600 (an existing file is tightened too)."""
    fd = os.open(path, flags | os.O_CREAT, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def tighten(path: Path, mode: int) -> bool:
    """chmod ``path`` to ``mode`` when it differs; True when it changed."""
    st = path.lstat()
    if stat.S_ISLNK(st.st_mode) or stat.S_IMODE(st.st_mode) == mode:
        return False
    os.chmod(path, mode)
    return True


def tighten_tree(root: Path) -> int:
    """Folders 0700 and files 0600 under ``root`` (itself included); returns how many changed."""
    changed = int(tighten(root, DIR_MODE))
    for top, dirs, files in os.walk(root):
        for name in dirs:
            changed += tighten(Path(top, name), DIR_MODE)
        for name in files:
            changed += tighten(Path(top, name), FILE_MODE)
    return changed


def tighten_cache_dir(path: Path, marker: str) -> None:
    """Make the ``--cache-dir`` itself 0700 when it is a cache folder and nothing else: owned by
    this user, not sticky, and every entry a model folder holding ``marker``. A folder that
    holds other things (a home, a project, /tmp) is left alone: a chmod there would surprise."""
    try:
        st = path.stat()
        entries = list(path.iterdir())
    except OSError:
        return
    if st.st_uid != os.geteuid() or st.st_mode & stat.S_ISVTX:
        return
    if all(e.is_dir() and not e.is_symlink() and (e / marker).exists() for e in entries):
        tighten(path, DIR_MODE)
