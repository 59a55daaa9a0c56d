"""The RL loss: group-normalised advantages and a token-level PPO-clip loss against the engine's
behaviour logprobs. Plain torch functions, no model and no Prefect: the trainer step calls them.

- `group_advantages` (GRPO): each sample's reward minus the mean of its group (the samples of one
  prompt), divided by the group's std. The group is its own baseline, so no value model is
  needed, and the division puts easy and hard prompts on one scale. The std is the POPULATION std
  (divide by n, not n-1): it is defined for any group size, a group of one included, and the
  advantages of a group then have unit variance exactly. (TRL's GRPO uses the sample std; the two
  differ by a constant factor sqrt((n-1)/n), 0.935 for n=8, which the learning rate absorbs.)
  A group whose rewards are all equal carries no signal and gets advantage 0 exactly, not the
  float noise of (r - mean) / (0 + eps). A group comes whole (one shard) or not at all.
- `policy_loss`: with importance correction, the PPO-clip surrogate of the ratio
  r = pi(token) / behaviour(token), where behaviour is the engine's logprob of the weights that
  generated the sample (up to max_lag versions old). min(r*A, clip(r, 1-eps, 1+eps)*A) stops the
  gradient once the policy has moved eps past the behaviour policy in the direction A asks for.
  For A < 0 that min is unbounded as r grows: a very stale token that the current policy now
  likes a lot would contribute r*A, its gradient growing with r. The truncated importance weight
  (cap configurable, on by default: TrainingConfig.is_cap) is the dual clip of Ye et al. 2020:
  max(surrogate, is_cap*A) for A < 0, so no single sample can dominate the gradient. Without
  importance correction the loss is the plain on-policy policy gradient -A * logprob.
- Token-level mean: the surrogate is averaged over every model token in the batch, not per
  sequence first. A per-sequence mean gives each token of a long episode less weight than a token
  of a short one (DAPO); the token mean weighs every model decision equally. Environment tokens
  (mask 0) and padding never count.
- Optional terms: a KL penalty against a reference policy and an entropy bonus. The KL term is
  GRPO's (DeepSeekMath): Schulman's k3 estimator exp(ref - logp) - (ref - logp) - 1, >= 0 on
  every token, as a loss. Its value estimates KL(pi || ref) on samples of pi, but its gradient is
  that of KL(ref || pi), and the samples are the behaviour policy's, not reweighted: it keeps pi
  near ref, not a KL-regularised objective exactly.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

LOG_RATIO_LIMIT = 20.0
"""log(ratio) is clamped to [-20, 20] before exp: a token the engine gave logprob -80 (or a
float mishap) must not make the ratio inf. Beyond the clamp the token's gradient is 0: what the
clip gives it anyway, except for A < 0 with no is_cap, where the unclipped r*A would have a
gradient of e^20 times A's, which is what the clamp is there to stop."""


def group_advantages(rewards: Tensor, group_ids: Sequence[str], eps: float = 1e-6) -> Tensor:
    """GRPO advantages [B]: (r - group mean) / (group population std + eps); equal rewards -> 0."""
    if rewards.dim() != 1 or len(group_ids) != rewards.shape[0]:
        raise ValueError(f"rewards {tuple(rewards.shape)} and {len(group_ids)} group ids differ")
    rewards = rewards.to(torch.float64)
    advantages = torch.zeros_like(rewards)
    members: dict[str, list[int]] = defaultdict(list)
    for index, group in enumerate(group_ids):
        members[group].append(index)
    for index in members.values():
        group = rewards[index]
        if group.max() > group.min():
            advantages[index] = (group - group.mean()) / (group.std(correction=0) + eps)
    return advantages.to(torch.float32)


LOGIT_CHUNK_POSITIONS = 2048
"""Positions whose float32 log-softmax is worked out at once. A whole micro-batch's would take 4
bytes per logit for each float32 copy the pass makes (the cast, the temperature's division, the
log-softmax that backward needs), about 20 bytes per logit with the entropy: 25 GB for 8,192
positions of a 152k vocabulary. A chunk's copies are freed after it and made again in the backward
pass (activation checkpointing), so the pass holds the model's own logits and one chunk's work."""


def token_logprobs(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
    """log p(target) [B, L] from logits [B, L, V] at `temperature`, in float32 whatever the
    logits' dtype, LOGIT_CHUNK_POSITIONS positions at a time."""
    return _by_chunks(_chunk_logprobs, logits, temperature, targets.reshape(-1)).view(targets.shape)


def token_entropy(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy [B, L] of the next-token distribution at each position, in float32, by chunks."""
    return _by_chunks(_chunk_entropy, logits, temperature).view(logits.shape[:-1])


def _chunk_logprobs(logits: Tensor, temperature: float, targets: Tensor) -> Tensor:
    logprobs = (logits.float() / temperature).log_softmax(dim=-1)
    return logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def _chunk_entropy(logits: Tensor, temperature: float) -> Tensor:
    logprobs = (logits.float() / temperature).log_softmax(dim=-1)
    # p * log p is 0 * -inf, NaN, at a logit of -inf (a model that masks its vocabulary's padding
    # rows so): clamped to the lowest float, the product is 0 there and so is its gradient.
    return -(logprobs.exp() * logprobs.clamp(min=torch.finfo(logprobs.dtype).min)).sum(dim=-1)


def _by_chunks(per_chunk, logits: Tensor, temperature: float, *rest: Tensor) -> Tensor:
    """`per_chunk` over the positions of `logits` in chunks, joined. With gradients each chunk is
    checkpointed: its float32 work is made again in backward instead of kept. `split`, not
    slicing, so that backward joins the chunks' gradients once instead of adding up a full-size
    gradient per chunk."""
    flat = logits.reshape(-1, logits.shape[-1])
    chunks = zip(flat.split(LOGIT_CHUNK_POSITIONS), *(r.split(LOGIT_CHUNK_POSITIONS) for r in rest))
    if not (flat.requires_grad and torch.is_grad_enabled()):
        return torch.cat([per_chunk(chunk, temperature, *others) for chunk, *others in chunks])
    return torch.cat([checkpoint(per_chunk, chunk, temperature, *others, use_reentrant=False) for chunk, *others in chunks])


def policy_loss(
    logprobs: Tensor,
    behavior_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_eps: float,
    is_cap: float | None,
    importance_correction: bool = True,
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
    token_total: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The loss to minimise and its metrics, over the model tokens (mask 1) of a batch.

    logprobs, behavior_logprobs, mask (and ref_logprobs, entropy) are [B, T]; advantages is [B]
    (one per sequence, shared by its tokens) or [B, T]. The loss is
    pg_loss + kl_coef * kl - entropy_coef * entropy, each a mean over all model tokens; the KL term
    needs ref_logprobs and the entropy term the per-token `entropy`. Metrics: pg_loss, kl and
    entropy (0.0 when their input is not given), ratio_mean, ratio_max, clip_fraction and
    capped_fraction (fractions of model tokens where the clip or the cap set the surrogate; 0.0
    without importance correction), tokens and loss. A batch without model tokens has loss 0.

    `token_total`: the model tokens of the whole batch when this is one micro-batch of it. Every
    mean then divides by it, so the micro-batches' losses, gradients and metrics (ratio_max
    aside, a max) add up to the whole batch's.
    """
    if is_cap is not None and is_cap <= 1.0:
        raise ValueError(f"is_cap must be > 1 (a cap <= 1 stops on-policy tokens), got {is_cap}")
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    advantages = advantages.expand_as(logprobs)
    model = mask.bool()
    tokens = model.sum()
    count = tokens.clamp(min=1) if token_total is None else max(token_total, 1.0)

    def mean(values: Tensor) -> Tensor:
        return torch.where(model, values, 0.0).sum() / count

    log_ratio = (logprobs - behavior_logprobs).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    ratio = log_ratio.exp()
    clipped = torch.zeros_like(model)
    capped = torch.zeros_like(model)
    if importance_correction:
        unclipped = ratio * advantages
        clipped_branch = ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages
        surrogate = torch.minimum(unclipped, clipped_branch)
        clipped = model & (clipped_branch < unclipped)
        if is_cap is not None:
            cap = is_cap * advantages
            capped = model & (advantages < 0) & (surrogate < cap)
            surrogate = torch.where(advantages < 0, torch.maximum(surrogate, cap), surrogate)
    else:
        surrogate = advantages * logprobs
    pg_loss = -mean(surrogate)
    loss = pg_loss
    kl = torch.zeros(())
    if ref_logprobs is not None:
        # Zeroed off the model tokens and clamped before exp: a prompt or tool position where the
        # two drift apart (freely: it is never trained) made exp() inf there, and its gradient,
        # 0 * inf, NaN, which skipped every step from then on.
        delta = torch.where(model, ref_logprobs - logprobs, 0.0).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
        kl = mean(delta.exp() - delta - 1)
        if kl_coef > 0:
            loss = loss + kl_coef * kl
    mean_entropy = torch.zeros(())
    if entropy is not None:
        mean_entropy = mean(entropy)
        if entropy_coef > 0:
            loss = loss - entropy_coef * mean_entropy
    ratio = ratio.detach()
    metrics = {
        "loss": loss.item(),
        "pg_loss": pg_loss.item(),
        "kl": kl.item(),
        "entropy": mean_entropy.item(),
        "ratio_mean": mean(ratio).item(),
        "ratio_max": torch.where(model, ratio, 0.0).max().item(),
        "clip_fraction": (clipped.sum() / count).item(),
        "capped_fraction": (capped.sum() / count).item(),
        "tokens": float(tokens.item()),
    }
    return loss, metrics
