"""Weight snapshots and manifest commits, on file:// and on SeaweedFS.

The invariants: LATEST only ever names a complete, verifiable snapshot and only moves forward; a
corrupt byte is detected and named; retention keeps what readers may need and removes MANIFEST
before anything else; a manifest cannot make a reader write outside its directory."""

from __future__ import annotations

import errno
import json
import re
import shutil
import tempfile
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from configs import TINY_CONFIG, load_config
from configs.sections import ModelConfig
import infra.manifest as manifest_module
from infra.manifest import (
    MANIFEST_FORMAT,
    MANIFEST_NAME,
    ManifestError,
    build_manifest,
    commit_directory,
    fetch_directory,
    numbered_directories,
    read_manifest,
    verify_local_dir,
)
from infra.modelfactory import build_model, build_tokenizer, load_model, load_tokenizer
from infra.storage import RunStore, open_run_store
from tasks.generator import snapshot_dir_for_engines
from tests.conftest import s3_requests
from tasks.snapshots import (
    PINS,
    SnapshotConflict,
    SnapshotMissing,
    apply_retention,
    latest_version,
    load_snapshot,
    pin_snapshot,
    pinned_versions,
    publish_snapshot,
    publish_snapshot_dir,
    snapshot_prefix,
    snapshot_versions,
    unpin_snapshot,
    withdraw_after,
)

TINY = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture
def model(tokenizer):
    return build_model(TINY, len(tokenizer), seed=0).eval()


def fake_snapshot(tmp_path: Path, version: int) -> Path:
    """A small directory standing in for an HF model dir (retention does not look inside)."""
    directory = tmp_path / f"fake-{version}"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"version": version}))
    (directory / "model.safetensors").write_bytes(bytes([version]) * 100)
    return directory


def test_snapshot_round_trip_gives_identical_logits(store, tmp_path, model, tokenizer) -> None:
    assert latest_version(store) is None
    assert publish_snapshot(store, model, tokenizer, version=0) == 0
    assert latest_version(store) == 0
    assert snapshot_versions(store) == [0]
    local = load_snapshot(store, tmp_path / "cache")
    assert local == tmp_path / "cache" / "v00000000"
    manifest = verify_local_dir(local)
    assert manifest["format"] == MANIFEST_FORMAT and manifest["extra"] == {"version": 0}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(manifest["files"])
    assert {p.name for p in local.iterdir()} == set(manifest["files"]) | {"MANIFEST.json"}
    input_ids = torch.tensor([tokenizer.encode("Q 3 7 + 4 5")])
    with torch.no_grad():
        expected = model(input_ids).logits
        assert torch.equal(load_model(local).eval()(input_ids).logits, expected)
        plain = AutoModelForCausalLM.from_pretrained(local).eval()
        assert torch.equal(plain(input_ids).logits, expected)
    assert load_tokenizer(local).encode("Q 3 7 + 4 5") == tokenizer.encode("Q 3 7 + 4 5")


def test_a_snapshot_is_written_back_in_the_checkpoints_dtype(file_store, tmp_path, model, tokenizer) -> None:
    """The trainer's float32 weights are published in the dtype the initial checkpoint is stored
    in: tensors and config.json's dtype, with the tied embeddings and head still one tensor."""
    publish_snapshot(file_store, model, tokenizer, version=1, dtype=torch.bfloat16)
    local = load_snapshot(file_store, tmp_path / "cache")
    assert json.loads((local / "config.json").read_text())["dtype"] == "bfloat16"
    served = load_model(local)
    assert served.dtype == torch.bfloat16 and model.dtype == torch.float32, "the trainer's copy is not cast"
    for name, weight in model.state_dict().items():
        assert torch.equal(served.state_dict()[name], weight.to(torch.bfloat16)), name
    with safe_open(local / "model.safetensors", "pt") as saved, tempfile.TemporaryDirectory() as plain:
        model.save_pretrained(plain)
        with safe_open(Path(plain) / "model.safetensors", "pt") as as_is:
            assert set(saved.keys()) == set(as_is.keys()), "the tied head is saved once, as the model saves it"


def test_weights_the_model_class_keeps_in_float32_stay_float32(file_store, tmp_path, model, tokenizer) -> None:
    """As a load in bfloat16 leaves them: matched as transformers does, by dotted name parts."""
    model._keep_in_fp32_modules_strict = ["mlp.down_proj"]
    publish_snapshot(file_store, model, tokenizer, version=1, dtype=torch.bfloat16)
    with safe_open(load_snapshot(file_store, tmp_path / "cache") / "model.safetensors", "pt") as saved:
        dtypes = {name: saved.get_tensor(name).dtype for name in saved.keys()}
    assert {d for name, d in dtypes.items() if "mlp.down_proj" in name} == {torch.float32}
    assert {d for name, d in dtypes.items() if "mlp.down_proj" not in name} == {torch.bfloat16}


def test_publishing_on_file_links_the_staged_files_and_leaves_no_staging(file_store, tmp_path, model, tokenizer,
                                                                         monkeypatch) -> None:  # fmt: skip
    """The snapshot is saved once, in the run's own staging area, and linked into place: a copy
    would write every snapshot twice (1.1 s of a 453 MB one)."""

    def no_copy(*args, **kwargs):
        raise AssertionError("a staged snapshot file was copied")

    monkeypatch.setattr(file_store.fs, "put_file", no_copy)
    publish_snapshot(file_store, model, tokenizer, version=0)
    assert not any(file_store.staging_dir().iterdir())
    assert (file_store.local_path(snapshot_prefix(0)) / "model.safetensors").stat().st_nlink == 1, "no staging link left"
    local = load_snapshot(file_store, tmp_path / "cache", 0)
    assert verify_local_dir(local)["extra"] == {"version": 0}


@pytest.mark.s3
def test_a_snapshot_staged_off_the_store_is_staged_where_a_killed_trainers_leftovers_are_swept(
    s3_store, tmp_path, model, tokenizer, monkeypatch
) -> None:
    """On S3 the files are written to a local directory first: a trainer killed mid-upload (the
    OOM killer, SIGKILL) left a whole model there for good. It is a `tandem-*` scratch directory
    naming its owner now, which the next scratch directory made on the machine empties."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    staged, upload = set(), s3_store.upload
    monkeypatch.setattr(s3_store, "upload", lambda local, key, **kwargs: (staged.add((local.parent, (local.parent / ".owner").exists())),
                                                                          upload(local, key, **kwargs))[1])  # fmt: skip
    publish_snapshot(s3_store, model, tokenizer, version=0)
    [(staging, owned)] = staged
    assert staging.parent == tmp_path and staging.name.startswith("tandem-snapshot-") and owned
    assert not staging.exists(), "removed once committed"


def test_a_fetch_on_file_links_the_committed_files_and_keeps_them_when_the_store_drops_them(
    file_store, tmp_path, model, tokenizer
) -> None:
    """On one filesystem a generator's fetch links the snapshot's files instead of copying them
    (a second copy of every version's bytes on the same disk); the fetched directory still
    verifies after retention deletes that version from the store."""
    publish_snapshot(file_store, model, tokenizer, version=1)
    publish_snapshot(file_store, model, tokenizer, version=2)
    local = load_snapshot(file_store, tmp_path / "cache", 1)
    stored = file_store.local_path(snapshot_prefix(1)) / "model.safetensors"
    assert (local / "model.safetensors").stat().st_ino == stored.stat().st_ino
    assert apply_retention(file_store, keep_last=1, keep_every=1000) == [1]
    assert not stored.exists() and verify_local_dir(local)["extra"] == {"version": 1}


def test_a_fetch_across_filesystems_copies(file_store, model, tokenizer) -> None:
    """Where a link cannot be made (the cache on another filesystem) the files are copied."""
    publish_snapshot(file_store, model, tokenizer, version=0)
    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == file_store.local_path(snapshot_prefix(0)).stat().st_dev:
        pytest.skip("needs /dev/shm on a filesystem of its own")
    with tempfile.TemporaryDirectory(dir=shm) as cache:
        local = load_snapshot(file_store, Path(cache), 0)
        assert (local / "model.safetensors").stat().st_nlink == 1 and verify_local_dir(local)["extra"] == {"version": 0}


def test_a_fetch_without_weights_gives_a_verified_tokenizer_and_no_weights(store, tmp_path, model, tokenizer) -> None:
    """What a Dask worker fetches for its tokenizer: every Dask worker fetched and hashed the
    whole v0 (28 GB of a 14B model) for it. Each file it does fetch is verified as ever, and no
    manifest is left to pass the copy off as a whole snapshot."""
    model.save_pretrained(tmp_path / "v0")
    tokenizer.save_pretrained(tmp_path / "v0")
    (tmp_path / "v0" / "pytorch_model.bin").write_bytes(b"weights too")  # model.path committed whole: a hub download's
    publish_snapshot_dir(store, tmp_path / "v0", version=0)
    local = load_snapshot(store, tmp_path / "cache", 0, weights=False)
    assert not list(local.glob("*.safetensors")) and not (local / "pytorch_model.bin").exists()
    assert not (local / MANIFEST_NAME).exists() and (local / "config.json").exists()
    assert load_tokenizer(local).get_vocab() == tokenizer.get_vocab()
    store.write_atomic(f"{snapshot_prefix(0)}/tokenizer.json", b"{}")
    with pytest.raises(ManifestError, match="tokenizer.json"):
        load_snapshot(store, tmp_path / "again", 0, weights=False)


def test_a_fetch_needs_free_space_only_where_it_copies(store, tmp_path, model, tokenizer, monkeypatch) -> None:
    """A full disk stops a fetch that would copy the snapshot (s3://) before it writes anything,
    naming the bytes it needs; a fetch that links the files (file://, the cache on the store's
    filesystem) takes no space, and goes on."""
    publish_snapshot(store, model, tokenizer, version=0)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(total=10**12, used=10**12, free=0))
    if store.protocol == "file":
        assert verify_local_dir(load_snapshot(store, tmp_path / "cache", 0))["extra"] == {"version": 0}
    else:
        with pytest.raises(OSError, match=r"needs \d+ bytes, 0 are free") as caught:
            load_snapshot(store, tmp_path / "cache", 0)
        assert caught.value.errno == errno.ENOSPC and not isinstance(caught.value, ManifestError), "the disk's, not the snapshot's"
        assert not any((tmp_path / "cache").iterdir())


def test_flipped_byte_is_detected_and_named(store, tmp_path, model, tokenizer) -> None:
    publish_snapshot(store, model, tokenizer, version=1)
    cached = load_snapshot(store, tmp_path / "cache", version=1)
    # A corrupted local copy is not reused: the next load fetches a fresh, verified one. (Written
    # as a new file: on file:// the fetched one is a link to the store's, as it is for reading.)
    data = bytearray((cached / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (cached / "model.safetensors").unlink()
    (cached / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(ManifestError, match="model.safetensors: sha256"):
        verify_local_dir(cached)
    assert verify_local_dir(load_snapshot(store, tmp_path / "cache", version=1))
    # A corrupted object in storage is refused, and nothing is left at the target directory.
    key = f"{snapshot_prefix(1)}/model.safetensors"
    store.write_atomic(key, bytes(data))
    with pytest.raises(ManifestError, match="model.safetensors: sha256"):
        load_snapshot(store, tmp_path / "fresh", version=1)
    assert not (tmp_path / "fresh" / "v00000001").exists()
    assert [p.name for p in (tmp_path / "fresh").iterdir()] == []


def test_failed_upload_leaves_latest_unchanged(store, tmp_path, model, tokenizer, monkeypatch) -> None:
    publish_snapshot(store, model, tokenizer, version=0)
    real_upload = store.upload
    uploads = []

    def upload_then_die(local: Path, key: str, take: bool = False) -> None:
        if len(uploads) == 2:
            raise OSError("writer killed mid-snapshot")
        uploads.append(key)
        real_upload(local, key, take=take)

    monkeypatch.setattr(store, "upload", upload_then_die)
    with pytest.raises(OSError, match="killed"):
        publish_snapshot(store, model, tokenizer, version=1)
    assert store.list_recursive(snapshot_prefix(1)), "some files were uploaded"
    assert latest_version(store) == 0
    assert snapshot_versions(store) == [0]
    with pytest.raises(ManifestError, match="MANIFEST.json: missing"):
        load_snapshot(store, tmp_path / "cache", version=1)

    def refuse_commit(key: str, data: bytes) -> bool:
        raise OSError("no commit")

    monkeypatch.setattr(store, "put_if_absent", refuse_commit)
    monkeypatch.setattr(store, "upload", real_upload)
    with pytest.raises(OSError, match="no commit"):
        publish_snapshot(store, model, tokenizer, version=1)
    assert latest_version(store) == 0 and snapshot_versions(store) == [0]

    monkeypatch.undo()
    assert publish_snapshot(store, model, tokenizer, version=1) == 1  # the retry commits
    assert latest_version(store) == 1
    assert verify_local_dir(load_snapshot(store, tmp_path / "cache"))["extra"] == {"version": 1}


def test_latest_only_moves_forward(store, tmp_path, model, tokenizer, monkeypatch) -> None:
    publish_snapshot(store, model, tokenizer, version=2)
    publish_snapshot(store, model, tokenizer, version=1)
    assert latest_version(store) == 2
    assert snapshot_versions(store) == [1, 2]
    uploads = []
    monkeypatch.setattr(store, "upload", lambda local, key: uploads.append(key))
    assert publish_snapshot(store, model, tokenizer, version=2) == 2  # a retried publish
    assert uploads == [], "a committed snapshot is never rewritten"
    assert latest_version(store) == 2
    with pytest.raises(ValueError):
        publish_snapshot(store, model, tokenizer, version=-1)


def test_concurrent_reader_only_sees_complete_snapshots(store, tmp_path, model, tokenizer) -> None:
    versions = range(1, 7)
    done = threading.Event()
    seen: list[int] = []
    errors: list[BaseException] = []

    def reader() -> None:
        try:
            while True:
                finished = done.is_set()  # read before LATEST: the last pass sees the last version
                version = latest_version(store)
                if version is not None:
                    local = load_snapshot(store, tmp_path / "reader", version)
                    assert verify_local_dir(local)["extra"] == {"version": version}
                    seen.append(version)
                if finished:
                    return
        except BaseException as err:  # noqa: BLE001 - reported by the main thread
            errors.append(err)

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for version in versions:
            with torch.no_grad():
                model.lm_head.weight[0, 0] = float(version)  # every version has other bytes
            publish_snapshot(store, model, tokenizer, version)
    finally:
        done.set()
        thread.join(timeout=120)
    assert not errors, errors
    assert seen and seen == sorted(seen), "LATEST moved backwards"
    assert seen[-1] == versions[-1]


def test_retention_keeps_last_every_latest_and_pinned(store, tmp_path, monkeypatch) -> None:
    for version in range(13):
        publish_snapshot_dir(store, fake_snapshot(tmp_path, version), version)
    pin_snapshot(store, "gen0", 2)
    deletions: list[str] = []
    real_delete = store.delete
    monkeypatch.setattr(store, "delete", lambda key: (deletions.append(key), real_delete(key)))
    deleted = apply_retention(store, keep_last=3, keep_every=5, pinned=(7,))
    assert deleted == [1, 3, 4, 6, 8, 9]
    assert snapshot_versions(store) == [0, 2, 5, 7, 10, 11, 12]
    for version in deleted:
        prefix = snapshot_prefix(version)
        # (SeaweedFS keeps an empty directory entry, which list_recursive reports as the prefix.)
        assert not [key for key in store.list_recursive(prefix) if key.startswith(prefix + "/")]
        mine = [key for key in deletions if key.startswith(prefix + "/")]
        assert mine[0] == f"{prefix}/MANIFEST.json", f"{prefix}: MANIFEST must go first, got {mine}"
    assert latest_version(store) == 12

    unpin_snapshot(store, "gen0")
    assert apply_retention(store, keep_last=3, keep_every=5) == [2, 7]


def test_a_lapsed_pin_keeps_its_version_no_longer_and_is_removed(store, tmp_path, caplog) -> None:
    """The trainer pins each version marked for evaluation for a triggered run that may never
    start: without a lapse, every such version of a long run stayed in storage for good."""
    for version in range(5):
        publish_snapshot_dir(store, fake_snapshot(tmp_path, version), version)
    pin_snapshot(store, "gen0", 1)
    pin_snapshot(store, "eval-v2", 2, lapse_seconds=3600)
    pin_snapshot(store, "eval-v3", 3, lapse_seconds=-1)
    assert pinned_versions(store) == {1, 2}
    assert apply_retention(store, keep_last=1, keep_every=100) == [3]
    assert snapshot_versions(store) == [0, 1, 2, 4]
    assert sorted(store.list(PINS)) == [f"{PINS}/eval-v2.json", f"{PINS}/gen0.json"], "the lapsed pin file is removed"
    assert f"{PINS}/eval-v3.json" in caplog.text


def test_a_lapsed_pin_written_afresh_before_retention_deletes_it_is_kept(store, tmp_path, monkeypatch) -> None:
    """An evaluation starting pins its version again under the same name: retention, which read
    the old pin as lapsed a moment before, must not delete the new one."""
    import tasks.snapshots as snapshots

    for version in range(3):
        publish_snapshot_dir(store, fake_snapshot(tmp_path, version), version)
    pin_snapshot(store, "eval-v1", 1, lapse_seconds=-1)
    read_pins = snapshots._read_pins

    def read_then_repinned(store):
        found = read_pins(store)
        pin_snapshot(store, "eval-v1", 1, lapse_seconds=3600)  # the evaluation's own pin, just after the read
        return found

    monkeypatch.setattr(snapshots, "_read_pins", read_then_repinned)
    apply_retention(store, keep_last=1, keep_every=100)
    assert store.list(PINS) == [f"{PINS}/eval-v1.json"]


@pytest.mark.parametrize("pin", [b"{not json", b'{"version": 1, "lapses_at": "tomorrow"}'], ids=["json", "lapses_at"])
def test_a_pin_file_that_does_not_parse_keeps_every_snapshot_and_is_named(store, tmp_path, caplog, pin) -> None:
    """Retention runs inside the trainer's step: a damaged pin must not fail it, nor let it delete
    what the pin's unknown consumer may be reading."""
    for version in range(4):
        publish_snapshot_dir(store, fake_snapshot(tmp_path, version), version)
    store.write_atomic(f"{PINS}/gen0.json", pin)
    assert apply_retention(store, keep_last=1, keep_every=100) == []
    assert snapshot_versions(store) == [0, 1, 2, 3]
    assert f"{PINS}/gen0.json" in caplog.text
    store.delete(f"{PINS}/gen0.json")
    assert apply_retention(store, keep_last=1, keep_every=100) == [1, 2]


def test_retention_never_deletes_latest(store, tmp_path) -> None:
    publish_snapshot_dir(store, fake_snapshot(tmp_path, 1), 1)
    # Committed by a trainer that died before moving LATEST: newer than LATEST.
    for version in (2, 3):
        assert commit_directory(store, fake_snapshot(tmp_path, version), snapshot_prefix(version))
    assert latest_version(store) == 1
    assert apply_retention(store, keep_last=1, keep_every=100) == [2]
    assert snapshot_versions(store) == [1, 3]


def test_retention_deletes_the_files_of_a_retirement_cut_short_but_not_a_publish_under_way(store, tmp_path) -> None:
    """A retirement deletes the manifest first, then the files: a trainer killed in between left
    a whole snapshot's files that no later retention saw, since they had no manifest."""
    for version in range(4):
        publish_snapshot_dir(store, fake_snapshot(tmp_path, version), version)
    store.delete(f"{snapshot_prefix(1)}/{MANIFEST_NAME}")  # v1's retirement, cut short
    store.write_atomic(f"{snapshot_prefix(4)}/model.safetensors", b"v4, being published")
    assert apply_retention(store, keep_last=10, keep_every=100) == []
    assert not store.list_recursive(snapshot_prefix(1))
    assert store.list_recursive(snapshot_prefix(4)) == [f"{snapshot_prefix(4)}/model.safetensors"]
    assert snapshot_versions(store) == [0, 2, 3]


def test_withdrawing_after_a_checkpoint_moves_latest_back_and_deletes_the_later_snapshots(store, tmp_path) -> None:
    """A trainer resumed from step 1 publishes v2 and v3 again, with other weights: the dead
    trainer's v2 and v3 go, a pinned one too, manifest first, and LATEST names v1 again."""
    for version in range(4):
        publish_snapshot_dir(store, fake_snapshot(tmp_path, version), version)
    pin_snapshot(store, "gen0", 3)
    assert withdraw_after(store, 3) == [] and latest_version(store) == 3, "nothing after the newest: nothing moves"
    assert withdraw_after(store, 1) == [2, 3]
    assert snapshot_versions(store) == [0, 1] and latest_version(store) == 1
    assert not [key for key in store.list_recursive(snapshot_prefix(3)) if key.startswith(snapshot_prefix(3) + "/")]
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    publish_snapshot_dir(store, fake_snapshot(resumed, 2), 2)
    assert latest_version(store) == 2, "the resumed trainer's v2 moves LATEST forward as any publish does"



def test_withdrawing_moves_latest_off_a_snapshot_a_killed_recommit_deleted(store, tmp_path) -> None:
    """A trainer killed inside recommit_snapshot (the damaged v2 deleted, not yet published again)
    left LATEST naming v2 with nothing after its checkpoint's v1: LATEST stayed on the missing
    v2, no publish of v2's successors below it moved it, and the generators stayed on v1."""
    for version in range(3):
        publish_snapshot_dir(store, fake_snapshot(tmp_path, version), version)
    store.delete(f"{snapshot_prefix(2)}/{MANIFEST_NAME}")
    store.delete_prefix(snapshot_prefix(2))
    assert withdraw_after(store, 1) == [] and latest_version(store) == 1
    store.write_atomic("weights/LATEST", b"not json")  # damaged: written anew, not a failed restart
    assert withdraw_after(store, 1) == [] and latest_version(store) == 1


def test_a_version_committed_with_other_weights_is_a_conflict_not_a_retried_publish(store, tmp_path) -> None:
    """Publishing a committed version again was taken as a retry whatever the files: a trainer
    whose version another trainer of the run had published went on, and the generators served the
    other trainer's weights under its version."""
    first = fake_snapshot(tmp_path, 1)
    publish_snapshot_dir(store, first, 1)
    (retry := tmp_path / "retry").mkdir()
    retried = fake_snapshot(retry, 1)
    (retried / "config.json").write_text(json.dumps({"version": 1, "transformers_version": "a later one"}))
    publish_snapshot_dir(store, retried, 1)  # the same weights: a retried publish, on an upgraded image maybe
    (other := tmp_path / "other").mkdir()
    with pytest.raises(SnapshotConflict, match="v1 is committed already with other weights"):
        publish_snapshot_dir(store, fake_snapshot(other, 2), 1)
    assert read_manifest(store, snapshot_prefix(1))["files"] == build_manifest(first)["files"], "left as it was"

def test_a_snapshot_retired_while_it_is_fetched_is_a_manifest_error(file_store, tmp_path, monkeypatch) -> None:
    """On file:// the fetch looks at the snapshot's directory after reading its manifest: one that
    retention deleted in between raised a bare FileNotFoundError, which the generator does not
    take for a snapshot gone (ManifestError: read LATEST again) and failed on."""
    publish_snapshot_dir(file_store, fake_snapshot(tmp_path, 1), 1)
    parse = manifest_module.parse_manifest

    def retired_meanwhile(data: bytes) -> dict:
        shutil.rmtree(file_store.local_path(snapshot_prefix(1)))
        return parse(data)

    monkeypatch.setattr(manifest_module, "parse_manifest", retired_meanwhile)
    with pytest.raises(ManifestError, match="deleted while it was fetched"):
        fetch_directory(file_store, snapshot_prefix(1), tmp_path / "cache" / "v1")


def test_withdrawing_back_to_a_version_not_kept_is_refused(store, tmp_path) -> None:
    for version in (0, 2):
        publish_snapshot_dir(store, fake_snapshot(tmp_path, version), version)
    with pytest.raises(SnapshotMissing, match="v1"):
        withdraw_after(store, 1)
    assert snapshot_versions(store) == [0, 2] and latest_version(store) == 2, "LATEST never names a missing snapshot"


@pytest.mark.parametrize("name", ["../x", "/tmp/x", "sub/../../x", "a\\..\\x", ".hidden", "", "a//b"])
def test_manifest_with_unsafe_name_is_refused(store: RunStore, tmp_path, name) -> None:
    manifest = {"format": MANIFEST_FORMAT, "files": {name: {"size": 1, "sha256": "0" * 64}}}
    store.put_if_absent("weights/v00000009/MANIFEST.json", json.dumps(manifest).encode())
    store.write_atomic("weights/v00000009/x", b"x")
    with pytest.raises(ManifestError, match="not a plain relative file name"):
        fetch_directory(store, "weights/v00000009", tmp_path / "reader" / "cache" / "v9")
    assert not (tmp_path / "reader").exists() and not (tmp_path / "x").exists()


@pytest.mark.s3
def test_a_weight_sync_on_s3_sends_the_commit_protocol_and_nothing_more(s3_store, tmp_path, model, tokenizer) -> None:
    """Publish: one listing (committed already? a killed attempt's leftovers?), the files, the
    manifest, LATEST read and written. Fetch: one listing (every size), the manifest, the files.
    Each round trip is milliseconds on loopback and tens of them on a remote bucket."""
    publish_snapshot(s3_store, model, tokenizer, version=0)
    with s3_requests(s3_store) as publish:
        publish_snapshot(s3_store, model, tokenizer, version=1)
    files = len(s3_store.list_recursive(snapshot_prefix(1))) - 1
    assert publish == ["ListObjectsV2"] + ["PutObject"] * (files + 1) + ["GetObject", "PutObject"]
    with s3_requests(s3_store) as fetch:
        load_snapshot(s3_store, tmp_path / "cache", version=1)
    assert fetch == ["ListObjectsV2", "GetObject"] + ["GetObject"] * files


def test_numbered_directories_groups_each_directorys_files_and_skips_the_rest(store: RunStore) -> None:
    for key in ("top/v00000001/MANIFEST.json", "top/v00000001/model.safetensors", "top/v00000002/sub/part.bin",
                "top/LATEST", "top/v3/a.bin", "top/v00000004x/a.bin", "top/.staging/v00000005/a.bin", "other/v00000006/a.bin"):
        store.write_atomic(key, b"x")
    found = numbered_directories(store, "top", re.compile(r"v(\d{8})"))
    assert found == {1: {"MANIFEST.json", "model.safetensors"}, 2: {"sub/part.bin"}}


def test_a_retried_commit_removes_what_the_killed_attempt_left(store: RunStore, tmp_path) -> None:
    local = tmp_path / "d"
    local.mkdir()
    (local / "a.bin").write_bytes(b"new")
    store.write_atomic("d/a.bin", b"half of a killed attempt's")
    store.write_atomic("d/shard-2.bin", b"a file this attempt does not write")
    assert commit_directory(store, local, "d") is True
    assert store.list_recursive("d") == ["d/MANIFEST.json", "d/a.bin"]
    assert fetch_directory(store, "d", tmp_path / "fetched")["files"].keys() == {"a.bin"}
    assert commit_directory(store, local, "d") is False  # committed: nothing is written again


def test_manifest_checks_shape_and_sizes_before_downloading(store: RunStore, tmp_path) -> None:
    entry = {"size": 2**50, "sha256": "0" * 64}
    huge = {"format": MANIFEST_FORMAT, "files": {"model.safetensors": entry}}
    store.put_if_absent("a/MANIFEST.json", json.dumps(huge).encode())
    with pytest.raises(ManifestError, match="invalid size"):
        fetch_directory(store, "a", tmp_path / "a")
    store.put_if_absent("b/MANIFEST.json", b"{not json")
    with pytest.raises(ManifestError, match="not JSON"):
        fetch_directory(store, "b", tmp_path / "b")
    lying = {"format": MANIFEST_FORMAT, "files": {"x.bin": {"size": 3, "sha256": "0" * 64}}}
    store.put_if_absent("c/MANIFEST.json", json.dumps(lying).encode())
    store.write_atomic("c/x.bin", b"much longer than three bytes")
    with pytest.raises(ManifestError, match="x.bin: size"):
        fetch_directory(store, "c", tmp_path / "c")
    with pytest.raises(ManifestError, match="MANIFEST.json: missing"):
        verify_local_dir(tmp_path)


def test_nested_names_round_trip_and_unlisted_files_are_ignored(store: RunStore, tmp_path) -> None:
    source = tmp_path / "source"
    (source / "original").mkdir(parents=True)
    (source / "original" / "params.json").write_text("{}")
    (source / "config.json").write_text('{"a": 1}')
    (source / ".write.tmp").write_text("a temporary: not part of the directory")
    assert set(build_manifest(source)["files"]) == {"config.json", "original/params.json"}
    assert commit_directory(store, source, "d", extra={"note": "nested"})
    assert not commit_directory(store, source, "d")
    local = tmp_path / "fetched"
    assert fetch_directory(store, "d", local)["extra"] == {"note": "nested"}
    assert (local / "original" / "params.json").read_text() == "{}"
    assert not (local / ".write.tmp").exists()
    (local / "unlisted.txt").write_text("ignored")
    verify_local_dir(local)
    (local / "config.json").unlink()
    with pytest.raises(ManifestError, match="config.json: listed in the manifest but missing"):
        verify_local_dir(local)


def test_engines_start_on_the_newest_snapshot_that_verifies(model, tokenizer, tmp_path: Path):
    """A snapshot damaged after its commit (benchmarks/faults.py truncates one) is passed over for
    the one before it, instead of failing the generator that starts on it."""
    config = load_config(TINY_CONFIG, [f"storage.root=file://{tmp_path / 'runs'}"])
    store = open_run_store(config.storage, config.run_id)
    for version in (0, 1):
        publish_snapshot(store, model, tokenizer, version)
    damaged = store.local_path("weights/v00000001/model.safetensors")
    damaged.write_bytes(damaged.read_bytes()[:1000])
    model_dir, version = snapshot_dir_for_engines(config, tmp_path / "cache", "gen0")
    assert version == 0 and (model_dir / "model.safetensors").exists()



def test_engines_start_on_a_pinned_snapshot_and_one_retired_while_fetched_sends_them_to_latest(
    model, tokenizer, tmp_path: Path, monkeypatch, caplog
):
    """A generator joining mid-run fetched LATEST unpinned: a few publishes retired it meanwhile,
    the missing files were reported as damage and the engines started on an older version."""
    import tasks.generator
    from tasks.snapshots import _delete_snapshot, pinned_versions

    config = load_config(TINY_CONFIG, [f"storage.root=file://{tmp_path / 'runs'}"])
    store = open_run_store(config.storage, config.run_id)
    for version in (0, 1):
        publish_snapshot(store, model, tokenizer, version)
    fetch = tasks.generator.load_snapshot

    def retired_midway(store_, cache, version):
        if version == 1:  # the trainer publishes v2 and a retention pass begun before the pin retires v1
            publish_snapshot(store, model, tokenizer, 2)
            _delete_snapshot(store, 1)
        return fetch(store_, cache, version)

    monkeypatch.setattr(tasks.generator, "load_snapshot", retired_midway)
    model_dir, version = snapshot_dir_for_engines(config, tmp_path / "cache", "gen0")
    assert version == 2 and (model_dir / "model.safetensors").exists()
    assert "failed verification" not in caplog.text, "a retired snapshot is not damage"
    assert pinned_versions(store) == {2}, "the engines' version is pinned for the generator"

def test_an_evaluation_of_a_version_not_kept_names_it_and_leaves_no_pin(tmp_path: Path):
    from flows.evaluation import evaluation
    from tasks.rundir import initialize_run
    from tasks.snapshots import SnapshotMissing, pinned_versions

    config = load_config(TINY_CONFIG, [f"storage.root=file://{tmp_path}", "run_id=evalpin", "training.warmup_steps=0"])
    store = initialize_run(config)
    with pytest.raises(SnapshotMissing, match="no snapshot v7 under .*kept: v0"):
        evaluation.fn(config, version=7)
    assert pinned_versions(store) == set() and not store.list("weights/pins")


def test_model_path_is_needed_only_until_v0_exists(tmp_path: Path):
    """`retrain --param new_run_id=...` starts a run from a fetched snapshot in a directory it then
    removes; continuing that run must not ask for the directory again."""
    from configs import ConfigError
    from tasks.rundir import initialize_run
    from tests.conftest import committed_model_dir

    model = committed_model_dir(tmp_path / "model", seed=0)
    overrides = [f"storage.root=file://{tmp_path}/runs", f"model.path={model}", "training.warmup_steps=0"]
    initialize_run(load_config(TINY_CONFIG, [*overrides, "run_id=successor"]))
    shutil.rmtree(model)
    store = initialize_run(load_config(TINY_CONFIG, [*overrides, "run_id=successor"]))
    assert snapshot_versions(store) == [0]
    with pytest.raises(ConfigError, match="is not an HF model directory"):
        initialize_run(load_config(TINY_CONFIG, [*overrides, "run_id=fresh"]))


def test_a_v0_committed_without_its_latest_gets_it_when_the_run_starts_again(tmp_path: Path):
    """A failure between v0's commit and LATEST's write left LATEST missing for good: every
    later start saw v0 and skipped publishing, and generators had no snapshot to start on."""
    from tasks.rundir import initialize_run
    from tasks.snapshots import LATEST_KEY, latest_version

    config = load_config(TINY_CONFIG, [f"storage.root=file://{tmp_path}", "run_id=nolatest", "training.warmup_steps=0"])
    store = initialize_run(config)
    store.delete(LATEST_KEY)
    assert latest_version(initialize_run(config)) == 0 and snapshot_versions(store) == [0]


def test_a_run_started_with_credentials_in_its_config_continues_with_them_from_elsewhere(tmp_path: Path):
    """config.json records storage.key and .secret masked and a continued run reads them from
    its environment or a Secret block: they are how it reaches the run, not what it trains."""
    from tasks.rundir import check_recorded_config, initialize_run

    first = load_config(TINY_CONFIG, [f"storage.root=file://{tmp_path}", "run_id=creds", "training.warmup_steps=0",
                                      "storage.key=k", "storage.secret=s"])  # fmt: skip
    store = initialize_run(first)
    for reach in ([], ["storage.credentials_block=s3-creds"]):
        check_recorded_config(store, load_config(TINY_CONFIG, [f"storage.root=file://{tmp_path}", "run_id=creds",
                                                               "training.warmup_steps=0", *reach]))  # fmt: skip
