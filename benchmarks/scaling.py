"""Does adding inference capacity speed training up as it should? slime's scaling table, emulated.

slime on SkyPilot (Qwen3-14B GRPO, H100s) ran async: 1 -> 3 SGLang engines cut the step from
1200 s to 661 s; sync went 1697 s -> 1032 s, and the trainer's wait ratio 0.8 -> 0.4. That
implies about 1000 s of generation per batch on one engine (G1) and 700 s of training plus
weight sync (T + S). This benchmark runs tandem's real pipeline (flows, Prefect, storage,
shards, snapshots, lag control) with GPU time emulated: `engine.backend: sim` engines whose
latency model is calibrated so that one engine generates one batch in G1 seconds, and a trainer
whose step takes T (`training.simulate_step_seconds`, a real optimizer step inside it) and whose
engines take S to load a snapshot. Profiles are slime's scaled down 100x, and a generation-heavy
agentic one; any G1/T/S can be given.

Per run (N engines, max_lag) it reports the steady-state step time, the trainer's idle
fraction, the generators' idle fraction (no group in flight), and tandem's own overhead per step
(the trainer's step interval minus its pure waiting and its simulated compute: listing, reading
and validating shards, publishing, checkpointing, Prefect task runs), beside the ideal:
sync = G1/N + T + S, async = max(G1/N, T + S). The step time compared with the ideal is the
mean over the measured steps (their span / their count), which is the run's throughput; the
median is reported beside it, but an async run trains in bursts (a backlog of max_lag + 1
batches, then a wait), and the median of a burst pattern is its short interval. Sync runs also
report the median batch generation span (first group started -> last committed), which is
what G1/N stands for in the ideal. Async runs skip max_lag + 1 warm-up steps (at least
--warmup; --quick skips 1 everywhere), the start-up backlog that admission lets them build. The last line is
`worst_async_ratio_vs_ideal: X`.

Usage: python benchmarks/scaling.py [--quick] [--out FILE] [--plot FILE] [--g1 S --t S --s S]
       [--engines 1,2,3,4] [--lags 0,1,2] [--steps K] [--warmup K] [--time-scale F] [--set FIELD=VALUE]
       [--runs-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.console import Console

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.floor import floor_seconds  # noqa: E402
from configs.sections import EngineConfig, SimLatencyConfig  # noqa: E402
from flows.cli import run_command  # noqa: E402
from infra.prefect_server import PrefectServer  # noqa: E402
from infra.scratch import scratch_dir  # noqa: E402

console = Console(stderr=True)

PROMPTS_PER_STEP, SAMPLES = 16, 8
BATCH = PROMPTS_PER_STEP * SAMPLES
MAX_NEW_TOKENS, LENGTH_MEDIAN, LENGTH_SIGMA = 40, 12.0, 0.8
DECODE_BASE_S, PREFILL_S_PER_TOKEN, PROMPT_TOKENS = 0.001, 1e-5, 8
RUNNING_CAP = EngineConfig().max_batch_size
"""Sequences an engine decodes at once: tandem's default (32), about what one H100 holds in KV
cache for a 14B model at agentic context lengths (160 KB a token, ~50 GB free: ~20 sequences of
16k tokens). Not a whole batch: a GPU queues the rest, and serves them first come, first served."""
RUN_TIMEOUT_SECONDS = 1800
SEED_POINTS = {1: {"async": 12.00, "sync": 16.97}, 3: {"async": 6.61, "sync": 10.32}}
"""slime's measured step times, in seconds / 100 (the profiles' units)."""


@dataclass(frozen=True)
class Profile:
    name: str
    g1: float
    """Seconds one engine takes to generate one batch."""
    t: float
    """Seconds of one training step."""
    s: float
    """Seconds of one weight sync (an engine loading a snapshot)."""

    def scaled(self, factor: float) -> Profile:
        return Profile(self.name, self.g1 * factor, self.t * factor, self.s * factor)

    def ideal(self, engines: int, sync: bool) -> float:
        return self.g1 / engines + self.t + self.s if sync else max(self.g1 / engines, self.t + self.s)


PROFILES = {"seed": Profile("seed", 10.0, 6.5, 0.3), "agentic": Profile("agentic", 15.0, 2.5, 0.3)}


def latency_for(profile: Profile, snapshot_bytes: int) -> SimLatencyConfig:
    """The sim engine's latency model that makes one engine generate one batch in G1 seconds.

    The engine runs at most RUNNING_CAP sequences and admits the rest first come, first served
    as slots free, so a batch of B sequences costs base * (decode steps) + per_seq * (total
    tokens) + prefill; per_seq follows from the expected steps and tokens, computed by replaying
    that admission over lengths drawn from the same capped lognormal the engine draws from."""
    rng = random.Random(0)
    totals, steps = [], []
    for _ in range(200):
        lengths = [min(MAX_NEW_TOKENS, max(1, round(rng.lognormvariate(math.log(LENGTH_MEDIAN), LENGTH_SIGMA)))) for _ in range(BATCH)]
        totals.append(sum(lengths))
        steps.append(_decode_steps(lengths, RUNNING_CAP))
    fixed = DECODE_BASE_S * statistics.mean(steps) + PREFILL_S_PER_TOKEN * PROMPT_TOKENS * BATCH
    per_seq = (profile.g1 - fixed) / statistics.mean(totals)
    return SimLatencyConfig(prefill_s_per_token=PREFILL_S_PER_TOKEN, decode_base_s=DECODE_BASE_S, decode_s_per_seq=per_seq,
                            length_median=LENGTH_MEDIAN, length_sigma=LENGTH_SIGMA, load_s_per_gb=profile.s / (snapshot_bytes / 1e9))  # fmt: skip


def _decode_steps(lengths: list[int], cap: int) -> int:
    """Decode steps an engine running at most `cap` sequences takes for `lengths`, admitted in order."""
    queue, running, steps = list(lengths), [], 0
    while queue or running:
        running += [queue.pop(0) for _ in range(min(len(queue), cap - len(running)))]
        running = [left - 1 for left in running if left > 1]
        steps += 1
    return steps


def tiny_snapshot_bytes() -> int:
    """Size of the tiny model's safetensors, which the sim engines' load time is scaled by."""
    from configs.sections import ModelConfig
    from infra.modelfactory import save_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        return sum(p.stat().st_size for p in save_tiny_model(ModelConfig(), Path(tmp) / "m", seed=0).glob("*.safetensors"))


class PipelineRun:
    """One pipeline run in a fresh `tandem run` process; its figures read back from its run directory.

    The benchmark starts the next run as soon as this one has recorded its last training step:
    what is left of it (the generators' stop, the summary and its plots, Dask's and Prefect's
    shutdown: about 4 s) and the next run's start (Python's imports, the engines' and workers'
    boot, its warm-up steps) fall in neither run's measured window, so they may share the two
    cores. Twenty runs save over a minute that way. The next run's start outlasts the last one's
    shutdown by far (its first group started 6-8 s after the last process exited, its measured
    steps 11 s or more after), and the benchmark warns if a measured step ever began before."""

    def __init__(self, profile: Profile, engines: int, max_lag: int, steps: int, warmup: int, root: Path, env: dict,
                 latency: SimLatencyConfig, extra: list[str] = ()):  # fmt: skip
        self.run_id = f"{profile.name}-n{engines}-lag{max_lag}"
        self.run_dir, self.warmup, self.last_version = root / self.run_id, warmup, warmup + steps
        overrides = [
            f"run_id={self.run_id}", f"storage.root=file://{root}", "engine.backend=sim", f"engine.sim={latency.model_dump_json()}",
            f"engine.max_batch_size={RUNNING_CAP}", f"generation.engines={engines}", f"generation.samples_per_prompt={SAMPLES}",
            f"generation.max_new_tokens={MAX_NEW_TOKENS}", f"generation.prompts_per_chunk={PROMPTS_PER_STEP}",
            "generation.temperature=1.0", f"training.prompts_per_step={PROMPTS_PER_STEP}", f"training.steps={warmup + steps}", "training.warmup_steps=0",
            f"training.simulate_step_seconds={profile.t}", "training.checkpoint_every=1000", "training.publish_every=1",
            f"lag.max_lag={max_lag}", "env.entrypoint=tasks.envs.arithmetic:AdditionEnv", "env.kwargs={}", "env.max_turns=1",
            "env.eval_prompts=0", "dask.n_workers=2", "dask.threads_per_worker=16", *extra,
        ]  # fmt: skip
        root.mkdir(parents=True, exist_ok=True)
        self.log_path = root / f"{self.run_id}.log"
        with self.log_path.open("wb") as log:  # a file, not a pipe: nobody reads a pipe while the run goes on
            self.process = subprocess.Popen(run_command(ROOT / "configs" / "tiny.yaml", overrides), cwd=ROOT, env=env,
                                            stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
        self.started_at, self.deadline = time.time(), time.monotonic() + RUN_TIMEOUT_SECONDS

    def wait_trained(self) -> None:
        """Return once the run has recorded its last training step (or has exited)."""
        trainer, seen = self.run_dir / "metrics" / "trainer.jsonl", -1
        while self.process.poll() is None:
            size = trainer.stat().st_size if trainer.exists() else 0
            if size != seen:
                seen = size
                records = map(json.loads, trainer.read_text().splitlines() if size else ())  # replaced whole, never half-written
                if any(r["event"] == "train_step" and r["version"] >= self.last_version for r in records):
                    return
            if time.monotonic() > self.deadline:
                raise self._stopped_overdue()
            time.sleep(0.5)

    def finish(self) -> dict:
        """Wait for the process to exit and measure the run."""
        try:
            self.process.wait(timeout=max(1.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise self._stopped_overdue() from None
        if self.process.returncode != 0:
            raise RuntimeError(f"{self.run_id} exited {self.process.returncode}; its output ({self.log_path}) ends:\n"
                               f"{self.log_path.read_text(errors='replace')[-5000:]}")  # fmt: skip
        return {**measure(self.run_dir, self.warmup), "process_started_at": self.started_at, "process_ended_at": time.time()}

    def stop(self) -> None:
        """Stop the run's process (its engines and Dask workers follow their parent)."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def _stopped_overdue(self) -> RuntimeError:
        self.stop()
        return RuntimeError(f"{self.run_id} ran past {RUN_TIMEOUT_SECONDS} s; its output: {self.log_path}")


def measure(run_dir: Path, warmup: int) -> dict:
    """Steady-state figures of a finished run, from its components' own records."""
    records = [json.loads(line) for line in (run_dir / "metrics" / "trainer.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["event"] == "train_step"]
    steps = list({r["version"]: r for r in steps}.values())
    steady = steps[warmup:]
    intervals = [b["time"] - a["time"] for a, b in zip(steps[warmup - 1:], steady)]
    overheads = [gap - r["poll_seconds"] - r["compute_seconds"] for gap, r in zip(intervals, steady)]
    window = (steps[warmup - 1]["time"], steady[-1]["time"])
    events = [json.loads(line) for f in (run_dir / "metrics").glob("generator-*.jsonl") for line in f.read_text().splitlines()]
    groups = [g for g in events if g["event"] == "group" and "started_at" in g]
    loaded_at = {e["version"]: _load_ended(e) for e in events if e["event"] == "weights_loaded"}
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "step_seconds": sum(intervals) / len(intervals),
        "median_step_seconds": statistics.median(intervals),
        "generation_span_seconds": statistics.median(_batch_spans(groups, [r["version"] for r in steady], loaded_at)),
        "trainer_idle": sum(r["wait_seconds"] for r in steady) / sum(intervals),
        "generator_idle": 1 - _covered(groups, *window) / (window[1] - window[0]),
        "overhead_seconds": statistics.median(overheads),
        "compute_seconds": statistics.median(r["compute_seconds"] for r in steady),
        "identity_holds": summary["identity_holds"], "max_trained_lag": summary["max_trained_lag"],
        "steps_measured": len(steady), "measured_from": window[0], "measured_until": window[1],
    }  # fmt: skip


def _load_ended(loaded: dict) -> float:
    """When the engines finished loading a version: its `weights_loaded` record is written once
    both the load and the work started during it are done, whichever ended last."""
    load, start = loaded.get("load_seconds", 0.0), loaded.get("start_seconds", 0.0)
    return loaded["time"] - max(load, start) + load


def _batch_spans(groups: list[dict], versions: list[int], loaded_at: dict[int, float]) -> list[float]:
    """Seconds from the first start to the last commit of the groups in the slots of each batch
    that steps `versions` trained (batch v - 1: what a sync step trains; in an async run batches
    overlap, and the span is a batch's latency, not a share of the step). A batch's groups start
    while the engines are paused to load its weights (flows/generation.py), so its span starts
    no earlier than that load ended (`loaded_at`: version -> time): generation, not the load."""
    spans = []
    for version in versions:
        batch = [g for g in groups if g["slot"] // PROMPTS_PER_STEP == version - 1]
        if batch:
            weights = min(g["policy_version"] for g in batch)
            start = max(min(g["started_at"] for g in batch), loaded_at.get(weights, float("-inf")))
            spans.append(max(g["finished_at"] for g in batch) - start)
    return spans or [float("nan")]


def _covered(groups: list[dict], start: float, end: float) -> float:
    """Seconds of [start, end] during which at least one group was in flight."""
    spans = sorted((max(g["started_at"], start), min(g["finished_at"], end)) for g in groups if g["finished_at"] > start and g["started_at"] < end)
    covered, reach = 0.0, start
    for a, b in spans:
        if b > reach:
            covered += b - max(a, reach)
            reach = b
    return covered


def plan(args) -> list[tuple[Profile, int, int]]:
    """(profile, engines, max_lag) of every run, in the order they run."""
    if args.quick:  # sync and async at 1 and 3 engines: CI checks that every part works, not the figures
        return [(PROFILES["seed"].scaled(args.time_scale), n, lag) for n in (1, 3) for lag in (0, 2)]
    if args.g1 is not None:
        profiles = {Profile("custom", args.g1, args.t, args.s): [0, 2]}
    else:
        profiles = {PROFILES["seed"]: [0, 1, 2], PROFILES["agentic"]: [0, 2]}
    if args.lags:
        profiles = {p: [int(lag) for lag in args.lags.split(",")] for p in profiles}
    engines = list(dict.fromkeys(int(n) for n in args.engines.split(",")))  # a run id names one run: no repeats
    return [(p.scaled(args.time_scale), n, lag) for p, lags in profiles.items() for n in engines for lag in dict.fromkeys(lags)]


def finished(planned: dict, run: PipelineRun) -> dict:
    """A run's row: what was planned for it and what it measured, side by side."""
    measured = run.finish()
    ratios = {"ratio": measured["step_seconds"] / planned["ideal_seconds"], "ratio_vs_floor": measured["step_seconds"] / planned["floor_seconds"]}
    return {**planned, **ratios, **measured}


def print_table(results: list[dict]) -> None:
    print("| profile | engines | max_lag | step s | median s | ideal s | measured/ideal | floor s | measured/floor | batch generation s "
          "| G1/N s | trainer idle | generator idle | overhead s/step | overhead % | slime s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        mode = "sync" if r["max_lag"] == 0 else "async"
        slime = SEED_POINTS.get(r["engines"], {}).get(mode) if r["profile"] == "seed" else None
        slime = slime * r["g1"] / PROFILES["seed"].g1 if slime is not None else None  # in the run's time scale
        span = f"{r['generation_span_seconds']:.2f}" if mode == "sync" else ""
        print(f"| {r['profile']} | {r['engines']} | {r['max_lag']} | {r['step_seconds']:.2f} | {r['median_step_seconds']:.2f} "
              f"| {r['ideal_seconds']:.2f} | {r['ratio']:.2f} | {r['floor_seconds']:.2f} | {r['ratio_vs_floor']:.2f} | {span} | {r['g1'] / r['engines']:.2f} | {r['trainer_idle']:.2f} | {r['generator_idle']:.2f} | {r['overhead_seconds']:.3f} "
              f"| {100 * r['overhead_seconds'] / r['step_seconds']:.1f}% | {'' if slime is None else f'{slime:.2f}'} |")  # fmt: skip


def plot(results: list[dict], path: Path) -> None:
    """Step time against engines: measured sync and async, their zero-overhead floors, both
    ideals, slime's points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    profiles = list(dict.fromkeys(r["profile"] for r in results))
    fig, axes = plt.subplots(1, len(profiles), figsize=(6 * len(profiles), 4.2), squeeze=False)
    for ax, name in zip(axes[0], profiles):
        rows = [r for r in results if r["profile"] == name]
        profile = Profile(name, rows[0]["g1"], rows[0]["t"], rows[0]["s"])
        ns = sorted({r["engines"] for r in rows})
        dense = [1 + i / 20 for i in range(int((max(ns) - 1) * 20) + 1)]
        ax.plot(dense, [profile.ideal(n, True) for n in dense], "--", color="tab:red", label="ideal sync")
        ax.plot(dense, [profile.ideal(n, False) for n in dense], "--", color="tab:blue", label="ideal async")
        for lag in sorted({r["max_lag"] for r in rows}):
            points = sorted((r["engines"], r["step_seconds"]) for r in rows if r["max_lag"] == lag)
            style = ("o-", "tab:red") if lag == 0 else ("s-", "tab:blue" if lag == 2 else "tab:cyan")
            ax.plot(*zip(*points), style[0], color=style[1], label=f"tandem, max_lag {lag}" + (" (sync)" if lag == 0 else ""))
            floors = sorted((r["engines"], r["floor_seconds"]) for r in rows if r["max_lag"] == lag)
            ax.plot(*zip(*floors), "x:", color=style[1], alpha=0.7, label=f"zero-overhead floor, max_lag {lag}")
        if name == "seed":
            scale = profile.g1 / PROFILES["seed"].g1
            for mode, marker in (("sync", "X"), ("async", "P")):
                xs = sorted(SEED_POINTS)
                ax.plot(xs, [SEED_POINTS[n][mode] * scale for n in xs], marker, markersize=11, color="black", linestyle="none",
                        label=f"slime on SkyPilot, {mode} (/100)")  # fmt: skip
        ax.set(title=f"{name}: G1={profile.g1:g}s, T={profile.t:g}s, S={profile.s:g}s", xlabel="engines (N)", ylabel="step time (s)")
        ax.set_xticks(ns)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="N = 1 and 3, max_lag 0 and 2, the seed's profile at half its times, 4 steps (1 warm-up, 3 measured).")  # fmt: skip
    parser.add_argument("--out", type=Path, help="Write every measurement as JSON here.")
    parser.add_argument("--plot", type=Path, default=Path("scaling.png"), help="PNG of step time against engines.")
    parser.add_argument("--engines", default="1,2,3,4", help="Engine counts to run (comma-separated).")
    parser.add_argument("--lags", help="max_lag values to run on every profile (comma-separated; default: the issue's plan).")
    parser.add_argument("--steps", type=int, default=8, help="Steady-state steps measured per run.")
    parser.add_argument("--warmup", type=int, default=1,
                        help="Steps run first and not measured (start-up); async runs skip at least max_lag + 1.")  # fmt: skip
    parser.add_argument("--g1", type=float, help="Custom profile: seconds one engine takes per batch.")
    parser.add_argument("--t", type=float, default=6.5, help="Custom profile: seconds of a training step.")
    parser.add_argument("--s", type=float, default=0.3, help="Custom profile: seconds of a weight sync.")
    parser.add_argument("--time-scale", type=float, help="Multiply every profile's times (default 1; 0.5 with --quick).")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="Config override for every run, as `tandem run --set` (repeatable).")  # fmt: skip
    parser.add_argument("--runs-dir", type=Path,
                        help="Keep every run's directory (metrics, shards, snapshots) here, to look into; by default they "
                             "are in a scratch directory removed when the benchmark succeeds.")  # fmt: skip
    return parser


def main() -> None:
    parser = main_parser()
    args = parser.parse_args()
    if args.runs_dir:
        args.runs_dir = args.runs_dir.resolve()
        if args.runs_dir.exists() and any(args.runs_dir.iterdir()):
            parser.error(f"--runs-dir {args.runs_dir} is not empty: a run of the same name there would be resumed, not measured")
    args.time_scale = args.time_scale or (0.5 if args.quick else 1.0)
    steps, warmup = (3, 1) if args.quick else (args.steps, args.warmup)
    runs = plan(args)
    snapshot_bytes = tiny_snapshot_bytes()
    results = []
    started = time.monotonic()
    with scratch_dir("tandem-scaling-") as root:  # removed after success; kept, with the runs' logs, after a failure
        server = PrefectServer(root / "prefect").start()
        env = os.environ | server.env()
        pending: list[tuple[dict, PipelineRun]] = []  # started, not yet measured: at most the last two
        try:
            for i, (profile, engines, lag) in enumerate(runs, 1):
                if pending:
                    pending[-1][1].wait_trained()
                    if pending[-1][1].process.poll() is not None:  # it ended early: measure it (or fail) before starting another
                        results.append(finished(*pending.pop()))
                skipped = warmup if lag == 0 or args.quick else max(warmup, lag + 1)
                cycles = math.ceil(steps / (lag + 1)) * (lag + 1)  # whole bursts: an async run trains max_lag + 1 batches, then waits
                latency = latency_for(profile, snapshot_bytes)
                floor = floor_seconds(latency, engines, lag, profile.t, profile.s, BATCH, RUNNING_CAP, MAX_NEW_TOKENS, PROMPT_TOKENS)
                planned = {"profile": profile.name, **asdict(profile), "engines": engines, "max_lag": lag, "steps": cycles,
                           "warmup": skipped, "ideal_seconds": profile.ideal(engines, sync=lag == 0), "floor_seconds": floor}  # fmt: skip
                console.print(f"[{i}/{len(runs)}] {profile.name}: {engines} engine(s), max_lag {lag} ({time.monotonic() - started:.0f} s so far)")
                pending.append((planned, PipelineRun(profile, engines, lag, cycles, skipped, args.runs_dir or root / "runs", env, latency, args.set)))
                if len(pending) == 2:  # the new run is starting: the last one is shutting down, measure it
                    results.append(finished(*pending[0]))
                    del pending[0]
            while pending:
                results.append(finished(*pending[0]))
                del pending[0]
        finally:
            for _, run in pending:
                run.stop()
            server.stop()
    for before, after in zip(results, results[1:]):
        if after["measured_from"] < before["process_ended_at"]:
            console.print(f"[yellow]warning: a {after['profile']} run (N={after['engines']}, max_lag {after['max_lag']}) began "
                          "its measured steps before the previous run's process had exited[/yellow]")  # fmt: skip
    print(f"\n{steps} steady-state steps per run (async: rounded up to whole bursts of max_lag + 1) after {warmup} warm-up "
          f"(async: max_lag + 1); batch {PROMPTS_PER_STEP} prompts x {SAMPLES} samples; times x{args.time_scale:g} of the profiles'; "
          "floor: the same scheduling with zero overhead (benchmarks/floor.py)\n")  # fmt: skip
    print_table(results)
    plot(results, args.plot)
    async_ratios = [r["ratio"] for r in results if r["max_lag"] > 0]
    sync_ratios = [r["ratio"] for r in results if r["max_lag"] == 0]
    if args.out:
        args.out.write_text(json.dumps({"steps": steps, "warmup": warmup, "runs": results, "seed_points": SEED_POINTS,
                                        "worst_ratio_vs_floor": max(r["ratio_vs_floor"] for r in results),
                                        "worst_async_ratio_vs_ideal": max(async_ratios, default=None),
                                        "worst_sync_ratio_vs_ideal": max(sync_ratios, default=None)}, indent=2))  # fmt: skip
    console.print(f"plot: {args.plot}; {time.monotonic() - started:.0f} s in all")
    print(f"worst_ratio_vs_floor: {max(r['ratio_vs_floor'] for r in results):.2f}")
    print(f"worst_sync_ratio_vs_ideal: {max(sync_ratios, default=float('nan')):.2f}")
    print(f"worst_async_ratio_vs_ideal: {max(async_ratios, default=float('nan')):.2f}")


if __name__ == "__main__":
    main()
