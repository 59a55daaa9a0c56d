"""Prefect work pools and deployments: what `tandem deploy` puts on a server.

The deployments are declared in prefect.yaml at the project root, the one place a Prefect user
looks for them. `apply_deployments` creates every work pool that file names, as process pools
(a worker runs each flow run as a process of its own, so cancelling one generation run stops
exactly its engines and Dask workers), and then applies the file with `prefect --no-prompt
deploy --all`, the command a Prefect user would type. Both steps are idempotent: a pool that
exists is kept, and a deployment that exists is updated in place. A schedule the user turned on
stays on: `prefect deploy` re-applies the file's `active: false`, so the schedules that were
active before are resumed after it.

`ensure_unresponsive_run_automation` adds Prefect's answer to a flow run whose machine was lost
(docs.prefect.io, "detect zombie flows"): the deployments' runs send a heartbeat event every
`HEARTBEAT_SECONDS` (prefect.yaml sets PREFECT_FLOWS_HEARTBEAT_FREQUENCY in their environment),
and an automation marks a run Crashed once `UNRESPONSIVE_SECONDS` (11 min) pass without one.
A process that dies on a live worker is reported Crashed by that worker at once; a lost worker
reports nothing, and without the automation its generation runs stayed Running for good, holding their
share of the lag window, so that the run hung. Crashed, the pipeline restarts them
(flows/supervisor.py) on the same producer ids, which take their unfinished slots over.
"""

from __future__ import annotations

import os
import subprocess
from datetime import timedelta
from pathlib import Path

from prefect.automations import Automation
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName
from prefect.client.schemas.objects import StateType
from prefect.events.actions import ChangeFlowRunState
from prefect.events.schemas.automations import EventTrigger, Posture
from prefect.events.schemas.events import ResourceSpecification
from prefect.exceptions import ObjectNotFound

from configs import ConfigError
from infra.prefect_server import installed_command

DEPLOY_TIMEOUT_S = 300
HEARTBEAT_SECONDS = 30
"""What prefect.yaml sets PREFECT_FLOWS_HEARTBEAT_FREQUENCY to: Prefect's minimum."""
UNRESPONSIVE_SECONDS = 660
"""A run whose last heartbeat is this old is marked Crashed. Far more than a few missed
heartbeats, because the server evaluates the automation as it comes back from an outage, before
the runs' clients resend the heartbeats they queued: a limit shorter than the outage crashed
every run. So it is the outage a run rides out (flows/supervisor.py API_OUTAGE_SECONDS, 600 s)
and two heartbeats more: the last one before the outage may be a heartbeat older than its start."""
UNRESPONSIVE_MESSAGE = "no heartbeat for {seconds:.0f} s: its machine or worker was lost"
UNRESPONSIVE_AUTOMATION = "tandem: crash unresponsive runs"
RUN_TAG = "tandem"
"""The tag prefect.yaml gives every deployment's runs: the automation looks at those only, since
another flow's heartbeats may come less often than UNRESPONSIVE_SECONDS."""


def require_child_deployments(name: str) -> None:
    """ConfigError unless the Prefect server this process talks to has the deployments a deployed
    run starts its children from (`training/NAME`, `generation/NAME`). Asked by `tandem run` and
    by the pipeline flow itself, before it takes the run: started with `prefect deployment run`,
    it warm-started, wrote v0 and evaluated it, and then failed on its first child with an
    ObjectNotFound traceback."""
    missing = []
    with get_client(sync_client=True) as client:
        for deployment in (f"training/{name}", f"generation/{name}"):
            try:
                client.read_deployment_by_name(deployment)
            except ObjectNotFound:
                missing.append(deployment)
        api_url = client.api_url
    if missing:
        raise ConfigError(f"prefect.mode is deployed, and the Prefect server at {api_url} has no deployment "
                          f"{' or '.join(missing)}: run `tandem deploy` from the project directory first (or set "
                          "prefect.deployment to yours)")  # fmt: skip


def work_pools_of(spec: dict) -> list[str]:
    """The work pool names prefect.yaml's deployments run on, in order of first use."""
    names = [d.get("work_pool", {}).get("name") for d in spec.get("deployments", [])]
    return list(dict.fromkeys(n for n in names if n))


def ensure_work_pools(names: list[str]) -> list[str]:
    """Create the process work pools among `names` that do not exist yet; returns those created."""
    created = []
    with get_client(sync_client=True) as client:
        for name in names:
            try:
                client.read_work_pool(name)
            except ObjectNotFound:
                client.create_work_pool(WorkPoolCreate(name=name, type="process"))
                created.append(name)
    return created


def apply_deployments(project: Path, spec: dict) -> list[str]:
    """Create the pools, apply prefect.yaml from `project`, keep active schedules active, add
    the automation that crashes unresponsive runs; returns the deployments' full names."""
    ensure_work_pools(work_pools_of(spec))
    ours = sorted({d["name"] for d in spec.get("deployments", [])})
    active = _active_schedules(ours)
    command = [installed_command("prefect"), "--no-prompt", "deploy", "--all"]
    # The pull step names the working directory as {{ $PWD }}: the project, wherever it lies.
    env = os.environ | {"PWD": str(project), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    try:
        done = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True, timeout=DEPLOY_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"`{' '.join(command[-3:])}` did not finish in {DEPLOY_TIMEOUT_S} s") from None
    except OSError as err:  # no prefect executable
        raise RuntimeError(f"cannot run `{' '.join(command[-3:])}`: {err}") from None
    finally:  # a deploy that failed half-way may have applied the file's `active: false` already
        _resume_schedules(ours, active)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(command[-3:])}` failed with exit code {done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}")
    ensure_unresponsive_run_automation()
    with get_client(sync_client=True) as client:
        return sorted(f"{client.read_flow(d.flow_id).name}/{d.name}" for d in _deployments_named(client, ours))


def _deployments_named(client, names: list[str]) -> list:
    """The server's deployments of these names, whatever their flow: asked for by name, since a
    plain read returns the first 200 of a shared server's, which may leave out tandem's."""
    return client.read_deployments(deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=names)))


def _active_schedules(names: list[str]) -> set[tuple[str, str]]:
    """(deployment id, schedule) of every active schedule of the deployments named `names`."""
    with get_client(sync_client=True) as client:
        return {(str(d.id), repr(s.schedule)) for d in _deployments_named(client, names) for s in d.schedules if s.active}


def _resume_schedules(names: list[str], active: set[tuple[str, str]]) -> None:
    with get_client(sync_client=True) as client:
        for deployment in _deployments_named(client, names):
            for schedule in deployment.schedules:
                if not schedule.active and (str(deployment.id), repr(schedule.schedule)) in active:
                    client.update_deployment_schedule(deployment.id, schedule.id, active=True)


def ensure_unresponsive_run_automation(within_seconds: float = UNRESPONSIVE_SECONDS) -> Automation:
    """Create (or update) the automation that marks a flow run tagged RUN_TAG Crashed once
    `within_seconds` pass after its last heartbeat without another heartbeat or a final state."""
    automation = Automation(
        name=UNRESPONSIVE_AUTOMATION,
        description="Marks a flow run Crashed when its heartbeats stop: its machine or worker was lost (tandem deploy).",
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            expect={"prefect.flow-run.heartbeat", *(f"prefect.flow-run.{s}" for s in ("Completed", "Failed", "Cancelled", "Crashed"))},
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            match_related=ResourceSpecification({"prefect.resource.role": "tag", "prefect.resource.id": f"prefect.tag.{RUN_TAG}"}),
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=within_seconds),
        ),
        actions=[ChangeFlowRunState(state=StateType.CRASHED, message=UNRESPONSIVE_MESSAGE.format(seconds=within_seconds))],
    )
    try:
        existing = Automation.read(name=UNRESPONSIVE_AUTOMATION)
    except ValueError:  # none of that name
        return automation.create()
    automation.id = existing.id
    automation.update()
    return automation
