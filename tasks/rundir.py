"""Starting a run directory: the resolved config, written once, and the initial snapshot v0.

`initialize_run` is what every entry point does first (`tandem init`, and the pipeline flow).
It is idempotent, so a restarted pipeline calls it again safely; and it refuses to reuse a run
id whose recorded config differs, because a run directory whose shards and snapshots came from
two configs cannot be trained on or compared honestly. Before it writes anything it checks what
validation cannot (`check_run_inputs`: the environment imports and takes env.kwargs, model.path
is a model, a GPU training.device names is here), so a typo there leaves no config.json behind
to refuse the corrected config.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from pydantic_core import to_jsonable_python

from configs.loader import ConfigError, apply_override, section_model, validate_config, without_masked_secrets
from configs.fields import is_run_id
from configs.schema import PRETRAINED_TRAINING_DEFAULTS, RunConfig
from infra.modelfactory import build_tokenizer, given_model_dir, load_tokenizer, load_trainable_model, prepare_initial_model
from infra.storage import RunStore, StorageRejected, open_run_store
from tasks.envs import EnvironmentLoadError, environment_factory, has_demonstrations
from tasks.placement import release_gpu_memory, trainer_device
from tasks.snapshots import latest_version, move_latest_forward, publish_snapshot, publish_snapshot_dir, snapshot_versions

CONFIG_KEY = "config.json"


OPERATIONAL_FIELDS = (
    "run_id", "storage.root", "storage.endpoint_url", "storage.retry_seconds", "storage.keep_last_snapshots",
    "storage.keep_every_snapshot", "storage.keep_last_checkpoints", "training.steps", "training.checkpoint_every", "training.micro_batch_size",
    "training.gradient_checkpointing",
    "training.device", "training.compute_dtype", "storage.key", "storage.secret", "storage.credentials_block",
    "generation.engines",
    "generation.prompts_per_chunk", "generation.hand_off_stragglers", "env.eval_prompts", "env.step_timeout_s", "prefect", "dask",
    "engine",
)  # fmt: skip
"""Config fields a restarted or continued run may change: how it runs and for how long, not
what it trains on. config.json keeps the values of the run's first start. Where the run lies
(run_id, storage.root and its endpoint) is among them: the directory found there is the run,
however its root was spelt (`file://./runs` from another directory, an absolute path, a copy)."""


class RunConflict(ValueError):
    """The run id exists with a different configuration."""


class RunMissing(ConfigError):
    """No run directory (no config.json) at a run's URL."""


def config_document(config: RunConfig) -> bytes:
    """The bytes of config.json: the resolved config with secrets masked, keys sorted."""
    return json.dumps(config.model_dump(mode="json"), indent=2, sort_keys=True).encode()


def write_run_config(store: RunStore, config: RunConfig) -> bool:
    """Record the config (once). Returns True if written now, False if the same one was there."""
    if store.put_if_absent(CONFIG_KEY, config_document(config)):
        return True
    check_recorded_config(store, config)
    return False


def check_recorded_config(store: RunStore, config: RunConfig) -> None:
    """RunConflict unless the run directory records no config, or one that differs from `config`
    in operational fields only (ConfigError for a damaged config.json). Read-only, so the CLI can
    refuse a reused run id in one line before a flow run starts."""
    if not store.exists(CONFIG_KEY):
        return
    recorded = read_recorded_config(store)
    changed = [f for f in _changed_fields(recorded, json.loads(config_document(config))) if not _operational(f)]
    if changed:
        raise RunConflict(
            f"run {config.run_id!r} at {store.url} was started with a different config "
            f"(differs in: {', '.join(changed)}); use another --run-id or the recorded config"
        )


def load_run_config(run_url: str, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """The config recorded in an existing run directory ({root}/{run_id}), with `overrides`
    (run_id and storage.root excepted: the URL names them).

    Secrets are recorded masked, so they are dropped here and come from the environment (or an
    override) again. The storage overrides (an endpoint, credentials, a Secret block) are also how
    config.json itself is read."""
    root, _, run_id = run_url.rstrip("/").rpartition("/")
    if not root or "://" not in root:
        raise ConfigError(f"{run_url!r} is not a run directory URL like file:///path/runs/RUN_ID")
    if not is_run_id(run_id):  # `..` would read the parent
        raise ConfigError(
            f"{run_url!r} ends in {run_id!r}, not a run id "
            "(1-64 letters, digits, '.', '_' or '-', no '..')"
        )
    for override in overrides:
        if override.partition("=")[0].strip() in ("run_id", "storage.root"):
            raise ConfigError(
                f"--set {override!r}: the run URL {run_url} names the run and its root; "
                "to score another run, give its URL"
            )
    reach: dict = {}  # how to read config.json itself: the storage overrides (endpoint, credentials block)
    for override in overrides:
        if override.startswith("storage."):
            apply_override(reach, override)
    storage = validate_config({"storage": reach.get("storage", {}) | {"root": root}}).storage
    store = open_run_store(storage, run_id)
    try:
        recorded = read_recorded_config(store)
    except FileNotFoundError:
        raise RunMissing(f"no {CONFIG_KEY} in {store.url}: not a tandem run directory") from None
    recorded = without_masked_secrets(recorded)
    recorded["run_id"] = run_id  # the run the URL names, wherever it was started (a relative
    recorded.setdefault("storage", {})["root"] = root  # root names another place from elsewhere)
    for override in overrides:
        apply_override(recorded, override)
    return validate_config(recorded)


def read_recorded_config(store: RunStore) -> dict:
    """The run's config.json as a mapping; FileNotFoundError if there is none.

    A damaged one is a ConfigError naming the file, not a bare JSONDecodeError: the person has to
    learn which file of the run directory to restore."""
    url = store.url_of(CONFIG_KEY)
    try:
        recorded = json.loads(store.read_bytes(CONFIG_KEY))
    except ValueError as err:  # JSONDecodeError and UnicodeDecodeError alike
        raise ConfigError(f"{url} is not JSON ({err}): the run directory is damaged") from None
    if not isinstance(recorded, dict):
        raise ConfigError(f"{url} holds a JSON {type(recorded).__name__}, not a run config")
    return recorded


def initialize_run(config: RunConfig) -> RunStore:
    """Open the run directory, record the config, and publish the initial model as v0 once:
    warm-started on the environment's demonstrations when training.warmup_steps > 0."""
    store = open_run_store(config.storage, config.run_id)
    check_run_inputs(config, store)
    write_run_config(store, config)
    if not _has_initial_snapshot(store):
        with tempfile.TemporaryDirectory(prefix="tandem-init-") as staging:
            model_dir = prepare_initial_model(config.model, Path(staging) / "model", config.seed)
            if config.training.warmup_steps == 0:
                publish_snapshot_dir(store, model_dir, 0)
            else:
                from tasks.warmup import warm_start  # torch's import (4 s): not for the checks above

                device = trainer_device(config)
                (model, stored_dtype), tokenizer = load_trainable_model(model_dir, device), load_tokenizer(model_dir)
                warm_start(model, tokenizer, config)
                publish_snapshot(store, model, tokenizer, 0, staging_dir=Path(staging), dtype=stored_dtype)
                del model
                release_gpu_memory(device)
    elif latest_version(store) is None:  # v0 committed and LATEST never written: a failure between the two
        move_latest_forward(store, 0)
    return store


def _has_initial_snapshot(store: RunStore) -> bool:
    return 0 in snapshot_versions(store) or latest_version(store) is not None


def check_run_writable(store: RunStore) -> None:
    """StorageRejected, in one line, unless a file:// run directory exists or can be made, and
    can be written (S3's bucket is made or refused when the store opens). Otherwise the first
    write, the run's lease, failed with a traceback of a few hundred lines. Leaves nothing
    behind: the directories it made to find out are removed again."""
    path = store.local_path("")
    if path is None:
        return
    made = [p for p in (path, *path.parents) if not p.exists()]
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".tandem-write-check-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise StorageRejected(f"cannot write the run directory {path}: {err.strerror or err}") from None
    finally:
        for directory in made:  # deepest first
            if directory.is_dir():
                directory.rmdir()


def check_run_inputs(config: RunConfig, store: RunStore) -> None:
    """ConfigError naming the field unless the run directory outlives this process, env.entrypoint
    loads, the environment accepts env.kwargs and has env.train_prompts and env.eval_prompts
    distinct problems, model.path (if set) is an HF model directory, and in local mode the GPU
    training.device names (if one) is here: what only importing and building can tell.

    model.path is read once, to make v0, so it is checked only while the run has no v0: a run
    that `retrain --param new_run_id=...` started from a directory since removed continues."""
    if config.storage.root.startswith("memory://"):
        raise ConfigError(f"storage.root {config.storage.root}: memory:// lives in one process (tests use it), and a run's "
                          "processes would each see their own, gone when they exit; use file:// or s3://")  # fmt: skip
    try:
        make_env = environment_factory(config.env.entrypoint, config.env.max_turns, config.env.kwargs)
    except EnvironmentLoadError as err:
        raise ConfigError(f"env.entrypoint: {err}") from None
    try:
        env = make_env()
    except Exception as err:  # whatever the user's class raises on these kwargs, a retry reads the same
        raise ConfigError(f"env.kwargs: {config.env.entrypoint} refuses them: {type(err).__name__}: {err}") from None
    if config.training.warmup_steps > 0 and not has_demonstrations(type(env)) and not _has_initial_snapshot(store):
        raise ConfigError(f"training.warmup_steps is {config.training.warmup_steps}, and {config.env.entrypoint} has no "
                          "demonstration for the warm-start: write its `demonstration`, or set training.warmup_steps: 0")  # fmt: skip
    for split, count in (("train", config.env.train_prompts), ("eval", config.env.eval_prompts)):
        if not count:  # an environment without held-out prompts runs with env.eval_prompts: 0
            continue
        try:  # the warm-start and the evaluation ask for them later, after the run directory is written
            env.prompts(split, count, config.seed)
        except Exception as err:
            raise ConfigError(f"env.{split}_prompts: {config.env.entrypoint} (env.kwargs {config.env.kwargs}) cannot give "
                              f"{count} {split} prompts: {type(err).__name__}: {err}") from None  # fmt: skip
    if config.model.path is not None and not _has_initial_snapshot(store):
        try:
            given_model_dir(config.model.path)
        except FileNotFoundError as err:
            raise ConfigError(str(err)) from None
        context = _model_context(config.model.path)
        if context is not None and config.model.max_position_embeddings > context:
            raise ConfigError(f"model.max_position_embeddings ({config.model.max_position_embeddings}) is past the context of "
                              f"model.path {config.model.path!r} ({context}): set it to at most {context}")  # fmt: skip
    if config.prefect.mode == "local" and config.training.device.startswith("cuda"):
        trainer_device(config)  # a GPU this machine lacks, before the engines start (deployed: in the warm-start or the trainer)


def pretrained_model_notes(config: RunConfig) -> list[str]:
    """What a config that gives model.path sets that is allowed but likely not meant: training
    values the config gives where a pretrained model's defaults differ (a shipped tiny config with
    `--set model.path=...` keeps its random-init model's learning rate and warm-start), and a
    context shorter than the model's (episodes are cut at it)."""
    if config.model.path is None:
        return []
    notes = []
    given = {name: getattr(config.training, name) for name, default in PRETRAINED_TRAINING_DEFAULTS.items()
             if getattr(config.training, name) != default}  # fmt: skip
    if given:
        notes.append("model.path is set, and the config gives " + ", ".join(f"training.{k} {v}" for k, v in given.items())
                     + " where a pretrained model's defaults are " + ", ".join(str(PRETRAINED_TRAINING_DEFAULTS[k]) for k in given)
                     + ": leave them out of the config to get those")  # fmt: skip
    context = _model_context(config.model.path)
    if context is not None and config.model.max_position_embeddings < context:
        notes.append(f"episodes are cut at model.max_position_embeddings ({config.model.max_position_embeddings}) tokens; "
                     f"model.path's context is {context}")  # fmt: skip
    return notes


UNKNOWN_TOKEN_NOTE_SHARE = 0.05
"""The share of unknown tokens in the training prompts past which `prompt_vocabulary_notes` speaks."""
PROMPTS_LOOKED_AT = 256


def prompt_vocabulary_notes(config: RunConfig) -> list[str]:
    """A note when the run's tokenizer reads much of its training prompts as its unknown token:
    the tiny built-in model knows only its tasks' words, and a user's environment of plain text
    on it trained on <unk> after <unk>, with nothing said. Looks at the first PROMPTS_LOOKED_AT
    prompts; says nothing if the environment or the tokenizer does not load (other checks name that)."""
    try:
        tokenizer = load_tokenizer(given_model_dir(config.model.path)) if config.model.path else build_tokenizer()
        make_env = environment_factory(config.env.entrypoint, config.env.max_turns, config.env.kwargs)
        prompts = make_env().prompts("train", config.env.train_prompts, config.seed)[:PROMPTS_LOOKED_AT]
    except Exception:
        return []
    unknown = tokenizer.unk_token_id
    ids = [i for p in prompts for i in tokenizer.encode(p.text, add_special_tokens=False)]
    share = sum(i == unknown for i in ids) / len(ids) if ids and unknown is not None else 0.0
    if share <= UNKNOWN_TOKEN_NOTE_SHARE:
        return []
    which = "model.path's tokenizer" if config.model.path else (
        "the tiny built-in model's tokenizer, which knows only its tasks' words (digits, + - * = ,, single letters and "
        "a few keywords: infra/modelfactory.py TASK_VOCABULARY); give model.path to train on text,"
    )  # fmt: skip
    return [f"{share:.0%} of the tokens of the training prompts are unknown to {which} and read as {tokenizer.unk_token}"]


def _model_context(path: str) -> int | None:
    """max_position_embeddings of the HF config.json under `path`, if it says (None if unreadable)."""
    try:
        context = json.loads((Path(path).expanduser() / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return None
    return context if isinstance(context, int) and not isinstance(context, bool) else None


def _operational(field: str) -> bool:
    return any(field == name or field.startswith(name + ".") for name in OPERATIONAL_FIELDS)


def _changed_fields(old: dict, new: dict, prefix: str = "") -> list[str]:
    """Fields of the recorded config `old` that `new` changes. A field the recorded config lacks
    was added since the run started, and ran as its default: only another value changes it."""
    changed = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key, _default_of(f"{prefix}{key}")), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            changed += _changed_fields(a, b, f"{prefix}{key}.")
        elif a != b:
            changed.append(f"{prefix}{key}")
    return changed


def _default_of(field: str) -> Any:
    """The JSON form of RunConfig's default for `field` ("training.lr"); None for a field it lacks."""
    *sections, name = field.split(".")
    model = section_model(RunConfig, sections)
    if model is None or name not in model.model_fields:
        return None
    return to_jsonable_python(model.model_fields[name].get_default(call_default_factory=True))
