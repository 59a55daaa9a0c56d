"""Deployed mode against real servers: a Prefect server, one process worker per pool, SeaweedFS.

The module starts `prefect server start` with its own PREFECT_HOME, runs `tandem deploy`, starts
workers for `training` and `inference`, and drives runs the way a user does: `prefect deployment
run 'pipeline/tandem' --param ...`, `tandem scale`, `prefect deployment run 'retrain/tandem'`.
It checks the outcome through the Prefect API and the run directory in S3.
"""

from __future__ import annotations

import json
from dataclasses import asdict
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from prefect import flow
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, FlowFilter, FlowFilterName
from prefect.events import emit_event
from prefect.events.worker import EventsWorker
from prefect.states import Cancelled, Running

from configs import RunConfig
from flows.scaling import scale_variable
from flows.ui import artifact_key
from benchmarks.prefect_restart import restart_mid_run
from infra.deployed_harness import Deployment, flow_run_id_from
from infra.deployments import RUN_TAG, ensure_unresponsive_run_automation
from infra.prefect_server import installed_command
from tasks.metrics import read_metrics
from tasks.promotion import PROMOTED_KEY, Promotion, read_promoted
from tasks.shards import list_shards, parse_shard_key
from tasks.snapshots import snapshot_versions

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.deployed, pytest.mark.s3, pytest.mark.slow, pytest.mark.timeout(900)]
S3_KEY, S3_SECRET = "deployed-test-key", "deployed-test-secret"
ENGINE_KEY = "deployed-engine-key"


_bin, _flow_run_id = installed_command, flow_run_id_from


@pytest.fixture(scope="module")
def deployment(seaweed, tmp_path_factory):
    """A Prefect server, `tandem deploy`, a worker per pool (infra/deployed_harness.py)."""
    with Deployment.start(tmp_path_factory.mktemp("prefect-home"), seaweed.endpoint_url, S3_KEY, S3_SECRET) as driver, driver.settings():
        yield driver


@pytest.fixture(scope="module")
def finished(deployment):
    """One whole deployed run: started from the CLI, finished, with its flow run id."""
    run_id = "e2e"
    flow_run_id = deployment.start_pipeline(deployment.config(run_id, "prefect.evaluate_every=3", f"engine.api_key={ENGINE_KEY}"))
    parent = deployment.wait_final(flow_run_id)
    return run_id, parent


def test_deployed_run_completes_on_two_pools(deployment, finished):
    run_id, parent = finished
    assert parent.state.is_completed(), f"{parent.state.message}\n{deployment.explain(str(parent.id))}"
    children = deployment.children(str(parent.id))
    pools = {name: {r.work_pool_name for _, r in children if _ == name} for name, _ in children}
    assert pools["training"] == {"training"} and pools["generation"] == {"inference"}
    assert {r.name for name, r in children if name in ("training", "generation")} == {"e2e-training", "e2e-gen0"}
    assert all(r.state.is_completed() for _, r in children), [(n, r.state.name) for n, r in children]
    keys = {r.parameters["config"]["engine"]["api_key"] for name, r in children if name in ("training", "generation")}
    assert keys == {ENGINE_KEY}, "a child runs with its parent's config, the engine key given to the parent included"
    store = deployment.store(run_id)
    assert len(list_shards(store)) >= 6 * 4
    assert snapshot_versions(store)[-1] == 6
    with deployment.client() as client:
        progress = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[artifact_key(run_id, "progress")])))
        summary = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[artifact_key(run_id, "summary")])))
    assert progress and max(a.data for a in progress) == 100
    assert summary and ": holds |" in summary[0].data and "plots/reward.png" in summary[0].data
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
        evaluations = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["evaluation"])))
    for run in evaluations:
        deployment.wait_final(str(run.id))
    triggered = [run for run in evaluations if run.deployment_id is not None]  # not the pipelines' own, run in-process
    assert triggered and all(run.parameters["config"]["engine"]["api_key"] is None for run in triggered), "an event carries no secret"
    last = [r for r in read_metrics(store, "evaluation") if r["event"] == "evaluation" and r["version"] == 6]
    assert len(last) == 1, "the last snapshot is the pipeline's to score, not the trigger's too"
    with deployment.client() as client:
        scored = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[artifact_key(run_id, "evaluation")])))
    assert {3, 6} <= {json.loads(a.data)[0]["version"] for a in scored}


def test_retrain_continues_the_run(deployment, finished):
    run_id, _ = finished
    with deployment.client() as client:
        retrain = client.read_deployment_by_name("retrain/tandem")
    assert [(s.schedule.cron, s.active) for s in retrain.schedules] == [("0 3 * * *", False)]
    store = deployment.store(run_id)
    setup = next(r["setup"] for r in read_metrics(store, "evaluation") if r["event"] == "evaluation")  # the run's: no rescoring
    below_any = Promotion(store.url, 6, -1e9, setup=setup)  # under any reachable score: the retrain must move PROMOTED
    store.write_atomic(PROMOTED_KEY, json.dumps(asdict(below_any)).encode())
    out = deployment.cli(_bin("prefect"), "deployment", "run", "retrain/tandem", "--param", f"run_id={run_id}",
                         "--param", "steps=2", "--param", f"storage_root=s3://{deployment.bucket}/runs")  # fmt: skip
    run = deployment.wait_final(_flow_run_id(out))
    assert run.state.is_completed(), run.state.message
    [pipeline_run] = [r for name, r in deployment.children(str(run.id)) if name == "pipeline"]
    assert RUN_TAG in pipeline_run.tags, "the retrained pipeline is one `tandem scale` finds"
    steps = [r["version"] for r in read_metrics(store, "trainer") if r["event"] == "train_step"]
    assert sorted(set(steps)) == list(range(1, 9)), "versions continue from 6 to 8"
    assert snapshot_versions(store)[-1] == 8
    scores = {r["version"]: r["score"] for r in read_metrics(store, "evaluation") if r["event"] == "evaluation"}
    promoted = read_promoted(store)
    assert (promoted.run_url, promoted.version, promoted.score) == (store.url, 8, scores[8])
    above_any = Promotion(store.url, 8, 1e9, setup=setup)  # over any reachable score (rewards are at most 1): nothing may move it
    store.write_atomic(PROMOTED_KEY, json.dumps(asdict(above_any)).encode())

    out = deployment.cli(_bin("prefect"), "deployment", "run", "retrain/tandem", "--param", f"run_id={run_id}", "--param", "steps=2",
                         "--param", f"new_run_id={run_id}-next", "--param", f"storage_root=s3://{deployment.bucket}/runs")  # fmt: skip
    run = deployment.wait_final(_flow_run_id(out))
    assert run.state.is_completed(), run.state.message
    successor = deployment.store(f"{run_id}-next")
    assert snapshot_versions(successor)[-1] == 2
    recorded = json.loads(successor.read_bytes("config.json"))
    assert recorded["training"]["warmup_steps"] == 0 and recorded["model"]["path"], "starts from the source's snapshot"
    assert read_promoted(store) == above_any, "a retrain scoring below the promoted score leaves PROMOTED alone"

    # The same retrain again (after a failure, say): it goes on with the successor as started,
    # whose model.path, the first attempt's temporary copy, is gone. Once more when the successor
    # has its steps and was compared: refused (a nightly schedule with new_run_id would otherwise
    # train nothing every night after the first, and show green). Once more after an attempt that
    # stopped before its comparison: it is only compared.
    def retrain_successor() -> object:
        out = deployment.cli(_bin("prefect"), "deployment", "run", "retrain/tandem", "--param", f"run_id={run_id}", "--param", "steps=3",
                             "--param", f"new_run_id={run_id}-next", "--param", f"storage_root=s3://{deployment.bucket}/runs")  # fmt: skip
        return deployment.wait_final(_flow_run_id(out))

    run = retrain_successor()
    assert run.state.is_completed(), run.state.message
    assert snapshot_versions(successor)[-1] == 3
    run = retrain_successor()
    assert run.state.is_failed() and "compared with PROMOTED already" in run.state.message, run.state.message
    successor.delete("metrics/retrain.jsonl")  # as if the last attempt had stopped before its comparison
    run = retrain_successor()
    assert run.state.is_completed(), run.state.message
    assert snapshot_versions(successor)[-1] == 3, "a successor that trained its steps is compared, not trained again"
    assert read_promoted(store) == above_any


NO_EVALUATION = "env.eval_prompts=0"
"""For the runs that test something else: the evaluations before and after a run each boot an
engine in the parent, about 10 s of a loaded machine's time a run."""

JOINING_STEPS = 40
LONG_ENOUGH_TO_JOIN = [f"training.steps={JOINING_STEPS}", "training.simulate_step_seconds=2.5", NO_EVALUATION]
"""About 100 s of steps, most of it the trainer sleeping, for the tests in which a second generation
run joins mid-run: that took 13 s with the CPU this leaves free, 30-40 s on two busy cores (a
worker's poll, a fresh process's imports, engines booting), and over 45 s with the suite's other
half beside it (pytest -n 2), when 20 steps ended before the second generator's first shard.
Counting steps alone did not do it: 32 real steps of the tiny model took 90 s, then 40 s once the
generators sent every admitted group to the engines at once."""


def test_scale_up_and_down_mid_run(deployment):
    run_id = "scaled"
    flow_run_id = deployment.start_pipeline(deployment.config(run_id, *LONG_ENOUGH_TO_JOIN))
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
    # gen1 left because it was retired: completed at the end of training, it passed either way
    records = [json.loads(line) for line in store.read_bytes("metrics/generator-gen1.jsonl").splitlines()]
    assert [r["retired"] for r in records if r["event"] == "finished"] == [True]
    report = json.loads(store.read_bytes("summary.json"))
    assert report["identity_holds"] and report["max_trained_lag"] <= 1 and report["steps"] == JOINING_STEPS
    with deployment.client() as client:  # a request lasts one run: a retrain of it starts with prefect.generators
        assert client.read_variable_by_name(scale_variable(run_id)) is None


def test_killed_generation_run_is_restarted(deployment):
    run_id = "killed"
    flow_run_id = deployment.start_pipeline(deployment.config(run_id, "training.steps=16", NO_EVALUATION))
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
    flow_run_id = deployment.start_pipeline(deployment.config(run_id, *LONG_ENOUGH_TO_JOIN, *autoscale))
    parent = deployment.wait_final(flow_run_id, timeout=600)
    assert parent.state.is_completed(), f"{parent.state.message}\n{deployment.explain(flow_run_id)}"
    generations = [r for name, r in deployment.children(flow_run_id) if name == "generation"]
    assert len(generations) == 2, f"a trainer idle 1% of the time gets a second generator and no third (max 2):\n{deployment.explain(flow_run_id)}"
    store = deployment.store(run_id)
    assert {parse_shard_key(k).producer for k in list_shards(store)} == {"gen0", "gen1"}
    assert json.loads(store.read_bytes("summary.json"))["identity_holds"]


def test_generation_that_fails_for_good_fails_the_run_and_leaves_nothing_running(deployment):
    run_id = "broken"
    broken = ["env.entrypoint=tests.test_recovery:BrokenTrainingEnv", "env.kwargs={}", "env.max_turns=1", "prefect.generation_restarts=1",
              NO_EVALUATION]  # fmt: skip
    flow_run_id = deployment.start_pipeline(deployment.config(run_id, *broken))
    parent = deployment.wait_final(flow_run_id, timeout=600)
    assert parent.state.is_failed()
    assert "every generation run failed" in parent.state.message, parent.state.message
    assert "RuntimeError: environment bug" in parent.state.message, "the run says why its generation failed"
    children = deployment.children(flow_run_id)
    assert all(r.state.is_final() for _, r in children), [(n, r.state.name) for n, r in children]
    assert len([r for name, r in children if name == "generation"]) == 2, "one start and one restart"
    store = deployment.store(run_id)
    engines = [e["pid"] for r in read_metrics(store, "generator-gen0") if r["event"] == "engines_started" for e in r["engines"]]
    assert engines
    for pid in engines:
        _wait(lambda: not Path(f"/proc/{pid}").exists(), 30, f"engine {pid} to exit")


def test_pipeline_survives_a_prefect_server_restart_mid_run(deployment):
    """The server stops and starts again on its database after v1 (benchmarks/prefect_restart.py):
    the run completes, with exactly its one training run and its configured generation runs, all
    Completed: nothing was restarted, nothing started twice."""
    result = restart_mid_run(deployment, "restarted", seed=0, steps=6)
    assert result["finished"], result["detail"]
    generators = deployment.config("restarted")["prefect"]["generators"]
    children = [(name, r) for name, r in deployment.children(result["flow_run_id"]) if name in ("training", "generation")]
    assert sorted(name for name, _ in children) == ["generation"] * generators + ["training"], result["detail"]
    assert all(r.state.is_completed() for _, r in children), result["detail"]
    report = json.loads(result["store"].read_bytes("summary.json"))
    assert report["identity_holds"] and report["steps"] == 6 and report["max_trained_lag"] <= result["max_lag"] == 1


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


@flow
def _heartbeat_probe() -> None:
    """Never run: a flow for the flow runs that the heartbeat test creates by hand."""


def _beat(flow_run_id, tags: tuple[str, ...] = (RUN_TAG,)) -> None:
    """A heartbeat as a run's engine sends it: the run as the resource, its tags as related ones."""
    related = [{"prefect.resource.id": f"prefect.tag.{tag}", "prefect.resource.role": "tag"} for tag in tags]
    emit_event("prefect.flow-run.heartbeat", resource={"prefect.resource.id": f"prefect.flow-run.{flow_run_id}"}, related=related)
    EventsWorker.drain_all()


def test_a_run_whose_heartbeats_stop_is_marked_crashed_and_one_that_beats_is_not(deployment):
    """The automation `tandem deploy` adds, for a run whose machine or worker was lost: it sends
    nothing more, and without the automation it stayed Running for good (a lost inference worker
    hung its run). Here with a 10 s limit instead of 90 s; restored after. A run of another flow
    (not tagged tandem) is left alone: its heartbeats may come every 180 s, Prefect's default."""
    ensure_unresponsive_run_automation(within_seconds=10)
    try:
        with deployment.client() as client:
            lost, alive, other = (client.create_flow_run(_heartbeat_probe, state=Running(), tags=tags).id
                                  for tags in ([RUN_TAG], [RUN_TAG], ["someone-else"]))  # fmt: skip
            _beat(lost)
            _beat(other, tags=("someone-else",))
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not client.read_flow_run(lost).state.is_final():
                _beat(alive)
                time.sleep(3)
            time.sleep(5)  # the other run's limit passed as long ago as the lost one's, and more
            lost_state, alive_state, other_state = (client.read_flow_run(r).state for r in (lost, alive, other))
            for run in (alive, other):
                client.set_flow_run_state(run, Cancelled(), force=True)
    finally:
        ensure_unresponsive_run_automation()
    assert lost_state.is_crashed() and "no heartbeat for 10 s" in lost_state.message, lost_state
    assert alive_state.is_running(), alive_state
    assert other_state.is_running(), other_state


def test_redeploying_keeps_a_schedule_the_user_turned_on(deployment):
    with deployment.client() as client:
        (retrain,) = [d for d in client.read_deployments() if d.entrypoint.endswith(":retrain")]
        (schedule,) = retrain.schedules
        client.update_deployment_schedule(retrain.id, schedule.id, active=True)
        try:
            deployment.cli(_bin("tandem"), "deploy")
        finally:  # off again for the module's other tests, whatever the deploy did
            (after,) = client.read_deployment(retrain.id).schedules
            client.update_deployment_schedule(retrain.id, after.id, active=False)
    assert after.active, "`tandem deploy` again turned the nightly retrain off"


def test_a_partial_config_is_refused_rather_than_run_in_local_mode_on_the_worker(deployment):
    """`config` replaces configs/deployed.yaml whole: `{"training": {"steps": 5}}` alone would
    take RunConfig's defaults, local mode and file://./runs, on the training worker."""
    flow_run_id = deployment.start_pipeline({"training": {"steps": 5}})
    parent = deployment.wait_final(flow_run_id, timeout=300)
    assert parent.state.is_failed() and "the config parameter has no prefect section" in parent.state.message, parent.state
    assert not deployment.children(flow_run_id), "no training or generation run started"


def test_a_deployment_run_without_the_child_deployments_fails_before_it_writes_anything(deployment):
    """`tandem run` checked that they exist; `prefect deployment run` did not, and its run warm-
    started, wrote and evaluated v0, then failed on its first child with a traceback."""
    run_id = "absent-children"
    flow_run_id = deployment.start_pipeline(deployment.config(run_id, "prefect.deployment=absent"))
    parent = deployment.wait_final(flow_run_id, timeout=300)
    assert parent.state.is_failed() and "has no deployment training/absent or generation/absent" in parent.state.message, parent.state
    assert not deployment.children(flow_run_id)
    assert not deployment.store(run_id).list(""), "no run directory written"


def test_scaling_a_run_that_is_not_running_is_refused(deployment):
    done = subprocess.run([_bin("tandem"), "scale", "nosuchrun", "--generators", "2"],
                          env=os.environ | deployment.env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 1 and "no pipeline of run 'nosuchrun' is running" in done.stderr, done.stdout + done.stderr
    with deployment.client() as client:
        assert client.read_variable_by_name(scale_variable("nosuchrun")) is None, "no request left for a later run"


def test_scaling_a_local_mode_run_is_refused(deployment):
    """A local-mode pipeline started through the deployment runs its generators as subflows of one
    process: `tandem scale` said it asked for more, and nothing read the request."""
    from flows.pipeline import pipeline

    local = RunConfig.model_validate({"run_id": "local-run", "prefect": {"mode": "local", "generators": 2}})
    with deployment.client() as client:
        run = client.create_flow_run(pipeline, parameters={"config": local.as_parameters(secrets=False)}, state=Running(), tags=[RUN_TAG])
    try:
        done = subprocess.run([_bin("tandem"), "scale", "local-run", "--generators", "3"],
                              env=os.environ | deployment.env, capture_output=True, text=True, timeout=120)  # fmt: skip
    finally:
        with deployment.client() as client:
            client.set_flow_run_state(run.id, Cancelled(), force=True)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "run local-run runs in local mode (prefect.mode: local): its 2 generation subflows share one process" in done.stderr
    assert "asked for" not in done.stdout
    with deployment.client() as client:
        assert client.read_variable_by_name(scale_variable("local-run")) is None


def test_a_deployed_tandem_run_needs_the_child_deployments_first(deployment):
    """Without them the pipeline warm-started and evaluated v0 before its first child failed to
    start, as a traceback."""
    done = subprocess.run([_bin("tandem"), "run", "configs/deployed.yaml", "--set", "prefect.deployment=absent"],
                          env=os.environ | deployment.env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert "has no deployment training/absent or generation/absent: run `tandem deploy`" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
