"""What `RunStore` (infra/storage.py) needs to know about a local filesystem (file://), as
infra/s3.py holds what it needs to know about S3.

A write goes to a hidden temporary beside its target (`temporary_sibling`: names that start with
"." are never listed), then is renamed over the target or hard-linked to it, so a reader sees a
whole file or none; `write_file` does both, `link_replacing` puts an existing file in place without
copying it. `remove_stale_temporaries` and `remove_empty_dirs` tidy what a deleted prefix leaves:
a killed writer's temporaries, and the directories they kept.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

STALE_TEMPORARY_SECONDS = 600.0
"""Age past which a hidden temporary is a killed writer's, not one being written."""


def write_file(target: Path, data: bytes, *, replace: bool, sync: bool) -> bool:
    """Write `data` at `target` through a hidden temporary: renamed over what is there
    (`replace`), or hard-linked, which fails if the name exists (False then: put-if-absent).
    `sync`: on disk before it is visible."""
    target.parent.mkdir(parents=True, exist_ok=True)
    temp = temporary_sibling(target)
    try:
        with open(temp, "wb") as handle:
            handle.write(data)
            if sync:
                handle.flush()
                os.fsync(handle.fileno())
        if replace:
            os.replace(temp, target)
            return True
        try:
            os.link(temp, target)
        except FileExistsError:
            return False
        return True
    finally:
        temp.unlink(missing_ok=True)


def link_replacing(source: Path, target: Path) -> bool:
    """Hard-link `source` at `target`, replacing what is there; False where the filesystems
    cannot (another device, links refused), and the caller copies instead."""
    temp = temporary_sibling(target)
    try:
        os.link(source, temp)
    except OSError:
        return False
    try:
        os.replace(temp, target)
    finally:  # a replace that failed (the target a directory) leaves no hidden link behind
        temp.unlink(missing_ok=True)
    return True


def temporary_sibling(target: Path) -> Path:
    """A unique hidden name beside `target` for a write not finished yet (hidden names are never listed)."""
    return target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")


def remove_stale_temporaries(top: Path) -> None:
    """Unlink what killed writers left under `top` (`temporary_sibling` names): never listed, a
    retired snapshot's leftover kept its directory, and, a hard link to a weight file, its bytes."""
    cutoff = time.time() - STALE_TEMPORARY_SECONDS
    for temporary in top.rglob(".*.tmp"):
        try:
            if temporary.is_file() and temporary.stat().st_mtime < cutoff:
                temporary.unlink()
        except FileNotFoundError:  # gone meanwhile
            continue


def remove_empty_dirs(top: Path) -> None:
    """Remove the empty directories under `top`, and `top` itself if that leaves it empty."""
    for directory in sorted((p for p in top.rglob("*") if p.is_dir()), reverse=True):
        if not any(directory.iterdir()):
            directory.rmdir()
    if top.is_dir() and not any(top.iterdir()):
        top.rmdir()
