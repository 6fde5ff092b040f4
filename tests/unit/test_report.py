"""`grpo report`: what is drawn for two runs (panels, lines, colours, data, legend), the HTML page, refusals, and
the end-of-run summary."""
import json

import matplotlib.image
import pytest
import yaml

from grpo.cli import main
from grpo.errors import GRPOError
from grpo.runlog import summarize, summary_lines
from grpo.report import differing_keys, figure, load_run, load_runs, write_report, _moving_mean


def make_run(path, *, lr, beta, steps=40, entropy=False, slow=1.0):
    path.mkdir(parents=True)
    config = {"algo": {"beta": beta, "preset": "grpo"}, "train": {"lr": lr, "steps": steps,
                                                                   "output_dir": str(path)},
              "log": {"trackers": ["tensorboard"], "run_name": path.name}}
    (path / "config.yaml").write_text(yaml.safe_dump(config))
    rows, t = [], 5.0
    for step in range(steps + 1):
        row = {"step": step}
        if step:
            t += slow * (1 + step % 3)
            row.update({"reward/mean": step / steps * lr * 1000, "kl": beta * step, "completion/mean_length": 20 + step,
                        "clip/frac": 0.01 * (step % 4), "perf/step_seconds": slow * (1 + step % 3),
                        "perf/completion_tokens": 100})
            if entropy:
                row["entropy/mean"] = 2.0 - step / steps
        if step % 10 == 0:
            t += 3.0
            row.update({"eval/accuracy": 0.2 + step / 100 * (1 if beta else 0.5), "eval/pass@8": 0.5 + step / 200})
        row["perf/elapsed_seconds"] = t
        rows.append(row)
    rows[5]["kl"] = float("nan")  # a step without loss tokens: not a point
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def lines_by_gid(ax):
    return {line.get_gid(): line for line in ax.get_lines() if line.get_gid()}


def test_two_runs_are_drawn_per_figure_against_steps_and_wall_time(tmp_path):
    rows_a = make_run(tmp_path / "a", lr=1e-3, beta=0.04)
    rows_b = make_run(tmp_path / "b", lr=2e-3, beta=0.0, entropy=True, slow=2.0)
    runs = load_runs([tmp_path / "a", tmp_path / "b"])
    assert differing_keys(runs) == ["algo.beta", "train.lr"]  # output_dir and log.* are not compared

    fig = figure(runs)
    axes = fig.axes
    titles = [ax.get_title() for ax in axes[::2]]
    assert titles == ["training reward (mean)", "held-out accuracy: greedy (solid), pass@k (dashed)",
                      "KL to the reference (per token)", "completion length (tokens)", "clip fraction (tokens)",
                      "entropy (per token)", "seconds per step"]
    reward_steps, reward_time = axes[0], axes[1]
    a, b = lines_by_gid(reward_steps)["a|reward/mean"], lines_by_gid(reward_steps)["b|reward/mean"]
    assert a.get_color() != b.get_color()
    assert list(a.get_xdata()) == list(range(1, 41))
    assert list(a.get_ydata()) == pytest.approx(_moving_mean([r["reward/mean"] for r in rows_a[1:]], 2))
    # against wall time: the elapsed seconds (run b is slower: its curve reaches further right)
    a_t, b_t = lines_by_gid(reward_time)["a|reward/mean"], lines_by_gid(reward_time)["b|reward/mean"]
    x = list(a_t.get_xdata())
    assert [v for v in x if v == v] == pytest.approx([r["perf/elapsed_seconds"] for r in rows_a[1:]])
    assert [i for i, v in enumerate(x) if v != v] == [10, 21, 32]  # a break after steps 10, 20, 30: evaluations
    assert max(b_t.get_xdata()) > max(a_t.get_xdata())
    assert reward_time.get_xlabel() == "wall time (seconds)"
    # held-out accuracy at each evaluation, and pass@8 dashed, in the run's colour
    acc = lines_by_gid(axes[2])
    assert list(acc["b|eval/accuracy"].get_xdata()) == [0, 10, 20, 30, 40]
    assert list(acc["b|eval/accuracy"].get_ydata()) == pytest.approx([r["eval/accuracy"] for r in rows_b[::10]])
    assert acc["a|eval/pass@8"].get_linestyle() == "--" and acc["a|eval/pass@8"].get_color() == a.get_color()
    # the NaN KL of step 5 is left out; the entropy panel has only run b, which logged it
    assert 5 not in lines_by_gid(axes[4])["a|kl"].get_xdata()
    assert set(lines_by_gid(axes[10])) == {"b|entropy/mean"}
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == ["a: algo.beta=0.04, train.lr=0.001", "b: algo.beta=0.0, train.lr=0.002"]


def test_panels_nobody_logged_are_left_out_and_one_run_has_no_diff(tmp_path):
    make_run(tmp_path / "a", lr=1e-3, beta=0.04)
    runs = load_runs([tmp_path / "a"])
    fig = figure(runs)
    assert "entropy (per token)" not in [ax.get_title() for ax in fig.axes]
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["a"]


def test_write_report_png_and_self_contained_html(tmp_path):
    make_run(tmp_path / "x" / "run", lr=1e-3, beta=0.04)
    make_run(tmp_path / "y" / "run", lr=2e-3, beta=0.04, steps=600, slow=3.0)
    runs = load_runs([tmp_path / "x" / "run", tmp_path / "y" / "run"])
    assert [r.label for r in runs] == ["x/run", "y/run"]  # equal names take their parent's
    png, page = write_report(runs, tmp_path / "cmp")
    image = matplotlib.image.imread(png)
    assert image.shape[1] == 1320 and image.shape[0] > 1500
    text = page.read_text()
    assert text.startswith("<!DOCTYPE html>") and text.count("<svg") == 1
    assert "x/run" in text and "y/run" in text and "<th>train.lr</th>" in text
    assert "wall time (minutes)" in text  # the long run's axis is in minutes
    assert "0.200 → 0.600" in text and "1 h 3 min" in text  # accuracy start → end, wall time of run y
    for external in ("<script", "<link", 'src="http', "@import"):
        assert external not in text

    with pytest.raises(GRPOError, match="cmp.png and .*cmp.html already exist; choose another --output or pass "
                                        "--overwrite"):
        write_report(runs, tmp_path / "cmp")
    before = png.stat().st_mtime_ns
    write_report(runs[:1], tmp_path / "cmp", overwrite=True)
    assert png.stat().st_mtime_ns >= before and "y/run" not in page.read_text()


def test_a_run_without_config_and_a_run_without_steps(tmp_path):
    make_run(tmp_path / "a", lr=1e-3, beta=0.04)
    make_run(tmp_path / "b", lr=2e-3, beta=0.04)
    make_run(tmp_path / "c", lr=2e-3, beta=0.04)
    (tmp_path / "c" / "config.yaml").unlink()
    runs = load_runs([tmp_path / n for n in "abc"])
    assert differing_keys(runs) == ["train.lr"]  # compared between the runs that have a config
    assert [t.get_text() for t in figure(runs).legends[0].get_texts()] == \
        ["a: train.lr=0.001", "b: train.lr=0.002", "c (no config.yaml)"]
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "metrics.jsonl").write_text('{"step": 0, "perf/elapsed_seconds": 3.0}\n')
    with pytest.raises(GRPOError, match="nothing to draw yet: the runs have logged no update step"):
        write_report(load_runs([tmp_path / "d"]), tmp_path / "out")
    assert not (tmp_path / "out.png").exists()


def test_output_may_be_a_directory(tmp_path):
    make_run(tmp_path / "a", lr=1e-3, beta=0.04)
    (tmp_path / "reports").mkdir()
    png, page = write_report(load_runs([tmp_path / "a"]), tmp_path / "reports")
    assert (png, page) == (tmp_path / "reports" / "report.png", tmp_path / "reports" / "report.html")
    with pytest.raises(GRPOError, match="the directory of --output, .* does not exist"):
        write_report(load_runs([tmp_path / "a"]), tmp_path / "nowhere" / "x")


def test_bad_run_directories(tmp_path):
    with pytest.raises(GRPOError, match="is not a run directory: it has no metrics.jsonl"):
        load_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\nnot json\n{"step": 1}\n')
    with pytest.raises(GRPOError, match=r"metrics.jsonl:2: not a JSON line"):
        load_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1, "lo')  # torn by a kill: dropped
    assert [r["step"] for r in load_run(tmp_path).rows] == [0]
    with pytest.raises(GRPOError, match="a run directory is named twice"):
        load_runs([tmp_path, tmp_path])


def test_cli_report(tmp_path, capsys, monkeypatch):
    make_run(tmp_path / "a", lr=1e-3, beta=0.04)
    make_run(tmp_path / "b", lr=2e-3, beta=0.04)
    monkeypatch.chdir(tmp_path)
    assert main(["report", "a", "b"]) == 0
    assert (tmp_path / "report.png").exists() and (tmp_path / "report.html").exists()
    assert main(["report", "a", "b"]) == 2
    assert "already exist" in capsys.readouterr().err
    assert main(["report", "a", "missing"]) == 2
    assert capsys.readouterr().err.strip() == "grpo: error: 'missing' is not a run directory: it has no metrics.jsonl"


def test_summary(tmp_path):
    rows = make_run(tmp_path / "a", lr=1e-3, beta=0.04)
    s = summarize(rows)
    assert s["accuracy_start"] == 0.2 and s["accuracy_end"] == pytest.approx(0.6)
    assert s["accuracy_best"] == pytest.approx(0.6) and s["accuracy_best_step"] == 40
    assert s["seconds"] == rows[-1]["perf/elapsed_seconds"] and s["steps"] == 40
    busy = sum(r.get("perf/step_seconds", 0) for r in rows)
    assert s["tokens_per_s"] == pytest.approx(40 * 100 / busy)
    (tmp_path / "a" / "model").mkdir()
    lines = summary_lines(rows, tmp_path / "a")
    assert lines[0] == "held-out accuracy 0.200 -> 0.600 (+40.0 points), best 0.600 at step 40; pass@8 0.500 -> 0.700"
    assert lines[1].startswith(f"40 steps in 1 min 40 s ({busy / 40:.2f} s per step), ")
    assert "GiB resident" in lines[1]
    assert lines[2] == (f"outputs in {tmp_path / 'a'}: model/, metrics.jsonl; compare runs with: grpo report "
                        f"{tmp_path / 'a'} [OTHER_RUN ...]")
