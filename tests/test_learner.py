"""The learner against a real run directory: a group reaches a batch once, however many copies
of its shard storage holds (benchmarks/faults.py copies one under a second key); a restarted
run's trainer meets nothing of what its dead predecessor published after their checkpoint; and a
step whose pipeline gave the run up writes nothing; a damaged newest checkpoint is set aside."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from configs import TINY_CONFIG, load_config
from infra.modelfactory import build_model, build_tokenizer
from infra.storage import open_run_store
from tasks.checkpoints import latest_checkpoint_step
from tasks.lag import admission_capacity, late_shard_keys, read_trainer_state, reopen_run, report_late
from tasks.learner import Learner
from tasks.metrics import MetricsLog, read_metrics
from tasks.failed_groups import set_aside_group
from tasks.shards import parse_shard_key, quarantined_keys, shard_key, write_shard
from tasks.snapshots import apply_retention, latest_version, load_snapshot, publish_snapshot, snapshot_versions
from tests.test_shards import make_rollouts


def make_learner(tmp_path: Path, *overrides: str) -> Learner:
    config = load_config(TINY_CONFIG, [f"storage.root=file://{tmp_path}", "training.prompts_per_step=2", "lag.max_lag=1", *overrides])
    store = open_run_store(config.storage, config.run_id)
    tokenizer = build_tokenizer()
    model = build_model(config.model, vocab_size=len(tokenizer), seed=0)
    return Learner(config, store, model, tokenizer, tmp_path / "cache", MetricsLog(store, "trainer"))


def write_group(learner: Learner, group: str, seq: int, version: int = 0) -> str:
    rollouts = [dataclasses.replace(r, group_id=group) for r in make_rollouts(n=4, version=version)]
    return write_shard(learner.store, rollouts, "gen0", seq).key


def test_a_group_of_more_episodes_than_samples_per_prompt_is_quarantined_not_trained(tmp_path: Path):
    """Its rows are padded into the step's batch: a producer's bug of 100,000 rows ran the
    trainer out of memory, and every restart admitted that shard first again."""
    learner = make_learner(tmp_path, "generation.samples_per_prompt=4")
    oversized = write_shard(learner.store, make_rollouts(n=5, version=0), "gen0", 0).key
    write_group(learner, "s00000001", seq=1)
    write_group(learner, "s00000002", seq=2)
    batch = learner.admit_batch(poll_seconds=0.01)
    assert oversized not in batch and len(batch) == 2
    assert learner.ledger.disposed[oversized] == "quarantined" and learner.ledger.lost_groups == 1
    reason = json.loads(learner.store.read_bytes(f"quarantine/{oversized}.reason.json"))["reason"]
    assert "at most 4 episodes (generation.samples_per_prompt), and this one has 5" in reason


def copy_shard(learner: Learner, key: str, seq: int) -> str:
    copy = shard_key(0, "gen0", seq)
    assert learner.store.put_if_absent(copy, learner.store.read_bytes(key))
    return copy


def test_a_copy_that_lands_in_the_same_batch_as_its_original_is_a_duplicate(tmp_path: Path):
    learner = make_learner(tmp_path)
    original = write_group(learner, "s00000000", seq=0)
    copy = copy_shard(learner, original, seq=1)  # sorts right after the original: the two oldest
    other = write_group(learner, "s00000001", seq=2)
    batch = learner.admit_batch(poll_seconds=0.01)
    assert sorted(batch) == [original, other]
    assert learner.ledger.disposed == {copy: "duplicate"}
    assert learner.ledger.counts["duplicate"] == 4


def test_a_copy_of_a_trained_group_is_never_trained_again(tmp_path: Path):
    learner = make_learner(tmp_path)
    first = [write_group(learner, f"s{slot:08d}", seq=slot) for slot in range(2)]
    learner.train_step(learner.admit_batch(poll_seconds=0.01))
    copy = copy_shard(learner, first[0], seq=7)
    fresh = [write_group(learner, f"s{slot:08d}", seq=slot + 6) for slot in range(2, 4)]  # after the copy
    batch = learner.admit_batch(poll_seconds=0.01)
    assert sorted(batch) == fresh
    assert learner.ledger.disposed[copy] == "duplicate"
    assert learner.ledger.trained_groups == ["s00000000", "s00000001"]


def write_fresh(learner: Learner, first_slot: int) -> None:
    """Two groups on the trainer's current version: a full batch that needs nothing older."""
    for slot in (first_slot, first_slot + 1):
        rollouts = [dataclasses.replace(r, group_id=f"s{slot:08d}") for r in make_rollouts(n=4, version=learner.version)]
        write_shard(learner.store, rollouts, "gen0", slot)


def test_an_original_whose_copy_was_trained_leaves_the_window_as_a_duplicate_not_stale(tmp_path: Path):
    learner = make_learner(tmp_path)  # max_lag 1: a version-0 shard is past the bound at version 2
    copy = write_group(learner, "s00000005", seq=0)  # the copy arrived first and was trained
    write_group(learner, "s00000001", seq=1)
    learner.train_step(learner.admit_batch(poll_seconds=0.01))
    write_fresh(learner, 10)
    learner.train_step(learner.admit_batch(poll_seconds=0.01))
    original = copy_shard(learner, copy, seq=5)  # the original commits late, already past the bound
    write_fresh(learner, 20)
    learner.admit_batch(poll_seconds=0.01)
    assert learner.ledger.disposed[copy] == "trained" and learner.ledger.disposed[original] == "duplicate"
    assert learner.ledger.counts["dropped_stale"] == 0 and learner.ledger.lost_groups == 0, "no replacement is owed"


def test_a_step_retried_after_its_publish_failed_is_not_applied_twice(tmp_path: Path, monkeypatch):
    """The training flow retries `train_step` once when storage stays down past its budget. The
    optimizer step and the ledger come before the publish: the retry finishes that step (one
    version, each group counted once) instead of stepping again on the same batch."""
    learner = make_learner(tmp_path)
    for slot in range(2):
        write_group(learner, f"s{slot:08d}", seq=slot)
    shards = learner.admit_batch(poll_seconds=0.01)
    publish, attempts = learner._publish, []

    def publish_failing_once() -> None:
        attempts.append(learner.version)
        if len(attempts) == 1:
            raise OSError("storage unavailable")
        publish()

    monkeypatch.setattr(learner, "_publish", publish_failing_once)
    weights = {name: p.detach().clone() for name, p in learner.trainer.model.named_parameters()}
    with pytest.raises(OSError, match="storage unavailable"):
        learner.train_step(shards)
    after_first = {name: p.detach().clone() for name, p in learner.trainer.model.named_parameters()}
    assert any(not (after_first[n] == weights[n]).all() for n in weights), "the first attempt stepped"
    record = learner.train_step(shards)
    assert attempts == [1, 1] and learner.version == 1 and record["version"] == 1
    assert all((p.detach() == after_first[n]).all() for n, p in learner.trainer.model.named_parameters()), "no second step"
    assert learner.ledger.trained_groups == ["s00000000", "s00000001"] and learner.ledger.counts["trained"] == 8
    assert learner.store.exists("weights/v00000001/MANIFEST.json")


def test_a_group_lost_while_a_batch_fills_is_shared_with_the_generators_at_once(tmp_path: Path):
    """At max_lag 0 the batch being filled is the whole admission window: the replacement of a
    group quarantined meanwhile is claimable only once generators know of the loss, which the
    trainer used to publish after its next step, which needed that replacement: a stall for good."""
    config = load_config(TINY_CONFIG, [f"storage.root=file://{tmp_path}", "training.prompts_per_step=2", "lag.max_lag=0"])
    store = open_run_store(config.storage, config.run_id)
    tokenizer = build_tokenizer()
    learner = Learner(config, store, build_model(config.model, vocab_size=len(tokenizer), seed=0), tokenizer,
                      tmp_path / "cache", MetricsLog(store, "trainer"))  # fmt: skip
    write_group(learner, "s00000000", seq=0)
    assert store.put_if_absent(shard_key(0, "gen0", 1), b"not a parquet file")
    looks = []
    assert learner.admit_batch(should_stop=lambda: looks.append(1) or len(looks) > 3, poll_seconds=0.01) is None
    assert learner.ledger.lost_groups == 1
    assert read_trainer_state(store).lost_groups == 1, "published while the batch still waits for its replacement"
    capacity = admission_capacity(read_trainer_state(store).version, 0, 2, read_trainer_state(store).lost_groups)
    assert capacity == 3, "the replacement's slot is admitted on v0"


def test_a_resumed_trainer_counts_the_shards_quarantined_after_its_checkpoint(tmp_path: Path):
    """Those shards left rollouts/ and the checkpoint's ledger does not name them: unless the
    resume counts them, their capacity is never returned and the accounting identity breaks."""
    learner = make_learner(tmp_path)
    for slot in range(2):
        write_group(learner, f"s{slot:08d}", seq=slot)
    learner.train_step(learner.admit_batch(poll_seconds=0.01))
    learner._checkpoint()  # the checkpoint at v1
    bad = shard_key(1, "gen0", 5)
    assert learner.store.put_if_absent(bad, b"not a parquet file")
    write_group(learner, "s00000002", seq=2)
    looks = []
    learner.admit_batch(should_stop=lambda: looks.append(1) or len(looks) > 3, poll_seconds=0.01)
    assert learner.ledger.disposed.get(bad) == "quarantined"  # ... then the trainer dies before its next checkpoint
    resumed = make_learner(tmp_path)
    assert resumed.resume() == 1
    assert resumed.ledger.disposed.get(bad) == "quarantined" and resumed.ledger.lost_groups == 1


def test_a_group_set_aside_while_no_trainer_looked_is_shared_as_lost_when_one_resumes(tmp_path: Path):
    """Set aside after the dead trainer's last look: the resumed trainer counted it lost but, its
    admissions sharing only the losses they count, never told the generators, whose capacity then
    lacked its replacement: at max_lag 0 the batch never filled."""
    from tasks.failed_groups import set_aside_group

    learner = make_learner(tmp_path, "lag.max_lag=0")
    publish_snapshot(learner.store, learner.trainer.model, learner.tokenizer, 0)
    for slot in range(2):
        write_group(learner, f"s{slot:08d}", seq=slot)
    learner.train_step(learner.admit_batch(poll_seconds=0.01))
    learner._checkpoint()  # the checkpoint at v1, then the trainer stops looking
    set_aside_group(learner.store, 2, {"error": "the tool is down"})
    resumed = restart_run(tmp_path)
    assert resumed.ledger.lost_groups == 1 and read_trainer_state(resumed.store).lost_groups == 1



def test_a_group_a_generator_set_aside_is_counted_lost_while_the_trainer_waits(tmp_path: Path):
    """A generator sets aside a group its environment failed; unless the waiting trainer counts
    it lost, its capacity never comes back, and at max_lag 0 the batch stays one group short."""
    learner = make_learner(tmp_path, "lag.max_lag=0")
    write_group(learner, "s00000000", seq=0)
    failed = set_aside_group(learner.store, 1, {"error": "CalcEnv.step raised"})
    looks = []
    assert learner.admit_batch(should_stop=lambda: looks.append(1) or len(looks) > 3, poll_seconds=0.01) is None
    assert learner.ledger.disposed == {failed: "quarantined"} and learner.ledger.lost_groups == 1
    assert read_trainer_state(learner.store).lost_groups == 1, "shared with the generators, who owe the batch its replacement"
    again = []
    learner.admit_batch(should_stop=lambda: again.append(1) or len(again) > 3, poll_seconds=0.01)
    assert learner.ledger.lost_groups == 1, "counted once"


def test_a_group_committed_after_its_last_look_is_dropped_once_its_generator_reports_it(tmp_path: Path):
    """The admit at v2 gave rollouts/v00000000 its last look; a v0 group committed after that is
    in no directory the trainer lists again. Its generator, reading the trainer state at v3, reports
    it: the trainer drops it as stale and returns its slot. Unreported, it held capacity for good
    (max_lag x groups_per_step + 1 such groups and no batch could fill again)."""
    learner = make_learner(tmp_path)  # two groups a step, max_lag 1
    for first_slot in (0, 2, 4):
        write_fresh(learner, first_slot)
        learner.train_step(learner.admit_batch(poll_seconds=0.01))
    late = write_group(learner, "s00000009", seq=9, version=0)
    write_fresh(learner, 6)
    learner.train_step(learner.admit_batch(poll_seconds=0.01))
    assert late not in learner.ledger.disposed, "below the window: no listing shows it"
    state = read_trainer_state(learner.store)
    assert report_late(learner.store, [late, shard_key(3, "gen0", 7)], state.version, max_lag=1) == [late]
    write_fresh(learner, 10)
    learner.admit_batch(poll_seconds=0.01)
    assert learner.ledger.disposed[late] == "stale" and learner.ledger.lost_groups == 1
    assert read_trainer_state(learner.store).lost_groups == 1, "shared with the generators"
    assert late_shard_keys(learner.store) == [late]
    learner._checkpoint()
    assert late_shard_keys(learner.store) == [], "forgotten once a checkpoint records its fate"


def test_a_late_report_of_a_group_already_dropped_changes_nothing(tmp_path: Path):
    """The last look saw the group and dropped it; its generator's state read came after that
    look and reported it too."""
    learner = make_learner(tmp_path)
    for first_slot in (0, 2):
        write_fresh(learner, first_slot)
        learner.train_step(learner.admit_batch(poll_seconds=0.01))
    stale = write_group(learner, "s00000009", seq=9, version=0)
    write_fresh(learner, 4)
    learner.train_step(learner.admit_batch(poll_seconds=0.01))  # the admit at v2 looks at v0 last
    assert learner.ledger.disposed[stale] == "stale" and learner.ledger.lost_groups == 1
    assert report_late(learner.store, [stale], learner.version, max_lag=1) == [stale]
    write_fresh(learner, 6)
    learner.admit_batch(poll_seconds=0.01)
    assert learner.ledger.lost_groups == 1 and learner.ledger.counts["dropped_stale"] == 4


def test_a_resumed_trainer_gives_the_directory_leaving_the_window_its_last_look(tmp_path: Path):
    """The checkpoint at v2 comes before the admit that would look at rollouts/v00000000 last; a
    v0 group committed between the dead trainer's look at v1 and its death is stale for the
    resumed trainer, and its generator, whose state read said v1, reported nothing."""
    learner = make_learner(tmp_path)
    for first_slot in (0, 2):
        write_fresh(learner, first_slot)
        learner.train_step(learner.admit_batch(poll_seconds=0.01))
    learner._checkpoint()  # the checkpoint at v2, then a late v0 group, then the trainer dies
    late = write_group(learner, "s00000009", seq=9, version=0)
    resumed = make_learner(tmp_path)
    assert resumed.resume() == 2
    write_fresh(resumed, 4)
    resumed.admit_batch(poll_seconds=0.01)
    assert resumed.ledger.disposed[late] == "stale" and resumed.ledger.lost_groups == 1


def restart_run(tmp_path: Path) -> Learner:
    """What a pipeline started again does before its trainer: reopen the run from the newest
    checkpoint (withdrawing the snapshots after it), then resume a fresh trainer."""
    resumed = make_learner(tmp_path)
    reopen_run(resumed.store, latest_checkpoint_step(resumed.store) or 0)
    resumed.resume()
    return resumed


def dead_after_publishing_v2(tmp_path: Path) -> tuple[Learner, list[str]]:
    """A trainer that checkpointed at v1, stepped to v2 on the groups it returns, published v2 and
    died."""
    learner = make_learner(tmp_path)
    publish_snapshot(learner.store, learner.trainer.model, learner.tokenizer, 0)  # the run's v0, as `tandem init` commits it
    for slot in range(2):
        write_group(learner, f"s{slot:08d}", seq=slot)
    learner.train_step(learner.admit_batch(poll_seconds=0.01))
    learner._checkpoint()  # the checkpoint at v1
    second = [write_group(learner, f"s{slot:08d}", seq=slot) for slot in range(2, 4)]
    learner.train_step(learner.admit_batch(poll_seconds=0.01))
    return learner, second


def test_a_restarted_run_withdraws_what_the_dead_trainer_published_after_its_checkpoint(tmp_path: Path):
    """The trainer checkpointed at v1, stepped to v2, published it, and died; generators played
    groups on its v2. The resumed trainer publishes other weights as v2: the old v2 goes, LATEST
    and the trainer state say v1 again, and the groups played on the old v2 are quarantined as
    from the future and owed again. Before, they waited for the new v2 and were trained as its."""
    learner, second = dead_after_publishing_v2(tmp_path)
    played_on_v2 = [write_group(learner, f"s{slot:08d}", seq=slot, version=2) for slot in range(4, 6)]
    assert snapshot_versions(learner.store) == [0, 1, 2] and read_trainer_state(learner.store).version == 2
    resumed = restart_run(tmp_path)
    assert resumed.version == 1 and snapshot_versions(resumed.store) == [0, 1] and latest_version(resumed.store) == 1
    assert read_trainer_state(resumed.store).version == 1
    assert sorted(resumed.admit_batch(poll_seconds=0.01)) == second, "this lineage trains the dead one's step 2 again"
    assert [resumed.ledger.disposed.get(key) for key in played_on_v2] == ["quarantined"] * 2
    assert set(played_on_v2) <= quarantined_keys(resumed.store) and resumed.ledger.lost_groups == 2


def test_a_group_played_partly_on_a_withdrawn_snapshot_is_quarantined_after_the_trainer_passes_its_number(tmp_path: Path):
    """An engine that failed the dead trainer's v2 played a group's first episodes on v1, the
    others on v2: the shard is keyed v1 (its lowest), so at the resumed v1 it was fine, and once
    the new lineage had published its own v2 its v2 rows were no longer from the future, and
    they were trained as the new v2's."""
    learner, second = dead_after_publishing_v2(tmp_path)
    rows = [dataclasses.replace(r, group_id="s00000006", policy_version=1 + i // 2) for i, r in enumerate(make_rollouts(n=4))]
    mixed = write_shard(learner.store, rows, "gen0", 6).key
    assert parse_shard_key(mixed).version == 1
    resumed = restart_run(tmp_path)
    batch = resumed.admit_batch(poll_seconds=0.01)
    assert sorted(batch) == second, "the dead lineage's step 2 again; the mixed group is younger"
    resumed.train_step(batch)  # the new v2
    fresh = [write_group(resumed, f"s{slot:08d}", seq=slot, version=2) for slot in range(7, 9)]
    assert sorted(resumed.admit_batch(poll_seconds=0.01)) == fresh
    assert resumed.ledger.disposed.get(mixed) == "quarantined"
    reason = json.loads(resumed.store.read_bytes(f"quarantine/{mixed}.reason.json"))["reason"]
    assert reason.startswith("policy_version 2 is past v1, the version this trainer resumed at")


def test_a_trainer_resumed_past_the_snapshots_kept_publishes_its_own_version(tmp_path: Path):
    """Retention kept v0 and LATEST v2 but not v1, the checkpoint's version: the run reopens on
    v0, which the trainer at v1 cannot wait on for long, and the trainer publishes its v1 from
    the checkpoint as it resumes."""
    learner = make_learner(tmp_path)
    publish_snapshot(learner.store, learner.trainer.model, learner.tokenizer, 0)
    for slot in range(4):
        write_group(learner, f"s{slot:08d}", seq=slot)
    learner.train_step(learner.admit_batch(poll_seconds=0.01))
    learner._checkpoint()  # the checkpoint at v1
    learner.train_step(learner.admit_batch(poll_seconds=0.01))
    assert apply_retention(learner.store, keep_last=1, keep_every=1000) == [1]
    resumed = restart_run(tmp_path)
    assert resumed.version == 1 and snapshot_versions(resumed.store) == [0, 1] and latest_version(resumed.store) == 1
    assert load_snapshot(resumed.store, tmp_path / "check", 1) and read_trainer_state(resumed.store).version == 1



def test_the_final_weights_are_published_though_publish_every_skips_the_last_version(tmp_path: Path):
    """steps 3 at publish_every 2: LATEST stayed v2 while the trainer finished at v3, so the closing
    evaluation, the summary and a promotion named weights one step old."""
    learner = make_learner(tmp_path, "training.publish_every=2", "training.steps=3", "lag.max_lag=2")
    publish_snapshot(learner.store, learner.trainer.model, learner.tokenizer, 0)
    for slot in range(6):
        write_group(learner, f"s{slot:08d}", seq=slot)
    for _ in range(3):
        learner.train_step(learner.admit_batch(poll_seconds=0.01))
    assert snapshot_versions(learner.store) == [0, 2]
    learner.finish()
    assert snapshot_versions(learner.store) == [0, 2, 3] and latest_version(learner.store) == 3
    assert read_trainer_state(learner.store).done

def test_a_step_whose_pipeline_gave_the_run_up_writes_nothing(tmp_path: Path):
    """The training flow's check between the step and its writes raises once another pipeline has
    the run: no snapshot, no trainer state, for the successor's generators to meet."""
    learner = make_learner(tmp_path)
    for slot in range(2):
        write_group(learner, f"s{slot:08d}", seq=slot)
    shards = learner.admit_batch(poll_seconds=0.01)

    def taken_over() -> None:
        raise RuntimeError("pipeline p2 has taken the run over")

    with pytest.raises(RuntimeError, match="taken the run over"):
        learner.train_step(shards, before_publish=taken_over)
    assert snapshot_versions(learner.store) == [] and not learner.store.exists("lag/trainer.json")
    learner.train_step(shards)  # the same trainer, still holding the run, finishes the step it applied
    assert snapshot_versions(learner.store) == [1] and read_trainer_state(learner.store).version == 1


def test_the_lag_histogram_counts_each_sample_at_its_own_version(tmp_path: Path):
    """A multi-turn group may span versions: its shard's key names the oldest, its rows their own."""
    learner = make_learner(tmp_path)
    write_fresh(learner, 0)
    learner.train_step(learner.admit_batch(poll_seconds=0.01))
    mixed = [dataclasses.replace(r, group_id="s00000002", policy_version=i // 2) for i, r in enumerate(make_rollouts(n=4, version=0))]
    write_shard(learner.store, mixed, "gen0", 2)
    write_fresh(learner, 3)
    batch = learner.admit_batch(poll_seconds=0.01)
    assert len(batch) == 2 and any(key.startswith("rollouts/v00000000/") for key in batch)
    record = learner.train_step(batch)
    assert record["lag_histogram"] == {"0": 6, "1": 2}


def test_a_checkpoint_save_is_recorded_with_its_seconds_and_counted_busy(tmp_path: Path):
    """A save (model and optimizer: seconds to minutes on a large model) was neither a step nor a
    wait: the idle fraction and the timeline left it out."""
    learner = make_learner(tmp_path, "training.checkpoint_every=2")
    publish_snapshot(learner.store, learner.trainer.model, learner.tokenizer, 0)
    for step in (1, 2):
        for slot in range(2 * step - 2, 2 * step):
            write_group(learner, f"s{slot:08d}", seq=slot, version=step - 1)
        record = learner.train_step(learner.admit_batch(poll_seconds=0.01))
    learner.metrics.flush()
    (save,) = [r for r in read_metrics(learner.store, "trainer") if r["event"] == "checkpoint"]
    assert save["version"] == 2 and save["seconds"] > 0
    assert learner.busy_seconds == pytest.approx(record["busy_seconds"] + save["seconds"])
    learner.finish()
    saves = [r["version"] for r in read_metrics(learner.store, "trainer") if r["event"] == "checkpoint"]
    assert saves == [2], "the last step's checkpoint is the final one: a large model's state was written twice"


def test_the_trainer_keeps_only_the_newest_checkpoints(tmp_path: Path):
    """A checkpoint is 12 bytes a parameter; every one kept would fill the bucket on a long run.
    Two stay (storage.keep_last_checkpoints), so that a damaged newest falls back to the other."""
    from tasks.checkpoints import checkpoint_steps

    learner = make_learner(tmp_path)
    publish_snapshot(learner.store, learner.trainer.model, learner.tokenizer, 0)
    for step in (1, 2, 3):
        for slot in range(2 * step - 2, 2 * step):
            write_group(learner, f"s{slot:08d}", seq=slot, version=step - 1)
        learner.train_step(learner.admit_batch(poll_seconds=0.01))
        learner._checkpoint()
    assert learner.config.storage.keep_last_checkpoints == 2
    assert checkpoint_steps(learner.store) == [2, 3]
    assert not learner.store.list_recursive("checkpoints/step00000001"), "every file of the deleted one goes"
    with pytest.raises(ValueError, match="keep_last must be >= 2"):
        from tasks.checkpoints import apply_checkpoint_retention

        apply_checkpoint_retention(learner.store, 1)


def test_a_trainer_restarted_before_any_checkpoint_marks_its_predecessors_steps_withdrawn(tmp_path: Path):
    """Killed at v1 before its first checkpoint: the restarted run withdraws v1, and the summary and
    progress bars must not show its step (tasks/report.py `kept_train_steps`)."""
    from tasks.report import train_steps

    learner = make_learner(tmp_path)
    publish_snapshot(learner.store, learner.trainer.model, learner.tokenizer, 0)
    write_group(learner, "s00000000", seq=0)
    write_group(learner, "s00000001", seq=1)
    learner.train_step(learner.admit_batch(poll_seconds=0.01))
    learner.metrics.flush()
    assert [s["version"] for s in train_steps(learner.store)] == [1]
    resumed = restart_run(tmp_path)
    resumed.metrics.flush()
    assert resumed.version == 0 and train_steps(resumed.store) == []
    fresh = make_learner(tmp_path / "fresh")
    fresh.resume()
    assert [r["event"] for r in read_metrics(fresh.store, "trainer")] == [], "a new run's trainer marks nothing"


def test_a_resumed_trainer_goes_on_counting_the_steps_skipped_in_a_row(tmp_path: Path):
    """Three non-finite steps in a row fail the trainer: the weights, not a batch, are the trouble.
    A trainer resumed in such a streak started again at 0, three more steps on broken weights."""
    learner = make_learner(tmp_path)
    publish_snapshot(learner.store, learner.trainer.model, learner.tokenizer, 0)
    write_group(learner, "s00000000", seq=0)
    write_group(learner, "s00000001", seq=1)
    learner.train_step(learner.admit_batch(poll_seconds=0.01))
    learner.trainer.skipped_in_a_row = 2  # as two non-finite steps leave it
    learner._checkpoint()
    assert restart_run(tmp_path).trainer.skipped_in_a_row == 2


def test_a_damaged_newest_checkpoint_is_set_aside_and_the_run_resumes_from_the_one_before(tmp_path: Path):
    """A checkpoint damaged after its commit (file:// writes it without fsync; a power loss) made
    every resume fail for good. The trainer now sets it aside and says so; the run, started
    again, withdraws the snapshots after the older checkpoint and resumes from it."""
    from tasks.checkpoints import CheckpointDamaged, checkpoint_prefix, checkpoint_steps

    learner = make_learner(tmp_path)
    publish_snapshot(learner.store, learner.trainer.model, learner.tokenizer, 0)
    for step in (1, 2):
        for slot in range(2 * step - 2, 2 * step):
            write_group(learner, f"s{slot:08d}", seq=slot, version=step - 1)
        learner.train_step(learner.admit_batch(poll_seconds=0.01))
        learner._checkpoint()
    assert checkpoint_steps(learner.store) == [1, 2]
    damaged = learner.store.local_path(f"{checkpoint_prefix(2)}/model.safetensors")
    damaged.write_bytes(damaged.read_bytes()[:-8])
    with pytest.raises(CheckpointDamaged, match="the checkpoint at step 2 failed verification.*resume from step 1"):
        restart_run(tmp_path)
    assert checkpoint_steps(learner.store) == [1]
    assert "reason" in json.loads(learner.store.read_bytes(f"{checkpoint_prefix(2)}/damaged.json"))
    resumed = restart_run(tmp_path)
    assert resumed.version == 1 and snapshot_versions(resumed.store) == [0, 1] and latest_version(resumed.store) == 1


def test_a_snapshot_the_generators_found_damaged_is_committed_again(tmp_path: Path):
    """A file of the newest snapshot damaged after its commit: every generator rejects it and
    keeps older weights, and at max_lag 0 no batch could ever be generated. The trainer, still at
    that version, commits it again, once for any number of reports."""
    from infra.manifest import read_manifest
    from tasks.snapshots import manifest_digest, rejection_reports, report_rejected, snapshot_prefix

    learner = make_learner(tmp_path)
    store = learner.store
    publish_snapshot(store, learner.trainer.model, learner.tokenizer, 0)
    damaged = manifest_digest(store, 0)
    weights = store.local_path(f"{snapshot_prefix(0)}/model.safetensors")
    weights.write_bytes(weights.read_bytes()[:-8])
    for generator in ("gen0", "gen1"):
        report_rejected(store, generator, 0, damaged, "model.safetensors: size mismatch")
    learner._repair_rejected_snapshots(waited=1.0)
    assert manifest_digest(store, 0) == damaged and len(rejection_reports(store)) == 2, "a trainer that gets batches waits"
    learner._repair_rejected_snapshots(waited=60.0)
    assert manifest_digest(store, 0) not in (None, damaged)
    assert read_manifest(store, snapshot_prefix(0))["extra"] == {"version": 0, "replaces": damaged}
    assert rejection_reports(store) == {}
    assert [r["rejected"] for r in read_metrics(store, "trainer") if r["event"] == "snapshot_republished"] == [0]
    load_snapshot(store, tmp_path / "verified", 0)


def test_a_snapshot_reported_damaged_that_verifies_is_left_alone(tmp_path: Path):
    """One generator's own trouble (its disk, its network) must not have the trainer delete and
    commit again a snapshot the others are loading."""
    from tasks.snapshots import manifest_digest, rejection_reports, report_rejected

    learner = make_learner(tmp_path)
    store = learner.store
    publish_snapshot(store, learner.trainer.model, learner.tokenizer, 0)
    good = manifest_digest(store, 0)
    report_rejected(store, "gen0", 0, good, "model.safetensors: sha256 mismatch")
    learner._repair_rejected_snapshots(waited=60.0)
    assert manifest_digest(store, 0) == good and rejection_reports(store) == {}


def test_a_recommit_that_failed_half_way_is_made_again(tmp_path: Path):
    """Storage went down between the deletion and the new commit: LATEST names a snapshot with no
    manifest, which no generator can ever load. The report is still there; answered again, the
    snapshot is committed."""
    from tasks.snapshots import _delete_snapshot, manifest_digest, rejection_reports, report_rejected

    learner = make_learner(tmp_path)
    store = learner.store
    publish_snapshot(store, learner.trainer.model, learner.tokenizer, 0)
    report_rejected(store, "gen0", 0, manifest_digest(store, 0), "model.safetensors: truncated")
    _delete_snapshot(store, 0)
    learner._repair_rejected_snapshots(waited=60.0)
    assert snapshot_versions(store) == [0] and rejection_reports(store) == {}


def test_a_trainer_past_the_damaged_snapshot_publishes_its_own_version_in_its_place(tmp_path: Path):
    """With publish_every 2 the trainer is at v1 while v0 is the newest snapshot: it publishes v1."""
    from tasks.snapshots import manifest_digest, rejection_reports, report_rejected, snapshot_prefix

    learner = make_learner(tmp_path, "training.publish_every=2")
    store = learner.store
    publish_snapshot(store, learner.trainer.model, learner.tokenizer, 0)
    for slot in (0, 1):
        write_group(learner, f"s{slot:08d}", seq=slot)
    learner.train_step(learner.admit_batch(poll_seconds=0.01))
    assert learner.version == 1 and snapshot_versions(store) == [0]
    weights = store.local_path(f"{snapshot_prefix(0)}/model.safetensors")
    weights.write_bytes(weights.read_bytes()[:-8])
    report_rejected(store, "gen0", 0, manifest_digest(store, 0), "model.safetensors: truncated")
    learner._repair_rejected_snapshots(waited=60.0)
    assert snapshot_versions(store) == [0, 1] and latest_version(store) == 1
    assert rejection_reports(store) == {}


def test_a_group_dropped_stale_is_lost_once_and_a_later_copy_of_it_is_a_duplicate(tmp_path: Path):
    """Two copies of one group in different version directories (an adopted claim's first owner
    committing after all): the older dropped as stale owed one replacement, and the newer was
    then trained as well; two stale copies were two losses."""
    learner = make_learner(tmp_path)  # max_lag 1
    for version, first in ((0, 0), (1, 2)):
        for slot in (first, first + 1):
            rollouts = [dataclasses.replace(r, group_id=f"s{slot:08d}") for r in make_rollouts(n=4, version=version)]
            write_shard(learner.store, rollouts, "gen0", slot)
        learner.train_step(learner.admit_batch(poll_seconds=0.01))
    stale = [write_group(learner, "s00000005", seq=5, version=0), write_group(learner, "s00000005", seq=6, version=0)]
    fresh = write_group(learner, "s00000005", seq=7, version=2)
    write_fresh(learner, 10)
    batch = learner.admit_batch(poll_seconds=0.01)
    assert fresh not in batch and learner.ledger.disposed[fresh] == "duplicate"
    assert sorted(learner.ledger.disposed[k] for k in stale) == ["duplicate", "stale"]
    assert learner.ledger.lost_groups == 1 and learner.ledger.dropped_groups == ["s00000005"]


def test_an_admission_retried_after_storage_failed_mid_drop_still_gives_the_leaving_directory_its_last_look(tmp_path: Path, monkeypatch):
    """The training flow retries a failed admit_batch on the same learner. The first try listed
    rollouts/v00000000 for the last time and failed reading its stale group: had the window moved
    on at the listing, no later look would count that group lost, and its slot was held for good."""
    import tasks.learner as learner_module
    from infra.storage import StorageUnavailable

    learner = make_learner(tmp_path)  # two groups a step, max_lag 1
    for first_slot in (0, 2):
        write_fresh(learner, first_slot)
        learner.train_step(learner.admit_batch(poll_seconds=0.01))
    straggler = write_group(learner, "s00000009", seq=9, version=0)
    write_fresh(learner, 4)
    read, failures = learner_module.read_valid_shards, []

    def fails_once_on_the_straggler(store, keys, *args, **kwargs):
        if straggler in keys and not failures:
            failures.append(straggler)
            raise StorageUnavailable("storage went away while the stale group was read")
        return read(store, keys, *args, **kwargs)

    monkeypatch.setattr(learner_module, "read_valid_shards", fails_once_on_the_straggler)
    with pytest.raises(StorageUnavailable):
        learner.admit_batch(poll_seconds=0.01)
    learner.admit_batch(poll_seconds=0.01)
    assert failures == [straggler]
    assert learner.ledger.disposed.get(straggler) == "stale" and learner.ledger.lost_groups == 1


def test_a_stale_copy_of_a_group_already_chosen_for_the_batch_is_a_duplicate_not_a_loss(tmp_path: Path, monkeypatch):
    """A group's other copy (an adopted claim's first owner committing after all) reported late
    while the batch holding its fresh copy is still filling: counted lost, it owed generators a
    replacement for a group that was trained, one surplus group every step from then on."""
    import tasks.learner as learner_module

    monkeypatch.setattr(learner_module, "LATE_CHECK_SECONDS", 0.0)
    learner = make_learner(tmp_path)  # two groups a step, max_lag 1
    for first_slot in (0, 2):
        write_fresh(learner, first_slot)
        learner.train_step(learner.admit_batch(poll_seconds=0.01))
    write_group(learner, "s00000009", seq=10, version=2)
    assert learner.store.put_if_absent(shard_key(2, "gen0", 11), b"not parquet")  # quarantined: the batch stays one short
    looks = []

    def copy_arrives_while_the_batch_fills() -> bool:
        looks.append(len(looks))
        if len(looks) == 2:  # the fresh copy is chosen
            report_late(learner.store, [write_group(learner, "s00000009", seq=12, version=0)], learner.version, max_lag=1)
        if len(looks) == 3:
            write_group(learner, "s00000020", seq=13, version=2)
        return False

    batch = learner.admit_batch(copy_arrives_while_the_batch_fills, poll_seconds=0.01)
    assert {table["group_id"][0].as_py() for table in batch.values()} == {"s00000009", "s00000020"}
    assert learner.ledger.disposed[shard_key(0, "gen0", 12)] == "duplicate"
    assert learner.ledger.dropped_groups == [] and learner.ledger.lost_groups == 1, "the quarantined shard's group only"


def write_rewarded(learner: Learner, group: str, seq: int, rewards: list[float]) -> str:
    """A group on the trainer's version whose samples got `rewards`."""
    rollouts = make_rollouts(n=len(rewards), version=learner.version)
    rollouts = [dataclasses.replace(r, group_id=group, reward=reward) for r, reward in zip(rollouts, rewards)]
    return write_shard(learner.store, rollouts, "gen0", seq).key


def test_dynamic_sampling_drops_groups_without_signal_and_has_generators_replace_them(tmp_path: Path):
    """All four samples solved (or all failed) give every advantage 0: no gradient, half of the
    tiny run's batches by its end. Dropped, they count lost, which has generators make others."""
    learner = make_learner(tmp_path, "training.dynamic_sampling=true")
    solved = write_rewarded(learner, "s00000000", 0, [1.0] * 4)
    write_rewarded(learner, "s00000001", 1, [0.0, 1.0, 0.0, 1.0])
    failed = write_rewarded(learner, "s00000002", 2, [0.0] * 4)
    write_rewarded(learner, "s00000003", 3, [0.5, 0.0, 1.0, 0.0])
    batch = learner.admit_batch(poll_seconds=0.01)
    assert sorted(batch) == [shard_key(0, "gen0", 1), shard_key(0, "gen0", 3)]
    assert learner.ledger.disposed[solved] == learner.ledger.disposed[failed] == "no_signal"
    assert learner.ledger.lost_groups == 2 and learner.ledger.counts["dropped_no_signal"] == 8
    assert read_trainer_state(learner.store).lost_groups == 2, "shared with the generators"
    assert learner.train_step(batch)["groups_without_signal"] == 0
    copy = copy_shard(learner, solved, seq=9)
    write_rewarded(learner, "s00000004", 4, [0.0, 1.0, 1.0, 1.0])
    write_rewarded(learner, "s00000005", 5, [0.0, 1.0, 0.0, 0.0])
    learner.admit_batch(poll_seconds=0.01)
    assert learner.ledger.disposed[copy] == "duplicate" and learner.ledger.lost_groups == 2


def test_dynamic_sampling_trains_on_groups_without_signal_past_its_drops_for_a_step(tmp_path: Path, capsys):
    learner = make_learner(tmp_path, "training.dynamic_sampling=true", "training.dynamic_sampling_max_drops=1")
    for seq in range(3):
        write_rewarded(learner, f"s{seq:08d}", seq, [1.0] * 4)
    batch = learner.admit_batch(poll_seconds=0.01)
    assert learner.ledger.lost_groups == 1 and len(batch) == 2
    assert learner.train_step(batch)["groups_without_signal"] == 2
    assert "dynamic_sampling_max_drops" in capsys.readouterr().out


def test_dynamic_sampling_s_limit_holds_for_the_step_across_admissions(tmp_path: Path):
    """The training flow retries a failed admission on the same learner: the drops of the first
    try count against the step's limit."""
    learner = make_learner(tmp_path, "training.dynamic_sampling=true", "training.dynamic_sampling_max_drops=1")
    for seq in range(3):
        write_rewarded(learner, f"s{seq:08d}", seq, [1.0] * 4)
    looks = []
    assert learner.admit_batch(lambda: looks.append(0) or len(looks) > 1, poll_seconds=0.01) is None
    assert learner.ledger.lost_groups == 1
    assert len(learner.admit_batch(poll_seconds=0.01)) == 2 and learner.ledger.lost_groups == 1


def test_dynamic_sampling_drops_nothing_the_shard_keys_could_not_number_a_replacement_for(tmp_path: Path):
    """(steps + max_lag + 1) x prompts_per_step slots at the config's limit: a loss would need one more."""
    learner = make_learner(tmp_path, "training.dynamic_sampling=true", "training.steps=333331", "training.prompts_per_step=3")
    for seq in range(3):
        write_rewarded(learner, f"s{seq:08d}", seq, [1.0] * 4)
    assert len(learner.admit_batch(poll_seconds=0.01)) == 3 and learner.ledger.lost_groups == 0


def test_without_dynamic_sampling_groups_without_signal_are_trained_and_counted(tmp_path: Path):
    learner = make_learner(tmp_path)
    write_rewarded(learner, "s00000000", 0, [1.0] * 4)
    write_rewarded(learner, "s00000001", 1, [0.0, 1.0, 0.0, 1.0])
    assert learner.train_step(learner.admit_batch(poll_seconds=0.01))["groups_without_signal"] == 1


def test_a_ledger_saved_before_a_fate_was_counted_loads_with_none_of_it():
    from tasks.ledger import Ledger

    old = {"disposed": {}, "trained_groups": [], "counts": {"trained": 8, "dropped_stale": 0, "quarantined": 0, "duplicate": 0},
           "lost_groups": 0, "dropped_groups": [], "lags": []}  # fmt: skip
    assert Ledger.from_json(old).counts == {"trained": 8, "dropped_stale": 0, "dropped_no_signal": 0, "quarantined": 0, "duplicate": 0}
