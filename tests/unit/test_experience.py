"""Rollout and Experience: shapes checked where they are built, the loss mask, selecting and joining rows."""
import pytest
import torch

from grpo.experience import Experience
from grpo.rollout import Rollout
from grpo.rollout.base import concat_rollouts
from grpo.tasks.base import Example


def rollout(n=4, lp=3, t=5, truncated=(False, True, False, False), pad=0):
    prompt_mask = torch.ones(n, lp, dtype=torch.long)
    prompt_mask[0, 0] = 0
    lengths = torch.tensor([2, 5, 1, 3][:n])
    completion_mask = (torch.arange(t) < lengths.unsqueeze(1)).long()
    ids = torch.arange(n * t).view(n, t) + 10
    return Rollout(torch.arange(n * lp).view(n, lp) + 1, prompt_mask, ids.masked_fill(completion_mask == 0, pad),
                   completion_mask, torch.tensor(truncated[:n]), [f"t{i}" for i in range(n)])


def test_rollout_loss_mask_defaults_to_the_completion_mask_and_shapes_are_checked():
    r = rollout()
    assert torch.equal(r.loss_mask, r.completion_mask) and r.loss_mask is not r.completion_mask
    assert r.sampler_logp is None and r.lengths.tolist() == [2, 5, 1, 3]
    with pytest.raises(ValueError, match=r"Rollout.loss_mask has shape \(4, 4\); completion_ids has \(4, 5\)"):
        Rollout(r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask, r.truncated, r.texts,
                loss_mask=torch.ones(4, 4))
    with pytest.raises(ValueError, match="4 completions but .* and 3 texts"):
        Rollout(r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask, r.truncated, r.texts[:3])


def test_select_and_concat_keep_every_field_row_by_row():
    a, b = rollout(), rollout(n=2, lp=2, t=7, truncated=(True, False))
    b.loss_mask[0, 1] = 0  # an environment's own token
    b.sampler_logp = None
    joined = concat_rollouts([a.select([3, 1]), b], pad_id=0)
    assert joined.completion_ids.shape == (4, 7) and joined.prompt_ids.shape == (4, 3)
    assert torch.equal(joined.completion_ids[0, :5], a.completion_ids[3]) and joined.completion_ids[0, 5:].eq(0).all()
    assert torch.equal(joined.prompt_ids[2, 1:], b.prompt_ids[0]) and joined.prompt_mask[2, 0] == 0  # left-padded
    assert joined.loss_mask[2].tolist() == b.loss_mask[0].tolist()
    assert joined.texts == ["t3", "t1", "t0", "t1"] and joined.truncated.tolist() == [False, True, True, False]
    assert joined.sampler_logp is None


def experience(**kw):
    r = rollout()
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    return Experience.from_rollout(r, [Example("p", "1"), Example("q", "2")], adv.unsqueeze(1).expand(4, 5).clone(),
                                   torch.tensor([1.0, 0.0, 1.0, 0.0]), {"f": torch.tensor([1.0, 0.0, 1.0, 0.0])},
                                   torch.tensor([1.0, 0.0, 1.0, 0.0]), **kw)


def test_experience_from_rollout_groups_rows_and_masks_truncated_rows_on_request():
    e = experience()
    assert e.group.tolist() == [0, 0, 1, 1] and len(e) == 4 and e.lengths.tolist() == [2, 5, 1, 3]
    assert torch.equal(e.loss_mask, e.completion_mask)
    masked = experience(mask_truncated=True)
    assert masked.loss_mask[1].sum() == 0 and torch.equal(masked.loss_mask[[0, 2, 3]], e.loss_mask[[0, 2, 3]])
    assert masked.completion_mask[1].sum() == 5  # the episode is still there, for the group statistics


def test_experience_checks_its_shapes():
    e = experience()
    with pytest.raises(ValueError, match=r"Experience.advantages has shape \(4,\)"):
        Experience(**{**e.__dict__, "advantages": torch.zeros(4)})
    with pytest.raises(ValueError, match=r"Experience.per_fn\['f'\] has shape \(3,\)"):
        Experience(**{**e.__dict__, "per_fn": {"f": torch.zeros(3)}})
    with pytest.raises(ValueError, match="group indexes 2 examples out of range"):
        Experience(**{**e.__dict__, "group": torch.tensor([0, 0, 1, 2])})
    with pytest.raises(ValueError, match="advantages must be float32"):
        Experience(**{**e.__dict__, "advantages": e.advantages.double()})
    with pytest.raises(ValueError, match="do not make 3 groups"):
        Experience.from_rollout(rollout(), [Example("p", "1")] * 3, e.advantages, e.rewards, {}, e.rewards)


def test_rows_select_concat_and_map_are_one_implementation_for_every_batch_type():
    e = experience(stats={"sampling/rounds": 2})
    e.version = torch.tensor([3, 3, 4, 4])
    # select: groups renumbered in order of first use, only the groups the rows use kept; figures of the whole
    # step kept as they are
    s = e.select([3, 2, 0])
    assert s.group.tolist() == [0, 0, 1] and [x.prompt for x in s.examples] == ["q", "p"]
    assert s.texts == ["t3", "t2", "t0"] and s.version.tolist() == [4, 4, 3]
    assert s.per_fn["f"].tolist() == [0.0, 1.0, 1.0] and s.advantages[:, 0].tolist() == [-0.5, 0.5, 1.0]
    assert s.stats == {"sampling/rounds": 2} and s.all_rewards is e.all_rewards
    # concat: group indices offset by the examples before them, completions right-padded with the pad id and
    # prompts left-padded, advantages with 0
    wide = Experience.from_rollout(rollout(n=2, lp=4, t=7), [Example("r", "3")], torch.ones(2, 7),
                                   torch.zeros(2), {"f": torch.zeros(2)}, torch.zeros(2))
    j = Experience.concat([s, wide], pad_id=-1)
    assert j.group.tolist() == [0, 0, 1, 2, 2] and [x.prompt for x in j.examples] == ["q", "p", "r"]
    assert j.completion_ids.shape == (5, 7) and j.completion_ids[0, 5:].tolist() == [-1, -1]
    assert j.prompt_ids[0].tolist() == [-1] + e.prompt_ids[3].tolist() and j.prompt_mask[0, 0] == 0
    assert j.advantages[0, 5:].tolist() == [0.0, 0.0] and j.sampler_logp is None
    assert j.version is None  # kept only when every part has it
    assert Rollout.concat([rollout(), rollout()]).version is None
    # map: every tensor, lists shared
    m = j.map(lambda x: x.clone())
    assert torch.equal(m.completion_ids, j.completion_ids) and m.completion_ids is not j.completion_ids
    assert m.texts is j.texts and torch.equal(m.group, j.group)
