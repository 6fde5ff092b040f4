"""`grpo report RUN_DIR [RUN_DIR ...]`: one PNG and one self-contained HTML page that compare finished (or
running) runs, each figure against steps and against wall time, one colour per run, the configs' differing
keys in the legend.

A run directory is what `grpo train` writes: metrics.jsonl (required) and config.yaml (for the legend).
"""
from __future__ import annotations

import html
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path

import yaml

from grpo.config import flatten
from grpo.errors import GRPOError
from grpo.runlog import duration, elapsed, summarize

# (title, metric keys, y-axis limits or None); "eval/pass@*" stands for every pass@k the runs logged
PANELS = [
    ("training reward (mean)", ["reward/mean"], None),
    ("held-out accuracy: greedy (solid), pass@k (dashed)", ["eval/accuracy", "eval/pass@*"], (0, 1.02)),
    ("KL to the reference (per token)", ["kl"], None),
    ("completion length (tokens)", ["completion/mean_length"], None),
    ("clip fraction (tokens)", ["clip/frac"], None),
    ("entropy (per token)", ["entropy/mean"], None),
    ("seconds per step", ["perf/step_seconds"], None),
]
# keys left out of the legend's comparison: where a run wrote, and how it reported
UNCOMPARED = ("train.output_dir", "train.resume", "log.")
LEGEND_KEYS = 4  # differing keys named in the legend; the HTML table lists them all


@dataclass
class Run:
    path: Path
    label: str
    config: dict          # flattened: {"algo.beta": 0.04, ...}; empty without config.yaml
    rows: list[dict]      # metrics.jsonl

    def series(self, key: str, x: str = "step") -> tuple[list[float], list[float]]:
        """(x, y) of the rows that logged `key` as a finite number; x is the step or the elapsed seconds (for a
        figure of the update step, when the step ended: before the evaluation logged with it)."""
        xs, ys = [], []
        for r, t in zip(self.rows, self.elapsed()):
            v = r.get(key)
            if isinstance(v, (int, float)) and math.isfinite(v):
                if not key.startswith("eval/"):
                    t -= r.get("perf/eval_seconds", 0.0)
                xs.append(r["step"] if x == "step" else t)
                ys.append(float(v))
        return xs, ys

    def elapsed(self) -> list[float]:
        return elapsed(self.rows)

    @property
    def evaluated(self) -> set[int]:
        """The steps after which the run evaluated."""
        return {r["step"] for r in self.rows if "eval/accuracy" in r}


def load_run(path: str | Path) -> Run:
    path = Path(path)
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise GRPOError(f"{str(path)!r} is not a run directory: it has no metrics.jsonl")
    lines = metrics.read_text().splitlines()
    rows = []
    for i, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except ValueError:
            if i == len(lines):  # the last line of a run that was killed while writing it
                break
            raise GRPOError(f"{metrics}:{i}: not a JSON line") from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise GRPOError(f"{metrics}:{i}: a metrics line must be an object with an integer step")
        rows.append(row)
    if not rows:
        raise GRPOError(f"{metrics} has no steps yet")
    config = {}
    if (path / "config.yaml").is_file():
        try:
            config = flatten(yaml.safe_load((path / "config.yaml").read_text()) or {})
        except yaml.YAMLError as e:
            raise GRPOError(f"{path / 'config.yaml'} is not valid YAML: {' '.join(str(e).split())}") from None
    return Run(path, path.resolve().name, config, rows)


def load_runs(paths: list[str | Path]) -> list[Run]:
    runs = [load_run(p) for p in paths]
    if len({r.path.resolve() for r in runs}) < len(runs):
        raise GRPOError("a run directory is named twice")
    # equal directory names (a/run, b/run) take their parents' names until they differ
    for depth in range(2, 8):
        labels = [r.label for r in runs]
        if len(set(labels)) == len(labels):
            break
        for r in runs:
            if labels.count(r.label) > 1:
                r.label = "/".join(r.path.resolve().parts[-depth:])
    return runs


def differing_keys(runs: list[Run]) -> list[str]:
    """Config keys whose values are not the same in every run that has a config.yaml (a key one of them lacks,
    written by an older grpo, counts as differing)."""
    configs = [r.config for r in runs if r.config]
    if len(configs) < 2:
        return []
    keys = sorted(set().union(*configs))
    return [k for k in keys if not k.startswith(UNCOMPARED)
            and len({json.dumps(c.get(k, "—"), sort_keys=True) for c in configs}) > 1]


def legend_label(run: Run, keys: list[str]) -> str:
    if not run.config:
        return f"{run.label} (no config.yaml)"
    shown = ", ".join(f"{k}={_value(run.config.get(k, '—'))}" for k in keys[:LEGEND_KEYS])
    more = f", +{len(keys) - LEGEND_KEYS} more" if len(keys) > LEGEND_KEYS else ""
    return f"{run.label}: {shown}{more}" if shown else run.label


# ---------------------------------------------------------------------------------------------------------
# the figure

def figure(runs: list[Run]):
    """One row per figure that some run logged, against steps (left) and wall time (right)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(title, _keys(runs, keys), ylim) for title, keys, ylim in PANELS]
    panels = [p for p in panels if any(run.series(k)[0] for run in runs for k in p[1])]
    if not panels:
        raise GRPOError("nothing to draw yet: the runs have logged no update step and no held-out evaluation")
    seconds = max(max(run.elapsed()) for run in runs)
    scale, unit = (60.0, "minutes") if seconds > 300 else (1.0, "seconds")
    colours = [f"C{i % 10}" for i in range(len(runs))]
    diff = differing_keys(runs)

    fig, axes = plt.subplots(len(panels), 2, figsize=(12, 2.5 * len(panels) + 0.6 + 0.22 * len(runs)),
                             squeeze=False, dpi=110)
    for row, (title, keys, ylim) in enumerate(panels):
        for col, x in enumerate(("step", "elapsed")):
            ax = axes[row][col]
            for run, colour in zip(runs, colours):
                for key in keys:
                    xs, ys = run.series(key, x)
                    if not xs:
                        continue
                    if x == "elapsed":
                        xs = [v / scale for v in xs]
                    if key.startswith("eval/"):
                        style = "o-" if key == "eval/accuracy" else "s--"
                        ax.plot(xs, ys, style, color=colour, lw=1.6 if key == "eval/accuracy" else 1, ms=3,
                                gid=f"{run.label}|{key}")
                    else:
                        window = max(1, len(ys) // 20)
                        smooth = _moving_mean(ys, window)
                        if x == "elapsed":  # the time of an evaluation is a gap in the curve, not a line across it
                            evaluated = run.evaluated
                            after = [s in evaluated for s in run.series(key)[0]]
                            xs, ys, smooth = (_break(v, after) for v in (xs, ys, smooth))
                        if window > 1:
                            ax.plot(xs, ys, "-", color=colour, lw=0.6, alpha=0.3)
                        ax.plot(xs, smooth, "-", color=colour, lw=1.6, gid=f"{run.label}|{key}")
            ax.set_title(title if col == 0 else f"{title}, against wall time", fontsize=9)
            ax.set_xlabel("step" if x == "step" else f"wall time ({unit})", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3)
            if ylim:
                ax.set_ylim(*ylim)
    handles = [matplotlib.lines.Line2D([], [], color=c, lw=2) for c in colours]
    fig.legend(handles, [legend_label(r, diff) for r in runs], loc="upper center", ncol=1, fontsize=8,
               frameon=False)
    top = 1 - (0.3 + 0.2 * len(runs)) / fig.get_figheight()
    fig.tight_layout(rect=(0, 0, 1, top))
    return fig


def _keys(runs: list[Run], keys: list[str]) -> list[str]:
    out = []
    for k in keys:
        if k.endswith("*"):
            found = {key for run in runs for r in run.rows for key in r if key.startswith(k[:-1])}
            out += sorted(found, key=lambda s: int(s.rsplit("@", 1)[1]) if s.rsplit("@", 1)[1].isdigit() else 0)
        else:
            out.append(k)
    return out


def _break(values: list[float], after: list[bool]) -> list[float]:
    """`values` with a NaN (a break in the line) after each point flagged in `after`, but the last."""
    out = []
    for i, (v, cut) in enumerate(zip(values, after)):
        out.append(v)
        if cut and i < len(values) - 1:
            out.append(float("nan"))
    return out


def _moving_mean(ys: list[float], window: int) -> list[float]:
    """The mean of each value and up to `window - 1` before it (no look-ahead: the curve lags, never leads)."""
    out, total = [], 0.0
    for i, y in enumerate(ys):
        total += y
        if i >= window:
            total -= ys[i - window]
        out.append(total / min(i + 1, window))
    return out


# ---------------------------------------------------------------------------------------------------------
# the files

def write_report(runs: list[Run], out: str | Path, *, overwrite: bool = False) -> tuple[Path, Path]:
    """`out`.png and `out`.html (`out` a directory: report.png and report.html in it); an existing file is
    refused unless `overwrite`."""
    out = Path(out)
    if out.is_dir() or not out.name:
        out = out / "report"
    png, page = out.with_name(out.name + ".png"), out.with_name(out.name + ".html")
    existing = [str(p) for p in (png, page) if p.exists()]
    if existing and not overwrite:
        raise GRPOError(f"{' and '.join(existing)} already exist{'s' if len(existing) == 1 else ''}; choose "
                        "another --output or pass --overwrite")
    if not out.parent.is_dir():
        raise GRPOError(f"the directory of --output, {str(out.parent)!r}, does not exist")
    import matplotlib.pyplot as plt

    fig = figure(runs)
    try:
        fig.savefig(png)
        svg = io.StringIO()
        with plt.rc_context({"svg.fonttype": "none"}):  # text stays text: searchable, and small
            fig.savefig(svg, format="svg", metadata={"Date": None})
    finally:
        plt.close(fig)
    page.write_text(_html(runs, svg.getvalue()))
    return png, page


def _html(runs: list[Run], svg: str) -> str:
    diff = differing_keys(runs)
    head = ["run", *diff, "steps", "held-out accuracy", "best", "wall time", "tokens/s", "directory"]
    body = []
    for i, run in enumerate(runs):
        s = summarize(run.rows)
        acc = f"{s['accuracy_start']:.3f} → {s['accuracy_end']:.3f}" if "accuracy_end" in s else "—"
        best = f"{s['accuracy_best']:.3f} (step {s['accuracy_best_step']})" if "accuracy_best" in s else "—"
        cells = [f'<span class="swatch" style="background:{_colour(i)}"></span>{html.escape(run.label)}',
                 *[html.escape(_value(run.config.get(k, "—"))) for k in diff], str(s["steps"]), acc, best,
                 duration(s["seconds"]), f"{s['tokens_per_s']:,.0f}" if s["tokens_per_s"] else "—",
                 f"<code>{html.escape(str(run.path))}</code>"]
        body.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    configs = "".join(
        f"<details><summary>config of {html.escape(r.label)}</summary><pre>"
        + html.escape("\n".join(f"{k}: {_value(v)}" for k, v in r.config.items()) or "(no config.yaml)")
        + "</pre></details>" for r in runs)
    svg = svg[svg.index("<svg"):]  # without the XML prolog and doctype
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>grpo report: {html.escape(", ".join(r.label for r in runs))}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }}
table {{ border-collapse: collapse; font-size: 0.9em; margin-bottom: 1em; }}
th, td {{ border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; }}
th {{ background: #f3f3f3; }}
.swatch {{ display: inline-block; width: 0.9em; height: 0.9em; margin-right: 0.4em; vertical-align: middle; }}
svg {{ max-width: 100%; height: auto; }}
pre {{ font-size: 0.8em; }}
</style></head><body>
<h1>grpo report</h1>
<p>{len(runs)} run{"s" if len(runs) > 1 else ""}. A figure of the update steps over 40 steps or more is drawn
twice: thin, each step, and thick, the mean over the last 5 % of the steps. Against wall time, its curve
breaks where the run evaluated. Accuracy is greedy on the held-out split; pass@k samples k completions per
prompt.</p>
<table><tr>{"".join(f"<th>{html.escape(h)}</th>" for h in head)}</tr>
{"".join(body)}</table>
{svg}
{configs}
</body></html>
"""


def _colour(i: int) -> str:
    import matplotlib.colors
    return matplotlib.colors.to_hex(f"C{i % 10}")


def _value(v) -> str:
    return v if isinstance(v, str) else json.dumps(v)
