"""The optimiser and its learning-rate schedule (`optim.*`, with the peak `train.lr`)."""
from __future__ import annotations

import torch

# our names -> transformers' scheduler names (each warms up linearly from 0 over optim.warmup_steps)
SCHEDULES = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}


def build_optimizer(params, cfg, lr: float, steps: int):
    """AdamW over `params` and transformers' scheduler of `cfg` (`grpo.config.OptimConfig`), decaying over
    `steps` optimiser steps. The scheduler is a LambdaLR of the step count, so a checkpoint's state resumes it
    exactly."""
    from transformers import get_scheduler

    # the fused kernel: one pass per parameter instead of a dozen small ops (FSDP2's DTensors included)
    optimizer = torch.optim.AdamW(list(params), lr=lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                  weight_decay=cfg.weight_decay, fused=True)
    scheduler = get_scheduler(SCHEDULES[cfg.lr_schedule], optimizer, num_warmup_steps=cfg.warmup_steps,
                              num_training_steps=steps)
    return optimizer, scheduler
