"""The `code` reward: the fraction of a row's tests that the completion's Python code passes, decided outside the
code's reach.

Each completion's code (its last ```python or bare ``` fenced block, else the whole text) runs in the sandbox
(`grpo.sandbox.run_python`: its own process, time, CPU and memory limits, no network, no access to the run's
files). The code is never trusted to say whether it passed. A row's tests are parsed here, in the trainer's
process, with `ast`: each `assert` is split into *probes* (the expressions that need the solution, such as
`add(2, 3)`) and *expectations* (literal values such as `5`, evaluated here with `ast.literal_eval`). Only the
probes, and the test's other statements (`import math`, `x = [1, 2]`), are sent to the sandbox; a harness there
runs the code (as module `solution`, so an `if __name__ == "__main__":` block does not run), then each test's
statements and probes in order, each test with its own time budget (SIGALRM), and writes each probe's value as
one JSON line. Here the values are decoded into plain Python values and compared with the expectations by
Python's own `==` (or `<`, `in`, `is None`, `math.isclose`…). So:

- the expected values never enter the sandbox: no frame, file or variable there holds them;
- a value crosses as data (JSON with tags for tuples, sets, dicts, bytes, complex numbers and non-finite
  floats), never as an object: one that defines its own `__eq__`, `__bool__` or `__class__` cannot be sent;
- patching builtins, `exec` or `json`, disarming the alarms, printing, writing to file descriptor 1 (the
  solution's fd 1 is /dev/null; the values go out on a copy the harness made before the code ran), exiting early
  or killing the interpreter can at most change or withhold the values claimed for the probes, and a claimed
  value passes only if it is the expected value, which the code had to produce without seeing it;
- output that an honest harness never writes (a line that is not a value, a value for a probe that does not
  exist, two values for one probe) scores the whole row 0, and so does an execution that ends "blocked",
  "error", "memory" or "output": the reward never pays for code the sandbox had to refuse or that tampered
  with the harness's channel. A "timeout" keeps the values written before it.

What a test may be (anything else is a `DataError` naming the test, raised on the first batch that holds it):
one or more statements with at least one top-level `assert`. An assert's condition is a comparison with one
operator (`==`, `!=`, `<`, `<=`, `>`, `>=`, `in`, `not in`; `is`/`is not` against None, True or False) of a
probe with an expected value, `math.isclose(probe, expected, rel_tol=…, abs_tol=…)`, a bare probe (truthiness),
or `not`, `and`, `or` of these. An expected value is a literal (numbers, strings, bytes, None, True, False,
tuples, lists, dicts, sets) or `set`, `frozenset`, `tuple`, `list`, `dict` or `float` applied to one. Refused:
a comparison with no literal side (`f(1) == f(2)`, `f(x) == x * 2`: both sides would be computed where the
solution decides), chained comparisons, any comparison inside a probe or a statement (`all(f(x) == 2 * x for x
in …)`: the sandbox would decide it), and asserts inside other statements.

Semantics: a test passes when every top-level assert holds, as Python would decide it for the builtin types the
values cross as (1 == 1.0 == True, (1, 2) != [1, 2], floats exact unless `math.isclose`). A probe whose value
is not of these types (a custom object, a generator, a NumPy array), is larger than `_RESULT_CHARS` as JSON, or
that raised or ran out of its time budget has no value, and the assert that needs it fails. An instance of a
subclass of a builtin type (a namedtuple, an OrderedDict, a Counter, an IntEnum) crosses as its builtin base
type. The sandbox sees every probe of the row (the inputs of the tests) but no expectation; a solution can still
special-case inputs it saw in its prompt, as it could in any test-based reward.

A row's `tests` is a list of such tests (MBPP's `test_list`: `"assert add(2, 3) == 5"`) or a single string, one
test (it may span several lines). A row without tests (None, "" or []) gets None: the reward does not apply to it.
The rows of a batch run concurrently, one sandboxed process per CPU.
"""
from __future__ import annotations

import ast
import functools
import json
import math
import operator
import os
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from grpo.errors import DataError
from grpo.rewards import RewardFn
from grpo.sandbox import Limits, run_python

# A fenced block: ``` and an optional info string ("python", "py", …) on the opening line, up to the closing
# ``` or the end of the text (a completion cut off by the token limit leaves its last block open).
_FENCE = re.compile(r"```([^\n`]*)\n(.*?)(?:```|\Z)", re.S)
_PYTHON_TAGS = ("", "python", "py", "python3")

# The most characters of JSON a row's probe values may take: a larger value is withheld (its assert fails). The
# executions of this reward keep at least this much of stdout, whatever `Limits.output_chars` says (the values
# are its only channel); it also bounds the work of decoding what a hostile solution writes.
_RESULT_CHARS = 65_536

# The program run in the sandbox: `_grpo_run(solution, tests, budget, result_chars)`, `tests` being a list of
# lists of steps ["exec", source] or ["eval", source]. Every name it uses after the solution has run is a local
# or a default argument bound before, so that an honest solution that shadows a builtin does not break it (a
# hostile one can break it at will: it then only loses its values).
_HARNESS = '''\
import json as _json, os as _os, signal as _signal, sys as _sys


def _grpo_encoder():
    """The typed JSON encoding of a plain value; raises TypeError for anything else."""
    kinds = (bool, int, float, complex, str, bytes, bytearray, list, tuple, dict, set, frozenset)

    def encode(v, depth=0, kinds=kinds, type=type, issubclass=issubclass, repr=repr, TypeError=TypeError,
               int_=int.__int__, float_=float.__float__, str_=str.__str__, real=complex.real.__get__,
               imag=complex.imag.__get__, hex_b=bytes.hex, hex_ba=bytearray.hex, it_list=list.__iter__,
               it_tuple=tuple.__iter__, it_set=set.__iter__, it_frozen=frozenset.__iter__, items=dict.items):
        if depth > 64:
            raise TypeError("nested too deep")
        if v is None or v is True or v is False:
            return v
        t = type(v)
        kind = None
        for k in kinds:
            if issubclass(t, k):
                kind = k
                break
        if kind is int:
            return int_(v)
        if kind is float:
            f = float_(v)
            return f if f - f == 0.0 else {"float": repr(f)}  # nan and the infinities are not JSON numbers
        if kind is str:
            return str_(v)
        if kind is complex:
            return {"complex": [encode(real(v), depth + 1), encode(imag(v), depth + 1)]}
        if kind is bytes:
            return {"bytes": hex_b(v)}
        if kind is bytearray:
            return {"bytearray": hex_ba(v)}
        if kind is list:
            return [encode(x, depth + 1) for x in it_list(v)]
        if kind is tuple:
            return {"tuple": [encode(x, depth + 1) for x in it_tuple(v)]}
        if kind is set:
            return {"set": [encode(x, depth + 1) for x in it_set(v)]}
        if kind is frozenset:
            return {"frozenset": [encode(x, depth + 1) for x in it_frozen(v)]}
        if kind is dict:
            return {"dict": [[encode(a, depth + 1), encode(b, depth + 1)] for a, b in items(v)]}
        raise TypeError("not a plain value")

    return encode


def _grpo_run(solution, tests, budget, result_chars):
    os, signal, dumps, encode = _os, _signal, _json.dumps, _grpo_encoder()
    write, compile_, exec_, eval_, len_, enumerate_ = os.write, compile, exec, eval, len, enumerate
    BaseException_, setitimer, ITIMER_REAL = BaseException, signal.setitimer, signal.ITIMER_REAL
    # The values go out on a copy of fd 1; the solution's fd 1 (print, os.write(1, ...)) is /dev/null.
    out = os.dup(1)
    null = os.open("/dev/null", os.O_WRONLY)
    os.dup2(null, 1)
    os.close(null)

    class OverBudget(BaseException):  # not an Exception, so that the solution's `except Exception` lets it by
        pass

    def alarm(signum, frame):
        raise OverBudget

    class Sink:
        def write(self, text):
            return len(text)

        def flush(self):
            pass

    def send(line, left=[result_chars]):
        data = (line + "\\n").encode()
        if len_(data) > left[0]:
            return
        left[0] -= len_(data)
        while data:
            data = data[write(out, data):]

    signal.signal(signal.SIGALRM, alarm)
    _sys.stdout = _sys.stderr = Sink()
    namespace = {"__name__": "solution", "__builtins__": __builtins__}
    try:
        try:
            setitimer(ITIMER_REAL, budget)
            exec_(compile_(solution, "solution.py", "exec"), namespace)
        finally:
            setitimer(ITIMER_REAL, 0)
    except BaseException_:
        return  # a solution that does not run passes nothing
    for t, steps in enumerate_(tests):
        try:
            try:
                setitimer(ITIMER_REAL, budget)
                k = 0
                for kind, source in steps:
                    if kind == "exec":
                        exec_(compile_(source, f"test_{t}.py", "exec"), namespace)
                        continue
                    value = eval_(compile_(source, f"test_{t}.py", "eval"), namespace)
                    try:
                        send(dumps([t, k, encode(value)], ensure_ascii=True, allow_nan=False,
                                   separators=(",", ":")))
                    except (TypeError, ValueError, RecursionError):
                        pass  # not a plain value: it has none
                    k += 1
            finally:
                setitimer(ITIMER_REAL, 0)
        except BaseException_:
            pass  # an exception ends the test: its later probes have no value
'''


def extract_code(text: str) -> str:
    """The code of a completion: its last fenced block tagged python (or py, python3) or untagged; else the whole
    text. Example: "Here:\\n```python\\ndef f(): return 1\\n```\\nDone." → "def f(): return 1\\n"."""
    blocks = [body for tag, body in _FENCE.findall(text) if (tag.split() or [""])[0].lower() in _PYTHON_TAGS]
    return blocks[-1] if blocks else text


# ------------------------------------------------------------------------------------------- parsing tests

class _Missing(Exception):
    """A probe without a value: the assert that needs it fails, as an exception fails it in Python."""


@dataclass(frozen=True)
class _Probe:
    """The value the sandbox wrote for a test's `index`-th probe."""
    index: int

    def get(self, values: dict[int, Any]) -> Any:
        if self.index not in values:
            raise _Missing
        return values[self.index]


@dataclass(frozen=True)
class _Const:
    """An expected value, evaluated here."""
    value: Any

    def get(self, values: dict[int, Any]) -> Any:
        return self.value


_OPS = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt,
        ast.GtE: operator.ge, ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b,
        ast.Is: operator.is_, ast.IsNot: operator.is_not}


@dataclass(frozen=True)
class _Check:
    """One condition, decided here: ("cmp", op, left, right), ("isclose", probe, expected, keywords),
    ("truthy", probe), ("not", check), ("and", checks) or ("or", checks)."""
    kind: str
    args: tuple

    def holds(self, values: dict[int, Any]) -> bool:
        """As Python evaluates the condition (left to right, short-circuit); raises _Missing where Python would
        have raised."""
        a = self.args
        if self.kind == "cmp":
            op, left, right = a
            try:
                return bool(_OPS[op](left.get(values), right.get(values)))
            except (TypeError, ValueError, RecursionError) as e:  # "<" between str and int, as in Python
                raise _Missing from e
        if self.kind == "isclose":
            probe, expected, kwargs = a
            got = probe.get(values)
            if type(got) not in (int, float, bool):
                raise _Missing
            return math.isclose(got, expected, **dict(kwargs))
        if self.kind == "truthy":
            return bool(a[0].get(values))
        if self.kind == "not":
            return not a[0].holds(values)
        if self.kind == "and":
            return all(c.holds(values) for c in a[0])
        return any(c.holds(values) for c in a[0])  # "or"


@dataclass(frozen=True)
class _Test:
    steps: tuple[tuple[str, str], ...]  # ("exec", statement) / ("eval", probe), in order, for the sandbox
    checks: tuple[_Check, ...]         # every top-level assert; all must hold

    def passed(self, values: dict[int, Any]) -> bool:
        try:
            return all(c.holds(values) for c in self.checks)
        except (_Missing, RecursionError):
            return False


_CONSTRUCTORS = {"set": set, "frozenset": frozenset, "tuple": tuple, "list": list, "dict": dict, "float": float}
_SINGLETONS = (None, True, False)


def _expected(node: ast.expr) -> tuple[bool, Any]:
    """(True, value) when `node` is an expected value evaluated here: a literal, or one of `_CONSTRUCTORS`
    applied to one (or to nothing); else (False, None)."""
    try:
        return True, ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        pass
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _CONSTRUCTORS
            and not node.keywords and len(node.args) <= 1):
        try:
            args = [ast.literal_eval(x) for x in node.args]
            return True, _CONSTRUCTORS[node.func.id](*args)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            pass
    return False, None


class _Refused(Exception):
    pass


class _Parser:
    """Turns one test's source into a `_Test`; raises _Refused with why for a shape it cannot check here."""

    def __init__(self):
        self.steps: list[tuple[str, str]] = []
        self.probes = 0

    def probe(self, node: ast.expr) -> _Probe:
        if any(isinstance(n, ast.Compare) for n in ast.walk(node)):
            raise _Refused(f"the comparison inside {ast.unparse(node)!r} would be decided in the sandbox, where the "
                           "solution can answer it; compare the probe's value with a literal instead")
        self.steps.append(("eval", ast.unparse(node)))
        self.probes += 1
        return _Probe(self.probes - 1)

    def operand(self, node: ast.expr) -> tuple[bool, _Probe | _Const]:
        ok, value = _expected(node)
        return (True, _Const(value)) if ok else (False, self.probe(node))

    def check(self, node: ast.expr) -> _Check:
        if isinstance(node, ast.BoolOp):
            return _Check("and" if isinstance(node.op, ast.And) else "or", (tuple(self.check(v) for v in node.values),))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            return _Check("not", (self.check(node.operand),))
        if isinstance(node, ast.Compare):
            return self.compare(node)
        if (isinstance(node, ast.Call) and len(node.args) == 2
                and ast.unparse(node.func) in ("math.isclose", "isclose")):
            return self.isclose(node)
        return _Check("truthy", (self.probe(node),))

    def compare(self, node: ast.Compare) -> _Check:
        if len(node.ops) != 1:
            raise _Refused(f"chained comparison {ast.unparse(node)!r}: write one comparison per assert")
        op, (left, right) = type(node.ops[0]), (node.left, node.comparators[0])
        left_ok, left_value = _expected(left)
        right_ok, right_value = _expected(right)
        if not (left_ok or right_ok):
            raise _Refused(f"{ast.unparse(node)!r} has no literal side: the expected value must be a literal (or "
                           "set/frozenset/tuple/list/dict/float of one), so that it never enters the sandbox")
        if op in (ast.Is, ast.IsNot):
            if not any((right_ok and right_value is s) or (left_ok and left_value is s) for s in _SINGLETONS):
                raise _Refused(f"{ast.unparse(node)!r}: 'is' compares only with None, True or False")
        # the literal side stays here; the other is probed (the left one when both are literals)
        a = _Const(left_value) if left_ok and not right_ok else self.probe(left)
        b = _Const(right_value) if right_ok else self.probe(right)
        return _Check("cmp", (op, a, b))

    def isclose(self, node: ast.Call) -> _Check:
        (a_ok, a), (b_ok, b) = (_expected(x) for x in node.args)
        kwargs = []
        for kw in node.keywords:
            ok, value = _expected(kw.value)
            if kw.arg not in ("rel_tol", "abs_tol") or not ok or type(value) not in (int, float) or not value >= 0:
                raise _Refused(f"{ast.unparse(node)!r}: isclose takes literal rel_tol and abs_tol (>= 0) only")
            kwargs.append((kw.arg, value))
        literal = a if a_ok and not b_ok else b if b_ok else None
        if not (a_ok or b_ok) or type(literal) not in (int, float):
            raise _Refused(f"{ast.unparse(node)!r}: one side of isclose must be a literal number")
        probe = self.probe(node.args[1] if a_ok and not b_ok else node.args[0])
        return _Check("isclose", (probe, literal, tuple(kwargs)))

    def statement(self, node: ast.stmt) -> _Check | None:
        if isinstance(node, ast.Assert):
            return self.check(node.test)
        for n in ast.walk(node):
            if isinstance(n, ast.Assert):
                raise _Refused("an assert inside another statement would be decided in the sandbox; asserts must "
                               "be top-level statements")
            if isinstance(n, ast.Compare):
                raise _Refused(f"the comparison in {ast.unparse(node)!r} would be decided in the sandbox, where the "
                               "solution can answer it")
        self.steps.append(("exec", ast.unparse(node)))
        return None


@functools.lru_cache(maxsize=4096)
def parse_test(source: str) -> _Test:
    """One test's source as the steps the sandbox runs and the checks decided here; DataError (naming the test)
    for a shape this reward cannot check outside the solution's reach (see the module docstring).

    Example: "assert add(2, 3) == 5" → steps (("eval", "add(2, 3)"),), one check: probe 0 == 5."""
    try:
        tree = ast.parse(source, mode="exec")
    except (SyntaxError, ValueError, MemoryError, RecursionError) as e:
        raise DataError(f"code reward: the test {source!r} is not valid Python: {e}") from None
    parser, checks = _Parser(), []
    try:
        for node in tree.body:
            check = parser.statement(node)
            if check is not None:
                checks.append(check)
    except _Refused as e:
        raise DataError(f"code reward: cannot check the test {source!r} outside the solution's reach: {e} "
                        "(docs/rewards.md#code)") from None
    except RecursionError:
        raise DataError(f"code reward: the test {source!r} is nested too deeply") from None
    if not checks:
        raise DataError(f"code reward: the test {source!r} has no top-level assert to check")
    return _Test(tuple(parser.steps), tuple(checks))


def check_tests(tests: Any) -> int:
    """The number of tests in a row's `tests` (0 for none); DataError for a test this reward cannot check. Call
    it on every row of a data set to find such tests before training."""
    row = _test_list(tests)
    for source in row or []:
        parse_test(source)
    return len(row or [])


def _test_list(tests: Any) -> list[str] | None:
    """A row's tests as a list of sources, or None when it has none."""
    if tests is None:
        return None
    if isinstance(tests, str):
        return [tests] if tests.strip() else None
    if isinstance(tests, Sequence) and all(isinstance(t, str) for t in tests):
        return list(tests) or None
    raise DataError(f"code reward: a row's tests must be a string or a list of strings, got {tests!r}")


# ------------------------------------------------------------------------------------------- values back

_TAGS = {"tuple": tuple, "set": set, "frozenset": frozenset}


class _Tampered(Exception):
    """Output an honest harness never writes."""


def _no_constant(name: str):
    raise _Tampered(f"JSON constant {name}")


def _decode(v: Any) -> Any:
    """A typed JSON value (as the harness's encoder writes it) as a plain Python value."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, list):
        return [_decode(x) for x in v]
    if not isinstance(v, dict) or len(v) != 1:
        raise _Tampered("not a typed value")
    (tag, body), = v.items()
    if tag in _TAGS and isinstance(body, list):
        return _TAGS[tag](_decode(x) for x in body)  # TypeError (unhashable) is caught by the caller
    if tag == "dict" and isinstance(body, list) and all(isinstance(p, list) and len(p) == 2 for p in body):
        return {_decode(a): _decode(b) for a, b in body}
    if tag == "float" and body in ("nan", "inf", "-inf"):
        return float(body)
    if tag == "complex" and isinstance(body, list) and len(body) == 2:
        re_, im = (_decode(x) for x in body)
        if type(re_) is float and type(im) is float:
            return complex(re_, im)
    if tag in ("bytes", "bytearray") and isinstance(body, str):
        return (bytes if tag == "bytes" else bytearray).fromhex(body)
    raise _Tampered(f"unknown tag {tag!r}")


def _values(stdout: str, shape: list[int]) -> list[dict[int, Any]] | None:
    """Each test's probe values from the harness's output; None when it holds anything the harness never writes.
    `shape[t]` is the number of probes of test t. A last line without its newline (the execution was killed while
    writing, or the output was cut) is dropped."""
    lines = stdout.split("\n")[:-1]  # the last piece is "" after a final newline, else an unfinished line
    out: list[dict[int, Any]] = [{} for _ in shape]
    try:
        for line in lines:
            t, k, raw = json.loads(line, parse_constant=_no_constant)
            if not (type(t) is int and type(k) is int and 0 <= t < len(shape) and 0 <= k < shape[t]) or k in out[t]:
                return None
            out[t][k] = _decode(raw)
    except (_Tampered, ValueError, TypeError, RecursionError):  # JSONDecodeError is a ValueError
        return None
    return out


# ------------------------------------------------------------------------------------------- scoring

_KEPT_STATUSES = ("ok", "timeout")


def _passed_fraction(completion: str, tests: list[str], limits: Limits) -> float:
    """Run the completion's code and the probes of `tests` in one sandboxed execution; the fraction of tests
    whose asserts hold for the values it wrote."""
    parsed = [parse_test(t) for t in tests]
    # The solution and each test get an equal share of 80% of the wall-clock limit (the rest: start-up).
    budget = 0.8 * limits.timeout_s / (len(tests) + 1)
    steps = [[list(s) for s in p.steps] for p in parsed]
    program = _HARNESS + f"\n\n_grpo_run({extract_code(completion)!r}, {steps!r}, {budget!r}, {_RESULT_CHARS!r})\n"
    execution = run_python(program, limits=_with_room(limits))
    if execution.status not in _KEPT_STATUSES:
        return 0.0
    values = _values(execution.stdout, [sum(kind == "eval" for kind, _ in p.steps) for p in parsed])
    if values is None:
        return 0.0
    return sum(p.passed(v) for p, v in zip(parsed, values)) / len(tests)


def _with_room(limits: Limits) -> Limits:
    """`limits` keeping enough of stdout for the values (the truncation marker included)."""
    return replace(limits, output_chars=max(limits.output_chars, _RESULT_CHARS + 64))


def _workers() -> int:
    try:
        return len(os.sched_getaffinity(0))  # the CPUs this process may use, in a container too
    except AttributeError:
        return os.cpu_count() or 1


def _score(completions: Sequence[str], tests: Sequence[Any] | None, limits: Limits) -> list[float | None]:
    rows = [None] * len(completions) if tests is None else [_test_list(t) for t in tests]
    if len(rows) != len(completions):
        raise DataError(f"code reward: {len(completions)} completions but {len(rows)} rows of tests")
    for row in rows:  # every test parses before anything runs: a bad one fails the batch at once
        for source in row or []:
            parse_test(source)
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
