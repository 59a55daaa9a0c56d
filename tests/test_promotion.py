"""PROMOTED moves only on improvement, and keeps its snapshot from retention."""

from __future__ import annotations

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
    from configs.schema import StorageConfig
    from infra.storage import open_run_store

    successor = open_run_store(StorageConfig(root=f"file://{tmp_path}/runs"), "successor")
    assert promote_if_better(file_store, successor, version=3, score=0.9, baseline=0.5)
    promoted = read_promoted(file_store)
    assert promoted.run_url == successor.url and promoted.version == 3
    assert pinned_versions(successor) == {3}


def test_a_successor_retrain_must_beat_its_v0_score_where_nothing_is_promoted(file_store, tmp_path):
    """Continued after a failed attempt, a successor's opening evaluation scores where that
    attempt stopped: the bar is its v0's recorded score (a number, as promote_if_better takes)."""
    from configs.schema import RunConfig
    from flows.retrain import _baseline
    from tasks.metrics import MetricsLog
    from tasks.snapshots import publish_snapshot_dir

    snapshot = tmp_path / "v0"
    snapshot.mkdir()
    (snapshot / "config.json").write_text("{}")
    publish_snapshot_dir(file_store, snapshot, 0)
    config = RunConfig.model_validate({"env": {"eval_prompts": 8}})
    resumed_at = {"eval_before": 0.6}
    assert _baseline(config, file_store, resumed_at, continued=False) == 0.6, "no v0 score recorded"
    MetricsLog(file_store, "evaluation", flush_seconds=0).log("evaluation", version=0, score=0.2, prompts=8)
    assert _baseline(config, file_store, resumed_at, continued=False) == 0.2
    assert _baseline(config, file_store, resumed_at, continued=True) == 0.6, "a continued run is judged from where it resumed"
    assert promote_if_better(file_store, file_store, version=3, score=0.5, baseline=_baseline(config, file_store, resumed_at, False))
