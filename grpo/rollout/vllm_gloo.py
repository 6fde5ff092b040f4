"""grpo's weight-transfer engine for vLLM servers, `grpo_gloo` (`vllm_server.weight_transfer=gloo`): vLLM's
weight-transfer protocol with a gloo group instead of NCCL, for servers on CPUs (or GPUs without NCCL between
them and the trainer). This module runs inside a vLLM worker: vLLM creates the engine when the server starts with
`--weight-transfer-config '{"backend": "grpo_gloo"}'` (`grpo serve` and launched servers on a CPU), after
`grpo.rollout.vllm_worker` registered it. The trainer's side is `grpo.rollout.vllm_transfer.GlooSender`.

Like vLLM's NCCL engine, an update loads the received tensors through the model's `load_weights` inside vLLM's
layerwise reload (`start_weight_update` ... `finish_weight_update`); on a CPU the prepacked LM head is rebuilt
after it, as after an in-place reload from files."""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)

from grpo.rollout.vllm_transfer import address_towards, buckets, empty_run, gloo_group, split_run


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float = 600.0


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    bucket_bytes: int

    def __post_init__(self):
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(f"names, dtype_names and shapes differ in length: {len(self.names)}, "
                             f"{len(self.dtype_names)}, {len(self.shapes)}")


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group = None
        self.store = None

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        """Join the trainer's group (a new trainer replaces the last one's group)."""
        self.shutdown()
        p = self.parallel_config
        rank = init_info.rank_offset + p.data_parallel_index * p.world_size + p.rank
        address = address_towards(init_info.master_address)  # this worker's, on the route to the trainer
        self.store = torch.distributed.TCPStore(init_info.master_address, init_info.master_port,
                                                init_info.world_size, is_master=False,
                                                timeout=timedelta(seconds=init_info.timeout_s))
        self.group = gloo_group(self.store, rank, init_info.world_size, address, init_info.timeout_s)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload
        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        from grpo.rollout.vllm_common import refresh_cpu_heads
        finalize_layerwise_reload(self.model, self.model_config)
        refresh_cpu_heads(self.model)

    def update_weights(self, update_info: dict) -> None:
        self.receive_weights(self.parse_update_info(update_info))  # gloo is synchronous: nothing to wait for
        if self.device.type != "cpu":
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("the grpo_gloo weight transfer is not initialized: call init_weight_transfer_engine")
        metas = list(zip(update_info.names, update_info.dtype_names, update_info.shapes))
        for run in buckets(metas, update_info.bucket_bytes):
            flat = empty_run(metas, run)  # gloo carries CPU tensors
            self.group.broadcast(flat, 0).wait()
            self.model.load_weights(split_run(flat.to(self.device), metas, run))

    def shutdown(self) -> None:
        if self.group is not None:
            try:
                self.group.shutdown()
            except Exception:  # noqa: BLE001 - the trainer already gone
                pass
        self.group = self.store = None
