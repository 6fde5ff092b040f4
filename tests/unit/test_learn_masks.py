"""The loss mask and the normaliser inside a real update (`grpo.learn.learn`), on rows whose loss mask is not their
episode mask: tokens a tool inserted into an episode, and truncated rows `algo.mask_truncated` leaves out. The
learner must take the normaliser's token count from the loss mask and hand the loss mask to the loss; either one
switched to the completion (episode) mask would train on tool output or dilute the loss, and these numbers move.
Also the figures that count tokens: the entropy by quarter of the episode, the completion lengths."""
import copy

import pytest
import torch

from grpo.collect import collect
from grpo.config import ModelConfig
from grpo.distributed import Dist
from grpo.envs.base import Episode
from grpo.experience import Experience
from grpo.learn import Learner, learn
from grpo.metrics import step_metrics
from grpo.models import load_model
from grpo.policy import LogprobModule
from grpo.rewards import last_number

from algo_specs import loss_spec
from test_collect import Scripted, collector, stream

# four rows, two groups of two, of at most 8 tokens ("it is 3" and EOS); each case below sets its rows' masks
EPISODES = {"p0": ["so 1", "so 22"], "p1": ["it is 3", "1"]}
ADV = torch.tensor([1.0, -1.0, 0.5, -0.5])


@pytest.fixture
def setup(random_model_dir):
    exp = collect(collector(Scripted(EPISODES), [("last_number", last_number)]), stream(["p0", "p1"]), Dist())
    model, _ = load_model(ModelConfig(path=str(random_model_dir)))
    return exp, model


def with_tools(exp):
    """Every row an episode of 6 tokens; in row 0 a tool inserted tokens 2-3, in row 2 tokens 1-4. The loss tokens:
    4, 6, 2 and 6 (18); the episode tokens: 24."""
    episode = torch.zeros_like(exp.completion_mask)
    episode[:, :6] = 1
    loss = episode.clone()
    loss[0, 2:4] = 0
    loss[2, 1:5] = 0
    return _with(exp, completion_mask=episode, loss_mask=loss)


def with_masked_truncation(exp):
    """Episodes of 5, 6, 8 and 2 tokens; rows 1 and 2 truncated, and out of the loss as `algo.mask_truncated`
    leaves them (their episode tokens stay). The loss tokens: 5 and 2 (7); the episode tokens: 21."""
    episode = (torch.arange(exp.completion_mask.shape[1]) < torch.tensor([[5], [6], [8], [2]])).long()
    loss = episode.clone()
    loss[1:3] = 0
    return _with(exp, completion_mask=episode, loss_mask=loss, truncated=torch.tensor([False, True, True, False]))


def _with(exp, **fields):
    adv = ADV.unsqueeze(1).expand_as(exp.advantages).contiguous()
    return Experience(**{**exp.__dict__, "advantages": adv, **fields})


def run(model, exp, aggregation, rows=8):
    """One update at μ = 1 (every ratio 1), β = 0: the policy term of a loss token is −Â."""
    model = copy.deepcopy(model)
    learner = Learner(LogprobModule(model), None, torch.optim.SGD(model.parameters(), lr=0.1),
                      loss_spec(8, beta=0.0, aggregation=aggregation), 1.0, 8, max_rows=rows, max_tokens=0,
                      max_grad_norm=0.0)
    return learn(learner, exp, Dist())[0], torch.cat([p.detach().flatten() for p in model.parameters()])


# μ = 1, β = 0: loss/policy = −Σ_rows Â·(the row's loss tokens) / normaliser.
# Tools: −(1·4 − 1·6 + 0.5·2 − 0.5·6) = 4; token_mean over 18 tokens 0.222222, constant over 4 rows × L_max 8 0.125.
# (The episode mask as the normaliser would give 4/24 = 0.166667; as the loss's mask −(6 − 6 + 3 − 3) = 0.)
# Truncation: −(1·5 − 0.5·2) = −4; over 7 tokens −0.571429, over 32 −0.125.
# (The episode mask as the normaliser: −4/21 = −0.190476; as the loss's mask −(5 − 6 + 4 − 1)/7 = −0.285714.)
@pytest.mark.parametrize("make, tokens, token_mean, constant", [
    (with_tools, 18, 0.222222, 0.125),
    (with_masked_truncation, 7, -0.571429, -0.125),
])
def test_the_normaliser_and_the_loss_count_the_loss_tokens_only(setup, make, tokens, token_mean, constant):
    exp, model = setup
    exp = make(exp)
    assert not torch.equal(exp.loss_mask, exp.completion_mask)
    for rows in (8, 1):  # the whole step, and a micro-batch per row (the normaliser is the step's)
        update, _ = run(model, exp, "token_mean", rows)
        assert update["tokens"] == tokens
        assert update["loss/policy"] == pytest.approx(token_mean, abs=1e-6)
        update, _ = run(model, exp, "constant", rows)
        assert update["loss/policy"] == pytest.approx(constant, abs=1e-6)


@pytest.mark.parametrize("make", [with_tools, with_masked_truncation])
def test_tokens_outside_the_loss_get_no_gradient(setup, make):
    """The advantages of the tokens outside the loss mask change nothing: not the loss, not the update."""
    exp, model = setup
    exp = make(exp)
    outside = (exp.completion_mask == 1) & (exp.loss_mask == 0)
    assert outside.any()
    for aggregation in ("seq_mean", "token_mean", "constant"):
        update, weights = run(model, exp, aggregation)
        shouted = Experience(**{**exp.__dict__, "advantages": torch.where(outside, 100.0, exp.advantages)})
        loud, loud_weights = run(model, shouted, aggregation)
        assert loud["loss"] == update["loss"]
        assert torch.equal(loud_weights, weights)


def test_entropy_quarters_are_quarters_of_the_episode(setup):
    # episodes of 6 tokens: position t is in quarter ⌊4t/6⌋ + 1, so positions 0-1, 2, 3-4, 5 in quarters 1-4;
    # row 0's loss tokens 0, 1, 4, 5, row 2's 0 and 5, rows 1 and 3 all six
    exp, model = setup
    update, _ = run(model, with_tools(exp), "token_mean")
    assert [update[f"entropy/q{k}_tokens"] for k in range(1, 5)] == [7, 2, 5, 4]
    assert sum(update[f"entropy/q{k}_tokens"] for k in range(1, 5)) == update["tokens"]


def test_length_figures_say_which_tokens_they_count(setup):
    exp, model = setup
    tools = with_tools(exp)
    update, _ = run(model, tools, "token_mean")
    figures = lambda e: step_metrics(e, [update], Dist(), group_size=2, seconds=2.0, rollout_seconds=1.0,  # noqa
                                     lr=0.1)
    single = figures(tools)
    assert single["completion/mean_length"] == 6.0  # the episode's tokens
    assert "completion/mean_loss_tokens" not in single  # single completions: the same count (the default job)
    episodes = [Episode([], [], turns=2, tool_calls=1) for _ in range(len(tools))]
    multi = figures(Experience(**{**tools.__dict__, "episodes": episodes}))
    assert multi["completion/mean_length"] == 6.0 and multi["completion/mean_loss_tokens"] == 18 / 4
    assert multi["perf/completion_tokens"] == 24 and multi["perf/tokens_per_s"] == 12.0
    # the entropy by quarter is the mean over the loss tokens in each quarter of the episode
    for k, n in zip(range(1, 5), [7, 2, 5, 4]):
        assert multi[f"entropy/q{k}"] == pytest.approx(update[f"entropy/q{k}"] / n)
