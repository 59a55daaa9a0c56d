"""PROMOTED moves only on improvement over the best score recorded, and keeps its snapshot from
retention; recorded scores count only under the evaluation setup they were made with."""

from __future__ import annotations

from configs.schema import StorageConfig
from tasks.promotion import promote_if_better, read_promoted
from tasks.snapshots import pinned_versions


def test_nothing_promoted_until_retraining_beats_where_it_started(file_store):
    assert read_promoted(file_store) is None
    assert not promote_if_better(file_store, file_store, version=5, score=0.40, baseline=0.50)
    assert read_promoted(file_store) is None


def test_promoted_moves_only_to_a_higher_score(file_store):
    assert promote_if_better(file_store, file_store, version=5, score=0.60, baseline=0.50)
    assert (read_promoted(file_store).version, read_promoted(file_store).score) == (5, 0.60)
    assert 5 in pinned_versions(file_store), "retention must keep the promoted snapshot"
    assert not promote_if_better(file_store, file_store, version=9, score=0.60, baseline=0.0), "a tie does not move it"
    assert not promote_if_better(file_store, file_store, version=9, score=0.55, baseline=0.0)
    assert read_promoted(file_store).version == 5
    assert promote_if_better(file_store, file_store, version=9, score=0.70, baseline=0.0)
    assert read_promoted(file_store).version == 9 and pinned_versions(file_store) == {9}


def test_a_new_run_can_be_promoted_in_the_source_run(file_store, tmp_path):
    from infra.storage import open_run_store

    successor = open_run_store(StorageConfig(root=f"file://{tmp_path}/runs"), "successor")
    assert promote_if_better(file_store, successor, version=3, score=0.9, baseline=0.5)
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
    assert not promote_if_better(file_store, file_store, 240, 0.75, _bar(config, file_store, file_store, 240, summary))
    assert _bar(config, file_store, file_store, 200, summary) == 0.75, "the candidate's own score is not its bar"

    successor = open_run_store(StorageConfig(root=f"file://{tmp_path}/runs"), "successor")
    MetricsLog(successor, "evaluation", flush_seconds=0).log("evaluation", version=0, score=0.85, setup=setup)
    assert _bar(config, successor, file_store, 3, summary) == 0.85, "the successor's v0 and the source's records both count"
    fresh = open_run_store(StorageConfig(root=f"file://{tmp_path}/runs"), "fresh")
    assert _bar(config, fresh, fresh, 3, summary) == 0.70, "nothing recorded: where the retrain started"


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


def test_records_from_before_setups_were_recorded_count_by_their_prompt_count(file_store):
    """A run evaluated before this digest existed: its scores still set the bar (a successor
    finished then, compared now, was otherwise promoted whatever it scored)."""
    from configs.schema import RunConfig
    from flows.retrain import _bar
    from tasks.metrics import MetricsLog

    config = RunConfig.model_validate({"env": {"eval_prompts": 8}})
    records = MetricsLog(file_store, "evaluation", flush_seconds=0)
    records.log("evaluation", version=0, score=0.6, prompts=8)
    records.log("evaluation", version=1, score=0.9, prompts=4)
    assert _bar(config, file_store, file_store, 5, {"eval_before": None}) == 0.6
