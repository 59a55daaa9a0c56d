"""The training flow: resume, then admit a batch and train on it until `training.steps`.

Each step is two Prefect task runs, `admit_batch` (waits for enough fresh groups; its duration is
the trainer's idle time) and `train_step` (one optimizer step, then publish and checkpoint), so
the Prefect UI shows where the trainer's time goes. Both are side-effecting and never cached.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pyarrow as pa
from prefect import flow, task
from prefect.cache_policies import NONE

from configs.schema import RunConfig
from infra.modelfactory import load_model, load_tokenizer
from infra.storage import open_run_store
from tasks.lag import stop_reason
from tasks.learner import Learner
from tasks.metrics import MetricsLog
from tasks.snapshots import load_snapshot


class GenerationStopped(RuntimeError):
    """The generation side failed for good, so no batch will ever come."""


@task(cache_policy=NONE)
def admit_batch(learner: Learner) -> dict[str, pa.Table]:
    """Wait for `prompts_per_step` groups within the lag bound; drop and count stale ones."""
    shards = learner.admit_batch(should_stop=lambda: stop_reason(learner.store) is not None)
    if shards is None:
        raise GenerationStopped(f"training stopped at v{learner.version}: {stop_reason(learner.store)}")
    return shards


@task(cache_policy=NONE, retries=1, retry_delay_seconds=2)
def train_step(learner: Learner, shards: dict[str, pa.Table]) -> dict:
    """One optimizer step, then the snapshot, trainer state and checkpoint it is due."""
    return learner.train_step(shards)


@flow(name="training", log_prints=True)
def training(config: RunConfig) -> dict:
    """Train `config`'s run to `training.steps`, resuming from its newest checkpoint."""
    store = open_run_store(config.storage, config.run_id)
    cache = Path(tempfile.mkdtemp(prefix="tandem-trainer-"))
    initial = load_snapshot(store, cache / "weights", version=0)
    learner = Learner(config, store, load_model(initial), load_tokenizer(initial), cache, MetricsLog(store, "trainer"))
    resumed = learner.resume()
    if resumed is not None:
        print(f"resumed from checkpoint at version {resumed}")
    while learner.version < config.training.steps:
        train_step(learner, admit_batch(learner))
    learner.finish()
    return {
        "version": learner.version, "busy_seconds": learner.busy_seconds,
        "idle_seconds": learner.idle_seconds, **learner.ledger.counts,
    }  # fmt: skip
