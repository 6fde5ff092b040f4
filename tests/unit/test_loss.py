"""policy_loss and kl_penalty against SPEC 7.2 and STYLE 8.5 (hand-computed numbers, to 1e-6)."""
import math
from dataclasses import replace

import pytest
import torch

from grpo.algo import PRESETS, get_preset, kl_penalty, loss_normalizer, policy_loss, preset_values

from algo_specs import loss_spec

S3 = math.sqrt(3) / 2


def spec_batch():
    """SPEC 7.2: two sequences of lengths 2 and 3 (padded to 3), β = 0.04, ε = 0.2."""
    logp = torch.tensor([[-1.0, -0.5, 0.0], [-2.0, -0.3, -1.5]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.1, -0.8, 0.0], [-1.7, -0.5, -1.5]], dtype=torch.float64)
    ref = torch.tensor([[-1.2, -0.4, 0.0], [-2.1, -0.2, -1.6]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    adv = torch.tensor([S3, -S3], dtype=torch.float64)
    return logp, old, ref, mask, adv


def close(a, b, tol=1e-6):
    a = torch.as_tensor(a, dtype=torch.float64)
    assert torch.allclose(a, torch.as_tensor(b, dtype=torch.float64), atol=tol, rtol=0), (a, b)


# (aggregation, loss, policy part, KL part, per-token gradients (1,1),(1,2),(2,1),(2,2),(2,3))
SPEC_72 = [
    ("seq_mean", -0.062644, -0.062982, 0.000338, [-0.237464, -0.001052, 0.000634, 0.175593, 0.144972]),
    ("token_mean", 0.124365, 0.124055, 0.000310, [-0.189971, -0.000841, 0.000761, 0.210712, 0.173966]),
    ("constant", 0.077728, 0.077534, 0.000194, [-0.118732, -0.000526, 0.000476, 0.131695, 0.108729]),
]


@pytest.mark.parametrize("aggregation, total, policy, kl, grads", SPEC_72)
def test_spec_72_loss_parts_and_gradients(aggregation, total, policy, kl, grads):
    logp, old, ref, mask, adv = spec_batch()
    loss, stats = policy_loss(logp, old, adv, mask, loss_spec(4, beta=0.04, aggregation=aggregation), ref_logp=ref)
    close(loss, total)
    close(stats["loss/policy"], policy)
    close(stats["loss/kl"], kl)
    (g,) = torch.autograd.grad(loss, logp)
    close(g[mask.bool()], grads)
    assert torch.equal(g[~mask.bool()], torch.zeros(1, dtype=torch.float64))


def test_spec_72_per_token_table():
    # k3 column and the clip stats of the table: (1,2) clipped high, (2,1) clipped low
    logp, old, ref, mask, adv = spec_batch()
    k3 = kl_penalty(logp.detach(), ref, "k3")
    close(k3[mask.bool()], [0.018731, 0.005171, 0.004837, 0.005171, 0.004837])
    close(kl_penalty(logp.detach(), ref, "k1")[mask.bool()], [0.2, -0.1, 0.1, -0.1, 0.1])
    close(kl_penalty(logp.detach(), ref, "k2")[mask.bool()], [0.02, 0.005, 0.005, 0.005, 0.005])
    _, stats = policy_loss(logp, old, adv, mask, loss_spec(beta=0.04), ref_logp=ref)
    close(stats["clip/high_frac"], 1 / 5)
    close(stats["clip/low_frac"], 1 / 5)
    close(stats["clip/frac"], 2 / 5)
    close(stats["ratio/mean"], (1.105171 + 1.349859 + 0.740818 + 1.221403 + 1.0) / 5)
    close(stats["kl"], (0.018731 + 0.005171 + 0.004837 + 0.005171 + 0.004837) / 5)
    assert stats["tokens"].item() == 5


def test_bnpo_vs_dapo_split_micro_batches():
    # SPEC 7.2: each sequence its own micro-batch; the step-wide token normaliser (5) keeps the DAPO value,
    # a per-micro-batch one collapses to grpo's value.
    logp, old, ref, mask, adv = spec_batch()
    parts = [(slice(0, 1)), (slice(1, 2))]
    spec = loss_spec(beta=0.04, aggregation="token_mean")
    dapo = sum(policy_loss(logp[s], old[s], adv[s], mask[s], spec, ref_logp=ref[s], normalizer=5.0)[0] for s in parts)
    bnpo = sum(policy_loss(logp[s], old[s], adv[s], mask[s], spec, ref_logp=ref[s])[0] for s in parts) / 2
    close(dapo, 0.124365)
    close(bnpo, -0.062644)


@pytest.mark.parametrize("aggregation, total, policy", [
    ("seq_mean", 0.000338, 0.0), ("token_mean", 0.173515, 0.173205), ("constant", 0.108447, 0.108253)])
def test_spec_72_mu_equals_one(aggregation, total, policy):
    logp, _, ref, mask, adv = spec_batch()
    loss, stats = policy_loss(logp, logp.detach(), adv, mask, loss_spec(4, beta=0.04, aggregation=aggregation),
                              ref_logp=ref)
    close(loss, total)
    close(stats["loss/policy"], policy)
    close(stats["ratio/mean"], 1.0)
    # μ = 1: the gradient is REINFORCE with coefficient −Â + β(1 − π_ref/π_θ) (SPEC 1.5), times the weight
    (g,) = torch.autograd.grad(loss, logp)
    w = {"seq_mean": [1 / 4, 1 / 4, 1 / 6, 1 / 6, 1 / 6], "token_mean": [1 / 5] * 5, "constant": [1 / 8] * 5}
    a = torch.tensor([S3, S3, -S3, -S3, -S3], dtype=torch.float64)
    coef = -a + 0.04 * (1 - torch.exp(ref[mask.bool()] - logp.detach()[mask.bool()]))
    close(g[mask.bool()], coef * torch.tensor(w[aggregation], dtype=torch.float64))


def test_spec_gspo_values():
    logp, old, ref, mask, adv = spec_batch()
    loss, stats = policy_loss(logp, old, adv, mask,
                              loss_spec(beta=0.04, ratio_level="sequence", clip_low=3e-4, clip_high=4e-4), ref_logp=ref)
    close(loss, 0.000035)
    (g,) = torch.autograd.grad(stats["loss/policy"] * 0 + loss, logp)
    # both sequences clipped: only the KL gradient is left, β(1 − e^(ℓref−ℓ)) × 1/(B|o_i|)
    kl_grad = 0.04 * (1 - torch.exp(ref - logp.detach())) / torch.tensor([[4.0], [6.0]], dtype=torch.float64)
    close(g[mask.bool()], kl_grad[mask.bool()])
    loss, _ = policy_loss(logp, old, adv, mask, loss_spec(beta=0.04, ratio_level="sequence"), ref_logp=ref)
    close(loss, -0.100460)


def test_gspo_gradient_is_sequence_ratio_times_mean_token_gradient():
    # SPEC 4: unclipped response i gets s_i·Â_i·(1/|o_i|)·Σ_t ∇ℓ_t (then ÷B under seq_mean)
    logp, old, _, mask, adv = spec_batch()
    loss, _ = policy_loss(logp, old, adv, mask, loss_spec(beta=0.0, ratio_level="sequence", clip_low=0.5,
                                                          clip_high=0.5))
    (g,) = torch.autograd.grad(loss, logp)
    s = torch.tensor([math.exp(0.2), math.exp(-0.1 / 3)], dtype=torch.float64)
    expect = (-s * adv / torch.tensor([2.0, 3.0], dtype=torch.float64) / 2).unsqueeze(1).expand(2, 3)
    close(g[mask.bool()], expect[mask.bool()])


def test_style_85_clip_edges():
    # ratio 1.5: Â = +1 → surrogate min(1.5, 1.2) = 1.2, loss −1.2; Â = −1 → min(−1.5, −1.2) = −1.5, loss 1.5
    logp = torch.tensor([[math.log(1.5)]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 1, dtype=torch.float64)
    one = torch.ones(1, 1)
    ppo, higher = loss_spec(beta=0.0), loss_spec(beta=0.0, clip_high=0.28)
    loss, st = policy_loss(logp, old, torch.tensor([1.0], dtype=torch.float64), one, ppo)
    close(loss, -1.2)
    assert torch.autograd.grad(loss, logp)[0].item() == 0.0 and st["clip/high_frac"].item() == 1.0
    loss, st = policy_loss(logp, old, torch.tensor([-1.0], dtype=torch.float64), one, ppo)
    close(loss, 1.5)
    close(torch.autograd.grad(loss, logp)[0], [[1.5]])
    assert st["clip/frac"].item() == 0.0
    # DAPO clip-higher: the upper edge moves to 1.28, the lower stays at 0.8
    loss, _ = policy_loss(logp, old, torch.tensor([1.0], dtype=torch.float64), one, higher)
    close(loss, -1.28)
    low = torch.tensor([[math.log(0.5)]], dtype=torch.float64, requires_grad=True)
    loss, st = policy_loss(low, old, torch.tensor([-1.0], dtype=torch.float64), one, higher)
    close(loss, 0.8)
    assert st["clip/low_frac"].item() == 1.0
    loss, _ = policy_loss(low, old, torch.tensor([1.0], dtype=torch.float64), one, higher)
    close(loss, -0.5)  # Â > 0 and r < 1 − ε: the unclipped branch, gradient flows


def test_dual_clip():
    logp = torch.tensor([[math.log(5.0)]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 1, dtype=torch.float64)
    loss, _ = policy_loss(logp, old, torch.tensor([-1.0], dtype=torch.float64), torch.ones(1, 1),
                          loss_spec(beta=0.0, dual_clip=3.0))
    close(loss, 3.0)  # min(−5, −1.2) = −5, capped at 3·Â = −3
    assert torch.autograd.grad(loss, logp)[0].item() == 0.0


def test_style_85_aggregation_one_fixture_three_numbers():
    # per-token losses [−1, −1] and [+1] (ratio 1, β = 0): seq_mean 0, token_mean −1/3, constant −1/8
    logp = torch.zeros(2, 2, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1], [1, 0]])
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    got = {agg: policy_loss(logp, logp.detach(), adv, mask, loss_spec(4, beta=0.0, aggregation=agg))[0].item()
           for agg in ("seq_mean", "token_mean", "constant")}
    close(list(got.values()), [0.0, -1 / 3, -1 / 8])


@pytest.mark.parametrize("aggregation", ["seq_mean", "token_mean", "constant"])
def test_closed_form_gradient_ratio_one(aggregation):
    # STYLE 8.5: ∂loss/∂logp = −Â/normaliser (−Â/(B·|o_i|) for seq_mean) on tokens, 0 on padding
    logp = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    adv = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
    loss, _ = policy_loss(logp, logp.detach(), adv, mask, loss_spec(5, beta=0.0, aggregation=aggregation))
    (g,) = torch.autograd.grad(loss, logp)
    lengths = mask.sum(1, keepdim=True).double()
    norm = {"seq_mean": 3 * lengths, "token_mean": 9.0, "constant": 15.0}[aggregation]
    close(g, (-adv.unsqueeze(1) / norm) * mask)


def test_k3_examples():
    logp = torch.zeros(2)
    ref = torch.tensor([math.log(0.5), 0.0])
    close(kl_penalty(logp, ref, "k3"), [0.5 - math.log(0.5) - 1, 0.0], tol=1e-7)


def test_k3_gradient_is_beta_one_minus_ratio():
    logp = torch.tensor([-1.0, -0.5], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-1.2, -0.4], dtype=torch.float64)
    (g,) = torch.autograd.grad(kl_penalty(logp, ref, "k3").sum(), logp)
    close(g, 1 - torch.exp(ref - logp.detach()))


def test_padding_garbage_never_reaches_loss_or_gradient():
    logp, old, ref, mask, adv = spec_batch()
    with torch.no_grad():
        logp[0, 2] = float("inf")
    old = old.clone()
    old[0, 2] = -float("inf")
    ref = ref.clone()
    ref[0, 2] = float("nan")
    loss, stats = policy_loss(logp, old, adv, mask, loss_spec(beta=0.04), ref_logp=ref)
    close(loss, -0.062644)
    assert all(torch.isfinite(v) for v in stats.values())
    (g,) = torch.autograd.grad(loss, logp)
    assert torch.isfinite(g).all() and g[0, 2] == 0


def test_old_ref_and_adv_are_detached():
    logp, old, ref, mask, adv = spec_batch()
    old, ref, adv = (x.clone().requires_grad_() for x in (old, ref, adv))
    loss, _ = policy_loss(logp, old, adv, mask, loss_spec(beta=0.04), ref_logp=ref)
    loss.backward()
    assert old.grad is None and ref.grad is None and adv.grad is None and logp.grad is not None


def test_loss_normalizer():
    assert loss_normalizer(loss_spec(aggregation="seq_mean"), num_sequences=4, num_tokens=10) == 4
    assert loss_normalizer(loss_spec(aggregation="token_mean"), num_sequences=4, num_tokens=10) == 10
    assert loss_normalizer(loss_spec(aggregation="token_mean"), num_sequences=4, num_tokens=0) == 1
    assert loss_normalizer(loss_spec(8, aggregation="constant"), num_sequences=4, num_tokens=10) == 32


def test_luspo_spec_14_9():
    # SPEC 14.9 on the 7.2 data, β = 0, ε = 0.2: s_1 = 1.221403 (clipped), s_2 = 0.967216; GSPO with grpo
    # aggregation −0.100798, LUSPO ½(2·(−1.039230) + 3·0.837634) = 0.217220; per-token gradient of sequence 2
    # 0.139606 (GSPO) and 0.418817 (LUSPO), of sequence 1 0 in both
    logp, old, ref, mask, adv = spec_batch()
    for aggregation, value, slope in (("seq_mean", -0.100798, 0.139606), ("luspo", 0.217220, 0.418817)):
        loss, _ = policy_loss(logp, old, adv, mask, loss_spec(beta=0.0, ratio_level="sequence",
                                                              aggregation=aggregation))
        close(loss, value)
        (g,) = torch.autograd.grad(loss, logp)
        close(g[0], [0, 0, 0]), close(g[1], [slope] * 3)
    assert loss_normalizer(loss_spec(aggregation="luspo"), num_sequences=4, num_tokens=10) == 4


def test_presets_name_papers_and_map_to_valid_arguments():
    logp, old, ref, mask, adv = spec_batch()
    assert set(PRESETS) == {"grpo", "dr_grpo", "dapo", "gspo", "cispo", "sapo", "dppo", "icepop"}
    for p in PRESETS.values():
        assert "arXiv" in p.paper
        loss, _ = policy_loss(logp, old, adv, mask, loss_spec(4, **preset_values(p.name)), ref_logp=ref)
        assert torch.isfinite(loss)
    grpo, dapo, dr_grpo, gspo, cispo, sapo = (get_preset(n).values
                                              for n in ("grpo", "dapo", "dr_grpo", "gspo", "cispo", "sapo"))
    assert grpo["beta"] == 0.04 and grpo["aggregation"] == "seq_mean"
    assert dapo["clip_high"] == 0.28 and dapo["aggregation"] == "token_mean"
    assert dr_grpo["scale"] == "none" and dr_grpo["aggregation"] == "constant"
    assert gspo["ratio_level"] == "sequence" and gspo["clip_low"] == 3e-4
    assert cispo["surrogate"] == "cispo" and cispo["clip_low"] == 1.0
    assert sapo["surrogate"] == "sapo" and sapo["sapo_tau_neg"] == 1.05
    dppo, icepop = get_preset("dppo").values, get_preset("icepop").values
    assert (dppo["surrogate"], dppo["dppo_tv_low"], dppo["dppo_tv_high"], dppo["dppo_cap"], dppo["scale"],
            dppo["aggregation"], dppo["beta"]) == ("dppo_tv", 0.2, 0.2, 0.0, "none", "token_mean", 0.0)  # prime-rl's
    assert "prime-rl" in get_preset("dppo").paper
    assert (icepop["sampler_correction"], icepop["sampler_correction_floor"], icepop["sampler_correction_cap"]) == (
        "token_mis", 0.5, 5.0)  # SPEC 14.6: token MIS with C_min = α, C = β
    with pytest.raises(ValueError, match="preset='ppo' is not allowed; choose one of 'grpo'"):
        get_preset("ppo")


def _args():
    logp, old, ref, mask, adv = spec_batch()
    return dict(logp=logp, old_logp=old, adv=adv, mask=mask, ref_logp=ref)


# each case: the tensors changed, or the spec's fields changed (the spec refuses them when it is built)
@pytest.mark.parametrize("change, match", [
    (dict(aggregation="sum"), "aggregation='sum' is not allowed; choose one of 'seq_mean', 'token_mean', 'constant'"),
    (dict(ratio_level="seq"), "ratio_level='seq' is not allowed"),
    (dict(kl_kind="k4"), "kl_kind='k4' is not allowed"),
    (dict(aggregation="constant"), "needs max_completion_length"),
    (dict(old_logp=torch.zeros(2, 4)), r"old_logp has shape \(2, 4\) but logp has shape \(2, 3\)"),
    (dict(mask=torch.ones(3)), r"mask has shape \(3,\)"),
    (dict(adv=torch.zeros(3)), r"adv has shape \(3,\)"),
    (dict(ref_logp=None, beta=0.1), "beta=0.1 > 0 needs ref_logp"),
    (dict(beta=-1.0), "beta must be >= 0"),
    (dict(clip_low=1.5), "clip_low must be in"),
    (dict(normalizer=0.0), "normalizer must be > 0"),
    (dict(dual_clip=0.5), "dual_clip must be > 1"),
])
def test_bad_input_names_the_argument(change, match):
    args = _args() | change
    tensors = {k: args.pop(k) for k in ("logp", "old_logp", "adv", "mask")}
    call = {k: args.pop(k) for k in ("ref_logp", "normalizer") if k in args}
    with pytest.raises(ValueError, match=match):
        policy_loss(*tensors.values(), replace(loss_spec(beta=0.0), **args), **call)


def test_kl_bad_input():
    with pytest.raises(ValueError, match="kind='k5' is not allowed"):
        kl_penalty(torch.zeros(2), torch.zeros(2), "k5")
    with pytest.raises(ValueError, match="ref_logp has shape"):
        kl_penalty(torch.zeros(2), torch.zeros(3), "k3")
