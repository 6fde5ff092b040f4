"""Decoding steps for Llama-family models without transformers' per-call machinery.

A decoding step of a small model is mostly overhead: for the 1 M parameter benchmark model on a CPU,
transformers' forward takes about 2.4 ms a step, of which the matmuls are 0.6. This module runs the decoding
steps (not the prefill, which transformers does once per batch) of the models `grpo.lean.supported` accepts,
with the layer pieces of `grpo.lean`. The query, key and value projections run as one matmul over a copy of
their weights made per batch (at most a quarter of the layers' weights, much less with grouped-query attention;
the MLP's larger projections are not copied). Keys and values go into buffers sized for the whole completion,
written in place. The tests check its logits and tokens against transformers' forward. Any other model gets
None from `LeanDecoding.start` and decodes with transformers' forward.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from grpo.lean import attention, mlp, norm, rotate_half, supported


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
            x = x + self._attention(layer.self_attn, norm(layer.input_layernorm, x), cos, sin, i, at, mask)
            x = x + mlp(layer.mlp, norm(layer.post_attention_layernorm, x))
        self.length += 1
        self.positions = self.positions + 1
        return self.model.lm_head(norm(base.norm, x))[:, -1]

    def _attention(self, attn, h, cos, sin, i: int, at: int, mask) -> torch.Tensor:
        n, d = h.shape[0], attn.head_dim
        weight, bias, heads, kv_heads = self.qkv[i]
        qkv = F.linear(h, weight, bias).view(n, 1, -1, d).transpose(1, 2)  # (N, heads + 2 kv heads, 1, d)
        qk = qkv[:, :heads + kv_heads]
        qk = qk * cos + rotate_half(qk) * sin  # rotary embedding of queries and keys at once
        q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads:]
        self.keys[i][:, :, at:at + 1] = k
        self.values[i][:, :, at:at + 1] = v
        keys, values = self.keys[i][:, :, :at + 1], self.values[i][:, :, :at + 1]
        out = attention(q, keys, values, mask, attn.scaling, self.eager)
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

