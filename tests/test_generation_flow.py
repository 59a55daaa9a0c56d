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
from flows.generation import dask_task_runner, fan_out, worker_state_released

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
    from tasks import generator

    spec = SimpleNamespace(engine_urls=urls, api_key=None, request_timeout=5.0, retry_seconds=1.0, hand_off_stragglers=True)
    asyncio.run_coroutine_threadsafe(generator._engine_client(spec), generator._worker_loop()).result()
    generator._TOKENIZERS[f"file:///runs/{urls[0][-2:]}"] = object()


def _worker_state() -> tuple[list, list]:
    from tasks import generator

    return sorted(key[0] for key in generator._CLIENTS), sorted(generator._TOKENIZERS)


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
