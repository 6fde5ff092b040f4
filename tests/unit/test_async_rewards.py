"""`async def` reward functions (TRL's convention): called like plain ones, once a batch, awaited; a batch's
asynchronous functions run concurrently, beside the plain ones; their errors and values are checked as a plain
function's are; evaluation and a training run take them too."""
import asyncio
import threading

import pytest
import torch

from grpo.errors import DataError
from grpo.rewards import exact_match, score
from grpo.rewards.calls import call, call_all, event_loop, is_async

FIELDS = {"answer": ["5", "5", "4"]}
PROMPTS, COMPLETIONS = ["p"] * 3, [" 5", " 6", " 4"]


async def exact_later(prompts, completions, answer, **_):
    await asyncio.sleep(0)
    return exact_match(prompts, completions, answer)


class Graded:
    """A callable object whose __call__ is asynchronous (as a judge client is)."""

    __name__ = "graded"

    async def __call__(self, prompts, completions, **_):
        await asyncio.sleep(0)
        return [float(len(c)) for c in completions]


def test_an_async_reward_scores_as_its_plain_twin():
    plain = score([exact_match, Graded()], [1.0, 0.5], PROMPTS, COMPLETIONS, FIELDS)
    both = score([("exact_match", exact_later), Graded()], [1.0, 0.5], PROMPTS, COMPLETIONS, FIELDS)
    assert torch.equal(plain.total, both.total) and plain.per_fn.keys() == both.per_fn.keys()
    assert both.per_fn["exact_match"].tolist() == [1.0, 0.0, 1.0] and both.per_fn["graded"].tolist() == [2.0] * 3
    assert is_async(exact_later) and is_async(Graded()) and not is_async(exact_match)


def test_a_batchs_async_rewards_run_concurrently_beside_the_plain_ones():
    # each waits for an event the other sets: awaited one after the other they would never finish
    a, b = asyncio.Event(), asyncio.Event()  # bound to the rewards' loop when first awaited (Python >= 3.10)
    plain_ran_in = []

    async def first(prompts, completions, **_):
        a.set()
        await asyncio.wait_for(b.wait(), 10)
        return [1.0] * len(completions)

    async def second(prompts, completions, **_):
        b.set()
        await asyncio.wait_for(a.wait(), 10)
        return [2.0] * len(completions)

    def plain(prompts, completions, **_):
        plain_ran_in.append(threading.current_thread().name)
        return [3.0] * len(completions)

    s = score([first, plain, second], None, PROMPTS, COMPLETIONS, FIELDS)
    assert s.total.tolist() == [6.0] * 3 and list(s.per_fn) == ["first", "plain", "second"]
    assert plain_ran_in == [threading.current_thread().name]  # the plain one in the caller's thread


def test_an_async_reward_that_raises_is_named_with_the_example():
    async def broken(prompts, completions, answer, **_):
        await asyncio.sleep(0)
        return [1.0 / int(a) for a in answer]

    with pytest.raises(DataError, match="reward function 'broken' raised ZeroDivisionError: float division by zero on "
                                        "prompt 'Calculate 0 =' with completion 'b'"):
        score([broken], None, ["Calculate 1 =", "Calculate 0 ="], ["a", "b"], {"answer": ["1", "0"]})


def test_an_async_reward_is_checked_as_a_plain_one():
    async def short(prompts, completions, **_):
        return [1.0]

    async def text(prompts, completions, **_):
        return ["1.0"] * len(completions)

    with pytest.raises(DataError, match="reward function 'short' returned 1 values for 3 completions"):
        score([short], None, PROMPTS, COMPLETIONS, FIELDS)
    with pytest.raises(DataError, match="reward function 'text' returned '1.0'"):
        score([text], None, PROMPTS, COMPLETIONS, FIELDS)


def test_a_plain_function_that_returns_an_awaitable_is_awaited():
    def deferred(prompts, completions, answer, **_):
        return exact_later(prompts, completions, answer)

    assert call(deferred, prompts=PROMPTS, completions=COMPLETIONS, **FIELDS) == [1.0, 0.0, 1.0]
    assert call_all([deferred], {"prompts": PROMPTS, "completions": COMPLETIONS, **FIELDS}) == [([1.0, 0.0, 1.0], None)]


def test_one_loop_for_the_process_from_any_thread():
    loops = []
    threads = [threading.Thread(target=lambda: loops.append(event_loop())) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(x) for x in loops}) == 1 and loops[0].is_running()


def test_evaluation_takes_an_async_reward():
    from grpo.evaluation import _correct
    from grpo.tasks.base import Example

    ok = _correct(exact_later, [Example("p", "5"), Example("q", "4")], [" 5", " 6"], 1)
    assert ok[:, 0].tolist() == [True, False]


def test_each_reward_gets_lists_of_its_own():
    def greedy(prompts, completions, **_):
        completions[:] = ["x"] * len(completions)  # a reward that edits its argument in place
        return [0.0] * len(completions)

    async def later(prompts, completions, **_):
        return [float(c == " 5") for c in completions]

    def plain(prompts, completions, **_):
        return [float(c == " 5") for c in completions]

    s = score([greedy, later, plain], None, PROMPTS, COMPLETIONS, FIELDS)
    assert s.per_fn["later"].tolist() == s.per_fn["plain"].tolist() == [1.0, 0.0, 0.0]
