"""The simulated engine's own promises: its timing follows the latency model, its lengths have
the configured long tail, its tokens are valid, and it reports the weights it was given.
(tests/test_engine_contract.py runs the HTTP contract against it.)"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from configs.sections import SimLatencyConfig
from infra.engines.api import SamplingParams
from infra.engines.scheduler import EngineStopped, GenerationJob
from infra.engines.sim import SimEngine
from tests.conftest import committed_model_dir

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sim-models")
    return committed_model_dir(root / "v0", seed=0), committed_model_dir(root / "v1", seed=1)


def run_jobs(engine: SimEngine, count: int, **sampling) -> tuple[list[GenerationJob], float]:
    jobs = [GenerationJob(rid=f"r{i}", input_ids=[1, 20, 21, 22], params=SamplingParams(**sampling)) for i in range(count)]
    started = time.monotonic()
    for job in jobs:
        engine.submit(job)
    for job in jobs:
        job.future.result(timeout=60)
    return jobs, time.monotonic() - started


@pytest.mark.timing
def test_decode_time_follows_the_model_alone_and_in_a_batch(model_dirs):
    latency = SimLatencyConfig(decode_base_s=0.02, decode_s_per_seq=0.01, prefill_s_per_token=0.0)
    engine = SimEngine(model_dirs[0], latency)
    try:
        _, alone = run_jobs(engine, 1, max_new_tokens=20, ignore_eos=True)
        _, batch = run_jobs(engine, 8, max_new_tokens=20, ignore_eos=True)
    finally:
        engine.shutdown()
    assert alone == pytest.approx(20 * (0.02 + 0.01 * 1), rel=0.25)
    assert batch == pytest.approx(20 * (0.02 + 0.01 * 8), rel=0.25), "eight sequences share each step, which grows with them"


@pytest.mark.timing
def test_prefill_is_paid_per_prompt_token_at_admission(model_dirs):
    engine = SimEngine(model_dirs[0], SimLatencyConfig(decode_base_s=0.0, decode_s_per_seq=0.0, prefill_s_per_token=0.05))
    try:
        _, seconds = run_jobs(engine, 1, max_new_tokens=1, ignore_eos=True, n=2)
    finally:
        engine.shutdown()
    assert seconds == pytest.approx(0.05 * 4 * 2, rel=0.25)


def test_lengths_are_long_tailed_and_tokens_valid(model_dirs):
    engine = SimEngine(model_dirs[0], SimLatencyConfig(decode_base_s=0.0, decode_s_per_seq=0.0, length_median=8, length_sigma=0.8))
    try:
        jobs, _ = run_jobs(engine, 1, max_new_tokens=60, n=256, sampling_seed=3, temperature=1.0)
    finally:
        engine.shutdown()
    samples = jobs[0].samples
    lengths = [len(s.output_ids) for s in samples]
    assert 6 <= statistics.median(lengths) <= 10
    assert max(lengths) >= 3 * statistics.median(lengths), "a long tail: some outputs far longer than the median"
    special = set(engine.tokenizer.all_special_ids)
    for sample in samples:
        assert all(0 <= t < engine.vocab_size for t in sample.output_ids)
        assert all(t not in special for t in sample.output_ids[:-1])
        if sample.finish_reason["type"] == "stop":
            assert sample.output_ids[-1] == engine.tokenizer.eos_token_id
        assert sample.logprobs and all(lp < 0 for lp in sample.logprobs)


def test_an_abort_takes_only_its_request_and_leaves_the_queue_queued(model_dirs):
    """The client's straggler hand-off aborts single requests: the rest of the engine's queue
    must stay queued, first come first served, within max_batch_size."""
    engine = SimEngine(model_dirs[0], SimLatencyConfig(decode_base_s=0.01, decode_s_per_seq=0.0), max_batch_size=2)
    try:
        jobs = [GenerationJob(rid=f"r{i}", input_ids=[1, 20, 21], params=SamplingParams(max_new_tokens=30, ignore_eos=True)) for i in range(5)]
        for job in jobs:
            engine.submit(job)
        deadline = time.monotonic() + 10
        while engine.stats()["num_running"] < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert engine.abort(rid="r3") == 1 and engine.abort(rid="r0") == 1
        for job in jobs:
            job.future.result(timeout=30)
    finally:
        engine.shutdown()
    assert [j.samples[0].finish_reason["type"] for j in jobs] == ["abort", "length", "length", "abort", "length"]
    assert jobs[3].samples[0].output_ids == [] and 0 < len(jobs[0].samples[0].output_ids) < 30
    assert max(int(size) for size in engine.stats()["decode_batch_sizes"]) == 2, "never more than max_batch_size at once"


@pytest.mark.timing
def test_update_weights_takes_the_load_time_and_is_reported(model_dirs):
    engine = SimEngine(model_dirs[0], SimLatencyConfig(load_s_per_gb=500.0), weight_version="0")
    try:
        size_gb = sum(p.stat().st_size for p in model_dirs[1].glob("*.safetensors")) / 1e9
        started = time.monotonic()
        ok, message = engine.update_weights(str(model_dirs[1]), "1")
        took = time.monotonic() - started
        jobs, _ = run_jobs(engine, 1, max_new_tokens=2)
    finally:
        engine.shutdown()
    assert ok, message
    assert took == pytest.approx(500.0 * size_gb, rel=0.3, abs=0.05)
    assert jobs[0].weight_version == "1" and engine.stats()["weight_version"] == "1"


def test_a_simulated_engine_imports_no_torch(model_dirs):
    """N simulated engines boot side by side with the trainer on 2 cores: torch (and transformers'
    model code, which imports it) cost each of them about 1.5 s of CPU at start-up."""
    probe = ("import sys; from configs.sections import SimLatencyConfig; from infra.engines.server import create_app; "
             "from infra.engines.sim import SimEngine; "
             f"engine = SimEngine({str(model_dirs[0])!r}, SimLatencyConfig()); create_app(engine); engine.shutdown(); "
             "print(len(engine.token_ids) > 0, engine.eos_token_id is not None, 'torch' in sys.modules)")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True", "False"]


def test_a_stopped_engine_fails_its_work_at_once(model_dirs):
    """Requests running or queued when the scheduler stops, and any sent after, fail with
    EngineStopped instead of waiting out their caller's timeout; so do commands (an abort)."""
    engine = SimEngine(model_dirs[0], SimLatencyConfig(decode_base_s=0.01, decode_s_per_seq=0.0), max_batch_size=1)
    running, queued = (GenerationJob(rid=r, input_ids=[1, 20], params=SamplingParams(max_new_tokens=10_000, ignore_eos=True)) for r in "ab")
    engine.submit(running)
    engine.submit(queued)
    time.sleep(0.2)
    engine.shutdown()
    late = GenerationJob(rid="c", input_ids=[1, 20], params=SamplingParams(max_new_tokens=2))
    engine.submit(late)
    for job in (running, queued, late):
        with pytest.raises(EngineStopped):
            job.future.result(timeout=5)
    with pytest.raises(EngineStopped):
        engine.abort(abort_all=True)


class FailingSimEngine(SimEngine):
    """A scheduler whose bookkeeping between steps raises once `broken` is set."""

    broken = False

    def _collect_work(self) -> bool:
        if self.broken:
            raise RuntimeError("bookkeeping failed")
        return super()._collect_work()


def test_a_scheduler_that_fails_outside_a_step_fails_its_work(model_dirs):
    engine = FailingSimEngine(model_dirs[0], SimLatencyConfig(decode_base_s=0.01, decode_s_per_seq=0.0))
    try:
        job = GenerationJob(rid="a", input_ids=[1, 20], params=SamplingParams(max_new_tokens=10_000, ignore_eos=True))
        engine.submit(job)
        time.sleep(0.1)
        engine.broken = True
        with pytest.raises(EngineStopped):
            job.future.result(timeout=5)
        assert not engine.thread.is_alive()
    finally:
        engine.shutdown()
