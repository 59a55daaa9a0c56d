"""A generation run's engines: start N of them, keep them alive, move them to new weights.

`EngineFleet` owns the engine processes of one generator (CPU engines or SGLang servers, by
`engine.backend`). `restart_dead` is called between chunks of work: an engine that died
(preempted, OOM-killed, SIGKILLed) is started again on the snapshot the fleet is on, so it comes
back with the same weights as its siblings; meanwhile the rollout clients have already moved its
requests to the live engines. `update_weights` moves every live engine with the client's
pause -> load -> continue and records the version the fleet is on; a `pause` first lets a
generator send the work that needs the new weights while they load: it waits in the engines'
queues and runs on them from its first token (tasks/generator.py).

The fleet sends its pauses, loads and aborts through one `EngineControl` (control.py) that lives
as long as the engines do, on an event loop of its own (an anyio blocking portal, so the fleet's
callers stay synchronous). Why not a client per call: an engine that hangs through a sync (stopped, swapping)
gets pauses that it only answers once it runs again, and the client that gave up on it must be
there then to continue it: its health probe does that (infra/engines/client.py). A client closed
after the call left such an engine paused, holding every request sent to it, until the next
version's sync. Continued, the engine runs on the weights it has, which its answers report, until
the next sync, which tries every engine that answers. Use the fleet as a context manager:
the portal's thread runs until `stop`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from contextlib import ExitStack
from pathlib import Path
from typing import TypeVar

from anyio.from_thread import BlockingPortal, start_blocking_portal

from configs.sections import EngineConfig
from infra.engines.control import EngineControl, WeightSyncResult
from infra.engines.process import EngineProcess, EngineStartError, cpu_engine_process
from infra.ports import free_port_block, port_is_free, reserve_ports

log = logging.getLogger(__name__)
T = TypeVar("T")
RESTART_BACKOFF_SECONDS = 10.0
"""The wait before an engine that failed its restart is started again, doubled at each failure."""
CRASH_LOOP_SECONDS = 60.0
"""An engine that dies this soon after its start counts as a failed start."""


class EngineFleet:
    """N engine processes serving the same weights."""

    def __init__(self, engine: EngineConfig, count: int, model_dir: Path, version: int, log_dir: Path, first_engine: int = 0):
        """`first_engine`: the number of this fleet's first engine among every engine its machine
        runs (other fleets' come before it): an SGLang engine's GPUs and seed follow from it."""
        self.engine = engine
        self.first_engine = first_engine
        self.model_dir = model_dir
        self.version = version
        self.log_dir = log_dir
        self.ports = self._ports(engine, count, first_engine)
        self.nccl_ports = [free_port_block(count=count) + i for i in range(count)] if engine.backend == "sglang" else []
        """Each SGLang engine's torch.distributed port, tandem's to pick (infra/engines/sglang.py)."""
        self.processes: list[EngineProcess] = [self._process(port) for port in self.ports]
        self.engine_versions = [version] * count
        """The version each engine serves: behind `version` after it failed that load."""
        self._started_at = [float("-inf")] * count
        self._restart_failures = [0] * count
        self._restart_due = [float("-inf")] * count
        self.restarts = 0
        self._control = ExitStack()
        self._portal: BlockingPortal | None = None
        self._client: EngineControl | None = None

    @staticmethod
    def _ports(engine: EngineConfig, count: int, first_engine: int) -> list[int]:
        """The fleet's ports: free ones, or with engine.base_port, engine i of the machine's on
        base_port + i. Those must be free: an engine's start is judged by /health answering on
        its port, which another fleet's engine there (a second generator's, before they were
        numbered apart) answered for it, and the fleet then served other weights unknowingly.
        (A deployed generation run has its machine to itself, its GPUs and these ports alike:
        tasks/placement.py `first_engine_of`.)"""
        if not engine.base_port:
            return [free_port_block(count=count) + i for i in range(count)]
        ports = [engine.base_port + first_engine + i for i in range(count)]
        if taken := [port for port in ports if not port_is_free(port)]:
            raise EngineStartError(
                f"engine.base_port {engine.base_port}: port {', '.join(map(str, taken))} of this machine's engines "
                f"{first_engine}-{first_engine + count - 1} (base_port + i) is in use, by another run's engines or another "
                "server: give engine.base_port a free range, or 0 to pick free ports"
            )  # fmt: skip
        reserve_ports(ports)  # an SGLang engine binds its port after loading: no other port of ours may be drawn there
        return ports

    @property
    def urls(self) -> list[str]:
        return [p.url for p in self.processes]

    @property
    def restart_seconds(self) -> float:
        """The longest an engine's restart may take (its backend's start timeout: minutes for SGLang)."""
        return max(process.start_timeout for process in self.processes)

    @property
    def api_key(self) -> str | None:
        return self.engine.api_key.get_secret_value() if self.engine.api_key else None

    def describe(self) -> list[dict]:
        """URL and process id of each engine: what an operator (or a fault test) needs to find it."""
        return [{"url": p.url, "pid": p.pid} for p in self.processes]

    def start(self, timeout: float | None = None) -> EngineFleet:
        """Launch every engine, then wait for each (within `timeout` s, default its backend's
        own: minutes for SGLang, which loads and captures graphs): they boot side by side, so N
        engines take about as long as one."""
        try:  # a launch that fails stops those launched before it
            for process in self.processes:
                process.launch()
            for process in self.processes:
                process.wait_healthy(timeout)
            self._portal = self._control.enter_context(start_blocking_portal())
            client = EngineControl(self.urls, api_key=self.api_key)
            self._client = self._control.enter_context(self._portal.wrap_async_context_manager(client))
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        try:
            self._control.close()
        finally:
            self._portal = self._client = None
            for process in self.processes:
                process.stop()

    def restart_dead(self, timeout: float | None = None) -> list[str]:
        """Start again every engine whose process has exited, on the fleet's current weights;
        returns the URLs started. One that does not start, or dies within `CRASH_LOOP_SECONDS`
        of its start (a faulted GPU, an out-of-memory at its first batch), is tried again after
        `RESTART_BACKOFF_SECONDS`, doubled at each such failure up to ten minutes: each start
        holds the generator's loop for up to the backend's start timeout, and the other engines
        serve meanwhile. Before, its start error ended the run however many engines were up."""
        restarted = []
        for i, process in enumerate(self.processes):
            now = time.monotonic()
            if process.is_running() or now < self._restart_due[i]:
                continue
            failures = self._restart_failures[i] + (now - self._started_at[i] < CRASH_LOOP_SECONDS)
            log.warning("engine %s died (exit %s); restarting on v%d", process.url, process.process.returncode, self.version)
            process.stop()  # what its group left running (SGLang's schedulers, on its GPUs)
            self._started_at[i] = time.monotonic()
            try:
                self.processes[i] = self._process(self.ports[i]).start(timeout)
            except EngineStartError as err:
                failures += 1
                log.error("engine %s did not start again: %s", process.url, str(err)[:2000])
            failures = self._restart_failures[i] = failures if failures > self._restart_failures[i] else 0
            self._restart_due[i] = time.monotonic() + (min(600.0, RESTART_BACKOFF_SECONDS * 2 ** (failures - 1)) if failures else 0.0)
            if self.processes[i] is not process:
                self.engine_versions[i] = self.version
                self.restarts += 1
                restarted.append(process.url)
        return restarted

    def pause(self, timeout: float = 2.0) -> bool:
        """Pause every engine, so that work sent to it waits until `update_weights` continues
        it; True if every engine confirmed. (update_weights pauses again: a pause is idempotent.)
        A healthy engine confirms in milliseconds; the short timeout keeps one hung engine from
        holding the healthy ones paused, which update_weights then continues after their loads.
        (The control client's probe, continuing an engine a sync left paused, may delay the
        pause by up to its own 2 s timeout.)"""
        return self._run(lambda client: client.pause("retract", timeout))

    def update_weights(self, model_dir: Path, version: int, timeout: float | None = None) -> list[WeightSyncResult]:
        """Pause, load snapshot `version` (a verified local directory) and continue every engine
        that answers within `timeout` (engine.weight_load_timeout_s); one that does not (hung, or
        dead until `restart_dead`) is reported failed."""
        timeout = timeout or self.engine.weight_load_timeout_s
        results = self._run(lambda client: client.update_weights(str(model_dir), str(version), timeout))
        self.model_dir, self.version = model_dir, version
        self._record(results)
        return results

    def reload_behind(self, timeout: float | None = None) -> list[WeightSyncResult]:
        """Load the fleet's version into every engine that failed to load it (hung through the
        sync, out of memory for a moment): it serves older weights meanwhile, whose groups the lag
        bound may soon drop. The others are left alone, and so is one that reports the version
        now (its load outlasted the sync's timeout). [] when none is behind."""
        behind = [url for url, version in zip(self.urls, self.engine_versions, strict=True) if version != self.version]
        if not behind:
            return []
        timeout = timeout or self.engine.weight_load_timeout_s
        results = self._run(lambda client: client.update_weights(str(self.model_dir), str(self.version), timeout, only=behind,
                                                                 unless_serving=True))  # fmt: skip
        self._record(results)
        return results

    def _record(self, results: list[WeightSyncResult]) -> None:
        for result in results:
            if result.ok:
                self.engine_versions[self.urls.index(result.url)] = self.version

    def abort_all(self) -> None:
        """Abort every request the engines are running or queueing (they answer it with
        finish_reason abort); one that does not answer within 5 s is skipped."""
        self._run(lambda client: client.abort_all())

    def _run(self, control: Callable[[EngineControl], Awaitable[T]]) -> T:
        """Run one control exchange with the fleet's client, on the fleet's event loop."""
        if self._portal is None or self._client is None:
            raise RuntimeError("start the fleet (EngineFleet.start, or `with fleet:`) before sending it control requests")
        client = self._client
        return self._portal.call(lambda: control(client))

    def _process(self, port: int) -> EngineProcess:
        log_path = self.log_dir / f"engine-{port}.log"
        if self.engine.backend == "sglang":
            from infra.engines.sglang import sglang_engine_process

            return sglang_engine_process(
                self.engine, str(self.model_dir), port, log_path, weight_version=str(self.version),
                index=self.first_engine + self.ports.index(port), nccl_port=self.nccl_ports[self.ports.index(port)],
            )  # fmt: skip
        return cpu_engine_process(
            self.model_dir, port, log_path, host=self.engine.host, api_key=self.api_key,
            max_batch_size=self.engine.max_batch_size, weight_version=str(self.version),
            sim_latency=self.engine.sim if self.engine.backend == "sim" else None,
        )  # fmt: skip

    def __enter__(self) -> EngineFleet:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()
