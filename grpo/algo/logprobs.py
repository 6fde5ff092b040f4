"""Log-probabilities of sampled tokens, computed from logits divided by the sampling temperature (SPEC 12).

Three ways, equal in value and gradient (tests pin this):

- `token_logprobs(logits, targets)`: the plain reference, log_softmax + gather. It builds a full
  (B, T, V) float32 tensor and keeps it for the backward pass.
- `token_logprobs(logits, targets, chunk_size=c)`: rows in chunks of c positions, float32 only per chunk;
  the backward pass recomputes the softmax per chunk. Peak extra memory is O(c·V), not O(B·T·V).
- `token_logprobs_from_hidden(hidden, weight, targets)`: starts from the last hidden states and the output
  projection, so the logits are never materialised as a whole, not even in the model's dtype (the trick
  behind Liger's and Unsloth's fused linear cross-entropy). This is what the trainer uses.

All return log-probs of shape (B, T) in float32 (float64 for float64 inputs).
"""
from __future__ import annotations

import torch

from grpo.algo._checks import check_positive_int, check_tensor


def _check(logits_or_hidden_name: str, x: torch.Tensor, targets: torch.Tensor, temperature: float) -> None:
    check_tensor(logits_or_hidden_name, x, 3)
    check_tensor("targets", targets, 2)
    if targets.shape != x.shape[:2]:
        raise ValueError(f"targets has shape {tuple(targets.shape)} but {logits_or_hidden_name} has shape "
                         f"{tuple(x.shape)}; targets must be {logits_or_hidden_name}.shape[:2]")
    if targets.is_floating_point():
        raise TypeError("targets must be an integer tensor of token ids")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")


def _check_range(targets: torch.Tensor, vocab: int) -> None:
    if not targets.numel():
        return
    low, high = torch.stack(torch.aminmax(targets)).tolist()  # one transfer from the device, not two
    if low < 0 or high >= vocab:
        raise ValueError(f"targets holds token ids outside [0, {vocab}) (vocabulary size {vocab})")


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                   chunk_size: int | None = None, entropy: bool = False):
    """log softmax(logits / temperature)[targets]: (B, T, V), (B, T) → (B, T) float32.

    With `chunk_size`, at most `chunk_size` positions are turned into float32 at a time, forward and backward.
    `entropy=True` also returns the entropy H = logsumexp(z) − Σ_v p_v z_v of softmax(z), z = logits /
    temperature, per position: (logp, H). H is differentiable (∂H/∂logits = −p ⊙ (log p + H) / temperature: the
    entropy bonus, SPEC 14.7); what does not use it costs nothing in the backward pass.

    Example: logits [[[0, ln 3]]] (one position, V = 2), target 1 → log(3/4) = −0.287682; H = 0.562335.
    """
    _check("logits", logits, targets, temperature)
    _check_range(targets, logits.shape[-1])
    if chunk_size is None:
        logp = torch.log_softmax(logits.to(_acc(logits.dtype)) / temperature, dim=-1)
        out = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        if not entropy:
            return out
        return out, -(logp.exp() * logp).sum(-1)
    check_positive_int("chunk_size", chunk_size)
    b, t, v = logits.shape
    out, ent = _ChunkedLogprobs.apply(logits.reshape(b * t, v), targets.reshape(b * t), temperature, chunk_size,
                                      entropy)
    return (out.view(b, t), ent.view(b, t)) if entropy else out.view(b, t)


def token_logprobs_from_hidden(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                               temperature: float = 1.0, chunk_size: int = 1024,
                               matmul_dtype: torch.dtype | None = None, entropy: bool = False):
    """log softmax((hidden @ weight.T) / temperature)[targets]: (B, T, H), (V, H), (B, T) → (B, T) float32.
    `entropy=True` also returns the entropy of each position's distribution, from the same chunks (never a
    (B, T, V) tensor; SPEC 13.5): (logp, H), H differentiable as in `token_logprobs`.

    `weight` is the output projection (`model.lm_head.weight`, no bias). The (chunk, V) logits exist one
    chunk at a time; gradients flow to both `hidden` and `weight`. `matmul_dtype` (e.g. bfloat16, as autocast
    would use for the projection) is the dtype of the projection's matmuls, forward and backward; the
    log-softmax and the weight gradient's accumulation stay in float32. None: the inputs' common dtype.
    """
    _check("hidden", hidden, targets, temperature)
    check_tensor("weight", weight, 2)
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight has shape {tuple(weight.shape)} but hidden has size {hidden.shape[-1]} in its "
                         "last dimension; weight must be (vocab, hidden)")
    _check_range(targets, weight.shape[0])
    check_positive_int("chunk_size", chunk_size)
    b, t, h = hidden.shape
    out, ent = _HiddenLogprobs.apply(hidden.reshape(b * t, h), weight, targets.reshape(b * t), temperature,
                                     chunk_size, matmul_dtype, entropy)
    return (out.view(b, t), ent.view(b, t)) if entropy else out.view(b, t)


# ---------------------------------------------------------------------------------------------------------
# autograd functions: the forward keeps only the log-sum-exp per position; the backward recomputes the
# softmax chunk by chunk. d logp / d z_j = (1[j = target] − softmax_j) / temperature.

def _acc(dtype: torch.dtype) -> torch.dtype:
    """The dtype log-probs are computed in: at least float32."""
    return torch.promote_types(dtype, torch.float32)


def _chunk_forward(z: torch.Tensor, tgt: torch.Tensor, temperature: float, ent: torch.Tensor | None = None):
    """This chunk's log-probs and log-sum-exp; with `ent` (a slice of the output), its entropies written there:
    H = lse − Σ p·z, the form TRL and verl use."""
    z = z.to(_acc(z.dtype)) / temperature  # (c, V) in float32, one chunk only
    lse = torch.logsumexp(z, dim=-1)
    if ent is not None:
        ent.copy_(lse - (torch.exp(z - lse.unsqueeze(-1)) * z).sum(-1))
    return z.gather(-1, tgt.unsqueeze(-1)).squeeze(-1) - lse, lse


def _entropies(n: int, like: torch.Tensor, dtype: torch.dtype, wanted: bool) -> torch.Tensor:
    return like.new_empty(n if wanted else 0, dtype=dtype)


def _chunk_grad(z: torch.Tensor, tgt: torch.Tensor, lse: torch.Tensor, g: torch.Tensor | None, temperature: float,
               g_ent: torch.Tensor | None = None, ent: torch.Tensor | None = None):
    """Gradient of Σ g·logp + Σ g_ent·H with respect to this chunk's logits z, in float32 (g None: 0; g_ent None:
    the entropies unused): ∂logp/∂z = (1[target] − p)/T, ∂H/∂z = −p ⊙ (log p + H)/T."""
    logp = z.to(_acc(z.dtype)) / temperature - lse.unsqueeze(-1)
    p = torch.exp(logp)
    if g_ent is None:
        grad = p.mul_(-g.unsqueeze(-1))
    else:
        weight = g_ent.unsqueeze(-1) * (logp + ent.unsqueeze(-1))
        if g is not None:
            weight = weight + g.unsqueeze(-1)
        grad = p.mul_(-weight)
    if g is not None:
        grad.scatter_add_(-1, tgt.unsqueeze(-1), g.unsqueeze(-1))
    return grad.div_(temperature)


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, temperature, chunk_size, entropy):
        n = logits.shape[0]
        out = logits.new_empty(n, dtype=_acc(logits.dtype))
        lse = logits.new_empty(n, dtype=_acc(logits.dtype))
        ent = _entropies(n, logits, _acc(logits.dtype), entropy)
        for s in range(0, n, chunk_size):
            out[s:s + chunk_size], lse[s:s + chunk_size] = _chunk_forward(
                logits[s:s + chunk_size], targets[s:s + chunk_size], temperature,
                ent[s:s + chunk_size] if entropy else None)
        ctx.save_for_backward(logits, targets, lse, ent)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        ctx.set_materialize_grads(False)  # an output the loss does not use has no gradient (None), not zeros
        return out, ent

    @staticmethod
    def backward(ctx, grad_out, grad_ent):
        logits, targets, lse, ent = ctx.saved_tensors
        if grad_out is None and grad_ent is None:
            return None, None, None, None, None
        grad = torch.empty_like(logits)
        for s in range(0, logits.shape[0], ctx.chunk_size):
            e = s + ctx.chunk_size
            grad[s:e] = _chunk_grad(logits[s:e], targets[s:e], lse[s:e], _part(grad_out, s, e, lse),
                                    ctx.temperature, _part(grad_ent, s, e, lse), _part(ent, s, e, lse, grad_ent))
        return grad, None, None, None, None


class _HiddenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_size, matmul_dtype, entropy):
        n = hidden.shape[0]
        dtype = matmul_dtype or torch.promote_types(hidden.dtype, weight.dtype)
        out = hidden.new_empty(n, dtype=_acc(dtype))
        lse = hidden.new_empty(n, dtype=_acc(dtype))
        ent = _entropies(n, hidden, _acc(dtype), entropy)
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            for s in range(0, n, chunk_size):
                z = hidden[s:s + chunk_size].to(dtype) @ w.T
                out[s:s + chunk_size], lse[s:s + chunk_size] = _chunk_forward(
                    z, targets[s:s + chunk_size], temperature, ent[s:s + chunk_size] if entropy else None)
        ctx.save_for_backward(hidden, weight, targets, lse, ent)
        ctx.temperature, ctx.chunk_size, ctx.dtype = temperature, chunk_size, dtype
        ctx.set_materialize_grads(False)  # an output the loss does not use has no gradient (None), not zeros
        return out, ent

    @staticmethod
    def backward(ctx, grad_out, grad_ent):
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        if grad_out is None and grad_ent is None:
            return None, None, None, None, None, None, None
        dtype = ctx.dtype
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, dtype=_acc(dtype), device=weight.device) \
            if ctx.needs_input_grad[1] else None
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            for s in range(0, hidden.shape[0], ctx.chunk_size):
                e = s + ctx.chunk_size
                h = hidden[s:e].to(dtype)
                dz = _chunk_grad(h @ w.T, targets[s:e], lse[s:e], _part(grad_out, s, e, lse), ctx.temperature,
                                 _part(grad_ent, s, e, lse), _part(ent, s, e, lse, grad_ent))
                dz = dz.to(dtype)
                if grad_h is not None:
                    grad_h[s:e] = dz @ w
                if grad_w is not None:
                    grad_w += (dz.T @ h).to(grad_w.dtype)
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None, None


def _part(x: torch.Tensor | None, s: int, e: int, like: torch.Tensor, wanted: object = True) -> torch.Tensor | None:
    """Rows s:e of `x` in `like`'s dtype; None when `x` (or what it serves, `wanted`) is None."""
    return None if x is None or wanted is None else x[s:e].to(like.dtype)
