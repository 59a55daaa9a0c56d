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
from pydantic import Field, ValidationError

from configs import DEPLOYED_CONFIG, load_config
from configs.fields import MAX_SLOTS, RunId
from configs.schema import RunConfig
from configs.sections import StorageConfig
from flows.pipeline import pipeline, score_snapshot
from infra.storage import open_run_store
from tasks.checkpoints import latest_checkpoint_step
from tasks.evaluation import evaluation_setup, is_score, same_setup
from tasks.metrics import MetricsLog, read_metrics
from tasks.promotion import Promotion, promote_if_better, read_promoted, rescore_promoted
from tasks.rundir import CONFIG_KEY, RunConflict, RunMissing, check_recorded_config, load_run_config
from tasks.snapshots import (
    FETCH_PIN_SECONDS, SnapshotMissing, committed_version, latest_version, load_snapshot, pin_snapshot, snapshot_versions,
    unpin_snapshot,
)  # fmt: skip


@flow(name="retrain", log_prints=True)
def retrain(
    run_id: RunId = "tiny-deployed",
    steps: Annotated[int, Field(ge=1, le=10_000_000)] = 20,
    new_run_id: RunId | None = None,
    storage_root: Annotated[str, Field(pattern=r"^(?:file://|s3:///*[^/])")] | None = None,
) -> dict:
    """Retrain `run_id` (under `storage_root`, default: configs/deployed.yaml's) for `steps` steps.
    Under deployed.yaml's root the run directory is reached as that file says (its endpoint and
    Secret block, if it names them); under another, or without them, with the worker's environment."""
    if new_run_id == run_id:
        raise ValueError(f"new_run_id names the run to retrain ({run_id}); leave it out to continue that run")
    root, reach = run_location(storage_root, load_config(DEPLOYED_CONFIG).storage)
    source = load_run_config(f"{root}/{run_id}", reach)
    if not source.env.eval_prompts:
        raise ValueError(f"run {run_id} was started with env.eval_prompts 0: retraining promotes by the held-out score, "
                         "and reads the run's recorded config, whose held-out prompts a later start cannot add. "
                         "Train a run started with held-out prompts (tandem run ... --set env.eval_prompts=200) "
                         "and retrain that one")  # fmt: skip
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
                if compared := [r for r in read_metrics(successor, "retrain") if r.get("event") == "compared"]:
                    raise RunConflict(
                        f"run {new_run_id} was started from {run_id} by an earlier retrain, trained its {steps} steps and was "
                        f"compared with PROMOTED already (v{compared[-1]['version']}: {compared[-1]['verdict']}): a retrain with "
                        f"new_run_id makes one run. To retrain every night, leave new_run_id out (the run goes on) or give each "
                        "night its own id"
                    )  # fmt: skip
                print(f"run {new_run_id}, which an earlier retrain started from a snapshot of {run_id}, has trained its "
                      f"{steps} steps already; that retrain stopped before comparing it, which this one does now")  # fmt: skip
                record = score_snapshot(config, successor)
                summary = {"eval_before": None, "eval_after": record["score"], "eval_versions": [None, record["version"]]}
            else:
                print(f"continuing run {new_run_id}, which an earlier retrain started from a snapshot of {run_id}, to step {steps}")
                summary = pipeline(config)
        else:
            with tempfile.TemporaryDirectory(prefix="tandem-retrain-") as cache:
                base, model_dir = _fetch_base(source_store, new_run_id, Path(cache))
                config = _successor(source, new_run_id, steps, str(model_dir))
                print(f"starting run {new_run_id} from snapshot v{base} of {run_id}")
                summary = pipeline(config)
    store = open_run_store(config.storage, config.run_id)
    version, setup = summary["eval_versions"][1], evaluation_setup(config)  # the version scored, not LATEST read again
    current = read_promoted(source_store)
    holder = _promoted_run(current, source, source_store, reach) if current is not None else None
    if holder is None:
        current = None
    elif current.setup != setup or not is_score(current.score):  # null: an earlier version's NaN
        current = _rescored(current, config, holder, source_store)
    bar = current.score if current is not None else _bar(config, store, source_store, version, summary)
    previous_store = open_run_store(holder.storage, holder.run_id) if holder is not None else None
    moved = promote_if_better(source_store, store, version, summary["eval_after"], bar, setup, previous_store)
    promoted = read_promoted(source_store)
    verdict = "promoted" if moved else "not promoted"
    MetricsLog(store, "retrain", flush_seconds=0).log("compared", version=version, score=summary["eval_after"], verdict=verdict,
                                                      bar=bar, source=source_store.url)  # fmt: skip
    print(f"v{version} of {config.run_id} scored {summary['eval_after']:.3f}: {verdict}; PROMOTED is "
          + (f"v{promoted.version} of {promoted.run_url} ({promoted.score})" if promoted else "unset"))  # fmt: skip
    return {"run_id": config.run_id, "version": version, "score": summary["eval_after"], "promoted": moved}


def _promoted_run(promoted: Promotion, source: RunConfig, source_store, reach: list[str]) -> RunConfig | None:
    """The config of the run holding the snapshot PROMOTED names, if that snapshot is still
    there; None, said so, if it or its run is gone (the comparison then goes as with nothing
    promoted: its score is of weights nobody can load). A run that storage refuses to show (its
    credentials), or whose config.json is damaged or no longer loads, fails the retrain instead:
    taken for gone, a worse candidate could replace it."""
    try:
        holder = source if promoted.run_url == source_store.url else load_run_config(promoted.run_url, reach)
        present = promoted.version in snapshot_versions(open_run_store(holder.storage, holder.run_id))
    except (RunMissing, FileNotFoundError) as err:  # its run deleted
        print(f"PROMOTED names v{promoted.version} of {promoted.run_url}, whose run is gone ({err}): compared as if "
              "nothing were promoted")  # fmt: skip
        return None
    if not present:
        print(f"PROMOTED names v{promoted.version} of {promoted.run_url}, which is no longer there: compared as if nothing "
              "were promoted")  # fmt: skip
        return None
    return holder


def _rescored(promoted: Promotion, config: RunConfig, holder: RunConfig, source_store) -> Promotion | None:
    """PROMOTED's snapshot scored under `config`'s evaluation setup, and so recorded; None (the
    comparison then goes as with nothing promoted) if that snapshot is gone meanwhile. Its score
    of another setup (other held-out prompts, rules or lengths; before setups were recorded, the
    held-out split that let operand-swapped twins of training problems in) compares with nothing
    measured now: a fair candidate could lose to it for good, or an unfair one beat it."""
    print(f"PROMOTED, v{promoted.version} of {promoted.run_url} ({promoted.score}), was scored under another "
          "evaluation setup: scoring it under this one")  # fmt: skip
    scoring = config.model_copy(update={"run_id": holder.run_id, "storage": holder.storage})
    try:
        record = score_snapshot(scoring, open_run_store(scoring.storage, scoring.run_id), promoted.version)
    except SnapshotMissing as err:  # retired since it was checked
        print(f"PROMOTED's snapshot cannot be scored again ({err}): compared as if nothing were promoted")
        return None
    return rescore_promoted(source_store, promoted, record["score"], record["setup"])


def _bar(config: RunConfig, store, source_store, version: int, summary: dict) -> float:
    """The score a retrain must beat with nothing promoted: the best that its run, or the run it
    started from, has recorded under the same evaluation setup, other than the candidate's own.

    Not merely where this retrain started (its opening score): a retrain that made the policy
    worse would lower the bar for the next, which could then promote a model worse than one the
    run had. For a successor the records include its v0's score, the source's snapshot."""
    setup = evaluation_setup(config)
    scores = [
        record["score"]
        for records_of in {store.url: store, source_store.url: source_store}.values()
        for record in read_metrics(records_of, "evaluation")
        if record.get("event") == "evaluation" and same_setup(record, setup) and is_score(record.get("score"))
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
    """The same run, `steps` steps past its newest checkpoint. A run retrained every night grows
    to the limit of prompt groups a run may number (configs/fields.py MAX_SLOTS); past it, the
    error says to go on under a new run id."""
    start = latest_checkpoint_step(store) or 0
    data = source.model_dump()
    data["training"]["steps"] = start + steps
    try:
        return RunConfig.model_validate(data)  # with the config's checks: the slot limit counts the steps
    except ValidationError as err:
        if "shard key" not in str(err):
            raise
        raise ValueError(
            f"run {source.run_id} has trained {start} steps: {steps} more would number more prompt groups than one run "
            f"may ({MAX_SLOTS:,}). Retrain it with new_run_id: a new run that starts from its newest snapshot"
        ) from err


def _fetch_base(source_store, new_run_id: str, cache: Path) -> tuple[int, Path]:
    """The source run's newest snapshot, fetched into `cache`: pinned meanwhile, since the source
    may still be training and retiring snapshots (unpinned, the fetch failed on retired files)."""
    consumer = f"retrain-{new_run_id}"
    base = latest_version(source_store)
    if base is None:
        raise SnapshotMissing(f"run {source_store.url} has published no snapshot to start {new_run_id} from")
    pin_snapshot(source_store, consumer, base, lapse_seconds=FETCH_PIN_SECONDS)  # a retrain killed mid-fetch leaves it
    try:
        committed_version(source_store, base)  # after the pin: retention keeps what it finds
        return base, load_snapshot(source_store, cache / "weights", base)
    finally:
        unpin_snapshot(source_store, consumer)


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
