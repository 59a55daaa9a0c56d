"""How many generation runs a deployed run has: how many a pipeline starts with
(`initial_generation_runs`), and what `tandem scale` asks for mid-run, a Prefect variable per run
(`scale_variable`, holding a `scale_request`) that the parent (flows/supervisor.py) reads at every
watch and the pipeline clears as it takes the run and as it ends (`clear_scale_request`).
`running_pipeline` finds the run a request reaches, by the tag `tag_for_scaling` makes sure it has.

A variable rather than a message to the parent: the CLI needs nothing from the parent's process,
and a request set before the parent reads it (or from the Prefect UI) is not lost.
"""

from __future__ import annotations

import hashlib
import re
import time

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowFilter,
    FlowFilterName,
    FlowRunFilter,
    FlowRunFilterState,
    FlowRunFilterStateType,
    FlowRunFilterTags,
)
from prefect.client.schemas.objects import FlowRun, StateType
from prefect.variables import Variable

from configs import DEPLOYED_CONFIG, load_config
from configs.loader import validate_config, without_masked_secrets
from configs.schema import RunConfig
from infra.deployments import RUN_TAG


def scale_variable(run_id: str) -> str:
    """Name of the Prefect variable that asks run `run_id` for a number of generation runs: the
    run id folded to what a variable name allows, and a digest of it, so that `a.b`, `a-b` and
    `A-b` each get their own."""
    digest = hashlib.sha256(run_id.encode()).hexdigest()[:8]
    return re.sub(r"[^a-z0-9_-]", "-", f"tandem-generators-{run_id}".lower()) + f"-{digest}"


def initial_generation_runs(config: RunConfig) -> int:
    """How many generation runs a pipeline starts with (gen0, gen1, ...): prefect.generators,
    within prefect.autoscale's bounds if set."""
    policy = config.prefect.autoscale
    return policy.bounded(config.prefect.generators) if policy else config.prefect.generators


def requested_count(request) -> int | None:
    """The count a `tandem scale` request asks for: `scale_request`'s form, or a bare number as
    older versions of the CLI wrote it (and `prefect variable set` writes, as text)."""
    if isinstance(request, dict):
        request = request.get("generators")
    if isinstance(request, str) and request.strip().isdigit():
        request = int(request)
    return request if isinstance(request, int) and not isinstance(request, bool) else None


def scale_request(generators: int, pipeline_run: str | None = None) -> dict:
    """The variable's value for a request of `generators` runs. It carries the time it was made,
    so that a request for the count of an earlier one is still news to the parent: autoscale
    may have moved the run away from it since; and the pipeline run it was made for, which
    keeps it when it clears what an earlier pipeline of the run left (`clear_scale_request`)."""
    return {"generators": generators, "requested_at": time.time(), "pipeline_run": pipeline_run}


def clear_scale_request(run_id: str, unless_for: str | None = None) -> None:
    """Drop the run's `tandem scale` request: one lasts for the pipeline run it was made during.
    A pipeline that takes the run clears what an earlier one left, but not a request made for
    itself (`unless_for`, its flow run id): `tandem scale` finds it Running a few seconds before
    it gets there, and a request made then was dropped while the CLI said it was made."""
    name = scale_variable(run_id)
    if unless_for is not None:
        request = Variable.get(name, default=None)
        if isinstance(request, dict) and request.get("pipeline_run") == unless_for:
            return
    Variable.unset(name)


def tag_for_scaling(flow_run_id) -> None:
    """Give pipeline run `flow_run_id` the tag RUN_TAG, which `running_pipeline` looks for, if it
    lacks it: a run of tandem's deployment has it, one that `tandem run` started in deployed mode
    (the flow called in the CLI's process) does not, and `tandem scale` could not reach it."""
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(flow_run_id)
        if RUN_TAG not in run.tags:
            client.update_flow_run(flow_run_id, tags=[*run.tags, RUN_TAG])


def running_pipeline(run_id: str) -> tuple[FlowRun, RunConfig | None] | None:
    """The deployed pipeline run of run `run_id` that the server has Running, if there is one,
    and the config it runs (None if it does not validate here): what a `tandem scale` request
    reaches (it is cleared when a pipeline of the run starts and ends). Runs of tandem's
    deployments carry the tag RUN_TAG; a local `tandem run` reads no request, and another
    project's flow named pipeline is not tandem's."""
    running = FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.RUNNING])),
                            tags=FlowRunFilterTags(all_=[RUN_TAG]))  # fmt: skip
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["pipeline"])), flow_run_filter=running)
    default = load_config(DEPLOYED_CONFIG).run_id
    for run in runs:
        given = run.parameters.get("config")
        named = run.parameters.get("run_id") or (given.get("run_id", RunConfig().run_id) if isinstance(given, dict) else default)
        if named == run_id:
            return run, pipeline_config(run.parameters)
    return None


def pipeline_config(parameters: dict) -> RunConfig | None:
    """The config a pipeline run started with these parameters runs, as flows/pipeline.py resolves
    them: its config parameter or configs/deployed.yaml's, with its run_id parameter over either;
    the server keeps secrets masked, which are read as unset. None where it does not validate
    here (a run started by another release of tandem, say)."""
    given = parameters.get("config")
    try:
        config = validate_config(without_masked_secrets(given)) if isinstance(given, dict) else load_config(DEPLOYED_CONFIG)
        if run_id := parameters.get("run_id"):
            config = RunConfig.model_validate(config.model_dump() | {"run_id": run_id})
    except ValueError:
        return None
    return config
