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
