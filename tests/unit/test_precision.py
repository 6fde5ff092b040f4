"""model.autocast_bf16: true, false or auto (grpo/precision.py), decided once per model and device."""
import pytest
import torch
from torch import nn

from grpo.config import load_config
from grpo.errors import ConfigError
from grpo.precision import BF16_MIN_PARAMS, autocast_choice, bf16_units, resolved


@pytest.mark.parametrize("flags, units", [
    ({"avx2", "avx512f", "avx512_bf16"}, "AVX-512 BF16"),
    ({"avx2", "avx512_bf16", "amx_bf16", "amx_tile"}, "AMX"),
    ({"avx2", "fma", "avx512f"}, None),       # AVX-512 without its BF16 extension: emulated
    ({"avx2", "fma"}, None),                  # an AVX2-only CPU (e.g. AMD EPYC Zen 2/3)
    (set(), None),                            # no /proc/cpuinfo (macOS): off
])
def test_bf16_units_of_a_cpu(flags, units):
    assert bf16_units("cpu", frozenset(flags)) == units


def test_auto_is_on_only_with_units_and_a_large_enough_model():
    on, why = autocast_choice("auto", "AMX", 135_000_000, "cpu")
    assert on and why == "on (model.autocast_bf16=auto: AMX, 135.0 M parameters)"
    on, why = autocast_choice("auto", "AMX", BF16_MIN_PARAMS - 1, "cpu")
    assert not on and "under the 1.5 M from which bfloat16 pays on AMX" in why
    assert autocast_choice("auto", "AMX", BF16_MIN_PARAMS, "cpu")[0]
    on, why = autocast_choice("auto", None, 10**9, "cpu")
    assert not on and "this CPU has no AMX, AVX-512 BF16 or Arm BF16, so bfloat16 would be emulated" in why
    assert "this GPU has no native bfloat16" in autocast_choice("auto", None, 10**9, "cuda")[1]


def test_an_explicit_setting_is_kept_and_emulation_is_said():
    assert autocast_choice(False, "AMX", 10**9, "cpu") == (False, "off (model.autocast_bf16=false)")
    on, why = autocast_choice(True, None, 1000, "cpu")
    assert on and why.startswith("on (model.autocast_bf16=true); this CPU has no bfloat16 matrix units")
    assert autocast_choice(True, "AMX", 1000, "cpu") == (True, "on (model.autocast_bf16=true)")


def test_resolved_counts_the_model_and_keeps_the_rest():
    cfg = load_config("tiny").model
    assert cfg.autocast_bf16 == "auto"  # the default
    small = nn.Linear(10, 10)
    decided, line = resolved(cfg, small)
    assert decided.autocast_bf16 is False and line.startswith("bfloat16 autocast: off (model.autocast_bf16=auto: ")
    assert decided.path == cfg.path and resolved(decided, small)[0] == decided  # a decided setting stays
    big_enough = nn.Embedding(BF16_MIN_PARAMS, 1)
    expected = bf16_units("cpu") is not None  # this machine's CPU decides
    assert resolved(cfg, big_enough)[0].autocast_bf16 is expected
    assert next(big_enough.parameters()).dtype == torch.float32  # nothing is cast by deciding


@pytest.mark.parametrize("value, expected", [("auto", "auto"), ("true", True), ("false", False)])
def test_config_takes_true_false_or_auto(value, expected):
    assert load_config("tiny", [f"model.autocast_bf16={value}"]).model.autocast_bf16 == expected


def test_config_names_the_allowed_values():
    with pytest.raises(ConfigError, match=r"model.autocast_bf16 must be bool or one of 'auto', got 'maybe'"):
        load_config("tiny", ["model.autocast_bf16=maybe"])
