"""EngineFleet against real engine processes: what it does to engines that a weight sync lost.

A fleet pauses its engines twice per sync (the generator's pre-pause, then the sync's own), so an
engine that hangs through a sync receives pauses it answers only once it runs again. Its control
client outlives each sync, so it must not keep an engine out of later syncs once the engine
answers again. The faults are real: SIGSTOP and SIGCONT of an engine's process group, SIGKILL and
a restart on the same port, a load slower than the sync's timeout. The last two use sim engines,
which start in about a second.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from configs.sections import EngineConfig, SimLatencyConfig
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
        assert fleet.engine_versions == [0, 1]
        assert [(r.url, r.ok) for r in fleet.reload_behind(timeout=10)] == [(hung.url, True)], "the other engine is left alone"
        assert fleet.engine_versions == [1, 1] and engine_state(hung.url) == ("1", False)
        assert fleet.reload_behind() == []


def engine_state(url: str) -> tuple[str, bool]:
    info = httpx.get(f"{url}/server_info", timeout=5).json()
    return info["weight_version"], info["paused"]


def test_the_sync_after_a_restart_moves_the_restarted_engine_too(tmp_path: Path):
    """Engine 0 dies, the v1 sync fails on it, `restart_dead` starts it on v1, and the v2 sync
    follows at once, as in the generation loop: before the control client's probe has seen the
    new process."""
    models = [committed_model_dir(tmp_path / f"v{i}", seed=i) for i in range(3)]
    with EngineFleet(EngineConfig(backend="sim"), 2, models[0], 0, tmp_path / "logs") as fleet:
        fleet.processes[0].kill()
        assert [r.ok for r in fleet.update_weights(models[1], 1, timeout=5)] == [False, True]
        assert fleet.restart_dead() == [fleet.urls[0]]
        fleet.pause()
        results = fleet.update_weights(models[2], 2, timeout=5)
        assert [(r.ok, r.weight_version) for r in results] == [(True, "2"), (True, "2")], results
        assert [engine_state(url) for url in fleet.urls] == [("2", False), ("2", False)]


def test_the_sync_after_one_that_timed_out_on_a_slow_engine_moves_and_continues_it(tmp_path: Path):
    """The v1 load takes about 3 s against a 1 s timeout: the sync gives up on the engine (alive,
    continued, out of rotation). The next pre-pause holds it paused, although the control
    client's probe, which continues an engine left paused, runs every 0.5 s meanwhile; then the
    sync moves and continues it."""
    models = [committed_model_dir(tmp_path / f"v{i}", seed=i) for i in range(3)]
    slow = EngineConfig(backend="sim", sim=SimLatencyConfig(load_s_per_gb=1500), weight_load_timeout_s=1.0)
    with EngineFleet(slow, 1, models[0], 0, tmp_path / "logs") as fleet:
        assert [r.ok for r in fleet.update_weights(models[1], 1)] == [False], "engine.weight_load_timeout_s is the limit"
        assert fleet.pause() is True
        time.sleep(2.0)
        assert engine_state(fleet.urls[0])[1] is True, "the probe continued an engine held paused for a sync"
        results = fleet.update_weights(models[2], 2, timeout=15)
        assert [(r.ok, r.weight_version) for r in results] == [(True, "2")], results
        assert engine_state(fleet.urls[0]) == ("2", False)


def wait_for_late_load(fleet: EngineFleet) -> None:
    """Until the fleet's one engine, whose v1 load outlasted its sync, serves v1 (at most 30 s)."""
    deadline = time.monotonic() + 30
    while engine_state(fleet.urls[0]) != ("1", False) and time.monotonic() < deadline:
        time.sleep(0.2)


def test_a_load_that_outlasted_its_sync_is_not_loaded_again_once_the_engine_serves_it(tmp_path: Path):
    """The engine goes on loading after the sync gave up on it, and ends serving the version:
    reloaded, it was paused for a whole load each retry and timed out again, for good."""
    models = [committed_model_dir(tmp_path / f"v{i}", seed=i) for i in range(2)]
    slow = EngineConfig(backend="sim", sim=SimLatencyConfig(load_s_per_gb=1500), weight_load_timeout_s=1.0)
    with EngineFleet(slow, 1, models[0], 0, tmp_path / "logs") as fleet:
        assert [r.ok for r in fleet.update_weights(models[1], 1)] == [False]
        wait_for_late_load(fleet)
        assert engine_state(fleet.urls[0]) == ("1", False), "the load finished in the engine"
        results = fleet.reload_behind()  # loading again would take its 3 s against the 1 s timeout, and fail
        assert [(r.ok, r.weight_version) for r in results] == [(True, "1")] and fleet.engine_versions == [1]


def test_an_engine_found_serving_the_version_already_is_continued_after_a_pre_pause(tmp_path: Path):
    """The generator pauses every engine before a sync; one the sync sends no load to, since it
    serves the version already, stayed paused, healthy and in rotation, every request to it
    waiting until the next sync."""
    models = [committed_model_dir(tmp_path / f"v{i}", seed=i) for i in range(2)]
    slow = EngineConfig(backend="sim", sim=SimLatencyConfig(load_s_per_gb=1500), weight_load_timeout_s=1.0)
    with EngineFleet(slow, 1, models[0], 0, tmp_path / "logs") as fleet:
        assert [r.ok for r in fleet.update_weights(models[1], 1)] == [False]
        wait_for_late_load(fleet)
        assert fleet.pause() is True and engine_state(fleet.urls[0]) == ("1", True)
        results = fleet.update_weights(models[1], 1)
        assert [(r.ok, r.message) for r in results] == [(True, "serving it already: an earlier load finished late")]
        assert engine_state(fleet.urls[0]) == ("1", False), "left paused"


def test_no_second_load_goes_to_an_engine_while_one_it_never_answered_may_run(tmp_path: Path):
    """The v1 load (about 3 s) outlasts its 1 s sync, and the v2 sync comes while it runs: SGLang's
    server exits on a second load sent while a first runs in a pause. The v2 sync waits its 1 s
    for v1 to land, then gives the engine up without sending it v2: the engine ends on v1 (the
    sim engine would have run the v2 load after it); after v1 landed, v2 loads."""
    models = [committed_model_dir(tmp_path / f"v{i}", seed=i) for i in range(3)]
    slow = EngineConfig(backend="sim", sim=SimLatencyConfig(load_s_per_gb=1500), weight_load_timeout_s=1.0)
    with EngineFleet(slow, 1, models[0], 0, tmp_path / "logs") as fleet:
        assert [r.ok for r in fleet.update_weights(models[1], 1)] == [False]
        [result] = fleet.update_weights(models[2], 2)
        assert not result.ok and "has not answered and may still run" in result.message, result
        time.sleep(6.0)  # v1 lands at about 3 s; a v2 load sent at 1 s would have landed by 6 s
        assert engine_state(fleet.urls[0]) == ("1", False), "a second load was sent while the first ran"
        results = fleet.reload_behind(timeout=15)
        assert [(r.ok, r.weight_version) for r in results] == [(True, "2")] and engine_state(fleet.urls[0]) == ("2", False)


def test_an_engine_gets_its_own_api_key_or_none_never_the_shells(tmp_path: Path, monkeypatch):
    """A shell set up for `tandem engine serve` has TANDEM_ENGINE_API_KEY: a fleet's engine that
    inherited it refused every request of its fleet, which sends none, with 401."""
    import sys

    from infra.engines.process import API_KEY_ENV, EngineProcess

    monkeypatch.setenv(API_KEY_ENV, "from-the-shell")
    show = [sys.executable, "-c", f"import os; print('key:', os.environ.get({API_KEY_ENV!r}))"]
    for env, expected in ((None, "key: None"), ({API_KEY_ENV: "its-own"}, "key: its-own")):
        log = tmp_path / f"{expected}.log"
        process = EngineProcess(show, "http://127.0.0.1:1", log, env=env).launch()
        process.process.wait(30)
        assert log.read_text().strip() == expected


@pytest.mark.parametrize(("host", "url"), [("0.0.0.0", "http://127.0.0.1:7"), ("", "http://127.0.0.1:7"), ("::", "http://[::1]:7"),
                                           ("::1", "http://[::1]:7"), ("10.0.0.2", "http://10.0.0.2:7")])  # fmt: skip
def test_a_cpu_engine_bound_to_every_interface_is_reached_on_loopback(host: str, url: str, tmp_path: Path):
    from infra.engines.process import cpu_engine_process

    assert cpu_engine_process(tmp_path, 7, tmp_path / "e.log", host=host).url == url


def test_an_engine_that_does_not_start_again_is_tried_later_while_the_others_serve(tmp_path: Path, monkeypatch):
    """Its start error ended the run, however many engines were up; and an engine that died at
    once after each start was started again at every turn of the generator's loop."""
    import infra.engines.fleet as fleet_module
    from infra.engines.process import EngineStartError

    model = committed_model_dir(tmp_path / "v0", seed=0)
    with EngineFleet(EngineConfig(backend="sim"), 2, model, 0, tmp_path / "logs") as fleet:
        healthy = fleet.processes[1]
        fleet.processes[0].kill()
        fleet.processes[0].process.wait(timeout=10)
        monkeypatch.setattr(fleet_module, "RESTART_BACKOFF_SECONDS", 1.0)
        start = fleet._process

        def fails_to_start(timeout=None):
            raise EngineStartError("CUDA error: device faulted")

        def faulted_gpu(port: int):
            process = start(port)
            process.start = fails_to_start
            return process

        monkeypatch.setattr(fleet, "_process", faulted_gpu)
        assert fleet.restart_dead() == [] and fleet.restarts == 0, "no exception: the other engine serves"
        assert fleet.restart_dead() == [], "not tried again at once"
        monkeypatch.setattr(fleet, "_process", start)
        time.sleep(1.1)
        assert fleet.restart_dead() == [fleet.urls[0]] and fleet.restarts == 1
        assert fleet.processes[1] is healthy and all(p.is_healthy() for p in fleet.processes)


def test_fixed_ports_are_numbered_across_a_machines_fleets_and_a_port_in_use_is_refused(tmp_path: Path):
    """Two local generators' fleets once took the same engine.base_port range: the second's start
    was judged by /health answered by the first's engines, and it served other weights unknowingly."""
    import socket

    from infra.engines.process import EngineStartError
    from infra.ports import free_port_block

    base = free_port_block(count=4)
    engine = EngineConfig(base_port=base)
    assert EngineFleet(engine, 2, tmp_path, 0, tmp_path / "logs", first_engine=0).ports == [base, base + 1]
    assert EngineFleet(engine, 2, tmp_path, 0, tmp_path / "logs", first_engine=2).ports == [base + 2, base + 3]
    with socket.socket() as server:
        server.bind(("127.0.0.1", base + 3))
        server.listen()
        with pytest.raises(EngineStartError, match=rf"engine.base_port {base}: port {base + 3} of this machine's engines 2-3"):
            EngineFleet(engine, 2, tmp_path, 0, tmp_path / "logs", first_engine=2)
