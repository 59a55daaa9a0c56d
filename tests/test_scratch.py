"""Scratch directories go when the work in them succeeds and stay, for their logs, when it fails."""

from __future__ import annotations

import pytest

from infra.scratch import scratch_dir


def test_a_scratch_directory_is_removed_after_success_and_kept_after_a_failure(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # re-read TMPDIR
    with scratch_dir("tandem-ok-") as ok:
        (ok / "weights").mkdir()
    assert not ok.exists()
    with pytest.raises(RuntimeError), scratch_dir("tandem-failed-") as failed:
        (failed / "engine.log").write_text("why it failed")
        raise RuntimeError("boom")
    assert (failed / "engine.log").read_text() == "why it failed"
