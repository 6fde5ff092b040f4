"""Whether the forward passes run under bfloat16 autocast: `model.autocast_bf16` true, false or 'auto'.

'auto' (the default) turns autocast on where the device multiplies bfloat16 natively (a CUDA GPU that supports
it, a CPU with AMX or AVX-512 BF16, an Arm CPU with its BF16 extension) and the model is large enough for the
cheaper matmuls to outweigh the casts: `BF16_MIN_PARAMS`. Elsewhere bfloat16 is emulated (an AVX2-only CPU
runs a bfloat16 matmul several times slower than a float32 one) or, on a model of about a million parameters,
costs more in casts than it saves (docs/benchmarks.md "bfloat16 autocast by default"). The decision and its
reason are the run's first line (`grpo train`, `grpo eval`, `grpo sample`).
"""
from __future__ import annotations

import functools
import platform
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

import torch

# the model section of the config (grpo.config.ModelConfig), not imported: the decision needs only its
# autocast_bf16 field, and this module stands below the config, beside the modules that build the model
Section = TypeVar("Section")

# Measured on a 2-core AMD EPYC with AVX-512 BF16, one step shape (8 x 8 x 32) and models from 1.0 to 7.9 M
# parameters, 3 alternating runs each (benchmarks/vs_trl.py --cases size_*, benchmarks/results/bf16_threshold.md):
# autocast made a step 0.93x as fast at 1.0 M, 1.09x at 2.0 M, then 1.27-1.54x at 3.3, 4.4, 5.9 and 7.9 M (and
# 1.25x at 12.1 M with a 32 k vocabulary, 2.19x against 1.45x TRL's best on SmolLM2-135M). The crossing lies
# between 1.0 and 2.0 M (about 1.4 M by linear interpolation).
BF16_MIN_PARAMS = 1_500_000


@functools.cache
def _cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (x86 `flags`, Arm `Features`); empty elsewhere."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return frozenset(flags)


def bf16_units(device: str, cpu_flags: frozenset[str] | None = None) -> str | None:
    """The device's native bfloat16 matrix units, named for the run's first line; None where bfloat16 matmuls
    would be emulated (e.g. an AVX2-only CPU)."""
    if device.startswith("cuda"):
        if torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False):
            return f"{torch.cuda.get_device_name()} bfloat16"
        return None
    flags = _cpu_flags() if cpu_flags is None else cpu_flags
    if "amx_bf16" in flags:
        return "AMX"
    if "avx512_bf16" in flags:
        return "AVX-512 BF16"
    if "bf16" in flags and platform.machine().lower() in ("aarch64", "arm64"):
        return "Arm BF16"
    return None


def autocast_choice(setting: bool | str, units: str | None, n_params: int, device: str) -> tuple[bool, str]:
    """(on, why) for `model.autocast_bf16=setting`, on a device with bfloat16 `units` (None: emulated), for a
    model of `n_params` parameters."""
    size = f"{n_params / 1e6:.1f} M parameters"
    if setting is True:
        return True, "on (model.autocast_bf16=true)" + ("" if units else f"; this {device.upper()} has no "
                                                         "bfloat16 matrix units, so bfloat16 is emulated and slow")
    if setting is False:
        return False, "off (model.autocast_bf16=false)"
    if units is None:
        what = "CPU has no AMX, AVX-512 BF16 or Arm BF16" if device == "cpu" else "GPU has no native bfloat16"
        return False, f"off (model.autocast_bf16=auto: this {what}, so bfloat16 would be emulated)"
    if n_params < BF16_MIN_PARAMS:
        return False, (f"off (model.autocast_bf16=auto: {size}, under the {BF16_MIN_PARAMS / 1e6:g} M from which "
                       f"bfloat16 pays on {units})")
    return True, f"on (model.autocast_bf16=auto: {units}, {size})"


def resolved(cfg: Section, model) -> tuple[Section, str]:
    """`cfg` with `autocast_bf16` decided (true or false) for `model` on its device, and the line that says so."""
    device = next(model.parameters()).device.type
    n_params = sum(p.numel() for p in model.parameters())
    on, why = autocast_choice(cfg.autocast_bf16, bf16_units(device), n_params, device)
    return replace(cfg, autocast_bf16=on), f"bfloat16 autocast: {why}"
