"""What any vLLM rollout backend shares, whether its engine lives in the training process
(`grpo.rollout.vllm_colocate`, `rollout.backend=vllm`) or elsewhere:

- `import_vllm`: the import, with the command that installs it when it is missing or broken;
- `engine_weights` and `write_start`: the policy's weights as a vLLM engine loads them, under the names of its
  transformers checkpoint: LoRA merged (W + ΔW, computed without touching the policy), FSDP2 shards gathered (a
  collective: every rank calls it); `write_start` puts them, with the config and tokenizer, in the directory an
  engine starts from;
- `sampling_params`: a `Sampling` and each prompt's seed and token limit as vLLM's `SamplingParams` (the engine's
  log-probs of the sampled tokens after temperature, `processed_logprobs`, for the mismatch correction, SPEC 13.1;
  of the distribution it sampled from: with rollout.repetition_penalty, the penalised one);
- `rows_from_outputs`: vLLM's `RequestOutput`s as a `Rollout`, as the in-process generator would have made it;
- `refresh_cpu_heads`: what an in-place weight reload leaves stale on the CPU, renewed.
"""
from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from grpo.errors import DataError, GRPOError
from grpo.policy.lora import lora_merged_weight
from grpo.rollout.base import Rollout, Sampling, encode_prompts, prompt_limits, prompt_seeds, stop_text

INSTALL = "pip install -e '.[vllm]' (or: make setup-vllm)"


class EngineError(GRPOError):
    """The vLLM engine failed to start, to sample or to take new weights, or did not answer in time."""


def import_vllm():
    """The vllm module, or a ConfigError that names the install command."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # an engine made here runs in this process
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")   # leave the trainer's threads alone
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from grpo.errors import ConfigError
    try:
        import vllm
    except ImportError as e:
        raise ConfigError(f"rollout.backend=vllm needs vLLM, which is not installed ({e}); install it with "
                          f"{INSTALL}") from None
    except Exception as e:  # noqa: BLE001 - e.g. a torchvision built for another torch
        raise ConfigError(f"vLLM is installed but cannot be imported: {first_line(e)}; reinstall it with "
                          f"{INSTALL}, which also removes the torchvision/torchaudio builds that break it") from None
    return vllm


def snapshot_weights(model) -> dict[str, torch.Tensor]:
    """A copy of `engine_weights(model)` that later updates of the policy leave as it is: what asynchronous
    sampling (`rollout.max_staleness`) hands the engine later, as `sync_weights(snapshot, version)`. Every
    process calls it (the FSDP2 gather is a collective)."""
    return {name: t.clone() for name, t in engine_weights(model)}


def engine_weights(model) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's weights under the names of its transformers checkpoint, whole, detached: a LoRA model's
    adapted weights merged (W + ΔW; the policy itself is not touched), FSDP2 shards gathered (a collective).
    `model` may also be a `snapshot_weights` dict, whose tensors are already these."""
    if isinstance(model, dict):
        yield from model.items()
        return
    lora = hasattr(model, "peft_config") and hasattr(model, "get_base_model")
    layers = {}
    if lora:
        from peft.tuners.lora import Embedding, Linear, LoraLayer
        layers = {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}
        other = sorted({type(m).__name__ for m in layers.values() if not isinstance(m, (Linear, Embedding))})
        if other:
            raise DataError(f"cannot merge LoRA layers of type {', '.join(other)} for the vLLM engine; adapt "
                            "linear and embedding layers only (lora.target_modules)")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if lora:
                if ".lora_" in name:
                    continue
                owner = name.rsplit(".", 2)[0] if ".base_layer." in name else None
                if owner in layers and name.endswith(".base_layer.weight"):
                    p = lora_merged_weight(layers[owner])  # W + ΔW, as the adapted layer computes it
                name = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
            t = p.detach()
            if hasattr(t, "full_tensor"):  # FSDP2: every rank gathers the whole tensor
                t = t.full_tensor()
            yield name, t


def write_start(model, tokenizer, path: Path) -> None:
    """What an engine starts from, written into `path`: the config, tokenizer and current weights of the policy."""
    from safetensors.torch import save_file

    weights = {n: t.to("cpu").contiguous() for n, t in engine_weights(model)}
    base_config(model).save_pretrained(path)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})


def prepare_prompts(tokenizer, prompts, sampling: Sampling, seeds, limits, *, add_special_tokens: bool,
                    max_model_len: int, who: str) -> tuple[list[list[int]], list[int], list[int]]:
    """(token ids, seeds, limits) of a generate call's prompts: seeds and limits checked or filled in, texts
    tokenized; a prompt whose tokens plus its limit exceed `max_model_len` is a DataError naming `who` (the
    engine, the servers)."""
    seeds = prompt_seeds(seeds, len(prompts))
    limits = prompt_limits(limits, sampling, len(prompts))
    ids = encode_prompts(tokenizer, prompts, add_special_tokens)
    x, k = max(zip(ids, limits), key=lambda p: len(p[0]) + p[1])
    if len(x) + k > max_model_len:
        raise DataError(f"a prompt of {len(x)} tokens plus {k} new tokens is more than {who} "
                        f"max_model_len={max_model_len}; raise vllm.max_model_len (at most the model's "
                        "max_position_embeddings) or shorten the prompts")
    return ids, seeds, limits


def sampling_fields(sampling: Sampling, seed: int, limit: int, eos_ids: list[int]) -> dict:
    """The fields of vLLM's `SamplingParams` for one prompt (as keyword arguments, or as JSON for a server): n
    completions (one when greedy: the n copies are equal), seeded by the prompt's seed, at most `limit` new tokens,
    stopping at the model's EOS ids and at the stop strings (the string kept in the text, which vLLM checks on the
    text it detokenizes: only then does it detokenize); min-p and the repetition penalty as they are. With
    temperature > 0 the log-probs of the sampled tokens come back: `processed_logprobs`, of the distribution the
    engine sampled from (repetition penalty, temperature, min-p, top-k and top-p applied)."""
    greedy = sampling.temperature == 0  # vLLM samples greedily once per prompt; the n copies are equal
    return dict(n=1 if greedy else sampling.n, temperature=sampling.temperature, top_p=sampling.top_p,
                top_k=sampling.top_k if sampling.top_k > 0 else -1, min_p=sampling.min_p,
                repetition_penalty=sampling.repetition_penalty, max_tokens=limit,
                min_tokens=min(sampling.min_new_tokens, limit), seed=int(seed) & (2**63 - 1),
                logprobs=None if greedy else 0, stop_token_ids=eos_ids, stop=list(sampling.stop),
                include_stop_str_in_output=True, detokenize=bool(sampling.stop))


def sampling_params(sampling: Sampling, seeds: Sequence[int], limits: Sequence[int], eos_ids: list[int]) -> list:
    """vLLM's `SamplingParams` of each prompt (`sampling_fields`)."""
    from vllm import SamplingParams

    return [SamplingParams(**sampling_fields(sampling, s, k, eos_ids)) for s, k in zip(seeds, limits)]


def rows_from_outputs(outs, ids: list[list[int]], n: int, *, with_logp: bool, tokenizer, pad_id: int, device,
                      version: int, stop: Sequence[str] = ()) -> Rollout:
    """The `Rollout` of vLLM's outputs `outs` (one `RequestOutput` per prompt, for the token-id prompts `ids`),
    n completions each (a greedy request's one completion repeated), on `device`: prompts left-padded and
    completions right-padded with `pad_id`, masks from lengths, truncated where the engine stopped at the length
    limit, texts decoded before the EOS as the in-process generator decodes them (a completion that one of the
    `stop` strings ended, `stop_reason`: its tokens decoded, cut after that string), the engine's log-probs of the
    sampled tokens when `with_logp`, and every row's weight version `version`."""
    rows, logps, truncated, by_string = [], [], [], []
    for out in outs:
        completions = sorted(out.outputs, key=lambda c: c.index)
        if len(completions) == 1 and n > 1 and not with_logp:  # greedy
            completions = completions * n
        if len(completions) != n:
            raise EngineError(f"the vLLM engine returned {len(completions)} completions for a prompt, not {n}")
        for c in completions:
            tokens = list(c.token_ids)
            if not tokens:  # max_tokens >= 1, so only a failed request has none
                raise EngineError(f"the vLLM engine returned an empty completion ({c.finish_reason})")
            rows.append(tokens)
            truncated.append(c.finish_reason == "length")
            by_string.append(c.finish_reason == "stop" and isinstance(getattr(c, "stop_reason", None), str))
            if with_logp:
                logps.append([d[t].logprob for d, t in zip(c.logprobs, tokens)])
    width = max(len(r) for r in rows)
    lp = max(len(x) for x in ids)
    prompt_ids = torch.full((len(rows), lp), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((len(rows), lp), dtype=torch.long)
    completion_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    completion_mask = torch.zeros((len(rows), width), dtype=torch.long)
    sampler_logp = torch.zeros((len(rows), width), dtype=torch.float32) if with_logp else None
    for j, tokens in enumerate(rows):
        p = ids[j // n]
        prompt_ids[j, lp - len(p):] = torch.tensor(p)
        prompt_mask[j, lp - len(p):] = 1
        completion_ids[j, :len(tokens)] = torch.tensor(tokens)
        completion_mask[j, :len(tokens)] = 1
        if with_logp:
            sampler_logp[j, :len(tokens)] = torch.tensor(logps[j])
    trunc = torch.tensor(truncated, dtype=torch.bool)
    # texts: the tokens before EOS (EOS itself is not text), as the in-process generator decodes them
    texts = tokenizer.batch_decode([r if t or b else r[:-1] for r, t, b in zip(rows, truncated, by_string)],
                                   skip_special_tokens=True)
    for j in (j for j, b in enumerate(by_string) if b):  # the engine's rule: the string ends in the last token
        texts[j] = stop_text(tokenizer, rows[j], texts[j], stop) or texts[j]
    return Rollout(prompt_ids.to(device), prompt_mask.to(device), completion_ids.to(device),
                   completion_mask.to(device), trunc.to(device), texts,
                   sampler_logp=None if sampler_logp is None else sampler_logp.to(device),
                   version=torch.full((len(rows),), version, dtype=torch.long, device=device))


def refresh_cpu_heads(model) -> None:
    """vLLM 0.32 on the CPU keeps a prepacked copy of the (tied) embedding matrix for the LM head that its
    in-place reload (`reload_weights`) does not renew; rebuild every prepacked linear weight of the engine's
    `model` from the reloaded one. Nothing to do on a GPU."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    for module in model.modules():
        w = getattr(module, "weight", None)
        if hasattr(module, "cpu_linear") and isinstance(w, torch.Tensor) and w.ndim == 2 and w.numel():
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)


def max_positions(model) -> int:
    """The model's context length as its config gives it (32768 when it does not)."""
    return int(getattr(base_config(model), "max_position_embeddings", 0) or 32768)


def base_config(model):
    """The transformers config of the policy (of its base model, for a LoRA model)."""
    return (model.get_base_model() if hasattr(model, "get_base_model") else model).config


def first_line(e: BaseException) -> str:
    """An engine error's message on one line, at most 400 characters."""
    text = " ".join(str(e).split()) or type(e).__name__
    return text[:400]
