"""completion_logprobs: the fused hidden-state path equals full logits, and padding changes nothing."""
import pytest
import torch
import transformers

import grpo.policy.forward as fwd


@pytest.fixture(scope="module")
def model_and_tok(random_model_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(random_model_dir, dtype=torch.float64)
    return model.eval(), transformers.AutoTokenizer.from_pretrained(random_model_dir)


def manual(model, tok, prompt, completion_ids, temperature):
    ids = torch.tensor([tok.encode(prompt) + completion_ids])
    logits = model(input_ids=ids).logits[0, -len(completion_ids) - 1:-1] / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion_ids).unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("fused", [True, False])
def test_matches_one_sequence_at_a_time(model_and_tok, fused):
    model, tok = model_and_tok
    prompts = ["Calculate 1 + 2 =", "Hi"]
    completions = [tok.encode(" 3") + [tok.eos_token_id], tok.encode(" there!")]
    enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left")
    width = max(map(len, completions))
    ids = torch.full((2, width), tok.pad_token_id)
    mask = torch.zeros(2, width, dtype=torch.long)
    for i, c in enumerate(completions):
        ids[i, :len(c)] = torch.tensor(c)
        mask[i, :len(c)] = 1
    out = fwd.completion_logprobs(model, enc["input_ids"], enc["attention_mask"], ids, mask, temperature=0.7,
                                  chunk_size=3, path=fwd.ForwardPath(fused=fused))
    assert out.dtype == torch.float64
    for i in range(2):
        ref = manual(model, tok, prompts[i], completions[i], 0.7)
        assert torch.allclose(out[i, :len(completions[i])], ref, atol=1e-10)


def test_gradients_of_fused_and_logits_paths_agree(model_and_tok):
    model, tok = model_and_tok
    enc = tok(["ab", "abcd"], return_tensors="pt", padding=True, padding_side="left")
    ids = torch.tensor([tok.encode("xyz"), tok.encode("uvw")])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    grads = []
    for fused in (True, False):
        model.zero_grad()
        out = fwd.completion_logprobs(model, enc["input_ids"], enc["attention_mask"], ids, mask, temperature=1.0,
                                      chunk_size=2, path=fwd.ForwardPath(fused=fused))
        (out * mask).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-10)


def grouped_batch(tok, g=3):
    """Two prompts of different lengths (left padding), g completions each, ragged completion lengths."""
    enc = tok(["Calculate 1 + 2 =", "Hi"], return_tensors="pt", padding=True, padding_side="left")
    prompt_ids, prompt_mask = enc["input_ids"].repeat_interleave(g, 0), enc["attention_mask"].repeat_interleave(g, 0)
    torch.manual_seed(1)
    ids = torch.randint(2, len(tok), (2 * g, 6))
    mask = (torch.arange(6) < torch.randint(1, 7, (2 * g, 1))).long()
    return prompt_ids, prompt_mask, ids, mask


def test_prompt_groups_are_runs_of_equal_prompts(model_and_tok):
    _, tok = model_and_tok
    prompt_ids, prompt_mask, _, _ = grouped_batch(tok)
    first, group = fwd.prompt_groups(prompt_ids, prompt_mask)
    assert first.tolist() == [0, 3] and group.tolist() == [0, 0, 0, 1, 1, 1]
    # a run boundary wherever the prompt changes, even back to an earlier prompt
    first, group = fwd.prompt_groups(prompt_ids[[0, 3, 0]], prompt_mask[[0, 3, 0]])
    assert first.tolist() == [0, 1, 2] and group.tolist() == [0, 1, 2]


@pytest.mark.parametrize("rows", [slice(0, 6), slice(1, 5)])  # whole groups, and groups cut by a micro-batch
def test_shared_prompt_equals_full_rows_in_values_and_gradients(model_and_tok, rows):
    model, tok = model_and_tok
    prompt_ids, prompt_mask, ids, mask = (x[rows] for x in grouped_batch(tok))
    results = []
    for share in (False, True):
        model.zero_grad()
        out = fwd.completion_logprobs(model, prompt_ids, prompt_mask, ids, mask, temperature=0.7, chunk_size=4,
                                      path=fwd.forward_path(model, share_prompt=share))
        (out * mask).sum().backward()
        results.append((out * mask, [p.grad.clone() for p in model.parameters()]))
    (a, grads_a), (b, grads_b) = results
    assert torch.allclose(a, b, atol=1e-10)
    # Qwen2's RMSNorm computes in float32 even in a float64 model, so the two orders of summation agree to
    # float32 rounding (~4e-7 here); a shared prompt whose keys and values got no gradient is off by ~3
    for x, y in zip(grads_a, grads_b):
        assert torch.allclose(x, y, atol=1e-5)


def test_shared_prompt_runs_each_prompt_once(model_and_tok):
    model, tok = model_and_tok
    prompt_ids, prompt_mask, ids, mask = grouped_batch(tok)
    seen = []
    hook = model.get_decoder().register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"].shape),
                                                         with_kwargs=True)
    try:
        fwd.completion_logprobs(model, prompt_ids, prompt_mask, ids, mask, temperature=1.0, chunk_size=4,
                                path=fwd.forward_path(model, share_prompt=True))
    finally:
        hook.remove()
    assert seen == [(2, prompt_ids.shape[1]), (6, ids.shape[1] - 1)]
