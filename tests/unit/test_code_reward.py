"""The `code` reward: the fraction of a row's tests the completion's code passes, run in the sandbox."""

import pytest

from grpo.errors import DataError
from grpo.rewards.code import code, extract_code, make_code_reward
from grpo.sandbox import Limits

ADD_TESTS = ["assert add(2, 3) == 5", "assert add(0, 0) == 0", "assert add(1, 1) == 3"]  # the last one is wrong
ADD = "def add(a, b):\n    return a + b\n"
FAST = make_code_reward(Limits(timeout_s=2.0, cpu_s=2))


def one(completion: str, tests, reward=code) -> float | None:
    out = reward(prompts=["p"], completions=[completion], tests=[tests], answer=["unused"], task=["x"])
    assert len(out) == 1
    return out[0]


def test_fraction_passed():
    assert one(ADD, ADD_TESTS) == pytest.approx(2 / 3)
    assert one(ADD, ADD_TESTS[:2]) == 1.0
    assert one("def add(a, b):\n    return a - b\n", ADD_TESTS) == pytest.approx(1 / 3)  # add(0, 0) == 0


def test_fenced_block_is_extracted():
    completion = ("Let me think.\n```python\ndef add(a, b):\n    return a * b\n```\nBetter:\n"
                  f"```python\n{ADD}```\nThat is it. ```inline``` code is not a block.")
    assert one(completion, ADD_TESTS) == pytest.approx(2 / 3)


@pytest.mark.parametrize("text, expected", [
    ("```python\nx = 1\n```", "x = 1\n"),
    ("```\nx = 1\n```", "x = 1\n"),
    ("```py\nx = 1\n```\n```bash\nls\n```", "x = 1\n"),  # the last *python* block
    ("```Python title=a.py\nx = 1\n```", "x = 1\n"),
    ("text\n```python\nx = 1\ny = 2", "x = 1\ny = 2"),  # cut off by the token limit: the block runs to the end
    ("x = 1", "x = 1"),  # no block: the whole text
])
def test_extract_code(text, expected):
    assert extract_code(text) == expected


def test_no_tests_is_none():
    assert code(prompts=["p", "q"], completions=[ADD, ADD]) == [None, None]
    out = code(prompts=["p"] * 4, completions=[ADD] * 4, tests=[None, [], "", ADD_TESTS[:1]])
    assert out == [None, None, None, 1.0]


def test_a_string_is_one_test():
    assert one(ADD, "assert add(1, 2) == 3\nassert add(2, 2) == 4") == 1.0
    assert one(ADD, "assert add(1, 2) == 3\nassert add(2, 2) == 5") == 0.0


def test_bad_tests_are_a_data_error():
    with pytest.raises(DataError, match="tests must be a string or a list of strings"):
        one(ADD, [1, 2])


def test_a_solution_that_raises_or_does_not_compile_fails_every_test():
    assert one(ADD + "raise ValueError('no')\n", ADD_TESTS) == 0.0
    assert one("def add(a, b) return a + b", ADD_TESTS) == 0.0


@pytest.mark.parametrize("exit_call", ["import sys\nsys.exit(0)", "import os\nos._exit(0)", "raise SystemExit"])
def test_exiting_early_passes_nothing(exit_call):
    assert one(ADD + exit_call + "\n", ADD_TESTS) == 0.0


def test_a_test_that_exits_fails_alone():
    assert one(ADD, ["assert add(1, 1) == 2", "import sys; sys.exit(0)", "assert add(2, 2) == 4"]) == \
        pytest.approx(2 / 3)


def test_infinite_loops():
    assert one("while True:\n    pass\n", ADD_TESTS, FAST) == 0.0  # at definition: every test fails
    looping = "def add(a, b):\n    while a == 1:\n        pass\n    return a + b\n"
    assert one(looping, ADD_TESTS, FAST) == pytest.approx(2 / 3)  # only the test that loops fails


def test_prints_do_not_count():
    noisy = "print('1' * 10**6)\ndef add(a, b):\n    print('x' * 10**5)\n    return a + b\n"
    assert one(noisy, ADD_TESTS) == pytest.approx(2 / 3)


def test_main_block_does_not_run():
    assert one(ADD + "if __name__ == '__main__':\n    add(int(input()), 1)\n", ADD_TESTS) == pytest.approx(2 / 3)


def test_hostile_code_scores_zero_and_does_no_harm(tmp_path):
    target = tmp_path / "pwned.txt"
    hostile = [
        "import socket\ns = socket.create_connection(('127.0.0.1', 22))\n" + ADD,
        f"open({str(target)!r}, 'w').write('x')\n" + ADD,
        "import os\nos.kill(os.getppid(), 9)\n" + ADD,
        "import os\nwhile True:\n    os.fork()\n",
    ]
    out = FAST(prompts=["p"] * len(hostile), completions=hostile, tests=[ADD_TESTS] * len(hostile))
    assert out == [0.0] * len(hostile)
    assert not target.exists()


def test_a_batch_runs_concurrently():
    solutions = [ADD, "def add(a, b):\n    return a - b\n", "def add(a, b):\n    return 0\n", "oops("]
    completions = [solutions[i % 4] for i in range(16)]
    out = FAST(prompts=["p"] * 16, completions=completions, tests=[ADD_TESTS] * 16)
    assert out == pytest.approx([[2 / 3, 1 / 3, 1 / 3, 0.0][i % 4] for i in range(16)])


def test_factory_binds_limits():
    reward = make_code_reward(Limits(timeout_s=1.0))
    assert reward.__name__ == "code"
    assert one(ADD, ADD_TESTS, reward) == pytest.approx(2 / 3)
