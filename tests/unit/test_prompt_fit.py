"""Prompts that do not fit the context are refused (count and longest) or cut from the left; prompts with no
tokens are refused; characters the tokenizer drops are warned about."""
import warnings

import pytest

from grpo.data import fit_prompts
from grpo.errors import DataError
from grpo.tasks import Example
from grpo.tiny import build_char_tokenizer

TOK = build_char_tokenizer()


def fit(prompts, limit=20, truncate="off", render=lambda t: t):
    return fit_prompts([Example(p, "1") for p in prompts], render, TOK, add_special_tokens=True, limit=limit,
                       truncate=truncate, what="training", why="context 52 minus max_new_tokens 32")


def test_prompts_that_fit_are_kept_as_they_are():
    prompts = ["Calculate 1 + 1 =", "x" * 20]
    assert [e.prompt for e in fit(prompts)] == prompts


def test_too_long_prompts_are_refused_with_the_count_and_the_longest():
    with pytest.raises(DataError, match=r"^2 of 3 training prompts have more than 20 tokens \(context 52 minus "
                                        r"max_new_tokens 32\); the longest has 30: 'b{30}'\.\.\. Shorten them"):
        fit(["a" * 25, "b" * 30, "ok"])


def test_left_truncation_keeps_the_end_and_the_template():
    render = lambda t: f"<<{t}>>"  # noqa: E731 - 4 tokens of template around the prompt
    with pytest.warns(UserWarning, match="1 of 2 training prompts were cut from the left to 20 tokens"):
        out = fit(["Q: " + "1 + " * 10 + "2 =", "short"], truncate="left", render=render)
    assert out[0].prompt == ("1 + " * 10 + "2 =")[-16:] and len(render(out[0].prompt)) == 20
    assert out[1].prompt == "short" and out[0].answer == "1"


def test_prompts_without_tokens_are_refused():
    with pytest.raises(DataError, match=r"^1 training prompt tokenizes to nothing \(e.g. '€€'\)"):
        fit(["fine", "€€"])
    with pytest.raises(DataError, match=r"^2 training prompts tokenize to nothing \(e.g. ''\)"):
        fit(["", ""])


def test_dropped_characters_are_warned_about_once():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fit(["Calculé 2 + 2 =", "é 1 =", "fine"])
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "drops them: 'é', in 2 of 3 prompts (e.g. 'Calculé 2 + 2 =')" in messages[0]
    assert out[0].prompt == "Calculé 2 + 2 ="  # the text is kept; the model sees it without the character


def test_conversations_are_measured_rendered_and_never_cut():
    def render(messages):  # a chat template: "role:content|" per message, then the generation prompt
        return "".join(f"{m['role']}:{m['content']}|" for m in messages) + "a:"
    short = [{"role": "user", "content": "1 + 1 ="}]                                   # 15 tokens rendered
    long = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1 + 1 ="}]   # 32
    examples = [Example("1 + 1 =", "2", conversation=c) for c in (short, long)]
    assert fit_prompts(examples[:1], render, TOK, add_special_tokens=False, limit=20, truncate="left",
                       what="training", why="w") == examples[:1]
    with pytest.raises(DataError, match=r"^1 of 2 training prompts \(conversations\) have more than 20 tokens once "
                                        r"rendered through the chat template \(w\); the longest has 32, .* "
                                        r"\(data.truncate_prompts cuts text prompts only\)"):
        fit_prompts(examples, render, TOK, add_special_tokens=False, limit=20, truncate="left", what="training",
                    why="w")
