"""Advantages against SPEC sections 1.3, 2.1, 2.3 and 8 (hand-computed numbers)."""
import math

import pytest
import torch

from grpo.algo import compute_advantages, group_advantages, process_advantages, rloo_advantages

from algo_specs import advantage_spec as spec

S3 = math.sqrt(3) / 2  # 0.866025: 0.5 / sqrt(1/3)


def t(*xs):
    return torch.tensor(xs, dtype=torch.float64)


def close(a, b, tol=1e-6):
    assert torch.allclose(a, torch.as_tensor(b, dtype=a.dtype), atol=tol, rtol=0), (a, b)


def test_spec_groups_sample_std_no_eps():
    # SPEC 2.1: [1,0,0,1] and [0,0,1,1] → ±0.866025, signs follow the rewards
    adv = group_advantages(t(1, 0, 0, 1, 0, 0, 1, 1), 4, spec(eps=0.0))
    close(adv, [S3, -S3, -S3, S3, -S3, -S3, S3, S3])


def test_spec_groups_default_eps_is_trl():
    # SPEC 2.1: TRL's ε = 1e-4 added to the std gives ±0.865875; this is our default
    close(group_advantages(t(1, 0, 0, 1), 4, spec()), [0.865875, -0.865875, -0.865875, 0.865875])


def test_verl_and_oat_eps():
    close(group_advantages(t(1, 0, 0, 1), 4, spec(eps=1e-6)), [0.866024, -0.866024, -0.866024, 0.866024])
    close(group_advantages(t(1, 0, 0, 1), 4, spec(eps=1e-8)), [S3, -S3, -S3, S3])


def test_population_std():
    # biased std 0.5 → ±1; [1,0,0,0] → 1.732051, −0.577350
    close(group_advantages(t(1, 0, 0, 1), 4, spec(std="population", eps=0)), [1, -1, -1, 1])
    close(group_advantages(t(1, 0, 0, 0), 4, spec(std="population", eps=0)), [1.732051] + [-0.577350] * 3)


def test_one_of_four():
    close(group_advantages(t(1, 0, 0, 0), 4, spec(eps=0)), [1.5, -0.5, -0.5, -0.5])


def test_style_two_completion_examples():
    # STYLE 8.5: G = 2, rewards [1, 0]: population std 0.5 → ±0.9998 (eps 1e-4); sample std 0.7071 → ±0.7070
    close(group_advantages(t(1, 0), 2, spec(std="population")), [0.5 / 0.5001, -0.5 / 0.5001])
    close(group_advantages(t(1, 0), 2, spec()), [0.5 / (math.sqrt(0.5) + 1e-4), -0.5 / (math.sqrt(0.5) + 1e-4)])
    close(group_advantages(t(1, 0), 2, spec(scale="none")), [0.5, -0.5])


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("eps", [0.0, 1e-4])
def test_equal_rewards_give_exact_zero(scale, eps):
    adv = group_advantages(t(1, 1, 1, 1, 0.1, 0.1, 0.1, 0.1), 4, spec(scale=scale, eps=eps))
    assert torch.equal(adv, torch.zeros(8, dtype=torch.float64))


def test_batch_scaling():
    # SPEC 2.3: both groups together, batch std sqrt(2/7) = 0.534522 → ±0.935414; TRL's ε → ±0.935239
    r = t(1, 0, 0, 1, 0, 0, 1, 1)
    close(group_advantages(r, 4, spec(scale="batch", eps=0)), [0.935414, -0.935414, -0.935414, 0.935414,
                                                               -0.935414, -0.935414, 0.935414, 0.935414])
    close(group_advantages(r, 4, spec(scale="batch"))[:1], [0.935239])


def test_dr_grpo_centres_only():
    close(group_advantages(t(1, 0, 0, 0), 4, spec(scale="none")), [0.75, -0.25, -0.25, -0.25])


def test_group_size_one_gives_zero():
    assert torch.equal(group_advantages(t(3, -1), 1, spec()), torch.zeros(2, dtype=torch.float64))


def test_nan_rewards_are_left_out_and_get_zero():
    adv = group_advantages(t(1, float("nan"), 0, 1), 4, spec(eps=0))
    # valid [1, 0, 1]: mean 2/3, sample std sqrt(1/3)
    close(adv, [(1 / 3) / math.sqrt(1 / 3), 0, -(2 / 3) / math.sqrt(1 / 3), (1 / 3) / math.sqrt(1 / 3)])


def test_dtype_follows_input_and_ints_accepted():
    assert group_advantages(torch.tensor([1.0, 0.0]), 2, spec()).dtype == torch.float32
    close(group_advantages(torch.tensor([1, 0, 0, 1]), 4, spec(eps=0)).double(), [S3, -S3, -S3, S3])


def test_rloo():
    close(rloo_advantages(t(1, 0, 0, 1), 4), [2 / 3, -2 / 3, -2 / 3, 2 / 3])
    close(rloo_advantages(t(1, 0, 0, 0), 4), [1, -1 / 3, -1 / 3, -1 / 3])
    assert torch.equal(rloo_advantages(t(0.1, 0.1, 0.1), 3), torch.zeros(3, dtype=torch.float64))


def test_compute_advantages_takes_the_scale_from_the_spec():
    close(compute_advantages(t(1, 0, 0, 1), 4, spec()), [0.865875, -0.865875, -0.865875, 0.865875])
    close(compute_advantages(t(1, 0, 0, 0), 4, spec(scale="none")), [0.75, -0.25, -0.25, -0.25])
    # RLOO: G/(G−1)·(r − mean); std and eps do not apply
    close(compute_advantages(t(1, 0, 0, 1), 4, spec(scale="rloo", eps=0.5)), [2 / 3, -2 / 3, -2 / 3, 2 / 3])


def test_process_supervision_spec_example():
    # SPEC 1.3 (1-based tokens there; 0-based step ends here)
    r = t(0.9, 0.2, 0.5, 0.0).view(2, 2)
    ends = torch.tensor([[2, 5], [3, -1]])
    adv = process_advantages(r, ends, 2, 7, spec(eps=0))
    close(adv, [[0.094916] * 3 + [-0.949158] * 3 + [0.0], [-0.094916] * 4 + [0.0] * 3])


def test_process_supervision_unsorted_steps_and_equal_rewards():
    r = t(0.2, 0.9, 0.5, 0.0).view(2, 2)
    ends = torch.tensor([[5, 2], [3, -1]])
    close(process_advantages(r, ends, 2, 6, spec(eps=0))[0], [0.094916] * 3 + [-0.949158] * 3)
    flat = process_advantages(t(1, 1, 1, 7).view(2, 2), torch.tensor([[0, 1], [1, -1]]), 2, 3, spec())
    assert torch.equal(flat, torch.zeros(2, 3, dtype=torch.float64))


@pytest.mark.parametrize("call, match", [
    (lambda: group_advantages(t(1, 0, 1), 2, spec()), "not a multiple of group_size=2"),
    (lambda: group_advantages(t(1, 0), 0, spec()), "group_size must be a positive integer"),
    (lambda: group_advantages(t(1, 0), 2, spec(scale="std")), "scale='std' is not allowed; choose one of 'group'"),
    (lambda: group_advantages(t(1, 0), 2, spec(std="unbiased")), "std='unbiased' is not allowed"),
    (lambda: group_advantages(t(1, 0).view(2, 1), 2, spec()), "rewards must have 1 dimension"),
    (lambda: group_advantages([1.0, 0.0], 2, spec()), "rewards must be a torch.Tensor"),
    (lambda: group_advantages(t(1, 0), 2, spec(eps=-1)), "eps must be >= 0"),
    (lambda: rloo_advantages(t(1, 0), 1), "group_size must be at least 2"),
    (lambda: process_advantages(t(1, 0).view(1, 2), torch.tensor([[0]]), 1, 3, spec()), "step_ends has shape"),
    (lambda: process_advantages(t(1, 0).view(1, 2), torch.tensor([[0, 4]]), 1, 3, spec()), "num_tokens=3"),
])
def test_bad_input_names_the_argument(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


def test_informative_groups_are_those_whose_rewards_differ():
    from grpo.algo import informative_groups

    nan = float("nan")
    r = torch.tensor([1, 0, 0, 1, 1, 1, 1, 1, 0.5, 0.5, nan, 0.5, 0.2, 0.9, 0.4, 0.4, nan, nan, nan, 3.0])
    # SPEC 13.7's table: acc 1,0,0,1 kept; 1,1,1,1 dropped; a constant F1 group dropped (NaN left out); F1
    # 0.2,0.9,0.4,0.4 kept; a group with one valid reward dropped
    assert informative_groups(r, 4).tolist() == [True, False, False, True, False]
    assert informative_groups(torch.tensor([-1, -1, -1.25, -1]), 4).tolist() == [True]  # a shaped reward


# ---- MaxRL (SPEC 14.3)

def test_maxrl_spec_table():
    from grpo.algo.advantages import maxrl_advantages
    close(maxrl_advantages(t(1, 0, 0, 0), 4), [3, -1, -1, -1])
    close(maxrl_advantages(t(1, 1, 1, 0), 4), [1 / 3, 1 / 3, 1 / 3, -1])
    close(maxrl_advantages(t(1, 1, 0, 0), 4), [1, 1, -1, -1])
    assert torch.equal(maxrl_advantages(t(0, 0, 0, 0, 1, 1, 1, 1), 4), torch.zeros(8, dtype=torch.float64))
    close(maxrl_advantages(t(1, float("nan"), 0, 0), 4), [2, 0, -1, -1])  # no reward: out of r̄, and 0
    assert torch.equal(maxrl_advantages(t(1, 0.5), 1), torch.zeros(2, dtype=torch.float64))  # a group of one
    # through the spec, as the trainer calls it: std and eps do not apply
    close(compute_advantages(t(1, 0, 0, 0), 4, spec(scale="maxrl", eps=0.5)), [3, -1, -1, -1])


def test_maxrl_gradient_and_its_expectation_by_enumeration():
    # SPEC 14.3: the one-token categorical of §6, z = (0.5, 0, -0.5); a0 is correct; the group samples a0, a1, a1, a2
    from itertools import product

    from grpo.algo.advantages import maxrl_advantages
    z = torch.tensor([0.5, 0.0, -0.5], dtype=torch.float64, requires_grad=True)
    logp = torch.log_softmax(z, 0)
    sampled = [0, 1, 1, 2]
    adv = maxrl_advantages(t(*[float(a == 0) for a in sampled]), 4)
    (-(adv * logp[sampled]).mean()).backward()
    close(z.grad, [-0.75, 0.5, 0.25])
    # the exact expectation of the ascent direction over all 3^4 groups is ∇J_3 = (1 − (1 − p)^3)/p ∇p
    pi = torch.softmax(z.detach(), 0)
    p, grad_p = pi[0], pi[0] * (torch.eye(3, dtype=torch.float64)[0] - pi)
    expect = torch.zeros(3, dtype=torch.float64)
    for group in product(range(3), repeat=4):
        a = maxrl_advantages(t(*[float(x == 0) for x in group]), 4)
        scores = torch.stack([torch.eye(3, dtype=torch.float64)[x] - pi for x in group])
        expect += torch.prod(pi[list(group)]) * (a.unsqueeze(1) * scores).mean(0)
    close(expect, [0.434197, -0.270270, -0.163927])
    close(expect, (1 - (1 - p) ** 3) / p * grad_p)


def test_maxrl_refuses_rewards_outside_0_1():
    # (grpo.collect turns it into one line: test_collect.py)
    from grpo.algo import RewardRangeError
    from grpo.algo.advantages import maxrl_advantages
    with pytest.raises(RewardRangeError, match=r"algo.scale=maxrl needs every reward in \[0, 1\] .* a completion's reward "
                                        r"is 2.5; use rewards in \[0, 1\] or another algo.scale"):
        maxrl_advantages(t(1, 2.5, 0, 0), 4)


# ---- GDPO (SPEC 14.4)

def test_gdpo_spec_example():
    from grpo.algo import gdpo_advantages
    rewards = torch.stack([t(1, 1, 0, 0), t(0, 0.1, 0, 0.1)], 1)  # correctness, format
    close(gdpo_advantages(rewards, [1, 1], 4, spec()), [0.000954, 1.224658, -1.224658, -0.000954])
    close(gdpo_advantages(rewards, [1, 1], 4, spec(eps=0)), [0, 1.224745, -1.224745, 0])
    close(gdpo_advantages(rewards, [2, 1], 4, spec()), [0.388004, 1.161602, -1.161602, -0.388004])
    # summing first (the default) lets the 0.1-scale format reward barely separate completions
    close(group_advantages(rewards.sum(1), 4, spec()), [0.775421, 0.947737, -0.947737, -0.775421])
    close(group_advantages(rewards @ t(2, 1), 4, spec()), [0.821627, 0.908114, -0.908114, -0.821627])


def test_gdpo_unscored_values_and_constant_groups():
    from grpo.algo import gdpo_advantages
    nan = float("nan")
    # group 1: format unscored on one row (it sits at the function's mean: adds 0), correctness constant (adds 0);
    # group 2: no function scores its last row (no s: advantage 0, out of the batch statistics), and format
    # scores one row only (adds 0 for the group)
    rewards = torch.stack([t(1, 1, 1, 1, 1, 0, 0, nan), t(0, 1, nan, 1, nan, 5, nan, nan)], 1)
    adv = gdpo_advantages(rewards, [1, 1], 4, spec(eps=0))
    f = group_advantages(t(0, 1, 1), 3, spec(eps=0))  # format's standardised values in group 1 (its 3 scored)
    c = group_advantages(t(1, 0, 0), 3, spec(eps=0))  # correctness in group 2 (3 scored)
    s = torch.cat([f[:2], t(0.0), f[2:], c])          # s of the seven rows that have one
    expect = (s - s.mean()) / s.std()
    close(adv, torch.cat([expect, t(0.0)]))
    assert torch.equal(gdpo_advantages(torch.ones(4, 2, dtype=torch.float64), [1, 1], 4, spec()),
                       torch.zeros(4, dtype=torch.float64))


# ---- the group rule of dynamic sampling under any baseline (SPEC 14.10) and unscorable completions (14.11)

def test_informativeness_is_the_groups_under_a_leave_one_out_baseline():
    from grpo.algo import informative_groups
    nan = float("nan")
    # one differing completion: every row's siblings but its own are identical; the group is kept whole
    assert informative_groups(t(1, 0, 0, 0, 1, 1, 1, 0, 1, 1, 0, 0), 4).tolist() == [True, True, True]
    # (1, 1, None, 1): a NaN-propagating max != min would keep it; the rule drops it. One scored value: dropped
    assert informative_groups(t(1, 1, nan, 1, nan, nan, 0.5, nan), 4).tolist() == [False, False]
    # never a floating std: seven copies of 0.95 beside a 0, and eight copies, decided exactly
    assert informative_groups(t(0, *[0.95] * 7, *[0.95] * 8), 8).tolist() == [True, False]
    # NeMo-RL's table, leave-one-out advantages (Â = r − b)
    close(rloo_advantages(t(1, 0, 0, 0), 4), [1, -1 / 3, -1 / 3, -1 / 3])
    close(rloo_advantages(t(1, 1, 1, 0), 4), [1 / 3, 1 / 3, 1 / 3, -1])
    close(rloo_advantages(t(1, 1, 0, 0), 4), [2 / 3, 2 / 3, -2 / 3, -2 / 3])


def test_unscorable_completions_leave_the_statistics():
    nan = float("nan")
    close(compute_advantages(t(1, 0, nan, 1), 4, spec()), [0.577250, -1.154501, 0, 0.577250])
    close(compute_advantages(t(-1, -1, nan, 0.5), 4, spec()), [-0.577284, -0.577284, 0, 1.154567])
    close(compute_advantages(t(1, 0, nan, 1), 4, spec(scale="rloo")), [0.5, -1, 0, 0.5])
    for scale in ("group", "batch", "none", "rloo", "maxrl"):  # fewer than two scored: 0 on every row
        assert compute_advantages(t(nan, 1, nan, nan), 4, spec(scale=scale)).abs().sum() == 0, scale


def test_partly_scored_completions_under_both_aggregations():
    from grpo.algo import gdpo_advantages
    from grpo.rewards import score
    nan = float("nan")
    acc, fmt = [1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 0.0, None]
    scores = score([("acc", lambda prompts, completions, **_: acc), ("fmt", lambda prompts, completions, **_: fmt)], None, ["q"] * 4, ["a"] * 4, {})
    assert scores.total.tolist() == [2, 1, 0, 1]  # the missing value counts as 0
    close(compute_advantages(scores.total, 4, spec()), [1.224595, 0, -1.224595, 0])
    per_fn = torch.tensor([acc, [1.0, 1.0, 0.0, nan]]).T.double()
    close(gdpo_advantages(per_fn, [1, 1], 4, spec()), [0.944849, -0.188970, -1.322789, 0.566910])
