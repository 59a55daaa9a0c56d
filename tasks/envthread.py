"""The environment's thread: where one episode's environment is built and called.

An environment is the user's code, and tasks/rollout.py plays it between engine calls. Three
things follow, each a reason for `EnvironmentThread`:

- Its calls may block (a tool's subprocess, an HTTP call to a sandbox). Every episode of a Dask
  worker shares one event loop (tasks/worker.py), so a call made on it held every episode
  there, and their engine timeouts with them. Calls run on a thread instead.
- Its resources may belong to one thread: an sqlite connection opened in `reset` refuses a
  `step` from another thread. So each episode has one thread, which builds the environment and
  makes every call of it, one at a time, in order.
- A call may never return. Each is bounded by `env.step_timeout_s`; a thread cannot be stopped,
  so the thread is a daemon, left behind without keeping its process from exiting (a pool's
  threads are joined at exit).

Whatever goes wrong (the constructor or a call raises or outlasts the bound, a reward that is not
a finite float32, an observation that is not text) is `EnvironmentFailed`, naming the class, the
call and the prompt: the worker sets the group aside (tasks/worker.py `_set_aside`).
"""

from __future__ import annotations

import asyncio
import numbers
import queue
import threading
from collections.abc import Callable
from typing import Any

from tasks.envs import Environment, Prompt, StepResult

FLOAT32_MAX = 3.4028234663852886e38
"""Largest reward a shard can store: its reward column is float32, where a larger one is inf."""


class EnvironmentFailed(RuntimeError):
    """The environment raised, took longer than `env.step_timeout_s`, or returned what an episode
    cannot record: its group is set aside, and another made in its place."""


class EnvironmentThread:
    """One episode's environment, built by `make_env` and called on a daemon thread of its own.

    `reset`, `step` and `truncate` are the environment's, awaited; `close` ends the thread once
    the episode is over (a call still running finishes first)."""

    def __init__(self, make_env: Callable[[], Environment], prompt: Prompt, timeout_s: float):
        self.make_env, self.prompt, self.timeout_s = make_env, prompt, timeout_s
        self.env: Environment | None = None
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name=f"tandem-env-{prompt.prompt_id}", daemon=True).start()

    @property
    def name(self) -> str:
        return type(self.env).__name__ if self.env is not None else "environment"

    async def reset(self) -> str:
        """Build the environment, then start it on the prompt: the initial observation."""
        if self.env is None:
            self.env = await self._call("__init__", self.make_env)
            if not isinstance(self.env, Environment):
                raise EnvironmentFailed(f"env.entrypoint made a {type(self.env).__name__}, not an Environment")
        observation = await self._call("reset", self.env.reset, self.prompt)
        if not isinstance(observation, str):
            raise EnvironmentFailed(f"{self._where('reset')} returned {type(observation).__name__}, not the initial observation's text")
        return observation

    async def step(self, action: str) -> StepResult:
        return self._checked("step", await self._call("step", self.env.step, action))

    async def truncate(self) -> StepResult:
        return self._checked("truncate", await self._call("truncate", self.env.truncate))

    def close(self) -> None:
        self._calls.put(None)

    def _serve(self) -> None:
        while (call := self._calls.get()) is not None:
            function, args, loop, outcome = call
            try:
                result = (function(*args), None)
            except BaseException as err:  # the user's code: whatever it raises is the group's failure
                result = (None, err)
            try:
                loop.call_soon_threadsafe(_settle, outcome, result)
            except RuntimeError:  # the loop closed meanwhile: nobody waits for it
                pass

    async def _call(self, method: str, function: Callable, *args: Any) -> Any:
        """`function(*args)` on the thread; its outcome comes back as a value, so that a
        TimeoutError the environment raises is told apart from the wait's own. `asyncio.timeout`,
        not `wait_for`: Python 3.11's wait_for returns the result of a call that finished as the
        episode was cancelled, swallowing the cancel, and the episode of a failed group played on."""
        loop = asyncio.get_running_loop()
        outcome: asyncio.Future = loop.create_future()
        self._calls.put((function, args, loop, outcome))
        try:
            async with asyncio.timeout(self.timeout_s):
                value, error = await outcome
        except TimeoutError:
            raise EnvironmentFailed(f"{self._where(method)} took longer than env.step_timeout_s ({self.timeout_s:g} s); its "
                                    "thread is left running (a thread cannot be stopped)") from None  # fmt: skip
        if error is not None:
            raise EnvironmentFailed(f"{self._where(method)} raised {type(error).__name__}: {error}") from error
        return value

    def _checked(self, method: str, result: Any) -> StepResult:
        where = self._where(method)
        if not isinstance(result, StepResult):
            raise EnvironmentFailed(f"{where} returned {type(result).__name__}, not a StepResult")
        if isinstance(result.reward, bool) or not isinstance(result.reward, numbers.Real) or not abs(result.reward) <= FLOAT32_MAX:
            raise EnvironmentFailed(f"{where} returned the reward {result.reward!r}: a reward is a finite number a shard can "
                                    f"store (float32: at most {FLOAT32_MAX:.4g} in size)")  # fmt: skip
        if not isinstance(result.observation, str):
            raise EnvironmentFailed(f"{where} returned the observation {result.observation!r:.80}, not text")
        return StepResult(result.observation, float(result.reward), result.done, result.info)

    def _where(self, method: str) -> str:
        if method == "__init__":
            return f"building the environment (env.entrypoint, env.kwargs) for prompt {self.prompt.prompt_id}"
        return f"{self.name}.{method} on prompt {self.prompt.prompt_id}"


def _settle(outcome: asyncio.Future, result: tuple) -> None:
    if not outcome.done():  # not given up on (timed out, or the episode cancelled)
        outcome.set_result(result)
