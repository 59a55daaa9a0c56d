"""Smoke test of benchmarks/engine.py: it runs end to end and reports in its documented format.

No timing is asserted: the machine running the tests may be busy with anything.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def test_engine_benchmark_quick_run_reports_table_json_and_ratios(tmp_path):
    out = tmp_path / "engine.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "engine.py"), "--quick", "--out", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()

    assert "| mode | concurrency | tokens/s | vs sequential | vs batched generate |" in lines
    rows = [line for line in lines if line.startswith("| ") and "---" not in line][1:]
    assert [row.split("|")[1].strip() for row in rows] == ["sequential generate", "batched generate"] + ["engine"] * 3
    assert [int(row.split("|")[2]) for row in rows] == [1, 32, 1, 8, 32]

    speedup, ceiling = lines[-2], lines[-1]
    assert speedup.startswith("speedup_at_32: ") and float(speedup.split(": ")[1]) > 0
    assert ceiling.startswith("ceiling_ratio_at_32: ") and float(ceiling.split(": ")[1]) > 0

    results = json.loads(out.read_text())
    assert [(r["mode"], r["concurrency"]) for r in results["rows"]] == [
        ("sequential generate", 1), ("batched generate", 32), ("engine", 1), ("engine", 8), ("engine", 32),
    ]  # fmt: skip
    assert all(r["tokens_per_s"] > 0 for r in results["rows"])
    assert results["speedup_at_32"] == pytest.approx(float(speedup.split(": ")[1]), abs=0.01)
    assert results["ceiling_ratio_at_32"] == pytest.approx(float(ceiling.split(": ")[1]), abs=0.01)
