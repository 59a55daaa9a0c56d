"""Fault: in deployed mode, the inference machine is lost mid-run (its worker and generation run die).

    python benchmarks/lost_worker.py [--steps N] [--unresponsive-seconds S]

Starts a Prefect server, `tandem deploy` and a worker per pool (infra/deployed_harness.py) on a
SeaweedFS of its own, starts a deployed pipeline run, and once the trainer reaches v3 SIGKILLs the
inference worker's process group and the generation run's process, as a lost machine would leave
them: nothing reports the run's end, so Prefect holds it Running. A new inference worker is
started (the machine that replaces it). It prints when the generation run was marked Crashed (by
the automation `tandem deploy` adds, infra/deployments.py, here with `--unresponsive-seconds`
as its limit: 90 by default, where the deployed default is 660), when the pipeline finished, its
children's states, and whether the run's accounting identity held.

Every process it starts is stopped at the end, by process group id, never by name.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from infra.deployed_harness import Deployment  # noqa: E402
from infra.deployments import ensure_unresponsive_run_automation  # noqa: E402
from infra.prefect_server import start_worker  # noqa: E402
from infra.seaweed import SeaweedServer, free_s3_port  # noqa: E402
from tasks.lag import read_trainer_state  # noqa: E402
from tasks.metrics import read_metrics  # noqa: E402

KILL_AT_VERSION = 3
CRASH_TIMEOUT_S = 900.0


def lose_the_inference_worker(deployment: Deployment, run_id: str, steps: int) -> dict:
    """The fault on a started deployment (inside `deployment.settings()`); seconds from the kill."""
    flow_run_id = deployment.start_pipeline(deployment.config(run_id, f"training.steps={steps}"))
    store = deployment.store(run_id)
    while read_trainer_state(store).version < KILL_AT_VERSION:
        time.sleep(0.5)
    (generation,) = [run for name, run in deployment.children(flow_run_id) if name == "generation"]
    generation_pid = [r for r in read_metrics(store, "generator-gen0") if r["event"] == "engines_started"][-1]["pid"]
    killed = time.monotonic()
    os.killpg(deployment.workers["inference"].pid, signal.SIGKILL)
    try:
        os.kill(generation_pid, signal.SIGKILL)  # a flow run's process has a session of its own
    except ProcessLookupError:
        pass
    deployment.workers["inference"] = start_worker("inference", deployment.env, deployment.logs / "worker-inference-2.log")
    with deployment.client() as client:
        while not (state := client.read_flow_run(generation.id).state).is_final():
            if time.monotonic() - killed > CRASH_TIMEOUT_S:
                raise TimeoutError(f"generation run still {state.name} {CRASH_TIMEOUT_S:.0f} s after the kill")
            time.sleep(1)
    ended = time.monotonic()
    parent = deployment.wait_final(flow_run_id, timeout=900)
    summary = json.loads(store.read_bytes("summary.json")) if parent.state.is_completed() else {}
    return {
        "generation_state": f"{state.name}: {state.message}", "ended_after_s": round(ended - killed, 1),
        "pipeline": parent.state.name, "pipeline_done_after_s": round(time.monotonic() - killed, 1),
        "children": sorted(f"{name} {run.state.name}" for name, run in deployment.children(flow_run_id)),
        "steps": summary.get("steps"), "identity_holds": summary.get("identity_holds"),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--unresponsive-seconds", type=float, default=90.0, help="the automation's limit for this run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tandem-lost-worker-") as tmp:
        with SeaweedServer(Path(tmp) / "seaweed", free_s3_port()) as seaweed:
            with Deployment.start(Path(tmp) / "prefect-home", seaweed.endpoint_url, "lost-key", "lost-secret") as deployment:
                with deployment.settings():
                    ensure_unresponsive_run_automation(within_seconds=args.unresponsive_seconds)
                    print(json.dumps(lose_the_inference_worker(deployment, "lost-worker", args.steps), indent=2))


if __name__ == "__main__":
    main()
