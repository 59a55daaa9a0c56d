"""Fault: in deployed mode, the Prefect server restarts mid-run (same database).

    python benchmarks/prefect_restart.py [--seed N] [--steps N] [--down-seconds S] [--work-dir DIR]

`run_with_prefect_restart` starts a Prefect server of its own (PREFECT_HOME under `work_dir`),
deploys tandem and starts a worker per pool (infra/deployed_harness.py), starts a deployed
pipeline run of the tiny config on the given SeaweedFS, waits until the first snapshot after v0
is published, waits a seeded 0-3 s more, and then stops the server and starts it again on the
same port with the same PREFECT_HOME, hence the same SQLite database. While it is away the
workers, the pipeline's supervisor and the flow runs in worker processes (reporting task and
flow states, logs, events, artifacts) all lose their API. Then it waits for the pipeline run to
be final. The fault matrix (benchmarks/faults.py) checks the run directory afterwards.

Every process it starts (server, workers, and the flow runs those started) is stopped in a
`finally`, by process group id, never by name.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from infra.deployed_harness import Deployment, HarnessError  # noqa: E402
from infra.seaweed import SeaweedServer, free_s3_port  # noqa: E402
from tasks.snapshots import latest_version  # noqa: E402

S3_KEY, S3_SECRET = "prefect-restart-key", "prefect-restart-secret"
FIRST_SNAPSHOT_TIMEOUT_S = 300.0
FINAL_TIMEOUT_S = 400.0


def run_with_prefect_restart(work_dir: Path, seaweed: SeaweedServer, seed: int, steps: int = 8, down_s: float = 0.0) -> dict:
    """One deployed tiny run of `steps` steps with the Prefect server restarted after v1, on a
    server and workers of its own (PREFECT_HOME `work_dir`/prefect-home), all stopped at the end.

    Returns {"finished": the pipeline run Completed, "store": the run's RunStore, "max_lag":
    the run's lag bound, "fault_at": time.time() when the server was stopped, "detail":
    seconds the server was away, the final state and each child's state (with the warnings of
    any child that did not complete)}. `down_s` keeps the server stopped that much longer (0:
    a plain restart)."""
    bucket = f"prefect-restart-{seed}-{uuid.uuid4().hex[:6]}"
    deployment = Deployment.start(Path(work_dir) / "prefect-home", seaweed.endpoint_url, S3_KEY, S3_SECRET, bucket=bucket)
    try:
        with deployment.settings():
            result = restart_mid_run(deployment, f"prefect-restart-{seed}", seed, steps, down_s)
        result.pop("flow_run_id")
        return result
    finally:
        deployment.stop()


def restart_mid_run(deployment: Deployment, run_id: str, seed: int, steps: int, down_s: float = 0.0) -> dict:
    """The fault on an existing deployment (the caller has entered `deployment.settings()`):
    start a deployed pipeline run `run_id`, wait for snapshot v1 and a seeded 0-3 s more,
    restart the server, wait until the run is final. Returns `run_with_prefect_restart`'s dict
    plus "flow_run_id", the pipeline run's id."""
    rng = random.Random(seed)
    config = deployment.config(run_id, f"training.steps={steps}", "env.eval_prompts=0")  # the restart is the test
    flow_run_id = deployment.start_pipeline(config)
    store = deployment.store(run_id)
    _wait_for_snapshot(deployment, store, flow_run_id, version=1)
    time.sleep(rng.uniform(0.0, 3.0))
    fault_at = time.time()
    away = deployment.restart_server(down_s=down_s)
    try:
        parent = deployment.wait_final(flow_run_id, timeout=FINAL_TIMEOUT_S)
        finished, outcome = parent.state.is_completed(), f"{parent.state.name}: {parent.state.message or ''}".strip()
    except HarnessError as err:
        finished, outcome = False, str(err)
    detail = f"server away {away:.1f} s; pipeline {outcome}\n{deployment.explain(flow_run_id)}"
    return {"finished": finished, "store": store, "max_lag": config["lag"]["max_lag"],
            "fault_at": fault_at, "detail": detail, "flow_run_id": flow_run_id}  # fmt: skip


def _wait_for_snapshot(deployment: Deployment, store, flow_run_id: str, version: int) -> None:
    """Until weights/LATEST names `version` or later; fail early if the pipeline ended first."""
    deadline = time.monotonic() + FIRST_SNAPSHOT_TIMEOUT_S
    while time.monotonic() < deadline:
        if (latest_version(store) or 0) >= version:
            return
        with deployment.client() as client:
            state = client.read_flow_run(uuid.UUID(flow_run_id)).state
        if state.is_final():
            raise HarnessError(f"pipeline ended {state.name} before v{version}: {state.message}\n{deployment.explain(flow_run_id)}")
        time.sleep(0.25)
    raise HarnessError(f"no snapshot v{version} after {FIRST_SNAPSHOT_TIMEOUT_S:.0f} s; logs in {deployment.logs}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--down-seconds", type=float, default=0.0, help="keep the server stopped this long before starting it again")
    parser.add_argument("--work-dir", type=Path, help="keep the servers' data and logs here (default: a temporary directory)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tandem-prefect-restart-") as tmp:
        work_dir = args.work_dir or Path(tmp)
        with SeaweedServer(work_dir / "seaweed", free_s3_port()) as seaweed:
            began = time.monotonic()
            result = run_with_prefect_restart(work_dir, seaweed, args.seed, args.steps, args.down_seconds)
            result["store"] = result["store"].url
            result["seconds"] = round(time.monotonic() - began, 1)
            print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
