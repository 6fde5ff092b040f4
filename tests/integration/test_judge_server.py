"""The LLM judge against a real one: SmolLM2-135M-Instruct (the packaged model) on a real `vllm serve` on
127.0.0.1, launched by grpo (judge.launch). No mock of the endpoint: scores from its log-probs, numbers and yes/no
from its words, where a 135 M model's words cannot always be read (each such one None and counted); and the
issue's own command line, `rewards=[judge] judge.launch=true judge.model=smollm2-135m-instruct`, trains the tiny
model as it stands, logging the judge's figures and stopping its server at the end."""
import json
import math
from pathlib import Path

import pytest

from grpo.config import JudgeConfig, VLLMConfig, load_config
from grpo.rewards.calls import run
from grpo.rewards.judge import Judge, launch_judge
from grpo.trainer import train

pytest.importorskip("vllm", reason="the judge's server tests need vLLM: pip install -e '.[vllm]'")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]
NAME = "smollm2-135m-instruct"
PROMPTS = ["What is 2 + 2?", "What is the capital of France?", "What is 2 + 2?"]
COMPLETIONS = ["2 + 2 = 4.", "The capital of France is Paris.", "2 + 2 = 4."]


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    server = launch_judge(JudgeConfig(model=NAME, launch=True, max_model_len=1024),
                          run_dir=tmp_path_factory.mktemp("judge"), vllm_cfg=VLLMConfig(kv_cache_gib=0.25))
    yield server.url + "/v1"
    server.stop()


def ask(j, prompts=PROMPTS, completions=COMPLETIONS):
    return run(j(prompts=list(prompts), completions=list(completions), answer=["4", "Paris", "4"]))


# a raw completion prompt ends where the answer's first token comes (the chat template does that for a chat)
RAW = "Question: {prompt}\nAnswer: {completion}\nIs the answer correct, Yes or No?\nVerdict:"


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_token_prob_reads_the_judges_log_probs(url, chat):
    extra = {} if chat else {"template": RAW}
    j = Judge(JudgeConfig(model=NAME, url=url, chat=chat, max_failure_frac=0.0, **extra))
    scores = ask(j)
    assert all(0.0 <= s <= 1.0 for s in scores) and scores[0] == scores[2]  # the same request, sent once
    assert j.sent == 2 and j.take_figures()["judge/failures"] == 0.0
    assert any(s > 0.01 for s in scores), scores  # Yes is among the judge's likely first tokens
    # greedy and deterministic: asked again, the same scores
    assert ask(Judge(JudgeConfig(model=NAME, url=url, chat=chat, **extra))) == pytest.approx(scores, abs=1e-6)


@pytest.mark.parametrize("parser, template", [
    ("number", "Rate this answer to the question from 0 to 10.\nQuestion: {prompt}\nAnswer: {completion}\n"
               "Reply with the number only."),
    ("yes_no", "Question: {prompt}\nAnswer: {completion}\nIs the answer right? Reply with Yes or No only."),
])
def test_words_parsed_or_counted_as_failures(url, parser, template):
    j = Judge(JudgeConfig(model=NAME, url=url, parser=parser, template=template, max_failure_frac=1.0))
    scores = ask(j)
    figures = j.take_figures()
    assert figures["judge/requests"] == 3 and figures["judge/failures"] == scores.count(None)
    read = [s for s in scores if s is not None]
    assert all(0 <= s <= 10 for s in read) if parser == "number" else all(s in (0.0, 1.0) for s in read)
    assert read or j.last_failure  # a failure says what the judge answered


def test_the_issues_command_trains_the_tiny_model_as_it_stands(tmp_path):
    cfg = load_config(None, ["rewards=[judge]", "judge.launch=true", f"judge.model={NAME}",
                             f"train.output_dir={tmp_path}", "train.steps=2", "train.prompts_per_step=4",
                             "rollout.group_size=4", "algo.dynamic_sampling=false", "eval.size=8", "eval.pass_k=0",
                             "log.progress=false", "log.trackers=[]", "log.chart=false", "vllm.kv_cache_gib=0.25",
                             "judge.max_model_len=1024"])
    result = train(cfg)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for r in rows[1:]:
        assert r["judge/requests"] == 16 and r["judge/failures"] == 0 and r["judge/seconds"] > 0
        assert 0 <= r["reward/judge"] <= 1 and not math.isnan(r["reward/mean"])
    assert result.steps_done == 2 and (tmp_path / "model").is_dir()
    log = (tmp_path / "judge-server.log").read_text()
    assert f"--served-model-name {NAME}" in log.splitlines()[0]
    # the run stopped its server: nothing answers at its address any more
    import urllib.request
    port = log.split("--port ")[1].split()[0]
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5)
    assert "judge" in Path(tmp_path / "config.yaml").read_text()
