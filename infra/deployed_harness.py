"""Deployed mode on loopback, the way a user runs it: for the deployed tests and the fault benchmark.

Its parts:

- `Deployment.start(home, s3_endpoint, ...)`: a `prefect server start` with PREFECT_HOME `home`
  (its SQLite database, settings and logs; nothing of the user's is touched), then `tandem
  deploy` against it (work pools and every deployment of prefect.yaml), then one `prefect
  worker start --pool NAME` per work pool (infra/prefect_server.py starts each process in a
  session of its own). `stop()` ends the workers and the server by their process groups, never
  by name; a `Deployment` is also a context manager that does so on exit.
- Driving runs as a user does: `cli` (a command with the deployment's environment),
  `config` (the tiny config made for deployed mode on this deployment's bucket),
  `start_pipeline` (`prefect deployment run 'pipeline/tandem' --param config=...`).
- Looking at the outcome through the Prefect API: `client`, `wait_final`, `children`, `explain`
  (each child's state and the warnings it logged: what a failed check prints); and through the
  run directory: `store`.
- `restart_server()`: stops the Prefect server and starts it again on the same port with the
  same PREFECT_HOME (so the same database): the "server restarted mid-run" fault.

Why a module rather than a test fixture: tests/test_deployed.py and the fault matrix
(benchmarks/prefect_restart.py) need the same servers, workers and helpers, and a benchmark
cannot import a pytest fixture. Failures raise errors with the command's output or the log
directory in their message, never bare assertions, so that a benchmark reports them too.

The workers get the same environment as `tandem deploy`: PREFECT_API_URL and PREFECT_HOME of the
server and the S3 endpoint and credentials (AWS_* variables: a deployed config carries none).
Nothing else: a server restart needs no special client settings (Prefect's client retries a
request for about a minute; see flows/supervisor.py for what tandem adds for longer outages),
so the workers run with what a user's would.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import httpx

from configs import TINY_CONFIG, load_config
from configs.sections import StorageConfig
from infra.prefect_server import PrefectServer, installed_command, start_worker, stop_process_group
from infra.storage import RunStore, open_run_store

ROOT = Path(__file__).resolve().parents[1]
"""The project directory: where prefect.yaml lies and where `tandem deploy` runs."""

POOLS = ("training", "inference")

TINY_DEPLOYED = [
    "prefect.mode=deployed", "prefect.watch_seconds=1",
    "training.steps=6", "training.warmup_steps=5", "training.prompts_per_step=4", "training.checkpoint_every=2",
    "generation.prompts_per_chunk=2", "generation.samples_per_prompt=4", "env.eval_prompts=8",
    "lag.max_lag=1", "dask.n_workers=1", "prefect.evaluate_every=0",
]  # fmt: skip
"""Overrides of configs/tiny.yaml for a short deployed run (about a minute on two cores).

No evaluation on publish unless a run asks for it: each triggered evaluation is a flow run and an
engine of its own on the inference pool, and at two seconds a step a 24-step run with
evaluate_every 3 started eight of them beside its generation runs, which left a second generation
run 29 s to start on two cores, longer than the rest of the run."""


class HarnessError(RuntimeError):
    """A command of the harness failed, or something it waited for did not happen in time."""


def flow_run_id_from(cli_output: str) -> str:
    """The flow run id that `prefect deployment run` printed."""
    for line in cli_output.splitlines():
        if "UUID:" in line:
            return line.split("UUID:")[1].strip()
    raise HarnessError(f"no flow run UUID in the output of `prefect deployment run`:\n{cli_output[-3000:]}")


class Deployment:
    """A Prefect server with tandem deployed on it and a worker per pool, and helpers to drive
    and inspect runs through them."""

    def __init__(self, server: PrefectServer, env: dict[str, str], bucket: str, logs: Path, s3_key: str, s3_secret: str):
        self.server, self.env, self.bucket, self.logs = server, env, bucket, logs
        self.s3_key, self.s3_secret = s3_key, s3_secret
        self.workers: dict[str, subprocess.Popen] = {}

    @classmethod
    def start(cls, home: Path, s3_endpoint: str, s3_key: str, s3_secret: str, bucket: str | None = None,
              pools: tuple[str, ...] = POOLS) -> Deployment:  # fmt: skip
        """Server, `tandem deploy`, one worker per pool; everything is stopped again if a step fails."""
        server = PrefectServer(Path(home)).start()
        env = server.env() | {
            "AWS_ACCESS_KEY_ID": s3_key, "AWS_SECRET_ACCESS_KEY": s3_secret, "AWS_ENDPOINT_URL": s3_endpoint,
        }  # fmt: skip
        deployment = cls(server, env, bucket or f"deployed-{uuid.uuid4().hex[:8]}", server.home, s3_key, s3_secret)
        try:
            deployment.cli(installed_command("tandem"), "deploy")
            for pool in pools:
                deployment.workers[pool] = start_worker(pool, env, server.home / f"worker-{pool}.log")
        except BaseException:
            deployment.stop()
            raise
        return deployment

    def stop(self) -> None:
        """Stop every worker (and the flow runs they started), then the server; by process group."""
        for worker in self.workers.values():
            stop_process_group(worker)
        self.workers.clear()
        self.server.stop()

    def __enter__(self) -> Deployment:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def restart_server(self, timeout_s: float = 90.0, down_s: float = 0.0) -> float:
        """Stop the server (SIGTERM to its process group) and start it again on the same port
        with the same PREFECT_HOME, hence the same database, after `down_s` more seconds;
        returns the seconds it was away."""
        began = time.monotonic()
        self.server.stop()
        time.sleep(down_s)
        self.server.start(timeout_s)
        return time.monotonic() - began

    @contextmanager
    def settings(self):
        """Point this process's Prefect client at the deployment's server while inside."""
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings(updates={PREFECT_API_URL: self.server.api_url}):
            yield self

    def cli(self, *args: str, timeout: float = 300) -> str:
        """Run a command in the project directory with the deployment's environment; its output."""
        done = subprocess.run(list(args), cwd=ROOT, env=os.environ | self.env, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise HarnessError(f"{args} failed with exit code {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        return done.stdout + done.stderr

    def config(self, run_id: str, *overrides: str) -> dict:
        """The tiny deployed config (`TINY_DEPLOYED`) of run `run_id` on this deployment's
        bucket, with `overrides` applied last; as the JSON a deployment parameter holds."""
        base = [f"run_id={run_id}", f"storage.root=s3://{self.bucket}/runs", *TINY_DEPLOYED]
        return load_config(TINY_CONFIG, [*base, *overrides]).as_parameters(secrets=True)

    def start_pipeline(self, config: dict) -> str:
        """`prefect deployment run 'pipeline/tandem'`; returns the flow run id it printed."""
        out = self.cli(installed_command("prefect"), "deployment", "run", "pipeline/tandem", "--param", f"config={json.dumps(config)}")
        return flow_run_id_from(out)

    def client(self):
        """A synchronous Prefect client of this deployment's server (use it in a `with`)."""
        from prefect.client.orchestration import get_client
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings(updates={PREFECT_API_URL: self.server.api_url}):
            return get_client(sync_client=True)

    def wait_final(self, flow_run_id: str, timeout: float = 400):
        """The flow run, once its state is final. A read that fails because the server is away
        (restarting) is tried again until `timeout`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with self.client() as client:
                    while time.monotonic() < deadline:
                        run = client.read_flow_run(uuid.UUID(flow_run_id))
                        if run.state.is_final():
                            return run
                        time.sleep(1)
            except httpx.HTTPError:
                time.sleep(1)
        raise HarnessError(f"flow run {flow_run_id} not final after {timeout:.0f} s; logs in {self.logs}")

    def children(self, flow_run_id: str) -> list:
        """(flow name, flow run) of each child run of `flow_run_id`."""
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

        with self.client() as client:
            flow_names = {f.id: f.name for f in client.read_flows()}
            parent = FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[uuid.UUID(flow_run_id)]))
            runs = client.read_flow_runs(flow_run_filter=parent)
        return [(flow_names[r.flow_id], r) for r in runs]

    def explain(self, flow_run_id: str) -> str:
        """Each child's state and message, and the warnings and errors each one that did not
        complete logged: what a failed check about the children prints."""
        from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId, LogFilterLevel

        lines = []
        with self.client() as client:
            for name, run in self.children(flow_run_id):
                lines.append(f"{name} {run.name}: {run.state.name} {run.state.message or ''}")
                if not run.state.is_completed():
                    logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id]), level=LogFilterLevel(ge_=30)))
                    lines += [f"    {log.message[-2000:]}" for log in logs[-5:]]
        return "\n".join(lines)

    def store(self, run_id: str) -> RunStore:
        """The run directory of `run_id` on this deployment's bucket."""
        endpoint = self.env["AWS_ENDPOINT_URL"]
        storage = StorageConfig(root=f"s3://{self.bucket}/runs", endpoint_url=endpoint, key=self.s3_key, secret=self.s3_secret)
        return open_run_store(storage, run_id)
