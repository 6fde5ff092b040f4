"""The trainer's side of vLLM's weight-transfer protocol (`vllm_server.weight_transfer`): the policy's weights go
to a vLLM server's workers as a broadcast over a process group of the trainer's first process and the server's
workers, driven through the server's endpoints (dev mode):

    /init_weight_transfer_engine     once: the server's workers join the trainer's group
    /start_weight_update             every sync: the workers get ready to load a checkpoint layer by layer
    /update_weights                  every sync, while the trainer broadcasts: the workers receive and load
    /finish_weight_update            every sync: the layers are finished (vLLM's processing after loading)

- `nccl` is vLLM's own engine on both sides (`NCCLTrainerWeightTransferEngine` here, `NCCLWeightTransferEngine` in
  the server): GPU to GPU.
- `gloo` is the same protocol over TCP (`GlooSender` here, `grpo.rollout.vllm_gloo.GlooWeightTransferEngine` in the
  server, registered in vLLM's engine registry under the name GLOO by the worker extension that `grpo serve`
  loads): the weights travel as flat buffers of up to BUCKET_BYTES, the tensors of a buffer back to back in the
  order the update names them (`buckets` cuts them alike on both sides).

The group's rendezvous is a TCPStore on this process, listening on the address the servers reach it by
(loopback for servers on loopback); it is open only while the servers join. This module imports no vLLM at its
top (`nccl` imports vLLM's trainer engine when it is asked for): the trainer of a gloo or file run needs none.
"""
from __future__ import annotations

import math
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import torch

GLOO = "grpo_gloo"  # the name of grpo's engine in vLLM's WeightTransferEngineFactory
SERVER_BACKEND = {"gloo": GLOO, "nccl": "nccl"}  # vllm_server.weight_transfer -> the server's engine
BUCKET_BYTES = 64 * 2**20
_ABANDONED: list = []  # the groups of failed transfers (`GlooSender.close`)


def buckets(metas: list[tuple[str, str, list[int]]], limit: int = BUCKET_BYTES) -> list[list[int]]:
    """The indices of `metas` ((name, dtype name, shape) per tensor, in the update's order) cut into runs of one
    dtype and at most `limit` bytes (a tensor larger than `limit` is a run of its own): one broadcast each."""
    out: list[list[int]] = []
    size, dtype = 0, None
    for i, (_, dtype_name, shape) in enumerate(metas):
        nbytes = math.prod(shape) * getattr(torch, dtype_name).itemsize
        if not out or dtype_name != dtype or size + nbytes > limit:
            out.append([])
            size, dtype = 0, dtype_name
        out[-1].append(i)
        size += nbytes
    return out


def empty_run(metas: list[tuple[str, str, list[int]]], run: list[int], device=None) -> torch.Tensor:
    """The flat buffer that receives one run of `buckets`."""
    return torch.empty(sum(math.prod(metas[i][2]) for i in run), dtype=getattr(torch, metas[run[0]][1]),
                       device=device)


def split_run(flat: torch.Tensor, metas: list[tuple[str, str, list[int]]], run: list[int]
              ) -> list[tuple[str, torch.Tensor]]:
    """A received run's tensors, (name, view of `flat`) in the update's order."""
    out, at = [], 0
    for i in run:
        name, _, shape = metas[i]
        n = math.prod(shape)
        out.append((name, flat[at:at + n].view(shape)))
        at += n
    return out


def gloo_group(store, rank: int, world: int, address: str, timeout_s: float):
    """A gloo process group of `world` members on `store`, this process being `rank`, its connections on the
    interface of `address` (the one the group's members reach each other by)."""
    from torch.distributed import PrefixStore, ProcessGroupGloo

    options = ProcessGroupGloo._Options()
    options._timeout = timedelta(seconds=timeout_s)
    options._devices = [ProcessGroupGloo.create_device(hostname=address)]
    return ProcessGroupGloo(PrefixStore("grpo-weights", store), rank, world, options)


def address_towards(host: str) -> str:
    """This machine's address on the route to `host` (the loopback address for a host on loopback)."""
    if host in ("127.0.0.1", "localhost", "::1"):
        return "::1" if host == "::1" else "127.0.0.1"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # UDP: nothing is sent, the kernel only picks the route
        return s.getsockname()[0]


def _broadcast_wait(work, pending, deadline: float, what: str) -> None:
    """Wait for a broadcast, but not on a server whose /update_weights already failed (it will never join)."""
    while not work.is_completed():
        if pending.done() and pending.exception() is not None:
            raise pending.exception()
        if time.monotonic() > deadline:
            raise TimeoutError(f"the weight broadcast to {what} did not finish in time")
        time.sleep(0.0005)
    work.wait()


class _Calls:
    """vLLM's VLLMWeightSyncClient protocol over grpo's client of one server (its API key, timeouts, errors)."""

    def __init__(self, client):
        self.client = client

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.client.call("POST", "/init_weight_transfer_engine", {"init_info": init_info},
                         what="join the trainer's weight-transfer group")

    def start_weight_update(self) -> None:
        self.client.call("POST", "/start_weight_update", what="start a weight update")

    def update_weights(self, update_info) -> None:
        self.client.call("POST", "/update_weights", {"update_info": update_info}, what="receive the trainer's weights")

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.client.call("POST", "/finish_weight_update", what="finish a weight update")


class GlooSender:
    """The trainer's end of a gloo group with one server's workers (rank 0 here, the workers after it)."""

    def __init__(self, client, workers: int, host: str, timeout_s: float):
        self.client, self.calls, self.timeout_s, self.broken = client, _Calls(client), timeout_s, False
        address = address_towards(host)
        listen = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET)
        listen.bind((address, 0))
        listen.listen(workers + 1)
        port = listen.getsockname()[1]
        self.world = 1 + workers
        try:
            store = torch.distributed.TCPStore(address, port, self.world, is_master=True,
                                               timeout=timedelta(seconds=timeout_s), wait_for_workers=False,
                                               master_listen_fd=listen.detach(), use_libuv=True)
        except BaseException:
            listen.close()
            raise
        info = {"master_address": address, "master_port": port, "rank_offset": 1, "world_size": self.world,
                "timeout_s": timeout_s}
        with ThreadPoolExecutor(max_workers=1) as pool:
            joined = pool.submit(self.calls.init_weight_transfer_engine, info)
            try:
                self.group = gloo_group(store, 0, self.world, address, timeout_s)
            except BaseException:
                if joined.done() and joined.exception() is not None:
                    raise joined.exception() from None
                raise
            joined.result()
        self.store = store  # the group's members keep talking to it

    def send(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Broadcast `weights` (name, tensor) into the server's model: start, update (the server receiving while
        this process broadcasts), finish."""
        metas = [(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in weights]
        info = {"names": [m[0] for m in metas], "dtype_names": [m[1] for m in metas], "shapes": [m[2] for m in metas],
                "bucket_bytes": BUCKET_BYTES}
        self.calls.start_weight_update()
        deadline = time.monotonic() + self.timeout_s
        try:
            with ThreadPoolExecutor(max_workers=1) as pool:
                received = pool.submit(self.calls.update_weights, info)
                for run in buckets(metas, BUCKET_BYTES):
                    parts = [weights[i][1].detach().reshape(-1).cpu() for i in run]
                    flat = parts[0] if len(parts) == 1 else torch.cat(parts)  # one tensor: itself, no copy
                    _broadcast_wait(self.group.broadcast(flat, 0), received, deadline, self.client.url)
                received.result()
        except BaseException:
            self.broken = True  # what was broadcast may wait for a server that will not receive it
            raise
        self.calls.finish_weight_update()

    def close(self) -> None:
        group = getattr(self, "group", None)
        if group is None:
            return
        self.group = None
        if self.broken:  # what was broadcast may still wait for a server that will not receive it: shutting the
            _ABANDONED.append(group)  # group down would wait for it (holding the GIL), so it is left to the exit
            return
        try:
            group.shutdown()
        except Exception:  # noqa: BLE001 - a peer already gone
            pass


class _Source:
    """The weights of one sync as vLLM's trainer engines read them: metadata, then the tensors in that order."""

    def __init__(self, weights: list[tuple[str, torch.Tensor]]):
        self.weights = weights

    def metadata(self):
        from vllm.distributed.weight_transfer.base import ParamMeta
        return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.weights]

    def held_names(self):
        return None

    def __iter__(self):
        return iter(self.weights)


class NcclSender:
    """vLLM's NCCL trainer engine for one server: the trainer's GPU broadcasts into the server's GPUs."""

    def __init__(self, client, workers: int, host: str, timeout_s: float):
        from vllm.distributed.weight_transfer.nccl_engine import (NCCLTrainerInitInfo,
                                                                   NCCLTrainerWeightTransferEngine)

        address = address_towards(host)
        with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as s:
            s.bind((address, 0))
            port = s.getsockname()[1]
        self.client = client
        self.engine = NCCLTrainerWeightTransferEngine.trainer_init(
            NCCLTrainerInitInfo(master_address=address, master_port=port, world_size=1 + workers, rank=0),
            client=_Calls(client), source=_Source([]))

    def send(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        self.engine.source = _Source(weights)
        self.engine.send_weights()

    def close(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
            self.engine = None


def open_sender(backend: str, client, workers: int, host: str, timeout_s: float):
    """The trainer's end of `backend` ('gloo' or 'nccl') with the server behind `client`, whose `workers` workers
    join it now."""
    return (NcclSender if backend == "nccl" else GlooSender)(client, workers, host, timeout_s)
