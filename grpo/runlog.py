"""A run's outputs as it goes: metrics.jsonl (one line per step), samples.jsonl, the trackers
(grpo/tracking.py), a progress bar with the live figures, and a PNG chart of reward and held-out accuracy against
step (`RunLogger`); and what a run prints when it ends (`summary_lines`). The figures themselves are
grpo/metrics.py's."""
from __future__ import annotations

import json
import math
import resource
import sys
import time
import warnings
from pathlib import Path

import torch

from grpo.config import LogConfig
from grpo.tracking import open_trackers

BAR_FIELDS = {"reward/mean": "reward", "eval/accuracy": "acc", "kl": "kl", "completion/mean_length": "len",
              "perf/step_seconds": "s/step"}


class RunLogger:
    def __init__(self, out_dir: Path, cfg: LogConfig, total_steps: int, *, resume_step: int | None = None,
                 enabled: bool = True, config: dict | None = None, started: float | None = None):
        """`resume_step`: continue a run whose checkpoint is at that step; lines the earlier process logged
        after it are dropped, so the files read as if the run had never stopped. `enabled=False` (processes
        other than the main one) writes nothing. `config`: the resolved config the trackers record.
        `started`: the run's `time.perf_counter()` start, from which `perf/elapsed_seconds` counts (added to
        the seconds of the run before a resume).

        A write of a step's metrics or samples that fails (a full disk) is not raised here: it is kept in `failure`
        and nothing more is written, so that the process reaches the trainer's next point of agreement with the
        others and every process stops there with it (the other processes write nothing and would wait)."""
        from tqdm.auto import tqdm

        self.out_dir = out_dir
        self.cfg = cfg
        self.enabled = enabled
        self.history: list[dict] = []
        self.failure: OSError | None = None
        self._started = time.perf_counter() if started is None else started
        if not enabled:
            return
        logged_until, samples = 0, []
        if resume_step is not None:
            self.history, logged_until = _truncate(out_dir / "metrics.jsonl", resume_step)
            # and only the steps this run writes samples at: a run resumed to more steps than it had drops the
            # samples of its old last step, as the uninterrupted run never wrote them
            samples, _ = _truncate(out_dir / "samples.jsonl", resume_step,
                                   lambda step: samples_due(step, cfg.samples_every, total_steps))
        self._elapsed_before = elapsed(self.history)[-1] if self.history else 0.0
        mode = "a" if resume_step is not None else "w"
        self._metrics = open(out_dir / "metrics.jsonl", mode)
        self._samples = open(out_dir / "samples.jsonl", mode)
        self._trackers, earlier = open_trackers(cfg.trackers, out_dir, config=config or {}, project=cfg.project,
                                                run_name=cfg.run_name, resume_step=resume_step)
        # steps a tracker already has are not sent again; one new to this run first gets the history so far
        self._skip = {}
        for t in self._trackers:
            if t.name in earlier:
                self._skip[t.name] = resume_step if t.rewrites else max(logged_until, resume_step)
            elif resume_step is not None:
                _replay(t, self.history, samples)
                self._skip[t.name] = resume_step
        self._last: dict[str, float] = {}
        for row in self.history:
            self._last.update({k: v for k, v in row.items() if k in BAR_FIELDS and v is not None})
        self.bar = tqdm(total=total_steps, initial=resume_step or 0, disable=not cfg.progress, dynamic_ncols=True,
                        desc="grpo", unit="step")
        for t in self._trackers:
            if t.where:
                self.write(t.where)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled or self.failure:
            return
        row = {"step": step, **{k: finite_or_none(_plain(v)) for k, v in metrics.items()}}
        row["perf/elapsed_seconds"] = self._elapsed_before + time.perf_counter() - self._started
        try:
            _append(self._metrics, json.dumps(row, allow_nan=False) + "\n")  # strict JSON: NaN and inf are null
            for t in self._trackers:
                if step > self._skip.get(t.name, -1):
                    t.log(step, row)
        except OSError as e:
            self.failure = e
            return
        self.history.append(row)
        self._last.update({k: v for k, v in row.items() if k in BAR_FIELDS and v is not None})
        self.bar.set_postfix({BAR_FIELDS[k]: f"{v:.3g}" for k, v in self._last.items()}, refresh=False)

    def advance(self) -> None:
        if self.enabled:
            self.bar.update(1)

    def write(self, message: str) -> None:
        if self.enabled:
            self.bar.write(message)

    def samples(self, step: int, rows: list[dict]) -> None:
        if not self.enabled or self.failure:
            return
        lines = ({"step": step, **{k: finite_or_none(v) for k, v in r.items()}} for r in rows)
        try:
            # tool arguments may be any literal (repr); a NaN reward or advantage is null
            _append(self._samples, "".join(json.dumps(x, default=repr, allow_nan=False) + "\n" for x in lines))
            for t in self._trackers:
                if step > self._skip.get(t.name, -1):
                    t.samples(step, rows)
        except OSError as e:
            self.failure = e

    def __enter__(self) -> RunLogger:
        return self

    def __exit__(self, kind, *_) -> None:
        self.close(failed=kind is not None and not issubclass(kind, KeyboardInterrupt))

    def close(self, failed: bool = False) -> None:
        """Close the files and trackers (a tracked run that `failed` is marked so), draw the chart. Once."""
        if not self.enabled or self._metrics.closed:
            return
        self.bar.close()
        for t in self._trackers:
            try:
                t.close(failed)
            except Exception as e:  # the run's own files are written: a tracker's failure to finish is not the run's
                warnings.warn(f"{t.name} did not close cleanly: {' '.join(str(e).split())[:300]}", stacklevel=2)
        # each is tried; after a failure (a full disk, say) they may fail too, and the first error is the one to
        # report, so theirs are dropped; otherwise the first of theirs is raised once all were tried
        errors = []
        for finish in (self._metrics.close, self._samples.close,
                       lambda: self.cfg.chart and draw_chart(self.history, self.out_dir / "chart.png")):
            try:
                finish()
            except OSError as e:
                errors.append(e)
        if errors and not failed:
            raise errors[0]


def samples_due(step: int, every: int, last: int) -> bool:
    """Whether samples.jsonl gets `step`'s samples: the first step, every `every` steps and the last (`every` 0:
    never)."""
    return bool(every) and (step == 1 or step == last or step % every == 0)


def format_samples(step: int, rows: list[dict], n: int, width: int = 100) -> str:
    """What `grpo train` prints of a step's completions (log.print_samples): at most `n` of `rows` (`sample_rows`,
    a group's completions one after another), the first completion of each prompt first, then the second of each,
    ...; one line each: the reward (and each function's, where there are several), the prompt, the completion,
    the reference answer. Texts longer than `width` characters are cut in the middle."""
    groups: list[list[dict]] = []
    for r in rows:
        if groups and groups[-1][0]["prompt"] == r["prompt"]:
            groups[-1].append(r)
        else:
            groups.append([r])
    picked = [g[i] for i in range(max(map(len, groups), default=0)) for g in groups if i < len(g)][:n]
    lines = [f"step {step}: {len(picked)} of its sampled completions (reward: prompt -> completion)"]
    for r in picked:
        per_fn = [f"{k[len('reward/'):]} {_figure(v)}" for k, v in r.items() if k.startswith("reward/")]
        parts = per_fn if len(per_fn) > 1 else []  # one function: its value is the reward
        if r.get("answer") not in (None, ""):
            parts.insert(0, f"answer {_cut(str(r['answer']), 40)!r}")
        if "stop" in r:
            parts.append(f"{r['tool_calls']} tool calls, ended by {r['stop']}")
        prompt = r["prompt"]
        if isinstance(prompt, list) and prompt and isinstance(prompt[-1], dict):  # chat messages: the last one's text
            prompt = prompt[-1].get("content", "")
        lines.append(f"  {_figure(r['reward']):>6}: {_cut(prompt, width)!r} -> {_cut(r['completion'], width)!r}"
                     + (f"  ({'; '.join(parts)})" if parts else ""))
    return "\n".join(lines)


def _figure(v) -> str:
    return "none" if v is None else f"{v:.3f}"


def _cut(text: str, width: int) -> str:
    text = str(text)
    return text if len(text) <= width else text[:width // 2 - 1] + " ... " + text[-(width // 2 - 2):]


def _append(f, text: str) -> None:
    """Write and flush; a failed write (a full disk) names the file."""
    try:
        f.write(text)
        f.flush()
    except OSError as e:
        raise OSError(e.errno, e.strerror, f.name) from None


def _replay(tracker, history: list[dict], samples: list[dict]) -> None:
    """Send a tracker that joins on resume what the run logged up to its checkpoint."""
    by_step: dict[int, list[dict]] = {}
    for r in samples:
        by_step.setdefault(r["step"], []).append({k: v for k, v in r.items() if k != "step"})
    for row in history:
        if row["step"] in by_step:
            tracker.samples(row["step"], by_step[row["step"]])
        tracker.log(row["step"], row)


def _truncate(path: Path, last_step: int, due=None) -> tuple[list[dict], int]:
    """Keep the rows of a JSONL file up to `last_step` (a torn last line is dropped too), and with `due` only
    those of the steps it says yes to; also return the largest step the file had."""
    rows, keep, largest = [], [], 0
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            largest = max(largest, row.get("step", 0))
            if row.get("step", 0) <= last_step and (due is None or due(row.get("step", 0))):
                rows.append(row)
                keep.append(line)
    path.write_text("".join(line + "\n" for line in keep))
    return rows, largest


def _plain(v):
    return v.item() if hasattr(v, "item") else v


def finite_or_none(v):
    """A float that is NaN or infinite becomes None (JSON null); anything else stays."""
    return None if isinstance(v, float) and not math.isfinite(v) else v


def draw_chart(history: list[dict], path: Path) -> None:
    """Mean training reward per step (with dynamic sampling also that of every completion drawn, dropped groups
    included), and held-out greedy accuracy (and pass@k) at each evaluation."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    rewarded = [r for r in history if r.get("reward/mean") is not None]  # null: a step no reward applied to
    drawn = [r for r in history if r.get("sampling/reward_mean") is not None]  # with dynamic sampling
    if rewarded:
        ax.plot([r["step"] for r in rewarded], [r["reward/mean"] for r in rewarded], lw=1, alpha=0.6,
                label="training reward (groups trained on)" if drawn else "training reward (mean)")
    if drawn:
        ax.plot([r["step"] for r in drawn], [r["sampling/reward_mean"] for r in drawn], lw=1, alpha=0.6,
                label="reward of every completion drawn")
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
# a run's summary, from its metrics rows

def elapsed(rows: list[dict]) -> list[float]:
    """Seconds since the run started at each row: perf/elapsed_seconds, or for runs written before it existed,
    the sum of the step times so far."""
    out, total = [], 0.0
    for r in rows:
        total += r.get("perf/step_seconds", 0.0) or 0.0
        out.append(r.get("perf/elapsed_seconds", total))
    return out


def summarize(rows: list[dict]) -> dict:
    """Held-out accuracy at the start, at the end and at its best; the steps, the wall time and the completion
    tokens per second of the update steps."""
    evals = [r for r in rows if isinstance(r.get("eval/accuracy"), (int, float))]
    steps = [r for r in rows if "perf/step_seconds" in r]
    out = {"steps": max((r["step"] for r in rows), default=0),
           "seconds": elapsed(rows)[-1] if rows else 0.0}
    busy = sum(r["perf/step_seconds"] for r in steps)
    out["tokens_per_s"] = sum(r.get("perf/completion_tokens", 0) for r in steps) / busy if busy else 0.0
    out["step_seconds"] = busy / len(steps) if steps else 0.0
    if evals:
        best = max(evals, key=lambda r: (r["eval/accuracy"], -r["step"]))
        out.update(accuracy_start=evals[0]["eval/accuracy"], accuracy_end=evals[-1]["eval/accuracy"],
                   accuracy_best=best["eval/accuracy"], accuracy_best_step=best["step"])
        for k in sorted(k for k in evals[-1] if k.startswith("eval/pass@")):
            if k in evals[0]:
                out[k] = (evals[0][k], evals[-1][k])
    return out


def summary_lines(rows: list[dict], out_dir: Path) -> list[str]:
    """What `grpo train` prints at the end: accuracy start → end and best, time, tokens/s, peak memory, and
    where the outputs are."""
    s = summarize(rows)
    lines = []
    if "accuracy_end" in s:
        a, b = s["accuracy_start"], s["accuracy_end"]
        line = (f"held-out accuracy {a:.3f} -> {b:.3f} ({100 * (b - a):+.1f} points), best {s['accuracy_best']:.3f} "
                f"at step {s['accuracy_best_step']}")
        line += "".join(f"; {k[5:]} {v[0]:.3f} -> {v[1]:.3f}" for k, v in s.items() if k.startswith("eval/pass@"))
        lines.append(line)
    lines.append(f"{s['steps']} steps in {duration(s['seconds'])} ({s['step_seconds']:.2f} s per step), "
                 f"{s['tokens_per_s']:,.0f} completion tokens/s, peak memory {peak_memory()}")
    names = ["model/", "metrics.jsonl", "samples.jsonl", "chart.png", "tensorboard/", "wandb/", "checkpoints/"]
    found = [n for n in names if (out_dir / n.rstrip("/")).exists()
             and not (n == "samples.jsonl" and (out_dir / n).stat().st_size == 0)]  # log.samples_every=0: none
    lines.append(f"outputs in {out_dir}: {', '.join(found)}; compare runs with: grpo report {out_dir} [OTHER_RUN ...]")
    return lines


def peak_memory() -> str:
    """This process's peak resident memory, and the GPU's peak allocation when one was used."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    text = f"{peak / 2**30:.2f} GiB resident"  # ru_maxrss: bytes on macOS, KiB on Linux
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        text += f", {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB on the GPU"
    return text


def duration(seconds: float) -> str:
    seconds = round(seconds)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h} h {m} min" if h else f"{m} min {s} s" if m else f"{s} s"
