"""The colocated vLLM rollout backend (`rollout.backend=vllm`): one engine in each training process, on the
trainer's device.

The engine runs in the calling process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so a weight sync hands it the
policy's tensors directly, with no copy through another process. Under torchrun every rank has its own engine
(vLLM's `external_launcher`: it joins the process group torchrun made). What the engine needs (the pieces any
vLLM backend shares are `grpo.rollout.vllm_common`'s):

- **start**: a directory with the policy's config, tokenizer and current weights (written once, in a temporary
  directory), so any model vLLM supports starts from exactly what the trainer holds, LoRA merged;
- **sampling**: each prompt's n completions are seeded with that prompt's `sampling_seed`, and the engine's
  log-probs of the sampled tokens (after temperature, `processed_logprobs`) come back as `Rollout.sampler_logp`
  for the mismatch correction (SPEC 13.1);
- **sync**: after every training step (its μ optimiser updates) the policy's weights replace the engine's in
  place (vLLM's `reload_weights`): full weights as they are, LoRA merged (W + ΔW, computed without touching the
  policy), FSDP2 shards gathered (a collective: every rank calls it). The prefix cache is then dropped.

Every engine call runs on one worker thread and waits at most `vllm.timeout_s`: an engine that stops
answering ends the run with an `EngineError` instead of a hang.
"""
from __future__ import annotations

import queue
import tempfile
import threading
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from grpo.rollout.base import Rollout, Sampling, stop_tokens
from grpo.rollout.vllm_common import (EngineError, engine_weights, first_line, import_vllm, max_positions,
                                      prepare_prompts, refresh_cpu_heads, rows_from_outputs, sampling_params,
                                      write_start)


class _Worker:
    """One daemon thread that runs every engine call, each waited for at most `timeout` seconds."""

    def __init__(self, timeout: float, threads: int):
        self.timeout = timeout
        self.jobs: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._loop, args=(threads,), name="grpo-vllm", daemon=True)
        self.thread.start()
        self.stuck = False

    def _loop(self, threads: int) -> None:
        torch.set_num_threads(threads)  # a new thread starts with the default; match the trainer's
        while True:
            fn, box, done = self.jobs.get()
            try:
                box.append((True, fn()))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                box.append((False, e))
            done.set()

    def call(self, fn: Callable, what: str):
        if self.stuck:
            raise EngineError(f"the vLLM engine did not finish an earlier call; cannot {what}")
        box: list = []
        done = threading.Event()
        self.jobs.put((fn, box, done))
        if not done.wait(self.timeout):
            self.stuck = True
            raise EngineError(f"the vLLM engine did not {what} within vllm.timeout_s={self.timeout:g} s")
        ok, value = box[0]
        if not ok:
            raise value
        return value


class VLLMGenerator:
    """Sampling with a vLLM engine that holds a copy of the policy's weights, replaced by `sync_weights`."""

    def __init__(self, model, tokenizer, *, vllm_cfg, dtype: str = "float32", seed: int = 0,
                 add_special_tokens: bool = True, distributed: bool = False):
        """`vllm_cfg`: the `vllm.*` config section (`grpo.config.VLLMConfig`). `distributed`: this process is
        one of several that torchrun started (the engine then joins their process group)."""
        vllm = import_vllm()
        self.tokenizer = tokenizer
        self.add_special_tokens = add_special_tokens
        self.cfg = vllm_cfg
        self.eos_ids, self.pad_id = stop_tokens(model, tokenizer)
        self.device = next(model.parameters()).device
        self._broken = ""
        self._worker = _Worker(vllm_cfg.timeout_s, vllm_cfg.threads or torch.get_num_threads())
        self._own_group = torch.distributed.is_available() and torch.distributed.is_initialized()
        self._dir = tempfile.TemporaryDirectory(prefix="grpo-vllm-")
        write_start(model, tokenizer, Path(self._dir.name))  # every rank (the FSDP gather is collective)
        kwargs = dict(model=self._dir.name, dtype=dtype, seed=seed, enforce_eager=vllm_cfg.enforce_eager,
                      max_model_len=vllm_cfg.max_model_len or None, logprobs_mode="processed_logprobs",
                      disable_log_stats=True)
        if self.device.type == "cuda":
            kwargs["gpu_memory_utilization"] = vllm_cfg.gpu_memory_utilization
        else:
            if vllm_cfg.kv_cache_gib:
                kwargs["kv_cache_memory_bytes"] = int(vllm_cfg.kv_cache_gib * 2**30)
            # a prefill split over engine steps rewinds the request's seeded generator, which a CPU generator
            # cannot do ("CPU Generator does not use offset"): prefill every prompt in one step
            longest = vllm_cfg.max_model_len or max_positions(model)
            kwargs.update(enable_chunked_prefill=False, max_num_batched_tokens=max(longest, 16384))
        if distributed:
            kwargs["distributed_executor_backend"] = "external_launcher"
        set_threads = torch.set_num_threads  # vLLM's CPU worker replaces it with a no-op; the trainer needs it
        try:
            self.llm = self._worker.call(lambda: vllm.LLM(**kwargs), "start")
        except EngineError:
            raise
        except Exception as e:  # noqa: BLE001 - an unsupported architecture, too little memory, ...
            why = first_line(e).replace("1 validation error for ModelConfig Value error, ", "")
            if " Supported architectures:" in why:  # not the whole list of vLLM's models on one line
                why = why.split(" Supported architectures:")[0] + " (vLLM's list: docs.vllm.ai, Supported Models)"
            self._dir.cleanup()
            raise EngineError(f"the vLLM engine did not start for this model: {why}") from None
        finally:
            torch.set_num_threads = set_threads
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len
        self.version = 0

    # ---- the Generator protocol

    def sync_weights(self, model, version: int | None = None) -> None:
        """Replace the engine's weights with the policy's (every rank calls it under FSDP), whose version is
        `version` (None: one more than now)."""
        weights = list(engine_weights(model))
        if self.device.type == "cuda":  # the engine's thread reads tensors this stream may still be writing
            torch.cuda.current_stream().synchronize()

        def load():
            self.llm.collective_rpc("reload_weights",
                                    kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
            _refresh_cpu_heads(self.llm)
            self.llm.reset_prefix_cache()

        self._check_usable()
        try:
            self._worker.call(load, "take the new weights")
        except EngineError:
            raise
        except Exception as e:  # noqa: BLE001
            # a reload that failed half-way leaves some layers new and some old: the engine is not used again
            self._broken = f"its weights are in an unknown state after a failed sync ({first_line(e)})"
            raise EngineError(f"the vLLM engine could not take the new weights: {first_line(e)}") from None
        self.version = self.version + 1 if version is None else version

    def _check_usable(self) -> None:
        if self._broken:
            raise EngineError(f"the vLLM engine cannot be used: {self._broken}")

    def generate(self, prompts: list[str] | list[list[int]], sampling: Sampling,
                 seeds: Sequence[int] | None = None, limits: Sequence[int] | None = None) -> Rollout:
        """n completions per prompt (texts, or token ids used as they are), prompt i's seeded by seeds[i] and
        limited to limits[i] new tokens; with temperature > 0 the engine's log-probs of the sampled tokens come
        back as `sampler_logp`."""
        from vllm.inputs import TokensPrompt

        self._check_usable()
        ids, seeds, limits = prepare_prompts(self.tokenizer, prompts, sampling, seeds, limits,
                                             add_special_tokens=self.add_special_tokens,
                                             max_model_len=self.max_model_len, who="the vLLM engine's")
        params = sampling_params(sampling, seeds, limits, self.eos_ids)
        requests = [TokensPrompt(prompt_token_ids=x) for x in ids]

        def run():
            # a batch never reuses blocks an earlier batch cached (a group still shares its prompt's): what a
            # call samples depends on its prompts and seeds, not on the calls before it, so a resumed run
            # samples as the uninterrupted one did
            self.llm.reset_prefix_cache()
            return self.llm.generate(requests, params, use_tqdm=False)

        try:
            outs = self._worker.call(run, "sample")
        except EngineError:
            raise
        except Exception as e:  # noqa: BLE001
            raise EngineError(f"the vLLM engine failed while sampling: {first_line(e)}") from None
        return rows_from_outputs(outs, ids, sampling.n, with_logp=sampling.temperature > 0, tokenizer=self.tokenizer,
                                 pad_id=self.pad_id, device=self.device, version=self.version, stop=sampling.stop)

    def close(self) -> None:
        """Shut the engine down (idempotent; errors are warnings). A process group the trainer made is left
        alone: vLLM's own shutdown would destroy it."""
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        self.llm = None
        if self._worker.stuck:  # its thread is still inside the engine: leave it, and disarm vLLM's exit hook
            _disarm(llm)
            return
        from vllm.distributed import parallel_state

        def shutdown():
            keep = parallel_state.destroy_distributed_environment
            if self._own_group:  # destroy vLLM's groups only, not the default one torchrun's processes share
                def destroy_vllm_groups():
                    if parallel_state._WORLD:
                        parallel_state._WORLD.destroy()
                    parallel_state._WORLD = None
                parallel_state.destroy_distributed_environment = destroy_vllm_groups
            try:
                llm.llm_engine.engine_core.shutdown()
            finally:
                parallel_state.destroy_distributed_environment = keep

        try:
            self._worker.call(shutdown, "shut down")
        except Exception as e:  # noqa: BLE001 - never hides the error that ended the run
            warnings.warn(f"the vLLM engine did not shut down cleanly: {first_line(e)}", stacklevel=2)
            _disarm(llm)
        finally:
            self._dir.cleanup()


def _disarm(llm) -> None:
    """Detach vLLM's at-exit shutdown, which would destroy process groups after torchrun's are gone."""
    finalizer = getattr(getattr(llm.llm_engine, "engine_core", None), "_finalizer", None)
    if finalizer is not None:
        finalizer.detach()


def _refresh_cpu_heads(llm) -> None:
    """vLLM 0.32 on the CPU keeps prepacked weights its in-place reload does not renew (vllm_common's
    `refresh_cpu_heads`); rebuild them in the engine's model. Nothing to do on a GPU."""
    llm.apply_model(refresh_cpu_heads)
