"""Prefill and decoding steps for Llama-family models without transformers' per-call machinery.

A decoding step of a small model is mostly overhead: for the 1 M parameter benchmark model on a CPU,
transformers' forward takes about 2.4 ms a step, of which the matmuls are 0.6. This module runs the prefill and
the decoding steps of the models `grpo.policy.lean.supported` accepts, with the layer pieces of `grpo.policy.lean`:
- the prefill is `grpo.policy.lean.completion_hidden` over the prompts alone, each prompt once; its keys and values go
  straight into buffers sized for the whole completion, one copy per completion of the group;
- each step writes its keys and values into those buffers in place. The query, key and value projections run
  as one matmul over a copy of their weights made per batch (at most a quarter of the layers' weights, much
  less with grouped-query attention; the MLP's larger projections are not copied). The rotary embedding comes
  from a table of cos and sin made once per batch (except for the RoPE types that rescale with the length).
  For a float32 model without autocast the single-query attention is two batched matmuls over the buffers, with
  the key padding as an additive bias; under autocast, or in another dtype, it is the model's kernel
  (`grpo.policy.lean.attention`), as in transformers.
The tests check its logits and tokens against transformers' forward. Any other model gets None from
`LeanDecoding.prefill` and decodes with transformers' forward.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from grpo.policy.lean import attention, completion_hidden, mlp, norm, rotate_half, supported


class LeanDecoding:
    """The decoding steps of one batch. `prefill` runs the prompts; each `step(tokens)` feeds one token per row
    and returns the next logits (N, V), as transformers' forward with a KV cache would."""

    def __init__(self, model, keys: list[torch.Tensor], values: list[torch.Tensor], key_mask: torch.Tensor,
                 length: int, positions: torch.Tensor):
        self.model = model
        self.base = base = model.model
        self.keys, self.values = keys, values  # per layer (N, KV heads, capacity, head dim)
        self.length = length  # keys filled so far
        self.positions = positions  # (N,) rotary position of the next token
        self.eager = model.config._attn_implementation == "eager"
        device = keys[0].device.type
        self.qkv = [_fused_qkv(layer.self_attn, device) for layer in base.layers]
        n, kv_heads, capacity = keys[0].shape[:3]
        # float32 without autocast: the single-query attention as two batched matmuls (one row per key head),
        # the prompt padding as an additive bias; otherwise the model's kernel, with a boolean mask (None: no
        # padding). `key_mask` (N, capacity) is True where a key is attended to.
        self.matmul_attention = (not torch.is_autocast_enabled(device) and keys[0].dtype == torch.float32
                                 and values[0].dtype == torch.float32)
        if self.matmul_attention:
            bias = torch.zeros(n, kv_heads, 1, capacity, dtype=torch.float32, device=key_mask.device)
            self.bias = bias.masked_fill_(~key_mask[:, None, None, :], float("-inf")).view(n * kv_heads, 1, capacity)
        else:
            self.key_mask = None if bool(key_mask.all()) else key_mask[:, None, None, :]
        rope = getattr(base.rotary_emb, "rope_type", "default")
        self.table = None  # (cos, sin) by position, when the rotary embedding does not depend on the length
        if isinstance(rope, str) and "dynamic" not in rope and rope != "longrope":
            x = base.embed_tokens.weight[:1].unsqueeze(0)  # the dtype and device of the hidden states
            cos, sin = base.rotary_emb(x, torch.arange(capacity, device=x.device).unsqueeze(0))
            self.table = cos[0], sin[0]

    @classmethod
    def prefill(cls, model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, n: int,
                steps: int) -> tuple[LeanDecoding, torch.Tensor] | None:
        """Run the (P, Lp) left-padded prompts once, for n completions each of up to `steps` more tokens: the
        decoding state of the P·n rows (a prompt's n rows consecutive) and their first logits (P·n, V); None
        when `model` is not `supported`."""
        if not supported(model):
            return None
        p, lp = prompt_ids.shape
        position = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
        rows = torch.arange(p, device=prompt_ids.device)
        prompt_kv = []
        last = completion_hidden(model, prompt_ids, prompt_mask, position, lp, rows, rows, prompt_kv)[:, 0]
        head = model.get_output_embeddings()
        logits = F.linear(last, head.weight, head.bias).repeat_interleave(n, dim=0)
        keys, values = [], []
        for k, v in prompt_kv:  # (P, KV heads, lp, head dim): each prompt's keys, copied for its n rows
            for src, dst in ((k, keys), (v, values)):
                buffer = src.new_empty(p, n, src.shape[1], lp + steps, src.shape[3])
                buffer[:, :, :, :lp] = src.unsqueeze(1)
                dst.append(buffer.view(p * n, src.shape[1], lp + steps, src.shape[3]))
        key_mask = torch.ones(p * n, lp + steps, dtype=torch.bool, device=prompt_mask.device)
        key_mask[:, :lp] = prompt_mask.bool().repeat_interleave(n, dim=0)
        return cls(model, keys, values, key_mask, lp, prompt_mask.sum(-1).repeat_interleave(n)), logits

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (N, V) after feeding `tokens` (N,)."""
        base, at = self.base, self.length
        x = base.embed_tokens(tokens)  # (N, hidden)
        if self.table is not None:
            cos, sin = (t.index_select(0, self.positions).unsqueeze(1) for t in self.table)
        else:
            cos, sin = base.rotary_emb(x.unsqueeze(1), self.positions.unsqueeze(1))
        for i, layer in enumerate(base.layers):
            x = x + self._attention(layer.self_attn, norm(layer.input_layernorm, x), cos, sin, i, at)
            x = x + mlp(layer.mlp, norm(layer.post_attention_layernorm, x))
        self.length += 1
        self.positions = self.positions + 1
        head = self.model.get_output_embeddings()
        return F.linear(norm(base.norm, x), head.weight, head.bias)

    def _attention(self, attn, h, cos, sin, i: int, at: int) -> torch.Tensor:
        n, d = h.shape[0], attn.head_dim
        weight, bias, heads, kv_heads = self.qkv[i]
        qkv = F.linear(h, weight, bias).view(n, -1, d)  # (N, heads + 2 kv heads, d)
        qk = qkv[:, :heads + kv_heads]
        qk = qk * cos + rotate_half(qk) * sin  # rotary embedding of queries and keys at once
        q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads:]
        self.keys[i][:, :, at] = k
        self.values[i][:, :, at] = v
        keys, values = self.keys[i][:, :, :at + 1], self.values[i][:, :, :at + 1]
        if not self.matmul_attention:
            mask = None if self.key_mask is None else self.key_mask[..., :at + 1]
            out = attention(q.unsqueeze(2), keys, values, mask, attn.scaling, self.eager)  # (N, heads, 1, d)
            return attn.o_proj(out.reshape(n, heads * d))
        # one query per row: scores and weighted values as batched matmuls, the query heads of a key head together
        b, group = n * kv_heads, heads // kv_heads
        scores = torch.baddbmm(self.bias[:, :, :at + 1], q.reshape(b, group, d),
                               keys.reshape(b, at + 1, d).transpose(1, 2), alpha=attn.scaling)
        out = torch.bmm(scores.softmax(dim=-1), values.reshape(b, at + 1, d))  # (N·kv heads, group, d)
        return F.linear(out.view(n, heads * d), attn.o_proj.weight, attn.o_proj.bias)


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
