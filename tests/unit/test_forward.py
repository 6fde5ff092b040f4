"""completion_logprobs: the fused hidden-state path equals full logits, and padding changes nothing."""
import pytest
import torch
import transformers

import grpo.forward as fwd


@pytest.fixture(scope="module")
def model_and_tok(random_model_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(random_model_dir, dtype=torch.float64)
    return model.eval(), transformers.AutoTokenizer.from_pretrained(random_model_dir)


def manual(model, tok, prompt, completion_ids, temperature):
    ids = torch.tensor([tok.encode(prompt) + completion_ids])
    logits = model(input_ids=ids).logits[0, -len(completion_ids) - 1:-1] / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion_ids).unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("fused", [True, False])
def test_matches_one_sequence_at_a_time(model_and_tok, monkeypatch, fused):
    model, tok = model_and_tok
    monkeypatch.setattr(fwd, "_fusable", lambda m: fused)
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
                                  chunk_size=3)
    assert out.dtype == torch.float64
    for i in range(2):
        ref = manual(model, tok, prompts[i], completions[i], 0.7)
        assert torch.allclose(out[i, :len(completions[i])], ref, atol=1e-10)


def test_gradients_of_fused_and_logits_paths_agree(model_and_tok, monkeypatch):
    model, tok = model_and_tok
    enc = tok(["ab", "abcd"], return_tensors="pt", padding=True, padding_side="left")
    ids = torch.tensor([tok.encode("xyz"), tok.encode("uvw")])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    grads = []
    for fused in (True, False):
        monkeypatch.setattr(fwd, "_fusable", lambda m, f=fused: f)
        model.zero_grad()
        out = fwd.completion_logprobs(model, enc["input_ids"], enc["attention_mask"], ids, mask, temperature=1.0,
                                      chunk_size=2)
        (out * mask).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-10)
