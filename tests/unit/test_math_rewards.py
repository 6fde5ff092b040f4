"""Math rewards: answer equivalence (math-verify), R1 format, DAPO's soft overlong punishment."""
import importlib
import signal
import sys
import threading
import time

import pytest

from grpo.errors import ConfigError
from grpo.rewards.math_answers import (extract_answer, format_reward, make_overlong_penalty, math_reward, overlong,
                               reference_answer)

# Not `from grpo.rewards import math`: that can be the standard library's math, imported by the package.
math_rewards = importlib.import_module("grpo.rewards.math_answers")

GSM8K_72 = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
            "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72")
GSM8K_1080 = "She pays 12 * 90 = $<<12*90=1080>>1,080 in total.\n#### 1,080"
MATH_HALF_PI = "The angle is a right angle halved, so it is $\\boxed{\\frac{\\pi}{2}}$."

MATH_CASES = [
    # --- GSM8K references (#### N), plain-number completions
    ("The answer is 72.", GSM8K_72, 1.0),
    ("#### 72", GSM8K_72, 1.0),
    ("So she sold 72 clips", GSM8K_72, 1.0),
    ("The answer is 71.", GSM8K_72, 0.0),
    ("48 + 24 = 72, so \\boxed{72}", GSM8K_72, 1.0),
    ("First 24, then 48 + 24 = 72. The answer is 24.", GSM8K_72, 0.0),   # the final answer counts
    # --- preference: boxed, then <answer>, then ####, then the last number
    ("\\boxed{72} although <answer>71</answer>", "72", 1.0),
    ("<answer>72</answer>\n#### 71", "72", 1.0),
    ("#### 72\nI also computed 71 earlier", "72", 1.0),
    ("<think>maybe 71</think><answer>72</answer>", "72", 1.0),
    ("<think>it is 72</think>\nThe answer is 71", "72", 0.0),             # after </think> only
    ("<answer>The answer is 72.</answer>", "72", 1.0),
    ("#### The answer is 72", "72", 1.0),
    ("\\boxed{The answer is 72}", "72", 1.0),
    ("<think>\\boxed{71}</think><answer>72</answer>", "72", 1.0),       # after </think> overrides inside
    ("<think>\\boxed{72}</think> So it is 71.", "72", 0.0),
    ("<think>so \\boxed{72}</think>\n", "72", 1.0),                   # nothing after: search everything
    # --- thousands separators
    ("\\boxed{1,080}", GSM8K_1080, 1.0),
    ("The total is 1080.", GSM8K_1080, 1.0),
    ("<answer>1,000,000</answer>", "1000000", 1.0),
    ("\\boxed{1{,}000}", "1000", 1.0),
    ("<answer>1,250.50</answer>", "1250.5", 1.0),
    ("\\boxed{1,000}", "100", 0.0),
    # --- units and currency
    ("<answer>$18</answer>", "#### 18", 1.0),
    ("She makes \\$18 every day.", "#### 18", 1.0),
    ("\\boxed{\\$18}", "18", 1.0),
    ("<answer>18 dollars</answer>", "#### 18", 1.0),
    ("\\boxed{3.5 \\text{ hours}}", "3.5", 1.0),
    ("<answer>3.5 hours</answer>", "3.5", 1.0),
    ("\\boxed{12 cm^2}", "12", 1.0),
    ("<answer>$19</answer>", "#### 18", 0.0),
    # --- percentages (math-verify: a predicted 18% matches 18 and 0.18; a bare 0.18 does not match 18)
    ("<answer>18%</answer>", "#### 18", 1.0),
    ("\\boxed{18\\%}", "0.18", 1.0),
    ("\\boxed{0.18}", "18", 0.0),
    ("\\boxed{18}", "0.18", 0.0),
    # --- fractions and decimals
    ("\\boxed{\\dfrac{3}{4}}", "3/4", 1.0),
    ("<answer>0.75</answer>", "\\frac{3}{4}", 1.0),
    ("The answer is 3/4.", "0.75", 1.0),
    ("The answer is $\\frac{3}{4}$.", "0.75", 1.0),
    ("\\boxed{\\tfrac{6}{8}}", "\\frac34", 1.0),
    ("\\boxed{0.333333}", "\\frac{1}{3}", 1.0),
    ("\\boxed{0.33}", "\\frac{1}{3}", 0.0),
    ("\\boxed{4/3}", "3/4", 0.0),
    # --- LaTeX
    ("\\boxed{2\\sqrt{3}}", "\\sqrt{12}", 1.0),
    ("\\boxed{\\pi/2}", MATH_HALF_PI, 1.0),
    ("\\boxed{\\frac{\\pi}{2}}", "\\boxed{\\frac{\\pi}{2}}", 1.0),
    ("\\boxed{\\pi}", MATH_HALF_PI, 0.0),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\sqrt{3}/2", 1.0),
    ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{\\sqrt{3}}{2}", 0.0),
    ("\\boxed{10^{3}}", "1000", 1.0),
    ("\\boxed{x = 5}", "5", 1.0),
    ("\\boxed{(1, 2)}", "(1,2)", 1.0),
    ("\\boxed{(2, 1)}", "(1,2)", 0.0),
    ("\\boxed{\\text{Evelyn}}", "\\text{Evelyn}", 1.0),
    ("<answer>Evelyn</answer>", "\\text{Evelyn}", 1.0),
    ("<answer>Bob</answer>", "\\text{Evelyn}", 0.0),
    ("\\boxed{ \\left( 3, \\frac{\\pi}{2} \\right) }", "\\left( 3, \\frac{\\pi}{2} \\right)", 1.0),
    # --- negative numbers
    ("<answer>-5</answer>", "#### -5", 1.0),
    ("The final answer is -12.", "-12", 1.0),
    ("\\boxed{-\\frac{1}{2}}", "-0.5", 1.0),
    ("<answer>-5</answer>", "#### 5", 0.0),
    ("\\boxed{5}", "-5", 0.0),
    # --- no answer, garbage, odd types
    ("", "5", 0.0),
    ("   \n ", "5", 0.0),
    ("I don't know.", "5", 0.0),
    ("}{\\boxed{", "5", 0.0),
    ("<answer></answer>", "5", 0.0),
    ("\\boxed{}", "5", 0.0),
    ("$$$$ \\frac{ ^^ __", "5", 0.0),
    (None, "5", 0.0),
    (12, "12", 0.0),
    ("\\boxed{5}", None, 0.0),
    ("\\boxed{5}", "", 0.0),
    ("\\boxed{5}", 5, 1.0),        # a numeric reference is read as text
]


@pytest.mark.parametrize("completion, reference, expected", MATH_CASES)
def test_math_reward(completion, reference, expected):
    assert math_reward(prompts=["p"], completions=[completion], answer=[reference]) == [expected]


def test_math_reward_table_is_large_and_balanced():
    assert len(MATH_CASES) >= 40
    assert sum(e == 1.0 for *_, e in MATH_CASES) >= 15 and sum(e == 0.0 for *_, e in MATH_CASES) >= 15


def test_math_reward_batch_and_extra_fields():
    out = math_reward(prompts=["a", "b", "c"], completions=["\\boxed{72}", "71", "<answer>3/4</answer>"],
                      answer=[GSM8K_72, "72", "0.75"], task=["x", "y", "z"], level=[1, 2, 3])
    assert out == [1.0, 0.0, 1.0]


@pytest.mark.parametrize("text, expected", [
    ("a \\boxed{1} b \\boxed{\\frac{2}{3}} c", ("expr", "\\frac{2}{3}")),
    ("\\boxed{\\{1, 2\\}}", ("expr", "\\{1, 2\\}")),
    ("\\boxed 5 apples", ("expr", "5")),
    ("\\fbox{7}", ("expr", "7")),
    ("\\boxed{3} then \\boxed{4", ("expr", "3")),          # an unclosed last box is skipped
    ("<answer> 42 </answer>", ("text", "42")),
    ("work\n#### 1,000\n", ("expr", "1,000")),
    ("<think>think</think> so 9", ("text", " so 9")),
    ("<think>\\boxed{1}</think><answer>2</answer>", ("text", "2")),
    ("<think>\\boxed{1}</think>", ("expr", "1")),
    ("just 9", ("text", "just 9")),
    ("", None),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize("reference, expected", [
    (GSM8K_72, "72"), (GSM8K_1080, "1,080"), (MATH_HALF_PI, "\\frac{\\pi}{2}"), ("  3/4 ", "3/4"),
    (7, "7"), (None, None), ("", None),
])
def test_reference_answer(reference, expected):
    assert reference_answer(reference) == expected


def test_math_reward_times_out_on_pathological_input(monkeypatch):
    monkeypatch.setattr(math_rewards, "MATH_TIMEOUT_S", 0.3)
    previous = signal.getsignal(signal.SIGALRM)
    start = time.monotonic()
    assert math_reward(["p"], ["\\boxed{9^{9^{9^{9^{9}}}}}"], ["5"]) == [0.0]  # sympy would run for ages
    assert time.monotonic() - start < 5
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)   # the timer is cleared
    assert signal.getsignal(signal.SIGALRM) is previous         # and the handler restored
    assert math_reward(["p"], ["\\boxed{72}"], ["72"]) == [1.0]


def test_math_reward_works_off_the_main_thread():
    out = []
    t = threading.Thread(target=lambda: out.append(math_reward(["p", "p"], ["\\boxed{0.5}", "2"], ["1/2", "3"])))
    t.start()
    t.join(30)
    assert out == [[1.0, 0.0]]


def test_math_reward_is_fast_on_ordinary_input():
    completions = [f"Step one. Step two gives {i} + 1 = {i + 1}. The answer is \\boxed{{{i + 1}}}."
                   for i in range(100)]
    start = time.monotonic()
    out = math_reward(["p"] * 100, completions, [f"x\n#### {i + 1}" for i in range(100)])
    assert out == [1.0] * 100 and time.monotonic() - start < 10


# ------------------------------------------------------------------------------------------------ format

@pytest.mark.parametrize("prompt, completion, expected", [
    ("Q", "<think>2+2 is 4</think><answer>4</answer>", 1.0),
    ("Q", "<think>\n2+2 is 4\n</think>\n<answer>\n4\n</answer>\n", 1.0),
    ("Q", "  <think>a</think>   \n\n <answer>4</answer>  ", 1.0),
    ("Q", "<think></think><answer>4</answer>", 1.0),                 # empty reasoning is allowed
    ("Q", "<think>a</think><answer> </answer>", 0.0),                # an empty answer is not
    ("Q", "<answer>4</answer>", 0.0),
    ("Q", "<think>a</think>", 0.0),
    ("Q", "<think>a</think>4", 0.0),
    ("Q", "<answer>4</answer><think>a</think>", 0.0),
    ("Q", "<think>a</think><answer>4</answer> and more text", 0.0),
    ("Q", "preamble <think>a</think><answer>4</answer>", 0.0),
    ("Q", "<think>a</think><answer>4</answer><answer>5</answer>", 0.0),
    ("Q", "<think>a<think>b</think><answer>4</answer>", 0.0),
    ("Q", "<think>a</think><answer>4", 0.0),                           # truncated
    ("Q", "2+2 is 4</think><answer>4</answer>", 0.0),                 # opening tag missing...
    ("Q <think>", "2+2 is 4</think><answer>4</answer>", 1.0),         # ...unless the prompt opened it
    ("Q\n<think>\n", "\n2+2 is 4\n</think>\n<answer>4</answer>", 1.0),
    ("Q <think>", "<think>2+2 is 4</think><answer>4</answer>", 1.0),  # repeating it is fine too
    ("Q <think>", "x <think>2+2</think><answer>4</answer>", 0.0),
    ("Q", "", 0.0),
    ("Q", None, 0.0),
])
def test_format_reward(prompt, completion, expected):
    assert format_reward(prompts=[prompt], completions=[completion]) == [expected]


def test_format_reward_batch_and_chat_prompts():
    chat = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "<think>\n"}]
    out = format_reward(prompts=["Q", chat], completions=["<think>a</think><answer>1</answer>",
                                                          "a</think><answer>1</answer>"], answer=["1", "1"])
    assert out == [1.0, 1.0]


# ---------------------------------------------------------------------------------------------- overlong

@pytest.mark.parametrize("length, expected", [
    (0, 0.0), (50, 0.0), (80, 0.0),            # up to L_max - L_cache: no penalty
    (81, -0.05), (90, -0.5), (95, -0.75),      # the soft zone, linear
    (100, -1.0), (101, -1.0), (10_000, -1.0),  # L_max and beyond
])
def test_overlong_penalty_dapo_eq13(length, expected):
    fn = make_overlong_penalty(max_length=100, cache_length=20)
    assert fn(prompts=["p"], completions=["x" * length]) == [pytest.approx(expected)]


def test_overlong_penalty_custom_length_and_name():
    fn = make_overlong_penalty(10, 4, length_fn=lambda text: len(text.split()))
    assert fn.__name__ == "overlong"
    words = [" ".join(["w"] * n) for n in (6, 7, 8, 10, 11)]
    assert fn(prompts=["p"] * 5, completions=words, answer=["a"] * 5) == [0.0, -0.25, -0.5, -1.0, -1.0]


def test_overlong_counts_the_generated_tokens_not_a_re_encoding():
    from grpo.rewards import build_rewards
    from grpo.tiny import build_char_tokenizer

    ((_, fn),) = build_rewards(["overlong"], tokenizer=build_char_tokenizer(), max_new_tokens=10, overlong_buffer=4)
    # "ab" decodes from 9 generated tokens (say, tokens that decode to nothing): 9 counts, not the 2 of a
    # re-encoding; without completion_ids (a direct call) it falls back to re-encoding the text
    assert fn(prompts=["p", "p"], completions=["ab", "abcdefghij"], completion_ids=[[5] * 9, [5] * 10]) == \
        [pytest.approx(-0.75), -1.0]
    assert fn(prompts=["p"], completions=["ab"]) == [0.0]


def test_overlong_penalty_hard_cut_and_bad_arguments():
    hard = make_overlong_penalty(5, 0)
    assert hard(prompts=None, completions=["12345", "123456", None]) == [0.0, -1.0, 0.0]
    for args in [(0, 0), (10, 11), (10, -1), (10.5, 2), ("10", 2), (True, 0)]:
        with pytest.raises(ConfigError, match="overlong penalty"):
            make_overlong_penalty(*args)


def test_default_overlong_instance():
    assert overlong.__name__ == "overlong"
    assert (overlong.max_length, overlong.cache_length) == (4096, 1024)
    assert overlong(prompts=["p"] * 3, completions=["x" * 3072, "x" * 3584, "x" * 5000]) == [0.0, -0.5, -1.0]


def test_missing_math_verify_fails_loudly(monkeypatch):
    monkeypatch.setattr(math_rewards, "_math_verify", None)
    monkeypatch.setitem(sys.modules, "math_verify", None)  # makes `import math_verify` fail
    with pytest.raises(ImportError, match=r"math reward needs math-verify"):
        math_reward(prompts=["p"], completions=["\\boxed{1}"], answer=["1"])
