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

With `truncation=(top_k, top_p)` or `(top_k, top_p, min_p)`, the sampler's truncated sampling (SPEC 14.12, Keep
Sampling Mask), each also returns, last, ℓ^K = ℓ − log Σ_{v∈K} e^{ℓ_v}: the log-prob of the target under the policy
renormalised over the kept set K of its position, which `sampling_keep_mask` replays on these logits (top-k and
min-p, then top-p over the probabilities they keep, the target always kept). K is a constant of the gradient; the
renormaliser is differentiated.
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


def sampling_keep_mask(z: torch.Tensor, targets: torch.Tensor | None = None, top_k: int = 0,
                       top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    """The kept set K of truncated sampling at each position, replayed on logits already divided by the
    temperature: (N, V), (N,) → (N, V) bool (SPEC 14.12). Top-k keeps the tokens whose logit is at least the k-th
    largest (ties at the k-th are kept, as the in-process sampler does); min-p keeps the tokens whose probability is
    at least `min_p` times the most likely token's (softmax of z, as vLLM and transformers compute it; both filters
    keep the most likely tokens, so their order does not matter); top-p then keeps the smallest prefix of the
    remaining tokens, by decreasing probability renormalised over them, whose probability reaches `top_p` (a token
    is kept iff the probability of the tokens before it is < top_p); the target (the sampled token), where given, is
    always kept. top_k = 0, top_p = 1 and min_p = 0 keep everything. The order is vLLM's (min-p, top-k, top-p). The
    in-process sampler draws from this set (`grpo.rollout.hf.sample_next`), so there the replayed K is the sampler's.

    Example (SPEC 14.12): logits (2.0, 1.5, 0.5, −1.0), top_p = 0.8 → K = {0, 1} (cumulative 0.532071 < 0.8).
    """
    v = z.shape[-1]
    keep = torch.ones(z.shape, dtype=torch.bool, device=z.device)
    if 0 < top_k < v:
        keep = z >= torch.topk(z, top_k, dim=-1).values[:, -1:]
    if min_p > 0:
        probs = torch.softmax(z, dim=-1)
        keep &= probs >= probs.amax(dim=-1, keepdim=True) * min_p
    if top_p < 1.0:
        keep &= _nucleus(torch.softmax(z.masked_fill(~keep, float("-inf")), dim=-1), top_p)
    return keep if targets is None else keep.scatter_(-1, targets.unsqueeze(-1), True)


# the most likely tokens a row's nucleus is first looked for among; a row whose nucleus is larger is sorted whole
_NUCLEUS_FIRST = 64


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """(N, V) probabilities → (N, V) bool: the tokens whose more likely predecessors hold < `top_p` of the mass.
    The nucleus is usually small, so it is found among each row's few most likely tokens (a top-k, far cheaper than
    sorting a vocabulary), and only rows whose nucleus goes beyond them are sorted."""
    first = min(_NUCLEUS_FIRST, probs.shape[-1])
    values, order = torch.topk(probs, first, dim=-1)  # descending
    before = values.cumsum(dim=-1) - values
    kept = torch.zeros(probs.shape, dtype=torch.bool, device=probs.device).scatter_(-1, order, before < top_p)
    beyond = (before[:, -1] + values[:, -1] < top_p).nonzero().squeeze(1)  # rows with mass < top_p in `first`
    if beyond.numel():
        values, order = torch.sort(probs[beyond], dim=-1, descending=True)
        before = values.cumsum(dim=-1) - values
        kept[beyond] = torch.zeros_like(order, dtype=torch.bool).scatter_(-1, order, before < top_p)
    return kept


def _check_truncation(truncation) -> tuple[int, float, float] | None:
    """(top_k, top_p, min_p) of a (top_k, top_p) or (top_k, top_p, min_p) when it truncates anything, else None."""
    if truncation is None:
        return None
    if len(truncation) not in (2, 3):
        raise ValueError(f"truncation must be (top_k, top_p) or (top_k, top_p, min_p), got {truncation!r}")
    top_k, top_p, min_p = (*truncation, 0.0) if len(truncation) == 2 else truncation
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"truncation's top_k must be an integer >= 0 (0 keeps every token), got {top_k!r}")
    if not 0 < top_p <= 1:
        raise ValueError(f"truncation's top_p must be in (0, 1], got {top_p!r}")
    if not 0 <= min_p < 1:
        raise ValueError(f"truncation's min_p must be in [0, 1), got {min_p!r}")
    return None if top_k == 0 and top_p == 1 and min_p == 0 else (int(top_k), float(top_p), float(min_p))


def _outputs(out, ent, outk, shape, entropy: bool, truncation):
    """What the public functions return: log-probs, then the entropies if asked, then ℓ^K if truncating."""
    extra = ([ent.view(shape)] if entropy else []) + ([outk.view(shape)] if truncation is not None else [])
    return (out.view(shape), *extra) if extra else out.view(shape)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                   chunk_size: int | None = None, entropy: bool = False,
                   truncation: tuple | None = None):
    """log softmax(logits / temperature)[targets]: (B, T, V), (B, T) → (B, T) float32.

    With `chunk_size`, at most `chunk_size` positions are turned into float32 at a time, forward and backward.
    `entropy=True` also returns the entropy H = logsumexp(z) − Σ_v p_v z_v of softmax(z), z = logits /
    temperature, per position: (logp, H). H is differentiable (∂H/∂logits = −p ⊙ (log p + H) / temperature: the
    entropy bonus, SPEC 14.7); what does not use it costs nothing in the backward pass.

    `truncation=(top_k, top_p[, min_p])`: also ℓ^K (the module docstring), last: (logp, [H,] ℓ^K).

    Example: logits [[[0, ln 3]]] (one position, V = 2), target 1 → log(3/4) = −0.287682; H = 0.562335.
    """
    _check("logits", logits, targets, temperature)
    _check_range(targets, logits.shape[-1])
    truncation = _check_truncation(truncation)
    b, t, v = logits.shape
    if chunk_size is None:
        z = logits.to(_acc(logits.dtype)) / temperature
        logp = torch.log_softmax(z, dim=-1)
        out = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        ent = -(logp.exp() * logp).sum(-1) if entropy else None
        outk = None
        if truncation is not None:
            keep = sampling_keep_mask(z.reshape(b * t, v), targets.reshape(b * t), *truncation).view(b, t, v)
            outk = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(
                z.masked_fill(~keep, float("-inf")), dim=-1)
        return _outputs(out, ent, outk, (b, t), entropy, truncation)
    check_positive_int("chunk_size", chunk_size)
    out, ent, outk = _ChunkedLogprobs.apply(logits.reshape(b * t, v), targets.reshape(b * t), temperature,
                                            chunk_size, entropy, truncation)
    return _outputs(out, ent, outk, (b, t), entropy, truncation)


def token_logprobs_from_hidden(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                               temperature: float = 1.0, chunk_size: int = 1024,
                               matmul_dtype: torch.dtype | None = None, entropy: bool = False,
                               truncation: tuple | None = None):
    """log softmax((hidden @ weight.T) / temperature)[targets]: (B, T, H), (V, H), (B, T) → (B, T) float32.
    `entropy=True` also returns the entropy of each position's distribution, from the same chunks (never a
    (B, T, V) tensor; SPEC 13.5): (logp, H), H differentiable as in `token_logprobs`.
    `truncation=(top_k, top_p[, min_p])`: also ℓ^K, last, as in `token_logprobs`.

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
    truncation = _check_truncation(truncation)
    b, t, h = hidden.shape
    out, ent, outk = _HiddenLogprobs.apply(hidden.reshape(b * t, h), weight, targets.reshape(b * t), temperature,
                                           chunk_size, matmul_dtype, entropy, truncation)
    return _outputs(out, ent, outk, (b, t), entropy, truncation)


# ---------------------------------------------------------------------------------------------------------
# autograd functions: the forward keeps only the log-sum-exp per position; the backward recomputes the
# softmax chunk by chunk. d logp / d z_j = (1[j = target] − softmax_j) / temperature.

def _acc(dtype: torch.dtype) -> torch.dtype:
    """The dtype log-probs are computed in: at least float32."""
    return torch.promote_types(dtype, torch.float32)


# float32 elements of a row block: the kernels below work a chunk's (rows, V) logits a few rows at a time, so that
# their float32 temporaries (the cast, exp(z - lse), the gradient before its cast) stay in the CPU's cache instead
# of being fresh allocations of the whole chunk. On a 2-core EPYC, 1024 positions of SmolLM2's 49 k vocabulary:
# log-sum-exp and entropy 68 ms in blocks of 16 rows against 382 ms at once. Each row's arithmetic is the same.
_BLOCK_ELEMENTS = 1 << 19


def _blocks(rows: int, vocab: int):
    """(start, end) of the row blocks of a (rows, vocab) chunk."""
    step = max(1, _BLOCK_ELEMENTS // max(vocab, 1))
    return ((s, min(s + step, rows)) for s in range(0, rows, step))


def _rows(x: torch.Tensor | None, s: int, e: int) -> torch.Tensor | None:
    """Rows s:e of an optional per-row tensor (a view, so a kernel's writes land in `x`)."""
    return None if x is None else x[s:e]


def _chunk_forward(z: torch.Tensor, tgt: torch.Tensor, temperature: float, ent: torch.Tensor | None = None,
                   truncation: tuple | None = None, outk: torch.Tensor | None = None,
                   lse_k: torch.Tensor | None = None):
    """This chunk's log-probs and log-sum-exp; with `ent` (a slice of the output), its entropies written there:
    H = lse − Σ p·z, the form TRL and verl use. With `truncation`, ℓ^K written into `outk` and the log-sum-exp
    over K into `lse_k`. Row block by row block (`_blocks`)."""
    acc = _acc(z.dtype)
    logp, lse = z.new_empty(z.shape[0], dtype=acc), z.new_empty(z.shape[0], dtype=acc)
    for s, e in _blocks(*z.shape):
        logp[s:e], lse[s:e] = _block_forward(z[s:e], tgt[s:e], temperature, _rows(ent, s, e), truncation,
                                             _rows(outk, s, e), _rows(lse_k, s, e))
    return logp, lse


def _scaled(z: torch.Tensor, temperature: float) -> torch.Tensor:
    """z / temperature in at least float32, a new tensor."""
    z = z.to(_acc(z.dtype), copy=True)
    return z if temperature == 1.0 else z.div_(temperature)


def _block_forward(z, tgt, temperature, ent, truncation, outk, lse_k):
    z = _scaled(z, temperature)  # (rows, V) in float32, one block only
    lse = torch.logsumexp(z, dim=-1)
    if ent is not None:
        ent.copy_(lse - (torch.exp(z - lse.unsqueeze(-1)) * z).sum(-1))
    picked = z.gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
    if truncation is not None:
        lse_k.copy_(torch.logsumexp(z.masked_fill_(~_keep(z, tgt, truncation), float("-inf")), dim=-1))
        outk.copy_(picked - lse_k)
    return picked - lse, lse


# rows of a chunk whose kept set is found at once: top-p holds (rows, V) probabilities, and a row whose nucleus goes
# beyond its most likely tokens sorts its vocabulary with int64 indices
_KEEP_ROWS = 256


def _keep(z: torch.Tensor, tgt: torch.Tensor, truncation: tuple) -> torch.Tensor:
    """`sampling_keep_mask` of a chunk, a few rows at a time."""
    return torch.cat([sampling_keep_mask(z[s:s + _KEEP_ROWS], tgt[s:s + _KEEP_ROWS], *truncation)
                      for s in range(0, z.shape[0], _KEEP_ROWS)]) if z.shape[0] else z.new_zeros(z.shape, dtype=bool)


def _buffer(n: int, like: torch.Tensor, dtype: torch.dtype, wanted: bool) -> torch.Tensor:
    """An (n,) output of the kernels (entropies, ℓ^K, the log-sum-exp over K), or an empty one when not wanted."""
    return like.new_empty(n if wanted else 0, dtype=dtype)


def _chunk_grad(z: torch.Tensor, tgt: torch.Tensor, lse: torch.Tensor, g: torch.Tensor | None, temperature: float,
               g_ent: torch.Tensor | None = None, ent: torch.Tensor | None = None, g_k: torch.Tensor | None = None,
               lse_k: torch.Tensor | None = None, truncation: tuple | None = None, out: torch.Tensor | None = None):
    """Gradient of Σ g·logp + Σ g_ent·H + Σ g_k·ℓ^K with respect to this chunk's logits z, computed in float32 (a
    None gradient: 0; g_ent None: the entropies unused): ∂logp/∂z = (1[target] − p)/T, ∂H/∂z = −p ⊙ (log p + H)/T,
    ∂ℓ^K/∂z = (1[target] − p^K)/T with p^K the softmax over K (0 outside it). Written into `out` (cast to its
    dtype), row block by row block; `out` None: a new float32 tensor."""
    if out is None:
        out = z.new_empty(z.shape, dtype=_acc(z.dtype))
    for s, e in _blocks(*z.shape):
        out[s:e] = _block_grad(z[s:e], tgt[s:e], lse[s:e], _rows(g, s, e), temperature, _rows(g_ent, s, e),
                               _rows(ent, s, e), _rows(g_k, s, e), _rows(lse_k, s, e), truncation)
    return out


def _block_grad(z, tgt, lse, g, temperature, g_ent, ent, g_k, lse_k, truncation):
    zs = _scaled(z, temperature)
    weight = None  # the factor of −p
    if g_ent is not None:
        weight = g_ent.unsqueeze(-1) * (zs - lse.unsqueeze(-1) + ent.unsqueeze(-1))
    if g is not None:
        weight = g.unsqueeze(-1) if weight is None else weight + g.unsqueeze(-1)
    if weight is not None:
        grad = torch.exp(zs - lse.unsqueeze(-1)).mul_(-weight)
    else:
        grad = torch.zeros_like(zs)
    picked = g
    if g_k is not None:
        keep = _keep(zs, tgt, truncation)
        grad.sub_(torch.exp(zs - lse_k.unsqueeze(-1)).masked_fill_(~keep, 0.0).mul_(g_k.unsqueeze(-1)))
        picked = g_k if picked is None else picked + g_k
    if picked is not None:
        grad.scatter_add_(-1, tgt.unsqueeze(-1), picked.unsqueeze(-1))
    return grad if temperature == 1.0 else grad.div_(temperature)


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, temperature, chunk_size, entropy, truncation):
        n = logits.shape[0]
        acc = _acc(logits.dtype)
        out, lse = logits.new_empty(n, dtype=acc), logits.new_empty(n, dtype=acc)
        ent = _buffer(n, logits, acc, entropy)
        outk, lse_k = (_buffer(n, logits, acc, truncation is not None) for _ in range(2))
        for s in range(0, n, chunk_size):
            e = s + chunk_size
            out[s:e], lse[s:e] = _chunk_forward(logits[s:e], targets[s:e], temperature, ent[s:e] if entropy else None,
                                                truncation, outk[s:e], lse_k[s:e])
        ctx.save_for_backward(logits, targets, lse, ent, lse_k)
        ctx.temperature, ctx.chunk_size, ctx.truncation = temperature, chunk_size, truncation
        ctx.set_materialize_grads(False)  # an output the loss does not use has no gradient (None), not zeros
        return out, ent, outk

    @staticmethod
    def backward(ctx, grad_out, grad_ent, grad_outk):
        logits, targets, lse, ent, lse_k = ctx.saved_tensors
        if grad_out is None and grad_ent is None and grad_outk is None:
            return None, None, None, None, None, None
        grad = torch.empty_like(logits)
        for s in range(0, logits.shape[0], ctx.chunk_size):
            e = s + ctx.chunk_size
            _chunk_grad(logits[s:e], targets[s:e], lse[s:e], _part(grad_out, s, e, lse), ctx.temperature,
                        _part(grad_ent, s, e, lse), _part(ent, s, e, lse, grad_ent), _part(grad_outk, s, e, lse),
                        _part(lse_k, s, e, lse, grad_outk), ctx.truncation, out=grad[s:e])
        return grad, None, None, None, None, None


class _HiddenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_size, matmul_dtype, entropy, truncation):
        n = hidden.shape[0]
        dtype = matmul_dtype or torch.promote_types(hidden.dtype, weight.dtype)
        acc = _acc(dtype)
        out, lse = hidden.new_empty(n, dtype=acc), hidden.new_empty(n, dtype=acc)
        ent = _buffer(n, hidden, acc, entropy)
        outk, lse_k = (_buffer(n, hidden, acc, truncation is not None) for _ in range(2))
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            for s in range(0, n, chunk_size):
                e = s + chunk_size
                z = hidden[s:e].to(dtype) @ w.T
                out[s:e], lse[s:e] = _chunk_forward(z, targets[s:e], temperature, ent[s:e] if entropy else None,
                                                    truncation, outk[s:e], lse_k[s:e])
        ctx.save_for_backward(hidden, weight, targets, lse, ent, lse_k)
        ctx.temperature, ctx.chunk_size, ctx.dtype, ctx.truncation = temperature, chunk_size, dtype, truncation
        ctx.set_materialize_grads(False)  # an output the loss does not use has no gradient (None), not zeros
        return out, ent, outk

    @staticmethod
    def backward(ctx, grad_out, grad_ent, grad_outk):
        hidden, weight, targets, lse, ent, lse_k = ctx.saved_tensors
        if grad_out is None and grad_ent is None and grad_outk is None:
            return None, None, None, None, None, None, None, None
        dtype = ctx.dtype
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, dtype=_acc(dtype), device=weight.device) \
            if ctx.needs_input_grad[1] else None
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            for s in range(0, hidden.shape[0], ctx.chunk_size):
                e = s + ctx.chunk_size
                h = hidden[s:e].to(dtype)
                z = h @ w.T
                dz = _chunk_grad(z, targets[s:e], lse[s:e], _part(grad_out, s, e, lse), ctx.temperature,
                                 _part(grad_ent, s, e, lse), _part(ent, s, e, lse, grad_ent),
                                 _part(grad_outk, s, e, lse), _part(lse_k, s, e, lse, grad_outk), ctx.truncation,
                                 out=z)  # written over the logits it is computed from, block by block, in dtype
                if grad_h is not None:
                    grad_h[s:e] = dz @ w
                if grad_w is not None:
                    grad_w += (dz.T @ h).to(grad_w.dtype)
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None, None, None


def _part(x: torch.Tensor | None, s: int, e: int, like: torch.Tensor, wanted: object = True) -> torch.Tensor | None:
    """Rows s:e of `x` in `like`'s dtype; None when `x` (or what it serves, `wanted`) is None."""
    return None if x is None or wanted is None else x[s:e].to(like.dtype)
