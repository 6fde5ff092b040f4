"""Lean decoding steps (grpo.rollout.lean_decoding) give transformers' logits, and fall back wherever they cannot."""
import copy

import pytest
import torch
import transformers

from grpo.errors import DataError
from grpo.rollout import HFGenerator, Sampling
from grpo.policy.lean import supported
from grpo.rollout.lean_decoding import LeanDecoding
from grpo.tiny import build_char_tokenizer

PROMPTS = ["Calculate 1 + 2 * 3 =", "Solve y = 2x + 1 for x = 2, y =", "Hi"]  # padded on the left


def build(arch: str, attn: str = "sdpa", **extra):
    tok = build_char_tokenizer()
    common = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}[arch]
    torch.manual_seed(0)
    model = cls[1](cls[0](**{**common, **extra}))
    model.config._attn_implementation = attn
    return model.eval(), tok


CASES = [("qwen2", "sdpa", {}), ("qwen2", "eager", {}), ("llama", "sdpa", {"attention_bias": True, "mlp_bias": True}),
         ("llama", "eager", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}}),
         ("mistral", "sdpa", {"sliding_window": None})]


@pytest.mark.parametrize("arch,attn,extra", CASES + [
    # a RoPE that rescales with the length (past 8 positions here): its cos and sin come step by step
    ("llama", "sdpa", {"max_position_embeddings": 8, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0,
                                                                          "rope_theta": 10000.0}})])
@pytest.mark.parametrize("bf16", [False, True])
def test_prefill_and_steps_give_transformers_logits(arch, attn, extra, bf16):
    model, tok = build(arch, attn, **extra)
    assert supported(model)
    reference = copy.deepcopy(model)  # its own rotary embedding: a dynamic RoPE keeps state
    enc = tok(PROMPTS, return_tensors="pt", padding=True, padding_side="left")
    mask = enc["attention_mask"].repeat_interleave(2, dim=0)
    steps = 6
    # bfloat16: the prefill's matmuls run over a flat batch of positions (other row counts, other roundings)
    tol = dict(atol=3e-2, rtol=0) if bf16 else dict(atol=1e-5, rtol=1e-5)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        out = reference(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"],
                        position_ids=(enc["attention_mask"].cumsum(-1) - 1).clamp(min=0), use_cache=True)
        cache = out.past_key_values
        cache.batch_repeat_interleave(2)
        lean, first = LeanDecoding.prefill(model, enc["input_ids"], enc["attention_mask"], 2, steps)
        torch.testing.assert_close(first, out.logits[:, -1].repeat_interleave(2, dim=0), **tol)
        attn_mask, pos = mask, mask.sum(-1, keepdim=True)
        tokens = torch.randint(3, len(tok), (mask.shape[0], steps))
        for t in range(steps):
            attn_mask = torch.cat([attn_mask, torch.ones_like(attn_mask[:, :1])], dim=1)
            ref = reference(input_ids=tokens[:, t:t + 1], attention_mask=attn_mask, position_ids=pos,
                            past_key_values=cache, use_cache=True).logits[:, -1]
            pos = pos + 1
            got = lean.step(tokens[:, t])
            assert got.dtype == ref.dtype
            torch.testing.assert_close(got, ref, **tol)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_generator_rollouts_match_the_transformers_forward(arch):
    model, tok = build(arch)
    s = Sampling(n=3, max_new_tokens=9, temperature=1.0, min_new_tokens=2)
    lean = HFGenerator(model, tok).generate(PROMPTS, s, seeds=[1, 2, 3])
    plain = HFGenerator(model, tok, lean=False).generate(PROMPTS, s, seeds=[1, 2, 3])
    assert torch.equal(lean.completion_ids, plain.completion_ids) and lean.texts == plain.texts
    assert torch.equal(lean.completion_mask, plain.completion_mask)
    # no padding at all: the lean steps run without a key mask
    same = HFGenerator(model, tok).generate(["abc", "xyz"], s, seeds=[4, 5])
    assert torch.equal(same.completion_ids,
                       HFGenerator(model, tok, lean=False).generate(["abc", "xyz"], s, seeds=[4, 5]).completion_ids)


def test_unsupported_models_decode_with_transformers():
    qwen, tok = build("qwen2")
    assert not supported(build("mistral", sliding_window=4)[0])  # a sliding window is not reproduced
    assert not supported(build("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=0)[0])
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2,
                                                                eos_token_id=tok.eos_token_id)).eval()
    assert not supported(gpt2)
    s = Sampling(n=2, max_new_tokens=5, temperature=0.0)
    r = HFGenerator(gpt2, tok).generate(PROMPTS, s)
    assert torch.equal(r.completion_ids, HFGenerator(gpt2, tok, lean=False).generate(PROMPTS, s).completion_ids)
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(copy.deepcopy(qwen), peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    assert not supported(lora) and not supported(lora.base_model.model)  # LoRA layers are not plain Linear


def test_prompts_without_tokens_are_refused_clearly():
    model, tok = build("qwen2")  # the character tokenizer adds no BOS: "" is no token at all
    for lean in (True, False):
        with pytest.raises(DataError, match="the prompt '' tokenizes to no tokens"):
            HFGenerator(model, tok, lean=lean).generate([""], Sampling(n=2, max_new_tokens=3, temperature=0.0))


def _lora(model, **extra):
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                                   **extra))
    with torch.no_grad():  # a non-zero adapter: B starts at zero
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return lora.eval()


@pytest.mark.parametrize("bf16", [False, True])
def test_lora_models_decode_from_merged_weights(bf16):
    from grpo.rollout.lean_decoding import merged_lora
    model, tok = build("llama", attention_bias=True)
    lora = _lora(model)
    before = {k: v.clone() for k, v in lora.state_dict().items()}
    view = merged_lora(lora)
    assert supported(view) and view is not lora.get_base_model()
    assert {k: v for k, v in lora.state_dict().items()}.keys() == before.keys()
    assert all(torch.equal(v, before[k]) for k, v in lora.state_dict().items())  # the policy itself is untouched
    assert view.model.embed_tokens is lora.get_base_model().model.embed_tokens  # shared, not copied
    enc = tok(PROMPTS, return_tensors="pt", padding=True, padding_side="left")
    tol = dict(atol=3e-2, rtol=0) if bf16 else dict(atol=1e-5, rtol=1e-5)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        pos = (enc["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        out = lora(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], position_ids=pos)
        _, first = LeanDecoding.prefill(lora, enc["input_ids"], enc["attention_mask"], 1, 4)
        torch.testing.assert_close(first, out.logits[:, -1], **tol)
        # the adapter matters: without it the logits differ
        with lora.disable_adapter():
            plain = lora(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], position_ids=pos)
        assert (plain.logits[:, -1] - out.logits[:, -1]).abs().max() > 1e-2
    s = Sampling(n=3, max_new_tokens=9, temperature=1.0, min_new_tokens=2)
    if not bf16:
        lean = HFGenerator(lora, tok).generate(PROMPTS, s, seeds=[1, 2, 3])
        slow = HFGenerator(lora, tok, lean=False).generate(PROMPTS, s, seeds=[1, 2, 3])
        assert torch.equal(lean.completion_ids, slow.completion_ids) and lean.texts == slow.texts


def test_lora_variants_the_merge_does_not_cover_decode_with_transformers():
    from grpo.rollout.lean_decoding import merged_lora
    model, tok = build("llama")
    assert merged_lora(model) is None  # not a peft model
    dora = _lora(model, use_dora=True)
    assert merged_lora(dora) is None
    lora = _lora(model)
    with lora.disable_adapter():
        assert merged_lora(lora) is None  # the reference: the base model's own forward
    s = Sampling(n=2, max_new_tokens=5, temperature=0.0)
    assert torch.equal(HFGenerator(dora, tok).generate(PROMPTS, s).completion_ids,
                       HFGenerator(dora, tok, lean=False).generate(PROMPTS, s).completion_ids)
