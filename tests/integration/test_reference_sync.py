"""algo.ref_sync_every in real runs: a hard reset makes the next step's KL exactly 0, a soft one lowers it, with
LoRA the policy is untouched by a reset, and a resume continues with the reference exactly as it was."""
import pytest
import torch

import grpo.trainer as trainer
from grpo.checkpoint import REFERENCE, checkpoint_root
from grpo.errors import ConfigError

from test_resume import assert_same_run, cfg_for, rows

KL = ["algo.beta=0.04", "train.lr=3e-3", "eval.every=0", "rewards=[tests.integration.rewards:odd_length]"]


def kls(out):
    return [r["kl"] for r in rows(out)[1:]]


@pytest.mark.parametrize("lora", [[], ["lora.rank=4", "train.lr=2e-2"]], ids=["full", "lora"])
def test_hard_reset_zeroes_the_next_kl_and_soft_lowers_it(tmp_path, random_model_dir, lora):
    trainer.train(cfg_for(random_model_dir, tmp_path / "frozen", "train.steps=4", *KL, *lora))
    trainer.train(cfg_for(random_model_dir, tmp_path / "hard", "train.steps=4", "algo.ref_sync_every=2", *KL, *lora))
    trainer.train(cfg_for(random_model_dir, tmp_path / "soft", "train.steps=4", "algo.ref_sync_every=2",
                          "algo.ref_sync_alpha=0.6", *KL, *lora))
    frozen, hard, soft = kls(tmp_path / "frozen"), kls(tmp_path / "hard"), kls(tmp_path / "soft")
    assert [r["ref/reset"] for r in rows(tmp_path / "hard")[1:]] == [0.0, 1.0, 0.0, 1.0]
    assert hard[:2] == frozen[:2] and frozen[2] > 0
    assert hard[2] == 0.0  # the step after a hard reset: the reference is the policy that samples (μ = 1)
    assert 0 < soft[2] < frozen[2]


def test_lora_reset_leaves_the_policy_unchanged(random_model_dir):
    from grpo.config import LoraConfig, ModelConfig
    from grpo.models import load_model
    from grpo.policy import LogprobModule
    from grpo.policy.reference_sync import ReferenceSync

    model, _ = load_model(ModelConfig(path=str(random_model_dir)), LoraConfig(rank=4))
    torch.manual_seed(3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.3)
    ids = torch.randint(3, 40, (2, 6))
    args = (ids[:, :3], torch.ones(2, 3), ids[:, 3:], torch.ones(2, 3))
    policy, reference = LogprobModule(model), LogprobModule(model, adapter_off=True)
    with torch.no_grad():
        before, ref_before = policy(*args, temperature=1.0, chunk_size=8), reference(*args, temperature=1.0,
                                                                                      chunk_size=8)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
        assert ReferenceSync(model, None, opt, every=1, alpha=1.0, lora=True)(1) == {"ref/reset": 1.0}
        after, ref_after = policy(*args, temperature=1.0, chunk_size=8), reference(*args, temperature=1.0,
                                                                                    chunk_size=8)
    assert not torch.allclose(before, ref_before, atol=1e-3)
    assert torch.allclose(after, before, atol=1e-5) and torch.allclose(ref_after, before, atol=1e-5)


@pytest.mark.parametrize("lora", [[], ["lora.rank=4", "train.lr=2e-2"]], ids=["full", "lora"])
def test_resume_keeps_the_reference_exactly(tmp_path, random_model_dir, lora):
    common = ["algo.ref_sync_every=2", "algo.ref_sync_alpha=0.6", "algo.num_iterations=2", *KL, *lora, "eval.every=3"]
    trainer.train(cfg_for(random_model_dir, tmp_path / "straight", "train.steps=5", *common))
    trainer.train(cfg_for(random_model_dir, tmp_path / "split", "train.steps=3", "train.save_every=3", *common))
    assert (checkpoint_root(tmp_path / "split") / "step-00000003" / REFERENCE).exists() == (not lora)
    trainer.train(cfg_for(random_model_dir, tmp_path / "split", "train.steps=5", "train.resume=auto", *common))
    # with LoRA, model/ holds the merged weights: the resets moved the base, so the adapter alone would be wrong
    assert_same_run(tmp_path / "straight", tmp_path / "split")


def test_reset_without_a_reference_is_refused(tmp_path, random_model_dir):
    with pytest.raises(ConfigError, match="algo.ref_sync_every=2 resets the KL reference, but algo.beta=0"):
        trainer.train(cfg_for(random_model_dir, tmp_path / "x", "algo.beta=0", "algo.ref_sync_every=2"))
