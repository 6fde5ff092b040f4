"""Decoupled PPO for stale rollouts (SPEC 14.1, our choices 14.13): the ratio is clipped around the trainer's
recompute π_prox and the sampler weight compares π_prox with the engine's π_beh, whatever version sampled; the
coupled form clips around π_beh with no weight. SPEC's worked example pins both, values and gradients; at η = 0
the decoupled loss is §13.1's, bit for bit."""
import math

import pytest
import torch

from algo_specs import loss_spec
from grpo.algo import policy_loss, proximal_terms, sampler_weights

A = math.sqrt(3) / 2
# SPEC 14.1: sequence 1 (η = 2, Â = +√3/2) has three tokens, sequence 2 (η = 1, Â = −√3/2) two; ℓ at the batch's
# second optimiser update (m = 2), so r ≠ 1
BEH = [[-1.20, -2.30, -0.50], [-0.80, -1.60, 0.0]]
PROX = [[-1.00, -1.20, -0.55], [-0.90, -1.50, 0.0]]
CUR = [[-0.90, -1.10, -0.30], [-1.20, -1.40, 0.0]]
MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]


def _loss(proximal: str):
    spec = loss_spec(beta=0.0, clip_low=0.2, clip_high=0.2, aggregation="token_mean", surrogate="clip",
                     sampler_correction="token_tis", sampler_correction_cap=2.0, proximal=proximal)
    logp = torch.tensor(CUR, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor(MASK, dtype=torch.float64)
    old, weight, figures = proximal_terms(torch.tensor(PROX, dtype=torch.float64),
                                          torch.tensor(BEH, dtype=torch.float64), mask, spec)
    loss, _ = policy_loss(logp, old, torch.tensor([A, -A], dtype=torch.float64), mask, spec, is_weight=weight,
                          normalizer=5.0)
    loss.backward()
    grad = logp.grad[mask.bool()].tolist()
    return loss.item(), grad, weight, figures


def test_the_decoupled_loss_has_spec_14_1s_numbers():
    loss, grad, weight, figures = _loss("recompute")
    assert loss == pytest.approx(-0.477423, abs=1e-6)
    assert grad == pytest.approx([-0.233802, -0.382842, 0.0, 0.0, 0.211553], abs=1e-6)
    # w = exp(ℓ_prox − ℓ_beh), token (1,2) capped at C = 2
    assert weight[mask_bool()].tolist() == pytest.approx([1.221403, 2.0, 0.951229, 0.904837, 1.105171], abs=1e-6)
    # the staleness figures of 14.13: mean |log w| 0.31 and one token in five at the cap, before capping
    assert (figures["abs_diff"] / 5).item() == pytest.approx(0.31, abs=1e-6)
    assert figures["capped"].item() == 1


def test_the_coupled_loss_clips_around_the_behaviour_policy_and_has_no_weight():
    loss, grad, weight, figures = _loss("behaviour")
    assert weight is None
    assert loss == pytest.approx(-0.273421, abs=1e-6)
    # tokens (1,1) and (1,2) are frozen by the clip around π_beh, two versions behind; only (2,2) learns
    assert grad == pytest.approx([0.0, 0.0, 0.0, 0.0, 0.211553], abs=1e-6)
    assert figures is not None  # the mismatch is still measured


def test_at_eta_0_the_decoupled_loss_is_the_sampler_correction_of_13_1_bit_for_bit():
    """With the sampler holding π_prox's weights, ℓ_beh is ℓ_smp: the loss is what the synchronous loop computed
    before proximal_terms existed (the ratio to ℓ_old, the weight sampler_weights(ℓ_old, ℓ_smp))."""
    torch.manual_seed(0)
    logp = (torch.randn(4, 6, dtype=torch.float64) - 1).requires_grad_()
    old = logp.detach() + 0.05 * torch.randn(4, 6, dtype=torch.float64)
    smp = old + 0.3 * torch.randn(4, 6, dtype=torch.float64)
    mask = (torch.rand(4, 6) > 0.2).double()
    adv = torch.randn(4, dtype=torch.float64)
    spec = loss_spec(beta=0.0)
    p_old, weight, _ = proximal_terms(old, smp, mask, spec)
    mine, _ = policy_loss(logp, p_old, adv, mask, spec, is_weight=weight)
    before, _ = policy_loss(logp, old, adv, mask, spec, is_weight=sampler_weights(old, smp, mask, spec)[0])
    assert torch.equal(mine, before)
    # and without sampler log-probs (the in-process generator) there is no weight at all
    assert proximal_terms(old, None, mask, spec)[1:] == (None, None)


def mask_bool():
    return torch.tensor(MASK).bool()
