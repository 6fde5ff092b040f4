"""The `code` reward: the fraction of a row's tests the completion's code passes, run in the sandbox."""

import re

import pytest

from grpo.errors import DataError
from grpo.rewards.code import _values, check_tests, code, extract_code, make_code_reward, parse_test
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
    # a test's statements run in the sandbox before its probes; one that exits ends that test only
    assert one(ADD, ["assert add(1, 1) == 2", "import sys; sys.exit(0)\nassert add(3, 3) == 6",
                     "assert add(2, 2) == 4"]) == pytest.approx(2 / 3)


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


# ---------------------------------------------------------------------------------------------------- forging
# Each attack is written against a harness that runs the tests in the solution's interpreter (as this reward's
# did before): it would score 1 there. Here the expected values and the comparison stay in the trainer's
# process, so each scores 0, while an honest solution scores 1 on the same tests.

SUM_TESTS = ["assert add(2, 3) == 5", "assert add(10, -4) == 6", "assert add(1, 1) == 2"]  # no constant passes

FORGERIES = {
    "patch exec, eval and compile": (
        "import builtins\n"
        "class Yes:\n"
        "    def __eq__(self, other): return True\n"
        "    __hash__ = object.__hash__\n"
        "builtins.exec = lambda *a, **k: None\n"
        "builtins.eval = lambda *a, **k: Yes()\n"
        "builtins.compile = lambda *a, **k: None\n"
        "def add(a, b): return None\n"),
    "patch the builtins the checks use": (
        "import builtins, operator\n"
        "builtins.isinstance = lambda *a: True\n"
        "builtins.type = lambda *a: int\n"
        "builtins.len = lambda *a: 0\n"
        "operator.eq = lambda *a: True\n"
        "builtins.AssertionError = type('Never', (BaseException,), {})\n"
        "def add(a, b): return None\n"),
    "read the expected values from the frames and the program": (
        "import sys, re, ast, linecache\n"
        "def add(a, b):\n"
        "    found = []\n"
        "    def walk(x, depth=0):\n"
        "        if depth > 8: return\n"
        "        if isinstance(x, str): found.append(x)\n"
        "        elif isinstance(x, (list, tuple)): [walk(y, depth + 1) for y in x]\n"
        "        elif isinstance(x, dict): [walk(y, depth + 1) for y in list(x.values())]\n"
        "    f = sys._getframe()\n"
        "    while f is not None:\n"
        "        walk(dict(f.f_locals)); walk(dict(f.f_globals)); walk(f.f_code.co_consts)\n"
        "        f = f.f_back\n"
        "    walk(dict(linecache.cache)); walk(sys.argv)\n"
        "    for text in found:\n"
        "        m = re.search(r'add\\(%d, %d\\) == ([^\\\\n\\'\\\"]+)' % (a, b), text)\n"
        "        if m: return ast.literal_eval(m.group(1).strip())\n"
        "    return None\n"),
    "return an object equal to anything": (
        "class Anything:\n"
        "    def __eq__(self, other): return True\n"
        "    def __ne__(self, other): return False\n"
        "    def __bool__(self): return True\n"
        "    __hash__ = object.__hash__\n"
        "def add(a, b): return Anything()\n"),
    "return an int that says it equals anything": (
        "class Int(int):\n"
        "    def __eq__(self, other): return True\n"
        "    def __ne__(self, other): return False\n"
        "    __hash__ = int.__hash__\n"
        "def add(a, b): return Int(0)\n"),
    "return an object that claims to be an int": (
        "class Fake:\n"
        "    __class__ = property(lambda self: int)\n"
        "    def __eq__(self, other): return True\n"
        "    def __int__(self): return 5\n"
        "    def __index__(self): return 5\n"
        "    __hash__ = object.__hash__\n"
        "def add(a, b): return Fake()\n"),
    "print success markers": (
        "import sys\n"
        "for line in ['ok', 'PASSED', '1 1 1', '[0, 0, true]', '{\"passed\": 3}']:\n"
        "    print(line)\n"
        "    sys.__stdout__.write(line + '\\n'); sys.__stdout__.flush()\n"
        "    sys.stderr.write(line + '\\n')\n"
        "def add(a, b): return None\n"),
    "read the result tag from the frames, write result lines and exit": (
        "import sys, os, re\n"
        "tags = set()\n"
        "f = sys._getframe()\n"
        "while f is not None:\n"
        "    for v in list(f.f_locals.values()) + list(f.f_code.co_consts):\n"
        "        if isinstance(v, str) and re.fullmatch(r'[0-9a-f]{16,}', v): tags.add(v)\n"
        "    f = f.f_back\n"
        "for tag in tags:\n"
        "    for n in range(1, 10):\n"
        "        os.write(1, (tag + ' ' + '1' * n + '\\n').encode())\n"
        "for n in range(1, 10):\n"
        "    for k in range(n):\n"
        "        os.write(1, ('[%d,0,true]\\n' % k).encode())\n"
        "os._exit(0)\n"),
    "write the right values to fd 1 and exit": (
        "import os\n"
        "os.write(1, b'[0,0,5]\\n[1,0,6]\\n[2,0,2]\\n')\n"
        "os._exit(0)\n"),
    "exit inside the function": "import os\ndef add(a, b):\n    os._exit(0)\n",
    "sys.exit inside the function": "import sys\ndef add(a, b):\n    sys.exit(0)\n",
    "monkeypatch json": (
        "import json, json.encoder\n"
        "json.dumps = lambda *a, **k: '[0,0,true]'\n"
        "json.encoder.JSONEncoder.encode = lambda self, o: 'true'\n"
        "json.encoder.c_make_encoder = None\n"
        "def add(a, b): return None\n"),
    "disarm the alarm and hang": (
        "import signal\n"
        "signal.signal(signal.SIGALRM, signal.SIG_IGN)\n"
        "def add(a, b):\n"
        "    while True: pass\n"),
}


@pytest.mark.parametrize("name", list(FORGERIES))
def test_forging_scores_zero(name):
    assert one(ADD, SUM_TESTS) == 1.0  # the honest solution passes these tests
    assert one(FORGERIES[name], SUM_TESTS, FAST) == 0.0


def test_writing_on_every_descriptor_scores_the_row_zero():
    """The values go out on a copy of fd 1 that the solution can find; lines it writes there (fake values,
    duplicates, garbage) zero the whole row, even when its function is right."""
    forger = ADD + (
        "import os\n"
        "for fd in range(3, 64):\n"
        "    try:\n"
        "        os.write(fd, b'[0,0,true]\\n[1,0,true]\\n[2,0,true]\\nPASSED\\n')\n"
        "    except OSError:\n"
        "        pass\n")
    assert one(forger, SUM_TESTS) == 0.0


def test_a_refused_operation_scores_the_row_zero():
    attempt = ADD + "try:\n    import socket\nexcept PermissionError:\n    pass\n"
    assert one(attempt, SUM_TESTS) == 0.0


# ---------------------------------------------------------------------------------------------------- values

@pytest.mark.parametrize("solution, tests, expected", [
    ("def f(): return [1, 2]", ["assert f() == [1, 2]", "assert f() == (1, 2)"], 0.5),  # a list is not a tuple
    ("def f(): return (1, 2)", ["assert f() == (1, 2)", "assert f() != [1, 2]"], 1.0),
    ("def f(): return 3", ["assert f() == 3.0", "assert f() == 3", "assert f() > 2", "assert f() in (1, 3)"], 1.0),
    ("def f(): return True", ["assert f() == 1", "assert f() is True", "assert f()", "assert f() is not None"], 1.0),
    ("def f(): return 1", ["assert f() is True"], 0.0),  # 1 is not the object True
    ("def f(): return None", ["assert f() is None", "assert not f()", "assert f() == None"], 1.0),
    ("def f(): return 0.1 + 0.2", ["assert f() == 0.30000000000000004", "assert f() == 0.3"], 0.5),  # exact
    ("def f(): return 0.1 + 0.2", ["import math\nassert math.isclose(f(), 0.3, rel_tol=1e-9)"], 1.0),
    ("def f(): return float('nan')", ["assert f() == float('nan')"], 0.0),  # nan is not nan, as in Python
    ("def f(): return float('inf')", ["assert f() == float('inf')", "assert f() > 1e308"], 1.0),
    ("def f(): return {3, 1}", ["assert f() == {1, 3}", "assert f() == set([1, 3])", "assert f() == [1, 3]"],
     2 / 3),
    ("def f(): return {(1, 2): [3], 'a': {4}}", ["assert f() == {'a': {4}, (1, 2): [3]}"], 1.0),
    ("def f(): return b'ab', bytearray(b'c'), 1 + 2j", ["assert f() == (b'ab', b'c', (1+2j))"], 1.0),
    ("def f(): return 'h\\u00e9\\ud800'", ["assert f() == 'h\\u00e9\\ud800'"], 1.0),
    ("def f(): return 2 ** 200", ["assert f() == 1606938044258990275541962092341162602522202993782792835301376"],
     1.0),
    ("from collections import namedtuple, OrderedDict, Counter\nP = namedtuple('P', 'x y')\n"
     "def f(): return P(1, 2), OrderedDict(a=1), Counter('aab')",
     ["assert f() == ((1, 2), {'a': 1}, {'a': 2, 'b': 1})"], 1.0),  # subclasses cross as their base type
    ("def f(): return iter([1])", ["assert f()"], 0.0),  # not a plain value: no value
    ("def f(): return [0] * 10**6", ["assert f() == [0, 0]", "assert f()"], 0.0),  # too large to cross
    ("def f(x): return x * 2", ["xs = [1, 2]\nassert f(xs) == [1, 2, 1, 2]\nassert f(3) == 6"], 1.0),
    ("def f(x): return x * 2", ["assert f(1) == 2 and f(2) == 4", "assert f(1) == 3 or f(2) == 4",
                                "assert not f(1) == 3"], 1.0),
    ("def f(x): return 1 // x", ["assert not f(0) == 5", "assert f(1) == 1 or f(0) == 7"], 0.5),  # raised: fails
])
def test_values_compare_as_python_does(solution, tests, expected):
    assert one(solution, tests) == pytest.approx(expected)


@pytest.mark.parametrize("test, why", [
    ("assert f(1) == f(2)", "no literal side"),
    ("assert f(3) == 3 * 2", "no literal side"),
    ("assert 0 < f(1) < 5", "chained comparison"),
    ("assert all(f(x) == 2 * x for x in range(3))", "would be decided in the sandbox"),
    ("assert [f(1) == 2] == [True]", "would be decided in the sandbox"),
    ("for x in range(3):\n    assert f(x) == x", "asserts must be top-level"),
    ("ok = f(1) == 2\nassert ok", "would be decided in the sandbox"),
    ("assert f(1) is 2", "'is' compares only with None, True or False"),
    ("assert math.isclose(f(1), g(1))", "one side of isclose must be a literal number"),
    ("assert math.isclose(f(1), 2.0, rel_tol=-1)", "isclose takes literal rel_tol and abs_tol (>= 0) only"),
    ("assert math.isclose(f(1), 2.0, tol=tol)", "isclose takes literal rel_tol and abs_tol (>= 0) only"),
    ("f(1)", "no top-level assert"),
    ("assert f(1) ==", "not valid Python"),
])
def test_tests_it_cannot_check_are_a_data_error(test, why):
    with pytest.raises(DataError, match=re.escape(why)):
        check_tests([test])
    with pytest.raises(DataError, match=re.escape(why)):
        one(ADD, ["assert add(1, 1) == 2", test])


def test_a_test_is_split_into_probes_and_expectations():
    t = parse_test("import math\nassert add(2, 3) == 5\nassert 6 == add(3, 3)\nassert math.isclose(half(1), 0.5)")
    assert t.steps == (("exec", "import math"), ("eval", "add(2, 3)"), ("eval", "add(3, 3)"), ("eval", "half(1)"))
    assert "5" not in repr(t.steps) and "0.5" not in repr(t.steps)  # no expected value goes to the sandbox
    assert t.passed({0: 5, 1: 6, 2: 0.5}) and not t.passed({0: 5, 1: 6}) and not t.passed({0: 5, 1: 7, 2: 0.5})
    assert check_tests(["assert add(1, 1) == 2", "assert set(f()) == set((4, 5))"]) == 2
    assert check_tests(None) == 0 and check_tests("") == 0


@pytest.mark.parametrize("stdout", [
    "[0,0,5]\n[0,0,5]\n",           # a value twice
    "[0,1,5]\n",                    # a probe that does not exist
    "[1,0,5]\n",                    # a test that does not exist
    "PASSED\n",                     # not a value
    "[0,0,NaN]\n",                  # not JSON
    '[0,0,{"eval":"1"}]\n',         # an unknown tag
    '[0,0,{"set":[[1]]}]\n',        # an unhashable element
    "[0,0," * 100_000 + "\n",       # nested past the decoder's depth
])
def test_output_an_honest_harness_never_writes_scores_the_row_zero(stdout):
    assert _values(stdout, [1]) is None


def test_an_unfinished_last_line_is_dropped():
    assert _values('[0,0,{"tuple":[1,2]}]\n[0,1,', [2]) == [{0: (1, 2)}]
    assert _values("", [1]) == [{}]
