"""Named algorithm presets: each maps to the arguments of `group_advantages` and `policy_loss` and names
its paper (SPEC sections 1, 2.2, 3, 4 and 12). Presets are data, not code paths: the trainer reads the
same fields whatever the preset, and any field can be overridden after a preset is chosen.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from grpo.algo._checks import check_choice


@dataclass(frozen=True)
class Preset:
    name: str
    paper: str
    # advantages
    scale: str
    std: str
    # policy loss
    beta: float
    clip_low: float
    clip_high: float
    ratio_level: str
    aggregation: str
    note: str = ""
    # sampling
    dynamic_sampling: bool = False
    # the policy term (grpo.algo.policy_loss): PPO's clip, CISPO's truncated weight or SAPO's soft gate
    surrogate: str = "clip"
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05

    def advantage_kwargs(self) -> dict:
        return {"scale": self.scale, "std": self.std}

    def loss_kwargs(self) -> dict:
        return {k: v for k, v in asdict(self).items()
                if k in ("beta", "clip_low", "clip_high", "ratio_level", "aggregation", "surrogate", "sapo_tau_pos",
                         "sapo_tau_neg")}


PRESETS: dict[str, Preset] = {
    "grpo": Preset(
        "grpo", "Shao et al. 2024, DeepSeekMath, arXiv:2402.03300 (eq. 3, eq. 4, §4.1.2, §4.2)",
        scale="group", std="sample", beta=0.04, clip_low=0.2, clip_high=0.2,
        ratio_level="token", aggregation="seq_mean",
        note="group-standardised advantages, per-sequence token mean, k3 KL with β = 0.04; the paper does not "
             "report ε, 0.2 is the common choice"),
    "dr_grpo": Preset(
        "dr_grpo", "Liu et al. 2025, Understanding R1-Zero-Like Training (Dr. GRPO), arXiv:2503.20783",
        scale="none", std="sample", beta=0.0, clip_low=0.2, clip_high=0.2,
        ratio_level="token", aggregation="constant",
        note="no std division, token sum over a constant (B·max_completion_length), β = 0"),
    "dapo": Preset(
        "dapo", "Yu et al. 2025, DAPO, arXiv:2503.14476 (eq. 8, §3.1–3.3)",
        scale="group", std="sample", beta=0.0, clip_low=0.2, clip_high=0.28,
        ratio_level="token", aggregation="token_mean", dynamic_sampling=True,
        note="clip-higher (0.2/0.28), token-level mean over the whole step, no KL, dynamic sampling (groups "
             "whose rewards are all equal are replaced); the soft overlong punishment is a reward (overlong)"),
    "gspo": Preset(
        "gspo", "Zheng et al. 2025, Group Sequence Policy Optimization, arXiv:2507.18071 (§5.1)",
        scale="group", std="sample", beta=0.0, clip_low=3e-4, clip_high=4e-4,
        ratio_level="sequence", aggregation="seq_mean",
        note="length-normalised sequence ratio, clip ranges 3e-4/4e-4, β = 0 (TRL's reproduction setting)"),
    "cispo": Preset(
        "cispo", "MiniMax 2025, MiniMax-M1, arXiv:2506.13585 (§3.1, eq. 4-5)",
        scale="group", std="sample", beta=0.0, clip_low=1.0, clip_high=0.2,
        ratio_level="token", aggregation="token_mean", surrogate="cispo",
        note="REINFORCE with a clipped, detached importance weight sg(clip(r, 1 − ε_low, 1 + ε_high)) on every "
             "token, normalised by the step's token count, β = 0; no lower bound (ε_low = 1), as the paper; the "
             "paper tunes only ε_high and does not report it here: 0.2 is verl's example (cap 1.2)"),
    "sapo": Preset(
        "sapo", "Gao et al. 2025 (Qwen), Soft Adaptive Policy Optimization, arXiv:2511.20347",
        scale="group", std="sample", beta=0.0, clip_low=0.2, clip_high=0.2,
        ratio_level="token", aggregation="seq_mean", surrogate="sapo", sapo_tau_pos=1.0, sapo_tau_neg=1.05,
        note="a soft gate (4/τ)·σ(τ(r − 1)) instead of the clip, τ = 1.0 for Â > 0 and 1.05 otherwise (the "
             "defaults of TRL and verl), per-sequence token mean, β = 0; ε is unused"),
}


def preset_values(name: str) -> dict:
    """The `algo.*` option values a preset sets, by option name (what the config fills in before the keys a user
    sets explicitly)."""
    p = get_preset(name)
    return {k: v for k, v in asdict(p).items() if k not in ("name", "paper", "note")}


def get_preset(name: str) -> Preset:
    check_choice("preset", name, PRESETS)
    return PRESETS[name]
