"""End to end: a few steps of the tiny pipeline, in a fresh process, on the embedded default."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from configs import TINY_CONFIG
from flows.cli import run_command
from configs.sections import StorageConfig
from flows.pipeline import INTERRUPT_GRACE_SECONDS, score_snapshot
from infra.prefect_server import descendants
from infra.storage import open_run_store
from tasks.lease import check_run_free, read_lease
from tasks.snapshots import publish_snapshot_dir, withdraw_after
from tasks.rundir import load_run_config
from tasks.envs import Environment, Prompt, Segment, StepResult

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


E2E_RUN = [
    "run_id=e2e", "training.steps=3", "training.warmup_steps=5", "training.prompts_per_step=4",
    "generation.prompts_per_chunk=2", "env.eval_prompts=8", "training.checkpoint_every=2", "lag.max_lag=1",
    "dask.n_workers=1", "training.kl_coef=0.05",
]  # fmt: skip


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    run_pipeline(root, [*E2E_RUN, f"storage.root=file://{root}"])
    return root / "e2e"


class CopyEnv(Environment):
    """A user's own environment, loaded by import path: repeat the prompt's letters."""

    def __init__(self, max_turns: int, length: int = 3) -> None:
        super().__init__(max_turns)
        self.length = length

    def prompts(self, split, count, seed):
        letters = "abcdefghijklmnopqrstuvwxyz"
        texts = [" ".join(letters[(i + j * 7 + (split == "eval") * 3) % 26] for j in range(self.length)) for i in range(count)]
        return [Prompt(f"{split}-{i}", text, text) for i, text in enumerate(texts)]

    def reset(self, prompt):
        self.prompt = prompt
        return prompt.text

    def step(self, action):
        return StepResult("", float(action.split() == self.prompt.answer.split()), True, {})

    def demonstration(self, prompt):
        return [Segment(f"{prompt.answer} <eos>", from_model=True)]


class FlakyCopyEnv(CopyEnv):
    """CopyEnv whose tool fails on every third training prompt, as a sandbox that refuses some tasks."""

    def step(self, action):
        if self.prompt.prompt_id in {f"train-{i}" for i in range(1, 100, 3)}:
            raise TimeoutError(f"sandbox for {self.prompt.prompt_id} did not answer")
        return super().step(action)


def run_pipeline(root: Path, overrides: list[str]) -> None:
    """`tandem run` in a process of its own, with its temporary files under root/scratch."""
    (root / "scratch").mkdir(exist_ok=True)
    env = os.environ | {"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "TMPDIR": str(root / "scratch")}
    done = subprocess.run(
        run_command(TINY_CONFIG, overrides),
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]


def records(run: Path, component: str) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics" / f"{component}.jsonl").read_text().splitlines()]


def test_a_finished_run_leaves_no_scratch_directory_behind(finished_run: Path):
    """The trainer, the generator and each evaluation copy the weights to a scratch directory
    of their own; a run that succeeds removes them (infra/scratch.py)."""
    assert not sorted(p.name for p in (finished_run.parent / "scratch").glob("tandem-*"))


def test_run_trains_to_the_step_count_and_accounts_for_every_sample(finished_run: Path):
    summary = json.loads((finished_run / "summary.json").read_text())
    assert summary["steps"] == 3
    assert summary["identity_holds"], summary
    assert summary["generated"] == summary["trained"] + summary["dropped_stale"] + summary["dropped_no_signal"] + summary["quarantined"] + summary["duplicate"] + summary["pending"]
    assert summary["trained"] == 3 * 4 * 8
    assert summary["max_trained_lag"] <= 1
    assert (finished_run / "plots" / "reward.png").stat().st_size > 0


def test_run_directory_holds_shards_snapshots_checkpoints_and_metrics(finished_run: Path):
    assert json.loads((finished_run / "weights" / "LATEST").read_text()) == {"version": 3}
    for version in range(4):
        assert (finished_run / "weights" / f"v{version:08d}" / "MANIFEST.json").exists()
    assert (finished_run / "checkpoints" / "step00000002" / "MANIFEST.json").exists()
    assert (finished_run / "checkpoints" / "step00000003" / "MANIFEST.json").exists()
    assert list((finished_run / "rollouts").glob("v*/gen0-*.parquet"))
    steps = [r for r in records(finished_run, "trainer") if r["event"] == "train_step"]
    assert [r["version"] for r in steps] == [1, 2, 3]
    assert all(r["lag_max"] <= 1 for r in steps)
    assert steps[0]["kl"] < 1e-6 < steps[-1]["kl"], "the KL term measures the policy against v0"
    assert not list((finished_run / "weights" / "pins").glob("*.json")), "a finished run holds no snapshot"
    assert read_lease(open_run_store(StorageConfig(root=f"file://{finished_run.parent}"), finished_run.name)) is None, "a finished pipeline releases its run"
    evaluations = records(finished_run, "evaluation")
    assert [e["version"] for e in evaluations] == [0, 3]


def test_a_continued_run_keeps_the_score_its_start_version_has(finished_run: Path):
    """A resumed or retrained run starts from the version the last closing evaluation scored: the
    pipeline takes that score instead of booting an engine to score it again."""
    recorded = (finished_run / "metrics" / "evaluation.jsonl").read_bytes()
    config = load_run_config(f"file://{finished_run}")
    store = open_run_store(config.storage, config.run_id)
    assert score_snapshot(config, store) == records(finished_run, "evaluation")[-1]
    assert (finished_run / "metrics" / "evaluation.jsonl").read_bytes() == recorded, "not scored again"
    assert score_snapshot(config.model_copy(update={"env": config.env.model_copy(update={"eval_prompts": 0})}), store) is None


def test_a_score_of_a_withdrawn_snapshot_is_not_taken_for_the_one_published_again(finished_run: Path, tmp_path: Path, monkeypatch):
    """v3 was scored, then withdrawn (a trainer resumed from an earlier checkpoint) and published
    again with other weights: the score recorded before is not its."""
    import flows.pipeline

    copy = tmp_path / finished_run.name
    shutil.copytree(finished_run, copy)
    config = load_run_config(f"file://{copy}")
    store = open_run_store(config.storage, config.run_id)
    assert score_snapshot(config, store)["version"] == 3, "scored by the closing evaluation"
    assert withdraw_after(store, 2) == [3]
    time.sleep(1.1)  # the manifest's time is in whole seconds
    publish_snapshot_dir(store, copy / "weights" / "v00000002", 3)  # other weights under the number
    monkeypatch.setattr(flows.pipeline, "evaluation", lambda config, version: {"event": "evaluation", "version": version, "new": True})
    assert score_snapshot(config, store) == {"event": "evaluation", "version": 3, "new": True}


def test_a_finished_run_started_again_says_it_has_nothing_to_train(finished_run: Path):
    trained = (finished_run / "metrics" / "trainer.jsonl").read_bytes()
    again = subprocess.run(run_command(TINY_CONFIG, [*E2E_RUN, f"storage.root=file://{finished_run.parent}"]),
                           cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert again.returncode == 0, again.stdout + again.stderr
    assert "run e2e has trained 3 steps already (training.steps is 3): nothing to train" in again.stdout
    assert "--set training.steps=6" in again.stdout
    assert (finished_run / "metrics" / "trainer.jsonl").read_bytes() == trained


def test_engines_moved_to_new_weights_mid_run(finished_run: Path):
    generator = records(finished_run, "generator-gen0")
    loaded = [r["version"] for r in generator if r["event"] == "weights_loaded"]
    assert loaded and loaded == sorted(loaded) and max(loaded) >= 2
    groups = [r for r in generator if r["event"] == "group"]
    assert {r["policy_version"] for r in groups} > {0}, "every group came from v0: engines never updated"


def test_a_custom_environment_runs_by_import_path_and_its_failures_cost_only_their_groups(tmp_path: Path):
    """Before, the first group the environment failed failed its chunk three times and the run."""
    run_pipeline(tmp_path, [
        "run_id=custom", f"storage.root=file://{tmp_path}", "env.entrypoint=tests.test_pipeline:FlakyCopyEnv", "env.kwargs={}",
        "env.kwargs.length=4", "env.max_turns=1", "training.steps=2", "training.warmup_steps=3",
        "training.prompts_per_step=2", "generation.prompts_per_chunk=2", "env.eval_prompts=0", "dask.n_workers=1",
    ])  # fmt: skip
    run = tmp_path / "custom"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["identity_holds"]
    assert summary["groups_failed"] >= 1 and summary["trained"] == 2 * 2 * 8, "the failed groups were replaced"
    failed = [r for r in records(run, "generator-gen0") if r["event"] == "group_failed"]
    assert failed and all("FlakyCopyEnv.step on prompt train-" in r["error"] and "raised TimeoutError" in r["error"] for r in failed)
    assert summary["groups_failed"] == len({r["key"] for r in failed}), "the summary counts what the generator set aside"
    assert summary["eval_before"] is None and not (run / "metrics" / "evaluation.jsonl").exists(), "eval_prompts 0: no evaluation"
    shards = list((run / "rollouts").glob("v*/*.parquet"))
    assert shards and {pq.read_table(s, columns=["env"])["env"][0].as_py() for s in shards} == {"FlakyCopyEnv"}
    prompt = pq.read_table(shards[0], columns=["prompt_ids"])["prompt_ids"][0].as_py()
    assert 3 not in prompt, "the custom prompts are in the vocabulary (no <unk>)"


@pytest.mark.parametrize(("whom", "signum"), [
    ("process", signal.SIGINT), ("process group", signal.SIGINT), ("process, twice", signal.SIGINT),
    ("process", signal.SIGTERM), ("process group", signal.SIGTERM),
], ids=["process", "process group", "process, twice", "process SIGTERM", "process group SIGTERM"])  # fmt: skip
def test_an_interrupted_run_stops_its_children_and_exits(tmp_path: Path, whom: str, signum: int):
    """Ctrl-C while the trainer and the generator work. To the process alone, its children stop
    (the trainer told by a stop request, the generator by the trainer's done mark) and it exits
    within seconds. To the whole process group, as a terminal sends it, the Dask workers and
    Prefect's temporary server die with it, so a child may never stop: it exits after the grace.
    A second Ctrl-C exits at once, without Python's shutdown. Each way with 130 and no process of
    its own left (the engines exit with it, and Prefect's temporary server is stopped). Before, it
    hung for good, its engine still up; and an exit without the shutdown, after the grace or on a
    second Ctrl-C, left Prefect's temporary server running. Small steps (4 prompts), so that a
    trainer on two busy cores ends the step under way well within the grace. SIGTERM (a `kill`, a
    service or container stop) the same, with 143: before, Prefect's own handling of it left its
    temporary server running (to the process) or retried its crash report for minutes against the
    server gone (to the group)."""
    (tmp_path / "scratch").mkdir()
    overrides = [f"storage.root=file://{tmp_path}", "run_id=interrupted", "training.steps=500", "training.warmup_steps=0",
                 "training.prompts_per_step=4", "env.eval_prompts=0", "dask.n_workers=1"]  # fmt: skip
    env = os.environ | {"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "TMPDIR": str(tmp_path / "scratch")}
    log = (tmp_path / "run.log").open("w")
    # SIGINT reset in the child: started from a background job without job control (`cmd &` in
    # a script), it inherits SIGINT ignored, and Python then never raises KeyboardInterrupt.
    run = subprocess.Popen(run_command(TINY_CONFIG, overrides), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
                           start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    trainer_state = tmp_path / "interrupted" / "lag" / "trainer.json"
    try:
        deadline = time.monotonic() + 300
        while not (trainer_state.exists() and json.loads(trainer_state.read_text())["version"] >= 2):
            assert run.poll() is None and time.monotonic() < deadline, (tmp_path / "run.log").read_text()[-3000:]
            time.sleep(0.5)
        assert read_lease(open_run_store(StorageConfig(root=f"file://{tmp_path}"), "interrupted"))["pid"] == run.pid, "the run holds its lease"
        interrupted = time.monotonic()
        os.killpg(run.pid, signum) if whom == "process group" else run.send_signal(signum)
        if whom == "process, twice":
            while "interrupted: waiting" not in (tmp_path / "run.log").read_text():
                assert time.monotonic() - interrupted < 30, "the first Ctrl-C is taken"
                time.sleep(0.1)
            run.send_signal(signal.SIGINT)
        returncode = run.wait(timeout=INTERRUPT_GRACE_SECONDS + 30)
        took = time.monotonic() - interrupted
        engines = [e["pid"] for r in records(tmp_path / "interrupted", "generator-gen0") if r["event"] == "engines_started" for e in r["engines"]]
        left = lingering([run.pid], engines, timeout=15)
    finally:
        with contextlib.suppress(ProcessLookupError):  # the run's group: the run, or what it left behind
            os.killpg(run.pid, signal.SIGKILL)
    output = (tmp_path / "run.log").read_text()
    assert returncode == 128 + signum, output[-3000:]
    assert engines and not left, f"processes of the run still alive 15 s after it exited: {left}"
    why = "was interrupted" if signum == signal.SIGINT else "was sent SIGTERM"
    assert f"stopping the trainer and generators: the pipeline {why}" in output
    check_run_free(open_run_store(StorageConfig(root=f"file://{tmp_path}"), "interrupted"))  # "start it again to resume"
    if whom == "process, twice":
        assert "exiting: interrupted again" in output, output[-3000:]
    if whom == "process":
        assert "did not stop within" not in output, f"its children did not stop by themselves ({took:.1f} s)"
        assert json.loads(trainer_state.read_text())["done"] is True, "the trainer marked itself done"


def test_sigterm_during_the_opening_evaluation_ends_the_run_with_143_and_leaves_nothing_running(tmp_path: Path):
    """Outside the children's watch SIGTERM went Prefect's way: a crash report, then death by the
    signal, which left Prefect's temporary server (and here the evaluation's engine) running."""
    overrides = [f"storage.root=file://{tmp_path}", "run_id=evaluating", "training.steps=50", "training.warmup_steps=0",
                 "env.eval_prompts=64", "dask.n_workers=1"]  # fmt: skip
    env = os.environ | {"PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    log = (tmp_path / "run.log").open("w")
    run = subprocess.Popen(run_command(TINY_CONFIG, overrides), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
                           start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        children: list[int] = []
        while not any(b"engine\0serve" in command_line(pid) for pid in children):  # the opening evaluation's engine
            assert run.poll() is None and time.monotonic() < deadline, (tmp_path / "run.log").read_text()[-3000:]
            time.sleep(0.1)
            children = descendants(run.pid)
        run.send_signal(signal.SIGTERM)
        returncode = run.wait(timeout=30)
        left = lingering([run.pid], children, timeout=15)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.pid, signal.SIGKILL)
    output = (tmp_path / "run.log").read_text()
    assert returncode == 143, output[-3000:]
    assert "exiting: terminated (SIGTERM)" in output and not left, f"still alive: {left}"
    assert not (tmp_path / "evaluating" / "lag" / "trainer.json").exists(), "it ended before training began"


def command_line(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # gone meanwhile
        return b""


def lingering(sessions: list[int], pids: list[int], timeout: float) -> str:
    """`ps` lines of the processes in `sessions` or among `pids` still alive after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        found = subprocess.run(["ps", "-o", "pid=,sid=,args=", "-e"], capture_output=True, text=True).stdout.splitlines()
        alive = [line for line in found if int(line.split()[1]) in sessions or int(line.split()[0]) in pids]
        if not alive or time.monotonic() > deadline:
            return "\n".join(alive)
        time.sleep(0.5)


def test_a_run_id_given_as_a_flow_parameter_goes_through_the_configs_checks(tmp_path: Path):
    """A run_id passed beside the config went in with model_copy, which skips the config's checks
    (`a..b` started a run at s3://tandem/runs/a..b). Prefect now refuses that one at submission
    (tests/test_deploy_spec.py); a caller of the flow itself meets the config's own check, before
    anything is written."""
    from pydantic import ValidationError

    from configs import load_config
    from flows.pipeline import pipeline

    with pytest.raises(ValidationError, match=r"contain no '\.\.'"):
        pipeline.fn(load_config(TINY_CONFIG, [f"storage.root=file://{tmp_path}"]), run_id="a..b")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("args", "says"), [
    (["configs/tiny.yaml", "lag.max_lag=two"], "lag.max_lag: Input should be a valid integer"),
    (["configs/tiny.yaml", "--set", "lag.max_lag=0"], "overrides without --set"),
    ([], "usage: python -m flows.pipeline CONFIG"),
])  # fmt: skip
def test_python_m_flows_pipeline_refuses_bad_arguments_in_one_line(args: list[str], says: str, capsys):
    from flows.pipeline import main

    with pytest.raises(SystemExit) as exit_:
        main([str(ROOT / a) if a.endswith(".yaml") else a for a in args])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err, err


def test_python_m_flows_pipeline_checks_a_run_as_tandem_run_does_before_it_starts(tmp_path: Path, capsys):
    """The module was "the same" as `tandem run` in the README, but skipped its checks: an
    environment with too few problems failed inside the flow, after the run directory was made."""
    from flows.pipeline import main

    with pytest.raises(SystemExit) as exit_:
        main([str(TINY_CONFIG), f"storage.root=file://{tmp_path}", "env.kwargs={digits: 1}"])
    assert exit_.value.code == 2
    assert "env.train_prompts" in capsys.readouterr().err and list(tmp_path.iterdir()) == []
