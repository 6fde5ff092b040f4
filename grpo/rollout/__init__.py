"""Rollout backends: sample G completions per prompt."""
from grpo.rollout.base import EVAL, SAMPLE, TRAIN, Generator, Rollout, Sampling, rollout_sampling, sampling_seed
from grpo.rollout.hf import HFGenerator, sample_next

__all__ = ["EVAL", "SAMPLE", "TRAIN", "Generator", "HFGenerator", "Rollout", "Sampling", "rollout_sampling",
           "sample_next", "sampling_seed"]
