"""The built-in process reward `arithmetic_steps`: one (end, reward) per worked step, offsets checked by hand."""
import pytest

from grpo.rewards import example_fields
from grpo.rewards.steps import arithmetic_steps, parse_steps
from grpo.tasks import load_builtin_task
from grpo.tasks.arithmetic import worked_solution

# "Calculate 2 + 2 * 6 =": the correct working multiplies first.
ARITH = {"task": "arithmetic", "operands": [2, 2, 6], "ops": ["+", "*"], "answer": "14"}
# "Solve y = 3x + 4 for x = 2, y =": a * x first, then ± b.
LINEAR = {"task": "linear", "a": 3, "b": 4, "x": 2, "sign": "+", "answer": "10"}
# "Calculate 1 - 5 * 2 =": a negative result.
NEG = {"task": "arithmetic", "operands": [1, 5, 2], "ops": ["-", "*"], "answer": "-9"}


def one(completion: str, row: dict, prompt: str = "p"):
    """Score a single completion of a single row, with the fields passed TRL-style (one value per completion)."""
    out = arithmetic_steps(prompts=[prompt], completions=[completion], **{k: [v] for k, v in row.items()})
    assert len(out) == 1
    return out[0]


@pytest.mark.parametrize("completion, row, expected, results", [
    # " 2 * 6 = 12" is text[:11]; ", 2 + 12 = 14" brings the end to 24 (the whole text).
    (" 2 * 6 = 12, 2 + 12 = 14", ARITH, [(11, 1.0), (24, 1.0)], ["12", "14"]),
    # The grouping mistake: both equations are true, both steps are wrong. " 2 + 2 = 4" is text[:10].
    (" 2 + 2 = 4, 4 * 6 = 24", ARITH, [(10, 0.0), (22, 0.0)], ["4", "24"]),
    # A right first step and a wrong second: the credit stops where the error is made.
    (" 2 * 6 = 12, 2 + 12 = 15", ARITH, [(11, 1.0), (24, 0.0)], ["12", "15"]),
    # Linear: " 3 * 2 = 6" is text[:10], " 6 + 4 = 10" ends at 22.
    (" 3 * 2 = 6, 6 + 4 = 10", LINEAR, [(10, 1.0), (22, 1.0)], ["6", "10"]),
    # Linear grouping mistake: x + b first, then a * t.
    (" 2 + 4 = 6, 3 * 6 = 18", LINEAR, [(10, 0.0), (22, 0.0)], ["6", "18"]),
    # Negative result: "-9" occupies text[22:24].
    (" 5 * 2 = 10, 1 - 10 = -9", NEG, [(11, 1.0), (24, 1.0)], ["10", "-9"]),
    # Negative intermediate and negative operand in the wrong grouping: " 1 - 5 = -4" is text[:11].
    (" 1 - 5 = -4, -4 * 2 = -8", NEG, [(11, 0.0), (24, 0.0)], ["-4", "-8"]),
    # A step beyond the reference's two scores 0.0 even though it is true: ", 14 * 1 = 14" ends at 37.
    (" 2 * 6 = 12, 2 + 12 = 14, 14 * 1 = 14", ARITH, [(11, 1.0), (24, 1.0), (37, 0.0)], ["12", "14", "14"]),
    # Without spaces the steps still parse: "2*6=12" ends at 7, "2+12=14" at 15.
    (" 2*6=12,2+12=14", ARITH, [(7, 1.0), (15, 1.0)], ["12", "14"]),
    # Numbers are compared as numbers, not strings.
    (" 2 * 06 = 12, 2 + 12 = 014", ARITH, [(12, 1.0), (26, 1.0)], ["12", "014"]),
    # Same operands in the other order is not the reference step (the working's order is what is scored).
    (" 6 * 2 = 12, 2 + 12 = 14", ARITH, [(11, 0.0), (24, 1.0)], ["12", "14"]),
    # A step surrounded by prose is still found.
    (" first 2 * 6 = 12 so the answer is 14", ARITH, [(17, 1.0)], ["12"]),
])
def test_steps_by_hand(completion, row, expected, results):
    got = one(completion, row)
    assert got == expected
    for (end, _), result in zip(got, results, strict=True):
        assert completion[:end].endswith(result)  # end is exclusive: text[end-1] is the result's last character


@pytest.mark.parametrize("completion", ["", " 14", " the answer is fourteen", " 1.5 + 2 = 3.5", " 2 * 6 ="])
def test_no_step_is_one_wrong_step_at_the_end(completion):
    assert one(completion, ARITH) == [(len(completion), 0.0)]


def test_empty_completion_ends_at_zero():
    assert one("", LINEAR) == [(0, 0.0)]


@pytest.mark.parametrize("row", [
    {"task": None, "answer": "14"},
    {"task": "gsm8k", "answer": "14", "operands": [2, 2, 6], "ops": ["+", "*"]},
    {"task": "arithmetic", "answer": "14", "operands": None, "ops": None},
    {"task": "arithmetic", "answer": "14"},
    {"task": "linear", "a": 3, "b": 4, "x": None, "sign": "+"},
    {"task": "arithmetic", "operands": [2, 2], "ops": ["+", "*"]},
    {"task": "arithmetic", "operands": [2, 2, 6], "ops": ["+", "/"]},
])
def test_rows_that_are_not_builtin_problems_get_none(row):
    assert one(" 2 * 6 = 12, 2 + 12 = 14", row) is None


def test_no_task_field_at_all_gives_none():
    assert arithmetic_steps(prompts=["p", "q"], completions=[" 1 + 1 = 2", ""], answer=["2", "0"]) == [None, None]


def test_mixed_batch_with_unused_fields():
    # As the trainer passes them: every field for every row, None where a row lacks it, plus unrelated columns.
    texts = [" 2 * 6 = 12, 2 + 12 = 14", " 3 * 2 = 6, 6 + 4 = 11", " 2 * 6 = 12"]
    fields = {"task": ["arithmetic", "linear", None], "operands": [[2, 2, 6], None, None],
              "ops": [["+", "*"], None, None], "a": [None, 3, None], "b": [None, 4, None], "x": [None, 2, None],
              "sign": [None, "+", None], "answer": ["14", "10", "14"], "source": ["x", "y", "z"]}
    assert arithmetic_steps(prompts=["p"] * 3, completions=texts, **fields) == [
        [(11, 1.0), (24, 1.0)], [(10, 1.0), (22, 0.0)], None]


def test_name():
    assert arithmetic_steps.__name__ == "arithmetic_steps"


def test_parse_steps():
    assert parse_steps(" 1 - 5 = -4, -4 * 2 = -8") == [((1, "-", 5, -4), 11), ((-4, "*", 2, -8), 24)]
    # A binary minus glued to a number is the operator, not the sign of the next step's operand; a match never
    # starts inside a number.
    assert parse_steps("3-5 * 2 = 10") == [((5, "*", 2, 10), 12)]
    assert parse_steps("12.5 + 1 = 13") == []
    assert parse_steps("5 - -3 = 8") == [((5, "-", -3, 8), 10)]


def test_every_builtin_example():
    task = load_builtin_task("mixed")
    examples = task.train + task.eval
    assert {e.fields["task"] for e in examples} == {"arithmetic", "linear"}
    fields = example_fields(examples)
    prompts = [e.prompt for e in examples]
    right = [worked_solution(e, correct=True) for e in examples]
    wrong = [worked_solution(e, correct=False) for e in examples]
    for e, text, steps in zip(examples, right, arithmetic_steps(prompts, right, **fields), strict=True):
        assert [r for _, r in steps] == [1.0, 1.0], (e.prompt, text)
        assert steps[-1][0] == len(text) and text[:steps[-1][0]].endswith(e.answer)
    differing = 0
    for e, good, bad, steps in zip(examples, right, wrong, arithmetic_steps(prompts, wrong, **fields), strict=True):
        assert len(steps) == 2 and steps[-1][0] == len(bad)
        if bad != good:
            differing += 1
            assert 0.0 in [r for _, r in steps], (e.prompt, bad)
    assert differing > len(examples) // 2  # the check above is not vacuous
