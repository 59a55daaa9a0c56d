"""Local scratch directories for a process's working copies: the snapshot its engines serve,
their logs, checkpoint staging.

`scratch_dir` removes the directory when the work inside succeeds and keeps its logs, saying
where, when the work fails. Why not `tempfile.TemporaryDirectory`: a failed flow's scratch holds what
explains the failure (its engines' logs). Why remove at all: every flow run made one and left
it behind, a copy of the weights each (a real model's is gigabytes), and a long run with
restarts or an evaluation every few versions filled the disk with them.

A process killed outright (SIGKILL, the OOM killer, a preempted machine) runs no cleanup, so each
directory names its owner (`.owner`), and making a new one first empties the `tandem-*`
directories whose owner is gone, keeping their logs as a failure does. On file:// their fetched
weights are hard links to the store's files, which retention then could not free either. The
owner is named as Linux's /proc knows it: boot, pid namespace, pid, and start in clock ticks since
boot (not the wall clock: an NTP step or a resumed VM would make a live owner look gone). Where
/proc cannot say (other systems), directories are removed on success and failure only.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


log = logging.getLogger(__name__)
OWNER_FILE = ".owner"
SWEPT_PREFIX = "tandem-"


@contextmanager
def scratch_dir(prefix: str, keep_logs: bool = True) -> Iterator[Path]:
    """A new directory under the system's temporary directory, named `prefix` + random.
    `keep_logs`: on failure, keep its logs (else it is removed whole, as on success)."""
    sweep_orphaned_scratch(Path(tempfile.gettempdir()))
    path = Path(tempfile.mkdtemp(prefix=prefix))
    (path / OWNER_FILE).write_text(json.dumps(_owner(os.getpid())))
    try:
        yield path
    except BaseException:
        if keep_logs:
            _keep_only_logs(path)
            log.warning("kept the logs in %s: what failed may have left its reasons there", path)
            raise
        shutil.rmtree(path, ignore_errors=True)
        raise
    shutil.rmtree(path, ignore_errors=True)


@contextmanager
def staging_area(prefix: str, parent: Path | None) -> Iterator[Path]:
    """A directory to write files in before they are uploaded: under `parent` when given (a file://
    store's own staging, on its filesystem, which the trainer clears as it starts), else a
    `tandem-*` scratch directory, which the next scratch directory made on this machine empties
    once its owner is gone. A trainer killed mid-upload to S3 left a whole model, or a checkpoint
    with its optimizer moments, in the system's temporary directory for good."""
    if parent is None:
        with scratch_dir(f"{SWEPT_PREFIX}{prefix}", keep_logs=False) as path:
            yield path
        return
    with tempfile.TemporaryDirectory(prefix=prefix, dir=parent) as path:
        yield Path(path)


def _keep_only_logs(path: Path) -> None:
    """Remove all but the `*.log` files: a failed generation run kept its engines' snapshot too,
    and its restart on the same machine, short of that space, failed the same way (ENOSPC)."""
    for file in path.rglob("*"):
        if (file.is_file() or file.is_symlink()) and file.suffix != ".log":
            file.unlink(missing_ok=True)


def sweep_orphaned_scratch(parent: Path) -> list[Path]:
    """Empty, but for their logs, the `tandem-*` directories under `parent` whose owner process is
    gone (or ran before the last boot); returns them. Another user's, one another process sweeps at
    the same moment, and one made in another pid namespace (a container sharing the directory),
    whose processes this one cannot see, are skipped as they are."""
    here = _owner(os.getpid())
    if here is None:
        return []
    swept = []
    for path in parent.glob(f"{SWEPT_PREFIX}*"):
        try:
            owner = json.loads((path / OWNER_FILE).read_text())
            if owner["namespace"] != here["namespace"] or (owner["boot"] == here["boot"] and _owner(owner["pid"]) == owner):
                continue
            (path / OWNER_FILE).unlink()  # first: a second sweeper skips it
            _keep_only_logs(path)
        except (OSError, ValueError, KeyError, TypeError):  # no owner named, not ours, or gone meanwhile
            continue
        log.warning("emptied %s, left by process %s, which is gone (its logs are kept)", path, owner["pid"])
        swept.append(path)
    return swept


def _owner(pid: int) -> dict | None:
    """Process `pid` as /proc names it: boot, pid namespace (this process's: where `pid` is
    seen), pid and start in clock ticks after boot; None if it runs no more, or without /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return {
            "boot": Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
            "namespace": os.readlink("/proc/self/ns/pid"),
            "pid": pid,
            "started": int(stat.rsplit(")", 1)[1].split()[19]),  # field 22; the name before it may hold spaces
        }
    except (OSError, IndexError, ValueError):
        return None
