"""Prefect work pools and deployments: what `tandem deploy` puts on a server.

The deployments are declared in prefect.yaml at the project root, the one place a Prefect user
looks for them. `apply_deployments` creates every work pool that file names, as process pools
(a worker runs each flow run as a process of its own, so cancelling one generation run stops
exactly its engines and Dask workers), and then applies the file with `prefect --no-prompt
deploy --all`, the command a Prefect user would type. Both steps are idempotent: a pool that
exists is kept, and a deployment that exists is updated in place.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.exceptions import ObjectNotFound

DEPLOY_TIMEOUT_S = 300


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
    """Create the pools, apply prefect.yaml from `project`; returns the deployments' full names."""
    ensure_work_pools(work_pools_of(spec))
    prefect = Path(sys.executable).with_name("prefect")
    command = [str(prefect) if prefect.exists() else "prefect", "--no-prompt", "deploy", "--all"]
    # The pull step names the working directory as {{ $PWD }}: the project, wherever it lies.
    env = os.environ | {"PWD": str(project), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    done = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True, timeout=DEPLOY_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(command[-3:])}` failed with exit code {done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}")
    with get_client(sync_client=True) as client:
        flows = {f.id: f.name for f in client.read_flows()}
        ours = {d["name"] for d in spec.get("deployments", [])}
        return sorted(f"{flows[d.flow_id]}/{d.name}" for d in client.read_deployments() if d.name in ours)
