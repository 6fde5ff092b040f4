"""The example environment of docs/examples (guess_env.GuessNumber: the model guesses, the environment says
"higher" or "lower") trained on the bundled tiny model, named in the config as 'module:Name' and given to
`train` as a class: its episodes have the turn structure and loss masks it promises, evaluation calls it as the
contract says (with seeds), and the run's config.yaml names it."""
import json
from pathlib import Path

import pytest
import torch
import yaml

from grpo.config import load_config
from grpo.trainer import train

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"
HINTS = {" higher\n", " lower\n", " a number, please\n"}
QUIET = ["log.progress=false", "log.trackers=[]", "log.chart=false", "compute.threads=1"]


@pytest.fixture
def guess_env(monkeypatch, tmp_path):
    """The docs' module, importable as the config names it, its rollouts recorded (sampling, seeds, result)."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import guess_env
    calls = []
    rollout = guess_env.GuessNumber.rollout

    def recorded(self, generator, examples, sampling, seeds):
        r = rollout(self, generator, examples, sampling, seeds)
        calls.append((sampling, list(seeds), r, self.tokenizer))
        return r
    monkeypatch.setattr(guess_env.GuessNumber, "rollout", recorded)
    # sums the tiny model writes out step by step; half the answers are off by one, so that its first guess is
    # often wrong and the environment answers
    rows = [{"question": f"Calculate {a} + {b} =", "answer": str(a + b + (a % 2))} for a in range(1, 7)
            for b in range(1, 4)]
    for name, part in (("train.jsonl", rows[:12]), ("eval.jsonl", rows[12:])):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in part))
    return guess_env, calls


def overrides(tmp_path, out: str) -> list[str]:
    return ["model.path=tiny", f"data.path={tmp_path / 'train.jsonl'}", f"data.eval_path={tmp_path / 'eval.jsonl'}",
            "data.prompt_column=question", "data.answer_column=answer", "rewards=[final_number]",
            "eval.reward=final_number", "rollout.max_new_tokens=32", "rollout.group_size=4", "train.prompts_per_step=4",
            "train.steps=2", "eval.every=0", "eval.pass_k=2", "algo.dynamic_sampling=false", "log.samples_every=1",
            f"train.output_dir={tmp_path / out}", *QUIET]


def test_the_example_environment_trains_from_the_config(guess_env, tmp_path):
    module, calls = guess_env
    cfg = load_config(None, [*overrides(tmp_path, "run"), "rollout.environment=guess_env:GuessNumber"])
    train(cfg)
    out = tmp_path / "run"
    logged = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert "eval/accuracy" in logged[0] and "eval/pass@2" in logged[-1]
    assert any(r.get("episode/turns", 0) > 1 for r in logged)  # the environment answered, the model went on
    assert yaml.safe_load((out / "config.yaml").read_text())["rollout"]["environment"] == "guess_env:GuessNumber"

    # evaluation called rollout(generator, examples, sampling, seeds): greedy and pass@k, one seed per example
    evals = [(s, seeds) for s, seeds, _, _ in calls if s.temperature == 0.0 or s.n == 2]
    assert {s.temperature for s, _ in evals} == {0.0, 1.0} and all(len(seeds) == 6 for _, seeds in evals)

    multi = 0
    for _, _, r, tok in calls:
        for i, e in enumerate(r.episodes):
            k = int(r.lengths[i])
            tokens, loss = r.completion_ids[i, :k].tolist(), r.loss_mask[i, :k].tolist()
            assert [m["role"] for m in e.messages][:2] == ["user", "assistant"]
            assert all(a["role"] != b["role"] for a, b in zip(e.messages, e.messages[1:]))  # turns alternate
            assert e.turns == sum(m["role"] == "assistant" for m in e.messages) <= 3
            # the tokens the loss skips are exactly the hints the environment wrote, in order
            inserted = [t for t, m in zip(tokens, loss) if m == 0]
            hints = [m["content"] for m in e.messages[2:] if m["role"] == "user"]
            assert len(hints) == e.turns - 1
            assert tok.decode(inserted) == "".join(f" {h}\n" for h in hints)
            assert all(f" {h}\n" in HINTS for h in hints)
            multi += bool(hints)
            # every model turn but a truncated last one ends with EOS; the loss counts the model's tokens only
            own = [t for t, m in zip(tokens, loss) if m == 1]
            assert own.count(tok.eos_token_id) == e.turns - bool(r.truncated[i])
            assert sum(loss) == k - len(inserted) and r.loss_mask.dtype == torch.long
            assert e.stop in ("done", "max_turns", "turn_length", "context")
            assert bool(r.truncated[i]) == (e.stop == "turn_length")
    assert multi > 0


def test_the_example_environment_from_the_python_api(guess_env, tmp_path):
    """`train(cfg, environment=GuessNumber)`: the class, built as the config's would be; config.yaml names it."""
    module, calls = guess_env
    cfg = load_config(None, [*overrides(tmp_path, "api"), "train.steps=1", "eval.pass_k=0", "eval.size=2"])
    train(cfg, environment=module.GuessNumber)
    assert cfg.rollout.environment == "single_turn"  # the caller's config is not changed
    assert calls and all(isinstance(r.episodes, list) for _, _, r, _ in calls)
    saved = yaml.safe_load((tmp_path / "api" / "config.yaml").read_text())
    assert saved["rollout"]["environment"] == "guess_env:GuessNumber"


WRAPPED = []


def counted_hf(model, tokenizer, cfg):
    """A rollout backend of one's own, named as 'module:factory': the in-process generator, kept for the test."""
    from grpo.rollout import HFGenerator

    generator = HFGenerator(model, tokenizer, add_special_tokens=not cfg.model.chat_template)
    WRAPPED.append(generator)
    return generator


def test_a_backend_of_ones_own_from_the_config(tmp_path):
    out = tmp_path / "backend"
    cfg = load_config(None, ["model.path=tiny", "rollout.backend=test_custom_env_train:counted_hf",
                             "rollout.group_size=4", "train.prompts_per_step=2", "train.steps=2", "eval.size=4",
                             "eval.pass_k=0", "algo.dynamic_sampling=false", f"train.output_dir={out}", *QUIET])
    train(cfg)
    assert len(WRAPPED) == 1 and WRAPPED[0].version == 2  # built once, synced after each step
    logged = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if "loss" in r] == [1, 2] and "eval/accuracy" in logged[-1]
    assert yaml.safe_load((out / "config.yaml").read_text())["rollout"]["backend"] == "test_custom_env_train:counted_hf"
