"""The vLLM backend's names under the module that held them before it was split: what any vLLM backend shares
is in `grpo.rollout.vllm_common`, the colocated engine (`rollout.backend=vllm`) in `grpo.rollout.vllm_colocate`.
Kept so that code importing from here goes on working."""
from grpo.rollout.vllm_colocate import VLLMGenerator, _Worker
from grpo.rollout.vllm_common import INSTALL, EngineError, engine_weights, import_vllm

__all__ = ["INSTALL", "EngineError", "VLLMGenerator", "_Worker", "engine_weights", "import_vllm"]
