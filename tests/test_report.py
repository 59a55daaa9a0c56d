"""The end-of-run report read back from a run directory: the identity, resumed steps, the plots."""

from __future__ import annotations

import json
import time

import pytest

from configs.sections import StorageConfig
from infra.storage import open_run_store
from tasks.ledger import LEDGER_KEY, Ledger
from tasks.metrics import MetricsLog, MetricsTail, read_metrics
from tasks.report import _union, accounting, kept_train_steps, summary_rows, timeline_bars, train_steps, write_summary
from tasks.failed_groups import set_aside_group
from tasks.shards import write_shard
from tests.test_shards import make_rollouts


def step_record(version: int, reward: float, at: float) -> dict:
    return {"version": version, "reward_mean": reward, "time": at, "step_seconds": 0.5, "wait_seconds": 0.2,
            "busy_seconds": 0.5 * version, "idle_seconds": 0.2 * version}  # fmt: skip


def test_a_resumed_trainer_counts_each_version_once_with_its_last_record(tmp_path):
    store = open_run_store(StorageConfig(root=f"file://{tmp_path}"), "run")
    trainer = MetricsLog(store, "trainer", flush_seconds=0)
    for version, reward in [(1, 0.1), (2, 0.2), (3, 0.9), (2, 0.25), (3, 0.3)]:  # killed after 3, resumed at 2
        trainer.log("train_step", **{k: v for k, v in step_record(version, reward, 100.0 + version).items() if k != "time"})
    steps = train_steps(store)
    assert [(s["version"], s["reward_mean"]) for s in steps] == [(1, 0.1), (2, 0.25), (3, 0.3)]


def test_the_steps_a_dead_trainer_made_past_its_checkpoint_are_dropped_though_the_run_stops_short_of_them(tmp_path):
    """A continued run of fewer steps: killed at v5 with its checkpoint at v2, resumed and
    finished at v3. v4 and v5 were withdrawn; the summary, the plots and the progress bars must
    not describe them."""
    store = open_run_store(StorageConfig(root=f"file://{tmp_path}"), "run")
    trainer = MetricsLog(store, "trainer", flush_seconds=0)
    for version in (1, 2, 3, 4, 5):
        trainer.log("train_step", **{k: v for k, v in step_record(version, 0.9, 100.0 + version).items() if k != "time"})
    trainer.log("resumed", version=2, disposed=8)
    trainer.log("train_step", **{k: v for k, v in step_record(3, 0.3, 200.0).items() if k != "time"})
    steps = train_steps(store)
    assert [(s["version"], s["reward_mean"]) for s in steps] == [(1, 0.9), (2, 0.9), (3, 0.3)]
    summary = write_summary(store, None, None)
    assert summary["steps"] == 3 and summary["reward_versions"] == [[1, 1], [3, 3]]
    assert kept_train_steps(read_metrics(store, "trainer")[:-1])[-1]["version"] == 2, "before the resumed trainer's first step"


def test_the_idle_fraction_covers_every_life_of_a_resumed_trainer(tmp_path):
    """A resumed trainer's running totals start at 0: the last record describes its life only."""
    store = open_run_store(StorageConfig(root=f"file://{tmp_path}"), "run")
    trainer = MetricsLog(store, "trainer", flush_seconds=0)
    first_life = [{"version": v, "reward_mean": 0.1, "step_seconds": 1.0, "wait_seconds": 0.0, "busy_seconds": v, "idle_seconds": 0.0}
                  for v in (1, 2, 3)]  # fmt: skip
    resumed = {"version": 4, "reward_mean": 0.1, "step_seconds": 1.0, "wait_seconds": 3.0, "busy_seconds": 1.0, "idle_seconds": 3.0}
    for record in [*first_life, resumed]:
        trainer.log("train_step", **record)
    assert write_summary(store, None, None)["trainer_idle_fraction"] == 3.0 / 7.0


def test_the_identity_sees_a_lost_shard(tmp_path):
    store = open_run_store(StorageConfig(root=f"file://{tmp_path}"), "run")
    generator = MetricsLog(store, "generator-gen0", flush_seconds=0)
    keys = [write_shard(store, make_rollouts(n=8, version=0), "gen0", slot).key for slot in range(3)]
    for slot, key in enumerate(keys):
        generator.log("group", slot=slot, key=key, samples=8, started_at=1.0, finished_at=2.0)
    ledger = Ledger(disposed={keys[0]: "trained"}, counts={"trained": 8, "dropped_stale": 0, "quarantined": 0, "duplicate": 0})
    store.write_atomic(LEDGER_KEY, json.dumps(ledger.to_json()).encode())
    assert accounting(store) | {"max_trained_lag": 0} == {
        "generated": 24, "trained": 8, "dropped_stale": 0, "dropped_no_signal": 0, "quarantined": 0, "duplicate": 0, "pending": 16,
        "identity_holds": True, "foreign_shards": 0, "groups_failed": 0, "max_trained_lag": 0,
    }  # fmt: skip
    store.delete(keys[2])  # a committed shard vanishes without the ledger knowing
    assert accounting(store)["identity_holds"] is False


def test_a_copy_of_a_shard_under_a_second_key_is_foreign_and_leaves_the_identity_whole(tmp_path):
    store = open_run_store(StorageConfig(root=f"file://{tmp_path}"), "run")
    generator = MetricsLog(store, "generator-gen0", flush_seconds=0)
    keys = [write_shard(store, make_rollouts(n=8, version=0), "gen0", slot).key for slot in range(2)]
    for slot, key in enumerate(keys):
        generator.log("group", slot=slot, key=key, samples=8, started_at=1.0, finished_at=2.0)
    copy = keys[0].replace("000000.parquet", "999999.parquet")
    store.put_if_absent(copy, store.read_bytes(keys[0]))
    # the learner read the copy first and trained it, then found the original a duplicate
    ledger = Ledger(disposed={copy: "trained", keys[0]: "duplicate"}, trained_groups=["s00000000"],
                    counts={"trained": 8, "dropped_stale": 0, "quarantined": 0, "duplicate": 8})  # fmt: skip
    store.write_atomic(LEDGER_KEY, json.dumps(ledger.to_json()).encode())
    counts = accounting(store)
    assert counts["foreign_shards"] == 1 and counts["identity_holds"], counts
    assert (counts["generated"], counts["trained"], counts["duplicate"], counts["pending"]) == (16, 0, 8, 8)
    rows = dict(summary_rows({**counts, "eval_before": None, "steps": 1, "reward_start": 0.0, "reward_end": 0.0, "trainer_idle_fraction": 0.0}))
    assert rows["shards no generator recorded"].startswith("1, left out of the counts above"), "shown, not in summary.json only"


def test_checkpoint_saves_count_as_the_trainers_time_and_skipped_steps_are_shown(tmp_path):
    store = open_run_store(StorageConfig(root=f"file://{tmp_path}"), "run")
    trainer = MetricsLog(store, "trainer", flush_seconds=0)
    for version in (1, 2):
        record = {k: v for k, v in step_record(version, 0.5, 0).items() if k != "time"}
        trainer.log("train_step", **record, skipped=float(version == 2))
    trainer.log("checkpoint", version=2, seconds=1.3)
    summary = write_summary(store, None, None)
    assert summary["trainer_idle_fraction"] == pytest.approx(0.4 / (0.4 + 1.0 + 1.3)), "a save is neither idle nor missing"
    assert dict(summary_rows(summary))["train steps"] == "2, 1 of them skipped: a gradient that was not finite, no update"


def test_the_timeline_of_a_resumed_run_starts_where_the_trainer_last_resumed():
    """A continued run's sessions can lie days apart: on one axis its steps would not show."""
    old = [{"version": 1, "time": 100.0, "step_seconds": 1.0, "wait_seconds": 1.0}]
    new = [{"version": 2, "time": 90_010.0, "step_seconds": 2.0, "wait_seconds": 3.0}]
    saves = [{"version": 2, "time": 90_011.0, "seconds": 1.0}]
    groups = [{"started_at": 97.0, "finished_at": 99.0}, {"started_at": 89_990.0, "finished_at": 90_004.0},
              {"started_at": 90_004.0, "finished_at": 90_008.0}]  # fmt: skip
    bars = timeline_bars(old + new, saves, groups, since=90_000.0)
    assert bars == {"busy": [(8.0, 2.0), (10.0, 1.0)], "waiting": [(5.0, 3.0)], "generating": [(0.0, 8.0)]}
    assert timeline_bars(old + new, saves, groups, since=None)["waiting"][0] == (1.0, 1.0), "a run never resumed: all of it"


def test_a_group_the_environment_failed_is_counted_apart_and_is_not_foreign(tmp_path):
    store = open_run_store(StorageConfig(root=f"file://{tmp_path}"), "run")
    generator = MetricsLog(store, "generator-gen0", flush_seconds=0)
    key = write_shard(store, make_rollouts(n=8, version=0), "gen0", 0).key
    generator.log("group", slot=0, key=key, samples=8, started_at=1.0, finished_at=2.0)
    failed = set_aside_group(store, 1, {"error": "QAEnv.step raised"})
    ledger = Ledger(disposed={key: "trained", failed: "quarantined"}, counts={"trained": 8, "dropped_stale": 0, "quarantined": 1, "duplicate": 0})
    store.write_atomic(LEDGER_KEY, json.dumps(ledger.to_json()).encode())
    counts = accounting(store)
    assert (counts["generated"], counts["trained"], counts["quarantined"], counts["identity_holds"]) == (8, 8, 0, True)
    assert (counts["foreign_shards"], counts["groups_failed"]) == (0, 1), "before, a failed group read as a foreign shard"
    rows = dict(summary_rows({**counts, "eval_before": None, "steps": 1, "reward_start": 0.0, "reward_end": 0.0, "trainer_idle_fraction": 0.0}))
    assert rows["groups failed"].startswith("1, set aside in quarantine/failed-groups/")


def test_the_summary_writes_both_plots(tmp_path):
    store = open_run_store(StorageConfig(root=f"file://{tmp_path}"), "run")
    trainer = MetricsLog(store, "trainer", flush_seconds=0)
    for version in (1, 2, 3):
        trainer.log("train_step", **{k: v for k, v in step_record(version, 0.1 * version, 0).items() if k != "time"})
    MetricsLog(store, "generator-gen0", flush_seconds=0).log("group", slot=0, key="k", samples=8, started_at=time.time() - 5, finished_at=time.time())
    summary = write_summary(store, {"score": 0.1, "solved": 0.0}, {"score": 0.3, "solved": 0.2})
    assert summary["steps"] == 3 and summary["eval_after"] == 0.3
    for plot in ("plots/reward.png", "plots/timeline.png"):
        assert store.read_bytes(plot)[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_run_without_evaluation_says_so_in_its_summary(tmp_path):
    store = open_run_store(StorageConfig(root=f"file://{tmp_path}"), "run")
    MetricsLog(store, "trainer", flush_seconds=0).log("train_step", **{k: v for k, v in step_record(1, 0.5, 0).items() if k != "time"})
    evaluated = dict(summary_rows(write_summary(store, {"score": 0.1, "solved": 0.0}, {"score": 0.3, "solved": 0.25})))
    assert evaluated["held-out eval score"] == "0.100 -> 0.300" and evaluated["held-out solved"] == "0.0% -> 25.0%"
    summary = write_summary(store, None, None)
    assert summary["eval_before"] is summary["eval_after"] is summary["solved_after"] is None
    rows = dict(summary_rows(summary))
    assert rows["held-out eval score"] == "not evaluated (env.eval_prompts is 0)"
    assert rows["samples"].endswith(": holds") and rows["train steps"] == "1"


def test_a_continued_runs_summary_says_which_versions_each_figure_covers(tmp_path):
    """A run continued from v10 to v20: its evaluations score the continuation, its batch rewards
    span every step trained since v1; the table must not set the two side by side unlabelled."""
    store = open_run_store(StorageConfig(root=f"file://{tmp_path}"), "run")
    trainer = MetricsLog(store, "trainer", flush_seconds=0)
    for version in range(1, 21):
        trainer.log("train_step", **{k: v for k, v in step_record(version, 0.01 * version, 0).items() if k != "time"})
    summary = write_summary(store, {"score": 0.4, "solved": 0.1, "version": 10}, {"score": 0.5, "solved": 0.2, "version": 20})
    assert summary["eval_versions"] == [10, 20] and summary["reward_versions"] == [[1, 2], [19, 20]]
    rows = dict(summary_rows(summary))
    assert rows["held-out eval score"] == "0.400 -> 0.500 (v10 -> v20)"
    assert rows["batch reward (first / last 10% of steps)"] == "0.015 -> 0.195 (v1-v2 / v19-v20)"


def test_busy_intervals_are_merged_where_they_overlap():
    assert _union([(5, 6), (0, 2), (1, 3), (3, 4)]) == [(0, 4), (5, 6)]


def test_a_metrics_tail_reads_only_what_was_written_since_and_starts_over_on_a_rewrite(store):
    log, tail = MetricsLog(store, "generator-gen0", flush_seconds=0), MetricsTail(store, "generator-gen0")
    assert tail.records() == []
    log.log("group", samples=8)
    log.log("group", samples=8)
    assert [r["samples"] for r in tail.records()] == [8, 8]
    read = tail.offset
    log.log("load", idle=0.5)
    assert [r["event"] for r in tail.records()] == ["group", "group", "load"] and tail.offset > read
    assert tail.records() == read_metrics(store, "generator-gen0"), "nothing new: nothing added"
    store.write_atomic("metrics/generator-gen0.jsonl", b'{"event": "other", "time": 1}\n')  # not a continuation
    assert [r["event"] for r in tail.records()] == ["other"]
    store.delete("metrics/generator-gen0.jsonl")
    assert tail.records() == []


def test_a_large_metrics_file_is_rewritten_less_often(file_store):
    log = MetricsLog(file_store, "generator-gen0", flush_seconds=0)
    log.log("group", samples=8)
    assert log.flush_interval() == 0 and len(read_metrics(file_store, "generator-gen0")) == 1, "small: every record"
    log.log("group", note="x" * 3_000_000)
    assert log.flush_interval() == pytest.approx(3.0, rel=0.01)
    log.log("group", samples=8)
    assert len(read_metrics(file_store, "generator-gen0")) == 1, "3 MB to write: not rewritten again within 3 s"
    log.flush()
    assert len(read_metrics(file_store, "generator-gen0")) == 3
