"""Gemma 3, the second vision-language family: its prompts rendered as its own processor renders them, its image
tokens attending to each other both ways in the prefill and the training pass alike (token_type_ids), and the
pitfalls of test_vision.py on its layout (placeholders, one policy for sampler and trainer, rows and their
images in micro-batches, the frozen tower)."""
import pytest
import torch
import transformers

from grpo.policy.forward import LogprobModule, completion_logprobs, forward_path
from grpo.policy.inputs import model_inputs
from grpo.rollout import HFGenerator, Sampling
from grpo.rollout.hf import _TransformersDecoding
from grpo.tasks.shapes import shape_examples
from grpo.tiny import (GEMMA3_IMAGE_TOKENS, build_gemma3_image_processor, build_gemma3_tokenizer,
                       tiny_gemma3_config)
from grpo.images import ImagePrompts, VisionPrompt, image_family, image_messages
from grpo.vision import join, mask_placeholders, placeholder_ids, token_types


@pytest.fixture(scope="module")
def gemma():
    """A random tiny Gemma 3 (sliding and full attention layers, a SigLIP tower), its tokenizer and prompts."""
    tok = build_gemma3_tokenizer()
    cfg = tiny_gemma3_config(tok)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    return model, tok, ImagePrompts(tok, build_gemma3_image_processor(), cfg)


@pytest.fixture(scope="module")
def examples():
    return shape_examples()[0]


def render(tok, text, images):
    return VisionPrompt(tok.apply_chat_template(image_messages(text, images), tokenize=False,
                                                add_generation_prompt=True), tuple(images))


def mixed_prompts(tok, examples):
    """One image, two images and none, of different lengths (different left padding per row)."""
    text_only = tok.apply_chat_template([{"role": "user", "content": "How many squares are there?"}],
                                        tokenize=False, add_generation_prompt=True)
    return [render(tok, examples[0].prompt, examples[0].images),
            render(tok, "Which has more red squares?", (examples[1].images[0], examples[2].images[0])),
            text_only]


def _padded(ids):
    width = max(map(len, ids))
    p = torch.zeros(len(ids), width, dtype=torch.long)
    m = torch.zeros_like(p)
    for i, x in enumerate(ids):
        p[i, width - len(x):] = torch.tensor(x)
        m[i, width - len(x):] = 1
    return p, m


def test_family_and_placeholder_sequence(gemma, examples):
    """`<start_of_image>` widens to Gemma3Processor's full image sequence; the pictures are (n, 3, 16, 16)."""
    model, tok, prompts = gemma
    assert image_family(model.config) == "gemma3"
    ids, images = prompts.encode(render(tok, "How many?", (examples[0].images[0], examples[1].images[0])))
    cfg = model.config
    text = tok.decode(ids)
    one = f"\n\n<start_of_image>{'<image_soft_token>' * GEMMA3_IMAGE_TOKENS}<end_of_image>\n\n"
    assert text == f"user: {one}{one}How many?<|endoftext|>model:"
    assert ids.count(cfg.image_token_id) == 2 * GEMMA3_IMAGE_TOKENS
    assert images.pixel_values.shape == (2, 3, 16, 16) and images.image_grid_thw is None and images.count == 2


def test_same_inputs_as_gemma3_processor(gemma, examples):
    """Ids, pixel values and token types equal those transformers' Gemma3Processor makes of the same prompt."""
    model, tok, prompts = gemma
    ours = build_gemma3_tokenizer()
    ours.boi_token, ours.eoi_token, ours.image_token = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
    ours.boi_token_id, ours.image_token_id = (ours.convert_tokens_to_ids(t) for t in
                                              ("<start_of_image>", "<image_soft_token>"))
    try:
        processor = transformers.Gemma3Processor(image_processor=build_gemma3_image_processor(), tokenizer=ours,
                                                 image_seq_length=GEMMA3_IMAGE_TOKENS)
    except (TypeError, ValueError, AttributeError) as e:  # a tokenizer without Gemma's named tokens
        pytest.skip(f"Gemma3Processor cannot be built around the character tokenizer: {e}")
    prompt = render(tok, "How many red squares?", (examples[0].images[0], examples[1].images[0]))
    theirs = processor(text=[prompt.text], images=[list(prompt.images)], return_tensors="pt", add_special_tokens=False)
    ids, images = prompts.encode(prompt)
    assert theirs["input_ids"][0].tolist() == ids
    torch.testing.assert_close(theirs["pixel_values"], images.pixel_values, atol=0, rtol=0)
    mine = model_inputs(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long), join([images]), model)
    assert mine.images["token_type_ids"].tolist() == theirs["token_type_ids"].tolist()


def test_token_types_matter_and_are_given(gemma, examples):
    """The training forward's inputs mark the image tokens, and the mark changes the policy (the image tokens
    attend to each other both ways): a forward without it is another model's."""
    model, tok, prompts = gemma
    ids, images = prompts.encode(render(tok, examples[0].prompt, examples[0].images))
    x = torch.tensor([ids])
    inputs = model_inputs(x, torch.ones_like(x), join([images]), model)
    assert inputs.images["token_type_ids"].tolist() == [[int(i == model.config.image_token_id) for i in ids]]
    assert token_types(transformers.Qwen2ForCausalLM(transformers.Qwen2Config(num_hidden_layers=1, hidden_size=8, intermediate_size=8, num_attention_heads=2, num_key_value_heads=1, vocab_size=8)), x) == {}
    with torch.no_grad():
        given = model(**inputs.forward_kwargs()).logits
        kwargs = inputs.forward_kwargs()
        kwargs.pop("token_type_ids")
        causal = model(**kwargs).logits
    assert (given[0, -1] - causal[0, -1]).abs().max() > 1e-4


def test_placeholders_are_never_sampled(gemma, examples):
    model, tok, prompts = gemma
    banned = placeholder_ids(model)
    cfg = model.config
    assert set(banned) == {cfg.image_token_id, cfg.boi_token_index, cfg.eoi_token_index}

    def boost(module, args, out):
        out[..., banned] += 100.0
        return out

    handle = model.lm_head.register_forward_hook(boost)
    try:
        g = HFGenerator(model, tok, add_special_tokens=False, image_prompts=prompts)
        r = g.generate(mixed_prompts(tok, examples), Sampling(4, 12, 1.0), seeds=[1, 2, 3])
        sampled = r.completion_ids[r.completion_mask.bool()]
        assert sampled.numel() and not torch.isin(sampled, torch.tensor(banned)).any()
    finally:
        handle.remove()


def test_sampler_and_trainer_log_probs_agree(gemma, examples):
    """The prefill (with the images and their token types) then one token at a time, and the training forward
    over each row in full, give the same log-probs with 1, 2 and no images in one left-padded batch."""
    model, tok, prompts = gemma
    g = HFGenerator(model, tok, add_special_tokens=False, image_prompts=prompts)
    batch = mixed_prompts(tok, examples)
    with torch.no_grad():
        r = g.generate(batch, Sampling(2, 10, 1.0), seeds=[1, 2, 3])
        assert [x is None for x in r.images] == [False, False, False, False, True, True]
        trained = completion_logprobs(model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask,
                                      temperature=1.0, chunk_size=64, images=join(r.images))
        ids, images = g._encode(batch)
        p, m = _padded(ids)
        state, logits = _TransformersDecoding.prefill(model, p, m, 2, join(images))
        decoded = []
        for t in range(r.completion_ids.shape[1]):
            z = torch.log_softmax(mask_placeholders(logits.float(), g.banned), -1)
            decoded.append(z.gather(1, r.completion_ids[:, t:t + 1]).squeeze(1))
            logits = state.step(r.completion_ids[:, t])
    decoded = torch.stack(decoded, 1)
    mask = r.completion_mask.bool()
    torch.testing.assert_close(trained[mask], decoded[mask], atol=1e-5, rtol=0)


def test_image_tensors_travel_with_their_rows(gemma, examples):
    """Log-probs and gradients of a batch with mixed image counts equal those of its rows in other splits."""
    model, tok, prompts = gemma
    g = HFGenerator(model, tok, add_special_tokens=False, image_prompts=prompts)
    r = g.generate(mixed_prompts(tok, examples), Sampling(2, 6, 1.0), seeds=[4, 5, 6])
    module = LogprobModule(model, forward_path(model))

    def run(rows):
        lp_rows = r.prompt_mask[rows].sum(1).max()
        return module(r.prompt_ids[rows, -lp_rows:], r.prompt_mask[rows, -lp_rows:], r.completion_ids[rows],
                      r.completion_mask[rows], temperature=1.0, chunk_size=64, images=join(r.images[rows]) or None)

    with torch.no_grad():
        whole = run(slice(0, 6))
        for rows in (slice(0, 1), slice(1, 3), slice(3, 6), slice(2, 5)):
            torch.testing.assert_close(run(rows) * r.completion_mask[rows], whole[rows] * r.completion_mask[rows],
                                       atol=1e-5, rtol=0)
    params = [p for p in model.parameters() if p.requires_grad]
    model.zero_grad()
    (run(slice(0, 6)) * r.completion_mask).sum().backward()
    whole_grads = [p.grad.clone() for p in params]
    model.zero_grad()
    for rows in (slice(0, 3), slice(3, 6)):
        (run(rows) * r.completion_mask[rows]).sum().backward()
    for a, p in zip(whole_grads, params):  # to rounding at each tensor's scale (the random projector's is 1e4)
        torch.testing.assert_close(p.grad, a, atol=1e-5 * max(1.0, a.abs().max().item()), rtol=1e-4)
    model.zero_grad()


def test_freeze_vision_and_lora_targets():
    from grpo.config import LoraConfig, ModelConfig
    from grpo.models import _prepared

    tok = build_gemma3_tokenizer()
    model, _ = _prepared(transformers.Gemma3ForConditionalGeneration(tiny_gemma3_config(tok)), tok, ModelConfig(),
                         None, "cpu")
    tower = [p.requires_grad for n, p in model.named_parameters()
             if "vision_tower" in n or "multi_modal_projector" in n]
    assert tower and not any(tower)
    assert all(p.requires_grad for n, p in model.named_parameters() if "language_model" in n)
    lora = _prepared(transformers.Gemma3ForConditionalGeneration(tiny_gemma3_config(tok)), tok, ModelConfig(),
                     LoraConfig(rank=4), "cpu")[0]
    adapted = {n for n, _ in lora.named_parameters() if "lora_A" in n}
    assert adapted and not any("vision_tower" in n or "multi_modal_projector" in n for n in adapted)
    assert any("language_model" in n and "gate_proj" in n for n in adapted)


def test_another_family_is_refused_in_one_line():
    from grpo.errors import ConfigError

    cfg = transformers.LlavaConfig()
    with pytest.raises(ConfigError, match="a llava model; grpo trains vision-language models of the Qwen2-VL "
                                          "family .* and Gemma 3"):
        image_family(cfg)
