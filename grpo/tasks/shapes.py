"""The built-in visual task `shapes`: count the squares of one colour in a small picture.

Each picture is a 32 x 32 pixel canvas of 4 x 4 cells; some cells hold a filled square, red, green or blue, the
rest are white. The prompt asks how many squares of one colour there are (" How many red squares?"); the answer is
the count, 0 to 6. One cell is one image token of the bundled tiny vision model (patches of 4 pixels merged 2 x 2),
so the model has to see each cell's colour and count the cells of the one asked for.

Scenes are drawn by a fixed generator: the same 2,400 for every run. The held-out split (200) is chosen by a hash of
the scene, so no held-out picture is ever trained on.
"""
from __future__ import annotations

import hashlib
import random

from grpo.tasks.base import Example

CANVAS = 32
CELLS = 4
COLOURS = {"red": (220, 30, 30), "green": (30, 170, 60), "blue": (40, 60, 220)}
MAX_COUNT = 6
SCENES = 2400
HELD_OUT = 200


def draw(cells: dict[int, str]):
    """The picture of a scene: cell index (row-major, 0-15) -> colour name; the rest white."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (CANVAS, CANVAS), (255, 255, 255))
    pen = ImageDraw.Draw(image)
    size = CANVAS // CELLS
    for cell, colour in cells.items():
        y, x = divmod(cell, CELLS)
        pen.rectangle([x * size + 1, y * size + 1, x * size + size - 2, y * size + size - 2], fill=COLOURS[colour])
    return image


def scene_key(cells: dict[int, str], colour: str) -> str:
    return ",".join(f"{c}{cells[c][0]}" for c in sorted(cells)) + ":" + colour


def scenes(count: int = SCENES, seed: int = 1234) -> list[tuple[dict[int, str], str, int]]:
    """`count` distinct scenes: (cells, the colour asked for, its count), the counts near-uniform over 0-6."""
    rng = random.Random(seed)
    out, seen = [], set()
    while len(out) < count:
        target = rng.randrange(MAX_COUNT + 1)
        colour = rng.choice(list(COLOURS))
        others = [c for c in COLOURS if c != colour]
        extra = rng.randrange(min(6, CELLS * CELLS - target) + 1)  # squares of the other colours
        chosen = rng.sample(range(CELLS * CELLS), target + extra)
        cells = {c: colour for c in chosen[:target]}
        cells.update({c: rng.choice(others) for c in chosen[target:]})
        key = scene_key(cells, colour)
        if key in seen:
            continue
        seen.add(key)
        out.append((cells, colour, target))
    return out


def shape_examples() -> tuple[list[Example], list[Example]]:
    """(train, held-out) examples of the task, the held-out ones the 200 scenes with the smallest hash."""
    made = []
    for cells, colour, target in scenes():
        key = scene_key(cells, colour)
        h = hashlib.sha256(key.encode()).hexdigest()
        made.append((h, Example(f"How many {colour} squares?", str(target), {"scene": key},
                                images=(draw(cells),))))
    held = {h for h, _ in sorted(made, key=lambda m: m[0])[:HELD_OUT]}
    train = [e for h, e in made if h not in held]
    return train, [e for h, e in made if h in held]
