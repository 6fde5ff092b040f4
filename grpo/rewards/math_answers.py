"""Rewards for math word problems: answer correctness (`math_reward`), R1-style format (`format_reward`) and
DAPO's soft overlong punishment (`make_overlong_penalty`, default instance `overlong`).

All follow the package convention `(prompts, completions, **example_fields) -> list[float]` and never raise
on odd input: an answer that cannot be found or parsed scores 0.0.

Answer extraction (see `extract_answer`), first hit wins:

1. the last complete ``\\boxed{...}`` (or ``\\fbox{...}``, nested braces allowed);
2. the last ``<answer>...</answer>`` block;
3. the last GSM8K-style ``#### ...`` line;
4. otherwise the free text, in which `math_verify` picks the final answer: a "final answer is ..." anchor
   if any, else the last number or LaTeX expression.

All four look only at the text after ``</think>`` when the completion has one and that text is not blank
(an answer after the reasoning overrides anything boxed inside it); otherwise at the whole completion.

Reference answers: GSM8K (``"...\\n#### 1,080"``: what follows the last ``####``), MATH (the last
``\\boxed{...}``), or plain (``"72"``, ``"3/4"``, ``"\\frac{3}{4}"``, ``"\\text{Evelyn}"``).

Equivalence is `math_verify.verify` (symbolic and numeric, 6 decimal places), after light normalisation:
thousands separators (``1,000`` = ``1000``), currency symbols (``$18`` = ``\\$18`` = ``18``), unit words
after a number (``18 dollars`` = ``18``, ``3.5 hours`` = ``3.5``, ``12 cm^2`` = ``12``), ``\\dfrac`` and
``\\tfrac``, a final full stop. Text answers also match by normalised string (``\\text{Evelyn}`` = ``Evelyn``).

Percentages follow math_verify: a *predicted* ``18%`` matches a reference of ``18`` or ``0.18``; a predicted
``0.18`` does not match a reference of ``18`` (nor the reverse). Decimals must agree to 6 places against an
exact reference (``1/3`` = ``0.333333``, not ``0.33``).

Time limit: each completion gets `MATH_TIMEOUT_S` seconds of wall clock for parsing and comparison (sympy
can hang on input such as ``9^{9^{9^{9^9}}}``); past it the completion scores 0.0. The limit uses SIGALRM,
so it applies only when called from the main thread and no other interval timer is running; elsewhere the
reward runs without a limit.
"""
from __future__ import annotations

import logging
import re
import signal
import threading
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

from grpo.errors import ConfigError

MATH_TIMEOUT_S = 2.0
"""Wall-clock seconds allowed to score one completion (parse both answers and compare)."""

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------------
# extraction

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*(\{)?")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_HASHES = re.compile(r"####[ \t]*([^\n]*)")


def _braced(text: str, start: int) -> str | None:
    """The contents of the brace group opening at `text[start] == '{'`, or None if it never closes."""
    depth = 0
    for i in range(start, len(text)):
        ch = text[i]
        if ch == "{" and (i == 0 or text[i - 1] != "\\"):  # an escaped \{ does not count
            depth += 1
        elif ch == "}" and (i == 0 or text[i - 1] != "\\"):
            depth -= 1
            if depth == 0:
                return text[start + 1:i]
    return None


def last_boxed(text: str) -> str | None:
    """The contents of the last complete ``\\boxed{...}`` / ``\\fbox{...}`` (or ``\\boxed 5``), else None."""
    for m in reversed(list(_BOXED.finditer(text))):
        if m.group(1):
            inner = _braced(text, m.start(1))
        else:  # "\boxed 5": up to the next whitespace or $
            inner = re.match(r"[^\s$]*", text[m.end():]).group(0) or None
        if inner is not None and inner.strip():
            return inner.strip()
    return None


def extract_answer(completion: str) -> tuple[str, str] | None:
    """The final answer of a completion and its kind: ``("expr", "72")`` for a boxed or ``####`` answer (a
    single expression), ``("text", "...")`` for an answer block or free text (math_verify finds the answer
    in it). None when the completion is empty.

    Only the part after ``</think>`` is searched when there is one and it is not blank: an answer given
    after the reasoning overrides anything boxed inside it."""
    if not isinstance(completion, str) or not completion.strip():
        return None
    region = completion.rsplit("</think>", 1)[-1]
    if not region.strip():
        region = completion
    boxed = last_boxed(region)
    if boxed is not None:
        return "expr", boxed
    tags = [t.strip() for t in _ANSWER_TAG.findall(region)]
    if tags and tags[-1]:
        return "text", tags[-1]
    hashes = [h.strip() for h in _HASHES.findall(region)]
    if hashes and hashes[-1]:
        return "expr", hashes[-1]
    return "text", region


def reference_answer(answer: Any) -> str | None:
    """The final answer in a reference: after the last ``####`` (GSM8K), the last ``\\boxed{}`` (MATH), or
    the whole text (plain)."""
    if answer is None:
        return None
    text = str(answer).strip()
    if "####" in text:
        text = text.rsplit("####", 1)[1].strip().split("\n", 1)[0].strip()
    else:
        boxed = last_boxed(text)
        if boxed is not None:
            text = boxed
    return text or None


# --------------------------------------------------------------------------------------------------------
# normalisation

_CURRENCY = r"(?:\\\$|\$|€|£|¥|₹|\\euro|\\pounds)"
_NUM = r"(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
_UNIT = r"[A-Za-z][A-Za-z'.\-]+(?:\^\{?\d\}?)?"  # a unit word: "dollars", "cm^2", "km/h" in parts
# "-$1,250.50", "$18", "18 dollars", "3.5 hours per day", "25%", "25 percent", "3/4 cup"
_NUMBER_WITH_UNITS = re.compile(
    rf"^(?P<sign>[-−]?)\s*{_CURRENCY}?\s*(?P<sign2>[-−]?)\s*(?P<num>{_NUM}(?:\s*/\s*\d+)?)"
    rf"\s*(?P<pct>\\?%|percent\b)?(?:\s+{_UNIT}(?:[\s/]+{_UNIT})*)?\s*\.?$")
_THOUSANDS = re.compile(r"(?<![\d.])(\d{1,3}(?:,\d{3})+)(?![\d,])")


def _normalise_expr(s: str) -> str:
    """Light clean-up of one answer expression before math_verify parses it."""
    s = s.strip()
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if len(s) > len(left) + len(right) and s.startswith(left) and s.endswith(right):
            s = s[len(left):-len(right)].strip()
            break
    s = s.replace("{,}", "").replace("\\!", "")
    s = re.sub(r"(?<=\d)\\,(?=\d{3})", "", s)
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = s.replace("−", "-").removesuffix(".").rstrip()
    m = _NUMBER_WITH_UNITS.match(s)
    if m:
        sign = "-" if (m.group("sign") or m.group("sign2")) else ""
        num = m.group("num").replace(",", "").replace(" ", "")
        s = sign + num + ("\\%" if m.group("pct") else "")
    return s


def _normalise_text(s: str) -> str:
    """Clean-up of free text (an answer block, the end of a completion) before math_verify searches it."""
    s = s.replace("\\$", " ").replace("{,}", "").replace("−", "-")
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = re.sub(r"(?<=\d)\\,(?=\d{3})", "", s)
    return _THOUSANDS.sub(lambda m: m.group(1).replace(",", ""), s)


def _plain_string(s: str) -> str:
    """A string key for text answers: no \\text{} wrappers, $, spaces, braces or case."""
    s = re.sub(r"\\(?:text|textbf|mathrm|mathbf|textit|mbox)\s*\{([^{}]*)\}", r"\1", s)
    s = re.sub(r"[\s${}]|\\[,;:! ]", "", s)
    return s.removesuffix(".").lower()


# --------------------------------------------------------------------------------------------------------
# parsing and comparison (math_verify)

_math_verify = None


def _mv():
    """Import math_verify once, with its own (whole-second, SIGALRM) timeouts off: ours covers the whole
    completion, and two users of one interval timer would cancel each other."""
    global _math_verify
    if _math_verify is None:
        try:
            import math_verify
            import math_verify.grader
            import math_verify.parser
        except ImportError as e:
            raise ImportError(f"the math reward needs math-verify ({e}): "
                              "pip install 'math-verify[antlr4_13_2]==0.9.0'") from e
        # We pass timeouts of None on purpose; silence the one-off warning that says so.
        math_verify.parser.TIMEOUT_WARNING_SHOWN = True
        math_verify.grader.TIMEOUT_WARNING_SHOWN = True
        latex = math_verify.LatexExtractionConfig(boxed_match_priority=0)
        expr = math_verify.ExprExtractionConfig()
        _math_verify = (math_verify, (latex, expr))
    return _math_verify


def _parse(text: str) -> list:
    mv, configs = _mv()
    return mv.parse(text, extraction_config=configs, parsing_timeout=None)


@lru_cache(maxsize=8192)
def _parse_expr(s: str) -> tuple:
    """Parsed forms of a single answer expression (sympy objects, then its string)."""
    s = _normalise_expr(s)
    if not s:
        return ()
    parsed = _parse(f"${s}$")
    if not any(not isinstance(p, str) for p in parsed):
        parsed = _parse(s) or parsed
    return tuple(parsed)


@lru_cache(maxsize=1024)
def _parse_text(s: str) -> tuple:
    """Parsed forms of the answer math_verify finds in free text; a short text is tried as one expression."""
    parsed = _parse(_normalise_text(s))
    if not any(not isinstance(p, str) for p in parsed) and len(s) <= 200:
        parsed = list(_parse_expr(s)) or parsed
    return tuple(parsed)


def _equivalent(reference: str, kind: str, predicted: str) -> bool:
    mv, _ = _mv()
    gold = _parse_expr(reference)
    pred = _parse_expr(predicted) if kind == "expr" else _parse_text(predicted)
    if gold and pred and mv.verify(list(gold), list(pred), timeout_seconds=None):
        return True
    if kind == "expr" and re.search(r"[A-Za-z]{2,}\s", predicted):  # prose in a box: "\boxed{it is 5}"
        pred = _parse_text(predicted)
        if gold and pred and mv.verify(list(gold), list(pred), timeout_seconds=None):
            return True
    # Text answers ("\text{Evelyn}" vs "Evelyn"): compare plain strings.
    candidate = predicted if kind == "expr" else predicted.strip()
    ref_key = _plain_string(reference)
    return bool(ref_key) and ref_key == _plain_string(candidate)


class _Timeout(BaseException):
    """Raised by our SIGALRM handler; a BaseException so that library `except Exception` blocks let it by."""


def _call_with_time_limit(fn: Callable[[], bool], seconds: float | None) -> bool:
    """`fn()`, interrupted after `seconds` of wall clock (raising `_Timeout`) when a timer can be used."""
    if (not seconds or seconds <= 0 or threading.current_thread() is not threading.main_thread()
            or signal.getitimer(signal.ITIMER_REAL)[0] > 0):
        return fn()
    armed = [True]

    def on_alarm(signum, frame):
        if armed[0]:
            raise _Timeout

    previous = signal.signal(signal.SIGALRM, on_alarm)
    try:
        # Re-fire every 50 ms in case library code swallows the first interruption.
        signal.setitimer(signal.ITIMER_REAL, seconds, 0.05)
        return fn()
    finally:
        while True:  # disarm first: an alarm landing here must not escape the clean-up
            try:
                armed[0] = False
                break
            except _Timeout:
                continue
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous if previous is not None else signal.SIG_DFL)


def _score_one(completion: Any, reference: Any) -> float:
    try:
        ref = reference_answer(reference)
        found = extract_answer(completion) if ref is not None else None
        if found is None:
            return 0.0
        kind, predicted = found
        ok = _call_with_time_limit(lambda: _equivalent(ref, kind, predicted), MATH_TIMEOUT_S)
        return 1.0 if ok else 0.0
    except _Timeout:
        log.debug("math_reward: timed out on completion %.200r", completion)
        return 0.0
    except Exception:  # never let a malformed completion stop training
        log.debug("math_reward: failed on completion %.200r", completion, exc_info=True)
        return 0.0


def math_reward(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[Any], **_) -> list[float]:
    """1.0 when the completion's final answer is mathematically equivalent to the reference, else 0.0.

    Examples (completion, reference → reward): ``"so \\boxed{\\dfrac{3}{4}}"``, ``"3/4"`` → 1.0;
    ``"<answer>0.75</answer>"``, ``"\\frac34"`` → 1.0; ``"The answer is $1,000."``, ``"...\\n#### 1000"`` → 1.0;
    ``"18 dollars"``, ``"#### 18"`` → 1.0; ``"-5"``, ``"5"`` → 0.0; ``""``, ``"5"`` → 0.0.
    """
    _mv()  # outside the per-completion guard: a missing math-verify must fail loudly, not score 0
    return [_score_one(c, a) for c, a in zip(completions, answer, strict=True)]


# --------------------------------------------------------------------------------------------------------
# format

_THINK_ANSWER = re.compile(
    r"\s*(?P<open><think>)?(?P<think>.*)</think>\s*<answer>(?P<answer>.*)</answer>\s*", re.DOTALL)


def _prompt_opens_think(prompt: Any) -> bool:
    if isinstance(prompt, list) and prompt and isinstance(prompt[-1], dict):  # chat messages
        prompt = prompt[-1].get("content", "")
    return isinstance(prompt, str) and prompt.rstrip().endswith("<think>")


def _well_formed(prompt: Any, completion: Any) -> bool:
    if not isinstance(completion, str):
        return False
    counts = [completion.count(t) for t in ("<think>", "</think>", "<answer>", "</answer>")]
    if counts[0] > 1 or counts[1:] != [1, 1, 1]:  # each tag once (checked first: keeps the match linear)
        return False
    m = _THINK_ANSWER.fullmatch(completion)
    if m is None or not m.group("answer").strip():
        return False
    return m.group("open") is not None or (counts[0] == 0 and _prompt_opens_think(prompt))


def format_reward(prompts: Sequence[Any], completions: Sequence[str], **_) -> list[float]:
    """1.0 when the completion is ``<think>…</think>`` then ``<answer>…</answer>`` and nothing else, else 0.0.

    Whitespace around and between the blocks is free; the answer must not be empty; each tag appears once.
    When the prompt itself ends with ``<think>`` (chat templates that open the thinking block for the
    model, e.g. DeepSeek-R1 distills and Qwen3), the completion may start inside the block, without its
    own ``<think>``. Example: ``"<think>2+2 is 4</think>\\n<answer>4</answer>"`` → 1.0;
    ``"<answer>4</answer>"`` → 0.0.
    """
    prompts = list(prompts) if prompts is not None else []
    if len(prompts) != len(completions):
        prompts = [None] * len(completions)
    return [1.0 if _well_formed(p, c) else 0.0 for p, c in zip(prompts, completions)]


# --------------------------------------------------------------------------------------------------------
# overlong

def make_overlong_penalty(max_length: int, cache_length: int, length_fn: Callable[[str], int] = len, *,
                          generated_tokens: bool = False) -> Callable[..., list[float]]:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13) as a reward named ``overlong``.

    With L = `length_fn(completion)`, L_max = `max_length` and L_cache = `cache_length`:
    0 when L <= L_max - L_cache; ((L_max - L_cache) - L) / L_cache when L_max - L_cache < L <= L_max (from 0
    down to -1); -1 when L > L_max. Example: L_max=100, L_cache=20: L=80 → 0, L=90 → -0.5, L=100 → -1,
    L=101 → -1. `cache_length=0` is a hard cut: 0 up to L_max, -1 beyond.

    `length_fn` counts characters by default; pass a token counter (and L_max = the generation budget in
    tokens) to follow the paper, e.g. ``lambda t: len(tokenizer(t, add_special_tokens=False).input_ids)``.
    `generated_tokens=True` counts the tokens the model generated instead (the `completion_ids` the trainer
    passes, EOS included; `length_fn` only where they are not given), which a re-encoding of the decoded
    text need not equal.
    """
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length <= 0:
        raise ConfigError(f"overlong penalty: max_length must be a positive integer, got {max_length!r}")
    if (isinstance(cache_length, bool) or not isinstance(cache_length, int)
            or not 0 <= cache_length <= max_length):
        raise ConfigError(f"overlong penalty: cache_length must be an integer in [0, max_length={max_length}], "
                          f"got {cache_length!r}")
    start = max_length - cache_length

    def penalty(length: int) -> float:
        if length <= start:
            return 0.0
        if length > max_length or cache_length == 0:
            return -1.0
        return (start - length) / cache_length

    def overlong(prompts: Sequence[Any], completions: Sequence[str], completion_ids=None, **_) -> list[float]:
        if generated_tokens and completion_ids is not None:
            return [penalty(len(ids)) for ids in completion_ids]
        return [penalty(length_fn(c if isinstance(c, str) else "")) for c in completions]

    overlong.__doc__ = (f"DAPO soft overlong punishment: 0 up to {start}, linear to -1 at {max_length}, "
                        f"-1 beyond (lengths by {getattr(length_fn, '__name__', 'length_fn')}).")
    overlong.max_length, overlong.cache_length, overlong.length_fn = max_length, cache_length, length_fn
    return overlong


OVERLONG_MAX_LENGTH = 4096
OVERLONG_CACHE_LENGTH = 1024
overlong = make_overlong_penalty(OVERLONG_MAX_LENGTH, OVERLONG_CACHE_LENGTH)
"""Default instance: lengths in characters, no penalty up to 3072, -1 beyond 4096 (about 1024 tokens)."""
