"""`grpo train|eval|sample|serve [CONFIG] [dotted.key=value ...]`: parse, load the config, call the library;
`grpo eval|sample RUN_DIR [dotted.key=value ...]`: a run's model with its own config (`run_source`);
`grpo report RUN_DIR [RUN_DIR ...]`: compare runs (grpo/report.py). `grpo serve` starts the vLLM server that a
run with rollout.backend=vllm_server and vllm_server.urls samples on (grpo/rollout/vllm_server.py).

CONFIG is a YAML path or the name of a shipped config (`grpo/configs/`, e.g. `presets/dapo`); without one, the
default job (`grpo/configs/tiny.yaml`, which adds dynamic sampling to the library's defaults). Errors in a
config, a data file or a user function print one line and exit with status 2, without a traceback.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

from grpo.config import describe_options, load_config
from grpo.errors import NO_ROOM, GRPOError, write_failure
from grpo.models import has_weights, model_device
from grpo.validate import registry_names

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
DEFAULT_JOB = CONFIG_DIR / "tiny.yaml"  # what `grpo train` runs without a CONFIG


def shipped_configs() -> list[str]:
    return sorted(str(p.relative_to(CONFIG_DIR).with_suffix("")) for p in CONFIG_DIR.rglob("*.yaml"))


def resolve_config(name: str) -> Path:
    path = Path(name)
    if path.is_file():
        return path
    shipped = CONFIG_DIR / (name if name.endswith(".yaml") else name + ".yaml")
    if shipped.is_file():
        return shipped
    raise GRPOError(f"config {name!r} is neither a file nor a shipped config ({', '.join(shipped_configs())})")


def _split_args(items: list[str]) -> tuple[Path, list[str]]:
    if items and "=" not in items[0]:
        return resolve_config(items[0]), items[1:]
    return DEFAULT_JOB, items


# the options each command reads besides `train` (which reads them all), for its --help: sections and dotted keys
# (`describe_options(only=...)`), less the keys of those sections it does not read (`leave_out`)
READS = {
    "eval": (("model", "data", "rollout", "tools", "sandbox", "eval", "reward_model", "judge", "vllm", "vllm_server",
              "compute.threads", "train.seed"),
             ("model.gradient_checkpointing", "model.logprob_chunk_size", "rollout.group_size",
              "rollout.max_staleness", "rollout.staleness_mode")),
    "sample": (("model", "data", "rollout", "tools", "sandbox", "vllm", "vllm_server", "compute.threads",
                "train.seed"),
               ("model.gradient_checkpointing", "model.logprob_chunk_size", "rollout.group_size",
                "rollout.max_staleness", "rollout.staleness_mode")),
    "serve": (("model.path", "model.dtype", "vllm", "vllm_server", "train.seed"), ()),
}
RUN_DIR_NOTE = ("CONFIG may be a run directory of grpo train: its config.yaml (task, chat template, tools, "
                "environment, ...) and its final model/ (or, before the run has one, its newest checkpoint's "
                "weights); dotted overrides apply on top. A model.path inside a run directory (runs/x/model) takes "
                "that run's config.yaml too, unless a CONFIG is given.")


def _epilog(command: str) -> str:
    if command in READS:
        sections, left_out = READS[command]
        text = describe_options(registry_names(), only=sections, leave_out=left_out)
        head = f"the options grpo {command} reads (as dotted.key=value, or in the YAML file; a config's others are " \
               "ignored):\n"
    else:
        text, head = describe_options(registry_names()), "options (as dotted.key=value, or in the YAML file):\n"
    note = "\n\n" + RUN_DIR_NOTE if command in ("eval", "sample") else ""
    return head + text + note + "\n\nshipped configs: " + ", ".join(shipped_configs())


@dataclass
class Source:
    """What `grpo eval` and `grpo sample` run: a config file and overrides, the checkpoint whose weights replace the
    model's (a run without its final model yet), and the line that says so (None: a config as given)."""

    config: Path | None
    overrides: list[str]
    checkpoint: Path | None = None
    note: str | None = None


# a run's training rewards are not what eval or sample use (eval.reward, eval.rewards are): a function given in
# Python to train() may not be importable here, so a run's config loads with the default in their place
_NOT_TRAINING = ["rewards=[last_number]", "reward_weights=null"]


def run_source(items: list[str], *, needs_data: bool = True) -> Source:
    """eval's and sample's arguments: `RUN_DIR [key=value ...]` (the run's config.yaml and its final model/, or
    before it has one its newest complete checkpoint), `CONFIG [key=value ...]` as train takes them, or only
    overrides, where a model.path inside a run directory (runs/x/model, runs/x/checkpoints/step-N) takes that run's
    config.yaml, else the default job's. A run's config.yaml that cannot say what the run used (`check_run`) is
    refused in one line that names the overrides to give; `needs_data`: the command reads the held-out examples."""
    source = _source(items)
    if source.note is not None:  # a run's config.yaml
        check_run(source.config, source.overrides, needs_data=needs_data)
    return source


# where a run's config.yaml names Python objects: those its training script defined cannot be imported here
_NAMED_OBJECTS = {"rollout.environment": "my_module:MyEnv", "rollout.backend": "my_module:MyBackend",
                  "tools.names": "[my_module:add]", "eval.reward": "my_module:accuracy_reward",
                  "eval.rewards": "[my_module:format_reward]"}


def check_run(config: Path, overrides: list[str], *, needs_data: bool = True) -> None:
    """A run's config.yaml loads for eval and sample as what the run used, or a GRPOError naming the overrides to
    give: the data sets it was given as objects (data.given) as files, and what its training script defined
    ('__main__:add', a local function) from an importable module."""
    import yaml

    saved = yaml.safe_load(config.read_text()) or {}
    keys = {o.partition("=")[0].strip() for o in overrides}
    data = saved.get("data") or {}
    given = data.get("given") or []
    need = ["data.path"] + (["data.eval_path"] if "eval_dataset" in given else [])
    if needs_data and given and not all(k in keys for k in need):
        raise GRPOError(f"{config} is a run trained on data given to grpo.train as objects ({', '.join(given)}), "
                        f"which its config cannot hold: give them as files, "
                        + " ".join(f"{k}=FILE" for k in need) + " (--prompt for grpo sample)")
    script = []
    for key, example in _NAMED_OBJECTS.items():
        section, _, name = key.partition(".")
        value = (saved.get(section) or {}).get(name)
        values = value if isinstance(value, list) else [value]
        bad = [v for v in values if isinstance(v, str) and (v.startswith("__main__:") or "<locals>" in v)]
        if bad and key not in keys:
            script.append((key, bad, example))
    if script:
        raise GRPOError(f"{config} names what its training script defined, which cannot be imported here ("
                        + "; ".join(f"{k}: {', '.join(b)}" for k, b, _ in script) + "): give them from an "
                        "importable module, " + " ".join(f"{k}={e}" for k, _, e in script))


def _source(items: list[str]) -> Source:
    first = items[0] if items and "=" not in items[0] else None
    overrides = items[1:] if first is not None else list(items)
    given = [o.partition("=")[2].strip() for o in overrides if o.partition("=")[0].strip() == "model.path"]
    if first is not None and Path(first).is_dir():
        run = Path(first)
        if not (run / "config.yaml").is_file():
            raise GRPOError(f"{first} is a directory without a config.yaml, not a run directory of grpo train; for "
                            f"a model directory give model.path={first}")
        if given:
            return Source(run / "config.yaml", _NOT_TRAINING + overrides,
                          note=f"run {run}: its config.yaml, with model.path={given[-1]}")
        if has_weights(run / "model"):
            return Source(run / "config.yaml", _NOT_TRAINING + [f"model.path={run / 'model'}"] + overrides,
                          note=f"run {run}: its config.yaml and its final model {run / 'model'}")
        from grpo.checkpoint import find_checkpoint
        ckpt = find_checkpoint("auto", run)
        if ckpt is None:
            raise GRPOError(f"run {run} has no final model ({run / 'model'}) and no complete checkpoint yet: "
                            "nothing to load")
        return Source(run / "config.yaml", _NOT_TRAINING + overrides, checkpoint=ckpt,
                      note=f"run {run} has no final model yet: its config.yaml and the weights of its newest "
                           f"checkpoint {ckpt}")
    if first is not None:
        return Source(resolve_config(first), overrides)
    if given:
        model = Path(given[-1]).expanduser()
        if _is_checkpoint(model):
            return Source(model / "config.yaml", _NOT_TRAINING + [o for o in overrides if not o.startswith(
                "model.path=")], checkpoint=model, note=f"model.path={given[-1]} is a checkpoint: its config.yaml and "
                                                         "its weights")
        if model.is_dir() and (model.parent / "config.yaml").is_file():
            return Source(model.parent / "config.yaml", _NOT_TRAINING + overrides,
                          note=f"model.path={given[-1]} is in run {model.parent}: its config.yaml (task, chat "
                               "template, tools, ...), not the default job's; give a CONFIG for another")
    return Source(DEFAULT_JOB, overrides)


def _is_checkpoint(path: Path) -> bool:
    from grpo.checkpoint import MARKER
    return (path / MARKER).is_file() and (path / "config.yaml").is_file()


def _parser() -> argparse.ArgumentParser:
    from grpo import __version__

    p = argparse.ArgumentParser(prog="grpo", description="Group Relative Policy Optimization for causal LMs.")
    p.add_argument("--version", action="version", version=f"grpo {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    fmt = argparse.RawDescriptionHelpFormatter
    t = sub.add_parser("train", help="train a model with GRPO (no arguments: the default tiny-model job)",
                       epilog=_epilog("train"), formatter_class=fmt)
    t.add_argument("args", nargs="*", metavar="[CONFIG] [key=value]")
    e = sub.add_parser("eval", help="held-out greedy accuracy and pass@k of a run (RUN_DIR) or a model "
                                    "(model.path=...)", epilog=_epilog("eval"), formatter_class=fmt)
    e.add_argument("args", nargs="*", metavar="[RUN_DIR|CONFIG] [key=value]")
    s = sub.add_parser("sample", help="print sampled completions of a run (RUN_DIR) or a model (model.path=...)",
                       epilog=_epilog("sample"), formatter_class=fmt)
    s.add_argument("args", nargs="*", metavar="[RUN_DIR|CONFIG] [key=value]")
    s.add_argument("--prompt", action="append", help="a prompt (repeatable); default: a few held-out prompts")
    s.add_argument("-n", type=int, default=None, help="completions per prompt (default 4; 1 when greedy)")
    s.add_argument("--temperature", type=float, default=None, metavar="T",
                   help="sampling temperature (default: rollout.temperature); 0 decodes greedily, as --greedy")
    s.add_argument("--greedy", action="store_true",
                   help="greedy decoding (the most likely token at each step, as grpo eval's accuracy): one "
                        "completion per prompt, the same every time")
    v = sub.add_parser("serve", help="start a vLLM server of model.path for rollout.backend=vllm_server (it prints "
                                     "the URL to give the trainer as vllm_server.urls)", epilog=_epilog("serve"),
                       formatter_class=fmt)
    v.add_argument("args", nargs="*", metavar="[CONFIG] [key=value]")
    r = sub.add_parser("report", help="compare runs: one PNG and one self-contained HTML page",
                       description="Draw training reward, held-out accuracy and pass@k, KL, completion length, clip "
                                   "fraction, entropy and seconds per step of each run against steps and wall "
                                   "time, one colour per run, the configs' differing keys in the legend.")
    r.add_argument("runs", nargs="+", metavar="RUN_DIR", help="an output directory of grpo train")
    r.add_argument("-o", "--output", default="report",
                   help="where to write: OUTPUT.png and OUTPUT.html (default: report, in this directory)")
    r.add_argument("--overwrite", action="store_true", help="replace OUTPUT.png and OUTPUT.html if they exist")
    return p


PACKAGE_DIR = str(Path(__file__).resolve().parent)


def _format_warning(message, category, filename, lineno, line=None) -> str:
    """grpo's own warnings as one line, "grpo: warning: ...", like its errors; other libraries' as Python has them."""
    if str(Path(filename).resolve()).startswith(PACKAGE_DIR) and issubclass(category, UserWarning):
        return f"grpo: warning: {message}\n"
    return _python_format(message, category, filename, lineno, line)


_python_format = warnings.formatwarning


def _thread_exception(args) -> None:
    """A write that failed for want of room in a library's background thread (TensorBoard's event writer) prints
    no traceback: the main thread gets the same error at its next write and reports it as one line."""
    failed = write_failure(args.exc_value) if args.exc_value is not None else None
    if failed is not None and failed.errno in NO_ROOM:
        return
    _python_thread_hook(args)


_python_thread_hook = threading.excepthook


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    warnings.formatwarning = _format_warning
    threading.excepthook = _thread_exception
    try:
        if args.command == "report":
            return _report(args)
        if args.command in ("eval", "sample"):
            source = run_source(args.args, needs_data=not (args.command == "sample" and args.prompt))
            if source.note:
                print(f"grpo {args.command}: {source.note}", file=sys.stderr, flush=True)
            args.checkpoint = source.checkpoint
            path, overrides = source.config, source.overrides
        else:
            path, overrides = _split_args(args.args)
        cfg = load_config(path, overrides)
        return {"train": _train, "eval": _eval, "sample": _sample, "serve": _serve}[args.command](cfg, args)
    except GRPOError as e:
        print(f"grpo: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("grpo: interrupted", file=sys.stderr)
        return 130


def _quiet_transformers() -> None:
    import transformers
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


def _train(cfg, args) -> int:
    _quiet_transformers()
    from grpo.distributed import process_group
    from grpo.runlog import summary_lines
    from grpo.trainer import train

    with process_group() as dist:  # one process, or the group torchrun describes
        result = train(cfg, dist=dist)
    if result.stopped_by:  # stopped and checkpointed: another signal while this process exits ends it at once,
        _exit_on_signal()  # not with a KeyboardInterrupt traceback from the interpreter's shutdown
    if not dist.is_main:
        return 0
    if result.stopped_by:
        again = " ".join(["grpo", "train", *args.args, "train.resume=auto"])
        print(f"stopped by {result.stopped_by} after step {result.steps_done}; checkpoint {result.checkpoint}\n"
              f"resume with: {again}", file=sys.stderr)
        return 128 + {"SIGINT": 2, "SIGTERM": 15}[result.stopped_by]
    print("\n".join(summary_lines(result.history, result.output_dir)))
    return 0


def _exit_on_signal() -> None:
    """From now on SIGINT and SIGTERM end this process at once, with their exit status (128 + the signal)."""
    import signal
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: os._exit(128 + signum))


def _serve(cfg, args) -> int:
    """Replace this process with `vllm serve` of model.path, with the flags grpo's trainer needs (the vllm.* and
    vllm_server.* sections: host, port (0: 8000), cache); the URL is printed first."""
    import importlib.util

    from grpo.models import resolve_model_path
    from grpo.rollout.vllm_server import open_host_error, serve_command

    if importlib.util.find_spec("vllm") is None:
        from grpo.rollout.vllm_common import INSTALL
        raise GRPOError(f"grpo serve needs vLLM, which is not installed; install it with {INSTALL}")
    host, port = cfg.vllm_server.host, cfg.vllm_server.port or 8000
    if why := open_host_error(host):
        raise GRPOError(why)
    model_dir = Path(resolve_model_path(cfg.model.path))
    if not (model_dir / "config.json").is_file():
        raise GRPOError(f"model.path={cfg.model.path}: {model_dir} has no config.json; grpo serve serves a "
                        "transformers model directory (a LoRA run serves its base model, model.path)")
    longest = cfg.vllm.max_model_len or int(json.loads((model_dir / "config.json").read_text())
                                            .get("max_position_embeddings") or 32768)
    cuda = any(os.path.exists(f"/dev/nvidia{i}") for i in range(8))
    cmd, env = serve_command(str(model_dir), vllm_cfg=cfg.vllm, host=host, port=port, dtype=cfg.model.dtype,
                             seed=cfg.train.seed, max_model_len=longest, device="cuda" if cuda else "cpu",
                             weight_transfer=cfg.vllm_server.weight_transfer)
    bracket = f"[{host}]" if ":" in host else host
    print(f"grpo serve: vLLM serves {cfg.model.path} at http://{bracket}:{port}; train on it with "
          f"rollout.backend=vllm_server vllm_server.urls=[http://{bracket}:{port}] (Ctrl-C stops it)",
          file=sys.stderr, flush=True)
    sys.stdout.flush()
    os.execve(cmd[0], cmd, {**os.environ, **env})
    return 0  # not reached


def _report(args) -> int:
    from grpo.report import load_runs, write_report

    png, page = write_report(load_runs(args.runs), args.output, overwrite=args.overwrite)
    print(f"wrote {png} and {page}")
    return 0


def _load(cfg, checkpoint: Path | None = None):
    """Model (a saved full model or LoRA adapter directory both load; with `checkpoint`, the run's model with that
    checkpoint's weights), generator, environment and task, built as training builds them."""
    _quiet_transformers()
    import torch

    from grpo.allocator import reuse_freed_memory
    from grpo.envs import build_environment
    from grpo.models import load_model
    from grpo.precision import resolved
    from grpo.rollout import build_generator
    from grpo.tasks import load_task

    if cfg.compute.threads:
        torch.set_num_threads(cfg.compute.threads)
    model, tokenizer = load_model(cfg.model, cfg.lora if checkpoint is not None else None)
    if cfg.compute.reuse_memory:
        reuse_freed_memory(model.device)
    if checkpoint is not None:
        _load_weights(model, checkpoint)
    model_cfg, precision = resolved(cfg.model, model)  # model.autocast_bf16=auto decided, on stderr as its line
    print(precision, file=sys.stderr)
    cfg = replace(cfg, model=model_cfg)
    generator = build_generator(model, tokenizer, cfg)
    if checkpoint is not None:  # an engine of its own (vLLM) starts from model.path: it takes the checkpoint's weights
        generator.sync_weights(model)
    environment = build_environment(model, tokenizer, cfg)
    return generator, environment, load_task(cfg.data, cfg.train.seed)


def _load_weights(model, ckpt: Path) -> None:
    """A checkpoint's model weights (grpo/checkpoint.py) into the model the run trained (its LoRA wrapping too)."""
    from grpo.checkpoint import load_model_weights, verify

    if problem := verify(ckpt):
        raise GRPOError(f"checkpoint {ckpt} cannot be loaded: {problem}")
    load_model_weights(ckpt, model, which="the model of its config.yaml")


def _eval(cfg, args) -> int:
    from tqdm.auto import tqdm

    from grpo.evaluation import Progress, evaluate
    from grpo.rewards import build_rewards, close_rewards, resolve_reward
    from grpo.rollout import rollout_sampling
    from grpo.sandbox import Limits

    generator, environment, task = _load(cfg, args.checkpoint)
    examples = task.eval[:cfg.eval.size] if cfg.eval.size else task.eval
    if not examples:
        raise GRPOError("no held-out examples to evaluate on: set data.eval_path, data.eval_split or "
                        "data.eval_fraction")
    with contextlib.closing(generator), contextlib.ExitStack() as stack:
        # a progress bar on a terminal (none when stderr is not one): the episodes, greedy and then pass@k's
        bar = stack.enter_context(tqdm(total=len(examples) * (1 + cfg.eval.pass_k), desc="grpo eval", unit="episode",
                                       disable=None, dynamic_ncols=True, file=sys.stderr))
        if not bar.disable:
            environment = Progress(environment, bar, chunk=max(8, -(-len(examples) // 20)),
                                   pad_id=getattr(generator, "pad_id", 0))
        correct = resolve_reward(cfg.eval.reward, field="eval.reward", sandbox_limits=Limits.from_config(cfg.sandbox))
        more = build_rewards(cfg.eval.rewards, sandbox_limits=Limits.from_config(cfg.sandbox),
                             reward_model=cfg.reward_model, device=model_device(cfg.model),
                             judge=cfg.judge, vllm_cfg=cfg.vllm, seed=cfg.train.seed)
        stack.callback(close_rewards, [fn for _, fn in more])  # a judge's launched server stops with the command
        metrics = evaluate(environment, generator, examples, correct,
                           max_new_tokens=cfg.rollout.max_new_tokens, pass_k=cfg.eval.pass_k,
                           temperature=cfg.eval.temperature, seed=cfg.train.seed, rewards=more,
                           threshold=cfg.eval.threshold, sampling=rollout_sampling(cfg.rollout, 1))
    print(json.dumps({"model": str(args.checkpoint or cfg.model.path), "task": getattr(task, "name", cfg.data.task),
                      "examples": len(examples), **metrics}, indent=2))
    return 0


def _sample(cfg, args) -> int:
    from grpo.rollout import SAMPLE, rollout_sampling, sampling_seed
    from grpo.tasks import Example

    if args.n is not None and args.n < 1:
        raise GRPOError(f"-n must be at least 1, got {args.n}")
    temperature = 0.0 if args.greedy else args.temperature
    if temperature is not None and not temperature >= 0:
        raise GRPOError(f"--temperature must be >= 0 (0: greedy), got {temperature:g}")
    greedy = temperature == 0
    if greedy and args.n not in (None, 1):
        raise GRPOError(f"greedy decoding gives one completion per prompt, the same every time; -n {args.n} asks "
                        "for more: leave -n out, or sample with --temperature > 0")
    n = args.n if args.n is not None else 1 if greedy else 4
    sampling = rollout_sampling(cfg.rollout, n)  # min_p, top_k, top_p, repetition_penalty and stop: the run's
    if temperature is not None:
        sampling = replace(sampling, temperature=temperature)  # 0: greedy, as grpo eval's accuracy
    generator, environment, task = _load(cfg, args.checkpoint)
    examples = [Example(p, "") for p in args.prompt] if args.prompt else (task.eval or task.train)[:4]
    seeds = [sampling_seed(cfg.train.seed, SAMPLE, i) for i in range(len(examples))]
    with contextlib.closing(generator):
        rollout = environment.rollout(generator, examples, sampling, seeds)
    for i, e in enumerate(examples):
        print(e.prompt)
        for j in range(i * n, (i + 1) * n):
            if rollout.episodes is None:
                print(f"    -> {rollout.texts[j]!r}")
                continue
            ep = rollout.episodes[j]  # a multi-turn episode: its turns after the prompt, and why it ended
            turns = [(m["role"], m["content"]) for m in ep.messages[1:]]
            print(f"    -> ({ep.stop}) " + " | ".join(f"{role}: {text!r}" for role, text in turns))
    return 0


if __name__ == "__main__":
    sys.exit(main())
