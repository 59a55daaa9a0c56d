"""A generation side that fails for good fails the run instead of leaving the trainer waiting.

The faults a run survives (SIGKILLed engine, Dask worker and trainer, a storage outage, damaged
and copied objects, a Prefect server restart) are checked by benchmarks/faults.py; its quick half
runs in tests/test_faults.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from configs import TINY_CONFIG, load_config
from flows.generation import generation
from flows.training import GenerationStopped, training
from infra.manifest import ManifestError
from tasks.lag import read_trainer_state, reopen_run
from tasks.lease import lease_key
from tasks.shards import list_shards
from tasks.rundir import initialize_run
from tests.test_pipeline import ROOT, CopyEnv

pytestmark = pytest.mark.slow

SMALL_RUN = [
    "training.warmup_steps=5", "training.prompts_per_step=4", "generation.prompts_per_chunk=2",
    "env.eval_prompts=0", "lag.max_lag=1", "dask.n_workers=1",
]  # fmt: skip


class BrokenTrainingEnv(CopyEnv):
    """Plays held-out prompts but raises on every training prompt: generation fails for good."""

    def step(self, action):
        if self.prompt.prompt_id.startswith("train"):
            raise RuntimeError("environment bug")
        return super().step(action)


def test_a_generation_side_that_fails_for_good_fails_the_run_instead_of_hanging(tmp_path: Path):
    command = [sys.executable, "-m", "flows.pipeline", str(TINY_CONFIG), f"storage.root=file://{tmp_path}", "run_id=broken",
               "env.entrypoint=tests.test_recovery:BrokenTrainingEnv", "env.kwargs={}", "env.max_turns=1", "training.steps=3", *SMALL_RUN]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=os.environ | {"PREFECT_SERVER_ANALYTICS_ENABLED": "false"})  # fmt: skip
    assert done.returncode != 0
    assert "environment bug" in (tmp_path / "broken" / "lag" / "stop.json").read_text()
    assert "GenerationStopped" in done.stdout + done.stderr


def test_a_trainer_that_fails_marks_itself_done_so_that_generators_stop(tmp_path: Path):
    """Generators wait for a trainer that is not done; one that died without saying so would
    keep them (and their engines) waiting for good."""
    config = load_config(TINY_CONFIG, [f"storage.root=file://{tmp_path}", "run_id=lost-trainer", "training.warmup_steps=0"])
    store = initialize_run(config)
    weights = tmp_path / "lost-trainer" / "weights" / "v00000000" / "model.safetensors"
    damaged = bytearray(weights.read_bytes())
    damaged[-1] ^= 0xFF
    weights.write_bytes(bytes(damaged))
    assert not read_trainer_state(store).done
    with pytest.raises(ManifestError):
        training.fn(config)
    assert read_trainer_state(store).done


def test_a_trainer_and_a_generator_whose_pipeline_is_gone_stop_by_themselves(tmp_path: Path, monkeypatch):
    """A deployed parent that died with its machine, or gave up with the Prefect API away, cannot
    cancel its children: each stops on its own once the lease claim it was given is gone, rather
    than hold its GPUs for good. Each runs alone here, so that nothing else could stop it: the
    trainer waits for data nobody makes, the generator for a trainer that never comes."""
    from prefect.testing.utilities import prefect_test_harness

    monkeypatch.setattr("tasks.lease.WATCH_SECONDS", 0.5)
    config = load_config(TINY_CONFIG, [f"storage.root=file://{tmp_path}", "run_id=orphans", *SMALL_RUN])
    store = initialize_run(config)
    outcome = {}

    def pipeline_until(done: threading.Event) -> None:
        """The pipeline's renewals (a record that was never renewed would lapse instead), until
        `done`; then what its end does: it releases the run."""
        while not done.wait(0.5):
            store.write_atomic(lease_key(1), json.dumps({"holder": "gone (1)", "claim": "c1", "where": ["elsewhere", "", ""], "pid": 1, "at": time.time()}).encode())
        store.delete(lease_key(1))

    with prefect_test_harness():
        ended = threading.Event()
        threading.Thread(target=pipeline_until, args=(ended,), daemon=True).start()
        threading.Timer(8.0, ended.set).start()
        with pytest.raises(GenerationStopped, match="the pipeline that started this run no longer holds"):
            training(config, "c1")
        assert read_trainer_state(store).done and read_trainer_state(store).version == 0

        reopen_run(store, 0)
        ended = threading.Event()
        threading.Thread(target=pipeline_until, args=(ended,), daemon=True).start()
        generator = threading.Thread(target=lambda: outcome.update(generation(config, "gen0", "c1")))
        generator.start()
        deadline = time.monotonic() + 180
        while len(list_shards(store)) < config.training.prompts_per_step:  # the lag window's first batch
            assert generator.is_alive() and time.monotonic() < deadline, f"no first batch: {outcome}"
            time.sleep(0.2)
        ended.set()
        generator.join(timeout=120)
    assert not generator.is_alive() and not read_trainer_state(store).done
    assert "no longer holds" in outcome["pipeline_gone"]


class _AdmittingLearner:
    """What `admit_batch` calls of a Learner: its admission, failing as told first."""

    def __init__(self, failures: list[Exception]):
        self.failures, self.calls = failures, 0

    def admit_batch(self, should_stop):
        self.calls += 1
        if self.failures:
            raise self.failures.pop(0)
        return {"rollouts/v00000000/gen0-000000.parquet": None}


class _SteppingLearner(_AdmittingLearner):
    """What `train_step` calls of a Learner: its step, failing as told first."""

    def train_step(self, shards, before_publish):
        self.calls += 1
        if self.failures:
            raise self.failures.pop(0)
        return {"version": 1}


class _HeldRun:
    def gone(self, now: bool = False) -> None:
        return None


def test_admission_is_tried_again_after_a_storage_outage_and_not_after_a_stop():
    """The trainer spends most of its time in admission: a storage outage longer than
    storage.retry_seconds failed the whole training run there, though admitting again is safe."""
    from prefect import flow
    from prefect.testing.utilities import prefect_test_harness

    from flows.training import admit_batch
    from infra.storage import StorageUnavailable

    admit = admit_batch.with_options(retry_delay_seconds=0)

    @flow(validate_parameters=False)
    def admission(learner: _AdmittingLearner) -> dict:
        return admit(learner, _HeldRun())

    with prefect_test_harness():
        outage = _AdmittingLearner([StorageUnavailable("down for 30 s"), StorageUnavailable("down for 30 s")])
        assert list(admission(outage)) == ["rollouts/v00000000/gen0-000000.parquet"] and outage.calls == 3
        stopped = _AdmittingLearner([GenerationStopped("the run was asked to stop")])
        with pytest.raises(GenerationStopped):
            admission(stopped)
        assert stopped.calls == 1, "a stop is not retried"


def test_a_step_is_tried_again_after_a_storage_outage_and_not_after_any_other_error():
    """A step whose publish met an outage finishes on its retry; anything else (the pipeline
    gone, out of memory, a bug) was retried too, two seconds later, to fail the same way."""
    from prefect import flow
    from prefect.testing.utilities import prefect_test_harness

    from flows.training import train_step
    from infra.storage import StorageUnavailable

    step = train_step.with_options(retry_delay_seconds=0)

    @flow(validate_parameters=False)
    def stepping(learner: _SteppingLearner) -> dict:
        return step(learner, {}, _HeldRun())

    with prefect_test_harness():
        outage = _SteppingLearner([StorageUnavailable("down for 30 s")])
        assert stepping(outage) == {"version": 1} and outage.calls == 2
        for failure in (GenerationStopped("the pipeline gave the run up"), RuntimeError("CUDA out of memory")):
            failed = _SteppingLearner([failure])
            with pytest.raises(type(failure)):
                stepping(failed)
            assert failed.calls == 1, f"{failure!r} is not retried"


def test_a_retiring_generator_makes_again_a_group_aborted_in_a_chunk_still_in_flight(tmp_path: Path):
    """Asked to retire (a scale-down), a generator claims nothing more and finishes its chunks in
    flight. A group aborted in one of them (an operator's abort, an engine's) is made again before
    it leaves: it left at once, and the slot it had claimed held admission capacity for good (at
    max_lag 0, a batch one group short). Sim engines with slow decode steps keep the chunks in
    flight for seconds, long after the generator has seen the retire."""
    import httpx
    from prefect.testing.utilities import prefect_test_harness

    from infra.ports import free_port_block
    from tasks.lag import SlotClaims, request_retire
    from tasks.metrics import read_metrics
    from tasks.shards import committed_slots

    port = free_port_block()
    config = load_config(TINY_CONFIG, [f"storage.root=file://{tmp_path}", "run_id=retiring", *SMALL_RUN, "engine.backend=sim",
                                       f"engine.base_port={port}", "engine.sim.decode_base_s=0.3"])  # fmt: skip
    store = initialize_run(config)
    done, outcome = threading.Event(), {}

    def pipeline_holds_the_run() -> None:
        while not done.wait(0.5):
            store.write_atomic(lease_key(1), json.dumps({"holder": "test (1)", "claim": "c1", "where": ["elsewhere", "", ""], "pid": 1, "at": time.time()}).encode())

    with prefect_test_harness():
        threading.Thread(target=pipeline_holds_the_run, daemon=True).start()
        generator = threading.Thread(target=lambda: outcome.update(generation(config, "gen0", "c1")))
        generator.start()
        deadline = time.monotonic() + 120
        while not SlotClaims(store, "gen0", config.training.prompts_per_step).claims() and time.monotonic() < deadline:
            time.sleep(0.2)
        request_retire(store, "gen0")
        retired_at, engine = time.monotonic(), f"http://127.0.0.1:{port}"
        while time.monotonic() < deadline and (time.monotonic() - retired_at < 2.0 or not _decoding(engine)):
            time.sleep(0.1)  # it looks once a second: it has seen the retire when its chunks decode
        assert httpx.post(f"{engine}/abort_request", json={"abort_all": True}, timeout=10).status_code == 200
        generator.join(timeout=180)
        done.set()
    assert not generator.is_alive() and outcome.get("retired")
    claimed = SlotClaims(store, "gen0", config.training.prompts_per_step).claims()
    assert claimed and set(claimed) <= set(committed_slots(store)), "every slot it claimed is committed"
    assert [r for r in read_metrics(store, "generator-gen0") if r["event"] == "groups_aborted"], "the abort met a group"


def _decoding(engine: str) -> bool:
    """Whether the engine at `engine` has sequences running (False while it does not answer yet)."""
    import httpx

    try:
        return httpx.get(f"{engine}/server_info", timeout=5).json()["num_running"] > 0
    except httpx.HTTPError:
        return False
