"""The training flow: resume, then admit a batch and train on it until `training.steps`.

Each step is two Prefect task runs, `admit_batch` (waits for enough fresh groups; its duration is
the trainer's idle time) and `train_step` (one optimizer step, then publish and checkpoint), so
the Prefect UI shows where the trainer's time goes. Both are side-effecting and never cached.
After each step the flow moves its progress artifact, and after each published snapshot it emits
`tandem.weights.published` (flows/ui.py).
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
from prefect import flow, task
from prefect.cache_policies import NONE

from configs.schema import RunConfig
from infra.modelfactory import load_reference_model, load_tokenizer, load_trainable_model
from infra.scratch import scratch_dir
from flows.ui import TrainingProgress, announce_snapshot, due_for_evaluation
from infra.storage import RunStore, StorageUnavailable, open_run_store
from tasks.lag import TrainerState, publish_trainer_state, read_trainer_state, stop_reason
from tasks.learner import Learner
from tasks.lease import PipelineWatch, check_run_free
from tasks.metrics import MetricsLog
from tasks.placement import autocast_dtype, trainer_device
from tasks.checkpoints import CHECKPOINTS
from tasks.snapshots import WEIGHTS, load_snapshot, pin_snapshot


class GenerationStopped(RuntimeError):
    """No batch will ever come: the run was asked to stop (its generation side failed for good,
    its pipeline failed or was interrupted), or the pipeline that started the trainer is gone."""


def after_storage_outage(task, task_run, state) -> bool:
    """Whether a failed admission or step is worth another try: only after storage was
    unreachable for longer than storage.retry_seconds. The trainer spends most of its time in
    admission, so an outage most often lands there; and admission is safe to repeat (nothing is
    consumed before `train_step`, and what it disposed of is in the ledger). A step repeated
    finishes the one it applied (`Learner.train_step`). Anything else (the pipeline gone, a bug,
    out of memory) fails the run at once rather than after a pause and the same error again."""
    return isinstance(state.result(raise_on_failure=False), StorageUnavailable)


@task(cache_policy=NONE, retries=2, retry_delay_seconds=[10, 30], retry_condition_fn=after_storage_outage)
def admit_batch(learner: Learner, pipeline: PipelineWatch) -> dict[str, pa.Table]:
    """Wait for `prompts_per_step` groups within the lag bound; drop and count stale ones."""

    def why_stop() -> str | None:
        return stop_reason(learner.store) or pipeline.gone()

    shards = learner.admit_batch(should_stop=lambda: why_stop() is not None)
    if shards is None:
        raise GenerationStopped(f"training stopped at v{learner.version}: {why_stop()}")
    return shards


@task(cache_policy=NONE, retries=1, retry_delay_seconds=2, retry_condition_fn=after_storage_outage)
def train_step(learner: Learner, shards: dict[str, pa.Table], pipeline: PipelineWatch) -> dict:
    """One optimizer step, then the snapshot, trainer state and checkpoint it is due: unless the
    pipeline gave the run up during the step. A successor pipeline may have withdrawn the
    snapshots after its checkpoint already (tasks/lag.py `reopen_run`), and this step's would be
    one more of a lineage nobody continues, for its generators to load."""

    def check_still_held() -> None:
        if (why := pipeline.gone(now=True)) is not None:
            raise GenerationStopped(f"training stopped with v{learner.version} unpublished: {why}")

    return learner.train_step(shards, before_publish=check_still_held)


@flow(name="training", log_prints=True)
def training(config: RunConfig, pipeline_claim: str | None = None) -> dict:
    """Train `config`'s run to `training.steps`, resuming from its newest checkpoint; stop if the
    pipeline whose lease claim is `pipeline_claim` no longer holds the run: while waiting for data
    (at most every `WATCH_SECONDS`), and before each step's first write (every time).

    If it fails, the trainer state is marked done first, so that the run's generators stop
    instead of waiting for a trainer that will not come back; not if another pipeline has taken
    the run over, whose trainer the state is now. Without `pipeline_claim` (started by hand),
    RunInUse while a pipeline holds the run: it would publish versions over that pipeline's
    trainer's, after aborting its uploads."""
    store = open_run_store(config.storage, config.run_id)
    if pipeline_claim is None:  # started by hand (a deployment's Run button): not beside a pipeline's own trainer
        check_run_free(store)
    pipeline = PipelineWatch(store, pipeline_claim)
    try:
        with scratch_dir("tandem-trainer-") as cache:
            return _train(config, store, cache, pipeline)
    except BaseException:
        if pipeline.successor is None:
            state = read_trainer_state(store)
            publish_trainer_state(store, TrainerState(state.version, state.lost_groups, done=True))
        raise


def _train(config: RunConfig, store: RunStore, cache: Path, pipeline: PipelineWatch) -> dict:
    if aborted := store.clear_staging(owned=(WEIGHTS, CHECKPOINTS)):  # what a killed trainer left half-written
        print(f"aborted {len(aborted)} upload(s) a killed trainer left unfinished: {', '.join(aborted)}")
    initial = load_snapshot(store, cache / "weights", version=0)
    device = trainer_device(config)
    model, stored_dtype = load_trainable_model(initial, device)
    reference = None
    if config.training.kl_coef > 0:  # the KL term's anchor: v0, unchanged
        reference = load_reference_model(initial, device, autocast_dtype(config.training, device))
    learner = Learner(config, store, model, load_tokenizer(initial), cache, MetricsLog(store, "trainer"),
                      ref_model=reference, publish_dtype=stored_dtype)  # fmt: skip
    precision = str(learner.trainer.compute_dtype or "float32").removeprefix("torch.")
    print(f"trainer on {device}, forward and backward passes in {precision}")
    resumed = learner.resume()
    if resumed is not None:
        print(f"resumed from checkpoint at version {resumed}")
    progress = TrainingProgress(config, learner.version)
    while learner.version < config.training.steps:
        record = train_step(learner, admit_batch(learner, pipeline), pipeline)
        progress.step_done(record)
        if learner.version % config.training.publish_every == 0:
            _announce(config, store, learner.version)
    if (why := pipeline.gone(now=True)) is not None:  # its final checkpoint and done mark are another pipeline's to write now
        raise GenerationStopped(f"training stopped at v{learner.version} before its final checkpoint: {why}")
    if learner.finish():  # it published the last version, which publish_every skipped
        _announce(config, store, learner.version)
    return {
        "version": learner.version, "busy_seconds": learner.busy_seconds,
        "idle_seconds": learner.idle_seconds, **learner.ledger.counts,
    }  # fmt: skip


def _announce(config: RunConfig, store: RunStore, version: int) -> None:
    """Tell automations about snapshot `version`, pinned first if it is marked for evaluation."""
    pin_for_evaluation(config, store, version)
    announce_snapshot(config, version, store.url)


def pin_for_evaluation(config: RunConfig, store: RunStore, version: int) -> None:
    """Pin `version` for the evaluation its announcement triggers in deployed mode (the evaluation
    flow unpins it), so that retention cannot delete it before that run has loaded it; for
    `prefect.evaluation_pin_hours` only, since that run may never start."""
    if due_for_evaluation(config, version):
        pin_snapshot(store, f"eval-v{version}", version, lapse_seconds=config.prefect.evaluation_pin_hours * 3600)
