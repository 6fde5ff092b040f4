"""What the trackers are given (finite numbers only, sample tables without episode messages), and the check
that each named tracker's package is there."""
import importlib
import types

import pytest

from grpo.errors import GRPOError
from grpo.tracking import check_installed, scalars, table


def test_scalars_are_the_finite_numbers_of_a_row():
    row = {"step": 3, "loss": 0.5, "kl": float("nan"), "grad_norm": float("inf"), "fault/nonfinite": "loss",
           "flag": True, "tokens": 7}
    assert scalars(row) == {"loss": 0.5, "tokens": 7.0}


def test_sample_table_leaves_out_messages_and_writes_other_values_as_json():
    rows = [{"prompt": "p", "completion": "c", "reward": None, "turns": 2, "messages": [{"role": "user"}]},
            {"prompt": "q", "completion": "d", "reward": 1.0, "extra": {"a": (1, 2)}}]
    columns, data = table(rows)
    assert columns == ["prompt", "completion", "reward", "turns", "extra"]
    assert data == [["p", "c", None, 2, None], ["q", "d", 1.0, None, '{"a": [1, 2]}']]


def test_a_missing_tracker_package_names_the_extra(monkeypatch, tmp_path):
    real = importlib.import_module
    stand_in = {}

    def fake(name, *a):
        if name == "wandb":
            raise ImportError("No module named 'wandb'")
        return stand_in.get(name) or real(name, *a)

    monkeypatch.setattr(importlib, "import_module", fake)
    with pytest.raises(GRPOError, match=r"^log.trackers names wandb, which is not installed; install it with "
                                        r"pip install 'grpo\[wandb\]', or leave it out of log.trackers$"):
        check_installed(["tensorboard", "wandb"])
    # not installed, but a directory of W&B's files beside the command imports as a namespace package
    stand_in["trackio"] = types.ModuleType("trackio")
    stand_in["trackio"].__path__ = [str(tmp_path / "trackio")]
    with pytest.raises(GRPOError, match=r"^log.trackers names trackio, which is not installed \('import trackio' "
                                        r"finds only .*/trackio\); install it with pip install 'grpo\[trackio\]'"):
        check_installed(["trackio"])
    check_installed(["tensorboard"])  # no package to check
