"""Gemma 3, the second vision-language family: its prompts rendered as its own processor renders them, and its image
tokens attending to each other both ways (token_type_ids). The pitfalls both families share (placeholders, one
policy for sampler and trainer, rows and their images in micro-batches, the frozen tower) are test_vision.py's,
run on each family."""
import pytest
import torch
import transformers

from grpo.policy.inputs import model_inputs
from grpo.tasks.shapes import shape_examples
from grpo.tiny import GEMMA3_IMAGE_TOKENS, build_gemma3_image_processor, build_gemma3_tokenizer
from grpo.images import VisionPrompt, image_family, image_messages
from grpo.vision import join, token_types
from tests.unit.vision_models import FAMILIES


@pytest.fixture(scope="module")
def gemma():
    return FAMILIES["gemma3"]()


@pytest.fixture(scope="module")
def examples():
    return shape_examples()[0]


def render(tok, text, images):
    return VisionPrompt(tok.apply_chat_template(image_messages(text, images), tokenize=False,
                                                add_generation_prompt=True), tuple(images))


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


def test_another_family_is_refused_in_one_line():
    from grpo.errors import ConfigError

    cfg = transformers.LlavaConfig()
    with pytest.raises(ConfigError, match="a llava model; grpo trains vision-language models of the Qwen2-VL "
                                          "family .* and Gemma 3"):
        image_family(cfg)
