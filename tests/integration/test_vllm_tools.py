"""The tool environment on the vLLM backend: the same environment code, the same greedy multi-turn episodes as the
in-process generator, the engine's log-probs on the model's tokens only, and a training run."""
import json
from pathlib import Path

import pytest
import torch

from grpo.config import load_config
from grpo.envs import build_environment
from grpo.models import load_model
from grpo.policy import LogprobModule
from grpo.rollout import HFGenerator, Sampling
from grpo.tasks import load_builtin_task

pytest.importorskip("vllm", reason="the vLLM backend's tests need vLLM: pip install -e '.[vllm]'")
pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
JOB = str(ROOT / "grpo" / "configs" / "tiny_tools.yaml")
VLLM = ["rollout.backend=vllm", "vllm.kv_cache_gib=0.25"]


@pytest.fixture(scope="module")
def setup(finished_run):
    """The tiny-tools model after test_tools_train's 12 steps of the tool job (hf, trained once for the suite), which
    then calls its calculator greedily, and a vLLM engine holding it."""
    from grpo.rollout.vllm_colocate import VLLMGenerator

    from test_tools_train import LEARNS

    out = finished_run("tools-12", *LEARNS)
    cfg = load_config(JOB, [*VLLM, f"model.path={out / 'model'}"])
    model, tok = load_model(cfg.model)
    engine = VLLMGenerator(model, tok, vllm_cfg=cfg.vllm, seed=0, add_special_tokens=False)
    yield cfg, model, tok, engine
    engine.close()


def test_greedy_episodes_are_the_same_on_both_backends(setup):
    cfg, model, tok, engine = setup
    env = build_environment(model, tok, cfg)
    examples = load_builtin_task("products").eval[:16]
    greedy = Sampling(1, cfg.rollout.max_new_tokens, temperature=0.0)
    a = env.rollout(HFGenerator(model, tok, add_special_tokens=False), examples, greedy, seeds=list(range(16)))
    b = env.rollout(engine, examples, greedy, seeds=list(range(16)))
    assert sum(e.tool_calls for e in a.episodes) >= 8  # most episodes call the calculator, then answer
    assert a.texts == b.texts
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.loss_mask, b.loss_mask)
    assert [e.stop for e in a.episodes] == [e.stop for e in b.episodes]


def test_engine_log_probs_cover_the_models_tokens_only(setup):
    cfg, model, tok, engine = setup
    env = build_environment(model, tok, cfg)
    examples = load_builtin_task("products").eval[:8]
    r = env.rollout(engine, examples, Sampling(8, cfg.rollout.max_new_tokens, temperature=1.0),
                    seeds=list(range(8)))
    assert sum(e.tool_calls for e in r.episodes) > 0  # some episodes are multi-turn
    inserted = (r.completion_mask == 1) & (r.loss_mask == 0)
    assert inserted.any() and torch.all(r.sampler_logp[inserted] == 0)
    assert torch.all(r.sampler_logp[r.loss_mask == 1] < 0)
    with torch.no_grad():
        ours = LogprobModule(model)(r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask,
                                    temperature=1.0, chunk_size=64).float()
    own = r.loss_mask == 1
    assert (ours[own] - r.sampler_logp[own]).abs().max() < 1e-3


# two steps of the tool job on the colocated engine: trained once for the suite, as test_vllm_server compares the
# same job on a server with it
TRAIN_2 = [JOB, *VLLM, "train.steps=2", "train.prompts_per_step=4", "rollout.group_size=4", "eval.size=8",
           "eval.pass_k=0", "log.progress=false", "log.trackers=[]", "log.chart=false"]


def test_tool_training_on_vllm(finished_run):
    out = finished_run("vllm-tools-2", *TRAIN_2)
    logged = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][1:]
    assert all(0 <= r["mismatch/abs_diff_max"] < 1e-3 for r in logged)
    assert all(r["episode/turns"] >= 1 for r in logged)
