"""The Python quickstarts of the README ("Your data, your reward") and of docs/from-trl.md ("The quickstart,
ported") run as written, from any directory, on the bundled tiny model: each is read from its page and run with
fewer steps, so the pages cannot drift from what works."""
import contextlib
import io
import re
from pathlib import Path

import pytest

pytest.importorskip("datasets")

ROOT = Path(__file__).resolve().parents[2]


def snippet(page: str, heading: str) -> str:
    """The first ```python block after `heading` in `page`."""
    text = (ROOT / page).read_text()
    after = text[text.index(heading):]
    return re.search(r"```python\n(.*?)```", after, re.S).group(1)


def run(code: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "<snippet>", "exec"), {"__name__": "__main__"})
    return out.getvalue()


def test_the_readmes_data_and_reward_quickstart(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = snippet("README.md", "### Your data, your reward")
    assert '"train.steps": 20' in code
    printed = run(code.replace('"train.steps": 20', '"train.steps": 2, "eval.pass_k": 0, "log.progress": False'))
    before, after = re.fullmatch(r"([\d.]+) -> ([\d.]+)", printed.splitlines()[-1]).groups()  # the snippet's print
    assert 0 <= float(before) <= 1 and 0 <= float(after) <= 1
    assert (tmp_path / "runs" / "mine" / "model" / "model.safetensors").is_file()
    assert "reward/correct" in (tmp_path / "runs" / "mine" / "metrics.jsonl").read_text()


def test_the_trl_quickstart_ported_as_the_page_shows_it(tmp_path, monkeypatch):
    """The page's snippet has no args: it runs the default job, here made short through the job it loads."""
    import grpo.api

    monkeypatch.chdir(tmp_path)
    job = tmp_path / "short.yaml"
    job.write_text("model: {path: tiny}\ntrain: {steps: 2, prompts_per_step: 4, output_dir: runs/tiny}\n"
                   "rollout: {group_size: 4, max_new_tokens: 8}\neval: {pass_k: 0}\nlog: {progress: false}\n")
    monkeypatch.setattr(grpo.api, "DEFAULT_JOB", str(job))
    run(snippet("docs/from-trl.md", "## The quickstart, ported"))
    assert (tmp_path / "runs" / "tiny" / "model" / "model.safetensors").is_file()
    assert "reward/accuracy_reward" in (tmp_path / "runs" / "tiny" / "metrics.jsonl").read_text()


def test_the_vision_pages_own_pictures_snippet(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = snippet("docs/vision.md", "### Your own pictures")
    assert '"train.steps=20", "eval.every=20"' in code
    code = code.replace('"train.steps=20", "eval.every=20"', '"train.steps=2", "eval.every=2", "eval.size=16"')
    printed = run(code.replace("rows(held_out)", "rows(held_out[:16])"))
    before, after = re.fullmatch(r"([\d.]+) -> ([\d.]+)", printed.splitlines()[-1]).groups()
    assert 0 <= float(before) <= 1 and 0 <= float(after) <= 1
    assert (tmp_path / "runs" / "pictures" / "model" / "preprocessor_config.json").is_file()
