"""SPEC 14.5 and 14.7 pinned to their worked numbers: DeepSeek-V3.2's off-policy sequence masking (OPSM), the unbiased
KL r·k3 (and its behaviour-weighted form), and the entropy bonus with TRL's adaptive coefficient."""
import math

import pytest
import torch

from grpo.algo import applied_entropy_coef, entropy_bonus, next_entropy_coef, policy_loss
from grpo.algo.loss import off_policy_sequence_mask

from algo_specs import loss_spec


def close(a, b, tol=1e-6):
    a = torch.as_tensor(a, dtype=torch.float64)
    assert torch.allclose(a, torch.as_tensor(b, dtype=torch.float64), atol=tol), (a, b)


A = -0.866025


# ---- OPSM (SPEC 14.5)

def opsm_batch():
    pad = 0.0
    logp = torch.tensor([[-1.5, -0.9, -0.3], [-0.8, -1.3, pad]], dtype=torch.float64, requires_grad=True)
    behaviour = torch.tensor([[-0.2, -0.4, -0.1], [-0.6, -1.0, 5.0]], dtype=torch.float64)  # garbage on padding
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    return logp, behaviour, mask


def test_opsm_spec_worked_example():
    logp, behaviour, mask = opsm_batch()
    kept = off_policy_sequence_mask(logp, behaviour, torch.tensor([A, A]), mask, 0.5)
    assert kept.tolist() == [[False] * 3, [True] * 3]  # sequence 1: mean 0.666667 > 0.5; sequence 2: 0.25
    kept = off_policy_sequence_mask(logp, behaviour, torch.tensor([0.0, A]), mask, 0.5)
    assert kept[0].all()  # Â ≥ 0 is never masked
    assert off_policy_sequence_mask(logp, behaviour, torch.tensor([A, A]), mask, 2 / 3 + 1e-9)[0].all()  # strict >


def test_opsm_drops_the_policy_term_only_and_keeps_the_tokens_in_the_normaliser():
    logp, behaviour, mask = opsm_batch()
    adv = torch.tensor([A, A], dtype=torch.float64)
    ref = logp.detach() - 0.3
    spec = loss_spec(beta=0.04, aggregation="token_mean", off_policy_mask_threshold=0.5)
    loss, stats = policy_loss(logp, logp.detach(), adv, mask, spec, ref_logp=ref, behaviour_logp=behaviour)
    grad = torch.autograd.grad(loss, logp)[0]
    k3_grad = 0.04 * (1 - math.exp(-0.3)) / 5  # ∂(β·k3)/∂ℓ with ℓ_ref − ℓ = −0.3, N = 5 tokens
    close(grad[0], [k3_grad] * 3)  # masked: the KL gradient alone
    close(grad[1, :2], [-A / 5 + k3_grad] * 2)  # kept: −Â/N (r = 1) plus the KL's
    close(stats["opsm/masked_frac"], 3 / 5)
    # without the sampler's log-probs the old policy stands in: with μ = 1 (old = sg ℓ) OPSM never fires
    _, stats = policy_loss(logp, logp.detach(), adv, mask, spec, ref_logp=ref)
    assert stats["opsm/masked_frac"] == 0


# ---- unbiased KL (SPEC 14.5): the §6 categorical, π_θ = (0.506480, 0.307196, 0.186324), π_ref = (0.2, 0.5, 0.3),
# samples from a uniform π_old

PI = torch.tensor([0.506480, 0.307196, 0.186324], dtype=torch.float64)
REF = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
UNIFORM = torch.full((3,), 1 / 3, dtype=torch.float64)


def expected_kl(unbiased: str, old: torch.Tensor, w: torch.Tensor | None = None):
    """E over a ~ π_beh = uniform of the loss β = 1, Â = 0, one token, and its expected gradient in the logits."""
    z = PI.log().clone().requires_grad_()
    total = 0
    for a in range(3):
        lp = torch.log_softmax(z, 0)[a].view(1, 1)
        o = old[a].view(1, 1) if old is not None else lp.detach()
        loss, _ = policy_loss(lp, o, torch.zeros(1, dtype=torch.float64), torch.ones(1, 1), loss_spec(
            beta=1.0, unbiased_kl=unbiased), ref_logp=REF[a].log().view(1, 1), normalizer=1.0,
            is_weight=w[a].view(1, 1) if w is not None else None)
        total = total + loss / 3
    return total.item(), torch.autograd.grad(total, z)[0]


def test_unbiased_kl_spec_values_and_gradients():
    value, grad = expected_kl("off", UNIFORM.log())
    close(value, 0.199453), close(grad, [0.308507, -0.144430, -0.164077])  # plain k3: biased, neither KL's
    value, grad = expected_kl("prox", UNIFORM.log())
    close(value, 0.232218), close(grad, [0.352992, -0.220978, -0.132013])  # = KL(π_θ‖π_ref) and its gradient
    # on-policy r·k3 (value 1, gradient ∇ℓ) also gives the reverse-KL gradient: enumerate under π_θ
    z = PI.log().clone().requires_grad_()
    total = sum(PI[a] * policy_loss(torch.log_softmax(z, 0)[a].view(1, 1), torch.log_softmax(z, 0)[a].detach().view(1, 1),
                                    torch.zeros(1), torch.ones(1, 1), loss_spec(beta=1.0, unbiased_kl="prox"),
                                    ref_logp=REF[a].log().view(1, 1), normalizer=1.0)[0] for a in range(3))
    close(torch.autograd.grad(total, z)[0], [0.352992, -0.220978, -0.132013])


def test_unbiased_kl_one_sample():
    lp = PI[0].log().view(1, 1).clone().requires_grad_()
    args = dict(ref_logp=REF[0].log().view(1, 1), normalizer=1.0)
    for unbiased, value, slope in (("off", 0.324050, 0.605118), ("prox", 0.492375, 1.411816)):
        loss, stats = policy_loss(lp, UNIFORM[:1].log().view(1, 1), torch.zeros(1), torch.ones(1, 1),
                                  loss_spec(beta=1.0, unbiased_kl=unbiased), **args)
        close(loss, value), close(torch.autograd.grad(loss, lp)[0], [[slope]])
        close(stats["loss/kl"], value)


def test_behaviour_weighted_kl_corrects_a_stale_sampler():
    # one optimiser step (old = sg ℓ, so r has value 1); the data come from a uniform sampler: only sg(w)·r·k3,
    # w = π_prox/π_beh under the cap C = 2, gives KL(π_θ‖π_ref) and its gradient
    w = PI / UNIFORM
    close(w, [1.519441, 0.921588, 0.558971])
    value, grad = expected_kl("prox", None)
    close(value, 0.199453)
    value, grad = expected_kl("behaviour", None, w)
    close(value, 0.232218), close(grad, [0.352992, -0.220978, -0.132013])


def test_unbiased_kl_needs_a_kl_term():
    with pytest.raises(ValueError, match="unbiased_kl='prox' corrects the KL term, and beta=0 has none"):
        loss_spec(beta=0.0, unbiased_kl="prox")


# ---- entropy bonus (SPEC 14.7)

def test_entropy_bonus_value_spec_worked_example():
    h = torch.tensor([[0.10, 2.30, 0.0], [0.05, 1.20, 0.40]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    close(entropy_bonus(h, mask, 0.01, 5), -0.0081)
    # two micro-batches with the step's N add up to the whole
    close(entropy_bonus(h[:1], mask[:1], 0.01, 5) + entropy_bonus(h[1:], mask[1:], 0.01, 5), -0.0081)
    assert entropy_bonus(h, mask, 0.0, 5) == 0


def test_entropy_bonus_gradient_spec_worked_example():
    from grpo.algo import token_logprobs
    logits = torch.tensor([[[0.75, 0.70, -0.15, -1.00]]], dtype=torch.float64, requires_grad=True)
    _, h = token_logprobs(logits, torch.tensor([[1]]), chunk_size=1, entropy=True)
    close(h, [[1.212293]])
    bonus = entropy_bonus(h, torch.ones(1, 1), 0.01, 5)  # c = 0.01, ν = 1/5
    close(torch.autograd.grad(bonus, logits)[0].flatten(), [0.000224, 0.000175, -0.000198, -0.000201])


def test_adaptive_entropy_coefficient_follows_trls_order():
    spec = loss_spec(use_adaptive_entropy=True, entropy_coef=0.0)
    coef, last, applied = spec.entropy_coef, math.inf, []
    for h in (0.5, 0.1, 0.15, 0.3, 0.0):  # the fifth step's entropy is never used
        applied.append(applied_entropy_coef(coef, last, spec))
        coef, last = next_entropy_coef(coef, h, spec), h
    close(applied, [0, 0, 0.005, 0.010, 0])
    fixed = loss_spec(entropy_coef=0.03)
    assert applied_entropy_coef(0.0, math.inf, fixed) == 0.03  # a fixed c applies from the first step
    top = loss_spec(use_adaptive_entropy=True, entropy_coef_max=0.007)
    assert next_entropy_coef(0.005, 0.1, top) == 0.007 and next_entropy_coef(0.002, 3.0, top) == 0.0


# ---- several optimiser steps per rollout (SPEC 14.8)

def test_the_second_mini_batch_is_clipped_around_the_sampling_weights():
    # mini-batch 2 = {c (Â > 0), d (Â < 0)} at θ_vprox+1 against π_old at θ_vprox; grpo aggregation within the
    # step: weights 1/4 (c) and 1/6 (d), ε = 0.2, β = 0
    a = math.sqrt(3) / 2
    old = torch.tensor([[-0.70, -1.60, 0.0], [-0.90, -2.00, -0.30]], dtype=torch.float64)
    logp = torch.tensor([[-0.40, -1.50, 0.0], [-1.20, -1.90, -0.35]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    adv = torch.tensor([a, -a], dtype=torch.float64)
    loss, stats = policy_loss(logp, old, adv, mask, loss_spec(beta=0.0))
    close(loss, -0.086798)
    (g,) = torch.autograd.grad(loss, logp)
    close(g[mask.bool()], [0, -0.239277, 0, 0.159518, 0.137298])  # c1 and d1 clipped
    close(stats["ratio/mean"], (1.349859 + 1.105171 + 0.740818 + 1.105171 + 0.951229) / 5)
    # the bug: ℓ_old := sg ℓ, r ≡ 1, no clip: 0 loss and every token pushed
    loss, _ = policy_loss(logp, logp.detach(), adv, mask, loss_spec(beta=0.0))
    close(loss, 0)
    close(torch.autograd.grad(loss, logp)[0][mask.bool()], [-0.216506, -0.216506, 0.144338, 0.144338, 0.144338])
