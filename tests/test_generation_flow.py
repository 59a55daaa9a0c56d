"""The generation flow's Dask plumbing: chunks fanning out their groups on the flow's cluster."""

from __future__ import annotations

import asyncio
import random
import time
from types import SimpleNamespace

import pytest
from prefect import flow, task
from prefect.cache_policies import NONE
from prefect.testing.utilities import prefect_test_harness

from configs import TINY_CONFIG, load_config
from configs.sections import StorageConfig
from flows.generation import _record, _stop_if_groups_keep_failing, dask_task_runner, fan_out, worker_state_released
from infra.storage import open_run_store
from tasks.generator import FAILED_GROUPS_IN_A_ROW_LIMIT
from tasks.metrics import MetricsLog, read_metrics
from tasks.envthread import EnvironmentFailed
from tasks.shards import shard_key
from tasks.worker import GroupResult

pytestmark = pytest.mark.slow


def _jittered_identity(x: int) -> int:
    time.sleep(random.random() * 0.05)
    return x


@task(cache_policy=NONE)
def _chunk(items: list[int]) -> list[int]:
    return sorted(fan_out(_jittered_identity, items))


@flow
def _many_chunks_at_once(chunks: int) -> list:
    config = load_config(TINY_CONFIG, ["dask.n_workers=1", "dask.threads_per_worker=4"])
    with dask_task_runner(config) as dask:
        futures = [dask.submit(_chunk, {"items": list(range(4 * i, 4 * i + 4))}) for i in range(chunks)]
        return [future.result(raise_on_failure=False) for future in futures]


def test_chunks_starting_while_others_finish_all_fan_out():
    """60 chunks on one 4-thread worker start and finish in every interleaving. With prefect_dask's
    get_dask_client a chunk that started while another closed its temporary client got the
    closed one (PrefectHQ/prefect#17334): 5 of 60 failed on this machine."""
    with prefect_test_harness():
        results = _many_chunks_at_once(60)
    assert results == [list(range(4 * i, 4 * i + 4)) for i in range(60)]


def _profiler_setting(_: int) -> bool:
    import dask

    return dask.config.get("distributed.worker.profile.enabled")


@task(cache_policy=NONE)
def _profiler_settings_on_the_workers() -> list[bool]:
    return fan_out(_profiler_setting, [0, 1])


@flow
def _worker_profiler_flow() -> list[bool]:
    config = load_config(TINY_CONFIG, ["dask.n_workers=1", "dask.threads_per_worker=2"])
    with dask_task_runner(config) as dask:
        return dask.submit(_profiler_settings_on_the_workers, {}).result()


def test_the_worker_processes_run_without_the_statistical_profiler():
    """On CPython 3.11 its sys._current_frames() calls can deadlock a worker (gh-106883)."""
    with prefect_test_harness():
        assert _worker_profiler_flow() == [False, False]


def _open_engine_client(urls: tuple[str, ...]) -> None:
    """What a group does on a worker: a client of its run's engines, the run's tokenizer."""
    from tasks import worker

    spec = SimpleNamespace(engine_urls=urls, api_key=None, request_timeout=5.0, retry_seconds=1.0, hand_off_stragglers=True)
    asyncio.run_coroutine_threadsafe(worker._engine_client(spec), worker._worker_loop()).result()
    worker._TOKENIZERS[f"file:///runs/{urls[0][-2:]}"] = object()


def _worker_state() -> tuple[list, list]:
    from tasks import worker

    return sorted(key[0] for key in worker._CLIENTS), sorted(worker._TOKENIZERS)


@flow
def _two_runs_on_one_cluster() -> list:
    config = load_config(TINY_CONFIG, ["dask.n_workers=1", "dask.threads_per_worker=1"])
    with dask_task_runner(config) as dask:
        dask.client.run(_open_engine_client, ("http://127.0.0.1:10",))  # another run's, still going
        this_run = (SimpleNamespace(urls=["http://127.0.0.1:11"]), SimpleNamespace(url="file:///runs/11"))
        with worker_state_released(dask, *this_run, cluster_outlives_run=True):  # as a cluster at dask.address does
            dask.client.run(_open_engine_client, ("http://127.0.0.1:11",))
        return list(dask.client.run(_worker_state).values())


def test_a_generation_run_leaves_the_workers_without_its_engine_clients():
    """The workers of a cluster at dask.address outlive the run: they kept every run's engine
    clients (sessions, probes) and tokenizer for as long as they lived."""
    with prefect_test_harness():
        assert _two_runs_on_one_cluster() == [([("http://127.0.0.1:10",)], ["file:///runs/10"])]


def test_failed_groups_are_logged_apart_and_enough_in_a_row_stop_the_run(tmp_path):
    """A group the environment failed is no committed group (no samples, no reward, nothing to
    report late); FAILED_GROUPS_IN_A_ROW_LIMIT of them in a row stop the run, naming the last,
    once the chunk's every result is recorded."""
    store = open_run_store(StorageConfig(root=f"file://{tmp_path}"), "r")
    metrics = MetricsLog(store, "generator-gen0", flush_seconds=0)
    totals = {"groups": 0, "samples": 0, "groups_failed": 0}

    def result(slot: int, failure: str | None = None) -> GroupResult:
        return GroupResult(slot, shard_key(0, "gen0", slot), True, 0 if failure else 4, 0.5, 0, 0.0, 1.0, failure=failure)

    limit = FAILED_GROUPS_IN_A_ROW_LIMIT
    committed = _record(metrics, totals, [result(0), *(result(s, f"E{s}") for s in range(1, limit)), result(limit)], version=0)
    assert committed == [shard_key(0, "gen0", 0), shard_key(0, "gen0", limit)]
    assert (totals["groups"], totals["samples"], totals["groups_failed"]) == (2, 8, limit - 1)
    assert [r["slot"] for r in read_metrics(store, "generator-gen0") if r["event"] == "group_failed"] == list(range(1, limit))
    _stop_if_groups_keep_failing(totals)  # the run of failures ended at slot `limit`
    failing = [result(s, f"E{s}") for s in range(limit + 1, 2 * limit + 1)]
    assert _record(metrics, totals, [*failing, result(2 * limit + 1, "E")], version=0) == []
    assert totals["groups_failed"] == 2 * limit
    with pytest.raises(EnvironmentFailed, match=rf"^{limit + 1} groups in a row failed, each set aside.*The last: E$"):
        _stop_if_groups_keep_failing(totals)
