"""Where a run's S3 credentials come from: the config, a Prefect Secret block, or the environment.

`s3_credentials` is what `infra/s3.s3_filesystem` asks. A deployed run's config carries no
credentials (parameters are stored and shown by the Prefect server), so its workers take them from
their environment or from the Secret block `storage.credentials_block` names, which a process reads
at most once per `BLOCK_READ_SECONDS`.
"""

from __future__ import annotations

import logging
import os
import time

from configs.sections import StorageConfig

log = logging.getLogger(__name__)


def s3_credentials(storage: StorageConfig) -> tuple[str | None, str | None]:
    """S3 key and secret: the config's own, else the named Prefect Secret block, else the env.

    A deployed run cannot carry them in its config (parameters are stored and shown by the
    server), so workers read them from their environment or from a Secret block."""
    if storage.key or storage.secret:
        return (storage.key.get_secret_value() if storage.key else None,
                storage.secret.get_secret_value() if storage.secret else None)  # fmt: skip
    if storage.credentials_block:
        return _block_credentials(storage.credentials_block)
    return os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")


BLOCK_READ_SECONDS = 600.0
"""How long a process uses a Secret block's credentials before it reads the block again."""
_block_reads: dict[str, tuple[float, tuple[str, str]]] = {}
"""Block name -> (when read, (key, secret)): the last good read of each block in this process."""


def _block_credentials(name: str) -> tuple[str, str]:
    """The key and secret of Secret block `name`, read from the Prefect API at most once per
    `BLOCK_READ_SECONDS` in a process. Every rollout group opens the run's store: a read per open
    was an API call per group, and while the Prefect server restarted the groups failed and took
    their generation run with them. A read that fails falls back on the last good one (the server
    is away); a rotated secret reaches a running process at its next read."""
    from prefect.blocks.system import Secret

    read_at, credentials = _block_reads.get(name, (-float("inf"), None))
    if time.monotonic() - read_at < BLOCK_READ_SECONDS:
        return credentials
    try:
        value = Secret.load(name).get()
    except Exception as err:
        if credentials is None:
            raise
        log.warning("could not read Secret block %r (%r): using the credentials read %.0f s ago", name, err, time.monotonic() - read_at)
        return credentials
    if not isinstance(value, dict) or not {"key", "secret"} <= value.keys():
        raise ValueError(f"Secret block {name!r} must hold {{\"key\": ..., \"secret\": ...}}")
    _block_reads[name] = (time.monotonic(), (value["key"], value["secret"]))
    return value["key"], value["secret"]
