"""Security checks: what tandem exposes on the network, and what it runs when it reads a bucket.

- Servers tandem starts listen on loopback unless told otherwise: a real engine process and the
  SeaweedFS helper are checked through the kernel's own table of listening sockets (psutil).
- With an API key set, every route of the engine app but /health refuses a request without it or
  with a wrong one. The routes are taken from the app itself, so a new endpoint is checked too.
- Reading a run directory runs no code and allocates nothing absurd: snapshots and checkpoints
  seeded with a pickle whose unpickling would create a marker file, a torch.save of one, and
  safetensors headers that declare absurd sizes are each refused with an error naming the reason,
  by the code paths that really read them (load_snapshot, the engine's weight update,
  load_model, load_checkpoint).

Run them with `pytest -m security`.
"""

from __future__ import annotations

import inspect
import io
import json
import pickle
import shutil
import struct
from pathlib import Path

import httpx
import psutil
import pytest
import torch
from fastapi.testclient import TestClient
from safetensors import SafetensorError
from starlette.routing import Route

from configs.sections import EngineConfig
from infra.engines.cpu import CpuEngine
from infra.engines.process import cpu_engine_process
from infra.engines.server import OPEN_PATHS, create_app, serve
from infra.engines.sglang import sglang_server_args
from infra.manifest import MANIFEST_NAME, ManifestError, build_manifest
from infra.modelfactory import load_model
from infra.ports import free_port_block
from infra.seaweed import SeaweedServer
from infra.storage import RunStore
from tasks.checkpoints import checkpoint_prefix, load_checkpoint, save_checkpoint
from tasks.snapshots import load_snapshot, publish_snapshot_dir, snapshot_prefix
from tests.conftest import committed_model_dir

pytestmark = pytest.mark.security

API_KEY = "security-test-key"
LOOPBACK = {"127.0.0.1", "::1"}
MAX_RSS_GROWTH_MB = 300


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return committed_model_dir(tmp_path_factory.mktemp("model") / "v0", seed=0)


def listening_addresses(pid: int) -> set[tuple[str, int]]:
    """(ip, port) of every TCP socket process `pid` and its children listen on."""
    process = psutil.Process(pid)
    return {
        (conn.laddr.ip, conn.laddr.port)
        for proc in [process, *process.children(recursive=True)]
        for conn in proc.net_connections(kind="tcp")
        if conn.status == psutil.CONN_LISTEN
    }


# -- loopback binds --------------------------------------------------------------------------------


def test_engine_host_defaults_to_loopback():
    """Every way of starting an engine binds 127.0.0.1 unless a host is given: the config
    default, the CPU engine's process and server, and the SGLang command line."""
    assert EngineConfig().host == "127.0.0.1"
    assert inspect.signature(cpu_engine_process).parameters["host"].default == "127.0.0.1"
    assert inspect.signature(serve).parameters["host"].default == "127.0.0.1"
    command = sglang_server_args(EngineConfig(), "/models/m", 30000, "0", seed=0)
    assert command[command.index("--host") + 1] == "127.0.0.1"


@pytest.mark.slow
def test_engine_process_listens_on_loopback_only(model_dir: Path, tmp_path: Path):
    """A real engine process, started as tandem starts one, listens on 127.0.0.1 and nowhere
    else, and its API key is not on its command line (where `ps` would show it)."""
    port = free_port_block(count=1)
    with cpu_engine_process(model_dir, port, tmp_path / "engine.log", api_key=API_KEY) as engine:
        addresses = listening_addresses(engine.pid)
        assert addresses == {("127.0.0.1", port)}, addresses
        assert API_KEY not in " ".join(psutil.Process(engine.pid).cmdline())
        assert httpx.post(f"{engine.url}/generate", json={"input_ids": [1]}, timeout=10).status_code == 401


def test_seaweed_command_binds_loopback(tmp_path: Path):
    """The SeaweedFS helper's command line binds every server of `weed mini` to 127.0.0.1."""
    command = SeaweedServer(tmp_path, 20000).command()
    assert "-ip.bind=127.0.0.1" in command and "-ip=127.0.0.1" in command
    assert not any("0.0.0.0" in arg for arg in command)


@pytest.mark.s3
def test_seaweed_listens_on_loopback_only(seaweed: SeaweedServer):
    """The running SeaweedFS server (the tests' own) listens on loopback addresses only."""
    addresses = listening_addresses(seaweed.process.pid)
    assert ("127.0.0.1", seaweed.port) in addresses
    assert {ip for ip, _ in addresses} <= LOOPBACK, sorted(addresses)


# -- the API key -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(model_dir: Path):
    cpu = CpuEngine(model_dir, max_batch_size=4, weight_version="0")
    yield cpu
    cpu.shutdown()


def test_api_key_guards_every_route_but_health(engine: CpuEngine):
    """With an API key set, each route of the app (taken from app.routes, so a new one cannot be
    forgotten), in each of its methods, answers 401 without the key and to every wrong form of
    it, and something other than 401 with it; /health alone stays open."""
    app = create_app(engine, api_key=API_KEY)
    routes = [(method, route.path) for route in app.routes if isinstance(route, Route) for method in route.methods]
    assert ("POST", "/generate") in routes and ("POST", "/update_weights_from_disk") in routes
    wrong = [{}, {"Authorization": "Bearer not-the-key"}, {"Authorization": API_KEY},
             {"Authorization": f"Bearer {API_KEY[:-1]}"}, {"Authorization": f"Basic {API_KEY}"}]  # fmt: skip
    with TestClient(app) as client:
        for method, path in routes:
            for headers in wrong:
                status = client.request(method, path, headers=headers).status_code
                assert status == (200 if path in OPEN_PATHS else 401), (method, path, headers, status)
            keyed = client.request(method, path, headers={"Authorization": f"Bearer {API_KEY}"})
            assert keyed.status_code != 401, (method, path)
        assert client.get("/no-such-route").status_code == 401, "unknown paths are refused before routing"
        assert client.get("/server_info", headers={"Authorization": f"Bearer {API_KEY}"}).json()["paused"] is False


# -- reading a run directory runs no code ----------------------------------------------------------


class RunsCode:
    """Unpickling this creates the file `marker`: any code could run in its place."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def pickle_payload(marker: Path) -> bytes:
    return pickle.dumps(RunsCode(marker))


def torch_save_payload(marker: Path) -> bytes:
    buffer = io.BytesIO()
    torch.save({"model.embed_tokens.weight": RunsCode(marker)}, buffer)
    return buffer.getvalue()


def huge_header_length(marker: Path) -> bytes:
    """A safetensors file whose 8-byte header length says 2^40 (1 TiB of JSON)."""
    return struct.pack("<Q", 2**40) + b"{}"


def huge_tensor(marker: Path) -> bytes:
    """A well-formed safetensors header declaring one float32 tensor of 10^12 elements (4 TB)."""
    header = json.dumps({"w": {"dtype": "F32", "shape": [10**6, 10**6], "data_offsets": [0, 4 * 10**12]}})
    return struct.pack("<Q", len(header)) + header.encode() + b"\0" * 64


@pytest.mark.parametrize("payload", [pickle_payload, torch_save_payload])
def test_the_pickle_payloads_run_code_when_unpickled(payload, tmp_path: Path):
    """The payloads are live: unpickled the unsafe way, they do create the marker. (So the tests
    below, which see no marker, show that tandem never unpickles them.)"""
    marker = tmp_path / "marker"
    data = payload(marker)
    if payload is pickle_payload:
        pickle.loads(data).close()  # the payload's "code" is open(marker, "w")
    else:
        torch.load(io.BytesIO(data), weights_only=False)["model.embed_tokens.weight"].close()
    assert marker.exists()


def _status_kb(field: str) -> int:
    """A memory figure of this process from /proc/self/status, in kB."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(f"{field}:"))
    return int(line.split()[1])


class Guard:
    """Records the peak RSS around a load; `check` asserts no code ran and nothing ballooned.

    The peak is reset first (writing 5 to /proc/self/clear_refs resets VmHWM): the process's
    lifetime peak (ru_maxrss), which an earlier test in a full run has already raised, would hide
    any load that stayed under it."""

    def __init__(self, marker: Path):
        self.marker = marker
        Path("/proc/self/clear_refs").write_text("5")
        self.rss_kb = _status_kb("VmRSS")

    def check(self) -> None:
        assert not self.marker.exists(), "unpickling ran code"
        grown_mb = (_status_kb("VmHWM") - self.rss_kb) / 1024
        assert grown_mb < MAX_RSS_GROWTH_MB, f"peak RSS grew by {grown_mb:.0f} MB"


def _weights_named_by_config(snapshot: Path) -> None:
    config = json.loads((snapshot / "config.json").read_text())
    (snapshot / "config.json").write_text(json.dumps(config | {"transformers_weights": "adapter_model.bin"}))


NO_SAFETENSORS = "no *.safetensors file"
"""The engine reads safetensors files only, so a snapshot without one is refused before any .bin is read."""
SNAPSHOT_CASES = {
    # id: (file the payload becomes, payload, drop model.safetensors, extra damage,
    #      reason in the engine's refusal, reason in load_model's)
    "pickle as model.safetensors": ("model.safetensors", pickle_payload, False, None, "header too large", "header too large"),
    "torch.save as model.safetensors": ("model.safetensors", torch_save_payload, False, None, "header too large",
                                        "header too large"),
    "pickle as pytorch_model.bin": ("pytorch_model.bin", pickle_payload, True, None, NO_SAFETENSORS,
                                    "no file named model.safetensors"),
    "torch.save as pytorch_model.bin": ("pytorch_model.bin", torch_save_payload, True, None, NO_SAFETENSORS,
                                        "no file named model.safetensors"),
    "torch.save named by config.json": ("adapter_model.bin", torch_save_payload, True, _weights_named_by_config,
                                        NO_SAFETENSORS, "Weights only load failed"),
    "header length of 2^40": ("model.safetensors", huge_header_length, False, None, "header too large", "header too large"),
    "tensor of 10^12 elements": ("model.safetensors", huge_tensor, False, None, "incomplete metadata",
                                 "incomplete metadata"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(SNAPSHOT_CASES), ids=list(SNAPSHOT_CASES))
def test_hostile_snapshot_runs_no_code(case, engine, file_store: RunStore, model_dir: Path, tmp_path: Path):
    """A snapshot committed by a hostile producer (its manifest agrees with the payload) is
    fetched by load_snapshot like any other, then refused, with the reason, by the engine's
    /update_weights_from_disk (a 400, the old weights serving on) and by load_model (the
    trainer's loader); no code runs and memory does not balloon."""
    name, payload, drop_safetensors, damage, engine_reason, loader_reason = SNAPSHOT_CASES[case]
    marker = tmp_path / "marker"
    hostile = shutil.copytree(model_dir, tmp_path / "hostile")
    if drop_safetensors:
        (hostile / "model.safetensors").unlink()
    (hostile / name).write_bytes(payload(marker))
    if damage:
        damage(hostile)
    publish_snapshot_dir(file_store, hostile, 1)

    guard = Guard(marker)
    local = load_snapshot(file_store, tmp_path / "cache", 1)
    with TestClient(create_app(engine)) as client:
        answer = client.post("/update_weights_from_disk", json={"model_path": str(local), "weight_version": "1"})
        assert answer.status_code == 400, answer.text[:1000]
        assert engine_reason in answer.json()["message"]
        assert client.get("/model_info").json()["weight_version"] == "0"
    with pytest.raises((OSError, SafetensorError, pickle.UnpicklingError)) as refused:
        load_model(local)
    assert loader_reason in str(refused.value)
    guard.check()


def test_tampered_snapshot_is_refused_before_it_is_read(file_store: RunStore, model_dir: Path, tmp_path: Path):
    """A payload swapped into a committed snapshot behind its manifest's back is refused by
    load_snapshot (size/sha256 mismatch) before anything reads it; a stray pickle added next to
    the listed files is not even copied to where the engine loads from."""
    publish_snapshot_dir(file_store, model_dir, 1)
    snapshot = file_store.local_path(snapshot_prefix(1))
    marker = tmp_path / "marker"
    (snapshot / "pytorch_model.bin").write_bytes(torch_save_payload(marker))
    guard = Guard(marker)
    fetched = load_snapshot(file_store, tmp_path / "cache", 1)
    assert not (fetched / "pytorch_model.bin").exists()

    (snapshot / "model.safetensors").write_bytes(pickle_payload(marker))
    with pytest.raises(ManifestError, match="model.safetensors: size"):
        load_snapshot(file_store, tmp_path / "cache2", 1)
    guard.check()


CHECKPOINT_CASES = {
    # id: (file of the checkpoint replaced, payload, reason in the error)
    "pickle as model.safetensors": ("model.safetensors", pickle_payload, "header too large"),
    "torch.save as optimizer.safetensors": ("optimizer.safetensors", torch_save_payload, "header too large"),
    "header length of 2^40 in rng.safetensors": ("rng.safetensors", huge_header_length, "header too large"),
    "tensor of 10^12 elements as model.safetensors": ("model.safetensors", huge_tensor, "incomplete metadata"),
}


@pytest.mark.parametrize("case", list(CHECKPOINT_CASES), ids=list(CHECKPOINT_CASES))
def test_hostile_checkpoint_runs_no_code(case, file_store: RunStore, model_dir: Path, tmp_path: Path):
    """A checkpoint whose file is replaced by a payload is refused by load_checkpoint, with the
    reason: recommitted by a hostile writer, safetensors refuses the file; swapped behind the
    manifest's back, the manifest check refuses it first. No code runs either way."""
    name, payload, reason = CHECKPOINT_CASES[case]
    model = load_model(model_dir)
    optimizer = torch.optim.AdamW(model.parameters())
    assert save_checkpoint(file_store, 1, model, optimizer, ledger=["rollouts/v00000000/gen0-000000.parquet"])
    checkpoint = file_store.local_path(checkpoint_prefix(1))
    marker = tmp_path / "marker"
    (checkpoint / name).write_bytes(payload(marker))

    guard = Guard(marker)
    with pytest.raises(ManifestError, match=f"{name}: size"):
        load_checkpoint(file_store, model, optimizer, tmp_path / "cache", 1)
    manifest = json.loads((checkpoint / MANIFEST_NAME).read_text())
    (checkpoint / MANIFEST_NAME).write_text(json.dumps(build_manifest(checkpoint, extra=manifest.get("extra"))))
    with pytest.raises(SafetensorError, match=reason):
        load_checkpoint(file_store, model, optimizer, tmp_path / "cache", 1)
    guard.check()
