"""The console output of a pipeline (flows/progress.py), read from a run directory on file://."""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace

from rich.console import Console

from configs import TINY_CONFIG, load_config
from flows.progress import print_summary, watch_run
from infra.storage import open_run_store
from tasks.lag import TrainerState, publish_trainer_state
from tasks.metrics import MetricsLog


class Finishing:
    """A future whose state turns final after `polls` looks."""

    def __init__(self, polls: int, on_poll=lambda n: None):
        self.polls, self.seen, self.on_poll = polls, 0, on_poll

    @property
    def state(self):
        self.seen += 1
        self.on_poll(self.seen)
        return SimpleNamespace(is_final=lambda: self.seen > self.polls)


def test_outside_a_terminal_progress_is_printed_as_lines_and_ends_on_the_final_figures(tmp_path: Path):
    config = load_config(TINY_CONFIG, [f"storage.root=file://{tmp_path}", "run_id=watched", "training.steps=40"])
    per_step = config.training.prompts_per_step * config.generation.samples_per_prompt
    store = open_run_store(config.storage, config.run_id)
    trainer, generator = MetricsLog(store, "trainer", flush_seconds=0), MetricsLog(store, "generator-gen0", flush_seconds=0)

    def advance(poll: int) -> None:
        """Each look at the future: ten more steps trained, and more samples generated than
        trained, as an async run generates ahead of its trainer."""
        version = min(10 * poll, 40)
        publish_trainer_state(store, TrainerState(version))
        trainer.log("train_step", reward_mean=0.5, lag_max=1, dropped_stale=0, trained=version * per_step)
        generator.log("group", samples=12 * per_step)

    out = io.StringIO()
    watch_run(config, [Finishing(polls=3, on_poll=advance)], poll_seconds=0.0, console=Console(file=out, width=160))
    lines = out.getvalue().splitlines()
    printed = [line for line in lines if line.startswith("train step ")]
    assert [line.split(":")[0] for line in printed] == ["train step 10/40", "train step 20/40", "train step 30/40", "train step 40/40"]
    assert f"episodes trained {40 * per_step}, generated {48 * per_step}" in printed[-1], (
        "the last line has the figures of after the children finished"
    )
    assert any("40/40" in line and "train steps" in line for line in lines), "the bar closes on the final step"
    bar = next(line for line in lines if line.startswith("episodes"))
    assert f"{40 * per_step}/{40 * per_step}" in bar, "the episodes bar counts episodes trained, never past its total"
    assert f"generated {48 * per_step}" in bar


def test_the_summary_table_folds_long_paths_rather_than_cutting_them():
    out = io.StringIO()
    url = "file:///a/rather/long/path/to/a/directory/of/runs/named/something-quite-long"
    summary = {"eval_before": None, "reward_start": 0.1, "reward_end": 0.2, "steps": 3, "trainer_idle_fraction": 0.5,
               "generated": 8, "trained": 8, "dropped_stale": 0, "quarantined": 0, "duplicate": 0, "pending": 0,
               "identity_holds": True, "max_trained_lag": 1}  # fmt: skip
    print_summary(summary, url, console=Console(file=out, width=80))
    assert "plots/timeline.png" in out.getvalue().replace("\n", "").replace("│", "").replace(" ", "")
