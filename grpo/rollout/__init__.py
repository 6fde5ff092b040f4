"""Rollout backends: sample G completions per prompt."""
from grpo.rollout.base import Generator, Rollout, Sampling
from grpo.rollout.hf import HFGenerator, sample_next

__all__ = ["Generator", "HFGenerator", "Rollout", "Sampling", "sample_next"]
