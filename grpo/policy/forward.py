"""The policy's log-prob forward: log-probs of completion tokens under a model, for the loss, the reference and
the old policy, and `LogprobModule`, the module DDP and FSDP wrap.

How a forward pass runs is decided once, by `forward_path`, for the training and the reference pass alike (so
at the first step the two agree bit for bit):
- `fused`: where the model allows it (an output projection without bias and no logit post-processing) and the
  parameters are not sharded, the log-probs come straight from the last hidden states and the output
  projection, chunk by chunk, so the (B, T, V) logits never exist. Sharded parameters are gathered by the
  root module's forward, so FSDP takes the full-logits path (chunked log-probs).
- `share_prompt`: consecutive rows with the same prompt (the G completions of a group) run that prompt through
  the model once: its keys and values are computed for one row and repeated for the others, and the completions
  attend to them as to a KV cache. Gradients flow through the shared keys and values, so the result is the same
  as running every row in full (to floating-point rounding), for a fraction of the prompt tokens. Not under
  FSDP or gradient checkpointing, which run every row in full.
- `lean`: models that `grpo.policy.lean.supported_for_training` accepts (Llama, Qwen2, Mistral) run through
  `grpo.policy.lean.completion_hidden`: the same arithmetic on the model's own weights, with the prompt and
  completion tokens of the batch in one flat batch of positions and without transformers' per-call machinery.
- `packing` (`compute.packing`): the forward runs over the attended tokens alone, no padding
  (`grpo.policy.inputs.packed_inputs`): on the lean path, the projections, norms, MLPs and output projection see
  each shared prompt once and each row's attended completion tokens (attention alone goes back to the padded
  layout: `grpo.policy.lean.packed_hidden`); on transformers' path, one row of the sequences one after another,
  with position ids restarting at each, from which transformers' masks keep every sequence to itself
  (`transformers.masking_utils.find_packed_sequence_indices`). The log-probs come from the positions that
  predict attended completion tokens alone and are 0 at the other positions (which every caller masks). Where
  packing cannot apply, `packing_unavailable` says why and the forward runs unpacked.
- `autocast_bf16`: the forward runs under bfloat16 autocast.
"""
from __future__ import annotations

import contextlib
import inspect
import sys
from dataclasses import dataclass

import torch

from grpo.algo import token_logprobs, token_logprobs_from_hidden
from grpo.policy import lean as lean_layers
from grpo.policy.context import is_checkpointing
from grpo.policy.inputs import PackedInputs, model_inputs, packed_inputs
from grpo.vision import is_multimodal, mask_placeholders, placeholder_ids


@dataclass(frozen=True)
class ForwardPath:
    """How the log-prob forward runs (see the module docstring); made by `forward_path`."""

    fused: bool = True
    share_prompt: bool = False
    lean: bool = False
    autocast_bf16: bool = False
    packing: bool = False
    # a vision-language model: every row in full through the whole model (its vision tower and multimodal
    # positions), full logits with the image placeholders masked out; the fused, lean, shared-prompt and packed
    # paths do not apply
    multimodal: bool = False


def forward_path(model, *, sharded: bool = False, share_prompt: bool = False, lean: bool = False,
                 autocast_bf16: bool = False, packing: bool = False) -> ForwardPath:
    """The one decision of how log-probs of `model` are computed: the options asked for, where the model allows
    them. `sharded`: the parameters are (or will be) FSDP2 shards."""
    if is_multimodal(model):  # the image inputs go through the whole model's forward (docs/vision.md)
        return ForwardPath(fused=False, autocast_bf16=autocast_bf16, multimodal=True)
    fused = not sharded and fusable(model)
    share_prompt = share_prompt and not sharded and not is_checkpointing(model)
    lean = fused and lean and lean_layers.supported_for_training(model)
    packing = packing and packing_unavailable(model, share_prompt=share_prompt, lean=lean) is None
    return ForwardPath(fused=fused, share_prompt=share_prompt, lean=lean, autocast_bf16=autocast_bf16,
                       packing=packing)


# the attention kernels whose packed masks the tests compare with unpacked rows
_PACKED_ATTENTION = ("sdpa", "eager")


def packing_unavailable(model, *, share_prompt: bool, lean: bool) -> str | None:
    """Why the forward of `model` cannot run packed on the path decided (`share_prompt`, `lean`: as applied), or
    None where it can. The lean path always can; transformers' path needs one packed row that its masks split by
    the position ids."""
    if lean:
        return None
    if share_prompt:
        return ("compute.share_prompt runs each group's prompt once through transformers' forward with a cache; "
                "packing on transformers' path needs every row in full (compute.share_prompt=false packs)")
    cfg = model.config
    if getattr(cfg, "vision_config", None) is not None or "mrope_section" in str(
            getattr(cfg, "rope_scaling", None) or getattr(cfg, "rope_parameters", None) or ""):
        return "a multimodal model's rotary positions are not one position per token"
    if (getattr(cfg, "sliding_window", None) is not None and getattr(cfg, "use_sliding_window", True)) or any(
            t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])):
        return "sliding-window attention is not among the packed masks the tests compare with unpacked rows"
    attn = getattr(cfg, "_attn_implementation", None)
    if attn not in _PACKED_ATTENTION:
        return (f"attention {attn!r}: packed rows are compared with unpacked ones for "
                f"{' and '.join(map(repr, _PACKED_ATTENTION))} attention only")
    decoder = model.get_decoder()
    if "position_ids" not in inspect.signature(decoder.forward).parameters or not any(
            hasattr(sys.modules.get(c.__module__), "create_causal_mask") for c in type(decoder).__mro__):
        return (f"{type(decoder).__name__} does not build its attention masks with transformers' masking_utils, "
                "which keeps packed sequences apart by their position ids")
    return None


def fusable(model) -> bool:
    """Whether log-probs can come from the hidden states and the output projection's weight alone."""
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
                        path: ForwardPath | None = None, entropy: bool = False,
                        truncation: tuple[int, float] | None = None, images: dict | None = None):
    """(B, T) log-probs of `completion_ids` given the prompts, from logits / temperature (float32), computed
    as `path` says (None: `forward_path(model)`, fused where the model allows, nothing else). The caller
    enters autocast; `path.autocast_bf16` is `LogprobModule`'s to apply. `entropy=True`: (log-probs, the
    policy's entropy at each of those positions), the latter from the same chunks. `truncation=(top_k, top_p)`:
    also, last, the log-probs renormalised over the sampler's kept set (SPEC 14.12; `grpo.algo.token_logprobs`).
    `images`: the rows' image tensors (`grpo.vision.join`), for a vision-language model."""
    path = path or forward_path(model)
    if path.multimodal:
        return _multimodal_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, images,
                                    temperature=temperature, chunk_size=chunk_size, entropy=entropy,
                                    truncation=truncation)
    if path.packing:
        return _packed_logprobs(model, path, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                temperature=temperature, chunk_size=chunk_size, entropy=entropy, truncation=truncation)
    lp = prompt_ids.shape[1]
    t = completion_ids.shape[1]
    # the last completion token predicts nothing: feed up to the one before it
    inputs = model_inputs(torch.cat([prompt_ids, completion_ids[:, :-1]], dim=1),
                          torch.cat([prompt_mask, completion_mask[:, :-1]], dim=1))
    ids, attn, position = inputs.input_ids, inputs.attention_mask, inputs.position_ids
    if path.fused:
        hidden = None
        if path.lean:
            if path.share_prompt:
                first, group = prompt_groups(prompt_ids, prompt_mask)
            else:
                first = group = torch.arange(ids.shape[0], device=ids.device)
            hidden = lean_layers.completion_hidden(model, ids, attn, position, lp, group, first)
        elif path.share_prompt and t > 1:
            hidden = _shared_prompt_hidden(model.get_decoder(), ids, attn, position, lp)
        if hidden is None:
            hidden = model.get_decoder()(**inputs.forward_kwargs()).last_hidden_state
            hidden = hidden[:, lp - 1:lp - 1 + t]
        device = hidden.device.type
        # under autocast the projection runs in the autocast dtype, as it would as an nn.Linear
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        return token_logprobs_from_hidden(hidden, model.get_output_embeddings().weight, completion_ids,
                                          temperature=temperature, chunk_size=chunk_size, matmul_dtype=dtype,
                                          entropy=entropy, truncation=truncation)
    logits = model(**inputs.forward_kwargs(), logits_to_keep=t).logits  # (B, T, V)
    return token_logprobs(logits, completion_ids, temperature=temperature, chunk_size=chunk_size, entropy=entropy,
                          truncation=truncation)


def _multimodal_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, images, *,
                         temperature: float, chunk_size: int, entropy: bool, truncation):
    """`completion_logprobs` of a vision-language model: its whole forward over the rows with their images and
    positions (`model_inputs`), the logits of the completion positions with the placeholders masked as the
    generator masks them, so that the policy the trainer computes is the one that sampled."""
    t = completion_ids.shape[1]
    inputs = model_inputs(torch.cat([prompt_ids, completion_ids[:, :-1]], dim=1),
                          torch.cat([prompt_mask, completion_mask[:, :-1]], dim=1), images, model)
    logits = model(**inputs.forward_kwargs(), logits_to_keep=t).logits  # (B, T, V)
    banned = placeholder_ids(model)
    logits = mask_placeholders(logits, torch.tensor(banned, device=logits.device) if banned else None)
    return token_logprobs(logits, completion_ids, temperature=temperature, chunk_size=chunk_size, entropy=entropy,
                          truncation=truncation)


def _packed_logprobs(model, path: ForwardPath, prompt_ids, prompt_mask, completion_ids, completion_mask, *,
                     temperature: float, chunk_size: int, entropy: bool, truncation):
    """`completion_logprobs` over the attended tokens alone (`path.packing`): the same outputs, (B, T) each, from
    the positions that predict attended completion tokens, 0 at the others."""
    if path.share_prompt and path.lean:
        first, group = prompt_groups(prompt_ids, prompt_mask)
    else:
        first = group = torch.arange(prompt_ids.shape[0], device=prompt_ids.device)
    packed = packed_inputs(prompt_ids, prompt_mask, completion_ids, completion_mask, group, first)
    targets = completion_ids[packed.wanted].unsqueeze(0)  # (1, M)
    if path.fused:
        if path.lean:
            hidden = lean_layers.packed_hidden(model, packed)
        else:
            hidden = model.get_decoder()(**_packed_kwargs(packed)).last_hidden_state[0]
        hidden = hidden.index_select(0, packed.predictors).unsqueeze(0)  # (1, M, H)
        device = hidden.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        out = token_logprobs_from_hidden(hidden, model.get_output_embeddings().weight, targets,
                                         temperature=temperature, chunk_size=chunk_size, matmul_dtype=dtype,
                                         entropy=entropy, truncation=truncation)
    else:
        logits = model(**_packed_kwargs(packed), logits_to_keep=packed.predictors).logits  # (1, M, V)
        out = token_logprobs(logits, targets, temperature=temperature, chunk_size=chunk_size, entropy=entropy,
                             truncation=truncation)
    unpacked = [x[0].new_zeros(packed.wanted.shape).masked_scatter(packed.wanted, x[0])
                for x in (out if isinstance(out, tuple) else (out,))]
    return tuple(unpacked) if isinstance(out, tuple) else unpacked[0]


def _packed_kwargs(packed: PackedInputs) -> dict[str, torch.Tensor | bool | None]:
    """A transformers forward over one packed row: no attention mask and no cache, so that its masks find the
    sequences from the position ids (`find_packed_sequence_indices` runs only without both; with the cache that
    `use_cache` left at the config's default makes, the row would be one causal sequence: the tests fail)."""
    return {"input_ids": packed.input_ids.unsqueeze(0), "position_ids": packed.position_ids.unsqueeze(0),
            "attention_mask": None, "use_cache": False}


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


class LogprobModule(torch.nn.Module):
    """The policy as a module whose forward returns completion log-probs, so DDP and FSDP see the one forward
    pass the loss needs."""

    def __init__(self, model, path: ForwardPath | None = None, *, adapter_off: bool = False, train_mode: bool = False):
        """`path`: how the forward runs (`forward_path`; None: its defaults for `model`).
        `adapter_off`: a LoRA model with its adapter disabled (the reference, without a second copy).
        `train_mode`: run the forward in train mode (gradient checkpointing needs it; dropout is off anyway)."""
        super().__init__()
        self.model = model
        self.path = path or forward_path(model)
        self.adapter_off = adapter_off
        self.train_mode = train_mode

    def forward(self, prompt_ids, prompt_mask, completion_ids, completion_mask, *, temperature: float,
                chunk_size: int, entropy: bool = False, truncation: tuple[int, float] | None = None,
                images: dict | None = None):
        with contextlib.ExitStack() as stack:
            if self.adapter_off:
                stack.enter_context(self.model.disable_adapter())
            stack.enter_context(torch.autocast(prompt_ids.device.type, dtype=torch.bfloat16,
                                               enabled=self.path.autocast_bf16))
            if self.train_mode and torch.is_grad_enabled():
                self.model.train()
                stack.callback(self.model.eval)
            return completion_logprobs(self.model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                       temperature=temperature, chunk_size=chunk_size, path=self.path,
                                       entropy=entropy, truncation=truncation, images=images)
