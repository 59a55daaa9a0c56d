"""The engine contract: one suite that any backend behind SGLang's native API must pass.

CI runs it against tandem's CPU engine and its simulated engine (`engine.backend: sim`; the
checks of model logprobs are the CPU engine's alone). scripts/gpu_check.sh runs the same file
against a real SGLang server with TANDEM_ENGINE_BACKEND=sglang. Everything goes over HTTP to a real engine
process on loopback, started with an API key so that the auth check runs on every request.
"""

from __future__ import annotations

import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from configs.sections import EngineConfig, ModelConfig, SimLatencyConfig
from infra.engines.process import EngineProcess, cpu_engine_process
from infra.manifest import MANIFEST_NAME, build_manifest
from infra.modelfactory import save_tiny_model
from infra.ports import free_port_block
from tests.conftest import committed_model_dir, corrupt_copy, reference_logprobs

BACKEND = os.environ.get("TANDEM_ENGINE_BACKEND", "cpu")
API_KEY = "contract-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = [1, 20, 21, 22, 23, 24]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {"initial": committed_model_dir(root / "v0", seed=0), "update": committed_model_dir(root / "v1", seed=1)}


SIM_LATENCY = SimLatencyConfig(decode_base_s=0.002, decode_s_per_seq=0.0005, prefill_s_per_token=0.0, load_s_per_gb=1.0)
"""A fast latency model: the contract suite checks behaviour, test_sim_engine.py the timing."""


@dataclass
class ServedEngine:
    backend: str
    process: EngineProcess

    @property
    def url(self) -> str:
        return self.process.url


@pytest.fixture(scope="module", params=["sglang"] if BACKEND == "sglang" else ["cpu", "sim"])
def engine(request, models, tmp_path_factory) -> ServedEngine:
    port = free_port_block(count=1)
    log_path = tmp_path_factory.mktemp("engine") / "engine.log"
    if request.param == "sglang":
        from infra.engines.sglang import sglang_engine_process

        config = EngineConfig(backend="sglang", api_key=API_KEY)
        process = sglang_engine_process(config, str(models["initial"]), port, log_path, weight_version="0")
    else:
        sim = SIM_LATENCY if request.param == "sim" else None
        process = cpu_engine_process(models["initial"], port, log_path, api_key=API_KEY, weight_version="0", sim_latency=sim)
    with process.start(timeout=600):
        yield ServedEngine(request.param, process)


@pytest.fixture
def http(engine) -> httpx.Client:
    with httpx.Client(base_url=engine.url, headers=AUTH, timeout=60) as client:
        yield client


def generate(http: httpx.Client, input_ids=PROMPT, **sampling) -> list[dict]:
    response = http.post("/generate", json={"input_ids": input_ids, "sampling_params": sampling, "return_logprob": True})
    assert response.status_code == 200, response.text
    answer = response.json()
    return answer if isinstance(answer, list) else [answer]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_a_reference_forward_pass(http, engine, models, temperature):
    """Behaviour logprobs are those of the distribution sampled from, softmax(logits / T): what
    the trainer computes (SGLang's default, which its launcher pins)."""
    if engine.backend == "sim":
        pytest.skip("the simulated engine computes no logprobs: it emits log(1/V)")
    current = http.get("/model_info").json()["model_path"]
    for sample in generate(http, temperature=temperature, max_new_tokens=24, ignore_eos=True, n=3, sampling_seed=7):
        output = sample["output_ids"]
        served = [entry[0] for entry in sample["meta_info"]["output_token_logprobs"]]
        assert [entry[1] for entry in sample["meta_info"]["output_token_logprobs"]] == output
        assert served == pytest.approx(reference_logprobs(Path(current), PROMPT, output, temperature), abs=1e-4)
        assert sample["meta_info"]["completion_tokens"] == len(output) == 24
        assert sample["meta_info"]["prompt_tokens"] == len(PROMPT)
        assert sample["meta_info"]["finish_reason"]["type"] == "length"


def test_sampling_seed_makes_outputs_reproducible(http, engine):
    if engine.backend == "sglang":
        pytest.skip("SGLang honours sampling_seed only when launched with --enable-deterministic-inference")
    first = generate(http, temperature=1.0, max_new_tokens=20, ignore_eos=True, sampling_seed=1234, n=2)
    again = generate(http, temperature=1.0, max_new_tokens=20, ignore_eos=True, sampling_seed=1234, n=2)
    other = generate(http, temperature=1.0, max_new_tokens=20, ignore_eos=True, sampling_seed=99, n=2)
    assert [s["output_ids"] for s in first] == [s["output_ids"] for s in again]
    assert [s["output_ids"] for s in first] != [s["output_ids"] for s in other]
    assert first[0]["output_ids"] != first[1]["output_ids"], "the n samples of a seeded request must differ"


def test_stop_token_ends_generation(http, engine):
    if engine.backend == "sim":  # no model to agree with itself: check the stop itself
        outputs = generate(http, temperature=1.0, max_new_tokens=24, stop_token_ids=[30], n=16, sampling_seed=3)
        stopped = [o for o in outputs if o["meta_info"]["finish_reason"]["type"] == "stop"]
        assert stopped, "some of 16 samples end before 24 tokens"
        for o in stopped:
            assert o["output_ids"][-1] == 30 and 30 not in o["output_ids"][:-1]
            assert o["meta_info"]["finish_reason"] == {"type": "stop", "matched": 30}
        return
    greedy = generate(http, temperature=0.0, max_new_tokens=12, ignore_eos=True)[0]["output_ids"]
    stop_at = greedy[3]
    stopped = generate(http, temperature=0.0, max_new_tokens=12, ignore_eos=True, stop_token_ids=[stop_at])[0]
    assert stopped["output_ids"] == greedy[: greedy.index(stop_at) + 1]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_at}


def test_update_weights_changes_outputs_and_version_and_refuses_a_corrupt_snapshot(http, engine, models, tmp_path):
    seeded = dict(temperature=1.0, max_new_tokens=16, ignore_eos=True, sampling_seed=5)
    before = generate(http, **seeded)[0]
    if engine.backend != "sglang":  # SGLang checks no manifest: the generator verifies one before a load
        corrupt = corrupt_copy(models["update"], tmp_path / "corrupt")
        refused = http.post("/update_weights_from_disk", json={"model_path": str(corrupt), "weight_version": "9"})
        assert refused.status_code == 400 and refused.json()["success"] is False
        assert "model.safetensors" in refused.json()["message"]
        assert http.get("/model_info").json()["weight_version"] == "0"
        assert generate(http, **seeded)[0]["output_ids"] == before["output_ids"]

    loaded = http.post("/update_weights_from_disk", json={"model_path": str(models["update"]), "weight_version": "1"})
    assert loaded.status_code == 200 and loaded.json()["success"] is True
    after = generate(http, **seeded)[0]
    assert after["output_ids"] != before["output_ids"]
    assert after["meta_info"]["weight_version"] == "1"
    assert http.get("/model_info").json()["weight_version"] == "1"
    if engine.backend != "sim":
        served = [entry[0] for entry in after["meta_info"]["output_token_logprobs"]]
        assert served == pytest.approx(reference_logprobs(models["update"], PROMPT, after["output_ids"]), abs=1e-4)


def test_concurrent_requests_run_in_batches_larger_than_one(http, engine):
    if engine.backend == "sglang":
        pytest.skip("decode batch sizes are reported by tandem's engines only")
    before = http.get("/server_info").json()["decode_batch_sizes"]
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda _: generate(http, max_new_tokens=24, ignore_eos=True), range(16)))
    assert all(r[0]["meta_info"]["completion_tokens"] == 24 for r in results)
    after = http.get("/server_info").json()["decode_batch_sizes"]
    new_steps = {int(size): count - before.get(size, 0) for size, count in after.items()}
    assert max(size for size, count in new_steps.items() if count > 0) > 1


def test_pause_holds_new_work_and_continue_releases_it(http):
    assert http.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(out=generate(http, max_new_tokens=4)))
    worker.start()
    try:
        worker.join(timeout=1.5)
        assert worker.is_alive(), "a request completed while the engine was paused"
    finally:
        assert http.post("/continue_generation", json={}).status_code == 200
    worker.join(timeout=30)
    assert result["out"][0]["meta_info"]["finish_reason"]["type"] in ("stop", "length")


def test_a_paused_engine_answers_health_only_once_continued(http):
    """SGLang's /health generates a token, which waits while the engine is paused (and answers
    503 after 20 s): a health probe must not take a paused engine for one that serves."""
    assert http.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
    with ThreadPoolExecutor(1) as pool:
        try:
            probe = pool.submit(http.get, "/health")
            time.sleep(2.5)
            assert not probe.done(), f"/health answered {probe.result().status_code} while the engine was paused"
        finally:
            assert http.post("/continue_generation", json={}).status_code == 200
        assert probe.result(timeout=30).status_code == 200


def wait_until_queued(http: httpx.Client, engine: ServedEngine, count: int = 1) -> None:
    """Return once `count` requests sent to the paused engine wait in its queue (SGLang reports
    no queue length: there, a moment's wait)."""
    if engine.backend == "sglang":
        time.sleep(0.5)
        return
    deadline = time.monotonic() + 30
    while http.get("/server_info").json()["num_waiting"] < count:
        assert time.monotonic() < deadline, "the request never reached the engine"
        time.sleep(0.02)


HELD_WHILE_PAUSED = (
    "SGLang 0.5.23 holds a request that arrives while paused in its tokenizer manager, before the "
    "scheduler sees it, and an abort goes to the scheduler only (TokenizerManager.abort_request)"
)


def test_abort_ends_a_request_with_finish_reason_abort(http, engine):
    if engine.backend == "sglang":
        pytest.skip(HELD_WHILE_PAUSED)
    http.post("/pause_generation", json={"mode": "in_place"})
    with ThreadPoolExecutor(2) as pool:
        try:
            pending = pool.submit(
                lambda: http.post("/generate", json={"input_ids": PROMPT, "rid": "to-abort", "sampling_params": {"max_new_tokens": 8}})
            )
            wait_until_queued(http, engine)
            assert http.post("/abort_request", json={"rid": "to-abort"}).status_code == 200
            answer = pending.result(timeout=30).json()
        finally:
            http.post("/continue_generation", json={})
    assert answer["meta_info"]["finish_reason"]["type"] == "abort"


def test_pause_in_abort_mode_aborts_running_requests(http, engine):
    if engine.backend == "sglang":
        pytest.skip(HELD_WHILE_PAUSED)
    http.post("/pause_generation", json={"mode": "in_place"})
    with ThreadPoolExecutor(1) as pool:
        try:
            pending = pool.submit(generate, http, max_new_tokens=8)
            wait_until_queued(http, engine)
            assert http.post("/pause_generation", json={"mode": "abort"}).status_code == 200
            answer = pending.result(timeout=30)
        finally:
            http.post("/continue_generation", json={})
    assert answer[0]["meta_info"]["finish_reason"]["type"] == "abort"


def test_a_weight_load_asked_to_abort_all_requests_aborts_them_first(http, engine, models):
    if engine.backend == "sglang":
        pytest.skip(HELD_WHILE_PAUSED)
    version = http.get("/model_info").json()["weight_version"]
    http.post("/pause_generation", json={"mode": "in_place"})
    with ThreadPoolExecutor(1) as pool:
        try:
            pending = pool.submit(generate, http, max_new_tokens=8)
            wait_until_queued(http, engine)
            loaded = http.post("/update_weights_from_disk",
                               json={"model_path": str(models["initial"]), "weight_version": version, "abort_all_requests": True})  # fmt: skip
            assert loaded.json()["success"], loaded.text
            answer = pending.result(timeout=30)
        finally:
            http.post("/continue_generation", json={})
    assert answer[0]["meta_info"]["finish_reason"]["type"] == "abort"


MALFORMED = {
    "bad json": dict(content=b"{not json", headers={"content-type": "application/json"}),
    "missing input_ids": dict(json={"sampling_params": {}}),
    "input_ids not a list": dict(json={"input_ids": "hello"}),
    "empty input_ids": dict(json={"input_ids": []}),
    "out-of-vocabulary id": dict(json={"input_ids": [1, 10_000_000]}),
    "negative id": dict(json={"input_ids": [1, -3]}),
    "negative max_new_tokens": dict(json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}}),
    "huge max_new_tokens": dict(json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 10**9}}),
    "temperature below 0": dict(json={"input_ids": [1, 2], "sampling_params": {"temperature": -0.1}}),
    "n is 0": dict(json={"input_ids": [1, 2], "sampling_params": {"n": 0}}),
    "unknown sampling field": dict(json={"input_ids": [1, 2], "sampling_params": {"temprature": 1.0}}),
    "body over the size limit": dict(content=b'{"input_ids": [' + b"1," * 5_000_000 + b"1]}"),
}


@pytest.mark.parametrize("case", list(MALFORMED), ids=list(MALFORMED))
def test_malformed_requests_get_a_4xx_and_the_server_stays_up(http, engine, case):
    if engine.backend == "sglang" and case == "body over the size limit":
        pytest.skip("SGLang sets no body size limit")
    response = http.post("/generate", **MALFORMED[case])
    assert 400 <= response.status_code < 500, (case, response.status_code, response.text[:200])
    assert response.text, "a 4xx must say why"
    assert http.get("/health").status_code == 200
    assert generate(http, max_new_tokens=2, ignore_eos=True)[0]["meta_info"]["completion_tokens"] == 2


def test_api_key_is_required_on_every_route_but_health(engine):
    with httpx.Client(base_url=engine.url, timeout=30) as anonymous:
        assert anonymous.get("/health").status_code == 200
        assert anonymous.post("/generate", json={"input_ids": PROMPT}).status_code == 401
        assert anonymous.get("/model_info").status_code == 401
        assert anonymous.post("/flush_cache").status_code == 401
        wrong = {"Authorization": "Bearer not-the-key"}
        assert anonymous.post("/generate", json={"input_ids": PROMPT}, headers=wrong).status_code == 401


def test_info_routes_answer_on_new_and_deprecated_paths(http):
    for path in ("/model_info", "/get_model_info"):
        info = http.get(path).json()
        assert info["is_generation"] is True and "weight_version" in info
    for path in ("/server_info", "/get_server_info"):
        assert http.get(path).status_code == 200
    assert http.post("/flush_cache").status_code == 200


def test_a_snapshot_of_another_architecture_is_refused_naming_the_tensor(http, engine, tmp_path):
    if engine.backend != "cpu":
        pytest.skip("the CPU engine copies tensors into its live model; the others load no tensors")
    wider = save_tiny_model(ModelConfig(hidden_size=64, num_heads=4), tmp_path / "wider", seed=0)
    (wider / MANIFEST_NAME).write_text(json.dumps(build_manifest(wider)))
    version = http.get("/model_info").json()["weight_version"]
    refused = http.post("/update_weights_from_disk", json={"model_path": str(wider), "weight_version": "7"})
    assert refused.status_code == 400 and refused.json()["success"] is False
    assert "model.embed_tokens.weight has shape" in refused.json()["message"], refused.json()
    assert http.get("/model_info").json()["weight_version"] == version
    assert len(generate(http, max_new_tokens=4, ignore_eos=True)[0]["output_ids"]) == 4


def context_length(model_dir: Path) -> int:
    """The context length of the served model (its config's, which every backend serves)."""
    return json.loads((model_dir / "config.json").read_text())["max_position_embeddings"]


def test_input_plus_max_new_tokens_must_stay_below_the_context_length(http, models):
    """SGLang refuses a request whose input + max_new_tokens reaches the context length (400),
    rather than cutting it short: the rollout leaves one token of room, and so must every caller."""
    context = context_length(models["initial"])
    fits = generate(http, input_ids=[1] * (context - 9), max_new_tokens=8, ignore_eos=True)
    assert fits[0]["meta_info"]["completion_tokens"] == 8
    refused = http.post("/generate", json={"input_ids": [1] * (context - 8), "sampling_params": {"max_new_tokens": 8}})
    assert refused.status_code == 400 and "context length" in refused.text, refused.text


def test_requests_retracted_across_a_weight_load_go_on_with_the_new_weights(http, engine, models):
    """The weight sync's pause (mode retract): running requests go back to the queue, and once
    continued they finish on the new weights, recomputed over their prompt and output so far, and
    report which version produced which tokens. Runs last: it leaves the engine on v5."""
    assert http.post("/update_weights_from_disk", json={"model_path": str(models["initial"]), "weight_version": "4"}).json()["success"]
    new_tokens = context_length(models["initial"]) - len(PROMPT) - 1
    generated_before = http.get("/server_info").json().get("tokens_generated", 0)
    assert http.post("/pause_generation", json={"mode": "in_place"}).status_code == 200  # all 16 start together:
    with ThreadPoolExecutor(16) as pool:  # none may be half done, on a loaded machine, when the last arrives
        pending = [pool.submit(generate, http, max_new_tokens=new_tokens, ignore_eos=True, temperature=1.0) for _ in range(16)]
        wait_until_queued(http, engine, count=16)
        assert http.post("/continue_generation", json={}).status_code == 200
        if engine.backend == "sglang":  # reports no token count: its 16 prefills take milliseconds
            time.sleep(0.05)
        deadline = time.monotonic() + 30
        while engine.backend != "sglang" and http.get("/server_info").json()["tokens_generated"] < generated_before + 16:
            assert time.monotonic() < deadline, "the requests never ran"
            time.sleep(0.005)
        assert http.post("/pause_generation", json={"mode": "retract"}).status_code == 200
        try:
            loaded = http.post("/update_weights_from_disk", json={"model_path": str(models["update"]), "weight_version": "5"})
            assert loaded.json()["success"], loaded.text
        finally:
            assert http.post("/continue_generation", json={}).status_code == 200
        results = [future.result(timeout=60)[0] for future in pending]
    assert all(r["meta_info"]["completion_tokens"] == new_tokens and r["meta_info"]["weight_version"] == "5" for r in results)
    straddled = [r for r in results if len(r["meta_info"]["weight_versions"]) == 2]
    assert straddled, [r["meta_info"]["weight_versions"] for r in results]
    for result in straddled:
        old, new = result["meta_info"]["weight_versions"]
        assert (old["version"], old["start"], new["version"], new["end"]) == ("4", 0, "5", new_tokens) and old["end"] == new["start"]
        if engine.backend == "cpu":  # the new weights' logprobs over the whole prefix: its KV was recomputed
            served = [entry[0] for entry in result["meta_info"]["output_token_logprobs"]][new["start"]:]
            reference = reference_logprobs(models["update"], PROMPT, result["output_ids"])[new["start"]:]
            assert served == pytest.approx(reference, abs=1e-4)


def test_a_request_whose_client_gave_up_is_aborted(http, engine):
    """As SGLang aborts a request whose connection closes: a client's timeout frees the slot (the
    engine client retries elsewhere, and the orphan would otherwise run to its end beside it)."""
    if engine.backend == "sglang":
        pytest.skip("SGLang's /server_info reports no queue length")
    assert http.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
    try:
        with ThreadPoolExecutor(1) as pool:
            given_up = pool.submit(http.post, "/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8}}, timeout=3)
            deadline = time.monotonic() + 2.5
            while not http.get("/server_info").json()["num_waiting"] and time.monotonic() < deadline:
                time.sleep(0.05)
            assert http.get("/server_info").json()["num_waiting"] == 1, "the request waits in the paused engine's queue"
            with pytest.raises(httpx.ReadTimeout):
                given_up.result()
        deadline = time.monotonic() + 10
        while http.get("/server_info").json()["num_waiting"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert http.get("/server_info").json()["num_waiting"] == 0, "the request outlived its client"
    finally:
        assert http.post("/continue_generation", json={}).status_code == 200
