"""The generation flow's Dask plumbing: chunks fanning out their groups on the flow's cluster."""

from __future__ import annotations

import random
import time

import pytest
from prefect import flow, task
from prefect.cache_policies import NONE
from prefect.testing.utilities import prefect_test_harness

from configs import TINY_CONFIG, load_config
from flows.generation import dask_task_runner, fan_out

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
