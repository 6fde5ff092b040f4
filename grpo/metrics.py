"""Run outputs: metrics.jsonl (one line per step), samples.jsonl, TensorBoard events, a progress bar with the
live figures, and a PNG chart of reward and held-out accuracy against step; and the arithmetic of a step's
figures (`step_metrics`, `sample_rows`)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from grpo.config import LogConfig
from grpo.distributed import Dist
from grpo.experience import Experience

BAR_FIELDS = {"reward/mean": "reward", "eval/accuracy": "acc", "kl": "kl", "completion/mean_length": "len",
              "perf/step_seconds": "s/step"}


class RunLogger:
    def __init__(self, out_dir: Path, cfg: LogConfig, total_steps: int, *, resume_step: int | None = None,
                 enabled: bool = True):
        """`resume_step`: continue a run whose checkpoint is at that step; lines the earlier process logged
        after it are dropped, so the files read as if the run had never stopped. `enabled=False` (processes
        other than the main one) writes nothing."""
        from tqdm.auto import tqdm

        self.out_dir = out_dir
        self.cfg = cfg
        self.enabled = enabled
        self.history: list[dict] = []
        if not enabled:
            return
        if resume_step is not None:
            self.history = _truncate(out_dir / "metrics.jsonl", resume_step)
            _truncate(out_dir / "samples.jsonl", resume_step)
        mode = "a" if resume_step is not None else "w"
        self._metrics = open(out_dir / "metrics.jsonl", mode)
        self._samples = open(out_dir / "samples.jsonl", mode)
        self._tb = None
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            purge = None if resume_step is None else resume_step + 1
            self._tb = SummaryWriter(str(out_dir / "tensorboard"), purge_step=purge)
        self._last: dict[str, float] = {}
        for row in self.history:
            self._last.update({k: v for k, v in row.items() if k in BAR_FIELDS})
        self.bar = tqdm(total=total_steps, initial=resume_step or 0, disable=not cfg.progress, dynamic_ncols=True,
                        desc="grpo", unit="step")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        row = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self._metrics.write(json.dumps(row) + "\n")
        self._metrics.flush()
        if self._tb is not None:
            # one event per step holding every scalar: add_scalar writes an event per value, ten times the cost
            # (about 2 ms a step for 25 values, a few percent of a small model's step)
            from tensorboard.compat.proto.summary_pb2 import Summary

            values = [Summary.Value(tag=k, simple_value=float(v)) for k, v in row.items()
                      if k != "step" and isinstance(v, (int, float)) and math.isfinite(v)]
            self._tb._get_file_writer().add_summary(Summary(value=values), step)
        self.history.append(row)
        self._last.update({k: v for k, v in row.items() if k in BAR_FIELDS})
        self.bar.set_postfix({BAR_FIELDS[k]: f"{v:.3g}" for k, v in self._last.items()}, refresh=False)

    def advance(self) -> None:
        if self.enabled:
            self.bar.update(1)

    def write(self, message: str) -> None:
        if self.enabled:
            self.bar.write(message)

    def samples(self, step: int, rows: list[dict]) -> None:
        if not self.enabled:
            return
        for r in rows:
            self._samples.write(json.dumps({"step": step, **r}, default=repr) + "\n")  # tool arguments may be any literal
        self._samples.flush()

    def close(self) -> None:
        if not self.enabled:
            return
        self.bar.close()
        if self._tb is not None:
            self._tb.close()
        self._metrics.close()
        self._samples.close()
        if self.cfg.chart:
            draw_chart(self.history, self.out_dir / "chart.png")


def _truncate(path: Path, last_step: int) -> list[dict]:
    """Keep the rows of a JSONL file up to `last_step` (a torn last line is dropped too)."""
    rows, keep = [], []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if row.get("step", 0) <= last_step:
                rows.append(row)
                keep.append(line)
    path.write_text("".join(line + "\n" for line in keep))
    return rows


def _plain(v):
    return v.item() if hasattr(v, "item") else v


def draw_chart(history: list[dict], path: Path) -> None:
    """Mean training reward per step, and held-out greedy accuracy (and pass@k) at each evaluation."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    steps = [r["step"] for r in history if "reward/mean" in r]
    if steps:
        ax.plot(steps, [r["reward/mean"] for r in history if "reward/mean" in r], lw=1, alpha=0.6,
                label="training reward (mean)")
    evals = [r for r in history if "eval/accuracy" in r]
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval/accuracy"] for r in evals], "o-", lw=2,
                label="held-out accuracy (greedy)")
        pass_keys = sorted({k for r in evals for k in r if k.startswith("eval/pass@")})
        for k in pass_keys:
            ax.plot([r["step"] for r in evals if k in r], [r[k] for r in evals if k in r], "s--", lw=1,
                    label=f"held-out {k.split('/')[1]} (sampled)")
    ax.set_xlabel("step")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------------
# a step's figures

def step_metrics(exp: Experience, updates: list[dict], dist: Dist, *, group_size: int, seconds: float,
                 rollout_seconds: float, lr: float) -> dict[str, float]:
    """Figures of the whole step (every process), the update's averaged over the μ updates."""
    rewards = exp.all_rewards
    lengths = dist.gather(exp.lengths.float().cpu())
    m: dict[str, float] = {"reward/mean": _nanmean(rewards), "reward/std": _nanstd(rewards)}
    for name, values in exp.per_fn.items():
        m[f"reward/{name}"] = _nanmean(dist.gather(values))
    # groups without a policy gradient: every advantage on their loss tokens is 0 (equal rewards, for outcome ones)
    signal = (exp.advantages * exp.loss_mask).ne(0).any(dim=1).view(-1, group_size).any(dim=1)
    m["adv/std_zero_frac"] = dist.gather((~signal).float().cpu()).mean().item()
    u = {k: dist.sum(sum(d[k] for d in updates)) / len(updates) for k in updates[0]
         if k not in ("grad_norm", "nonfinite", "mismatch/abs_diff_max")}
    tokens = u.pop("tokens")  # none when every token of the step is masked out: the per-token figures are NaN
    per_token = ["kl", "ratio/mean", "clip/frac", "clip/low_frac", "clip/high_frac"]
    if "mismatch/abs_diff_max" in updates[0]:  # a sampler with log-probs of its own (SPEC 13.1)
        per_token += ["mismatch/abs_diff", "mismatch/k3", "mismatch/capped", "mismatch/weight"]
        m["mismatch/abs_diff_max"] = dist.max(max(d["mismatch/abs_diff_max"] for d in updates))
    m.update({k: u[k] / tokens if tokens else float("nan") for k in per_token})
    m.update({"loss": u["loss"], "loss/policy": u["loss/policy"], "loss/kl": u["loss/kl"]})
    m["grad_norm"] = sum(d["grad_norm"] for d in updates) / len(updates)
    m["completion/mean_length"] = lengths.mean().item()
    m["completion/truncated_frac"] = dist.gather(exp.truncated.float().cpu()).mean().item()
    m["lr"] = lr
    m.update(exp.stats)
    if exp.episodes is not None:
        m.update(episode_metrics(exp.episodes, dist))
    m["perf/step_seconds"] = seconds
    m["perf/rollout_seconds"] = rollout_seconds
    m["perf/completion_tokens"] = lengths.sum().item()
    m["perf/tokens_per_s"] = lengths.sum().item() / max(seconds, 1e-9)
    return m


def episode_metrics(episodes: list, dist: Dist) -> dict[str, float]:
    """Means over the step's multi-turn episodes (every process's): model turns, tool calls, failed calls,
    and the share of episodes that ended for each reason of `STOP_REASONS`."""
    from grpo.envs.base import STOP_REASONS

    rows = torch.tensor([[e.turns, e.tool_calls, e.tool_errors] + [float(e.stop == r) for r in STOP_REASONS]
                         for e in episodes], dtype=torch.float32)
    mean = dist.gather(rows.reshape(-1)).view(-1, rows.shape[1]).mean(dim=0).tolist()
    names = ["episode/turns", "episode/tool_calls", "episode/tool_errors"] + [f"episode/stop_{r}" for r in STOP_REASONS]
    return dict(zip(names, mean))


def sample_rows(exp: Experience, groups: int) -> list[dict]:
    """The first `groups` groups of the step for samples.jsonl: prompt, answer, completion, rewards, advantage
    (of the first token: an outcome advantage is the same on every token)."""
    rows = []
    for j in range(len(exp)):
        if int(exp.group[j]) >= groups:
            break
        e = exp.examples[int(exp.group[j])]
        row = {"prompt": e.prompt, "answer": e.answer, "completion": exp.texts[j],
               "reward": _json_float(exp.rewards[j].item()), "advantage": exp.advantages[j, 0].item(),
               "truncated": bool(exp.truncated[j])}
        row.update({f"reward/{k}": _json_float(v[j].item()) for k, v in exp.per_fn.items()})
        if exp.episodes is not None:
            ep = exp.episodes[j]
            row.update({"turns": ep.turns, "tool_calls": ep.tool_calls, "stop": ep.stop, "messages": ep.messages})
        rows.append(row)
    return rows


def _nanmean(x: torch.Tensor) -> float:
    return x.nanmean().item() if (~x.isnan()).any() else float("nan")


def _nanstd(x: torch.Tensor) -> float:
    x = x[~x.isnan()]
    return x.std().item() if x.numel() > 1 else 0.0


def _json_float(v: float) -> float | None:
    return None if math.isnan(v) else v
