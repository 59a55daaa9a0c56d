"""RunStore against real backends: commit primitives, listing, retries, and the local S3 server."""

from __future__ import annotations

import contextvars
import errno
import gc
import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiohttp
import fsspec
import pytest
from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError

from configs.sections import StorageConfig
from infra import credentials
from infra.s3 import rejection_reason
from infra.seaweed import SeaweedServer, free_s3_port
from infra.storage import RunStore, StorageRejected, StorageUnavailable, open_run_store
from tests.conftest import s3_requests, s3_storage_config


def test_put_if_absent_creates_once(store: RunStore):
    assert store.put_if_absent("a/b.json", b"first") is True
    assert store.put_if_absent("a/b.json", b"second") is False
    assert store.read_bytes("a/b.json") == b"first"


def test_write_atomic_replaces(store: RunStore):
    store.write_atomic("LATEST", b'{"version": 1}')
    store.write_atomic("LATEST", b'{"version": 2}')
    assert store.read_bytes("LATEST") == b'{"version": 2}'
    assert store.list("") == ["LATEST"]


def test_concurrent_put_if_absent_has_exactly_one_winner(store: RunStore):
    with ThreadPoolExecutor(8) as pool:
        wins = list(pool.map(lambda i: store.put_if_absent("claim", str(i).encode()), range(16)))
    assert wins.count(True) == 1
    assert store.read_bytes("claim") == str(wins.index(True)).encode()


def test_listing_is_sorted_and_relative(store: RunStore):
    for name in ["v2/b", "v1/a", "v1/c"]:
        store.write_atomic(f"rollouts/{name}", b"x")
    assert store.list("rollouts") == ["rollouts/v1", "rollouts/v2"]
    assert store.list("rollouts/v1") == ["rollouts/v1/a", "rollouts/v1/c"]
    assert store.list_recursive("rollouts") == ["rollouts/v1/a", "rollouts/v1/c", "rollouts/v2/b"]
    assert store.list("nothing/here") == []
    assert not store.exists("rollouts/v3/a")


def test_delete_prefix_removes_everything_below(store: RunStore):
    for name in ["w/v1/a", "w/v1/b", "w/v1/x[1]", "w/v1/q*", "w/v2/a"]:  # names, not glob patterns
        store.write_atomic(name, b"x")
    store.delete_prefix("w/v1")
    assert store.list_recursive("w") == ["w/v2/a"]
    store.delete("w/v2/a")
    store.delete("w/v2/a")  # deleting twice is not an error
    assert store.list_recursive("") == []


def test_sizes_lists_every_object_below_a_prefix(store: RunStore):
    store.write_atomic("w/v1/a", b"x")
    store.write_atomic("w/v1/sub/b", b"yz")
    store.write_atomic("w/v10/c", b"not below w/v1")
    assert store.sizes("w/v1") == {"w/v1/a": 1, "w/v1/sub/b": 2}
    assert store.sizes("w/v2") == {}


@pytest.mark.s3
def test_a_read_an_existence_check_a_listing_and_a_prefix_delete_are_one_request_each(seaweed: SeaweedServer):
    """What a generator's poll, a commit, the trainer's poll of the rollouts and retention send:
    one round trip each, whether or not the object is there (s3fs's defaults send two or three),
    and nothing for a bucket already seen (every rollout group opens the store)."""
    config = s3_storage_config(seaweed)
    s3_store = open_run_store(config, "run-test")
    for name in ["w/v1/a", "w/v1/b", "w/v1/c"]:
        s3_store.write_atomic(name, b"x")
    with s3_requests(s3_store) as sent:
        assert s3_store.read_bytes("w/v1/a") == b"x"
        assert s3_store.exists("w/v1/a") and not s3_store.exists("w/v1/absent")
        assert s3_store.sizes("w/v2") == {} and s3_store.list("w/v2") == [] and s3_store.list("w") == ["w/v1"]
        s3_store.delete_prefix("w/v1")
        open_run_store(config, "another-run")  # the bucket is known to exist by now
    assert sent == ["GetObject", "HeadObject", "HeadObject"] + ["ListObjectsV2"] * 4 + ["DeleteObjects"]
    assert s3_store.list_recursive("w") == []


def test_missing_key_raises_file_not_found_without_retrying(store: RunStore):
    started = time.monotonic()
    with pytest.raises(FileNotFoundError):
        store.read_bytes("absent")
    assert time.monotonic() - started < store.retry_seconds


def test_upload_and_download_round_trip(store: RunStore, tmp_path: Path):
    source = tmp_path / "blob.bin"
    source.write_bytes(os.urandom(3_000_000))
    store.upload(source, "weights/v00000000/model.safetensors")
    copy = tmp_path / "copy" / "model.safetensors"
    store.download("weights/v00000000/model.safetensors", copy)
    assert copy.read_bytes() == source.read_bytes()


def test_a_taken_staging_file_is_linked_and_a_kept_file_copied(file_store: RunStore):
    """On file://, upload(take=True) moves a staging file in by hard link (no second write of a
    snapshot); a file the caller keeps is copied, so that writing into it later changes nothing."""
    staging = file_store.staging_dir()
    assert staging is not None and file_store.list("") == []  # the staging area is never listed
    taken, kept = staging / "taken.bin", staging / "kept.bin"
    taken.write_bytes(b"snapshot bytes")
    kept.write_bytes(b"user bytes")
    file_store.upload(taken, "weights/v1/model.safetensors", take=True)
    file_store.upload(kept, "weights/v0/model.safetensors")
    assert os.path.samefile(taken, file_store.path("weights/v1/model.safetensors"))
    kept.write_bytes(b"changed by the user")
    assert file_store.read_bytes("weights/v0/model.safetensors") == b"user bytes"
    file_store.clear_staging(owned=())
    assert not staging.exists() and file_store.read_bytes("weights/v1/model.safetensors") == b"snapshot bytes"


def test_a_taken_file_that_cannot_replace_its_target_leaves_no_hidden_link(file_store: RunStore):
    """The link is made under a hidden name, then moved over the target: a move that fails (a
    directory stands at the target) must not leave that hidden link, which no listing shows."""
    staging = file_store.staging_dir()
    (staging / "taken.bin").write_bytes(b"snapshot bytes")
    (Path(file_store.path("weights/v1/model.safetensors")) / "inside").mkdir(parents=True)
    with pytest.raises(OSError):
        file_store.upload(staging / "taken.bin", "weights/v1/model.safetensors", take=True)
    assert sorted(p.name for p in Path(file_store.path("weights/v1")).iterdir()) == ["model.safetensors"]


@pytest.mark.s3
def test_the_multipart_uploads_a_killed_trainer_left_are_aborted_as_the_next_one_starts(seaweed: SeaweedServer):
    """A trainer killed mid-publish left a snapshot's worth of parts no listing shows and the bucket
    kept: the next trainer's start aborts the run's incomplete uploads, and no other run's."""
    config = s3_storage_config(seaweed)
    store, other = open_run_store(config, "run-a"), open_run_store(config, "run-b")
    bucket = store.base.partition("/")[0]

    def start_upload(run: RunStore, key: str) -> None:
        object_key = run.path(key).partition("/")[2]
        upload = run.fs.call_s3("create_multipart_upload", Bucket=bucket, Key=object_key)
        run.fs.call_s3("upload_part", Bucket=bucket, Key=object_key, UploadId=upload["UploadId"], PartNumber=1, Body=b"x" * 1024)

    def pending(run: RunStore) -> list[str]:
        answer = run.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=run.path("").partition("/")[2] + "/")
        return [upload["Key"] for upload in answer.get("Uploads", [])]

    start_upload(store, "weights/v00000003/model.safetensors")
    start_upload(store, "checkpoints/step-00000002/optimizer.pt")
    start_upload(store, "metrics/generator-gen0.jsonl")  # a live generator's: not the trainer's to abort
    start_upload(other, "weights/v00000001/model.safetensors")
    assert store.list_recursive("") == [], "the parts are in no listing"
    owned = ("weights", "checkpoints")
    assert sorted(store.clear_staging(owned)) == ["checkpoints/step-00000002/optimizer.pt", "weights/v00000003/model.safetensors"]
    assert pending(store) == [store.path("metrics/generator-gen0.jsonl").partition("/")[2]] and len(pending(other)) == 1
    assert store.clear_staging(owned) == []

@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs a second filesystem (tmpfs at /dev/shm)")
def test_a_taken_file_on_another_filesystem_is_copied(file_store: RunStore):
    with tempfile.TemporaryDirectory(dir="/dev/shm") as other:
        source = Path(other) / "snapshot.bin"
        source.write_bytes(b"bytes from tmpfs")
        file_store.upload(source, "weights/v1/model.safetensors", take=True)
        assert file_store.read_bytes("weights/v1/model.safetensors") == b"bytes from tmpfs"
        assert not os.path.samefile(source, file_store.path("weights/v1/model.safetensors"))


def test_file_store_hides_temporaries_of_unfinished_writes(file_store: RunStore):
    file_store.write_atomic("rollouts/v1/a.parquet", b"done")
    Path(file_store.path("rollouts/v1/.b.parquet.1234.tmp")).write_bytes(b"half")
    assert file_store.list("rollouts/v1") == ["rollouts/v1/a.parquet"]
    assert file_store.list_recursive("rollouts") == ["rollouts/v1/a.parquet"]


def test_a_prefix_deleted_on_file_takes_killed_writers_temporaries_with_it(file_store: RunStore):
    """A hidden temporary a killed writer left is never listed, so deleting a prefix left it, and
    with it the directory and, for a retired snapshot's hard link, the weights' bytes. One being
    written (recent) is left to its writer."""
    file_store.write_atomic("weights/v00000001/model.safetensors", b"weights")
    stale, fresh = (Path(file_store.path(f"weights/v0000000{v}/.model.safetensors.1234.tmp")) for v in (1, 2))
    for temporary in (stale, fresh):
        temporary.parent.mkdir(parents=True, exist_ok=True)
        temporary.write_bytes(b"half")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    file_store.delete_prefix("weights/v00000001")
    file_store.delete_prefix("weights/v00000002")
    assert not stale.parent.exists() and fresh.exists()


def test_memory_store_has_the_same_primitives():
    store = open_run_store(StorageConfig(root="memory://unit"), f"run-{os.getpid()}-{time.time_ns()}")
    assert store.put_if_absent("k", b"1") and not store.put_if_absent("k", b"2")
    store.write_atomic("k", b"3")
    assert store.read_bytes("k") == b"3" and store.list("") == ["k"]


def test_file_root_is_resolved_to_an_absolute_url(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    store = open_run_store(StorageConfig(root="file://./runs"), "r1")
    assert store.url == f"file://{tmp_path}/runs/r1"


def test_put_if_absent_does_not_fsync_but_write_atomic_does(file_store: RunStore, monkeypatch):
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or real_fsync(fd))
    assert file_store.put_if_absent("rollouts/v1/a.parquet", b"checked by content on read")
    assert synced == []
    file_store.write_atomic("weights/LATEST", b'{"version": 1}')
    assert len(synced) == 1


def _client_error(code: str, status: int) -> ClientError:
    response = {"Error": {"Code": code, "Message": f"{code} message"},
                "ResponseMetadata": {"HTTPStatusCode": status}}  # fmt: skip
    return ClientError(response, "PutObject")


def _translated(code: str, status: int, errno_: int) -> OSError:
    """An OSError caused by a ClientError, as s3fs raises them."""
    err = OSError(errno_, f"{code} message")
    err.__cause__ = _client_error(code, status)
    return err


@pytest.mark.parametrize(
    ("err", "permanent"),
    [
        (_translated("InvalidBucketName", 400, errno.EINVAL), True),
        (_client_error("NoSuchBucket", 404), True),
        (_client_error("AccessDenied", 403), True),
        (_client_error("InvalidAccessKeyId", 403), True),
        (_client_error("SignatureDoesNotMatch", 403), True),
        (_client_error("SomethingNew", 400), True),
        (OSError(errno.EINVAL, "The specified bucket is not valid."), True),
        (NoCredentialsError(), True),
        (_translated("SlowDown", 503, errno.EBUSY), False),
        (_client_error("InternalError", 500), False),
        (_client_error("ServiceUnavailable", 503), False),
        (_client_error("RequestTimeout", 400), False),  # S3 sends this code with a 400
        (_client_error("BadDigest", 400), False),  # a body damaged on its way
        (_client_error("XAmzContentSHA256Mismatch", 400), False),
        (_client_error("IncompleteBody", 400), False),
        (_client_error("TooManyRequests", 429), False),
        (_client_error("Whatever", 408), False),
        (_client_error("Whatever", 502), False),
        (EndpointConnectionError(endpoint_url="http://127.0.0.1:1"), False),
        (ConnectionRefusedError(errno.ECONNREFUSED, "refused"), False),
        (TimeoutError("timed out"), False),
        (OSError(errno.EIO, "unexpected end of stream"), False),
    ],
)
def test_rejection_reason_separates_hopeless_errors_from_transient_ones(err, permanent):
    assert (rejection_reason(err) is not None) is permanent


@pytest.mark.timing
def test_rejected_requests_fail_at_once_and_throttling_is_retried():
    store = RunStore(fsspec.filesystem("memory"), "/retry-test", "memory://retry-test", 0.6)
    calls = []

    def fail(err: BaseException):
        calls.append(err)
        raise err

    started = time.monotonic()
    with pytest.raises(StorageRejected, match="memory://retry-test.*InvalidBucketName") as caught:
        store._retry(fail, _translated("InvalidBucketName", 400, errno.EINVAL))
    assert len(calls) == 1 and time.monotonic() - started < 0.5
    assert isinstance(caught.value, OSError) and caught.value.errno == errno.EINVAL
    calls.clear()
    with pytest.raises(StorageUnavailable):
        store._retry(fail, _translated("SlowDown", 503, errno.EBUSY))
    assert len(calls) > 1


@pytest.mark.parametrize("cut_off", [
    aiohttp.ClientPayloadError("Response payload is not completed"), aiohttp.ServerDisconnectedError(),
    http.client.IncompleteRead(b"partial"),
], ids=["payload", "disconnected", "incomplete read"])  # fmt: skip
def test_a_response_cut_off_mid_body_is_retried(cut_off):
    """s3fs passes these through as they are, none an OSError: one truncated shard read failed
    the trainer's admit at once."""
    store = RunStore(fsspec.filesystem("memory"), "/retry-test", "memory://retry-test", 5.0)
    answers = [cut_off]

    def read():
        if answers:
            raise answers.pop()
        return b"whole"

    assert store._retry(read) == b"whole" and not answers


def test_a_full_or_read_only_local_disk_fails_at_once():
    store = RunStore(fsspec.filesystem("memory"), "/retry-test", "memory://retry-test", 5.0)
    for code in (errno.ENOSPC, errno.EROFS):
        calls = []

        def write():
            calls.append(1)
            raise OSError(code, os.strerror(code))

        with pytest.raises(OSError) as caught:
            store._retry(write)
        assert caught.value.errno == code and not isinstance(caught.value, StorageUnavailable) and len(calls) == 1


def test_a_long_call_that_fails_late_is_still_retried():
    """The retry budget runs from the first failure: a transfer longer than retry_seconds that
    fails near its end was given up on at once."""
    store = RunStore(fsspec.filesystem("memory"), "/retry-test", "memory://retry-test", 0.3)
    attempts = []

    def long_transfer():
        attempts.append(time.monotonic())
        if len(attempts) == 1:
            time.sleep(0.5)
            raise ConnectionResetError(errno.ECONNRESET, "reset by peer")
        return b"done"

    assert store._retry(long_transfer) == b"done" and len(attempts) == 2


@pytest.mark.s3
def test_invalid_bucket_name_fails_at_once_with_a_clear_error(seaweed: SeaweedServer):
    config = s3_storage_config(seaweed, root="s3://Not_A_Valid..Bucket/runs", retry_seconds=20.0)
    started = time.monotonic()
    with pytest.raises(StorageRejected) as caught:
        store = open_run_store(config, "r1")
        store.write_atomic("x", b"1")
    assert time.monotonic() - started < 3
    message = str(caught.value)
    assert "s3://Not_A_Valid..Bucket/runs/r1" in message
    assert "InvalidBucketName" in message and "not valid" in message
    assert "tandem-test-secret" not in message


@pytest.mark.s3
def test_a_missing_bucket_is_storage_unavailable_not_an_empty_run(s3_store: RunStore):
    """s3fs raises NoSuchBucket as FileNotFoundError, a missing key's error: a restarted SeaweedFS
    answers so before it has loaded its buckets, and the run looked empty (no checkpoint: the
    pipeline withdrew every snapshot after v0)."""
    s3_store.write_atomic("weights/v00000001/MANIFEST.json", b"{}")
    gone = RunStore(s3_store.fs, "tandem-no-such-bucket/runs/r1", "s3://tandem-no-such-bucket/runs/r1", retry_seconds=0.5)
    reads = [(lambda store: store.list("weights"), ["weights/v00000001"]),
             (lambda store: store.sizes("weights"), {"weights/v00000001/MANIFEST.json": 2}),
             (lambda store: store.read_bytes("weights/v00000001/MANIFEST.json"), b"{}")]  # fmt: skip
    for read, found in reads:
        assert read(s3_store) == found
        with pytest.raises(StorageUnavailable, match="failed for 0s: .*bucket"):
            read(gone)
    with pytest.raises(FileNotFoundError):
        s3_store.read_bytes("weights/v00000002/MANIFEST.json")


@pytest.mark.s3
@pytest.mark.slow
def test_refused_access_fails_at_once_naming_the_store_and_the_settings(tmp_path: Path):
    """s3fs raises a wrong secret and AccessDenied as a bare PermissionError, which the store
    raised as it was: no URL, no hint, and past the CLI's storage errors as a traceback."""
    identities = {"identities": [
        {"name": "admin", "credentials": [{"accessKey": "admin", "secretKey": "right"}], "actions": ["Admin", "Read", "Write", "List"]},
        {"name": "reader", "credentials": [{"accessKey": "reader", "secretKey": "right"}], "actions": ["Read", "List"]},
    ]}  # fmt: skip
    (tmp_path / "s3.json").write_text(json.dumps(identities))
    with SeaweedServer(tmp_path / "data", free_s3_port(), s3_config=tmp_path / "s3.json") as server:
        config = s3_storage_config(server, key="admin", secret="right", retry_seconds=20.0)
        open_run_store(config, "r1").write_atomic("x", b"1")
        cases = [  # a wrong secret, where the bucket is to be made; credentials that may not write
            (s3_storage_config(server, key="admin", secret="wrong", retry_seconds=20.0), lambda store: None),
            (s3_storage_config(server, root=config.root, key="reader", secret="right", retry_seconds=20.0),
             lambda store: store.write_atomic("y", b"2")),
        ]  # fmt: skip
        for refused, call in cases:
            started = time.monotonic()
            with pytest.raises(StorageRejected) as caught:
                call(open_run_store(refused, "r1"))
            assert time.monotonic() - started < 5, "not retried for storage.retry_seconds"
            message = str(caught.value)
            assert caught.value.errno == errno.EACCES and f"{refused.root}/r1" in message
            assert "storage.key and storage.secret" in message and "wrong" not in message and "right" not in message


@pytest.mark.s3
def test_s3_bucket_is_created_on_open(seaweed: SeaweedServer):
    config = s3_storage_config(seaweed)
    store = open_run_store(config, "r1")
    store.write_atomic("x", b"1")
    bucket = config.root.removeprefix("s3://").split("/")[0]
    fs = fsspec.filesystem("s3", key="k", secret="s", endpoint_url=seaweed.endpoint_url, skip_instance_cache=True)
    assert fs.cat_file(f"{bucket}/runs/r1/x") == b"1"


@pytest.mark.s3
@pytest.mark.slow
def test_a_server_takes_writes_to_more_buckets_than_its_disk_has_gib(tmp_path: Path):
    """Every bucket takes a SeaweedFS volume of its own. Left to size its volume count by itself
    (free disk / 1 GiB here), `weed mini` refused every write to the 67th bucket on a 67 GiB
    disk with InternalError, which failed the test suite late in a run."""
    buckets = 120
    with SeaweedServer(tmp_path / "sw", free_s3_port()) as server:
        for index in range(buckets):
            config = s3_storage_config(server, root=f"s3://many-{index}/runs", retry_seconds=5.0)
            open_run_store(config, "r").write_atomic("k", b"v")
        assert open_run_store(s3_storage_config(server, root="s3://many-0/runs"), "r").read_bytes("k") == b"v"


@pytest.mark.s3
@pytest.mark.slow
def test_outage_longer_than_retry_budget_fails_clearly_without_leaking_credentials(tmp_path: Path):
    server = SeaweedServer(tmp_path / "sw", free_s3_port()).start()
    config = s3_storage_config(server, key="AKIALEAKCHECK", secret="leak-check-secret", retry_seconds=2.0)
    store = open_run_store(config, "r1")
    store.write_atomic("x", b"1")
    server.stop()
    started = time.monotonic()
    with pytest.raises(StorageUnavailable) as caught:
        store.read_bytes("x")
    assert time.monotonic() - started < 2.0 + 3, "the retry budget (2 s) bounds the wait, not the libraries' own retries"
    message = str(caught.value)
    assert store.url in message
    assert "AKIALEAKCHECK" not in message and "leak-check-secret" not in message


@pytest.mark.s3
@pytest.mark.slow
def test_reads_and_writes_survive_a_short_outage(tmp_path: Path):
    port = free_s3_port()
    server = SeaweedServer(tmp_path / "sw", port).start()
    store = open_run_store(s3_storage_config(server, retry_seconds=30.0), "r1")
    store.write_atomic("before", b"1")
    server.stop()
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(store.put_if_absent, "during", b"2")
        time.sleep(3)
        assert not pending.done()
        server = SeaweedServer(tmp_path / "sw", port).start()
        assert pending.result(timeout=60) is True
    try:
        assert store.read_bytes("before") == b"1" and store.read_bytes("during") == b"2"
    finally:
        server.stop()


@pytest.mark.s3
@pytest.mark.slow
def test_storage_up_serves_s3_and_stops_on_sigterm(tmp_path: Path):
    port = free_s3_port()
    env = os.environ | {"PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "storage", "up", "--dir", str(tmp_path / "d"), "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    try:
        first_line = proc.stdout.readline()
        assert f"http://127.0.0.1:{port}" in first_line
        fs = fsspec.filesystem("s3", key="k", secret="s", endpoint_url=f"http://127.0.0.1:{port}", skip_instance_cache=True)
        fs.mkdir("cli-bucket")
        fs.pipe_file("cli-bucket/x", b"hello")
        assert fs.cat_file("cli-bucket/x") == b"hello"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert "S3 server stopped" in proc.stdout.read()
        assert not SeaweedServer(tmp_path / "d", port).is_serving()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.s3
@pytest.mark.slow
def test_credentials_come_from_a_prefect_secret_block_when_named(seaweed, monkeypatch):
    """A deployed run names a Secret block instead of carrying credentials as parameters."""
    from prefect.blocks.system import Secret
    from prefect.testing.utilities import prefect_test_harness

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(credentials, "_block_reads", {})  # this test's reads, dropped after it
    with prefect_test_harness():
        Secret(value={"key": "block-key", "secret": "block-secret"}).save("tandem-s3")
        Secret(value={"key": "only-a-key"}).save("tandem-s3-incomplete")
        by_block = s3_storage_config(seaweed, key=None, secret=None, credentials_block="tandem-s3")
        store = open_run_store(by_block, "run-secret")
        store.write_atomic("probe.json", b"{}")
        assert store.read_bytes("probe.json") == b"{}"
        assert (store.fs.key, store.fs.secret) == ("block-key", "block-secret")

        def api_away(*args, **kwargs):
            raise ConnectionError("the Prefect server is restarting")

        load = Secret.load
        monkeypatch.setattr(Secret, "load", api_away)  # every rollout group opens the store: one read a while
        again = open_run_store(by_block, "run-secret")
        assert again.read_bytes("probe.json") == b"{}"
        monkeypatch.setattr(credentials, "BLOCK_READ_SECONDS", 0.0)  # due for a read, which fails: the last good one holds
        assert open_run_store(by_block, "run-secret").fs.key == "block-key"
        monkeypatch.setattr(Secret, "load", load)
        Secret(value={"key": "rotated-key", "secret": "rotated-secret"}).save("tandem-s3", overwrite=True)
        rotated = open_run_store(by_block, "run-secret")
        assert rotated.fs.key == "rotated-key", "a rotated secret reaches a running process"
        with pytest.raises(ValueError, match="tandem-s3-incomplete.*must hold"):
            open_run_store(s3_storage_config(seaweed, key=None, secret=None, credentials_block="tandem-s3-incomplete"), "run-secret")


@pytest.mark.s3
def test_processes_opening_a_new_bucket_at_once_all_get_it(seaweed: SeaweedServer):
    """Each sees no bucket, each creates it: the ones that lose the race must not fail (generator
    workers open their store per group, all at once after a storage restart)."""
    config = s3_storage_config(seaweed, root="s3://raced-bucket/runs")
    with ThreadPoolExecutor(8) as pool:
        stores = list(pool.map(lambda i: open_run_store(config, f"run{i}"), range(8)))
    stores[0].write_atomic("k", b"v")
    assert stores[0].read_bytes("k") == b"v"


CALLER = contextvars.ContextVar("caller")


def test_a_storage_call_keeps_nothing_of_its_callers_context(store):
    """s3fs runs a call on fsspec's IO-loop thread, where timers (aiohttp's keep-alive) outlive
    it holding a copy of the context it was made in. A Prefect task run's context holds its
    parameters, the trainer's tensors among them, and that daemon thread freed them at
    interpreter exit: the process aborted after a finished run. Nothing the caller's context
    holds may outlive the call."""

    class Payload:
        pass

    payload = Payload()
    alive = weakref.ref(payload)
    token = CALLER.set(payload)
    store.write_atomic("context/key", b"x")
    assert store.read_bytes("context/key") == b"x" and store.list("context") == ["context/key"]
    CALLER.reset(token)
    del payload
    gc.collect()
    assert alive() is None
