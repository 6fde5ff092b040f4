"""algo.surrogate and algo.dual_clip reach the real update (`grpo.learn.learn`) as SPEC 13.2-13.4 predicts."""
import copy

import pytest
import torch

from grpo.collect import collect
from grpo.config import ModelConfig, load_config
from grpo.distributed import Dist
from grpo.learn import Learner, learn
from grpo.models import load_model
from grpo.policy import LogprobModule
from grpo.rewards import last_number

from algo_specs import loss_spec
from test_collect import Scripted, collector, stream

EPISODES = {"p0": ["so 1", "so 22"], "p1": ["it is 3", "1"]}  # rewards 1, 0 and 0, 1


@pytest.fixture
def setup(random_model_dir):
    exp = collect(collector(Scripted(EPISODES), [("last_number", last_number)]), stream(["p0", "p1"]), Dist())
    model, _ = load_model(ModelConfig(path=str(random_model_dir)))
    return exp, model


def run(model, exp, *, lr=0.1, mu=1, aggregation="seq_mean", **algo):
    model = copy.deepcopy(model)
    spec = loss_spec(8, beta=0.0, num_iterations=mu, aggregation=aggregation, **algo)
    learner = Learner(LogprobModule(model), None, torch.optim.SGD(model.parameters(), lr=lr), spec, 1.0, 8,
                      max_rows=8, max_tokens=0, max_grad_norm=0.0)
    return learn(learner, exp, Dist()), torch.cat([p.detach().flatten() for p in model.parameters()])


def test_sapo_on_policy_has_grpos_gradient_and_its_own_loss_value(setup):
    exp, model = setup
    clip, w_clip = run(model, exp)
    sapo, w_sapo = run(model, exp, surrogate="sapo", sapo_tau_pos=1.0, sapo_tau_neg=1.05)
    assert torch.allclose(w_clip, w_sapo, atol=1e-6)  # at r = 1 the gate's slope is 1
    adv = exp.advantages[:, 0]
    assert clip[0]["loss/policy"] == pytest.approx(0.0, abs=1e-6)  # seq_mean, μ = 1: 0 per group
    predicted = -(2 / 1.0 * adv[adv > 0].sum() + 2 / 1.05 * adv[adv <= 0].sum()).item() / len(adv)
    assert sapo[0]["loss/policy"] == pytest.approx(predicted, rel=1e-5)


def test_cispo_on_policy_has_the_dapo_gradient_and_a_value_that_scales_with_the_logprobs(setup):
    exp, model = setup
    dapo, w_dapo = run(model, exp, aggregation="token_mean")
    cispo, w_cispo = run(model, exp, aggregation="token_mean", surrogate="cispo", clip_low=1.0, clip_high=0.2)
    assert torch.allclose(w_dapo, w_cispo, atol=1e-6)  # weight sg(clip(1)) = 1
    with torch.no_grad():
        logp = LogprobModule(model)(exp.prompt_ids, exp.prompt_mask, exp.completion_ids, exp.completion_mask,
                                    temperature=1.0, chunk_size=8).double()
    m = exp.loss_mask.double()
    predicted = -(exp.advantages.double() * logp * m).sum() / m.sum()
    assert cispo[0]["loss/policy"] == pytest.approx(predicted.item(), rel=1e-5)


@pytest.mark.parametrize("surrogate", ["dppo_tv", "dppo_kl"])
def test_dppo_on_policy_has_the_dapo_gradient_and_masks_in_the_second_update(setup, surrogate):
    exp, model = setup
    dapo, w_dapo = run(model, exp, aggregation="token_mean")
    dppo, w_dppo = run(model, exp, aggregation="token_mean", surrogate=surrogate)
    assert torch.allclose(w_dapo, w_dppo, atol=1e-6)  # at r = 1 (p = q) nothing is masked and the weight is 1
    assert dppo[0]["clip/frac"] == 0
    with torch.no_grad():
        logp = LogprobModule(model)(exp.prompt_ids, exp.prompt_mask, exp.completion_ids, exp.completion_mask,
                                    temperature=1.0, chunk_size=8).double()
    m = exp.loss_mask.double()
    assert dppo[0]["loss/policy"] == pytest.approx((-(exp.advantages.double() * logp * m).sum() / m.sum()).item(),
                                                   rel=1e-5)  # verl's value: −Â·ℓ on policy
    # a large first step moves the probabilities: in the second update of the batch the mask binds
    moved, _ = run(model, exp, lr=30.0, mu=2, aggregation="token_mean", surrogate=surrogate, dppo_tv_low=0.01,
                   dppo_tv_high=0.01, dppo_kl_low=0.001, dppo_kl_high=0.001)
    assert moved[0]["clip/frac"] == 0 and moved[1]["clip/frac"] > 0


def test_dual_clip_binds_in_the_second_update_only(setup):
    exp, model = setup
    plain, w_plain = run(model, exp, lr=30.0, mu=2)
    dual, w_dual = run(model, exp, lr=30.0, mu=2, dual_clip=1.05)
    assert dual[0]["clip/dual_frac"] == 0  # the first update is at r = 1
    assert dual[1]["clip/dual_frac"] > 0 and not torch.equal(w_plain, w_dual)
    assert dual[0]["loss"] == plain[0]["loss"]


def test_config_keys_and_presets():
    cfg = load_config(None, ["algo.preset=sapo"])
    assert (cfg.algo.surrogate, cfg.algo.sapo_tau_pos, cfg.algo.sapo_tau_neg) == ("sapo", 1.0, 1.05)
    cfg = load_config(None, ["algo.preset=cispo"])
    assert (cfg.algo.surrogate, cfg.algo.clip_low, cfg.algo.aggregation) == ("cispo", 1.0, "token_mean")
    assert load_config(None, ["algo.dual_clip=3"]).algo.dual_clip == 3.0


def _entropies(model, exp):
    with torch.no_grad():  # an independent computation from the full logits
        ids = torch.cat([exp.prompt_ids, exp.completion_ids[:, :-1]], 1)
        attn = torch.cat([exp.prompt_mask, exp.completion_mask[:, :-1]], 1)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, exp.prompt_ids.shape[1] - 1:]
        p = torch.softmax(logits.double(), -1)
        return -(p * p.clamp(min=1e-300).log()).sum(-1)


def test_entropy_is_logged_from_the_training_pass(setup):
    exp, model = setup
    updates, _ = run(model, exp)
    h, m = _entropies(model, exp), exp.loss_mask.bool()
    assert updates[0]["entropy"] / updates[0]["tokens"] == pytest.approx(h[m].mean().item(), rel=1e-5)
    assert sum(updates[0][f"entropy/q{k}_tokens"] for k in range(1, 5)) == updates[0]["tokens"]


def test_top_entropy_masking_trains_only_the_kept_tokens(setup):
    from grpo.experience import Experience

    exp, model = setup
    masked, w_masked = run(model, exp, top_entropy_quantile=0.3, aggregation="token_mean")
    h, m = _entropies(model, exp), exp.loss_mask.bool()
    keep = (h >= torch.quantile(h[m], 0.7)) & m
    assert 0 < keep.sum() < m.sum()
    # the same update as plain training with the advantages of the other tokens set to 0 (the normaliser unchanged)
    zeroed = Experience(**{**exp.__dict__, "advantages": exp.advantages * keep.to(exp.advantages.dtype)})
    _, w_zeroed = run(model, zeroed, aggregation="token_mean")
    assert torch.allclose(w_masked, w_zeroed, atol=1e-6)
    _, w_plain = run(model, exp, aggregation="token_mean")
    assert not torch.allclose(w_masked, w_plain, atol=1e-6)


# ---- SPEC 14.5 and 14.7 through the update

def mean_entropy(model, exp):
    with torch.no_grad():
        _, h = LogprobModule(model)(exp.prompt_ids, exp.prompt_mask, exp.completion_ids, exp.completion_mask,
                                    temperature=1.0, chunk_size=8, entropy=True)
    m = exp.loss_mask.double()
    return ((h.double() * m).sum() / m.sum()).item()


def test_the_entropy_bonus_is_logged_as_predicted_and_raises_the_entropy(setup):
    exp, model = setup
    zero = exp.__class__(**{**exp.__dict__, "advantages": torch.zeros_like(exp.advantages)})  # no policy gradient
    before = mean_entropy(model, zero)
    updates, _ = run(model, zero, lr=0.5, entropy_coef=0.1)
    assert updates[0]["loss/entropy"] == pytest.approx(-0.1 * before, rel=1e-5)
    assert updates[0]["entropy_coef"] == 0.1
    moved = copy.deepcopy(model)
    learner = Learner(LogprobModule(moved), None, torch.optim.SGD(moved.parameters(), lr=0.5),
                      loss_spec(8, beta=0.0, entropy_coef=0.1), 1.0, 8, max_rows=3, max_tokens=0, max_grad_norm=0.0)
    assert learn(learner, zero, Dist())[0]["loss/entropy"] == pytest.approx(updates[0]["loss/entropy"], rel=1e-6)
    assert mean_entropy(moved, zero) > before + 1e-4  # micro-batches of 3 rows: the same update, entropy up
    plain, _ = run(model, zero, lr=0.5)
    assert "loss/entropy" not in plain[0] and "entropy_coef" not in plain[0]


def test_the_adaptive_entropy_coefficient_moves_after_each_optimiser_step(setup):
    from grpo.learn import EntropyControl
    exp, model = setup
    model = copy.deepcopy(model)
    control = EntropyControl(0.02)
    spec = loss_spec(8, beta=0.0, num_iterations=3, use_adaptive_entropy=True, entropy_coef=0.02, entropy_target=50.0)
    learner = Learner(LogprobModule(model), None, torch.optim.SGD(model.parameters(), lr=0.1), spec, 1.0, 8,
                      max_rows=8, max_tokens=0, max_grad_norm=0.0, entropy=control)
    updates = learn(learner, exp, Dist())
    # step 1 applies none (H_0 = +∞); every entropy is below the target, so c grows by Δ = 0.005 a step
    assert [u["entropy_coef"] for u in updates] == pytest.approx([0.0, 0.025, 0.030])
    assert updates[0]["loss/entropy"] == 0 and updates[1]["loss/entropy"] < 0
    assert control.coef == pytest.approx(0.035) and control.last_entropy == pytest.approx(mean_entropy(model, exp),
                                                                                           rel=1e-2)


def test_opsm_drops_drifted_negative_sequences_in_the_second_update_only(setup):
    exp, model = setup
    updates, _ = run(model, exp, lr=30.0, mu=2, off_policy_mask_threshold=0.01)
    assert updates[0]["opsm/masked_frac"] == 0  # old = the current policy: the statistic is 0
    masked = updates[1]["opsm/masked_frac"] / updates[1]["tokens"]  # learn's figures are sums over the tokens
    assert 0 < masked < 1  # negative-advantage sequences only


def test_unbiased_kl_on_policy_keeps_the_kl_value_and_changes_its_gradient(setup, random_model_dir):
    exp, model = setup
    reference, _ = load_model(ModelConfig(path=str(random_model_dir)))
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(0)))

    def kl_run(unbiased):
        moved = copy.deepcopy(model)
        learner = Learner(LogprobModule(moved), LogprobModule(reference), torch.optim.SGD(moved.parameters(), lr=1.0),
                          loss_spec(8, beta=0.5, unbiased_kl=unbiased), 1.0, 8, max_rows=8, max_tokens=0,
                          max_grad_norm=0.0)
        return learn(learner, exp, Dist())[0], torch.cat([p.detach().flatten() for p in moved.parameters()])

    (plain, w_plain), (fixed, w_fixed) = kl_run("off"), kl_run("prox")
    assert plain["loss/kl"] > 0 and fixed["loss/kl"] == pytest.approx(plain["loss/kl"], rel=1e-6)  # r = 1
    assert not torch.allclose(w_plain, w_fixed, atol=1e-7)  # ∇(r·k3) = ∇k3 + k3·∇ℓ
    behaviour, w_behaviour = kl_run("behaviour")  # no sampler of its own: w = 1, the same as prox
    assert torch.equal(w_behaviour, w_fixed)


def test_steps_per_generation_updates_each_mini_batch_against_the_sampling_weights(setup, monkeypatch):
    # SPEC 14.8: two mini-batches of one group each; the second runs one update later, against π_old at θ_vprox
    import grpo.learn as learn_module
    from grpo.learn import mini_batch_rows
    exp, model = setup
    assert mini_batch_rows(exp.group, 2) == [[0, 1], [2, 3]] and mini_batch_rows(torch.tensor([0, 0, 1, 1, 2, 2, 3, 3]),
                                                                                   2) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    with torch.no_grad():
        sampling = LogprobModule(model)(exp.prompt_ids, exp.prompt_mask, exp.completion_ids, exp.completion_mask,
                                        temperature=1.0, chunk_size=8)
    seen, real = [], learn_module.policy_loss

    def spy(logp, old, adv, mask, *args, **kw):
        seen.append((logp.detach().clone(), old.clone(), mask.clone()))
        return real(logp, old, adv, mask, *args, **kw)

    monkeypatch.setattr(learn_module, "policy_loss", spy)
    moved = copy.deepcopy(model)
    learner = Learner(LogprobModule(moved), None, torch.optim.SGD(moved.parameters(), lr=1.0), loss_spec(8, beta=0.0),
                      1.0, 8, max_rows=8, max_tokens=0, max_grad_norm=0.0, steps_per_generation=2)
    updates = learn(learner, exp, Dist())
    assert len(updates) == 2 and [u["tokens"] for u in updates] == [exp.loss_mask[:2].sum(), exp.loss_mask[2:].sum()]
    (lp1, old1, m1), (lp2, old2, m2) = seen
    width = old2.shape[1]
    assert torch.equal(old2, sampling[2:, :width])  # π_old of mini-batch 2: the weights before the first update
    assert torch.equal(old1, sampling[:2, :old1.shape[1]])
    assert not torch.allclose(lp2[m2.bool()], old2[m2.bool()], atol=1e-4)  # the first update moved the policy
    assert updates[0]["ratio/mean"] == pytest.approx(updates[0]["tokens"])  # a sum: r = 1 on every token
    assert updates[1]["ratio/mean"] != pytest.approx(updates[1]["tokens"], rel=1e-6)
