"""The `tandem` commands, over configs/, infra/ and the flows; what they check before they act,
and how a failed check exits, is flows/preflight.py.

Commands: `run CONFIG` (train end to end; configs/tiny.yaml is the embedded default), `init` (lay out a run directory
with its config and the initial weight snapshot), `eval` (score a snapshot), `deploy` (work
pools and deployments on a Prefect server), `scale` (generation runs of a deployed run),
`config show|schema` (inspect a run configuration), `storage up` (a local S3 server on
loopback) and `engine serve` (tandem's CPU engine, or its simulated one).
Every command validates its config before it touches anything, so a bad config exits 2 having
written nothing; `run` and `init` also check, before writing, that the environment loads and takes
its kwargs and that model.path is a model. `deploy` and `scale` need PREFECT_API_URL and a server
that answers there.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Annotated

import typer
import yaml
from rich.console import Console
from rich.markup import escape

from configs import ConfigError, RunConfig
from configs.fields import MAX_GENERATION_RUNS
from flows.preflight import (
    err_console, exits_on_run_errors, fail, load_deployment_spec, note_all, prefect_server_reached, prefect_server_url,
    require_child_deployments, require_engine_backend, resolve_config,
)  # fmt: skip

app = typer.Typer(
    help="tandem: agentic RL with inference and training scaled independently.",
    no_args_is_help=True,
    add_completion=False,
)
config_app = typer.Typer(help="Inspect run configurations.", no_args_is_help=True)
storage_app = typer.Typer(help="Object storage helpers.", no_args_is_help=True)
engine_app = typer.Typer(help="Inference engines.", no_args_is_help=True)
app.add_typer(config_app, name="config")
app.add_typer(storage_app, name="storage")
app.add_typer(engine_app, name="engine")

console = Console()

ConfigFile = Annotated[Path, typer.Argument(help="Run configuration YAML (e.g. configs/tiny.yaml).")]
Overrides = Annotated[
    list[str] | None,
    typer.Option("--set", help="Override a field: section.field=value, or section.sub.field=value; the value is read as YAML "
                 "(a number, true, \\[a, b], {k: v}). Repeatable."),
]

SECRETS_IN_DEPLOYED_RUNS = (
    "A deployed run gets storage credentials on its workers: AWS_ACCESS_KEY_ID and "
    "AWS_SECRET_ACCESS_KEY, or a Prefect Secret block named in storage.credentials_block. "
    "engine.api_key has no such channel: add it to the JSON yourself, knowing that the Prefect "
    "server stores a run's parameters and shows them in its UI."
)
"""How secrets reach a deployed run, for `config show --json`, which leaves them out."""

RunIdOption = Annotated[str | None, typer.Option("--run-id", help="Run id (overrides run_id in the file).")]


@app.command("init")
def init(
    config: ConfigFile,
    overrides: Overrides = None,
    run_id: RunIdOption = None,
) -> None:
    """Create a run directory: the resolved config.json and the initial weight snapshot v0."""
    resolved = resolve_config(config, overrides, run_id)  # before importing torch: fail fast
    from infra.storage import open_run_store
    from tasks.rundir import check_run_writable, initialize_run, pretrained_model_notes, prompt_vocabulary_notes
    from tasks.snapshots import snapshot_versions

    note_all(pretrained_model_notes(resolved))
    with exits_on_run_errors(f"storage.root {resolved.storage.root}"):
        check_run_writable(open_run_store(resolved.storage, resolved.run_id))
        with console.status(f"initialising run {resolved.run_id}"):
            store = initialize_run(resolved)
    note_all(prompt_vocabulary_notes(resolved))
    console.print(f"run directory: [bold]{store.url}[/]")
    console.print(f"snapshots: {snapshot_versions(store)}; files: {len(store.list_recursive(''))}")


@app.command("run")
def run(
    config: ConfigFile,
    overrides: Overrides = None,
    run_id: RunIdOption = None,
) -> None:
    """Train end to end: warm-start, generation and training side by side, evaluation, summary.

    Run again, it continues from its last checkpoint (raise training.steps past a finished run); --run-id NAME starts afresh."""
    resolved = resolve_config(config, overrides, run_id)
    if resolved.prefect.mode == "deployed":
        require_child_deployments(resolved.prefect.deployment)
    from infra.storage import open_run_store
    from tasks.lag import read_trainer_state
    from tasks.lease import RunInUse, check_run_free
    from tasks.rundir import (
        RunConflict, check_recorded_config, check_run_inputs, check_run_writable, pretrained_model_notes, prompt_vocabulary_notes,
    )  # fmt: skip

    with exits_on_run_errors(f"storage.root {resolved.storage.root}"):  # here too: one line, not a failed flow run
        store = open_run_store(resolved.storage, resolved.run_id)
        check_run_inputs(resolved, store)
        note_all(pretrained_model_notes(resolved) + prompt_vocabulary_notes(resolved))
        check_recorded_config(store, resolved)
        check_run_writable(store)
        check_run_free(store)
    trained = read_trainer_state(store).version
    if trained >= resolved.training.steps and store.exists("summary.json"):  # finished: say so, start nothing
        console.print(f"run {resolved.run_id} has trained {trained} steps already (training.steps is "
                      f"{resolved.training.steps}): nothing to train. Its summary: {store.url_of('summary.json')}; "
                      f"to continue it, raise training.steps (--set training.steps={trained + resolved.training.steps})",
                      soft_wrap=True)  # fmt: skip
        return
    if resolved.prefect.mode == "local" or resolved.env.eval_prompts:  # this process starts engines
        require_engine_backend(resolved)
    from flows.pipeline import pipeline  # Prefect, torch and the flows (8 s): after the checks

    try:  # not storage's errors: an outage hours into the run keeps its traceback
        pipeline(resolved)
    except (RunConflict, ConfigError) as err:
        fail(str(err))
    except RunInUse as err:  # taken between the check above and the pipeline's claim
        fail(str(err), code=1)


def run_command(config: Path, overrides: list[str]) -> list[str]:
    """`tandem run CONFIG --set ...` as a subprocess command line (tests and benchmarks).

    Through the CLI module rather than `python -m flows.pipeline`: LocalCluster spawns its Dask
    workers, and each re-imports the parent's main module, which for the CLI is light."""
    return [sys.executable, "-m", "flows.cli", "run", str(config), *(arg for o in overrides for arg in ("--set", o))]


@app.command("eval")
def evaluate_run(
    run: Annotated[str, typer.Argument(help="Run directory URL, e.g. file://./runs/tiny or s3://bucket/runs/tiny.")],
    version: Annotated[int | None, typer.Option(help="Snapshot version to score (default: LATEST).", min=0)] = None,
    overrides: Overrides = None,
) -> None:
    """Score one snapshot of a run on its held-out prompts (greedy), and record it in metrics."""
    from infra.storage import open_run_store
    from tasks.rundir import load_run_config
    from tasks.snapshots import SnapshotMissing, committed_version

    if run.startswith("file://") and not run.startswith("file:///"):
        run = "file://" + os.path.abspath(run.removeprefix("file://"))
    with exits_on_run_errors(run):
        resolved = load_run_config(run, overrides or ())
    if not resolved.env.eval_prompts:
        fail(f"run {resolved.run_id} has no held-out prompts (env.eval_prompts is 0): add --set env.eval_prompts=N")
    require_engine_backend(resolved)
    with exits_on_run_errors(run):  # before the flow starts, which would print the error as a traceback
        try:
            version = committed_version(open_run_store(resolved.storage, resolved.run_id), version)
        except (SnapshotMissing, ValueError) as err:  # ValueError: a LATEST that does not parse, named
            fail(str(err))
    from flows.evaluation import evaluation

    result = evaluation(resolved, version)
    console.print(f"v{result['version']}: score {result['score']:.3f} (solved {result['solved']:.1%})")


@app.command("deploy")
def deploy(
    project_dir: Annotated[Path, typer.Option(help="Directory holding prefect.yaml (and the flows workers run).")] = Path("."),
) -> None:
    """Create the work pools and every deployment of prefect.yaml on the server at PREFECT_API_URL.

    Idempotent: existing pools are kept, deployments are updated in place."""
    project = project_dir.resolve()
    spec_path = project / "prefect.yaml"
    if not spec_path.is_file():
        fail(f"{spec_path}: no prefect.yaml here; run from tandem's project directory or pass --project-dir")
    spec = load_deployment_spec(spec_path)
    api_url = prefect_server_url()
    from infra.deployments import apply_deployments

    with prefect_server_reached(api_url):
        try:
            names = apply_deployments(project, spec)
        except RuntimeError as err:  # the `prefect deploy` that it runs failed
            fail(str(err), code=1)
    console.print(f"deployed to {api_url}: " + ", ".join(names))


@app.command("scale")
def scale(
    run_id: Annotated[str, typer.Argument(help="Run id of a deployed pipeline run.")],
    generators: Annotated[int, typer.Option(help="Generation runs the run should have.", min=1, max=MAX_GENERATION_RUNS)],
) -> None:
    """Ask a deployed run for N generation runs; its parent adds or retires them within seconds."""
    from configs.fields import is_run_id

    if not is_run_id(run_id):
        fail(f"{run_id!r} is not a run id (letters, digits, '.', '_', '-', no '..'; at most 64 characters)")
    url = prefect_server_url()
    from prefect.variables import Variable

    from flows.scaling import running_pipeline, scale_request, scale_variable  # Prefect's client (seconds): after the checks

    with prefect_server_reached(url):
        if (running := running_pipeline(run_id)) is None:
            fail(f"no pipeline of run {run_id!r} is running on {url}: nothing to scale", code=1)
        pipeline_run, started_with = running
        if started_with is not None and started_with.prefect.mode == "local":
            fail(f"run {run_id} runs in local mode (prefect.mode: local): its {started_with.prefect.generators} generation "
                 "subflows share one process, which no scale request reaches; start it with prefect.mode: deployed to scale it", code=1)  # fmt: skip
        Variable.set(scale_variable(run_id), scale_request(generators, str(pipeline_run.id)), overwrite=True)
    console.print(f"run {run_id}: asked for {generators} generation run{'s' if generators != 1 else ''} (variable {scale_variable(run_id)})")
    if started_with is not None and (policy := started_with.prefect.autoscale) is not None:
        bounded = policy.bounded(generators)
        takes = f"it takes {bounded} (prefect.autoscale's min {policy.min}, max {policy.max}), and" if bounded != generators else "and"
        console.print(f"note: run {run_id} autoscales: {takes} its measurements may move it again "
                      f"{policy.cooldown_seconds:g} s after", soft_wrap=True)  # fmt: skip


@config_app.command("show")
def config_show(
    config: ConfigFile,
    overrides: Overrides = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of YAML.")] = False,
) -> None:
    """Print the resolved configuration (defaults filled in, overrides applied, secrets masked).

    --json leaves the secrets out (null), saying on stderr which: its output is what a deployed run is submitted with, where the mask is refused as a value."""
    resolved = resolve_config(config, overrides)
    if not as_json:
        typer.echo(yaml.safe_dump(resolved.model_dump(mode="json"), sort_keys=False))
        return
    typer.echo(json.dumps(resolved.as_parameters(secrets=False), indent=2))
    if secrets := resolved.secrets():
        left_out = ", ".join(secrets)
        note = f"note: left out of the JSON (null): {left_out}. {SECRETS_IN_DEPLOYED_RUNS}"
        err_console.print(escape(note), highlight=False, soft_wrap=True)


@config_app.command("schema")
def config_schema() -> None:
    """Print the JSON Schema of a run configuration, with every field's description."""
    typer.echo(json.dumps(RunConfig.model_json_schema(), indent=2))


@storage_app.command("up")
def storage_up(
    data_dir: Annotated[Path, typer.Option("--dir", help="Directory that holds the data.")] = Path(
        "./s3data"
    ),
    port: Annotated[
        int, typer.Option(help="S3 port; the server also uses the next 8 ports.", min=1024, max=55000)
    ] = 8333,
) -> None:
    """Serve S3 on 127.0.0.1 (SeaweedFS) until Ctrl-C or SIGTERM."""
    from infra.seaweed import SeaweedServer

    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    if data_dir.exists() and not data_dir.is_dir():
        fail(f"--dir {data_dir}: not a directory; name a directory (it is created if missing)")
    try:
        server = SeaweedServer(data_dir.resolve(), port).start()
    except (RuntimeError, TimeoutError, OSError) as err:  # OSError: no weed binary, --dir not creatable
        fail(str(err), code=1)
    console.print(f"S3 endpoint: [bold]{server.endpoint_url}[/] (data in {server.data_dir})")
    console.print("any access key and secret work; Ctrl-C stops the server")
    try:
        while not stop.wait(0.5):
            if server.process.poll() is not None:
                fail(f"weed exited with code {server.process.returncode}", code=1)
    finally:
        server.stop()
    console.print("S3 server stopped")


@engine_app.command("serve")
def engine_serve(
    model: Annotated[Path, typer.Option(help="HF model directory to serve.", exists=True, file_okay=False)],
    port: Annotated[int, typer.Option(help="Port to listen on.", min=1, max=65535)] = 30000,
    host: Annotated[str, typer.Option(help="Address to bind; loopback unless you mean to expose it.")] = "127.0.0.1",
    api_key: Annotated[
        str | None,
        typer.Option(envvar="TANDEM_ENGINE_API_KEY", help="Require this Bearer token (or set the env var)."),
    ] = None,
    max_batch_size: Annotated[int, typer.Option(help="Most sequences decoded together.", min=1, max=1024)] = 32,
    weight_version: Annotated[str, typer.Option(help="Weight version reported until the first update.")] = "0",
    parent_pid: Annotated[
        int | None, typer.Option(help="Stop when this process (the one that starts the engine) dies.", min=2)
    ] = None,
    sim_latency: Annotated[
        str | None, typer.Option(help="Serve the simulated engine with this latency model (JSON of engine.sim).")
    ] = None,
) -> None:
    """Serve a model with tandem's CPU engine (or the simulated one) behind SGLang's native HTTP API."""
    import logging

    from pydantic import ValidationError

    from configs.loader import describe_validation_error
    from configs.sections import SimLatencyConfig
    from infra.engines.server import AddressUnavailable, ModelUnloadable, serve
    from infra.modelfactory import given_model_dir

    try:
        latency = SimLatencyConfig.model_validate_json(sim_latency) if sim_latency else None
    except ValidationError as err:
        fail(describe_validation_error(err, SimLatencyConfig, what="--sim-latency (a JSON object of engine.sim's fields)"))
    try:
        given_model_dir(str(model))
    except FileNotFoundError:
        fail(f"--model {model}: not an HF model directory (no config.json)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        serve(str(model), host=host, port=port, api_key=api_key, max_batch_size=max_batch_size,
              weight_version=weight_version, parent_pid=parent_pid, sim_latency=latency)  # fmt: skip
    except AddressUnavailable as err:
        fail(f"--port {port}: {err}", code=1)
    except ModelUnloadable as err:
        fail(f"--model: {err}")


def main() -> None:
    """Entry point for `python -m flows.cli`."""
    sys.exit(app())


if __name__ == "__main__":
    main()
