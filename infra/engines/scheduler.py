"""What tandem's two in-process engines share: the request types and the scheduler thread's front.

An engine (`CpuEngine`, `SimEngine`) owns one scheduler thread that does all the work. HTTP
handlers (server.py) only use the thread-safe front `ScheduledEngine` defines: they `submit` a
`GenerationJob` and wait on its future, and they send weight updates, pauses and aborts as
commands (`run_command`) that the thread applies between two steps. So nothing a step reads
changes during the step, and no lock is held while the model (or the latency model) computes.

A subclass supplies the steps: `_collect_work` (take submitted jobs in; is there anything to
step?), `_step` (one batched step), `_fail_running` (end every running request with an error
after a step raised), `_retract` (a pause in mode retract: running sequences back to the queue),
plus `abort`, `update_weights` and `stats`.

When the thread stops (a shutdown, or an error outside a step), every request and command it
would have served fails with `EngineStopped` at once, and so does any sent afterwards: an HTTP
handler waiting on one would otherwise hold its caller until the caller's timeout.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from infra.engines.api import SamplingParams

if TYPE_CHECKING:  # the CPU engine's samplers; the simulated engine's process never imports torch
    import torch

log = logging.getLogger(__name__)


class EngineStopped(RuntimeError):
    """The engine's scheduler thread has stopped: nothing queued or sent to it will be served."""


@dataclass(eq=False)
class GenerationJob:
    """One /generate request: a prompt sampled `params.n` times."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    future: Future = field(default_factory=Future)
    submitted_at: float = field(default_factory=time.monotonic)
    aborted: bool = False
    samples: list[Sample] = field(default_factory=list)
    weight_version: str = ""


@dataclass(eq=False)
class Sample:
    """One sequence being generated for a job (sample `index` of its n)."""

    job: GenerationJob
    index: int
    generator: torch.Generator | None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: dict | None = None
    weight_versions: list[dict] = field(default_factory=list)
    """Which weight version produced which output tokens: SGLang's `meta_info.weight_versions`
    spans, {version, start, end} over output positions [start, end)."""

    def record_token(self, token: int, logprob: float, weight_version: str) -> None:
        """Append one generated token, produced by the weights of `weight_version`."""
        self.output_ids.append(token)
        self.logprobs.append(logprob)
        end = len(self.output_ids)
        if self.weight_versions and self.weight_versions[-1]["version"] == weight_version:
            self.weight_versions[-1]["end"] = end
        else:
            self.weight_versions.append({"version": weight_version, "start": end - 1, "end": end})

    @property
    def context_length(self) -> int:
        return len(self.job.input_ids) + len(self.output_ids)


class ScheduledEngine:
    """The thread-safe front of an engine and the loop of its scheduler thread."""

    def __init__(self, model_path: str | Path, max_batch_size: int, weight_version: str):
        self.model_path = str(model_path)
        self.max_batch_size = max_batch_size
        self.weight_version = weight_version
        self.waiting: queue.SimpleQueue[GenerationJob] = queue.SimpleQueue()
        self.commands: queue.SimpleQueue[tuple[Callable[[], object], Future]] = queue.SimpleQueue()
        self.wake = threading.Event()
        self.paused = False
        self.running = True
        self.stopped = False
        """Set once the thread has left its loop; from then on, work is failed, not queued."""
        self.thread = threading.Thread(target=self._schedule, name=f"{type(self).__name__}-scheduler", daemon=True)

    def start_scheduler(self) -> None:
        """Start the thread; a subclass calls it last in its __init__, once its state exists."""
        self.thread.start()

    # -- the API the HTTP server calls (thread-safe) -----------------------------------------

    def submit(self, job: GenerationJob) -> Future:
        """Queue a job; its future resolves to the job, its samples finished."""
        self.waiting.put(job)
        self.wake.set()
        if self.stopped:  # the thread may have drained the queue before this put
            self._fail_queued()
        return job.future

    def run_command(self, command: Callable[[], object]) -> Future:
        """Run `command` on the scheduler thread between two steps; resolves to its result."""
        future: Future = Future()
        self.commands.put((command, future))
        self.wake.set()
        if self.stopped:
            self._fail_queued()
        return future

    def pause(self) -> None:
        """Stop stepping (the server then aborts or retracts the running requests, as the
        pause's mode asks)."""
        self.paused = True

    def retract_running(self) -> None:
        """Move every running sequence back to the queue, its output so far kept (a pause in
        mode retract): once continued, each is prefilled again, prompt and output, on the weights
        then loaded, so no key or value the old weights computed is used with the new ones.

        Queued, not waited for: a command runs before any later one (a weight load sent after
        the pause) and before the next step, which the pause holds anyway; waiting would keep the
        pause's answer behind a load already under way, seconds for a large model."""
        self.run_command(self._retract)

    def resume(self) -> None:
        self.paused = False
        self.wake.set()

    def abort(self, rid: str | None = None, abort_all: bool = False) -> int:
        raise NotImplementedError

    def shutdown(self) -> None:
        self.running = False
        self.wake.set()
        self.thread.join(timeout=10)

    # -- the scheduler thread ----------------------------------------------------------------

    def _schedule(self) -> None:
        reason = "the engine shut down"
        try:
            while self.running:
                self._run_commands()
                if not self._collect_work() or self.paused:
                    self.wake.wait(0.5)
                    self.wake.clear()
                    continue
                try:
                    self._step()
                except Exception as err:  # a failed step must fail its requests, not the server
                    log.exception("engine step failed")
                    self._fail_running(err)
        except Exception as err:
            log.exception("engine scheduler stopped")
            reason = f"the engine's scheduler failed: {err!r}"
        finally:
            self.stopped = True
            self._fail_running(EngineStopped(reason))
            self._fail_queued()

    def _fail_queued(self) -> None:
        """Fail every job and command still queued (safe from any thread: each is taken once)."""
        err = EngineStopped("the engine's scheduler has stopped")
        while True:
            try:
                job = self.waiting.get_nowait()
            except queue.Empty:
                break
            job.future.set_exception(err)
        while True:
            try:
                _, future = self.commands.get_nowait()
            except queue.Empty:
                break
            future.set_exception(err)

    def _run_commands(self) -> None:
        while not self.commands.empty():
            command, future = self.commands.get()
            try:
                future.set_result(command())
            except Exception as err:
                future.set_exception(err)

    def _collect_work(self) -> bool:
        raise NotImplementedError

    def _retract(self) -> None:
        raise NotImplementedError

    def _step(self) -> None:
        raise NotImplementedError

    def _fail_running(self, err: Exception) -> None:
        raise NotImplementedError
