"""Top-p / top-k sampling and the importance ratio (SPEC 14.12): Keep Sampling Mask, the kept set K replayed on the
trainer's logits, pinned to SPEC's worked example (values and gradients), the in-process sampler drawing from the
same set, and the update taking its ratio to the truncated policy while the KL stays full-vocabulary."""
import copy
import math

import pytest
import torch

from grpo.algo import policy_loss, sampler_weights, sampling_keep_mask, token_logprobs, token_logprobs_from_hidden
from grpo.distributed import Dist
from grpo.learn import Learner, learn
from grpo.policy import LogprobModule
from grpo.rollout import Sampling, sample_next

from algo_specs import loss_spec
from test_learn_surrogates import setup  # noqa: F401 (a fixture: the scripted batch and a random model)

LOGITS = [2.0, 1.5, 0.5, -1.0]  # SPEC 14.12: π = (0.532071, 0.322717, 0.118721, 0.026490)
L_FULL, L_KEPT, S = -1.130978, -0.974077, 0.854789
D_FULL = [-0.532071, 0.677283, -0.118721, -0.026490]
D_KEPT = [-0.622459, 0.622459, 0.0, 0.0]


def _spec_example(path: str):
    z = torch.tensor([[LOGITS]], dtype=torch.float64, requires_grad=True)
    target = torch.tensor([[1]])
    if path == "hidden":  # the identity projection: the hidden states are the logits
        out = token_logprobs_from_hidden(z, torch.eye(4, dtype=torch.float64), target, chunk_size=1,
                                         truncation=(0, 0.8))
    else:
        out = token_logprobs(z, target, chunk_size=None if path == "plain" else 1, truncation=(0, 0.8))
    return z, out


def test_spec_example_kept_set():
    z = torch.tensor([LOGITS])
    assert sampling_keep_mask(z, torch.tensor([1]), top_p=0.8).tolist() == [[True, True, False, False]]
    # the sampled token is always kept, even where the sampler's set would not hold it (engine noise)
    assert sampling_keep_mask(z, torch.tensor([3]), top_p=0.8).tolist() == [[True, True, False, True]]
    assert sampling_keep_mask(z).all() and sampling_keep_mask(z, top_p=1.0, top_k=0).all()


@pytest.mark.parametrize("path", ["plain", "chunked", "hidden"])
def test_spec_example_values_and_gradients(path):
    z, (full, kept) = _spec_example(path)
    assert full.item() == pytest.approx(L_FULL, abs=1e-6)
    assert kept.item() == pytest.approx(L_KEPT, abs=1e-6)
    assert (kept - full).item() == pytest.approx(-math.log(S), abs=1e-6)  # Δ = log S = −0.156901
    g_full, = torch.autograd.grad(full.sum(), z, retain_graph=True)
    g_kept, = torch.autograd.grad(kept.sum(), z)
    assert g_full.flatten().tolist() == pytest.approx(D_FULL, abs=1e-6)
    assert g_kept.flatten().tolist() == pytest.approx(D_KEPT, abs=1e-6)


def test_the_sampler_correction_is_one_for_the_truncated_policy_and_s_for_the_full_one():
    """SPEC 14.12's numbers: the sampler's processed log-prob is ℓ^K (vLLM normalises over K), so the weight
    against the trainer's ℓ^K is 1 and against its full ℓ it is S, whichever token was drawn."""
    _, (full, kept) = _spec_example("plain")
    full, kept = full.detach().float(), kept.detach().float()
    mask = torch.ones(1, 1)
    spec = loss_spec(4, sampler_correction="token_tis", sampler_correction_cap=2.0)
    w_kept, _ = sampler_weights(kept, kept, mask, spec)
    w_full, _ = sampler_weights(full, kept, mask, spec)
    assert w_kept.item() == pytest.approx(1.0, abs=1e-6)
    assert w_full.item() == pytest.approx(S, abs=1e-6)


def test_top_k_then_top_p_over_the_renormalised_top_k():
    z = torch.tensor([LOGITS])
    # top-3 renormalised: (0.546549, 0.331498, 0.121953); before token 2: 0.878047 >= 0.8 → dropped
    assert sampling_keep_mask(z, top_k=3, top_p=0.8).tolist() == [[True, True, False, False]]
    # over the full distribution the mass before token 2 is 0.854789: at top_p 0.86 only the renormalised one drops it
    assert sampling_keep_mask(z, top_k=3, top_p=0.86).tolist() == [[True, True, False, False]]
    assert sampling_keep_mask(z, top_p=0.86).tolist() == [[True, True, True, False]]
    assert sampling_keep_mask(z, top_p=0.85).tolist() == [[True, True, False, False]]
    assert sampling_keep_mask(z, top_k=1).tolist() == [[True, False, False, False]]
    assert sampling_keep_mask(z, top_k=2).tolist() == [[True, True, False, False]]
    assert sampling_keep_mask(torch.tensor([[1.0, 1.0, 0.0]]), top_k=1).tolist() == [[True, True, False]]  # ties


@pytest.mark.parametrize("sampling", [Sampling(1, 1, top_p=0.7), Sampling(1, 1, top_k=3),
                                      Sampling(1, 1, top_k=5, top_p=0.6, temperature=0.7)])
def test_the_in_process_sampler_draws_exactly_the_replayed_set(sampling):
    torch.manual_seed(0)
    logits = torch.randn(6, 12) * 2
    draws = 4000
    rows = logits.repeat_interleave(draws, 0)
    drawn = sample_next(rows, sampling, torch.rand(rows.shape[0])).view(6, draws)
    kept = sampling_keep_mask(logits / sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
    for i in range(6):
        assert set(drawn[i].tolist()) == set(kept[i].nonzero().flatten().tolist())


def test_gradients_of_every_output_together_match_the_reference_and_finite_differences():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 7, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 7, (2, 5))

    def weighted(chunk):
        outs = token_logprobs(x, targets, chunk_size=chunk, temperature=0.8, entropy=True, truncation=(4, 0.7))
        return sum(o.sum() * c for o, c in zip(outs, (0.3, 0.5, 1.1)))

    assert torch.autograd.gradcheck(lambda _: weighted(3), (x,))
    g_chunked, = torch.autograd.grad(weighted(3), x)
    g_plain, = torch.autograd.grad(weighted(None), x)
    assert torch.allclose(g_chunked, g_plain, atol=1e-12)
    h = torch.randn(2, 5, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda h, w: token_logprobs_from_hidden(h, w, targets, chunk_size=4, temperature=0.8,
                                                truncation=(3, 0.9))[1].sum(), (h, w))


def test_bad_truncation_is_refused():
    z, t = torch.zeros(1, 1, 4), torch.tensor([[1]])
    with pytest.raises(ValueError, match="top_k must be an integer >= 0"):
        token_logprobs(z, t, truncation=(-1, 1.0))
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        token_logprobs(z, t, truncation=(0, 0.0))
    assert torch.equal(token_logprobs(z, t, truncation=(0, 1.0)), token_logprobs(z, t))  # nothing truncated


def test_the_kl_term_takes_kl_logp():
    logp, kl_logp = torch.tensor([[-0.9, -0.4]]), torch.tensor([[-1.2, -0.5]])
    ref = torch.tensor([[-1.0, -0.7]])
    adv, mask = torch.tensor([0.5]), torch.ones(1, 2)
    spec = loss_spec(2, beta=0.04)
    _, split = policy_loss(logp, logp, adv, mask, spec, ref_logp=ref, kl_logp=kl_logp)
    _, whole = policy_loss(kl_logp, kl_logp, adv, mask, spec, ref_logp=ref)
    assert split["kl"].item() == pytest.approx(whole["kl"].item(), abs=1e-7)
    assert split["ratio/mean"].item() == 1.0


# ---------------------------------------------------------------------------------------------------------
# the update (`grpo.learn.learn`)

def _run(model, exp, truncation, *, reference=None, beta=0.0, mu=1, **algo):
    model = copy.deepcopy(model)
    spec = loss_spec(8, beta=beta, aggregation="token_mean", num_iterations=mu, **algo)
    learner = Learner(LogprobModule(model), reference, torch.optim.SGD(model.parameters(), lr=0.1), spec, 1.0, 8,
                      max_rows=3, max_tokens=0, max_grad_norm=0.0, truncation=truncation)
    return learn(learner, exp, Dist()), torch.cat([p.detach().flatten() for p in model.parameters()])


def _logits(model, exp):
    lp = exp.prompt_ids.shape[1]
    ids = torch.cat([exp.prompt_ids, exp.completion_ids[:, :-1]], dim=1)
    attn = torch.cat([exp.prompt_mask, exp.completion_mask[:, :-1]], dim=1)
    position = (attn.cumsum(1) - 1).clamp(min=0)
    return model(input_ids=ids, attention_mask=attn, position_ids=position).logits[:, lp - 1:]


def _predicted(model, exp, truncation, reference=None, beta=0.0):
    """The weights after SGD (lr 0.1) on −Σ Â·ℓ^K / N + β·Σ k3(ℓ, ℓ_ref) / N, from the full logits: on policy (r = 1)
    the clip's gradient, the KL of the full-vocabulary log-probs."""
    manual = copy.deepcopy(model)
    full, kept = token_logprobs(_logits(manual, exp), exp.completion_ids, truncation=truncation)
    m = exp.loss_mask.float()
    loss = -(exp.advantages * kept * m).sum() / m.sum()
    if beta:
        with torch.no_grad():
            ref = token_logprobs(_logits(reference, exp), exp.completion_ids)
        x = ref - full
        loss = loss + beta * ((torch.expm1(x) - x) * m).sum() / m.sum()
    loss.backward()
    with torch.no_grad():
        return torch.cat([(p - 0.1 * p.grad).flatten() for p in manual.parameters()])


def test_the_update_takes_its_ratio_to_the_truncated_policy(setup):
    exp, model = setup
    truncation = (5, 0.9)
    _, w_kept = _run(model, exp, truncation)
    _, w_full = _run(model, exp, None)
    assert torch.allclose(w_kept, _predicted(model, exp, truncation), atol=1e-6)
    assert (w_kept - w_full).abs().max() > 1e-4  # the truncation changes the update


def test_the_kl_stays_full_vocabulary(setup):
    exp, model = setup
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * torch.randn_like(p))
    kept, w_kept = _run(model, exp, (5, 0.9), reference=LogprobModule(other), beta=0.04)
    full, _ = _run(model, exp, None, reference=LogprobModule(other), beta=0.04)
    assert kept[0]["kl"] > 1e-4
    assert kept[0]["kl"] == pytest.approx(full[0]["kl"], rel=1e-6)  # k3 of the full log-probs in both
    # and its gradient: the update is the predicted one, the KL's part from the full-vocabulary log-probs
    assert torch.allclose(w_kept, _predicted(model, exp, (5, 0.9), other, beta=0.04), atol=1e-6)


def test_reused_batches_take_the_old_log_probs_of_the_truncated_policy(setup):
    """With μ = 2 the old log-probs come from a pass of their own: ℓ^K at θ_old, so the first update's ratio is
    exactly 1 (it would be 1/S > 1 against full-vocabulary old log-probs) and its update is μ = 1's."""
    exp, model = setup
    (first, second), _ = _run(model, exp, (5, 0.9), mu=2)
    # the update's figures are sums over its tokens (mean × tokens), for `grpo.metrics` to reduce
    assert first["ratio/mean"] / first["tokens"] == pytest.approx(1.0, abs=1e-6) and first["clip/frac"] == 0
    assert second["ratio/mean"] / second["tokens"] != pytest.approx(1.0, abs=1e-4)  # the second is off-policy


def test_the_sampler_correction_compares_the_truncated_policies(setup):
    """An engine's processed log-probs are normalised over its kept set: against the trainer's ℓ^K the correction
    sees no mismatch, against the full ℓ it would see log S at every token."""
    exp, model = setup
    truncation = (5, 0.9)
    with torch.no_grad():
        full, kept = token_logprobs(_logits(model, exp), exp.completion_ids, truncation=truncation)
    exp.sampler_logp = torch.where(exp.completion_mask.bool(), kept, torch.zeros_like(kept))  # the engine's ℓ^K
    (stats,), _ = _run(model, exp, truncation, sampler_correction="token_tis", sampler_correction_cap=2.0)
    assert stats["mismatch/abs_diff"] < 1e-5 * stats["tokens"]
    (untruncated,), _ = _run(model, exp, None, sampler_correction="token_tis", sampler_correction_cap=2.0)
    assert untruncated["mismatch/abs_diff"] > 1e-2 * untruncated["tokens"]  # |log S| summed over the tokens


def _sorted_nucleus(z, top_k, top_p):
    """SPEC 14.12's K by a sort of the whole vocabulary, the reference for the top-k-first search, and each token's
    probability mass before it."""
    keep = torch.ones(z.shape, dtype=torch.bool)
    if 0 < top_k < z.shape[-1]:
        keep = z >= torch.topk(z, top_k, dim=-1).values[:, -1:]
    ordered, order = torch.sort(z.masked_fill(~keep, float("-inf")), dim=-1, descending=True)
    probs = torch.softmax(ordered, dim=-1)
    before = probs.cumsum(dim=-1) - probs
    return keep & (before < top_p).scatter(-1, order, before < top_p), before.scatter(-1, order, before)


@pytest.mark.parametrize("first", [1, 4, 64])
def test_the_nucleus_search_equals_a_full_sort(monkeypatch, first):
    """The nucleus is looked for among each row's `first` most likely tokens and rows that need more are sorted
    whole; with few candidates most rows take the second path, with 64 most take the first. The two sum the
    probabilities in another order, so a token whose preceding mass is within rounding of top_p may go either way."""
    import grpo.algo.logprobs as logprobs
    monkeypatch.setattr(logprobs, "_NUCLEUS_FIRST", first)
    torch.manual_seed(0)
    for scale in (0.3, 3.0, 10.0):
        z = torch.randn(200, 300) * scale
        for top_k in (0, 5, 100):
            for top_p in (0.1, 0.5, 0.9, 0.99):
                expected, before = _sorted_nucleus(z, top_k, top_p)
                differ = sampling_keep_mask(z, top_k=top_k, top_p=top_p) != expected
                assert all(abs(b - top_p) < 1e-6 for b in before[differ].tolist())
                assert differ.sum() <= 2
