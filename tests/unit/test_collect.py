"""collect → learn on hand-built episodes: process-reward advantages (SPEC 1.3) reach the loss token by token,
outcome and process advantages add, and dynamic sampling replaces a zero-variance group."""
import threading
from dataclasses import dataclass, replace

import pytest
import torch

import grpo.learn as learn_module
from grpo.algo.specs import AdvantageSpec
from grpo.collect import Collector, _step_tensors, _token_of, collect
from grpo.config import ModelConfig
from grpo.data import PromptStream
from grpo.distributed import Dist
from grpo.experience import Experience
from grpo.learn import Learner, learn
from grpo.models import load_model
from grpo.policy import LogprobModule
from grpo.rewards import last_number
from grpo.rollout import Rollout, Sampling
from grpo.sampling import Sampler
from grpo.tasks.base import Example
from grpo.tiny import build_char_tokenizer

from algo_specs import loss_spec

TOK = build_char_tokenizer()


class Scripted:
    """An environment whose episodes are fixed texts per prompt (each ending with EOS), whatever the seed."""

    def __init__(self, episodes: dict[str, list[str]]):
        self.episodes = episodes
        self.calls = []

    def rollout(self, generator, examples, sampling, seeds=None):
        self.calls.append([e.prompt for e in examples])
        texts = [t for e in examples for t in self.episodes[e.prompt]]
        assert len(texts) == len(examples) * sampling.n
        enc = TOK([e.prompt for e in examples for _ in range(sampling.n)], return_tensors="pt", padding=True,
                  padding_side="left")
        rows = [TOK(t, add_special_tokens=False)["input_ids"] + [TOK.eos_token_id] for t in texts]
        width = max(map(len, rows))
        ids = torch.full((len(rows), width), TOK.pad_token_id)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1
        return Rollout(enc["input_ids"], enc["attention_mask"], ids, mask, torch.zeros(len(rows), dtype=torch.bool),
                       texts)


# SPEC 1.3's tiny check: o1 has steps ending at (1-based) tokens 3 and 6 with rewards 0.9 and 0.2, o2 one step
# ending at token 4 with reward 0.5. A second group: one right step and one wrong.
STEPS = {"abc,de": [(3, 0.9), (6, 0.2)], "fgh,": [(4, 0.5)], "xy": [(2, 1.0)], "z": [(1, 0.0)]}
EPISODES = {"p0": ["abc,de", "fgh,"], "p1": ["xy", "z"]}


def steps_reward(prompts, completions, **_):
    return [STEPS[c] for c in completions]


def collector(env, rewards, **kw):
    spec = AdvantageSpec(**{"scale": "group", "std": "sample", "eps": 0.0, "mask_truncated": False,
                            "dynamic_sampling": False, "max_sampling_rounds": 1,
                            "multi_objective_aggregation": "sum_then_normalize", **kw})
    return Collector(Sampler(env, None, Sampling(2, 8), seed=0), rewards, None, TOK, prompts_per_step=2, spec=spec)


def stream(prompts, answers=None):
    answers = answers or ["1"] * len(prompts)
    return PromptStream([Example(p, a) for p, a in zip(prompts, answers)], 2, seed=0)


def hand_process_advantages():
    # pooled over the group's three steps: mean 0.533333, sample std 0.351188 -> 1.044074, -0.949158, -0.094916.
    # A token gets the sum over the steps that end at or after it; a step that ends at the end of the text
    # ends at the EOS. Group 1: [1, 0] -> +-0.707107
    a = torch.zeros(4, 7)
    a[0, :3], a[0, 3:7] = 1.044074 - 0.949158, -0.949158   # "abc,de" + EOS: tokens 0-2, then 3-6
    a[1, :5] = -0.094916                                   # "fgh," + EOS
    a[2, :3] = 0.707107                                    # "xy" + EOS
    a[3, :2] = -0.707107                                   # "z" + EOS
    return a


def test_step_ends_map_to_the_token_holding_the_last_character():
    ids = TOK("ab cd", add_special_tokens=False)["input_ids"]
    assert [_token_of(TOK, ids, end, "ab cd", 6) for end in (0, 1, 2, 3, 4)] == [0, 0, 1, 2, 3]
    assert _token_of(TOK, ids, 5, "ab cd", 6) == 5  # the end of the text: the last token, the EOS


def test_step_ends_wait_for_every_byte_of_a_character():
    # a byte-level BPE without merges: "é" is two tokens and "😀" four; a character split over tokens decodes as
    # U+FFFD until its last byte, so a step ending on it ends at its last byte's token
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    raw = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw)
    text = "é = 1, 😀😀 = 2"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text and len(ids) == 2 + 6 + 8 + 4  # "é", " = 1, ", "😀😀", " = 2"
    assert _token_of(tok, ids, 1, text, len(ids)) == 1       # "é": bytes 0-1
    assert _token_of(tok, ids, 5, text, len(ids)) == 5       # "1", one byte
    assert _token_of(tok, ids, 8, text, len(ids)) == 11      # the first "😀": bytes 8-11
    assert _token_of(tok, ids, 9, text, len(ids)) == 15      # the second: 12-15


class Words:
    """A tokenizer of whole pieces (the last one EOS, a special token), for steps that end inside a token."""

    pieces = ["The", " answer", " is", " 42", ".\n\n", "<eos>"]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.pieces[i] for i in ids if not (skip_special_tokens and i == 5))


def test_a_step_ending_in_the_token_that_completed_a_stop_string():
    # the same text ended by EOS (row 0) and by the stop string "\n\n" (row 1: its last token completed the
    # string, and is text): a step that ends on "." ends on the token ".\n\n" in both rows, not the one before
    ids = torch.tensor([[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5]])
    ids[1, 5] = 5  # padding
    mask = torch.tensor([[1] * 6, [1] * 5 + [0]])
    text = "The answer is 42.\n\n"
    rollout = Rollout(torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1, dtype=torch.long), ids, mask,
                      torch.zeros(2, dtype=torch.bool), [text, text])
    steps = [[(16, 1.0), (17, 0.5), (len(text), 0.0)]] * 2  # after "42", after ".", the end of the text
    ends, rewards = _step_tensors(Words(), rollout, steps)
    assert ends.tolist() == [[3, 4, 5], [3, 4, 4]]
    assert rewards.tolist() == [[1.0, 0.5, 0.0]] * 2


def test_process_advantages_are_the_hand_computed_ones():
    examples = stream(["p0", "p1"])
    exp = collect(collector(Scripted(EPISODES), [("steps", steps_reward)]), examples, Dist())
    order = [exp.examples[i].prompt for i in range(2)]
    want = hand_process_advantages()
    if order == ["p1", "p0"]:
        want = want[[2, 3, 0, 1]]
    assert torch.allclose(exp.advantages, want, atol=1e-5)
    assert exp.loss_mask.tolist() == exp.completion_mask.tolist()
    # reward/steps is each episode's step mean
    assert exp.per_fn["steps"].tolist() == pytest.approx([[0.55, 0.5, 1.0, 0.0], [1.0, 0.0, 0.55, 0.5]][order[0] == "p1"])


def test_outcome_and_process_advantages_add():
    def outcome(prompts, completions, **_):
        return [1.0 if c in ("abc,de", "xy", "z") else 0.0 for c in completions]  # group 0: [1, 0]; group 1: [1, 1]

    exp = collect(collector(Scripted(EPISODES), [("steps", steps_reward), ("outcome", outcome)]),
                  stream(["p0", "p1"]), Dist())
    want = hand_process_advantages()
    want[0, :7] += 0.707107  # group 0's outcome advantages, broadcast to every token; group 1's are 0
    want[1, :5] -= 0.707107
    if exp.examples[0].prompt == "p1":
        want = want[[2, 3, 0, 1]]
    assert torch.allclose(exp.advantages * exp.completion_mask, want, atol=1e-5)


def test_a_process_function_that_applies_to_no_row_of_a_share_changes_nothing():
    # rows where it does not apply get None; a share with no step at all still has the outcome advantages, and
    # with dynamic sampling rounds with and without steps join
    def some_steps(prompts, completions, **_):
        return [STEPS[c] if c in ("xy", "z") else None for c in completions]

    def outcome(prompts, completions, **_):
        return [1.0 if c in ("abc,de", "xy") else 0.0 for c in completions]

    only_p0 = collect(collector(Scripted(EPISODES), [("steps", some_steps), ("outcome", outcome)]),
                      stream(["p0", "p0"]), Dist())
    assert torch.allclose(only_p0.advantages[:, 0], torch.tensor([0.707107, -0.707107] * 2), atol=1e-5)
    c = collector(Scripted({**EPISODES, "p2": ["z", "z"]}), [("steps", some_steps), ("outcome", outcome)],
                  dynamic_sampling=True, max_sampling_rounds=3)
    exp = collect(c, PromptStream([Example(p, "1") for p in ("p0", "p2", "p1", "p1")], 2, seed=0), Dist())
    assert len(exp.examples) == 2 and "p2" not in [e.prompt for e in exp.examples]


def test_the_loss_gets_the_per_token_advantages(random_model_dir, monkeypatch):
    exp = collect(collector(Scripted(EPISODES), [("steps", steps_reward)]), stream(["p0", "p1"]), Dist())
    model, _ = load_model(ModelConfig(path=str(random_model_dir)))
    module = LogprobModule(model)
    seen = []
    real = learn_module.policy_loss

    def spy(logp, old, adv, mask, *args, **kw):
        seen.append((adv.clone(), mask.clone()))
        return real(logp, old, adv, mask, *args, **kw)

    monkeypatch.setattr(learn_module, "policy_loss", spy)
    learner = Learner(module, None, torch.optim.AdamW(model.parameters(), lr=1e-3), loss_spec(8, beta=0.0), 1.0, 8,
                      max_rows=3, max_tokens=0, max_grad_norm=1.0)
    learn(learner, exp, Dist())
    assert [a.shape[0] for a, _ in seen] == [3, 1]  # micro-batches of at most 3 rows
    got = torch.zeros_like(exp.advantages)
    row = 0
    for adv, mask in seen:
        got[row:row + adv.shape[0], :adv.shape[1]] = adv * mask
        row += adv.shape[0]
    assert torch.allclose(got, exp.advantages * exp.loss_mask)
    assert torch.allclose(got.abs().sum(), hand_process_advantages().abs().sum(), atol=1e-4)


# ---------------------------------------------------------------------------------------------------------
# dynamic sampling

def dynamic_setup(rounds):
    prompts = ["p0", "p1", "p2", "p3", "p4", "p5"]
    same = stream(prompts)
    order = [e.prompt for e in same.next_batch() + same.next_batch()]  # the stream's order: seeded shuffle
    flat = order[0]  # the first prompt drawn gets a zero-variance group
    episodes = {p: (["1", "1"] if p == flat else ["1", "2"]) for p in prompts}
    env = Scripted(episodes)
    c = collector(env, [("last_number", last_number)], dynamic_sampling=True, max_sampling_rounds=rounds)
    return c, env, stream(prompts), order


def test_dynamic_sampling_replaces_a_zero_variance_group():
    c, env, s, order = dynamic_setup(rounds=4)
    exp = collect(c, s, Dist())
    assert [e.prompt for e in exp.examples] == [order[1], order[2]]  # the next prompt drawn takes its place
    assert env.calls == [order[:2], order[2:4]]
    # the reward of every completion drawn, the dropped group's [1, 1] included: (2 + 1 + 1 + 1) / 8
    assert exp.stats == {"sampling/rounds": 2, "sampling/prompts_drawn": 4, "sampling/groups_dropped": 1,
                         "sampling/groups_trained": 2, "sampling/reward_mean": 0.625}
    assert exp.rewards.tolist() == [1.0, 0.0, 1.0, 0.0] and exp.all_rewards.tolist() == exp.rewards.tolist()
    assert (exp.advantages[:, 0].abs() > 0.7).all()
    assert s.drawn == 4  # the surplus group of the last round is dropped, its prompt stays drawn


def test_dynamic_sampling_at_the_cap_trains_on_the_informative_groups_only():
    # SPEC 13.8: at the cap the step trains on what it has; a zero-advantage group filled in would count in the
    # token-mean normaliser and get a KL gradient
    c, env, s, order = dynamic_setup(rounds=1)
    exp = collect(c, s, Dist())
    assert [e.prompt for e in exp.examples] == [order[1]] and len(exp) == 2
    assert exp.stats == {"sampling/rounds": 1, "sampling/prompts_drawn": 2, "sampling/groups_dropped": 1,
                         "sampling/groups_trained": 1, "sampling/reward_mean": 0.75}
    assert (exp.advantages[:, 0].abs() > 0.7).all()  # every group trained on carries a signal
    assert exp.all_rewards.tolist() == [1.0, 0.0]


def test_dynamic_sampling_without_any_informative_group_has_nothing_to_train_on():
    c, env, s, order = dynamic_setup(rounds=2)
    c = replace(c, sampler=replace(c.sampler, environment=Scripted({p: ["1", "1"] for p in order})))
    exp = collect(c, s, Dist())
    assert len(exp) == 0 and exp.examples == [] and exp.advantages.shape[0] == 0
    assert exp.stats["sampling/groups_trained"] == 0 and exp.stats["sampling/groups_dropped"] == 4


def test_without_dynamic_sampling_nothing_is_dropped():
    c, env, s, order = dynamic_setup(rounds=4)
    c = replace(c, spec=replace(c.spec, dynamic_sampling=False))
    exp = collect(c, s, Dist())
    assert [e.prompt for e in exp.examples] == order[:2] and exp.stats == {}


def test_dynamic_sampling_with_mask_truncated_drops_groups_that_are_all_truncated():
    class Truncating(Scripted):
        def rollout(self, generator, examples, sampling, seeds=None):
            r = super().rollout(generator, examples, sampling, seeds)
            r.truncated[:] = torch.tensor([e.prompt == "p0" for e in examples for _ in range(sampling.n)])
            return r

    env = Truncating({"p0": ["1", "2"], "p1": ["1", "2"], "p2": ["2", "1"], "p3": ["1", "1"]})
    c = collector(env, [("last_number", last_number)], dynamic_sampling=True, max_sampling_rounds=4,
                  mask_truncated=True)
    exp = collect(c, PromptStream([Example(p, "1") for p in ("p0", "p1", "p2", "p3")], 2, seed=0), Dist())
    assert sorted(e.prompt for e in exp.examples) == ["p1", "p2"]  # p0's rewards differ, but it is all masked
    assert exp.loss_mask.sum(1).gt(0).all()


def test_rewards_get_the_generated_token_ids():
    seen = {}

    def spy(prompts, completions, completion_ids, **_):
        seen["ids"] = completion_ids
        return [0.0] * len(completions)

    collect(collector(Scripted(EPISODES), [("spy", spy)]), stream(["p0", "p1"]), Dist())
    texts = [t for p in ("p0", "p1") for t in EPISODES[p]]  # the scripted order (groups may be reordered)
    expected = sorted(TOK(t, add_special_tokens=False)["input_ids"] + [TOK.eos_token_id] for t in texts)
    assert sorted(seen["ids"]) == expected  # EOS included, no padding


# ---------------------------------------------------------------------------------------------------------
# several processes: threads of this test sharing the collectives of `grpo.distributed.Dist`

class Hub:
    """What `world` processes' collectives see: each puts its value, all read all of them."""

    def __init__(self, world):
        self.barrier = threading.Barrier(world)
        self.slots = [None] * world
        self.moved = []  # (from, to, the groups' prompts, rows) of every exchange between two processes

    def all(self, rank, value):
        self.slots[rank] = value
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out


@dataclass(frozen=True)
class ThreadDist(Dist):
    hub: Hub = None

    def gather(self, x):
        return torch.cat(self.hub.all(self.rank, x))

    def gather_objects(self, obj):
        return self.hub.all(self.rank, obj)

    def sum(self, x):
        return sum(self.hub.all(self.rank, x))

    def exchange(self, parts):
        assert len(parts) == self.world_size
        for to, part in enumerate(parts):
            if to != self.rank and part:
                self.hub.moved.append((self.rank, to, [e.prompt for _, rows in part for e in rows.examples],
                                       sum(len(rows) for _, rows in part)))
        return [sent[self.rank] for sent in self.hub.all(self.rank, parts)]


class Versioned(Scripted):
    def rollout(self, generator, examples, sampling, seeds=None):
        r = super().rollout(generator, examples, sampling, seeds)
        return replace(r, version=torch.full((len(r),), 5))


PROMPTS = [f"p{i}" for i in range(12)]


def collect_on(world, flat, rounds, scale="group", rewards=(("last_number", last_number),), **spec):
    """Every process's Experience of one dynamic-sampling step (4 prompts a round, G = 2), and the hub."""
    hub, out = Hub(world), [None] * world
    episodes = {p: (["1", "1"] if p in flat else ["1", "2 2 2" + "2" * int(p[1:])]) for p in PROMPTS}

    def run(rank):
        c = replace(collector(Versioned(episodes), list(rewards), dynamic_sampling=True,
                              max_sampling_rounds=rounds, scale=scale, **spec), prompts_per_step=4)
        s = PromptStream([Example(p, "1") for p in PROMPTS], 4, seed=0)
        out[rank] = collect(c, s, ThreadDist(rank, world, hub=hub) if world > 1 else Dist())

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(e is not None for e in out)
    return out, hub


def same_rows(a, b, step_rewards=True):
    """Two Experiences hold the same rows, with the same values (padding aside), and (`step_rewards`) the same
    rewards of the step."""
    assert [e.prompt for e in a.examples] == [e.prompt for e in b.examples] and a.texts == b.texts
    assert a.group.tolist() == b.group.tolist() and a.version.tolist() == b.version.tolist()
    t = int(a.lengths.max())
    for name in ("completion_ids", "completion_mask", "loss_mask"):
        assert torch.equal(getattr(a, name)[:, :t], getattr(b, name)[:, :t]), name
    # an outcome advantage is broadcast to the padding too, which is as wide as the rows that travelled together
    assert torch.equal((a.advantages * a.completion_mask)[:, :t], (b.advantages * b.completion_mask)[:, :t])
    assert torch.equal(a.rewards, b.rewards) and (not step_rewards or torch.equal(a.all_rewards, b.all_rewards))


# the stream's order of PROMPTS (4 a round)
ORDER = [e.prompt for e in (lambda s: s.next_batch() + s.next_batch() + s.next_batch())(
    PromptStream([Example(p, "1") for p in PROMPTS], 4, seed=0))]


@pytest.mark.parametrize("flat,rounds,worlds", [
    ({"p1", "p4", "p7"}, 3, (2, 4)),                          # enough informative groups
    (set(PROMPTS) - {ORDER[1], ORDER[6]}, 2, (2,)),           # the cap: 2 informative groups, shared by 1 or 2
])
@pytest.mark.parametrize("scale", ["group", "batch"])
def test_dynamic_sampling_on_several_processes_equals_one(flat, rounds, worlds, scale):
    (one,), _ = collect_on(1, flat, rounds, scale)
    assert one.version.tolist() == [5] * len(one)  # the generator's weight version reaches the Experience
    for world in worlds:
        parts, hub = collect_on(world, flat, rounds, scale)
        assert len({len(p) for p in parts}) == 1  # equal shares
        joined = Experience.concat(parts, TOK.pad_token_id)
        same_rows(joined, one)
        assert all(p.stats == one.stats for p in parts)
        # only the groups a process trains, and that another sampled, move: every dropped group stays put
        trained = {e.prompt for e in one.examples}
        moved = [p for _, _, prompts, _ in hub.moved for p in prompts]
        assert set(moved) <= trained and len(moved) == len(set(moved))  # a trained group moves once, if at all
        for sender, to, prompts, rows in hub.moved:
            assert set(prompts) <= {e.prompt for e in parts[to].examples} and rows == 2 * len(prompts)


def test_at_the_cap_the_processes_share_the_informative_groups_equally():
    # 3 informative groups in 2 rounds: one process trains on the 3; two on the first 2 drawn, one each (the
    # last drawn is dropped, as the surplus of a last round is); four on none (no rows, no update)
    flat = set(PROMPTS) - {ORDER[1], ORDER[2], ORDER[6]}
    (one,), _ = collect_on(1, flat, 2)
    assert [e.prompt for e in one.examples] == [ORDER[1], ORDER[2], ORDER[6]]
    assert one.stats["sampling/groups_trained"] == 3
    two, _ = collect_on(2, flat, 2)
    assert [[e.prompt for e in p.examples] for p in two] == [[ORDER[1]], [ORDER[2]]]
    assert all(p.stats["sampling/groups_trained"] == 2 for p in two)
    same_rows(Experience.concat(two, TOK.pad_token_id), one.select(range(4)), step_rewards=False)
    assert all(torch.equal(p.all_rewards, one.rewards[:4]) for p in two)
    four, _ = collect_on(4, flat, 2)
    assert all(len(p) == 0 and p.stats["sampling/groups_trained"] == 0 for p in four)
    assert all(p.stats == {**one.stats, "sampling/groups_trained": 0} for p in four)


def test_maxrl_advantages_reach_the_experience():
    # SPEC 14.3 through the config and a real collect: groups [1, 0] and [0, 1] of the scripted episodes; MaxRL
    # divides r − r̄ by r̄ = 0.5 (±1), where GRPO's std without eps gives ±0.707107
    from grpo.config import load_config
    algo = load_config(None, ["algo.scale=maxrl"]).algo
    episodes = Scripted({"p0": ["so 1", "so 22"], "p1": ["it is 3", "1"]})
    exp = collect(collector(episodes, [("last_number", last_number)], scale=AdvantageSpec.from_algo(algo).scale),
                  stream(["p0", "p1"]), Dist())
    assert exp.rewards.tolist() in ([1, 0, 0, 1], [0, 1, 1, 0])  # the groups in the stream's order
    assert exp.advantages[:, 0].tolist() == ((exp.rewards - 0.5) / 0.5).tolist()


def length(completions, **_):
    return [len(c) / 10 for c in completions]


def test_gdpo_normalises_each_reward_over_the_step_on_several_processes_as_on_one():
    # SPEC 14.4 through collect: two reward functions, dynamic sampling, one process and two
    from grpo.algo import gdpo_advantages
    from test_advantages import spec as advantage_spec
    rewards = (("last_number", last_number), ("length", length))
    (one,), _ = collect_on(1, {"p1", "p4", "p7"}, 3, rewards=rewards, multi_objective_aggregation="normalize_then_sum")
    per_fn = torch.stack([torch.tensor([float(t == "1") for t in one.texts]),
                          torch.tensor([len(t) / 10 for t in one.texts])], 1).double()
    expect = gdpo_advantages(per_fn, [1.0, 1.0], 2, advantage_spec(eps=0.0))
    assert torch.allclose(one.advantages[:, 0].double(), expect, atol=1e-6)
    summed, _ = collect_on(1, {"p1", "p4", "p7"}, 3, rewards=rewards)
    assert not torch.allclose(summed[0].advantages[:, 0], one.advantages[:, 0])
    two, _ = collect_on(2, {"p1", "p4", "p7"}, 3, rewards=rewards, multi_objective_aggregation="normalize_then_sum")
    same_rows(Experience.concat(two, TOK.pad_token_id), one)


def test_gdpo_refuses_process_rewards_in_one_line():
    from grpo.errors import DataError
    c = collector(Scripted(EPISODES), [("steps", steps_reward), ("last_number", last_number)],
                  multi_objective_aggregation="normalize_then_sum")
    with pytest.raises(DataError, match="normalize_then_sum .GDPO. normalises outcome rewards, and a reward function "
                                        "returned process steps"):
        collect(c, stream(["p0", "p1"]), Dist())


def test_maxrl_rewards_outside_0_1_are_one_line():
    from grpo.config import load_config
    from grpo.errors import DataError
    algo = load_config(None, ["algo.scale=maxrl"]).algo
    c = collector(Scripted({"p0": ["so 1", "so 22"], "p1": ["it is 3", "1"]}), [("twice", twice)],
                  scale=AdvantageSpec.from_algo(algo).scale)
    with pytest.raises(DataError, match=r"algo.scale=maxrl needs every reward in \[0, 1\] .* a completion's reward "
                                        r"is 2; use rewards in \[0, 1\] or another algo.scale"):
        collect(c, stream(["p0", "p1"]), Dist())


def twice(prompts, completions, answer, **_):
    return [2.0 * r for r in last_number(prompts, completions, answer)]


def maybe_one(prompts, completions, **_):
    return [None if c == "none" else float(c == "1") for c in completions]


def test_unscorable_completions_leave_the_loss_and_its_normaliser(random_model_dir):
    # SPEC 14.11, our choice (14.13): a completion no reward function scores gets Â = 0, and leaves the loss mask
    # and N, so it gets no KL gradient either; the step's loss is that of the scored rows alone
    from grpo.metrics import step_metrics
    episodes = Scripted({"p0": ["1", "0", "none", "1"], "p1": ["0", "none", "none", "1"]})
    c = collector(episodes, [("maybe", maybe_one)], eps=1e-4)
    c = replace(c, sampler=replace(c.sampler, sampling=Sampling(4, 8)))
    exp = collect(c, stream(["p0", "p1"]), Dist())
    unscored = exp.rewards.isnan()
    assert unscored.sum() == 3 and exp.loss_mask[unscored].sum() == 0 and exp.loss_mask[~unscored].sum(1).gt(0).all()
    assert exp.advantages[unscored].abs().sum() == 0
    p0 = [i for i, e in enumerate(exp.group.tolist()) if exp.examples[e].prompt == "p0"]
    assert torch.allclose(exp.advantages[p0, 0], torch.tensor([0.577250, -1.154501, 0, 0.577250]), atol=1e-6)
    model, _ = load_model(ModelConfig(path=str(random_model_dir)))
    reference, _ = load_model(ModelConfig(path=str(random_model_dir)))
    torch.manual_seed(0)
    with torch.no_grad():  # a reference away from the policy, so that the KL term is not 0
        for p in reference.parameters():
            p.add_(0.05 * torch.randn_like(p))
    module = LogprobModule(model)

    def loss(e, aggregation):
        learner = Learner(module, LogprobModule(reference), torch.optim.SGD(model.parameters(), lr=0.0),
                          loss_spec(8, beta=0.04, aggregation=aggregation), 1.0, 8, max_rows=3, max_tokens=0,
                          max_grad_norm=1.0)
        return learn(learner, e, Dist())[0]["loss"]

    scored = exp.select((~unscored).nonzero().flatten().tolist())
    for aggregation in ("seq_mean", "token_mean", "constant"):
        got, want = loss(exp, aggregation), loss(scored, aggregation)
        assert abs(want) > 1e-4 and got == pytest.approx(want, rel=1e-4), aggregation  # float32 micro-batches
    m = step_metrics(exp, [], Dist(), group_size=4, seconds=1.0, rollout_seconds=1.0, lr=1.0)
    assert m["reward/unscored_frac"] == 3 / 8 and m["reward/mean"] == pytest.approx(3 / 5)
