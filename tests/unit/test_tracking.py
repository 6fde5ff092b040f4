"""What the trackers are given: finite numbers only, sample tables without episode messages."""
from grpo.tracking import scalars, table


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
