"""The simulated engine (`engine.backend: sim`): GPU-like latency without the GPU.

The scaling benchmark (benchmarks/scaling.py) needs N inference engines that behave like N
GPUs on a 2-core machine. `SimEngine` serves the same HTTP API as the CPU engine (server.py
serves either), but produces tokens by a latency model instead of computing them, so N of them
cost almost no CPU while each takes the time a GPU would:

- a decode step advances every running sequence by one token and takes
  `decode_base_s + decode_s_per_seq * running` seconds (a GPU's step time grows with its batch),
  plus `prefill_s_per_token` for each prompt token admitted at that step;
- each sequence's length is drawn from a lognormal (`length_median`, `length_sigma`), a long
  tail as agentic outputs have, capped at the request's max_new_tokens (reached always with
  ignore_eos); a sequence that ends before the cap ends with its request's first stop token,
  or the end-of-sequence token if it gave none. A continuation (the client's straggler
  hand-off sends prompt + tokens so far) draws a fresh length, capped at what is left: the
  engine cannot tell its earlier output from a prompt. A Monte Carlo of the benchmark's lengths
  and hand-offs at 4 engines puts a batch at 1.024x G1/N that way against 1.019x with each
  sample's true remaining length (1.021x and 1.018x at 3 engines), so the benchmark charges the
  hand-off a little more than it costs, not less;
- tokens are drawn uniformly from the tokenizer's non-special ids other than the request's stop
  tokens, with a logprob of log(1/V), so everything downstream (rollout, shards, the trainer's
  real optimizer step) sees valid data and lengths follow the model, not chance stop tokens;
- `update_weights` verifies the snapshot's manifest like the CPU engine, then holds generation
  for `load_s_per_gb` times the snapshot's size; pause, continue and abort behave as the CPU
  engine's, and a retract charges the running sequences' prefill (prompt and output so far) to
  the step after it. Outputs are seeded by the request's sampling_seed and the weight version, so they
  change when the weights do.

Like the CPU engine, one scheduler thread does all the work (scheduler.py `ScheduledEngine`);
HTTP handlers only submit jobs and commands. Time is real (the thread sleeps), so a client measures what it would against a GPU.

Its process imports neither torch nor transformers' model code: the fast tokenizer class
(tokenizer.json and the special tokens of tokenizer_config.json) and config.json's two sizes are
all it reads. AutoTokenizer and AutoConfig import torch, which cost each engine's start about
1.5 s of CPU, 6 s of start-up for four engines on 2 cores beside a trainer starting too.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections import Counter
from pathlib import Path

from transformers import PreTrainedTokenizerFast

from configs.sections import SimLatencyConfig
from infra.engines.scheduler import GenerationJob, Sample, ScheduledEngine
from infra.manifest import ManifestError, verify_local_dir


class SimEngine(ScheduledEngine):
    """An engine that sleeps like a GPU and emits valid random tokens."""

    def __init__(self, model_path: str | Path, latency: SimLatencyConfig, max_batch_size: int = 256, weight_version: str = "default"):
        super().__init__(model_path, max_batch_size, weight_version)
        self.latency = latency
        self.tokenizer = PreTrainedTokenizerFast.from_pretrained(self.model_path)
        config = json.loads((Path(self.model_path) / "config.json").read_text())
        self.vocab_size = config["vocab_size"]
        self.context_length = config["max_position_embeddings"]
        special = set(self.tokenizer.all_special_ids)
        self.eos_token_id = self.tokenizer.eos_token_id
        self.token_ids = [t for t in range(self.vocab_size) if t not in special]
        self.logprob = -math.log(len(self.token_ids))
        self.running_samples: list[Sample] = []
        self.backlog: list[GenerationJob] = []
        """Jobs submitted and not yet running (the engine runs at most max_batch_size sequences)."""
        self.lengths: dict[int, int] = {}
        """id(sample) -> the length it will end at."""
        self.rngs: dict[int, random.Random] = {}
        self.retracted_tokens = 0
        """Tokens a retract left to prefill again, charged to the next step."""
        self.tokens_generated = 0
        self.busy_seconds = 0.0
        self.batch_sizes: Counter[int] = Counter()
        self._choices_by_stops: dict[tuple[int, ...], list[int]] = {}
        self.start_scheduler()

    # -- the API the HTTP server calls (thread-safe), beside ScheduledEngine's ------------------

    def abort(self, rid: str | None = None, abort_all: bool = False) -> int:
        def mark() -> int:
            self._drain_waiting()
            queued = [job for job in self.backlog if abort_all or job.rid == rid]
            self.backlog = [job for job in self.backlog if job not in queued]
            for job in queued:
                job.samples = [Sample(job, i, None) for i in range(job.params.n)]
            running = {s.job for s in self.running_samples if abort_all or s.job.rid == rid}
            for job in running | set(queued):
                job.aborted = True
            self._finish({s for job in queued for s in job.samples} | {s for s in self.running_samples if s.job.aborted}, {"type": "abort"})
            return len(running) + len(queued)

        return self.run_command(mark).result()

    def update_weights(self, model_path: str, weight_version: str | None) -> tuple[bool, str]:
        """Verify the snapshot, then hold the scheduler for the simulated load time."""
        try:
            verify_local_dir(Path(model_path))
        except (ManifestError, OSError, ValueError) as err:
            return False, f"refused {model_path}: {err}"
        size_gb = sum(p.stat().st_size for p in Path(model_path).glob("*.safetensors")) / 1e9

        def load() -> None:
            time.sleep(self.latency.load_s_per_gb * size_gb)
            self.model_path = model_path
            self.weight_version = weight_version if weight_version is not None else self.weight_version

        self.run_command(load).result()
        return True, f"loaded {model_path} as weight_version {self.weight_version} ({size_gb:.3f} GB, simulated)"

    def stats(self) -> dict:
        return {
            "weight_version": self.weight_version, "max_batch_size": self.max_batch_size, "paused": self.paused,
            "num_running": len(self.running_samples), "num_waiting": len(self.backlog) + self.waiting.qsize(),
            "tokens_generated": self.tokens_generated, "busy_seconds": round(self.busy_seconds, 3),
            "decode_batch_sizes": {str(k): v for k, v in sorted(self.batch_sizes.items())},
            "latency_model": self.latency.model_dump(),
        }  # fmt: skip

    # -- the scheduler thread's steps -------------------------------------------------------

    def _collect_work(self) -> bool:
        return bool(self.running_samples or self.backlog) or not self.waiting.empty()

    def _step(self) -> None:
        prefill_tokens = self._admit_waiting() + self.retracted_tokens
        self.retracted_tokens = 0
        if self.running_samples:
            self._decode_step(prefill_tokens)

    def _retract(self) -> None:
        """The running sequences stay where they are, but the next step pays their prefill again
        (prompt and output so far), as a GPU engine's would after a retract; once, however many
        retracts a pause gets (a weight sync's pre-pause and its own pause)."""
        self.retracted_tokens = sum(len(s.job.input_ids) + len(s.output_ids) for s in self.running_samples)

    def _fail_running(self, err: Exception) -> None:
        """End the running and the queued jobs, as the CPU engine does (its queue holds both)."""
        for job in {s.job for s in self.running_samples} | set(self.backlog):
            if not job.future.done():
                job.future.set_exception(err)
        self.running_samples, self.lengths, self.rngs, self.backlog = [], {}, {}, []

    def _drain_waiting(self) -> None:
        """Move submitted jobs into the backlog, in order (where an abort can find them)."""
        while not self.waiting.empty():
            self.backlog.append(self.waiting.get())

    def _admit_waiting(self) -> int:
        """Move backlog jobs' samples into the running set, first come first served, up to
        max_batch_size sequences; returns the prompt tokens admitted, which this step pays
        prefill for."""
        self._drain_waiting()
        prefill = 0
        while self.backlog and len(self.running_samples) < self.max_batch_size:
            job = self.backlog.pop(0)
            job.samples = [Sample(job, i, None) for i in range(job.params.n)]
            room = self.context_length - len(job.input_ids)
            cap = max(0, min(job.params.max_new_tokens, room))
            for sample in job.samples:
                rng = random.Random(self._seed(job, sample.index))
                self.rngs[id(sample)] = rng
                natural = max(1, round(rng.lognormvariate(math.log(self.latency.length_median), self.latency.length_sigma)))
                self.lengths[id(sample)] = cap if job.params.ignore_eos else min(cap, natural)
            if cap == 0:
                self._finish(set(job.samples), {"type": "length", "length": 0})
                continue
            self.running_samples += job.samples
            prefill += len(job.input_ids) * job.params.n
        return prefill

    def _seed(self, job: GenerationJob, index: int) -> str | None:
        """What a sample's tokens and length are drawn from: the request's sampling_seed (or,
        greedy, its prompt), the sample's index and the weight version; None: unseeded."""
        if job.params.sampling_seed is not None:
            return f"{job.params.sampling_seed}-{index}-{self.weight_version}"
        if job.params.temperature == 0:
            return f"greedy-{job.input_ids}-{index}-{self.weight_version}"
        return None

    def _decode_step(self, prefill_tokens: int) -> None:
        """One decode step of every running sequence, taking the model's time."""
        seconds = self.latency.decode_base_s + self.latency.decode_s_per_seq * len(self.running_samples)
        seconds += self.latency.prefill_s_per_token * prefill_tokens
        time.sleep(seconds)
        self.busy_seconds += seconds
        self.batch_sizes[len(self.running_samples)] += 1
        done = set()
        for sample in self.running_samples:
            target = self.lengths[id(sample)]
            stop_ids = sample.job.params.stop_token_ids or []
            ends_early = target < sample.job.params.max_new_tokens and not sample.job.params.ignore_eos
            last = stop_ids[0] if stop_ids else self.eos_token_id
            if len(sample.output_ids) + 1 == target and ends_early and last is not None:
                token = last
            else:
                token = self.rngs[id(sample)].choice(self._choices(stop_ids))
            sample.record_token(token, self.logprob, self.weight_version)
            self.tokens_generated += 1
            if token == self.eos_token_id or token in stop_ids:
                sample.finish_reason = {"type": "stop", "matched": token}
                done.add(sample)
            elif len(sample.output_ids) >= target:
                sample.finish_reason = {"type": "length", "length": len(sample.output_ids)}
                done.add(sample)
        self._finish(done, None)

    def _choices(self, stop_ids: list[int]) -> list[int]:
        """Token ids a sample may emit before its drawn length is reached: not special, and not
        one of its request's stop tokens, which would end it early and shorten the tail."""
        if not stop_ids:
            return self.token_ids
        key = tuple(sorted(stop_ids))
        if key not in self._choices_by_stops:
            self._choices_by_stops[key] = [t for t in self.token_ids if t not in set(stop_ids)]
        return self._choices_by_stops[key]

    def _finish(self, samples: set[Sample], reason: dict | None) -> None:
        for sample in samples:
            if reason is not None:
                sample.finish_reason = reason
            self.lengths.pop(id(sample), None)
            self.rngs.pop(id(sample), None)
        self.running_samples = [s for s in self.running_samples if s not in samples]
        for job in {s.job for s in samples}:
            if all(s.finish_reason is not None for s in job.samples) and not job.future.done():
                job.weight_version = self.weight_version  # as the CPU engine: the version that finished it
                job.future.set_result(job)
