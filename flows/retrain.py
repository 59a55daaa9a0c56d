"""The retrain flow: scheduled retraining of a named run, promoted only on improvement.

Two ways to retrain run `run_id` (its config is read back from its run directory):

- continue it (the default): the same run trains `steps` more steps from its newest checkpoint,
  so policy versions go on from where they stopped, on the prompts its environment offers now;
- or, with `new_run_id`, start a new run whose initial model is `run_id`'s newest snapshot (no
  warm-start), for when the old run's optimizer state or config should not carry over.

Either way it runs the pipeline flow as a subflow (deployed or local, as the run's config says),
then compares the held-out score with the run's PROMOTED snapshot (tasks/promotion.py), or with
none, the best score the run has recorded, and moves PROMOTED only if the new score is higher. The `retrain` deployment in prefect.yaml carries a cron
schedule that is off until the user turns it on.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Annotated

from prefect import flow, tags
from prefect.runtime import flow_run
from pydantic import Field

from configs import DEPLOYED_CONFIG, load_config
from configs.fields import RunId
from configs.schema import RunConfig, StorageConfig
from flows.pipeline import pipeline, score_newest_snapshot
from infra.storage import open_run_store
from tasks.checkpoints import latest_checkpoint_step
from tasks.evaluation import same_setup
from tasks.metrics import read_metrics
from tasks.promotion import promote_if_better, read_promoted
from tasks.rundir import CONFIG_KEY, RunConflict, check_recorded_config, load_run_config
from tasks.snapshots import latest_version, load_snapshot, snapshot_versions

@flow(name="retrain", log_prints=True)
def retrain(
    run_id: RunId = "tiny-deployed",
    steps: Annotated[int, Field(ge=1, le=10_000_000)] = 20,
    new_run_id: RunId | None = None,
    storage_root: Annotated[str, Field(pattern=r"^(file|s3|memory)://")] | None = None,
) -> dict:
    """Retrain `run_id` (under `storage_root`, default: configs/deployed.yaml's) for `steps` steps.
    Under deployed.yaml's root the run directory is reached as that file says (its endpoint and
    Secret block, if it names them); under another, or without them, with the worker's environment."""
    if new_run_id == run_id:
        raise ValueError(f"new_run_id names the run to retrain ({run_id}); leave it out to continue that run")
    root, reach = run_location(storage_root, load_config(DEPLOYED_CONFIG).storage)
    source = load_run_config(f"{root}/{run_id}", reach)
    if not source.env.eval_prompts:
        raise ValueError(f"run {run_id} has env.eval_prompts 0: retraining promotes by the held-out score, "
                         "so the run needs held-out prompts")  # fmt: skip
    source_store = open_run_store(source.storage, source.run_id)
    with tags(*flow_run.tags):  # the pipeline runs in this process: without them it would lack RUN_TAG, which `tandem scale` looks for
        if new_run_id is None:
            config = _continued(source, source_store, steps)
            print(f"continuing run {run_id} from step {config.training.steps - steps} to {config.training.steps}")
            summary = pipeline(config)
        elif open_run_store(source.storage, new_run_id).exists(CONFIG_KEY):
            config = _unfinished_successor(source, new_run_id, steps, f"{root}/{new_run_id}", reach)
            successor = open_run_store(config.storage, new_run_id)
            if (latest_checkpoint_step(successor) or 0) >= steps:
                print(f"run {new_run_id}, which an earlier retrain started from a snapshot of {run_id}, has trained its "
                      f"{steps} steps already; that retrain stopped before comparing it, which this one does now")  # fmt: skip
                summary = {"eval_before": None, "eval_after": score_newest_snapshot(config, successor)["score"]}
            else:
                print(f"continuing run {new_run_id}, which an earlier retrain started from a snapshot of {run_id}, to step {steps}")
                summary = pipeline(config)
        else:
            with tempfile.TemporaryDirectory(prefix="tandem-retrain-") as cache:
                model_dir = load_snapshot(source_store, Path(cache) / "weights", latest_version(source_store))
                config = _successor(source, new_run_id, steps, str(model_dir))
                print(f"starting run {new_run_id} from snapshot v{latest_version(source_store)} of {run_id}")
                summary = pipeline(config)
    store = open_run_store(config.storage, config.run_id)
    version = latest_version(store)
    moved = promote_if_better(source_store, store, version, summary["eval_after"], _bar(config, store, source_store, version, summary))
    promoted = read_promoted(source_store)
    verdict = "promoted" if moved else "not promoted"
    print(f"v{version} of {config.run_id} scored {summary['eval_after']:.3f}: {verdict}; PROMOTED is "
          + (f"v{promoted.version} of {promoted.run_url} ({promoted.score:.3f})" if promoted else "unset"))  # fmt: skip
    return {"run_id": config.run_id, "version": version, "score": summary["eval_after"], "promoted": moved}


def _bar(config: RunConfig, store, source_store, version: int, summary: dict) -> float:
    """The score a retrain must beat with nothing promoted: the best that its run, or the run it
    started from, has recorded under the same evaluation setup, other than the candidate's own.

    Not merely where this retrain started (its opening score): a retrain that made the policy
    worse would lower the bar for the next, which could then promote a model worse than one the
    run had. For a successor the records include its v0's score, the source's snapshot."""
    scores = [
        record["score"]
        for records_of in {store.url: store, source_store.url: source_store}.values()
        for record in read_metrics(records_of, "evaluation")
        if record.get("event") == "evaluation" and same_setup(record, config)
        and not (records_of.url == store.url and record.get("version") == version)
    ]  # fmt: skip
    return max(scores, default=summary["eval_before"] if summary["eval_before"] is not None else -float("inf"))


def run_location(storage_root: str | None, deployed: StorageConfig) -> tuple[str, list[str]]:
    """The root to find the run under, and the storage overrides to reach it with: deployed.yaml's
    endpoint and Secret block under its own root, none under another."""
    root = (storage_root or deployed.root).rstrip("/")
    if root != deployed.root.rstrip("/"):
        return root, []
    given = (("endpoint_url", deployed.endpoint_url), ("credentials_block", deployed.credentials_block))
    return root, [f"storage.{field}={value}" for field, value in given if value]


def _continued(source: RunConfig, store, steps: int) -> RunConfig:
    """The same run, `steps` steps past its newest checkpoint."""
    start = latest_checkpoint_step(store) or 0
    data = source.model_dump()
    data["training"]["steps"] = start + steps
    return RunConfig.model_validate(data)  # with the config's checks: the slot limit counts the steps


def _successor(source: RunConfig, new_run_id: str, steps: int, model_path: str) -> RunConfig:
    """A new run that starts from `source`'s snapshot in `model_path`, with no warm-start."""
    data = source.as_parameters(secrets=True)
    data["run_id"] = new_run_id
    data["model"]["path"] = model_path
    data["training"] |= {"steps": steps, "warmup_steps": 0}
    for key in ("key", "secret"):
        data["storage"].pop(key, None)
    return RunConfig.model_validate(data)


def _unfinished_successor(source: RunConfig, new_run_id: str, steps: int, url: str, reach: list[str]) -> RunConfig:
    """The config to go on with successor run `new_run_id`, which an earlier retrain of `source`
    started (and which failed, or was stopped: maybe after it trained its `steps`, before its
    comparison with PROMOTED); RunConflict if it is another run or never made its initial snapshot.

    Started afresh, the retry's model.path (a temporary copy of the source's snapshot, like the
    earlier attempt's, since deleted) differed from the recorded one, and the run refused to
    start over a field the user never set. The successor's v0 holds that snapshot already."""
    recorded = load_run_config(url, reach)
    store = open_run_store(recorded.storage, new_run_id)
    config = _successor(source, new_run_id, steps, recorded.model.path)
    check_recorded_config(store, config)  # RunConflict naming the fields of another run's config
    if 0 not in snapshot_versions(store):
        raise RunConflict(f"run {new_run_id} at {store.url} was started by an earlier retrain that stopped before its "
                          "initial snapshot: delete that run directory, or give another new_run_id")  # fmt: skip
    return config
