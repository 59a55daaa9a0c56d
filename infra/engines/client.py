"""The rollout side's view of inference: one async client over N engines (CPU or SGLang).

`EngineClient` sends each /generate to the healthy engine with the fewest outstanding requests:
with long-tailed agentic episodes, round-robin piles requests behind one slow engine, while
least-outstanding keeps every engine's batch equally full. A request that fails on a connection
error, timeout or a 500, 502, 503 or 504 marks its engine unhealthy (out of rotation) and is retried on another one
with backoff; a background probe of /health brings the engine back when it answers again. A 4xx
is the caller's mistake and is raised at once, never retried. A request retries for
`retry_seconds` of backoff, and for at most `retry_seconds + request_timeout` of wall time from
its first failure: a request that hung on an engine until its timeout still goes to the engines
that answer, and one that keeps hanging (on engines that answer /health but never generate)
still gives up.

Stragglers are handed off. A batch of long-tailed episodes ends with its most loaded engine:
counts are balanced when requests are sent, lengths cannot be (on the scaling benchmark's
lengths a synchronous batch over 4 engines took 4.16 s against G1/N = 3.75 s). So when an
engine runs out of this client's requests while another still holds two or more, the client
aborts the newer half of those (/abort_request by the rid it gave them), and each answers with
the tokens it has so far, as SGLang's abort does; the client sends the rest of each sample
(prompt + tokens so far, the remaining max_new_tokens) to the least loaded engine and joins the
parts into one answer (handoff.py): tokens and behaviour logprobs in order, the lowest weight
version of a part with tokens (what the lag bound is checked against), the last part's finish
reason. Only single-sample requests the caller gave no rid are moved: a caller's rid is the
caller's to abort. An abort the client did not send means someone is stopping the work (the
generation flow at the end of a run aborts every engine's requests through its own client): it
holds hand-offs until every request in flight has answered, or continuations would undo it.

Weight syncs, pauses and aborts are `EngineControl` (control.py), the same client with the
requests a fleet's owner sends.

HTTP goes through aiohttp, not httpx: httpcore's connection pool checks every pooled connection
with a syscall each time a request starts or ends, which cost 3-4 ms of client CPU per /generate
at 32 requests in flight (14x aiohttp's 0.25 ms) and capped a rollout worker near 200 requests/s
(benchmarks/engine.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import uuid
from dataclasses import dataclass, field

import aiohttp

from infra.engines.api import SamplingParams
from infra.engines.handoff import continued_seed, handed_off_finish, joined_parts

log = logging.getLogger(__name__)
RETRYABLE_STATUS = frozenset({500, 502, 503, 504})
TRANSPORT_ERRORS = (aiohttp.ClientError, TimeoutError)
"""Connection refused or reset, server gone mid-answer, timeouts: the engine's fault, not the request's."""


class EngineRequestError(RuntimeError):
    """An engine refused a request (4xx): retrying it elsewhere would not help."""

    def __init__(self, status: int, detail: str):
        super().__init__(f"engine answered {status}: {detail}")
        self.status = status


class NoHealthyEngine(RuntimeError):
    """Every engine failed for longer than the client's retry budget."""


class EngineClientClosed(RuntimeError):
    """A request through a client that was closed (a Dask worker's, released at the run's end)."""


@dataclass(eq=False)
class _Movable:
    """One single-sample request the client may hand off: the rid of its current attempt (a
    retry is a new request, so it gets a new rid), and whether the client is aborting it to move it."""

    rid: str = ""
    handing_off: bool = False


@dataclass(eq=False)
class Endpoint:
    """One engine as the client sees it."""

    url: str
    outstanding: int = 0
    healthy: bool = True
    weight_version: str | None = None
    completed: int = 0
    failures: int = 0
    handed_off: int = 0
    """Requests this client aborted here to finish them on an engine with room."""
    movable: dict[str, _Movable] = field(default_factory=dict)
    """This client's single-sample requests in flight here by rid, oldest first."""
    paused: bool = False
    """This client sent /pause_generation and no /continue_generation has been answered since."""
    held: bool = False
    """A caller holds the engine paused on purpose (control.py): from `pause` to the end of the
    `update_weights` that follows it, or through a sync. The probe continues only an engine
    nobody holds."""
    load_sent: tuple[str, float] | None = None
    """A weight load sent here that never answered (its sync gave up: control.py): its version
    and when it was sent (monotonic). The engine may still be running it."""
    control: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Taken by the probe from its check of `held` to its continue's answer, and by whoever sets
    `held`: so that no pause is sent between the two and then undone by that continue."""


KEEPALIVE_SECONDS = 3.0
"""How long an idle pooled connection is kept for reuse: under the 5 s after which uvicorn (the
HTTP server of tandem's engines, and of SGLang's) closes an idle connection by default. With
aiohttp's default of 15 s, a connection reused about 5 s after its last request (in a synchronous
run, a training step and a weight load between two batches) could meet the server closing it:
the request failed with "Server disconnected" and took its engine out of rotation until the
health probe brought it back (in both of two 3-step runs of the quick scaling benchmark's first
configuration, 1-2 times a run; in neither of two runs with this bound)."""


def generate_answer(payload: bytes) -> dict | list[dict]:
    """A /generate answer parsed, or ValueError if it is not one: every result has output_ids and
    meta_info with a finish_reason, which is all that callers index without a check. (A proxy's
    error page or a half-written body can come with a 200.)"""
    try:
        answer = json.loads(payload)
        for result in answer if isinstance(answer, list) else [answer]:
            if not isinstance(result["output_ids"], list) or not isinstance(result["meta_info"]["finish_reason"], dict):
                raise TypeError("output_ids or meta_info.finish_reason of the wrong type")
    except (ValueError, KeyError, TypeError, IndexError) as err:
        raise ValueError(f"not a /generate answer ({err!r}): {payload[:120]!r}") from None
    return answer


class EngineClient:
    """Least-outstanding balancing, health-based rotation and retries over engine URLs."""

    def __init__(
        self,
        urls: list[str],
        api_key: str | None = None,
        request_timeout: float = 120.0,
        retry_seconds: float = 60.0,
        health_interval: float = 0.5,
        hand_off_stragglers: bool = True,
    ):
        if not urls:
            raise ValueError("EngineClient needs at least one engine URL")
        self.endpoints = [Endpoint(url.rstrip("/")) for url in urls]
        self.retry_seconds = retry_seconds
        self.request_timeout = request_timeout
        self.health_interval = health_interval
        self.hand_off_stragglers = hand_off_stragglers
        self._handing_off: set[_Movable] = set()
        """Requests aborted by this client to move them: their abort answer is a part, not an end."""
        self._hand_off_held = False
        """An abort this client did not send came back (the end of a run, a pause that aborts):
        no hand-off until every request it has in flight has answered, or the abort it meant to
        end the work would be undone by continuations."""
        self._hand_offs: set[asyncio.Task] = set()
        """Hand-off aborts in flight (held so that the event loop does not drop them)."""
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: aiohttp.ClientSession | None = None
        self._prober: asyncio.Task | None = None
        self._closed = False

    @property
    def http(self) -> aiohttp.ClientSession:
        """The client's connection pool, made on first use inside the running event loop. After
        `close` it raises `EngineClientClosed` rather than opening a new pool: a request still in
        flight would otherwise count its engine unhealthy and open a pool and a probe that nothing
        closed again, polling the run's stopped engines for as long as the Dask worker lived."""
        if self._closed:
            raise EngineClientClosed("the engine client is closed")
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                headers=self.headers,
                timeout=aiohttp.ClientTimeout(total=self.request_timeout, sock_connect=2.0),
                connector=aiohttp.TCPConnector(limit=1024, limit_per_host=0, keepalive_timeout=KEEPALIVE_SECONDS),
            )
        return self._session

    async def __aenter__(self) -> EngineClient:
        self._prober = asyncio.create_task(self._probe_unhealthy())
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def close(self) -> None:
        self._closed = True
        for task in [self._prober, *self._hand_offs]:
            if task is not None:
                task.cancel()
        if self._session is not None:
            await self._session.close()

    # -- generation -------------------------------------------------------------------------

    async def generate(
        self, input_ids: list[int], sampling_params: SamplingParams, return_logprob: bool = True, rid: str | None = None
    ) -> list[dict]:
        """Generate `sampling_params.n` samples for one prompt; always returns a list of n results."""
        if self.hand_off_stragglers and sampling_params.n == 1 and rid is None:
            return [await self._generate_movable(input_ids, sampling_params, return_logprob)]
        body = {
            "input_ids": input_ids,
            "sampling_params": sampling_params.model_dump(exclude_none=True),
            "return_logprob": return_logprob,
        }
        if rid:
            body["rid"] = rid
        answer = await self._post_balanced("/generate", body)
        return answer if isinstance(answer, list) else [answer]

    async def _generate_movable(self, input_ids: list[int], params: SamplingParams, return_logprob: bool) -> dict:
        """One sample that may be handed off mid-way: each hand-off is one more part."""
        parts: list[dict] = []
        generated = 0
        stop_ids = set(params.stop_token_ids or ())
        while True:
            seed = continued_seed(params.sampling_seed, generated)
            part_params = params.model_copy(update={"max_new_tokens": params.max_new_tokens - generated, "sampling_seed": seed})
            body = {
                "input_ids": input_ids + [t for part in parts for t in part["output_ids"]],
                "sampling_params": part_params.model_dump(exclude_none=True),
                "return_logprob": return_logprob,
            }
            movable = _Movable()
            try:
                answer = await self._post_balanced("/generate", body, movable)
            finally:
                self._handing_off.discard(movable)
            parts.append(answer)
            generated += len(answer["output_ids"])
            if not (movable.handing_off and answer["meta_info"]["finish_reason"]["type"] == "abort"):
                return joined_parts(parts, len(input_ids))
            finish = handed_off_finish(answer["output_ids"], stop_ids, generated, params.max_new_tokens)
            if finish is not None:
                answer["meta_info"]["finish_reason"] = finish
                return joined_parts(parts, len(input_ids))

    async def _post_balanced(self, path: str, body: dict, movable: _Movable | None = None):
        waited, delay, first_failure = 0.0, 0.05, None
        while True:
            if self._closed:  # not another retry for the budget's rest: no one waits for the answer
                raise EngineClientClosed("the engine client is closed")
            endpoint = self._pick()
            if endpoint is not None:
                endpoint.outstanding += 1
                if movable is not None:
                    movable.rid, movable.handing_off = uuid.uuid4().hex, False
                    body = {**body, "rid": movable.rid}
                    endpoint.movable[movable.rid] = movable
                try:
                    async with self.http.post(endpoint.url + path, json=body) as response:
                        payload = await response.read()
                    if response.status < 400:
                        try:
                            answer = generate_answer(payload)
                        except ValueError as err:  # a 200 that is no answer: an engine failing, not the request
                            self._mark_unhealthy(endpoint, f"malformed answer: {err}")
                        else:
                            self._count_answer(endpoint, answer, movable)
                            return answer
                    elif response.status not in RETRYABLE_STATUS:
                        raise EngineRequestError(response.status, payload[:500].decode(errors="replace"))
                    else:
                        self._mark_unhealthy(endpoint, f"HTTP {response.status}")
                except TRANSPORT_ERRORS as err:
                    self._mark_unhealthy(endpoint, repr(err))
                finally:
                    endpoint.outstanding -= 1
                    if movable is not None:
                        endpoint.movable.pop(movable.rid, None)
                    if all(e.outstanding == 0 for e in self.endpoints):
                        self._hand_off_held = False
                    elif endpoint.outstanding == 0:
                        self._take_stragglers(endpoint)
            now = asyncio.get_running_loop().time()
            first_failure = now if first_failure is None else first_failure
            if waited + delay > self.retry_seconds or now + delay > first_failure + self.retry_seconds + self.request_timeout:
                raise NoHealthyEngine(f"no engine answered {path} in {now - first_failure:.0f}s of retries: {self.status()}")
            await asyncio.sleep(delay)
            waited += delay
            delay = min(delay * 2, 1.0)

    def _count_answer(self, endpoint: Endpoint, answer: dict | list[dict], movable: _Movable | None) -> None:
        """Count an answer as completed or handed off. An abort this client did not send holds
        hand-offs and turns those under way into ends: someone is stopping the work."""
        aborted = any(r["meta_info"]["finish_reason"]["type"] == "abort" for r in (answer if isinstance(answer, list) else [answer]))
        if aborted and movable is not None and movable.handing_off:
            endpoint.handed_off += 1
            return
        endpoint.completed += 1
        if aborted:
            self._hand_off_held = True
            for moving in self._handing_off:
                moving.handing_off = False
            self._handing_off.clear()

    def _pick(self) -> Endpoint | None:
        healthy = [e for e in self.endpoints if e.healthy]
        if not healthy:
            return None
        fewest = min(e.outstanding for e in healthy)
        return random.choice([e for e in healthy if e.outstanding == fewest])

    def _take_stragglers(self, idle: Endpoint) -> None:
        """`idle` has none of this client's requests: move the newer half of the busiest engine's
        movable ones to it (the newer ones are likelier still queued, with no work to lose)."""
        if not self.hand_off_stragglers or self._hand_off_held or not idle.healthy or idle.paused or idle.outstanding:
            return
        donors = [e for e in self.endpoints if e is not idle and e.healthy and not e.paused and len(e.movable) >= 2]
        if not donors:
            return
        donor = max(donors, key=lambda e: len(e.movable))
        moving = list(donor.movable.values())[len(donor.movable) // 2 :]
        for request in moving:
            del donor.movable[request.rid]
            request.handing_off = True
        self._handing_off.update(moving)
        task = asyncio.get_running_loop().create_task(self._abort_for_hand_off(donor, [m.rid for m in moving]))
        self._hand_offs.add(task)
        task.add_done_callback(self._hand_offs.discard)

    async def _abort_for_hand_off(self, donor: Endpoint, rids: list[str]) -> None:
        """Abort `rids` on `donor`; one that finished first, or an abort that fails, just ends
        where it was (its answer is then a whole one, not a part)."""
        answers = await asyncio.gather(
            *(self._control(donor, "/abort_request", {"rid": rid}, timeout=5.0) for rid in rids), return_exceptions=True
        )
        for answer in answers:
            if isinstance(answer, BaseException):
                log.info("hand-off abort on %s failed: %r", donor.url, answer)

    def _mark_unhealthy(self, endpoint: Endpoint, reason: str) -> None:
        endpoint.failures += 1
        if endpoint.healthy:
            log.warning("engine %s out of rotation: %s", endpoint.url, reason)
        endpoint.healthy = False
        if not self._closed and (self._prober is None or self._prober.done()):
            self._prober = asyncio.create_task(self._probe_unhealthy())

    async def _probe_unhealthy(self) -> None:
        """Bring engines back into rotation once their /health answers again, probing them side by
        side: a paused engine's /health holds the probe for its whole 2 s timeout."""
        while True:
            await asyncio.gather(*(self._probe(e) for e in self.endpoints if not e.healthy))
            await asyncio.sleep(self.health_interval)

    async def _probe(self, endpoint: Endpoint) -> None:
        """Put `endpoint` back in rotation if it answers; first continue it if a weight sync gave up on it."""
        if endpoint.paused and not await self._continue_left_paused(endpoint):
            return
        if await self.is_healthy(endpoint.url):
            endpoint.weight_version = await self._weight_version(endpoint.url)
            endpoint.healthy = True
            self._take_stragglers(endpoint)
            log.info("engine %s back in rotation (weights %s)", endpoint.url, endpoint.weight_version)

    async def _continue_left_paused(self, endpoint: Endpoint) -> bool:
        """Continue an engine that a sync gave up on (it hung, and runs again: the pauses it was
        sent may have landed, and a paused engine holds every request); True once it is continued.
        Whether it runs is asked of /model_info, not /health: SGLang's /health generates a token,
        which waits while the engine is paused."""
        if not await self._answers(endpoint.url, "/model_info"):
            return False
        async with endpoint.control:
            if endpoint.held:
                return False
            try:  # a short timeout: EngineControl's pause and update_weights wait for this lock
                await self._control(endpoint, "/continue_generation", {}, timeout=2.0)
            except (*TRANSPORT_ERRORS, EngineRequestError):
                return False
            endpoint.paused = False
        return True

    async def is_healthy(self, url: str) -> bool:
        return await self._answers(url, "/health")

    async def _answers(self, url: str, path: str) -> bool:
        try:
            async with self.http.get(url + path, timeout=aiohttp.ClientTimeout(total=2.0)) as response:
                return response.status == 200
        except TRANSPORT_ERRORS:
            return False

    async def _weight_version(self, url: str) -> str | None:
        try:
            async with self.http.get(url + "/model_info", timeout=aiohttp.ClientTimeout(total=5.0)) as response:
                return json.loads(await response.read()).get("weight_version") if response.status == 200 else None
        except (*TRANSPORT_ERRORS, ValueError):
            return None

    # -- requests to one engine ----------------------------------------------------------------

    async def _control(self, endpoint: Endpoint, path: str, body: dict, timeout: float = 30.0) -> None:
        async with self.http.post(endpoint.url + path, json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as response:
            if response.status >= 400:
                raise EngineRequestError(response.status, (await response.text())[:500])

    def status(self) -> list[dict]:
        """Per engine: URL, in rotation or not, outstanding, completed and handed-off requests, weight version."""
        return [
            {"url": e.url, "healthy": e.healthy, "outstanding": e.outstanding, "completed": e.completed,
             "handed_off": e.handed_off, "failures": e.failures, "weight_version": e.weight_version}
            for e in self.endpoints
        ]  # fmt: skip

