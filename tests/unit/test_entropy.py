"""Entropy from the chunked log-prob pass, its figures, and top-entropy masking, against SPEC 13.5's numbers."""
import math

import pytest
import torch

from grpo.algo import entropy_figures, entropy_threshold, policy_loss, token_logprobs, token_logprobs_from_hidden, \
    top_entropy_mask
from grpo.algo.entropy import position_quarters, quarter_counts, quarter_index

from algo_specs import loss_spec
from test_loss import S3, close

H = torch.tensor([[[1.0, -0.5]]], dtype=torch.float64)                                     # (1, 1, 2)
W = torch.tensor([[1.0, 0.5], [0.2, -1.0], [0.0, 0.3], [-0.8, 0.4]], dtype=torch.float64)   # (V = 4, 2)
Y = torch.tensor([[1]])


@pytest.mark.parametrize("temperature, entropy, logp", [(1.0, 1.212293, -0.978841), (0.7, 1.102293, -0.899806)])
def test_spec_13_5_numeric_check_every_path(temperature, entropy, logp):
    for chunk in (1, 1024):
        lp, h = token_logprobs_from_hidden(H, W, Y, temperature=temperature, chunk_size=chunk, entropy=True)
        close(lp, [[logp]]), close(h, [[entropy]])
    logits = H @ W.T
    for chunk in (None, 1):
        lp, h = token_logprobs(logits, Y, temperature=temperature, chunk_size=chunk, entropy=True)
        close(lp, [[logp]]), close(h, [[entropy]])


def test_chunked_entropy_equals_unchunked_and_leaves_the_gradient_alone():
    torch.manual_seed(0)
    hidden = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 8, dtype=torch.float64)
    targets = torch.randint(0, 11, (3, 5))
    lp, h = token_logprobs_from_hidden(hidden, weight, targets, temperature=0.9, chunk_size=4, entropy=True)
    p = torch.softmax(hidden.detach() @ weight.T / 0.9, dim=-1)
    close(h, -(p * p.log()).sum(-1))
    plain = token_logprobs_from_hidden(hidden, weight, targets, temperature=0.9, chunk_size=4)
    g1 = torch.autograd.grad(lp.sum(), hidden)[0]
    g2 = torch.autograd.grad(plain.sum(), hidden)[0]
    assert torch.equal(g1, g2)  # asking for the entropy changes nothing else


def test_entropy_gradient_spec_14_7_every_path():
    # SPEC 14.7: logits (0.75, 0.70, −0.15, −1.00), T = 1 → ∂H/∂z = (−0.111967, −0.087719, 0.099017, 0.100668)
    want = [-0.111967, -0.087719, 0.099017, 0.100668]
    logits = torch.tensor([[[0.75, 0.70, -0.15, -1.00]]], dtype=torch.float64, requires_grad=True)
    for chunk in (None, 1):
        _, h = token_logprobs(logits, Y, chunk_size=chunk, entropy=True)
        close(torch.autograd.grad(h.sum(), logits)[0].flatten(), want)
    hidden = torch.eye(4, dtype=torch.float64)[:1].view(1, 1, 4).requires_grad_()
    weight = torch.zeros(4, 4, dtype=torch.float64)
    weight[:, 0] = logits.detach().flatten()  # hidden (1, 0, 0, 0) @ weight.T = the logits
    weight.requires_grad_()
    _, h = token_logprobs_from_hidden(hidden, weight, Y, chunk_size=1, entropy=True)
    close(torch.autograd.grad(h.sum(), weight)[0][:, 0], want)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_entropy_and_logprob_gradients_together_equal_autograd(temperature):
    torch.manual_seed(0)
    hidden = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 8, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 11, (3, 5))
    a, b = torch.randn(3, 5, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)
    logp = torch.log_softmax(hidden @ weight.T / temperature, -1)
    ref = (a * logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1) + b * -(logp.exp() * logp).sum(-1)).sum()
    want = torch.autograd.grad(ref, (hidden, weight), retain_graph=True)
    for chunk in (1, 4, 1024):
        lp, h = token_logprobs_from_hidden(hidden, weight, targets, temperature=temperature, chunk_size=chunk,
                                           entropy=True)
        for got, w in zip(torch.autograd.grad((a * lp + b * h).sum(), (hidden, weight), retain_graph=True), want):
            assert torch.allclose(got, w, atol=1e-10)
        only = torch.autograd.grad((b * h).sum(), hidden)[0]  # the entropy alone
        assert torch.allclose(only, torch.autograd.grad((b * -(logp.exp() * logp).sum(-1)).sum(), hidden,
                                                        retain_graph=True)[0], atol=1e-10)
    logits = (hidden @ weight.T).detach().requires_grad_()
    for chunk in (None, 2):
        lp, h = token_logprobs(logits, targets, temperature=temperature, chunk_size=chunk, entropy=True)
        logp = torch.log_softmax(logits / temperature, -1)
        ref = (a * logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1) + b * -(logp.exp() * logp).sum(-1)).sum()
        assert torch.allclose(torch.autograd.grad((a * lp + b * h).sum(), logits)[0],
                              torch.autograd.grad(ref, logits)[0], atol=1e-10)


def test_threshold_and_mask_spec_13_5():
    ent = torch.tensor([[0.10, 2.30, 0.05, 1.20], [0.40, 0.02, 3.10, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    values = ent[mask.bool()]
    assert entropy_threshold(values, 0.2) == pytest.approx(2.08)
    assert entropy_threshold(values, 0.3) == pytest.approx(1.42)
    assert entropy_threshold(values, 1.0) == pytest.approx(0.02)  # keep 1: every token
    for keep in (0.2, 0.3):  # both keep (1,2) and (2,3) under the quantile rule
        kept = top_entropy_mask(ent, mask, entropy_threshold(values, keep))
        assert kept.tolist() == [[0, 1, 0, 0], [0, 0, 1, 0]]
    # μ = 1, DAPO aggregation: the mask multiplies the policy term; the normaliser keeps all 7 tokens
    logp = torch.zeros(2, 4, dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([S3, -S3], dtype=torch.float64)
    loss, _ = policy_loss(logp, logp.detach(), adv, mask, loss_spec(beta=0.0, aggregation="token_mean"),
                          is_weight=kept)
    g = torch.autograd.grad(loss, logp)[0]
    close(g, [[0, -0.123718, 0, 0], [0, 0, 0.123718, 0]])
    close(loss, 0.0)  # the kept tokens have opposite advantages


def test_entropy_figures_by_quarter():
    ent = torch.tensor([[1.0, 2.0, 3.0, 4.0, 9.0], [5.0, 6.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]])
    quarters = position_quarters(mask, mask)  # single completions: every episode token is in the loss
    counts = quarter_counts(quarters).tolist()
    f = entropy_figures(ent, mask, quarter_index(quarters, counts))
    assert f["entropy"] == 21.0
    # row 1 (length 4): one token per quarter; row 2 (length 2): positions 0 and 1 fall in quarters 1 and 3
    assert [f[f"entropy/q{k}"] for k in range(1, 5)] == [6.0, 2.0, 9.0, 4.0]
    assert counts == [2, 1, 2, 1]
    assert all(v.dtype == torch.float64 for v in f.values())  # sums that stay on the device


def test_entropy_quarters_of_a_tool_episode_are_quarters_of_the_episode():
    # an episode of 8 tokens whose tokens 2-5 a tool inserted: the model's tokens 0, 1 are in the first quarter
    # of the episode and 6, 7 in the last; quarters 2 and 3 hold no loss token (their mean is logged as null)
    ent = torch.tensor([[1.0, 2.0, 9.0, 9.0, 9.0, 9.0, 3.0, 5.0]])
    episode = torch.ones(1, 8, dtype=torch.long)
    mask = torch.tensor([[1, 1, 0, 0, 0, 0, 1, 1]])
    quarters = position_quarters(mask, episode)
    counts = quarter_counts(quarters).tolist()
    f = entropy_figures(ent, mask, quarter_index(quarters, counts))
    assert counts == [2, 0, 0, 2]  # by share of the 4 loss tokens it would be 1, 1, 0, 2
    assert [f[f"entropy/q{k}"].item() for k in range(1, 5)] == [3.0, 0.0, 0.0, 8.0]
    assert f["entropy/q1"] / counts[0] == 1.5 and f["entropy/q4"] / counts[3] == 4.0  # the means per quarter
    assert f["entropy"] == 11.0


def test_bad_keep():
    with pytest.raises(ValueError, match=r"keep must be in \(0, 1\]"):
        entropy_threshold(torch.ones(3), 0.0)
    assert math.isinf(entropy_threshold(torch.ones(0), 0.5))
