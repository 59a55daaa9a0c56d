"""The engine HTTP server: SGLang's native API subset (docs/architecture.md) over `CpuEngine` or `SimEngine`.

Routes validate their bodies with the pydantic models of api.py, which are the contract shared
with the client and checked against SGLang's own field names, so a request SGLang would refuse is
refused here too (4xx with a reason). Handlers only translate between HTTP and the engine; the
engine's scheduler thread does all model work. Two pieces of plumbing sit in front of the routes:
a body-size limit enforced while the body streams in (a 1 GB upload is cut off at the limit, not
buffered), and an optional Bearer API key like SGLang's `--api-key` (/health stays open so load
balancers can probe).
"""

from __future__ import annotations

import asyncio
import gc
import hmac
import logging
import os
import signal
import socket
import threading
import time
from contextlib import closing

import uvicorn
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.routing import Route

from infra.engines.api import (
    AbortRequest,
    GenerateRequest,
    PauseGenerationRequest,
    UpdateWeightsFromDiskRequest,
)
from configs.sections import SimLatencyConfig
from infra.engines.scheduler import GenerationJob, ScheduledEngine
from infra.engines.sim import SimEngine

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 8 * 1024 * 1024
OPEN_PATHS = frozenset({"/health"})
LISTEN_BACKLOG = 2048
"""Connections the kernel queues before the server accepts them: uvicorn's default."""
HEALTH_WHILE_PAUSED_SECONDS = 20.0
"""How long /health waits for a paused engine to be continued: SGLang's HEALTH_CHECK_TIMEOUT."""


class BodySizeLimit:
    """ASGI middleware: answer 413 as soon as a request body grows past `limit` bytes."""

    def __init__(self, app, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._too_large(send)
        seen = 0
        exceeded = False

        async def counting_receive():
            nonlocal seen, exceeded
            if exceeded:
                return {"type": "http.disconnect"}
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                exceeded = True  # the app sees a client that went away and stops reading
                return {"type": "http.disconnect"}
            return message

        async def guarded_send(message):
            if not exceeded:  # whatever the app answers to the cut-off body is replaced by 413
                await send(message)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except Exception:
            if not exceeded:
                raise
        if exceeded:
            await self._too_large(send)

    async def _too_large(self, send):
        response = JSONResponse({"error": f"request body over {self.limit} bytes"}, status_code=413)
        await response({"type": "http"}, None, send)


class RequireApiKey:
    """ASGI middleware: answer 401 unless the request carries `Authorization: Bearer <key>`.

    A plain ASGI class rather than `@app.middleware("http")`: Starlette's BaseHTTPMiddleware
    spawns a task group and a body stream per request, about a quarter of the server's CPU per
    /generate under load (benchmarks/engine.py)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            sent = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(sent, self.expected):
                response = JSONResponse({"error": "missing or wrong API key"}, status_code=401)
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)


def create_app(engine: ScheduledEngine, api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The FastAPI app serving `engine`; `api_key` (if set) is required on every route but /health."""
    app = FastAPI(title="tandem CPU engine", version="1")
    if api_key:
        app.add_middleware(RequireApiKey, api_key=api_key)
    app.add_middleware(BodySizeLimit, limit=max_body_bytes)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, err: RequestValidationError):
        return _invalid(err.errors())

    async def generate(request: Request):
        try:
            body = GenerateRequest.model_validate_json(await request.body())
        except ValidationError as err:
            return _invalid(err.errors(), prefix=["body"])
        bad = [t for t in body.input_ids if not 0 <= t < engine.vocab_size]
        if bad:
            raise HTTPException(400, f"input_ids outside the vocabulary [0, {engine.vocab_size}): {bad[:5]}")
        if len(body.input_ids) + body.sampling_params.max_new_tokens >= engine.context_length:
            # SGLang's own check: input + max_new_tokens must stay below the context length
            raise HTTPException(400, (
                f"Requested token count exceeds the model's maximum context length of {engine.context_length} "
                f"tokens: {len(body.input_ids)} tokens of input and max_new_tokens {body.sampling_params.max_new_tokens}"
            ))  # fmt: skip
        job = GenerationJob(rid=body.rid or os.urandom(8).hex(), input_ids=body.input_ids, params=body.sampling_params)
        started = time.monotonic()
        finished = asyncio.wrap_future(engine.submit(job))
        client_gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({finished, client_gone}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            engine.abort(rid=job.rid)
            raise
        finally:
            client_gone.cancel()
        if not finished.done():  # as SGLang does: a client that gave up (a timeout) frees its batch slots
            await run_in_threadpool(engine.abort, job.rid)
        try:
            await finished
        except Exception as err:  # the engine's step failed under this request: no half-made answer
            return JSONResponse({"error": {"message": f"generation failed: {err!r}"}}, status_code=500)
        results = [_result(engine, job, sample, body.return_logprob, started) for sample in job.samples]
        return JSONResponse(results[0] if len(results) == 1 else results)

    # The hot route is a plain Starlette route that validates its body with the same pydantic
    # model: FastAPI's dependency solving and response encoding (jsonable_encoder walks every
    # logprob in Python) were half the event loop's CPU per /generate (benchmarks/engine.py).
    app.router.routes.insert(0, Route("/generate", generate, methods=["POST"]))  # matched first

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: UpdateWeightsFromDiskRequest):
        aborted = await run_in_threadpool(engine.abort, None, True) if body.abort_all_requests else 0
        success, message = await run_in_threadpool(engine.update_weights, body.model_path, body.weight_version)
        if body.abort_all_requests:
            message += f" (aborted {aborted} requests first)"
        content = {"success": success, "message": message, "num_paused_requests": 0}
        return JSONResponse(content, status_code=200 if success else 400)

    @app.post("/pause_generation")
    async def pause_generation(body: PauseGenerationRequest):
        # The pause itself is set here, on the event loop like /continue_generation, so that the two
        # take effect in the order they arrived, as SGLang's do: a pause sent to an engine that was
        # stopped (SIGSTOP) runs when it resumes, before a continue sent after it answered again.
        engine.pause()
        if body.mode == "abort":
            aborted = await run_in_threadpool(engine.abort, None, True)
            return {"success": True, "message": f"paused (abort); aborted {aborted} requests"}
        if body.mode == "retract":
            engine.retract_running()
        return {"success": True, "message": f"paused ({body.mode})"}

    @app.post("/continue_generation")
    async def continue_generation():
        engine.resume()
        return {"success": True, "message": "continued"}

    @app.post("/abort_request")
    async def abort_request(body: AbortRequest):
        if not body.abort_all and not body.rid:
            raise HTTPException(400, "give a rid or abort_all: true")
        count = await run_in_threadpool(engine.abort, body.rid, body.abort_all)
        return {"success": True, "aborted": count}

    @app.post("/flush_cache")
    async def flush_cache():
        # No prefix cache is kept between requests, so there is nothing stale to drop.
        return {"success": True, "message": "nothing cached between requests"}

    @app.get("/health")
    async def health(request: Request):
        # SGLang's /health generates a token, so a paused engine answers it only once continued,
        # or 503 after SGLang's 20 s: a probe must not take a paused engine for one that serves.
        # A probe that gave up (the client's wait is 2 s) is not waited for.
        deadline = time.monotonic() + HEALTH_WHILE_PAUSED_SECONDS
        while engine.paused and time.monotonic() < deadline and not await request.is_disconnected():
            await asyncio.sleep(0.05)
        if engine.paused:
            return JSONResponse({"status": "paused"}, status_code=503)
        if not engine.thread.is_alive():  # as SGLang's, which generates a token: an engine that cannot is not healthy
            return JSONResponse({"status": "the engine's scheduler stopped: see its log"}, status_code=503)
        return {"status": "ok"}

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info():
        return {
            "model_path": engine.model_path,
            "tokenizer_path": engine.model_path,
            "is_generation": True,
            "weight_version": engine.weight_version,
        }

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info():
        backend = "sim" if isinstance(engine, SimEngine) else "cpu"
        return {"backend": backend, "context_length": engine.context_length, **engine.stats()}

    return app


def _invalid(errors: list[dict], prefix: list = ()) -> JSONResponse:
    """422 naming each offending field and the problem. FastAPI's default echoes every offending
    input back; a 10^6-token prompt would come back whole."""
    problems = [{"loc": [*prefix, *e["loc"]], "msg": e["msg"], "type": e["type"]} for e in errors]
    return JSONResponse({"error": "invalid request", "detail": problems}, status_code=422)


async def _disconnected(request: Request) -> None:
    """Return once the client of `request` (whose body was read) disconnects."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _result(engine: ScheduledEngine, job: GenerationJob, sample, return_logprob: bool, started: float) -> dict:
    meta = {
        "id": job.rid if job.params.n == 1 else f"{job.rid}-{sample.index}",
        "finish_reason": sample.finish_reason,
        "prompt_tokens": len(job.input_ids),
        "completion_tokens": len(sample.output_ids),
        "weight_version": job.weight_version,
        "weight_versions": sample.weight_versions or [{"version": job.weight_version, "start": 0, "end": 0}],
        "e2e_latency": time.monotonic() - started,
    }
    if return_logprob:
        meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(sample.logprobs, sample.output_ids)]
    text = engine.tokenizer.decode(sample.output_ids, skip_special_tokens=True)
    return {"output_ids": sample.output_ids, "text": text, "meta_info": meta}


GRACEFUL_SHUTDOWN_SECONDS = 5.0
"""How long a stopping engine lets requests in flight finish before it cancels them. Without a
bound uvicorn waits for them forever, and an engine whose generator was killed between pause and
continue holds its requests forever: it outlived its run (a deployed test caught one)."""


def serve(
    model_path: str, host: str = "127.0.0.1", port: int = 30000, api_key: str | None = None,
    max_batch_size: int = 32, weight_version: str = "default", parent_pid: int | None = None,
    sim_latency: SimLatencyConfig | None = None,
) -> None:  # fmt: skip
    """Load the model and serve until SIGINT/SIGTERM (uvicorn stops gracefully on both).

    host:port is listened on first, so a port in use raises AddressUnavailable before the model
    loads, and "serving ... on" is logged only once the address is held. A directory that
    transformers or the tokenizer cannot load raises ModelUnloadable with their reason.

    With `sim_latency`, serve a `SimEngine` (infra/engines/sim.py) on the model's tokenizer
    instead of computing with the model: same routes, GPU-like timing.

    With `parent_pid`, the server also stops when that process (the one that started it) dies: an
    engine runs in a session of its own (so that stopping it never signals anything else), and
    without this a SIGKILLed generator would leave its engines serving forever. The starter passes
    its pid rather than the engine reading getppid(): a starter that dies while the engine is still
    importing leaves an engine whose first getppid() already names its new parent.

    torch and the CPU engine are imported only to serve the CPU engine: a simulated engine's
    process never imports them (1.5 s of start-up each, see sim.py).

    Unless OMP_NUM_THREADS says otherwise, torch gets one thread fewer than the cores this process
    may use: the HTTP event loop shares the process and the rollout client often shares the
    machine, and an oversubscribed intra-op pool collapses (on 2 busy cores, 2 torch threads
    decoded 10x slower than 1 in benchmarks/engine.py)."""
    listener = listening_socket(host, port)  # before the model loads: a taken port fails at once
    with closing(listener):
        if parent_pid is not None:
            _stop_when_orphaned(parent_pid)
        try:
            engine = _load_engine(model_path, max_batch_size, weight_version, sim_latency)
        except (OSError, ValueError) as err:  # transformers' and tokenizers' words for a bad directory
            reason = " ".join(str(err).split())  # the tokenizer's reason spans lines
            raise ModelUnloadable(f"cannot load {model_path}: {reason}") from err
        config = uvicorn.Config(create_app(engine, api_key=api_key), log_level="warning", access_log=False,
                                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS)  # fmt: skip
        # The heap of start-up (torch, transformers, the model) is long-lived: collected once and
        # frozen, no later collection walks it. Otherwise a full collection of it fell on the
        # first requests (0.2 s where a request took 0.04 s: a restarted engine lost them to its
        # warm sibling) and recurred while serving.
        gc.collect()
        gc.freeze()
        log.info("serving %s on http://%s:%d", model_path, host, port)
        try:
            uvicorn.Server(config).run(sockets=[listener])
        except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it stopped on
            pass
        finally:
            engine.shutdown()


def _load_engine(model_path: str, max_batch_size: int, weight_version: str, sim_latency: SimLatencyConfig | None) -> ScheduledEngine:
    if sim_latency is not None:
        return SimEngine(model_path, sim_latency, max_batch_size=max_batch_size, weight_version=weight_version)
    import torch

    from infra.engines.cpu import CpuEngine

    if not os.environ.get("OMP_NUM_THREADS"):
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(max(1, cores - 1))
    return CpuEngine(model_path, max_batch_size=max_batch_size, weight_version=weight_version)


class ModelUnloadable(RuntimeError):
    """The model directory has a config.json but transformers or tokenizers cannot load it."""


class AddressUnavailable(OSError):
    """The engine cannot listen where it was asked to: the port is taken, or the host is not local."""


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on host:port (its first address; "" is every interface), with the
    options asyncio would set, or AddressUnavailable naming them. It listens here, not only once
    uvicorn starts: two sockets with SO_REUSEADDR may both bind a port that nothing listens on
    yet, and uvloop does not report a listen that then fails, so an engine that lost the port
    during its model load would stay up serving nothing."""
    sock = None
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
        sock.listen(LISTEN_BACKLOG)
    except OSError as err:
        if sock is not None:
            sock.close()
        raise AddressUnavailable(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    return sock


def _stop_when_orphaned(parent_pid: int, poll_seconds: float = 1.0) -> None:
    """SIGTERM this process once `parent_pid` is no longer its parent (it died, and this process
    was re-parented), also if that had happened before this was called."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_seconds)
        log.warning("parent process %d is gone; stopping", parent_pid)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
