"""Log-probs of completion tokens under a model, for the loss, the reference and the old policy.

The sequence is the left-padded prompt followed by the right-padded completion. Where the model allows it
(an output projection without bias and no logit post-processing), the log-probs come straight from the last
hidden states and the output projection, chunk by chunk, so the (B, T, V) logits never exist.

With `share_prompt`, consecutive rows with the same prompt (the G completions of a group) run that prompt
through the model once: its keys and values are computed for one row and repeated for the others, and the
completions attend to them as to a KV cache. Gradients flow through the shared keys and values, so the result
is the same as running every row in full (to floating-point rounding), for a fraction of the prompt tokens.

With `lean`, models that `grpo.lean.supported_for_training` accepts (Llama, Qwen2, Mistral) run that forward
pass through `grpo.lean.completion_hidden`: the same arithmetic on the model's own weights, with the prompt and
completion tokens of the batch in one flat batch of positions and without transformers' per-call machinery.
"""
from __future__ import annotations

import torch

from grpo import lean as lean_layers
from grpo.algo import token_logprobs, token_logprobs_from_hidden


def _fusable(model) -> bool:
    head = model.get_output_embeddings()
    cfg = model.config
    return (isinstance(head, torch.nn.Linear) and head.bias is None
            and getattr(cfg, "final_logit_softcapping", None) is None
            and getattr(cfg, "logit_scale", None) in (None, 1.0))


def prompt_groups(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs of identical consecutive prompts: (first row of each run, run index of every row)."""
    key = torch.cat([prompt_ids * prompt_mask, prompt_mask], dim=1)
    new = torch.ones(key.shape[0], dtype=torch.bool, device=key.device)
    new[1:] = (key[1:] != key[:-1]).any(dim=1)
    return new.nonzero().squeeze(1), new.long().cumsum(0) - 1


def completion_logprobs(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                        completion_mask: torch.Tensor, *, temperature: float, chunk_size: int,
                        fused: bool = True, share_prompt: bool = False, lean: bool = False) -> torch.Tensor:
    """(B, T) log-probs of `completion_ids` given the prompts, from logits / temperature (float32).
    `fused=False` forces the full-logits path (needed when the parameters are sharded); `share_prompt` runs
    each run of identical consecutive prompts once and `lean` runs supported models through `grpo.lean` (both
    on the fused path only)."""
    lp = prompt_ids.shape[1]
    t = completion_ids.shape[1]
    # the last completion token predicts nothing: feed up to the one before it
    ids = torch.cat([prompt_ids, completion_ids[:, :-1]], dim=1)
    attn = torch.cat([prompt_mask, completion_mask[:, :-1]], dim=1)
    position = (attn.cumsum(-1) - 1).clamp(min=0)
    if fused and _fusable(model):
        hidden = None
        if lean and lean_layers.supported_for_training(model):
            if share_prompt:
                first, group = prompt_groups(prompt_ids, prompt_mask)
            else:
                first = group = torch.arange(ids.shape[0], device=ids.device)
            hidden = lean_layers.completion_hidden(model, ids, attn, position, lp, group, first)
        elif share_prompt and t > 1:
            hidden = _shared_prompt_hidden(model.get_decoder(), ids, attn, position, lp)
        if hidden is None:
            hidden = model.get_decoder()(input_ids=ids, attention_mask=attn, position_ids=position).last_hidden_state
            hidden = hidden[:, lp - 1:lp - 1 + t]
        device = hidden.device.type
        # under autocast the projection runs in the autocast dtype, as it would as an nn.Linear
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        return token_logprobs_from_hidden(hidden, model.get_output_embeddings().weight, completion_ids,
                                          temperature=temperature, chunk_size=chunk_size, matmul_dtype=dtype)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=position, logits_to_keep=t).logits  # (B, T, V)
    return token_logprobs(logits, completion_ids, temperature=temperature, chunk_size=chunk_size)


def _shared_prompt_hidden(decoder, ids, attn, position, lp: int) -> torch.Tensor | None:
    """The hidden states at the positions that predict the completion tokens, (B, T, H), running each run of
    identical prompts once; None when no prompt repeats or the model returns no cache (e.g. gradient
    checkpointing in train mode switches the cache off)."""
    first, group = prompt_groups(ids[:, :lp], attn[:, :lp])
    if len(first) == ids.shape[0]:
        return None
    out = decoder(input_ids=ids[first, :lp], attention_mask=attn[first, :lp], position_ids=position[first, :lp],
                  use_cache=True)
    cache = out.past_key_values
    if cache is None:
        return None
    cache.batch_select_indices(group)  # every row gets its prompt's keys and values (differentiable)
    rest = decoder(input_ids=ids[:, lp:], attention_mask=attn, position_ids=position[:, lp:],
                   past_key_values=cache, use_cache=True).last_hidden_state
    return torch.cat([out.last_hidden_state[group, -1:], rest], dim=1)
