"""Reward functions for the integration tests, importable as `tests.integration.rewards:<name>` from a config
(the subprocess runs start in the repository root)."""
import asyncio


def starts_below_digits(prompts, completions, **_):
    """1.0 when the completion's first character comes before '0' (space, punctuation, control characters), else
    0.0 (0.5 when empty): on a random model some groups of 4 get equal rewards and some do not, which exercises
    dynamic sampling."""
    return [float(c[0] < "0") if c else 0.5 for c in completions]


def odd_length(prompts, completions, **_):
    """1.0 for a completion of an odd number of characters, else 0.0: groups of a real model's completions get
    rewards that differ, so a step has a policy gradient whatever the model knows."""
    return [float(len(c) % 2) for c in completions]


async def odd_length_async(prompts, completions, **_):
    """`odd_length` as an `async def` function (TRL's convention for rewards that wait on a server)."""
    await asyncio.sleep(0)
    return odd_length(prompts, completions)


def never_applies(prompts, completions, **_):
    """None for every completion: no step has a reward."""
    return [None] * len(completions)


def raises(prompts, completions, **_):
    """Always fails: a broken reward function."""
    return [1.0 / 0 for _ in completions]


def slow(prompts, completions, **_):
    """`odd_length` after 2 seconds' sleep, announced first by a line appended to the file $SLOW_REWARD_MARKER: a
    test knows when a step is in the middle of its scoring, and has seconds to interrupt it there."""
    import os
    import time
    with open(os.environ["SLOW_REWARD_MARKER"], "a") as f:
        f.write("scoring\n")
    time.sleep(2.0)
    return odd_length(prompts, completions)
