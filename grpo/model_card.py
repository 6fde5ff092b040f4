"""The model card of a run's final model: `<output_dir>/model/README.md`, Hugging Face Hub metadata (YAML front
matter: base model, data set, tags, library, license) and a body that says what was trained, on what, with which
rewards and config, and how it scored on the held-out set before and after, so that `huggingface-cli upload`
publishes a complete model. grpo/models.py `save_final` writes it beside the weights."""
from __future__ import annotations

import re
from pathlib import Path

import yaml

from grpo.config import Config, to_yaml

# bundled and packaged model names (grpo/models.py resolve_model_path) and what they are on the Hub, with licence
KNOWN_MODELS = {"smollm2-135m-instruct": ("HuggingFaceTB/SmolLM2-135M-Instruct", "apache-2.0")}
BUNDLED = ("tiny", "tiny-tools", "tiny-rm")
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

CITATION = """\
@article{shao2024deepseekmath,
  title   = {{DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models}},
  author  = {Zhihong Shao and Peiyi Wang and Qihao Zhu and Runxin Xu and Junxiao Song and Xiao Bi and Haowei Zhang
             and Mingchuan Zhang and Y. K. Li and Y. Wu and Daya Guo},
  year    = 2024,
  journal = {arXiv preprint arXiv:2402.03300},
  url     = {https://arxiv.org/abs/2402.03300}
}"""


def hub_base_model(path: str) -> tuple[str | None, str | None]:
    """(Hub id, licence) of the model a run started from, where known: a packaged model's original, a Hub id (its
    licence from the card in the local Hugging Face cache, if there), a local directory's card's `base_model` or its
    own name on the Hub is not known (None)."""
    if path in KNOWN_MODELS:
        return KNOWN_MODELS[path]
    if path in BUNDLED:
        return None, None
    from grpo.packaged import packaged_name

    local = Path(path).expanduser()
    if local.is_dir() and packaged_name(local) in KNOWN_MODELS:  # a packaged model loaded from its cache
        return KNOWN_MODELS[packaged_name(local)]
    if local.is_dir():
        meta = front_matter((local / "README.md").read_text()) if (local / "README.md").is_file() else {}
        return None, meta.get("license")
    if HUB_ID.match(path):
        return path, _cached_licence(path)
    return None, None


def _cached_licence(repo_id: str) -> str | None:
    """The licence in the front matter of a Hub model's card, if the card is in the local cache (no download)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        card = try_to_load_from_cache(repo_id, "README.md")
        return front_matter(Path(card).read_text()).get("license") if isinstance(card, str) else None
    except Exception:  # no cache, an unreadable card: the licence is simply not known
        return None


def front_matter(text: str) -> dict:
    """The YAML front matter of a model card ({} if none or unreadable)."""
    match = re.match(r"^---\n(.*?)\n---\n", text, re.S)
    if not match:
        return {}
    try:
        data = yaml.safe_load(match.group(1))
    except yaml.YAMLError:
        return {}
    return data if isinstance(data, dict) else {}


def _name(value) -> str:
    """A model or data set given as an object (train(model=...)) by its name or path; a string as it is."""
    return value if isinstance(value, str) else str(getattr(value, "name_or_path", "") or type(value).__name__)


def hub_dataset(cfg: Config) -> str | None:
    """data.path when it names a Hub data set (not a local file or directory)."""
    path = cfg.data.path
    if (not isinstance(path, str) or not path or Path(path).expanduser().exists()
            or Path(path).suffix in (".jsonl", ".json", ".parquet", ".csv")):
        return None
    return path if re.match(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$", path) else None


def model_card(cfg: Config, *, initial_eval: dict, final_eval: dict, history: list[dict], steps: int,
               adapter: bool = False, merged: bool = False) -> str:
    """The card's text. `initial_eval`, `final_eval`: the held-out figures before the first step and after the last
    (empty without a held-out set); `history`: metrics.jsonl's rows (the training reward at the first and last
    step); `adapter`: the directory holds a LoRA adapter (peft), not full weights; `merged`: the adapter merged."""
    import grpo

    path = _name(cfg.model.path)
    base, licence = hub_base_model(path)
    dataset = hub_dataset(cfg)
    meta: dict = {}
    if base:
        meta["base_model"] = base
    if dataset:
        meta["datasets"] = [dataset]
    meta["library_name"] = "peft" if adapter else "transformers"
    if licence:
        meta["license"] = licence
    meta["pipeline_tag"] = "text-generation"
    meta["tags"] = ["grpo", "reinforcement-learning"] + (["lora"] if adapter or merged else [])
    name = Path(cfg.train.output_dir).name or "model"
    here = str(Path(cfg.train.output_dir) / ("model-merged" if merged else "model"))
    data = (f"the Hugging Face data set [{dataset}](https://huggingface.co/datasets/{dataset})" if dataset
            else f"the data set `{_name(cfg.data.path)}`" if cfg.data.path
            else "a data set given to `grpo.train` in Python" if "train_dataset" in cfg.data.given
            else f"grpo's built-in task `{cfg.data.task}`")
    if cfg.data.given and not dataset:
        data += (" (not recorded: " + " and ".join(f"`{w}`" for w in cfg.data.given) + " given as objects)")
    if cfg.data.path and cfg.data.split:
        data += f" (split `{cfg.data.split}`)"
    weights = cfg.reward_weights or [1.0] * len(cfg.rewards)
    rewards = " + ".join(f"{w:g} × `{r}`" for r, w in zip(cfg.rewards, weights))
    started = (f"[{base}](https://huggingface.co/{base})" if base else f"`{path}`")
    if path in KNOWN_MODELS:
        started += f" (grpo's packaged `{path}`)"
    what = ("a LoRA adapter (rank {r}) on it".format(r=cfg.lora.rank) if adapter
            else "its weights with a LoRA adapter (rank {r}) merged in".format(r=cfg.lora.rank) if merged
            else "its full weights")
    lines = [
        "---", yaml.safe_dump(meta, sort_keys=False).rstrip(), "---", "",
        f"# {name}", "",
        f"{started} trained with GRPO (Group Relative Policy Optimization) by "
        f"grpo {grpo.__version__}: {steps} steps of "
        f"{cfg.train.prompts_per_step} prompts × {cfg.rollout.group_size} completions, algorithm preset "
        f"`{cfg.algo.preset}`. This directory holds {what}.", "",
        f"- **Base model:** {started}",
        f"- **Data:** {data}",
        f"- **Rewards:** {rewards}",
        f"- **Episodes:** `{cfg.rollout.environment}`"
        + (f" (tools: {', '.join(f'`{t}`' for t in cfg.tools.names)})" if cfg.rollout.environment == "tools" else "")
        + (", prompts through the chat template" if cfg.model.chat_template else ""),
        "",
        "## Held-out figures", "",
    ]
    lines += _figures(cfg, initial_eval, final_eval, steps)
    rewarded = [r for r in history if r.get("reward/mean") is not None and r.get("step", 0) > 0]
    if rewarded:
        a, b = rewarded[0], rewarded[-1]
        last = f", {b['reward/mean']:.3f} at step {b['step']}" if b is not a else ""  # one rewarded step: said once
        lines += ["", f"Mean training reward: {a['reward/mean']:.3f} at step {a['step']}{last}."]
    lines += [
        "", "## Use", "",
        "```python",
        *(["from peft import AutoPeftModelForCausalLM", "from transformers import AutoTokenizer", "",
           f'model = AutoPeftModelForCausalLM.from_pretrained("{here}")  # or its Hub id, once uploaded'] if adapter
          else ["from transformers import AutoModelForCausalLM, AutoTokenizer", "",
                f'model = AutoModelForCausalLM.from_pretrained("{here}")  # or its Hub id, once uploaded']),
        f'tokenizer = AutoTokenizer.from_pretrained("{here}")',
        "```", "",
        f"or, with grpo: `grpo eval {cfg.train.output_dir}` and `grpo sample {cfg.train.output_dir}` (the run's "
        "directory: this model with the config below).", "",
        "## Config", "",
        "<details><summary>config.yaml: the run's resolved config (<code>grpo train config.yaml</code> runs it "
        "again)</summary>", "",
        "```yaml", to_yaml(cfg).rstrip(), "```", "", "</details>", "",
        "## Citation", "",
        "GRPO was introduced in DeepSeekMath:", "",
        "```bibtex", CITATION, "```", "",
    ]
    return "\n".join(lines)


def _figures(cfg: Config, before: dict, after: dict, steps: int) -> list[str]:
    """The held-out figures as a Markdown table, before the first step and after the last."""
    if not before and not after:
        return ["No held-out evaluation (the run had no held-out set: data.eval_path, data.eval_split or "
                "data.eval_fraction)."]
    keys = [k for k in {**before, **after} if k.startswith("eval/")]
    what = {"eval/accuracy": "accuracy (greedy)", "eval/mean_length": "mean completion length (tokens)",
            "eval/sample_accuracy": f"accuracy of the sampled completions (temperature {cfg.eval.temperature:g})"}
    lines = [f"Scored by the reward `{cfg.eval.reward}` (correct when at least {cfg.eval.threshold:g})"
             + (f" on {cfg.eval.size} held-out examples" if cfg.eval.size else " on the held-out examples") + ".",
             "", f"| | before (step 0) | after (step {steps}) |", "|---|---|---|"]
    for k in keys:
        label = (what.get(k) or (f"{k[5:]} ({cfg.eval.pass_k} samples, temperature {cfg.eval.temperature:g})"
                                 if k.startswith("eval/pass@") else f"accuracy (greedy) on `{k[14:]}`"
                                 if k.startswith("eval/accuracy/") else f"mean `{k[12:]}` (greedy)"
                                 if k.startswith("eval/reward/") else k[5:]))
        lines.append(f"| {label} | {_number(before.get(k))} | {_number(after.get(k))} |")
    return lines


def _number(v) -> str:
    return "" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)
