"""The `code` reward: the fraction of a row's test cases that the completion's Python code passes.

Each completion's code (its last ```python or bare ``` fenced block, else the whole text) runs in the sandbox
(`grpo.sandbox.run_python`: its own process, time, CPU and memory limits, no network, no access to the run's
files) together with all of its row's tests, in one execution: a harness exec()s the code in a fresh namespace
(with `__name__ == "solution"`, so an `if __name__ == "__main__":` demo does not run), then each test in that
namespace, each inside try/except and its own time budget (SIGALRM; a test stuck in C code that ignores it
costs the whole row at the wall-clock limit). Code that fails to compile or raises (SystemExit included)
fails every test. The harness prints one result line tagged with a random nonce, and the parent counts only
that line, so code that exits early (sys.exit(0), os._exit(0)) or dies passes nothing; prints of the code and
of the tests are discarded.

A row's `tests` is a list of Python statements (MBPP's `test_list` style: `"assert add(2, 3) == 5"`), or a
single string, which is one test (it may span several lines). A row without tests (None, "" or []) gets None:
the reward does not apply to it. The rows of a batch run concurrently, one sandboxed process per CPU, so a batch
of 64 completions takes about 64 / CPUs executions' time.

The sandbox protects the machine, not the reward: the code runs in the same interpreter as the harness, so a
solution written against this harness (finding the nonce, replacing its functions, disarming its alarms) can
forge a result. Reward hacking of that kind has to be caught by reading the completions, as for any reward.
"""
from __future__ import annotations

import os
import re
import secrets
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from grpo.errors import DataError
from grpo.rewards import RewardFn
from grpo.sandbox import Limits, run_python

# A fenced block: ``` and an optional info string ("python", "py", …) on the opening line, up to the closing
# ``` or the end of the text (a completion cut off by the token limit leaves its last block open).
_FENCE = re.compile(r"```([^\n`]*)\n(.*?)(?:```|\Z)", re.S)
_PYTHON_TAGS = ("", "python", "py", "python3")

# The program run in the sandbox. `_grpo_check` keeps what it needs in local variables and writes its result
# with the os.write it captured before the solution ran.
_HARNESS = '''\
import os as _os, signal as _signal, sys as _sys


def _grpo_check(solution, tests, budget, nonce):
    write, stdout_fd = _os.write, 1

    class OverBudget(BaseException):  # not an Exception, so that the solution's `except Exception` lets it by
        pass

    def alarm(signum, frame):
        raise OverBudget

    class Sink:
        def write(self, text):
            return len(text)

        def flush(self):
            pass

    namespace = {"__name__": "solution", "__builtins__": __builtins__}

    def run(source, name):
        try:
            try:
                _signal.setitimer(_signal.ITIMER_REAL, budget)
                exec(compile(source, name, "exec"), namespace)
                return True
            finally:
                _signal.setitimer(_signal.ITIMER_REAL, 0)
        except BaseException:
            return False

    _signal.signal(_signal.SIGALRM, alarm)
    _sys.stdout = _sys.stderr = Sink()
    passed = run(solution, "solution.py")
    results = [passed and run(test, f"test_{i}.py") for i, test in enumerate(tests)]
    write(stdout_fd, (nonce + " " + "".join("1" if r else "0" for r in results) + "\\n").encode())
'''


def extract_code(text: str) -> str:
    """The code of a completion: its last fenced block tagged python (or py, python3) or untagged; else the whole
    text. Example: "Here:\\n```python\\ndef f(): return 1\\n```\\nDone." → "def f(): return 1\\n"."""
    blocks = [body for tag, body in _FENCE.findall(text) if (tag.split() or [""])[0].lower() in _PYTHON_TAGS]
    return blocks[-1] if blocks else text


def _test_list(tests: Any) -> list[str] | None:
    """A row's tests as a list of statements, or None when it has none."""
    if tests is None:
        return None
    if isinstance(tests, str):
        return [tests] if tests.strip() else None
    if isinstance(tests, Sequence) and all(isinstance(t, str) for t in tests):
        return list(tests) or None
    raise DataError(f"code reward: a row's tests must be a string or a list of strings, got {tests!r}")


def _passed_fraction(completion: str, tests: list[str], limits: Limits) -> float:
    """Run the completion's code and `tests` in one sandboxed execution; the fraction of tests passed."""
    nonce = secrets.token_hex(16)
    # The solution and each test get an equal share of 80% of the wall-clock limit (the rest: start-up).
    budget = 0.8 * limits.timeout_s / (len(tests) + 1)
    program = _HARNESS + f"\n\n_grpo_check({extract_code(completion)!r}, {tests!r}, {budget!r}, {nonce!r})\n"
    execution = run_python(program, limits=limits)
    for line in reversed(execution.stdout.splitlines()):
        tag, _, results = line.partition(" ")
        if tag == nonce and len(results) == len(tests) and set(results) <= {"0", "1"}:
            return results.count("1") / len(tests)
    return 0.0


def _workers() -> int:
    try:
        return len(os.sched_getaffinity(0))  # the CPUs this process may use, in a container too
    except AttributeError:
        return os.cpu_count() or 1


def _score(completions: Sequence[str], tests: Sequence[Any] | None, limits: Limits) -> list[float | None]:
    rows = [None] * len(completions) if tests is None else [_test_list(t) for t in tests]
    if len(rows) != len(completions):
        raise DataError(f"code reward: {len(completions)} completions but {len(rows)} rows of tests")
    out: list[float | None] = [None] * len(completions)
    jobs = [i for i, row in enumerate(rows) if row is not None]
    if jobs:
        with ThreadPoolExecutor(max_workers=min(len(jobs), _workers())) as pool:
            for i, value in zip(jobs, pool.map(lambda i: _passed_fraction(completions[i], rows[i], limits), jobs)):
                out[i] = value
    return out


def make_code_reward(limits: Limits) -> RewardFn:
    """The `code` reward with the sandbox's limits set to `limits` (e.g. from a config)."""

    def code(prompts: Sequence[str], completions: Sequence[str], tests: Sequence[Any] | None = None,
             **fields: Any) -> list[float | None]:
        return _score(completions, tests, limits)

    code.__doc__ = f"The `code` reward (see grpo.rewards.code.code) under {limits}."
    return code


def code(prompts: Sequence[str], completions: Sequence[str], tests: Sequence[Any] | None = None,
         **fields: Any) -> list[float | None]:
    """The fraction (0.0 to 1.0) of the row's `tests` that the completion's code passes, run in the sandbox with
    the default `Limits()`; None for a row without tests. Other fields are accepted and ignored.

    Example: completion "```python\\ndef add(a, b): return a + b\\n```" with tests
    ["assert add(2, 3) == 5", "assert add(0, 0) == 0", "assert add(1, 1) == 3"] → 2/3.
    """
    return _score(completions, tests, Limits())
