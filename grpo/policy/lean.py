"""Llama-family layers run straight from the model's weights, without transformers' per-call machinery.

For a small model on a CPU, much of a forward pass is overhead: transformers builds attention masks, looks up
an attention interface, keeps a cache object and runs output-capturing hooks on every call. This module holds
what grpo runs instead for the architectures whose layers are exactly "x += attn(norm(x)); x += mlp(norm(x))"
with rotary embeddings (Llama, Qwen2 and Mistral, full attention): `supported()`, the layer pieces that the lean
decoding steps (`grpo.rollout.lean_decoding`) share, and `completion_hidden()`, the training and reference
forward pass, and `packed_hidden()`, the same over the attended tokens alone (`compute.packing`).
All use the model's own weights, rotary embedding, norms, activation and attention kernel (SDPA, or the eager
matmul-softmax-matmul, per its `attn_implementation`), in transformers' order of operations; the tests compare
their outputs and gradients with transformers' forward. Any other model (other architectures, LoRA layers,
sharded parameters, sliding windows, quantised or fused linear layers, gradient checkpointing, attention
dropout in training) is not `supported` and runs through transformers.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from grpo.policy.context import is_checkpointing, is_sharded

ARCHITECTURES = ("llama", "qwen2", "mistral")


def supported(model) -> bool:
    """Whether `model` can run here: a plain (unwrapped) Llama, Qwen2 or Mistral causal LM with full attention,
    gated MLPs, plain `nn.Linear` layers and unsharded parameters."""
    cfg = getattr(model, "config", None)
    base = getattr(model, "model", None)
    if cfg is None or getattr(cfg, "model_type", None) not in ARCHITECTURES or base is None:
        return False
    if getattr(cfg, "sliding_window", None) is not None and getattr(cfg, "use_sliding_window", True):
        return False
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])):
        return False
    if getattr(cfg, "_attn_implementation", None) not in ("sdpa", "eager"):
        return False
    if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
        return False
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear or not all(hasattr(base, a) for a in ("rotary_emb", "embed_tokens", "layers")):
        return False
    for layer in base.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        names = [(attn, "q_proj"), (attn, "k_proj"), (attn, "v_proj"), (attn, "o_proj"),
                 (mlp, "gate_proj"), (mlp, "up_proj"), (mlp, "down_proj")]
        if any(type(getattr(m, n, None)) is not torch.nn.Linear for m, n in names):
            return False
        if getattr(attn, "sliding_window", None) is not None or hasattr(attn, "q_norm"):
            return False
    return not is_sharded(model)


def supported_for_training(model) -> bool:
    """`supported`, and nothing that a training forward of transformers' would do differently: no gradient
    checkpointing (it recomputes activations to save memory), no attention dropout while training."""
    if not supported(model) or is_checkpointing(model):
        return False
    return not (model.training and getattr(model.config, "attention_dropout", 0.0))


def completion_hidden(model, ids: torch.Tensor, attn: torch.Tensor, position: torch.Tensor, lp: int,
                      group: torch.Tensor, first: torch.Tensor, prompt_kv: list | None = None) -> torch.Tensor:
    """The final hidden states (B, T, H) at the positions that predict the completion tokens, from rows of
    `lp` left-padded prompt tokens followed by T - 1 completion tokens (`ids`, `attn`, `position`: (B, lp+T-1)).

    Row `first[g]` holds the prompt of group `g`; `group[i]` is row i's group. Each group's prompt runs once and
    its completions attend to its keys and values. The prompt tokens and the completion tokens of the whole
    batch go through every projection and MLP as one flat batch of positions (one matmul each, no padding
    between them); only attention runs per part: the prompts causally among themselves, each completion over
    its prompt's keys and its own earlier tokens. A padded prompt position attends to itself, so its (unused)
    output stays finite. Gradients flow through the shared prompt keys and values, as through the full rows.
    `prompt_kv`: a list that receives each layer's prompt keys (after the rotary embedding) and values, (P, kv
    heads, lp, head dim) each: the prefill of the lean decoding steps.
    """
    base = model.model
    b, t1 = ids.shape[0], ids.shape[1] - lp  # t1: completion tokens fed (the last one predicts nothing)
    p = len(first)
    shared = p != b
    n_prompt = p * lp
    prompt_valid = attn[first, :lp].bool()  # (P, lp)
    flat_ids = torch.cat([ids[first, :lp].reshape(-1), ids[:, lp:].reshape(-1)])
    flat_pos = torch.cat([position[first, :lp].reshape(-1), position[:, lp:].reshape(-1)])
    x, cos, sin = _embedded(base, flat_ids, flat_pos)

    device = ids.device
    prompt_mask = _prompt_mask(prompt_valid)
    completion_mask = None
    if t1:
        j = torch.arange(t1, device=device)
        completion_mask = torch.cat([prompt_valid.index_select(0, group)[:, None, :].expand(b, t1, lp),
                                     (j[:, None] >= j[None, :]).expand(b, t1, t1)], dim=2).unsqueeze(1)
    eager = model.config._attn_implementation == "eager"

    def attend(q, k, v, a):
        return _grouped_attention(q, k, v, a, (p, lp, b, t1), group if shared else None, prompt_mask,
                                  completion_mask, eager, prompt_kv)

    x = _layers(base, x, cos, sin, attend)
    last = x[:n_prompt].view(p, lp, -1)[:, -1]  # the last prompt position predicts the first completion token
    if shared:
        last = last.index_select(0, group)
    return torch.cat([last.unsqueeze(1), x[n_prompt:].view(b, t1, x.shape[-1])], dim=1)


def packed_hidden(model, packed) -> torch.Tensor:
    """The final hidden states (N, H) of the N tokens of `packed` (a `grpo.policy.inputs.PackedInputs`): the
    projections, norms and MLPs see those tokens alone, no padding. Attention runs as in `completion_hidden`: each
    prompt causally over its own tokens, each completion over its prompt's keys and values and its own earlier
    tokens, never over padding; for that call alone the queries, keys and values go to their padded slots (zeros
    elsewhere; a padded query attends to itself, so its unused output stays finite, and no gradient reaches it)."""
    base = model.model
    p, lp, b, t1 = packed.prompts, packed.prompt_width, packed.rows, packed.fed_width
    n_prompt, slots, group = p * lp, packed.slots, packed.group
    size = n_prompt + b * t1
    x, cos, sin = _embedded(base, packed.input_ids, packed.position_ids)
    valid = torch.zeros(size, dtype=torch.bool, device=slots.device)
    valid[slots] = True
    prompt_valid = valid[:n_prompt].view(p, lp)
    prompt_mask = _prompt_mask(prompt_valid)
    completion_mask = None
    if t1:
        j = torch.arange(t1, device=slots.device)
        own = (j[:, None] >= j[None, :]) & (valid[n_prompt:].view(b, 1, t1) | (j[:, None] == j[None, :]))
        completion_mask = torch.cat([prompt_valid.index_select(0, group)[:, None, :].expand(b, t1, lp), own],
                                    dim=2).unsqueeze(1)
    eager = model.config._attn_implementation == "eager"
    shared = p != b  # else every row is its own prompt: group = arange(B)

    def attend(q, k, v, a):
        q, k, v = (z.new_zeros(size, z.shape[1], a.head_dim).index_copy(0, slots, z) for z in (q, k, v))
        return _grouped_attention(q, k, v, a, (p, lp, b, t1), group if shared else None, prompt_mask,
                                  completion_mask, eager).index_select(0, slots)

    return _layers(base, x, cos, sin, attend)


def _grouped_attention(q, k, v, a, shape: tuple[int, int, int, int], group: torch.Tensor | None,
                       prompt_mask: torch.Tensor | None, completion_mask: torch.Tensor | None, eager: bool,
                       prompt_kv: list | None = None) -> torch.Tensor:
    """Attention over a flat batch laid out as P prompts of lp positions, then B rows of t1 completion positions
    (`shape` = (P, lp, B, t1); q, k, v (P·lp + B·t1, heads, d) each, after the rotary embedding) -> (P·lp + B·t1,
    heads·d): the prompts causally among themselves (`prompt_mask`, None: no padding), each completion over its
    prompt's keys and values (row i's is prompt `group[i]`; None: prompt i) and its own earlier positions
    (`completion_mask`). `prompt_kv` receives the layer's prompt keys and values."""
    p, lp, b, t1 = shape
    n_prompt, d, heads = p * lp, a.head_dim, q.shape[1]
    qp, kp, vp = (z[:n_prompt].view(p, lp, -1, d).transpose(1, 2) for z in (q, k, v))
    if prompt_kv is not None:
        prompt_kv.append((kp, vp))
    out = [attention(qp, kp, vp, prompt_mask, a.scaling, eager, causal=prompt_mask is None)
           .transpose(1, 2).reshape(n_prompt, heads * d)]
    if t1:
        qc, kc, vc = (z[n_prompt:].view(b, t1, -1, d).transpose(1, 2) for z in (q, k, v))
        if group is not None:
            kp, vp = kp.index_select(0, group), vp.index_select(0, group)
        keys, values = torch.cat([kp, kc], dim=2), torch.cat([vp, vc], dim=2)
        out.append(attention(qc, keys, values, completion_mask, a.scaling, eager)
                   .transpose(1, 2).reshape(b * t1, heads * d))
    return torch.cat(out)


def _embedded(base, flat_ids: torch.Tensor, flat_pos: torch.Tensor):
    """The embeddings (N, hidden) of a flat batch of tokens, and the rotary cos and sin of their positions,
    (N, 1, head dim) each."""
    x = base.embed_tokens(flat_ids).unsqueeze(0)  # (1, N, hidden): every position in one row
    cos, sin = base.rotary_emb(x, flat_pos.unsqueeze(0))
    return x[0], cos[0].unsqueeze(1), sin[0].unsqueeze(1)


def _prompt_mask(prompt_valid: torch.Tensor) -> torch.Tensor | None:
    """(P, 1, lp, lp) bool: causal attention over each prompt's tokens, a padded position attending to itself
    alone; None without padding (plain causal attention)."""
    if bool(prompt_valid.all()):
        return None
    i = torch.arange(prompt_valid.shape[1], device=prompt_valid.device)
    causal = i[:, None] >= i[None, :]
    return (causal & (prompt_valid[:, None, :] | (i[:, None] == i[None, :]))).unsqueeze(1)


def _layers(base, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend) -> torch.Tensor:
    """The decoder layers and the final norm over a flat batch of positions (N, hidden): every projection and MLP
    one matmul over all of them; `attend(q, k, v, self_attn)` (N, heads, d) each after the rotary embedding ->
    (N, heads·d) is the attention, the one part that sees which position belongs to which sequence."""
    for layer in base.layers:
        a = layer.self_attn
        d = a.head_dim
        h = norm(layer.input_layernorm, x)
        q = F.linear(h, a.q_proj.weight, a.q_proj.bias).view(-1, a.q_proj.out_features // d, d)  # (N, heads, d)
        k = F.linear(h, a.k_proj.weight, a.k_proj.bias).view(-1, a.k_proj.out_features // d, d)
        v = F.linear(h, a.v_proj.weight, a.v_proj.bias).view(-1, a.v_proj.out_features // d, d)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        x = x + F.linear(attend(q, k, v, a), a.o_proj.weight, a.o_proj.bias)
        x = x + mlp(layer.mlp, norm(layer.post_attention_layernorm, x))
    return norm(base.norm, x)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
              eager: bool, causal: bool = False) -> torch.Tensor:
    """(B, heads, Tq, d) attention over (B, kv heads, Tk, d) keys and values; `mask` (B, 1, Tq, Tk) bool, True
    where attended, or `causal` (Tq = Tk), or neither: every key. `eager`: transformers' eager arithmetic
    (matmul, masked softmax in float32, matmul), the query heads of a key head sharing its keys and values
    without copies; else SDPA (grouped-query attention without copies too)."""
    heads, kv_heads = q.shape[1], k.shape[1]
    if not eager:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                              enable_gqa=heads != kv_heads)
    b, tq, tk, d = q.shape[0], q.shape[2], k.shape[2], q.shape[3]
    if causal:
        i = torch.arange(tq, device=q.device)
        mask = (i[:, None] >= i[None, :]).view(1, 1, tq, tk)
    q = q.reshape(b, kv_heads, heads // kv_heads, tq, d)
    w = torch.matmul(q, k.unsqueeze(2).transpose(3, 4)) * scale  # (B, kv heads, group, Tq, Tk)
    if mask is not None:
        w = w.masked_fill(~mask.unsqueeze(2), torch.finfo(w.dtype).min)
    w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(w, v.unsqueeze(2)).reshape(b, heads, tq, d)


def mlp(module, h: torch.Tensor, weights: tuple | None = None) -> torch.Tensor:
    """The gated MLP: down(act(gate(h)) * up(h)). `weights`: (gate weight, gate bias, up weight, up bias, down
    weight, down bias) to use instead of the module's own (the lean decoding steps' copies cast once per batch)."""
    if weights is None:
        weights = tuple(t for proj in (module.gate_proj, module.up_proj, module.down_proj)
                        for t in (proj.weight, proj.bias))
    gate_w, gate_b, up_w, up_b, down_w, down_b = weights
    return F.linear(module.act_fn(F.linear(h, gate_w, gate_b)) * F.linear(h, up_w, up_b), down_w, down_b)


def norm(module, x: torch.Tensor) -> torch.Tensor:
    """The model's RMSNorm: in float32 as one kernel (transformers' arithmetic), otherwise its own forward."""
    if x.dtype == torch.float32 and module.weight.dtype == torch.float32:
        return F.rms_norm(x, module.weight.shape, module.weight, module.variance_epsilon)
    return module(x)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
