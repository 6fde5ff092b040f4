"""TRL's option names and grpo's: one table, read by the config's unknown-key error (`train.learning_rate=1e-5`
is answered "learning_rate is TRL's name; grpo's is train.lr") and rendered into docs/from-trl.md
(`scripts/gen_config_docs.py`; tests/unit/test_docs.py checks that page is current).

`TRL_NAMES` holds every field of TRL 1.16's `GRPOConfig` (its own, then those of transformers' `TrainingArguments`
a GRPO script commonly sets) and the names of TRL's `ModelConfig` and `GRPOScriptArguments` (`trl grpo
--model_name_or_path ... --use_peft`), each with grpo's key or setting (`ours`; empty where grpo has no
equivalent), a note (what differs, or what to do instead) and, where a TRL value needs translating
(`loss_type="dr_grpo"`), grpo's setting for each value. This module is data: it imports nothing of grpo.
"""
from __future__ import annotations

from typing import Any, NamedTuple


class TrlName(NamedTuple):
    ours: str                     # grpo's key ("train.lr") or setting ("rollout.backend=vllm"); "" for none
    note: str = ""                # what differs, or what to do where grpo has no equivalent
    values: tuple = ()            # (TRL value, grpo's setting for it) pairs, for options whose values differ
    default: str = ""             # TRL's default, as TRL 1.16 has it
    source: str = "GRPOConfig"    # where TRL declares it: GRPOConfig, TrainingArguments, ModelConfig, script


def _n(ours: str, note: str = "", default: str = "", values: dict | None = None, source: str = "GRPOConfig"):
    return TrlName(ours, note, tuple((values or {}).items()), default, source)


_TA = "TrainingArguments"
_NO_VESPO = "VESPO (arXiv 2602.10693) is not offered"
_HF_LOOP = ("not offered: rollout.backend=hf samples with grpo's own decoding loop (rollout.lean_decoding); for "
            "throughput use rollout.backend=vllm")
_DEEPSPEED = "not offered: grpo shards with FSDP2 (compute.sharding=fsdp) under torchrun"

TRL_NAMES: dict[str, TrlName] = {
    # --- GRPOConfig's own fields, in TRL's order -----------------------------------------------------------
    "learning_rate": _n("train.lr", "TRL's default 1e-6 is for real models; grpo's 2e-4 is for the bundled tiny "
                                    "model", "1e-6"),
    "model_init_kwargs": _n("", "its dtype is model.dtype and its attn_implementation model.attn_implementation; "
                                "other from_pretrained arguments are not offered", "None"),
    "trust_remote_code": _n("model.trust_remote_code", "", "False"),
    "router_aux_loss_coef": _n("", "not offered: no Mixture-of-Experts load-balancing loss is added", "None"),
    "disable_dropout": _n("", "not needed: grpo always switches dropout off (and refuses lora.dropout > 0)",
                          "False"),
    "cast_lm_head_to_fp32": _n("", "not needed: grpo computes log-probs in float32 from the hidden states, chunk by "
                                   "chunk (model.logprob_chunk_size), whatever model.dtype", "False"),
    "remove_unused_columns": _n("", "not needed: every dataset column reaches the reward functions, as with TRL's "
                                    "default False", "False"),
    "num_generations": _n("rollout.group_size", "G, completions per prompt", "8"),
    "num_generations_eval": _n("eval.pass_k", "completions per held-out prompt for pass@k (accuracy is greedy)",
                               "None"),
    "max_completion_length": _n("rollout.max_new_tokens", "TRL's default is 512, grpo's 32 (the tiny model's "
                                                          "tasks)", "512"),
    "ds3_gather_for_generation": _n("", _DEEPSPEED, "True"),
    "shuffle_dataset": _n("", "not offered: the training order is always shuffled, seeded by train.seed and "
                              "reshuffled every epoch", "True"),
    "pad_to_multiple_of": _n("", "not offered", "'auto'"),
    "generation_batch_size": _n("train.prompts_per_step", "grpo counts prompts, TRL completions: "
                                                          "train.prompts_per_step = generation_batch_size / "
                                                          "num_generations", "None"),
    "steps_per_generation": _n("train.steps_per_generation", "grpo counts optimiser updates per batch of rollouts, "
                                                             "TRL micro-batches: grpo's = TRL's / "
                                                             "gradient_accumulation_steps (TRL's default, equal to "
                                                             "gradient_accumulation_steps, is grpo's 1)", "None"),
    "temperature": _n("rollout.temperature", "", "1.0"),
    "top_p": _n("rollout.top_p", "", "1.0"),
    "top_k": _n("rollout.top_k", "0 keeps every token in both", "0"),
    "min_p": _n("rollout.min_p", "0 is off in grpo (TRL's None); it joins the kept set that top_p and top_k "
                                 "truncate to, which the loss replays", "None"),
    "generation_kwargs": _n("", "the sampler's settings are the rollout.* options (temperature, top_p, top_k, "
                                "min_p, repetition_penalty, stop, min_new_tokens, max_new_tokens); others are not "
                                "offered", "None"),
    "chat_template_kwargs": _n("model.chat_template_kwargs", "passed to apply_chat_template wherever a prompt is "
                                                             "rendered (enable_thinking, say)", "None"),
    "repetition_penalty": _n("rollout.repetition_penalty", "transformers' and vLLM's definition; warns at load: "
                                                       "the loss's ratio and KL are the unpenalised policy's", "1.0"),
    "cache_implementation": _n("", _HF_LOOP, "None"),
    "use_vllm": _n("rollout.backend", "", "False",
                   {True: "rollout.backend=vllm", False: "rollout.backend=hf"}),
    "vllm_mode": _n("rollout.backend", "grpo names the mode by the backend", "'colocate'",
                    {"colocate": "rollout.backend=vllm", "server": "rollout.backend=vllm_server"}),
    "vllm_model_impl": _n("", "not offered: vLLM's own implementation is used", "'vllm'"),
    "vllm_enable_sleep_mode": _n("", "not offered: the colocated engine keeps vllm.gpu_memory_utilization of the "
                                     "GPU throughout", "False"),
    "vllm_structured_outputs_regex": _n("", "not offered", "None"),
    "vllm_server_base_url": _n("vllm_server.urls", "a list: vllm_server.urls=[URL], and several servers may be "
                                                   "given", "None"),
    "vllm_server_host": _n("vllm_server.urls", "a running server is given by its URL: "
                                               "vllm_server.urls=[http://HOST:PORT] (vllm_server.host is where a "
                                               "server grpo launches listens)", "'0.0.0.0'"),
    "vllm_server_port": _n("vllm_server.urls", "a running server is given by its URL: "
                                               "vllm_server.urls=[http://HOST:PORT] (vllm_server.port is where a "
                                               "server grpo launches listens)", "8000"),
    "vllm_server_timeout": _n("vllm_server.startup_timeout_s", "how long servers may take to start; "
                                                               "vllm_server.timeout_s bounds each call", "240.0"),
    "vllm_group_port": _n("", "not needed: the weight transfer (vllm_server.weight_transfer) picks its own ports",
                          "51216"),
    "vllm_gpu_memory_utilization": _n("vllm.gpu_memory_utilization", "", "0.3"),
    "vllm_max_model_length": _n("vllm.max_model_len", "", "None"),
    "vllm_tensor_parallel_size": _n("", "not offered: each engine runs on one device; vllm_server.launch starts "
                                        "several servers (data parallel)", "1"),
    "beta": _n("algo.beta", "TRL's default is 0, grpo's 0.04 (DeepSeekMath's); 0 loads no reference model in "
                            "both", "0.0"),
    "num_iterations": _n("algo.num_iterations", "μ", "1"),
    "epsilon": _n("algo.clip_low", "TRL's epsilon sets both bounds unless epsilon_high is given: set "
                                   "algo.clip_low and algo.clip_high", "0.2"),
    "delta": _n("algo.dual_clip", "the same rule when delta > 1 + epsilon_high (algo.dual_clip=delta)", "None"),
    "epsilon_high": _n("algo.clip_high", "", "None"),
    "sapo_temperature_neg": _n("algo.sapo_tau_neg", "", "1.05"),
    "sapo_temperature_pos": _n("algo.sapo_tau_pos", "", "1.0"),
    "vespo_k_pos": _n("", _NO_VESPO, "2.0"),
    "vespo_lambda_pos": _n("", _NO_VESPO, "3.0"),
    "vespo_k_neg": _n("", _NO_VESPO, "3.0"),
    "vespo_lambda_neg": _n("", _NO_VESPO, "2.0"),
    "importance_sampling_level": _n("algo.ratio_level", "", "'token'",
                                    {"token": "algo.ratio_level=token", "sequence": "algo.ratio_level=sequence"}),
    "reward_weights": _n("reward_weights", "", "None"),
    "multi_objective_aggregation": _n("algo.multi_objective_aggregation", "the same values", "'sum_then_normalize'"),
    "scale_rewards": _n("algo.scale", "grpo also has rloo and maxrl", "'group'",
                        {"group": "algo.scale=group", True: "algo.scale=group", "batch": "algo.scale=batch",
                         "none": "algo.scale=none", False: "algo.scale=none"}),
    "loss_type": _n("algo.aggregation", "TRL's default is dapo (token_mean), grpo's seq_mean; CISPO, SAPO and "
                                        "LUSPO are also algo.surrogate or presets (algo.preset=cispo, sapo)", "'dapo'",
                    {"grpo": "algo.aggregation=seq_mean", "dapo": "algo.aggregation=token_mean",
                     "dr_grpo": "algo.aggregation=constant (L_max is rollout.max_new_tokens)",
                     "bnpo": "not offered: it normalises per micro-batch, so its result depends on the micro-batch "
                             "size; algo.aggregation=token_mean is its step-wide form",
                     "cispo": "algo.surrogate=cispo algo.aggregation=token_mean algo.clip_low=1 "
                              "algo.clip_high=<epsilon_high − 1> (grpo's bound is relative, TRL's absolute)",
                     "sapo": "algo.surrogate=sapo algo.aggregation=seq_mean",
                     "luspo": "algo.aggregation=luspo algo.ratio_level=sequence",
                     "vespo": "not offered"}),
    "mask_truncated_completions": _n("algo.mask_truncated", "", "False"),
    "sync_ref_model": _n("algo.ref_sync_every", "a reset every N steps is on when N > 0", "False",
                         {True: "algo.ref_sync_every=512 algo.ref_sync_alpha=0.6 (TRL's ref_model_sync_steps and "
                                "ref_model_mixup_alpha defaults)", False: "algo.ref_sync_every=0"}),
    "ref_model_mixup_alpha": _n("algo.ref_sync_alpha", "grpo's default is 1 (a hard reset)", "0.6"),
    "ref_model_sync_steps": _n("algo.ref_sync_every", "grpo counts steps (batches of rollouts), TRL optimiser "
                                                      "updates; 0 is off", "512"),
    "top_entropy_quantile": _n("algo.top_entropy_quantile", "taken over the whole step's tokens, not per "
                                                            "micro-batch", "1.0"),
    "entropy_coef": _n("algo.entropy_coef", "", "0.0"),
    "use_adaptive_entropy": _n("algo.use_adaptive_entropy", "", "False"),
    "entropy_coef_min": _n("algo.entropy_coef_min", "", "0.0"),
    "entropy_coef_max": _n("algo.entropy_coef_max", "", "1.0"),
    "entropy_coef_delta": _n("algo.entropy_coef_delta", "", "0.005"),
    "entropy_target": _n("algo.entropy_target", "", "0.2"),
    "max_tool_calling_iterations": _n("tools.max_turns", "with rollout.environment=tools; grpo counts model turns: "
                                                         "tools.max_turns = max_tool_calling_iterations + 1", "None"),
    "vllm_importance_sampling_correction": _n("algo.sampler_correction", "", "True",
                                              {True: "algo.sampler_correction=token_tis (grpo's default) or the "
                                                     "mode's value", False: "algo.sampler_correction=none"}),
    "vllm_importance_sampling_mode": _n("algo.sampler_correction", "TRL's default is sequence_mask with a cap of 3, "
                                                                   "grpo's token_tis with 2", "'sequence_mask'",
                                        {"token_truncate": "algo.sampler_correction=token_tis",
                                         "token_mask": "algo.sampler_correction=token_mis",
                                         "sequence_truncate": "algo.sampler_correction=seq_tis",
                                         "sequence_mask": "algo.sampler_correction=seq_mis"}),
    "vllm_importance_sampling_clip_max": _n("algo.sampler_correction_cap", "", "3.0"),
    "vllm_importance_sampling_clip_min": _n("algo.sampler_correction_floor", "0 is no lower bound", "None"),
    "off_policy_mask_threshold": _n("algo.off_policy_mask_threshold", "", "None"),
    "use_bias_correction_kl": _n("algo.unbiased_kl", "TRL's default is on, grpo's off", "True",
                                 {True: "algo.unbiased_kl=prox", False: "algo.unbiased_kl=off"}),
    "log_completions": _n("log.print_samples", "grpo prints sampled completions with their rewards by default, at "
                                               "the first step, every log.samples_every steps and at the last; "
                                               "samples.jsonl and the trackers get them at those steps too", "False",
                          {True: "log.print_samples=4 (the default)", False: "log.print_samples=0"}),
    "log_multimodal": _n("", "not needed: grpo trains on text", "True"),
    "num_completions_to_print": _n("log.print_samples", "completions printed each time; TRL's None (all of the "
                                                        "step's) is not offered: give a number", "None"),
    "log_unique_prompts": _n("", "not needed: each group written is one prompt with its completions", "False"),
    "log_completions_hub_repo": _n("", "not offered: samples.jsonl is in the run directory", "None"),
    "use_transformers_continuous_batching": _n("", _HF_LOOP, "False"),
    "transformers_continuous_batching_config": _n("", _HF_LOOP, "None"),
    "use_transformers_paged": _n("", _HF_LOOP, "False"),
    "vllm_importance_sampling_cap": _n("algo.sampler_correction_cap", "deprecated in TRL for "
                                                                      "vllm_importance_sampling_clip_max", "None"),
    # --- transformers' TrainingArguments, as GRPOConfig inherits them --------------------------------------
    "output_dir": _n("train.output_dir", "", "None ('trainer_output')", source=_TA),
    "overwrite_output_dir": _n("train.overwrite", "a run directory that holds a run is refused without it (the "
                                                  "option is gone from transformers 5)", "False", source=_TA),
    "max_steps": _n("train.steps", "grpo counts batches of rollouts, TRL optimiser updates: train.steps = "
                                   "max_steps / (num_iterations × train.steps_per_generation)", "-1", source=_TA),
    "num_train_epochs": _n("train.steps", "grpo has no epochs: train.steps = epochs × rows / "
                                          "train.prompts_per_step (the data are reshuffled every epoch)", "3.0",
                           source=_TA),
    "per_device_train_batch_size": _n("compute.micro_batch_size", "for memory; grpo's batch is "
                                      "train.prompts_per_step prompts × rollout.group_size completions: "
                                      "train.prompts_per_step = per_device_train_batch_size × processes × "
                                      "gradient_accumulation_steps / num_generations", "8", source=_TA),
    "per_device_eval_batch_size": _n("", "not needed: evaluation samples every held-out prompt (eval.size limits "
                                         "them) in micro-batches of compute.micro_batch_size", "8", source=_TA),
    "gradient_accumulation_steps": _n("", "not needed: grpo accumulates by itself, over micro-batches of "
                                          "compute.micro_batch_size with the step's normaliser (the result does not "
                                          "depend on it); the batch is train.prompts_per_step", "1", source=_TA),
    "lr_scheduler_type": _n("optim.lr_schedule", "TRL's default is linear, grpo's constant", "'linear'",
                            {"linear": "optim.lr_schedule=linear", "cosine": "optim.lr_schedule=cosine",
                             "constant": "optim.lr_schedule=constant",
                             "constant_with_warmup": "optim.lr_schedule=constant (optim.warmup_steps warms up)"},
                            source=_TA),
    "lr_scheduler_kwargs": _n("", "not offered", "None", source=_TA),
    "warmup_ratio": _n("optim.warmup_steps", "grpo counts steps: optim.warmup_steps = warmup_ratio × train.steps "
                                             "(transformers 5 takes the ratio as a warmup_steps below 1)", "0.0",
                       source=_TA),
    "warmup_steps": _n("optim.warmup_steps", "a whole number of steps in grpo (transformers 5 reads a value below 1 "
                                             "as a fraction of the steps)", "0", source=_TA),
    "weight_decay": _n("optim.weight_decay", "", "0.0", source=_TA),
    "adam_beta1": _n("optim.adam_beta1", "", "0.9", source=_TA),
    "adam_beta2": _n("optim.adam_beta2", "TRL's default is 0.999, grpo's 0.99", "0.999", source=_TA),
    "adam_epsilon": _n("", "not offered: AdamW's ε is PyTorch's 1e-8, TRL's default", "1e-8", source=_TA),
    "max_grad_norm": _n("optim.max_grad_norm", "", "1.0", source=_TA),
    "optim": _n("", "not offered: the optimiser is PyTorch's AdamW", "'adamw_torch_fused'", source=_TA),
    "bf16": _n("model.autocast_bf16", "TRL's bf16 is mixed precision (bfloat16 compute, float32 weights), as "
                                      "model.autocast_bf16=true; model.dtype=bfloat16 keeps the weights in bfloat16",
               "None (True unless fp16)", {True: "model.autocast_bf16=true", False: "model.autocast_bf16=false"},
               source=_TA),
    "fp16": _n("", "not offered: use bfloat16 (model.autocast_bf16 or model.dtype)", "False", source=_TA),
    "tf32": _n("", "not offered", "None", source=_TA),
    "gradient_checkpointing": _n("model.gradient_checkpointing", "TRL's default is on, grpo's off", "True",
                                 source=_TA),
    "gradient_checkpointing_kwargs": _n("", "not offered: grpo uses non-reentrant checkpointing", "None", source=_TA),
    "seed": _n("train.seed", "it seeds the data order too", "42", source=_TA),
    "data_seed": _n("", "not offered: train.seed seeds the data order", "None", source=_TA),
    "logging_steps": _n("", "not needed: every step's figures go to metrics.jsonl and the trackers (log.trackers), "
                            "with a progress bar (log.progress)", "10", source=_TA),
    "logging_first_step": _n("", "not needed: every step is logged", "False", source=_TA),
    "logging_dir": _n("", "not offered: TensorBoard's events go to <output_dir>/tensorboard (the option is gone from "
                          "transformers 5)", "None", source=_TA),
    "report_to": _n("log.trackers", "a list of tensorboard, wandb, trackio; grpo's default is [tensorboard]", "'none'",
                    {"none": "log.trackers=[]", "all": "log.trackers=[tensorboard,wandb,trackio]",
                     "tensorboard": "log.trackers=[tensorboard]", "wandb": "log.trackers=[wandb]",
                     "trackio": "log.trackers=[trackio]"}, source=_TA),
    "run_name": _n("log.run_name", "", "None", source=_TA),
    "disable_tqdm": _n("log.progress", "the opposite sense: log.progress=false", "None",
                       {True: "log.progress=false", False: "log.progress=true"}, source=_TA),
    "save_steps": _n("train.save_every", "grpo counts steps (batches of rollouts); 0 writes no checkpoint", "500",
                     source=_TA),
    "save_strategy": _n("train.save_every", "", "'steps'", {"no": "train.save_every=0"}, source=_TA),
    "save_total_limit": _n("train.keep_last", "", "None", source=_TA),
    "save_only_model": _n("", "not offered: a checkpoint holds what an exact resume needs; the final model/ holds "
                              "only the model", "False", source=_TA),
    "resume_from_checkpoint": _n("train.resume", "a checkpoint or run directory, or auto", "None", source=_TA),
    "eval_strategy": _n("eval.every", "grpo evaluates before the first update, every eval.every steps and after "
                                      "the last, whenever there are held-out data (data.eval_path, data.eval_split "
                                      "or data.eval_fraction)", "'no'", {"no": "eval.every=0 (before and after "
                                                                               "only)"}, source=_TA),
    "eval_steps": _n("eval.every", "", "None", source=_TA),
    "eval_on_start": _n("", "not needed: grpo always evaluates before the first update", "False", source=_TA),
    "do_eval": _n("", "not needed: held-out data (data.eval_path, data.eval_split, data.eval_fraction) turn "
                      "evaluation on", "False", source=_TA),
    "push_to_hub": _n("", "not offered: upload <output_dir>/model with huggingface-cli upload", "False", source=_TA),
    "hub_model_id": _n("", "not offered: upload <output_dir>/model with huggingface-cli upload", "None", source=_TA),
    "use_cpu": _n("model.device", "", "False", {True: "model.device=cpu"}, source=_TA),
    "fsdp": _n("compute.sharding", "under torchrun: compute.sharding=fsdp (FSDP2)", "None", source=_TA),
    "deepspeed": _n("", _DEEPSPEED, "None", source=_TA),
    "use_liger_kernel": _n("", "not needed: grpo never builds the full logits tensor (model.logprob_chunk_size)",
                           "False", source=_TA),
    "torch_compile": _n("", "not offered", "False", source=_TA),
    "torch_empty_cache_steps": _n("", "not offered", "None", source=_TA),
    "dataloader_num_workers": _n("", "not needed: prompts are read in memory", "0", source=_TA),
    "auto_find_batch_size": _n("", "not offered (TRL refuses it for GRPO too): set compute.micro_batch_size",
                               "False", source=_TA),
    # --- TRL's ModelConfig and GRPOScriptArguments (trl grpo --model_name_or_path ...) ----------------------
    "model_name_or_path": _n("model.path", "", "None", source="ModelConfig"),
    "model_revision": _n("", "not offered: download the revision and give its directory as model.path", "'main'",
                         source="ModelConfig"),
    "dtype": _n("model.dtype", "float32 or bfloat16", "'float32'", source="ModelConfig"),
    "attn_implementation": _n("model.attn_implementation", "", "None", source="ModelConfig"),
    "use_peft": _n("lora.rank", "LoRA is on when lora.rank > 0", "False", {True: "lora.rank=16 (any rank > 0)",
                                                                        False: "lora.rank=0"}, source="ModelConfig"),
    "lora_r": _n("lora.rank", "", "16", source="ModelConfig"),
    "lora_alpha": _n("lora.alpha", "TRL's default is 32, grpo's 16", "32", source="ModelConfig"),
    "lora_dropout": _n("lora.dropout", "must be 0 in grpo (dropout would make the loss's policy differ from the "
                                       "sampler's)", "0.05", source="ModelConfig"),
    "lora_target_modules": _n("lora.target_modules", "TRL's None is peft's default for the architecture; grpo's "
                                                     "default is ['all-linear']", "None", source="ModelConfig"),
    "use_rslora": _n("", "not offered", "False", source="ModelConfig"),
    "use_dora": _n("", "not offered", "False", source="ModelConfig"),
    "load_in_4bit": _n("", "not offered: grpo trains float32 or bfloat16 weights (LoRA saves memory: lora.rank)",
                       "False", source="ModelConfig"),
    "load_in_8bit": _n("", "not offered: grpo trains float32 or bfloat16 weights (LoRA saves memory: lora.rank)",
                       "False", source="ModelConfig"),
    "dataset_name": _n("data.path", "a Hub dataset name or a local file or directory", "None", source="script"),
    "dataset_config": _n("data.config_name", "", "None", source="script"),
    "dataset_train_split": _n("data.split", "", "'train'", source="script"),
    "dataset_test_split": _n("data.eval_split", "", "'test'", source="script"),
    "reward_model_name_or_path": _n("rewards", "a reward model is the reward rm:<path or Hub id> "
                                               "(rewards=[rm:PATH]; reward_model.* runs it)", "None", source="script"),
    "reward_funcs": _n("rewards", "built-in names, module:function, rm:<model> or judge", "None", source="script"),
    "max_prompt_length": _n("data.truncate_prompts", "not in TRL 1.16 (older TRL): grpo refuses a prompt longer "
                                                     "than the context minus rollout.max_new_tokens at load, or "
                                                     "with data.truncate_prompts=left cuts it from the left",
                            "", source="older TRL"),
    "torch_dtype": _n("model.dtype", "float32 or bfloat16 (TRL 1.16 calls it dtype)", "", source="older TRL"),
}

SOURCES = ("GRPOConfig", "TrainingArguments", "ModelConfig", "script", "older TRL")


def trl_hint(name: str, value: Any = None, *, has_value: bool = False) -> str | None:
    """The answer to an unknown config key whose last part, `name`, is one of TRL's names: grpo's key (or what to
    do where grpo has none), and grpo's setting for the value given (`value`, when `has_value`), if TRL's values
    need translating. None for a name TRL does not have."""
    entry = TRL_NAMES.get(name)
    if entry is None:
        return None
    if entry.ours:
        text = f"{name} is TRL's name; grpo's is {entry.ours}" + (f" ({entry.note})" if entry.note else "")
    else:
        text = f"{name} is TRL's name; grpo has no such option ({entry.note})"
    if has_value:
        for trl_value, setting in entry.values:
            if value == trl_value and type(value) is type(trl_value):
                text += f"; TRL's {name}={_show(value)} is {setting}"
                break
    return text


def trl_hints(given: dict) -> str | None:
    """The answer to several unknown keys of one mapping (`given`: name -> value), as a TRL config copied whole
    gives: each of TRL's names with grpo's key and the value's translation (or why grpo has none), in one line.
    None where fewer than two are TRL's names (`trl_hint` answers one)."""
    known = [(name, value, TRL_NAMES[name]) for name, value in given.items() if name in TRL_NAMES]
    if len(known) < 2:
        return None
    parts = []
    for name, value, entry in known:
        setting = next((s for v, s in entry.values if value == v and type(value) is type(v)), None)
        if setting is not None:
            parts.append(f"{name}={_show(value)} is {setting}")
        elif entry.ours:
            parts.append(f"{name} is {entry.ours}")
        else:
            parts.append(f"{name} has no equivalent ({entry.note})")
    return (f"{', '.join(repr(n) for n, _, _ in known)} are TRL's names; in grpo: " + "; ".join(parts)
            + " (docs/from-trl.md says what differs)")


def _show(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else repr(value)
