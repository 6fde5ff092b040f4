"""Process groups: the only module that talks to torch.distributed.

`torchrun --nproc_per_node=N -m grpo train ...` sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT; `init_from_env` joins that group with NCCL when CUDA is available and gloo otherwise, and
`process_group` holds it for the length of a run (`grpo train`, and `grpo.train(cfg)` called without a `dist`).
With one process (plain `grpo train`) every helper is the identity, so the trainer has a single code path.

The policy's `LogprobModule` (`grpo.policy`) is wrapped for training by `wrap_for_training`:
DistributedDataParallel by default, or FSDP2 (`torch.distributed.fsdp.fully_shard`, one unit per decoder layer
plus the root) with `compute.sharding=fsdp`.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from grpo.policy import ForwardPath, LogprobModule


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str = ""
    # the process group its collectives run in: None is torchrun's (the default group); `own_group` makes another
    # over the same processes, for a thread whose collectives must not interleave with the trainer's
    group: object = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    def sum(self, x: float) -> float:
        """Sum of a number over all processes."""
        if self.world_size == 1:
            return x
        import torch.distributed as td
        t = torch.tensor([x], dtype=torch.float64, device=self.device)
        td.all_reduce(t, group=self.group)
        return t.item()

    def max(self, x: float) -> float:
        """Largest value of a number over all processes."""
        if self.world_size == 1:
            return x
        import torch.distributed as td
        t = torch.tensor([x], dtype=torch.float64, device=self.device)
        td.all_reduce(t, op=td.ReduceOp.MAX, group=self.group)
        return t.item()

    def any(self, flag: bool) -> bool:
        """True on every process if `flag` is true on any of them."""
        return self.sum(1.0 if flag else 0.0) > 0

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenation of an equally sized 1-D tensor from every process, in rank order."""
        if self.world_size == 1:
            return x
        import torch.distributed as td
        src = x.detach().to(self.device).contiguous()
        parts = [torch.empty_like(src) for _ in range(self.world_size)]
        td.all_gather(parts, src, group=self.group)
        return torch.cat(parts).to(x.device)

    def gather_objects(self, obj) -> list:
        """Every process's picklable `obj`, in rank order (a one-item list with one process)."""
        if self.world_size == 1:
            return [obj]
        import torch.distributed as td
        out = [None] * self.world_size
        td.all_gather_object(out, obj, group=self.group)
        return out

    def exchange(self, parts: list) -> list:
        """Picklable objects from every process to every process: `parts[d]` goes to process d (one entry per
        process); returns what each process sent to this one, in rank order. Nothing goes where it is not sent."""
        if len(parts) != self.world_size:
            raise ValueError(f"exchange needs one part per process ({self.world_size}), got {len(parts)}")
        if self.world_size == 1:
            return list(parts)
        import torch.distributed as td
        out = []
        for src in range(self.world_size):  # each process in turn scatters its parts
            got = [None]
            td.scatter_object_list(got, list(parts) if self.rank == src else None, src=src, group=self.group)
            out.append(got[0])
        return out

    def barrier(self) -> None:
        if self.world_size > 1:
            import torch.distributed as td
            td.barrier(group=self.group)

    def own_group(self) -> Dist:
        """This Dist over a process group of its own (gloo, the same processes; every process calls it, as a
        collective): collectives in it may run on another thread at the same time as the trainer's in the default
        group, each group's in the same order on every process. With one process, itself."""
        if self.world_size == 1:
            return self
        import torch.distributed as td
        return replace(self, group=td.new_group(backend="gloo"), backend="gloo")


@contextlib.contextmanager
def process_group() -> Iterator[Dist]:
    """This process's `Dist` for the length of a run: the group torchrun describes in the environment, or the
    one-process Dist without torchrun. `grpo train` and the library's `train(cfg)` both run inside it, so a script
    launched with torchrun is one run on N processes, not N runs racing on one directory. At a normal end every
    process waits for the others before the group is left; a group joined before (by the caller) is left alone."""
    joins = int(os.environ.get("WORLD_SIZE", "1")) > 1 and not _initialized()
    dist = init_from_env()
    try:
        yield dist
        dist.barrier()  # every process has finished its run before the group goes
    finally:
        if joins:
            shutdown(dist)


def _initialized() -> bool:
    import torch.distributed as td
    return td.is_available() and td.is_initialized()


def init_from_env() -> Dist:
    """Join the process group that torchrun describes in the environment, or return the one-process Dist."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Dist()
    import torch.distributed as td

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    if not td.is_initialized():
        td.init_process_group(backend)
    return Dist(td.get_rank(), td.get_world_size(), local_rank, backend)


def shutdown(dist: Dist) -> None:
    if dist.world_size > 1:
        import torch.distributed as td
        if td.is_initialized():
            td.destroy_process_group()


def wrap_for_training(model, dist: Dist, sharding: str, path: ForwardPath, *,
                      train_mode: bool = False) -> torch.nn.Module:
    """The module the training forward runs through: a `LogprobModule` computing as `path` says, plain, in DDP,
    or over FSDP2-sharded parameters (in place; `path` must then be `forward_path(..., sharded=True)`)."""
    module = LogprobModule(model, path, train_mode=train_mode)
    if sharding == "fsdp":
        import torch.distributed as td
        from torch.distributed.fsdp import fully_shard
        if not td.is_initialized():  # FSDP2 with one process (plain `grpo train`, no torchrun): a group of one
            td.init_process_group("nccl" if next(model.parameters()).is_cuda else "gloo", store=td.HashStore(),
                                  rank=0, world_size=1)
        for layer in _decoder_layers(model):
            fully_shard(layer)
        fully_shard(model)
        return module
    if dist.world_size == 1:
        return module
    from torch.nn.parallel import DistributedDataParallel
    ids = [dist.local_rank] if dist.backend == "nccl" else None
    return DistributedDataParallel(module, device_ids=ids)


def _decoder_layers(model) -> list[torch.nn.Module]:
    decoder = model.get_decoder()
    layers = getattr(decoder, "layers", None)
    return list(layers) if layers is not None else []


def no_sync(module: torch.nn.Module, skip: bool):
    """DDP: skip the gradient all-reduce of this backward pass (all micro-batches but the last)."""
    if skip and hasattr(module, "no_sync"):
        return module.no_sync()
    return contextlib.nullcontext()
