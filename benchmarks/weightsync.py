"""Weight sync: how long from the trainer publishing version v to every engine serving it?

    python benchmarks/weightsync.py [--out FILE] [--quick]

For the tiny model and a random-init Llama of about 100M parameters, on file:// and on a
SeaweedFS server this script starts on loopback, two ways of moving the same snapshot bytes:

- tandem: `publish_snapshot` (save_pretrained into staging, sha256 manifest, upload, manifest
  last, LATEST), then what a generator does: `load_snapshot` (download into staging, sha256 of
  every file, rename into place) and `EngineFleet.update_weights` (pause -> update_weights_from_disk
  -> continue on every engine, each loading the weights into its live model), until every engine
  reports version v. Two CPU engines.
- raw: the snapshot's files, already saved, `put_file` to the same storage and `get_file` back
  into a local directory: moving the bytes and nothing else (no serialising, hashing or loading).

ratio = tandem seconds / raw seconds; the last line is `worst_sync_ratio_vs_raw: X`, the largest
ratio of all rows (target <= 1.5). Each is the median of repeats (15 for the tiny model, whose
milliseconds one stray writeback moves; 5 for the 100M one), taking turns, and each repeat starts
with the page cache written back (os.sync): on this machine's disk the writeback of one 453 MB
repeat otherwise landed in the next one's time, and the raw copy of the same bytes ranged from
1.3 s to 6.7 s between invocations.

Beside them, the floor: what no sync that serialises the weights as HF files and moves them
through storage to engines that speak SGLang's API can avoid. It is measured, not summed:
`save_pretrained` of the model and tokenizer into a scratch directory, then the same `put_file` and `get_file`
of the files just written (so that their writeback lands where it lands in a real sync: the raw
copy's files were written long before), plus the engine contract's three calls to every engine,
engines side by side (pause, a call in place of the load: /model_info, continue). tandem / floor
is what tandem's own work adds (manifest hashes, the fetch's verification, the engines' checks and
loads); on file:// it can come in under 1, since tandem links the files where the floor copies
them. A sync that checks what it moved also hashes it twice at least, once to write the manifest
and once to verify what was fetched: "verified floor" adds two sha256 passes over the snapshot's
files (measured apart) to the floor. Where that exceeds 1.5x the raw copy, the row's target is out
of reach of a verified sync through storage, and the table says so.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from rich.console import Console

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from configs.sections import EngineConfig, ModelConfig, StorageConfig  # noqa: E402
from infra.engines.fleet import EngineFleet  # noqa: E402
from infra.manifest import sha256_file  # noqa: E402
from infra.modelfactory import load_model, load_tokenizer, save_tiny_model  # noqa: E402
from infra.seaweed import SeaweedServer, free_s3_port  # noqa: E402
from infra.storage import open_run_store  # noqa: E402
from tasks.snapshots import load_snapshot, publish_snapshot  # noqa: E402

console = Console(stderr=True)
TARGET = 1.5
"""The issue's target: a sync within this many times the raw copy."""
MODELS = {
    "tiny": ModelConfig(),
    "100M": ModelConfig(hidden_size=768, num_layers=12, num_heads=12, intermediate_size=3072),
}


def tandem_sync(store, model, tokenizer, version: int, fleet: EngineFleet, cache: Path) -> float:
    os.sync()
    started = time.monotonic()
    publish_snapshot(store, model, tokenizer, version)
    local = load_snapshot(store, cache, version)
    results = fleet.update_weights(local, version)
    seconds = time.monotonic() - started
    if not all(r.ok and r.weight_version == str(version) for r in results):
        raise RuntimeError(f"engines did not all load v{version}: {results}")
    return seconds


def raw_copy(store, files: list[Path], repeat: int, scratch: Path) -> float:
    os.sync()
    started = time.monotonic()
    _put_and_get(store, files, f"raw{repeat}", scratch)
    return time.monotonic() - started


def serialised_copy(store, model, tokenizer, repeat: int, scratch: Path) -> float:
    """save_pretrained (model and tokenizer, as a snapshot holds), then `raw_copy`'s put and get
    of the files it wrote."""
    written = scratch / f"serialised{repeat}"
    os.sync()
    started = time.monotonic()
    model.save_pretrained(written)
    tokenizer.save_pretrained(written)
    _put_and_get(store, sorted(written.iterdir()), f"serialised{repeat}", scratch)
    return time.monotonic() - started


def _put_and_get(store, files: list[Path], name: str, scratch: Path) -> None:
    """`files` to `{store}/{name}/` with put_file, then back into `scratch/{name}-fetched/` with get_file."""
    fs, base, target = store.fs, f"{store.base}/{name}", scratch / f"{name}-fetched"
    target.mkdir(parents=True)
    if store.protocol == "file":
        fs.makedirs(base, exist_ok=True)  # a local filesystem needs the directory; S3 has none
    for path in files:
        fs.put_file(str(path), f"{base}/{path.name}")
    for path in files:
        fs.get_file(f"{base}/{path.name}", str(target / path.name))


def sha256_seconds(files: list[Path]) -> float:
    """One sha256 pass over `files`, as a manifest's writer or a fetch's verification makes it."""
    started = time.monotonic()
    for path in files:
        sha256_file(path)
    return time.monotonic() - started


def engine_call_seconds(urls: list[str]) -> float:
    """The contract's pause -> load -> continue as bare calls: /model_info stands in for the load."""

    async def one(client: httpx.AsyncClient, url: str) -> None:
        for method, path, body in (("POST", "/pause_generation", {"mode": "retract"}), ("GET", "/model_info", None),
                                   ("POST", "/continue_generation", {})):  # fmt: skip
            (await client.request(method, url + path, json=body)).raise_for_status()

    async def all_engines() -> float:
        async with httpx.AsyncClient(timeout=10) as client:
            await asyncio.gather(*(one(client, url) for url in urls))  # connections up, not counted
            started = time.monotonic()
            await asyncio.gather(*(one(client, url) for url in urls))
            return time.monotonic() - started

    return asyncio.run(all_engines())


def measure(backend: str, storage: StorageConfig, size: str, repeats: int, scratch: Path) -> dict:
    model_dir = save_tiny_model(MODELS[size], scratch / f"{size}-model", seed=0)
    model, tokenizer = load_model(model_dir), load_tokenizer(model_dir)
    files = sorted(p for p in model_dir.iterdir() if p.is_file())
    store = open_run_store(storage, f"weightsync-{size}")
    publish_snapshot(store, model, tokenizer, 0)
    engines = EngineFleet(EngineConfig(), 2, load_snapshot(store, scratch / f"{size}-cache", 0), 0, scratch / "logs")
    tandem, raw, floor, hashing = [], [], [], []
    with engines:
        tandem_sync(store, model, tokenizer, 1, engines, scratch / f"{size}-cache")  # warm-up, not counted
        for i in range(repeats):
            tandem.append(tandem_sync(store, model, tokenizer, 2 + i, engines, scratch / f"{size}-cache"))
            raw.append(raw_copy(store, files, i, scratch / size))
            floor.append(serialised_copy(store, model, tokenizer, i, scratch / size) + engine_call_seconds(engines.urls))
            hashing.append(sha256_seconds(files))
    megabytes = sum(p.stat().st_size for p in files) / 1e6
    t, r, f, h = statistics.median(tandem), statistics.median(raw), statistics.median(floor), statistics.median(hashing)
    return {"backend": backend, "model": size, "megabytes": megabytes, "tandem_seconds": t, "raw_seconds": r, "ratio": t / r,
            "floor_seconds": f, "floor_ratio": f / r, "ratio_vs_floor": t / f, "sha256_seconds": h,
            "verified_floor_seconds": f + 2 * h, "verified_floor_ratio": (f + 2 * h) / r}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="Write every measurement as JSON here.")
    parser.add_argument("--quick", action="store_true", help="The tiny model only, one repeat.")
    args = parser.parse_args()
    repeats = {"tiny": 1} if args.quick else {"tiny": 15, "100M": 5}
    scratch = Path(tempfile.mkdtemp(prefix="tandem-weightsync-"))
    server = SeaweedServer(scratch / "s3", free_s3_port()).start()
    results = []
    try:
        backends = {
            "file": StorageConfig(root=f"file://{scratch}/runs"),
            "s3": StorageConfig(root="s3://weightsync/runs", endpoint_url=server.endpoint_url, key="bench", secret="bench"),
        }
        for size, count in repeats.items():
            for backend, storage in backends.items():
                console.print(f"{size} model on {backend}")
                results.append(measure(backend, storage, size, count, scratch / backend))
    finally:
        server.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    print("| storage | model | MB | tandem s (publish -> all engines on v) | raw copy s | ratio | floor s | floor / raw | tandem / floor "
          "| sha256 s | verified floor / raw |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['backend']} | {r['model']} | {r['megabytes']:.1f} | {r['tandem_seconds']:.3f} | {r['raw_seconds']:.3f} "
              f"| {r['ratio']:.2f} | {r['floor_seconds']:.3f} | {r['floor_ratio']:.2f} | {r['ratio_vs_floor']:.2f} "
              f"| {r['sha256_seconds']:.3f} | {r['verified_floor_ratio']:.2f} |")  # fmt: skip
    for r in results:
        if r["verified_floor_ratio"] > TARGET:
            print(f"{r['backend']} {r['model']}: serialising, moving the files just written, the engine calls and two sha256 "
                  f"passes alone take {r['verified_floor_ratio']:.2f}x the raw copy: the {TARGET}x target is out of reach of a "
                  "verified sync through storage")  # fmt: skip
    worst = max(r["ratio"] for r in results)
    if args.out:
        args.out.write_text(json.dumps({"runs": results, "worst_sync_ratio_vs_raw": worst}, indent=2))
    print(f"worst_sync_ratio_vs_raw: {worst:.2f}")


if __name__ == "__main__":
    main()
