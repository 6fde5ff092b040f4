"""Process groups: the only module that talks to torch.distributed.

`torchrun --nproc_per_node=N -m grpo train ...` sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT; `init_from_env` joins that group with NCCL when CUDA is available and gloo otherwise. With one
process (plain `grpo train`) every helper is the identity, so the trainer has a single code path.

The model is wrapped for training by `wrap_for_training`: DistributedDataParallel by default, or FSDP2
(`torch.distributed.fsdp.fully_shard`, one unit per decoder layer plus the root) with `train.sharding=fsdp`.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str = ""

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
        td.all_reduce(t)
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
        td.all_gather(parts, src)
        return torch.cat(parts).to(x.device)

    def barrier(self) -> None:
        if self.world_size > 1:
            import torch.distributed as td
            td.barrier()


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


class LogprobModule(torch.nn.Module):
    """The policy as a module whose forward returns completion log-probs, so DDP and FSDP see the one forward
    pass the loss needs."""

    def __init__(self, model, *, fused: bool = True, adapter_off: bool = False, autocast_bf16: bool = False,
                 train_mode: bool = False, share_prompt: bool = False, lean: bool = False):
        """`fused`: log-probs from hidden states (False: full logits, which sharded parameters need).
        `adapter_off`: a LoRA model with its adapter disabled (the reference, without a second copy).
        `train_mode`: run the forward in train mode (gradient checkpointing needs it; dropout is off anyway).
        `share_prompt`: run each group's prompt once (see `grpo.forward`); it needs a KV cache, which gradient
        checkpointing in train mode switches off.
        `lean`: run supported models (Llama, Qwen2, Mistral) through `grpo.lean` (see `grpo.forward`)."""
        super().__init__()
        self.model = model
        self.fused = fused
        self.share_prompt = share_prompt
        self.lean = lean
        self.adapter_off = adapter_off
        self.autocast_bf16 = autocast_bf16
        self.train_mode = train_mode

    def forward(self, prompt_ids, prompt_mask, completion_ids, completion_mask, *, temperature: float,
                chunk_size: int) -> torch.Tensor:
        from grpo.forward import completion_logprobs
        with contextlib.ExitStack() as stack:
            if self.adapter_off:
                stack.enter_context(self.model.disable_adapter())
            stack.enter_context(torch.autocast(prompt_ids.device.type, dtype=torch.bfloat16,
                                               enabled=self.autocast_bf16))
            if self.train_mode and torch.is_grad_enabled():
                self.model.train()
                stack.callback(self.model.eval)
            return completion_logprobs(self.model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                       temperature=temperature, chunk_size=chunk_size, fused=self.fused,
                                       share_prompt=self.share_prompt, lean=self.lean)


def wrap_for_training(model, dist: Dist, sharding: str, **options) -> torch.nn.Module:
    """The module the training forward runs through: plain, DDP, or FSDP2-sharded (parameters in place).
    `options` go to `LogprobModule`."""
    if dist.world_size == 1 and sharding != "fsdp":
        return LogprobModule(model, **options)
    if sharding == "fsdp":
        from torch.distributed.fsdp import fully_shard
        for layer in _decoder_layers(model):
            fully_shard(layer)
        fully_shard(model)
        # sharded parameters are gathered by the root's forward: go through it (full logits, chunked log-probs)
        return LogprobModule(model, **{**options, "fused": False})
    from torch.nn.parallel import DistributedDataParallel
    ids = [dist.local_rank] if dist.backend == "nccl" else None
    return DistributedDataParallel(LogprobModule(model, **options), device_ids=ids)


def _decoder_layers(model) -> list[torch.nn.Module]:
    decoder = model.get_decoder()
    layers = getattr(decoder, "layers", None)
    return list(layers) if layers is not None else []


def is_sharded(module) -> bool:
    """Whether any of `module`'s parameters is an FSDP2 shard (a DTensor). Any, not the first: after a forward
    the root module's parameters (embeddings, final norm) can stay gathered as plain tensors while the decoder
    layers' are shards."""
    return hasattr(module, "parameters") and any(hasattr(p, "full_tensor") for p in module.parameters())


def inference(module: torch.nn.Module):
    """A context without autograd for forward passes through `module`: inference mode (no bookkeeping at all),
    except for FSDP2-sharded parameters, whose gathered buffers must stay usable by the training passes."""
    return torch.no_grad() if is_sharded(module) else torch.inference_mode()


def no_sync(module: torch.nn.Module, skip: bool):
    """DDP: skip the gradient all-reduce of this backward pass (all micro-batches but the last)."""
    if skip and hasattr(module, "no_sync"):
        return module.no_sync()
    return contextlib.nullcontext()
