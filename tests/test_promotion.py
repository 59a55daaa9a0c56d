"""PROMOTED moves only on improvement over the best score recorded, and keeps its snapshot from
retention; recorded scores count only under the evaluation setup they were made with."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from configs.sections import StorageConfig
from tasks.envs import Environment, Prompt, StepResult
from tasks.promotion import PROMOTED_KEY, promote_if_better, read_promoted
from tasks.snapshots import pinned_versions


def test_nothing_promoted_until_retraining_beats_where_it_started(file_store):
    assert read_promoted(file_store) is None
    assert not promote_if_better(file_store, file_store, version=5, score=0.40, bar=0.50, setup="s")
    assert read_promoted(file_store) is None


def test_promoted_moves_only_to_a_higher_score(file_store):
    assert promote_if_better(file_store, file_store, version=5, score=0.60, bar=0.50, setup="s")
    assert (read_promoted(file_store).version, read_promoted(file_store).score, read_promoted(file_store).setup) == (5, 0.60, "s")
    assert 5 in pinned_versions(file_store), "retention must keep the promoted snapshot"
    bar = read_promoted(file_store).score
    assert not promote_if_better(file_store, file_store, version=9, score=0.60, bar=bar, setup="s"), "a tie does not move it"
    assert not promote_if_better(file_store, file_store, version=9, score=0.55, bar=bar, setup="s")
    assert not promote_if_better(file_store, file_store, version=9, score=float("nan"), bar=bar, setup="s")
    assert read_promoted(file_store).version == 5
    assert promote_if_better(file_store, file_store, version=9, score=0.70, bar=bar, setup="s")
    assert read_promoted(file_store).version == 9 and pinned_versions(file_store) == {9}


def test_a_promotion_recorded_before_setups_were_reads_as_of_no_setup(file_store):
    file_store.write_atomic(PROMOTED_KEY, json.dumps({"run_url": file_store.url, "version": 3, "score": 0.5, "at": 1.0}).encode())
    assert read_promoted(file_store).setup is None


def test_a_new_run_can_be_promoted_in_the_source_run(file_store, tmp_path):
    from infra.storage import open_run_store

    successor = open_run_store(StorageConfig(root=f"file://{tmp_path}/runs"), "successor")
    assert promote_if_better(file_store, successor, version=3, score=0.9, bar=0.5, setup="s")
    promoted = read_promoted(file_store)
    assert promoted.run_url == successor.url and promoted.version == 3
    assert pinned_versions(successor) == {3}


def test_with_nothing_promoted_a_retrain_must_beat_the_best_score_the_run_recorded(file_store, tmp_path):
    """demo scored 0.80 at v200; a first retrain ended at v220 with 0.70 and promoted nothing.
    A second, from v220, must still beat 0.80: where it started (0.70) would let it promote a
    model worse than one the run had. Scores under another evaluation setup (a `tandem eval
    --set` of other prompts) are not the run's."""
    from configs.schema import RunConfig
    from flows.retrain import _bar
    from infra.storage import open_run_store
    from tasks.evaluation import evaluation_setup
    from tasks.metrics import MetricsLog

    config = RunConfig.model_validate({"env": {"eval_prompts": 8}})
    setup = evaluation_setup(config)
    other = evaluation_setup(RunConfig.model_validate({"env": {"eval_prompts": 8}, "seed": 1}))
    records = MetricsLog(file_store, "evaluation", flush_seconds=0)
    records.log("evaluation", version=200, score=0.80, setup=setup)
    records.log("evaluation", version=220, score=0.70, setup=setup)
    records.log("evaluation", version=220, score=0.95, setup=other)
    records.log("evaluation", version=240, score=0.75, setup=setup)
    summary = {"eval_before": 0.70, "eval_after": 0.75}
    assert _bar(config, file_store, file_store, 240, summary) == 0.80
    assert not promote_if_better(file_store, file_store, 240, 0.75, _bar(config, file_store, file_store, 240, summary), setup)
    assert _bar(config, file_store, file_store, 200, summary) == 0.75, "the candidate's own score is not its bar"

    successor = open_run_store(StorageConfig(root=f"file://{tmp_path}/runs"), "successor")
    MetricsLog(successor, "evaluation", flush_seconds=0).log("evaluation", version=0, score=0.85, setup=setup)
    assert _bar(config, successor, file_store, 3, summary) == 0.85, "the successor's v0 and the source's records both count"
    fresh = open_run_store(StorageConfig(root=f"file://{tmp_path}/runs"), "fresh")
    assert _bar(config, fresh, fresh, 3, summary) == 0.70, "nothing recorded: where the retrain started"


class FileQAEnv(Environment):
    """Questions from a JSON file named by its `path` kwarg: a data set refreshed between nights."""

    def __init__(self, max_turns: int, path: str) -> None:
        super().__init__(max_turns)
        self.path = path

    def prompts(self, split, count, seed):
        rows = json.loads(Path(self.path).read_text())
        return [Prompt(f"q{i}", question, answer) for i, (question, answer) in enumerate(rows)][:count]

    def reset(self, prompt):
        return prompt.text

    def step(self, action):
        return StepResult("", 0.0, True, {})

    def demonstration(self, prompt):
        return []


def test_the_evaluation_setup_changes_with_the_held_out_prompts_a_data_refresh_brings(tmp_path):
    """Same seed, count and environment settings, other questions in the file: PROMOTED's score
    on yesterday's held-out prompts was compared with a candidate's on today's."""
    from configs.schema import RunConfig
    from tasks.evaluation import evaluation_setup

    data = tmp_path / "qa.json"
    data.write_text(json.dumps([["1 + 1", "2"], ["2 + 2", "4"]]))
    config = RunConfig.model_validate({"env": {"entrypoint": f"{__name__}:FileQAEnv", "kwargs": {"path": str(data)}, "eval_prompts": 2}})
    before = evaluation_setup(config)
    assert evaluation_setup(config) == before, "the same prompts, the same setup"
    data.write_text(json.dumps([["1 + 1", "2"], ["3 + 3", "6"]]))
    assert evaluation_setup(config) != before


def test_a_recorded_score_is_reused_only_under_the_same_evaluation_setup(file_store, tmp_path):
    """`tandem eval --set env.kwargs...` records a score of other prompts or rules: the run's next
    start must evaluate its snapshot again rather than take that score for its own."""
    from configs.schema import RunConfig
    from flows.pipeline import recorded_score
    from tasks.evaluation import evaluation_setup
    from tasks.metrics import MetricsLog
    from tasks.snapshots import publish_snapshot_dir

    snapshot = tmp_path / "v0"
    snapshot.mkdir()
    (snapshot / "config.json").write_text("{}")
    publish_snapshot_dir(file_store, snapshot, 0)
    config = RunConfig.model_validate({"env": {"eval_prompts": 8}})
    overridden = RunConfig.model_validate({"env": {"eval_prompts": 8, "max_turns": 1}})
    assert evaluation_setup(config) != evaluation_setup(overridden)
    MetricsLog(file_store, "evaluation", flush_seconds=0).log("evaluation", version=0, score=0.9, prompts=8, setup=evaluation_setup(overridden))
    assert recorded_score(config, file_store, 0) is None
    MetricsLog(file_store, "evaluation", flush_seconds=0).log("evaluation", version=0, score=0.3, prompts=8, setup=evaluation_setup(config))
    assert recorded_score(config, file_store, 0)["score"] == 0.3
    assert recorded_score(overridden, file_store, 0)["score"] == 0.9


def test_records_from_before_setups_were_recorded_are_of_another_setup(file_store, tmp_path):
    """They were scored on the held-out split that let operand-swapped twins of training problems
    in (tasks/evaluation.py HELD_OUT_SPLIT): counted by their prompt count, a leaky 0.9 set a bar
    that honest scores could not reach."""
    from configs.schema import RunConfig
    from flows.pipeline import recorded_score
    from flows.retrain import _bar
    from tasks.metrics import MetricsLog

    from tasks.snapshots import publish_snapshot_dir

    (snapshot := tmp_path / "v0").mkdir()
    (snapshot / "config.json").write_text("{}")
    publish_snapshot_dir(file_store, snapshot, 0)
    config = RunConfig.model_validate({"env": {"eval_prompts": 8}})
    MetricsLog(file_store, "evaluation", flush_seconds=0).log("evaluation", version=0, score=0.9, prompts=8)
    assert _bar(config, file_store, file_store, 5, {"eval_before": 0.4}) == 0.4
    assert recorded_score(config, file_store, 0) is None


def test_a_promoted_score_of_another_setup_is_measured_again_under_this_one(file_store, tmp_path):
    """PROMOTED kept the score of its own setup: a retrain evaluated on other prompts compared with
    it, and lost to a leaky score for good (or beat one that was harder). Its snapshot is scored
    under the retrain's setup (here a score already recorded for it) and PROMOTED records that."""
    from configs.schema import RunConfig
    from flows.retrain import _promoted_run, _rescored
    from tasks.evaluation import evaluation_setup
    from tasks.metrics import MetricsLog
    from tasks.promotion import Promotion
    from tasks.rundir import write_run_config
    from tasks.snapshots import publish_snapshot_dir

    config = RunConfig.model_validate({"run_id": "run-test", "storage": {"root": file_store.url.rsplit("/", 1)[0]},
                                       "env": {"eval_prompts": 8}})  # fmt: skip
    write_run_config(file_store, config)
    snapshot = tmp_path / "v5"
    snapshot.mkdir()
    (snapshot / "config.json").write_text("{}")
    publish_snapshot_dir(file_store, snapshot, 5)
    MetricsLog(file_store, "evaluation", flush_seconds=0).log("evaluation", version=5, score=0.42, setup=evaluation_setup(config))
    leaky = Promotion(file_store.url, 5, 0.9, at=1.0, setup=None)
    file_store.write_atomic(PROMOTED_KEY, json.dumps(dataclasses.asdict(leaky)).encode())
    assert _promoted_run(leaky, config, file_store, []) == config
    rescored = _rescored(leaky, config, config, file_store)
    assert rescored == read_promoted(file_store) == Promotion(file_store.url, 5, 0.42, at=1.0, setup=evaluation_setup(config))


def test_a_promoted_snapshot_that_is_gone_compares_as_nothing_promoted_whatever_its_setup(file_store, tmp_path):
    """Only a promoted score of another setup led to a look at its snapshot: one deleted (its run
    directory removed, or retention after a lost pin) stayed the bar, and PROMOTED named weights
    nobody could load until a candidate beat a score nobody could measure again."""
    from configs.schema import RunConfig
    from flows.retrain import _promoted_run
    from tasks.promotion import Promotion
    from tasks.rundir import write_run_config

    config = RunConfig.model_validate({"run_id": "run-test", "storage": {"root": file_store.url.rsplit("/", 1)[0]}})
    write_run_config(file_store, config)
    assert _promoted_run(Promotion(file_store.url, 7, 0.9, at=1.0, setup="s"), config, file_store, []) is None
    deleted_run = Promotion(file_store.url.rsplit("/", 1)[0] + "/deleted", 3, 0.9, at=1.0, setup="s")
    assert _promoted_run(deleted_run, config, file_store, []) is None


def test_a_promoted_run_whose_config_does_not_load_fails_the_retrain_rather_than_counting_as_gone(file_store, tmp_path):
    """Taken for gone, its score stopped being the bar, and a worse candidate could replace it."""
    from configs import ConfigError
    from configs.schema import RunConfig
    from flows.retrain import _promoted_run
    from infra.storage import open_run_store
    from tasks.promotion import Promotion
    from tasks.rundir import CONFIG_KEY

    root = file_store.url.rsplit("/", 1)[0]
    config = RunConfig.model_validate({"run_id": "run-test", "storage": {"root": root}})
    open_run_store(config.storage, "damaged").write_atomic(CONFIG_KEY, b"{not json")
    with pytest.raises(ConfigError, match="is not JSON"):
        _promoted_run(Promotion(f"{root}/damaged", 3, 0.9, at=1.0, setup="s"), config, file_store, [])


def test_a_snapshot_promoted_by_two_runs_keeps_a_pin_for_each_and_a_move_drops_the_old_one(file_store, tmp_path):
    """A successor's v25 promoted in its source run, then the successor's own PROMOTED promoting
    its v45: under one pin name the second moved the first off v25, which the successor's
    retention then deleted under the source's PROMOTED. When the source's PROMOTED moves on, the
    successor's pin of v25 goes (it was kept for good)."""
    from infra.storage import open_run_store

    successor = open_run_store(StorageConfig(root=f"file://{tmp_path}/runs"), "successor")
    assert promote_if_better(file_store, successor, version=25, score=0.8, bar=0.5, setup="s")
    assert promote_if_better(successor, successor, version=45, score=0.9, bar=0.5, setup="s")
    assert pinned_versions(successor) == {25, 45}
    assert promote_if_better(file_store, file_store, version=60, score=0.95, bar=0.8, setup="s", previous_store=successor)
    assert pinned_versions(successor) == {45} and pinned_versions(file_store) == {60}
    assert promote_if_better(file_store, successor, version=70, score=0.99, bar=0.95, setup="s", previous_store=file_store)
    assert pinned_versions(file_store) == set() and pinned_versions(successor) == {45, 70}


def test_a_score_recorded_as_null_is_never_reused_nor_a_bar(file_store, tmp_path):
    """An earlier version recorded a NaN score as null: reused, it was printed with :.3f and
    compared with <=, and both raised TypeError on every later retrain."""
    from configs.schema import RunConfig
    from flows.pipeline import recorded_score
    from flows.retrain import _bar
    from tasks.evaluation import evaluation_setup
    from tasks.metrics import MetricsLog
    from tasks.snapshots import publish_snapshot_dir

    (snapshot := tmp_path / "v0").mkdir()
    (snapshot / "config.json").write_text("{}")
    publish_snapshot_dir(file_store, snapshot, 0)
    config = RunConfig.model_validate({"env": {"eval_prompts": 8}})
    MetricsLog(file_store, "evaluation", flush_seconds=0).log("evaluation", version=0, score=None, setup=evaluation_setup(config))
    assert recorded_score(config, file_store, 0) is None
    assert _bar(config, file_store, file_store, 5, {"eval_before": 0.4}) == 0.4


def test_a_run_retrained_past_the_groups_a_run_may_number_is_told_to_go_on_under_a_new_id(file_store):
    """Each night adds its steps to the run's: past the six-digit shard keys' limit every retrain
    failed with the config check's message, which says nothing of retraining."""
    import pytest

    from configs.schema import RunConfig
    from flows.retrain import _continued

    source = RunConfig.model_validate({"training": {"prompts_per_step": 1000, "steps": 900}})
    assert _continued(source, file_store, 900).training.steps == 900
    with pytest.raises(ValueError, match=r"1000 more would number more prompt groups than one run may \(999,999\)\. Retrain it with new_run_id"):
        _continued(source, file_store, 1000)


def test_a_successor_starts_from_the_sources_newest_snapshot_pinned_while_it_is_fetched(file_store, tmp_path, monkeypatch):
    """The source may still be training: unpinned, its newest snapshot could be retired mid-fetch."""
    import flows.retrain
    from tasks.snapshots import publish_snapshot_dir

    for version in (0, 1):
        (snapshot := tmp_path / f"v{version}").mkdir()
        (snapshot / "config.json").write_text(json.dumps({"version": version}))
        publish_snapshot_dir(file_store, snapshot, version)
    fetch, pinned_during_fetch = flows.retrain.load_snapshot, []

    def watched(store, cache, version):
        pinned_during_fetch.extend(pinned_versions(store))
        return fetch(store, cache, version)

    monkeypatch.setattr(flows.retrain, "load_snapshot", watched)
    base, model_dir = flows.retrain._fetch_base(file_store, "next", tmp_path / "cache")
    assert base == 1 and json.loads((model_dir / "config.json").read_text()) == {"version": 1}
    assert pinned_during_fetch == [1] and pinned_versions(file_store) == set(), "pinned while fetched, then let go"


def test_retraining_a_run_started_without_held_out_prompts_says_what_to_do_instead(tmp_path):
    from configs.schema import RunConfig
    from flows.retrain import retrain
    from infra.storage import open_run_store
    from tasks.rundir import write_run_config

    config = RunConfig.model_validate({"run_id": "r0", "storage": {"root": f"file://{tmp_path}"}, "env": {"eval_prompts": 0}})
    write_run_config(open_run_store(config.storage, "r0"), config)
    with pytest.raises(ValueError, match=r"started with env.eval_prompts 0.*--set env.eval_prompts=200\) and retrain that one"):
        retrain.fn(run_id="r0", steps=1, storage_root=f"file://{tmp_path}")
