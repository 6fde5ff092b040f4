"""Packed forward passes (`compute.packing`): the attended tokens alone, no padding, give the unpacked forward's
log-probs, entropies, kept-set log-probs and parameter gradients (float32, to 1e-5), on the lean path and on
transformers' path (fused, full logits, LoRA, gradient checkpointing), with shared prompts or not, left-padded
prompts of different lengths, long-tailed completion lengths and multi-turn masks; and the packed forward falls back,
saying why, where it cannot apply."""
import copy

import pytest
import torch

import grpo.policy.forward as fwd
from grpo.config import LoraConfig, ModelConfig
from grpo.distributed import Dist
from grpo.learn import Learner, learn
from grpo.models import load_model
from grpo.policy import LogprobModule, packing_unavailable
from grpo.policy.inputs import packed_inputs

from algo_specs import loss_spec
from test_lean_decoding import CASES, build
from test_learn_masks import setup, with_tools  # noqa: F401 - setup is a fixture

PROMPTS = ["Calculate 1 + 2 * 3 =", "Solve y = 2x + 1 for x = 2, y =", "Hi", "a"]  # left-padded, 4 lengths


def batch(tok, g=3, width=17, seed=3, tools=False):
    """g completions per prompt, most of 1-3 tokens and one of `width` (a long tail), right-padded; with `tools`,
    a multi-turn episode: tokens a tool inserted are attended (completion mask 1) and not learned (loss mask 0).
    (prompt ids, prompt mask, completion ids, completion mask, loss mask)."""
    enc = tok(PROMPTS, return_tensors="pt", padding=True, padding_side="left")
    prompt_ids, prompt_mask = enc["input_ids"].repeat_interleave(g, 0), enc["attention_mask"].repeat_interleave(g, 0)
    gen = torch.Generator().manual_seed(seed)
    n = len(PROMPTS) * g
    ids = torch.randint(3, len(tok), (n, width), generator=gen)
    lengths = torch.randint(1, 4, (n, 1), generator=gen)
    lengths[4] = width
    if tools:
        lengths[1], lengths[7] = 9, 12
    mask = (torch.arange(width) < lengths).long()
    ids[mask == 0] = tok.pad_token_id
    loss_mask = mask.clone()
    if tools:
        loss_mask[4, 3:10] = 0  # tool output inside the long episode
        loss_mask[1, 2:5] = 0
        loss_mask[7, 6:8] = 0
    return prompt_ids, prompt_mask, ids, mask, loss_mask


def outputs_and_grads(model, data, path, module=None):
    """The log-probs, entropies and kept-set log-probs (zeroed where not attended) and the gradients of a loss of
    all three over the learned tokens."""
    prompt_ids, prompt_mask, ids, mask, loss_mask = data
    model.zero_grad(set_to_none=True)
    module = module or LogprobModule(model, path)
    out = module(prompt_ids, prompt_mask, ids, mask, temperature=0.7, chunk_size=5, entropy=True,
                 truncation=(5, 0.9))
    weights = torch.linspace(-1.0, 1.0, ids.numel()).view(ids.shape)
    loss = sum(((o * loss_mask) * weights * (k + 1)).sum() for k, o in enumerate(out))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert grads
    return [o * mask for o in out], grads


def assert_same(model, data, unpacked, packed, module=None, packed_module=None):
    assert packed.packing and not unpacked.packing
    want, want_grads = outputs_and_grads(model, data, unpacked, module)
    got, got_grads = outputs_and_grads(model, data, packed, packed_module)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    assert got_grads.keys() == want_grads.keys()
    for name, g in want_grads.items():
        torch.testing.assert_close(got_grads[name], g, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("arch,attn,extra", CASES)
@pytest.mark.parametrize("share", [True, False])
@pytest.mark.parametrize("tools", [False, True])
def test_lean_packed_equals_unpacked(arch, attn, extra, share, tools):
    model, tok = build(arch, attn, **extra)
    model.train()  # as in the update (no dropout in these configs)
    unpacked = fwd.forward_path(model, share_prompt=share, lean=True)
    packed = fwd.forward_path(model, share_prompt=share, lean=True, packing=True)
    assert packed == fwd.ForwardPath(share_prompt=share, lean=True, packing=True)
    assert_same(model, batch(tok, tools=tools), unpacked, packed)


@pytest.mark.parametrize("arch,attn", [("qwen2", "sdpa"), ("qwen2", "eager"), ("llama", "sdpa"), ("llama", "eager")])
@pytest.mark.parametrize("fused", [True, False])  # False: full logits, FSDP's path
@pytest.mark.parametrize("tools", [False, True])
def test_transformers_packed_row_equals_unpacked(arch, attn, fused, tools):
    model, tok = build(arch, attn)
    model.train()
    unpacked = fwd.ForwardPath(fused=fused)
    packed = fwd.forward_path(model, packing=True)
    assert packed == fwd.ForwardPath(packing=True)  # transformers' forward: neither lean nor shared prompts
    assert_same(model, batch(tok, tools=tools), unpacked, fwd.ForwardPath(fused=fused, packing=True))


def test_transformers_packed_row_with_gradient_checkpointing():
    model, tok = build("llama")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    packed = fwd.forward_path(model, share_prompt=True, lean=True, packing=True)
    assert packed == fwd.ForwardPath(packing=True)  # checkpointing: no shared prompts, no lean path; packed
    assert_same(model, batch(tok), fwd.forward_path(model, share_prompt=True, lean=True), packed)


def lora_model(random_model_dir):
    model, tok = load_model(ModelConfig(path=str(random_model_dir)), LoraConfig(rank=4))
    torch.manual_seed(1)
    with torch.no_grad():  # a trained adapter (B starts at 0)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    return model, tok


@pytest.mark.parametrize("adapter_off", [False, True])  # the policy, and the reference (its adapter disabled)
def test_lora_packed_equals_unpacked(random_model_dir, adapter_off):
    model, tok = lora_model(random_model_dir)
    unpacked = fwd.forward_path(model, share_prompt=False, lean=True)
    packed = fwd.forward_path(model, share_prompt=False, lean=True, packing=True)
    assert not packed.lean and packed.packing
    data = batch(tok, tools=True)
    if adapter_off:  # no gradient reaches the frozen base weights: compare the outputs alone
        with torch.no_grad():
            want = LogprobModule(model, unpacked, adapter_off=True)(*data[:4], temperature=0.7, chunk_size=5,
                                                                    entropy=True)
            got = LogprobModule(model, packed, adapter_off=True)(*data[:4], temperature=0.7, chunk_size=5,
                                                                 entropy=True)
            on = LogprobModule(model, packed)(*data[:4], temperature=0.7, chunk_size=5)
        for w, g in zip(want, got):
            torch.testing.assert_close(g * data[3], w * data[3], atol=1e-5, rtol=1e-5)
        assert not torch.allclose(on * data[3], got[0] * data[3], atol=1e-3)  # the adapter was off
    else:
        assert_same(model, data, unpacked, packed)
        assert all(p.requires_grad == ("lora_" in n) for n, p in model.named_parameters())


def test_packed_inputs_hold_the_attended_tokens_alone():
    _, tok = build("qwen2")
    prompt_ids, prompt_mask, ids, mask, _ = batch(tok)
    b = len(ids)
    fed = mask[:, :-1].sum()
    rows = torch.arange(b)
    packed = packed_inputs(prompt_ids, prompt_mask, ids, mask, rows, rows)
    assert len(packed.input_ids) == prompt_mask.sum() + fed  # each row's prompt and completion, no padding
    # sequence after sequence, each from position 0: [prompt 0, completion 0, prompt 1, ...]
    starts = (packed.position_ids == 0).nonzero().squeeze(1)
    lengths = prompt_mask.sum(1) + mask[:, :-1].sum(1)
    assert starts.tolist() == (lengths.cumsum(0) - lengths).tolist()
    assert packed.position_ids.tolist() == [i for n in lengths.tolist() for i in range(n)]
    assert packed.input_ids[:prompt_mask[0].sum()].tolist() == prompt_ids[0, prompt_mask[0].bool()].tolist()
    assert torch.equal(packed.wanted, mask.bool())
    before = torch.cat([prompt_ids[:, -1:], ids[:, :-1]], dim=1)  # the token before each completion token
    assert torch.equal(packed.input_ids.index_select(0, packed.predictors), before[packed.wanted])
    # shared prompts: each group's prompt once
    first, group = fwd.prompt_groups(prompt_ids, prompt_mask)
    shared = packed_inputs(prompt_ids, prompt_mask, ids, mask, group, first)
    assert len(first) == len(PROMPTS)
    assert len(shared.input_ids) == prompt_mask[first].sum() + fed


def test_the_passes_see_no_padding():
    """The lean MLPs run over the attended tokens alone; transformers' decoder over one row of them."""
    model, tok = build("llama")
    prompt_ids, prompt_mask, ids, mask, _ = batch(tok)
    first, _ = fwd.prompt_groups(prompt_ids, prompt_mask)
    fed = int(mask[:, :-1].sum())
    seen = []
    rows = lambda m, a, out: seen.append(a[0].numel() // a[0].shape[-1])  # noqa: E731 - positions into the MLP
    hooks = [model.model.layers[0].mlp.act_fn.register_forward_hook(rows),
             model.get_decoder().register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"].shape),
                                                           with_kwargs=True)]
    try:
        with torch.no_grad():
            for share, lean in [(True, True), (False, True), (False, False)]:
                path = fwd.forward_path(model, share_prompt=share, lean=lean, packing=True)
                fwd.completion_logprobs(model, prompt_ids, prompt_mask, ids, mask, temperature=1.0, chunk_size=4,
                                        path=path)
    finally:
        for h in hooks:
            h.remove()
    prompts = int(prompt_mask.sum())
    assert seen[:2] == [int(prompt_mask[first].sum()) + fed, prompts + fed]
    assert seen[2] == (1, prompts + fed) and seen[3] == prompts + fed


def test_an_update_with_packing_is_the_unpacked_update(setup):  # noqa: F811 - the fixture
    """A whole update (`grpo.learn.learn`): multi-turn masks, a frozen reference, old log-probs reused (μ = 2),
    several micro-batches, the entropy bonus: the same figures and the same weights after it."""
    exp, model = setup
    exp = with_tools(exp)
    results = []
    for packing in (False, True):
        policy, reference = copy.deepcopy(model), copy.deepcopy(model)
        path = fwd.forward_path(policy, share_prompt=True, lean=True, packing=packing)
        assert path.packing == packing and path.lean
        learner = Learner(LogprobModule(policy, path), LogprobModule(reference, path),
                          torch.optim.SGD(policy.parameters(), lr=0.1),
                          loss_spec(8, beta=0.04, num_iterations=2, entropy_coef=0.01), 1.0, 8, max_rows=3,
                          max_tokens=0, max_grad_norm=0.0)
        figures = learn(learner, exp, Dist())
        results.append((figures, torch.cat([p.detach().flatten() for p in policy.parameters()])))
    (want, want_w), (got, got_w) = results
    for w, g in zip(want, got):
        assert w.keys() == g.keys()
        for k in w:
            if isinstance(w[k], float):
                assert g[k] == pytest.approx(w[k], rel=1e-5, abs=1e-6), k
    torch.testing.assert_close(got_w, want_w, atol=1e-6, rtol=1e-5)


def test_falls_back_where_packing_cannot_apply():
    model, _ = build("qwen2")
    # share_prompt on transformers' path: its cached prompts need the rows in full
    path = fwd.forward_path(model, share_prompt=True, lean=False, packing=True)
    assert path.share_prompt and not path.packing
    assert "share_prompt" in packing_unavailable(model, share_prompt=True, lean=False)
    assert fwd.forward_path(model, share_prompt=True, lean=True, packing=True).packing  # the lean path packs
    model, _ = build("mistral", sliding_window=4)
    path = fwd.forward_path(model, lean=True, packing=True)
    assert not path.lean and not path.packing
    assert "sliding-window" in packing_unavailable(model, share_prompt=False, lean=False)
    model, _ = build("llama", "flex_attention")
    assert "attention 'flex_attention'" in packing_unavailable(model, share_prompt=False, lean=False)
    model, _ = build("qwen2")
    model.config.rope_parameters = {**model.config.rope_parameters, "mrope_section": [2, 2, 4]}
    assert "multimodal" in packing_unavailable(model, share_prompt=False, lean=False)
    assert not fwd.forward_path(model, packing=True).packing
    assert fwd.forward_path(model) == fwd.ForwardPath()  # packing asked for only where it is given


@pytest.mark.parametrize("lean_on", [True, False])
def test_cut_groups_unpadded_prompts_and_single_tokens(lean_on):
    model, tok = build("qwen2")
    model.train()
    prompt_ids, prompt_mask, ids, mask, loss_mask = batch(tok)
    cases = [
        (prompt_ids[2:7], prompt_mask[2:7], ids[2:7], mask[2:7], loss_mask[2:7]),  # groups cut by a micro-batch
        (prompt_ids[:3, -1:], prompt_mask[:3, -1:], ids[:3], mask[:3], loss_mask[:3]),  # no prompt padding
        (prompt_ids, prompt_mask, ids[:, :1], mask[:, :1], loss_mask[:, :1]),  # one completion token
    ]
    for data in cases:
        assert_same(model, data, fwd.forward_path(model, share_prompt=lean_on, lean=lean_on),
                    fwd.forward_path(model, share_prompt=lean_on, lean=lean_on, packing=True))


@pytest.mark.parametrize("lean_on", [True, False])
def test_bf16_autocast_packed_matches_unpacked(lean_on):
    model, tok = build("llama", attention_bias=True, mlp_bias=True)
    data = batch(tok, tools=True)
    paths = [fwd.forward_path(model, share_prompt=lean_on, lean=lean_on, packing=p, autocast_bf16=True)
             for p in (False, True)]
    assert paths[1].packing and paths[1].autocast_bf16
    (want, want_grads), (got, got_grads) = (outputs_and_grads(model, data, p) for p in paths)
    # the same bfloat16 operations; packing only changes the matmuls' row counts
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, atol=2e-2, rtol=0)
    for name, g in want_grads.items():
        scale = g.abs().max().item() + 1e-6
        assert (got_grads[name] - g).abs().max().item() <= 2e-2 * scale, name
