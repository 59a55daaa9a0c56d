"""Fuzzing the CPU engine's HTTP API with schemathesis: no request may get a 5xx or take it down.

The CPU engine (a tiny model, in this process) is served by the app of infra/engines/server.py
and fuzzed against the OpenAPI schema FastAPI generates for that app. schemathesis draws bodies
that fit the schema and bodies that break it (wrong types, missing fields, out-of-range values),
for every operation; each answer must be below 500, and afterwards the engine must still answer
/health and generate. With an API key set, every request is also sent without the key and must
get 401 (except /health).

/generate is a plain Starlette route (server.py: FastAPI's per-request machinery cost half the
event loop), so FastAPI leaves it out of /openapi.json; `fuzz_schema` adds it from its request
model, tightened to what this engine serves (token ids in its vocabulary, a few short samples),
so that most valid requests reach the model instead of stopping at a 400 and none takes
seconds. The examples are derandomized, so a run in CI is the same run as on a laptop.
Run it with `pytest -m fuzz`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import schemathesis
from fastapi import FastAPI
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from starlette.routing import Route

from infra.engines.api import DEPRECATED_ROUTES, ROUTES, GenerateRequest
from infra.engines.cpu import CpuEngine
from infra.engines.server import OPEN_PATHS, create_app
from tests.conftest import committed_model_dir
from tests.test_engine_contract import PROMPT

pytestmark = pytest.mark.fuzz

API_KEY = "fuzz-key"
FUZZ = settings(
    max_examples=50, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow]
)
"""50 examples per operation and generation mode (valid or invalid inputs), the same ones every run;
no deadlines or speed checks, which a loaded 2-core CI machine would trip."""
OPERATIONS = sorted({*ROUTES.values(), *(("GET", old) for old in DEPRECATED_ROUTES)}, key=lambda op: op[1])
"""Every route of the engine API (infra/engines/api.py); fuzz_schema checks the app serves no other."""
DOC_ROUTES = frozenset({"/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})


def fuzz_schema(app: FastAPI, engine: CpuEngine) -> schemathesis.BaseSchema:
    """The schemathesis schema of `app`: FastAPI's own OpenAPI document plus /generate."""
    document = app.openapi()  # not GET /openapi.json: with an API key that route needs the key too
    request = GenerateRequest.model_json_schema(ref_template="#/components/schemas/{model}")
    document["components"]["schemas"].update(request.pop("$defs"))
    document["components"]["schemas"]["GenerateRequest"] = request
    request["properties"]["input_ids"].update(maxItems=engine.context_length - 17)  # input + max_new_tokens < context
    request["properties"]["input_ids"]["items"].update(maximum=engine.vocab_size - 1)
    sampling = document["components"]["schemas"]["SamplingParams"]["properties"]
    sampling["n"].update(maximum=4)
    sampling["max_new_tokens"].update(maximum=16)
    body = {"required": True, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/GenerateRequest"}}}}
    document["paths"]["/generate"] = {
        "post": {"operationId": "generate", "requestBody": body, "responses": {"200": {"description": "OK"}}}
    }
    served = {(method, route.path) for route in app.routes if isinstance(route, Route) for method in route.methods}
    fuzzed = {(method.upper(), path) for path, item in document["paths"].items() for method in item}
    assert {op for op in served if op[1] not in DOC_ROUTES} == fuzzed == set(OPERATIONS), "every route is fuzzed"
    schema = schemathesis.openapi.from_dict(document)
    schema.app = app  # what schemathesis.openapi.from_asgi sets: calls go to the app in this process
    return schema


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return committed_model_dir(tmp_path_factory.mktemp("model") / "v0", seed=0)


@pytest.fixture(scope="module")
def engine(model_dir: Path):
    cpu = CpuEngine(model_dir, max_batch_size=8, weight_version="0")
    yield cpu
    cpu.shutdown()


@dataclass(frozen=True)
class Served:
    """The engine's app and its fuzz schema; `key` is the API key the app requires, if any."""

    app: FastAPI
    schema: schemathesis.BaseSchema
    key: str | None

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}


@pytest.fixture(scope="module", params=["no key", "api key"])
def served(request, engine) -> Served:
    key = API_KEY if request.param == "api key" else None
    app = create_app(engine, api_key=key)
    return Served(app, fuzz_schema(app, engine), key)


@pytest.mark.parametrize(("method", "path"), OPERATIONS, ids=[f"{m} {p}" for m, p in OPERATIONS])
def test_fuzz(served: Served, method: str, path: str):
    """Fuzzed requests to one operation, valid inputs and then invalid ones, never get a 5xx, and
    the engine still serves afterwards. With an API key, each is sent with the key, and also
    without it, which must get 401 on every route but /health."""
    operation = served.schema[path][method]
    takes_input = bool(operation.body) or any(True for _ in operation.iter_parameters())
    modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if takes_input else [])  # nothing to break

    def check(case) -> None:
        if served.key and path not in OPEN_PATHS:
            anonymous = case.call(timeout=60)
            assert anonymous.status_code == 401, f"{method} {path} without the key: {anonymous.status_code}"
        response = case.call(headers=served.auth, timeout=60)
        if path == "/pause_generation":  # a paused engine would hold every later /generate forever
            assert TestClient(served.app).post("/continue_generation", headers=served.auth).status_code == 200
        assert response.status_code < 500, f"{method} {path}: {response.status_code}\n{response.text[:2000]}"
        if response.status_code >= 400:
            assert response.text, "a refusal says why"

    for mode in modes:
        FUZZ(given(case=operation.as_strategy(generation_mode=mode))(check))()
    assert_engine_still_serves(served)


def assert_engine_still_serves(served: Served) -> None:
    """/health answers, a small /generate works and the engine is not left paused."""
    with TestClient(served.app, headers=served.auth) as client:
        assert client.get("/health").json() == {"status": "ok"}
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}
        answer = client.post("/generate", json=body)
        assert answer.status_code == 200, answer.text[:1000]
        assert answer.json()["meta_info"]["completion_tokens"] == 3
        assert client.get("/server_info").json()["paused"] is False
