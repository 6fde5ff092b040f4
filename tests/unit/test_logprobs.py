"""token_logprobs (plain and chunked) and token_logprobs_from_hidden against log_softmax + gather."""
import math

import pytest
import torch

from grpo.algo import token_logprobs, token_logprobs_from_hidden


def reference(logits, targets, temperature=1.0):
    return torch.log_softmax(logits.double() / temperature, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def test_hand_example():
    logits = torch.tensor([[[0.0, math.log(3.0)]]])
    out = token_logprobs(logits, torch.tensor([[1]]))
    assert out.dtype == torch.float32
    assert token_logprobs(logits.double(), torch.tensor([[1]]), chunk_size=1).dtype == torch.float64
    assert abs(out.item() - math.log(0.75)) < 1e-7
    # temperature 2: softmax([0, ln 3 / 2]) = [1, √3] / (1 + √3)
    assert abs(token_logprobs(logits, torch.tensor([[1]]), temperature=2.0).item()
               - math.log(math.sqrt(3) / (1 + math.sqrt(3)))) < 1e-7


@pytest.mark.parametrize("chunk_size", [None, 1, 3, 7, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradients_match_reference(chunk_size, temperature):
    logits = torch.randn(3, 5, 11, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 11, (3, 5))
    w = torch.randn(3, 5, dtype=torch.float64)
    out = token_logprobs(logits, targets, temperature=temperature, chunk_size=chunk_size)
    ref = reference(logits, targets, temperature)
    assert torch.allclose(out.double(), ref, atol=1e-6)
    (g,) = torch.autograd.grad((out * w).sum(), logits)
    (g_ref,) = torch.autograd.grad((ref * w).sum(), logits)
    assert torch.allclose(g.double(), g_ref, atol=1e-6)


def test_chunked_gradcheck():
    logits = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 5, (2, 3))
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, targets, chunk_size=2, temperature=0.9).double(),
                                    (logits,))


@pytest.mark.parametrize("chunk_size", [1, 4, 64])
def test_from_hidden_matches_logits_path(chunk_size):
    hidden = torch.randn(2, 6, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(13, 8, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 13, (2, 6))
    w = torch.randn(2, 6, dtype=torch.float64)
    out = token_logprobs_from_hidden(hidden, weight, targets, temperature=0.8, chunk_size=chunk_size)
    ref = reference(hidden @ weight.T, targets, 0.8)
    assert torch.allclose(out.double(), ref, atol=1e-6)
    g = torch.autograd.grad((out * w).sum(), (hidden, weight))
    g_ref = torch.autograd.grad((ref * w).sum(), (hidden, weight))
    for a, b in zip(g, g_ref):
        assert torch.allclose(a.double(), b, atol=1e-6)


def test_from_hidden_gradcheck():
    hidden = torch.randn(1, 3, 4, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 5, (1, 3))
    assert torch.autograd.gradcheck(
        lambda h, w: token_logprobs_from_hidden(h, w, targets, chunk_size=2).double(), (hidden, weight))


def test_bf16_inputs_keep_their_dtype_for_gradients():
    logits = torch.randn(2, 4, 9).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 9, (2, 4))
    out = token_logprobs(logits, targets, chunk_size=3)
    assert out.dtype == torch.float32
    assert torch.allclose(out, reference(logits.float(), targets).float(), atol=1e-5)
    out.sum().backward()
    assert logits.grad.dtype == torch.bfloat16


def test_from_hidden_bf16_matmuls_match_bf16_logits():
    # what autocast gives an nn.Linear output projection: bfloat16 logits, then float32 log-probs
    torch.manual_seed(0)
    hidden = torch.randn(2, 5, 16, requires_grad=True)
    weight = torch.randn(40, 16, requires_grad=True)
    targets = torch.randint(0, 40, (2, 5))
    w = torch.randn(2, 5)
    out = token_logprobs_from_hidden(hidden, weight, targets, chunk_size=3, matmul_dtype=torch.bfloat16)
    ref = reference((hidden.bfloat16() @ weight.bfloat16().T).float(), targets)
    assert out.dtype == torch.float32 and torch.allclose(out, ref.float(), atol=1e-5)
    g = torch.autograd.grad((out * w).sum(), (hidden, weight))
    g_ref = torch.autograd.grad((ref * w).sum(), (hidden, weight))
    exact = torch.autograd.grad((reference(hidden @ weight.T, targets) * w).sum(), (hidden, weight))
    for a, b, c in zip(g, g_ref, exact):
        assert a.dtype == torch.float32
        # the backward matmuls also run in bfloat16: within bfloat16 rounding of the float32 gradient
        assert torch.allclose(a, b, atol=0.05, rtol=0.02) and torch.allclose(a, c, atol=0.1, rtol=0.05)


def _largest_allocation(fn) -> int:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max(e.cpu_memory_usage for e in prof.events())


def test_chunked_never_materialises_full_float32_logprobs():
    b, t, v = 4, 32, 512
    full = b * t * v * 4  # bytes of a float32 (B, T, V) tensor
    logits = torch.randn(b, t, v).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, v, (b, t))
    plain = _largest_allocation(lambda: token_logprobs(logits, targets).sum().backward())
    chunked = _largest_allocation(lambda: token_logprobs(logits, targets, chunk_size=16).sum().backward())
    assert plain >= full
    assert chunked <= full / 2  # the bf16 gradient of the logits (full / 2) is the largest allowed


def test_from_hidden_never_builds_full_logits():
    b, t, h, v = 4, 32, 16, 512
    hidden = torch.randn(b, t, h, requires_grad=True)
    weight = torch.randn(v, h, requires_grad=True)
    targets = torch.randint(0, v, (b, t))
    biggest = _largest_allocation(
        lambda: token_logprobs_from_hidden(hidden, weight, targets, chunk_size=16).sum().backward())
    assert biggest < b * t * v * 4 / 4


@pytest.mark.parametrize("call, match", [
    (lambda: token_logprobs(torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.long)), "logits must have 3"),
    (lambda: token_logprobs(torch.zeros(2, 3, 4), torch.zeros(2, 4, dtype=torch.long)), r"targets has shape \(2, 4\)"),
    (lambda: token_logprobs(torch.zeros(2, 3, 4), torch.zeros(2, 3)), "targets must be an integer tensor"),
    (lambda: token_logprobs(torch.zeros(1, 1, 4), torch.tensor([[4]])), r"outside \[0, 4\)"),
    (lambda: token_logprobs(torch.zeros(1, 1, 4), torch.tensor([[1]]), temperature=0), "temperature must be > 0"),
    (lambda: token_logprobs(torch.zeros(1, 1, 4), torch.tensor([[1]]), chunk_size=0), "chunk_size must be"),
    (lambda: token_logprobs_from_hidden(torch.zeros(1, 1, 4), torch.zeros(5, 3), torch.tensor([[1]])),
     r"weight has shape \(5, 3\)"),
])
def test_bad_input_names_the_argument(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_row_blocks_change_no_bit(monkeypatch, temperature):
    """The kernels work a chunk a few rows at a time (`_BLOCK_ELEMENTS`); blocks of 2 rows with a ragged last one
    give the same log-probs, entropies, ℓ^K and gradients, bit for bit, as one block for the whole chunk."""
    from grpo.algo import logprobs

    torch.manual_seed(0)
    hidden, weight = torch.randn(2, 9, 8), torch.randn(40, 8)
    logits = torch.randn(2, 9, 40)
    targets = torch.randint(0, 40, (2, 9))
    w = torch.randn(3, 2, 9)

    def run():
        h, wt, z = (x.clone().requires_grad_() for x in (hidden, weight, logits))
        outs = [*token_logprobs_from_hidden(h, wt, targets, temperature=temperature, chunk_size=7, entropy=True,
                                            truncation=(5, 0.9)),
                *token_logprobs(z, targets, temperature=temperature, chunk_size=7, entropy=True,
                                truncation=(5, 0.9))]
        sum((o * w[i % 3]).sum() for i, o in enumerate(outs)).backward()
        return [o.detach() for o in outs] + [h.grad, wt.grad, z.grad]

    whole = run()  # 40 columns: every chunk of 7 rows is one block
    monkeypatch.setattr(logprobs, "_BLOCK_ELEMENTS", 2 * 40)
    assert list(logprobs._blocks(7, 40)) == [(0, 2), (2, 4), (4, 6), (6, 7)]
    for a, b in zip(whole, run(), strict=True):
        assert torch.equal(a, b)
