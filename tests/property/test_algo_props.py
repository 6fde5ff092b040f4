"""Properties of the objective (hypothesis): invariances the SPEC implies, for any input."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo.algo import group_advantages, kl_penalty, loss_normalizer, policy_loss, rloo_advantages, token_logprobs

from algo_specs import advantage_spec, loss_spec

settings.register_profile("grpo", deadline=None, max_examples=60)
settings.load_profile("grpo")

finite = st.floats(allow_nan=False, allow_infinity=False, width=32)  # the whole float32 range


@st.composite
def grouped_rewards(draw, elements=finite):
    g = draw(st.integers(1, 8))
    n_groups = draw(st.integers(1, 5))
    r = draw(st.lists(elements, min_size=g * n_groups, max_size=g * n_groups))
    return torch.tensor(r, dtype=torch.float32), g


@given(grouped_rewards(), st.sampled_from(["group", "batch", "none"]), st.sampled_from(["sample", "population"]))
def test_advantages_finite_and_zero_mean_per_group(rg, scale, std):
    r, g = rg
    if scale == "none":
        # r − mean is returned as is: keep the differences themselves representable in float32
        r = r.clamp(-1e38, 1e38) / 2
    adv = group_advantages(r, g, advantage_spec(scale=scale, std=std))
    assert torch.isfinite(adv).all()
    per_group = adv.double().view(-1, g)
    # zero mean relative to the group's spread (advantages may be as large as the rewards for scale="none")
    spread = per_group.abs().amax(dim=1).clamp(min=1.0)
    assert (per_group.mean(dim=1).abs() <= 1e-5 * spread).all()


@given(grouped_rewards(st.floats(-100, 100, width=32)), st.floats(-50, 50))
def test_advantages_invariant_to_a_constant_shift(rg, c):
    r, g = rg
    a = group_advantages(r.double(), g, advantage_spec())
    b = group_advantages(r.double() + c, g, advantage_spec())
    assert torch.allclose(a, b, atol=1e-6)


@given(grouped_rewards(st.floats(-100, 100, width=32)), st.floats(0.01, 100))
def test_std_normalised_advantages_are_scale_invariant(rg, k):
    r, g = rg
    r = r.double()
    spec = advantage_spec(eps=0.0)
    assert torch.allclose(group_advantages(r, g, spec), group_advantages(r * k, g, spec), atol=1e-6)


@given(grouped_rewards(st.floats(-100, 100, width=32)))
def test_rloo_is_centred_times_g_over_g_minus_one(rg):
    r, g = rg
    if g < 2:
        return
    expect = group_advantages(r.double(), g, advantage_spec(scale="none")) * g / (g - 1)
    assert torch.allclose(rloo_advantages(r.double(), g), expect, atol=1e-6)


@given(st.lists(st.floats(-30, 30), min_size=1, max_size=20), st.lists(st.floats(-30, 30), min_size=1, max_size=20))
def test_k3_is_never_negative(a, b):
    n = min(len(a), len(b))
    logp, ref = torch.tensor(a[:n]), torch.tensor(b[:n])
    assert (kl_penalty(logp, ref, "k3") >= 0).all()
    assert (kl_penalty(logp, ref, "k2") >= 0).all()


# ---------------------------------------------------------------------------------------------------------
# the loss


@st.composite
def loss_batch(draw):
    b = draw(st.integers(1, 6))
    t = draw(st.integers(1, 7))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=gen, dtype=torch.float64) * 3
    old = logp + (torch.rand(b, t, generator=gen, dtype=torch.float64) - 0.5) * 0.8
    ref = logp + (torch.rand(b, t, generator=gen, dtype=torch.float64) - 0.5) * 0.8
    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    mask = (torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)).long()
    adv = torch.randn(b, generator=gen, dtype=torch.float64)
    spec = loss_spec(t, beta=draw(st.sampled_from([0.0, 0.04])),
                     ratio_level=draw(st.sampled_from(["token", "sequence"])),
                     aggregation=draw(st.sampled_from(["seq_mean", "token_mean", "constant"])),
                     clip_high=draw(st.sampled_from([0.2, 0.28])))
    return logp, old, ref, mask, adv, spec


def run(logp, old, ref, mask, adv, spec):
    logp = logp.clone().requires_grad_()
    loss, stats = policy_loss(logp, old, adv, mask, spec, ref_logp=ref)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss, grad, stats


@given(loss_batch(), st.integers(1, 4))
def test_padding_with_mask_zero_changes_nothing(batch, extra):
    logp, old, ref, mask, adv, spec = batch
    loss, grad, stats = run(logp, old, ref, mask, adv, spec)
    pad = lambda x, v: torch.cat([x, torch.full((x.shape[0], extra), v, dtype=x.dtype)], 1)  # noqa: E731
    # the constant normaliser depends on max_completion_length, not on the tensor width
    loss2, grad2, stats2 = run(pad(logp, -7.0), pad(old, 3.0), pad(ref, 9.0), pad(mask, 0), adv, spec)
    assert torch.allclose(loss, loss2, atol=1e-12)
    assert torch.allclose(grad, grad2[:, :logp.shape[1]], atol=1e-12)
    assert (grad2[:, logp.shape[1]:] == 0).all()
    for k in stats:
        assert torch.allclose(stats[k], stats2[k], atol=1e-12), k


@given(loss_batch(), st.randoms(use_true_random=False))
def test_permuting_sequences_changes_nothing(batch, rnd):
    logp, old, ref, mask, adv, spec = batch
    perm = list(range(logp.shape[0]))
    rnd.shuffle(perm)
    p = torch.tensor(perm)
    loss, grad, _ = run(logp, old, ref, mask, adv, spec)
    loss2, grad2, _ = run(logp[p], old[p], ref[p], mask[p], adv[p], spec)
    assert torch.allclose(loss, loss2, atol=1e-12)
    assert torch.allclose(grad[p], grad2, atol=1e-12)


@given(loss_batch(), st.integers(1, 6))
def test_micro_batches_with_step_normaliser_equal_whole_batch(batch, micro):
    logp, old, ref, mask, adv, spec = batch
    norm = loss_normalizer(spec, num_sequences=logp.shape[0], num_tokens=int(mask.sum()))
    loss, grad, _ = run(logp, old, ref, mask, adv, spec)
    x = logp.clone().requires_grad_()
    total = 0.0
    for s in range(0, logp.shape[0], micro):
        sl = slice(s, s + micro)
        part, _ = policy_loss(x[sl], old[sl], adv[sl], mask[sl], spec, ref_logp=ref[sl], normalizer=norm)
        part.backward()  # gradients accumulate over micro-batches, as in training
        total = total + part.detach()
    assert torch.allclose(total, loss, atol=1e-12)
    assert torch.allclose(x.grad, grad, atol=1e-12)


@st.composite
def logits_case(draw):
    b, t, v = draw(st.integers(1, 4)), draw(st.integers(1, 6)), draw(st.integers(2, 17))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, t, v, generator=gen, dtype=torch.float64) * draw(st.sampled_from([0.1, 1.0, 10.0]))
    targets = torch.randint(0, v, (b, t), generator=gen)
    weights = torch.randn(b, t, generator=gen, dtype=torch.float64)
    return logits, targets, weights, draw(st.integers(1, b * t + 2)), draw(st.sampled_from([0.5, 1.0, 1.3]))


@given(logits_case())
def test_chunked_logprobs_equal_plain_for_any_chunk_size(case):
    logits, targets, weights, chunk, temp = case
    a_in = logits.clone().requires_grad_()
    b_in = logits.clone().requires_grad_()
    a = token_logprobs(a_in, targets, temperature=temp)
    b = token_logprobs(b_in, targets, temperature=temp, chunk_size=chunk)
    assert torch.allclose(a, b, atol=1e-10)
    (a * weights).sum().backward()
    (b * weights).sum().backward()
    assert torch.allclose(a_in.grad, b_in.grad, atol=1e-10)
