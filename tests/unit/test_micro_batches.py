"""Micro-batches: consecutive rows, capped in rows and in positions, trimmed to their own longest lengths."""
import torch

from grpo.learn import micro_batches


def rollout(prompt_lens, completion_lens, lp=6, t=8):
    """(prompt mask, completion mask) of rows with these lengths."""
    pm = torch.tensor([[0] * (lp - p) + [1] * p for p in prompt_lens])
    cm = torch.tensor([[1] * c + [0] * (t - c) for c in completion_lens])
    return pm, cm


def batches(r, rows, tokens):
    return [(s.start, s.stop, p.start, c.stop) for s, p, c in micro_batches(*r, rows, tokens)]


def test_rows_cap_and_trimming():
    r = rollout([2, 3, 3, 1, 6], [1, 4, 2, 8, 3])
    # (first row, end row, first prompt column, completion width)
    assert batches(r, 2, 0) == [(0, 2, 3, 4), (2, 4, 3, 8), (4, 5, 0, 3)]
    assert batches(r, 64, 0) == [(0, 5, 0, 8)]


def test_token_budget_counts_rows_times_trimmed_width():
    r = rollout([2, 3, 3, 1, 6], [1, 4, 2, 8, 3])
    # widths: rows 0-1 -> 3+4=7 (14 positions), adding row 2 -> 3 x 7 = 21
    assert batches(r, 64, 21) == [(0, 3, 3, 4), (3, 4, 5, 8), (4, 5, 0, 3)]
    assert batches(r, 64, 20) == [(0, 2, 3, 4), (2, 3, 3, 2), (3, 4, 5, 8), (4, 5, 0, 3)]
    # a row longer than the budget is a micro-batch of its own; the rows cap still applies
    assert batches(r, 64, 1) == [(i, i + 1, 6 - p, c) for i, (p, c) in enumerate(zip([2, 3, 3, 1, 6], [1, 4, 2, 8, 3]))]
    assert batches(r, 1, 1000) == batches(r, 64, 1)


def test_empty_prompt_and_completion_keep_one_column():
    r = rollout([0, 0], [0, 0])
    assert batches(r, 64, 0) == [(0, 2, 5, 1)]
