"""Deployed mode against real servers: a Prefect server, one process worker per pool, SeaweedFS.

The module starts `prefect server start` with its own PREFECT_HOME, runs `tandem deploy`, starts
workers for `training` and `inference`, and drives runs the way a user does: `prefect deployment
run 'pipeline/tandem' --param ...`, `tandem scale`, `prefect deployment run 'retrain/tandem'`.
It checks the outcome through the Prefect API and the run directory in S3.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter, ArtifactFilterKey, FlowRunFilter, FlowRunFilterParentFlowRunId, LogFilter, LogFilterFlowRunId, LogFilterLevel,
)  # fmt: skip
from prefect.settings import PREFECT_API_URL, temporary_settings

from configs import TINY_CONFIG, load_config
from flows.ui import artifact_key
from infra.prefect_server import PrefectServer, start_worker, stop_process_group
from infra.storage import open_run_store
from tasks.metrics import read_metrics
from tasks.shards import list_shards, parse_shard_key
from tasks.snapshots import snapshot_versions

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.deployed, pytest.mark.s3, pytest.mark.slow, pytest.mark.timeout(900)]
S3_KEY, S3_SECRET = "deployed-test-key", "deployed-test-secret"


class Deployment:
    """The servers and workers of this module, and helpers to drive runs through them."""

    def __init__(self, server: PrefectServer, env: dict[str, str], bucket: str, logs: Path):
        self.server, self.env, self.bucket, self.logs = server, env, bucket, logs

    def cli(self, *args: str, timeout: float = 300) -> str:
        done = subprocess.run(list(args), cwd=ROOT, env=os.environ | self.env, capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, f"{args} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        return done.stdout + done.stderr

    def config(self, run_id: str, *overrides: str) -> dict:
        base = [
            f"run_id={run_id}", f"storage.root=s3://{self.bucket}/runs", "prefect.mode=deployed", "prefect.watch_seconds=1",
            "training.steps=6", "training.warmup_steps=5", "training.prompts_per_step=4", "training.checkpoint_every=2",
            "generation.prompts_per_chunk=2", "generation.samples_per_prompt=4", "env.eval_prompts=8",
            "lag.max_lag=1", "dask.n_workers=1", "prefect.evaluate_every=3",
        ]  # fmt: skip
        return load_config(TINY_CONFIG, [*base, *overrides]).model_dump(mode="json")

    def start_pipeline(self, config: dict) -> str:
        """`prefect deployment run 'pipeline/tandem'`; returns the flow run id it printed."""
        out = self.cli(_bin("prefect"), "deployment", "run", "pipeline/tandem", "--param", f"config={json.dumps(config)}")
        return _flow_run_id(out)

    def client(self):
        return get_client(sync_client=True)

    def wait_final(self, flow_run_id: str, timeout: float = 400):
        deadline = time.monotonic() + timeout
        with self.client() as client:
            while time.monotonic() < deadline:
                run = client.read_flow_run(uuid.UUID(flow_run_id))
                if run.state.is_final():
                    return run
                time.sleep(1)
        raise TimeoutError(f"flow run {flow_run_id} not final after {timeout} s; logs in {self.logs}")

    def children(self, flow_run_id: str) -> list:
        with self.client() as client:
            flow_names = {f.id: f.name for f in client.read_flows()}
            runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[uuid.UUID(flow_run_id)])))
        return [(flow_names[r.flow_id], r) for r in runs]

    def explain(self, flow_run_id: str) -> str:
        """Each child's state and message, and the warnings and errors each one that did not
        complete logged: what an assertion about the children prints when it fails."""
        lines = []
        with self.client() as client:
            for name, run in self.children(flow_run_id):
                lines.append(f"{name} {run.name}: {run.state.name} {run.state.message or ''}")
                if not run.state.is_completed():
                    logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id]), level=LogFilterLevel(ge_=30)))
                    lines += [f"    {log.message[-2000:]}" for log in logs[-5:]]
        return "\n".join(lines)

    def store(self, run_id: str):
        from configs.schema import StorageConfig

        storage = StorageConfig(root=f"s3://{self.bucket}/runs", endpoint_url=self.env["AWS_ENDPOINT_URL"], key=S3_KEY, secret=S3_SECRET)
        return open_run_store(storage, run_id)


def _bin(name: str) -> str:
    """A command installed beside this Python (prefect, tandem)."""
    return str(Path(sys.executable).with_name(name))


def _flow_run_id(cli_output: str) -> str:
    for line in cli_output.splitlines():
        if "UUID:" in line:
            return line.split("UUID:")[1].strip()
    raise AssertionError(f"no flow run UUID in:\n{cli_output}")


@pytest.fixture(scope="module")
def deployment(seaweed, tmp_path_factory):
    home = tmp_path_factory.mktemp("prefect-home")
    server = PrefectServer(home).start()
    env = server.env() | {
        "AWS_ACCESS_KEY_ID": S3_KEY, "AWS_SECRET_ACCESS_KEY": S3_SECRET, "AWS_ENDPOINT_URL": seaweed.endpoint_url,
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    }  # fmt: skip
    workers = []
    try:
        with temporary_settings(updates={PREFECT_API_URL: server.api_url}):
            driver = Deployment(server, env, f"deployed-{uuid.uuid4().hex[:8]}", home)
            driver.cli(_bin("tandem"), "deploy")
            workers = [start_worker(pool, env, home / f"worker-{pool}.log") for pool in ("training", "inference")]
            yield driver
    finally:
        for worker in workers:
            stop_process_group(worker)
        server.stop()


@pytest.fixture(scope="module")
def finished(deployment):
    """One whole deployed run: started from the CLI, finished, with its flow run id."""
    run_id = "e2e"
    flow_run_id = deployment.start_pipeline(deployment.config(run_id))
    parent = deployment.wait_final(flow_run_id)
    return run_id, parent


def test_deployed_run_completes_on_two_pools(deployment, finished):
    run_id, parent = finished
    assert parent.state.is_completed(), f"{parent.state.message}\n{deployment.explain(str(parent.id))}"
    children = deployment.children(str(parent.id))
    pools = {name: {r.work_pool_name for _, r in children if _ == name} for name, _ in children}
    assert pools["training"] == {"training"} and pools["generation"] == {"inference"}
    assert all(r.state.is_completed() for _, r in children), [(n, r.state.name) for n, r in children]
    store = deployment.store(run_id)
    assert len(list_shards(store)) >= 6 * 4
    assert snapshot_versions(store)[-1] == 6
    with deployment.client() as client:
        progress = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[artifact_key(run_id, "progress")])))
        summary = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[artifact_key(run_id, "summary")])))
    assert progress and max(a.data for a in progress) == 100
    assert summary and "(holds)" in summary[0].data and "plots/reward.png" in summary[0].data
    report = json.loads(store.read_bytes("summary.json"))
    assert report["identity_holds"] and report["steps"] == 6 and report["max_trained_lag"] <= 1


@pytest.mark.parametrize("param,field", [("run_id=a/b", "run_id"), ('config={"training": {"steps": -1}}', "config.training.steps"),
                                         ('config={"lag": {"max_lagg": 1}}', "config.lag")])  # fmt: skip
def test_a_bad_parameter_is_refused_at_submission_naming_the_field(deployment, param, field):
    done = subprocess.run([_bin("prefect"), "deployment", "run", "pipeline/tandem", "--param", param],
                          env=os.environ | deployment.env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode != 0
    assert f"Validation failed for field '{field}'" in done.stdout + done.stderr


def test_s3_credentials_are_written_nowhere(deployment, finished):
    """The workers read the S3 key and secret from their environment. Neither may appear in any
    object of the run directory (metrics included), in any artifact, flow-run parameter or log
    line the server holds, or in the server's and workers' own log files."""
    run_id, _ = finished
    secrets = [S3_KEY.encode(), S3_SECRET.encode()]
    store = deployment.store(run_id)
    objects = store.list_recursive("")
    assert any(k.startswith("metrics/") for k in objects) and any(k.startswith("weights/") for k in objects)
    leaks = [key for key in objects if any(secret in _read_unless_gone(store, key) for secret in secrets)]
    with deployment.client() as client:
        artifacts = [a.model_dump_json() for a in _all_pages(client.read_artifacts)]
        runs = [r.model_dump_json() for r in _all_pages(client.read_flow_runs)]
        logs = [log.message for log in _all_pages(client.read_logs)]
    assert artifacts and runs and logs, "the server holds what the run created"
    leaks += [text[:200] for text in artifacts + runs + logs if any(secret.decode() in text for secret in secrets)]
    leaks += [f.name for f in deployment.logs.glob("*.log") if any(secret in f.read_bytes() for secret in secrets)]
    assert not leaks, leaks


def _read_unless_gone(store, key: str) -> bytes:
    """An object's bytes; b"" if it was deleted since it was listed (the evaluations that the
    run's snapshots triggered may still be pinning and unpinning them)."""
    try:
        return store.read_bytes(key)
    except FileNotFoundError:
        return b""


def _all_pages(read, page: int = 200) -> list:
    """Every object a paginated Prefect client `read_*` call returns."""
    items, offset = [], 0
    while batch := read(limit=page, offset=offset):
        items += batch
        offset += page
    return items


def test_published_snapshots_trigger_evaluation(deployment, finished):
    run_id, _ = finished
    store = deployment.store(run_id)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        versions = {r["version"] for r in read_metrics(store, "evaluation") if r["event"] == "evaluation"}
        if {3, 6} <= versions:
            break
        time.sleep(2)
    assert {3, 6} <= versions, f"triggered evaluations seen: {sorted(versions)}"
    with deployment.client() as client:
        scored = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[artifact_key(run_id, "evaluation")])))
    assert {3, 6} <= {json.loads(a.data)[0]["version"] for a in scored}


def test_retrain_continues_the_run(deployment, finished):
    run_id, _ = finished
    with deployment.client() as client:
        retrain = client.read_deployment_by_name("retrain/tandem")
    assert [(s.schedule.cron, s.active) for s in retrain.schedules] == [("0 3 * * *", False)]
    out = deployment.cli(_bin("prefect"), "deployment", "run", "retrain/tandem", "--param", f"run_id={run_id}",
                         "--param", "steps=2", "--param", f"storage_root=s3://{deployment.bucket}/runs")  # fmt: skip
    run = deployment.wait_final(_flow_run_id(out))
    assert run.state.is_completed(), run.state.message
    store = deployment.store(run_id)
    steps = [r["version"] for r in read_metrics(store, "trainer") if r["event"] == "train_step"]
    assert sorted(set(steps)) == list(range(1, 9)), "versions continue from 6 to 8"
    assert snapshot_versions(store)[-1] == 8
    assert_promoted_only_on_improvement(store, store, before=6, after=8)

    out = deployment.cli(_bin("prefect"), "deployment", "run", "retrain/tandem", "--param", f"run_id={run_id}", "--param", "steps=2",
                         "--param", f"new_run_id={run_id}-next", "--param", f"storage_root=s3://{deployment.bucket}/runs")  # fmt: skip
    run = deployment.wait_final(_flow_run_id(out))
    assert run.state.is_completed(), run.state.message
    successor = deployment.store(f"{run_id}-next")
    assert snapshot_versions(successor)[-1] == 2
    recorded = json.loads(successor.read_bytes("config.json"))
    assert recorded["training"]["warmup_steps"] == 0 and recorded["model"]["path"], "starts from the source's snapshot"


def assert_promoted_only_on_improvement(source, candidate, before: int, after: int) -> None:
    """PROMOTED names the retrained snapshot iff it scored above the promoted one (or, with none
    promoted, above the score retraining started from)."""
    scores = {r["version"]: r["score"] for r in read_metrics(candidate, "evaluation") if r["event"] == "evaluation"}
    try:
        promoted = json.loads(source.read_bytes("PROMOTED.json"))
    except FileNotFoundError:
        promoted = None
    if scores[after] > scores[before]:
        assert promoted and promoted["version"] == after and promoted["score"] == scores[after]
    else:
        assert promoted is None


def test_scale_up_and_down_mid_run(deployment):
    run_id = "scaled"
    flow_run_id = deployment.start_pipeline(deployment.config(run_id, "training.steps=24"))
    store = deployment.store(run_id)
    _wait(lambda: _trainer_version(store) >= 2, 300, "training to reach v2")
    deployment.cli(_bin("tandem"), "scale", run_id, "--generators", "2")
    _wait(lambda: any(parse_shard_key(k).producer == "gen1" for k in list_shards(store)), 300, "gen1 to commit a shard")
    deployment.cli(_bin("tandem"), "scale", run_id, "--generators", "1")
    parent = deployment.wait_final(flow_run_id, timeout=600)
    assert parent.state.is_completed(), f"{parent.state.message}\n{deployment.explain(flow_run_id)}"
    generations = [r for name, r in deployment.children(flow_run_id) if name == "generation"]
    assert len(generations) == 2 and all(r.state.is_completed() for r in generations), deployment.explain(flow_run_id)
    assert {parse_shard_key(k).producer for k in list_shards(store)} == {"gen0", "gen1"}
    report = json.loads(store.read_bytes("summary.json"))
    assert report["identity_holds"] and report["max_trained_lag"] <= 1 and report["steps"] == 24


def test_killed_generation_run_is_restarted(deployment):
    run_id = "killed"
    flow_run_id = deployment.start_pipeline(deployment.config(run_id, "training.steps=16"))
    store = deployment.store(run_id)
    _wait(lambda: _trainer_version(store) >= 2, 300, "training to reach v2")
    started = [r for r in read_metrics(store, "generator-gen0") if r["event"] == "engines_started"]
    victim = started[-1]["pid"]
    os.kill(victim, signal.SIGKILL)
    parent = deployment.wait_final(flow_run_id, timeout=600)
    assert parent.state.is_completed(), f"{parent.state.message}\n{deployment.explain(flow_run_id)}"
    generations = [r for name, r in deployment.children(flow_run_id) if name == "generation"]
    assert sorted(r.state.name for r in generations) == ["Completed", "Crashed"], deployment.explain(flow_run_id)
    report = json.loads(store.read_bytes("summary.json"))
    assert report["identity_holds"] and report["steps"] == 16 and report["max_trained_lag"] <= 1
    ledger = json.loads(store.read_bytes("lag/ledger.json"))
    assert len(ledger["trained_groups"]) == len(set(ledger["trained_groups"])) == 16 * 4
    for engine in started[-1]["engines"]:
        _wait(lambda: not Path(f"/proc/{engine['pid']}").exists(), 30, f"engine {engine['pid']} of the killed run to exit")


def test_autoscale_adds_a_generator_while_the_trainer_waits(deployment):
    run_id = "autoscaled"
    autoscale = ["prefect.autoscale.min=1", "prefect.autoscale.max=2", "prefect.autoscale.target_trainer_idle=0.01",
                 "prefect.autoscale.max_generator_wait=0.99", "prefect.autoscale.cooldown_seconds=5"]  # fmt: skip
    flow_run_id = deployment.start_pipeline(deployment.config(run_id, "training.steps=20", *autoscale))
    parent = deployment.wait_final(flow_run_id, timeout=600)
    assert parent.state.is_completed(), f"{parent.state.message}\n{deployment.explain(flow_run_id)}"
    generations = [r for name, r in deployment.children(flow_run_id) if name == "generation"]
    assert len(generations) == 2, f"a trainer idle 1% of the time gets a second generator and no third (max 2):\n{deployment.explain(flow_run_id)}"
    store = deployment.store(run_id)
    assert {parse_shard_key(k).producer for k in list_shards(store)} == {"gen0", "gen1"}
    assert json.loads(store.read_bytes("summary.json"))["identity_holds"]


def test_generation_that_fails_for_good_fails_the_run_and_leaves_nothing_running(deployment):
    run_id = "broken"
    broken = ["env.entrypoint=tests.test_recovery:BrokenTrainingEnv", "env.kwargs={}", "env.max_turns=1", "prefect.generation_restarts=1"]
    flow_run_id = deployment.start_pipeline(deployment.config(run_id, *broken))
    parent = deployment.wait_final(flow_run_id, timeout=600)
    assert parent.state.is_failed()
    assert "every generation run failed" in parent.state.message, parent.state.message
    children = deployment.children(flow_run_id)
    assert all(r.state.is_final() for _, r in children), [(n, r.state.name) for n, r in children]
    assert len([r for name, r in children if name == "generation"]) == 2, "one start and one restart"
    store = deployment.store(run_id)
    engines = [e["pid"] for r in read_metrics(store, "generator-gen0") if r["event"] == "engines_started" for e in r["engines"]]
    assert engines
    for pid in engines:
        _wait(lambda: not Path(f"/proc/{pid}").exists(), 30, f"engine {pid} to exit")


def _trainer_version(store) -> int:
    try:
        return json.loads(store.read_bytes("lag/trainer.json"))["version"]
    except FileNotFoundError:
        return 0


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise TimeoutError(f"waited {timeout:.0f} s for {what}")


CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--hide-scrollbars", "--window-size=1500,1000",
]  # fmt: skip
TEST_ARTIFACTS = Path(os.environ.get("TANDEM_TEST_ARTIFACTS", ROOT / "test-artifacts"))


@pytest.fixture
def browser(tmp_path):
    """Headless Debian Chromium driven through Debian's chromedriver (.ci/run installs both)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary, driver = shutil.which("chromium"), shutil.which("chromedriver")
    assert binary and driver, "the browser test needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)"
    options = webdriver.ChromeOptions()
    for flag in [*CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}"]:
        options.add_argument(flag)
    options.binary_location = binary
    chrome = webdriver.Chrome(options=options, service=Service(driver))
    yield chrome
    chrome.quit()


@pytest.mark.browser
def test_prefect_ui_shows_the_run_its_children_and_progress(deployment, finished, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    run_id, parent = finished
    children = {name: r for name, r in deployment.children(str(parent.id)) if name in ("training", "generation")}
    assert set(children) == {"training", "generation"}
    wait = WebDriverWait(browser, 60)

    def page_text(driver) -> str:
        return driver.find_element(By.TAG_NAME, "body").text

    browser.get(f"{deployment.server.ui_url}/runs/flow-run/{parent.id}")
    wait.until(lambda d: parent.name in page_text(d) and "Subflow Runs" in page_text(d))
    innermost = "//*[normalize-space(.)='Subflow Runs' and not(*[normalize-space(.)='Subflow Runs'])]"
    wait.until(lambda d: d.find_elements(By.XPATH, innermost))[0].click()
    wait.until(lambda d: all(f"{name}\n{child.name}" in page_text(d) for name, child in children.items()))
    TEST_ARTIFACTS.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(TEST_ARTIFACTS / "prefect-ui-pipeline-run.png"))

    browser.get(f"{deployment.server.ui_url}/runs/flow-run/{children['training'].id}")
    wait.until(lambda d: children["training"].name in page_text(d))
    tab = "//*[normalize-space(.)='Artifacts' and not(*[normalize-space(.)='Artifacts'])]"
    wait.until(lambda d: d.find_elements(By.XPATH, tab))[0].click()
    wait.until(lambda d: artifact_key(run_id, "progress") in page_text(d) and artifact_key(run_id, "metrics") in page_text(d))
    browser.save_screenshot(str(TEST_ARTIFACTS / "prefect-ui-training-artifacts.png"))
