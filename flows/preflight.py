"""What the `tandem` commands check before they act, and how they exit when a check fails.

Each check ends the command with one line for a person on stderr and an exit code (`fail`: 2
for bad input, 1 for a failure at run time) instead of a traceback: a config that does not
validate (`resolve_config`), an engine backend not installed here, a Prefect server not named
or not answering, a deployed run's missing child deployments, a prefect.yaml that does not
parse, and what the run directory refuses (`exits_on_run_errors`). `note_all` prints what is
allowed but likely not meant. flows/cli.py holds the commands; these stay light to import, as
the commands import torch and Prefect only after their checks.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

import typer
import yaml
from rich.console import Console
from rich.markup import escape

from configs import ConfigError, RunConfig, load_config

err_console = Console(stderr=True)


def fail(message: str, code: int = 2) -> NoReturn:
    """Print an error for a person and exit with `code` (2: bad input, 1: runtime failure)."""
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def resolve_config(config: Path | None, overrides: list[str] | None, run_id: str | None = None) -> RunConfig:
    """Load and validate (`--run-id` wins over the file), or exit 2 naming the field and what is allowed.

    `--run-id` is a string as given: quoted as a YAML scalar, so `--run-id 123` is the run "123"
    (not the integer), and `--run-id ''` is refused rather than ignored."""
    run_id_override = [f"run_id={json.dumps(run_id, ensure_ascii=False)}"] if run_id is not None else []
    try:
        return load_config(config, [*(overrides or ()), *run_id_override])
    except ConfigError as err:
        fail(str(err))


def note_all(notes: list[str]) -> None:
    """Print what is allowed but likely not meant, one `note:` line each, on stderr."""
    for note in notes:
        err_console.print(f"[bold yellow]note:[/] {escape(note)}", highlight=False, soft_wrap=True)


def require_engine_backend(config: RunConfig) -> None:
    """Exit 2 before anything starts when engine.backend is sglang and SGLang is not installed
    here (for a process that starts engines itself)."""
    if config.engine.backend == "sglang":
        from infra.engines.process import EngineStartError
        from infra.engines.sglang import require_sglang

        try:
            require_sglang()
        except EngineStartError as err:
            fail(str(err))


def prefect_server_url() -> str:
    """PREFECT_API_URL, or exit 2 saying how to set it: unset, Prefect would start a temporary
    server of its own, and what `deploy` or `scale` writes there reaches no one."""
    from prefect.settings import PREFECT_API_URL

    api_url = PREFECT_API_URL.value()
    if not api_url:
        fail("PREFECT_API_URL is not set: point it at your Prefect server, e.g. "
             "export PREFECT_API_URL=http://127.0.0.1:4200/api")  # fmt: skip
    return api_url


@contextmanager
def prefect_server_reached(api_url: str) -> Iterator[None]:
    """Exit 1 with one line naming `api_url` when the Prefect server there does not answer."""
    import httpx

    try:
        yield
    except httpx.TransportError as err:
        fail(f"cannot reach the Prefect server at {api_url} (PREFECT_API_URL): {err or type(err).__name__}", code=1)


def require_child_deployments(name: str) -> None:
    """Exit unless the server at PREFECT_API_URL has the deployments a deployed run starts its
    children from (infra/deployments.py); without PREFECT_API_URL, a deployed run would start
    them on a temporary server of its own, which no worker polls."""
    from infra.deployments import require_child_deployments as check

    with prefect_server_reached(prefect_server_url()):
        try:
            check(name)
        except ConfigError as err:
            fail(str(err))


def load_deployment_spec(path: Path) -> dict:
    """prefect.yaml, or exit 2 naming what is wrong with it: README has people edit it (the
    nightly schedule's run id), and a slip there was a traceback from the YAML parser or the
    pool set-up."""
    try:
        spec = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        fail(f"{path}: not valid YAML: {err}")
    if not isinstance(spec, dict):
        fail(f"{path}: must be a mapping with a `deployments` list, not {'nothing' if spec is None else f'a YAML {type(spec).__name__}'}")
    deployments = spec.get("deployments", [])
    if not isinstance(deployments, list):
        fail(f"{path}: `deployments` must be a list of mappings, each with a `name`")
    for i, deployment in enumerate(deployments):
        if not (isinstance(deployment, dict) and isinstance(deployment.get("name"), str)):
            fail(f"{path}: deployments[{i}] must be a mapping with a `name`")
        if not isinstance(deployment.get("work_pool", {}), dict):
            fail(f"{path}: deployments[{i}] ({deployment['name']}): `work_pool` must be a mapping with a `name`")
    return spec


@contextmanager
def exits_on_run_errors(where: str) -> Iterator[None]:
    """Exit with one line for what a run directory refuses: another config recorded there or a
    damaged one, a bad config (2); storage that does not answer or refuses, prefixed with
    `where` (the storage root or run URL), or a run another pipeline holds (1)."""
    from infra.storage import StorageRejected, StorageUnavailable
    from tasks.lease import RunInUse
    from tasks.rundir import RunConflict

    try:
        yield
    except (RunConflict, ConfigError) as err:
        fail(str(err))
    except (StorageUnavailable, StorageRejected) as err:
        fail(f"{where}: {err}", code=1)
    except RunInUse as err:
        fail(str(err), code=1)
