"""Files that appear whole or not at all."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable
from pathlib import Path


def create_whole(path: str | os.PathLike[str], write: Callable[[Path], None]) -> Path:
    """Create ``path`` with what ``write`` puts into a temporary file beside it, linked in place once written and
    synced: a stop or a crash in the middle leaves no half-written file for the next start to refuse, and an
    existing ``path`` is never replaced.

    Raises:
        FileExistsError: ``path`` exists, also when another process created it meanwhile.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        write(tmp)
        fsync(tmp)
        os.link(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    fsync(path.parent)  # the new name itself survives a crash
    return path


def fsync(path: str | os.PathLike[str]) -> None:
    """Flush a file, or a folder's names, to the disk. A folder's on POSIX only: Windows cannot open one to sync
    it, and journals its renames anyway."""
    if os.name != "posix" and os.path.isdir(path):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
