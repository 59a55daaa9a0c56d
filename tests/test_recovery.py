"""The pipeline survives its processes dying: a SIGKILLed trainer resumes, a SIGKILLed engine
comes back on the current weights. Each test runs the tiny pipeline in a process group of its
own and kills by PID only."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from configs import TINY_CONFIG
from tests.test_pipeline import ROOT, CopyEnv, records, run_pipeline

pytestmark = pytest.mark.slow

SMALL_RUN = [
    "training.warmup_steps=5", "training.prompts_per_step=4", "generation.prompts_per_chunk=2",
    "env.eval_prompts=8", "lag.max_lag=1", "dask.n_workers=1",
]  # fmt: skip


def start_pipeline(overrides: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "flows.pipeline", str(TINY_CONFIG), *overrides], cwd=ROOT,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        env=os.environ | {"PREFECT_SERVER_ANALYTICS_ENABLED": "false"},
    )  # fmt: skip


def wait_for(condition, process: subprocess.Popen, timeout: float = 300.0):
    """Poll `condition()` until it returns something truthy; fail if the run ends first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (found := condition()):
            return found
        assert process.poll() is None, f"the pipeline exited ({process.returncode}) before the fault"
        time.sleep(0.2)
    raise AssertionError(f"not reached in {timeout} s")


def metric_events(run: Path, component: str, event: str) -> list[dict]:
    try:
        return [r for r in records(run, component) if r["event"] == event]
    except (FileNotFoundError, json.JSONDecodeError):
        return []


def test_a_trainer_killed_after_a_step_resumes_without_training_a_group_twice(tmp_path: Path):
    steps = 10
    overrides = [f"storage.root=file://{tmp_path}", "run_id=killed", f"training.steps={steps}", "training.checkpoint_every=2", *SMALL_RUN]
    run = tmp_path / "killed"
    first = start_pipeline(overrides)
    try:  # watch the checkpoint itself: metrics reach storage only every 2 s, too late on a fast run
        wait_for(lambda: (run / "checkpoints" / "step00000002" / "MANIFEST.json").exists(), first)
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
    checkpointed = max(int(p.parent.name.removeprefix("step")) for p in run.glob("checkpoints/step*/MANIFEST.json"))
    assert 2 <= checkpointed < steps
    run_pipeline(tmp_path, overrides)

    resumed = metric_events(run, "trainer", "resumed")
    assert [r["version"] for r in resumed] == [checkpointed], "resumed from the newest checkpoint before the kill"
    ledger = json.loads((run / "lag" / "ledger.json").read_text())
    twice = [group for group, n in Counter(ledger["trained_groups"]).items() if n > 1]
    assert not twice, f"groups trained twice: {twice}"
    assert len(ledger["trained_groups"]) == steps * 4, "every step of the final lineage trained a full batch"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == steps and summary["identity_holds"], summary
    assert json.loads((run / "weights" / "LATEST").read_text()) == {"version": steps}


def test_an_engine_killed_mid_run_is_restarted_on_the_current_weights(tmp_path: Path):
    steps = 10  # metrics reach storage every 2 s: enough steps that the run outlives the kill
    overrides = [f"storage.root=file://{tmp_path}", "run_id=engine", f"training.steps={steps}", "generation.engines=2", *SMALL_RUN]
    pipeline = start_pipeline(overrides)
    run = tmp_path / "engine"
    try:
        started = wait_for(lambda: metric_events(run, "generator-gen0", "engines_started"), pipeline)
        wait_for(lambda: any(r["version"] >= 1 for r in metric_events(run, "generator-gen0", "weights_loaded")), pipeline)
        victim = started[0]["engines"][0]["pid"]
        os.kill(victim, signal.SIGKILL)
        assert pipeline.wait(timeout=400) == 0
    finally:
        if pipeline.poll() is None:
            os.killpg(pipeline.pid, signal.SIGKILL)

    restarts = metric_events(run, "generator-gen0", "engines_restarted")
    assert restarts, "the dead engine was never restarted"
    assert restarts[0]["version"] >= 1, "restarted on the weights the fleet was on, not on v0"
    assert victim not in [e["pid"] for e in restarts[0]["engines"]]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == steps and summary["identity_holds"], summary
    assert summary["trained"] == steps * 4 * 8


class BrokenTrainingEnv(CopyEnv):
    """Plays held-out prompts but raises on every training prompt: generation fails for good."""

    def step(self, action):
        if self.prompt.prompt_id.startswith("train"):
            raise RuntimeError("environment bug")
        return super().step(action)


def test_a_generation_side_that_fails_for_good_fails_the_run_instead_of_hanging(tmp_path: Path):
    command = [sys.executable, "-m", "flows.pipeline", str(TINY_CONFIG), f"storage.root=file://{tmp_path}", "run_id=broken",
               "env.entrypoint=tests.test_recovery:BrokenTrainingEnv", "env.kwargs={}", "env.max_turns=1", "training.steps=3", *SMALL_RUN]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=os.environ | {"PREFECT_SERVER_ANALYTICS_ENABLED": "false"})  # fmt: skip
    assert done.returncode != 0
    assert "environment bug" in (tmp_path / "broken" / "lag" / "stop.json").read_text()
    assert "GenerationStopped" in done.stdout + done.stderr
