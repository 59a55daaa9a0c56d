"""Shared fixtures: a real SeaweedFS S3 server for the session, run stores on every backend, and
a temporary directory for everything the tests start.

`store` is parametrised over file:// and s3:// so that a test written once checks both backends;
the s3 case carries the `s3` marker, so `pytest -m "not s3"` runs without starting a server.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from configs.sections import ModelConfig, StorageConfig
from infra.manifest import MANIFEST_NAME, build_manifest
from infra.modelfactory import save_tiny_model
from infra.seaweed import SeaweedServer, free_s3_port
from infra.storage import RunStore, open_run_store


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the longest files first, each file's tests in their own order.

    `make test` gives whole files to two workers (`--dist loadfile --no-loadscope-reorder`) in
    this order, each taking the next file as it runs low. In xdist's own order (most tests
    first) the deployed-mode file (18 minutes) and the benchmarks' (9) came last and could end
    on one worker while the other sat idle. A file's weight is the sum of the timeouts its tests
    declare: a test sets its own only when it runs for minutes, so the bound is what is known of
    its length before it runs. Files that declare none keep their places after those that do."""
    weight: dict[Path, float] = {}
    for item in items:
        timeout = item.get_closest_marker("timeout")
        weight[item.path] = weight.get(item.path, 0.0) + (float(timeout.args[0]) if timeout else 0.0)
    items.sort(key=lambda item: -weight[item.path])  # stable: a file's tests stay together, in order


@pytest.fixture(scope="session", autouse=True)
def session_tmpdir(tmp_path_factory) -> Path:
    """TMPDIR for the session, in this process and every server, worker and engine it starts:
    under pytest's base directory, which keeps the last three sessions, not the system's /tmp.
    A flow that fails keeps its scratch directory to explain the failure (infra/scratch.py), and
    the tests that kill workers and fail flows on purpose left 24 there in one CI run."""
    path = tmp_path_factory.mktemp("tmpdir")
    patch = pytest.MonkeyPatch()
    patch.setenv("TMPDIR", str(path))
    # The Prefect home (database, settings) of the runs the tests start as processes: one per
    # pytest process, so that two workers (make test) never share the SQLite file of Prefect's
    # temporary server, and the user's ~/.prefect stays untouched.
    patch.setenv("PREFECT_HOME", str(tmp_path_factory.mktemp("prefect-home")))
    patch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    yield path
    patch.undo()


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory) -> SeaweedServer:
    """One SeaweedFS server on loopback for the whole test session."""
    server = SeaweedServer(tmp_path_factory.mktemp("seaweed"), free_s3_port()).start()
    yield server
    server.stop()


def s3_storage_config(server: SeaweedServer, **overrides) -> StorageConfig:
    """A StorageConfig pointing at `server` with a bucket of its own per test."""
    fields = {
        "root": f"s3://test-{uuid.uuid4().hex[:12]}/runs",
        "endpoint_url": server.endpoint_url,
        "key": "tandem-test-key",
        "secret": "tandem-test-secret",
        "retry_seconds": 20.0,
    }
    return StorageConfig(**(fields | overrides))


@pytest.fixture
def file_store(tmp_path: Path) -> RunStore:
    return open_run_store(StorageConfig(root=f"file://{tmp_path}/runs"), "run-test")


@pytest.fixture
def s3_store(seaweed: SeaweedServer) -> RunStore:
    return open_run_store(s3_storage_config(seaweed), "run-test")


@pytest.fixture(params=["file", pytest.param("s3", marks=pytest.mark.s3)])
def store(request) -> RunStore:
    """A fresh run directory on file:// and, as a second case, on SeaweedFS."""
    return request.getfixturevalue(f"{request.param}_store")


@contextlib.contextmanager
def s3_requests(store: RunStore) -> Iterator[list[str]]:
    """The S3 operations `store` sends inside the block, in order ("GetObject", ...), as its
    botocore client reports them just before sending each request."""
    sent: list[str] = []

    def record(event_name: str, **_) -> None:
        sent.append(event_name.rsplit(".", 1)[-1])

    events = store.fs.s3.meta.events
    events.register("before-send.s3", record)
    try:
        yield sent
    finally:
        events.unregister("before-send.s3", record)


def committed_model_dir(out_dir: Path, seed: int) -> Path:
    """A tiny model directory committed like a snapshot: MANIFEST.json written last."""
    path = save_tiny_model(ModelConfig(), out_dir, seed=seed)
    (path / MANIFEST_NAME).write_text(json.dumps(build_manifest(path)))
    return path


def corrupt_copy(model_dir: Path, out_dir: Path) -> Path:
    """A copy of a committed model directory with one byte of its weights flipped."""
    shutil.copytree(model_dir, out_dir)
    weights = out_dir / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    return out_dir


def reference_logprobs(model_dir: Path, prompt: list[int], output: list[int], temperature: float = 1.0) -> list[float]:
    """Logprob of each output token under a plain full-sequence forward pass of the model, of the
    distribution softmax(logits / temperature)."""
    import torch

    from infra.modelfactory import load_model

    model = load_model(model_dir).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float() / temperature
    logprobs = torch.log_softmax(logits, dim=-1)
    return [float(logprobs[len(prompt) - 1 + i, token]) for i, token in enumerate(output)]
