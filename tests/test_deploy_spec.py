"""prefect.yaml, checked without a server: every deployment loads, runs on the right pool, and
its parameters, trigger and schedule fit the flow it names."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import yaml
from prefect.flows import load_flow_from_entrypoint
from prefect.utilities.callables import parameter_schema
from prefect.utilities.schema_tools import ValidationError, validate

from flows import TANDEM_PREFECT_LOGGING
from flows.scaling import scale_variable
from flows.supervisor import API_OUTAGE_SECONDS
from configs.schema import RunConfig
from flows.training import pin_for_evaluation
from flows.ui import artifact_key, due_for_evaluation
from infra.storage import open_run_store
from tasks.snapshots import PINS
from infra.deployments import HEARTBEAT_SECONDS, RUN_TAG, UNRESPONSIVE_SECONDS, work_pools_of

ROOT = Path(__file__).resolve().parents[1]
SPEC = yaml.safe_load((ROOT / "prefect.yaml").read_text())
DEPLOYMENTS = {d["entrypoint"].rsplit(":", 1)[1]: d for d in SPEC["deployments"]}


def test_every_flow_has_a_deployment_on_its_pool():
    pools = {name: d["work_pool"]["name"] for name, d in DEPLOYMENTS.items()}
    assert pools == {"pipeline": "training", "training": "training", "generation": "inference",
                     "evaluation": "inference", "retrain": "training"}  # fmt: skip
    assert work_pools_of(SPEC) == ["training", "inference"]
    assert {d["name"] for d in SPEC["deployments"]} == {"tandem"}, "children are found as FLOW/tandem"


@pytest.mark.parametrize("name", sorted(DEPLOYMENTS))
def test_deployment_parameters_fit_the_flow(name):
    deployment = DEPLOYMENTS[name]
    flow = load_flow_from_entrypoint(str(ROOT / deployment["entrypoint"]))
    assert flow.name == name
    schema = parameter_schema(flow.fn).model_dump_for_openapi()
    validate(deployment.get("parameters") or {}, schema, raise_on_error=True, ignore_required=True)


def test_retrain_schedule_is_present_but_off():
    assert DEPLOYMENTS["retrain"]["schedules"] == [{"cron": "0 3 * * *", "timezone": "UTC", "active": False}]


def test_evaluation_trigger_fills_the_flow_parameters_from_the_event():
    (trigger,) = DEPLOYMENTS["evaluation"]["triggers"]
    assert trigger["expect"] == ["tandem.weights.published"] and trigger["match"]["tandem.evaluate"] == "true"
    flow = load_flow_from_entrypoint(str(ROOT / DEPLOYMENTS["evaluation"]["entrypoint"]))
    assert set(trigger["parameters"]) == set(parameter_schema(flow.fn).properties)


def test_the_trigger_leaves_the_last_snapshot_to_the_pipelines_closing_evaluation():
    config = RunConfig.model_validate({"training": {"steps": 9}, "prefect": {"mode": "deployed", "evaluate_every": 3}})
    assert [v for v in range(1, 10) if due_for_evaluation(config, v)] == [3, 6]
    local = config.model_copy(update={"prefect": config.prefect.model_copy(update={"mode": "local"})})
    assert not any(due_for_evaluation(local, v) for v in range(1, 10)), "a deployment's trigger would answer a local run"


def test_a_version_marked_for_evaluation_is_pinned_for_its_run_until_the_pin_lapses(tmp_path):
    """A triggered evaluation may never start (the automation off, no worker on its pool): its
    pin must lapse, or every marked version of a long run is kept in storage for good."""
    config = RunConfig.model_validate({
        "storage": {"root": f"file://{tmp_path}"}, "training": {"steps": 9},
        "prefect": {"mode": "deployed", "evaluate_every": 3, "evaluation_pin_hours": 2},
    })  # fmt: skip
    store = open_run_store(config.storage, config.run_id)
    for version in (3, 4):
        pin_for_evaluation(config, store, version)
    assert store.list(PINS) == [f"{PINS}/eval-v3.json"]
    record = json.loads(store.read_bytes(f"{PINS}/eval-v3.json"))
    assert record["version"] == 3 and 2 * 3600 - 60 < record["lapses_at"] - time.time() <= 2 * 3600


def test_evaluations_and_retrains_run_one_at_a_time_and_none_is_dropped():
    for name in ("evaluation", "retrain"):
        assert DEPLOYMENTS[name]["concurrency_limit"] == {"limit": 1, "collision_strategy": "ENQUEUE"}, name


def test_names_derived_from_run_ids_are_what_prefect_allows():
    assert artifact_key("run-7", "progress") == "tandem-run-7-progress"
    folded = {artifact_key(run_id, "progress") for run_id in ("exp-1", "exp_1", "EXP-1", "exp.1")}
    assert len(folded) == 4, "run ids folding into the same characters must not share artifacts"
    assert re.fullmatch(r"tandem-my-run-v2-[0-9a-f]{8}-progress", artifact_key("My_Run.v2", "progress"))
    assert scale_variable("My_Run.v2").startswith("tandem-generators-my_run-v2-")
    assert len({scale_variable(r) for r in ("a.b", "a-b", "A-b", "a_b")}) == 4, "one variable per run"


@pytest.mark.parametrize("run_id", ["a..b", "..", "-x", "a/b", "x" * 65, "demo\n"])
def test_prefect_refuses_a_bad_run_id_parameter_at_submission(run_id):
    """What `prefect deployment run pipeline/tandem --param run_id=...` checks before a run exists
    (a run id with '..' passed it and started a run at s3://tandem/runs/a..b)."""
    flow = load_flow_from_entrypoint(str(ROOT / DEPLOYMENTS["pipeline"]["entrypoint"]))
    schema = parameter_schema(flow.fn).model_dump_for_openapi()
    validate({"run_id": "demo.v2-1_a"}, schema, raise_on_error=True, ignore_required=True)
    with pytest.raises(ValidationError):
        validate({"run_id": run_id}, schema, raise_on_error=True, ignore_required=True)


@pytest.mark.parametrize(
    "config",
    [{"run_id": "../x"}, {"storage": {"root": "http://x"}}, {"storage": {"root": "s3:///"}},
     {"env": {"entrypoint": "tasks/envs.py"}}, {"generation": {"top_k": 0}},
     {"run_id": "demo\n"}, {"env": {"entrypoint": "tasks.envs.calculator:CalculatorEnv\n"}},
     {"storage": {"credentials_block": "s3-creds\n"}}, {"prefect": {"deployment": "tandem\n"}},
     {"training": {"device": "gpu"}}, {"training": {"device": "cuda:0\n"}}],  # fmt: skip
    ids=["run_id", "root scheme", "root without bucket", "entrypoint", "top_k 0", "run_id newline",
         "entrypoint newline", "credentials block newline", "deployment newline", "device", "device newline"],
)
def test_prefect_refuses_bad_fields_of_the_config_parameter_at_submission(config):
    """Fields whose validator is Python code carry a pattern too, so that the server refuses them
    before a run exists rather than the run failing once it starts."""
    flow = load_flow_from_entrypoint(str(ROOT / DEPLOYMENTS["pipeline"]["entrypoint"]))
    schema = parameter_schema(flow.fn).model_dump_for_openapi()
    good = {"run_id": "demo", "storage": {"root": "s3://tandem/runs", "credentials_block": "s3-creds"},
            "generation": {"top_k": 5}, "env": {"entrypoint": "tasks.envs.calculator:CalculatorEnv"},
            "prefect": {"deployment": "tandem"}, "training": {"device": "cuda:1"}}  # fmt: skip
    validate({"config": good}, schema, raise_on_error=True, ignore_required=True)
    with pytest.raises(ValidationError):
        validate({"config": config}, schema, raise_on_error=True, ignore_required=True)


def test_every_run_sends_the_heartbeats_the_unresponsive_run_automation_expects():
    for deployment in SPEC["deployments"]:
        env = deployment["work_pool"]["job_variables"]["env"]
        assert env["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] == str(HEARTBEAT_SECONDS), deployment["entrypoint"]
    assert UNRESPONSIVE_SECONDS >= API_OUTAGE_SECONDS + 2 * HEARTBEAT_SECONDS, (
        "a run that rides out an outage is not crashed after it, though its last heartbeat came a heartbeat before it"
    )


def test_every_deployed_run_sends_tandems_own_warnings_to_the_ui():
    """A deployed run's process imports Prefect before tandem's flows package sets its logging
    defaults: the job's environment has to carry them."""
    for deployment in SPEC["deployments"]:
        env = deployment["work_pool"]["job_variables"]["env"]
        assert TANDEM_PREFECT_LOGGING.items() <= env.items(), deployment["entrypoint"]


def test_every_run_is_tagged_for_the_unresponsive_run_automation():
    assert all(RUN_TAG in deployment["tags"] for deployment in SPEC["deployments"])
