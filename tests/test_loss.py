"""The RL loss against numbers worked out by hand: values and gradients, clip and cap, KL, entropy,
and the GRPO group advantages."""

from __future__ import annotations

import math

import pytest
import torch

from tasks.loss import group_advantages, policy_loss, token_entropy, token_logprobs

# A fixed batch, B=2 sequences of T=3 tokens; the last token of row 0 is an environment token.
LOGPROBS = [[-1.0, -0.5, -2.0], [-1.5, -0.2, -1.0]]
BEHAVIOR = [[-1.1, -1.0, 0.0], [-1.0, -1.5, -0.9]]
ADVANTAGES = [1.0, -2.0]
MASK = [[1, 1, 0], [1, 1, 1]]
CLIP_EPS, IS_CAP = 0.2, 3.0
# Per model token, log r = logprob - behaviour, r = e^(log r), with A the row's advantage:
#   (0,0) log r  0.1: r = 1.1051709181, A=+1, inside [0.8, 1.2]: surrogate r*A = 1.1051709181,
#         d surrogate / d logprob = r*A = 1.1051709181
#   (0,1) log r  0.5: r = 1.6487212707, A=+1, r > 1.2: clipped, surrogate 1.2*1 = 1.2, gradient 0
#   (1,0) log r -0.5: r = 0.6065306597, A=-2, r < 0.8: clipped, min(-1.2130613, 0.8*-2) = -1.6,
#         gradient 0
#   (1,1) log r  1.3: r = 3.6692966676, A=-2, r > 1.2 so the min keeps r*A = -7.3385933353;
#         r > cap 3: dual clip max(-7.3385933353, 3*-2) = -6, gradient 0
#   (1,2) log r -0.1: r = 0.9048374180, A=-2, inside: surrogate r*A = -1.8096748360,
#         gradient r*A = -1.8096748360
# pg_loss = -(1.1051709181 + 1.2 - 1.6 - 6 - 1.8096748360) / 5 = 7.1045039179 / 5
PG_LOSS = 1.4209007836
# d pg_loss / d logprob = -(r*A)/5 on the unclipped, uncapped tokens, 0 elsewhere
PG_GRAD = [[-0.2210341836, 0.0, 0.0], [0.0, 0.0, 0.3619349672]]
# ratio_mean = (1.1051709181 + 1.6487212707 + 0.6065306597 + 3.6692966676 + 0.9048374180) / 5
RATIO_MEAN = 1.5869113868
RATIO_MAX = 3.6692966676


def tensors(*rows):
    return [torch.tensor(r, dtype=torch.float32) for r in rows]


def run_loss(**kwargs):
    logprobs, behavior, mask = tensors(LOGPROBS, BEHAVIOR, MASK)
    logprobs.requires_grad_(True)
    loss, metrics = policy_loss(
        logprobs, behavior, torch.tensor(ADVANTAGES), mask, clip_eps=CLIP_EPS, **kwargs
    )
    loss.backward()
    return loss.item(), logprobs.grad, metrics


def test_ppo_clip_with_dual_clip_cap_matches_hand_computation() -> None:
    loss, grad, metrics = run_loss(is_cap=IS_CAP)
    assert loss == pytest.approx(PG_LOSS, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor(PG_GRAD), atol=1e-6, rtol=0)
    assert metrics["pg_loss"] == metrics["loss"] == pytest.approx(PG_LOSS, abs=1e-6)
    assert metrics["ratio_mean"] == pytest.approx(RATIO_MEAN, abs=1e-6)
    assert metrics["ratio_max"] == pytest.approx(RATIO_MAX, abs=1e-6)
    assert metrics["clip_fraction"] == pytest.approx(2 / 5)  # (0,1) and (1,0)
    assert metrics["capped_fraction"] == pytest.approx(1 / 5)  # (1,1)
    assert metrics["tokens"] == 5.0
    assert metrics["kl"] == 0.0 and metrics["entropy"] == 0.0


def test_without_the_cap_a_stale_negative_token_keeps_its_unbounded_ratio() -> None:
    # (1,1) now contributes r*A = -7.3385933353 and the gradient -(r*A)/5 = 1.4677186671
    loss, grad, metrics = run_loss(is_cap=None)
    assert loss == pytest.approx((7.1045039179 - 6 + 7.3385933353) / 5, abs=1e-6)
    expected = [[-0.2210341836, 0.0, 0.0], [0.0, 1.4677186671, 0.3619349672]]
    torch.testing.assert_close(grad, torch.tensor(expected), atol=1e-6, rtol=0)
    assert metrics["capped_fraction"] == 0.0


def test_without_importance_correction_it_is_the_on_policy_policy_gradient() -> None:
    # surrogate A * logprob: -(1*-1.0 + 1*-0.5 + -2*-1.5 + -2*-0.2 + -2*-1.0) / 5 = -3.9 / 5
    loss, grad, metrics = run_loss(is_cap=IS_CAP, importance_correction=False)
    assert loss == pytest.approx(-0.78, abs=1e-6)
    # gradient -A/5 on every model token, whatever the behaviour logprobs were
    expected = [[-0.2, -0.2, 0.0], [0.4, 0.4, 0.4]]
    torch.testing.assert_close(grad, torch.tensor(expected), atol=1e-6, rtol=0)
    assert metrics["clip_fraction"] == metrics["capped_fraction"] == 0.0
    assert metrics["ratio_max"] == pytest.approx(RATIO_MAX, abs=1e-6)


def test_kl_and_entropy_terms_match_hand_computation() -> None:
    # k3 with d = ref - logprob: e^d - d - 1; d/dlogprob = 1 - e^d.
    #   (0,0) d  0.0: 0                   (0,1) d -0.2: 0.8187307531 + 0.2 - 1 = 0.0187307531
    #   (1,0) d  0.5: 1.6487212707 - 1.5 = 0.1487212707         (1,1) d 0.0: 0
    #   (1,2) d -0.3: 0.7408182207 + 0.3 - 1 = 0.0408182207
    # kl = 0.2082702445 / 5 = 0.0416540489; with kl_coef 0.5 the loss gains 0.0208270245 and the
    # gradient 0.5/5 * (1 - e^d): (0,1) 0.0181269247, (1,0) -0.0648721271, (1,2) 0.0259181779.
    ref = torch.tensor([[-1.0, -0.7, -5.0], [-1.0, -0.2, -1.3]])
    # entropy bonus: masked mean (1 + 2 + 0.5 + 1.5 + 3) / 5 = 1.6, times -0.1 = -0.16;
    # d loss / d entropy = -0.1/5 = -0.02 on model tokens
    entropy = torch.tensor([[1.0, 2.0, 9.0], [0.5, 1.5, 3.0]], requires_grad=True)
    loss, grad, metrics = run_loss(
        is_cap=IS_CAP, ref_logprobs=ref, kl_coef=0.5, entropy=entropy, entropy_coef=0.1
    )
    assert metrics["kl"] == pytest.approx(0.0416540489, abs=1e-6)
    assert metrics["entropy"] == pytest.approx(1.6, abs=1e-6)
    assert loss == pytest.approx(1.4209007836 + 0.0208270245 - 0.16, abs=1e-6)
    expected = [[-0.2210341836, 0.0181269247, 0.0], [-0.0648721271, 0.0, 0.3878531451]]
    torch.testing.assert_close(grad, torch.tensor(expected), atol=1e-6, rtol=0)
    torch.testing.assert_close(
        entropy.grad, torch.tensor([[-0.02, -0.02, 0.0], [-0.02, -0.02, -0.02]]), atol=1e-7, rtol=0
    )


def test_kl_is_measured_but_not_added_when_its_coefficient_is_zero() -> None:
    ref = torch.tensor([[-1.0, -0.7, -5.0], [-1.0, -0.2, -1.3]])
    loss, _, metrics = run_loss(is_cap=IS_CAP, ref_logprobs=ref)
    assert loss == pytest.approx(PG_LOSS, abs=1e-6)
    assert metrics["kl"] == pytest.approx(0.0416540489, abs=1e-6)


def test_env_tokens_and_extreme_ratios_stay_finite_and_out_of_the_gradient() -> None:
    logprobs = torch.tensor([[-90.0, -1.0]], requires_grad=True)
    loss, metrics = policy_loss(
        logprobs, torch.tensor([[0.0, -80.0]]), torch.tensor([-1.0]), torch.tensor([[0, 1]]),
        clip_eps=0.2, is_cap=3.0,
    )
    loss.backward()
    assert math.isfinite(loss.item()) and loss.item() == pytest.approx(3.0)  # -(3 * A)
    assert logprobs.grad.tolist() == [[0.0, 0.0]]
    assert metrics["ratio_max"] == pytest.approx(math.exp(20), rel=1e-5)  # log ratio clamped at 20


def test_the_kl_term_stays_finite_where_the_reference_drifted_far() -> None:
    """A tool-output position (never trained, so free to drift) 100 nats from the reference made
    exp() inf there and the gradient NaN; a model token that far is clamped like the ratio."""
    logprobs = torch.tensor([[-100.0, -1.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[0.0, -1.0, -101.0]])
    loss, metrics = policy_loss(
        logprobs, logprobs.detach(), torch.tensor([1.0]), torch.tensor([[0, 1, 1]]),
        clip_eps=0.2, is_cap=3.0, ref_logprobs=ref, kl_coef=0.1,
    )
    loss.backward()
    assert math.isfinite(loss.item()) and math.isfinite(metrics["kl"])
    assert torch.isfinite(logprobs.grad).all() and logprobs.grad[0, 0] == 0.0


def test_a_batch_without_model_tokens_has_zero_loss() -> None:
    loss, metrics = policy_loss(
        torch.tensor([[-1.0]]), torch.tensor([[0.0]]), torch.tensor([1.0]), torch.tensor([[0]]),
        clip_eps=0.2, is_cap=2.0,
    )
    assert loss.item() == 0.0 and metrics["tokens"] == 0.0


def test_a_cap_that_would_stop_on_policy_tokens_is_refused() -> None:
    with pytest.raises(ValueError, match="is_cap"):
        run_loss(is_cap=1.0)


def test_group_advantages_use_the_population_std_per_group() -> None:
    # group a: rewards 1, 0, 0, 0 -> mean 0.25, population std sqrt(0.75 / 4) = 0.4330127019,
    #          advantages 0.75 / 0.4330127019 = 1.7320508076, -0.25 / 0.4330127019 = -0.5773502692
    # group c: rewards 3, 1 -> mean 2, population std 1 -> +1, -1 (the sample std would give 0.707)
    # group b: rewards 0.5, 0.5 -> all equal -> 0; group d: one sample -> 0
    ids = ["a", "c", "a", "b", "a", "b", "c", "a", "d"]
    rewards = torch.tensor([1.0, 3.0, 0.0, 0.5, 0.0, 0.5, 1.0, 0.0, 7.0])
    expected = [1.7320508076, 1.0, -0.5773502692, 0.0, -0.5773502692, 0.0, -1.0, -0.5773502692, 0.0]
    advantages = group_advantages(rewards, ids)
    assert advantages.dtype == torch.float32
    torch.testing.assert_close(advantages, torch.tensor(expected), atol=1e-5, rtol=0)


def test_equal_rewards_give_exactly_zero_advantages() -> None:
    advantages = group_advantages(torch.full((8,), 0.1), ["g"] * 8)
    assert advantages.tolist() == [0.0] * 8
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(3), ["g", "g"])


def test_token_logprobs_and_entropy_of_known_distributions() -> None:
    # logits (0, 0, ln 2): probabilities 1/4, 1/4, 1/2; a uniform row over 3 tokens
    logits = torch.tensor([[[0.0, 0.0, math.log(2.0)], [5.0, 5.0, 5.0]]], dtype=torch.bfloat16)
    logprobs = token_logprobs(logits, torch.tensor([[2, 0]]))
    assert logprobs.dtype == torch.float32
    expected = torch.tensor([[math.log(0.5), -math.log(3.0)]])
    torch.testing.assert_close(logprobs, expected, atol=3e-3, rtol=0)
    entropy = token_entropy(logits)
    expected = [[2 * 0.25 * math.log(4.0) + 0.5 * math.log(2.0), math.log(3.0)]]
    torch.testing.assert_close(entropy, torch.tensor(expected), atol=3e-3, rtol=0)


def test_logprobs_and_entropy_by_chunks_match_the_whole_pass_and_keep_no_float32_logits(monkeypatch) -> None:
    torch.manual_seed(0)
    logits = (torch.randn(3, 5, 40) * 3).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 40, (3, 5))
    whole = (logits.float() / 0.7).log_softmax(-1)
    expected = (whole.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(whole.exp() * whole).sum(-1))
    (expected[0].sum() + expected[1].sum()).backward()
    expected_grad, logits.grad = logits.grad, None
    monkeypatch.setattr("tasks.loss.LOGIT_CHUNK_POSITIONS", 4)  # 15 positions: chunks of 4, 4, 4 and 3
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        logprobs, entropy = token_logprobs(logits, targets, 0.7), token_entropy(logits, 0.7)
    torch.testing.assert_close((logprobs, entropy), expected)
    assert logprobs.dtype == entropy.dtype == torch.float32
    assert not [t for t in saved if t.dtype == torch.float32 and t.shape[-1] == 40]  # backward makes them again
    (logprobs.sum() + entropy.sum()).backward()
    torch.testing.assert_close(logits.grad.float(), expected_grad.float(), atol=1e-3, rtol=1e-2)  # bfloat16, summed in another order
    with torch.no_grad():
        torch.testing.assert_close(token_logprobs(logits, targets, 0.7), expected[0])


def test_entropy_is_finite_where_a_logit_is_minus_infinity() -> None:
    """A model that masks its vocabulary's padding rows to -inf gave p * log p = 0 * -inf, NaN:
    with an entropy bonus, every step's loss, and the trainer failed after three skipped steps."""
    logits = torch.tensor([[[0.0, 1.0, -float("inf")]]], requires_grad=True)
    entropy = token_entropy(logits, temperature=0.7)
    p = torch.softmax(torch.tensor([0.0, 1.0]) / 0.7, dim=-1)
    assert entropy.item() == pytest.approx(-(p * p.log()).sum().item(), abs=1e-6)
    entropy.sum().backward()
    assert torch.isfinite(logits.grad).all() and logits.grad[0, 0, 2] == 0
