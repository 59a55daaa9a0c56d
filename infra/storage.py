"""Object storage for run directories: one fsspec code path for file://, memory:// and s3://.

`RunStore` is a run directory ({root}/{run_id}/) seen as a flat key space ("rollouts/v00000001/
gen0-000003.parquet"). Everything above infra/ reads and writes through it and never learns which
backend it is on. Two commit primitives carry the atomicity contract of docs/architecture.md:

- `write_atomic(key, data)`: readers see the old object or the new one, never a partial one
  (S3 PUT is atomic per object; file:// writes a hidden temporary file and renames it).
- `put_if_absent(key, data) -> bool`: creates the object only if no object has the key. On S3 this
  is a conditional PUT (`IfNoneMatch="*"`), on file:// a hard link of a complete temporary file,
  which fails if the name exists. It is the one primitive every backend makes atomic, so commits
  and claims build on it rather than on rename, which S3 does not have.

Durability on file:// (fsync), and why the two primitives differ:

- A killed process (SIGKILL, OOM, crash) never needs an fsync: what it wrote is in the kernel's
  page cache, which outlives the process, and the temporary-then-rename/link order already
  guarantees that no reader sees a partial object. Only a power loss or kernel crash can lose
  written-but-unsynced data, and then a renamed or linked file may come back truncated or empty.
- `put_if_absent` does NOT fsync. Everything committed through it is checked by content when read,
  so a file truncated by a power loss is detected and never trusted: shards (and their quarantine
  copies) carry a CRC32 on every Parquet page and are validated (tasks/shards.py); a manifest must
  parse and lists the size and sha256 of every file it commits (infra/manifest.py); the run's
  config.json is parsed and compared on every start (tasks/rundir.py), so a damaged one is an
  error, never a silently different config; and an admission slot claim (tasks/lag.py) that
  does not parse is taken for nobody's, which the next pipeline hands to a generator of its own
  (`adopt_orphaned_claims`). An fsync there would cost milliseconds on every shard (about 4 ms on a 66 KB
  shard, several times the rest of the write: benchmarks/storage.py) and protect nothing.
- `write_atomic` DOES fsync the temporary before the rename. It replaces mutable pointers such as
  weights/LATEST and pins, which no checksum covers and which readers follow blindly: losing one
  to a power failure (an empty LATEST, a pin that silently vanished) would be worse than the cost
  of the rare write.

Every call retries transient errors (connection refused, timeouts, throttling, 5xx, a response
cut off) with exponential backoff for up to `retry_seconds` from its first failure (so a call
takes at most its failed attempts plus that long), so a storage outage of a few seconds stalls a
run instead of killing it. Errors that no retry can fix fail at once: missing keys (FileNotFoundError), a full or read-only
local disk (ENOSPC, EDQUOT, EROFS), and, as `StorageRejected` naming the store's URL, refused
access and bad credentials (the PermissionError fsspec raises, with the settings to check) and
requests the server rejects as invalid (an invalid bucket name: OSError EINVAL, or any other 4xx
answer except 408 Request Timeout and 429 Too Many Requests).
infra/s3.py holds that reading of S3's errors, and the s3fs filesystem the store talks through;
infra/localfs.py the file:// writes. Names that start with "." are temporaries of an unfinished
write and are never listed; deleting a prefix on file:// removes those a killed writer left.
"""

from __future__ import annotations

import contextvars
import errno
import functools
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from http.client import IncompleteRead
from pathlib import Path
from typing import TypeVar

import aiohttp
import fsspec
from botocore.exceptions import BotoCoreError, ClientError

from configs.sections import StorageConfig
from infra.localfs import link_replacing, remove_empty_dirs, remove_stale_temporaries, write_file
from infra.s3 import abort_incomplete_uploads, is_missing_bucket, is_precondition_failure, rejection_reason, s3_filesystem

log = logging.getLogger(__name__)
T = TypeVar("T")

TRANSIENT_ERRORS = (OSError, BotoCoreError, ClientError, TimeoutError, aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, IncompleteRead)
"""Errors a store call retries. s3fs turns most of what goes wrong in a request into OSError, but
a response cut off mid-body comes through as aiohttp's ClientPayloadError (or http.client's
IncompleteRead), which is not one. Not every aiohttp error: a proxy's 407 or a redirect loop is
the configuration's, and a retry would only hide it for retry_seconds."""

LOCAL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})
"""This machine's disk is full or read-only: an OSError no retry cures, raised at once (a full
cache disk was reported, after retry_seconds, as storage unavailable)."""

PERMANENT_ERRORS = (
    FileNotFoundError,
    FileExistsError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
    ValueError,
    TypeError,
)
_MEMORY_LOCK = threading.Lock()
_BUCKETS_SEEN: set[tuple[str | None, str | None, str]] = set()
"""(endpoint, access key, bucket) this process has found or created: `open_run_store` checks a
bucket once, not on every open (a HEAD per rollout group, 8% of a tiny run's requests)."""
STAGING = ".staging"
"""The file:// run directory's staging area for files uploaded by hard link (`RunStore.upload`)."""


class StorageUnavailable(RuntimeError):
    """Storage kept failing for longer than `retry_seconds`."""


class StorageRejected(OSError):
    """The storage refused a request in a way that no retry can change (e.g. an invalid bucket
    name); raised at once instead of being retried for `retry_seconds`."""


class RunStore:
    """A run directory on object storage, addressed by keys relative to {root}/{run_id}."""

    def __init__(self, fs: fsspec.AbstractFileSystem, base: str, url: str, retry_seconds: float):
        self.fs = fs
        self.base = base.rstrip("/")
        self.url = url.rstrip("/")
        self.retry_seconds = retry_seconds
        self.protocol = "s3" if url.startswith("s3://") else url.split("://", 1)[0]

    def __repr__(self) -> str:
        return f"RunStore({self.url!r})"

    # -- addressing -------------------------------------------------------------------------

    def path(self, key: str) -> str:
        """The backend path of `key` (what fsspec calls are given)."""
        return f"{self.base}/{key}" if key else self.base

    def url_of(self, key: str) -> str:
        """The full URL of `key`, for messages and for users."""
        return f"{self.url}/{key}" if key else self.url

    def local_path(self, key: str) -> Path | None:
        """The key's path on the local disk when the store is file://, else None."""
        return Path(self.path(key)) if self.protocol == "file" else None

    # -- reads ------------------------------------------------------------------------------

    def read_bytes(self, key: str, start: int = 0) -> bytes:
        """The object from byte `start` (0: the whole of it), in one request; FileNotFoundError
        if there is none. `start` must lie inside the object.

        On S3 it asks for no concurrency: s3fs otherwise sends a HEAD before every whole-object
        read, to decide whether to split one over 50 MB into ranged reads. A run directory's
        reads (LATEST, leases, manifests, shards) are far smaller, so that HEAD doubled the
        round trips of every read, a generator's poll of LATEST included."""
        ranged = {"start": start} if start else {}
        if self.protocol == "s3":
            return self._retry(self.fs.cat_file, self.path(key), max_concurrency=1, **ranged)
        return self._retry(self.fs.cat_file, self.path(key), **ranged)

    def exists(self, key: str) -> bool:
        """Whether the object `key` exists (an object, not a prefix). One HEAD on S3, where
        s3fs's own `exists` also lists the key as a directory after a miss: two round trips for
        the answer callers most often get (no manifest yet, no retirement marker)."""
        if self.protocol != "s3":
            return self._retry(self.fs.exists, self.path(key))
        bucket, _, object_key = self.path(key).partition("/")
        try:
            self._retry(self.fs.call_s3, "head_object", Bucket=bucket, Key=object_key)
        except FileNotFoundError:
            return False
        return True

    def size(self, key: str) -> int:
        return self._retry(self.fs.size, self.path(key))

    def list(self, prefix: str) -> list[str]:
        """Keys directly under `prefix` (files and sub-prefixes), sorted; [] if there are none.

        A sub-prefix whose objects were all deleted may still be listed on SeaweedFS, which keeps
        empty directories: callers look for the objects they need inside, never at the prefix.
        One request on S3, as in `sizes`: s3fs's `ls` of an empty prefix also lists its parent."""
        path = self.path(prefix)
        parent, _, name = path.rpartition("/")
        try:
            if self.protocol == "s3" and parent and name:
                entries = self._retry(self.fs.find, parent, maxdepth=1, withdirs=True, prefix=f"{name}/")
            else:
                entries = self._retry(self.fs.ls, path, detail=False)
        except FileNotFoundError:
            return []
        keys = {self._key_of(entry) for entry in entries}  # a marker "d/" and the prefix d/ are one name
        return sorted(k for k in keys if not k.rsplit("/", 1)[-1].startswith(".") and k != prefix)

    def list_recursive(self, prefix: str) -> list[str]:
        """Every object key below `prefix`, sorted."""
        return sorted(self.sizes(prefix))

    def sizes(self, prefix: str) -> dict[str, int]:
        """Every object key below `prefix`, with its size in bytes: one listing request on S3.

        s3fs's `find` of a prefix with nothing below it also HEADs and lists the prefix as an
        object, two more round trips, and a commit lists its own prefix, still empty, before
        every upload. Asked for the parent's keys that start with the last component plus "/",
        the same objects come in one request."""
        path = self.path(prefix)
        parent, _, name = path.rpartition("/")
        try:
            if self.protocol == "s3" and parent and name:
                found = self._retry(self.fs.find, parent, prefix=f"{name}/", detail=True)
            else:
                found = self._retry(self.fs.find, path, detail=True)
        except FileNotFoundError:
            return {}
        # An object named "k/" (a directory marker, or a hostile bucket's decoy) is not "k": keyed
        # alike, its size would stand in for k's in the checks made before k is read.
        keys = {self._key_of(entry): info["size"] for entry, info in found.items() if not entry.endswith("/")}
        return {k: size for k, size in keys.items() if k and "/." not in f"/{k}"}

    def download(self, key: str, local: Path, *, share: bool = False) -> None:
        """Copy one object to a local file.

        `share`: the caller only reads `local` (a verified snapshot an engine loads). On file://
        the store then hard-links the object instead of copying it, when both are on one
        filesystem: a generator's fetch of a 453 MB snapshot was a second full copy of the bytes
        on the same disk. Safe because a committed object is never written in place (a commit
        deletes a killed attempt's leftovers before it uploads, and replacing writes a new file
        and renames or links it over the key), so the link keeps the bytes it was verified with."""
        local.parent.mkdir(parents=True, exist_ok=True)
        if share and self.protocol == "file" and link_replacing(Path(self.path(key)), local):
            return
        self._retry(self.fs.get_file, self.path(key), str(local))

    # -- writes -----------------------------------------------------------------------------

    def write_atomic(self, key: str, data: bytes) -> None:
        """Create or replace `key` so that readers see either the old or the new bytes.

        On file:// the new bytes are fsynced before the rename (see the module docstring)."""
        if self.protocol == "file":
            self._retry(write_file, Path(self.path(key)), data, replace=True, sync=True)
        else:
            self._retry(self.fs.pipe_file, self.path(key), data)

    def put_if_absent(self, key: str, data: bytes, *, sync: bool = False) -> bool:
        """Create `key` with `data` unless it exists. Returns False (and writes nothing) if it did.

        A retry after a lost response may find the object that its own first attempt created;
        it then returns False, which callers treat as "already committed" (writes are idempotent).
        On file:// there is no fsync unless `sync`: what is committed this way is checked by
        content on read (see the module docstring); a caller that deletes the only other copy
        next asks for one.
        """
        if self.protocol == "file":
            return self._retry(write_file, Path(self.path(key)), data, replace=False, sync=sync)
        if self.protocol == "s3":
            return self._retry(self._put_if_absent_s3, key, data)
        with _MEMORY_LOCK:
            if self.fs.exists(self.path(key)):
                return False
            self.fs.pipe_file(self.path(key), data)
            return True

    def upload(self, local: Path, key: str, *, take: bool = False) -> None:
        """Copy a local file to `key` (not a commit by itself: a manifest written last is).

        `take`: `local` is a staging file its caller deletes and never writes again. On file://
        the store then hard-links it instead of copying it, when both are on one filesystem
        (`staging_dir` makes sure): a 453 MB snapshot's upload went from a 1.1 s copy to a link
        (benchmarks/weightsync.py). Never for files the caller keeps, such as a user's model
        directory: a hard link would share any later write into them."""
        if self.protocol == "file":
            target = Path(self.path(key))
            target.parent.mkdir(parents=True, exist_ok=True)
            if take and link_replacing(local, target):
                return
        self._retry(self.fs.put_file, str(local), self.path(key))

    def staging_dir(self) -> Path | None:
        """Where to write files that `upload(..., take=True)` will move in: on file://, the run's
        hidden `.staging/` (the store's own filesystem; hidden names are never listed), made on
        demand; None elsewhere (the system's temporary directory)."""
        if self.protocol != "file":
            return None
        path = Path(self.path(STAGING))
        path.mkdir(parents=True, exist_ok=True)
        return path

    def clear_staging(self, owned: Sequence[str]) -> list[str]:
        """Remove what a killed writer left half-written (the trainer calls it as it starts: it
        is the run's one writer of snapshots and checkpoints, its only large files): on file://
        `staging_dir`; on S3 the multipart uploads under the prefixes `owned` that never
        completed, whose parts no listing shows and the bucket keeps, and bills, until they are
        aborted (a trainer killed mid-publish left a snapshot's worth each time). Only the
        caller's own prefixes: a live generator's upload elsewhere in the run (a metrics log past
        s3fs's multipart size) would fail on its aborted upload. Returns the keys aborted.
        A store that refuses (credentials without s3:ListBucketMultipartUploads or
        s3:AbortMultipartUpload, a store without the calls) gets a warning, not a trainer that
        cannot start; an upload that completes or goes between the listing and its abort is left."""
        if self.protocol == "file":
            shutil.rmtree(self.path(STAGING), ignore_errors=True)
        if self.protocol != "s3":
            return []
        bucket, _, base = self.base.partition("/")
        aborted: list[str] = []
        try:
            for prefix in owned:
                keys = abort_incomplete_uploads(functools.partial(self._retry, self.fs.call_s3), bucket, f"{base}/{prefix}/")
                aborted += [self._key_of(f"{bucket}/{key}") for key in keys]
            return aborted
        except (OSError, StorageUnavailable) as err:  # StorageRejected is an OSError
            log.warning("could not abort the incomplete uploads under %s (their parts stay billed: a lifecycle rule "
                        "AbortIncompleteMultipartUpload removes them): %s", self.url, err)  # fmt: skip
            return aborted

    def delete(self, key: str) -> None:
        """Remove one object; a missing one is not an error."""
        try:
            self._retry(self.fs.rm_file, self.path(key))
        except FileNotFoundError:
            pass

    def delete_prefix(self, prefix: str) -> None:
        """Remove every object below `prefix`: on S3 in one bulk request per 1,000 keys (the
        trainer retires a snapshot of several files every step).

        The bulk request is sent as is, not through s3fs's `rm`, which reads keys as glob
        patterns (a key with "[" in it was left, or failed the call) and ignores the keys a
        DeleteObjects answer lists as not deleted. Those are deleted one by one, so that their
        errors are retried or raised like any other call's."""
        keys = self.list_recursive(prefix)
        if self.protocol == "s3":
            chunks = (keys[start : start + 1000] for start in range(0, len(keys), 1000))
            keys = [key for chunk in chunks for key in self._delete_bulk(chunk)]
        for key in keys:
            self.delete(key)
        if self.protocol == "file" and Path(self.path(prefix)).is_dir():
            remove_stale_temporaries(Path(self.path(prefix)))
            remove_empty_dirs(Path(self.path(prefix)))

    # -- internals --------------------------------------------------------------------------

    def _key_of(self, path: str) -> str:
        path = path.split("://", 1)[-1] if self.protocol != "file" else path
        base = self.base.split("://", 1)[-1] if self.protocol != "file" else self.base
        return path[len(base) :].strip("/")

    def _delete_bulk(self, keys: list[str]) -> list[str]:
        """Delete up to 1,000 keys in one DeleteObjects request; returns those it did not delete."""
        bucket, _, base = self.base.partition("/")
        objects = [{"Key": f"{base}/{key}" if base else key} for key in keys]
        answer = self._retry(self.fs.call_s3, "delete_objects", Bucket=bucket, Delete={"Objects": objects, "Quiet": True})
        failed = {error.get("Key") for error in answer.get("Errors", [])}
        return [key for key, entry in zip(keys, objects) if entry["Key"] in failed]

    def _put_if_absent_s3(self, key: str, data: bytes) -> bool:
        bucket, _, object_key = self.path(key).partition("/")
        try:
            self.fs.call_s3("put_object", Bucket=bucket, Key=object_key, Body=data, IfNoneMatch="*")
        except OSError as err:
            if is_precondition_failure(err):
                return False
            raise
        return True

    def _retry(self, call: Callable[..., T], *args, **kwargs) -> T:
        """`call` with retries, in an empty contextvars context. s3fs runs it on fsspec's IO-loop
        thread, where timers it leaves (aiohttp's keep-alive) hold a copy of the caller's context
        long after the call: Prefect's task run context, whose parameters are the Learner and its
        tensors. That daemon thread then freed the tensors at interpreter exit, and the process
        aborted ("terminate called without an active exception", exit -6) after a finished run."""
        deadline = None  # from the first failure: a long transfer that fails late gets its retries too
        delay = 0.1
        while True:
            try:
                return contextvars.Context().run(call, *args, **kwargs)
            except PERMANENT_ERRORS as err:
                if isinstance(err, PermissionError):
                    raise StorageRejected(errno.EACCES, self._refused_access(err)) from err
                if not is_missing_bucket(err):
                    raise
                deadline = deadline or time.monotonic() + self.retry_seconds
                self._wait_before_retry(err, deadline, delay)
                delay = min(delay * 2, 2.0)
            except TRANSIENT_ERRORS as err:
                if isinstance(err, OSError) and (is_precondition_failure(err) or err.errno in LOCAL_ERRNOS):
                    raise
                if (reason := rejection_reason(err)) is not None:
                    code = err.errno if isinstance(err, OSError) and err.errno else errno.EINVAL
                    message = getattr(err, "strerror", None) or str(err)
                    raise StorageRejected(
                        code, f"storage at {self.url} rejected the request, {reason}: {message}"
                    ) from err
                deadline = deadline or time.monotonic() + self.retry_seconds
                self._wait_before_retry(err, deadline, delay)
                delay = min(delay * 2, 2.0)

    def _refused_access(self, err: PermissionError) -> str:
        """What to check when the storage refuses access: s3fs raises AccessDenied, a wrong
        secret (SignatureDoesNotMatch) and InvalidAccessKeyId as a bare PermissionError, which
        named neither the store nor the settings that decide it."""
        if self.protocol != "s3":
            return f"storage at {self.url} refused access: {err}; this user must be able to read and write below it"
        return (f"storage at {self.url} refused access: {err}; check storage.key and storage.secret (or "
                "storage.credentials_block), and that they may list, read, write and delete below it, and create "
                "its bucket unless it exists")  # fmt: skip

    def _wait_before_retry(self, err: BaseException, deadline: float, delay: float) -> None:
        """Sleep `delay` before the next try; StorageUnavailable if that would pass `deadline`."""
        if time.monotonic() + delay > deadline:
            raise StorageUnavailable(f"storage at {self.url} failed for {self.retry_seconds:.0f}s: {err}") from err
        log.warning("storage error on %s, retrying in %.1fs: %s", self.url, delay, err)
        time.sleep(delay)


def open_run_store(storage: StorageConfig, run_id: str) -> RunStore:
    """The `RunStore` of run `run_id` under `storage.root`, creating the S3 bucket if needed."""
    scheme, _, rest = storage.root.partition("://")
    if scheme == "file":
        base = os.path.abspath(os.path.expanduser(rest))
        fs = fsspec.filesystem("file")
        url = f"file://{base}/{run_id}"
        return RunStore(fs, f"{base}/{run_id}", url, storage.retry_seconds)
    if scheme == "memory":
        fs = fsspec.filesystem("memory")
        return RunStore(fs, f"/{rest.strip('/')}/{run_id}", f"memory://{rest.strip('/')}/{run_id}", 0)
    fs = s3_filesystem(storage)
    bucket = rest.strip("/").split("/", 1)[0]
    if not bucket:
        raise ValueError(f"storage.root {storage.root!r} names no bucket")
    store = RunStore(fs, f"{rest.strip('/')}/{run_id}", f"s3://{rest.strip('/')}/{run_id}", storage.retry_seconds)
    seen = (fs.endpoint_url, fs.key, bucket)
    if seen in _BUCKETS_SEEN:  # every rollout group opens the store: one check a process
        return store
    if not store._retry(fs.exists, bucket):
        log.info("creating bucket %s", bucket)
        try:
            store._retry(fs.mkdir, bucket)
        except FileExistsError:
            # Another process created it meanwhile, or a server just restarted answered "no such
            # bucket" before it had loaded its buckets (seen with SeaweedFS: benchmarks/faults.py).
            pass
    _BUCKETS_SEEN.add(seen)
    return store
