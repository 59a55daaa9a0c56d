"""Loading a run configuration: YAML file -> `--set` overrides -> validated `RunConfig`.

`load_config` is how a config file enters tandem (CLI, flows, tests); a config that arrives as
a mapping (a run's recorded config.json) goes through `validate_config`, and a deployment's
parameter is validated by Prefect into `RunConfig` itself. Every failure, from a
YAML syntax error to an out-of-range field, raises `ConfigError` whose message names the field
path and what is allowed, so the CLI can print it and exit 2 before anything is written.
"""

from __future__ import annotations

import reprlib
import types
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, SecretStr, ValidationError

from configs.fields import MASKED_SECRET
from configs.schema import RunConfig


class ConfigError(ValueError):
    """A configuration that cannot be used; the message is meant for the person who wrote it."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping: YAML keeps the last one
    silently, so a section written twice (two `training:` blocks) would lose the first one's
    settings unseen, the same trap as a misspelt key."""


def _construct_unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: set[str] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if isinstance(key, str):
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} is given twice", key_node.start_mark)
            seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping)


def load_config(source: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Read YAML `source` (None: all defaults), apply `section.field=value` overrides, validate."""
    data = read_yaml_mapping(Path(source)) if source is not None else {}
    for override in overrides:
        apply_override(data, override)
    return validate_config(data)


def read_yaml_mapping(path: Path) -> dict[str, Any]:
    """Parse a YAML file that must hold a mapping of sections."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot read config file: {err}") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if data is None:
        raise ConfigError(f"{path}: the config file is empty; expected a mapping of sections")
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: the config must be a mapping of sections, got a YAML {type(data).__name__}"
        )
    _keep_text_as_written(data, yaml.compose(text, Loader=_UniqueKeyLoader))
    # A section whose keys are all commented out is null to YAML: empty, not "not a dictionary".
    return {key: {} if value is None and section_model(RunConfig, [key]) else value for key, value in data.items()}


def _keep_text_as_written(data: dict[str, Any], document: yaml.MappingNode) -> None:
    """Give each text field that YAML read as something else (`run_id: 007` the number 7,
    `0777` 511 in YAML 1.1, `1:30` 90, `2024-12-07` a date, `yes` true) its text as written."""
    for path in TEXT_FIELDS:
        node, value = document, data
        for key in path:
            if not (isinstance(node, yaml.MappingNode) and isinstance(value, dict) and key in value):
                break
            node = next(v for k, v in node.value if k.value == key)
            value = value[key]
        else:
            if value is not None and not isinstance(value, str) and isinstance(node, yaml.ScalarNode) and not node.style:
                parent = data
                for key in path[:-1]:
                    parent = parent[key]
                parent[path[-1]] = node.value


def _text_fields(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """The paths of `model`'s fields that hold text (a str or a secret, or null)."""
    paths = []
    for name, field in model.model_fields.items():
        union = typing.get_origin(field.annotation) in (typing.Union, types.UnionType)
        kinds = [t for t in typing.get_args(field.annotation) if t is not type(None)] if union else [field.annotation]
        kinds = [typing.get_args(t)[0] if typing.get_origin(t) is typing.Annotated else t for t in kinds]
        if sections := [t for t in kinds if isinstance(t, type) and issubclass(t, BaseModel)]:
            paths += _text_fields(sections[0], (*prefix, name))
        elif all(t in (str, SecretStr) for t in kinds):
            paths.append((*prefix, name))
    return paths


TEXT_FIELDS = _text_fields(RunConfig)
"""Paths of the config's text fields: `run_id`, `model.path`, `engine.api_key`, ..."""


YAML_INDICATORS = "&*!#|>%@`"
"""Characters that YAML reads as syntax at the start of a value, not as the start of a text."""


def apply_override(data: dict[str, Any], override: str) -> None:
    """Set `a.b.c=value` in nested `data`; the value is parsed as YAML (`2`, `true`, `null`,
    `[1, 2]`), except that one starting with a character YAML gives a meaning of its own (`&`
    anchor, `*` alias, `#` comment, `!` tag, ...) or that is not YAML at all is taken as the text
    it is. YAML would read `&k3y` as an anchor on nothing, null, and an api key given so would
    have turned authentication off; `**********`, the mask `config show` prints, is then refused
    by the field's own message rather than a parser's."""
    path, sep, raw_value = override.partition("=")
    keys = path.strip().split(".")
    if not sep or not all(keys):
        raise ConfigError(f"--set {override!r}: expected section.field=value")
    text = raw_value.strip()
    if not text:
        value: Any = ""
    elif text[0] in YAML_INDICATORS:
        value = raw_value
    else:
        try:
            value = yaml.safe_load(raw_value)
        except yaml.YAMLError:
            value = raw_value
        if tuple(keys) in TEXT_FIELDS and value is not None and not isinstance(value, str):
            value = text  # a text field as written: `run_id=007` is not run 7
    node = data
    for depth, key in enumerate(keys[:-1]):
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {override!r}: {'.'.join(keys[: depth + 1])} is not a section")
        node = child
    node[keys[-1]] = value


def without_masked_secrets(data: dict[str, Any]) -> dict[str, Any]:
    """A config mapping as recorded (a run's config.json, a flow run's parameters on the Prefect
    server) with each masked secret (`**********`, written in place of one) read as unset: the
    secret itself is not there, and the mask is refused as a value."""
    return {name: {key: None if value == MASKED_SECRET else value for key, value in section.items()} if isinstance(section, dict) else section
            for name, section in data.items()}  # fmt: skip


def validate_config(data: dict[str, Any]) -> RunConfig:
    """Validate a raw mapping into a `RunConfig`, turning pydantic's errors into one readable message."""
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(describe_validation_error(err)) from None


def describe_validation_error(err: ValidationError, model: type[BaseModel] = RunConfig, what: str = "config") -> str:
    """One line per problem: `field.path: what is wrong (got X)`, unknown keys with the allowed
    ones (of `model`, the one validated: the run config unless said)."""
    lines = [f"invalid {what} ({err.error_count()} problem{'s' * (err.error_count() > 1)}):"]
    for problem in err.errors():
        loc = [str(part) for part in problem["loc"]]
        where = ".".join(loc) or "(top level)"
        if problem["type"] == "extra_forbidden":
            allowed = ", ".join(_allowed_keys(model, loc[:-1]))
            lines.append(f"  {where}: unknown key; allowed here: {allowed}")
            continue
        message = problem["msg"].removeprefix("Value error, ")
        shown = problem.get("input")
        quoted = f"got {shown!r}" in message  # a validator's own "got 'x'" (or "got 0")
        got = "" if isinstance(shown, dict) or quoted else f" (got {_short_repr(shown)})"
        lines.append(f"  {where}: {message}{got}")
    return "\n".join(lines)


def _short_repr(value: Any) -> str:
    """repr() with long strings and deep or long containers cut short: a 10^6-item list, or a YAML
    alias bomb (nested anchors that expand exponentially), would otherwise print megabytes or
    never finish."""
    shortener = reprlib.Repr()
    shortener.maxlevel = 2
    shortener.maxstring = shortener.maxother = 100
    return shortener.repr(value)


def section_model(model: type[BaseModel], path: list[str]) -> type[BaseModel] | None:
    """The model of the section at `path` inside `model` (["training"] -> TrainingConfig); None
    where a step of the path is not a field holding a section."""
    for key in path:
        field = model.model_fields.get(key)
        annotation = field.annotation if field else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        model = annotation
    return model


def _allowed_keys(model: type[BaseModel], loc: list[str]) -> list[str]:
    """The field names valid at `loc` inside `model`, for the unknown-key message."""
    section = section_model(model, loc)
    return sorted(section.model_fields) if section else []
