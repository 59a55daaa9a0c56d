"""Console output of a pipeline: progress bars while it runs (train steps, episodes, policy
version, lag), and the summary table at the end.

The episodes bar counts episodes trained, against the steps' total: generation runs ahead of the
trainer by up to max_lag batches and makes some that are dropped, so episodes generated pass that
total in every async run, and the bar shows them beside it instead.

It reads what the components publish in the run directory (the trainer state and the metrics
files), the same things any observer of the run could read, so it works unchanged whether the
children run in this process or on other machines.

`quiet_task_run_logs` keeps Prefect's INFO lines about task runs off a local run's console, not
what the children print.
"""

from __future__ import annotations

import logging
import os
import time

import prefect
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from configs.schema import RunConfig
from infra.storage import open_run_store
from tasks.lag import read_trainer_state
from tasks.metrics import MetricsTail, generator_components
from tasks.report import kept_train_steps, summary_rows


TASK_RUN_LOG_LEVEL = "PREFECT_LOGGING_LOGGERS_PREFECT_TASK_RUNS_LEVEL"
PREFECT_SOURCE = os.path.dirname(prefect.__file__) + os.sep
"""Where Prefect's own modules lie: a log record made there is Prefect's, not tandem's."""


class PrefectTaskRunChatter(logging.Filter):
    """Drops the INFO lines Prefect's own engines log under a task run ("Finished in state
    Completed()", "Beginning subflow run"); keeps warnings and errors, and whatever tandem's code
    prints or logs. In local mode the training and generation flows run inside the pipeline's
    task runs, so their prints (log_prints) are task-run records too: a level on the logger would
    drop those with the chatter ("trainer on cuda:2", "resumed from checkpoint at version 30")."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or not record.pathname.startswith(PREFECT_SOURCE)


def quiet_task_run_logs() -> None:
    """Keep Prefect's task-run chatter off a local run's console, unless TASK_RUN_LOG_LEVEL is set.

    A local run's console was mostly "Task run 'train_step-...' - Finished in state Completed()"
    (608 of the 687 lines of `tandem run configs/tiny.yaml`), with the progress lines buried among
    them. In this process a filter drops those (`PrefectTaskRunChatter`); the Dask workers the
    generation flow starts, whose task runs are its chunks, inherit TASK_RUN_LOG_LEVEL=WARNING.
    A task run that fails for good still shows (ERROR); one that Prefect retries logs that failure
    at INFO, so it shows only with the level set. The Prefect UI still shows every task run and
    its state."""
    if TASK_RUN_LOG_LEVEL in os.environ:
        return  # the user's level, which Prefect's logging set-up applied
    os.environ[TASK_RUN_LOG_LEVEL] = "WARNING"
    logger = logging.getLogger("prefect.task_runs")
    if not any(isinstance(f, PrefectTaskRunChatter) for f in logger.filters):
        logger.addFilter(PrefectTaskRunChatter())


def watch_run(config: RunConfig, futures: list, poll_seconds: float = 1.0, console: Console | None = None) -> None:
    """Draw progress bars until every future is done, and once more after, so that they end on the
    run's final figures. Outside a terminal, where rich could draw the bars only when they close,
    print a line each time the trainer passes another twentieth of its steps instead.

    Whether the children are done is asked of their futures here, not of the Prefect API, and a
    failed read of the run directory skips one look, said once: the bars are for show, and the
    pipeline stops its children when this raises. The metrics files are read as they grow
    (`MetricsTail`), not whole every second."""
    store = open_run_store(config.storage, config.run_id)
    console = console or Console(stderr=True)
    steps = config.training.steps
    every, reported = max(1, steps // 20), 0
    tails = {"trainer": MetricsTail(store, "trainer")}
    warned = False
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(), console=console, transient=False, disable=not console.is_terminal,
    ) as progress:  # fmt: skip
        train = progress.add_task("train steps", total=steps, info="")
        episodes = progress.add_task("episodes   ", total=steps * config.training.prompts_per_step * config.generation.samples_per_prompt, info="")
        while True:
            finished = all(f.wrapped_future.done() for f in futures)
            try:
                version = read_trainer_state(store).version
                for name in generator_components(store):
                    tails.setdefault(name, MetricsTail(store, name))
                records = {name: tail.records() for name, tail in tails.items()}
            except Exception as err:
                if not warned:
                    console.print(f"progress: could not read the run directory ({err!r}); the run goes on", soft_wrap=True)
                    warned = True
                records = None
            if records is not None:
                trainer = kept_train_steps(records.pop("trainer"))  # a resumed run's: not its dead trainer's last
                last = trainer[-1] if trainer else {}
                step_info = f"v{version} reward {last.get('reward_mean', 0):.2f} lag<={last.get('lag_max', 0):.0f}"
                progress.update(train, completed=version, info=step_info)
                generators_report = sum(r.get("samples", 0) for group in records.values() for r in group if r["event"] == "group")
                # Generators write their metrics every few seconds, the trainer every step: what it has
                # trained or dropped was generated, even if not reported yet (the line read "trained
                # 1280, generated 1152").
                generated = max(generators_report, sum(last.get(fate, 0) for fate in ("trained", "dropped_stale", "dropped_no_signal", "duplicate")))
                episode_info = f"generated {generated}, dropped {last.get('dropped_stale', 0)}"
                if last.get("dropped_no_signal"):  # dynamic sampling
                    episode_info += f" stale and {last['dropped_no_signal']} without signal"
                progress.update(episodes, completed=last.get("trained", 0), info=episode_info)
                if not console.is_terminal and version // every > reported:
                    reported = version // every
                    line = f"train step {version}/{steps}: {step_info}, episodes trained {last.get('trained', 0)}, {episode_info}"
                    console.print(line, soft_wrap=True)  # a log file's line, not wrapped at rich's 80 columns
            if finished:
                return
            time.sleep(poll_seconds)


def print_summary(summary: dict, run_url: str, console: Console | None = None) -> None:
    """The end-of-run summary as a table: learning, time, and the accounting identity."""
    table = Table(title=f"run summary ({run_url}/summary.json)", show_header=False)
    table.add_column(overflow="fold")
    table.add_column(overflow="fold")  # paths fold onto the next line rather than lose their ends
    for label, text in summary_rows(summary):
        table.add_row(label, text, style="bold red" if text.endswith("BROKEN") else None)
    table.add_row("plots", f"{run_url}/plots/reward.png, {run_url}/plots/timeline.png")
    (console or Console(stderr=True)).print(table)
