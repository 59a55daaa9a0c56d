"""Directory commits on object storage: upload every file, then write MANIFEST.json LAST.

Object storage has no atomic rename of a directory, so a multi-file object (a weight snapshot, a
trainer checkpoint) is made visible by one atomic write: `{prefix}/MANIFEST.json`, created with
`put_if_absent` after every other file is uploaded. A prefix without a manifest is an unfinished
(or killed) write and readers ignore it; a prefix with one is complete and immutable.

The manifest lists each file with its size and sha256:

    {"format": "tandem-manifest/1", "created_at": "2026-12-02T14:00:00+00:00",
     "files": {"model.safetensors": {"size": 123, "sha256": "ab12..."}, ...},
     "extra": {...caller metadata, e.g. {"version": 3}...}}

Readers trust nothing in a bucket. `fetch_directory` checks the manifest's shape, refuses file
names that could escape the target directory ('..', absolute paths, backslashes, hidden names;
nested names like "original/params.json" are allowed when every component is a plain name), refuses
absurd sizes before allocating anything, downloads into a temporary sibling directory, checks every
size and sha256 (streamed, so 100M-parameter files never sit in memory), and only then renames the
directory into place. A half-fetched or corrupt copy is never left at the final path.

Files in a directory that the manifest does not list are ignored by `verify_local_dir` (the
manifest defines the content); `fetch_directory` never creates such files, so a fetched directory
holds exactly the listed files plus MANIFEST.json.

`numbered_directories` groups a listing's files by numbered directory (`weights/v00000003/`,
`checkpoints/step00000040/`), so that one listing tells the committed directories from a killed
write's leftovers.

One writer per prefix is assumed (the trainer owns weights/ and checkpoints/); put_if_absent makes
the commit itself single-winner even so.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import uuid
from datetime import datetime, timezone
from collections.abc import Callable
from pathlib import Path
from typing import Any

from infra.storage import RunStore

MANIFEST_NAME = "MANIFEST.json"
MANIFEST_FORMAT = "tandem-manifest/1"
MAX_MANIFEST_BYTES = 16 * 2**20
MAX_FILE_BYTES = 2**40
"""1 TiB: a single listed file larger than this is a corrupt or hostile manifest."""
_NAME_COMPONENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,254}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_CHUNK = 8 * 2**20


class ManifestError(Exception):
    """A directory does not match its manifest, or the manifest itself is missing or invalid.

    `manifest_digest`: sha256 of the manifest bytes the check was made against, when it got that
    far (`fetch_directory`): which commit of the directory failed, read once, by the reader."""

    manifest_digest: str | None = None


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def build_manifest(local_dir: Path, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The manifest of every file below `local_dir` (hidden names and MANIFEST.json excluded)."""
    local_dir = Path(local_dir)
    files: dict[str, dict[str, Any]] = {}
    for path in sorted(local_dir.rglob("*")):
        name = path.relative_to(local_dir).as_posix()
        if path.is_dir() or name == MANIFEST_NAME or any(p.startswith(".") for p in name.split("/")):
            continue
        _check_name(name)
        files[name] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
    manifest: dict[str, Any] = {
        "format": MANIFEST_FORMAT,
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "files": files,
    }
    if extra:
        manifest["extra"] = extra
    return manifest


def parse_manifest(data: bytes) -> dict[str, Any]:
    """Decode and validate manifest bytes; ManifestError on anything unexpected."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{MANIFEST_NAME}: {len(data)} bytes, more than {MAX_MANIFEST_BYTES}")
    try:
        manifest = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ManifestError(f"{MANIFEST_NAME}: not JSON ({err})") from err
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise ManifestError(f"{MANIFEST_NAME}: not a {MANIFEST_FORMAT} manifest")
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise ManifestError(f"{MANIFEST_NAME}: 'files' is not an object")
    for name, entry in files.items():
        _check_name(name)
        if not isinstance(entry, dict):
            raise ManifestError(f"{name}: manifest entry is not an object")
        size, sha = entry.get("size"), entry.get("sha256")
        if type(size) is not int or not 0 <= size <= MAX_FILE_BYTES:
            raise ManifestError(f"{name}: invalid size {size!r} in manifest")
        if not isinstance(sha, str) or not _SHA256.fullmatch(sha):
            raise ManifestError(f"{name}: invalid sha256 {sha!r} in manifest")
    return manifest


def verify_local_dir(local_dir: Path) -> dict[str, Any]:
    """Check every file listed in `local_dir/MANIFEST.json`; return the manifest or raise."""
    local_dir = Path(local_dir)
    try:
        data = (local_dir / MANIFEST_NAME).read_bytes()
    except FileNotFoundError as err:
        raise ManifestError(f"{MANIFEST_NAME}: missing in {local_dir}") from err
    manifest = parse_manifest(data)
    for name, entry in manifest["files"].items():
        _verify_file(local_dir / name, name, entry)
    return manifest


def commit_directory(
    store: RunStore, local_dir: Path, prefix: str, extra: dict[str, Any] | None = None, take_files: bool = False
) -> bool:
    """Upload `local_dir` under `prefix` and commit it with a manifest written last.

    `take_files`: `local_dir` is staging its caller deletes, so the store may link its files
    rather than copy them (`RunStore.upload`). Returns False, uploading nothing, if `prefix` is
    already committed (a retried commit)."""
    manifest_key = f"{prefix}/{MANIFEST_NAME}"
    present = store.sizes(prefix)  # one listing: committed already, or a killed attempt's leftovers
    if manifest_key in present:
        return False
    manifest = build_manifest(local_dir, extra)
    for key in present:  # never committed, never read
        store.delete(key)
    for name in manifest["files"]:
        store.upload(Path(local_dir) / name, f"{prefix}/{name}", take=take_files)
    data = json.dumps(manifest, indent=1, sort_keys=True).encode()
    return store.put_if_absent(manifest_key, data)


def numbered_directories(store: RunStore, top: str, name: re.Pattern[str]) -> dict[int, set[str]]:
    """The files of each numbered directory below `top` (`name` matches the directory's name and
    captures its number), from one listing: {number: file names relative to the directory}.

    One listing, not a request per directory: SeaweedFS lists a directory emptied by retention for
    good, so a check of each would grow with the run's length. A directory's files say what state
    it is in (committed: a manifest; a killed write: files but no manifest), so callers sort them
    by that without a second request."""
    files: dict[int, set[str]] = {}
    for key in store.sizes(top):
        parts = key.split("/")
        if len(parts) >= 3 and (match := name.fullmatch(parts[1])):
            files.setdefault(int(match.group(1)), set()).add("/".join(parts[2:]))
    return files


def read_manifest(store: RunStore, prefix: str) -> dict[str, Any]:
    """The validated manifest of a committed prefix; ManifestError if it has none."""
    return parse_manifest(_read_manifest_bytes(store, prefix))


def fetch_directory(
    store: RunStore, prefix: str, local_dir: Path, include: Callable[[str], bool] | None = None
) -> dict[str, Any]:
    """Download the committed directory at `prefix` into `local_dir`, verified; return its manifest.

    A `local_dir` that already holds the same manifest and verifies is reused as it is. Its
    files are for reading: on file:// they may be hard links to the store's (`RunStore.download`).

    `include`: fetch only the files whose names it accepts, each verified as in a whole fetch
    (a tokenizer without the weights beside it). No manifest is written into such a copy, so it
    is never taken for a whole one."""
    local_dir = Path(local_dir)
    stored_sizes = store.sizes(prefix)  # one listing for the manifest's size and every file's
    data = _read_manifest_bytes(store, prefix, stored_sizes)
    try:
        return _fetch_committed(store, prefix, local_dir, stored_sizes, data, include)
    except ManifestError as err:
        err.manifest_digest = hashlib.sha256(data).hexdigest()
        raise


def _fetch_committed(
    store: RunStore, prefix: str, local_dir: Path, stored_sizes: dict[str, int], data: bytes, include: Callable[[str], bool] | None
) -> dict[str, Any]:  # fmt: skip
    manifest = parse_manifest(data)
    if include is None and _is_verified_copy(local_dir, data):
        return manifest
    files = {name: entry for name, entry in manifest["files"].items() if include is None or include(name)}
    local_dir.parent.mkdir(parents=True, exist_ok=True)
    stored = store.local_path(prefix)
    try:
        linked = stored is not None and stored.stat().st_dev == local_dir.parent.stat().st_dev  # takes no space
    except FileNotFoundError as err:  # retired since the listing, as a file missing at its download is
        raise ManifestError(f"{prefix}: deleted while it was fetched") from err
    needed = 0 if linked else sum(entry["size"] for entry in files.values())
    free = shutil.disk_usage(local_dir.parent).free
    if needed > free:  # the machine's trouble, not the snapshot's: not a ManifestError, which rejects the snapshot
        raise OSError(errno.ENOSPC, f"no space for {prefix}: it needs {needed} bytes, {free} are free at {local_dir.parent} "
                      "(free space there, or point TMPDIR at a larger disk; a generator needs room for two snapshots, "
                      "as it keeps its engines' until the next one has loaded)")
    staging = local_dir.with_name(f".{local_dir.name}.{uuid.uuid4().hex}.partial")
    try:
        staging.mkdir()
        for name, entry in files.items():
            key = f"{prefix}/{name}"
            if key not in stored_sizes:
                raise ManifestError(f"{name}: listed in the manifest but missing")
            if stored_sizes[key] != entry["size"]:
                raise ManifestError(f"{name}: size {stored_sizes[key]}, manifest says {entry['size']}")
            try:
                store.download(key, staging / name, share=True)
            except FileNotFoundError as err:
                raise ManifestError(f"{name}: listed in the manifest but missing") from err
            _verify_file(staging / name, name, entry)
        if include is None:
            (staging / MANIFEST_NAME).write_bytes(data)
        _move_into_place(staging, local_dir, data)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return manifest


def _read_manifest_bytes(store: RunStore, prefix: str, stored_sizes: dict[str, int] | None = None) -> bytes:
    """The manifest's bytes, its size checked before it is read (`stored_sizes`: the prefix's
    listing, when the caller has it, saves a request)."""
    key = f"{prefix}/{MANIFEST_NAME}"
    try:
        size = store.size(key) if stored_sizes is None else stored_sizes.get(key)
        if size is None:
            raise FileNotFoundError(key)
        if size > MAX_MANIFEST_BYTES:
            raise ManifestError(f"{MANIFEST_NAME}: {size} bytes, more than {MAX_MANIFEST_BYTES}")
        return store.read_bytes(key)
    except FileNotFoundError as err:
        raise ManifestError(f"{MANIFEST_NAME}: missing under {store.url_of(prefix)}") from err


def _check_name(name: object) -> None:
    parts = name.split("/") if isinstance(name, str) else [""]
    if not all(_NAME_COMPONENT.fullmatch(part) for part in parts) or name == MANIFEST_NAME:
        raise ManifestError(f"{name!r}: not a plain relative file name")


def _verify_file(path: Path, name: str, entry: dict[str, Any]) -> None:
    if not path.is_file():
        raise ManifestError(f"{name}: listed in the manifest but missing")
    size = path.stat().st_size
    if size != entry["size"]:
        raise ManifestError(f"{name}: size {size}, manifest says {entry['size']}")
    digest = sha256_file(path)
    if digest != entry["sha256"]:
        raise ManifestError(f"{name}: sha256 {digest}, manifest says {entry['sha256']}")


def _is_verified_copy(local_dir: Path, manifest_bytes: bytes) -> bool:
    try:
        if (local_dir / MANIFEST_NAME).read_bytes() != manifest_bytes:
            return False
        verify_local_dir(local_dir)
    except (OSError, ManifestError):
        return False
    return True


def _move_into_place(staging: Path, local_dir: Path, manifest_bytes: bytes) -> None:
    """Rename the verified staging directory to `local_dir`, replacing a stale copy there."""
    if local_dir.exists():
        shutil.rmtree(local_dir)
    try:
        os.rename(staging, local_dir)
    except OSError:
        # Another process fetched the same directory in the meantime: theirs is as good.
        if not _is_verified_copy(local_dir, manifest_bytes):
            raise
