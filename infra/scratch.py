"""Local scratch directories for a process's working copies: the snapshot its engines serve,
their logs, checkpoint staging.

`scratch_dir` removes the directory when the work inside succeeds and keeps its logs, saying
where, when the work fails. Why not `tempfile.TemporaryDirectory`: a failed flow's scratch holds what
explains the failure (its engines' logs). Why remove at all: every flow run made one and left
it behind, a copy of the weights each (a real model's is gigabytes), and a long run with
restarts or an evaluation every few versions filled the disk with them.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)


@contextmanager
def scratch_dir(prefix: str) -> Iterator[Path]:
    """A new directory under the system's temporary directory, named `prefix` + random."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield path
    except BaseException:
        _keep_only_logs(path)
        log.warning("kept the logs in %s: what failed may have left its reasons there", path)
        raise
    shutil.rmtree(path, ignore_errors=True)


def _keep_only_logs(path: Path) -> None:
    """Remove all but the `*.log` files: a failed generation run kept its engines' snapshot too,
    and its restart on the same machine, short of that space, failed the same way (ENOSPC)."""
    for file in path.rglob("*"):
        if (file.is_file() or file.is_symlink()) and file.suffix != ".log":
            file.unlink(missing_ok=True)
