"""Named algorithm presets (SPEC sections 1, 2.2, 3, 4 and 12): each is its paper, a note, and the `algo.*` option
values it sets. Presets are data, not code paths: the config fills these values in before the keys a user sets
explicitly, and every option a preset leaves out keeps its default (`grpo.config.AlgoConfig`, where every default
is declared). Each preset names the options that define its algorithm, so that one chosen over a config file that
sets them otherwise can say which keys win.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from grpo.algo._checks import check_choice


@dataclass(frozen=True)
class Preset:
    name: str
    paper: str
    note: str
    values: Mapping[str, object]   # algo.* option name -> value


def _preset(name: str, paper: str, note: str, **values) -> Preset:
    return Preset(name, paper, note, MappingProxyType(values))


PRESETS: dict[str, Preset] = {p.name: p for p in (
    _preset("grpo", "Shao et al. 2024, DeepSeekMath, arXiv:2402.03300 (eq. 3, eq. 4, §4.1.2, §4.2)",
            "group-standardised advantages, per-sequence token mean, k3 KL with β = 0.04; the paper does not "
            "report ε, 0.2 is the common choice",
            scale="group", std="sample", beta=0.04, clip_low=0.2, clip_high=0.2, ratio_level="token",
            aggregation="seq_mean", dynamic_sampling=False, surrogate="clip"),
    _preset("dr_grpo", "Liu et al. 2025, Understanding R1-Zero-Like Training (Dr. GRPO), arXiv:2503.20783",
            "no std division, token sum over a constant (B·max_completion_length), β = 0",
            scale="none", std="sample", beta=0.0, clip_low=0.2, clip_high=0.2, ratio_level="token",
            aggregation="constant", dynamic_sampling=False, surrogate="clip"),
    _preset("dapo", "Yu et al. 2025, DAPO, arXiv:2503.14476 (eq. 8, §3.1–3.3)",
            "clip-higher (0.2/0.28), token-level mean over the whole step, no KL, dynamic sampling (groups whose "
            "rewards are all equal are replaced); the soft overlong punishment is a reward (overlong)",
            scale="group", std="sample", beta=0.0, clip_low=0.2, clip_high=0.28, ratio_level="token",
            aggregation="token_mean", dynamic_sampling=True, surrogate="clip"),
    _preset("gspo", "Zheng et al. 2025, Group Sequence Policy Optimization, arXiv:2507.18071 (§5.1)",
            "length-normalised sequence ratio, clip ranges 3e-4/4e-4, β = 0 (TRL's reproduction setting)",
            scale="group", std="sample", beta=0.0, clip_low=3e-4, clip_high=4e-4, ratio_level="sequence",
            aggregation="seq_mean", dynamic_sampling=False, surrogate="clip"),
    _preset("cispo", "MiniMax 2025, MiniMax-M1, arXiv:2506.13585 (§3.1, eq. 4-5)",
            "REINFORCE with a clipped, detached importance weight sg(clip(r, 1 − ε_low, 1 + ε_high)) on every "
            "token, normalised by the step's token count, β = 0; no lower bound (ε_low = 1), as the paper; the "
            "paper tunes only ε_high and does not report it here: 0.2 is verl's example (cap 1.2)",
            scale="group", std="sample", beta=0.0, clip_low=1.0, clip_high=0.2, ratio_level="token",
            aggregation="token_mean", dynamic_sampling=False, surrogate="cispo"),
    _preset("sapo", "Gao et al. 2025 (Qwen), Soft Adaptive Policy Optimization, arXiv:2511.20347",
            "a soft gate (4/τ)·σ(τ(r − 1)) instead of the clip, τ = 1.0 for Â > 0 and 1.05 otherwise (the "
            "defaults of TRL and verl), per-sequence token mean, β = 0; ε is unused",
            scale="group", std="sample", beta=0.0, clip_low=0.2, clip_high=0.2, ratio_level="token",
            aggregation="seq_mean", dynamic_sampling=False, surrogate="sapo", sapo_tau_pos=1.0, sapo_tau_neg=1.05),
    _preset("dppo", "Qi et al. 2026, Rethinking the Trust Region in LLM RL (DPPO), arXiv:2602.04879, as prime-rl runs "
                    "it by default (prime-rl @ 559b4477: DefaultLossConfig, default_loss_fn, algo/grpo.py)",
            "REINFORCE on the tokens whose probability moved by at most 0.2 since the old policy in the direction "
            "of Â (binary TV mask), untruncated ratio, token sum over the step's tokens, advantages r − mean "
            "without a std; no reference KL (prime-rl's squared log-ratio to the sampler, kl_tau 1e-3, is not "
            "offered)",
            scale="none", std="sample", beta=0.0, clip_low=0.2, clip_high=0.2, ratio_level="token",
            aggregation="token_mean", dynamic_sampling=False, surrogate="dppo_tv", dppo_tv_low=0.2,
            dppo_tv_high=0.2, dppo_cap=0.0),
    _preset("icepop", "Ling Team 2025, Ring-1T (IcePop), arXiv:2510.18855; the bounds as verl's "
                      "decoupled_token_icepop preset",
            "GRPO with the sampler-trainer correction as IcePop: the policy term of a token whose ratio "
            "ρ = π_old/π_sampler lies outside [0.5, 5] is masked, the others weighted by ρ (SPEC 13.1's token MIS, "
            "14.6); acts only with a sampler of its own (vLLM)",
            scale="group", std="sample", beta=0.04, clip_low=0.2, clip_high=0.2, ratio_level="token",
            aggregation="seq_mean", dynamic_sampling=False, surrogate="clip", sampler_correction="token_mis",
            sampler_correction_floor=0.5, sampler_correction_cap=5.0),
)}


def preset_values(name: str) -> dict:
    """The `algo.*` option values a preset sets, by option name (what the config fills in before the keys a user
    sets explicitly)."""
    return dict(get_preset(name).values)


def get_preset(name: str) -> Preset:
    check_choice("preset", name, PRESETS)
    return PRESETS[name]
