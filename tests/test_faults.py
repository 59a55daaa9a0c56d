"""The quick fault matrix survives: an engine, a Dask worker and the trainer SIGKILLed, and
SeaweedFS down for 10 s, each in a run of its own (benchmarks/faults.py --quick). Survival is
judged from the run directory: finished, the accounting identity, nothing trained twice, nothing
trained past max_lag. Its timings are reported, not asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.faults, pytest.mark.slow, pytest.mark.s3, pytest.mark.timeout(1200)]


def test_the_quick_fault_matrix_survives_every_fault(tmp_path: Path):
    out = tmp_path / "faults.json"
    done = subprocess.run([sys.executable, "benchmarks/faults.py", "--quick", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=1100)  # fmt: skip
    lines = done.stdout.strip().splitlines()
    assert lines and lines[-1] == "faults_survived: 4/4", f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    assert done.returncode == 0
    report = json.loads(out.read_text())
    rows = {row["fault"]: row for row in report["rows"]}
    assert list(rows) == ["engine SIGKILL", "Dask worker SIGKILL", "trainer SIGKILL, resumed", "SeaweedFS down 10 s"]
    for row in rows.values():
        assert row["survived"] and row["identity_holds"] and row["trained_twice"] == 0 and row["lag_violations"] == 0, row
        assert row["steps"] == report["steps"], "every run trained all its steps"
        # a step trained after the fault; it may follow at once (0.0 s) when rollouts were
        # already committed, as a killed Dask worker's batch often is
        assert row["recovery_seconds"] is not None, row
    assert any("engine restarted on v" in event and "on v0" not in event for event in rows["engine SIGKILL"]["recovery"])
    assert any("resumed from the step-" in event for event in rows["trainer SIGKILL, resumed"]["recovery"])
    assert rows["SeaweedFS down 10 s"]["recovery_seconds"] >= 10, "no step can be trained while storage is down"
    table = [line for line in lines if line.startswith("| ") and "---" not in line]
    assert len(table) == 1 + 4
