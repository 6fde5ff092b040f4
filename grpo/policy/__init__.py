"""The policy's log-prob forward: `LogprobModule` and `completion_logprobs` (forward.py), the one decision of
how they run (`forward_path`), the lean Llama-family layers (lean.py), and the no-autograd context (context.py).
Nothing here knows about process groups: `grpo.distributed` wraps a `LogprobModule` for DDP or FSDP2.
Also the policy's weights as one whole (weights.py: `full_model_state`, `tied_names`), LoRA's merged weights
(lora.py) and the reference's resets (reference_sync.py: `ReferenceSync`)."""
from grpo.policy.context import inference, is_sharded
from grpo.policy.forward import (ForwardPath, LogprobModule, completion_logprobs, forward_path, packing_unavailable,
                                 prompt_groups)

__all__ = ["ForwardPath", "LogprobModule", "completion_logprobs", "forward_path", "inference", "is_sharded",
           "packing_unavailable", "prompt_groups"]
