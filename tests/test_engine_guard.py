"""infra/engines/guard.py: an engine that does not watch its parent (SGLang) stops when the process
that started it dies, and still stops as usual when asked to. The command here is a stand-in
that writes its pid and sleeps: what matters is the process group around it."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from infra.engines.process import EngineProcess
from tests.test_engine_client import _assert_exits

SLEEPER = "import os, time; print(os.getpid(), flush=True); time.sleep(600)"


def _pid_in(log: Path, within: float = 30.0) -> int:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        text = log.read_text() if log.exists() else ""
        if text.strip():
            return int(text.split()[0])
        time.sleep(0.1)
    raise AssertionError(f"nothing in {log}")


def test_a_guarded_engine_stops_when_the_process_that_started_it_is_killed(tmp_path: Path):
    log = tmp_path / "engine.log"
    starter = (
        "import sys, time; from pathlib import Path; from infra.engines.process import EngineProcess; "
        f"p = EngineProcess([sys.executable, '-c', {SLEEPER!r}], 'http://127.0.0.1:9', Path({str(log)!r}), guard=True).launch(); "
        "time.sleep(600)"
    )
    parent = subprocess.Popen([sys.executable, "-c", starter], cwd=Path(__file__).resolve().parents[1])
    engine = _pid_in(log)
    parent.kill()
    parent.wait()
    _assert_exits(engine, 15)
    assert "is gone; stopping it" in log.read_text()


def test_a_guarded_engine_stops_when_asked_and_its_guard_with_it(tmp_path: Path):
    process = EngineProcess([sys.executable, "-c", SLEEPER], "http://127.0.0.1:9", tmp_path / "engine.log", guard=True).launch()
    engine = _pid_in(tmp_path / "engine.log")
    assert engine != process.pid, "the guard leads the group, the engine runs under it"
    started = time.monotonic()
    process.stop(grace=10)
    assert time.monotonic() - started < 5 and not process.is_running()
    _assert_exits(engine, 1)


def test_stopping_an_engine_whose_leader_died_stops_what_its_group_left(tmp_path: Path):
    """SGLang's launcher can die leaving its scheduler processes in its group, holding the GPU;
    a restart on that GPU would not fit. The leader here starts a sleeper and exits at once."""
    leaves_a_child = f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {SLEEPER!r}], stdout=sys.stdout)"
    process = EngineProcess([sys.executable, "-c", leaves_a_child], "http://127.0.0.1:9", tmp_path / "engine.log").launch()
    child = _pid_in(tmp_path / "engine.log")
    process.process.wait(10)
    assert not process.is_running()
    process.stop()
    _assert_exits(child, 5)
    process.stop()  # again: nothing left to do, and nothing else signalled
