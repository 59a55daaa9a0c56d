"""The pipeline flow (parent): set up the run, then generation and training side by side.

On the embedded default (`prefect.mode: local`) both children run in this process,
concurrently: each is a subflow called inside a task, and the two tasks are submitted to the
thread-pool task runner, which keeps them linked to this run in the Prefect UI. The generation
flow brings its own Dask cluster. In deployed mode the children are deployment runs on their
work pools, started and watched by flows/supervisor.py. Either way they meet only in the run
directory. If training fails, its flow marks the trainer state done so that generation stops
instead of waiting forever; if generation fails for good, a stop request in the run directory
ends the trainer's wait for data. Either way the failure propagates. An interrupted pipeline
(Ctrl-C) sends the stop request itself, on which the trainer stops and marks itself done, and
exits anyway if its children have not stopped within `INTERRUPT_GRACE_SECONDS`: a terminal's
Ctrl-C also reaches the Dask workers and Prefect's temporary server, without which a child can
wait forever. SIGTERM does the same and then ends the process (at any other moment of a local
run too: at once, with 143); a deployment's run leaves it to Prefect, which records the cancel. The run resumes from its newest checkpoint when started again. From its set-up
to its summary a pipeline holds its run directory's lease (tasks/lease.py): a second pipeline of
the same run is refused with `RunInUse` instead of training beside it, before it writes anything.

Run it with `tandem run configs/tiny.yaml` or `python -m flows.pipeline configs/tiny.yaml`.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import NoReturn

from prefect import flow, task
from prefect.futures import PrefectFuture
from prefect.client.orchestration import get_client
from prefect.cache_policies import NONE
from prefect.exceptions import TerminationSignal
from prefect.runtime import deployment, flow_run

from configs import DEPLOYED_CONFIG, ConfigError, load_config
from configs.fields import RunId
from configs.schema import RunConfig
from flows.evaluation import evaluation
from flows.generation import generation
from flows.progress import print_summary, quiet_task_run_logs, watch_run
from flows.scaling import clear_scale_request, initial_generation_runs, tag_for_scaling
from flows.supervisor import Supervisor
from flows.training import training
from flows.ui import publish_summary
from infra.deployments import require_child_deployments
from infra.prefect_server import stop_temporary_server
from infra.storage import RunStore, open_run_store
from tasks.checkpoints import latest_checkpoint_step
from tasks.evaluation import evaluation_setup, is_score, same_setup
from tasks.lag import adopt_orphaned_claims, reopen_run, request_stop
from tasks.lease import hold_run
from tasks.metrics import MetricsLog, read_metrics
from tasks.report import write_summary
from tasks.rundir import RunConflict, check_run_inputs, initialize_run
from tasks.snapshots import committed_at, committed_version

INTERRUPT_GRACE_SECONDS = 10.0
"""How long an interrupted pipeline waits for its trainer and generators to stop: a training step
and the generators' abort of their engines take seconds."""


def _worth_retrying(task, task_run, state) -> bool:
    """Retry storage trouble, not a run id reused with another config, a damaged config.json or
    a warm-start that diverged (user errors that a retry meets again unchanged)."""
    try:
        state.result()
    except (RunConflict, ConfigError, FloatingPointError):
        return False
    except Exception:
        return True
    return True


@task(cache_policy=NONE, retries=2, retry_delay_seconds=[2, 10], retry_condition_fn=_worth_retrying)
def initialize(config: RunConfig) -> str:
    """Record the config and publish the warm-started v0 (idempotent, so safe to retry)."""
    return initialize_run(config).url


@task(cache_policy=NONE)
def run_generation(config: RunConfig, producer: str, claim: str) -> dict:
    try:
        return generation(config, producer, claim)
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
def run_training(config: RunConfig, claim: str) -> dict:
    return training(config, claim)


@flow(name="pipeline", log_prints=True)
def pipeline(config: RunConfig | None = None, run_id: RunId | None = None) -> dict:
    """Train a run end to end: init, eval, generate and train, eval, summary.

    The first evaluation scores the newest snapshot: v0 for a new run, where it stopped for a
    restarted or continued one (whose score is usually on record already, and then kept). With
    `env.eval_prompts: 0` there is neither.

    `config` defaults to configs/deployed.yaml (what `prefect deployment run pipeline/tandem`
    runs); `run_id` overrides the config's, so that a user starts a fresh run with one --param.
    A deployment run's `config` that leaves out the prefect section is refused: it is a partial
    config, which would run in local mode on the training worker's disk.
    """
    from_deployment = deployment.get_id() is not None  # asked now: later the API may be gone (a SIGTERM to the group)
    if config is not None and from_deployment and "prefect" not in config.model_fields_set:
        raise ConfigError(
            "the config parameter has no prefect section, so the run would take RunConfig's defaults: mode "
            "'local' (generation inside this training worker) and storage.root file://./runs on its disk. "
            "`config` replaces configs/deployed.yaml whole: build it with "
            "`tandem config show configs/deployed.yaml --json --set ...`"
        )
    config = config or load_config(DEPLOYED_CONFIG)
    if run_id:
        config = RunConfig.model_validate(config.model_dump() | {"run_id": run_id})  # with the config's own checks
    share_prefect_api_with_workers()
    if config.prefect.mode == "local":
        quiet_task_run_logs()
    if config.prefect.mode == "deployed":
        require_child_deployments(config.prefect.deployment)  # before v0 is written and evaluated
    store = open_run_store(config.storage, config.run_id)
    check_run_inputs(config, store)  # a typo is refused before the lease: the run directory stays as it was
    with hold_run(store, f"{flow_run.get_name()} ({flow_run.get_id()})") as claim:  # RunInUse: another pipeline has it
        if config.prefect.mode == "deployed":
            tag_for_scaling(flow_run.get_id())
            clear_scale_request(config.run_id, unless_for=flow_run.get_id())
        try:
            url = initialize(config)
            print(f"run directory: {url}")
            return _train_and_report(config, store, url, claim, from_deployment)
        except TerminationSignal:  # SIGTERM outside the children's watch (which stops them first)
            if config.prefect.mode != "local" or from_deployment:
                raise  # a worker cancelling its flow run: Prefect records the cancellation
            _exit_now("terminated (SIGTERM)", 128 + signal.SIGTERM)


def _train_and_report(config: RunConfig, store: RunStore, url: str, claim: str, from_deployment: bool) -> dict:
    checkpoint = latest_checkpoint_step(store) or 0
    withdrawn = reopen_run(store, checkpoint)
    if withdrawn:
        MetricsLog(store, "pipeline", flush_seconds=0).log("withdrawn", checkpoint=checkpoint, versions=withdrawn)
        print(f"withdrew {', '.join(f'v{v}' for v in withdrawn)}: published after the checkpoint at v{checkpoint} by a "
              "trainer that stopped before its next one; the trainer resumed from it publishes these versions again")  # fmt: skip
    starting = initial_generation_runs(config) if config.prefect.mode == "deployed" else config.prefect.generators
    producers = [f"gen{i}" for i in range(starting)]
    adopted = adopt_orphaned_claims(store, producers, config.training.prompts_per_step)
    if any(adopted.values()):
        MetricsLog(store, "pipeline", flush_seconds=0).log("claims_adopted", slots=adopted)
        print(f"{sum(map(len, adopted.values()))} groups claimed by generators this run does not start again go to "
              f"{', '.join(p for p, slots in adopted.items() if slots)}, which generate them first")  # fmt: skip
    before = score_snapshot(config, store)
    if config.prefect.mode == "deployed":
        Supervisor(config, claim).run()
    else:
        generators = [run_generation.submit(config, producer, claim) for producer in producers]
        trainer = run_training.submit(config, claim)
        try:
            watch_run(config, [trainer, *generators])
        except TerminationSignal as err:
            if from_deployment:  # a worker cancelling its flow run: Prefect records the cancellation
                stop_children(config, f"the pipeline failed: {err!r}")
                raise
            exit_at_a_second_sigterm()
            stop_children(config, "the pipeline was sent SIGTERM")
            exit_once_stopped_or_after_grace([trainer, *generators])
        except BaseException as err:
            interrupted = isinstance(err, KeyboardInterrupt)
            if interrupted:
                exit_unless_stopped_within_grace([trainer, *generators], lambda: stop_children(config, "the pipeline was interrupted"))
            else:
                stop_children(config, f"the pipeline failed: {err!r}")
            raise
        trainer.result()
        for generator in generators:
            generator.result()
    after = score_snapshot(config, store)
    summary = write_summary(store, before, after)
    publish_summary(summary, url, config.run_id)
    print_summary(summary, url)
    return summary


def score_snapshot(config: RunConfig, store: RunStore, version: int | None = None) -> dict | None:
    """The held-out score of snapshot `version` (default: the newest); None for a run without
    held-out prompts; SnapshotMissing if that snapshot is not kept.

    A version scored already on the same prompts keeps its recorded score: a continued or resumed
    run starts from the snapshot the last pipeline's closing evaluation (or a triggered one)
    scored, and greedy decoding would only repeat it, at the cost of an engine of its own. Only a
    score recorded since that snapshot's commit counts: the number of a withdrawn snapshot
    (tasks/lag.py `reopen_run`) names other weights once the resumed trainer publishes it again."""
    if not config.env.eval_prompts:
        return None
    version = committed_version(store, version)
    if (record := recorded_score(config, store, version)) is not None:
        print(f"v{version}: scored {record['score']:.3f} already, not evaluated again")
        return record
    return evaluation(config, version)


def recorded_score(config: RunConfig, store: RunStore, version: int) -> dict | None:
    """The newest evaluation of snapshot `version` under the config's evaluation setup
    (tasks/evaluation.py `evaluation_setup`) since its commit, if one is recorded."""
    since, setup = committed_at(store, version), evaluation_setup(config)
    for record in reversed(read_metrics(store, "evaluation")):
        if record.get("event") == "evaluation" and record.get("version") == version and same_setup(record, setup) \
                and is_score(record.get("score")) and record["time"] >= since:  # fmt: skip
            return record
    return None


def stop_children(config: RunConfig, reason: str) -> None:
    """Ask the trainer to stop, as a failed generator does; the trainer then marks itself done,
    on which the generators abort their engines' requests and leave. (The trainer's state is the
    trainer's alone to write: a second writer could publish an older version over a newer one.)"""
    print(f"stopping the trainer and generators: {reason}", file=sys.stderr)
    request_stop(open_run_store(config.storage, config.run_id), reason)


def exit_unless_stopped_within_grace(children: list[PrefectFuture], stop: Callable[[], None]) -> None:
    """Ask the children to `stop`, then exit the process unless every child has stopped within
    the grace, or at once on a second Ctrl-C while one still runs. Once they have stopped, nothing
    happens: a caller that catches the interrupt (a notebook, a test) keeps its process, and
    Ctrl-C its usual meaning. The second Ctrl-C's handler is in place before the stop request and
    before the message that invites it: one that came between them raised KeyboardInterrupt
    there instead, and the process went through Python's shutdown, which waits for the children."""
    threads = [child.wrapped_future for child in children]

    def exit_unless_stopped() -> None:
        if concurrent.futures.wait(threads, timeout=INTERRUPT_GRACE_SECONDS).not_done:
            _exit_now(f"the trainer or a generator did not stop within {INTERRUPT_GRACE_SECONDS:.0f} s")

    threading.Thread(target=exit_unless_stopped, name="tandem-interrupt-grace", daemon=True).start()
    if threading.current_thread() is threading.main_thread():
        usual = signal.getsignal(signal.SIGINT)

        def on_interrupt(signum, frame) -> None:
            if not all(thread.done() for thread in threads):
                _exit_now("interrupted again")
            signal.signal(signal.SIGINT, usual)
            if callable(usual):
                usual(signum, frame)

        signal.signal(signal.SIGINT, on_interrupt)
    stop()
    print(f"interrupted: waiting up to {INTERRUPT_GRACE_SECONDS:.0f} s for the trainer and generators to stop (Ctrl-C "
          "again to exit now); start the same run again to resume it", file=sys.stderr)  # fmt: skip


def exit_once_stopped_or_after_grace(children: list[PrefectFuture]) -> NoReturn:
    """SIGTERM (a `kill`, a service or container stop): the process ends, once the children
    have stopped or after the grace, with 143. Not through Prefect's handling, which reports a
    crash to the API (retried for minutes when the signal went to the whole process group and
    the temporary server is gone) and then dies by the signal, skipping the stop of that server."""
    concurrent.futures.wait([child.wrapped_future for child in children], timeout=INTERRUPT_GRACE_SECONDS)
    _exit_now("terminated (SIGTERM)", 128 + signal.SIGTERM)


def exit_at_a_second_sigterm() -> None:
    """From now on SIGTERM exits at once (Prefect's handler would raise in the stop under way)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: _exit_now("terminated again (SIGTERM)", 128 + signal.SIGTERM))


def _exit_now(why: str, code: int = 130) -> NoReturn:
    """Exit at once, without the interpreter's shutdown, which waits for the children's threads.
    The engines and Dask workers exit with this process, and Prefect's temporary server is stopped
    here (its own stop runs at the shutdown skipped); the run resumes from its newest checkpoint."""
    print(f"exiting: {why}; start the same run again to resume it", file=sys.stderr, flush=True)
    stop_temporary_server()
    os._exit(code)


def main(argv: list[str] | None = None) -> None:
    """`python -m flows.pipeline CONFIG [section.field=value ...]`: `tandem run CONFIG --set ...`,
    with the same checks before anything starts (the run's inputs, its recorded config, its lease)."""
    args = sys.argv[1:] if argv is None else argv
    if not args or any(arg.startswith("-") for arg in args):
        print("usage: python -m flows.pipeline CONFIG [section.field=value ...] (overrides without --set)", file=sys.stderr)
        sys.exit(2)
    from flows.cli import app

    app(["run", args[0], *(part for override in args[1:] for part in ("--set", override))], prog_name="python -m flows.pipeline")


if __name__ == "__main__":
    main()
