"""Files written so that a crash leaves the old content or the new, never a part (fsync, rename)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_durably(path: Path, data: bytes) -> None:
    """``data`` at ``path``, flushed to disk (fsync) before this returns; an OSError (a full disk)
    surfaces here with its errno."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_durably(path: Path, text: str) -> None:
    """``text`` at ``path`` through a temporary file, fsync and rename: the old content or the new."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    write_bytes_durably(tmp, text.encode())
    os.replace(tmp, path)
    fsync_dir(path.parent)
