"""TRL's names (grpo/trl_names.py): an unknown key that is one of them is answered with grpo's key, bare or under
any section, with grpo's setting for a value that needs translating; the table covers every GRPOConfig field of
TRL 1.16 and names only options grpo has."""
import re

import pytest

from grpo.config import load_config, options
from grpo.errors import ConfigError
from grpo.trl_names import TRL_NAMES, trl_hint

# every field of TRL 1.16.0's GRPOConfig (trl/trainer/grpo_config.py), in its order
GRPO_CONFIG_1_16 = """
learning_rate model_init_kwargs trust_remote_code router_aux_loss_coef disable_dropout cast_lm_head_to_fp32
remove_unused_columns num_generations num_generations_eval max_completion_length ds3_gather_for_generation
shuffle_dataset pad_to_multiple_of generation_batch_size steps_per_generation temperature top_p top_k min_p
generation_kwargs chat_template_kwargs repetition_penalty cache_implementation use_vllm vllm_mode vllm_model_impl
vllm_enable_sleep_mode vllm_structured_outputs_regex vllm_server_base_url vllm_server_host vllm_server_port
vllm_server_timeout vllm_group_port vllm_gpu_memory_utilization vllm_max_model_length vllm_tensor_parallel_size
beta num_iterations epsilon delta epsilon_high sapo_temperature_neg sapo_temperature_pos vespo_k_pos
vespo_lambda_pos vespo_k_neg vespo_lambda_neg importance_sampling_level reward_weights multi_objective_aggregation
scale_rewards loss_type mask_truncated_completions sync_ref_model ref_model_mixup_alpha ref_model_sync_steps
top_entropy_quantile entropy_coef use_adaptive_entropy entropy_coef_min entropy_coef_max entropy_coef_delta
entropy_target max_tool_calling_iterations vllm_importance_sampling_correction vllm_importance_sampling_mode
vllm_importance_sampling_clip_max vllm_importance_sampling_clip_min off_policy_mask_threshold
use_bias_correction_kl log_completions log_multimodal num_completions_to_print log_unique_prompts
log_completions_hub_repo use_transformers_continuous_batching transformers_continuous_batching_config
use_transformers_paged vllm_importance_sampling_cap
""".split()

# the TrainingArguments fields a GRPO script commonly sets
TRAINING_ARGUMENTS = """
output_dir num_train_epochs max_steps per_device_train_batch_size gradient_accumulation_steps bf16 seed
logging_steps save_steps report_to lr_scheduler_type warmup_ratio warmup_steps weight_decay max_grad_norm
gradient_checkpointing adam_beta1 adam_beta2 save_total_limit resume_from_checkpoint eval_strategy eval_steps
push_to_hub run_name
""".split()

KEYS = {key for key, _, _ in options()}
SECTION_KEY = re.compile(r"\b((?:model|data|rollout|lora|algo|train|optim|compute|vllm|vllm_server|tools|sandbox|"
                         r"eval|log|reward_model|judge)\.[a-z_0-9]+)")


def test_the_table_covers_every_grpo_config_field_and_the_common_training_arguments():
    assert [n for n in GRPO_CONFIG_1_16 if n not in TRL_NAMES] == []
    assert [n for n in GRPO_CONFIG_1_16 if TRL_NAMES[n].source != "GRPOConfig"] == []
    assert [n for n in TRAINING_ARGUMENTS if n not in TRL_NAMES] == []


def test_the_table_names_only_options_grpo_has():
    for name, entry in TRL_NAMES.items():
        if entry.ours:
            key = entry.ours.partition("=")[0]
            assert key in KEYS, (name, entry.ours)
        else:
            assert entry.note, f"{name}: no grpo option and no word on what to do instead"
        texts = [entry.ours, entry.note, *(setting for _, setting in entry.values)]
        for key in SECTION_KEY.findall(" ".join(texts)):
            assert key in KEYS, (name, key)


def test_a_trl_name_said_to_be_missing_is_not_an_option_of_grpo():
    """When an option of TRL's name is added (rollout.min_p, say), the table must map it, not call it missing."""
    leaves = {key.rpartition(".")[2] for key in KEYS}
    assert [n for n, e in TRL_NAMES.items() if not e.ours and n in leaves] == []


@pytest.mark.parametrize("override, message", [
    ("train.learning_rate=1e-5", "unknown key 'train.learning_rate': learning_rate is TRL's name; grpo's is train.lr"),
    ("learning_rate=1e-5", "unknown key 'learning_rate': learning_rate is TRL's name; grpo's is train.lr"),
    ("rollout.num_generations=4", "num_generations is TRL's name; grpo's is rollout.group_size"),
    ("max_completion_length=64", "grpo's is rollout.max_new_tokens"),
    ("train.max_steps=10", "grpo's is train.steps (grpo counts batches of rollouts, TRL optimiser updates"),
    ("beta=0.0", "grpo's is algo.beta"),
    ("algo.epsilon=0.3", "grpo's is algo.clip_low"),
    ("per_device_train_batch_size=8", "grpo's is compute.micro_batch_size"),
    ("gradient_accumulation_steps=4", "gradient_accumulation_steps is TRL's name; grpo has no such option (not "
                                      "needed: grpo accumulates by itself"),
    ("algo.num_iterations_=2", "did you mean 'algo.num_iterations'?"),  # a typo, not TRL's name: difflib
    ("train.num_iterations=2", "num_iterations is TRL's name; grpo's is algo.num_iterations"),
    ("scale_rewards=batch", "grpo's is algo.scale (grpo also has rloo and maxrl); TRL's scale_rewards='batch' is "
                            "algo.scale=batch"),
    ("algo.scale_rewards=false", "TRL's scale_rewards=false is algo.scale=none"),
    ("loss_type=dr_grpo", "TRL's loss_type='dr_grpo' is algo.aggregation=constant"),
    ("loss_type=bnpo", "TRL's loss_type='bnpo' is not offered: it normalises per micro-batch"),
    ("bf16=true", "TRL's bf16=true is model.autocast_bf16=true"),
    ("use_vllm=true", "TRL's use_vllm=true is rollout.backend=vllm"),
    ("vllm_mode=server", "TRL's vllm_mode='server' is rollout.backend=vllm_server"),
    ("report_to=none", "TRL's report_to='none' is log.trackers=[]"),
    ("pad_to_multiple_of=8", "pad_to_multiple_of is TRL's name; grpo has no such option"),
    ("min_p=0.1", "min_p is TRL's name; grpo's is rollout.min_p"),
    # printing completions on the console is log.print_samples (it counts completions, as TRL's does)
    ("log.log_completions=false", "grpo's is log.print_samples (grpo prints"),
    ("log.log_completions=false", "TRL's log_completions=false is log.print_samples=0"),
    ("num_completions_to_print=3", "num_completions_to_print is TRL's name; grpo's is log.print_samples ("),
    ("mask_truncated_completions=true", "grpo's is algo.mask_truncated"),
    ("log.logging_steps=5", "logging_steps is TRL's name; grpo has no such option (not needed: every step's "),
    ("output_dir=runs/x", "grpo's is train.output_dir"),
    ("seed=1", "grpo's is train.seed"),
    ("optim=adamw_torch", "optim must be a mapping of keys, got str; optim is TRL's name; grpo has no such option "
                          "(not offered: the optimiser is PyTorch's AdamW)"),  # grpo's section of the same name
])
def test_trl_names_are_answered_with_grpos(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_a_trl_name_in_a_yaml_file_is_answered_the_same_way(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  learning_rate: 1.0e-5\n  steps: 4\n")
    with pytest.raises(ConfigError, match="unknown key 'train.learning_rate': learning_rate is TRL's name; grpo's is "
                                          "train.lr"):
        load_config(path)


def test_an_option_under_another_section_is_named():
    with pytest.raises(ConfigError, match=r"unknown key 'model.group_size'; did you mean 'rollout.group_size'\?"):
        load_config(None, ["model.group_size=4"])
    with pytest.raises(ConfigError, match=r"unknown key 'model.max_model_len'; did you mean 'vllm.max_model_len' "
                                          r"or 'judge.max_model_len'\?"):
        load_config(None, ["model.max_model_len=512"])


def test_trl_hint_without_a_value_and_for_other_names():
    assert trl_hint("learning_rate").startswith("learning_rate is TRL's name; grpo's is train.lr")
    assert "TRL's loss_type" not in trl_hint("loss_type")
    assert trl_hint("loss_type", "dapo", has_value=True).endswith(
        "TRL's loss_type='dapo' is algo.aggregation=token_mean")
    assert trl_hint("scale_rewards", 1, has_value=True).count("TRL's scale_rewards") == 0  # 1 is not True here
    assert trl_hint("stepz") is None


def test_a_trl_config_copied_whole_is_answered_in_one_line(tmp_path):
    path = tmp_path / "trl.yaml"
    path.write_text("learning_rate: 1.0e-6\nnum_generations: 8\ngradient_accumulation_steps: 4\n"
                    "loss_type: dr_grpo\nbf16: true\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value) == (
        "unknown keys in the config: 'learning_rate', 'num_generations', 'gradient_accumulation_steps', 'loss_type', "
        "'bf16' are TRL's names; in grpo: learning_rate is train.lr; num_generations is rollout.group_size; "
        "gradient_accumulation_steps has no equivalent (" + TRL_NAMES["gradient_accumulation_steps"].note + "); "
        "loss_type='dr_grpo' is algo.aggregation=constant (L_max is rollout.max_new_tokens); "
        "bf16=true is model.autocast_bf16=true (docs/from-trl.md says what differs)")
