"""The fault matrix: does a run survive what goes wrong on a real cluster, losing nothing and
training nothing twice?

Each row runs the tiny pipeline on SeaweedFS (a real S3 server on loopback) with one fault
injected at a seeded random point after the first snapshot past v0 is published, lets the run
finish (a killed trainer is resumed with the same command, as a user would), and then checks
the run directory, not the processes' word for it:

- finished: the run did all its work, its summary (written after the last step; the runs skip
  the held-out evaluations, `env.eval_prompts: 0`, which no fault touches) counts every step (deployed: the pipeline flow run Completed); the pipeline's
  exit code is reported beside it;
- identity: generated = trained + dropped_stale + dropped_no_signal + quarantined + duplicate + pending
  (tasks/report.py `accounting`, which counts what generators recorded and what the ledger says);
- trained twice: group ids that occur more than once in the ledger's trained groups;
- lag violations: trained samples whose policy_version is more than max_lag behind the step
  that trained them, read from the trained shards themselves (the k-th batch of the ledger
  was trained at version k);
- recovery: seconds from the fault to the next trained step (the trainer's step records).

A row survived when it finished, the identity held, and nothing was trained twice or past
max_lag. The embedded faults (the first seven) run `tandem run` (`python -m flows.cli run`) against one Prefect
server that the matrix starts (rather than each run's ephemeral one, whose start-up times out
on a loaded 2-core machine); the last one restarts the Prefect server under a deployed run
(benchmarks/prefect_restart.py).

Usage: python benchmarks/faults.py [--quick] [--only 1,5,...] [--seed N] [--steps K] [--out FILE] [--keep DIR]
--quick runs the first four faults. The last line is `faults_survived: K/N`.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from rich.console import Console

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from configs.sections import StorageConfig  # noqa: E402
from flows.cli import run_command  # noqa: E402
from infra.prefect_server import PrefectServer, descendants  # noqa: E402
from infra.seaweed import SeaweedServer, free_s3_port  # noqa: E402
from infra.storage import RunStore, open_run_store  # noqa: E402
from tasks.ledger import LEDGER_KEY  # noqa: E402
from tasks.metrics import read_metrics  # noqa: E402
from tasks.checkpoints import latest_checkpoint_step  # noqa: E402
from tasks.report import SUMMARY_KEY, accounting, train_steps  # noqa: E402
from tasks.shards import list_shards, parse_shard_key, shard_key  # noqa: E402
from tasks.snapshots import latest_version, snapshot_prefix  # noqa: E402

console = Console(stderr=True)
BUCKET, KEY, SECRET = "faults", "faults-key", "faults-secret"
PROMPTS_PER_STEP, MAX_LAG = 4, 1
RUN_TIMEOUT_S = 400.0
OUTAGE_SECONDS = 10.0


@dataclass
class EmbeddedRun:
    """One `tandem run` on the matrix's SeaweedFS, in a session of its own."""

    name: str
    seaweed: SeaweedServer
    work_dir: Path
    steps: int
    prefect_env: dict[str, str]
    struck_at: float | None = None
    """When a fault that waits for its moment struck (time.time()); None: when it was called."""
    process: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def storage(self) -> StorageConfig:
        return StorageConfig(root=f"s3://{BUCKET}/runs", endpoint_url=self.seaweed.endpoint_url, key=KEY, secret=SECRET)

    @property
    def store(self) -> RunStore:
        return open_run_store(self.storage, self.name)

    def start(self) -> None:
        overrides = [
            f"run_id={self.name}", f"storage.root={self.storage.root}", f"storage.endpoint_url={self.seaweed.endpoint_url}",
            f"training.steps={self.steps}", "training.warmup_steps=5", f"training.prompts_per_step={PROMPTS_PER_STEP}",
            "training.checkpoint_every=2", "generation.prompts_per_chunk=2", "env.eval_prompts=0",
            f"lag.max_lag={MAX_LAG}", "dask.n_workers=1",
        ]  # fmt: skip
        env = os.environ | self.prefect_env | {"AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET}
        with open(self.work_dir / f"{self.name}.log", "ab") as log:
            self.process = subprocess.Popen(
                run_command(ROOT / "configs" / "tiny.yaml", overrides),
                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def wait(self, timeout: float = RUN_TIMEOUT_S) -> int | None:
        """The run's exit code, or None if it was still going after `timeout` (it is killed)."""
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def finished(self) -> bool:
        """Whether the run did all its work: its summary (written after the last step) counts
        every step."""
        try:
            return json.loads(self.store.read_bytes(SUMMARY_KEY))["steps"] == self.steps
        except FileNotFoundError:
            return False

    def kill(self) -> None:
        """SIGKILL the run's whole process group (the pipeline, its engines, its Dask workers)."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(30)

    def children(self, marker: str) -> list[int]:
        """PIDs of the run's processes whose command line contains `marker`."""
        found = []
        for pid in descendants(self.process.pid):
            try:
                if marker in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    found.append(pid)
            except OSError:
                continue
        return found


# -- the faults: each injects its fault into a running run and says what it did -------------


def kill_engine(run: EmbeddedRun, rng: random.Random) -> str:
    """SIGKILL one of the generator's engines a seeded 0-3 s after its generator has its engines
    on a snapshot past v0 (by its metrics records, written within seconds): the row shows that
    the engine comes back on the fleet's weights, not the initial model's. Killed between the
    first publish and that load, it would come back on v0, rightly, and show nothing: a race
    with the generator's next poll that tests/test_faults.py, which asserts a restart past v0,
    could lose."""
    deadline = time.monotonic() + 120
    while not _engines_past_v0(run.store):
        if run.process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the generator's engines never loaded a snapshot past v0")
        time.sleep(0.1)
    time.sleep(rng.uniform(0.0, 3.0))
    victim = rng.choice(run.children("engine serve"))
    run.struck_at = time.time()
    os.kill(victim, signal.SIGKILL)
    return f"engine pid {victim} SIGKILLed"


def _engines_past_v0(store: RunStore) -> bool:
    for key in store.list("metrics"):
        component = key.rsplit("/", 1)[-1].removesuffix(".jsonl")
        if component.startswith("generator-") and any(
            r["event"] in ("engines_started", "weights_loaded") and r["version"] >= 1 for r in read_metrics(store, component)
        ):
            return True
    return False


def kill_dask_worker(run: EmbeddedRun, rng: random.Random) -> str:
    victim = rng.choice(run.children("multiprocessing.spawn"))
    os.kill(victim, signal.SIGKILL)
    return f"Dask worker pid {victim} SIGKILLed"


def kill_trainer(run: EmbeddedRun, rng: random.Random) -> str:
    """The embedded trainer is the pipeline process: SIGKILL it (and everything it started, as
    a preempted node would), then resume with the same command. It strikes a seeded 0-3 s
    after the first checkpoint, so that there is one to resume from."""
    store, deadline = run.store, time.monotonic() + 120
    while latest_checkpoint_step(store) is None and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(rng.uniform(0.0, 3.0))
    run.struck_at = time.time()
    run.kill()
    run.start()
    return "pipeline process group SIGKILLed, resumed with the same command"


def stop_storage(run: EmbeddedRun, rng: random.Random) -> str:
    """Stop SeaweedFS (SIGKILL if it is not gone within 2 s: a graceful stop can take 30 s while
    its volume server drains, longer than the outage itself) and start it again on the same
    directory and ports `OUTAGE_SECONDS` later. The fault strikes once the server's process is
    gone: while it shuts down it may still answer, and a step that published in those moments
    was trained before the outage, not during it."""
    run.seaweed.stop(timeout=2.0)
    run.struck_at, down = time.time(), time.monotonic()
    time.sleep(OUTAGE_SECONDS)
    run.seaweed.start()
    return f"SeaweedFS stopped for {time.monotonic() - down:.0f} s, started again on the same directory"


def _next_new_shard(store: RunStore, timeout: float = 60.0) -> str:
    """The first shard committed from now on: the one least likely to be trained already (the
    trainer looks for new shards every 0.2 s)."""
    known = set(list_shards(store))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if new := sorted(set(list_shards(store)) - known):
            return new[0]
        time.sleep(0.02)
    raise TimeoutError(f"no new shard in {timeout:.0f} s")


def corrupt_shard(run: EmbeddedRun, rng: random.Random) -> str:
    """Flip 16 bytes in the middle of the next shard to be committed, overwriting it in place."""
    store = run.store
    key = _next_new_shard(store)
    data = bytearray(store.read_bytes(key))
    middle = len(data) // 2
    data[middle : middle + 16] = bytes(b ^ 0xFF for b in data[middle : middle + 16])
    run.struck_at = time.time()
    store.write_atomic(key, bytes(data))
    return f"16 bytes flipped in {key}"


def duplicate_shard(run: EmbeddedRun, rng: random.Random) -> str:
    """Copy the next shard to be committed under a second key in its own version directory, so
    that it passes every check of a shard's own content. The copy's sequence number is one an
    older version directory already used (so no generator will ever write that key) and sorts
    before the original's, so the trainer, which takes the oldest first, meets the copy first."""
    store = run.store
    key = _next_new_shard(store)
    name = parse_shard_key(key)
    here = {parse_shard_key(k).seq for k in list_shards(store, min_version=name.version, max_version=name.version)}
    older = [parse_shard_key(k).seq for k in list_shards(store, max_version=name.version - 1) if parse_shard_key(k).producer == name.producer]
    free = sorted(seq for seq in older if seq not in here and seq < name.seq)
    copy = shard_key(name.version, name.producer, free[-1] if free else 999_999)
    run.struck_at = time.time()
    store.put_if_absent(copy, store.read_bytes(key))
    return f"{key} copied to {copy}"


def truncate_snapshot(run: EmbeddedRun, rng: random.Random) -> str:
    """Wait for the next snapshot and cut its safetensors to half, after its manifest (and
    LATEST) were written: the generators see a committed snapshot whose weights are damaged."""
    store = run.store
    seen = latest_version(store)
    deadline = time.monotonic() + 60
    while (version := latest_version(store)) == seen and time.monotonic() < deadline:
        time.sleep(0.02)
    key = f"{snapshot_prefix(version)}/model.safetensors"
    data = store.read_bytes(key)
    run.struck_at = time.time()
    store.write_atomic(key, data[: len(data) // 2])
    return f"{key} truncated from {len(data)} to {len(data) // 2} bytes"


EMBEDDED_FAULTS: dict[str, Callable[[EmbeddedRun, random.Random], str]] = {
    "engine SIGKILL": kill_engine,
    "Dask worker SIGKILL": kill_dask_worker,
    "trainer SIGKILL, resumed": kill_trainer,
    "SeaweedFS down 10 s": stop_storage,
    "shard corrupted in place": corrupt_shard,
    "shard duplicated": duplicate_shard,
    "snapshot truncated": truncate_snapshot,
}
PREFECT_RESTART = "Prefect server restarted (deployed)"
FAULTS = [*EMBEDDED_FAULTS, PREFECT_RESTART]
QUICK = FAULTS[:4]


def run_embedded_fault(name: str, seaweed: SeaweedServer, prefect: PrefectServer, work_dir: Path, rng: random.Random,
                       steps: int) -> dict:  # fmt: skip
    run = EmbeddedRun(f"fault{FAULTS.index(name) + 1}", seaweed, work_dir, steps, prefect.env())
    run.start()
    try:
        _wait_for_first_publish(run.store, run.process)
        time.sleep(rng.uniform(0.0, 3.0))
        fault_at = time.time()
        injected = True
        try:
            detail = EMBEDDED_FAULTS[name](run, rng)
        except Exception as err:  # the run goes on; the row says the fault never struck
            injected, detail = False, f"fault not injected: {type(err).__name__}: {err}"
        exit_code = run.wait()
    finally:
        run.kill()
    return {"finished": run.finished(), "exit_code": exit_code, "injected": injected, "store": run.store,
            "fault_at": run.struck_at or fault_at, "detail": detail, "log": str(work_dir / f"{run.name}.log")}  # fmt: skip


def _wait_for_first_publish(store: RunStore, process: subprocess.Popen, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the run exited ({process.returncode}) before its first snapshot")
        try:
            if (latest_version(store) or 0) >= 1:
                return
        except (FileNotFoundError, ValueError):
            pass
        time.sleep(0.1)
    raise TimeoutError(f"no snapshot past v0 in {timeout:.0f} s")


# -- the checks ------------------------------------------------------------------------------


def check_run(store: RunStore, max_lag: int, fault_at: float) -> dict:
    """What the run directory says about the run after its fault."""
    counts = accounting(store)
    ledger = json.loads(store.read_bytes(LEDGER_KEY))
    trained_twice = sum(n - 1 for n in Counter(ledger["trained_groups"]).values() if n > 1)
    # A step whose publish began before the fault was trained before it (its record is written
    # once the publish returns, which a storage outage holds up).
    steps_after = [r["time"] for r in train_steps(store) if r["time"] - r["publish_seconds"] > fault_at]
    return {
        "identity_holds": counts["identity_holds"], "accounting": counts, "trained_twice": trained_twice,
        "lag_violations": _lag_violations(store, ledger, max_lag),
        "recovery_seconds": round(min(steps_after) - fault_at, 1) if steps_after else None,
        "steps": len(train_steps(store)), "recovery": recovery_events(store, ledger),
    }  # fmt: skip


def recovery_events(store: RunStore, ledger: dict) -> list[str]:
    """What the run's own records say it did about the fault, in words."""
    events = []
    for key in store.list("metrics"):
        component = key.rsplit("/", 1)[-1].removesuffix(".jsonl")
        for r in read_metrics(store, component):
            if r["event"] == "engines_restarted":
                events.append(f"{component}: engine restarted on v{r['version']}")
            elif r["event"] == "snapshot_rejected":
                events.append(f"{component}: snapshot v{r['version']} rejected ({r['reason'][:80]})")
            elif r["event"] == "resumed":
                events.append(f"{component}: resumed from the step-{r['version']} checkpoint")
            elif r["event"] == "withdrawn":
                events.append(f"{component}: withdrew {', '.join(f'v{v}' for v in r['versions'])}, published after the "
                              f"step-{r['checkpoint']} checkpoint")  # fmt: skip
            elif r["event"] == "orphans_reclaimed":
                events.append(f"{component}: {len(r['slots'])} orphaned slots regenerated")
    quarantined = [k for k, fate in ledger["disposed"].items() if fate == "quarantined"]
    duplicates = [k for k, fate in ledger["disposed"].items() if fate == "duplicate"]
    events += [f"quarantined {k}" for k in quarantined] + [f"duplicate {k} not trained" for k in duplicates]
    return events


def _lag_violations(store: RunStore, ledger: dict, max_lag: int) -> int:
    """Trained samples more than `max_lag` behind the version that trained them. The ledger's
    trained groups are in training order, `prompts_per_step` a step, so the group at position i
    was trained at version i // prompts_per_step; each sample's policy_version is read from the
    trained shard itself."""
    versions_by_group: dict[str, list[int]] = {}
    for key, fate in ledger["disposed"].items():
        if fate == "trained":
            try:
                table = pq.read_table(io.BytesIO(store.read_bytes(key)), columns=["group_id", "policy_version"])
            except (OSError, pa.ArrowException):  # damaged after it was trained (the corruption fault):
                name = parse_shard_key(key)  # its key still names its slot and its oldest sample's version
                versions_by_group[f"s{name.seq:08d}"] = [name.version]
                continue
            versions_by_group[table["group_id"][0].as_py()] = table["policy_version"].to_pylist()
    violations = 0
    for position, group in enumerate(ledger["trained_groups"]):
        trained_at = position // PROMPTS_PER_STEP
        violations += sum(1 for v in versions_by_group.get(group, []) if trained_at - v > max_lag)
    return violations


def survived(row: dict) -> bool:
    """Finished, identity held, nothing trained twice or past max_lag; and the fault did strike."""
    checks = row.get("identity_holds") and row.get("trained_twice") == 0 and row.get("lag_violations") == 0
    return bool(row["injected"] and row["finished"] and checks)


def run_fault(name: str, seaweed: SeaweedServer, prefect: PrefectServer, work_dir: Path, seed: int, steps: int) -> dict:
    rng = random.Random(f"{seed}-{name}")
    started = time.monotonic()
    if name == PREFECT_RESTART:
        from benchmarks.prefect_restart import run_with_prefect_restart

        outcome = run_with_prefect_restart(work_dir / "deployed", seaweed, seed, steps=steps)
        max_lag = outcome["max_lag"]
    else:
        outcome = run_embedded_fault(name, seaweed, prefect, work_dir, rng, steps)
        max_lag = MAX_LAG
    row = {"fault": name, "injected": outcome.get("injected", True), "finished": outcome["finished"], "exit_code": outcome.get("exit_code"),
           "detail": outcome["detail"], "log": outcome.get("log")}  # fmt: skip
    try:
        row |= check_run(outcome["store"], max_lag, outcome["fault_at"])
    except Exception as err:  # a run that died may have no ledger: it did not survive, say why
        row |= {"check_error": f"{type(err).__name__}: {err}"}
    row["survived"] = survived(row)
    row["seconds"] = round(time.monotonic() - started, 1)
    return row


def markdown_table(rows: list[dict]) -> str:
    lines = [
        "| fault | finished | exit code | identity | trained twice | lag violations | recovery s | survived |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        recovery = "-" if r.get("recovery_seconds") is None else f"{r['recovery_seconds']:.1f}"
        lines.append(
            f"| {r['fault']} | {_yes(r['finished'])} | {'-' if r.get('exit_code') is None else r['exit_code']} "
            f"| {_yes(r.get('identity_holds'))} | {r.get('trained_twice', '-')} "
            f"| {r.get('lag_violations', '-')} | {recovery} | {_yes(r['survived'])} |"
        )
    return "\n".join(lines)


def _yes(value) -> str:
    return "-" if value is None else ("yes" if value else "NO")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"only the first four faults ({', '.join(QUICK)})")
    parser.add_argument("--only", help="comma-separated fault numbers (1-8) to run")
    parser.add_argument("--seed", type=int, default=0, help="seeds where each fault strikes")
    parser.add_argument("--steps", type=int, default=12, help="training steps per run")
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    parser.add_argument("--keep", type=Path, help="keep the runs' logs and SeaweedFS data in this directory")
    args = parser.parse_args(argv)
    chosen = QUICK if args.quick else FAULTS
    if args.only:
        chosen = [FAULTS[int(n) - 1] for n in args.only.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="tandem-faults-") as tmp:
        work_dir = args.keep or Path(tmp)
        work_dir.mkdir(parents=True, exist_ok=True)
        seaweed = SeaweedServer(work_dir / "s3", free_s3_port()).start()
        prefect = PrefectServer(work_dir / "prefect").start()
        try:
            for name in chosen:
                console.print(f"[bold]{name}[/bold] ...")
                row = run_fault(name, seaweed, prefect, work_dir, args.seed, args.steps)
                console.print(f"  {'survived' if row['survived'] else 'NOT survived'} in {row['seconds']:.0f} s: {row['detail']}")
                if not row["survived"]:
                    console.print(f"  {json.dumps({k: v for k, v in row.items() if k != 'detail'})}")
                    console.print(f"  log: {row.get('log')} (kept with --keep DIR)")
                rows.append(row)
        finally:
            prefect.stop()
            seaweed.stop()
    table = markdown_table(rows)
    print(table)
    survivors = sum(r["survived"] for r in rows)
    if args.out:
        args.out.write_text(json.dumps({"seed": args.seed, "steps": args.steps, "max_lag": MAX_LAG, "rows": rows,
                                        "faults_survived": survivors, "faults": len(rows)}, indent=2) + "\n")  # fmt: skip
    print(f"faults_survived: {survivors}/{len(rows)}")
    return 0 if survivors == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
