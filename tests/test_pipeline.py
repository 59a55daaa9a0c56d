"""End to end: a few steps of the tiny pipeline, in a fresh process, on the embedded default."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from configs import TINY_CONFIG
from flows.cli import run_command
from tasks.envs import Environment, Prompt, Segment, StepResult

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    overrides = [
        "run_id=e2e", f"storage.root=file://{root}", "training.steps=3", "training.warmup_steps=5",
        "training.prompts_per_step=4", "generation.prompts_per_chunk=2", "env.eval_prompts=8",
        "training.checkpoint_every=2", "lag.max_lag=1", "dask.n_workers=1",
    ]  # fmt: skip
    run_pipeline(root, overrides)
    return root / "e2e"


class CopyEnv(Environment):
    """A user's own environment, loaded by import path: repeat the prompt's letters."""

    def __init__(self, max_turns: int, length: int = 3) -> None:
        super().__init__(max_turns)
        self.length = length

    def prompts(self, split, count, seed):
        letters = "abcdefghijklmnopqrstuvwxyz"
        texts = [" ".join(letters[(i + j * 7 + (split == "eval") * 3) % 26] for j in range(self.length)) for i in range(count)]
        return [Prompt(f"{split}-{i}", text, text) for i, text in enumerate(texts)]

    def reset(self, prompt):
        self.prompt = prompt
        return prompt.text

    def step(self, action):
        return StepResult("", float(action.split() == self.prompt.answer.split()), True, {})

    def demonstration(self, prompt):
        return [Segment(f"{prompt.answer} <eos>", from_model=True)]


def run_pipeline(root: Path, overrides: list[str]) -> None:
    """`tandem run` in a process of its own, with its temporary files under root/scratch."""
    (root / "scratch").mkdir(exist_ok=True)
    env = os.environ | {"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "TMPDIR": str(root / "scratch")}
    done = subprocess.run(
        run_command(TINY_CONFIG, overrides),
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]


def records(run: Path, component: str) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics" / f"{component}.jsonl").read_text().splitlines()]


def test_a_finished_run_leaves_no_scratch_directory_behind(finished_run: Path):
    """The trainer, the generator and each evaluation copy the weights to a scratch directory
    of their own; a run that succeeds removes them (infra/scratch.py)."""
    assert not sorted(p.name for p in (finished_run.parent / "scratch").glob("tandem-*"))


def test_run_trains_to_the_step_count_and_accounts_for_every_sample(finished_run: Path):
    summary = json.loads((finished_run / "summary.json").read_text())
    assert summary["steps"] == 3
    assert summary["identity_holds"], summary
    assert summary["generated"] == summary["trained"] + summary["dropped_stale"] + summary["quarantined"] + summary["duplicate"] + summary["pending"]
    assert summary["trained"] == 3 * 4 * 8
    assert summary["max_trained_lag"] <= 1
    assert (finished_run / "plots" / "reward.png").stat().st_size > 0


def test_run_directory_holds_shards_snapshots_checkpoints_and_metrics(finished_run: Path):
    assert json.loads((finished_run / "weights" / "LATEST").read_text()) == {"version": 3}
    for version in range(4):
        assert (finished_run / "weights" / f"v{version:08d}" / "MANIFEST.json").exists()
    assert (finished_run / "checkpoints" / "step00000002" / "MANIFEST.json").exists()
    assert (finished_run / "checkpoints" / "step00000003" / "MANIFEST.json").exists()
    assert list((finished_run / "rollouts").glob("v*/gen0-*.parquet"))
    steps = [r for r in records(finished_run, "trainer") if r["event"] == "train_step"]
    assert [r["version"] for r in steps] == [1, 2, 3]
    assert all(r["lag_max"] <= 1 for r in steps)
    evaluations = records(finished_run, "evaluation")
    assert [e["version"] for e in evaluations] == [0, 3]


def test_engines_moved_to_new_weights_mid_run(finished_run: Path):
    generator = records(finished_run, "generator-gen0")
    loaded = [r["version"] for r in generator if r["event"] == "weights_loaded"]
    assert loaded and loaded == sorted(loaded) and max(loaded) >= 2
    groups = [r for r in generator if r["event"] == "group"]
    assert {r["policy_version"] for r in groups} > {0}, "every group came from v0: engines never updated"


def test_a_custom_environment_runs_through_the_pipeline_by_import_path(tmp_path: Path):
    run_pipeline(tmp_path, [
        "run_id=custom", f"storage.root=file://{tmp_path}", "env.entrypoint=tests.test_pipeline:CopyEnv", "env.kwargs={}",
        "env.kwargs.length=4", "env.max_turns=1", "training.steps=2", "training.warmup_steps=3",
        "training.prompts_per_step=2", "generation.prompts_per_chunk=2", "env.eval_prompts=0", "dask.n_workers=1",
    ])  # fmt: skip
    run = tmp_path / "custom"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["identity_holds"]
    assert summary["eval_before"] is None and not (run / "metrics" / "evaluation.jsonl").exists(), "eval_prompts 0: no evaluation"
    shards = list((run / "rollouts").glob("v*/*.parquet"))
    assert shards and {pq.read_table(s, columns=["env"])["env"][0].as_py() for s in shards} == {"CopyEnv"}
    prompt = pq.read_table(shards[0], columns=["prompt_ids"])["prompt_ids"][0].as_py()
    assert 3 not in prompt, "the custom prompts are in the vocabulary (no <unk>)"
