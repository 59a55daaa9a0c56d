"""Engine processes: start a server command, wait until /health answers, stop it by PID.

Both backends run as separate processes behind the same HTTP API: the CPU engine
(`python -m flows.cli engine serve`) and SGLang (`python -m sglang.launch_server`, see sglang.py).
An `EngineProcess` is started in a new session so that stopping it signals its own process group
only (SGLang forks scheduler and detokenizer children), never anything else on the machine. An
engine must not outlive the process that started it: the CPU engine watches its parent itself,
SGLang runs under infra/engines/guard.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from configs.sections import SimLatencyConfig
from infra.engines.guard import guarded


class EngineStartError(RuntimeError):
    """The engine process exited or did not become healthy in time."""


API_KEY_ENV = "TANDEM_ENGINE_API_KEY"
"""Where `tandem engine serve` reads its API key from (the command line would show it to `ps`)."""


class EngineProcess:
    """One engine server process listening on `url`."""

    start_timeout = 300.0
    """How long a start waits for /health by default."""

    def __init__(self, command: list[str], url: str, log_path: Path, env: dict[str, str] | None = None, guard: bool = False):
        self.command = command
        self.url = url
        self.log_path = log_path
        self.env = env
        self.guard = guard
        """Run `command` under infra/engines/guard.py, which stops it if this process dies: for a
        server that does not watch its parent itself (SGLang)."""
        self.process: subprocess.Popen | None = None
        self._group_stopped = False

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def start(self, timeout: float | None = None) -> EngineProcess:
        """Start the process and return once GET /health answers 200 (within `timeout` s,
        default `start_timeout`)."""
        return self.launch().wait_healthy(timeout)

    def launch(self) -> EngineProcess:
        """Start the process without waiting for it (several engines boot side by side)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # The key is this engine's own or none: one inherited from a shell set up for
        # `tandem engine serve` would have the engine refuse its fleet's every request with 401.
        env = {name: value for name, value in os.environ.items() if name != API_KEY_ENV} | (self.env or {})
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                guarded(self.command) if self.guard else self.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=env, start_new_session=True,
            )  # fmt: skip
        self._group_stopped = False
        return self

    def wait_healthy(self, timeout: float | None = None) -> EngineProcess:
        """Return once GET /health answers 200 (within `timeout` s, default `start_timeout`);
        stop the process and raise if it never does, or if the wait itself is interrupted
        (Ctrl-C, a test's timeout): a server that nobody holds would otherwise outlive its
        caller, with a GPU's memory taken."""
        timeout = self.start_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise EngineStartError(f"engine exited with code {self.process.returncode}:\n{self.log_tail()}")
                if self.is_healthy():
                    return self
                time.sleep(0.2)
            raise EngineStartError(f"engine at {self.url} not healthy after {timeout:.0f}s:\n{self.log_tail()}")
        except BaseException:
            self.stop()
            raise

    def is_healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM the engine's process group, then SIGKILL what is left of it once the leader has
        exited or after `grace` seconds. Also for an engine whose leader died by itself: SGLang's
        scheduler processes outlive it in its group, holding the GPU's memory, and a restart on
        that GPU would not fit. Once only: a group that is gone may see its number reused."""
        if self.process is None or self._group_stopped:
            return
        if self.is_running():
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # the leader's children that outlived it (SGLang's)
        except ProcessLookupError:
            pass
        self.process.wait()
        self._group_stopped = True

    def kill(self) -> None:
        """SIGKILL the engine at once (fault tests: a preempted engine)."""
        if self.is_running():
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def __enter__(self) -> EngineProcess:
        return self if self.is_running() else self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


def cpu_engine_process(
    model_path: str | Path, port: int, log_path: Path, host: str = "127.0.0.1",
    api_key: str | None = None, max_batch_size: int = 32, weight_version: str = "0",
    sim_latency: SimLatencyConfig | None = None,
) -> EngineProcess:  # fmt: skip
    """An `EngineProcess` for tandem's CPU engine, or with `sim_latency` its simulated twin.
    The API key travels in the environment, not on the command line, where `ps` would show it
    to every user of the machine."""
    command = [
        sys.executable, "-m", "flows.cli", "engine", "serve", "--model", str(model_path),
        "--host", host, "--port", str(port), "--max-batch-size", str(max_batch_size),
        "--weight-version", weight_version, "--parent-pid", str(os.getpid()),
    ]  # fmt: skip
    if sim_latency is not None:
        command += ["--sim-latency", sim_latency.model_dump_json()]
    env = {API_KEY_ENV: api_key} if api_key else None
    return EngineProcess(command, f"http://{connect_host(host)}:{port}", log_path, env=env)


def connect_host(host: str) -> str:
    """Where a client on this machine reaches a server bound to `host`: loopback for every
    interface ("" or 0.0.0.0, ::), an IPv6 address in brackets."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host
