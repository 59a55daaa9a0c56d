"""The generation flow: engines up, then claim slots and run groups until training is done.

Prefect sees coarse units: one `generate_chunk` task run per `generation.prompts_per_chunk`
groups, with retries. Inside it the groups fan out as plain Dask work on the flow's own cluster
(`worker_client`), because a Prefect task run costs about 100 times a Dask task. Every slot
admission allows goes to the engines at once, and their first-come-first-served queues serve
the oldest batch first: the lag bound is what limits the work in flight. With several
generators, each holds at most an equal share of that bound in flight, so that one added to a
running run finds slots to claim.

Between chunks the flow restarts dead engines on the current snapshot, loads newer snapshots
(pause, then load -> continue while the chunks the new version admits start: their requests
wait in the paused engines, and their start overlaps the load instead of following it) and
publishes how many groups it has in flight on each policy version (kept fresh by a thread while
a load or restart holds the loop up), which the trainer reads so that it trains the oldest of
them before they go stale. Each trainer state it reads, it checks
against the groups committed since the last one, and reports those past the lag bound, which
the trainer may have stopped looking for (tasks/lag.py "Late groups").
It stops when the trainer's published state says done, or when the pipeline that started it no
longer holds the run (tasks/lease.py `PipelineWatch`: a dead or failed deployed parent), and then
aborts the engines' requests: the groups in flight would never be trained. Asked to retire (a
scale-down), it claims nothing more and finishes the chunks it has in flight, so that every slot
it claimed is committed. On its way out every Dask worker closes its clients of the run's
engines (`worker_state_released`): the workers of a cluster at dask.address outlive the run.
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import dask
from distributed import as_completed, worker_client
from prefect import flow, task
from prefect.cache_policies import NONE
from prefect.futures import PrefectFuture
from prefect_dask import DaskTaskRunner

from configs.schema import RunConfig
from infra.engines.fleet import EngineFleet
from infra.scratch import scratch_dir
from infra.storage import RunStore, open_run_store
from tasks.generator import FAILED_GROUPS_IN_A_ROW_LIMIT, Generator, SnapshotRejected, snapshot_dir_for_engines
from tasks.lag import (
    IN_FLIGHT_TTL_SECONDS, live_producers, publish_in_flight, read_trainer_state, recheck_after_restart, report_late, retire_requested,
    withdraw_in_flight,
)  # fmt: skip
from tasks.lease import PipelineWatch, check_run_free
from tasks.metrics import MetricsLog
from tasks.placement import first_engine_of
from tasks.envthread import EnvironmentFailed
from tasks.snapshots import unpin_snapshot
from tasks.worker import GroupResult, GroupSpec, generate_group, release_worker_state


POLL_SECONDS = 0.2
"""How often the loop looks at LATEST and the trainer state while it has nothing to start: a
storage read each, so not much more often than the trainer steps."""


LOAD_REPORT_SECONDS = 10.0
"""How often a generator records how much of its time it could start no work."""


@task(cache_policy=NONE, retries=2, retry_delay_seconds=[1, 5])
def generate_chunk(specs: list[GroupSpec]) -> list[GroupResult]:
    """Generate and commit a chunk of groups, fanned out on Dask; a retry skips committed groups.

    No task timeout: Prefect cannot interrupt a Dask worker thread. Every engine request inside
    carries its own (engine.request_timeout_s) and a bounded retry budget, and every call of the
    environment its own (env.step_timeout_s), which is what bounds a chunk.

    The groups are submitted through the worker's own client (`worker_client`), which also
    secedes this thread from the worker's pool while it waits: the groups need worker threads
    too, and a few chunks in flight would otherwise hold every thread and wait forever.
    prefect_dask's `get_dask_client` is not used here: it opens a temporary Client per call,
    which becomes the process's default, and a chunk that starts while another closes its
    client is handed the closed one (PrefectHQ/prefect#17334), failing the chunk."""
    return [result for result in fan_out(generate_group, specs) if result is not None]


def fan_out(function: Callable, items: list) -> list:
    """`function` over `items` as plain Dask tasks on the cluster the calling task runs on;
    the results in the order they finish."""
    with worker_client() as client:
        futures = client.map(function, items, pure=False)
        return [future.result() for future in as_completed(futures)]


def dask_task_runner(config: RunConfig) -> DaskTaskRunner:
    """The run's Dask cluster: the scheduler at dask.address, or a LocalCluster of processes.

    The generation flow enters it itself rather than taking it as the flow's task runner:
    its size comes from the run's config, a parameter, and a deployment's flow (started by a
    worker from its entrypoint) has no other place to take it from.

    Dask's own INFO lines (a client connection per chunk) would bury the run's progress, so
    its loggers are kept to warnings.

    The workers' statistical profiler is off. It calls sys._current_frames() every 10 ms, and on
    CPython 3.11 a garbage collection inside that call, while another thread starts (each chunk
    secedes a thread), deadlocks the whole worker process with no error (CPython gh-106883,
    fixed in 3.12 only): a run of benchmarks/faults.py hung that way, every worker thread
    waiting for the GIL. The nanny hands this config to the worker processes it starts.

    The scheduler's HTTP server takes a free loopback port: it starts even without a dashboard,
    on 8787 by default (every generation run after the first on a machine warned that it was
    taken), and ":0" would serve its call stacks and metrics on every interface."""
    logging.getLogger("distributed").setLevel(logging.WARNING)
    dask.config.set({"distributed.worker.profile.enabled": False})
    if config.dask.address:
        return DaskTaskRunner(address=config.dask.address)
    return DaskTaskRunner(
        cluster_class="distributed.LocalCluster",
        cluster_kwargs={"n_workers": config.dask.n_workers, "threads_per_worker": config.dask.threads_per_worker,
                        "processes": True, "dashboard_address": "127.0.0.1:0", "silence_logs": logging.WARNING},
    )  # fmt: skip


@contextmanager
def worker_state_released(dask: DaskTaskRunner, fleet: EngineFleet, store: RunStore, cluster_outlives_run: bool) -> Iterator[None]:
    """On the way out, every worker of `dask`'s cluster closes its clients of `fleet`'s engines
    and forgets the run's tokenizer (tasks/worker.py `release_worker_state`), if the cluster
    outlives the run: the workers at dask.address serve run after run and would keep them, while
    a LocalCluster ends with the run (and one whose run failed before its first chunk is not
    even started: asking its workers would start it)."""
    try:
        yield
    finally:
        if cluster_outlives_run:
            try:
                dask.client.run(release_worker_state, tuple(fleet.urls), store.url)
            except Exception as err:  # the run's own outcome matters more
                print(f"could not release the Dask workers' engine clients: {err!r}")


@flow(name="generation", log_prints=True)
def generation(config: RunConfig, producer: str = "gen0", pipeline_claim: str | None = None) -> dict:
    """Generate rollouts for `config`'s run until its trainer is done, or the pipeline whose lease
    claim is `pipeline_claim` no longer holds the run; returns counts. Its pin goes with it,
    however it ends: a retired or failed generator's version would be kept for good (a restart
    of the same producer pins again). Without `pipeline_claim` (started by hand), RunInUse while
    a pipeline holds the run: its claims would collide with that pipeline's generator's."""
    store = open_run_store(config.storage, config.run_id)
    if pipeline_claim is None:  # started by hand: not beside the generators of a pipeline that holds the run
        check_run_free(store)
    pipeline = PipelineWatch(store, pipeline_claim)
    try:
        with scratch_dir(f"tandem-{producer}-") as cache:
            return _generate(config, producer, cache, pipeline)
    finally:
        try:
            if pipeline.successor is None:  # else the pin is the successor's generator of this name
                unpin_snapshot(store, producer)
        except Exception as err:  # the run's own outcome matters more; a restart of it pins again
            print(f"{producer}: could not drop its snapshot pin: {err!r}")


def _generate(config: RunConfig, producer: str, cache: Path, pipeline: PipelineWatch) -> dict:
    store = pipeline.store
    model_dir, version = snapshot_dir_for_engines(config, cache, producer)
    metrics = MetricsLog(store, f"generator-{producer}")
    totals = {"groups": 0, "samples": 0, "groups_failed": 0, "engine_restarts": 0, "weight_updates": 0}
    fleet = EngineFleet(config.engine, config.generation.engines, model_dir, version, cache / "logs", first_engine_of(config, producer))
    in_flight: list[_Chunk] = []
    with (dask_task_runner(config) as dask, fleet, worker_state_released(dask, fleet, store, bool(config.dask.address)),
          InFlightReport(store, producer, in_flight) as reported):  # fmt: skip
        metrics.log("engines_started", version=version, engines=fleet.describe(), pid=os.getpid())
        generator = Generator(config, producer, fleet, cache)
        _recover_records(metrics, generator, config.generation.samples_per_prompt)
        busy_since, idle_seconds = time.monotonic(), 0.0
        retiring = _RetireCheck(store, producer)
        producers = _ProducerCount(store, producer)
        load = _LoadReport(metrics)
        # Committed groups whose first trainer state read since their commit is still to come
        # (tasks/lag.py "Late groups"); at the start, an earlier life's recent ones.
        unchecked = recheck_after_restart(generator.committed_at_start.values(), read_trainer_state(store).version, config.lag.max_lag)

        def start_chunk() -> bool:
            """Submit one chunk of what admission allows now; False if it allows nothing."""
            held = sum(len(chunk.slots) for chunk in in_flight)
            specs = generator.claim_specs(config.generation.prompts_per_chunk, held, producers.count(), new_claims=not retiring.due())
            if specs:
                in_flight.append(_Chunk(dask.submit(generate_chunk, {"specs": specs}), specs[0].loaded_version, [s.slot for s in specs]))
            return bool(specs)

        def start_chunks() -> None:
            while start_chunk():
                pass

        while True:
            state = read_trainer_state(store)
            report_late(store, unchecked, state.version, config.lag.max_lag)
            unchecked.clear()
            if state.done or pipeline.gone() or (retiring.due() and not generator.orphans and not in_flight):
                break  # retiring: once every chunk is in, so that a group aborted in one is made again first
            if fleet.restart_dead():
                totals["engine_restarts"] = fleet.restarts
                metrics.log("engines_restarted", version=fleet.version, engines=fleet.describe(), restarts=fleet.restarts)
            for chunk in [c for c in in_flight if c.future.wrapped_future.done()]:
                in_flight.remove(chunk)
                results = chunk.future.result()
                aborted, set_aside = generator.requeue_unfinished(chunk.slots, results)
                unchecked += _record(metrics, totals, [*results, *set_aside], fleet.version)
                _stop_if_groups_keep_failing(totals)
                if aborted:
                    metrics.log("groups_aborted", slots=aborted)
            try:
                if timings := generator.refresh_weights(while_loading=start_chunks):
                    totals["weight_updates"] += 1
                    metrics.log("weights_loaded", version=fleet.version, **timings)
            except SnapshotRejected as rejected:
                print(f"{producer}: {rejected}; the engines stay on v{fleet.version}")
                metrics.log("snapshot_rejected", version=rejected.version, reason=rejected.reason[:500])
            started = start_chunk()
            reported.maybe_publish()
            if not started and not in_flight:
                idle_started = time.monotonic()
                time.sleep(POLL_SECONDS)
                idle_seconds += time.monotonic() - idle_started
            elif not started:
                _wait_for_first([c.future for c in in_flight], POLL_SECONDS)
            load.maybe_log(idle_seconds, len(in_flight))
        if pipeline.successor is not None:  # its generator of this name writes the record now
            reported.stop()
        if in_flight and (read_trainer_state(store).done or pipeline.reason is not None):
            fleet.abort_all()
        for chunk in in_flight:
            unchecked += _record(metrics, totals, chunk.future.result(), fleet.version)
        report_late(store, unchecked, read_trainer_state(store).version, config.lag.max_lag)
        if pipeline.successor is None:  # else the record is the successor's generator of this name
            reported.withdraw()
    totals.pop("keys", None)
    totals.pop("failed_in_a_row", None)
    totals.pop("last_failure", None)
    totals["retired"] = retiring.requested
    if pipeline.reason is not None:
        print(f"{producer}: stopped: {pipeline.reason}")
        totals["pipeline_gone"] = pipeline.reason
    metrics.log("finished", busy_seconds=time.monotonic() - busy_since - idle_seconds, idle_seconds=idle_seconds, **totals)
    metrics.flush()
    return totals


@dataclass
class _Chunk:
    """A `generate_chunk` run in flight: its future, and the policy version and slots of its groups."""

    future: PrefectFuture
    version: int
    slots: list[int]


class InFlightReport:
    """Publishes this generator's groups in flight by policy version (tasks/lag.py
    `publish_in_flight`) when they change, and, from a thread of its own, again every third of
    the record's lifetime, which is how the trainer tells a live generator's record from a dead
    one's. The thread is why: the flow's loop can be held up for longer than the lifetime while
    its groups are still in flight (a large snapshot's fetch, a real model's weight load or an
    engine's restart take minutes), and a stale record would have the trainer stop waiting for
    them and a restarted pipeline hand this generator's claims to another. The thread counts
    the chunks afresh each time, leaving out those that finished meanwhile, which the held-up
    loop has not yet taken off `chunks`: the trainer would wait for groups already committed."""

    def __init__(self, store, producer: str, chunks: list[_Chunk], refresh_seconds: float = IN_FLIGHT_TTL_SECONDS / 3):
        self.store, self.producer, self.chunks, self.refresh_seconds = store, producer, chunks, refresh_seconds
        self.published: Counter | None = None
        self._lock = threading.Lock()  # a refresh never overwrites a newer count with an older one
        self._stop = threading.Event()
        self._refresher = threading.Thread(  # in the flow run's context, for its warnings' sake (flows/__init__.py)
            target=contextvars.copy_context().run, args=(self._refresh,), name=f"tandem-in-flight-{producer}", daemon=True
        )

    def __enter__(self) -> InFlightReport:
        self._refresher.start()
        return self

    def __exit__(self, exc_type, *exc) -> None:
        """A generator that fails withdraws its record (unless it was stopped already: a
        successor's generator of this name owns it then): its chunks end with its Dask cluster,
        which closes next, and the record, left to lapse, had the trainer wait a lifetime for
        last-chance groups that would never come, and a pipeline started meanwhile leave it the
        claims no run of it would make."""
        if exc_type is None or self._stop.is_set():
            self.stop()
            return
        try:
            self.withdraw()
        except Exception as err:  # the failure under way is the one to report
            print(f"{self.producer}: could not withdraw its in-flight record: {err!r}")

    def maybe_publish(self) -> None:
        """Publish the count if it changed since the last publish."""
        with self._lock:
            groups = self._count()
            if groups != self.published:
                publish_in_flight(self.store, self.producer, groups)
                self.published = groups

    def stop(self) -> None:
        """Refresh no more (the record may be another's now: a successor's generator of this name)."""
        self._stop.set()
        if self._refresher.is_alive():
            self._refresher.join()

    def withdraw(self) -> None:
        """Stop refreshing and remove the record: this generator has stopped."""
        self.stop()
        withdraw_in_flight(self.store, self.producer)

    def _count(self) -> Counter:
        groups = Counter()
        for chunk in list(self.chunks):  # a copy: the loop changes the list
            if not chunk.future.wrapped_future.done():
                groups[chunk.version] += len(chunk.slots)
        return groups

    def _refresh(self) -> None:
        while not self._stop.wait(self.refresh_seconds):
            with self._lock:
                if self.published is None:
                    continue
                try:
                    groups = self._count()
                    publish_in_flight(self.store, self.producer, groups)
                    self.published = groups
                except Exception as err:  # storage trouble: the next refresh, well within the lifetime, tries again
                    print(f"{self.producer}: could not refresh its in-flight record: {err!r}")


class _LoadReport:
    """A `load` record every `LOAD_REPORT_SECONDS`: the share of that window in which this
    generator had nothing it was allowed to start (waiting on the lag bound, or for a snapshot).
    The deployed parent's autoscaler reads it (tasks/autoscale.py)."""

    def __init__(self, metrics: MetricsLog):
        self.metrics, self.since, self.idle_at_start = metrics, time.monotonic(), 0.0

    def maybe_log(self, idle_seconds: float, in_flight: int) -> None:
        window = time.monotonic() - self.since
        if window >= LOAD_REPORT_SECONDS:
            share = (idle_seconds - self.idle_at_start) / window
            self.metrics.log("load", idle_fraction=share, window_seconds=window, chunks_in_flight=in_flight)
            self.since, self.idle_at_start = time.monotonic(), idle_seconds


class _RetireCheck:
    """Whether this producer was asked to leave the run (tasks/lag.py `request_retire`),
    looked up at most once a second: it is a storage read, and scaling down is not urgent."""

    def __init__(self, store, producer: str):
        self.store, self.producer, self.checked_at, self.requested = store, producer, 0.0, False

    def due(self) -> bool:
        if not self.requested and time.monotonic() - self.checked_at >= 1.0:
            self.checked_at = time.monotonic()
            self.requested = retire_requested(self.store, self.producer)
        return self.requested


class _ProducerCount:
    """How many generators the run has now (tasks/lag.py `live_producers`, this one included),
    which sets this one's share of the admission window; looked up at most once a second: a
    listing and a read per generator, and generators join and leave on a scale of seconds."""

    def __init__(self, store, producer: str):
        self.store, self.producer, self.checked_at, self.producers = store, producer, float("-inf"), 1

    def count(self) -> int:
        if time.monotonic() - self.checked_at >= 1.0:
            self.checked_at = time.monotonic()
            self.producers = len(live_producers(self.store) | {self.producer})
        return self.producers


def _wait_for_first(futures: list, timeout: float) -> None:
    """Block until one chunk finishes or `timeout` passes. It looks at the Dask futures
    themselves, a local check: a Prefect future's `state` is an API call, and polling it in a
    loop kept the Prefect server busier than the engines."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not any(f.wrapped_future.done() for f in futures):
        time.sleep(0.01)


def _recover_records(metrics: MetricsLog, generator: Generator, samples: int) -> None:
    """Record the groups an earlier life of this producer committed but died before recording
    (metrics are flushed every few seconds), so that the run's accounting still sees them."""
    recorded = {line["key"] for line in map(json.loads, metrics.lines) if line["event"] == "group"}
    for slot, key in sorted(generator.committed_at_start.items()):
        if key not in recorded:
            metrics.log("group", slot=slot, key=key, samples=samples, recovered=True)
    if generator.orphans:
        metrics.log("orphans_reclaimed", slots=generator.orphans)


def _record(metrics: MetricsLog, totals: dict, results: list[GroupResult], version: int) -> list[str]:
    """Log each committed group once, also one that a failed attempt of its chunk committed, and
    each group that failed (set aside: tasks/failed_groups.py), and count those in a row; returns
    the committed groups' keys."""
    for result in results:
        if result.key in totals.setdefault("keys", set()):
            continue
        totals["keys"].add(result.key)
        if result.failure is not None:
            totals["groups_failed"] += 1
            totals["failed_in_a_row"] = totals.get("failed_in_a_row", 0) + 1
            totals["last_failure"] = result.failure
            metrics.log("group_failed", slot=result.slot, key=result.key, error=result.failure[:2000], loaded_version=version)
            print(f"group of slot {result.slot} set aside ({result.key}), another made in its place: {result.failure[:500]}")
        else:
            totals["failed_in_a_row"] = 0
            totals["groups"] += 1
            totals["samples"] += result.samples
            metrics.log("group", slot=result.slot, key=result.key, samples=result.samples,
                        reward_mean=result.reward_mean, policy_version=result.policy_version,
                        loaded_version=version, started_at=result.started_at, finished_at=result.finished_at,
                        tokens=result.tokens, tokens_per_second=result.tokens / max(result.finished_at - result.started_at, 1e-9))  # fmt: skip
    return [result.key for result in results if result.failure is None]


def _stop_if_groups_keep_failing(totals: dict) -> None:
    """EnvironmentFailed once FAILED_GROUPS_IN_A_ROW_LIMIT groups in a row have failed: a bug, a
    tool that is down, or engines that abort every request, which setting groups aside would
    only carry through the data set."""
    if totals.get("failed_in_a_row", 0) >= FAILED_GROUPS_IN_A_ROW_LIMIT:
        raise EnvironmentFailed(
            f"{totals['failed_in_a_row']} groups in a row failed, each set aside with its error in quarantine/failed-groups/: "
            f"a bug, a tool that is down, or engines that abort every request; not bad luck. The last: {totals['last_failure']}"
        )  # fmt: skip
