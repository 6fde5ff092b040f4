"""Reward functions and their plumbing: per-function values, weights, None, errors that name the function."""
import math

import pytest
import torch

from grpo.errors import DataError
from grpo.rewards import exact_match, first_number, resolve_reward, score


@pytest.mark.parametrize("completion, answer, expected", [
    (" 14", "14", 1.0), ("14", "14", 1.0), (" 14.0", "14", 1.0), (" -3", "-3", 1.0), (" 3", "-3", 0.0),
    (" 1 4", "14", 0.0), ("", "5", 0.0), (" five", "5", 0.0), (" 5 because 2*2+1", "5", 1.0),
    (" 12, not 14", "14", 0.0), (" 1,000", "1000", 0.0), (" 7", " 7 ", 1.0), (" 0", "0", 1.0), (" -0", "0", 1.0),
])
def test_exact_match_first_number(completion, answer, expected):
    assert exact_match(prompts=["p"], completions=[completion], answer=[answer]) == [expected]


@pytest.mark.parametrize("completion, answer, expected", [
    (" 2 * 6 = 12, 2 + 12 = 14", "14", 1.0), (" 2 + 2 = 4, 4 * 6 = 24", "14", 0.0), (" 14", "14", 1.0),
    (" 3 - 5 = -2, -2 * 4 = -8", "-8", 1.0), ("", "1", 0.0), (" 14 apples", "14", 1.0), (" 14, no: 15", "14", 0.0),
])
def test_last_number(completion, answer, expected):
    from grpo.rewards import last_number
    assert last_number(prompts=["p"], completions=[completion], answer=[answer]) == [expected]


def test_first_number():
    assert first_number("a -12.5 b 3") == "-12.5" and first_number("none") is None


def _fn_none(prompts, completions, **kw):
    return [None if c == "skip" else 2.0 for c in completions]


def _fn_kwargs(prompts, completions, answer, task, **kw):
    return [1.0 if t == "linear" else 0.0 for t in task]


def test_score_weights_none_and_fields_as_keywords():
    s = score([exact_match, _fn_none, _fn_kwargs], [1.0, 0.5, 3.0], ["p"] * 3, [" 5", "skip", " 4"],
              {"answer": ["5", "5", "5"], "task": ["linear", "arithmetic", "linear"]})
    total, per_fn = s.total, s.per_fn
    assert s.steps == [[], [], []] and torch.equal(s.outcome, total)
    assert per_fn["exact_match"].tolist() == [1.0, 0.0, 0.0]
    assert math.isnan(per_fn["_fn_none"][1])
    assert total.tolist() == [1.0 + 1.0 + 3.0, 0.0 + 0.0, 0.0 + 1.0 + 3.0]


def test_completion_no_function_scores_gets_nan_total():
    total = score([_fn_none], None, ["p", "p"], ["skip", "x"], {"answer": ["1", "1"]}).total
    assert math.isnan(total[0]) and total[1] == 2.0


def test_wrong_number_of_values_is_an_error_naming_the_function():
    def short(prompts, completions, **kw):
        return [1.0]

    with pytest.raises(DataError, match="reward function 'short' returned 1 values for 2 completions"):
        score([short], None, ["p", "q"], ["a", "b"], {"answer": ["1", "2"]})


def test_raising_function_is_named_with_the_example():
    def broken(prompts, completions, answer, **kw):
        return [1.0 / int(a) for a in answer]

    with pytest.raises(DataError, match="reward function 'broken' raised ZeroDivisionError: float division by zero on "
                                        "prompt 'Calculate 0 =' with completion 'b'"):
        score([broken], None, ["Calculate 1 =", "Calculate 0 ="], ["a", "b"], {"answer": ["1", "0"]})


def test_non_numeric_value_is_an_error():
    with pytest.raises(DataError, match="returned 'yes' \\(str\\) on prompt 'p' with completion 'a'; rewards must "
                                        "be floats, lists of"):
        score([lambda prompts, completions, **kw: ["yes"]], None, ["p"], ["a"], {"answer": ["1"]})
    with pytest.raises(DataError, match="returned '1.0' \\(str\\)"):  # refused, not converted
        score([lambda prompts, completions, **kw: ["1.0"]], None, ["p"], ["a"], {"answer": ["1"]})


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_reward_is_an_error_naming_the_function_and_completion(bad):
    def flaky(prompts, completions, **kw):
        return [1.0, bad]

    with pytest.raises(DataError, match=f"reward function 'flaky' returned {bad} on prompt 'q' with completion "
                                        "'b'; a reward must be a finite number, or None where it does not apply"):
        score([flaky], None, ["p", "q"], ["a", "b"], {"answer": ["1", "2"]})
    with pytest.raises(DataError, match="and reward a finite number"):
        score([lambda prompts, completions, **kw: [[(1, bad)]]], None, ["p"], ["a"], {"answer": ["1"]})


def test_numbers_of_other_types_are_rewards():
    import numpy as np

    s = score([lambda prompts, completions, **kw: [np.float32(0.5), True, 2, None]], None, ["p"] * 4,
              ["a", "b", "c", "d"], {"answer": ["1"] * 4})
    assert s.total[:3].tolist() == [0.5, 1.0, 2.0] and s.total[3].isnan()


def test_resolve_module_function():
    assert resolve_reward("grpo.rewards:exact_match") is exact_match
    assert resolve_reward("exact_match") is exact_match
    assert isinstance(score([exact_match], None, ["p"], ["1"], {"answer": ["1"]}).total, torch.Tensor)


def test_process_rewards_are_kept_apart_from_outcome_rewards():
    def steps(prompts, completions, **kw):
        return [[(1, 1.0), (2, 0.0)] if c == "ab" else None for c in completions]

    s = score([("steps", steps), exact_match, ("half", lambda prompts, completions, **kw: [0.5, None])], [2.0, 1.0, 1.0],
              ["p", "p"], ["ab", " 5"], {"answer": ["5", "5"]})
    assert s.steps == [[(1, 2.0), (2, 0.0)], []]                     # weighted, in order of end
    assert s.per_fn["steps"].tolist()[0] == 0.5 and math.isnan(s.per_fn["steps"][1])  # the step mean
    assert s.outcome.tolist() == [0.0 + 0.5, 1.0]                    # the outcome functions only
    assert s.total.tolist() == [2.0 * 0.5 + 0.0 + 0.5, 1.0]
    none = score([("steps", lambda prompts, completions, **kw: [None, None])], None, ["p", "p"], ["a", "b"],
                 {"answer": ["1", "1"]})
    assert none.steps == [[], []] and none.outcome.isnan().all()     # applies to none: neither kind


def test_bad_steps_and_mixed_kinds_are_errors_naming_the_function():
    with pytest.raises(DataError, match=r"'s' returned the step \(9, 1.0\) for completion 'ab'; a step is"):
        score([("s", lambda prompts, completions, **kw: [[(9, 1.0)]])], None, ["p"], ["ab"], {"answer": ["1"]})
    with pytest.raises(DataError, match="returned step lists for some completions and 1.0 for another"):
        score([("s", lambda prompts, completions, **kw: [[(1, 1.0)], 1.0])], None, ["p", "p"], ["a", "b"],
              {"answer": ["1", "1"]})


def test_repeated_names_are_kept_apart():
    s = score([exact_match, exact_match], [1.0, 2.0], ["p"], [" 5"], {"answer": ["5"]})
    assert list(s.per_fn) == ["exact_match", "exact_match_2"] and s.total.tolist() == [3.0]


def test_a_process_reward_cannot_judge_evaluation():
    from grpo.evaluation import _correct
    from grpo.rewards import arithmetic_steps
    from grpo.tasks.base import Example

    with pytest.raises(DataError, match="eval.reward 'arithmetic_steps' returned lists of steps"):
        _correct(arithmetic_steps, [Example("Calculate 2 + 2 * 6 =", "14", {"task": "arithmetic",
                                                                            "operands": [2, 2, 6], "ops": ["+", "*"]})],
                 [" 2 * 6 = 12, 2 + 12 = 14"], 1)


def test_final_number_scores_the_models_last_message():
    from grpo.rewards import final_number

    call = {"role": "assistant", "content": '[calculator(expression="12 * 34")]',
            "tool_calls": [{"type": "function", "function": {"name": "calculator", "arguments": {}}}]}
    result = {"role": "tool", "name": "calculator", "content": "408"}
    episodes = [[{"role": "user", "content": "q"}, call, result, {"role": "assistant", "content": "It is 408"}],
                [{"role": "user", "content": "q"}, call, result],          # ends on the tool's number
                [{"role": "user", "content": "q"}, {"role": "assistant", "content": "409"}],
                [{"role": "user", "content": "q"}, call]]                  # ends on a call
    assert final_number(["q"] * 4, ["x"] * 4, ["408"] * 4, messages=episodes) == [1.0, 0.0, 0.0, 0.0]
    assert final_number(["q"], ["so 408"], ["408"]) == [1.0]  # single turns: last_number
