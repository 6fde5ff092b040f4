"""The training prompt stream: whole batches of examples in a seeded order, reshuffled every epoch."""
from __future__ import annotations

import random
from dataclasses import dataclass

from grpo.errors import DataError
from grpo.tasks.base import Example


@dataclass
class PromptStream:
    examples: list[Example]
    batch_size: int
    seed: int
    epoch: int = 0
    position: int = 0  # (epoch, position) is all a resume needs

    def __post_init__(self):
        if not self.examples:
            raise DataError("the training set is empty")
        self._order = self._shuffled(self.epoch)

    def _shuffled(self, epoch: int) -> list[int]:
        order = list(range(len(self.examples)))
        random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    @property
    def drawn(self) -> int:
        """How many examples were drawn before the next one (the next one's index in the stream)."""
        return self.epoch * len(self.examples) + self.position

    def restore(self, epoch: int, position: int) -> None:
        self.epoch, self.position = epoch, position
        self._order = self._shuffled(epoch)

    def next_batch(self) -> list[Example]:
        out = []
        while len(out) < self.batch_size:
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._shuffled(self.epoch)
            out.append(self.examples[self._order[self.position]])
            self.position += 1
        return out
