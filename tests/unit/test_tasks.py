"""The built-in tasks `stories` (word problems) and `functions` (small Python functions with tests): answers and
tests that are right, split once and for all."""
import re

from grpo.rewards import last_number
from grpo.tasks import load_builtin_task
from grpo.tasks.stories import INSTRUCTION, STORIES, story_examples


def test_every_story_has_the_right_answer():
    examples = story_examples()
    assert len({e.prompt for e in examples}) == len(examples) == 50208  # no prompt twice
    ops = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b}
    for e in examples:
        f = e.fields
        assert e.answer == str(ops[f["kind"]](f["a"], f["b"])) and int(e.answer) >= 0
        assert e.prompt.endswith(INSTRUCTION) and re.findall(r"\d+", e.prompt) == [str(f["a"]), str(f["b"])]
    assert {e.fields["kind"] for e in examples} == {kind for kind, _ in STORIES}
    e = next(x for x in examples if x.prompt.startswith("Mia has 7 apples. She buys 5 more."))
    assert e.answer == "12" and e.prompt == ("Mia has 7 apples. She buys 5 more. How many apples does Mia have "
                                             "now? Answer with a number.")
    assert last_number([e.prompt], ["Mia has 7 + 5 = 12 apples."], [e.answer]) == [1.0]


def test_held_out_is_disjoint_and_the_same_for_every_seed():
    a, b = load_builtin_task("stories", seed=0), load_builtin_task("stories", seed=1)
    assert not {e.prompt for e in a.train} & {e.prompt for e in a.eval}
    assert [e.prompt for e in a.eval] == [e.prompt for e in b.eval]
    assert [e.prompt for e in a.train] != [e.prompt for e in b.train]  # the seed orders the training stream
    assert 0.18 < len(a.eval) / (len(a.train) + len(a.eval)) < 0.22


def test_every_function_problem_has_tests_its_reference_passes():
    from grpo.rewards.code import check_tests
    from grpo.tasks.functions import FAMILIES, TESTS_PER_PROBLEM, function_examples

    examples = function_examples()
    assert len({e.prompt for e in examples}) == len(examples) == 240  # no prompt twice
    assert {e.fields["kind"] for e in examples} == {f.kind for f in FAMILIES}
    for e in examples:
        tests = e.fields["tests"]
        assert check_tests(tests) == TESTS_PER_PROBLEM  # a shape the code reward checks outside the sandbox
        assert len(set(tests)) == TESTS_PER_PROBLEM      # three different inputs
        namespace = {}
        exec(e.answer, namespace)  # the task's own reference code, here; the sandboxed run is below
        for test in tests:
            exec(test, namespace)
    e = next(x for x in examples if x.prompt == "Write a Python function `add_7(x)` that returns x plus 7.")
    assert e.answer == "def add_7(x):\n    return x + 7\n"
    assert all(re.fullmatch(r"assert add_7\(-?\d+\) == -?\d+", t) for t in e.fields["tests"])


def test_function_references_score_one_and_wrong_code_zero_through_the_code_reward():
    from grpo.rewards.code import make_code_reward
    from grpo.sandbox import Limits
    from grpo.tasks.functions import function_examples

    one_per_kind = list({e.fields["kind"]: e for e in function_examples()}.values())
    reward = make_code_reward(Limits(timeout_s=5.0))
    fenced = [f"Here it is:\n```python\n{e.answer}```\n" for e in one_per_kind]
    tests = [e.fields["tests"] for e in one_per_kind]
    assert reward(prompts=[""] * len(fenced), completions=fenced, tests=tests) == [1.0] * len(fenced)
    wrong = [e.answer.splitlines()[0] + "\n    return None\n" for e in one_per_kind[:4]]
    assert reward(prompts=[""] * 4, completions=wrong, tests=tests[:4]) == [0.0] * 4


def test_functions_held_out_is_disjoint_and_the_same_for_every_seed():
    a, b = load_builtin_task("functions", seed=0), load_builtin_task("functions", seed=1)
    assert not {e.prompt for e in a.train} & {e.prompt for e in a.eval}
    assert [e.prompt for e in a.eval] == [e.prompt for e in b.eval]
    assert [e.prompt for e in a.train] != [e.prompt for e in b.train]
    assert (len(a.train), len(a.eval)) == (181, 59)
