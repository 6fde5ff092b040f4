"""The sampler–trainer correction against SPEC 13.1's worked example (numbers recomputed by hand there)."""
import math

import pytest
import torch

from grpo.algo import policy_loss, sampler_weights

from algo_specs import loss_spec

def spec(mode="token_tis", cap=2.0, floor=0.0, beta=0.0):
    """μ = 1, DAPO token mean, β = 0 unless given, and the correction's mode, C and C_min."""
    return loss_spec(beta=beta, aggregation="token_mean", sampler_correction=mode, sampler_correction_cap=cap,
                     sampler_correction_floor=floor)


OLD = torch.tensor([[-1.20, -0.40, -2.00], [-0.70, -1.50, 0.0]], dtype=torch.float64)
SMP = torch.tensor([[-1.25, -0.38, -3.10], [-0.60, -1.45, 0.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
ADV = torch.tensor([0.866025, -0.866025], dtype=torch.float64)


def _loss_and_grad(mode: str, cap: float):
    """μ = 1 (ratio 1), DAPO token mean over N = 5 tokens, β = 0: ∂L/∂ℓ = −Â·w/N."""
    w, _ = sampler_weights(OLD, SMP, MASK, spec(mode, cap))
    logp = OLD.clone().requires_grad_(True)
    loss, _ = policy_loss(logp, logp.detach(), ADV, MASK, spec(), is_weight=w)
    loss.backward()
    return loss.item(), logp.grad[MASK.bool()].tolist()


@pytest.mark.parametrize("mode,cap,grads,loss", [
    ("none", 2.0, [-0.173205] * 3 + [0.173205] * 2, -0.173205),
    ("token_tis", 2.0, [-0.182085, -0.169775, -0.346410, 0.156722, 0.164758], -0.376791),
    ("token_mis", 2.0, [-0.182085, -0.169775, 0.0, 0.156722, 0.164758], -0.030381),
    ("seq_tis", 3.0, [-0.519615] * 3 + [0.149079] * 2, -1.260688),
    ("seq_mis", 3.0, [0.0] * 3 + [0.149079] * 2, 0.298158),
])
def test_spec_worked_example(mode, cap, grads, loss):
    got_loss, got_grads = _loss_and_grad(mode, cap)
    assert got_loss == pytest.approx(loss, abs=2e-6)
    assert got_grads == pytest.approx(grads, abs=2e-6)


def test_token_weights_and_figures():
    w, s = sampler_weights(OLD, SMP, MASK, spec("token_tis", 2.0))
    assert w[MASK.bool()].tolist() == pytest.approx([1.051271, 0.980199, 2.0, 0.904837, 0.951229], abs=1e-6)
    assert w[1, 2] == 0  # padding
    n = s["tokens"].item()
    assert n == 5
    assert s["abs_diff"].item() / n == pytest.approx(0.264, abs=1e-6)
    assert s["abs_diff_max"].item() == pytest.approx(1.1, abs=1e-6)
    assert s["k3"].item() / n == pytest.approx(0.182341, abs=1e-6)
    assert s["capped"].item() / n == pytest.approx(0.2)
    w, s = sampler_weights(OLD, SMP, MASK, spec("token_mis", 2.0))
    assert w[0, 2] == 0 and s["capped"].item() == 1


def test_sequence_ratio_is_the_product_and_never_overflows():
    w, _ = sampler_weights(OLD, SMP, MASK, spec("seq_tis", 100.0))
    assert w[0, 0].item() == pytest.approx(math.exp(1.13), abs=1e-6)  # 3.095657
    assert w[1, 0].item() == pytest.approx(math.exp(-0.15), abs=1e-6)  # 0.860708
    long_old = torch.zeros(1, 4000)
    long_smp = torch.full((1, 4000), -1.0)  # log ρ_i = 4000: e^4000 overflows, the weight must not
    w, _ = sampler_weights(long_old, long_smp, torch.ones(1, 4000), spec("seq_tis", 2.0))
    assert torch.isfinite(w).all() and w.max().item() == pytest.approx(2.0)
    w, _ = sampler_weights(long_old, long_smp, torch.ones(1, 4000), spec("seq_mis", 2.0))
    assert (w == 0).all()


def test_floor_raises_small_truncated_weights():
    w, s = sampler_weights(OLD, SMP, MASK, spec("token_tis", 2.0, 0.95))
    assert w[1, 0].item() == pytest.approx(0.95) and w[1, 1].item() == pytest.approx(0.951229, abs=1e-6)
    assert w[0, 2].item() == pytest.approx(2.0) and s["capped"].item() == 2


def test_floor_masks_small_ratios():
    w, s = sampler_weights(OLD, SMP, MASK, spec("token_mis", 2.0, 0.95))
    # ρ(2,1) = 0.904837 < 0.95 is masked, ρ(2,2) = 0.951229 is kept, ρ(1,3) > 2 is masked
    assert w[1, 0] == 0 and w[1, 1] > 0 and w[0, 2] == 0 and s["capped"].item() == 2


def test_equal_logprobs_give_weight_one_and_zero_figures():
    w, s = sampler_weights(OLD, OLD.clone(), MASK, spec("token_tis", 2.0))
    assert torch.equal(w, MASK.to(w.dtype))
    assert s["abs_diff"].item() == 0 and s["k3"].item() == 0 and s["capped"].item() == 0


def test_weight_multiplies_the_policy_term_only():
    """With β > 0 the KL term is unchanged by the weights (SPEC 13.1: after clipping, never on the KL)."""
    ref = OLD - 0.1
    w = torch.zeros_like(OLD)
    _, stats = policy_loss(OLD.clone(), OLD, ADV, MASK, spec(beta=0.04), ref_logp=ref, is_weight=w)
    assert stats["loss/policy"].item() == 0
    _, plain = policy_loss(OLD.clone(), OLD, ADV, MASK, spec(beta=0.04), ref_logp=ref)
    assert stats["loss/kl"].item() == pytest.approx(plain["loss/kl"].item())


@pytest.mark.parametrize("kwargs,match", [({"mode": "tis"}, "sampler_correction='tis' is not allowed"),
                                          ({"cap": 0.0}, "sampler_correction_cap must be > 0"),
                                          ({"floor": 3.0}, "sampler_correction_floor must be in")])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):  # the spec refuses them when it is built
        sampler_weights(OLD, SMP, MASK, spec(**kwargs))
