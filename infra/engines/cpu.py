"""tandem's CPU engine core: continuous batching over an HF causal LM and its KV cache.

`CpuEngine` owns the model and runs one scheduler thread (scheduler.py `ScheduledEngine`, shared
with the simulated engine). HTTP handlers (server.py) never touch the model: they submit jobs and
send weight updates, pauses and aborts as commands that the scheduler applies between two decode
steps. So a weight swap never races a forward pass, and no lock is held while the model computes.

Batching is continuous at step granularity. Every running sequence sits in one `RunningBatch`
whose DynamicCache rows are left-padded to a common length. At each step boundary the scheduler
admits waiting sequences (one prefill forward for all of them, then their cache rows are padded
and concatenated to the running batch), runs one decode forward for the whole batch, samples, and
drops finished rows (`batch_select_indices`) and any leading columns that became all padding. A
request that arrives while 31 others decode joins the next step instead of waiting for them.

Logprobs are those of the distribution the request samples from before top-k/top-p filtering,
softmax(logits / temperature) (the raw one for greedy requests), at the sampled token: what
SGLang returns by default and what the trainer recomputes.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from infra.engines.api import SamplingParams
from infra.engines.scheduler import GenerationJob, Sample, ScheduledEngine
from infra.manifest import ManifestError, verify_local_dir

GREEDY_TEMPERATURE = 1e-5
"""A temperature at or below this samples greedily, and its logprobs are the raw distribution's."""


class RunningBatch:
    """The sequences being decoded, their KV cache rows, attention mask and next positions."""

    def __init__(self, samples: list[Sample], cache: DynamicCache, mask: torch.Tensor):
        self.samples = samples
        self.cache = cache
        self.mask = mask

    def __len__(self) -> int:
        return len(self.samples)

    def merge(self, other: RunningBatch) -> None:
        """Append `other`'s rows, left-padding whichever cache is shorter."""
        width = max(self.mask.shape[1], other.mask.shape[1])
        layers = [
            (torch.cat([_pad_left(k1, width), _pad_left(k2, width)]), torch.cat([_pad_left(v1, width), _pad_left(v2, width)]))
            for (k1, v1), (k2, v2) in zip(_layers(self.cache), _layers(other.cache), strict=True)
        ]
        self.cache = DynamicCache(ddp_cache_data=layers)
        self.mask = torch.cat([_pad_left(self.mask, width), _pad_left(other.mask, width)])
        self.samples += other.samples

    def keep(self, rows: list[int]) -> None:
        """Keep only `rows`, then drop leading columns that are padding in every kept row."""
        index = torch.tensor(rows, dtype=torch.long)
        self.samples = [self.samples[i] for i in rows]
        self.mask = self.mask[index]
        first_real = int(self.mask.any(0).nonzero()[0]) if rows else 0
        self.mask = self.mask[:, first_real:]
        self.cache = DynamicCache(
            ddp_cache_data=[(k[index, :, first_real:], v[index, :, first_real:]) for k, v in _layers(self.cache)]
        )


def _read_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF directory's safetensors files (one, or the shards of a large model)."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise OSError(f"no *.safetensors file in {model_dir}")
    state: dict[str, torch.Tensor] = {}
    for path in files:
        state.update(load_file(path))
    return state


def _check_config(model_dir: Path, model_type: str) -> None:
    """Raise ValueError unless the directory's config.json is a JSON object of `model_type`."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"config.json is not valid JSON: {err}") from err
    if not isinstance(config, dict) or config.get("model_type") != model_type:
        found = config.get("model_type") if isinstance(config, dict) else type(config).__name__
        raise ValueError(f"config.json describes model_type {found!r}, the serving model is {model_type!r}")


def _check_matches(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Raise ValueError unless `state` holds exactly `model`'s tensors, shape for shape."""
    live = model.state_dict()
    unexpected = sorted(state.keys() - live.keys())
    if unexpected:
        raise ValueError(f"tensors the serving model does not have: {', '.join(unexpected[:5])}")
    present = {live[name].data_ptr() for name in state}
    missing = sorted(name for name in live.keys() - state.keys() if live[name].data_ptr() not in present)
    if missing:
        raise ValueError(f"tensors missing from the snapshot: {', '.join(missing[:5])}")
    for name, tensor in state.items():
        if tensor.shape != live[name].shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, the serving model's is {tuple(live[name].shape)}")


def _layers(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def _pad_left(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """Zero-pad the sequence dimension (dim 2 of a KV tensor, dim 1 of a mask) on the left."""
    seq_dim = 2 if tensor.dim() == 4 else 1
    missing = width - tensor.shape[seq_dim]
    if missing == 0:
        return tensor
    pad = (0, 0, missing, 0) if seq_dim == 2 else (missing, 0)
    return F.pad(tensor, pad)


class CpuEngine(ScheduledEngine):
    """An HF causal LM served with continuous batching on one scheduler thread."""

    def __init__(self, model_path: str | Path, max_batch_size: int = 32, weight_version: str = "default"):
        super().__init__(model_path, max_batch_size, weight_version)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, use_safetensors=True).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.vocab_size = self.model.config.vocab_size
        self.context_length = self.model.config.max_position_embeddings
        self.eos_token_ids = _eos_ids(self.model)
        layer_types = getattr(self.model.config, "layer_types", None) or ["full_attention"]
        self.full_attention_only = all(kind == "full_attention" for kind in layer_types)
        self.batch: RunningBatch | None = None
        self.backlog: list[Sample] = []
        self.batch_sizes: Counter[int] = Counter()
        self.prefill_sizes: Counter[int] = Counter()
        self.tokens_generated = 0
        self.start_scheduler()

    # -- the API the HTTP server calls (thread-safe), beside ScheduledEngine's ------------------

    def abort(self, rid: str | None = None, abort_all: bool = False) -> int:
        """Mark matching requests aborted; the scheduler finishes them at the next step."""
        def mark() -> int:
            jobs = {s.job for s in self.backlog + (self.batch.samples if self.batch else [])}
            self._drain_waiting()
            jobs |= {s.job for s in self.backlog}
            hits = [j for j in jobs if abort_all or j.rid == rid]
            for job in hits:
                job.aborted = True
            self._finish_aborted()
            return len(hits)

        return self.run_command(mark).result()

    def update_weights(self, model_path: str, weight_version: str | None) -> tuple[bool, str]:
        """Verify the snapshot's manifest, then copy its tensors into the live model between two steps.

        The tensors are read with safetensors and copied into the model that is serving, not
        into a model built afresh by from_pretrained: building one (config, modules, init) cost
        16 ms of a tiny model's 18 ms load, and a snapshot of the same policy has the same
        architecture by construction. What a snapshot must match is checked before the swap:
        every tensor the model has (a tied one may be absent: it shares its storage with one
        that is present), nothing it lacks, the same shapes, and a config.json of the same
        model_type (an engine restarted on this snapshot builds from it). Only *.safetensors
        files are read, so a pickled .bin never reaches torch.load. A file that is not what it
        claims to be is a refusal naming the reason, not a server error."""
        try:
            verify_local_dir(Path(model_path))
            _check_config(Path(model_path), self.model.config.model_type)
            state = _read_safetensors(Path(model_path))
            _check_matches(self.model, state)
        except (ManifestError, OSError, ValueError, SafetensorError) as err:
            return False, f"refused {model_path}: {err}"

        def swap() -> None:
            with torch.no_grad():
                self.model.load_state_dict(state, strict=False)
            self.model_path = model_path
            self.weight_version = weight_version if weight_version is not None else self.weight_version

        self.run_command(swap).result()
        return True, f"loaded {model_path} as weight_version {self.weight_version}"

    def stats(self) -> dict:
        running = len(self.batch) if self.batch else 0
        return {
            "weight_version": self.weight_version,
            "max_batch_size": self.max_batch_size,
            "paused": self.paused,
            "num_running": running,
            "num_waiting": len(self.backlog) + self.waiting.qsize(),
            "tokens_generated": self.tokens_generated,
            "decode_batch_sizes": {str(k): v for k, v in sorted(self.batch_sizes.items())},
            "prefill_batch_sizes": {str(k): v for k, v in sorted(self.prefill_sizes.items())},
        }

    # -- the scheduler thread's steps -------------------------------------------------------

    def _collect_work(self) -> bool:
        self._drain_waiting()
        self._finish_aborted()
        return bool(self.batch or self.backlog)

    @torch.no_grad()
    def _step(self) -> None:
        self._admit()
        self._decode_step()

    def _retract(self) -> None:
        """The running batch back to the front of the queue; its KV cache is dropped with it."""
        self.backlog = (self.batch.samples if self.batch else []) + self.backlog
        self.batch = None

    def _fail_running(self, err: Exception) -> None:
        for sample in (self.batch.samples if self.batch else []) + self.backlog:
            if not sample.job.future.done():
                sample.job.future.set_exception(err)
        self.batch, self.backlog = None, []

    def _drain_waiting(self) -> None:
        while not self.waiting.empty():
            job = self.waiting.get()
            job.samples = [Sample(job, i, _generator(job.params.sampling_seed, i)) for i in range(job.params.n)]
            if job.params.max_new_tokens == 0:
                for sample in job.samples:
                    sample.finish_reason = {"type": "length", "length": 0}
                self._complete(job)
            else:
                self.backlog += job.samples

    def _finish_aborted(self) -> None:
        aborted = [s for s in self.backlog if s.job.aborted]
        for sample in aborted:
            sample.finish_reason = {"type": "abort", "message": "aborted"}
        self.backlog = [s for s in self.backlog if s.finish_reason is None]
        if self.batch:
            self._retire([s.job.aborted for s in self.batch.samples], {"type": "abort", "message": "aborted"})
        self._complete_done({s.job for s in aborted})

    def _admit(self) -> None:
        room = self.max_batch_size - (len(self.batch) if self.batch else 0)
        if room <= 0 or not self.backlog:
            return
        newcomers = self.backlog[:room]
        sequences = [s.job.input_ids + s.output_ids for s in newcomers]  # a retracted one has output
        width = max(len(sequence) for sequence in sequences)
        ids = torch.tensor([[0] * (width - len(sequence)) + sequence for sequence in sequences])
        mask = torch.tensor([[0] * (width - len(sequence)) + [1] * len(sequence) for sequence in sequences])
        cache = DynamicCache()
        # Still in the backlog while their prefill runs: if it raises (out of memory, weights
        # that sample NaN), `_fail_running` ends them too, where they were lost before and
        # their /generate calls waited for the client's timeout.
        logits = self._forward(ids, mask, cache, logits_to_keep=1)
        self.prefill_sizes[len(newcomers)] += 1
        admitted = RunningBatch(newcomers, cache, mask)
        self._sample_and_record(admitted, logits)
        self.backlog = self.backlog[room:]
        if self.batch is None:
            self.batch = admitted
        else:
            self.batch.merge(admitted)
        self._retire([s.finish_reason is not None for s in self.batch.samples])

    def _decode_step(self) -> None:
        batch = self.batch
        if not batch:
            return
        last = torch.tensor([[s.output_ids[-1]] for s in batch.samples])
        batch.mask = torch.cat([batch.mask, torch.ones(len(batch), 1, dtype=batch.mask.dtype)], dim=1)
        logits = self._forward(last, batch.mask, batch.cache, logits_to_keep=1)
        self.batch_sizes[len(batch)] += 1
        self._sample_and_record(batch, logits)
        self._retire([s.finish_reason is not None for s in batch.samples])

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, cache: DynamicCache, logits_to_keep: int) -> torch.Tensor:
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)[:, -ids.shape[1] :]
        attention = mask
        if ids.shape[1] == 1 and self.full_attention_only:
            # One query token per row attends to every unpadded key: the 4D mask is the padding
            # mask itself, and a ready 4D mask skips the model's mask building (~10% of a step).
            attention = mask[:, None, None, :].bool()
        out = self.model(
            input_ids=ids, attention_mask=attention, position_ids=positions, cache=cache,
            use_cache=True, logits_to_keep=logits_to_keep,
        )  # fmt: skip
        return out.logits[:, -1, :].float()

    def _sample_and_record(self, batch: RunningBatch, logits: torch.Tensor) -> None:
        temperatures = torch.tensor([s.job.params.temperature for s in batch.samples], dtype=logits.dtype)
        scale = torch.where(temperatures <= GREEDY_TEMPERATURE, 1.0, temperatures)
        logprobs = torch.log_softmax(logits / scale[:, None], dim=-1)
        tokens = sample_tokens(logits, [s.job.params for s in batch.samples], [s.generator for s in batch.samples])
        chosen = logprobs.gather(1, tokens[:, None])[:, 0].tolist()
        for sample, token, logprob in zip(batch.samples, tokens.tolist(), chosen, strict=True):
            sample.record_token(token, logprob, self.weight_version)
            self.tokens_generated += 1
            sample.finish_reason = self._finish_reason(sample, token)

    def _finish_reason(self, sample: Sample, token: int) -> dict | None:
        params = sample.job.params
        if token in (params.stop_token_ids or ()) or (token in self.eos_token_ids and not params.ignore_eos):
            return {"type": "stop", "matched": token}
        if len(sample.output_ids) >= params.max_new_tokens or sample.context_length >= self.context_length:
            return {"type": "length", "length": len(sample.output_ids)}
        return None

    def _retire(self, done: list[bool], reason: dict | None = None) -> None:
        """Remove the rows flagged `done` from the running batch and complete finished jobs."""
        if not any(done):
            return
        retired = [s for s, finished in zip(self.batch.samples, done, strict=True) if finished]
        for sample in retired:
            sample.finish_reason = reason or sample.finish_reason
        self.batch.keep([i for i, finished in enumerate(done) if not finished])
        if not self.batch.samples:
            self.batch = None
        self._complete_done({s.job for s in retired})

    def _complete_done(self, jobs: set[GenerationJob]) -> None:
        for job in jobs:
            if all(s.finish_reason is not None for s in job.samples) and not job.future.done():
                self._complete(job)

    def _complete(self, job: GenerationJob) -> None:
        job.weight_version = self.weight_version
        job.future.set_result(job)


def sample_tokens(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> torch.Tensor:
    """One token per row, each row with its own temperature, top-k, top-p and seeded generator.

    Temperature 0 is greedy. Top-k and top-p are applied on the temperature-scaled distribution,
    in that order, as SGLang does.
    """
    vocab = logits.shape[1]
    if all(p.temperature == 1.0 and (p.top_k < 0 or p.top_k >= vocab) and p.top_p >= 1.0 for p in params) and all(
        g is None for g in generators
    ):  # plain sampling, the common case in RL rollouts: the general path below, minus its no-ops
        return torch.multinomial(torch.softmax(logits, dim=-1), 1)[:, 0]
    temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype)
    greedy = temperature <= GREEDY_TEMPERATURE
    scaled = logits / temperature.clamp(min=GREEDY_TEMPERATURE)[:, None]
    top_k = [p.top_k if p.top_k > 0 else vocab for p in params]
    top_p = [p.top_p for p in params]
    if all(k >= vocab for k in top_k) and all(p >= 1.0 for p in top_p):
        order = None
        probs = torch.softmax(scaled, dim=-1)
    else:
        scaled, order = scaled.sort(dim=-1, descending=True)
        rank = torch.arange(vocab)[None, :]
        scaled = scaled.masked_fill(rank >= torch.tensor(top_k)[:, None], float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        probs = probs.masked_fill(mass_before > torch.tensor(top_p, dtype=probs.dtype)[:, None], 0.0)
    if all(g is None for g in generators):
        choice = torch.multinomial(probs, 1)[:, 0]
    else:
        choice = torch.cat([torch.multinomial(row, 1, generator=g) for row, g in zip(probs, generators, strict=True)])
    tokens = choice if order is None else order.gather(1, choice[:, None])[:, 0]
    return torch.where(greedy, logits.argmax(dim=-1), tokens)


def _generator(seed: int | None, index: int) -> torch.Generator | None:
    """A generator for sample `index` of a seeded request: same seed, same samples."""
    if seed is None:
        return None
    return torch.Generator().manual_seed((seed * 1_000_003 + index) % 2**63)


def _eos_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id if model.generation_config else None
    eos = eos if eos is not None else model.config.eos_token_id
    if eos is None:
        return set()
    return {eos} if isinstance(eos, int) else set(eos)
