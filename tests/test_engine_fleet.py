"""EngineFleet against real CPU engine processes: what it does to engines that a weight sync lost.

A fleet pauses its engines twice per sync (the generator's pre-pause, then the sync's own), so an
engine that hangs through a sync receives pauses it answers only once it runs again. The fault is
real: SIGSTOP of the engine's process group, then SIGCONT.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from configs.schema import EngineConfig
from infra.engines.fleet import EngineFleet
from tests.conftest import committed_model_dir

pytestmark = pytest.mark.slow


def test_an_engine_that_hung_through_a_weight_sync_is_continued_when_it_answers_again(tmp_path: Path):
    """Engine 0 stops during the sync; both of its pauses land when it runs again. Left alone it
    would hold every request sent to it until the next version's sync continued it."""
    v0, v1 = committed_model_dir(tmp_path / "v0", seed=0), committed_model_dir(tmp_path / "v1", seed=1)
    with EngineFleet(EngineConfig(), 2, v0, 0, tmp_path / "logs") as fleet:
        hung = fleet.processes[0]
        os.killpg(hung.pid, signal.SIGSTOP)
        try:
            confirmed = fleet.pause(timeout=1.0)
            results = fleet.update_weights(v1, 1, timeout=2.0)
        finally:
            os.killpg(hung.pid, signal.SIGCONT)
        assert confirmed is False
        assert [r.ok for r in results] == [False, True], results
        assert fleet.version == 1

        def server_info() -> dict:
            return httpx.get(f"{hung.url}/server_info", timeout=5).json()

        deadline = time.monotonic() + 15
        while server_info()["paused"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert server_info()["paused"] is False, "the engine stayed paused after it recovered"
        answer = httpx.post(f"{hung.url}/generate", json={"input_ids": [1, 20, 21], "sampling_params": {"max_new_tokens": 2}}, timeout=10)
        assert answer.status_code == 200
        assert answer.json()["meta_info"]["weight_version"] == "0", "it runs on the weights it has until the next sync"
