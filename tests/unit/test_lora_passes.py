"""LoRA with gradient checkpointing (the one setting that runs the training pass in train mode): the training
pass is the same network as the no-grad pass that gives the old log-probs, so the first of μ updates sees a
ratio of exactly 1. LoRA dropout would break that, which is why the config refuses lora.dropout > 0."""
import torch

from grpo.collect import collect
from grpo.config import LoraConfig, ModelConfig
from grpo.distributed import Dist, wrap_for_training
from grpo.learn import Learner, learn
from grpo.models import load_model
from grpo.policy import forward_path
from grpo.rewards import last_number

from algo_specs import loss_spec
from test_collect import Scripted, collector, stream

EPISODES = {"p0": ["so 1", "so 22"], "p1": ["it is 3", "1"]}


def first_update(random_model_dir, dropout, checkpointing=True):
    exp = collect(collector(Scripted(EPISODES), [("last_number", last_number)]), stream(["p0", "p1"]), Dist())
    model, _ = load_model(ModelConfig(path=str(random_model_dir), gradient_checkpointing=checkpointing),
                          LoraConfig(rank=4, dropout=dropout))  # built directly: the config would refuse 0.5
    torch.manual_seed(1)
    with torch.no_grad():  # a trained adapter (B starts at 0, which would hide any dropout)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    path = forward_path(model, sharded=False, share_prompt=False, lean=False, autocast_bf16=False)
    trainable = wrap_for_training(model, Dist(), "ddp", path, train_mode=True)
    learner = Learner(trainable, None, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1),
                      loss_spec(8, beta=0.0, num_iterations=2), 1.0, 8, max_rows=8, max_tokens=0, max_grad_norm=0.0)
    first = learn(learner, exp, Dist())[0]
    return first["ratio/mean"] / first["tokens"], first["clip/frac"]


def test_without_dropout_the_training_pass_is_the_sampling_network(random_model_dir):
    ratio, clipped = first_update(random_model_dir, 0.0)
    assert ratio == 1.0 and clipped == 0.0


def test_lora_dropout_would_make_the_ratio_measure_noise(random_model_dir):
    # the training pass in train mode (as with gradient checkpointing, under which torch's recomputation even
    # fails with peft's dropout): the dropout acts there and not in the old-policy pass
    ratio, clipped = first_update(random_model_dir, 0.5, checkpointing=False)
    assert abs(ratio - 1.0) > 1e-3 or clipped > 0
