"""The trainer step: rollout rows -> one padded batch -> one optimizer step of the RL loss, plus
the supervised warm-start that precedes RL. Plain torch, no Prefect, no DDP.

- `build_batch`: each row's prompt_ids + completion_ids, right-padded with the pad id 0. A causal
  LM's logit at position t predicts token t+1, so completion token i (at position P+i, P the
  prompt length) is scored by the logit at P+i-1: its loss_mask and behaviour logprob go there,
  in `targets`' frame. Prompt tokens are never in the loss, the last real position predicts
  nothing, and padding predicts nothing either.
- `Trainer.rl_step`: forward with the attention mask (in micro-batches of
  `training.micro_batch_size` rows, gradients accumulated, when the batch would not fit at
  once), logits divided by the sampling temperature (generation.temperature), `policy_loss` of
  tasks/loss.py with the
  TrainingConfig's clip_eps, is_cap, importance_correction, kl_coef and entropy_coef, backward,
  gradient-norm clipping, one AdamW step. The reported grad_norm is the norm BEFORE clipping (what
  the loss asked for). A non-finite one skips the update (`skipped`: 1): the weights stay as they
  were, the version still advances and the batch counts as trained, as verl does. Raising kept
  the batch unconsumed, so Prefect's retry and every resume met the same batch and the same
  overflow, and the run could not go on; applying it would publish NaN weights to every
  generator. `MAX_SKIPPED_IN_A_ROW` in a row raise: the weights, not a batch, are then the
  trouble. A warm-start step raises at once, naming training.warmup_lr. The RL passes run in eval
  mode: dropout would make the trainer's logprobs differ from the engines' at lag 0 (verl and TRL
  turn it off for the policy too).
- Device and precision: the Trainer computes where its model lies (the training flow puts it on
  training.device, tasks/placement.py) and moves each batch there. Its forward passes autocast to
  training.compute_dtype (bfloat16 on a GPU by default); weights, gradients, optimizer state and
  everything after the logits stay float32.
- Temperature: the policy that acts is softmax(logits / T), so that is the one trained: its
  logprobs are the ratio's numerator and the gradient is that of the distribution the samples
  came from (as verl and slime do). The engines report behaviour logprobs of the same
  distribution (SGLang's default, and tandem's engines). Top-k and top-p truncation are not
  modelled, on either side.
- Version: `Trainer.version` is the policy version V of docs/architecture.md, the number of RL optimizer
  steps applied. The warm-start does not count: it runs before v0 is published, so v0 IS the
  warm-started model and every rl_step makes V+1. A sample of version v trained in the step
  that makes V+1 has lag V - v (reported as lag_mean / lag_max).
- Optimizers: the warm-start has its own AdamW at warmup_lr; the RL AdamW at lr is created fresh
  and is untouched by the warm-start, so RL starts with empty Adam moments: the supervised
  phase's moments describe another loss at a 10x learning rate. The warm-start optimizer is freed
  at the first rl_step, and `supervised_step` is refused from then on: it would change the
  weights of a published version without a new version number.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, fields

import pyarrow as pa
import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer

from configs.sections import TrainingConfig
from infra.modelfactory import PAD, TASK_VOCABULARY
from tasks.loss import policy_loss, token_entropy, token_logprobs
from tasks.placement import autocast_dtype
from tasks.shards import Rollout, table_to_rollouts

log = logging.getLogger(__name__)

PAD_ID = TASK_VOCABULARY.index(PAD)
MAX_SKIPPED_IN_A_ROW = 3
"""Optimizer steps with a non-finite gradient skipped one after another before the trainer fails."""


@dataclass
class TrainBatch:
    """One RL batch of B trajectories padded to length L."""

    input_ids: Tensor
    """[B, L] int64: prompt + completion, right-padded with PAD_ID."""
    attention_mask: Tensor
    """[B, L] int64: 1 on real tokens, 0 on padding."""
    targets: Tensor
    """[B, L] int64: targets[:, t] = input_ids[:, t + 1] (PAD_ID where t + 1 is past the end)."""
    loss_mask: Tensor
    """[B, L] float32: 1 where targets[:, t] is a model token of the completion, else 0."""
    behavior_logprobs: Tensor
    """[B, L] float32: the engine's logprob of targets[:, t] where loss_mask is 1, else 0."""
    advantages: Tensor
    """[B] float32: one advantage per trajectory, shared by its tokens."""
    policy_versions: Tensor
    """[B] int64: the policy version that generated each trajectory."""

    def to(self, device: torch.device) -> TrainBatch:
        return TrainBatch(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})

    def micro_batches(self, size: int) -> list[TrainBatch]:
        """The batch in slices of `size` rows, each cut to its own longest row (less padding)."""
        parts = []
        for start in range(0, self.input_ids.shape[0], size):
            rows = slice(start, start + size)
            length = int(self.attention_mask[rows].sum(dim=1).max())
            parts.append(TrainBatch(**{
                f.name: value[rows, :length] if value.dim() == 2 else value[rows]
                for f in fields(self) for value in [getattr(self, f.name)]
            }))  # fmt: skip
        return parts


def build_batch(
    rows: Sequence[Rollout] | pa.Table, advantages: Tensor | Sequence[float]
) -> TrainBatch:
    """The TrainBatch of rollout rows (or a ROLLOUT_SCHEMA table) with one advantage per row."""
    if isinstance(rows, pa.Table):
        rows = table_to_rollouts(rows)
    advantages = torch.as_tensor(advantages, dtype=torch.float32)
    if not rows or advantages.shape != (len(rows),):
        raise ValueError(f"{len(rows)} rows need as many advantages, got {tuple(advantages.shape)}")
    size, length = len(rows), max(len(r.prompt_ids) + len(r.completion_ids) for r in rows)
    batch = TrainBatch(
        input_ids=torch.full((size, length), PAD_ID, dtype=torch.int64),
        attention_mask=torch.zeros(size, length, dtype=torch.int64),
        targets=torch.full((size, length), PAD_ID, dtype=torch.int64),
        loss_mask=torch.zeros(size, length),
        behavior_logprobs=torch.zeros(size, length),
        advantages=advantages,
        policy_versions=torch.tensor([r.policy_version for r in rows], dtype=torch.int64),
    )
    for b, row in enumerate(rows):
        prompt, completion = len(row.prompt_ids), len(row.completion_ids)
        if prompt == 0:
            raise ValueError(f"row {b} has an empty prompt: its first token would have no logit")
        if not len(row.loss_mask) == len(row.behavior_logprobs) == completion:
            raise ValueError(f"row {b}: loss_mask, behavior_logprobs, completion lengths differ")
        ids = torch.tensor(row.prompt_ids + row.completion_ids, dtype=torch.int64)
        end = prompt + completion
        batch.input_ids[b, :end] = ids
        batch.attention_mask[b, :end] = 1
        batch.targets[b, : end - 1] = ids[1:]
        # completion token i sits at position prompt + i and is scored by the logit before it
        batch.loss_mask[b, prompt - 1 : end - 1] = torch.tensor(row.loss_mask, dtype=torch.float32)
        batch.behavior_logprobs[b, prompt - 1 : end - 1] = torch.tensor(row.behavior_logprobs)
    return batch


def build_supervised_batch(
    examples: Sequence[tuple[Sequence[int], Sequence[int]]],
) -> tuple[Tensor, Tensor, Tensor]:
    """(input_ids, attention_mask, loss_mask) [B, L] of warm-start examples (token_ids, flags).

    flags[t] is 1 where token t is a model token (trained on) and 0 for prompt and environment
    tokens; loss_mask keeps that per-token frame, unlike TrainBatch's targets frame. The first
    token has no logit before it, so it must not be a model token.
    """
    if not examples:
        raise ValueError("no warm-start examples")
    length = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), length), PAD_ID, dtype=torch.int64)
    attention_mask = torch.zeros(len(examples), length, dtype=torch.int64)
    loss_mask = torch.zeros(len(examples), length)
    for b, (ids, flags) in enumerate(examples):
        if len(ids) != len(flags) or not ids or flags[0]:
            raise ValueError(f"example {b}: need equal, non-empty ids and flags, flags[0] == 0")
        input_ids[b, : len(ids)] = torch.tensor(list(ids), dtype=torch.int64)
        attention_mask[b, : len(ids)] = 1
        loss_mask[b, : len(ids)] = torch.tensor(list(flags), dtype=torch.float32)
    return input_ids, attention_mask, loss_mask


def checkpoint_blocks(model: PreTrainedModel) -> None:
    """Recompute each transformer block's activations in backward instead of keeping them
    (torch's activation checkpointing around the block's forward): one block's activations are
    held, not every block's, for about a third more compute.

    Not transformers' own switch: it checkpoints a block only while the block is in training
    mode, and the RL pass runs in eval mode, without dropout, to compare with the engines'
    deterministic pass; a block in training mode would apply the dropout some models' blocks
    apply themselves (OPT's, Falcon's). Wrapped here, a block checkpoints in either mode."""
    blocks = [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]
    if not blocks:
        log.warning("training.gradient_checkpointing: %s has no transformer blocks transformers marks for it; "
                    "every activation is kept", type(model).__name__)  # fmt: skip
    for block in blocks:
        if not isinstance(block.forward, functools.partial):  # once, for a model given to a second trainer
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)


class Trainer:
    """The policy model, its optimizers and its version; `version` > 0 resumes a run at that V."""

    def __init__(
        self,
        model: PreTrainedModel,
        cfg: TrainingConfig,
        ref_model: PreTrainedModel | None = None,
        *,
        version: int = 0,
        sampling_temperature: float = 1.0,
    ):
        """`sampling_temperature`: the generators' temperature (generation.temperature)."""
        if cfg.kl_coef > 0 and ref_model is None:
            raise ValueError("kl_coef > 0 needs a ref_model to measure the KL against")
        if sampling_temperature <= 0:
            raise ValueError(f"an RL policy samples at a temperature > 0, got {sampling_temperature}")
        self.model, self.cfg, self.ref_model = model, cfg, ref_model
        self.sampling_temperature = sampling_temperature
        if ref_model is not None:
            ref_model.eval().requires_grad_(False)
        # fused: one kernel over every parameter, without the multi-tensor path's temporaries
        # (its square root of the second moments is a float32 copy the size of the model)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True)
        self.warmup_optimizer: torch.optim.AdamW | None = None
        if version == 0:
            self.warmup_optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.warmup_lr, weight_decay=cfg.weight_decay, fused=True)
        if cfg.gradient_checkpointing:
            checkpoint_blocks(model)
        self._version = version
        self.skipped_in_a_row = 0
        self.compute_dtype = autocast_dtype(cfg, model.device)
        """What the passes autocast to (training.compute_dtype); None: float32 throughout."""

    @property
    def version(self) -> int:
        """Policy version V of the model's weights: RL optimizer steps applied."""
        return self._version

    def supervised_step(
        self, input_ids: Tensor, attention_mask: Tensor, loss_mask: Tensor
    ) -> dict[str, float]:
        """One warm-start step: cross-entropy of the model tokens (loss_mask per token) only, over
        micro-batches of `training.micro_batch_size` rows (each its share of the batch's token
        mean) as in an RL step: the warm-start's 64 demonstrations in one pass did not fit a
        real model's GPU, which the RL steps' micro-batches do."""
        if self.warmup_optimizer is None:
            raise RuntimeError("the warm-start must come before v0 is trained on (version 0 only)")
        device = self.model.device
        self.model.train()
        tokens = loss_mask[:, 1:].bool().sum()
        size = self.cfg.micro_batch_size or input_ids.shape[0]
        loss_total = 0.0
        try:  # gradients accumulate over the micro-batches; a failure leaves none behind
            for rows in torch.arange(input_ids.shape[0]).split(size):
                length = int(attention_mask[rows].sum(dim=1).max())  # the part's longest row, not the batch's
                ids = input_ids[rows, :length].to(device)
                inputs = {"input_ids": ids, "attention_mask": attention_mask[rows, :length].to(device), "use_cache": False}
                logprobs = token_logprobs(self._logits(self.model, inputs)[:, :-1], ids[:, 1:])
                model_tokens = loss_mask[rows, 1:length].to(device).bool()
                loss = -torch.where(model_tokens, logprobs, 0.0).sum() / tokens.clamp(min=1)
                loss.backward()
                loss_total += loss.item()
            step = self._step(self.warmup_optimizer)
            if step["skipped"]:
                raise FloatingPointError(f"a warm-start step's gradient norm is {step['grad_norm']}: lower training.warmup_lr")
        finally:
            self.warmup_optimizer.zero_grad(set_to_none=True)
        return {"loss": loss_total, "tokens": float(tokens.item())} | step

    def rl_step(self, batch: TrainBatch) -> dict[str, float]:
        """One RL optimizer step on `batch`; the model becomes version V + 1."""
        lags = self._version - batch.policy_versions
        if (lags < 0).any():
            raise ValueError(f"batch has samples newer than the trainer's version {self._version}")
        self.warmup_optimizer = None
        self.model.eval()  # no dropout: the ratio compares with the engines' deterministic pass
        total = float(batch.loss_mask.sum())
        metrics: dict[str, float] = {}
        try:  # gradients accumulate over the micro-batches; a failure leaves none behind
            for part in batch.micro_batches(self.cfg.micro_batch_size or batch.input_ids.shape[0]):
                loss, part_metrics = self._micro_batch_loss(part.to(self.model.device), total)
                loss.backward()
                for name, value in part_metrics.items():
                    metrics[name] = max(metrics.get(name, value), value) if name == "ratio_max" else metrics.get(name, 0.0) + value
            metrics |= self._step(self.optimizer)
        finally:
            self.optimizer.zero_grad(set_to_none=True)
        self._version += 1
        lags = lags.float()
        metrics |= {"lag_mean": lags.mean().item(), "lag_max": lags.max().item()}
        return metrics | {"version": self._version}

    def _micro_batch_loss(self, part: TrainBatch, token_total: float) -> tuple[Tensor, dict[str, float]]:
        """The loss of one micro-batch, as its share of the whole batch's token mean."""
        inputs = {"input_ids": part.input_ids, "attention_mask": part.attention_mask, "use_cache": False}
        logits, temperature = self._logits(self.model, inputs), self.sampling_temperature
        logprobs = token_logprobs(logits, part.targets, temperature)
        with torch.set_grad_enabled(self.cfg.entropy_coef > 0):
            entropy = token_entropy(logits, temperature)
        ref_logprobs = None
        if self.ref_model is not None:
            with torch.no_grad():
                ref_logprobs = token_logprobs(self._logits(self.ref_model, inputs), part.targets, temperature)
        return policy_loss(
            logprobs, part.behavior_logprobs, part.advantages, part.loss_mask,
            clip_eps=self.cfg.clip_eps, is_cap=self.cfg.is_cap, importance_correction=self.cfg.importance_correction,
            ref_logprobs=ref_logprobs, kl_coef=self.cfg.kl_coef, entropy=entropy, entropy_coef=self.cfg.entropy_coef,
            token_total=token_total,
        )  # fmt: skip

    def _logits(self, model: PreTrainedModel, inputs: dict) -> Tensor:
        """The model's logits, its forward pass autocast to `compute_dtype` if set, in the dtype
        that gives them (bfloat16 under autocast): the log-softmax and the loss after it run in
        float32 (tasks/loss.py, by chunks of positions), where a bfloat16 logprob would be off by
        up to 1/128 of its value and the ratio with it.

        The logits themselves are rounded to bfloat16 under autocast (the LM head runs in it): a
        step of 0.125 at logits of 16-32, a few hundredths of a logprob on average, more at a low
        temperature. The LM head is not run in float32 here because its logits and their gradient
        would take twice the memory of the largest tensors of the pass; SGLang's LM head rounds the
        same way unless started with --enable-fp32-lm-head."""
        device = self.model.device.type
        autocast = torch.autocast(device, dtype=self.compute_dtype) if self.compute_dtype else contextlib.nullcontext()
        with autocast:
            return model(**inputs).logits

    def _step(self, optimizer: torch.optim.Optimizer) -> dict[str, float]:
        """Clip the accumulated gradients and step; grad_norm is the norm before clipping."""
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        step = {"grad_norm": grad_norm.item(), "lr": optimizer.param_groups[0]["lr"]}
        if not torch.isfinite(grad_norm):
            self.skipped_in_a_row += 1
            if self.skipped_in_a_row >= MAX_SKIPPED_IN_A_ROW:
                raise FloatingPointError(f"a non-finite gradient norm ({grad_norm.item()}) in {self.skipped_in_a_row} steps in a row")
            return step | {"skipped": 1.0}
        self.skipped_in_a_row = 0
        optimizer.step()
        return step | {"skipped": 0.0}
