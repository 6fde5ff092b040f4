"""Reference resets (grpo.algo.reference) against SPEC 13.6's worked example."""
import math

import pytest
import torch

from grpo.algo import kl_penalty
from grpo.algo.reference import mix_into, move_base_into_adapter_share

from test_loss import close


def two_token_policy(theta):
    """π(a0) = σ(θ), π(a1) = 1 − σ(θ): log-probs of the two tokens."""
    p = torch.sigmoid(torch.tensor(theta, dtype=torch.float64))
    return torch.stack([p.log(), (1 - p).log()])


@pytest.mark.parametrize("syncs, alpha, theta_ref, k3_a0, k3_a1, kl", [
    (0, 0.6, 0.0, 0.133887, 1.760747, 0.327813),
    (1, 0.6, 1.2, 0.008888, 0.278213, 0.040992),
    (2, 0.6, 1.68, 0.000953, 0.041856, 0.005829),
    (1, 1.0, 2.0, 0.0, 0.0, 0.0),
])
def test_spec_13_6_soft_and_hard_resets(syncs, alpha, theta_ref, k3_a0, k3_a1, kl):
    theta, ref = torch.tensor([2.0], dtype=torch.float64), torch.tensor([0.0], dtype=torch.float64)
    for _ in range(syncs):
        mix_into(ref, theta, alpha)
    close(ref, [theta_ref])
    logp, ref_logp = two_token_policy(2.0), two_token_policy(ref.item())
    k3 = kl_penalty(logp, ref_logp, "k3")
    close(k3, [k3_a0, k3_a1])
    close((logp.exp() * k3).sum(), kl)  # π-weighted k3 is the exact KL(π‖π_ref)
    exact = (logp.exp() * (logp - ref_logp)).sum()
    close(exact, kl)


def test_lora_reset_mixes_the_merged_update_and_keeps_the_policy():
    base, b, a, s = torch.tensor([[0.5]]), torch.tensor([[2.0]]), torch.tensor([[3.0]]), 1.0
    policy = base + s * b @ a  # 6.5: the reference (base) is 0.5
    move_base_into_adapter_share(base, b, s * b @ a, 0.6)
    close(base, [[0.6 * 6.5 + 0.4 * 0.5]])          # 4.1: α·policy + (1 − α)·reference
    close(base + s * b @ a, policy)                   # the policy is unchanged (B scaled to 0.8)
    # mixing the factors instead would not be a mix of the weights: SPEC's (1.4)(2.2) = 3.08 against 3.8
    assert (0.6 * 2 + 0.4 * 0.5) * (0.6 * 3 + 0.4 * 1) == pytest.approx(3.08)
    assert 0.6 * 6 + 0.4 * 0.5 == pytest.approx(3.8)


def test_hard_reset_copies_exactly_and_bad_alpha():
    ref, pol = torch.zeros(3), torch.tensor([1.0, math.pi, -2.5])
    mix_into(ref, pol, 1.0)
    assert torch.equal(ref, pol)
    with pytest.raises(ValueError, match=r"alpha must be in \(0, 1\]"):
        mix_into(ref, pol, 0.0)
