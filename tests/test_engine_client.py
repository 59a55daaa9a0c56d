"""EngineClient against real CPU engine processes on loopback: failover, rejoin, balance, weights.

Every test starts its own two engines (with an API key, so the client's auth header is exercised
too) and stops them by their handles. Faults are real: SIGKILL of an engine's process group mid-run,
SIGSTOP of an engine during a weight sync, a restart on the same port.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import uvicorn

from configs.sections import ModelConfig, SimLatencyConfig
from infra.engines.api import SamplingParams, oldest_weight_version
from infra.engines.client import KEEPALIVE_SECONDS, EngineClient, EngineClientClosed, EngineRequestError, NoHealthyEngine
from infra.engines.control import EngineControl
from infra.engines.handoff import continued_seed, handed_off_finish, joined_parts
from infra.engines.process import EngineProcess, cpu_engine_process
from infra.modelfactory import save_tiny_model
from infra.ports import free_port_block
from tests.conftest import committed_model_dir, corrupt_copy, reference_logprobs

pytestmark = pytest.mark.slow

API_KEY = "client-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = [1, 20, 21, 22, 23, 24]


def prompt(i: int) -> list[int]:
    """Distinct prompts of equal length (6 tokens)."""
    return [1, 5 + i % 40, 20, 21, 22, 5 + (i // 40) % 40]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """v0 and v1 snapshots (MANIFEST.json last, as committed), and v1 with one byte flipped after
    its manifest was written."""
    root = tmp_path_factory.mktemp("models")
    out = {name: committed_model_dir(root / name, seed=seed) for name, seed in (("v0", 0), ("v1", 1))}
    return out | {"corrupt": corrupt_copy(out["v1"], root / "corrupt")}


class Engines:
    """Two CPU engine processes; `restart(i)` starts engine i again on its port."""

    def __init__(self, model: Path, log_dir: Path, sim_latency: SimLatencyConfig | None = None):
        self.model = model
        self.log_dir = log_dir
        self.sim_latency = sim_latency
        base = free_port_block(count=2)
        self.ports = [base, base + 1]
        self.processes: list[EngineProcess] = [self._process(port) for port in self.ports]

    def _process(self, port: int) -> EngineProcess:
        return cpu_engine_process(self.model, port, self.log_dir / f"engine-{port}.log", api_key=API_KEY, sim_latency=self.sim_latency)

    @property
    def urls(self) -> list[str]:
        return [p.url for p in self.processes]

    def start(self) -> Engines:
        with ThreadPoolExecutor(len(self.processes)) as pool:
            list(pool.map(lambda p: p.start(timeout=120), self.processes))
        return self

    def restart(self, i: int) -> None:
        self.processes[i].stop()
        self.processes[i] = self._process(self.ports[i]).start(timeout=120)

    def stop(self) -> None:
        """Stop both side by side: each may wait out its graceful shutdown."""
        with ThreadPoolExecutor(len(self.processes)) as pool:
            list(pool.map(self._stop, self.processes))

    @staticmethod
    def _stop(process: EngineProcess) -> None:
        if process.is_running():
            os.killpg(process.pid, signal.SIGCONT)  # a SIGSTOPped engine cannot act on SIGTERM
        process.stop()

    def get(self, i: int, path: str) -> dict:
        return httpx.get(self.urls[i] + path, headers=AUTH, timeout=10).json()


@pytest.fixture
def engines(models, tmp_path) -> Engines:
    pair = Engines(models["v0"], tmp_path)
    try:
        yield pair.start()
    finally:
        pair.stop()


def params(max_new_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, ignore_eos=True)


async def generate_many(client: EngineClient, count: int, max_new_tokens: int, concurrency: int) -> list[dict]:
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> dict:
        async with gate:
            (result,) = await client.generate(prompt(i), params(max_new_tokens))
            return result

    return await asyncio.gather(*(one(i) for i in range(count)))


async def wait_for(condition, timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        await asyncio.sleep(interval)
    return condition()


def test_requests_survive_a_sigkilled_engine(engines):
    async def scenario():
        async with EngineClient(engines.urls, api_key=API_KEY, retry_seconds=60) as client:
            run = asyncio.create_task(generate_many(client, 100, max_new_tokens=40, concurrency=100))
            # Kill engine 0 once it has answered a few requests and still holds many more.
            assert await wait_for(lambda: client.status()[0]["completed"] >= 3, timeout=60, interval=0.01)
            engine = engines.processes[0]
            # A failure here is the scenario's precondition, not the behaviour under test: say why.
            assert client.status()[0]["outstanding"] > 0, (client.status(), engine.is_running(), engine.log_tail())
            engine.kill()
            results = await run
            return results, client.status()

    results, status = asyncio.run(scenario())
    assert len(results) == 100
    assert all(r["meta_info"]["completion_tokens"] == 40 for r in results)
    assert all(r["meta_info"]["finish_reason"]["type"] == "length" for r in results)
    killed, survivor = status
    assert killed["healthy"] is False and killed["failures"] >= 1
    assert survivor["healthy"] is True
    assert killed["completed"] + survivor["completed"] == 100
    assert survivor["completed"] > 50, "the survivor must have taken over the killed engine's requests"


def test_a_restarted_engine_rejoins_the_rotation(engines):
    async def scenario():
        async with EngineClient(engines.urls, api_key=API_KEY, retry_seconds=30, health_interval=0.2) as client:
            engines.processes[0].kill()
            await generate_many(client, 8, max_new_tokens=4, concurrency=8)
            assert client.status()[0]["healthy"] is False
            await asyncio.to_thread(engines.restart, 0)  # same port, fresh process
            assert await wait_for(lambda: client.status()[0]["healthy"], timeout=10), client.status()
            before = client.status()[0]["completed"]
            await generate_many(client, 40, max_new_tokens=8, concurrency=16)
            return before, client.status()

    before, status = asyncio.run(scenario())
    assert status[0]["healthy"] and status[1]["healthy"]
    assert status[0]["completed"] - before >= 10, status
    assert status[0]["weight_version"] == "0"


@pytest.mark.timing
def test_a_paused_engine_out_of_rotation_does_not_hold_up_the_others_return(engines):
    """Both engines out of rotation, engine 0 paused: its /health holds the probe for the probe's
    2 s timeout, as SGLang's does. Engine 1 answers and is back long before that; probed one after
    the other, engine 0 first, it came back only after it."""

    async def scenario():
        async with EngineClient(engines.urls, api_key=API_KEY, health_interval=0.2) as client:
            await client._control(client.endpoints[0], "/pause_generation", {"mode": "in_place"})
            try:
                started = time.monotonic()
                for endpoint in client.endpoints:
                    client._mark_unhealthy(endpoint, "test")
                back = await wait_for(lambda: client.status()[1]["healthy"], timeout=10)
                return back, time.monotonic() - started, client.status()[0]["healthy"]
            finally:
                await client._control(client.endpoints[0], "/continue_generation", {})

    back, took, paused_healthy = asyncio.run(scenario())
    assert back and took < 1.5, f"engine 1 back after {took:.2f} s"
    assert paused_healthy is False, "a paused engine is not put back in rotation"


@pytest.mark.timing  # equal shares need equally fast engines: on a busy machine one ran 133 of 200
def test_least_outstanding_balances_equal_requests(engines):
    before = [engines.get(i, "/server_info")["tokens_generated"] for i in range(2)]

    async def scenario():
        async with EngineClient(engines.urls, api_key=API_KEY, hand_off_stragglers=False) as client:
            results = await generate_many(client, 200, max_new_tokens=16, concurrency=32)
            return results, client.status()

    results, status = asyncio.run(scenario())
    assert all(r["meta_info"]["completion_tokens"] == 16 for r in results)
    completed = [s["completed"] for s in status]
    assert sum(completed) == 200
    assert max(completed) <= 0.65 * 200, completed
    generated = [engines.get(i, "/server_info")["tokens_generated"] - before[i] for i in range(2)]
    assert generated == [16 * c for c in completed], (generated, completed)


def test_a_request_that_timed_out_on_a_hung_engine_is_answered_by_another(engines):
    """Engine 0 is SIGSTOPped: the requests sent to it hang until the client's request timeout
    (5 s), longer than its whole retry budget (1 s). Each must then be answered by engine 1: the
    budget bounds the backoff between attempts, not the attempts. (No hand-off, which would also
    move them, as an abort to the hung engine.)"""

    async def scenario():
        async with EngineClient(engines.urls, api_key=API_KEY, request_timeout=5.0, retry_seconds=1.0, health_interval=60,
                                hand_off_stragglers=False) as client:  # fmt: skip
            hung = engines.processes[0]
            os.killpg(hung.pid, signal.SIGSTOP)
            try:
                results = await generate_many(client, 8, max_new_tokens=4, concurrency=8)
            finally:
                os.killpg(hung.pid, signal.SIGCONT)
            return results, client.status()

    results, status = asyncio.run(scenario())
    assert [len(r["output_ids"]) for r in results] == [4] * 8
    assert status[0]["failures"] >= 1 and status[0]["completed"] == 0 and status[1]["completed"] == 8, status


def test_a_request_that_keeps_hanging_on_engines_that_answer_health_gives_up_in_bounded_time(models, tmp_path):
    """Two sim engines whose every decode step takes 5 s: they answer /health, so the probe
    puts each back in rotation, but they hold every request past its timeout (2 s). With 2 s of
    backoff allowed, backoff alone would allow six such attempts (about 13.5 s); the wall time from
    the first failure is capped at retry_seconds + request_timeout, so the request gives up after
    about three."""
    stalled = Engines(models["v0"], tmp_path, SimLatencyConfig(decode_base_s=5.0, prefill_s_per_token=0.0))

    async def scenario():
        async with EngineClient(stalled.urls, api_key=API_KEY, request_timeout=2.0, retry_seconds=2.0, health_interval=0.2,
                                hand_off_stragglers=False) as client:  # fmt: skip
            started = time.monotonic()
            with pytest.raises(NoHealthyEngine):
                await client.generate(PROMPT, params(4))
            return time.monotonic() - started

    try:
        stalled.start()
        elapsed = asyncio.run(scenario())
    finally:
        stalled.stop()
    assert 4.5 < elapsed < 2.0 + 3 * 2.0 + 1.0, elapsed


def test_a_straggler_handed_off_mid_way_is_one_answer_with_the_models_logprobs(engines, models):
    """Engine 1 out of rotation, 24 requests go to engine 0, which is paused once they are a few
    tokens in. Engine 1 rejoins and answers one short request; each time it runs dry it takes the
    newer half of engine 0's requests with their tokens so far (a continuation may land back on
    paused engine 0, to be taken again), until engine 0 holds one request, which it cannot halve.
    Every answer must be one sample: 48 tokens, each logprob the model's for that token after the
    prompt and the tokens before it, whichever engine produced it (so a continuation was given the
    tokens before it)."""
    prompts = [prompt(i) for i in range(24)]

    async def scenario():
        async with EngineClient(engines.urls, api_key=API_KEY, health_interval=60) as client:
            client.endpoints[1].healthy = False
            before = engines.get(0, "/server_info")["tokens_generated"]
            run = asyncio.gather(*(client.generate(p, params(48)) for p in prompts))
            assert await wait_for(lambda: engines.get(0, "/server_info")["tokens_generated"] - before >= 24 * 4, 30, 0.005)
            await client._control(client.endpoints[0], "/pause_generation", {"mode": "in_place"})
            client.endpoints[1].healthy = True
            await client.generate(PROMPT, params(1))

            def settled() -> bool:  # engine 0 holds one request; the others are answered
                status = client.status()
                return [s["outstanding"] for s in status] == [1, 0] and sum(s["completed"] for s in status) == 24

            assert await wait_for(settled, timeout=30), client.status()
            await client._control(client.endpoints[0], "/continue_generation", {})
            return await run, client.status()

    results, status = asyncio.run(scenario())
    # Engine 1 answered the short request and the ones handed to it (one may have ended on engine
    # 0 before the pause landed); engine 0 was never idle while engine 1 had work to hand off.
    assert status[0]["handed_off"] >= status[1]["completed"] - 1 >= 12, status
    assert sum(s["completed"] for s in status) == 25 and status[1]["handed_off"] == 0, status
    for p, (result,) in zip(prompts, results):
        meta = result["meta_info"]
        assert meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == len(result["output_ids"]) == 48
        assert meta["prompt_tokens"] == len(p) and meta["weight_version"] == "0"
        assert [entry[1] for entry in meta["output_token_logprobs"]] == result["output_ids"]
        served = [entry[0] for entry in meta["output_token_logprobs"]]
        assert served == pytest.approx(reference_logprobs(models["v0"], p, result["output_ids"]), abs=1e-4)


def test_an_abort_the_client_did_not_send_ends_requests_and_hands_nothing_off(engines):
    """The generation flow ends a run by aborting every engine's requests (its own client, not
    the rollout workers'). Engine 0's aborts answer first; running dry, it must not take engine
    1's requests, whose aborts are on their way: continued, they would run on past the end."""
    async def scenario():
        async with EngineClient(engines.urls, api_key=API_KEY, health_interval=60) as client:
            for i in range(2):
                httpx.post(engines.urls[i] + "/pause_generation", json={"mode": "in_place"}, headers=AUTH, timeout=10)
            run = asyncio.gather(*(client.generate(prompt(i), params(48)) for i in range(24)))
            assert await wait_for(lambda: [s["outstanding"] for s in client.status()] == [12, 12], 10, 0.005), client.status()
            await client._control(client.endpoints[0], "/abort_request", {"abort_all": True})
            assert await wait_for(lambda: client.status()[0]["outstanding"] == 0, 10, 0.005), client.status()
            await asyncio.sleep(0.2)  # room for a hand-off to engine 0, if the client made one
            await client._control(client.endpoints[1], "/abort_request", {"abort_all": True})
            for i in range(2):
                await client._control(client.endpoints[i], "/continue_generation", {})
            return await run, client.status()

    results, status = asyncio.run(scenario())
    assert [r["meta_info"]["finish_reason"]["type"] for (r,) in results] == ["abort"] * 24
    assert [s["handed_off"] for s in status] == [0, 0] and sum(s["completed"] for s in status) == 24, status


def test_a_closed_client_ends_its_requests_and_opens_no_pool_or_probe_again():
    """A Dask worker closes its client when the run ends (tasks/worker.py release_worker_state)
    while another try of a chunk may still be playing: that request failed on the closed pool,
    took its engine out of rotation, and opened a pool and a probe that polled the stopped
    engines for as long as the worker lived."""
    url = f"http://127.0.0.1:{free_port_block()}"  # nothing listens: every try fails, and the probe runs

    async def scenario():
        client = EngineClient([url], retry_seconds=30)
        await client.__aenter__()
        request = asyncio.create_task(client.generate([1, 2], SamplingParams(max_new_tokens=2)))
        for _ in range(100):  # its first try fails at once: nothing listens
            if not client.endpoints[0].healthy:
                break
            await asyncio.sleep(0.05)
        assert not client.endpoints[0].healthy
        await client.close()
        started = time.monotonic()
        with pytest.raises(EngineClientClosed):
            await request
        await asyncio.sleep(0.1)
        return time.monotonic() - started, client._prober.done(), client._session.closed

    waited, probe_done, pool_closed = asyncio.run(scenario())
    assert waited < 5 and probe_done and pool_closed


def test_joined_parts_keep_the_order_and_the_lowest_weight_version():
    def part(ids: list[int], version: str, finish: str) -> dict:
        meta = {"id": f"r{ids[0] if ids else ''}", "prompt_tokens": 2 + len(ids), "completion_tokens": len(ids), "weight_version": version,
                "finish_reason": {"type": finish}, "output_token_logprobs": [[-0.5, t, None] for t in ids]}  # fmt: skip
        return {"output_ids": ids, "text": "".join(map(str, ids)), "meta_info": meta}

    joined = joined_parts([part([1, 2], "7", "abort"), part([3], "6", "abort"), part([], "5", "abort"), part([4, 5], "8", "stop")], prompt_tokens=3)
    assert joined["output_ids"] == [1, 2, 3, 4, 5] and joined["text"] == "12345"
    meta = joined["meta_info"]
    assert [entry[1] for entry in meta["output_token_logprobs"]] == [1, 2, 3, 4, 5]
    assert meta["weight_version"] == "6", "a sample is as old as its oldest token (a part with none has no say)"
    assert meta["finish_reason"] == {"type": "stop"} and meta["completion_tokens"] == 5
    assert meta["prompt_tokens"] == 3 and meta["id"] == "r1"
    assert continued_seed(None, 5) is None and continued_seed(11, 0) == 11
    assert continued_seed(11, 5) == continued_seed(11, 5) != continued_seed(11, 6) != 11


def test_a_result_is_as_old_as_the_oldest_span_that_produced_tokens():
    """SGLang's weight_version names the newest weights of a request that went on across a load;
    its weight_versions spans name them all."""
    spans = [{"version": "3", "start": 0, "end": 4}, {"version": "5", "start": 4, "end": 9}]
    assert oldest_weight_version({"weight_version": "5", "weight_versions": spans}) == "3"
    assert oldest_weight_version({"weight_version": "5", "weight_versions": [{"version": "2", "start": 0, "end": 0}, spans[1]]}) == "5"
    assert oldest_weight_version({"weight_version": "5"}) == "5"
    assert oldest_weight_version({"weight_version": "default", "weight_versions": [{"version": "default", "start": 0, "end": 3}]}) == "default"
    part = {"output_ids": [1, 2], "text": "", "meta_info": {"weight_version": "5", "weight_versions": [{"version": "3", "start": 0, "end": 1},
            {"version": "5", "start": 1, "end": 2}], "finish_reason": {"type": "abort"}}}  # fmt: skip
    last = {"output_ids": [3], "text": "", "meta_info": {"weight_version": "6", "weight_versions": [{"version": "6", "start": 0, "end": 1}],
            "finish_reason": {"type": "stop"}}}  # fmt: skip
    joined = joined_parts([part, last], prompt_tokens=2)["meta_info"]
    assert joined["weight_version"] == "3" and "weight_versions" not in joined


def test_a_handed_off_part_that_ended_in_a_stop_token_or_at_the_limit_is_not_continued():
    """SGLang keeps the token of the decode step an abort lands in; the CPU engine aborts between
    steps, so this case is checked on the decision alone."""
    assert handed_off_finish([7, 8, 2], {2, 5}, generated=3, max_new_tokens=16) == {"type": "stop", "matched": 2}
    assert handed_off_finish([7, 8], {2, 5}, generated=16, max_new_tokens=16) == {"type": "length", "length": 16}
    assert handed_off_finish([7, 8], {2, 5}, generated=2, max_new_tokens=16) is None
    assert handed_off_finish([], {2, 5}, generated=0, max_new_tokens=16) is None, "aborted while queued: goes on"


def test_update_weights_loads_refuses_corrupt_snapshots_and_survives_a_hung_engine(engines, models):
    versions = lambda: [engines.get(i, "/model_info")["weight_version"] for i in range(2)]  # noqa: E731

    async def scenario():
        async with EngineControl(engines.urls, api_key=API_KEY, health_interval=0.2) as client:
            loaded = await client.update_weights(str(models["v1"]), "1", timeout=60)
            assert [r.ok for r in loaded] == [True, True], loaded
            assert [r.weight_version for r in loaded] == ["1", "1"]
            assert versions() == ["1", "1"]

            refused = await client.update_weights(str(models["corrupt"]), "2", timeout=60)
            assert [r.ok for r in refused] == [False, False], refused
            assert all("model.safetensors" in r.message for r in refused), refused
            assert versions() == ["1", "1"]
            results = await generate_many(client, 8, max_new_tokens=4, concurrency=8)
            assert {r["meta_info"]["weight_version"] for r in results} == {"1"}
            assert all(s["healthy"] for s in client.status())

            hung = engines.processes[0]
            os.killpg(hung.pid, signal.SIGSTOP)
            try:
                started = time.monotonic()
                synced = await client.update_weights(str(models["v0"]), "3", timeout=3)
                elapsed = time.monotonic() - started
            finally:
                os.killpg(hung.pid, signal.SIGCONT)
            assert elapsed < 5, f"a hung engine held the weight sync for {elapsed:.1f}s"
            assert [r.ok for r in synced] == [False, True], synced
            assert client.status()[0]["healthy"] is False
            assert engines.get(1, "/model_info")["weight_version"] == "3"
            # Resumed, the engine is probed back into rotation and un-paused (the pause the sync
            # sent before giving up lands once the process runs again).
            assert await wait_for(lambda: client.status()[0]["healthy"], timeout=10), client.status()
            assert await wait_for(lambda: not engines.get(0, "/server_info")["paused"], timeout=10)
            assert engines.get(0, "/model_info")["weight_version"] == "1"
            results = await generate_many(client, 16, max_new_tokens=4, concurrency=16)
            return {r["meta_info"]["weight_version"] for r in results}

    assert asyncio.run(scenario()) <= {"1", "3"}


@pytest.mark.timing
def test_a_4xx_is_raised_at_once_and_the_engine_stays_in_rotation(engines):
    async def scenario():
        async with EngineClient(engines.urls, api_key=API_KEY, retry_seconds=30) as client:
            started = time.monotonic()
            with pytest.raises(EngineRequestError) as refused:
                await client.generate([1, 10_000_000], params(4))
            elapsed = time.monotonic() - started
            status = client.status()
            (after,) = await client.generate(PROMPT, params(4))
            return refused.value, elapsed, status, after

    error, elapsed, status, after = asyncio.run(scenario())
    assert error.status == 400 and "vocabulary" in str(error)
    assert elapsed < 1.0, f"a 4xx took {elapsed:.2f}s: it must not be retried"
    assert all(s["healthy"] and s["failures"] == 0 and s["outstanding"] == 0 for s in status), status
    assert after["meta_info"]["completion_tokens"] == 4


class GarbageEngine:
    """A loopback server that is healthy and answers every /generate with 200 and `body`: an
    engine behind a proxy's error page, or one that writes half an answer."""

    def __init__(self, body: bytes):
        async def app(scope, receive, send):
            if scope["type"] != "http":
                return
            text = b"ok" if scope["path"] == "/health" else body
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/html")]})
            await send({"type": "http.response.body", "body": text})

        self.port = free_port_block(count=1)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        assert self.server.started, f"the garbage engine did not start on port {self.port}"  # else its failures would be refusals
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc_info) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def test_a_200_that_is_no_answer_takes_the_engine_out_and_the_request_goes_elsewhere(engines):
    async def scenario(garbage: str):
        async with EngineClient([garbage, engines.urls[0]], api_key=API_KEY, retry_seconds=30) as client:
            results = await generate_many(client, 12, 4, concurrency=4)
            return results, client.status()

    for body in (b"<html>502 Bad Gateway</html>", b'{"text": "no output_ids"}', b'{"output_ids": [1], "meta_info": {}}'):
        with GarbageEngine(body) as garbage:
            results, status = asyncio.run(scenario(garbage))
        assert all(r["meta_info"]["completion_tokens"] == 4 for r in results), body
        broken = next(s for s in status if s["url"] == garbage)
        assert broken["failures"] >= 1, (body, status)


def test_the_client_drops_idle_connections_before_the_engine_server_would():
    """A pooled connection the server closes just as the client reuses it fails the request and
    takes the engine out of rotation; the client must give up idle connections first."""
    assert KEEPALIVE_SECONDS < uvicorn.Config(app=None).timeout_keep_alive


def _engine_of_a_doomed_parent(tmp_path: Path) -> tuple[subprocess.Popen, int, int]:
    """A CPU engine started (with --parent-pid, as EngineFleet starts them) by a process
    the caller will kill: (that process, the engine's pid, its port)."""
    model = save_tiny_model(ModelConfig(), tmp_path / "model", seed=0)
    port = free_port_block(count=1)
    starter = (
        "import sys, time, json; from pathlib import Path; from infra.engines.process import cpu_engine_process; "
        f"p = cpu_engine_process(Path({str(model)!r}), {port}, Path({str(tmp_path / 'e.log')!r})).start(); "
        "print(json.dumps(p.pid), flush=True); time.sleep(600)"
    )
    parent = subprocess.Popen([sys.executable, "-c", starter], stdout=subprocess.PIPE, text=True)
    return parent, json.loads(parent.stdout.readline()), port


def _assert_exits(pid: int, within: float) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.kill(pid, 9)
    raise AssertionError(f"the engine outlived its parent by {within:.0f} s")


def test_engine_stops_when_the_process_that_started_it_is_killed(tmp_path):
    """A SIGKILLed generator must not leave its engines serving (they run in their own session)."""
    parent, engine_pid, _ = _engine_of_a_doomed_parent(tmp_path)
    parent.kill()
    parent.wait()
    _assert_exits(engine_pid, 30)


def test_an_orphaned_engine_stops_even_while_a_pause_holds_a_request(tmp_path):
    """A generator killed between pause and continue (it loads weights every step) leaves its
    engine paused with requests in flight that will never finish; the engine must stop anyway,
    not wait for them as a graceful shutdown would."""
    parent, engine_pid, port = _engine_of_a_doomed_parent(tmp_path)
    url = f"http://127.0.0.1:{port}"
    httpx.post(f"{url}/pause_generation", json={}, timeout=10).raise_for_status()
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(httpx.post, f"{url}/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}}, timeout=60)
        time.sleep(1.0)
        assert not held.done(), "the pause should hold the request"
        parent.kill()
        parent.wait()
        _assert_exits(engine_pid, 15)


def test_an_engine_whose_starter_died_while_it_started_stops(tmp_path):
    """The starter passes its pid. Read from getppid() once the engine was up, it named whatever
    adopted the engine if the starter had died meanwhile, and the engine served for good (a CI
    run killed mid-test left one)."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    model = save_tiny_model(ModelConfig(), tmp_path / "model", seed=0)
    latency = '{"decode_base_s": 0.001, "decode_s_per_seq": 0.0, "prefill_s_per_token": 0.0}'
    command = [sys.executable, "-m", "flows.cli", "engine", "serve", "--model", str(model), "--port", str(free_port_block(count=1)),
               "--parent-pid", str(gone.pid), "--sim-latency", latency]  # fmt: skip
    engine = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        engine.wait(timeout=60)
    finally:
        if engine.poll() is None:
            os.killpg(engine.pid, signal.SIGKILL)
    assert f"parent process {gone.pid} is gone; stopping" in engine.stderr.read()
