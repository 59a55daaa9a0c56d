"""Lag control: a property test over random generation and training speeds, plus unit cases.

The simulation runs the real admission rule, slot claims (on a memory:// run directory) and batch
selection against generators and a trainer whose speeds hypothesis draws, tick by tick.
"""

from __future__ import annotations

import itertools
import json
import time
from collections import Counter
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from configs.sections import StorageConfig
from flows.generation import InFlightReport, _Chunk
from infra.storage import open_run_store
from tasks.lag import (
    Candidate, SlotClaims, adopt_orphaned_claims, admission_capacity, slot_key, claim_share, groups_in_flight, lag_of, live_producers, publish_in_flight,
    recheck_after_restart, select_batch, IN_FLIGHT_PREFIX, IN_FLIGHT_TTL_SECONDS, waits_for_last_chance, withdraw_in_flight,
)  # fmt: skip
from tasks.failed_groups import set_aside_group, spent_slots
from tasks.shards import committed_slots, quarantine_shard, shard_key, write_shard
from tests.test_shards import make_rollouts

RUNS = itertools.count()


def simulate(max_lag: int, per_step: int, steps: int, generator_speeds: list[list[int]], train_ticks: int,
             last_chance_first: bool = True, quarantine_every: int = 0) -> dict:
    """Generators claim slots and finish groups after their drawn durations; the trainer takes a
    batch whenever select_batch gives one and (with `last_chance_first`) waits_for_last_chance
    does not hold it back. With `quarantine_every` k, every k-th slot's shard is bad: the trainer
    finds out when a batch it picks holds it, quarantines it (a lost group, as a stale one is,
    which generators learn of at once) and picks again. Returns every trained lag and the group
    counts."""
    store = open_run_store(StorageConfig(root="memory://lag-sim"), f"run{next(RUNS)}")
    claims = [SlotClaims(store, f"gen{i}", per_step) for i in range(len(generator_speeds))]
    version, latest, lost, trainer_free_at = 0, 0, 0, 0
    busy: dict[int, tuple[int, int, int]] = {}  # generator -> (finishes at, slot, policy version)
    finished: list[Candidate] = []
    trained_lags, generated, stale_count, quarantined = [], 0, 0, 0
    training = False
    for tick in range(10_000):
        if training and tick >= trainer_free_at:  # the step ends: a new version is published
            training, version = False, version + 1
            latest = version
        if not training and version < steps:
            batch, stale = select_batch(finished, version, max_lag, per_step)
            for c in stale:
                finished.remove(c)
            stale_count += len(stale)
            lost += len(stale)
            in_flight = lambda: Counter(made_by for _, _, made_by in busy.values())  # noqa: E731
            if batch and last_chance_first and waits_for_last_chance(batch, version, max_lag, in_flight):
                batch = []
            if bad := [c for c in batch if c.key.startswith("bad")]:
                for c in bad:
                    finished.remove(c)
                quarantined, lost, batch = quarantined + len(bad), lost + len(bad), []
            if batch:
                trained_lags += [lag_of(version, c.policy_version) for c in batch]
                for c in batch:
                    finished.remove(c)
                training, trainer_free_at = True, tick + train_ticks
        if version >= steps:
            break
        for g, speeds in enumerate(generator_speeds):
            if g in busy and busy[g][0] <= tick:
                _, slot, made_by = busy.pop(g)
                generated += 1
                bad = quarantine_every and slot % quarantine_every == quarantine_every - 1
                finished.append(Candidate(f"{'bad' if bad else 's'}{slot:08d}", made_by))
            if g not in busy:  # what the generator's claim_specs allows on the weights it holds
                slot = claims[g].claim(admission_capacity(min(version, latest), max_lag, per_step, lost))
                if slot is not None:
                    busy[g] = (tick + speeds[slot % len(speeds)], slot, latest)
    return {"version": version, "lags": trained_lags, "generated": generated, "trained": len(trained_lags),
            "stale": stale_count, "quarantined": quarantined, "pending": len(finished)}  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(
    max_lag=st.integers(0, 4),
    per_step=st.integers(1, 4),
    steps=st.integers(1, 6),
    generator_speeds=st.lists(st.lists(st.integers(1, 12), min_size=1, max_size=5), min_size=1, max_size=3),
    train_ticks=st.integers(1, 10),
    quarantine_every=st.sampled_from([0, 2, 3, 7]),
    last_chance_first=st.booleans(),
)
def test_no_trained_group_exceeds_max_lag_and_every_group_is_accounted_for(
    max_lag, per_step, steps, generator_speeds, train_ticks, quarantine_every, last_chance_first
):
    """Also with groups lost (quarantined, or dropped stale when the trainer does not wait for
    last-chance groups): the capacity they give back is claimable, so the run never stalls."""
    result = simulate(max_lag, per_step, steps, generator_speeds, train_ticks, last_chance_first, quarantine_every)
    assert result["version"] == steps, "the run stalled before training every step"
    assert all(0 <= lag <= max_lag for lag in result["lags"])
    assert result["generated"] == result["trained"] + result["stale"] + result["quarantined"] + result["pending"]
    if max_lag == 0:
        assert set(result["lags"]) == {0}, "max_lag 0 must train on-policy samples only"


def test_last_chance_groups_in_flight_are_waited_for_instead_of_going_stale():
    """One slow group in four, generation slower than training: taking the younger groups that
    are ready first sends the slow old ones past the bound every step; waiting for them does not."""
    speeds, run = [[3, 3, 3, 14]] * 4, dict(max_lag=1, per_step=4, steps=6, train_ticks=2)
    eager = simulate(**run, generator_speeds=speeds, last_chance_first=False)
    patient = simulate(**run, generator_speeds=speeds)
    assert eager["stale"] > 0
    assert patient["stale"] == 0 and patient["version"] == 6


def test_a_batch_of_younger_groups_waits_only_for_last_chance_groups_in_flight():
    asked = []

    def in_flight(groups):
        return lambda: asked.append(True) or groups

    young, old = [Candidate("y", 4)], [Candidate("o", 3)]
    assert waits_for_last_chance(young, trainer_version=4, max_lag=1, in_flight=in_flight({3: 2}))
    assert not waits_for_last_chance(young, 4, 1, in_flight({4: 5, 2: 1})), "only version V - max_lag is last chance"
    asked.clear()
    assert not waits_for_last_chance(old, 4, 1, in_flight({3: 2})) and not asked, "all last-chance: no storage read"
    assert not waits_for_last_chance(young, 4, 0, in_flight({4: 2})) and not asked, "max_lag 0: every group is last chance"


def test_in_flight_records_add_up_over_live_generators_and_ignore_dead_ones(file_store, monkeypatch):
    publish_in_flight(file_store, "gen0", {3: 2, 4: 8})
    publish_in_flight(file_store, "gen1", {3: 1, 5: 0})
    assert groups_in_flight(file_store) == {3: 3, 4: 8}
    withdraw_in_flight(file_store, "gen1")
    assert groups_in_flight(file_store) == {3: 2, 4: 8}
    later = time.time() + IN_FLIGHT_TTL_SECONDS + 1
    monkeypatch.setattr(time, "time", lambda: later)
    assert groups_in_flight(file_store) == {}, "a record older than its lifetime is a dead generator's"


def test_a_generators_in_flight_record_stays_fresh_while_its_loop_is_held_up(file_store):
    """The record is refreshed by a thread: a weight load or engine restart longer than the
    record's lifetime must not make a generator with groups in flight look dead, and a chunk that
    finishes meanwhile leaves the count, though the held-up loop has not taken it off yet."""
    def published_at() -> float:
        return json.loads(file_store.read_bytes(f"{IN_FLIGHT_PREFIX}/gen0.json"))["at"]

    running, finishing = Future(), Future()
    chunks = [_Chunk(SimpleNamespace(wrapped_future=running), version=3, slots=[0, 1]),
              _Chunk(SimpleNamespace(wrapped_future=finishing), version=4, slots=[2, 3, 4, 5, 6])]  # fmt: skip
    with InFlightReport(file_store, "gen0", chunks, refresh_seconds=0.05) as report:
        report.maybe_publish()
        first = published_at()
        assert groups_in_flight(file_store) == {3: 2, 4: 5}
        finishing.set_result(None)
        time.sleep(0.3)  # the loop held up: no maybe_publish
        assert published_at() > first, "refreshed without the loop"
        assert groups_in_flight(file_store) == {3: 2}
        report.withdraw()
    time.sleep(0.2)
    assert not file_store.exists(f"{IN_FLIGHT_PREFIX}/gen0.json"), "no refresh brings a withdrawn record back"


def test_a_generator_that_fails_withdraws_its_in_flight_record(file_store):
    chunks = [_Chunk(SimpleNamespace(wrapped_future=Future()), version=3, slots=[0, 1])]
    with pytest.raises(RuntimeError, match="engine died"), InFlightReport(file_store, "gen0", chunks) as report:
        report.maybe_publish()
        assert live_producers(file_store) == {"gen0"}
        raise RuntimeError("engine died")
    assert live_producers(file_store) == set() and groups_in_flight(file_store) == {}

    publish_in_flight(file_store, "gen0", {5: 2})  # a successor's generator of this name owns the record now
    with pytest.raises(RuntimeError), InFlightReport(file_store, "gen0", chunks) as report:
        report.stop()  # what the flow does when a successor holds the run
        raise RuntimeError("storage went away")
    assert groups_in_flight(file_store) == {5: 2}, "the successor's record stays"


def test_live_producers_are_the_generators_with_a_fresh_in_flight_record(file_store, monkeypatch):
    publish_in_flight(file_store, "gen0", {3: 2})
    publish_in_flight(file_store, "gen1", {})
    assert live_producers(file_store) == {"gen0", "gen1"}, "a generator with nothing in flight yet is still live"
    withdraw_in_flight(file_store, "gen0")
    assert live_producers(file_store) == {"gen1"}
    later = time.time() + IN_FLIGHT_TTL_SECONDS + 1
    monkeypatch.setattr(time, "time", lambda: later)
    assert live_producers(file_store) == set()


def test_claim_shares_cover_the_admission_window():
    for max_lag, per_step, producers in [(0, 4, 1), (1, 4, 2), (2, 4, 3), (1, 3, 4), (0, 1, 5)]:
        window = admission_capacity(0, max_lag, per_step)
        share = claim_share(max_lag, per_step, producers)
        assert share >= 1 and share * producers >= window > (share - 1) * producers
    assert claim_share(1, 4, 1) == 8, "a lone generator may fill the whole window"


@pytest.mark.parametrize("max_lag, lost_every", [(0, 40), (2, 16)])
def test_a_long_run_that_keeps_losing_groups_does_not_stall(max_lag: int, lost_every: int):
    """Before, the capacity that lost groups give back needed weights one version too new to be
    claimed: at max_lag 0 one quarantined shard, at max_lag 2 one group in 16 lost (the 33rd)
    left the trainer waiting for good."""
    result = simulate(max_lag, per_step=16, steps=60, generator_speeds=[[1]], train_ticks=1, quarantine_every=lost_every)
    assert result["version"] == 60 and result["quarantined"] > max_lag * 16


def test_select_batch_takes_the_oldest_trainable_and_reports_the_stale():
    candidates = [Candidate("a", 1), Candidate("b", 4), Candidate("c", 3), Candidate("d", 2)]
    batch, stale = select_batch(candidates, trainer_version=4, max_lag=2, groups_per_step=2)
    assert [c.key for c in batch] == ["d", "c"]
    assert [c.key for c in stale] == ["a"]
    assert select_batch(candidates, 4, 2, groups_per_step=4)[0] == [], "waits for a full batch"


def test_concurrent_claims_never_share_a_slot():
    store = open_run_store(StorageConfig(root="memory://lag-claims"), f"run{next(RUNS)}")
    first, second = SlotClaims(store, "gen0", 4), SlotClaims(store, "gen1", 4)
    got = [first.claim(6), second.claim(6), first.claim(6), second.claim(6), first.claim(6), second.claim(6)]
    assert sorted(got) == list(range(6))
    assert first.claim(6) is None and second.claim(6) is None
    late = SlotClaims(store, "gen2", 4)
    assert late.claim(8) == 6, "a generator that joins late starts after the existing claims"


def test_a_restarted_producer_finds_the_slots_it_claimed_but_never_committed(tmp_path):
    store = open_run_store(StorageConfig(root=f"file://{tmp_path}"), "run")
    mine, theirs = SlotClaims(store, "gen0", 4), SlotClaims(store, "gen1", 4)
    claimed = {name: [claims.claim(capacity=100) for _ in range(3)] for name, claims in (("gen0", mine), ("gen1", theirs))}
    committed, quarantined, in_flight = claimed["gen0"]
    write_shard(store, make_rollouts(version=0), "gen0", committed)
    bad = write_shard(store, make_rollouts(version=0), "gen0", quarantined).key
    quarantine_shard(store, bad, store.read_bytes(bad), "test")

    slots = committed_slots(store)
    assert slots == {committed: shard_key(0, "gen0", committed), quarantined: bad}, "quarantined groups count as committed"
    restarted = SlotClaims(store, "gen0", 4)
    assert restarted.claimed_by_me(exclude=set(slots)) == [in_flight], "only its own uncommitted claim"


def test_a_claim_whose_answer_was_lost_is_still_the_claimers(file_store):
    """The store retries a put whose response was lost; the retry finds the object the first
    attempt made and reports it taken. The claim reads it back and knows its own."""
    put_if_absent = file_store.put_if_absent

    def answer_lost(key: str, data: bytes) -> bool:
        put_if_absent(key, data)
        return False  # what the retry of a put that landed says

    mine, theirs = SlotClaims(file_store, "gen0", 4), SlotClaims(file_store, "gen1", 4)
    assert theirs.claim(capacity=10) == 0
    file_store.put_if_absent = answer_lost
    assert mine.claim(capacity=10) == 1, "slot 0 is taken indeed; slot 1 is this claim's"
    assert mine.claimed_by_me() == [1] and theirs.claimed_by_me() == [0]


def test_claims_of_producers_that_do_not_start_again_go_to_those_that_do(tmp_path):
    """A run that ends leaves its generators' last groups claimed and uncommitted. Continued with
    gen0 only, gen1's and gen2's would never be generated: the pipeline hands them to gen0, whose
    start then finds them among its orphans. Committed claims, set-aside ones and gen0's own stay
    as they were."""
    store = open_run_store(StorageConfig(root=f"file://{tmp_path}"), "run")
    claims = {name: SlotClaims(store, name, 4) for name in ("gen0", "gen1", "gen2")}
    claimed = {name: [c.claim(capacity=100) for _ in range(3)] for name, c in claims.items()}
    write_shard(store, make_rollouts(version=0, producer="gen1"), "gen1", claimed["gen1"][0])
    set_aside_group(store, claimed["gen2"][2], {"error": "the environment failed it"})  # spent: never played again
    orphans = sorted([*claimed["gen1"][1:], *claimed["gen2"][:2]])

    assert adopt_orphaned_claims(store, ["gen0"], 4) == {"gen0": orphans}
    restarted = SlotClaims(store, "gen0", 4)
    assert restarted.claimed_by_me(exclude=spent_slots(store)) == sorted([*claimed["gen0"], *orphans])
    assert SlotClaims(store, "gen1", 4).claimed_by_me() == [claimed["gen1"][0]], "its committed slot stays its own"
    assert adopt_orphaned_claims(store, ["gen0"], 4) == {"gen0": []}, "nothing left to hand over"

    store2 = open_run_store(StorageConfig(root=f"file://{tmp_path}"), "run2")
    for name in ("gen0", "gen1", "gen2"):
        SlotClaims(store2, name, 4).claim(capacity=100)
    assert adopt_orphaned_claims(store2, ["gen0", "gen1"], 4) == {"gen0": [2], "gen1": []}, "in turn, to those that start"
    with pytest.raises(ValueError, match="no producer"):
        adopt_orphaned_claims(store2, [], 4)


def test_a_claim_that_does_not_parse_and_a_superseded_generators_claims_are_handed_over(tmp_path):
    """A claim left empty by a power loss (put_if_absent does not fsync) stopped every generator's
    start; it is now nobody's, and handed over. So are the claims of a generator of an earlier
    pipeline still at work (its in-flight record fresh): it aborts its groups once it sees the
    lease change hands, and its claims, kept for it, held capacity nobody generated for good."""
    store = open_run_store(StorageConfig(root=f"file://{tmp_path}"), "run")
    for name in ("gen1", "gen2"):
        SlotClaims(store, name, 4).claim(capacity=100)
    store.write_atomic(slot_key(2, 4), b"")
    publish_in_flight(store, "gen2", {0: 1})
    assert SlotClaims(store, "gen0", 4).claimed_by_me() == []
    assert adopt_orphaned_claims(store, ["gen0"], 4) == {"gen0": [0, 1, 2]}
    assert SlotClaims(store, "gen0", 4).claimed_by_me() == [0, 1, 2]


def test_retire_request_is_per_producer_and_can_be_withdrawn(file_store):
    from tasks.lag import request_retire, retire_requested, withdraw_retire

    request_retire(file_store, "gen1")
    assert retire_requested(file_store, "gen1") and not retire_requested(file_store, "gen0")
    withdraw_retire(file_store, "gen1")
    assert not retire_requested(file_store, "gen1")
    withdraw_retire(file_store, "gen1")  # withdrawing twice is harmless (a scale-up of a new id)


def test_reopening_a_run_clears_the_stop_request_the_retire_requests_and_the_done_mark(file_store):
    """A retire request of a scale-down or a cancelled generator stayed: a continued run's
    generator of that name boots, sees it, and leaves."""
    from tasks.lag import (
        TrainerState, publish_trainer_state, read_trainer_state, reopen_run, request_retire, request_stop, retire_requested,
        stop_reason,
    )  # fmt: skip

    publish_trainer_state(file_store, TrainerState(version=6, lost_groups=2, done=True))
    request_stop(file_store, "generation gen0 failed")
    request_retire(file_store, "gen1")
    assert reopen_run(file_store, 6) == [], "no snapshot after the checkpoint: none withdrawn"
    assert stop_reason(file_store) is None and not retire_requested(file_store, "gen1")
    assert read_trainer_state(file_store) == TrainerState(version=6, lost_groups=2, done=False)


def test_reopening_a_run_moves_the_trainer_state_back_to_the_checkpoint_without_a_snapshot_to_withdraw(file_store):
    """publish_every 2: the dead trainer's step 7 published its state, not a snapshot. Left at v7,
    the state had generators admit a step's groups more than the trainer resumed at v6 allows."""
    from tasks.lag import TrainerState, publish_trainer_state, read_trainer_state, reopen_run

    publish_trainer_state(file_store, TrainerState(version=7, lost_groups=1))
    assert reopen_run(file_store, 6) == []
    assert read_trainer_state(file_store) == TrainerState(version=6, lost_groups=1, done=False)


def test_a_restarted_generator_checks_again_its_earlier_commits_of_the_last_lag_windows():
    """By version, not by slot: a replayed orphan has a low slot and a current version."""
    orphan, recent, old, older = (shard_key(v, "gen0", slot) for slot, v in [(1, 19), (40, 12), (39, 11), (38, 3)])
    assert recheck_after_restart([orphan, recent, old, older], trainer_version=20, max_lag=1) == [orphan, recent]
    assert recheck_after_restart([orphan, recent, old, older], trainer_version=8, max_lag=0) == [orphan, recent, old]
