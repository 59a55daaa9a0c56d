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
        (failed / "logs").mkdir()
        (failed / "logs" / "engine.log").write_text("why it failed")
        (failed / "weights" / "v00000003").mkdir(parents=True)
        (failed / "weights" / "v00000003" / "model.safetensors").write_bytes(b"gigabytes")
        raise RuntimeError("boom")
    assert (failed / "logs" / "engine.log").read_text() == "why it failed"
    assert not (failed / "weights" / "v00000003" / "model.safetensors").exists(), (
        "the weights go: a restart on this machine needs their space")
