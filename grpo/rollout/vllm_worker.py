"""What grpo adds to each worker of a vLLM server it samples from (`rollout.backend=vllm_server`): vLLM mixes this
class into its worker when the server starts with `--worker-extension-cls grpo.rollout.vllm_worker.WorkerExtension`
(`grpo serve` and the servers grpo launches do), and the trainer calls its methods through the server's
`/collective_rpc` endpoint (dev mode, `VLLM_SERVER_DEV_MODE=1`), whose arguments are strings.

This module runs inside vLLM's worker process: it imports vLLM's and torch's modules only, and
`grpo.rollout.vllm_common` for what the colocated engine does the same way. Imported, it registers grpo's gloo
weight-transfer engine (`grpo.rollout.vllm_gloo`) in vLLM's registry, before the worker loads its model and
creates the engine its `--weight-transfer-config` names."""
from __future__ import annotations

VERSION = "2"  # what `grpo_hello` answers: the calls below and their arguments, as this grpo makes them
# the config fields of the served model that the trainer's must equal before it sends its weights (a reload of
# weights of another shape fails half-way and leaves the server unusable)
SHAPE = ("architectures", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads", "vocab_size", "tie_word_embeddings", "model_type")


def shape_of(config) -> dict:
    """A transformers config's SHAPE fields (of its text model, for a multimodal one), as JSON carries them."""
    import json

    text = getattr(config, "get_text_config", lambda: config)()
    return json.loads(json.dumps({k: getattr(text, k, getattr(config, k, None)) for k in SHAPE}, default=str))


def _register_gloo() -> None:
    import sys
    if "vllm" not in sys.modules:  # the trainer, which reads VERSION and SHAPE, and imports no vLLM for them
        return
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from grpo.rollout.vllm_transfer import GLOO
    if GLOO not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(GLOO, "grpo.rollout.vllm_gloo", "GlooWeightTransferEngine")


_register_gloo()


class WorkerExtension:
    """Methods of a vLLM worker (`self` is vLLM's `Worker`)."""

    def grpo_hello(self) -> str:
        """Proof that the server runs grpo's extension, and which version of its calls."""
        return VERSION

    def grpo_describe(self) -> dict:
        """The served model's shape (`shape_of` its transformers config), and under "weight_transfer" the
        weight-transfer engine the server started with (None: none)."""
        transfer = self.vllm_config.weight_transfer_config
        return {**shape_of(self.model_runner.model_config.hf_config),
                "weight_transfer": None if transfer is None else transfer.backend}

    def grpo_load_weights(self, path: str) -> str:
        """Replace the model's weights in place with the safetensors files in the directory `path` (the policy's
        weights under the names of its transformers checkpoint, written by the trainer), and renew what the
        reload leaves stale on a CPU."""
        from grpo.rollout.vllm_common import refresh_cpu_heads

        self.reload_weights(weights_path=path, is_checkpoint_format=True)
        refresh_cpu_heads(self.model_runner.get_model())
        return "loaded"
