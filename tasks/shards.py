"""Rollout shards: Parquet files of trajectories that generation writes and training reads.

One row is one trajectory with the rollout record of docs/architecture.md (`Rollout`, `ROLLOUT_SCHEMA`);
one shard is one Parquet file at `rollouts/v{V:08d}/{producer}-{seq:06d}.parquet`, where V is the
lowest `policy_version` of its rows, so a reader finds the shards of a version window by listing
a few prefixes. The parts, and why they are built this way:

- Writing (`write_shard`): the table is validated, serialised in memory, and committed with one
  `RunStore.put_if_absent` of its final key. An object is either absent or complete: a writer
  killed mid-write leaves nothing a reader can list (S3 never shows an unfinished PUT; file://
  writes a hidden temporary and links it into place). Put-if-absent is also what makes writes
  idempotent: the key is determined by producer and seq, so a retried task that writes the same
  shard again finds it committed (`created=False`) and changes nothing. A producer must never
  reuse a seq for different rows.
- Parquet settings: zstd compression, and a CRC32 on every page (`write_page_checksum=True`),
  verified on read. The checksums cover the pages' data, not their headers or the footer, so the
  file's key-value metadata also holds a sha256 of the table's content (`content_digest`,
  `tandem.content_sha256`), checked on read: bytes flipped at rest or in transit are detected
  instead of trained on. The schema version lives there too (`tandem.schema_version`).
- Reading (`list_shards`, `read_shard`, `read_valid_shards`): a shard is accepted only if it
  parses with checksums verified, has exactly ROLLOUT_SCHEMA and SCHEMA_VERSION, and its values
  are in range (see `validate_table`). Reading runs no code: Parquet through pyarrow only, no
  pickle, no pandas metadata.
- Quarantine (`quarantine_shard`): a bad shard is moved to `quarantine/{key}` next to
  `quarantine/{key}.reason.json` and the reader goes on. The move never loses data (reason
  first, then a put-if-absent copy, then the delete) and can be repeated after an interruption.

behavior_logprobs holds one value per completion token: the engine's logprob for model tokens
(loss_mask 1) and 0.0 for environment tokens (loss_mask 0), which no loss term reads. Logprobs
must be <= 0 up to LOGPROB_TOLERANCE, which absorbs engines' float rounding of near-certain tokens.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from configs.fields import MAX_SLOTS
from infra.storage import RunStore

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
SCHEMA_VERSION_KEY = b"tandem.schema_version"
CONTENT_DIGEST_KEY = b"tandem.content_sha256"
LOGPROB_TOLERANCE = 1e-5
MAX_SEQ = MAX_SLOTS
MAX_VERSION = 99_999_999  # the 8 digits of v{V:08d}
LOSS_MASK_VALUES = pa.array([0, 1], pa.int8())
PRODUCER_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")
VERSION_PREFIX_PATTERN = re.compile(r"rollouts/v(\d{8})")
SHARD_KEY_PATTERN = re.compile(
    r"rollouts/v(?P<version>\d{8})/(?P<producer>[A-Za-z0-9_-]{1,64})-(?P<seq>\d{6})\.parquet"
)


def _list_of(value_type: pa.DataType) -> pa.DataType:
    return pa.list_(pa.field("element", value_type, nullable=False))


ROLLOUT_SCHEMA = pa.schema(
    [
        pa.field("prompt_ids", _list_of(pa.int32()), nullable=False),
        pa.field("completion_ids", _list_of(pa.int32()), nullable=False),
        pa.field("loss_mask", _list_of(pa.int8()), nullable=False),
        pa.field("behavior_logprobs", _list_of(pa.float32()), nullable=False),
        pa.field("reward", pa.float32(), nullable=False),
        pa.field("group_id", pa.string(), nullable=False),
        pa.field("policy_version", pa.int64(), nullable=False),
        pa.field("env", pa.string(), nullable=False),
        pa.field("turns", pa.int32(), nullable=False),
        pa.field("finish_reason", pa.string(), nullable=False),
        pa.field("producer", pa.string(), nullable=False),
        pa.field("started_at", pa.float64(), nullable=False),
        pa.field("finished_at", pa.float64(), nullable=False),
        pa.field("generate_seconds", pa.float32(), nullable=False),
    ],
    metadata={SCHEMA_VERSION_KEY: str(SCHEMA_VERSION).encode()},
)


@dataclass
class Rollout:
    """One trajectory as a producer fills it; the fields are ROLLOUT_SCHEMA's columns, in order."""

    prompt_ids: list[int]
    completion_ids: list[int]
    loss_mask: list[int]
    behavior_logprobs: list[float]
    reward: float
    group_id: str
    policy_version: int
    env: str
    turns: int
    finish_reason: str
    producer: str
    started_at: float
    finished_at: float
    generate_seconds: float


class ShardError(ValueError):
    """A shard that must not be trained on; `reason` says why."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class ShardName(NamedTuple):
    version: int
    producer: str
    seq: int


class ShardWrite(NamedTuple):
    key: str
    created: bool
    """False when the key was already committed (a retried write): nothing was written."""


@dataclass
class ValidShards:
    tables: dict[str, pa.Table] = field(default_factory=dict)
    """Key -> validated table, in the order the keys were given."""
    quarantined: dict[str, str] = field(default_factory=dict)
    """Key -> reason, for every shard moved to quarantine/."""


def rollouts_to_table(rollouts: Sequence[Rollout]) -> pa.Table:
    columns = {name: [getattr(r, name) for r in rollouts] for name in ROLLOUT_SCHEMA.names}
    return pa.Table.from_pydict(columns, schema=ROLLOUT_SCHEMA)


def table_to_rollouts(table: pa.Table) -> list[Rollout]:
    return [Rollout(**row) for row in table.to_pylist()]


def shard_key(version: int, producer: str, seq: int) -> str:
    if not PRODUCER_PATTERN.fullmatch(producer):
        raise ValueError(f"producer must be 1-64 letters, digits, '_' or '-', got {producer!r}")
    if not 0 <= seq <= MAX_SEQ:
        raise ValueError(f"seq must be in [0, {MAX_SEQ}], got {seq}")
    if not 0 <= version <= MAX_VERSION:
        raise ValueError(f"policy version must be in [0, {MAX_VERSION}], got {version}")
    return f"rollouts/v{version:08d}/{producer}-{seq:06d}.parquet"


def parse_shard_key(key: str) -> ShardName:
    match = SHARD_KEY_PATTERN.fullmatch(key)
    if not match:
        raise ShardError(f"{key!r} is not a shard key rollouts/vVVVVVVVV/PRODUCER-SEQ.parquet")
    return ShardName(int(match["version"]), match["producer"], int(match["seq"]))


def content_digest(table: pa.Table) -> str:
    """sha256 of what a shard's table holds, whatever the chunks and encodings Parquet gave it:
    column by column, each list's length and then the values (numbers little-endian, text as
    JSON). It goes in the file's metadata (`encode_shard`) and is checked on read, because the
    page checksums cover the pages' data and not their headers or the footer: in a fuzz of 20,000
    random corruptions of a shard, one was read back with a prompt cut from 5 tokens to 2."""
    digest = hashlib.sha256()
    for name in ROLLOUT_SCHEMA.names:
        column = table[name].combine_chunks()
        digest.update(name.encode())
        if pa.types.is_list(column.type):
            digest.update(pc.list_value_length(column).to_numpy().astype("<i8").tobytes())
            column = pc.list_flatten(column)
        if pa.types.is_string(column.type):
            digest.update(json.dumps(column.to_pylist()).encode())
        else:
            numbers = column.to_numpy(zero_copy_only=False)
            digest.update(numbers.astype(numbers.dtype.newbyteorder("<")).tobytes())
    return digest.hexdigest()


def encode_shard(table: pa.Table) -> bytes:
    """Parquet bytes of `table` (zstd, page checksums, schema version, content digest); no validation.

    No dictionary encoding: logprobs are nearly all distinct and token ids are spread over the
    vocabulary, so a dictionary only adds work and bytes (benchmarks/storage.py: a 64-trajectory
    shard encodes about 40% faster and comes out about 20% smaller without one)."""
    sink = pa.BufferOutputStream()
    stamped = table.replace_schema_metadata(ROLLOUT_SCHEMA.metadata | {CONTENT_DIGEST_KEY: content_digest(table).encode()})
    pq.write_table(
        stamped, sink, compression="zstd", write_page_checksum=True, use_dictionary=False
    )
    return sink.getvalue().to_pybytes()


def write_shard(
    store: RunStore, rollouts: Sequence[Rollout] | pa.Table, producer: str, seq: int, *, context_length: int | None = None
) -> ShardWrite:
    """Validate and commit one shard; a second write of the same producer/seq changes nothing."""
    table = rollouts if isinstance(rollouts, pa.Table) else rollouts_to_table(rollouts)
    validate_table(table, producer=producer, context_length=context_length)
    key = shard_key(pc.min(table["policy_version"]).as_py(), producer, seq)
    return ShardWrite(key, store.put_if_absent(key, encode_shard(table)))


def list_shards(store: RunStore, min_version: int = 0, max_version: int | None = None) -> list[str]:
    """Committed shard keys with min_version <= V <= max_version (None: no upper bound), sorted."""
    keys = []
    for prefix in store.list("rollouts"):
        match = VERSION_PREFIX_PATTERN.fullmatch(prefix)
        version = int(match[1]) if match else -1
        if min_version <= version and (max_version is None or version <= max_version):
            keys.extend(key for key in store.list(prefix) if SHARD_KEY_PATTERN.fullmatch(key))
    return keys


def committed_slots(store: RunStore) -> dict[int, str]:
    """Slot (seq) -> key of every group ever committed, in rollouts/ or moved to quarantine/
    (by its original key, as the ledger and the generators' records name it).

    A quarantined group was generated and is accounted for (as lost); only a slot with neither
    was never committed."""
    slots = {parse_shard_key(key).seq: key for key in list_shards(store)}
    for key in quarantined_keys(store):
        slots.setdefault(parse_shard_key(key).seq, key)
    return slots


def quarantined_keys(store: RunStore) -> set[str]:
    """The original keys of the shards moved to quarantine/, from one listing."""
    keys = set()
    for key in store.list_recursive("quarantine/rollouts"):
        match = SHARD_KEY_PATTERN.match(key.removeprefix("quarantine/"))
        if match and not key.endswith(".reason.json"):
            keys.add(match[0])
    return keys


def read_shard(
    store: RunStore, key: str, *, current_version: int | None = None, vocab_size: int | None = None,
    context_length: int | None = None,
) -> pa.Table:
    """The validated table of shard `key`; ShardError if it is bad."""
    data = store.read_bytes(key)
    return decode_shard(data, key, current_version=current_version, vocab_size=vocab_size, context_length=context_length)


def decode_shard(
    data: bytes, key: str, *, current_version: int | None = None, vocab_size: int | None = None,
    context_length: int | None = None, max_rows: int | None = None,
) -> pa.Table:
    """Parse and validate the bytes of shard `key`; ShardError if they are not a good shard."""
    name = parse_shard_key(key)
    try:
        parquet = pq.ParquetFile(pa.BufferReader(data), page_checksum_verification=True)
        table = parquet.read()
    except Exception as err:  # any failure to parse untrusted bytes makes the shard bad
        if isinstance(err, MemoryError) and not isinstance(err, pa.ArrowException):
            raise  # this machine's trouble, not the shard's (pyarrow's, a damaged header's size, is the shard's)
        raise ShardError(f"not a readable Parquet file: {type(err).__name__}: {err}") from err
    metadata = parquet.metadata.metadata or {}
    found = metadata.get(SCHEMA_VERSION_KEY)
    if found != ROLLOUT_SCHEMA.metadata[SCHEMA_VERSION_KEY]:
        raise ShardError(f"schema version {found!r} in the metadata, expected {SCHEMA_VERSION}")
    if not table.schema.equals(ROLLOUT_SCHEMA, check_metadata=False):
        raise ShardError(_schema_difference(table.schema))
    digest = metadata.get(CONTENT_DIGEST_KEY)  # shards written before it have none
    if digest is not None and digest != content_digest(table).encode():
        raise ShardError("its content does not match the digest written with it: damaged at rest or in transit")
    validate_table(
        table, producer=name.producer, current_version=current_version, vocab_size=vocab_size, context_length=context_length,
        max_rows=max_rows,
    )
    lowest = pc.min(table["policy_version"]).as_py()
    if lowest != name.version:
        raise ShardError(f"key says version {name.version}, lowest policy_version is {lowest}")
    return table


def validate_table(
    table: pa.Table,
    *,
    producer: str | None = None,
    current_version: int | None = None,
    vocab_size: int | None = None,
    context_length: int | None = None,
    max_rows: int | None = None,
) -> None:
    """Raise ShardError unless `table` has ROLLOUT_SCHEMA and every value is in range.

    With `context_length` (the model's), a row of more tokens (prompt + completion) is refused:
    every turn of an episode fits the engine's context, so a longer row came from no engine of
    this run, and one 10^6-token row would exhaust the trainer's memory. With `max_rows` (the
    run's generation.samples_per_prompt), so is a group of more episodes: its rows are padded
    into the step's one batch, and a shard that ran the trainer out of memory was admitted
    first again by every restart."""
    if not table.schema.equals(ROLLOUT_SCHEMA, check_metadata=False):
        raise ShardError(_schema_difference(table.schema))
    if table.num_rows == 0:
        raise ShardError("shard has no rows")
    if max_rows is not None and table.num_rows > max_rows:
        raise ShardError(f"a group is at most {max_rows} episodes (generation.samples_per_prompt), and this one has {table.num_rows}")
    groups = pc.unique(table["group_id"])
    if len(groups) > 1:  # the trainer records a group as trained, and drops its copies, by shard
        raise ShardError(f"a shard is one group, and this one holds {len(groups)}: {', '.join(map(str, groups.to_pylist()[:4]))}")
    row = _first_false(pc.greater(pc.list_value_length(table["prompt_ids"]), 0))
    if row >= 0:  # the trainer scores a completion's first token from the prompt's last position
        raise ShardError(f"prompt_ids is empty in row {row}")
    lengths = pc.list_value_length(table["completion_ids"])
    for name in ("loss_mask", "behavior_logprobs"):
        row = _first_false(pc.equal(pc.list_value_length(table[name]), lengths))
        if row >= 0:
            raise ShardError(f"len({name}) != len(completion_ids) in row {row}")
    if context_length is not None:
        tokens = pc.add(pc.list_value_length(table["prompt_ids"]), lengths)
        row = _first_false(pc.less_equal(tokens, context_length))
        if row >= 0:
            count = tokens[row].as_py()
            raise ShardError(f"row {row} has {count} tokens (prompt + completion), over the model's context of {context_length}")
    check = _range_checker(table)
    check("loss_mask", lambda v: pc.is_in(v, value_set=LOSS_MASK_VALUES), "must be 0 or 1")
    check("behavior_logprobs", pc.is_finite, "must be finite")
    check("behavior_logprobs", lambda v: pc.less_equal(v, LOGPROB_TOLERANCE), "must be <= 0")
    check("reward", pc.is_finite, "must be finite")
    check("turns", lambda v: pc.greater_equal(v, 0), "must be >= 0")
    check("policy_version", lambda v: pc.greater_equal(v, 0), "must be >= 0")
    if current_version is not None:
        check(
            "policy_version",
            lambda v: pc.less_equal(v, current_version),
            f"is from the future (trainer is at version {current_version})",
        )
    for name in ("prompt_ids", "completion_ids"):
        check(name, lambda v: pc.greater_equal(v, 0), "must be >= 0")
        if vocab_size is not None:
            check(name, lambda v: pc.less(v, vocab_size), f"must be < vocab_size {vocab_size}")
    if producer is not None:
        check("producer", lambda v: pc.equal(v, producer), f"does not match the key's {producer!r}")


def read_valid_shards(
    store: RunStore, keys: Iterable[str], current_version: int, *, vocab_size: int | None = None,
    context_length: int | None = None, max_rows: int | None = None,
) -> ValidShards:
    """Read every shard of `keys`; quarantine the bad ones (logged) and return the rest.

    A shard that fails is read again before it is quarantined: bytes damaged on their way here
    (the digest's reason to be) would otherwise replace a good object with their bad copy."""
    result = ValidShards()
    decode = functools.partial(
        decode_shard, current_version=current_version, vocab_size=vocab_size, context_length=context_length, max_rows=max_rows
    )
    for key in keys:
        try:
            data = store.read_bytes(key)
            try:
                result.tables[key] = decode(data, key)
                continue
            except ShardError as err:
                reason, stored = err.reason, store.read_bytes(key)
            if stored != data:
                result.tables[key] = decode(stored, key)
                log.warning("shard %s was damaged on its way here (%s); read again, it is good", key, reason)
                continue
        except FileNotFoundError:
            log.warning("shard %s disappeared before it was read; skipping it", key)
            continue
        except ShardError as err:  # what is kept is bad too
            reason = err.reason
        target = quarantine_shard(store, key, stored, reason)
        log.warning("quarantined shard %s to %s: %s", key, target, reason)
        result.quarantined[key] = reason
    return result


def quarantine_shard(store: RunStore, key: str, data: bytes, reason: str) -> str:
    """Move `key` (whose bytes are `data`) to quarantine/ with a reason file; return the new key.

    Order: the reason, then a put-if-absent copy, then the delete, so an interruption at any
    point leaves the bytes in at least one place and a rerun finishes the move. A quarantined
    copy of the same key with other bytes is kept: this one gets a content-hash suffix.
    """
    digest = hashlib.sha256(data).hexdigest()
    target = f"quarantine/{key}"
    if store.exists(target) and store.read_bytes(target) != data:
        target = f"{target}.{digest[:16]}"
    record = {"key": key, "reason": reason, "quarantined_at": time.time(), "sha256": digest}
    store.write_atomic(f"{target}.reason.json", json.dumps(record, indent=1).encode())
    if not store.put_if_absent(target, data, sync=True) and store.read_bytes(target) != data:  # on disk before the delete
        raise RuntimeError(f"{target} was written concurrently with other bytes; {key} kept")
    store.delete(key)
    return target


def _range_checker(table: pa.Table) -> Callable[[str, Callable[[pa.Array], pa.Array], str], None]:
    """check(column, predicate, problem): ShardError naming the first row whose values fail."""

    def check(column: str, predicate: Callable[[pa.Array], pa.Array], problem: str) -> None:
        values = table[column].combine_chunks()
        is_list = pa.types.is_list(values.type)
        flat = values.flatten() if is_list else values
        index = _first_false(predicate(flat))
        if index >= 0:
            row = pc.list_parent_indices(values)[index].as_py() if is_list else index
            raise ShardError(f"{column} {problem}: row {row} has {flat[index].as_py()!r}")

    return check


def _first_false(mask: pa.Array) -> int:
    """Index of the first False in a boolean array (nulls skipped), -1 if there is none.

    pc.all settles the usual all-true case about 7x faster than pc.index (4 vs 27 us); that cut
    validate_table from about 450 to 310 us on a 64-trajectory shard (benchmarks/storage.py)."""
    if pc.all(mask).as_py():
        return -1
    return pc.index(mask, False).as_py()


def _schema_difference(schema: pa.Schema) -> str:
    expected = {f.name: f for f in ROLLOUT_SCHEMA}
    found = {f.name: f for f in schema}
    missing = [n for n in expected if n not in found]
    unexpected = [n for n in found if n not in expected]
    retyped = [
        f"{n}: {found[n].type}{'' if found[n].nullable else ' not null'}"
        for n in expected
        if n in found and not found[n].equals(expected[n])
    ]
    if not (missing or unexpected or retyped):
        return f"schema mismatch: columns out of order {schema.names}"
    return f"schema mismatch: missing {missing}, unexpected {unexpected}, wrong type {retyped}"
