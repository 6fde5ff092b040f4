"""The frozen reference of the KL penalty, and its resets every `algo.ref_sync_every` steps (`grpo.algo.reference`
holds the rule; SPEC 13.6). Built once by the trainer; calling it each step does nothing unless a reset is due.

- A full model's reference is a frozen copy of the initial policy. A reset mixes the policy's full (unsharded)
  weights into it, on every process alike (under FSDP gathering them is a collective).
- With LoRA the reference is the same model with the adapter disabled. A reset moves α of the adapter's merged
  update into the base weights and scales B by 1 − α. The policy stays exactly what it was, and the adapter's
  AdamW moments are cleared, since B has changed scale (at α = 1 the adapter starts again from B = 0).

A checkpoint stores a full model's reference whenever resets are on (`reference.safetensors`), so a resume
continues with the reference exactly as it was. A LoRA reference is the base weights, which the model's
weights already hold.
"""
from __future__ import annotations

import torch

from grpo.algo.reference import mix_into, move_base_into_adapter_share
from grpo.policy.weights import full_model_state, tied_names


class ReferenceSync:
    def __init__(self, policy, reference_model, optimizer, *, every: int, alpha: float, lora: bool):
        """`reference_model`: the frozen copy (None with LoRA, or when there is no reference)."""
        self.policy, self.reference_model, self.optimizer = policy, reference_model, optimizer
        self.every, self.alpha, self.lora = every, alpha, lora

    def __call__(self, step: int) -> dict[str, float]:
        """Reset the reference if step `step` ends a period. The step's figure: {"ref/reset": 1.0} when it did,
        0.0 when resets are on and this step had none, nothing when they are off."""
        if not self.every:
            return {}
        if step % self.every:
            return {"ref/reset": 0.0}
        if self.lora:
            self._lora()
        else:
            self._full()
        return {"ref/reset": 1.0}

    def _full(self) -> None:
        weights = full_model_state(self.policy)  # every process: a collective under FSDP
        for name, ref in reference_weights(self.reference_model).items():
            mix_into(ref, weights[name].to(ref.device), self.alpha)

    def _lora(self) -> None:
        adapter = []
        for module in self.policy.modules():
            if not (hasattr(module, "get_delta_weight") and hasattr(module, "lora_B")):
                continue
            for name in module.active_adapters:
                if name not in module.lora_B:
                    continue
                b = module.lora_B[name].weight
                move_base_into_adapter_share(module.get_base_layer().weight, b, module.get_delta_weight(name),
                                             self.alpha)
                adapter += [b, module.lora_A[name].weight]
        for p in adapter:  # B changed scale: its moments (and A's, which were taken with the old B) start again
            self.optimizer.state.pop(p, None)


def reference_weights(model) -> dict[str, torch.Tensor]:
    """The reference copy's tensors by the names of the policy's full state dict (tied weights once)."""
    tied = tied_names(model)
    return {n: t for n, t in model.state_dict(keep_vars=True).items() if n not in tied}
