"""The built-in task ``functions``: write a small Python function, scored by running it against tests (the
`code` reward), for a real model (docs/smollm2.md#code).

``"Write a Python function `add_7(x)` that returns x plus 7."`` → a completion such as
```` ```python\\ndef add_7(x):\\n    return x + 7\\n``` ````, run against three tests such as
``"assert add_7(3) == 10"``.

Every problem is one of `FAMILIES`: a one-line behaviour on an int, a list or a string, either with a constant
(``add_{k}``, ``count_{k}``…) or under one of a few function and argument names (``largest(nums)``,
``max_value(values)``…). The space is enumerated completely and split by a stable hash of the prompt, like the
other built-in tasks, so the held-out prompts are never trained on. Each example carries its tests (the field
``tests``, three asserts of a call against a literal, the shape the `code` reward checks outside the sandbox)
and, as its answer, a reference solution that passes them. The tests' inputs are drawn from a generator seeded
by the prompt, so they are the same on every machine and differ from prompt to prompt.
"""
from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Callable

from grpo.tasks.base import Example

WORDS = ("level", "apple", "rotor", "banana", "kayak", "python", "noon", "grape", "radar", "table", "stats",
         "orange", "civic", "lemon", "refer", "music")


@dataclass(frozen=True)
class Family:
    """Problems of one kind. `name`, `says` and `body` are templates over {k} (the constant) and {a} (the argument's
    name); `ks` are the constants (None: the problem has none and varies by `names` and `args` instead);
    `fn(k)` is the behaviour, `inputs(rng, k)` draws one input."""

    kind: str
    names: tuple[str, ...]
    args: tuple[str, ...]
    says: str
    body: str
    fn: Callable
    inputs: Callable
    ks: tuple[int, ...] | None = None


def _ints(lo: int, hi: int):
    return lambda rng, k: rng.randint(lo, hi)


def _lists(lo: int, hi: int):
    return lambda rng, k: [rng.randint(lo, hi) for _ in range(rng.randint(1, 6))]


def _lists_with_k(rng, k):
    """Lists of small numbers that hold k some of the time (zero, one or more times)."""
    xs = [rng.randint(0, 9) for _ in range(rng.randint(2, 6))]
    for _ in range(rng.randint(0, 2)):
        xs[rng.randrange(len(xs))] = k
    return xs


def _longer_than_k(rng, k):
    return [rng.randint(0, 20) for _ in range(rng.randint(k + 1, k + 4))]


def _words(rng, k):
    return rng.choice(WORDS)


def _sentences(rng, k):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 5)))


FAMILIES = (
    Family("plus", ("add_{k}",), ("x",), "returns {a} plus {k}", "return {a} + {k}",
           lambda k: lambda x: x + k, _ints(-20, 50), tuple(range(1, 21))),
    Family("minus", ("subtract_{k}",), ("x",), "returns {a} minus {k}", "return {a} - {k}",
           lambda k: lambda x: x - k, _ints(-20, 50), tuple(range(1, 21))),
    Family("times", ("times_{k}",), ("x",), "returns {a} times {k}", "return {a} * {k}",
           lambda k: lambda x: x * k, _ints(-20, 50), tuple(range(2, 13))),
    Family("remainder", ("mod_{k}",), ("x",), "returns the remainder of {a} divided by {k}", "return {a} % {k}",
           lambda k: lambda x: x % k, _ints(0, 100), tuple(range(2, 13))),
    Family("power", ("power_{k}",), ("x",), "returns {a} raised to the power {k}", "return {a} ** {k}",
           lambda k: lambda x: x ** k, _ints(-9, 9), tuple(range(2, 7))),
    Family("multiple", ("is_multiple_of_{k}",), ("n",), "returns True if {a} is a multiple of {k}, else False",
           "return {a} % {k} == 0", lambda k: lambda x: x % k == 0, lambda rng, k: k * rng.randint(0, 9)
           + rng.choice((0, 0, 1, k - 1)), tuple(range(2, 13))),
    Family("greater", ("is_greater_than_{k}",), ("x",), "returns True if {a} is greater than {k}, else False",
           "return {a} > {k}", lambda k: lambda x: x > k, lambda rng, k: k + rng.randint(-5, 5), tuple(range(0, 21))),
    Family("count", ("count_{k}",), ("items",), "returns how many times {k} appears in the list {a}",
           "return {a}.count({k})", lambda k: lambda xs: xs.count(k), _lists_with_k, tuple(range(0, 10))),
    Family("add_each", ("add_{k}_to_each",), ("nums",), "returns a new list with {k} added to each number in {a}",
           "return [x + {k} for x in {a}]", lambda k: lambda xs: [x + k for x in xs], _lists(-9, 20),
           tuple(range(1, 11))),
    Family("first", ("first_{k}",), ("items",), "returns a list of the first {k} elements of the list {a}",
           "return {a}[:{k}]", lambda k: lambda xs: xs[:k], _longer_than_k, tuple(range(1, 6))),
    Family("remove", ("remove_{k}",), ("nums",), "returns the list {a} without the numbers equal to {k}",
           "return [x for x in {a} if x != {k}]", lambda k: lambda xs: [x for x in xs if x != k], _lists_with_k,
           tuple(range(0, 10))),
    Family("repeat", ("repeat_{k}",), ("s",), "returns the string {a} repeated {k} times", "return {a} * {k}",
           lambda k: lambda s: s * k, _words, tuple(range(2, 6))),
    Family("sum", ("total", "sum_list", "list_sum", "add_all"), ("nums", "numbers", "values"),
           "returns the sum of the numbers in the list {a}", "return sum({a})", lambda k: sum, _lists(-20, 50)),
    Family("largest", ("largest", "max_value", "biggest", "maximum"), ("nums", "numbers", "values"),
           "returns the largest number in the list {a}", "return max({a})", lambda k: max, _lists(-20, 50)),
    Family("smallest", ("smallest", "min_value", "lowest", "minimum"), ("nums", "numbers", "values"),
           "returns the smallest number in the list {a}", "return min({a})", lambda k: min, _lists(-20, 50)),
    Family("last", ("last", "last_item", "last_element", "get_last"), ("items", "values", "xs"),
           "returns the last element of the list {a}", "return {a}[-1]", lambda k: lambda xs: xs[-1],
           _lists(0, 50)),
    Family("evens", ("count_evens", "num_evens", "even_count"), ("nums", "numbers", "values"),
           "returns how many even numbers there are in the list {a}", "return sum(1 for x in {a} if x % 2 == 0)",
           lambda k: lambda xs: sum(1 for x in xs if x % 2 == 0), _lists(0, 50)),
    Family("reverse", ("reverse", "reverse_string", "backwards", "flip"), ("s", "text", "word"),
           "returns the string {a} reversed", "return {a}[::-1]", lambda k: lambda s: s[::-1], _words),
    Family("upper", ("upper", "to_upper", "shout"), ("s", "text", "word"), "returns the string {a} in upper case",
           "return {a}.upper()", lambda k: str.upper, _words),
    Family("vowels", ("count_vowels", "vowel_count", "num_vowels"), ("s", "text", "word"),
           "returns the number of vowels (a, e, i, o, u) in the string {a}",
           "return sum(1 for c in {a} if c in 'aeiou')", lambda k: lambda s: sum(1 for c in s if c in "aeiou"),
           _words),
    Family("palindrome", ("is_palindrome", "reads_same_backwards"), ("s", "text", "word"),
           "returns True if the string {a} reads the same backwards, else False", "return {a} == {a}[::-1]",
           lambda k: lambda s: s == s[::-1], _words),
    Family("words", ("count_words", "word_count", "num_words"), ("s", "text", "sentence"),
           "returns the number of words in the string {a} (words are separated by spaces)",
           "return len({a}.split())", lambda k: lambda s: len(s.split()), _sentences),
)
TESTS_PER_PROBLEM = 3


def _problems(family: Family):
    """(function name, argument name, k) of every problem of `family`."""
    if family.ks is not None:
        return [(family.names[0].format(k=k), family.args[0], k) for k in family.ks]
    return [(name, arg, None) for name in family.names for arg in family.args]


def _example(family: Family, name: str, arg: str, k: int | None) -> Example:
    says = family.says.format(k=k, a=arg)
    prompt = f"Write a Python function `{name}({arg})` that {says}."
    rng = random.Random(int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "big"))
    fn = family.fn(k)
    inputs: list = []
    for _ in range(50):  # distinct inputs where the family has enough of them
        x = family.inputs(rng, k)
        if x not in inputs:
            inputs.append(x)
        if len(inputs) == TESTS_PER_PROBLEM:
            break
    tests = [f"assert {name}({x!r}) == {fn(x)!r}" for x in inputs]
    reference = f"def {name}({arg}):\n    {family.body.format(k=k, a=arg)}\n"
    return Example(prompt, reference, {"task": "functions", "kind": family.kind, "tests": tests})


def function_examples() -> list[Example]:
    """Every problem of every family, with its tests and reference solution."""
    return [_example(f, name, arg, k) for f in FAMILIES for name, arg, k in _problems(f)]

