"""CLI failures outside a run directory, each one line on stderr naming what to fix: `scale` and
`deploy` without a Prefect server to talk to, and `engine serve` on a port that is taken or on a
model directory that cannot be loaded.
(Bad configs and arguments that touch a run directory are in tests/test_badinput.py.)"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import committed_model_dir

ROOT = Path(__file__).resolve().parents[1]


def tandem(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """`tandem ARGS` from the project directory, with PREFECT_API_URL only where `env` sets it."""
    base = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    full_env = base | {"PYTHONPATH": str(ROOT), "COLUMNS": "250", "NO_COLOR": "1"} | (env or {})
    command = [sys.executable, "-m", "flows.cli", *args]
    return subprocess.run(command, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)


def one_line_error(done: subprocess.CompletedProcess) -> str:
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr[-3000:]
    return lines[0]


@pytest.fixture
def held_port():
    """A loopback port some other socket listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


SERVER_COMMANDS = [("scale", "demo", "--generators", "3"), ("deploy",), ("run", "configs/deployed.yaml")]
"""Commands that talk to the Prefect server: `run` does when its config's prefect.mode is deployed."""


@pytest.mark.parametrize("args", SERVER_COMMANDS, ids=["scale", "deploy", "run deployed"])
def test_scale_and_deploy_refuse_to_run_without_prefect_api_url(args, tmp_path: Path):
    # Without it Prefect would start a temporary server and the request would reach no run.
    done = tandem(*args, env={"PREFECT_HOME": str(tmp_path)})
    assert done.returncode == 2, done.stdout + done.stderr
    assert "PREFECT_API_URL is not set" in one_line_error(done)
    assert "asked for" not in done.stdout


@pytest.mark.parametrize("args", SERVER_COMMANDS, ids=["scale", "deploy", "run deployed"])
def test_scale_and_deploy_name_the_url_of_a_server_that_is_down(args, tmp_path: Path):
    with socket.socket() as sock:  # a port nobody listens on once closed
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/api"
    done = tandem(*args, env={"PREFECT_API_URL": url, "PREFECT_HOME": str(tmp_path)})
    assert done.returncode == 1, done.stdout + done.stderr
    line = one_line_error(done)
    assert f"cannot reach the Prefect server at {url}" in line and "Connection refused" in line


@pytest.mark.slow
def test_engine_serve_on_a_taken_port_fails_in_one_line_without_claiming_to_serve(held_port: int, tmp_path: Path):
    model = committed_model_dir(tmp_path / "model", seed=0)
    done = tandem("engine", "serve", "--model", str(model), "--port", str(held_port))
    assert done.returncode == 1, done.stdout + done.stderr
    assert one_line_error(done) == (
        f"error: --port {held_port}: cannot listen on 127.0.0.1:{held_port}: Address already in use"
    )
    assert "serving" not in done.stdout + done.stderr


@pytest.mark.parametrize(
    ("remove", "engine_args", "reason"),
    [
        ("model.safetensors", (), "no file named model.safetensors"),
        ("tokenizer.json", ("--sim-latency", "{}"), "Couldn't instantiate the backend tokenizer"),
    ],
    ids=["cpu without weights", "sim without tokenizer"],
)
@pytest.mark.slow
def test_engine_serve_on_a_model_it_cannot_load_fails_in_one_line(remove, engine_args, reason, tmp_path: Path):
    model = committed_model_dir(tmp_path / "model", seed=0)
    (model / remove).unlink()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    done = tandem("engine", "serve", "--model", str(model), "--port", str(port), *engine_args)
    assert done.returncode == 2, done.stdout + done.stderr
    line = one_line_error(done)
    assert line.startswith(f"error: --model: cannot load {model}: ") and reason in line
    assert "serving" not in done.stdout + done.stderr


@pytest.mark.slow
def test_of_two_engines_started_on_one_port_one_serves_and_the_other_fails(tmp_path: Path):
    """Both may bind the port while nothing listens on it yet (SO_REUSEADDR); the one that lost it
    used to load its model, log "serving" and stay up listening on nothing, since uvloop does not
    report the failed listen."""
    model = committed_model_dir(tmp_path / "model", seed=0)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "flows.cli", "engine", "serve", "--model", str(model), "--port", str(port)]
    env = os.environ | {"PYTHONPATH": str(ROOT), "COLUMNS": "250", "NO_COLOR": "1"}
    engines = [subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True) for _ in range(2)]  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while all(e.poll() is None for e in engines) and time.monotonic() < deadline:
            time.sleep(0.2)
        lost = [e for e in engines if e.poll() is not None]
        assert len(lost) == 1, "both engines are up, and only one can listen on the port"
        assert lost[0].returncode == 1 and f"--port {port}: cannot listen on 127.0.0.1:{port}" in lost[0].stderr.read()
        (winner,) = [e for e in engines if e.poll() is None]
        while time.monotonic() < deadline:
            try:
                assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
                break
            except httpx.TransportError:
                time.sleep(0.2)
        else:
            raise AssertionError("the engine that won the port never answered")
    finally:
        for engine in engines:
            if engine.poll() is None:
                os.killpg(engine.pid, signal.SIGTERM)
                engine.wait(timeout=30)


TANDEM_WARNING_IN_A_RUN = """
import flows
import logging
import uuid
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
from prefect.context import get_run_context
from prefect.testing.utilities import prefect_test_harness

@flow
def probe() -> str:
    logging.getLogger("tasks.probe").warning("quarantined a shard")
    return str(get_run_context().flow_run.id)

with prefect_test_harness():
    logging.getLogger("infra.probe").warning("outside any run")
    run_id = probe()
    with get_client(sync_client=True) as client:
        for _ in range(50):
            logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[uuid.UUID(run_id)])))
            if any("quarantined a shard" in log.message for log in logs):
                print("in the run's logs")
                break
            __import__("time").sleep(0.2)
"""


@pytest.mark.slow
def test_tandems_own_warnings_reach_the_runs_logs_in_the_ui():
    """tandem logs through its modules' loggers (an engine restarted, a shard quarantined,
    storage retrying), which Prefect sent to the terminal only: someone watching the run in the
    UI never saw why it slowed down or stopped. A record outside any run is not sent, and Prefect
    does not warn about it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_LOGGING_")}
    done = subprocess.run([sys.executable, "-c", TANDEM_WARNING_IN_A_RUN], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "in the run's logs" in done.stdout
    assert "outside any run" in done.stderr and "without a flow run id" not in done.stderr


PREFECT_SETTINGS_SEEN = """
import flows
from prefect.settings import get_current_settings
settings = get_current_settings().server
print(settings.ephemeral.startup_timeout_seconds, settings.analytics_enabled)
"""


def test_a_local_runs_temporary_prefect_server_may_take_two_minutes_to_start_unless_the_user_says_otherwise():
    """Prefect gives its temporary server 20 s: on a 2-core machine busy with another run, `tandem
    run` failed with "Timed out while attempting to connect to ephemeral Prefect API server"."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_SERVER_")}

    def seen(**overrides: str) -> str:
        done = subprocess.run([sys.executable, "-c", PREFECT_SETTINGS_SEEN], cwd=ROOT, env=env | overrides, capture_output=True, text=True, timeout=120)  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    assert seen() == "120 False"
    assert seen(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="33") == "33 False", "the user's own setting wins"
