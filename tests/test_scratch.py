"""Scratch directories go when the work in them succeeds and stay, for their logs, when it fails."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from infra.scratch import scratch_dir, sweep_orphaned_scratch

REPO = Path(__file__).resolve().parents[1]


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


HOLD_SCRATCH = """
import os, signal, sys, time
from infra.scratch import scratch_dir
with scratch_dir("tandem-gen0-") as path:
    (path / "logs").mkdir()
    (path / "logs" / "engine.log").write_text("its last words")
    (path / "model.safetensors").write_bytes(b"gigabytes")
    print(path, flush=True)
    if sys.argv[1] == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)
"""


def test_a_killed_processs_scratch_is_emptied_but_for_its_logs_when_the_next_one_is_made(tmp_path, monkeypatch):
    """SIGKILL (the OOM killer, a preemption) runs no cleanup: each killed generator left a copy
    of the weights in the temporary directory, and on file:// a link that kept retired snapshots'
    space. A live process's directory is left alone."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    run = lambda how: subprocess.Popen([sys.executable, "-c", HOLD_SCRATCH, how], cwd=REPO, stdout=subprocess.PIPE, text=True)  # noqa: E731
    alive = run("live")
    try:
        alive_dir = Path(alive.stdout.readline().strip())
        killed = run("die")  # after: the live one's own sweep would have emptied it
        killed_dir = Path(killed.stdout.readline().strip())
        assert killed.wait(timeout=30) == -signal.SIGKILL and (killed_dir / "model.safetensors").exists()
        with scratch_dir("tandem-gen0-") as mine:
            assert (mine / ".owner").exists()
        assert not (killed_dir / "model.safetensors").exists(), "the dead process's weights are removed"
        assert (killed_dir / "logs" / "engine.log").read_text() == "its last words"
        assert (alive_dir / "model.safetensors").exists(), "a live process's directory is its own"
        assert sweep_orphaned_scratch(tmp_path) == [], "swept once"
    finally:
        alive.kill()
        alive.wait()


def test_a_scratch_directory_from_before_the_last_boot_is_emptied_though_its_pid_runs_again(tmp_path):
    """A pid is reused, across boots too: the owner's boot and start time tell them apart."""
    import json
    import os

    from infra.scratch import _owner

    old = tmp_path / "tandem-gen0-old"
    old.mkdir()
    (old / "model.safetensors").write_bytes(b"gigabytes")
    (old / ".owner").write_text(json.dumps(_owner(os.getpid()) | {"boot": "an earlier boot"}))
    mine = tmp_path / "tandem-gen0-mine"
    mine.mkdir()
    (mine / "model.safetensors").write_bytes(b"in use")
    (mine / ".owner").write_text(json.dumps(_owner(os.getpid())))
    assert sweep_orphaned_scratch(tmp_path) == [old]
    assert not (old / "model.safetensors").exists() and (mine / "model.safetensors").exists()
