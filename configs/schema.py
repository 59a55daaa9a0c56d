"""The run configuration: `RunConfig`, which holds one model per section (configs/sections.py)
and checks what spans sections.

A run is described by one YAML file (configs/tiny.yaml is the embedded default) that loads into
`RunConfig`; configs/loader.py reads the file and applies `--set` overrides. A config that gives
`model.path` takes other training defaults (`PRETRAINED_TRAINING_DEFAULTS`) where it leaves
them out.

This package imports nothing of tandem: every other layer may import it.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import Field, SecretStr, field_validator, model_validator

from configs.fields import MAX_SLOTS, RUN_ID_FORM, is_run_id, whole_text_pattern
from configs.sections import (
    DaskConfig, EngineConfig, EnvConfig, GenerationConfig, LagConfig, ModelConfig, PrefectConfig, Section, StorageConfig, TrainingConfig,
)  # fmt: skip

PRETRAINED_TRAINING_DEFAULTS = {
    "lr": 1e-6, "warmup_steps": 0, "warmup_lr": 1e-5, "micro_batch_size": 4, "gradient_checkpointing": True,
}  # fmt: skip
"""TrainingConfig's defaults for a run that starts from model.path (RunConfig._pretrained_defaults):
learning rates of the order full-parameter GRPO uses on pretrained models, no warm-start, and the
memory savings a real model's GPU needs."""


class RunConfig(Section):
    """A whole run: what `tandem run` takes and what {root}/{run_id}/config.json records."""

    run_id: str = Field("tiny", json_schema_extra={**whole_text_pattern(RUN_ID_FORM), "maxLength": 64})
    """Name of the run directory: letters, digits, `.`, `_`, `-`; at most 64 characters."""
    seed: int = Field(0, ge=0, le=2**32 - 1)
    """Seed of the initial model's weights, the prompt sets and the warm-start's sampling. Engines
    sample unseeded: with batching and timing in play, a rollout is not reproducible anyway."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """The policy model."""
    engine: EngineConfig = Field(default_factory=EngineConfig)
    """The inference engines."""
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    """The generation side."""
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    """The trainer."""
    lag: LagConfig = Field(default_factory=LagConfig)
    """The staleness bound."""
    storage: StorageConfig = Field(default_factory=StorageConfig)
    """The run directory's object storage."""
    env: EnvConfig = Field(default_factory=EnvConfig)
    """The environment, reward and prompts."""
    dask: DaskConfig = Field(default_factory=DaskConfig)
    """The Dask cluster for episodes."""
    prefect: PrefectConfig = Field(default_factory=PrefectConfig)
    """How the flows are run."""

    @model_validator(mode="before")
    @classmethod
    def _pretrained_defaults(cls, data: Any) -> Any:
        """Training defaults for a `model.path` model where the config leaves them out. The plain
        defaults fit the factory's random-init model; on pretrained weights a warm-start of 55
        steps at 1e-3 and RL at 1e-4 would overwrite what the model knows, and a batch of
        128 sequences in one pass does not fit a GPU. Given values always win, and the run's
        recorded config holds the values used."""
        if not isinstance(data, dict):
            return data
        model, training = data.get("model"), data.get("training") or {}
        path = model.path if isinstance(model, ModelConfig) else model.get("path") if isinstance(model, dict) else None
        if path is None:
            return data
        if isinstance(training, TrainingConfig):
            given = {name: getattr(training, name) for name in training.model_fields_set}
            return data | {"training": training.model_copy(update=PRETRAINED_TRAINING_DEFAULTS | given)}
        return data | {"training": PRETRAINED_TRAINING_DEFAULTS | training} if isinstance(training, dict) else data

    def secrets(self) -> dict[str, SecretStr]:
        """The credentials this config sets, by field path (`engine.api_key`)."""
        return {f"{name}.{key}": value for name, section in self if isinstance(section, Section)
                for key, value in section if isinstance(value, SecretStr)}  # fmt: skip

    def as_parameters(self, *, secrets: bool) -> dict[str, Any]:
        """This config as JSON flow parameters. Pydantic's JSON dump writes each secret as the
        mask, which validation refuses, so the caller says what a secret becomes: its value
        (`secrets=True`: a child run of a parent that was given it, which the server already holds
        among the parent's parameters) or null (an event's payload, which the server shows to anyone
        who can read events: its consumer takes credentials from its own environment)."""
        data = self.model_dump(mode="json")
        for path, value in self.secrets().items():
            section, key = path.split(".")
            data[section][key] = value.get_secret_value() if secrets else None
        return data

    @model_validator(mode="after")
    def _no_credentials_in_parameters(self) -> RunConfig:
        # A deployed run hands its config to child runs as Prefect parameters, which the server
        # stores and the UI shows: credentials must reach the workers another way.
        if self.prefect.mode == "deployed" and (self.storage.key or self.storage.secret):
            raise ValueError(
                "storage.key and storage.secret must be null when prefect.mode is 'deployed': "
                "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY on the workers, or name a Prefect "
                "Secret block in storage.credentials_block"
            )
        return self

    @model_validator(mode="after")
    def _slots_fit_shard_keys(self) -> RunConfig:
        # Admission lets generators start groups up to max_lag + 1 steps past the trainer, and a
        # group's slot number is its shard key's six-digit sequence.
        steps, per_step, lag = self.training.steps, self.training.prompts_per_step, self.lag.max_lag
        if (steps + lag + 1) * per_step > MAX_SLOTS:
            raise ValueError(
                f"(training.steps + lag.max_lag + 1) x training.prompts_per_step (({steps} + {lag} + 1) x "
                f"{per_step}) must be at most {MAX_SLOTS:,}: a shard key numbers a run's prompt groups in six digits"
            )
        return self

    @model_validator(mode="after")
    def _evaluations_have_prompts(self) -> RunConfig:
        if self.prefect.evaluate_every and not self.env.eval_prompts:
            raise ValueError(
                f"prefect.evaluate_every ({self.prefect.evaluate_every}) needs held-out prompts: "
                "env.eval_prompts must be at least 1, or set evaluate_every to 0"
            )
        every, publish = self.prefect.evaluate_every, self.training.publish_every
        if every % publish:
            raise ValueError(
                f"prefect.evaluate_every ({every}) must be a multiple of training.publish_every ({publish}): only "
                f"published snapshots are evaluated, so v{every} would be skipped, and the first scored would be "
                f"v{every * publish // math.gcd(every, publish)}"
            )
        return self

    @model_validator(mode="after")
    def _generators_can_stay_fresh(self) -> RunConfig:
        # Admission lets a generator start work for batch b only on weights >= b - max_lag. If
        # snapshots came out less often than every max_lag + 1 steps, no published snapshot
        # would ever be fresh enough and the run would wait forever.
        if self.training.publish_every > self.lag.max_lag + 1:
            raise ValueError(
                f"training.publish_every ({self.training.publish_every}) must be at most "
                f"lag.max_lag + 1 ({self.lag.max_lag + 1}): generators need a snapshot at most "
                "max_lag versions old"
            )
        return self

    @field_validator("run_id", mode="before")
    @classmethod
    def _digits_are_a_name(cls, run_id: Any) -> Any:
        """`run_id: 2024` in YAML (or `--set run_id=2024`) is a number to the parser, a name here,
        as `--run-id 2024` is."""
        return str(run_id) if isinstance(run_id, int) and not isinstance(run_id, bool) else run_id

    @field_validator("run_id")
    @classmethod
    def _safe_run_id(cls, run_id: str) -> str:
        if not is_run_id(run_id):
            raise ValueError(
                "run_id must be 1-64 characters of letters, digits, '.', '_' or '-', start with a "
                f"letter or digit and contain no '..', got {run_id!r}"
            )
        return run_id
