"""The sections of the run configuration: one pydantic model each (`model`, `engine`,
`generation`, `training`, `lag`, `storage`, `env`, `dask`, `prefect`), with the checks that need
only the section's own fields. configs/schema.py's `RunConfig` holds them all and checks what
spans sections; the field types with checks of their own are configs/fields.py's.

Every section forbids unknown keys, because a misspelt key that is silently ignored is the worst
kind of config bug: the run goes ahead with a default the user thinks they changed. Field
docstrings double as the JSON Schema descriptions (`tandem config schema`).
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from configs.fields import (
    BLOCK_NAME_FORM, DEPLOYMENT_NAME_FORM, ENTRYPOINT_FORM, MAX_GENERATION_RUNS, ROOT_PATTERN, TRAINER_DEVICE_FORM, Credential,
    EndpointUrl, SGLangArgs, TopK, takes_a_number_not_a_boolean, whole_text_pattern,
)  # fmt: skip

class Section(BaseModel):
    """Base of every config section: unknown keys are errors, docstrings become descriptions."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        """Refuse `true`/`false` where a number goes: pydantic's lax mode reads them as 1 and 0,
        so `--set training.steps=true` (a value meant for another field) would train one step."""
        if isinstance(value, bool) and takes_a_number_not_a_boolean(cls.model_fields[info.field_name].annotation):
            raise ValueError("a number is needed here, not a boolean")
        return value


class ModelConfig(Section):
    """The policy model: an HF directory, or a tiny random-init model built by the factory."""

    path: str | None = None
    """Local HF model directory to start from; null builds a tiny model from the fields below."""
    architecture: Literal["llama", "qwen2"] = "llama"
    """Architecture of the factory-built model (both load in transformers and SGLang)."""
    hidden_size: int = Field(128, ge=8, le=8192)
    """Width of the factory-built model."""
    num_layers: int = Field(2, ge=1, le=96)
    """Transformer blocks of the factory-built model."""
    num_heads: int = Field(4, ge=1, le=128)
    """Attention heads of the factory-built model (must divide hidden_size into an even head size)."""
    intermediate_size: int = Field(512, ge=8, le=65536)
    """MLP width of the factory-built model."""
    max_position_embeddings: int = Field(64, ge=16, le=131072)
    """Longest episode (prompt plus completions) that rollouts and evaluation build; it applies to
    a `path` model too, so set it to that model's context."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """The dtype the factory-built model is stored and served in (a `path` model keeps its own);
    the trainer updates float32 copies of the weights whatever it is."""

    @model_validator(mode="after")
    def _heads_divide_width(self) -> ModelConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must divide hidden_size ({self.hidden_size})"
            )
        if (self.hidden_size // self.num_heads) % 2:
            raise ValueError(
                f"hidden_size / num_heads ({self.hidden_size} / {self.num_heads} = {self.hidden_size // self.num_heads}) must be "
                "even: rotary position embeddings turn a head's dimensions in pairs"
            )  # fmt: skip
        return self


class SimLatencyConfig(Section):
    """The simulated engine's latency model (`engine.backend: sim`, benchmarks/scaling.py)."""

    prefill_s_per_token: float = Field(2e-5, ge=0, le=1)
    """Seconds of prefill per prompt token admitted at a step."""
    decode_base_s: float = Field(0.005, ge=0, le=60)
    """Seconds of one decode step, before the per-sequence part."""
    decode_s_per_seq: float = Field(0.001, ge=0, le=60)
    """Seconds a decode step grows by for each running sequence."""
    length_median: float = Field(12.0, gt=0, le=1_000_000)
    """Median output length in tokens (lognormal, capped at max_new_tokens)."""
    length_sigma: float = Field(0.8, ge=0, le=5)
    """Lognormal sigma of output lengths: the length of the tail."""
    load_s_per_gb: float = Field(1.0, ge=0, le=3600)
    """Seconds update_weights_from_disk holds generation per GB of safetensors."""


class EngineConfig(Section):
    """The inference engines: tandem's CPU engine or real SGLang servers, same HTTP API."""

    backend: Literal["cpu", "sglang", "sim"] = "cpu"
    """`cpu`: tandem's own engine (laptops, CI); `sglang`: real SGLang servers (GPU machines);
    `sim`: GPU-like latency without computing (the scaling benchmark)."""
    host: str = "127.0.0.1"
    """Address engines bind; loopback unless you mean to expose them."""
    base_port: int = Field(0, ge=0, le=65000)
    """Port of a machine's first generation engine (engine i, counted over its local generators,
    listens on base_port + i; each must be free); 0 picks free ports. An evaluation's engine always does."""
    api_key: Credential = None
    """Bearer token every engine request must carry (SGLang's --api-key); null disables it."""
    max_batch_size: int = Field(32, ge=1, le=1024)
    """Most sequences the CPU (or simulated) engine decodes in one batch."""
    request_timeout_s: float = Field(1800.0, gt=0, le=86400)
    """Client-side limit of one /generate call, from sending to the answer, the wait in the
    engine's queue and any pause for a weight load included: past it the engine is taken out of
    rotation and the request retried on another. Keep it above the longest generation expected."""
    weight_load_timeout_s: float = Field(120.0, gt=0, le=7200)
    """Most an engine may take to load a snapshot before it counts as failed (then retried): raise
    it for a model whose weights take longer to read from the generator's disk."""
    tp_size: int = Field(1, ge=1, le=64)
    """Tensor-parallel size of each SGLang engine."""
    mem_fraction_static: float = Field(0.8, gt=0, lt=1)
    """Fraction of GPU memory SGLang reserves for weights and KV cache."""
    sglang_args: SGLangArgs = Field(default_factory=list, max_length=256)
    """More `sglang.launch_server` flags, passed as they are after tandem's own, e.g.
    ["--max-running-requests", "64", "--attention-backend", "triton"]; not the flags tandem sets."""
    sim: SimLatencyConfig = Field(default_factory=SimLatencyConfig)
    """Latency model of `backend: sim`."""

    @model_validator(mode="after")
    def _requests_outwait_a_load(self) -> EngineConfig:
        if self.request_timeout_s <= self.weight_load_timeout_s:
            raise ValueError(
                f"engine.request_timeout_s ({self.request_timeout_s:g}) must exceed engine.weight_load_timeout_s "
                f"({self.weight_load_timeout_s:g}): requests sent while a snapshot loads wait in the paused engines, "
                "and each one that timed out would take its engine out of rotation at every load"
            )  # fmt: skip
        return self


class GenerationConfig(Section):
    """The generation side: how many engines, how episodes are sampled."""

    engines: int = Field(1, ge=1, le=64)
    """Engine processes started by one generation run (one generator drives them all)."""
    samples_per_prompt: int = Field(8, ge=2, le=256)
    """Group size n: samples per prompt, normalised together for the advantage (at least 2: a
    sample's advantage is its reward against its group's, so a group of one learns nothing)."""
    prompts_per_chunk: int = Field(16, ge=1, le=4096)
    """Prompt groups in one Prefect task run (episodes inside fan out on Dask)."""
    temperature: float = Field(1.0, ge=0.01, le=10)
    """Sampling temperature of the training rollouts, at least 0.01: greedy samples of one prompt
    are alike, so their advantages are all 0 (evaluation decodes greedily by itself), and engines
    decode greedily below about 1e-5. The trainer scores the same softmax(logits / temperature)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass. Below 1 the engines sample from the cut distribution, but report,
    and the trainer scores, the whole softmax: the ratio then departs from 1 even at lag 0."""
    top_k: TopK = -1
    """Top-k cut-off; -1 disables it (SGLang's convention, which refuses 0). Set, it departs from
    what the trainer scores as top_p below 1 does."""
    max_new_tokens: int = Field(16, ge=1, le=32768)
    """Most tokens the model generates in one turn."""
    hand_off_stragglers: bool = True
    """Move half of a busy engine's requests, with their tokens so far, to an engine that ran dry."""


class TrainingConfig(Section):
    """The trainer: optimizer, batch, and how often it publishes and checkpoints."""

    steps: int = Field(40, ge=1, le=10_000_000)
    """Optimizer steps of the RL phase; policy version V counts them ((steps + lag.max_lag + 1)
    x prompts_per_step at most 999,999)."""
    prompts_per_step: int = Field(16, ge=1, le=65536)
    """Prompt groups in one training batch."""
    micro_batch_size: int | None = Field(None, ge=1, le=65536)
    """Sequences per forward and backward pass, gradients accumulated over the batch (the same
    step, in less memory: prompts_per_step x samples_per_prompt sequences at once do not fit a
    real model's GPU); null: the whole batch in one pass (4 with model.path)."""
    lr: float = Field(1e-4, gt=0, le=1)
    """AdamW learning rate of the RL phase (1e-6 with model.path)."""
    weight_decay: float = Field(0.0, ge=0, le=1)
    """AdamW weight decay."""
    grad_clip: float = Field(1.0, gt=0, le=1e6)
    """Gradient-norm clipping threshold."""
    clip_eps: float = Field(0.2, gt=0, le=10)
    """PPO-clip epsilon of the token-level ratio."""
    is_cap: float | None = Field(3.0, gt=1, le=1e6)
    """Cap (> 1) of the truncated importance weight (dual-clip on negative advantages); null: off."""
    importance_correction: bool = True
    """PPO-clip ratio against behaviour logprobs; false trains as if every sample were on-policy."""
    kl_coef: float = Field(0.0, ge=0, le=100)
    """Weight of the k3 KL term against snapshot v0 (the warm-started policy); 0 disables it."""
    entropy_coef: float = Field(0.0, ge=0, le=100)
    """Weight of the entropy bonus; 0 disables it."""
    dynamic_sampling: bool = False
    """Drop groups whose samples all got one reward (GRPO gives them no gradient) and train on
    groups generated in their place, as DAPO does: every batch teaches, for more generation."""
    dynamic_sampling_max_drops: int = Field(64, ge=1, le=1_000_000)
    """Groups without signal one step drops at most before it trains on them (a policy that solves
    or fails every prompt would otherwise generate without end)."""
    warmup_steps: int = Field(55, ge=0, le=1_000_000)
    """Supervised warm-start steps before RL (a random-init model gets no reward otherwise; 0 with model.path)."""
    warmup_lr: float = Field(1e-3, gt=0, le=1)
    """Learning rate of the supervised warm-start (1e-5 with model.path)."""
    publish_every: int = Field(1, ge=1, le=1_000_000)
    """Publish a weight snapshot every this many steps."""
    checkpoint_every: int = Field(10, ge=1, le=1_000_000)
    """Write a resumable trainer checkpoint every this many steps."""
    simulate_step_seconds: float | None = Field(None, ge=0, le=86400)
    """Benchmarks: make each optimizer step take this long (the real step runs inside it); null: off."""
    device: str = Field("auto", json_schema_extra=whole_text_pattern(TRAINER_DEVICE_FORM))
    """Where the trainer's weights, optimizer and passes live: auto (the first CUDA GPU that no
    engine of this process takes, else the CPU), cpu, cuda or cuda:N."""
    compute_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """The dtype the forward and backward passes run in (autocast; weights and optimizer state stay
    float32): auto is bfloat16 on a CUDA GPU that has it, float32 elsewhere."""
    gradient_checkpointing: bool = False
    """Keep one transformer block's activations, not every block's, and recompute them in backward
    (a third more compute; true with model.path)."""

    @field_validator("device")
    @classmethod
    def _torch_device(cls, device: str) -> str:
        if not re.fullmatch(TRAINER_DEVICE_FORM, device):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N (N a GPU index), got {device!r}")
        return device


class LagConfig(Section):
    """The staleness bound between the trainer and the samples it trains on."""

    max_lag: int = Field(2, ge=0, le=64)
    """Most policy versions a trained-on sample may trail the trainer; 0 is synchronous."""


class StorageConfig(Section):
    """The run directory's object storage: file://, memory:// or s3:// through fsspec."""

    root: str = Field("file://./runs", json_schema_extra={"pattern": ROOT_PATTERN})
    """URL under which each run gets {root}/{run_id}/."""
    endpoint_url: EndpointUrl | None = None
    """S3 endpoint URL (MinIO, SeaweedFS, ...), http:// or https://; null means AWS or $AWS_ENDPOINT_URL."""
    key: Credential = None
    """S3 access key, given with `secret` or not at all; null: credentials_block, else $AWS_ACCESS_KEY_ID."""
    secret: Credential = None
    """S3 secret key, given with `key` or not at all; null: credentials_block, else $AWS_SECRET_ACCESS_KEY."""
    credentials_block: str | None = Field(None, pattern=f"^{BLOCK_NAME_FORM}$", json_schema_extra=whole_text_pattern(BLOCK_NAME_FORM))
    """Name of a Prefect Secret block holding {"key": ..., "secret": ...}; wins over the env vars."""
    retry_seconds: float = Field(30.0, ge=0, le=3600)
    """How long a storage call keeps retrying transient errors, from its first failure, before it gives up."""
    keep_last_snapshots: int = Field(3, ge=1, le=10000)
    """Retention: keep the newest this many weight snapshots."""
    keep_every_snapshot: int = Field(10, ge=1, le=1_000_000)
    """Retention: also keep every snapshot whose version is a multiple of this."""
    keep_last_checkpoints: int = Field(2, ge=2, le=10000)
    """Retention: keep the newest this many trainer checkpoints (2 or more: a damaged newest one falls back to the one before)."""

    @field_validator("root")
    @classmethod
    def _known_scheme(cls, root: str) -> str:
        scheme, sep, rest = root.partition("://")
        if not sep or scheme not in ("file", "memory", "s3"):
            raise ValueError(f"root must start with file://, memory:// or s3://, got {root!r}")
        if scheme == "s3" and not rest.strip("/"):
            raise ValueError(f"root must name a bucket, like s3://BUCKET or s3://BUCKET/PREFIX, got {root!r}")
        return f"{scheme}://{rest.rstrip('/') or rest[:1]}"  # trailing slashes off; file:/// stays /

    @model_validator(mode="after")
    def _key_with_secret(self) -> StorageConfig:
        if (self.key is None) != (self.secret is None):
            given, missing = ("key", "secret") if self.secret is None else ("secret", "key")
            raise ValueError(f"storage.{given} is set but storage.{missing} is not: give both, or neither "
                             "(then they come from storage.credentials_block or the AWS_* variables)")  # fmt: skip
        return self


class EnvConfig(Section):
    """The environment: task, reward and prompts."""

    entrypoint: str = Field("tasks.envs.calculator:CalculatorEnv", json_schema_extra=whole_text_pattern(ENTRYPOINT_FORM))
    """Import path `package.module:Class` of the environment."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments passed to the environment's constructor."""
    max_turns: int = Field(2, ge=1, le=256)
    """Most model turns in one episode."""
    step_timeout_s: float = Field(600.0, gt=0, le=86400)
    """Most seconds one call of the environment (reset, step, truncate: a tool call) may take;
    past it the episode's group is set aside in quarantine/ and another made in its place."""
    train_prompts: int = Field(2000, ge=1, le=100_000_000)
    """Procedurally generated training prompts."""
    eval_prompts: int = Field(200, ge=0, le=1_000_000)
    """Held-out evaluation prompts, disjoint from the training prompts; 0: no evaluation at all
    (a smoke or benchmark run saves the two engine boots it costs)."""

    @field_validator("entrypoint")
    @classmethod
    def _import_path(cls, entrypoint: str) -> str:
        if not re.fullmatch(ENTRYPOINT_FORM, entrypoint):
            raise ValueError(f"entrypoint must look like 'package.module:Class', got {entrypoint!r}")
        return entrypoint


class DaskConfig(Section):
    """The Dask cluster that runs episodes, tool calls and rewards."""

    address: str | None = None
    """Scheduler address of an existing cluster on the generator's machine (its workers reach the engines on engine.host); null starts a LocalCluster."""
    n_workers: int = Field(2, ge=1, le=1024)
    """Worker processes of the LocalCluster."""
    threads_per_worker: int = Field(4, ge=1, le=256)
    """Threads per LocalCluster worker (episodes mostly wait on engines, so a few per core)."""


class AutoscaleConfig(Section):
    """Deployed mode: the parent sizes the generation side from what the run measures."""

    min: int = Field(1, ge=1, le=MAX_GENERATION_RUNS)
    """Fewest generation runs."""
    max: int = Field(4, ge=1, le=MAX_GENERATION_RUNS)
    """Most generation runs."""
    target_trainer_idle: float = Field(0.2, gt=0, lt=1)
    """Add a generation run while the trainer's idle fraction (last 10 steps) stays above this."""
    max_generator_wait: float = Field(0.3, gt=0, lt=1)
    """Retire a generation run while the generators wait on the lag bound more than this fraction,
    if the rest would still wait that much doing its work."""
    cooldown_seconds: float = Field(30.0, ge=0, le=86400)
    """Least time between two changes, so that the last one shows in the measurements first."""

    @model_validator(mode="after")
    def _min_below_max(self) -> AutoscaleConfig:
        if self.min > self.max:
            raise ValueError(f"autoscale.min ({self.min}) must be at most autoscale.max ({self.max})")
        return self

    def bounded(self, count: int) -> int:
        """`count` generation runs moved into [min, max]."""
        return min(max(count, self.min), self.max)


class PrefectConfig(Section):
    """How the flows run: in one process (local) or as deployments on two work pools."""

    mode: Literal["local", "deployed"] = "local"
    """`local`: both subflows in this process; `deployed`: children are deployment runs on their pools."""
    deployment: str = Field("tandem", pattern=f"^{DEPLOYMENT_NAME_FORM}$", json_schema_extra=whole_text_pattern(DEPLOYMENT_NAME_FORM))
    """Deployed mode: name of the child deployments (`training/NAME`, `generation/NAME`)."""
    generators: int = Field(1, ge=1, le=MAX_GENERATION_RUNS)
    """Generation runs started at the beginning (each with `generation.engines` engines)."""
    generation_restarts: int = Field(3, ge=0, le=1000)
    """Deployed mode: how often, in all, the parent restarts a crashed or failed generation run."""
    watch_seconds: float = Field(2.0, gt=0, le=600)
    """Deployed mode: how often the parent looks at its children and the scale request."""
    evaluate_every: int = Field(0, ge=0, le=1_000_000)
    """Deployed mode: mark each published snapshot whose version is a multiple of this for
    evaluation (the `evaluation` deployment's trigger; a local run has none); 0: none."""
    evaluation_pin_hours: float = Field(24.0, gt=0, le=8760)
    """How long retention keeps a snapshot for an evaluation that has not unpinned it: one marked
    for its triggered run that never starts, or whose run was killed."""
    autoscale: AutoscaleConfig | None = None
    """Deployed mode: size the generation side between min and max automatically; null: fixed."""
