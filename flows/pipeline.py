"""The pipeline flow (parent): set up the run, then generation and training side by side.

On the embedded default both children run in this process, concurrently: each is a subflow
called inside a task, and the two tasks are submitted to the thread-pool task runner, which keeps
them linked to this run in the Prefect UI. The generation flow brings its own Dask cluster. They
meet only in the run directory. If training fails, the trainer state is marked done so that
generation stops instead of waiting forever; if generation fails, a stop request in the run
directory ends the trainer's wait for data. Either way the failure propagates.

Run it with `tandem run configs/tiny.yaml` or `python -m flows.pipeline configs/tiny.yaml`.
"""

from __future__ import annotations

import os
import sys

from prefect import flow, task
from prefect.client.orchestration import get_client
from prefect.cache_policies import NONE

from configs import load_config
from configs.schema import RunConfig
from flows.evaluation import evaluation
from flows.generation import dask_task_runner, generation
from flows.progress import print_summary, watch_run
from flows.training import training
from infra.storage import open_run_store
from tasks.lag import STOP_KEY, TrainerState, publish_trainer_state, read_trainer_state, request_stop
from tasks.report import write_summary
from tasks.rundir import RunConflict, initialize_run


def _worth_retrying(task, task_run, state) -> bool:
    """Retry storage trouble, not a run id reused with another config (a user error)."""
    try:
        state.result()
    except RunConflict:
        return False
    except Exception:
        return True
    return True


@task(cache_policy=NONE, retries=2, retry_delay_seconds=[2, 10], retry_condition_fn=_worth_retrying)
def initialize(config: RunConfig) -> str:
    """Record the config and publish the warm-started v0 (idempotent, so safe to retry)."""
    return initialize_run(config).url


@task(cache_policy=NONE)
def run_generation(config: RunConfig, producer: str) -> dict:
    try:
        return generation.with_options(task_runner=dask_task_runner(config))(config, producer)
    except BaseException as err:
        request_stop(open_run_store(config.storage, config.run_id), f"generation {producer} failed: {err!r}"[:2000])
        raise


def share_prefect_api_with_workers() -> None:
    """Point child processes (Dask workers) at this process's Prefect API. With the ephemeral
    API they would otherwise each start a temporary server of their own, and their task runs
    would not show under this run."""
    if not os.environ.get("PREFECT_API_URL"):
        os.environ["PREFECT_API_URL"] = str(get_client(sync_client=True).api_url)


@task(cache_policy=NONE)
def run_training(config: RunConfig) -> dict:
    try:
        return training(config)
    except BaseException:
        store = open_run_store(config.storage, config.run_id)
        state = read_trainer_state(store)
        publish_trainer_state(store, TrainerState(state.version, state.lost_groups, done=True))
        raise


@flow(name="pipeline", log_prints=True)
def pipeline(config: RunConfig) -> dict:
    """Train `config`'s run end to end: init, eval v0, generate and train, eval, summary."""
    share_prefect_api_with_workers()
    url = initialize(config)
    print(f"run directory: {url}")
    open_run_store(config.storage, config.run_id).delete(STOP_KEY)  # a stop request of an earlier attempt
    before = evaluation(config, version=0)
    producers = [f"gen{i}" for i in range(1)]
    generators = [run_generation.submit(config, producer) for producer in producers]
    trainer = run_training.submit(config)
    watch_run(config, [trainer, *generators])
    trainer.result()
    for generator in generators:
        generator.result()
    after = evaluation(config)
    summary = write_summary(open_run_store(config.storage, config.run_id), before, after)
    print_summary(summary, url)
    return summary


def main(argv: list[str] | None = None) -> None:
    """`python -m flows.pipeline CONFIG [section.field=value ...]`."""
    args = sys.argv[1:] if argv is None else argv
    if not args:
        sys.exit("usage: python -m flows.pipeline CONFIG [section.field=value ...]")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    pipeline(load_config(args[0], args[1:]))


if __name__ == "__main__":
    main()
