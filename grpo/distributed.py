"""Process-group helpers: the only module that talks to torch.distributed.

With one process (the default) every helper is the identity, so the trainer has a single code path.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def sum(self, x: float) -> float:
        """Sum of a number over all processes."""
        if self.world_size == 1:
            return x
        import torch.distributed as td
        t = torch.tensor([x], dtype=torch.float64)
        td.all_reduce(t)
        return t.item()

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenation of an equally sized 1-D tensor from every process, in rank order."""
        if self.world_size == 1:
            return x
        import torch.distributed as td
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        td.all_gather(parts, x.contiguous())
        return torch.cat(parts)
