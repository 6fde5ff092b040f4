"""Prefill and decoding steps for Llama-family models without transformers' per-call machinery.

A decoding step of a small model is mostly overhead: for the 1 M parameter benchmark model on a CPU,
transformers' forward takes about 2.4 ms a step, of which the matmuls are 0.6. This module runs the prefill and
the decoding steps of the models `grpo.policy.lean.supported` accepts, with the layer pieces of `grpo.policy.lean`:
- the prefill is `grpo.policy.lean.completion_hidden` over the prompts alone, each prompt once; its keys and values go
  straight into buffers sized for the whole completion, one copy per completion of the group;
- each step writes its keys and values into those buffers in place. The query, key and value projections run
  as one matmul over a copy of their weights made per batch (at most a quarter of the layers' weights, much
  less with grouped-query attention). Under autocast every weight a step reads is cast to the autocast dtype
  once per batch, the same values autocast would make at every step (for SmolLM2-135M the bfloat16 copies take
  270 MB while the batch decodes, and each step reads them instead of 538 MB of float32). The rotary embedding comes
  from a table of cos and sin made once per batch (except for the RoPE types that rescale with the length).
  For a float32 model without autocast the single-query attention is two batched matmuls over the buffers, with
  the key padding as an additive bias; under autocast, or in another dtype, it is the model's kernel
  (`grpo.policy.lean.attention`), as in transformers.
- `keep(rows)` drops the rows the sampler has finished with: every per-row tensor (keys, values, positions, the key
  bias or mask) is index-selected, a copy of the rows kept, and the following steps compute only those.
A LoRA policy (peft's plain `lora.Linear` layers) decodes here too, from `merged_lora`: a view of its base model
whose adapted projections hold W + ΔW, made once per batch (its other modules, the embeddings, norms and head, are
the model's own). Its logits equal the adapter's forward W x + s·B(A x) up to rounding; the trainer computes the
log-probs of the loss with the adapter itself, so that rounding only touches which tokens are drawn, as a
different matmul kernel would. Where the merged weights are no longer needed they are freed with the batch.
The tests check its logits and tokens against transformers' forward. Any other model gets None from
`LeanDecoding.prefill` and decodes with transformers' forward.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from grpo.policy.inputs import model_inputs
from grpo.policy.lean import attention, completion_hidden, mlp, norm, rotate_half, supported
from grpo.policy.lora import lora_merged_weight


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
        # the other weights each step reads, cast once per batch under autocast (bit for bit the cast autocast
        # makes of every projection at every step, which reads the float32 weights and writes a copy each time)
        cast = _autocast_cast(device)
        self.out_proj = [(cast(layer.self_attn.o_proj.weight), cast(layer.self_attn.o_proj.bias))
                         for layer in base.layers]
        self.mlps = [tuple(cast(t) for proj in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)
                           for t in (proj.weight, proj.bias)) for layer in base.layers]
        head = model.get_output_embeddings()
        self.head = cast(head.weight), cast(head.bias)
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
        when `model` is not `supported` (a LoRA model decodes from its `merged_lora` view)."""
        model = merged_lora(model) or model
        if not supported(model):
            return None
        p, lp = prompt_ids.shape
        inputs = model_inputs(prompt_ids, prompt_mask)
        rows = torch.arange(p, device=prompt_ids.device)
        prompt_kv = []
        last = completion_hidden(model, prompt_ids, prompt_mask, inputs.position_ids, lp, rows, rows, prompt_kv)[:, 0]
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
        return cls(model, keys, values, key_mask, lp, inputs.next_position.repeat_interleave(n)), logits

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only the state of `rows` (indices of the rows held now, in the order the next steps take them):
        every per-row tensor (the keys and values, the positions, the key bias or mask) is index-selected, which
        copies the keys and values of the rows kept."""
        self.keys = [k.index_select(0, rows) for k in self.keys]
        self.values = [v.index_select(0, rows) for v in self.values]
        self.positions = self.positions.index_select(0, rows)
        if self.matmul_attention:
            kv_heads, capacity = self.keys[0].shape[1], self.bias.shape[-1]
            self.bias = self.bias.view(-1, kv_heads, 1, capacity).index_select(0, rows).view(-1, 1, capacity)
        elif self.key_mask is not None:
            self.key_mask = self.key_mask.index_select(0, rows)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (N, V) after feeding `tokens` (N,), N the rows held (all of the batch's, or those `keep` kept)."""
        base, at = self.base, self.length
        x = base.embed_tokens(tokens)  # (N, hidden)
        if self.table is not None:
            cos, sin = (t.index_select(0, self.positions).unsqueeze(1) for t in self.table)
        else:
            cos, sin = base.rotary_emb(x.unsqueeze(1), self.positions.unsqueeze(1))
        for i, layer in enumerate(base.layers):
            x = x + self._attention(layer.self_attn, norm(layer.input_layernorm, x), cos, sin, i, at)
            x = x + mlp(layer.mlp, norm(layer.post_attention_layernorm, x), self.mlps[i])
        self.length += 1
        self.positions = self.positions + 1
        return F.linear(norm(base.norm, x), *self.head)

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
            return F.linear(out.reshape(n, heads * d), *self.out_proj[i])
        # one query per row: scores and weighted values as batched matmuls, the query heads of a key head together
        b, group = n * kv_heads, heads // kv_heads
        scores = torch.baddbmm(self.bias[:, :, :at + 1], q.reshape(b, group, d),
                               keys.reshape(b, at + 1, d).transpose(1, 2), alpha=attn.scaling)
        out = torch.bmm(scores.softmax(dim=-1), values.reshape(b, at + 1, d))  # (N·kv heads, group, d)
        return F.linear(out.view(n, heads * d), *self.out_proj[i])


def _autocast_cast(device: str):
    """A function that casts a tensor (or None) to the autocast dtype when autocast is on, else the identity."""
    if not torch.is_autocast_enabled(device):
        return lambda t: t
    dtype = torch.get_autocast_dtype(device)
    return lambda t: None if t is None else t.to(dtype)


def _fused_qkv(attn, device: str) -> tuple[torch.Tensor, torch.Tensor | None, int, int]:
    """The query, key and value projections as one (weight, bias, query heads, key heads): one matmul a step
    instead of three. A copy of those weights for the batch; under autocast, already in its dtype (the cast
    autocast would make of every projection at every step)."""
    projections = [attn.q_proj, attn.k_proj, attn.v_proj]
    weight = torch.cat([p.weight for p in projections])
    bias = None
    if any(p.bias is not None for p in projections):
        bias = torch.cat([p.bias if p.bias is not None else p.weight.new_zeros(p.out_features) for p in projections])
    cast = _autocast_cast(device)
    weight, bias = cast(weight), cast(bias)
    d = attn.head_dim
    return weight, bias, attn.q_proj.out_features // d, attn.k_proj.out_features // d


def merged_lora(model):
    """For a peft model whose adapters are all plain LoRA on `nn.Linear` layers (no DoRA, not merged in place,
    not disabled): a view of its base model in which every adapted layer is an `nn.Linear` holding W + ΔW of
    the active adapters. It shares every other module and parameter with `model`; nothing of `model` changes.
    None for any other model."""
    if not (hasattr(model, "peft_config") and hasattr(model, "get_base_model")):
        return None
    from peft.tuners.lora import Linear as LoraLinear, LoraLayer
    base = model.get_base_model()
    layers = [m for m in base.modules() if isinstance(m, LoraLayer)]
    if not layers or any(type(m) is not LoraLinear or m.merged or m.disable_adapters or m.fan_in_fan_out
                         or any(m.use_dora.get(a, False) for a in m.active_adapters)
                         or type(m.base_layer) is not torch.nn.Linear for m in layers):
        return None
    with torch.no_grad():
        return _rebuild(base)


def _rebuild(module):
    """`module`, or where a LoRA layer sits below it a shallow copy with that layer replaced by its merge."""
    from peft.tuners.lora import LoraLayer
    if isinstance(module, LoraLayer):
        linear = module.base_layer
        merged = torch.nn.Linear(linear.in_features, linear.out_features, bias=False, device="meta")
        merged.weight = torch.nn.Parameter(lora_merged_weight(module), requires_grad=False)
        merged.bias = linear.bias
        return merged
    children = {name: _rebuild(child) for name, child in module._modules.items() if child is not None}
    if all(children[name] is child for name, child in module._modules.items() if child is not None):
        return module
    view = copy.copy(module)
    view._modules = {**module._modules, **children}
    return view
