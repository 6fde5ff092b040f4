"""Vision-language models (grpo.vision, grpo.images): images through collect and learn on a Qwen2.5-VL-architecture model.

Each pitfall the trainers that support VLMs have hit is a test here: placeholder tokens sampled into completions
(TRL #3847), image tensors split wrongly per micro-batch (TRL #4488), left-padded prompts against multimodal positions
(TRL #5785), the sampler's and the trainer's log-probs differing on-policy (verl #2996)."""
import io

import pytest
import torch

from grpo.errors import ConfigError, DataError
from grpo.policy.forward import LogprobModule, completion_logprobs, forward_path
from grpo.rollout import HFGenerator, Sampling
from grpo.rollout.hf import _TransformersDecoding
from grpo.tasks.hf import to_examples
from grpo.tasks.shapes import draw, shape_examples
from grpo.images import VisionPrompt, image_messages, load_image
from grpo.vision import join, mask_placeholders, placeholder_ids
from tests.unit.vision_models import FAMILIES


@pytest.fixture(scope="module")
def vlm():
    return FAMILIES["qwen2_5_vl"]()


@pytest.fixture(scope="module", params=list(FAMILIES))
def any_vlm(request):
    """Each family's tiny model: the tests that take it hold for the Qwen2-VL family and Gemma 3 alike."""
    return FAMILIES[request.param]()


@pytest.fixture(scope="module")
def examples():
    train, _ = shape_examples()
    return train


def render(tok, text, images):
    return VisionPrompt(tok.apply_chat_template(image_messages(text, images), tokenize=False,
                                                add_generation_prompt=True), tuple(images))


def mixed_prompts(tok, examples):
    """Prompts with one image, two images (of two sizes: 16 and 64 image tokens) and none, of different lengths
    (so left padding differs per row)."""
    small = examples[3].images[0].resize((16, 16))
    text_only = tok.apply_chat_template([{"role": "user", "content": "How many squares are there?"}],
                                        tokenize=False, add_generation_prompt=True)
    return [render(tok, examples[0].prompt, examples[0].images),
            render(tok, "Which has more red squares?", (examples[1].images[0], small)),
            text_only]


def test_placeholder_widened_per_image(vlm, examples):
    model, tok, prompts = vlm
    ids, images = prompts.encode(render(tok, "How many?", (examples[0].images[0], examples[0].images[0].resize((64, 64)))))
    image_id = model.config.image_token_id
    # 32 x 32: an 8 x 8 grid of 4-pixel patches, merged 2 x 2 -> 16 tokens; 64 x 64 -> 64
    assert images.image_grid_thw.tolist() == [[1, 8, 8], [1, 16, 16]]
    assert ids.count(image_id) == 16 + 64
    assert images.pixel_values.shape[0] == 64 + 256


def test_placeholders_are_never_sampled(any_vlm, examples):
    """A model that would put nearly all its mass on the placeholder tokens still never writes one."""
    model, tok, prompts = any_vlm
    banned = placeholder_ids(model)
    c = model.config
    assert set(banned) == ({c.image_token_id, c.boi_token_index, c.eoi_token_index} if c.model_type == "gemma3" else
                           {c.image_token_id, c.video_token_id, c.vision_start_token_id, c.vision_end_token_id})

    def boost(module, args, out):
        out[..., banned] += 100.0
        return out

    handle = model.lm_head.register_forward_hook(boost)
    try:
        g = HFGenerator(model, tok, add_special_tokens=False, image_prompts=prompts)
        r = g.generate(mixed_prompts(tok, examples), Sampling(4, 12, 1.0), seeds=[1, 2, 3])
        sampled = r.completion_ids[r.completion_mask.bool()]
        assert sampled.numel() > 0
        assert not torch.isin(sampled, torch.tensor(banned)).any()
        # and the trainer's policy is the same one: the placeholders have probability 0 there too
        lp = completion_logprobs(model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask,
                                 temperature=1.0, chunk_size=64, images=join(r.images))
        assert torch.isfinite(lp).all()
    finally:
        handle.remove()


def test_sampler_and_trainer_log_probs_agree(any_vlm, examples):
    """The decoding steps (prefill with the images, then one token at a time from each row's last rotary position)
    and the training forward (every row in full, positions from the model's get_rope_index; Gemma 3's image tokens
    marked by their token types in both) give the same log-probs, with 1, 2 and no images in one left-padded
    batch."""
    model, tok, prompts = any_vlm
    g = HFGenerator(model, tok, add_special_tokens=False, image_prompts=prompts)
    batch = mixed_prompts(tok, examples)
    with torch.no_grad():
        r = g.generate(batch, Sampling(2, 10, 1.0), seeds=[1, 2, 3])
        assert [x is None for x in r.images] == [False, False, False, False, True, True]
        trained = completion_logprobs(model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask,
                                      temperature=1.0, chunk_size=64, images=join(r.images))
        ids, images = g._encode(batch)
        width = max(map(len, ids))
        p = torch.zeros(len(ids), width, dtype=torch.long)
        m = torch.zeros_like(p)
        for i, x in enumerate(ids):
            p[i, width - len(x):] = torch.tensor(x)
            m[i, width - len(x):] = 1
        state, logits = _TransformersDecoding.prefill(model, p, m, 2, join(images))
        decoded = []
        for t in range(r.completion_ids.shape[1]):
            z = torch.log_softmax(mask_placeholders(logits.float(), g.banned), -1)
            decoded.append(z.gather(1, r.completion_ids[:, t:t + 1]).squeeze(1))
            logits = state.step(r.completion_ids[:, t])
    decoded = torch.stack(decoded, 1)
    mask = r.completion_mask.bool()
    torch.testing.assert_close(trained[mask], decoded[mask], atol=1e-5, rtol=0)


def test_image_tensors_travel_with_their_rows(any_vlm, examples):
    """Log-probs and gradients of a batch with mixed image counts equal those of its rows one by one and in other
    splits: each micro-batch takes exactly its rows' pixel values and grids."""
    model, tok, prompts = any_vlm
    g = HFGenerator(model, tok, add_special_tokens=False, image_prompts=prompts)
    r = g.generate(mixed_prompts(tok, examples), Sampling(2, 6, 1.0), seeds=[4, 5, 6])
    module = LogprobModule(model, forward_path(model))

    def run(rows):
        lp_rows = r.prompt_mask[rows].sum(1).max()
        out = module(r.prompt_ids[rows, -lp_rows:], r.prompt_mask[rows, -lp_rows:], r.completion_ids[rows],
                     r.completion_mask[rows], temperature=1.0, chunk_size=64, images=join(r.images[rows]) or None)
        return out

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
    for a, p in zip(whole_grads, params):  # to rounding at each tensor's scale (Gemma's random projector's is 1e4)
        torch.testing.assert_close(p.grad, a, atol=1e-5 * max(1.0, a.abs().max().item()), rtol=1e-4)
    model.zero_grad()


def test_the_multimodal_path_is_stated(vlm):
    model, _, _ = vlm
    path = forward_path(model, share_prompt=True, lean=True, packing=True)
    assert path.multimodal and not (path.fused or path.share_prompt or path.lean or path.packing)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_freeze_vision_and_lora_targets(family):
    """The tower and its projector frozen by default; LoRA's all-linear adapts the language model alone."""
    from grpo.config import LoraConfig, ModelConfig
    from grpo.models import _VISION_MODULES, _prepared

    def tower(name):
        return bool(set(name.split(".")) & set(_VISION_MODULES))

    model, tok, _ = FAMILIES[family]()
    model, _ = _prepared(model, tok, ModelConfig(), None, "cpu")
    frozen = [p.requires_grad for n, p in model.named_parameters() if tower(n)]
    assert frozen and not any(frozen)
    assert all(p.requires_grad for n, p in model.named_parameters() if "language_model" in n)
    lora = _prepared(FAMILIES[family]()[0], tok, ModelConfig(), LoraConfig(rank=4), "cpu")[0]
    adapted = {n for n, _ in lora.named_parameters() if "lora_A" in n}
    assert adapted and not any(tower(n) for n in adapted)
    assert any("language_model" in n and "gate_proj" in n for n in adapted)


def test_vllm_backends_refuse_images_in_one_line(vlm):
    from grpo.config import Config
    from grpo.rollout import build_generator

    model, tok, _ = vlm
    cfg = Config()
    for backend in ("vllm", "vllm_server"):
        cfg.rollout.backend = backend
        with pytest.raises(ConfigError, match=f"rollout.backend={backend}: images are not passed to vLLM"):
            build_generator(model, tok, cfg)


# ------------------------------------------------------------------------------------------------- images in data

def _png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def test_image_column_from_paths_bytes_and_images(tmp_path):
    picture = draw({0: "red", 5: "blue"})
    path = tmp_path / "a.png"
    picture.save(path)
    gray = picture.convert("L")
    rows = [{"prompt": "How many red squares?", "answer": "1", "images": str(path)},
            {"prompt": "How many?", "answer": "2", "images": [_png(picture), picture]},
            {"prompt": "Gray?", "answer": "0", "images": {"bytes": _png(gray), "path": None}},
            {"prompt": "None?", "answer": "0", "images": None}]
    ex = to_examples(rows, "data", ("prompt", "answer", "images"))
    assert [len(e.images) for e in ex] == [1, 2, 1, 0]
    assert all(im.mode == "RGB" and im.size == (32, 32) for e in ex for im in e.images)
    assert ex[0].images[0].tobytes() == picture.tobytes()
    assert "images" not in ex[0].fields


@pytest.mark.parametrize("value, message", [
    (b"not an image", "not a readable image"),
    (b"", "the image is empty"),
    ("missing.png", "no image file"),
    (3, "an image must be a PIL image, a file path or bytes, got int"),
])
def test_a_bad_image_is_one_line_naming_its_row(tmp_path, value, message):
    rows = [{"prompt": "ok", "images": _png(draw({}))}, {"prompt": "bad", "images": value}]
    with pytest.raises(DataError, match=f"data row 2, column 'images': {message}"):
        to_examples(rows, "data", ("prompt", "answer", "images"))


def test_zero_size_and_odd_modes(tmp_path):
    from PIL import Image

    empty = tmp_path / "empty.png"
    empty.write_bytes(b"")
    with pytest.raises(DataError, match="is empty"):
        load_image(str(empty), "row 7")
    with pytest.raises(DataError, match="row 7: the image has zero size"):
        load_image(Image.new("RGB", (0, 4)), "row 7")
    assert load_image(Image.new("RGBA", (4, 4)), "row 7").mode == "RGB"
    assert load_image(Image.new("I;16", (4, 4)), "row 7").mode == "RGB"


def test_shapes_task_is_fixed_and_split_by_scene():
    from grpo.tasks import load_builtin_task

    a, b = load_builtin_task("shapes", seed=0), load_builtin_task("shapes", seed=1)
    assert len(a.eval) == 200 and len(a.train) == 2200
    assert [e.fields["scene"] for e in a.eval] == [e.fields["scene"] for e in b.eval]
    assert not {e.fields["scene"] for e in a.eval} & {e.fields["scene"] for e in a.train}
    counts = {int(e.answer) for e in a.train}
    assert counts == set(range(7))
    e = a.train[0]
    cells = [c for c in e.fields["scene"].split(":")[0].split(",") if c]
    colour = e.fields["scene"].split(":")[1]
    assert int(e.answer) == sum(c[-1] == colour[0] for c in cells)


# ------------------------------------------------------------------------------- conversational prompts with images

def _chat_rows(picture):
    return [
        # the images' places given: the question between two pictures
        {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Left or"},
                                                 {"type": "image"}, {"type": "text", "text": "right?"}]}],
         "images": [_png(picture), picture]},
        # no places: the image goes first in the first user message, as TRL puts it
        {"prompt": [{"role": "system", "content": "Count."}, {"role": "user", "content": "How many red squares?"}],
         "images": [picture]},
    ]


def test_conversations_hold_their_images_in_place():
    picture = draw({0: "red", 5: "blue"})
    ex = to_examples(_chat_rows(picture), "data", ("prompt", "answer", "images"))
    assert [len(e.images) for e in ex] == [2, 1]
    assert ex[0].conversation[0]["content"] == [{"type": "image"}, {"type": "text", "text": "Left or"},
                                                {"type": "image"}, {"type": "text", "text": "right?"}]
    assert ex[1].conversation[1]["content"] == [{"type": "image"}, {"type": "text", "text": "How many red squares?"}]
    assert ex[0].prompt == "Left or right?" and ex[1].prompt == "How many red squares?"


def test_conversations_from_arrow_and_a_wrong_image_count():
    """A `datasets.Dataset` fills each part's missing keys with None (they are dropped); a row whose image parts
    are not as many as its images is one line naming it; list contents without images become text."""
    import datasets

    picture = draw({3: "green"})
    rows = _chat_rows(picture)
    listed = [{**r, "prompt": [{**m, "content": m["content"] if isinstance(m["content"], list) else
                                [{"type": "text", "text": m["content"]}]} for m in r["prompt"]],
               "images": [_png(picture)] * len(r["images"])} for r in rows]  # Arrow takes one kind of content
    ds = datasets.Dataset.from_list(listed)
    ex = to_examples(ds, "data", ("prompt", "answer", "images"))
    assert ex[0].conversation[0]["content"][0] == {"type": "image"} and len(ex[0].images) == 2
    bad = [rows[1], {**rows[0], "images": [picture]}]
    with pytest.raises(DataError, match="data row 2: the conversation has 2 image parts for 1 image in the image"):
        to_examples(bad, "data", ("prompt", "answer", "images"))
    text = [{"prompt": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}], "images": None}]
    assert to_examples(text, "data", ("prompt", "answer", "images"))[0].conversation == [
        {"role": "user", "content": "Hi"}]


def test_a_conversation_with_images_renders_and_samples(vlm):
    from grpo.config import ModelConfig
    from grpo.envs.single_turn import SingleTurn, prompt_formatter

    model, tok, prompts = vlm
    picture = draw({0: "red", 5: "blue"})
    ex = to_examples(_chat_rows(picture), "data", ("prompt", "answer", "images"))
    render = prompt_formatter(tok, ModelConfig(chat_template=True))
    rendered = render(ex[0].conversation, ex[0].images)
    assert rendered.text == ("user: <|vision_start|><|image_pad|><|vision_end|>Left or<|vision_start|><|image_pad|>"
                             "<|vision_end|>right?<|endoftext|>assistant:")
    assert render(ex[1].conversation, ex[1].images).text.startswith("system: Count.<|endoftext|>user: <|vision_start|>")
    g = HFGenerator(model, tok, add_special_tokens=False, image_prompts=prompts)
    r = SingleTurn(render).rollout(g, ex, Sampling(2, 4, 1.0), seeds=[1, 2])
    assert [x.count for x in r.images] == [2, 2, 1, 1]
    assert (r.prompt_ids == model.config.image_token_id).sum(1).tolist() == [32, 32, 16, 16]


# ------------------------------------------------------------------------------------ prompt lengths with images

def test_length_from_image_sizes_equals_the_encoded_length(any_vlm, examples):
    """`ImagePrompts.length` (images' sizes only, no pixels processed) is the length `encode` gives, over sizes the
    processor resizes differently."""
    from PIL import Image

    model, tok, prompts = any_vlm
    picture = examples[0].images[0]
    for sizes in [(), ((32, 32),), ((16, 16), (64, 64)), ((37, 53), (100, 30), (8, 8))]:
        images = tuple(picture.resize(s, Image.NEAREST) for s in sizes)
        prompt = render(tok, "How many red squares?", images)
        assert prompts.length(prompt) == len(prompts.encode(prompt)[0]), sizes


def test_a_prompt_too_long_with_its_images_is_refused_at_load(vlm, examples):
    """The load-time check counts each image's tokens, not one placeholder: a prompt that fits as text but not with
    its pictures is one line, with the count, the images' size and the way out."""
    from PIL import Image

    from grpo.config import ModelConfig
    from grpo.data import fit_prompts
    from grpo.envs.single_turn import prompt_formatter
    from grpo.tasks.base import Example

    model, tok, prompts = vlm
    render_ = prompt_formatter(tok, ModelConfig(chat_template=True))
    big = examples[0].images[0].resize((64, 64), Image.NEAREST)  # 64 image tokens
    rows = [Example("How many red squares?", "1", images=(big,)), Example("How many?", "1", images=())]
    fit = dict(render=render_, tokenizer=tok, add_special_tokens=False, truncate="left", what="training",
               why="the test's limit", image_prompts=prompts)
    assert fit_prompts(rows, limit=120, **fit) == rows
    with pytest.raises(DataError, match=r"1 of 2 training prompts with images have more than 60 tokens once their "
                                        r"images are widened .* the longest has 10\d with 1 image \(64x64\)"):
        fit_prompts(rows, limit=60, **fit)


def test_the_first_of_mu_updates_sees_a_ratio_of_exactly_one(any_vlm, examples):
    """Collect with the generator (pictures in every row), then learn with μ = 2 in micro-batches that cut the groups
    apart: the old-policy pass and the first training pass are one network on the same rows and images, so the
    first update's ratio is exactly 1 and nothing is clipped (the on-policy check slime's CI makes)."""
    from algo_specs import advantage_spec, loss_spec
    from grpo.collect import Collector, collect
    from grpo.config import ModelConfig
    from grpo.data import PromptStream
    from grpo.distributed import Dist, wrap_for_training
    from grpo.envs.single_turn import SingleTurn, prompt_formatter
    from grpo.learn import Learner, learn
    from grpo.sampling import Sampler

    model, tok, prompts = any_vlm

    def length(prompts, completions, **_):  # a signal from any model: longer is better
        return [float(len(c)) for c in completions]

    env = SingleTurn(prompt_formatter(tok, ModelConfig(chat_template=True)))
    generator = HFGenerator(model, tok, add_special_tokens=False, image_prompts=prompts)
    collector = Collector(Sampler(env, generator, Sampling(4, 6), seed=0), [("length", length)], None, tok,
                          prompts_per_step=2, spec=advantage_spec(dynamic_sampling=False))
    exp = collect(collector, PromptStream(examples[:4], 2, seed=0), Dist())
    assert all(x is not None and x.count == 1 for x in exp.images)
    trainable = wrap_for_training(model, Dist(), "ddp", forward_path(model))
    learner = Learner(trainable, None, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1),
                      loss_spec(6, beta=0.0, num_iterations=2), 1.0, 64, max_rows=3, max_tokens=0, max_grad_norm=0.0)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        first, second = learn(learner, exp, Dist())
        assert first["ratio/mean"] / first["tokens"] == 1.0 and first["clip/frac"] == 0.0
        assert second["ratio/mean"] / second["tokens"] != 1.0  # the first update moved the policy
    finally:
        model.load_state_dict(state)  # the module-scoped model stays the random one
        model.zero_grad(set_to_none=True)
