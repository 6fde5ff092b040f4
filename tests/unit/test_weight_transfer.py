"""The trainer's side of the gloo weight transfer (grpo/rollout/vllm_transfer.py) without a server: how an
update is cut into broadcasts, and a group of the trainer and a stand-in worker on 127.0.0.1 that receives the
tensors exactly as `grpo.rollout.vllm_gloo` does (the engine itself runs inside real servers in
tests/integration/test_vllm_server.py)."""
import time
from datetime import timedelta

import pytest
import torch

from grpo.rollout.vllm_transfer import BUCKET_BYTES, GlooSender, buckets, empty_run, gloo_group, split_run


def test_an_update_is_cut_into_runs_of_one_dtype_and_at_most_the_limit():
    metas = [("a", "float32", [4, 4]), ("b", "float32", [8]), ("c", "bfloat16", [2]), ("d", "bfloat16", [3]),
             ("e", "float32", [100]), ("f", "float32", [1])]
    # 64 + 32 bytes fit 100, the dtype changes at c, e alone is over the limit and is a run of its own
    assert buckets(metas, 100) == [[0, 1], [2, 3], [4], [5]]
    assert buckets(metas, BUCKET_BYTES) == [[0, 1], [2, 3], [4, 5]]
    assert buckets([], 100) == []


class _Worker:
    """A vLLM server's endpoints as the sender calls them, its one worker receiving as GlooWeightTransferEngine."""

    url = "http://stand-in"

    def __init__(self):
        self.received, self.calls, self.group = [], [], None

    def call(self, method, path, body=None, *, what, timeout=None, params=None):
        self.calls.append(path)
        if path == "/init_weight_transfer_engine":
            info = body["init_info"]
            store = torch.distributed.TCPStore(info["master_address"], info["master_port"], info["world_size"],
                                               is_master=False, timeout=timedelta(seconds=30))
            self.group = gloo_group(store, info["rank_offset"], info["world_size"], "127.0.0.1", 30)
        elif path == "/update_weights":
            u = body["update_info"]
            metas = list(zip(u["names"], u["dtype_names"], u["shapes"]))
            for run in buckets(metas, u["bucket_bytes"]):
                flat = empty_run(metas, run)
                self.group.broadcast(flat, 0).wait()
                self.received += split_run(flat, metas, run)


def test_the_weights_arrive_bit_for_bit_in_their_order():
    worker = _Worker()
    sender = GlooSender(worker, 1, "127.0.0.1", 30)
    try:
        g = torch.Generator().manual_seed(0)
        weights = [("embed", torch.randn(50, 8, generator=g)), ("norm", torch.randn(8, generator=g).bfloat16()),
                   ("head", torch.randn(8, 50, generator=g).t())]  # not contiguous
        for _ in range(2):  # the group serves every sync
            worker.received = []
            sender.send(weights)
            assert [n for n, _ in worker.received] == ["embed", "norm", "head"]
            assert all(torch.equal(a, b) and a.dtype == b.dtype for (_, a), (_, b) in zip(weights, worker.received))
        assert worker.calls == ["/init_weight_transfer_engine"] + ["/start_weight_update", "/update_weights",
                                                                   "/finish_weight_update"] * 2
    finally:
        sender.close()


def test_a_server_that_refuses_the_update_stops_the_broadcast_at_once():
    class Refusing(_Worker):
        def call(self, method, path, body=None, **kw):
            if path == "/update_weights":
                raise RuntimeError("refused to receive the trainer's weights")
            return super().call(method, path, body, **kw)

    sender = GlooSender(Refusing(), 1, "127.0.0.1", 600)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="refused to receive"):
        sender.send([("w", torch.ones(3))])
    sender.close()  # the group left as it is: its broadcast waits for a peer that never receives
    assert time.monotonic() - start < 60  # not the group's 600 s timeout
