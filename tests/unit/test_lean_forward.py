"""The lean training forward (grpo.policy.lean.completion_hidden, via a lean forward_path) gives transformers'
log-probs and gradients, and steps aside wherever transformers' forward would do something else."""
import pytest
import torch

import grpo.policy.forward as fwd
from grpo.policy import lean
from tests.unit.test_lean_decoding import CASES, PROMPTS, build


def batch(tok, prompts=PROMPTS, g=2, width=6, seed=1):
    """g completions per prompt, of ragged lengths (right padding), prompts left-padded."""
    enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left")
    prompt_ids, prompt_mask = enc["input_ids"].repeat_interleave(g, 0), enc["attention_mask"].repeat_interleave(g, 0)
    gen = torch.Generator().manual_seed(seed)
    n = len(prompts) * g
    ids = torch.randint(3, len(tok), (n, width), generator=gen)
    lengths = torch.randint(1, width + 1, (n, 1), generator=gen)
    lengths[0] = width  # at least one full row
    return prompt_ids, prompt_mask, ids, (torch.arange(width) < lengths).long()


def logprobs_and_grads(model, data, *, lean_on: bool, share: bool, bf16: bool = False):
    prompt_ids, prompt_mask, ids, mask = data
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        out = fwd.completion_logprobs(model, prompt_ids, prompt_mask, ids, mask, temperature=0.7, chunk_size=5,
                                      path=fwd.forward_path(model, share_prompt=share, lean=lean_on))
    (out * mask).sum().backward()
    return out * mask, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("arch,attn,extra", CASES)
@pytest.mark.parametrize("share", [True, False])
def test_logprobs_and_gradients_match_transformers(arch, attn, extra, share):
    model, tok = build(arch, attn, **extra)
    model.train()  # as in the update (no dropout in these configs)
    assert lean.supported_for_training(model)
    data = batch(tok)
    want, want_grads = logprobs_and_grads(model, data, lean_on=False, share=share)
    got, got_grads = logprobs_and_grads(model, data, lean_on=True, share=share)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for name, g in want_grads.items():
        torch.testing.assert_close(got_grads[name], g, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("arch,attn,extra", CASES[:3])
def test_bf16_autocast_matches_transformers(arch, attn, extra):
    model, tok = build(arch, attn, **extra)
    data = batch(tok)
    want, want_grads = logprobs_and_grads(model, data, lean_on=False, share=True, bf16=True)
    got, got_grads = logprobs_and_grads(model, data, lean_on=True, share=True, bf16=True)
    # the same bfloat16 operations; the flat batch only changes the matmuls' row counts
    torch.testing.assert_close(got, want, atol=2e-2, rtol=0)
    for name, g in want_grads.items():
        scale = g.abs().max().item() + 1e-6
        assert (got_grads[name] - g).abs().max().item() <= 2e-2 * scale, name


@pytest.mark.parametrize("rows", [slice(0, 6), slice(1, 5)])  # whole groups, and groups cut by a micro-batch
def test_no_prompt_padding_single_token_and_cut_groups(rows):
    model, tok = build("qwen2")
    cases = [
        tuple(x[rows] for x in batch(tok)),
        batch(tok, prompts=["abc", "xyz", "cab"]),  # no padding: plain causal attention over the prompts
        batch(tok, width=1),  # one completion token: only the prompts' last positions
    ]
    for data in cases:
        want, want_grads = logprobs_and_grads(model, data, lean_on=False, share=True)
        got, got_grads = logprobs_and_grads(model, data, lean_on=True, share=True)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        for name, g in want_grads.items():
            torch.testing.assert_close(got_grads[name], g, atol=1e-5, rtol=1e-4, msg=name)


def test_lean_path_does_not_call_the_decoder():
    model, tok = build("llama")
    calls = []
    hook = model.get_decoder().register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with torch.no_grad():
            fwd.completion_logprobs(model, *batch(tok), temperature=1.0, chunk_size=4,
                                    path=fwd.forward_path(model, share_prompt=True, lean=True))
        assert calls == []
        with torch.no_grad():
            fwd.completion_logprobs(model, *batch(tok), temperature=1.0, chunk_size=4,
                                    path=fwd.forward_path(model, share_prompt=True))
        assert calls  # without lean, transformers' decoder runs
    finally:
        hook.remove()


def test_falls_back_where_transformers_would_differ():
    model, _ = build("qwen2")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert not lean.supported_for_training(model)  # recomputation saves memory: keep it
    model, _ = build("qwen2", attention_dropout=0.1)
    assert lean.supported_for_training(model)  # eval mode: no dropout
    model.train()
    assert not lean.supported_for_training(model)
    model, _ = build("mistral", sliding_window=4)
    assert not lean.supported_for_training(model)
