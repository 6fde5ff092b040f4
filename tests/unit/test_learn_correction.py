"""The sampler–trainer correction inside a real update (`grpo.learn.learn`): the weights reach the loss, the
mismatch figures add up over micro-batches and updates, and without sampler log-probs nothing changes."""
import copy
import math

import pytest
import torch

from grpo.collect import collect
from grpo.config import ModelConfig
from grpo.distributed import Dist
from grpo.experience import Experience
from grpo.learn import Learner, learn
from grpo.models import load_model
from grpo.policy import LogprobModule
from grpo.rewards import last_number

from algo_specs import loss_spec
from test_collect import Scripted, collector, stream

# group 0: rewards 1, 0; group 1: rewards 0, 1 (last_number against the answer "1")
EPISODES = {"p0": ["so 1", "so 22"], "p1": ["it is 3", "1"]}


@pytest.fixture
def setup(random_model_dir):
    exp = collect(collector(Scripted(EPISODES), [("last_number", last_number)]), stream(["p0", "p1"]), Dist())
    model, _ = load_model(ModelConfig(path=str(random_model_dir)))
    with torch.no_grad():
        logp = LogprobModule(model)(exp.prompt_ids, exp.prompt_mask, exp.completion_ids, exp.completion_mask,
                                    temperature=1.0, chunk_size=8).float() * exp.completion_mask
    return exp, model, logp


def _run(model, exp, *, rows=8, mu=1, mode="token_tis", cap=2.0):
    model = copy.deepcopy(model)
    spec = loss_spec(8, beta=0.0, num_iterations=mu, sampler_correction=mode, sampler_correction_cap=cap)
    learner = Learner(LogprobModule(model), None, torch.optim.SGD(model.parameters(), lr=0.1), spec, 1.0, 8,
                      max_rows=rows, max_tokens=0, max_grad_norm=0.0)
    return learn(learner, exp, Dist()), model


def _with(exp, **fields):
    return Experience(**{**exp.__dict__, **fields})


def _params(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_equal_logprobs_change_nothing(setup):
    exp, model, logp = setup
    plain, m0 = _run(model, exp)
    same, m1 = _run(model, _with(exp, sampler_logp=logp.clone()))
    assert "mismatch/abs_diff" not in plain[0]
    assert same[0]["mismatch/capped"] == 0 and same[0]["mismatch/abs_diff"] < 1e-5
    assert same[0]["mismatch/weight"] == pytest.approx(same[0]["tokens"], rel=1e-5)
    assert torch.allclose(_params(m0), _params(m1), atol=1e-6)


def test_a_masked_row_trains_like_a_row_without_advantage(setup):
    """token_mis with the sampler far off on row 0 (ρ = e² > C): its policy term is 0, exactly as if its advantage
    were 0; the row still counts in the normaliser."""
    exp, model, logp = setup
    smp = logp.clone()
    smp[0] -= 2.0 * exp.completion_mask[0]
    masked, m_masked = _run(model, _with(exp, sampler_logp=smp), mode="token_mis")
    adv = exp.advantages.clone()
    adv[0] = 0
    zeroed, m_zeroed = _run(model, _with(exp, advantages=adv))
    assert masked[0]["loss/policy"] == pytest.approx(zeroed[0]["loss/policy"], abs=1e-6)
    assert torch.allclose(_params(m_masked), _params(m_zeroed), atol=1e-6)
    n0, n = int(exp.loss_mask[0].sum()), int(exp.loss_mask.sum())
    assert masked[0]["mismatch/capped"] == n0
    assert masked[0]["mismatch/abs_diff"] == pytest.approx(2.0 * n0, rel=1e-5)
    assert masked[0]["mismatch/abs_diff_max"] == pytest.approx(2.0, rel=1e-5)
    assert masked[0]["tokens"] == n
    # truncation instead: row 0's weight is the cap, so its policy term is doubled
    capped, _ = _run(model, _with(exp, sampler_logp=smp), mode="token_tis")
    assert capped[0]["mismatch/weight"] == pytest.approx(2.0 * n0 + (n - n0), rel=1e-5)
    assert capped[0]["loss/policy"] != pytest.approx(zeroed[0]["loss/policy"], abs=1e-6)


@pytest.mark.parametrize("mode", ["token_tis", "seq_mis"])
def test_figures_do_not_depend_on_micro_batches_or_updates(setup, mode):
    exp, model, logp = setup
    g = torch.Generator().manual_seed(0)
    smp = (logp + 0.3 * torch.randn(logp.shape, generator=g)) * exp.completion_mask
    whole, _ = _run(model, _with(exp, sampler_logp=smp), rows=8, mode=mode)
    split, _ = _run(model, _with(exp, sampler_logp=smp), rows=1, mode=mode)
    twice, _ = _run(model, _with(exp, sampler_logp=smp), rows=3, mu=2, mode=mode)
    keys = ["mismatch/abs_diff", "mismatch/k3", "mismatch/capped", "mismatch/weight", "mismatch/abs_diff_max"]
    for k in keys:
        assert split[0][k] == pytest.approx(whole[0][k], rel=1e-5)
        # with μ = 2 the old log-probs are fixed for the step: both updates see the same mismatch
        assert twice[0][k] == pytest.approx(whole[0][k], rel=1e-4) and twice[1][k] == pytest.approx(twice[0][k])
    assert whole[0]["loss/policy"] == pytest.approx(split[0]["loss/policy"], abs=1e-6)
    assert math.isfinite(whole[0]["loss"])
