"""Dual clip, CISPO and SAPO in `policy_loss` against the hand-computed numbers of SPEC 13.2-13.4 (to 1e-6)."""
import math

import pytest
import torch

from grpo.algo import policy_loss

from algo_specs import loss_spec
from test_loss import S3, close, spec_batch

TOKENS = [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)]  # (1,1), (1,2), (2,1), (2,2), (2,3) of SPEC 7.2


def one_token(r, adv, **algo):
    logp = torch.tensor([[math.log(r)]], dtype=torch.float64, requires_grad=True)
    loss, stats = policy_loss(logp, torch.zeros(1, 1, dtype=torch.float64), torch.tensor([adv], dtype=torch.float64),
                              torch.ones(1, 1), loss_spec(beta=0.0, aggregation="token_mean", **algo))
    return loss, torch.autograd.grad(loss, logp)[0].item(), stats


# SPEC 13.2: r, Â, PPO loss and ∂L/∂ℓ, dual-clip (c = 3) loss and ∂L/∂ℓ
DUAL = [(0.5, -S3, 0.692820, 0.0, 0.692820, 0.0),
        (2.0, -S3, 1.732051, 1.732051, 1.732051, 1.732051),
        (math.exp(1.5), -S3, 3.881257, 3.881257, 2.598076, 0.0),
        (math.exp(1.5), S3, -1.039230, 0.0, -1.039230, 0.0)]


@pytest.mark.parametrize("r, adv, ppo, ppo_grad, dual, dual_grad", DUAL)
def test_dual_clip_spec_13_2(r, adv, ppo, ppo_grad, dual, dual_grad):
    loss, grad, stats = one_token(r, adv)
    close(loss, ppo), close(grad, ppo_grad)
    loss, grad, stats = one_token(r, adv, dual_clip=3.0)
    close(loss, dual), close(grad, dual_grad)
    assert stats["clip/dual_frac"].item() == (1.0 if adv < 0 and r > 3 else 0.0)


def grads_and_loss(**algo):
    logp, old, _, mask, adv = spec_batch()
    loss, stats = policy_loss(logp, old, adv, mask, loss_spec(beta=0.0, **algo))
    g = torch.autograd.grad(loss, logp)[0]
    return loss, [g[i, t].item() for i, t in TOKENS], stats


@pytest.mark.parametrize("low, high, total, grads", [
    # verl's default, relative and two-sided: [0.8, 1.2]
    (0.2, 0.2, -0.303945, [-0.191421, -0.207846, 0.138564, 0.207846, 0.173205]),
    # TRL's absolute cap 5, no lower bound (clip_low = 1: the weight is never raised)
    (1.0, 4.0, -0.271578, [-0.191421, -0.233802, 0.128313, 0.211553, 0.173205]),
    # verl's example script: no lower bound, cap 1.2
    (1.0, 0.2, -0.283444, [-0.191421, -0.207846, 0.128313, 0.207846, 0.173205]),
])
def test_cispo_spec_13_3(low, high, total, grads):
    loss, g, stats = grads_and_loss(surrogate="cispo", clip_low=low, clip_high=high, aggregation="token_mean")
    close(loss, total)
    close(g, grads)
    # the truncated weights, whatever the sign of Â: (1,2) above the cap, and (2,1) below 0.8 when bounded, (2,2)
    # above 1.2
    truncated = sum([1.349859 > 1 + high, 0.740818 < 1 - low, 1.221403 > 1 + high])
    close(stats["clip/frac"], truncated / 5)


def test_cispo_keeps_the_gradient_ppo_clip_zeroes():
    _, ppo, _ = grads_and_loss(aggregation="token_mean")
    _, cispo, _ = grads_and_loss(surrogate="cispo", aggregation="token_mean")
    assert ppo[1] == 0 and ppo[2] == 0 and cispo[1] != 0 and cispo[2] != 0  # tokens (1,2) and (2,1)


def test_sapo_spec_13_4():
    loss, g, stats = grads_and_loss(surrogate="sapo", sapo_tau_pos=1.0, sapo_tau_neg=1.05, aggregation="seq_mean")
    close(loss, -0.144339)
    close(g, [-0.238616, -0.283489, 0.104972, 0.173934, 0.144338])
    assert stats["clip/frac"].item() == 0.0  # no clip binds


def test_sapo_at_ratio_one_has_the_grpo_gradient():
    logp, _, _, mask, adv = spec_batch()
    on_policy = logp.detach()
    sapo, _ = policy_loss(logp, on_policy, adv, mask, loss_spec(beta=0.0, surrogate="sapo"))
    grpo, _ = policy_loss(logp, on_policy, adv, mask, loss_spec(beta=0.0))
    close(torch.autograd.grad(sapo, logp)[0], torch.autograd.grad(grpo, logp)[0])
    close(sapo, -(2 / 1.0 * S3 - 2 / 1.05 * S3) / 2)  # the value is −2Â/τ per token, not 0


@pytest.mark.parametrize("algo, message", [
    (dict(surrogate="ppo"), "surrogate"),
    (dict(surrogate="cispo", dual_clip=3.0), "dual_clip bounds PPO's clipped surrogate"),
    (dict(surrogate="sapo", sapo_tau_neg=0.0), "sapo_tau_pos and sapo_tau_neg must be > 0"),
])
def test_bad_surrogate_arguments(algo, message):
    logp, old, _, mask, adv = spec_batch()
    with pytest.raises(ValueError, match=message):  # the spec refuses them when it is built
        policy_loss(logp, old, adv, mask, loss_spec(beta=0.0, **algo))
