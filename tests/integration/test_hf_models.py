"""Any HF causal LM with a real BPE tokenizer and a data file: full fine-tuning and LoRA, chat template on/off.

Everything is built here, offline: a byte-level BPE tokenizer trained with `tokenizers` (with a ChatML chat
template), small random Llama and Qwen2 models, and GSM8K-format JSONL files.
"""
import json

import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import grpo.trainer as trainer
from grpo.config import load_config
from grpo.policy import LogprobModule
from grpo.models import load_model

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def gsm8k_rows(n, offset=0):
    rows = []
    for i in range(offset, offset + n):
        a, b = i % 7 + 2, i % 5 + 3
        rows.append({"question": f"Tom has {a} boxes with {b} apples each. How many apples does he have?",
                     "answer": f"Each box has {b} apples, so {a} * {b} = {a * b}.\n#### {a * b}", "level": i % 3})
    return rows


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    corpus = [r["question"] + " " + r["answer"] for r in gsm8k_rows(200)] + ["<think> so </think> <answer> 12 </answer>"]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                                chat_template=CHATML)  # no pad token: the trainer must cope
    data = root / "gsm8k"
    data.mkdir()
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in gsm8k_rows(24)))
    (data / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in gsm8k_rows(6, offset=100)))
    dirs = {}
    for arch in ("llama", "qwen2"):
        cls = transformers.LlamaConfig if arch == "llama" else transformers.Qwen2Config
        cfg = cls(vocab_size=len(fast), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  eos_token_id=fast.eos_token_id, tie_word_embeddings=arch == "qwen2")
        torch.manual_seed(0)
        model = (transformers.LlamaForCausalLM if arch == "llama" else transformers.Qwen2ForCausalLM)(cfg)
        dirs[arch] = root / arch
        model.save_pretrained(dirs[arch])
        fast.save_pretrained(dirs[arch])
    return dirs, data


def overrides(model_dir, data, out, *extra):
    return [f"model.path={model_dir}", f"data.path={data / 'train.jsonl'}", f"data.eval_path={data / 'test.jsonl'}",
            "data.prompt_column=question", f"train.output_dir={out}", "train.steps=2", "train.prompts_per_step=2",
            "rollout.group_size=3",
            "rollout.max_new_tokens=12", "rewards=[math, format, overlong]", "reward_weights=[1.0, 0.5, 0.1]",
            "eval.reward=math", "eval.pass_k=2", "log.progress=false", "log.trackers=[]",
            "log.chart=false", "log.samples_every=1", "train.lr=1e-3", *extra]


def metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("chat", [False, True])
def test_full_fine_tuning(assets, tmp_path, arch, chat):
    dirs, data = assets
    out = tmp_path / "run"
    result = trainer.train(load_config(None, overrides(dirs[arch], data, out, f"model.chat_template={chat}",
                                                       "model.system_prompt=Think, then answer.")))
    rows = metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for name in ("math", "format", "overlong"):
        assert f"reward/{name}" in rows[1]
    assert "eval/accuracy" in rows[-1] and result.final_eval
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out / "model")
    assert type(reloaded).__name__.lower().startswith(arch)
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert "#### " in samples[0]["answer"] and samples[0]["prompt"].startswith("Tom has")


def _length_reward(prompts, completions, **kw):
    return [len(c) / 10 for c in completions]


def test_gradient_checkpointing_changes_memory_not_results(assets, tmp_path):
    dirs, data = assets
    for name, on in (("plain", "false"), ("gc", "true")):
        trainer.train(load_config(None, overrides(dirs["llama"], data, tmp_path / name,
                                                  f"model.gradient_checkpointing={on}", "reward_weights=null")),
                      rewards=[_length_reward])
    a = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "plain" / "model").state_dict()
    b = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "gc" / "model").state_dict()
    # the same to float rounding: plain runs the lean forward, checkpointing transformers' (both packed, in
    # another order of sums); after two AdamW steps at lr 1e-3 the weights differed by at most 3.1e-6 (1.5e-6
    # unpacked), 0.3 % of one step
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)
    assert metrics(tmp_path / "gc")[1]["grad_norm"] > 0


def test_bf16_autocast_trains(assets, tmp_path):
    dirs, data = assets
    out = tmp_path / "bf16"
    trainer.train(load_config(None, overrides(dirs["qwen2"], data, out, "model.autocast_bf16=true",
                                              "reward_weights=null")), rewards=[_length_reward])
    rows = metrics(out)
    assert all(r["grad_norm"] > 0 and r["fault/skipped_updates"] == 0 for r in rows[1:])


def test_chat_template_reaches_the_model(assets, monkeypatch):
    dirs, data = assets
    cfg = load_config(None, overrides(dirs["qwen2"], data, "unused", "model.chat_template=true",
                                      "model.system_prompt=Be brief."))
    _, tok = load_model(cfg.model)
    from grpo.envs import prompt_formatter
    text = prompt_formatter(tok, cfg.model)("What is 2 + 2?")
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert tok.pad_token_id == tok.eos_token_id  # the tokenizer had no pad token


def test_extra_columns_reach_reward_functions(assets, tmp_path):
    dirs, data = assets
    seen = {}

    def by_level(prompts, completions, answer, level, **kw):
        seen["level"] = sorted(set(level))
        seen["answer"] = answer[0]
        return [0.1 * lv for lv in level]

    trainer.train(load_config(None, overrides(dirs["llama"], data, tmp_path / "r", "reward_weights=null",
                                              "rewards=[exact_match]")), rewards=[by_level])
    assert set(seen["level"]) <= {0, 1, 2} and "####" in seen["answer"]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_lora_reference_is_the_base_model_without_a_copy(assets, tmp_path, monkeypatch, arch):
    dirs, data = assets
    copies = []
    monkeypatch.setattr(trainer, "frozen_copy", lambda m: copies.append(m))
    out = tmp_path / "lora"
    cfg = load_config(None, overrides(dirs[arch], data, out, "lora.rank=4", "lora.save_merged=true",
                                      "algo.beta=0.04"))
    trainer.train(cfg)
    assert copies == []  # no second model in memory
    assert (out / "model" / "adapter_config.json").exists() and (out / "model" / "adapter_model.safetensors").exists()
    assert not (out / "model" / "model.safetensors").exists()
    merged = transformers.AutoModelForCausalLM.from_pretrained(out / "model-merged")
    # the reference log-probs (adapter disabled) equal the base model's, while the policy's differ
    policy, tok = load_model(cfg.model, cfg.lora)
    trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    assert 0 < trainable < sum(p.numel() for p in policy.parameters()) / 5
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    base = transformers.AutoModelForCausalLM.from_pretrained(dirs[arch]).eval()
    enc = tok(["Tom has 3 boxes."], return_tensors="pt")
    ids = torch.tensor([tok.encode(" He has 12.")])
    mask = torch.ones_like(ids)
    args = (enc["input_ids"], enc["attention_mask"], ids, mask)
    with torch.no_grad():
        ref = LogprobModule(policy, adapter_off=True)(*args, temperature=1.0, chunk_size=4)
        pol = LogprobModule(policy)(*args, temperature=1.0, chunk_size=4)
        want = LogprobModule(base)(*args, temperature=1.0, chunk_size=4)
    assert torch.allclose(ref, want, atol=1e-6) and not torch.allclose(pol, want, atol=1e-3)
    assert merged.config.vocab_size == base.config.vocab_size
