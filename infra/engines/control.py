"""Weight syncs, pauses and aborts: what the owner of a generation run's engines sends them.

`EngineControl` is an `EngineClient` (client.py: the same endpoints, rotation and health probe)
with the requests that `EngineFleet` (fleet.py) sends, apart from the /generate path that every
rollout worker runs.

`update_weights` moves every engine to a new snapshot with SGLang's documented order (pause ->
update_weights_from_disk -> continue), each engine under its own timeout, and reports which
engine is on which weight version, so one stuck engine cannot hang a weight sync.

Pauses for a sync are in mode `retract`, which moves running requests back to the engine's queue
with their output so far. SGLang's update_weights_from_disk flushes the KV cache after loading
(its `flush_cache`, on by default), and that flush fails while requests sit in the running
batch, as they do after an `in_place` pause: SGLang 0.5.23 then serves the new weights but answers
the load 400 ("the cache was not flushed"), keeping its old weight_version, and its cache holds
keys and values the old weights computed (earlier releases asserted and exited). Retracted,
they are prefilled again on the new weights once continued, so no key or value that the old
weights computed (the prefix cache included) is used with the new ones. The flush passes with
requests waiting in the queue, retracted or never started, only because SGLang (0.5.23, the
release tests/fixtures/sglang_api.json records) ignores the queue while paused
(`Scheduler.flush_cache`: `is_fully_idle(ignore_waiting=self._engine_paused)`); releases that
did not would assert on a busy engine, so `tandem[sglang]` asks for 0.5.23 or later. An engine given
up on mid-sync is out of rotation; once it answers again the probe sends the /continue_generation
it missed (unless a caller holds it paused for the next sync: `pause` until `update_weights` ends)
before putting it back.

A load that a sync gave up waiting for goes on in the engine, and no other load is sent to that
engine until it serves that load's version or `UNANSWERED_LOAD_LIMIT` timeouts have passed since
it was sent. SGLang runs one load at a time only while unpaused: during a pause its
update_weights_from_disk skips the lock it otherwise takes, each call replaces the one future
that the scheduler's answer resolves, and the first load's answer then resolves the second's and
the second's finds it done, an error on which its server kills itself.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Collection
from dataclasses import dataclass

import aiohttp

from infra.engines.client import TRANSPORT_ERRORS, Endpoint, EngineClient, EngineRequestError


UNANSWERED_LOAD_LIMIT = 5.0
"""How many sync timeouts after it was sent a load that never answered is waited for before
another load goes to its engine: past it, the load is taken for lost (one that failed leaves the
version as it was, which looks the same as one still running). Generous, since a second load
while the first runs costs the engine (SGLang's server exits), and waiting costs only this
engine's freshness: it serves the older weights meanwhile, the others the new ones."""
UNANSWERED_LOAD_POLL_SECONDS = 0.5


def _at_least(serving: str | None, version: str) -> bool:
    """Whether an engine serving weight version `serving` has what a load of `version` gave it:
    that version, or (tandem's versions are step numbers) a later one."""
    if serving is None:
        return False
    return serving == version or (serving.isdigit() and version.isdigit() and int(serving) >= int(version))


@dataclass
class WeightSyncResult:
    """How one engine's update went."""

    url: str
    ok: bool
    weight_version: str | None
    message: str


class EngineControl(EngineClient):
    """An engine client that also moves its engines to new weights, pauses and aborts them."""

    async def update_weights(
        self, model_path: str, weight_version: str, timeout: float = 120.0, pause_mode: str = "retract",
        only: Collection[str] | None = None, unless_serving: bool = False,
    ) -> list[WeightSyncResult]:  # fmt: skip
        """Pause, load and continue every engine (or those whose URL is in `only`) concurrently,
        each within `timeout` s.

        One result per engine synced, in the client's order, so that `all(r.ok ...)` means every
        one is on the new weights. An engine out of rotation is synced too if it answers /model_info
        now (which a paused SGLang engine does, unlike /health), without waiting for the probe:
        one restarted on its port, or one that a sync gave up on and that runs again, would
        otherwise miss this version; one that does not answer is reported failed. Every engine
        is held (see `Endpoint.held`) until all are done; then the probe may continue one that
        this sync left paused.

        `unless_serving` (a retry of a load that failed): an engine whose /model_info reports
        `weight_version` already is left alone, reported ok. A load that outlasted its sync's
        timeout goes on in the engine and ends serving the version: loaded again, it was paused
        for a whole load each retry, and timed out again, for good."""

        async def one(endpoint: Endpoint) -> WeightSyncResult:
            if not endpoint.healthy and not await self._answers(endpoint.url, "/model_info"):
                return WeightSyncResult(endpoint.url, False, endpoint.weight_version, "skipped: out of rotation, not answering")
            unanswered = endpoint.load_sent is not None
            if unanswered and (running := await self._wait_for_unanswered_load(endpoint, timeout)):
                await self._continue_skipped(endpoint)
                return WeightSyncResult(endpoint.url, False, endpoint.weight_version, running)
            if (unless_serving or unanswered) and await self._weight_version(endpoint.url) == weight_version:
                endpoint.weight_version = weight_version
                await self._continue_skipped(endpoint)
                return WeightSyncResult(endpoint.url, True, weight_version, "serving it already: an earlier load finished late")
            return await self._update_one(endpoint, model_path, weight_version, timeout, pause_mode)

        endpoints = [e for e in self.endpoints if only is None or e.url in only]
        await self._hold(endpoints)
        try:  # every engine's sync ends before any is released to the probe
            results = await asyncio.gather(*(one(e) for e in endpoints), return_exceptions=True)
        finally:
            for endpoint in endpoints:
                endpoint.held = False
        if errors := [r for r in results if isinstance(r, BaseException)]:
            raise errors[0]
        return results

    async def _continue_skipped(self, endpoint: Endpoint) -> None:
        """Continue an engine this sync sends no load to, if it is paused: the caller's pre-pause
        (`pause`) would otherwise hold it, healthy and in rotation, with every request sent to it
        waiting until the next sync."""
        if not endpoint.paused:
            return
        try:
            await self._control(endpoint, "/continue_generation", {}, timeout=5.0)
            endpoint.paused = False
        except (*TRANSPORT_ERRORS, EngineRequestError) as err:
            self._mark_unhealthy(endpoint, f"continue after a skipped load failed: {err!r}")

    async def pause(self, mode: str = "retract", timeout: float = 10.0) -> bool:
        """Pause every engine: a request sent from now on waits in its queue until the engine is
        continued (SGLang's tokenizer manager holds it before tokenizing; tandem's engines queue
        it). True only if every engine confirmed, within `timeout` s. Every engine is held
        paused until the `update_weights` that must follow has ended (the probe continues none of
        them meanwhile), and marked paused before its pause is sent: one that hangs may take the
        pause when it runs again, after that sync, and the probe then continues it."""
        await self._hold(self.endpoints)
        for endpoint in self.endpoints:
            endpoint.paused = True
        answers = await asyncio.gather(
            *(self._control(e, "/pause_generation", {"mode": mode}, timeout=timeout) for e in self.endpoints),
            return_exceptions=True,
        )
        return not any(isinstance(answer, BaseException) for answer in answers)

    async def _wait_for_unanswered_load(self, endpoint: Endpoint, timeout: float) -> str | None:
        """Wait up to `timeout` s for the load `endpoint` never answered to land; None once it is
        over (serving its version, or past `UNANSWERED_LOAD_LIMIT`), else why no load may go there."""
        assert endpoint.load_sent is not None
        version, sent_at = endpoint.load_sent
        deadline = time.monotonic() + timeout
        while True:
            if _at_least(serving := await self._weight_version(endpoint.url), version):  # or later: restarted on a newer one
                endpoint.weight_version = serving
                break
            if time.monotonic() - sent_at > UNANSWERED_LOAD_LIMIT * timeout:
                break
            if time.monotonic() >= deadline:
                return (f"skipped: its load of weight version {version}, sent {time.monotonic() - sent_at:.0f} s ago, has not "
                        "answered and may still run (SGLang's server exits on a second load sent meanwhile)")  # fmt: skip
            await asyncio.sleep(UNANSWERED_LOAD_POLL_SECONDS)
        endpoint.load_sent = None
        return None

    async def _hold(self, endpoints: list[Endpoint]) -> None:
        """Mark `endpoints` held, each once no probe is between its check and its continue."""
        for endpoint in endpoints:
            async with endpoint.control:
                endpoint.held = True

    async def _update_one(
        self, endpoint: Endpoint, model_path: str, weight_version: str, timeout: float, pause_mode: str
    ) -> WeightSyncResult:
        async def sequence() -> WeightSyncResult:
            endpoint.paused = True  # before sending: the pause may land even if we give up waiting
            await self._control(endpoint, "/pause_generation", {"mode": pause_mode})
            endpoint.load_sent = (weight_version, time.monotonic())
            try:
                async with self.http.post(
                    endpoint.url + "/update_weights_from_disk",
                    json={"model_path": model_path, "weight_version": weight_version},
                    timeout=aiohttp.ClientTimeout(total=timeout),
                ) as response:
                    endpoint.load_sent = None  # it answered: the load is over
                    answer = json.loads(await response.read())
            except aiohttp.ClientConnectorError:  # never reached the engine: nothing runs there
                endpoint.load_sent = None
                raise
            finally:
                # Also runs when the timeout cancels the load: un-pause an engine that is slow but
                # alive, within a short grace, so that a hung one still cannot hold the sync.
                await self._control(endpoint, "/continue_generation", {}, timeout=min(timeout, 5.0))
                endpoint.paused = False
            if response.status == 200 and answer.get("success"):
                endpoint.weight_version = weight_version
            return WeightSyncResult(endpoint.url, bool(answer.get("success")), endpoint.weight_version, answer.get("message", ""))

        try:
            return await asyncio.wait_for(sequence(), timeout)
        except (*TRANSPORT_ERRORS, EngineRequestError, ValueError) as err:
            self._mark_unhealthy(endpoint, f"weight update failed: {err!r}")
            return WeightSyncResult(endpoint.url, False, endpoint.weight_version, f"failed: {err!r}")

    async def abort_all(self) -> None:
        """Abort every engine's requests, also on an engine out of rotation (it may still run
        some); one that does not answer within 5 s is skipped."""
        await asyncio.gather(
            *(self._control(e, "/abort_request", {"abort_all": True}, timeout=5.0) for e in self.endpoints),
            return_exceptions=True,
        )
