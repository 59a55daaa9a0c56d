"""The retrain flow: scheduled retraining of a named run, promoted only on improvement.

Two ways to retrain run `run_id` (its config is read back from its run directory):

- continue it (the default): the same run trains `steps` more steps from its newest checkpoint,
  so policy versions go on from where they stopped, on the prompts its environment offers now;
- or, with `new_run_id`, start a new run whose initial model is `run_id`'s newest snapshot (no
  warm-start), for when the old run's optimizer state or config should not carry over.

Either way it runs the pipeline flow as a subflow (deployed or local, as the run's config says),
then compares the held-out score with the run's PROMOTED snapshot (tasks/promotion.py) and moves
PROMOTED only if the new score is higher. The `retrain` deployment in prefect.yaml carries a cron
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
from flows.pipeline import pipeline
from infra.storage import open_run_store
from tasks.checkpoints import latest_checkpoint_step
from tasks.promotion import promote_if_better, read_promoted
from tasks.rundir import CONFIG_KEY, load_run_config
from tasks.snapshots import latest_version, load_snapshot

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
            # An earlier retrain started it (and failed, or was stopped): go on with it as it was
            # started. Started afresh, its model.path (the earlier attempt's temporary copy)
            # differed from the recorded one, and the run refused to start.
            data = load_run_config(f"{root}/{new_run_id}", reach).model_dump()
            data["training"]["steps"] = steps
            config = RunConfig.model_validate(data)
            print(f"continuing run {new_run_id}, which an earlier retrain started from {run_id}, to step {steps}")
            summary = pipeline(config)
        else:
            with tempfile.TemporaryDirectory(prefix="tandem-retrain-") as cache:
                config = _successor(source, source_store, new_run_id, steps, Path(cache))
                print(f"starting run {new_run_id} from snapshot v{latest_version(source_store)} of {run_id}")
                summary = pipeline(config)
    store = open_run_store(config.storage, config.run_id)
    version = latest_version(store)
    baseline = summary["eval_before"]
    moved = promote_if_better(source_store, store, version, summary["eval_after"], baseline)
    promoted = read_promoted(source_store)
    verdict = "promoted" if moved else "not promoted"
    print(f"v{version} of {config.run_id} scored {summary['eval_after']:.3f}: {verdict}; PROMOTED is "
          + (f"v{promoted.version} of {promoted.run_url} ({promoted.score:.3f})" if promoted else "unset"))  # fmt: skip
    return {"run_id": config.run_id, "version": version, "score": summary["eval_after"], "promoted": moved}


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


def _successor(source: RunConfig, store, new_run_id: str, steps: int, cache: Path) -> RunConfig:
    """A new run that starts from `source`'s newest snapshot, with no warm-start."""
    model_dir = load_snapshot(store, cache / "weights", latest_version(store))
    data = source.as_parameters(secrets=True)
    data["run_id"] = new_run_id
    data["model"]["path"] = str(model_dir)
    data["training"] |= {"steps": steps, "warmup_steps": 0}
    for key in ("key", "secret"):
        data["storage"].pop(key, None)
    return RunConfig.model_validate(data)
