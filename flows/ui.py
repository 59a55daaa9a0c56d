"""What a run shows in the Prefect UI, and the event it emits for automations.

- `TrainingProgress`: a progress artifact the training flow moves after every step, and a table
  artifact of the most recent steps' metrics, refreshed with every checkpoint (each refresh is
  a new version of the same key, so the UI keeps the history without one artifact per step).
- `publish_summary`: the markdown artifact the pipeline leaves at the end: the summary and where
  the reward and timeline plots lie in the run directory.
- `publish_evaluation`: each evaluation's score, as a new version of one table artifact.
- `announce_snapshot`: the `tandem.weights.published` event, one per published snapshot. A
  deployment trigger in prefect.yaml runs `evaluation` on the snapshots it marks for evaluation
  (every `prefect.evaluate_every`-th but the run's last, which the pipeline scores itself), so
  scoring runs beside training instead of pausing it.

What the UI shows is best effort: an artifact that cannot be written because the Prefect API is
unavailable (a server restart outlasting the client's own retries of about a minute) is logged
and skipped, never raised, so that a training run does not fail over its progress bar. The next
step's update writes the progress again. The event needs no such care: Prefect's events client
queues it and sends it again once it reconnects.

Artifact keys are derived from the run id, lowercased, with every character Prefect does not
allow in a key (only lowercase letters, digits and dashes) turned into a dash and, when that changed
it, a digest of the run id appended (so `exp_1` and `exp-1` do not share artifacts).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import re

import httpx
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, create_table_artifact, update_progress_artifact
from prefect.events import emit_event

from configs.schema import RunConfig
from tasks.report import summary_rows

log = logging.getLogger(__name__)

RECENT_STEPS = 10
"""Rows of the metrics table artifact."""
TABLE_COLUMNS = ("version", "reward_mean", "groups_without_signal", "loss", "kl", "entropy", "grad_norm", "lag_max", "dropped_stale", "wait_seconds", "step_seconds")


def api_unavailable(err: BaseException) -> bool:
    """Whether `err` says the Prefect API could not be reached or could not serve, for now: a
    transport error (refused, reset, timed out) or a 5xx / 408 / 429 answer. Other errors (a 404,
    a validation error, a bug) are not waited out."""
    if isinstance(err, httpx.TransportError):
        return True
    return isinstance(err, httpx.HTTPStatusError) and (err.response.status_code >= 500 or err.response.status_code in (408, 429))


def best_effort(function):
    """Run `function`; if the Prefect API is unavailable (after the client's retries), log a
    warning and return None instead of raising."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except Exception as err:
            if not api_unavailable(err):
                raise
            log.warning("%s skipped: the Prefect API is unavailable (%r)", function.__name__, err)
        return None

    return wrapper


def artifact_key(run_id: str, kind: str) -> str:
    """`tandem-{run}-{kind}` in the characters Prefect allows in an artifact key. A run id that
    had to be folded into them (`exp_1`, `EXP-1`) gets a digest of itself after it, so that its
    artifacts are not those of the run id it folds into (`exp-1`), which keeps its plain key."""
    folded = re.sub(r"[^a-z0-9-]", "-", run_id.lower())
    if folded != run_id:
        folded += "-" + hashlib.sha256(run_id.encode()).hexdigest()[:8]
    return f"tandem-{folded}-{kind}"


class TrainingProgress:
    """The training flow's artifacts: progress in percent of `training.steps`, recent metrics."""

    def __init__(self, config: RunConfig, version: int):
        self.config = config
        self.artifact_id = self._create(version)
        self.recent: list[dict] = []

    @best_effort
    def _create(self, version: int):
        return create_progress_artifact(
            progress=self._percent(version), key=artifact_key(self.config.run_id, "progress"),
            description=f"run {self.config.run_id}: training steps done, in percent of {self.config.training.steps}",
        )  # fmt: skip

    @best_effort
    def _move(self, version: int) -> None:
        if self.artifact_id is None:
            self.artifact_id = self._create(version)
        else:
            update_progress_artifact(self.artifact_id, progress=self._percent(version))

    def step_done(self, record: dict) -> None:
        self.recent = [*self.recent, {k: record.get(k) for k in TABLE_COLUMNS}][-RECENT_STEPS:]
        self._move(record["version"])
        if record["version"] % self.config.training.checkpoint_every == 0 or record["version"] >= self.config.training.steps:
            self.publish_table()

    @best_effort
    def publish_table(self) -> None:
        if self.recent:
            create_table_artifact(self.recent, key=artifact_key(self.config.run_id, "metrics"),
                                  description=f"run {self.config.run_id}: the last {len(self.recent)} training steps")  # fmt: skip

    def _percent(self, version: int) -> float:
        return min(100.0, 100.0 * version / self.config.training.steps)


@best_effort
def publish_summary(summary: dict, run_url: str, run_id: str) -> None:
    """The end-of-run markdown artifact: learning, accounting, and links to the plots."""
    markdown = "\n".join([
        f"# tandem run `{run_id}`", "",
        "| | |", "|---|---|",
        *(f"| {label} | {text} |" for label, text in summary_rows(summary)), "",
        f"Run directory: `{run_url}`", "",
        f"- reward curve: `{run_url}/plots/reward.png`",
        f"- generator and trainer timeline: `{run_url}/plots/timeline.png`",
        f"- summary: `{run_url}/summary.json`",
    ])  # fmt: skip
    create_markdown_artifact(markdown, key=artifact_key(run_id, "summary"), description=f"run {run_id}: summary")


@best_effort
def publish_evaluation(run_id: str, result: dict) -> None:
    """The held-out score of one snapshot, as a new version of the run's evaluation artifact."""
    row = {k: result.get(k) for k in ("version", "score", "solved", "prompts", "failed")}
    create_table_artifact([row], key=artifact_key(run_id, "evaluation"),
                          description=f"run {run_id}: held-out score of snapshot v{result.get('version')}")  # fmt: skip


def due_for_evaluation(config: RunConfig, version: int) -> bool:
    """Whether snapshot `version` is one the `evaluation` trigger should score: not the run's last,
    which the pipeline's closing evaluation scores (a triggered run would score it a second time,
    an engine's worth of work for a duplicate row), and none of a local run: a deployment's
    trigger on the same server would answer it, on a worker that may not reach the run's
    directory, and with no pin keeping the version meanwhile."""
    every = config.prefect.evaluate_every
    return config.prefect.mode == "deployed" and every > 0 and version % every == 0 and version != config.training.steps


def announce_snapshot(config: RunConfig, version: int, run_url: str) -> None:
    """Emit `tandem.weights.published` for snapshot `version`, labelled with whether it is due
    for evaluation (the trigger matches on that label).

    The payload carries the run's config with its secrets null (the server shows events to anyone
    who reads them), so the evaluation it triggers needs nothing but the event and its worker's
    own credentials: its engine runs without engine.api_key."""
    evaluate = due_for_evaluation(config, version)
    emit_event(
        event="tandem.weights.published",
        resource={"prefect.resource.id": f"tandem.run.{config.run_id}", "tandem.evaluate": str(evaluate).lower()},
        payload={"run_id": config.run_id, "version": version, "run_url": run_url, "config": config.as_parameters(secrets=False)},
    )  # fmt: skip
