"""Decoding steps for Llama-family models without transformers' per-call machinery.

A decoding step of a small model is mostly overhead. transformers' forward builds an attention mask, looks up an
attention interface, updates a cache object and runs its output-capturing hooks on every call. For the 1 M
parameter benchmark model on a CPU that is about 2.4 ms a step, of which the matmuls are 0.6. This module runs
the decoding steps (not the prefill, which transformers does once per batch) of the architectures whose layers
are exactly "x += attn(norm(x)); x += mlp(norm(x))" with rotary embeddings: Llama, Qwen2 and Mistral, with full
attention. It uses the model's own weights, its rotary embedding, norms and activation, and the attention of its
`attn_implementation` (SDPA, or the eager matmul-softmax-matmul), in the same order as transformers' code. The
query, key and value projections run as one matmul over a copy of their weights made per batch (at most a quarter
of the layers' weights, much less with grouped-query attention; the MLP's larger projections are not copied).
Keys and values go into buffers sized for the whole completion, written in place. The tests check its logits and
tokens against transformers' forward.

Any other model (other architectures, LoRA layers, sharded parameters, sliding windows, quantised or fused
linear layers) gets None from `LeanDecoding.start` and decodes with transformers' forward.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from grpo.distributed import is_sharded

ARCHITECTURES = ("llama", "qwen2", "mistral")


def supported(model) -> bool:
    """Whether `model`'s decoding steps can run here: a plain (unwrapped) Llama, Qwen2 or Mistral causal LM
    with full attention, gated MLPs, plain `nn.Linear` layers and unsharded parameters."""
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


class LeanDecoding:
    """The decoding steps of one batch. `start` takes the prefill's cache; each `step(tokens)` feeds one token
    per row and returns the next logits (N, V), as transformers' forward with that cache would."""

    def __init__(self, model, keys: list[torch.Tensor], values: list[torch.Tensor], key_mask: torch.Tensor | None,
                 length: int, positions: torch.Tensor):
        self.model = model
        self.base = model.model
        self.keys, self.values = keys, values  # per layer (N, KV heads, capacity, head dim)
        self.key_mask = key_mask  # (N, 1, 1, capacity) bool, or None: no padding, every key is attended to
        self.length = length  # keys filled so far
        self.positions = positions  # (N, 1) rotary position of the next token
        self.eager = model.config._attn_implementation == "eager"
        self.qkv = [_fused_qkv(layer.self_attn, keys[0].device.type) for layer in self.base.layers]

    @classmethod
    def start(cls, model, cache, prompt_mask: torch.Tensor, steps: int) -> LeanDecoding | None:
        """Decoding state after a prefill whose transformers cache `cache` holds the (N, Lp) left-padded prompts'
        keys and values, with room for `steps` more tokens; None when `model` is not `supported`."""
        if not supported(model) or len(getattr(cache, "layers", ())) != len(model.model.layers):
            return None
        n, lp = prompt_mask.shape
        keys, values = [], []
        for layer in cache.layers:
            k, v = layer.keys, layer.values
            if k is None or k.shape[0] != n or k.shape[2] != lp:
                return None
            keys.append(k.new_empty(n, k.shape[1], lp + steps, k.shape[3]))
            values.append(v.new_empty(n, v.shape[1], lp + steps, v.shape[3]))
            keys[-1][:, :, :lp] = k
            values[-1][:, :, :lp] = v
        mask = None
        if not bool(prompt_mask.all()):
            mask = torch.ones(n, 1, 1, lp + steps, dtype=torch.bool, device=prompt_mask.device)
            mask[:, 0, 0, :lp] = prompt_mask.bool()
        return cls(model, keys, values, mask, lp, prompt_mask.sum(-1, keepdim=True))

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (N, V) after feeding `tokens` (N,)."""
        base, at = self.base, self.length
        x = base.embed_tokens(tokens.unsqueeze(1))  # (N, 1, hidden)
        cos, sin = base.rotary_emb(x, self.positions)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        mask = None if self.key_mask is None else self.key_mask[..., :at + 1]
        for i, layer in enumerate(base.layers):
            x = x + self._attention(layer.self_attn, _norm(layer.input_layernorm, x), cos, sin, i, at, mask)
            mlp = layer.mlp
            h = _norm(layer.post_attention_layernorm, x)
            h = mlp.act_fn(F.linear(h, mlp.gate_proj.weight, mlp.gate_proj.bias)) * F.linear(h, mlp.up_proj.weight,
                                                                                           mlp.up_proj.bias)
            x = x + F.linear(h, mlp.down_proj.weight, mlp.down_proj.bias)
        self.length += 1
        self.positions = self.positions + 1
        return self.model.lm_head(_norm(base.norm, x))[:, -1]

    def _attention(self, attn, h, cos, sin, i: int, at: int, mask) -> torch.Tensor:
        n, d = h.shape[0], attn.head_dim
        weight, bias, heads, kv_heads = self.qkv[i]
        qkv = F.linear(h, weight, bias).view(n, 1, -1, d).transpose(1, 2)  # (N, heads + 2 kv heads, 1, d)
        qk = qkv[:, :heads + kv_heads]
        qk = qk * cos + _rotate_half(qk) * sin  # rotary embedding of queries and keys at once
        q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads:]
        self.keys[i][:, :, at:at + 1] = k
        self.values[i][:, :, at:at + 1] = v
        keys, values = self.keys[i][:, :, :at + 1], self.values[i][:, :, :at + 1]
        if self.eager:  # transformers' eager attention; the query heads of a key head share its keys, no copies
            q = q.reshape(n, kv_heads, heads // kv_heads, d)
            w = torch.matmul(q, keys.transpose(2, 3)) * attn.scaling
            if mask is not None:
                w = w.masked_fill(~mask, torch.finfo(w.dtype).min)
            w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
            out = torch.matmul(w, values).reshape(n, heads, 1, d)
        else:
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=attn.scaling,
                                                 enable_gqa=heads != kv_heads)
        return attn.o_proj(out.transpose(1, 2).reshape(n, 1, heads * d))


def _fused_qkv(attn, device: str) -> tuple[torch.Tensor, torch.Tensor | None, int, int]:
    """The query, key and value projections as one (weight, bias, query heads, key heads): one matmul a step
    instead of three. A copy of those weights for the batch; under autocast, already in its dtype (the cast
    autocast would make of every projection at every step)."""
    projections = [attn.q_proj, attn.k_proj, attn.v_proj]
    weight = torch.cat([p.weight for p in projections])
    bias = None
    if any(p.bias is not None for p in projections):
        bias = torch.cat([p.bias if p.bias is not None else p.weight.new_zeros(p.out_features) for p in projections])
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        weight, bias = weight.to(dtype), None if bias is None else bias.to(dtype)
    d = attn.head_dim
    return weight, bias, attn.q_proj.out_features // d, attn.k_proj.out_features // d


def _norm(norm, x: torch.Tensor) -> torch.Tensor:
    """The model's RMSNorm: in float32 as one kernel (transformers' arithmetic), otherwise its own forward."""
    if x.dtype == torch.float32 and norm.weight.dtype == torch.float32:
        return F.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)
    return norm(x)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
