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


# ---- DPPO (SPEC 14.2): anchor π_beh as old_logp, token mean over N = 5, two sequences of 3 and 2 tokens
DPPO_Q = [[0.01, 0.80, 0.40], [0.05, 0.50, 1.0]]    # the anchor's probabilities (the last one is padding)
DPPO_P = [[0.02, 0.955, 0.42], [0.03, 0.32, 1.0]]   # the policy's
DPPO_GRADS = [-0.346410, 0.0, -0.181865, 0.103923, 0.0]  # ∂𝓛/∂ℓ, TV (δ 0.15) and KL (δ 0.05) alike


def dppo(surrogate, dtype=torch.float64, **algo):
    logp = torch.tensor(DPPO_P, dtype=dtype).log().requires_grad_(True)
    old = torch.tensor(DPPO_Q, dtype=dtype).log()
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv = torch.tensor([S3, -S3], dtype=dtype)
    loss, stats = policy_loss(logp, old, adv, mask, loss_spec(beta=0.0, aggregation="token_mean",
                                                              surrogate=surrogate, **algo))
    g = torch.autograd.grad(loss, logp)[0]
    return loss, [g[i, t].item() for i, t in [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]], stats


@pytest.mark.parametrize("surrogate, knobs", [("dppo_tv", {"dppo_tv_low": 0.15, "dppo_tv_high": 0.15}),
                                              ("dppo_kl", {"dppo_kl_low": 0.05, "dppo_kl_high": 0.05})])
@pytest.mark.parametrize("cap", [0.0, 3.0])  # no r_a exceeds 2: C = 3 and no cap give the same numbers
def test_dppo_spec_14_2(surrogate, knobs, cap):
    loss, g, stats = dppo(surrogate, dppo_cap=cap, **knobs)
    close(loss, 1.148521)  # verl's form: it multiplies ℓ, so its value is no progress signal
    close(g, DPPO_GRADS)
    # the masked tokens: (1,2) rose with Â > 0 ("high"), (2,2) fell with Â < 0 ("low")
    close(stats["clip/high_frac"], 1 / 5), close(stats["clip/low_frac"], 1 / 5), close(stats["clip/frac"], 2 / 5)


def test_dppo_tv_at_the_default_delta_keeps_every_token():
    # δ_TV = 0.2 (prime-rl's, our default): |p − q| = 0.155 and 0.18 stay inside, so nothing is masked
    _, g, stats = dppo("dppo_tv")
    close(g, [-0.346410, -0.206764, -0.181865, 0.103923, 0.110851])
    assert stats["clip/frac"].item() == 0.0


def test_dppo_cap_truncates_the_weight_not_the_mask():
    # C = 1.5: token (1,1), r_a = 2, gets weight 1.5 instead of 2
    _, g, _ = dppo("dppo_tv", dppo_cap=1.5)
    close(g[0], -S3 * 1.5 / 5)


@pytest.mark.parametrize("adv, masked", [(S3, True), (-S3, False)])
def test_dppo_kl_is_finite_where_p_rounds_to_one(adv, masked):
    # SPEC 14.2's edge case in float32: q = 0.5, p = 1.0 (ℓ = 0) gives D_KL = 8.517193, finite (verl's placement of
    # 1e-8); p > q, so the token is masked when Â > 0 and kept when Â < 0
    logp = torch.zeros(1, 1, dtype=torch.float32, requires_grad=True)
    old = torch.tensor([[math.log(0.5)]], dtype=torch.float32)
    loss, stats = policy_loss(logp, old, torch.tensor([adv]), torch.ones(1, 1),
                              loss_spec(beta=0.0, surrogate="dppo_kl", aggregation="token_mean"))
    grad = torch.autograd.grad(loss, logp)[0].item()
    assert math.isfinite(loss.item()) and math.isfinite(grad)
    assert (grad == 0.0) == masked and stats["clip/frac"].item() == float(masked)
    from grpo.algo.surrogates import _probabilities
    p, q, anchor = _probabilities(torch.exp(logp - old), logp)
    d = q * (anchor - logp.detach()) + (1 - q) * torch.log((1 - q + 1e-8) / (1 - p + 1e-8))
    assert abs(d.item() - 8.517193) < 1e-5


def test_dppo_needs_token_ratios():
    with pytest.raises(ValueError, match="surrogate='dppo_tv' masks tokens by their own probabilities; it needs "
                                         "ratio_level='token'"):
        loss_spec(surrogate="dppo_tv", ratio_level="sequence")
