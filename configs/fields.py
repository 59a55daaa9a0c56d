"""Field types of the run configuration and their checks, which configs/sections.py and configs/schema.py build on.

Each type carries both a pydantic check, worded for a person, and where Prefect needs it a
JSON-schema twin (`whole_text_pattern`), so that a deployment refuses a bad parameter when the
run is submitted, before any worker starts it.
"""

from __future__ import annotations

import re
from types import UnionType
from typing import Annotated, Any, Union, get_args, get_origin
from urllib.parse import urlsplit

from pydantic import AfterValidator, Field, SecretStr

RUN_ID_FORM = r"[A-Za-z0-9](?:\.?[A-Za-z0-9_-])*\.?"
"""Letters, digits, '.', '_' and '-', starting with a letter or digit, no '..' (a run id is a path
segment: '..' would name the parent). Without lookarounds, so that pydantic's regex engine takes it."""


def whole_text_pattern(form: str) -> dict[str, str]:
    """The JSON-schema `pattern` of text that is `form` and nothing else, for a field's
    `json_schema_extra`. Prefect checks submitted parameters with Python's re, whose `$` also
    matches before a final newline: the lookahead refuses that newline. Pydantic validates with its
    own engine, whose `$` is the very end and which has no lookarounds, so fields keep a plain
    `pattern` (or validator) for validation and carry this one for the schema."""
    return {"pattern": f"^(?:{form})(?!\\n)$"}


RunId = Annotated[str, Field(pattern=f"^{RUN_ID_FORM}$", max_length=64, json_schema_extra=whole_text_pattern(RUN_ID_FORM))]
"""A run id as a flow parameter: Prefect checks the pattern when a run is submitted."""


MAX_GENERATION_RUNS = 256
"""Generation runs one deployed run may have (prefect.generators, autoscale, `tandem scale`)."""

MAX_SLOTS = 999_999
"""Prompt groups one run may generate ((steps + max_lag + 1) x prompts_per_step): a shard key numbers them in six
digits (tasks/shards.py)."""

ROOT_PATTERN = r"^(?:file://|memory://|s3:///*[^/])"
ENTRYPOINT_FORM = r"[A-Za-z_][\w.]*:[A-Za-z_]\w*"
BLOCK_NAME_FORM = r"[a-z0-9][a-z0-9-]{0,127}"
DEPLOYMENT_NAME_FORM = r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}"
TRAINER_DEVICE_FORM = r"auto|cpu|cuda(?::[0-9]{1,2})?"
"""Forms of the fields below whose checks are Python code or need the JSON-schema twin of
`whole_text_pattern`: a field's validator words the error for a person, its pattern lets Prefect
refuse the field at submission."""


def _top_k_disabled_or_positive(top_k: int) -> int:
    if top_k == 0:
        raise ValueError("top_k must be -1 (disabled) or at least 1, got 0")
    return top_k


TopK = Annotated[int, Field(ge=-1, json_schema_extra={"not": {"const": 0}}), AfterValidator(_top_k_disabled_or_positive)]
"""A top-k cut-off as SGLang takes it: -1 disables it, 0 is refused (the config's and the engine
API's; the JSON-schema twin lets Prefect refuse 0 at submission)."""


MASKED_SECRET = "**********"
"""What pydantic's JSON dump writes in place of a secret (config.json, `tandem config show`)."""


def _not_the_mask(secret: SecretStr | None) -> SecretStr | None:
    if secret is not None and secret.get_secret_value() == MASKED_SECRET:
        raise ValueError(
            f"{MASKED_SECRET!r} is what a config dump shows in place of a secret, not a secret: "
            "give the value itself, or null"
        )
    return secret


Credential = Annotated[SecretStr | None, AfterValidator(_not_the_mask)]
"""A credential, or null. The mask is refused: a dumped config fed back as parameters (a child
run's, an event's) would otherwise make the ten asterisks the credential, silently."""


def takes_a_number_not_a_boolean(annotation: Any) -> bool:
    """Whether a field of this type is a number (maybe optional, maybe constrained) and no bool."""
    if get_origin(annotation) is Annotated:
        return takes_a_number_not_a_boolean(get_args(annotation)[0])
    options = get_args(annotation) if get_origin(annotation) in (Union, UnionType) else (annotation,)
    plain = [get_args(o)[0] if get_origin(o) is Annotated else o for o in options]
    return bool not in plain and any(o in (int, float) for o in plain)


def is_run_id(text: str) -> bool:
    return len(text) <= 64 and re.fullmatch(RUN_ID_FORM, text) is not None


def _http_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"endpoint_url must be an http:// or https:// URL such as http://127.0.0.1:8333, got {url!r}")
    return url


EndpointUrl = Annotated[str, AfterValidator(_http_url), Field(json_schema_extra={"pattern": r"^https?://[^/\s]+"})]
"""An S3 endpoint URL. botocore refuses anything else only at the first request, as a traceback
on whichever machine makes it (a deployed run's worker)."""


SGLANG_FLAGS_SET_BY_TANDEM = {
    "--model-path": "the run's snapshot", "--host": "engine.host", "--port": "engine.base_port",
    "--tp-size": "engine.tp_size", "--mem-fraction-static": "engine.mem_fraction_static",
    "--random-seed": "the engine's index", "--base-gpu-id": "the engine's index",
    "--weight-version": "the snapshot's version", "--dtype": "the checkpoint's dtype",
    "--api-key": "engine.api_key", "--config": "engine.api_key",
    "--model": "the run's snapshot", "--tensor-parallel-size": "engine.tp_size",
    "--nccl-port": "a free port tandem picks for each engine",
}  # fmt: skip
"""What each `sglang.launch_server` flag the launcher passes comes from (infra/engines/sglang.py),
with SGLang's aliases of them (--model, --tensor-parallel-size)."""
SGLANG_FLAGS_REFUSED = {
    "--trust-remote-code": "would run Python files from the snapshot, which a run directory must never make anyone do "
                           "(a bucket's content is data)",
    "--enable-deterministic-inference": "seeds every request that carries no sampling_seed alike, and tandem's samples carry "
                                        "none: every sample of a group would come out the same, and GRPO learn nothing",
    "--admin-api-key": "would make SGLang's pause, continue, weight-load and abort endpoints take that key only, and tandem "
                       "sends them engine.api_key",
}  # fmt: skip
"""`sglang.launch_server` flags that would break a run, and how (SGLang 0.5.23)."""


def _no_flag_tandem_sets_or_refuses(args: list[str]) -> list[str]:
    for arg in args:
        flag = arg.split("=", 1)[0]
        # argparse also takes an unambiguous prefix of a flag: --tp for --tp-size
        refused = [name for name in SGLANG_FLAGS_REFUSED if flag.startswith("--") and len(flag) > 3 and name.startswith(flag)]
        if refused:
            raise ValueError(f"{refused[0]} {SGLANG_FLAGS_REFUSED[refused[0]]}; leave it out")
        owned = [name for name in SGLANG_FLAGS_SET_BY_TANDEM if flag.startswith("--") and name.startswith(flag)]
        if owned:
            raise ValueError(f"{owned[0]} is set by tandem from {SGLANG_FLAGS_SET_BY_TANDEM[owned[0]]}; leave {flag} out")
    return args


SGLangArgs = Annotated[list[str], AfterValidator(_no_flag_tandem_sets_or_refuses)]
"""Extra `sglang.launch_server` flags: none that tandem sets itself, nor one that would break a run."""
