"""Rollouts with vLLM (`rollout.backend=vllm`): one engine in each training process, on the trainer's device.

The engine runs in the calling process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so a weight sync hands it the
policy's tensors directly, with no copy through another process. Under torchrun every rank has its own engine
(vLLM's `external_launcher`: it joins the process group torchrun made). What the engine needs:

- **start**: a directory with the policy's config, tokenizer and current weights (written once, in a temporary
  directory), so any model vLLM supports starts from exactly what the trainer holds, LoRA merged;
- **sampling**: each prompt's n completions are seeded with that prompt's `sampling_seed`, and the engine's
  log-probs of the sampled tokens (after temperature, `processed_logprobs`) come back as `Rollout.sampler_logp`
  for the mismatch correction (SPEC 13.1);
- **sync**: after every training step (its μ optimiser updates) the policy's weights replace the engine's in place (vLLM's
  `reload_weights`): full weights as they are, LoRA merged (W + ΔW, computed without touching the policy),
  FSDP2 shards gathered (a collective: every rank calls it). The prefix cache is then dropped.

Every engine call runs on one worker thread and waits at most `vllm.timeout_s`: an engine that stops
answering ends the run with an `EngineError` instead of a hang.
"""
from __future__ import annotations

import os
import queue
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

from grpo.errors import DataError, GRPOError
from grpo.policy.lora import lora_merged_weight
from grpo.rollout.base import Rollout, Sampling, encode_prompts, prompt_limits, prompt_seeds, stop_tokens

INSTALL = "pip install -e '.[vllm]' (or: make setup-vllm)"


class EngineError(GRPOError):
    """The vLLM engine failed to start, to sample or to take new weights, or did not answer in time."""


def import_vllm():
    """The vllm module, or a ConfigError that names the install command."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine lives in this process (weights are handed over)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")   # leave the trainer's threads alone
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from grpo.errors import ConfigError
    try:
        import vllm
    except ImportError as e:
        raise ConfigError(f"rollout.backend=vllm needs vLLM, which is not installed ({e}); install it with "
                          f"{INSTALL}") from None
    except Exception as e:  # noqa: BLE001 - e.g. a torchvision built for another torch
        raise ConfigError(f"vLLM is installed but cannot be imported: {_first_line(e)}; reinstall it with "
                          f"{INSTALL}, which also removes the torchvision/torchaudio builds that break it") from None
    return vllm


def engine_weights(model) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's weights under the names of its transformers checkpoint, whole, detached: a LoRA model's
    adapted weights merged (W + ΔW; the policy itself is not touched), FSDP2 shards gathered (a collective)."""
    lora = hasattr(model, "peft_config") and hasattr(model, "get_base_model")
    layers = {}
    if lora:
        from peft.tuners.lora import Embedding, Linear, LoraLayer
        layers = {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}
        other = sorted({type(m).__name__ for m in layers.values() if not isinstance(m, (Linear, Embedding))})
        if other:
            raise DataError(f"cannot merge LoRA layers of type {', '.join(other)} for the vLLM engine; adapt "
                            "linear and embedding layers only (lora.target_modules)")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if lora:
                if ".lora_" in name:
                    continue
                owner = name.rsplit(".", 2)[0] if ".base_layer." in name else None
                if owner in layers and name.endswith(".base_layer.weight"):
                    p = lora_merged_weight(layers[owner])  # W + ΔW, as the adapted layer computes it
                name = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
            t = p.detach()
            if hasattr(t, "full_tensor"):  # FSDP2: every rank gathers the whole tensor
                t = t.full_tensor()
            yield name, t


def _max_positions(model) -> int:
    return int(getattr(_base_config(model), "max_position_embeddings", 0) or 32768)


def _base_config(model):
    return (model.get_base_model() if hasattr(model, "get_base_model") else model).config


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
        self._worker = _Worker(vllm_cfg.timeout_s, torch.get_num_threads())
        self._own_group = torch.distributed.is_available() and torch.distributed.is_initialized()
        self._dir = tempfile.TemporaryDirectory(prefix="grpo-vllm-")
        self._write_start(model, tokenizer, Path(self._dir.name))  # every rank (the FSDP gather is collective)
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
            longest = vllm_cfg.max_model_len or _max_positions(model)
            kwargs.update(enable_chunked_prefill=False, max_num_batched_tokens=max(longest, 16384))
        if distributed:
            kwargs["distributed_executor_backend"] = "external_launcher"
        set_threads = torch.set_num_threads  # vLLM's CPU worker replaces it with a no-op; the trainer needs it
        try:
            self.llm = self._worker.call(lambda: vllm.LLM(**kwargs), "start")
        except EngineError:
            raise
        except Exception as e:  # noqa: BLE001 - an unsupported architecture, too little memory, ...
            why = _first_line(e).replace("1 validation error for ModelConfig Value error, ", "")
            if " Supported architectures:" in why:  # not the whole list of vLLM's models on one line
                why = why.split(" Supported architectures:")[0] + " (vLLM's list: docs.vllm.ai, Supported Models)"
            self._dir.cleanup()
            raise EngineError(f"the vLLM engine did not start for this model: {why}") from None
        finally:
            torch.set_num_threads = set_threads
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len

    @staticmethod
    def _write_start(model, tokenizer, path: Path) -> None:
        """What the engine starts from: the config, tokenizer and current weights of the policy."""
        from safetensors.torch import save_file

        weights = {n: t.to("cpu").contiguous() for n, t in engine_weights(model)}
        _base_config(model).save_pretrained(path)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(path)
        tokenizer.save_pretrained(path)
        save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})

    # ---- the Generator protocol

    def sync_weights(self, model) -> None:
        """Replace the engine's weights with the policy's (every rank calls it under FSDP)."""
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
            self._broken = f"its weights are in an unknown state after a failed sync ({_first_line(e)})"
            raise EngineError(f"the vLLM engine could not take the new weights: {_first_line(e)}") from None

    def _check_usable(self) -> None:
        if self._broken:
            raise EngineError(f"the vLLM engine cannot be used: {self._broken}")

    def generate(self, prompts: list[str] | list[list[int]], sampling: Sampling,
                 seeds: Sequence[int] | None = None, limits: Sequence[int] | None = None) -> Rollout:
        """n completions per prompt (texts, or token ids used as they are), prompt i's seeded by seeds[i] and
        limited to limits[i] new tokens; with temperature > 0 the engine's log-probs of the sampled tokens come
        back as `sampler_logp`."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self._check_usable()
        seeds = prompt_seeds(seeds, len(prompts))
        limits = prompt_limits(limits, sampling, len(prompts))
        ids = encode_prompts(self.tokenizer, prompts, self.add_special_tokens)
        longest = max(len(x) + k for x, k in zip(ids, limits))
        if longest > self.max_model_len:
            x, k = max(zip(ids, limits), key=lambda p: len(p[0]) + p[1])
            raise DataError(f"a prompt of {len(x)} tokens plus {k} new tokens is more than the vLLM engine's "
                            f"max_model_len={self.max_model_len}; raise vllm.max_model_len (at most the model's "
                            "max_position_embeddings) or shorten the prompts")
        greedy = sampling.temperature == 0  # vLLM samples greedily once per prompt; the n copies are equal
        params = [SamplingParams(n=1 if greedy else sampling.n, temperature=sampling.temperature, top_p=sampling.top_p,
                                 top_k=sampling.top_k if sampling.top_k > 0 else -1,
                                 max_tokens=k, min_tokens=min(sampling.min_new_tokens, k),
                                 seed=int(s) & (2**63 - 1), logprobs=None if greedy else 0,
                                 stop_token_ids=self.eos_ids, detokenize=False)
                  for s, k in zip(seeds, limits)]
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
            raise EngineError(f"the vLLM engine failed while sampling: {_first_line(e)}") from None
        return self._rollout(ids, outs, sampling.n, with_logp=not greedy)

    def _rollout(self, ids: list[list[int]], outs, n: int, with_logp: bool) -> Rollout:
        rows, logps, truncated = [], [], []
        for out in outs:
            completions = sorted(out.outputs, key=lambda c: c.index)
            if len(completions) == 1 and n > 1 and not with_logp:  # greedy
                completions = completions * n
            if len(completions) != n:
                raise EngineError(f"the vLLM engine returned {len(completions)} completions for a prompt, not {n}")
            for c in completions:
                tokens = list(c.token_ids)
                if not tokens:  # max_tokens >= 1, so only a failed request has none
                    raise EngineError(f"the vLLM engine returned an empty completion ({c.finish_reason})")
                rows.append(tokens)
                truncated.append(c.finish_reason == "length")
                if with_logp:
                    logps.append([d[t].logprob for d, t in zip(c.logprobs, tokens)])
        width = max(len(r) for r in rows)
        lp = max(len(x) for x in ids)
        prompt_ids = torch.full((len(rows), lp), self.pad_id, dtype=torch.long)
        prompt_mask = torch.zeros((len(rows), lp), dtype=torch.long)
        completion_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        completion_mask = torch.zeros((len(rows), width), dtype=torch.long)
        sampler_logp = torch.zeros((len(rows), width), dtype=torch.float32) if with_logp else None
        for j, tokens in enumerate(rows):
            p = ids[j // n]
            prompt_ids[j, lp - len(p):] = torch.tensor(p)
            prompt_mask[j, lp - len(p):] = 1
            completion_ids[j, :len(tokens)] = torch.tensor(tokens)
            completion_mask[j, :len(tokens)] = 1
            if with_logp:
                sampler_logp[j, :len(tokens)] = torch.tensor(logps[j])
        trunc = torch.tensor(truncated, dtype=torch.bool)
        # texts: the tokens before EOS (EOS itself is not text), as the in-process generator decodes them
        texts = self.tokenizer.batch_decode([r if t else r[:-1] for r, t in zip(rows, truncated)],
                                            skip_special_tokens=True)
        dev = self.device
        return Rollout(prompt_ids.to(dev), prompt_mask.to(dev), completion_ids.to(dev), completion_mask.to(dev),
                       trunc.to(dev), texts, sampler_logp=None if sampler_logp is None else sampler_logp.to(dev))

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
            warnings.warn(f"the vLLM engine did not shut down cleanly: {_first_line(e)}", stacklevel=2)
            _disarm(llm)
        finally:
            self._dir.cleanup()


def _disarm(llm) -> None:
    """Detach vLLM's at-exit shutdown, which would destroy process groups after torchrun's are gone."""
    finalizer = getattr(getattr(llm.llm_engine, "engine_core", None), "_finalizer", None)
    if finalizer is not None:
        finalizer.detach()


def _refresh_cpu_heads(llm) -> None:
    """vLLM 0.32 on the CPU keeps a prepacked copy of the (tied) embedding matrix for the LM head that its
    in-place reload does not renew; rebuild it from the reloaded weight. Nothing to do on a GPU."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    def refresh(model):
        for module in model.modules():
            w = getattr(module, "weight", None)
            if hasattr(module, "cpu_linear") and isinstance(w, torch.Tensor) and w.ndim == 2 and w.numel():
                dispatch_cpu_unquantized_gemm(module, remove_weight=False)

    llm.apply_model(refresh)


def _first_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text[:400]
