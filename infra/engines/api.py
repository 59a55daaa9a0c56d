"""The engine contract: pydantic models of the part of SGLang's native HTTP API that tandem uses.

One definition shared by the client (the sampling parameters it sends), the CPU and simulated
engines (what they accept and answer) and tests/test_sglang_compat.py, which checks every field name
here against the names recorded from SGLang's own source (tests/fixtures/sglang_api.json): the
response models are that record of what SGLang answers. The client reads an answer's few fields
itself (infra/engines/client.py `generate_answer`), so that an answer it cannot use is a failed try,
named, rather than a validation error of fields it never reads. Requests forbid unknown keys, so a
misspelt field is a 4xx rather than a silently ignored knob (SGLang itself rejects unknown
sampling_params keys and ignores unknown top-level ones). Responses ignore unknown keys: SGLang
answers with many more than tandem reads.

Shapes worth knowing: with `n > 1`, /generate answers a JSON list of n results, one per sample,
and SGLang gives each sample a fresh random rid, so only `abort_all` reaches them. /pause_generation
and /continue_generation take a JSON body in SGLang (send `{}`). /health needs no API key.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from configs.fields import TopK

INT64 = 2**63
TokenId = Annotated[int, Field(ge=0, lt=2**31)]

ROUTES: dict[str, tuple[str, str]] = {
    "generate": ("POST", "/generate"),
    "update_weights_from_disk": ("POST", "/update_weights_from_disk"),
    "pause_generation": ("POST", "/pause_generation"),
    "continue_generation": ("POST", "/continue_generation"),
    "abort_request": ("POST", "/abort_request"),
    "flush_cache": ("POST", "/flush_cache"),
    "health": ("GET", "/health"),
    "model_info": ("GET", "/model_info"),
    "server_info": ("GET", "/server_info"),
}
"""Every route tandem calls: name -> (method, path)."""
DEPRECATED_ROUTES: dict[str, str] = {"/get_model_info": "/model_info", "/get_server_info": "/server_info"}
"""Old names SGLang still answers (with a deprecation warning); the CPU engine serves both."""


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class _Response(BaseModel):
    model_config = ConfigDict(extra="ignore", use_attribute_docstrings=True)


class SamplingParams(_Request):
    """How to sample one prompt (SGLang's `sampling_params`)."""

    temperature: float = Field(1.0, ge=0.0, le=100.0, allow_inf_nan=False)
    """Softmax temperature; 0 is greedy."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass, in (0, 1]."""
    top_k: TopK = Field(-1, le=2**30)
    """Keep the k most likely tokens; -1 keeps all (0 is invalid, as in SGLang)."""
    max_new_tokens: int = Field(128, ge=0, le=1_000_000)
    """Most tokens to generate (SGLang's default is 128)."""
    stop_token_ids: list[TokenId] | None = Field(None, max_length=4096)
    """Token ids that end generation (the stop token is kept in output_ids)."""
    ignore_eos: bool = False
    """Keep generating past the model's EOS tokens."""
    n: int = Field(1, ge=1, le=256)
    """Samples of the prompt; with n > 1 the answer is a list of n results."""
    sampling_seed: int | None = Field(None, ge=-INT64, lt=INT64)
    """Seed of a reproducible request; null samples from the engine's generator. tandem's engines
    honour it; SGLang 0.5.23 only with --enable-deterministic-inference, which tandem refuses
    (configs/fields.py), so no training request sends one and no result relies on it there."""


class GenerateRequest(_Request):
    """Body of POST /generate: one tokenized prompt."""

    input_ids: list[TokenId] = Field(min_length=1, max_length=1_000_000)
    """Prompt token ids, exactly as the model sees them (tandem never sends text)."""
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    """How to sample."""
    return_logprob: bool = False
    """Return meta_info.output_token_logprobs (the behaviour logprobs the loss needs)."""
    rid: str | None = Field(None, min_length=1, max_length=256)
    """Request id, for /abort_request; the engine makes one up when null."""


class FinishReason(_Response):
    """Why a sample ended: {"type": "stop", "matched": ...}, {"type": "length", "length": n} or abort."""

    type: Literal["stop", "length", "abort"]
    """stop: EOS or a stop token/string; length: max_new_tokens or context; abort: aborted."""
    matched: int | list[int] | str | None = None
    """The stop token id(s) or string that matched (type stop)."""
    length: int | None = None
    """Tokens generated when the length limit hit (type length)."""
    message: str | None = None
    """Why the request was aborted (type abort)."""


class WeightVersionSpan(_Response):
    """Output tokens [start, end) of a sample, produced by the weights of `version`."""

    version: str
    """The weight version."""
    start: int
    """First output position it produced."""
    end: int
    """One past the last output position it produced."""


class GenerateMetaInfo(_Response):
    """The `meta_info` of one /generate result."""

    id: str
    """The sample's request id."""
    finish_reason: FinishReason | None = None
    """Why it ended; null only in a streamed, unfinished chunk."""
    prompt_tokens: int
    """Tokens in the prompt (SGLang 0.5.23 leaves it out of its answer to a request aborted in its
    waiting queue; tandem's client reads it from no engine)."""
    completion_tokens: int
    """Tokens generated."""
    cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""
    output_token_logprobs: list[tuple[float | None, int, str | None]] | None = None
    """[logprob, token_id, text] per generated token (text null unless asked for)."""
    weight_version: str | None = None
    """Weight version that generated the sample's last token (SGLang: a string)."""
    weight_versions: list[WeightVersionSpan] | None = None
    """Every weight version that generated some of its tokens, when weights changed mid-request."""
    e2e_latency: float | None = None
    """Seconds from arrival to the last token."""


class GenerateResponse(_Response):
    """One /generate result (a list of them when n > 1)."""

    output_ids: list[int]
    """Generated token ids."""
    text: str = ""
    """Detokenized output (absent when SGLang runs with --skip-tokenizer-init)."""
    meta_info: GenerateMetaInfo
    """Counts, finish reason, logprobs and weight version."""


class UpdateWeightsFromDiskRequest(_Request):
    """Body of POST /update_weights_from_disk: load an HF directory in place."""

    model_path: str = Field(min_length=1, max_length=4096)
    """Local HF directory (a committed snapshot) to load."""
    weight_version: str | None = Field(None, min_length=1, max_length=256)
    """Version to report from now on in meta_info and /model_info."""
    abort_all_requests: bool = False
    """Abort every running request before loading."""


class UpdateWeightsFromDiskResponse(_Response):
    """Answer of /update_weights_from_disk (HTTP 200 on success, 400 otherwise)."""

    success: bool
    """Whether the new weights are live."""
    message: str = ""
    """What happened, or why it failed."""
    num_paused_requests: int = 0
    """Requests paused during the load."""


class PauseGenerationRequest(_Request):
    """Body of POST /pause_generation."""

    mode: Literal["abort", "retract", "in_place"] = "abort"
    """abort: end running requests; retract: requeue them; in_place: freeze them with their KV."""


class AbortRequest(_Request):
    """Body of POST /abort_request: one request by rid, or all of them."""

    rid: str | None = Field(None, max_length=256)
    """Request to abort (SGLang's default is "", which aborts nothing)."""
    abort_all: bool = False
    """Abort every request on the engine."""


class ModelInfo(_Response):
    """Answer of GET /model_info."""

    model_path: str
    """Model directory currently loaded (moves with each weight update)."""
    tokenizer_path: str | None = None
    """Tokenizer directory."""
    is_generation: bool = True
    """A generative model (not an embedding one)."""
    weight_version: str | None = None
    """Version of the loaded weights."""


def oldest_weight_version(meta: dict) -> str | None:
    """The oldest weight version that produced any token of a result (a `meta_info` dict): the
    one its staleness counts from. `weight_version` names the newest when an update landed
    mid-request (SGLang's retract and in-place pauses let a request go on across a load), so
    the spans decide where the engine reports them."""
    spans = [span for span in meta.get("weight_versions") or () if span.get("end", 0) > span.get("start", 0)]
    numbered = [span["version"] for span in spans if isinstance(span.get("version"), str) and span["version"].isdigit()]
    return min(numbered, key=int) if numbered else meta.get("weight_version")
