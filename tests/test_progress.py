"""The console output of a pipeline (flows/progress.py), read from a run directory on file://."""

from __future__ import annotations

import io
import logging
import os
from pathlib import Path
from types import SimpleNamespace

from rich.console import Console

from configs import TINY_CONFIG, load_config
from flows.progress import PREFECT_SOURCE, TASK_RUN_LOG_LEVEL, print_summary, quiet_task_run_logs, watch_run
from infra.storage import open_run_store
from tasks.lag import TrainerState, publish_trainer_state
from tasks.metrics import MetricsLog

ROOT = Path(__file__).resolve().parents[1]


class Finishing:
    """A future done after `polls` looks (at its wrapped future, as the watcher asks: a local one,
    not the Prefect API)."""

    def __init__(self, polls: int, on_poll=lambda n: None):
        self.polls, self.seen, self.on_poll = polls, 0, on_poll

    @property
    def wrapped_future(self):
        self.seen += 1
        self.on_poll(self.seen)
        return SimpleNamespace(done=lambda: self.seen > self.polls)


def watched_run(tmp_path: Path, console: Console, reported_per_look: int = 12) -> int:
    """watch_run over a 40-step run that trains ten steps a look, its generators reporting
    `reported_per_look` steps' worth of samples each look; returns samples per step."""
    config = load_config(TINY_CONFIG, [f"storage.root=file://{tmp_path}", "run_id=watched", "training.steps=40"])
    per_step = config.training.prompts_per_step * config.generation.samples_per_prompt
    store = open_run_store(config.storage, config.run_id)
    trainer, generator = MetricsLog(store, "trainer", flush_seconds=0), MetricsLog(store, "generator-gen0", flush_seconds=0)

    def advance(poll: int) -> None:
        """Each look at the future: ten more steps trained, and more samples generated than
        trained, as an async run generates ahead of its trainer."""
        version = min(10 * poll, 40)
        publish_trainer_state(store, TrainerState(version))
        trainer.log("train_step", version=version, reward_mean=0.5, lag_max=1, dropped_stale=0, trained=version * per_step)
        generator.log("group", samples=reported_per_look * per_step)

    watch_run(config, [Finishing(polls=3, on_poll=advance)], poll_seconds=0.0, console=console)
    return per_step


def test_outside_a_terminal_progress_is_printed_as_whole_lines_and_ends_on_the_final_figures(tmp_path: Path):
    out = io.StringIO()
    per_step = watched_run(tmp_path, Console(file=out, width=80))  # rich's width for a file
    lines = out.getvalue().splitlines()
    assert all(line.startswith("train step ") for line in lines), "lines only: no bars drawn once at the end"
    assert [line.split(":")[0] for line in lines] == ["train step 10/40", "train step 20/40", "train step 30/40", "train step 40/40"]
    assert lines[-1].endswith(f"episodes trained {40 * per_step}, generated {48 * per_step}, dropped 0"), (
        "one line each, not wrapped at 80 columns, with the figures of after the children finished"
    )


def test_episodes_generated_are_never_shown_below_those_trained(tmp_path: Path):
    """Generators' metrics reach storage every few seconds, the trainer's every step."""
    out = io.StringIO()
    per_step = watched_run(tmp_path, Console(file=out, width=80), reported_per_look=4)
    assert out.getvalue().splitlines()[-1].endswith(f"episodes trained {40 * per_step}, generated {40 * per_step}, dropped 0")


def test_in_a_terminal_the_bars_close_on_the_final_figures(tmp_path: Path):
    out = io.StringIO()
    per_step = watched_run(tmp_path, Console(file=out, width=160, force_terminal=True, color_system=None))
    final = out.getvalue().rsplit("\r", 1)[-1]
    assert "train steps" in final and "40/40" in final, "the bar closes on the final step"
    bar = next(line for line in final.splitlines() if "episodes" in line)
    assert f"{40 * per_step}/{40 * per_step}" in bar, "the episodes bar counts episodes trained, never past its total"
    assert f"generated {48 * per_step}" in bar
    assert "train step 10/40:" not in out.getvalue(), "no lines beside the bars"


def test_the_summary_table_folds_long_paths_rather_than_cutting_them():
    out = io.StringIO()
    url = "file:///a/rather/long/path/to/a/directory/of/runs/named/something-quite-long"
    summary = {"eval_before": None, "reward_start": 0.1, "reward_end": 0.2, "steps": 3, "trainer_idle_fraction": 0.5,
               "generated": 8, "trained": 8, "dropped_stale": 0, "quarantined": 0, "duplicate": 0, "pending": 0,
               "identity_holds": True, "max_trained_lag": 1}  # fmt: skip
    print_summary(summary, url, console=Console(file=out, width=80))
    assert "plots/timeline.png" in out.getvalue().replace("\n", "").replace("│", "").replace(" ", "")


def test_a_local_run_keeps_prefects_task_run_lines_off_the_console_but_not_what_its_flows_print(monkeypatch):
    """In local mode the training and generation flows run inside the pipeline's task runs, so
    what they print is a task-run record as much as Prefect's "Finished in state Completed()"."""
    logger = logging.getLogger("prefect.task_runs")

    def shown(level: int, path: str) -> bool:
        return logger.filter(logging.LogRecord("prefect.task_runs", level, path, 1, "message", None, None)) is not False

    engine, trainer = os.path.join(PREFECT_SOURCE, "task_engine.py"), str(ROOT / "flows" / "training.py")
    before = list(logger.filters)
    try:
        monkeypatch.delenv(TASK_RUN_LOG_LEVEL, raising=False)
        quiet_task_run_logs()
        quiet_task_run_logs()
        assert len(logger.filters) == len(before) + 1, "one filter, however often the pipeline runs"
        assert not shown(logging.INFO, engine) and shown(logging.WARNING, engine) and shown(logging.ERROR, engine)
        assert shown(logging.INFO, trainer), "the trainer's prints"
        assert os.environ[TASK_RUN_LOG_LEVEL] == "WARNING", "the Dask workers' task runs: they inherit it"
        logger.filters[:] = before
        monkeypatch.setenv(TASK_RUN_LOG_LEVEL, "DEBUG")
        quiet_task_run_logs()
        assert shown(logging.INFO, engine), "the user's own setting stands"
    finally:
        logger.filters[:] = before
        monkeypatch.undo()


def test_a_failed_read_of_the_run_directory_skips_a_look_and_is_said_once(tmp_path: Path, monkeypatch):
    """The bars are for show: the pipeline stops its children when the watcher raises."""
    config = load_config(TINY_CONFIG, [f"storage.root=file://{tmp_path}", "run_id=watched", "training.steps=40"])
    store = open_run_store(config.storage, config.run_id)
    publish_trainer_state(store, TrainerState(20))
    failures = [OSError("storage away"), OSError("storage away")]

    def read_trainer_state(store):
        if failures:
            raise failures.pop()
        return TrainerState(40)

    monkeypatch.setattr("flows.progress.read_trainer_state", read_trainer_state)
    out = io.StringIO()
    watch_run(config, [Finishing(polls=3)], poll_seconds=0.0, console=Console(file=out, width=80))
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("progress: could not read the run directory (OSError('storage away'))")
    assert sum("could not read" in line for line in lines) == 1 and lines[-1].startswith("train step 40/40")
