"""A group's fate when training ends under it: generate_group against a real (simulated) engine;
how two generators share the slots the lag bound admits; and work started while the engines
load newer weights, which must wait for them without holding the load up.

A finished run aborts its engines' requests instead of waiting for groups nobody will train;
those groups must not be committed half-played, and a group that starts after the end must not
start at all. A group left alone commits, so that the other two tests can fail.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from configs import TINY_CONFIG, load_config
from infra.engines.fleet import EngineFleet
from infra.storage import open_run_store
from tasks.generator import Generator, snapshot_dir_for_engines
from tasks.lag import TrainerState, admission_capacity, publish_trainer_state
from tasks.rundir import initialize_run
from tasks.envs.arithmetic import AdditionEnv
from tasks.failed_groups import failed_group_slots, set_aside_group
from tasks.shards import committed_slots, list_shards, quarantined_keys, write_shard
from tasks.worker import generate_group
from tests.test_shards import make_rollouts
from tasks.snapshots import (
    FETCH_PIN_SECONDS, LATEST_KEY, PINS, load_snapshot, publish_snapshot_dir, snapshot_prefix, withdraw_after,
)  # fmt: skip

pytestmark = pytest.mark.slow  # every test starts an engine

SLOW_SIM = '{"decode_base_s": 0.05, "decode_s_per_seq": 0.0, "length_median": 30, "length_sigma": 0.1, "load_s_per_gb": 500}'
"""About 30 decode steps of 50 ms: a group plays for ~1.5 s, long enough to abort it mid-way;
a weight load of the tiny model (2 MB) takes ~1 s, long enough to start work during it."""


@pytest.fixture
def generator(tmp_path: Path):
    config = load_config(TINY_CONFIG, [
        f"storage.root=file://{tmp_path / 'runs'}", "run_id=fate", "engine.backend=sim", f"engine.sim={SLOW_SIM}",
        "generation.max_new_tokens=40", "generation.samples_per_prompt=2", "env.max_turns=1",
        "env.entrypoint=tasks.envs.arithmetic:AdditionEnv", "env.kwargs={}", "model.max_position_embeddings=128",
        "training.warmup_steps=0",
    ])  # fmt: skip
    initialize_run(config)
    model_dir, version = snapshot_dir_for_engines(config, tmp_path / "cache", "gen0")
    with EngineFleet(config.engine, 1, model_dir, version, tmp_path / "logs") as fleet:
        yield Generator(config, "gen0", fleet, tmp_path / "cache"), open_run_store(config.storage, config.run_id)


def test_a_group_left_alone_commits_its_shard(generator):
    gen, store = generator
    result = generate_group(gen.spec(0))
    assert result is not None and result.samples == 2
    assert list_shards(store) == [result.key]


def test_a_group_s_requests_wait_for_an_engine_as_long_as_its_restart_may_take(generator):
    """One engine (the default) that crashes: its requests wait while the generator starts it
    again. With the client's 60 s, a chunk and its two retries failed within an SGLang restart
    (up to 15 min) and the run stopped."""
    gen, _ = generator
    assert gen.spec(0).retry_seconds >= gen.fleet.restart_seconds == gen.fleet.processes[0].start_timeout


def engine_info(gen: Generator) -> dict:
    return httpx.get(gen.fleet.urls[0] + "/server_info", timeout=10).json()


def wait_for_engine(gen: Generator, ready, what: str) -> None:
    """Poll the engine's /server_info until `ready(info)`: requests have reached it."""
    deadline = time.monotonic() + 30
    while not ready(engine_info(gen)):
        assert time.monotonic() < deadline, f"waited 30 s for {what}"
        time.sleep(0.02)


def test_a_group_that_starts_after_training_finished_does_not_play(generator):
    gen, store = generator
    publish_trainer_state(store, TrainerState(version=1, done=True))
    before = engine_info(gen)["tokens_generated"]
    assert generate_group(gen.spec(0)) is None
    assert engine_info(gen)["tokens_generated"] == before, "the group sent requests"
    assert list_shards(store) == []


def test_a_group_whose_requests_are_aborted_is_not_committed_and_is_generated_again(generator):
    gen, store = generator
    (spec,) = gen.claim_specs(1)
    results = []
    playing = threading.Thread(target=lambda: results.append(generate_group(spec)))
    playing.start()
    wait_for_engine(gen, lambda info: info["num_running"] >= 1, "the group's requests to run")
    gen.fleet.abort_all()
    playing.join(timeout=30)
    assert results == [None]
    assert list_shards(store) == []
    assert gen.requeue_unfinished([spec.slot], []) == ([spec.slot], [])  # its slot is claimed: nobody else would make it
    (again,) = gen.claim_specs(1)
    assert again.slot == spec.slot
    assert generate_group(again) is not None and len(list_shards(store)) == 1
    tries = [gen.requeue_unfinished([9], []) for _ in range(4)]
    assert [requeued for requeued, _ in tries] == [[9], [9], [9], []], "an abort every try meets: given up"
    (key,) = failed_group_slots(store).values()  # set aside: the trainer counts it lost, and another group takes its place
    (failed,) = tries[-1][1]  # counted by the flow as a failed group, toward FAILED_GROUPS_IN_A_ROW_LIMIT
    assert (failed.slot, failed.key, failed.samples) == (9, key, 0) and "aborted 4 times" in failed.failure
    record = json.loads(store.read_bytes(key))
    assert (record["slot"], record["producer"], record["prompt_id"]) == (9, gen.producer, gen.prompts[9 % len(gen.prompts)].prompt_id)
    assert record["error"] == failed.failure
    assert [gen.requeue_unfinished([spec.slot], []) for _ in range(4)][-1] == ([], [])
    assert set(failed_group_slots(store)) == {9}, "a slot a concurrent try committed stands"
    publish_trainer_state(store, TrainerState(version=0, done=True))
    assert gen.requeue_unfinished([7], []) == ([], [])  # a finished run's aborted groups stay for a continued run


def test_a_generator_takes_its_share_of_the_window_and_leaves_the_rest_to_the_others(generator):
    gen0, _ = generator
    gen1 = Generator(gen0.config, "gen1", gen0.fleet, gen0.cache_dir)
    window = admission_capacity(0, gen0.config.lag.max_lag, gen0.config.training.prompts_per_step)
    first = gen0.claim_specs(most=window, producers=2)
    assert len(first) == window // 2 and not gen0.claim_specs(most=window, held=len(first), producers=2)
    second = gen1.claim_specs(most=window, producers=2)
    assert {s.slot for s in first} | {s.slot for s in second} == set(range(window))
    assert gen0.claim_specs(most=window, held=0, producers=2) == [], "the window is full"


def _publish_v1(gen: Generator, store) -> None:
    """The trainer's step 1: snapshot v1 committed (the v0 weights again) and its state at 1."""
    publish_snapshot_dir(store, gen.fleet.model_dir, 1)
    publish_trainer_state(store, TrainerState(version=1))


def test_work_started_during_a_load_waits_in_the_paused_engines_and_runs_on_the_new_weights(generator):
    gen, store = generator
    gen.claim_specs(most=10**6)  # everything version 0 admits: what is left needs version 1
    _publish_v1(gen, store)
    seen, results = {}, []

    def start_work() -> None:
        seen["paused"] = httpx.get(gen.fleet.urls[0] + "/server_info", timeout=10).json()["paused"]
        seen["specs"] = gen.claim_specs(most=1)
        seen["group"] = threading.Thread(target=lambda: results.append(generate_group(seen["specs"][0])))
        seen["group"].start()
        wait_for_engine(gen, lambda info: info["num_waiting"] >= 1, "the group's requests to wait in the paused engine")

    timings = gen.refresh_weights(while_loading=start_work)
    assert timings is not None and timings["load_seconds"] > 0.5
    assert seen["paused"] is True, "work was started before the engines were paused"
    assert [s.loaded_version for s in seen["specs"]] == [1], "work started during the load names the new version"
    seen["group"].join(timeout=30)
    assert results[0] is not None and results[0].policy_version == 1
    assert gen.loaded_version == 1 and gen.fleet.version == 1


def test_a_retried_group_finds_its_commit_from_an_engine_that_failed_a_load(generator, tmp_path):
    """The engine refused v1 and played the group on v0, which the shard's key says; the retry,
    on the engine now loaded, must find that commit rather than commit the slot again as v1."""
    gen, store = generator
    _publish_v1(gen, store)
    v0_weights = gen.fleet.model_dir
    assert not gen.fleet.update_weights(tmp_path / "missing", 1)[0].ok
    assert gen.fleet.version == 1 and gen.fleet.engine_versions == [0]
    assert gen.loaded_version == 0, "admission counts the weights an engine serves, not a version none loaded"
    spec = gen.spec(0)
    first = generate_group(spec)
    assert first is not None and first.policy_version == 0 and first.created
    assert gen.fleet.update_weights(v0_weights, 1)[0].ok and gen.fleet.engine_versions == [1]
    retried = generate_group(spec)
    assert retried is not None and retried.key == first.key and not retried.created
    assert list_shards(store) == [first.key]


def test_the_load_runs_while_the_work_that_needs_it_starts(generator):
    """A start slower than the load (a Prefect task run can be) must not add to it."""
    gen, store = generator
    _publish_v1(gen, store)
    versions = []

    def slow_start() -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and "1" not in versions:
            versions.append(httpx.get(gen.fleet.urls[0] + "/server_info", timeout=10).json()["weight_version"])
            time.sleep(0.1)

    gen.refresh_weights(while_loading=slow_start)
    assert versions[0] == "0" and versions[-1] == "1", "the engine loaded the new weights only after the start"


def test_no_work_starts_during_a_load_that_an_engine_did_not_pause_for(generator):
    gen, store = generator
    _publish_v1(gen, store)
    gen.fleet.processes[0].stop()  # it cannot confirm a pause, so it could serve old weights
    started = []
    assert gen.refresh_weights(while_loading=lambda: started.append(gen.loaded_version))
    assert started == []


def test_a_load_leaves_only_the_loaded_version_on_local_disk(generator):
    """A generator that kept each version it loaded would hold a full copy of a real model per
    published step on its machine's disk."""
    gen, store = generator
    _publish_v1(gen, store)
    assert gen.refresh_weights()
    assert sorted(p.name for p in (gen.cache_dir / "weights").iterdir()) == ["v00000001"]
    gen.fleet.processes[0].stop()
    assert gen.fleet.restart_dead() == gen.fleet.urls, "an engine that died restarts on the version kept"
    assert httpx.get(gen.fleet.urls[0] + "/server_info", timeout=10).json()["weight_version"] == "1"


def test_a_generators_pin_lapses_and_its_engines_restart_without_the_stored_copy(generator):
    """A generator killed before it unpinned (SIGKILL, a lost machine) kept its version in storage
    for good. The pin needs only outlive the fetch: it lapses, and an engine that dies after
    retention removed the version restarts from the generator's local copy."""
    gen, store = generator
    _publish_v1(gen, store)
    assert gen.refresh_weights()
    pin = json.loads(store.read_bytes(f"{PINS}/gen0.json"))
    assert pin["version"] == 1 and FETCH_PIN_SECONDS - 60 < pin["lapses_at"] - time.time() <= FETCH_PIN_SECONDS
    store.delete_prefix(snapshot_prefix(1))  # as retention may, once the pin has lapsed
    gen.fleet.processes[0].stop()
    assert gen.fleet.restart_dead() == gen.fleet.urls
    assert httpx.get(gen.fleet.urls[0] + "/server_info", timeout=10).json()["weight_version"] == "1"


def test_engines_follow_latest_back_when_a_resumed_trainer_withdraws_their_version(generator):
    """A trainer resumed from its checkpoint at v0 withdrew v1, which the engines serve: they load
    v0 again rather than go on generating on weights no trainer has."""
    gen, store = generator
    _publish_v1(gen, store)
    assert gen.refresh_weights() and gen.fleet.version == 1
    assert withdraw_after(store, 0) == [1]
    assert gen.refresh_weights() and gen.fleet.version == gen.loaded_version == 0
    assert engine_info(gen)["weight_version"] == "0"
    assert gen.refresh_weights() is None, "then nothing to load until LATEST moves"


def test_a_snapshot_withdrawn_while_it_is_fetched_is_not_refused_for_good(generator):
    """LATEST named v1 when the generator read it, and v1 was withdrawn before the fetch: the load
    fails, and the generator reads LATEST again rather than refuse the number, which the resumed
    trainer publishes again."""
    gen, store = generator
    store.write_atomic(LATEST_KEY, b'{"version": 1}')  # read before the withdrawal deleted v1
    assert gen.refresh_weights() is None and gen.fleet.version == 0 and not gen.rejected_snapshots
    _publish_v1(gen, store)
    assert gen.refresh_weights() and gen.fleet.version == 1


def test_a_snapshot_damaged_after_its_commit_is_reported_and_tried_again_once_committed_anew(generator, monkeypatch):
    from tasks.generator import SnapshotRejected
    from tasks.snapshots import _delete_snapshot, manifest_digest, rejection_reports

    gen, store = generator
    v0_weights = gen.fleet.model_dir
    _publish_v1(gen, store)
    damaged = store.local_path(f"{snapshot_prefix(1)}/model.safetensors")
    damaged.write_bytes(damaged.read_bytes()[:-8])
    with pytest.raises(SnapshotRejected):
        gen.refresh_weights()
    [report] = rejection_reports(store).values()
    assert report["version"] == 1 and report["manifest"] == manifest_digest(store, 1)
    monkeypatch.setattr("tasks.generator.REJECTION_RECHECK_SECONDS", 0.0)
    assert gen.refresh_weights() is None and gen.fleet.version == 0, "the same commit is not fetched again"
    _delete_snapshot(store, 1)  # what the trainer's recommit_snapshot does
    publish_snapshot_dir(store, v0_weights, 1, replaces=report["manifest"])
    assert gen.refresh_weights() and gen.fleet.version == 1 and not gen.rejected_snapshots


def test_an_engine_that_failed_a_load_is_loaded_again(generator, monkeypatch):
    """It served the older weights until the next snapshot, whose groups the lag bound may drop;
    where no newer snapshot comes, for good."""
    gen, store = generator
    _publish_v1(gen, store)
    assert gen.refresh_weights() and gen.fleet.engine_versions == [1]
    v0 = load_snapshot(store, gen.cache_dir / "v0-again", 0)  # the engine back on v0, as if it had failed the load:
    assert httpx.post(gen.fleet.urls[0] + "/update_weights_from_disk", json={"model_path": str(v0), "weight_version": "0"},
                      timeout=30).json()["success"]  # fmt: skip
    gen.fleet.engine_versions[0] = 0  # as the fleet records a failed load,
    gen._reloaded_at = time.monotonic()  # and refresh_weights the failure
    assert gen.refresh_weights() is None and gen.fleet.engine_versions == [0], "not before RELOAD_RETRY_SECONDS"
    monkeypatch.setattr("tasks.generator.RELOAD_RETRY_SECONDS", 0.0)
    assert gen.refresh_weights() is None, "nothing new to fetch"
    assert gen.fleet.engine_versions == [1] and engine_info(gen)["weight_version"] == "1"


class BrokenToolEnv(AdditionEnv):
    """AdditionEnv whose tool is down: every step raises."""

    def step(self, action: str):
        raise ConnectionError("tool server refused the connection")


def test_a_group_its_environment_fails_is_set_aside_with_its_traceback_and_not_played_again(generator):
    """Before, the error failed the chunk three times and then the run, naming neither the
    environment nor the prompt, and a flaky tool could end a run hours in."""
    gen, store = generator
    (claimed,) = gen.claim_specs(1)
    spec = dataclasses.replace(claimed, env_entrypoint="tests.test_generator:BrokenToolEnv")
    result = generate_group(spec)
    assert result.failure.startswith(f"BrokenToolEnv.step on prompt {spec.prompt.prompt_id} raised ConnectionError")
    assert list_shards(store) == [] and quarantined_keys(store) == set() and committed_slots(store) == {}
    assert failed_group_slots(store) == {spec.slot: result.key}
    record = json.loads(store.read_bytes(result.key))
    assert (record["prompt_id"], record["producer"]) == (spec.prompt.prompt_id, "gen0") and "ConnectionError" in record["traceback"]
    retried = generate_group(spec)  # its chunk failed for another reason and runs again
    assert (retried.key, retried.created) == (result.key, False) and "another try" in retried.failure
    restarted = Generator(gen.config, "gen0", gen.fleet, gen.cache_dir)
    assert (restarted.orphans, restarted.committed_at_start) == ([], {}), (
        "the slot is spent, not an orphan to play again, nor a committed group to record with samples"
    )


@pytest.mark.parametrize("other_try", ["set it aside", "committed it"])
def test_a_group_another_try_finished_while_it_played_is_neither_committed_nor_set_aside_again(generator, other_try):
    """A failed chunk is retried while its other groups still play, so two tries of one group can
    run at once. Had one committed and the other set aside, the slot was trained and counted lost,
    admitting a group past the window."""
    gen, store = generator
    (spec,) = gen.claim_specs(1)
    if other_try == "committed it":  # this try's environment fails; the other try's did not
        spec = dataclasses.replace(spec, env_entrypoint="tests.test_generator:BrokenToolEnv")
    results = []
    playing = threading.Thread(target=lambda: results.append(generate_group(spec)))
    playing.start()
    time.sleep(0.5)  # its first turn decodes for about 1.5 s
    if other_try == "set it aside":
        set_aside_group(store, spec.slot, {"error": "the other try's environment failed"})
    else:
        write_shard(store, make_rollouts(n=2, version=spec.loaded_version), "gen0", spec.slot)
    playing.join(timeout=30)
    (result,) = results
    assert result.created is False
    if other_try == "set it aside":
        assert list_shards(store) == [] and "another try" in result.failure
    else:
        assert failed_group_slots(store) == {} and result.failure is None and list_shards(store) == [result.key]
