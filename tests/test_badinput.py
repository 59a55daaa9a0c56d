"""The bad-input sweep: every kind of malformed input tandem takes in, listed in one table.

Each case enters through the code path that really receives that input, and expects the
documented answer with an error that names the problem:

- config and CLI: the `tandem` command, run as a subprocess. Exit code 2, a message on stderr
  naming the field and what is allowed, no traceback.
- engine API: the CPU engine's app in this process (FastAPI's TestClient over a tiny model).
  The documented HTTP status (400, 401, 413 or 422) with a body naming the problem, answered
  within seconds; afterwards the engine still answers /health and generates, on its old weights.
- shards: bad bytes committed past the writer's validation (as a buggy or hostile producer would),
  then read by `read_valid_shards`: the shard is quarantined with a reason naming the problem and
  the good shard next to it is still read. Where the writer can tell, it refuses the rows itself.
- snapshots: a committed snapshot damaged in the run directory, then fetched by `load_snapshot`
  (what a generator does) or loaded by an engine's /update_weights_from_disk.

Every case that has a run directory checks that the directory is byte-for-byte as it was,
hidden files included, apart from quarantine/: the one change a bad input may cause is a bad
shard moving there, bytes unchanged, next to its reason. Run the sweep with `pytest -m badinput`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from fastapi.testclient import TestClient

from configs import TINY_CONFIG, load_config
from infra.engines.cpu import CpuEngine
from infra.engines.server import create_app
from infra.manifest import MANIFEST_NAME, ManifestError, build_manifest
from infra.storage import RunStore
from tasks.lease import process_namespace
from tasks.rundir import initialize_run
from tasks.shards import (
    ROLLOUT_SCHEMA,
    SCHEMA_VERSION_KEY,
    Rollout,
    ShardError,
    encode_shard,
    list_shards,
    parse_shard_key,
    read_valid_shards,
    rollouts_to_table,
    shard_key,
    write_shard,
)
from tasks.snapshots import load_snapshot, publish_snapshot_dir, snapshot_prefix
from tests.conftest import committed_model_dir
from tests.test_engine_contract import MALFORMED, PROMPT
from tests.test_shards import (
    _break_loss_mask_length,
    _future_version,
    _infinite_reward,
    _loss_mask_value,
    _middle_of_column,
    _nan_logprob,
    _negative_token,
    _positive_logprob,
    make_rollouts,
    put_raw,
)

pytestmark = pytest.mark.badinput

ROOT = Path(__file__).resolve().parents[1]
AREAS = ("cli", "engine", "shard", "snapshot")
API_KEY = "badinput-key"
TRAINER_VERSION = 5
"""The trainer's version when the shards are read (a row of version 9 is from the future)."""
VOCAB_SIZE = 50
"""The vocabulary the shards are read against (make_rollouts draws token ids below 50)."""
CONTEXT_LENGTH = 4096
"""The model context the writer and the trainer check rows against."""


# -- what a case feeds in, one kind per area ---------------------------------------------------


@dataclass(frozen=True)
class Cli:
    """`tandem ARGS` in a fresh directory {tmp} that holds a run directory {tmp}/runs/base."""

    args: tuple[str, ...]
    """Arguments after `tandem`; "{tmp}" is replaced by the test's directory."""
    files: dict[str, bytes] = field(default_factory=dict)
    """Written under {tmp} before the run: the bad YAML, a damaged file of the run directory."""


@dataclass(frozen=True)
class Request:
    """One HTTP request to the engine."""

    path: str
    kwargs: dict
    """httpx arguments: json=, content=, headers=."""
    method: str = "POST"
    key: str | None = API_KEY
    """The Bearer token sent; None sends no Authorization header."""


@dataclass(frozen=True)
class BadShard:
    """A shard committed without the writer's validation."""

    build: Callable[[], list[Rollout] | bytes]
    """The rows (encoded as they are) or the raw bytes of the file."""
    key: str = shard_key(1, "gen0", 1)
    writer_refuses: bool = True
    """Rows only: whether write_shard itself can tell (not a future version or vocabulary)."""


@dataclass(frozen=True)
class DamagedSnapshot:
    """Snapshot v1, committed in the run directory, then damaged in place."""

    damage: Callable[[Path], None]
    """Given the snapshot's directory, weights/v00000001, on file://."""
    consumer: str
    """"load_snapshot" (a generator fetching it) or "engine" (/update_weights_from_disk)."""
    version: int | None = 1
    """The version load_snapshot asks for; None reads LATEST."""


@dataclass(frozen=True)
class Case:
    id: str
    area: str
    feed: Cli | Request | BadShard | DamagedSnapshot
    expect: int | type[Exception]
    """Exit code, HTTP status, or the exception the reading code raises."""
    error: str | tuple[str, ...]
    """What the error message must contain (each of them)."""

    @property
    def errors(self) -> tuple[str, ...]:
        return (self.error,) if isinstance(self.error, str) else self.error


# -- config and CLI ----------------------------------------------------------------------------

INTO_TMP = ("--set", "storage.root=file://{tmp}/runs")
RUN_ID_RULE = "run_id must be 1-64 characters of letters, digits, '.', '_' or '-'"
SECTIONS = "allowed here: dask, engine, env, generation, lag, model, prefect, run_id, seed, storage, training"
ALIAS_BOMB = b"""env:
  kwargs:
    a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]
    b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]
    c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]
    d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c]
    e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d]
    f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e, *e]
seed: *f
"""
"""Six nested anchors: 10^6 strings once expanded (a repr of it is 7 MB)."""


def init_yaml(text: bytes | str) -> Cli:
    """`tandem init` of a config file holding `text`, into {tmp}/runs."""
    data = text.encode() if isinstance(text, str) else text
    return Cli(("init", "{tmp}/bad.yaml", *INTO_TMP), {"bad.yaml": data})


def init_tiny(*args: str, files: dict[str, bytes] | None = None) -> Cli:
    """`tandem init` of the shipped tiny config with `args`, into {tmp}/runs."""
    return Cli(("init", str(TINY_CONFIG), *INTO_TMP, *args), files or {})


def cli(id: str, feed: Cli, error: str | tuple[str, ...]) -> Case:
    return Case(id, "cli", feed, 2, error)


CLI_CASES = [
    cli("wrong type", init_yaml("lag:\n  max_lag: two\n"),
        "lag.max_lag: Input should be a valid integer, unable to parse string as an integer (got 'two')"),
    cli("section is not a mapping", init_yaml("training: 5\n"), "training: Input should be a valid dictionary"),
    cli("section given twice", init_yaml("training:\n  steps: 5\nlag:\n  max_lag: 1\ntraining:\n  lr: 0.001\n"),
        ("not valid YAML", "key 'training' is given twice", "line 5")),
    cli("out of range in the file", init_yaml("generation:\n  temperature: -0.5\n"),
        "generation.temperature: Input should be greater than or equal to 0.01 (got -0.5)"),
    cli("a group of one sample", init_tiny("--set", "generation.samples_per_prompt=1"),
        "generation.samples_per_prompt: Input should be greater than or equal to 2 (got 1)"),
    cli("a boolean for a count", init_tiny("--set", "training.steps=true"),
        "training.steps: a number is needed here, not a boolean (got True)"),
    cli("a boolean for a rate", init_yaml("training:\n  lr: false\n"),
        "training.lr: a number is needed here, not a boolean (got False)"),
    cli("out of range in --set", init_tiny("--set", "engine.max_batch_size=5000"),
        "engine.max_batch_size: Input should be less than or equal to 1024 (got 5000)"),
    cli("value not among the allowed", init_tiny("--set", "engine.backend=tpu"),
        "engine.backend: Input should be 'cpu', 'sglang' or 'sim' (got 'tpu')"),
    cli("unknown key", init_yaml("lag:\n  max_lagg: 1\n"), "lag.max_lagg: unknown key; allowed here: max_lag"),
    cli("unknown section", init_yaml("trainer:\n  lr: 0.1\n"), f"trainer: unknown key; {SECTIONS}"),
    cli("fields that contradict", init_tiny("--set", "training.publish_every=5"),
        "training.publish_every (5) must be at most lag.max_lag + 1 (3)"),
    cli("evaluations between published snapshots",
        init_tiny("--set", "training.publish_every=2", "--set", "prefect.evaluate_every=5", "--set", "env.eval_prompts=4"),
        "prefect.evaluate_every (5) must be a multiple of training.publish_every (2)"),
    cli("top_k of 0", init_tiny("--set", "generation.top_k=0"),
        "generation.top_k: top_k must be -1 (disabled) or at least 1, got 0"),
    cli("more prompt groups than shard keys number", init_tiny("--set", "training.steps=100000"),
        "(training.steps + lag.max_lag + 1) x training.prompts_per_step ((100000 + 2 + 1) x 16) must be at most 999,999"),
    cli("storage key without its secret", init_tiny("--set", "storage.key=AKIA"),
        "storage: storage.key is set but storage.secret is not: give both, or neither"),
    cli("empty yaml", init_yaml(""), "the config file is empty; expected a mapping of sections"),
    cli("yaml of comments only", init_yaml("# lag: 1\n"), "the config file is empty"),
    cli("yaml list", init_yaml("- lag\n- seed\n"), "the config must be a mapping of sections, got a YAML list"),
    cli("yaml scalar", init_yaml("42\n"), "the config must be a mapping of sections, got a YAML int"),
    cli("yaml syntax error", init_yaml("lag: [unclosed\n"), "not valid YAML"),
    cli("config not utf-8", init_yaml(b"\xff\xfe\x00lag: \xc3\x28\n"), "cannot read config file"),
    cli("no such config file", Cli(("init", "{tmp}/missing.yaml", *INTO_TMP)), "missing.yaml: no such config file"),
    cli("yaml alias bomb", init_yaml(ALIAS_BOMB), "seed: Input should be a valid integer (got [[[...]"),
    cli("--set without a value", init_tiny("--set", "lag.max_lag"), "expected section.field=value"),
    cli("--set below a scalar", init_tiny("--set", "seed.x=1"), "seed is not a section"),
    cli("run id with /", init_tiny("--run-id", "a/b"), (RUN_ID_RULE, "got 'a/b'")),
    cli("run id ..", init_tiny("--run-id", ".."), (RUN_ID_RULE, "contain no '..'", "got '..'")),
    cli("run id escaping the root", init_yaml("run_id: ../escape\n"), (RUN_ID_RULE, "got '../escape'")),
    cli("run id with NUL", init_yaml('run_id: "nul\\0id"\n'), (RUN_ID_RULE, "got 'nul\\x00id'")),
    cli("run id of 300 characters", init_tiny("--run-id", "r" * 300), (RUN_ID_RULE, "got 'rrrrrrrr")),
    cli("run id empty", init_tiny("--run-id", ""), (RUN_ID_RULE, "got ''")),
    cli("run id of the wrong type", init_yaml("run_id: [1, 2]\n"), "run_id: Input should be a valid string"),
    cli("run id override read as written", init_tiny("--set", "run_id=[1, 2]"), (RUN_ID_RULE, "got '[1, 2]'")),
    cli("run's config.json not JSON", init_tiny("--run-id", "base", files={"runs/base/config.json": b"{not json"}),
        ("runs/base/config.json is not JSON", "the run directory is damaged")),
    cli("run's config.json a JSON list", init_tiny("--run-id", "base", files={"runs/base/config.json": b"[1]"}),
        "runs/base/config.json holds a JSON list, not a run config"),
    cli("run with an unknown key", Cli(("run", str(TINY_CONFIG), "--set", "lag.lag=1")),
        "lag.lag: unknown key; allowed here: max_lag"),
    cli("eval of a run url ending in ..", Cli(("eval", "file://{tmp}/runs/base/..")),
        ("ends in '..', not a run id", "no '..'")),
    cli("eval of a path without a scheme", Cli(("eval", "{tmp}/runs/base")),
        "is not a run directory URL like file:///path/runs/RUN_ID"),
    cli("eval of a directory without config.json", Cli(("eval", "file://{tmp}/runs/nothing")),
        "runs/nothing: not a tandem run directory"),
    cli("eval of a damaged config.json", Cli(("eval", "file://{tmp}/runs/base"), {"runs/base/config.json": b"\xff"}),
        "runs/base/config.json is not JSON"),
    cli("eval of a negative version", Cli(("eval", "file://{tmp}/runs/base", "--version", "-1")),
        ("Invalid value for '--version'", "greater than or equal to 0")),
    cli("engine serve on port 70000", Cli(("engine", "serve", "--model", "{tmp}/runs", "--port", "70000")),
        ("Invalid value for '--port'", "less than or equal to 65535")),
    cli("engine serve of a missing model", Cli(("engine", "serve", "--model", "{tmp}/no-model")),
        ("Invalid value for '--model'", "does not exist")),
    cli("engine serve with a bad latency model",
        Cli(("engine", "serve", "--model", "{tmp}/runs/base/weights/v00000000", "--sim-latency", '{"decode_base_s": -1}')),
        ("--sim-latency", "decode_base_s", "greater than or equal to 0")),
    cli("engine serve with an unknown latency field",
        Cli(("engine", "serve", "--model", "{tmp}/runs/base/weights/v00000000", "--sim-latency", '{"decode_ms": 1}')),
        ("--sim-latency", "decode_ms: unknown key; allowed here: decode_base_s, decode_s_per_seq")),
    cli("env entrypoint that does not import", init_tiny("--set", "env.entrypoint=nope.mod:Cls"),
        ("env.entrypoint", "cannot import 'nope.mod'")),
    cli("env kwargs the environment refuses", init_tiny("--set", "env.kwargs={digts: 3}"),
        ("env.kwargs", "unexpected keyword argument 'digts'")),
    cli("env kwargs of a bad value", init_tiny("--set", "env.kwargs={digits: -3}"), ("env.kwargs", "digits must be in")),
    cli("env with fewer problems than env.train_prompts asks", init_tiny("--set", "env.kwargs={digits: 1}"),
        ("env.train_prompts", "cannot give 2000 train prompts", "found 83 distinct ones")),
    cli("deploy of a prefect.yaml that is not YAML", Cli(("deploy", "--project-dir", "{tmp}/project"), {"project/prefect.yaml": b"deployments: [\n"}),
        "project/prefect.yaml: not valid YAML"),
    cli("deploy of a prefect.yaml holding a list", Cli(("deploy", "--project-dir", "{tmp}/project"), {"project/prefect.yaml": b"- 1\n"}),
        "project/prefect.yaml: must be a mapping with a `deployments` list, not a YAML list"),
    cli("deploy of a deployment without a name", Cli(("deploy", "--project-dir", "{tmp}/project"), {"project/prefect.yaml": b"deployments:\n- entrypoint: x\n"}),
        "project/prefect.yaml: deployments[0] must be a mapping with a `name`"),
    cli("run on a memory:// root", init_tiny("--set", "storage.root=memory://runs"), ("storage.root memory://runs", "use file:// or s3://")),
    cli("model path that is not a model", init_tiny("--set", "model.path={tmp}/runs"),
        "model.path '{tmp}/runs' is not an HF model directory"),
    cli("run of a run id started with another config",
        Cli(("run", str(TINY_CONFIG), *INTO_TMP, "--run-id", "base", "--set", "training.lr=0.5")),
        ("run 'base' at file://{tmp}/runs/base was started with a different config", "training.lr")),
    Case("run of a run another pipeline holds", "cli",
         Cli(("run", str(TINY_CONFIG), *INTO_TMP, "--run-id", "held"),
             {"runs/held/lease/00000001.json": json.dumps({"holder": "other (x)", "where": process_namespace(), "pid": 1,
                                                  "at": 4102444800}).encode()}),  # pid 1 lives; renewed "in 2100"
         1, "run file://{tmp}/runs/held is in use by pipeline other (x)"),
    Case("run with its storage down", "cli",
         Cli(("run", str(TINY_CONFIG), "--set", "storage.root=s3://tandem", "--set", "storage.retry_seconds=0",
              "--set", "storage.endpoint_url=http://127.0.0.1:1", "--set", "storage.key=k", "--set", "storage.secret=s")),
         1, ("storage.root s3://tandem: storage at s3://tandem/tiny failed", "Could not connect")),
    Case("run on a file:// root that cannot be made", "cli",
         Cli(("run", str(TINY_CONFIG), "--set", "storage.root=file:///proc/tandem-runs")), 1,
         "storage.root file:///proc/tandem-runs: cannot write the run directory /proc/tandem-runs/tiny"),
    Case("init on a file:// root under a plain file", "cli",
         Cli(("init", str(TINY_CONFIG), "--set", "storage.root=file:///etc/hostname")), 1,
         "storage.root file:///etc/hostname: cannot write the run directory /etc/hostname/tiny: Not a directory"),
    cli("run of an env entrypoint that does not import",
        Cli(("run", str(TINY_CONFIG), *INTO_TMP, "--set", "env.entrypoint=nope.mod:Cls")), "env.entrypoint"),
    *[cli(f"{command} on a GPU this machine lacks", Cli((command, str(TINY_CONFIG), *INTO_TMP, "--set", "training.device=cuda:7")),
          "training.device: 'cuda:7' asks for GPU 7, and torch sees")
      for command in ("run", "init") if not torch.cuda.is_available()],
    cli("storage endpoint without a scheme", init_tiny("--set", "storage.endpoint_url=127.0.0.1:8333"),
        "storage.endpoint_url: endpoint_url must be an http:// or https:// URL such as http://127.0.0.1:8333, got '127.0.0.1:8333'"),
    Case("eval with its storage down", "cli",
         Cli(("eval", "s3://tandem/runs/x", "--set", "storage.retry_seconds=0", "--set", "storage.endpoint_url=http://127.0.0.1:1",
              "--set", "storage.key=k", "--set", "storage.secret=s")),
         1, ("s3://tandem/runs/x: storage at", "Could not connect")),
    cli("eval of a damaged LATEST", Cli(("eval", "file://{tmp}/runs/base"), {"runs/base/weights/LATEST": b"{not json"}),
        ("weights/LATEST: not a {\"version\": V} record",)),
    cli("s3 root without a bucket", init_tiny("--set", "storage.root=s3://"),
        "storage.root: root must name a bucket, like s3://BUCKET or s3://BUCKET/PREFIX, got 's3://'"),
    cli("eval of a version not kept", Cli(("eval", "file://{tmp}/runs/base", "--version", "7")),
        ("no snapshot v7 under", "runs/base/weights", "kept: v0")),
    cli("eval with another run id", Cli(("eval", "file://{tmp}/runs/base", "--set", "run_id=other")),
        ("--set 'run_id=other'", "names the run")),
    cli("engine serve of a directory that is not a model", Cli(("engine", "serve", "--model", "{tmp}/runs")),
        "--model {tmp}/runs: not an HF model directory"),
    cli("storage up in a file", Cli(("storage", "up", "--dir", "{tmp}/afile"), {"afile": b"data"}),
        "--dir {tmp}/afile: not a directory"),
    *[cli(f"{command} of backend sglang without SGLang",
          Cli((command, *where, "--set", "engine.backend=sglang")),
          "engine.backend 'sglang' needs SGLang installed: pip install 'tandem[sglang]'")
      for command, where in (("run", (str(TINY_CONFIG), *INTO_TMP)), ("eval", ("file://{tmp}/runs/base",)))
      if importlib.util.find_spec("sglang") is None],
]  # fmt: skip


# -- engine API ----------------------------------------------------------------------------------

MALFORMED_EXPECTED: dict[str, tuple[int, str | tuple[str, ...]]] = {
    "bad json": (422, "Invalid JSON"),
    "missing input_ids": (422, ('"input_ids"', "Field required")),
    "input_ids not a list": (422, ('"input_ids"', "Input should be a valid array")),
    "empty input_ids": (422, ('"input_ids"', "at least 1 item")),
    "out-of-vocabulary id": (400, "input_ids outside the vocabulary [0, 55): [10000000]"),
    "negative id": (422, ('"input_ids",1', "greater than or equal to 0")),
    "negative max_new_tokens": (422, ('"max_new_tokens"', "greater than or equal to 0")),
    "huge max_new_tokens": (422, ('"max_new_tokens"', "less than or equal to 1000000")),
    "temperature below 0": (422, ('"temperature"', "greater than or equal to 0")),
    "n is 0": (422, ('"n"', "greater than or equal to 1")),
    "unknown sampling field": (422, ('"temprature"', "Extra inputs are not permitted")),
    "body over the size limit": (413, "request body over 8388608 bytes"),
}
"""The answer to each malformed request of the engine contract suite (tests/test_engine_contract.py)."""


JSON = {"content-type": "application/json"}


def generate(body: dict | None = None, content: bytes | None = None, key: str | None = API_KEY) -> Request:
    if content is not None:
        return Request("/generate", {"content": content, "headers": JSON}, key=key)
    return Request("/generate", {"json": body}, key=key)


def tokens(count: int, token: bytes = b"1") -> bytes:
    """The body of a /generate request whose prompt is `count` copies of `token`."""
    return b'{"input_ids": [' + b",".join([token] * count) + b"]}"


ENGINE_CASES = [
    *(Case(name, "engine", Request("/generate", kwargs), *MALFORMED_EXPECTED[name]) for name, kwargs in MALFORMED.items()),
    Case("body is a JSON list", "engine", generate(content=b"[1, 2, 3]"), 422, ('"body"', "Input should be an object")),
    Case("body is JSON null", "engine", generate(content=b"null"), 422, "Input should be an object"),
    Case("empty body", "engine", generate(content=b""), 422, "Invalid JSON: EOF while parsing"),
    Case("input_ids an object", "engine", generate({"input_ids": {"0": 1}}), 422, ('"input_ids"', "valid array")),
    Case("input_ids of floats", "engine", generate({"input_ids": [1.5]}), 422, ('"input_ids",0', "fractional part")),
    Case("sampling_params a list", "engine", generate({"input_ids": [1], "sampling_params": [1]}), 422,
         ('"sampling_params"', "Input should be an object")),
    Case("return_logprob a number", "engine", generate({"input_ids": [1], "return_logprob": 2}), 422,
         ('"return_logprob"', "valid boolean")),
    Case("temperature a string", "engine", generate({"input_ids": [1], "sampling_params": {"temperature": "hot"}}), 422,
         ('"temperature"', "valid number")),
    Case("temperature NaN", "engine", generate(content=b'{"input_ids": [1], "sampling_params": {"temperature": NaN}}'), 422,
         ('"temperature"', "finite number")),
    Case("top_k 0", "engine", generate({"input_ids": [1], "sampling_params": {"top_k": 0}}), 422,
         ('"top_k"', "top_k must be -1 (disabled) or at least 1")),
    Case("sampling_seed past int64", "engine", generate({"input_ids": [1], "sampling_params": {"sampling_seed": 2**70}}), 422,
         ('"sampling_seed"', "less than 9223372036854775808")),
    Case("stop token past int32", "engine", generate({"input_ids": [1], "sampling_params": {"stop_token_ids": [2**40]}}), 422,
         ('"stop_token_ids",0', "less than 2147483648")),
    Case("unknown top-level field", "engine", generate({"input_ids": [1], "text": "2 + 2"}), 422,
         ('"text"', "Extra inputs are not permitted")),
    Case("rid of 300 characters", "engine", generate({"input_ids": [1], "rid": "r" * 300}), 422,
         ('"rid"', "at most 256 characters")),
    Case("prompt of 10^6 tokens", "engine", generate(content=tokens(10**6)), 400,
         "Requested token count exceeds the model's maximum context length of 64 tokens: 1000000 tokens of input"),
    Case("prompt of 10^6 + 1 tokens", "engine", generate(content=tokens(10**6 + 1)), 422,
         ('"input_ids"', "at most 1000000 items")),
    Case("prompt of 10^6 wide tokens", "engine", generate(content=tokens(10**6, b"12345678")), 413,
         "request body over 8388608 bytes"),
    Case("number of 5000 digits", "engine", generate(content=b'{"input_ids": [' + b"9" * 5000 + b"]}"), 422,
         "Invalid JSON: number out of range"),
    Case("JSON nested 10^5 deep", "engine", generate(content=b"[" * 10**5 + b"]" * 10**5), 422,
         "Invalid JSON: recursion limit exceeded"),
    Case("body not UTF-8", "engine", generate(content=b"\xff\xfe\x00{\xc3\x28}"), 422, "Invalid JSON"),
    Case("emoji for token ids", "engine", generate({"input_ids": ["\U0001f642", "\u00fc"]}), 422,
         ('"input_ids",0', "valid integer")),
    Case("lone surrogate in rid", "engine", generate(content=b'{"input_ids": [1], "rid": "\\ud800"}'), 422,
         "Invalid JSON"),
    Case("no API key", "engine", generate({"input_ids": PROMPT}, key=None), 401, "missing or wrong API key"),
    Case("wrong API key", "engine", generate({"input_ids": PROMPT}, key="not-the-key"), 401, "missing or wrong API key"),
    Case("API key on another route", "engine", Request("/model_info", {}, method="GET", key="not-the-key"), 401,
         "missing or wrong API key"),
    Case("update without model_path", "engine", Request("/update_weights_from_disk", {"json": {}}), 422,
         ('"model_path"', "Field required")),
    Case("update with weight_version a number", "engine",
         Request("/update_weights_from_disk", {"json": {"model_path": "/x", "weight_version": 3}}), 422,
         ('"weight_version"', "valid string")),
    Case("update of a path with NUL", "engine", Request("/update_weights_from_disk", {"json": {"model_path": "a\0b"}}), 400,
         "embedded null byte"),
    Case("update body nested 10^5 deep", "engine",
         Request("/update_weights_from_disk", {"content": b"[" * 10**5 + b"]" * 10**5, "headers": JSON}), 400,
         "There was an error parsing the body"),
    Case("update body not UTF-8", "engine", Request("/update_weights_from_disk", {"content": b"\xff\xfe", "headers": JSON}),
         422, "JSON decode error"),
    Case("pause in an unknown mode", "engine", Request("/pause_generation", {"json": {"mode": "freeze"}}), 422,
         ('"mode"', "Input should be 'abort', 'retract' or 'in_place'")),
    Case("abort of nothing", "engine", Request("/abort_request", {"json": {}}), 400, "give a rid or abort_all: true"),
]  # fmt: skip


# -- shards --------------------------------------------------------------------------------------


def rows(violation: Callable[[list[Rollout]], None] | None = None, **kwargs) -> Callable[[], list[Rollout]]:
    """Builder of make_rollouts(**kwargs) with `violation` applied."""

    def build() -> list[Rollout]:
        rollouts = make_rollouts(**kwargs)
        if violation:
            violation(rollouts)
        return rollouts

    return build


def _long_row(rollouts: list[Rollout]) -> None:
    count = 10**6
    rollouts[0].completion_ids, rollouts[0].loss_mask = [1] * count, [0] * count
    rollouts[0].behavior_logprobs = [0.0] * count


def _out_of_vocabulary(rollouts: list[Rollout]) -> None:
    rollouts[1].prompt_ids[0] = 10**6


def _empty_prompt(rollouts: list[Rollout]) -> None:
    rollouts[2].prompt_ids = []


def _two_groups(rollouts: list[Rollout]) -> None:
    rollouts[3].group_id = "g7"


def _no_rows(rollouts: list[Rollout]) -> None:
    rollouts.clear()


def _valid_bytes(n: int = 4, completion_len: int = 6) -> bytes:
    return encode_shard(rollouts_to_table(make_rollouts(n=n, completion_len=completion_len)))


def _truncated() -> bytes:
    data = _valid_bytes(n=200, completion_len=64)
    return data[: len(data) // 2]


def _flipped_page() -> bytes:
    data = bytearray(_valid_bytes(n=200, completion_len=64))
    offset = _middle_of_column(bytes(data), "completion_ids")
    data[offset : offset + 8] = bytes(b ^ 0xFF for b in data[offset : offset + 8])
    return bytes(data)


def _parquet(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink)
    return sink.getvalue()


def _foreign_columns() -> bytes:
    table = pa.table({"prompt": ["2 + 2"], "score": [1.0]})
    return _parquet(table.replace_schema_metadata(ROLLOUT_SCHEMA.metadata))


def _reward_as_double() -> bytes:
    index = ROLLOUT_SCHEMA.get_field_index("reward")
    schema = ROLLOUT_SCHEMA.set(index, pa.field("reward", pa.float64(), nullable=False))
    return _parquet(rollouts_to_table(make_rollouts()).cast(schema))


def _schema_version(version: bytes | None) -> Callable[[], bytes]:
    def build() -> bytes:
        table = rollouts_to_table(make_rollouts())
        return _parquet(table.replace_schema_metadata({SCHEMA_VERSION_KEY: version} if version else None))

    return build


def shard(id: str, feed: BadShard, error: str | tuple[str, ...]) -> Case:
    return Case(id, "shard", feed, ShardError, error)


SHARD_CASES = [
    shard("truncated", BadShard(_truncated), "not a readable Parquet file"),
    shard("empty file", BadShard(lambda: b""), "not a readable Parquet file"),
    shard("unicode garbage", BadShard(lambda: "\U0001f642 nicht parquet \u00fc\u0000".encode()), "not a readable Parquet file"),
    shard("flipped bytes in a page", BadShard(_flipped_page), ("not a readable Parquet file", "checksum")),
    shard("wrong schema", BadShard(_foreign_columns),
          ("schema mismatch: missing ['prompt_ids'", "unexpected ['prompt', 'score']")),
    shard("column of the wrong type", BadShard(_reward_as_double), "wrong type ['reward: double not null']"),
    shard("no schema version", BadShard(_schema_version(None)), "schema version None in the metadata, expected 1"),
    shard("schema version from the future", BadShard(_schema_version(b"2")), "schema version b'2' in the metadata"),
    shard("row of 10^6 tokens", BadShard(rows(_long_row)),
          f"row 0 has 1000005 tokens (prompt + completion), over the model's context of {CONTEXT_LENGTH}"),
    shard("NaN logprob", BadShard(rows(_nan_logprob)), "behavior_logprobs must be finite: row 2 has nan"),
    shard("positive logprob", BadShard(rows(_positive_logprob)), "behavior_logprobs must be <= 0: row 0 has 0.5"),
    shard("policy_version from the future", BadShard(rows(_future_version), writer_refuses=False),
          "policy_version is from the future (trainer is at version 5): row 2 has 9"),
    shard("loss_mask of the wrong length", BadShard(rows(_break_loss_mask_length)),
          "len(loss_mask) != len(completion_ids) in row 1"),
    shard("loss_mask value 2", BadShard(rows(_loss_mask_value)), "loss_mask must be 0 or 1: row 3 has 2"),
    shard("infinite reward", BadShard(rows(_infinite_reward)), "reward must be finite: row 1 has inf"),
    shard("negative token id", BadShard(rows(_negative_token)), "completion_ids must be >= 0: row 0 has -1"),
    shard("token outside the vocabulary", BadShard(rows(_out_of_vocabulary), writer_refuses=False),
          "prompt_ids must be < vocab_size 50: row 1 has 1000000"),
    shard("no rows", BadShard(rows(_no_rows)), "shard has no rows"),
    shard("empty prompt", BadShard(rows(_empty_prompt)), "prompt_ids is empty in row 2"),
    shard("two groups in one shard", BadShard(rows(_two_groups)), "a shard is one group, and this one holds 2: g0, g7"),
    shard("key names another version", BadShard(rows(version=2), writer_refuses=False),
          "key says version 1, lowest policy_version is 2"),
    shard("key names another producer", BadShard(rows(), key=shard_key(1, "gen1", 0)),
          "producer does not match the key's 'gen1': row 0 has 'gen0'"),
]  # fmt: skip


# -- snapshots -----------------------------------------------------------------------------------


def _drop_manifest(snapshot: Path) -> None:
    (snapshot / MANIFEST_NAME).unlink()


def _drop_listed_file(snapshot: Path) -> None:
    (snapshot / "tokenizer.json").unlink()


def _flip_weights_byte(snapshot: Path) -> None:
    weights = snapshot / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))


def _grow_weights(snapshot: Path) -> None:
    with open(snapshot / "model.safetensors", "ab") as handle:
        handle.write(b"\0")


def _garble_manifest(snapshot: Path) -> None:
    (snapshot / MANIFEST_NAME).write_bytes(b"{not json")


def _garble_latest(snapshot: Path) -> None:
    (snapshot.parent / "LATEST").write_bytes(b"v1, I think")


def _config(text: bytes, recommit: bool) -> Callable[[Path], None]:
    """Replace the snapshot's config.json; with `recommit`, its manifest agrees (a buggy producer)."""

    def damage(snapshot: Path) -> None:
        (snapshot / "config.json").write_bytes(text)
        if recommit:
            manifest = build_manifest(snapshot, extra={"version": 1})
            (snapshot / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1, sort_keys=True))

    return damage


def snapshot(id: str, feed: DamagedSnapshot, error: str | tuple[str, ...]) -> Case:
    expect = 400 if feed.consumer == "engine" else ValueError if feed.version is None else ManifestError
    return Case(id, "snapshot", feed, expect, error)


SNAPSHOT_CASES = [
    snapshot("fetch without a manifest", DamagedSnapshot(_drop_manifest, "load_snapshot"),
             "MANIFEST.json: missing under file://"),
    snapshot("fetch of a manifest naming a missing file", DamagedSnapshot(_drop_listed_file, "load_snapshot"),
             "tokenizer.json: listed in the manifest but missing"),
    snapshot("fetch with a sha256 mismatch", DamagedSnapshot(_flip_weights_byte, "load_snapshot"),
             ("model.safetensors: sha256", "manifest says")),
    snapshot("fetch with a size mismatch", DamagedSnapshot(_grow_weights, "load_snapshot"),
             "model.safetensors: size"),
    snapshot("fetch of a manifest that is not JSON", DamagedSnapshot(_garble_manifest, "load_snapshot"),
             "MANIFEST.json: not JSON"),
    snapshot("fetch of a config.json that is not JSON", DamagedSnapshot(_config(b"{not json", False), "load_snapshot"),
             "config.json: size 9, manifest says"),
    snapshot("fetch of LATEST that is not JSON", DamagedSnapshot(_garble_latest, "load_snapshot", version=None),
             ("weights/LATEST: not a {\"version\": V} record", "JSONDecodeError")),
    snapshot("engine load without a manifest", DamagedSnapshot(_drop_manifest, "engine"), "MANIFEST.json: missing in"),
    snapshot("engine load of a manifest naming a missing file", DamagedSnapshot(_drop_listed_file, "engine"),
             "tokenizer.json: listed in the manifest but missing"),
    snapshot("engine load with a sha256 mismatch", DamagedSnapshot(_flip_weights_byte, "engine"),
             ("model.safetensors: sha256", "manifest says")),
    snapshot("engine load of a config.json that is not JSON", DamagedSnapshot(_config(b"{not json", True), "engine"),
             "config.json is not valid JSON"),
    snapshot("engine load of a config.json that is a list", DamagedSnapshot(_config(b"[1, 2]", True), "engine"),
             "config.json describes model_type 'list', the serving model is 'llama'"),
]  # fmt: skip


CASES: list[Case] = CLI_CASES + ENGINE_CASES + SHARD_CASES + SNAPSHOT_CASES


def cases_of(area: str):
    return pytest.mark.parametrize("case", [c for c in CASES if c.area == area], ids=lambda c: c.id)


def test_the_sweep_lists_every_case():
    counts = Counter(case.area for case in CASES)
    table = "\n".join(f"{c.area:8} {str(getattr(c.expect, '__name__', c.expect)):13} {c.id}" for c in CASES)
    print(f"{len(CASES)} bad-input cases ({dict(counts)}):\n{table}")
    assert len(CASES) >= 30, "the issue asks for at least 30 cases"
    assert set(counts) == set(AREAS) and all(counts[area] >= 5 for area in AREAS), counts
    assert len({(c.area, c.id) for c in CASES}) == len(CASES), "case ids repeat"
    assert set(MALFORMED) <= {c.id for c in ENGINE_CASES}, "every malformed request of the engine contract"


# -- what every run-directory case checks --------------------------------------------------------


def tree_digest(root: Path) -> dict[str, str]:
    """Every file and directory below `root`, hidden ones included: relative path -> sha256 or "dir"."""
    return {
        path.relative_to(root).as_posix(): "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*"))
    }


def outside_quarantine(tree: dict[str, str]) -> dict[str, str]:
    return {path: digest for path, digest in tree.items() if path.split("/")[0] != "quarantine"}


def assert_message(case: Case, message: str) -> None:
    for expected in case.errors:
        assert expected in message, f"{case.id}: {expected!r} not in the error:\n{message[:2000]}"


# -- config and CLI --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pristine_run(tmp_path_factory) -> Path:
    """A run directory as `tandem init` lays it out (config.json, snapshot v0, LATEST), made once."""
    root = tmp_path_factory.mktemp("pristine") / "runs"
    config = load_config(TINY_CONFIG, [f"storage.root=file://{root}", "run_id=base", "training.warmup_steps=0"])
    initialize_run(config)
    return root / "base"


@cases_of("cli")
def test_config_and_cli(case: Case, pristine_run: Path, tmp_path: Path):
    shutil.copytree(pristine_run, tmp_path / "runs" / "base")
    (tmp_path / "cwd").mkdir()
    for name, data in case.feed.files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data)
    before = tree_digest(tmp_path)
    args = [arg.replace("{tmp}", str(tmp_path)) for arg in case.feed.args]
    env = os.environ | {"PYTHONPATH": str(ROOT), "COLUMNS": "250", "NO_COLOR": "1"}
    command = [sys.executable, "-m", "flows.cli", *args]
    done = subprocess.run(command, cwd=tmp_path / "cwd", env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == case.expect, f"exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert_message(case, done.stderr.replace(str(tmp_path), "{tmp}"))
    assert len(done.stderr) < 5000, "an error for a person, not a dump of the input"
    assert tree_digest(tmp_path) == before, "a refused command changed files"


# -- engine API ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return committed_model_dir(tmp_path_factory.mktemp("model") / "v0", seed=0)


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> TestClient:
    """The CPU engine's app, in this process; the client sends no API key unless told to."""
    cpu = CpuEngine(model_dir, max_batch_size=4, weight_version="0")
    try:
        with TestClient(create_app(cpu, api_key=API_KEY), raise_server_exceptions=False) as client:
            yield client
    finally:
        cpu.shutdown()


def test_an_engine_whose_scheduler_stopped_is_not_healthy(model_dir: Path):
    """SGLang's /health generates a token; the CPU engine's answered 200 on a scheduler thread
    that had died, and every request sent there waited out its timeout. Now such a request fails
at once."""
    cpu = CpuEngine(model_dir, max_batch_size=4, weight_version="0")
    with TestClient(create_app(cpu), raise_server_exceptions=False) as client:
        assert client.get("/health").status_code == 200
        cpu.shutdown()  # the thread ends, as one that raised would
        answer = client.get("/health")
        assert answer.status_code == 503 and "scheduler stopped" in answer.json()["status"]
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}
        answer = client.post("/generate", json=body)  # failed at once, not left queued
        assert answer.status_code == 500 and "EngineStopped" in answer.text


def call(client: TestClient, request: Request):
    kwargs = dict(request.kwargs)
    headers = dict(kwargs.pop("headers", {}))
    if request.key is not None:
        headers["Authorization"] = f"Bearer {request.key}"
    return client.request(request.method, request.path, headers=headers, **kwargs)


def assert_engine_still_serves(client: TestClient) -> None:
    auth = {"Authorization": f"Bearer {API_KEY}"}
    assert client.get("/health").status_code == 200
    assert client.get("/model_info", headers=auth).json()["weight_version"] == "0", "the old weights serve on"
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}
    answer = client.post("/generate", json=body, headers=auth)
    assert answer.status_code == 200 and answer.json()["meta_info"]["completion_tokens"] == 2, answer.text[:500]


@cases_of("engine")
def test_engine_api(case: Case, engine: TestClient):
    started = time.monotonic()
    response = call(engine, case.feed)
    elapsed = time.monotonic() - started
    assert response.status_code == case.expect, response.text[:1000]
    assert_message(case, response.text)
    assert len(response.text) < 5000, "the error must not echo the input back"
    assert elapsed < 30, f"{case.id} took {elapsed:.1f}s"
    assert_engine_still_serves(engine)


def test_a_failed_engine_step_ends_its_requests_with_an_error_and_the_engine_serves_on(model_dir: Path):
    """A prefill that raised (out of memory, weights that sample NaN) lost its requests, whose
    /generate calls waited for the client's timeout; one whose decode step raised was answered
    200 with a half-made sample and no finish reason."""
    from infra.engines.api import SamplingParams
    from infra.engines.scheduler import GenerationJob

    cpu = CpuEngine(model_dir, max_batch_size=4, weight_version="0")
    real_forward, calls = cpu._forward, []

    def failing(fail_on: int):
        def forward(*args, **kwargs):
            calls.append(1)
            if len(calls) == fail_on:
                raise RuntimeError("out of memory (a stand-in)")
            return real_forward(*args, **kwargs)

        return forward

    try:
        cpu._forward = failing(fail_on=1)  # the prefill
        job = GenerationJob(rid="r0", input_ids=PROMPT, params=SamplingParams(max_new_tokens=4, ignore_eos=True))
        assert "out of memory" in str(cpu.submit(job).exception(timeout=30))
        calls.clear()
        cpu._forward = failing(fail_on=2)  # the first decode step
        with TestClient(create_app(cpu), raise_server_exceptions=False) as client:
            body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
            failed = client.post("/generate", json=body)
            assert failed.status_code == 500 and "out of memory" in failed.json()["error"]["message"]
            served = client.post("/generate", json=body)
            assert served.status_code == 200 and served.json()["meta_info"]["completion_tokens"] == 4
    finally:
        cpu.shutdown()


# -- shards ----------------------------------------------------------------------------------------


@cases_of("shard")
def test_shards(case: Case, file_store: RunStore):
    run_dir = file_store.local_path("")
    good = write_shard(file_store, make_rollouts(), "gen0", 0).key
    key, built = case.feed.key, case.feed.build()
    if isinstance(built, list):
        if case.feed.writer_refuses:
            name = parse_shard_key(key)
            with pytest.raises(ShardError) as refused:
                write_shard(file_store, built, name.producer, name.seq, context_length=CONTEXT_LENGTH)
            assert_message(case, refused.value.reason)
        built = encode_shard(rollouts_to_table(built))
    put_raw(file_store, key, built)
    assert list_shards(file_store) == sorted([good, key])
    before = tree_digest(run_dir)

    result = read_valid_shards(file_store, list_shards(file_store), TRAINER_VERSION, vocab_size=VOCAB_SIZE,
                               context_length=CONTEXT_LENGTH)  # fmt: skip

    assert list(result.tables) == [good], "the good shard is still read"
    assert list(result.quarantined) == [key]
    assert_message(case, result.quarantined[key])
    after = tree_digest(run_dir)
    assert outside_quarantine(after) == {path: d for path, d in before.items() if path != key}
    assert after[f"quarantine/{key}"] == before[key], "quarantine keeps the bytes as they were"
    reason = json.loads((run_dir / f"quarantine/{key}.reason.json").read_bytes())
    assert reason["key"] == key and reason["reason"] == result.quarantined[key]


# -- snapshots -------------------------------------------------------------------------------------


@cases_of("snapshot")
def test_snapshots(case: Case, file_store: RunStore, model_dir: Path, tmp_path: Path, request):
    publish_snapshot_dir(file_store, model_dir, 1)
    snapshot_dir = file_store.local_path(snapshot_prefix(1))
    case.feed.damage(snapshot_dir)
    run_dir = file_store.local_path("")
    before = tree_digest(run_dir)

    if case.feed.consumer == "engine":
        client = request.getfixturevalue("engine")
        body = {"model_path": str(snapshot_dir), "weight_version": "1"}
        response = call(client, Request("/update_weights_from_disk", {"json": body}))
        assert response.status_code == case.expect, response.text[:1000]
        assert response.json()["success"] is False
        assert_message(case, response.json()["message"])
        assert_engine_still_serves(client)
    else:
        cache = tmp_path / "cache"
        with pytest.raises(case.expect) as refused:
            load_snapshot(file_store, cache, case.feed.version)
        assert_message(case, str(refused.value))
        assert not cache.exists() or list(cache.iterdir()) == [], "no copy, whole or partial, is left to load"
    assert tree_digest(run_dir) == before, "a refused snapshot changed the run directory"

