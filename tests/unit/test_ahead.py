"""The sampling lane of asynchronous runs (grpo/ahead.py): which weights sample each batch (fixed lag: exactly
max(0, s − 1 − k); freshest: the newest within the bound), where the evaluations fall, what a checkpoint keeps,
and a failure on the lane reaching the trainer. The lane's batches come from a stand-in for `collect` that records
the engine's version, so that the schedule is tested without an engine (the engines' runs are
tests/integration/test_async.py)."""
import random
import time

import pytest

import grpo.ahead as ahead
from grpo.ahead import Lane, lagged_versions, sampled_by
from grpo.distributed import Dist


class Engine:
    """A generator's version and weight syncs, and a log of what the lane did with it."""

    def __init__(self, version=0):
        self.version = version
        self.log = []

    def sync_weights(self, weights, version):
        assert weights == {"v": version}  # the weights published for that version, not another's
        self.version = version
        self.log.append(("sync", version))


class Stream:
    epoch, position = 0, 0


@pytest.fixture
def lane_of():
    lanes = []

    def make(engine, *, k, mode="fixed", first=1, last=8, eval_steps=(), slow=0.0, fail_at=None, weights=None,
             dist=None):
        def fake_collect(stream, dist):
            if fail_at is not None and stream.position + 1 == fail_at:
                raise ValueError("a reward function broke")
            time.sleep(slow * random.random())
            stream.position += 1
            engine.log.append(("collect", stream.position, engine.version))
            return ("batch", stream.position, engine.version)

        stream = Stream()
        stream.position = first - 1

        def evaluate(dist):
            engine.log.append(("eval", engine.version))
            return {"eval/accuracy": float(engine.version)}

        lane = Lane(fake_collect, stream, engine, dist or Dist(), k=k, mode=mode, first=first, last=last,
                    eval_steps=set(eval_steps), evaluate=evaluate, weights=weights or {first - 1: {"v": first - 1}})
        lanes.append(lane)
        return lane

    yield make
    for lane in lanes:
        lane.close(timeout=5)


def test_the_schedule():
    assert [sampled_by(s, 2) for s in range(1, 7)] == [0, 0, 0, 1, 2, 3]
    assert [sampled_by(s, 0) for s in range(1, 4)] == [0, 1, 2]  # k = 0 is the synchronous loop
    assert lagged_versions(0, 2) == []          # batches 1-2 both come from version 0, the policy's
    assert lagged_versions(1, 2) == [0]         # batches 2-3: version 0
    assert lagged_versions(5, 2) == [3, 4]      # batches 6-7: versions 3 and 4
    assert lagged_versions(5, 1) == [4]


def _train(lane, steps, first=1, work=0.0, evals=()):
    """The trainer's side: each step takes its batch, works, publishes its weights (and takes an evaluation)."""
    got = []
    for step in range(first, steps + 1):
        batch, _ = lane.next_batch(step)
        got.append((step, batch.version))
        time.sleep(work * random.random())
        lane.publish(step, {"v": step})
        if step in evals:
            got.append(("eval", step, lane.evaluation(step)["eval/accuracy"]))
    return got


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("slow, work", [(0.02, 0.0), (0.0, 0.02)])  # the engine behind, or the trainer
def test_fixed_lag_samples_batch_s_with_version_s_minus_1_minus_k_whatever_the_timing(lane_of, k, slow, work):
    random.seed(k)
    engine = Engine()
    lane = lane_of(engine, k=k, slow=slow)
    got = _train(lane, 8, work=work)
    assert got == [(s, sampled_by(s, k)) for s in range(1, 9)]
    assert [e for e in engine.log if e[0] == "collect"] == [("collect", s, sampled_by(s, k)) for s in range(1, 9)]


def test_freshest_takes_the_newest_weights_within_the_bound(lane_of):
    random.seed(0)
    engine = Engine()
    lane = lane_of(engine, k=3, mode="freshest", slow=0.03, last=12)
    got = _train(lane, 12)
    assert all(sampled_by(s, 3) <= v <= s - 1 or (s == 1 and v == 0) for s, v in got)
    assert any(v > sampled_by(s, 3) for s, v in got)  # an engine behind the trainer samples fresher than k allows


def test_evaluations_fall_before_batch_t_plus_k_plus_1_with_the_weights_of_step_t(lane_of):
    engine = Engine()
    lane = lane_of(engine, k=2, last=6, eval_steps={2, 4, 6})
    got = _train(lane, 6, evals={2, 4, 6})
    assert [g for g in got if g[0] == "eval"] == [("eval", 2, 2.0), ("eval", 4, 4.0), ("eval", 6, 6.0)]
    log = [e for e in engine.log if e[0] != "sync"]
    assert log.index(("eval", 2)) == log.index(("collect", 5, 2)) - 1  # batch 5 = 2 + k + 1 comes right after
    assert log[-1] == ("eval", 6)  # the last step's evaluation, with no batch after it


def test_a_resumed_lane_starts_from_the_weights_the_checkpoint_held(lane_of):
    engine = Engine(version=5)  # the engine holds the policy's weights after step 5
    lane = lane_of(engine, k=2, first=6, last=9, weights={3: {"v": 3}, 4: {"v": 4}, 5: {"v": 5}})
    assert _train(lane, 9, first=6) == [(6, 3), (7, 4), (8, 5), (9, 6)]


def test_a_checkpoint_keeps_the_versions_of_the_batches_in_flight_and_no_others(lane_of):
    engine = Engine()
    lane = lane_of(engine, k=2, last=8)
    _train(lane, 5)
    assert sorted(lane.lagged(5)) == [3, 4]
    assert sorted(lane._weights) == [3, 4, 5]  # older versions are let go


def test_a_failure_on_the_lane_is_raised_where_the_trainer_waits(lane_of):
    engine = Engine()
    lane = lane_of(engine, k=1, fail_at=3)
    assert [lane.next_batch(s)[0].step for s in (1, 2)] == [1, 2]
    lane.publish(1, {"v": 1})
    with pytest.raises(ValueError, match="a reward function broke"):
        lane.next_batch(3)


def test_closing_a_lane_that_waits_for_weights_is_prompt(lane_of):
    engine = Engine()
    lane = lane_of(engine, k=1, last=8)
    lane.next_batch(1), lane.next_batch(2)  # batch 3 needs version 1, which never comes
    start = time.perf_counter()
    lane.close(timeout=5)
    assert time.perf_counter() - start < 1 and not lane._thread.is_alive()


class OtherLaneStops:
    """Two processes' `Dist` as one lane sees it: the other process's lane is stopping from its `after`-th
    decision on (its trainer closed it a moment earlier)."""

    world_size, rank = 2, 0

    def __init__(self, after):
        self.after, self.decisions = after, 0

    def any(self, flag):
        self.decisions += 1
        return flag or self.decisions >= self.after

    def max(self, x):
        return x


@pytest.mark.parametrize("mode", ["fixed", "freshest"])
def test_lanes_stop_together_so_none_starts_a_batch_the_others_never_join(lane_of, mode):
    engine = Engine()
    dist = OtherLaneStops(after=3)
    # every version this lane needs is there: alone, it would sample all 8 batches at once
    lane = lane_of(engine, k=1, mode=mode, last=8, dist=dist, weights={v: {"v": v} for v in range(8)})
    lane._thread.join(5)
    assert not lane._thread.is_alive() and dist.decisions == 3
    assert [x[1] for x in engine.log if x[0] == "collect"] == [1, 2]  # the third batch was never begun


def test_an_item_put_as_the_lane_ends_is_taken_not_lost(lane_of):
    import queue

    lane = lane_of(Engine(), k=1, last=1)
    lane._thread.join(5)  # it put batch 1 and ended

    class Late(queue.Queue):  # the item lands between the trainer's timed wait and its look at the thread
        def get(self, block=True, timeout=None):
            if block and timeout:
                raise queue.Empty
            return super().get(block, timeout)

    late = Late()
    late.put(lane._batches.get())
    lane._batches = late
    assert lane.next_batch(1)[0].step == 1


def test_a_batch_older_than_its_bound_is_refused_before_the_update():
    import torch

    from grpo.trainer import _check_fresh

    class Rows:
        def __init__(self, versions):
            self.version = torch.tensor(versions)

        def __len__(self):
            return len(self.version)

    _check_fresh(Rows([2, 2, 3]), step=5, k=2)  # bound: 5 - 1 - 2 = 2
    with pytest.raises(RuntimeError, match="step 5 was handed rows sampled by the weights of step 1, older than "
                                           "rollout.max_staleness=2 allows"):
        _check_fresh(Rows([2, 1]), step=5, k=2)
