"""A real Prefect server and process workers on loopback, for tests and benchmarks; and the stop
of the temporary server Prefect starts for a local run, for a run that exits without Python's
shutdown.

Deployed mode is tested the way users run it: `prefect server start` with a PREFECT_HOME of its
own (so its SQLite database and settings touch nothing of the user's), one `prefect worker
start --pool NAME` per work pool, and everything talking over HTTP. Each process is started in a
session of its own and stopped by its process group id, never by name.

Two gotchas handled here: a worker started from a non-interactive shell
inherits SIGINT ignored and then ignores SIGTERM too, so SIGINT is reset to the default in the
child; and workers poll every 15 s by default, so `start_worker` sets a 1 s poll for tests.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from infra.ports import free_port_block


def installed_command(name: str) -> str:
    """The console script `name` (prefect, tandem) installed beside this Python: a virtual
    environment's, which PATH may not lead to; the bare name where there is none."""
    beside_python = Path(sys.executable).with_name(name)
    return str(beside_python) if beside_python.exists() else name


def stop_temporary_server() -> None:
    """Stop the temporary API server Prefect started for this process, if it started one.

    Without PREFECT_API_URL Prefect serves its API from a uvicorn child process, which it stops
    from an atexit hook. A process that leaves with os._exit (an interrupted pipeline whose
    children did not stop in time) skips that hook, and the server would run on for good, holding
    its port, with nobody to use it. Prefect imports the module that starts it only to start it."""
    server = sys.modules.get("prefect.server.api.server")
    if server is not None:
        server.SubprocessASGIServer().stop()


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def descendants(pid: int) -> list[int]:
    """Every living process below `pid` (from /proc), children first."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, frontier = [], [pid]
    while frontier:
        frontier = [c for p in frontier for c in children.get(p, [])]
        found += frontier
    return found


def stop_process_group(process: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM the group `process` leads, then SIGKILL it if it is still there after `grace_s`.

    Processes it started in sessions of their own (a worker's flow runs, their engines) are
    found through /proc and their groups stopped too: they would outlive it otherwise."""
    for pid in descendants(process.pid) if process.poll() is None else []:
        try:
            group = os.getpgid(pid)
            if group != process.pid:
                os.killpg(group, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if process.poll() is None:
        for signum, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(process.pid, signum)
            except ProcessLookupError:
                break
            try:
                process.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
    try:  # whatever else the group started (a flow run's engines) goes with it
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


@dataclass
class PrefectServer:
    """`prefect server start` on 127.0.0.1 with its own PREFECT_HOME (database, logs)."""

    home: Path
    port: int = 0
    process: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    @property
    def ui_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """Environment for any process that should talk to this server."""
        return {"PREFECT_HOME": str(self.home), "PREFECT_API_URL": self.api_url,
                "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}  # fmt: skip

    def start(self, timeout_s: float = 90.0) -> PrefectServer:
        self.home.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port_block(1)
        # The UI asks the API at PREFECT_UI_API_URL, which otherwise defaults to port 4200.
        env = os.environ | self.env() | {"PREFECT_UI_API_URL": self.api_url}
        log = open(self.home / "server.log", "ab")
        self.process = subprocess.Popen(
            [installed_command("prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(self.port)],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True, preexec_fn=_default_sigint,
        )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"prefect server exited with {self.process.returncode}; see {self.home / 'server.log'}")
            try:
                if httpx.get(f"{self.api_url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise TimeoutError(f"prefect server on port {self.port} not healthy after {timeout_s:.0f} s")

    def stop(self) -> None:
        if self.process is not None:
            stop_process_group(self.process)
            self.process = None


def start_worker(pool: str, env: dict[str, str], log_path: Path, query_seconds: float = 1.0) -> subprocess.Popen:
    """`prefect worker start --pool POOL` in a session of its own, polling every `query_seconds`."""
    env = os.environ | env | {"PREFECT_WORKER_QUERY_SECONDS": str(query_seconds), "PREFECT_WORKER_PREFETCH_SECONDS": "5"}
    return subprocess.Popen(
        [installed_command("prefect"), "worker", "start", "--pool", pool, "--type", "process"],
        stdout=open(log_path, "ab"), stderr=subprocess.STDOUT, env=env, start_new_session=True, preexec_fn=_default_sigint,
    )  # fmt: skip
