"""Weight snapshots: how the trainer hands policy versions to the generators.

    weights/v{V:08d}/           HF model dir (config.json, *.safetensors, tokenizer files),
                                committed by MANIFEST.json written last (infra/manifest.py)
    weights/LATEST              {"version": V}, moved only after V's manifest exists; forward,
                                except back to the checkpoint a restarted run resumes from
    weights/pins/{consumer}.json  {"version": V}: a generator or engine is using V; retention
                                keeps it (a withdrawal does not), until "lapses_at" if given
    weights/rejected/{consumer}.json  {"version": V, "manifest": digest, "reason": ...}: a
                                generator found V damaged after its commit; the trainer commits
                                it again (`recommit_snapshot`) and removes the report

Why this shape: a generator polls LATEST and loads what it names, so LATEST must never name a
snapshot that is incomplete or gone. Hence the order publish = upload, manifest, then LATEST; and
retention never deletes LATEST or a pinned version, and deletes a snapshot's MANIFEST before its
other files, so that no reader starts on a half-deleted snapshot.
Version 0 (the initial model) is a multiple of every `keep_every`, so retention always keeps it.

`load_snapshot` always fetches into a local cache directory and verifies there, on file:// too,
rather than verifying the store's own directory in place: what it fetched cannot be deleted by a
retention sweep while an engine reads it, stray uncommitted files in the store never reach
from_pretrained, and every backend takes one code path. On file:// the fetch hard-links the
committed files when the cache is on the same filesystem (a committed file is never rewritten, so
the link keeps the verified bytes); elsewhere it copies them, which an S3 reader pays anyway.

A trainer resumed from its checkpoint at step K numbers its next snapshots K+1, K+2, ... again,
with weights other than those its dead predecessor published under those numbers. Before it
starts, and before any generator of the restarted run does, `withdraw_after(K)` moves LATEST back
to K and deletes the predecessor's later snapshots, pinned or not (tasks/lag.py `reopen_run`), so
that the run's generators start on weights the resumed trainer has. `committed_at` tells a
number's two snapshots apart where that matters (a score recorded for the first).

A snapshot damaged after its commit (a file truncated or changed in the bucket) fails every
generator's verification. They keep their engines' weights and report it (`report_rejected`);
where the lag bound needs that version (at max_lag 0, every batch needs the newest) the run would
otherwise wait for good. The trainer commits the same version again from its weights, marked as
replacing the damaged commit, so that its manifest differs and generators try it again.

A consumer that must not lose its snapshot mid-load pins it first (`pin_snapshot`), then loads;
a ManifestError from `load_snapshot` means the version was retired or withdrawn meanwhile: read
LATEST again.
A consumer told which version to use (an evaluation) pins it too, then checks it with
`committed_version`: a retention pass that starts after the pin keeps the version.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import re
import time
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from infra.manifest import MANIFEST_NAME, build_manifest, commit_directory, fetch_directory, numbered_directories, read_manifest
from infra.scratch import staging_area
from infra.storage import RunStore

if TYPE_CHECKING:  # transformers' model classes import torch, which the rollout side never needs
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)
WEIGHTS = "weights"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
"""What weights a model directory may hold: v0 is model.path committed whole, a hub download's
pytorch_model*.bin and original/*.pth included."""
LATEST_KEY = f"{WEIGHTS}/LATEST"
PINS = f"{WEIGHTS}/pins"
REJECTED = f"{WEIGHTS}/rejected"
_VERSION_DIR = re.compile(r"v(\d{8})")
_CONSUMER = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def snapshot_prefix(version: int) -> str:
    """The key prefix of snapshot `version`: weights/v00000003."""
    if version < 0:
        raise ValueError(f"a policy version is >= 0, got {version}")
    return f"{WEIGHTS}/v{version:08d}"


def publish_snapshot(
    store: RunStore,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    version: int,
    staging_dir: Path | None = None,
    dtype: torch.dtype | None = None,
    replaces: str | None = None,
) -> int:
    """Save `model` and `tokenizer` as snapshot `version`, commit it, move LATEST; returns version.

    `dtype`: the dtype to store the weights in (the model's own if None). The trainer's weights
    are float32 masters of a checkpoint that may be stored in bfloat16
    (`infra.modelfactory.load_trainable_model`); the engines get that checkpoint's dtype back.
    Idempotent: publishing a version already committed with the same weights only (re)moves
    LATEST forward; with other weights it is a SnapshotConflict.
    On file:// it stages in the run's own `.staging/`, so that the files are linked into the
    snapshot rather than written a second time (`RunStore.upload`)."""
    with staging_area("snapshot-", staging_dir or store.staging_dir()) as temp:
        if dtype is None or dtype == model.dtype:
            model.save_pretrained(temp)
        else:
            _save_cast(model, temp, dtype)
        tokenizer.save_pretrained(temp)
        return publish_snapshot_dir(store, temp, version, take_files=True, replaces=replaces)


def _save_cast(model: PreTrainedModel, out_dir: Path, dtype: torch.dtype) -> None:
    """`model.save_pretrained` with its floating-point weights, and config.json's dtype, in
    `dtype`, except those the model class keeps in float32 (as a load in `dtype` leaves them).
    Tied weights (embeddings and head) stay one tensor, so they are saved once, as from the
    model itself."""
    keep = [*(model._keep_in_fp32_modules_strict or ()), *((model._keep_in_fp32_modules or ()) if str(dtype) == "torch.float16" else ())]
    kept = re.compile("|".join(rf"(^|\.){re.escape(part)}(\.|$)" for part in keep)) if keep else None  # "mlp.gate" too
    cast: dict[tuple, torch.Tensor] = {}

    def stored(name: str, tensor: torch.Tensor) -> torch.Tensor:
        if not tensor.is_floating_point() or (kept and kept.search(name)) or tensor.numel() == 0:
            return tensor
        tie = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.shape, tensor.stride())
        if tie not in cast:
            cast[tie] = tensor.to(dtype)
        return cast[tie]

    model.save_pretrained(out_dir, state_dict={name: stored(name, t) for name, t in model.state_dict().items()})
    config = copy.deepcopy(model.config)
    config.dtype = dtype
    config.save_pretrained(out_dir)


def publish_snapshot_dir(store: RunStore, local_dir: Path, version: int, take_files: bool = False, replaces: str | None = None) -> int:
    """Commit an HF directory already on disk (e.g. the initial model) as snapshot `version`;
    `take_files` only for a staging directory the caller deletes (see `commit_directory`);
    `replaces`: the manifest digest of a damaged commit of this version (`recommit_snapshot`)."""
    prefix = snapshot_prefix(version)
    extra = {"version": version} | ({"replaces": replaces} if replaces else {})
    if not commit_directory(store, local_dir, prefix, extra=extra, take_files=take_files):
        _check_same_snapshot(store, local_dir, version)
    move_latest_forward(store, version)
    return version


def _weight_files(manifest: dict) -> dict:
    return {name: entry for name, entry in manifest["files"].items() if name.endswith(WEIGHT_SUFFIXES)}


class SnapshotConflict(RuntimeError):
    """A version already committed with other weights than the publisher's: another trainer's."""


def _check_same_snapshot(store: RunStore, local_dir: Path, version: int) -> None:
    """A version found committed is a retried publish of the same weights, or another trainer's
    (a trainer whose pipeline lost the run to a restart, still publishing; a training run started
    without its pipeline, which withdraws what follows the checkpoint). Taking the second for the
    first would let generators serve other weights under this trainer's version, as on-policy.
    Only the weight files are compared: config.json records the transformers version, which a
    trainer restarted on an upgraded image would change without changing a weight."""
    if _weight_files(read_manifest(store, snapshot_prefix(version))) != _weight_files(build_manifest(local_dir)):
        raise SnapshotConflict(
            f"snapshot v{version} is committed already with other weights ({store.url_of(snapshot_prefix(version))}): "
            "another trainer of this run published it. Start the run again (tandem run): it withdraws the snapshots "
            "after its last checkpoint and resumes from there"
        )  # fmt: skip


def move_latest_forward(store: RunStore, version: int) -> None:
    """Point LATEST at committed snapshot `version` unless it names a newer one already."""
    current = latest_version(store)
    if current is None or version > current:
        store.write_atomic(LATEST_KEY, json.dumps({"version": version}).encode())


def latest_version(store: RunStore) -> int | None:
    """The version LATEST names, or None before the first publish."""
    try:
        return _read_version(store, LATEST_KEY)
    except FileNotFoundError:
        return None


def snapshot_versions(store: RunStore) -> list[int]:
    """Committed snapshot versions (those with a MANIFEST), ascending."""
    return _version_dirs(store)[0]


def _version_dirs(store: RunStore) -> tuple[list[int], list[int]]:
    """From one listing: the committed versions, and those whose directory holds files but no
    manifest (a killed publish's, or a retirement's cut short), both ascending."""
    files = numbered_directories(store, WEIGHTS, _VERSION_DIR)
    committed = sorted(version for version, names in files.items() if MANIFEST_NAME in names)
    return committed, sorted(set(files) - set(committed))


class SnapshotMissing(LookupError):
    """A snapshot asked for that the run directory does not hold: never published, or retired."""


def committed_version(store: RunStore, version: int | None) -> int:
    """`version` (None: the one LATEST names) if it is a committed snapshot; SnapshotMissing
    naming it and the versions kept otherwise."""
    wanted = latest_version(store) if version is None else version
    kept = snapshot_versions(store)
    if wanted in kept:
        return wanted
    if not kept:
        raise SnapshotMissing(f"no snapshot published under {store.url_of(WEIGHTS)}")
    shown = kept if len(kept) <= 12 else [*kept[:6], "...", *kept[-6:]]
    listed = ", ".join(v if v == "..." else f"v{v}" for v in shown)
    raise SnapshotMissing(
        f"no snapshot v{wanted} under {store.url_of(WEIGHTS)} (never published, or removed by retention); "
        f"kept: {listed}"
    )


def load_snapshot(store: RunStore, cache_dir: Path, version: int | None = None, weights: bool = True) -> Path:
    """Fetch and verify snapshot `version` (default: LATEST) into cache_dir; returns its directory.

    The directory loads with `AutoModelForCausalLM.from_pretrained` and SGLang as it is. Without
    `weights`, every file but the weights (WEIGHT_SUFFIXES) is fetched: what a tokenizer loads
    from, for a process that needs no model (each Dask worker: a 14B model's 28 GB fetched and
    hashed per worker, for its tokenizer, filled a machine's disk)."""
    if version is None:
        version = latest_version(store)
        if version is None:
            raise FileNotFoundError(f"no snapshot published under {store.url_of(WEIGHTS)}")
    local_dir = Path(cache_dir) / f"v{version:08d}"
    fetch_directory(store, snapshot_prefix(version), local_dir, None if weights else _not_weights)
    return local_dir


def _not_weights(name: str) -> bool:
    return not name.endswith(WEIGHT_SUFFIXES)


FETCH_PIN_SECONDS = 24 * 3600
"""How long a pin taken for a fetch holds its snapshot if its owner never unpins it. A generator
and a retrain need the version in storage only while they fetch it (engines restart from the
local copy); one killed before its `finally` otherwise kept a whole snapshot for good."""


def pin_snapshot(store: RunStore, consumer: str, version: int, lapse_seconds: float | None = None) -> None:
    """Record that `consumer` uses `version`, so that retention keeps it (one pin per consumer).

    A pin with `lapse_seconds` keeps it that long only: for a consumer that may never come to
    unpin it. The trainer pins each version marked for evaluation for its triggered run, which
    never starts if the automation is off or the inference pool has no worker; without a lapse,
    every marked version of a long run stayed in storage for good. The time is the writer's
    clock, which retention compares with its own: a lapse is hours, a skew seconds."""
    record: dict[str, float] = {"version": version}
    if lapse_seconds is not None:
        record["lapses_at"] = time.time() + lapse_seconds
    store.write_atomic(_pin_key(consumer), json.dumps(record).encode())


def unpin_snapshot(store: RunStore, consumer: str) -> None:
    """Drop `consumer`'s pin (a consumer that stops for good should)."""
    store.delete(_pin_key(consumer))


def pinned_versions(store: RunStore) -> set[int]:
    """Versions named by any pin file that has not lapsed."""
    return _read_pins(store)[0]


def _read_pins(store: RunStore) -> tuple[set[int], list[str]]:
    """The versions the pins in force name, and the keys of the pins that have lapsed."""
    pins, lapsed = set(), []
    for key in store.list(PINS):
        if not key.endswith(".json"):
            continue
        try:
            record = _read_pointer(store, key)
        except FileNotFoundError:  # unpinned since the listing
            continue
        if _has_lapsed(store, key, record):
            lapsed.append(key)
        else:
            pins.add(record["version"])
    return pins, lapsed


def _has_lapsed(store: RunStore, key: str, pin: dict) -> bool:
    """Whether pin record `pin` (of file `key`) has a "lapses_at" that has passed; ValueError
    naming the file if that is not a time."""
    lapses_at = pin.get("lapses_at")
    if lapses_at is not None and type(lapses_at) not in (int, float):
        raise ValueError(f"{store.url_of(key)}: lapses_at is not a time: {lapses_at!r}")
    return lapses_at is not None and lapses_at <= time.time()


def apply_retention(
    store: RunStore, keep_last: int, keep_every: int, pinned: Iterable[int] = ()
) -> list[int]:
    """Delete snapshots that nothing needs; returns the deleted versions.

    Kept: the newest `keep_last` committed versions, every multiple of `keep_every` (so v0),
    LATEST, the `pinned` argument and every version a pin file names. Files without a manifest
    below the newest committed version are deleted too: a retirement cut short after its
    manifest went (a killed trainer, an outage) left them, or a publish killed before its commit
    that no retry will make (a publish in progress is of a newer version).

    A pin file that does not parse (edited by hand, written by a foreign tool) keeps every
    snapshot, with a warning naming it: its consumer may need any of them, and retention is
    housekeeping, which must not fail the trainer's step."""
    if keep_last < 1 or keep_every < 1:
        raise ValueError("keep_last and keep_every must be >= 1")
    try:
        pins, lapsed = _read_pins(store)
    except ValueError as err:
        log.warning("snapshot retention skipped, every snapshot kept until the pin is fixed or removed: %s", err)
        return []
    for key in lapsed:
        if _still_lapsed(store, key):  # not pinned afresh since it was read (an evaluation starting)
            log.warning("pin %s lapsed before its consumer unpinned it: its version is no longer kept for it", store.url_of(key))
            store.delete(key)
    committed, uncommitted = _version_dirs(store)
    latest = latest_version(store)
    keep = set(committed[-keep_last:]) | set(pinned) | pins
    keep |= {v for v in committed if v % keep_every == 0}
    if latest is not None:
        keep.add(latest)
    deleted = [version for version in committed if version not in keep]
    for version in deleted:
        _delete_snapshot(store, version)
    for version in uncommitted:
        if committed and version < committed[-1] and version != latest:  # LATEST's: a recommit under way
            store.delete_prefix(snapshot_prefix(version))
    return deleted


def committed_at(store: RunStore, version: int) -> float:
    """When snapshot `version` was committed: its manifest's time (whole seconds, the writer's
    clock). A number withdrawn and published again names other weights from then on."""
    return datetime.fromisoformat(read_manifest(store, snapshot_prefix(version))["created_at"]).timestamp()


def manifest_digest(store: RunStore, version: int) -> str | None:
    """sha256 of snapshot `version`'s MANIFEST.json as stored, which names one commit of it;
    None if it has none."""
    try:
        return hashlib.sha256(store.read_bytes(f"{snapshot_prefix(version)}/{MANIFEST_NAME}")).hexdigest()
    except FileNotFoundError:
        return None


def report_rejected(store: RunStore, consumer: str, version: int, manifest: str | None, reason: str) -> None:
    """Tell the trainer that `consumer` found the commit of snapshot `version` whose manifest
    digest is `manifest` damaged (module docstring)."""
    record = {"version": version, "manifest": manifest, "reason": reason[:2000], "at": time.time()}
    store.write_atomic(f"{REJECTED}/{_consumer_name(consumer)}.json", json.dumps(record).encode())


def rejection_reports(store: RunStore) -> dict[str, dict | None]:
    """Key -> report of every rejection reported; None for one that does not parse."""
    reports: dict[str, dict | None] = {}
    for key in store.list(REJECTED):
        try:
            reports[key] = read_rejection_report(store, key)
        except FileNotFoundError:  # handled since the listing
            continue
    return reports


def read_rejection_report(store: RunStore, key: str) -> dict | None:
    """The report at `key`; None if it does not parse."""
    try:
        record = json.loads(store.read_bytes(key))
    except ValueError:
        return None
    return record if isinstance(record, dict) and type(record.get("version")) is int else None


def recommit_snapshot(store: RunStore, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, version: int,
                      replaces: str | None, dtype: torch.dtype | None = None) -> None:  # fmt: skip
    """Commit snapshot `version` again from the weights that made it (the trainer's, still at
    that version), in place of the commit whose manifest digest is `replaces`, which a reader
    found damaged. LATEST keeps naming `version`; a generator that reads it meanwhile finds no
    snapshot and reads LATEST again."""
    _delete_snapshot(store, version)
    publish_snapshot(store, model, tokenizer, version, dtype=dtype, replaces=replaces or "unreadable")


def withdraw_after(store: RunStore, version: int) -> list[int]:
    """Move LATEST back to committed snapshot `version` and delete every snapshot after it, newest
    first; returns the versions deleted. For a trainer resumed from its checkpoint at `version`
    (module docstring). LATEST is also moved when nothing comes after `version` but it names
    another: a trainer killed inside `recommit_snapshot` left it naming a snapshot it had just
    deleted, which no publish below it could move it off."""
    later = [v for v in snapshot_versions(store) if v > version]
    try:
        latest = latest_version(store)
    except ValueError:  # damaged: written anew below
        latest = None
    if later or latest != version:
        committed_version(store, version)  # LATEST must never name a snapshot that is not there
        store.write_atomic(LATEST_KEY, json.dumps({"version": version}).encode())
        for v in reversed(later):
            _delete_snapshot(store, v)
    return later


def _delete_snapshot(store: RunStore, version: int) -> None:
    prefix = snapshot_prefix(version)
    store.delete(f"{prefix}/{MANIFEST_NAME}")  # first: readers stop seeing it
    store.delete_prefix(prefix)


def _still_lapsed(store: RunStore, key: str) -> bool:
    try:
        return _has_lapsed(store, key, _read_pointer(store, key))
    except (FileNotFoundError, ValueError):
        return False


def _read_version(store: RunStore, key: str) -> int:
    """The version a pointer file names."""
    return _read_pointer(store, key)["version"]


def _read_pointer(store: RunStore, key: str) -> dict:
    """A pointer file's record; ValueError naming the file if it is not {"version": V, ...}
    (a bare JSONDecodeError would not say which file of the run directory is damaged)."""
    try:
        record = json.loads(store.read_bytes(key))
        version = record["version"]
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{store.url_of(key)}: not a {{\"version\": V}} record ({err!r})") from None
    if type(version) is not int or version < 0:
        raise ValueError(f"{store.url_of(key)}: invalid version {version!r}")
    return record


def _pin_key(consumer: str) -> str:
    return f"{PINS}/{_consumer_name(consumer)}.json"


def _consumer_name(consumer: str) -> str:
    if not _CONSUMER.fullmatch(consumer):
        raise ValueError(f"consumer name must be letters, digits, '.', '_', '-': {consumer!r}")
    return consumer
