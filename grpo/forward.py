"""Log-probs of completion tokens under a model, for the loss, the reference and the old policy.

The sequence is the left-padded prompt followed by the right-padded completion. Where the model allows it
(an output projection without bias and no logit post-processing), the log-probs come straight from the last
hidden states and the output projection, chunk by chunk, so the (B, T, V) logits never exist.
"""
from __future__ import annotations

import torch

from grpo.algo import token_logprobs, token_logprobs_from_hidden


def _fusable(model) -> bool:
    head = model.get_output_embeddings()
    cfg = model.config
    return (isinstance(head, torch.nn.Linear) and head.bias is None
            and getattr(cfg, "final_logit_softcapping", None) is None
            and getattr(cfg, "logit_scale", None) in (None, 1.0))


def completion_logprobs(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                        completion_mask: torch.Tensor, *, temperature: float, chunk_size: int,
                        fused: bool = True) -> torch.Tensor:
    """(B, T) log-probs of `completion_ids` given the prompts, from logits / temperature (float32).
    `fused=False` forces the full-logits path (needed when the parameters are sharded)."""
    lp = prompt_ids.shape[1]
    t = completion_ids.shape[1]
    # the last completion token predicts nothing: feed up to the one before it
    ids = torch.cat([prompt_ids, completion_ids[:, :-1]], dim=1)
    attn = torch.cat([prompt_mask, completion_mask[:, :-1]], dim=1)
    position = (attn.cumsum(-1) - 1).clamp(min=0)
    if fused and _fusable(model):
        hidden = model.get_decoder()(input_ids=ids, attention_mask=attn, position_ids=position).last_hidden_state
        return token_logprobs_from_hidden(hidden[:, lp - 1:lp - 1 + t], model.get_output_embeddings().weight,
                                          completion_ids, temperature=temperature, chunk_size=chunk_size)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=position, logits_to_keep=t).logits  # (B, T, V)
    return token_logprobs(logits, completion_ids, temperature=temperature, chunk_size=chunk_size)
