"""The built-in task `stories`: word problems whose answers are right, split once and for all."""
import re

from grpo.rewards import last_number
from grpo.tasks import load_builtin_task
from grpo.tasks.stories import INSTRUCTION, STORIES, story_examples


def test_every_story_has_the_right_answer():
    examples = story_examples()
    assert len({e.prompt for e in examples}) == len(examples) == 50208  # no prompt twice
    ops = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b}
    for e in examples:
        f = e.fields
        assert e.answer == str(ops[f["kind"]](f["a"], f["b"])) and int(e.answer) >= 0
        assert e.prompt.endswith(INSTRUCTION) and re.findall(r"\d+", e.prompt) == [str(f["a"]), str(f["b"])]
    assert {e.fields["kind"] for e in examples} == {kind for kind, _ in STORIES}
    e = next(x for x in examples if x.prompt.startswith("Mia has 7 apples. She buys 5 more."))
    assert e.answer == "12" and e.prompt == ("Mia has 7 apples. She buys 5 more. How many apples does Mia have "
                                             "now? Answer with a number.")
    assert last_number([e.prompt], ["Mia has 7 + 5 = 12 apples."], [e.answer]) == [1.0]


def test_held_out_is_disjoint_and_the_same_for_every_seed():
    a, b = load_builtin_task("stories", seed=0), load_builtin_task("stories", seed=1)
    assert not {e.prompt for e in a.train} & {e.prompt for e in a.eval}
    assert [e.prompt for e in a.eval] == [e.prompt for e in b.eval]
    assert [e.prompt for e in a.train] != [e.prompt for e in b.train]  # the seed orders the training stream
    assert 0.18 < len(a.eval) / (len(a.train) + len(a.eval)) < 0.22
