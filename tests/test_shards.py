"""Rollout shards on real backends (file:// and SeaweedFS): round trip, idempotent commits, killed
writers, corrupted and out-of-range shards going to quarantine, version windows, storage outage."""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from configs.sections import StorageConfig
from infra.seaweed import SeaweedServer, free_s3_port
from infra.storage import RunStore, open_run_store
from tasks.shards import (
    CONTENT_DIGEST_KEY,
    MAX_VERSION,
    ROLLOUT_SCHEMA,
    SCHEMA_VERSION,
    SCHEMA_VERSION_KEY,
    Rollout,
    ShardError,
    content_digest,
    decode_shard,
    encode_shard,
    list_shards,
    quarantine_shard,
    read_shard,
    read_valid_shards,
    rollouts_to_table,
    shard_key,
    table_to_rollouts,
    validate_table,
    write_shard,
)
from tests.conftest import s3_storage_config

ROOT = Path(__file__).resolve().parents[1]


def make_rollouts(
    n: int = 4, version: int = 1, producer: str = "gen0", completion_len: int = 6, seed: int = 0
) -> list[Rollout]:
    """Valid rollouts: model tokens (mask 1, logprob < 0) and env tokens (mask 0, logprob 0.0)."""
    rng = random.Random(seed)
    rollouts = []
    for i in range(n):
        mask = [1 if (t // 3) % 2 == 0 else 0 for t in range(completion_len)]
        rollouts.append(
            Rollout(
                prompt_ids=[rng.randrange(50) for _ in range(5)],
                completion_ids=[rng.randrange(50) for _ in range(completion_len)],
                loss_mask=mask,
                behavior_logprobs=[-rng.randrange(1, 64) / 16 if m else 0.0 for m in mask],
                reward=float(i % 2),
                group_id="g0",
                policy_version=version,
                env="calculator",
                turns=2,
                finish_reason="stop",
                producer=producer,
                started_at=1_700_000_000.125 + i,
                finished_at=1_700_000_001.5 + i,
                generate_seconds=0.25,
            )
        )
    return rollouts


def put_raw(store: RunStore, key: str, data: bytes) -> bytes:
    """Commit bytes without the writer's validation, as a buggy or hostile producer would."""
    assert store.put_if_absent(key, data)
    return data


def test_rollout_fields_are_the_schema_columns():
    assert [f.name for f in dataclasses.fields(Rollout)] == ROLLOUT_SCHEMA.names
    assert ROLLOUT_SCHEMA.metadata[SCHEMA_VERSION_KEY] == str(SCHEMA_VERSION).encode()


def test_round_trip(store: RunStore):
    rollouts = make_rollouts(version=3) + make_rollouts(version=4, seed=1)
    written = write_shard(store, rollouts, "gen0", 7)
    assert written.key == "rollouts/v00000003/gen0-000007.parquet" and written.created
    assert list_shards(store) == [written.key]
    table = read_shard(store, written.key, current_version=4)
    assert table_to_rollouts(table) == rollouts
    metadata = pq.ParquetFile(io.BytesIO(store.read_bytes(written.key))).metadata
    assert metadata.row_group(0).column(0).compression == "ZSTD"


@st.composite
def rollouts(draw) -> list[Rollout]:
    group = draw(st.text(max_size=8))

    def one(_) -> Rollout:
        mask = draw(st.lists(st.integers(0, 1), max_size=12))
        token, logprob = st.integers(0, 2**31 - 1), st.floats(-30, 0, width=32)
        return Rollout(
            prompt_ids=draw(st.lists(token, min_size=1, max_size=8)),
            completion_ids=draw(st.lists(token, min_size=len(mask), max_size=len(mask))),
            loss_mask=mask,
            behavior_logprobs=[draw(logprob) if m else 0.0 for m in mask],
            reward=draw(st.floats(-1e6, 1e6, width=32)),
            group_id=group,
            policy_version=draw(st.integers(0, MAX_VERSION)),
            env=draw(st.text(max_size=8)),
            turns=draw(st.integers(0, 100)),
            finish_reason=draw(st.sampled_from(["stop", "length", "abort"])),
            producer="gen0",
            started_at=draw(st.floats(0, 2e9)),
            finished_at=draw(st.floats(0, 2e9)),
            generate_seconds=draw(st.floats(0, 1e4, width=32)),
        )

    return [one(i) for i in range(draw(st.integers(1, 5)))]


@settings(max_examples=40, deadline=None)
@given(rollouts())
def test_any_valid_rollouts_survive_encoding(rows: list[Rollout]):
    key = shard_key(min(r.policy_version for r in rows), "gen0", 0)
    assert table_to_rollouts(decode_shard(encode_shard(rollouts_to_table(rows)), key)) == rows


def test_plain_pandas_reads_a_shard(store: RunStore):
    rollouts = make_rollouts()
    key = write_shard(store, rollouts, "gen0", 0).key
    local = store.local_path(key)
    frame = pd.read_parquet(local if local else io.BytesIO(store.read_bytes(key)))
    assert list(frame.columns) == ROLLOUT_SCHEMA.names
    assert [list(ids) for ids in frame["completion_ids"]] == [r.completion_ids for r in rollouts]
    assert frame["reward"].tolist() == [r.reward for r in rollouts]
    assert b"pandas" not in pq.ParquetFile(io.BytesIO(store.read_bytes(key))).metadata.metadata


def test_duplicate_write_is_idempotent(store: RunStore):
    first = write_shard(store, make_rollouts(), "gen0", 1)
    committed = store.read_bytes(first.key)
    again = write_shard(store, make_rollouts(), "gen0", 1)
    other_rows = write_shard(store, make_rollouts(seed=9), "gen0", 1)
    assert first.created and not again.created and not other_rows.created
    assert first.key == again.key == other_rows.key
    assert store.read_bytes(first.key) == committed
    assert list_shards(store) == [first.key]


def test_writer_rejects_bad_names_and_rows(file_store: RunStore):
    rollouts = make_rollouts()
    for producer in ["", "gen/0", "../x", "gen.0", "a" * 65]:
        with pytest.raises(ValueError, match="producer"):
            write_shard(file_store, make_rollouts(producer=producer), producer, 0)
    for seq in [-1, 1_000_000]:
        with pytest.raises(ValueError, match="seq"):
            write_shard(file_store, rollouts, "gen0", seq)
    with pytest.raises(ValueError, match="policy version"):
        write_shard(file_store, make_rollouts(version=MAX_VERSION + 1), "gen0", 0)
    with pytest.raises(ShardError, match="producer"):
        write_shard(file_store, rollouts, "gen1", 0)
    with pytest.raises(ShardError, match="no rows"):
        write_shard(file_store, [], "gen0", 0)
    assert list_shards(file_store) == []


def test_version_window_lists_only_shards_inside_it(store: RunStore):
    keys = {v: write_shard(store, make_rollouts(version=v), "gen0", v).key for v in range(6)}
    write_shard(store, make_rollouts(version=3, producer="gen-b"), "gen-b", 0)
    store.write_atomic("rollouts/v00000003/notes.txt", b"not a shard")
    store.write_atomic("rollouts/unrelated/gen0-000000.parquet", b"not a version prefix")
    assert list_shards(store, 2, 4) == [
        keys[2], "rollouts/v00000003/gen-b-000000.parquet", keys[3], keys[4]
    ]  # fmt: skip
    assert list_shards(store, 4) == [keys[4], keys[5]]
    assert list_shards(store, 6, 9) == []


def _flip_in_place(store: RunStore, key: str, offset: int, count: int = 8) -> None:
    data = bytearray(store.read_bytes(key))
    data[offset : offset + count] = bytes(b ^ 0xFF for b in data[offset : offset + count])
    local = store.local_path(key)
    if local:
        with open(local, "r+b") as handle:
            handle.seek(offset)
            handle.write(data[offset : offset + count])
    else:
        store.write_atomic(key, bytes(data))  # S3 objects cannot change in place: replace it


def _middle_of_column(data: bytes, column: str) -> int:
    chunk = next(
        chunk
        for chunk in map(pq.ParquetFile(io.BytesIO(data)).metadata.row_group(0).column, range(20))
        if chunk.path_in_schema.startswith(column)
    )
    assert chunk.total_compressed_size > 200, "the page must be big enough to hit its body"
    return chunk.data_page_offset + chunk.total_compressed_size // 2


def test_damaged_shards_are_quarantined_and_the_reader_goes_on(store: RunStore):
    good = [write_shard(store, make_rollouts(), "gen0", seq).key for seq in (0, 1)]
    big = make_rollouts(n=200, completion_len=64, producer="gen1")
    valid = encode_shard(rollouts_to_table(big))
    truncated = "rollouts/v00000001/gen1-000000.parquet"
    put_raw(store, truncated, valid[: len(valid) // 2])
    corrupted = "rollouts/v00000001/gen1-000001.parquet"
    put_raw(store, corrupted, valid)
    _flip_in_place(store, corrupted, _middle_of_column(valid, "completion_ids"))
    wrong_schema = "rollouts/v00000001/gen1-000002.parquet"
    sink = io.BytesIO()
    foreign = pa.table({"prompt": ["2 + 2"], "score": [1.0]})
    pq.write_table(foreign.replace_schema_metadata(ROLLOUT_SCHEMA.metadata), sink)
    put_raw(store, wrong_schema, sink.getvalue())
    originals = {key: store.read_bytes(key) for key in (truncated, corrupted, wrong_schema)}

    result = read_valid_shards(store, list_shards(store), current_version=5)

    assert list(result.tables) == good
    assert all(table.num_rows == 4 for table in result.tables.values())
    assert set(result.quarantined) == set(originals)
    assert "Parquet" in result.quarantined[truncated]
    assert "checksum" in result.quarantined[corrupted].lower()
    assert "missing ['prompt_ids'" in result.quarantined[wrong_schema]
    assert "unexpected ['prompt', 'score']" in result.quarantined[wrong_schema]
    for key, data in originals.items():
        assert not store.exists(key)
        assert store.read_bytes(f"quarantine/{key}") == data
        record = json.loads(store.read_bytes(f"quarantine/{key}.reason.json"))
        assert record["key"] == key and record["reason"] == result.quarantined[key]
        assert abs(record["quarantined_at"] - time.time()) < 120
    assert list_shards(store) == good
    assert not read_valid_shards(store, list_shards(store), current_version=5).quarantined


def test_a_shard_damaged_on_its_way_is_read_again_not_quarantined(store: RunStore, monkeypatch):
    """The digest catches bytes damaged in transit too: quarantining the bytes that came would
    replace the good object with their bad copy, and lose its group."""
    key = write_shard(store, make_rollouts(), "gen0", 0).key
    stored, read_bytes = store.read_bytes(key), store.read_bytes
    flipped = iter([stored[: len(stored) // 2]])
    monkeypatch.setattr(store, "read_bytes", lambda k, *args: next(flipped, None) or read_bytes(k, *args))
    result = read_valid_shards(store, [key], current_version=5)
    assert list(result.tables) == [key] and not result.quarantined
    assert read_bytes(key) == stored and not store.exists(f"quarantine/{key}")


def _break_loss_mask_length(rollouts):
    rollouts[1].loss_mask = rollouts[1].loss_mask[:-1]


def _nan_logprob(rollouts):
    rollouts[2].behavior_logprobs[0] = math.nan


def _positive_logprob(rollouts):
    rollouts[0].behavior_logprobs[1] = 0.5


def _loss_mask_value(rollouts):
    rollouts[3].loss_mask[0] = 2


def _negative_token(rollouts):
    rollouts[0].completion_ids[2] = -1


def _infinite_reward(rollouts):
    rollouts[1].reward = math.inf


def _future_version(rollouts):
    rollouts[2].policy_version = 9  # the trainer below is at version 5


@pytest.mark.parametrize(
    ("violation", "expected"),
    [
        (_break_loss_mask_length, "len(loss_mask) != len(completion_ids) in row 1"),
        (_nan_logprob, "behavior_logprobs must be finite: row 2"),
        (_positive_logprob, "behavior_logprobs must be <= 0"),
        (_loss_mask_value, "loss_mask must be 0 or 1: row 3"),
        (_negative_token, "completion_ids must be >= 0: row 0"),
        (_infinite_reward, "reward must be finite: row 1"),
        (_future_version, "policy_version is from the future"),
    ],
)
def test_out_of_range_values_are_quarantined(store: RunStore, violation, expected: str):
    good = write_shard(store, make_rollouts(), "gen0", 0).key
    rollouts = make_rollouts()
    violation(rollouts)
    if violation is not _future_version:  # the writer cannot know the trainer's version
        with pytest.raises(ShardError, match=re.escape(expected.split(":")[0])):
            write_shard(store, rollouts, "gen0", 1)
    bad = put_raw(store, shard_key(1, "gen0", 1), encode_shard(rollouts_to_table(rollouts)))

    result = read_valid_shards(store, list_shards(store), current_version=5)

    assert list(result.tables) == [good]
    assert list(result.quarantined) == [shard_key(1, "gen0", 1)]
    assert expected in result.quarantined[shard_key(1, "gen0", 1)]
    assert store.read_bytes(f"quarantine/{shard_key(1, 'gen0', 1)}") == bad


def test_a_row_may_fill_the_models_context_and_no_more():
    context = 256
    rollouts = make_rollouts(n=1)
    count = context - len(rollouts[0].prompt_ids)
    rollouts[0].completion_ids, rollouts[0].loss_mask = [1] * count, [0] * count
    rollouts[0].behavior_logprobs = [0.0] * count
    validate_table(rollouts_to_table(rollouts), context_length=context)
    rollouts[0].prompt_ids.append(1)
    with pytest.raises(ShardError, match=f"row 0 has {context + 1} tokens .* context of {context}"):
        validate_table(rollouts_to_table(rollouts), context_length=context)


def test_reader_checks_key_version_schema_version_and_vocabulary(store: RunStore):
    data = encode_shard(rollouts_to_table(make_rollouts(version=2)))
    put_raw(store, shard_key(1, "gen0", 0), data)
    with pytest.raises(ShardError, match="key says version 1, lowest policy_version is 2"):
        read_shard(store, shard_key(1, "gen0", 0))
    put_raw(store, shard_key(2, "gen1", 0), data)
    with pytest.raises(ShardError, match="producer does not match"):
        read_shard(store, shard_key(2, "gen1", 0))
    unversioned = io.BytesIO()
    table = rollouts_to_table(make_rollouts(version=2))
    pq.write_table(table.replace_schema_metadata(None), unversioned)
    put_raw(store, shard_key(2, "gen0", 1), unversioned.getvalue())
    with pytest.raises(ShardError, match="schema version None"):
        read_shard(store, shard_key(2, "gen0", 1))
    put_raw(store, shard_key(2, "gen0", 2), data)
    assert read_shard(store, shard_key(2, "gen0", 2), vocab_size=50).num_rows == 4
    with pytest.raises(ShardError, match="must be < vocab_size 10"):
        read_shard(store, shard_key(2, "gen0", 2), vocab_size=10)


def test_a_shard_whose_content_is_not_what_its_digest_says_is_refused_and_one_without_a_digest_read():
    """Page checksums do not cover page headers or the footer: a damage there can decode to other
    values (a review's fuzz read a prompt cut from 5 tokens to 2 back without an error)."""
    written, other = rollouts_to_table(make_rollouts(version=2)), rollouts_to_table(make_rollouts(version=2, seed=9))
    key = shard_key(2, "gen0", 0)
    assert decode_shard(encode_shard(written), key).equals(written)
    stamped = io.BytesIO()
    pq.write_table(other.replace_schema_metadata(ROLLOUT_SCHEMA.metadata | {CONTENT_DIGEST_KEY: content_digest(written).encode()}), stamped)
    with pytest.raises(ShardError, match="does not match the digest written with it"):
        decode_shard(stamped.getvalue(), key)
    older = io.BytesIO()  # from before the digest: read as before
    pq.write_table(other.replace_schema_metadata(ROLLOUT_SCHEMA.metadata), older)
    assert decode_shard(older.getvalue(), key).equals(other)


def test_the_content_digest_does_not_depend_on_chunks():
    table = rollouts_to_table(make_rollouts(version=2))
    rechunked = pa.concat_tables([table.slice(0, 1), table.slice(1)])
    assert content_digest(rechunked) == content_digest(table) != content_digest(table.slice(1))


def test_quarantine_finishes_after_an_interruption_and_never_overwrites(store: RunStore):
    key = shard_key(1, "gen0", 0)
    truncated = encode_shard(rollouts_to_table(make_rollouts()))[:100]
    put_raw(store, key, truncated)
    store.put_if_absent(f"quarantine/{key}", truncated)  # a previous reader died before its delete
    assert read_valid_shards(store, [key], current_version=5).quarantined.keys() == {key}
    assert not store.exists(key) and store.read_bytes(f"quarantine/{key}") == truncated
    assert store.exists(f"quarantine/{key}.reason.json")

    other = truncated[:50]  # the same key committed again later, with other bad bytes
    put_raw(store, key, other)
    assert read_valid_shards(store, [key], current_version=5).quarantined.keys() == {key}
    assert store.read_bytes(f"quarantine/{key}") == truncated
    copies = [k for k in store.list_recursive("quarantine") if not k.endswith(".reason.json")]
    assert len(copies) == 2 and {store.read_bytes(k) for k in copies} == {truncated, other}
    assert all(store.exists(f"{k}.reason.json") for k in copies)


CHILD_WRITER = """
import json, sys, time
sys.path.insert(0, {root!r})
from configs.sections import StorageConfig
from infra.storage import open_run_store
from tasks.shards import Rollout, rollouts_to_table, write_shard
import random
rng = random.Random(0)
store = open_run_store(StorageConfig(**json.loads(sys.argv[1])), "run-kill")
n = 64 * 8
rows = [Rollout([1] * 64, [rng.randrange(50000) for _ in range(n)], [1] * n,
                [-rng.random() for _ in range(n)], 1.0, "g0", 0, "calc", 1, "stop", "gen0",
                0.0, 1.0, 0.5) for i in range(600)]
table = rollouts_to_table(rows)
if len(sys.argv) > 2:  # freeze in the first file write of shard number argv[2] of this run
    run_dir, shard = str(store.local_path("")), f"gen0-{{int(sys.argv[2]):06d}}.parquet"
    def freeze_mid_write(frame, event, function):
        if event == "c_call" and getattr(function, "__name__", "") == "write":
            name = str(getattr(getattr(function, "__self__", None), "name", ""))
            if name.startswith(run_dir) and shard in name:
                print("writing", name, flush=True)
                time.sleep(600)
    sys.setprofile(freeze_mid_write)
print("ready", flush=True)
for seq in range(100000):
    write_shard(store, table, "gen0", seq)
"""


def _backend_fields(backend: str, tmp_path: Path, request) -> dict:
    if backend == "file":
        return {"root": f"file://{tmp_path}/runs"}
    config = s3_storage_config(request.getfixturevalue("seaweed"))
    secrets = {"key": config.key.get_secret_value(), "secret": config.secret.get_secret_value()}
    return config.model_dump(mode="json") | secrets


def _start_writer(fields: dict, *freeze_in_shard: str) -> subprocess.Popen:
    command = [sys.executable, "-c", CHILD_WRITER.format(root=str(ROOT)), json.dumps(fields)]
    command += freeze_in_shard
    child = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    if child.stdout.readline().strip() != "ready":
        child.kill()
        child.wait(30)
        pytest.fail("the writer process did not start")
    return child


def _kill(child: subprocess.Popen) -> None:
    os.kill(child.pid, signal.SIGKILL)
    child.wait(30)
    assert child.returncode == -signal.SIGKILL  # it was still writing shards


def _assert_only_complete_shards(store: RunStore) -> list[str]:
    keys = list_shards(store)
    result = read_valid_shards(store, keys, current_version=0, vocab_size=50000)
    assert result.quarantined == {}
    assert list(result.tables) == keys
    assert all(table.num_rows == 600 for table in result.tables.values())
    assert keys == [shard_key(0, "gen0", seq) for seq in range(len(keys))]
    return keys


@pytest.mark.parametrize("backend", ["file", pytest.param("s3", marks=pytest.mark.s3)])
def test_writer_killed_at_a_random_point_leaves_only_complete_shards(backend, tmp_path, request):
    fields = _backend_fields(backend, tmp_path, request)
    store = open_run_store(StorageConfig(**fields), "run-kill")
    child = _start_writer(fields)
    try:
        deadline = time.monotonic() + 60
        while not list_shards(store):  # then the kill lands among the later shards, not before all of them
            assert time.monotonic() < deadline, "the writer committed no shard"
            time.sleep(0.05)
        time.sleep(random.Random(request.node.name).uniform(0.1, 1.0))
    finally:
        _kill(child)
    assert _assert_only_complete_shards(store), "the kill left no shard to check"


def test_writer_killed_with_a_shard_file_open_leaves_no_visible_shard(tmp_path: Path):
    fields = {"root": f"file://{tmp_path}/runs"}
    store = open_run_store(StorageConfig(**fields), "run-kill")
    child = _start_writer(fields, "2")
    try:
        frozen_in = child.stdout.readline().split(" ", 1)[1].strip()
    finally:
        _kill(child)
    assert "gen0-000002.parquet" in Path(frozen_in).name  # frozen while writing the third shard
    assert _assert_only_complete_shards(store) == [shard_key(0, "gen0", seq) for seq in (0, 1)]


@pytest.mark.s3
@pytest.mark.slow
def test_shard_writes_survive_a_storage_outage(tmp_path: Path):
    port = free_s3_port()
    server = SeaweedServer(tmp_path / "sw", port).start()
    try:
        store = open_run_store(s3_storage_config(server, retry_seconds=30.0), "run-outage")
        results, errors = [], []

        def write_all() -> None:
            try:
                for seq in range(20):
                    results.append(write_shard(store, make_rollouts(version=seq % 3), "gen0", seq))
                    time.sleep(0.2)
            except Exception as err:  # reported by the assertion below
                errors.append(err)

        writer = threading.Thread(target=write_all, daemon=True)
        writer.start()
        deadline = time.monotonic() + 30
        while len(results) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        server.stop()
        committed_before_outage = len(results)
        time.sleep(5)
        server = SeaweedServer(tmp_path / "sw", port).start()
        writer.join(90)

        assert not writer.is_alive() and errors == []
        assert 3 <= committed_before_outage < 20
        expected = sorted(shard_key(seq % 3, "gen0", seq) for seq in range(20))
        assert sorted(write.key for write in results) == expected
        keys = list_shards(store)
        assert keys == expected
        result = read_valid_shards(store, keys, current_version=2)
        assert result.quarantined == {} and len(result.tables) == 20
    finally:
        server.stop()


def test_on_file_the_quarantined_copy_is_on_disk_before_the_shard_is_deleted(file_store: RunStore, monkeypatch):
    """Without the fsync, a power cut could keep the delete and the copy's link but not its bytes."""
    key = shard_key(1, "gen0", 0)
    data = put_raw(file_store, key, b"not parquet")
    synced: list[int] = []  # inodes
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.fstat(fd).st_ino) or real_fsync(fd))
    target = quarantine_shard(file_store, key, data, "not a readable Parquet file")
    assert file_store.local_path(target).stat().st_ino in synced and not file_store.exists(key)
