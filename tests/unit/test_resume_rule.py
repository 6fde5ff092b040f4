"""What a resume may change (each option's resume class, grpo/config.py): every key except a short list of harmless
ones is refused."""
import pytest

from grpo.config import FREE, ROUNDING, Config, config_changes, flatten, load_config, may_change

DEFAULTS = Config().to_dict()

# each changes what is trained, so a resume with it differs from the uninterrupted run (the list first)
REFUSED = ["model.chat_template=true", "model.system_prompt=Be brief.", "overlong_buffer=4", "model.autocast_bf16=true",
           "compute.share_prompt=false", "compute.lean_forward=false",
           "model.logprob_chunk_size=7", "model.path=elsewhere",
           "model.attn_implementation=eager", "model.device=cpu", "rollout.temperature=0.7", "algo.beta=0.1",
           "optim.adam_beta2=0.999", "train.lr=1e-3", "train.seed=3", "train.prompts_per_step=8",
           "rewards=[exact_match]", "reward_weights=[2.0]", "data.task=linear", "lora.rank=4",
           "tools.max_turns=2", "sandbox.timeout_s=2", "eval.size=5", "eval.pass_k=0", "eval.reward=exact_match",
           "vllm.enforce_eager=false", "vllm.max_model_len=512"]
FREE_CHANGES = ["train.steps=500", "train.save_every=5", "train.keep_last=4", "train.resume=auto",
                "train.output_dir=other", "train.max_nonfinite_steps=9", "eval.every=3", "log.samples_every=1",
                "log.trackers=[]", "log.progress=false", "log.run_name=x", "vllm.timeout_s=60",
                "compute.reuse_memory=false"]
ROUNDING_CHANGES = ["compute.micro_batch_size=4", "compute.micro_batch_tokens=256", "compute.threads=1",
                    "model.gradient_checkpointing=true", "compute.sharding=fsdp",
                    "vllm.gpu_memory_utilization=0.5", "vllm.kv_cache_gib=2"]


def changes(override):
    return config_changes(DEFAULTS, load_config(None, [override]).to_dict(), DEFAULTS)


@pytest.mark.parametrize("override", REFUSED)
def test_a_change_of_results_is_refused(override):
    refused, rounding = changes(override)
    key = override.partition("=")[0]
    assert len(refused) == 1 and refused[0].startswith(f"{key}: ") and rounding == []


@pytest.mark.parametrize("override", FREE_CHANGES)
def test_harmless_keys_may_change(override):
    assert changes(override) == ([], [])


@pytest.mark.parametrize("override", ROUNDING_CHANGES)
def test_memory_and_thread_keys_change_only_rounding(override):
    refused, rounding = changes(override)
    assert refused == [] and len(rounding) == 1 and rounding[0].startswith(override.partition("=")[0] + ": ")


def test_every_listed_key_exists_and_is_named_in_the_error():
    keys = flatten(DEFAULTS)
    named = may_change().split(", ")
    for key in FREE + ROUNDING:  # each option declares its class (grpo/config.py: opt(..., resume=...))
        assert key in keys, key
        assert key in named or f"{key.rpartition('.')[0]}.*" in named, key
    assert named[0] == "train.steps" and "log.*" in named


# the rule as key patterns, before each option declared its class: the declarations give the same keys
PATTERNS = {"free": ("train.steps", "train.save_every", "train.keep_last", "train.resume", "train.overwrite",
                     "train.output_dir", "train.max_nonfinite_steps", "eval.every", "log.", "vllm.timeout_s",
                     "vllm_server.",  # added since: where the servers are (they sample the same rows)
                     # the judge's endpoint and how it is asked (not what: its model, template and parser stay),
                     # and what more evaluation logs
                     "judge.url", "judge.launch", "judge.api_key_env", "judge.concurrency", "judge.timeout_s",
                     "judge.retries", "judge.backoff_s", "judge.max_failure_frac", "judge.startup_timeout_s",
                     "eval.rewards",
                     "compute.reuse_memory"),  # where malloc takes memory from: the same arithmetic
            "rounding": ("compute.micro_batch_size", "compute.micro_batch_tokens", "compute.threads",
                         "compute.sharding", "model.gradient_checkpointing", "vllm.gpu_memory_utilization",
                         "vllm.kv_cache_gib", "vllm.threads", "reward_model.device", "reward_model.batch_size")}


def test_the_declared_classes_are_the_rule_as_it_was():
    def matching(patterns):
        return {k for k in flatten(DEFAULTS) if any(k == p or (p.endswith(".") and k.startswith(p)) for p in patterns)}

    assert set(FREE) == matching(PATTERNS["free"]) and set(ROUNDING) == matching(PATTERNS["rounding"])


def test_a_key_the_checkpoint_lacks_counts_as_its_default():
    saved = {k: v for k, v in DEFAULTS.items() if k != "overlong_buffer"}  # written before the option existed
    assert config_changes(saved, DEFAULTS, DEFAULTS) == ([], [])
    assert config_changes(saved, load_config(None, ["overlong_buffer=3"]).to_dict(), DEFAULTS)[0] == [
        "overlong_buffer: 0 -> 3"]


def test_a_key_this_version_no_longer_has_is_ignored():
    saved = {**DEFAULTS, "train": {**DEFAULTS["train"], "retired_option": 3}}
    assert config_changes(saved, DEFAULTS, DEFAULTS) == ([], [])


def test_a_key_removed_from_a_dict_option_is_a_change():
    saved = load_config(None, ["model.chat_template_kwargs={enable_thinking: false}"]).to_dict()
    refused, _ = config_changes(saved, DEFAULTS, DEFAULTS)
    assert refused == ["model.chat_template_kwargs: {'enable_thinking': False} -> {}"]
    assert config_changes(DEFAULTS, saved, DEFAULTS)[0] == [
        "model.chat_template_kwargs: {} -> {'enable_thinking': False}"]
