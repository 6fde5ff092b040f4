"""What every test shares: the markers, a seeded RNG, a small random model, and the rule that CI fails where a
skip would hide an optional extra it installed (GRPO_REQUIRE_EXTRAS)."""
import importlib
import os

import pytest
import torch

pytest_plugins = ["pytester"]  # tests/unit/test_suite_rules.py runs pytest on files of its own

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# A machine without a kernel layer for the sandbox (no bubblewrap, no user namespaces) refuses to run model-written
# code unless this is set (docs/sandbox.md); the suite accepts the rlimits and the guard there, so that the tools
# and the code reward are still tested. Where a kernel layer works this changes nothing; the refusal's own test
# unsets it.
os.environ.setdefault("GRPO_SANDBOX_RLIMITS_ONLY", "1")
# Under pytest-xdist (`make test`: TEST_WORKERS processes) each worker gets an equal share of the cores, it and the
# processes its tests start (OMP_NUM_THREADS), so that the workers do not fight over them; alone, at most 2.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_THREADS = max(1, min(2, (os.cpu_count() or 1) // _WORKERS))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(_THREADS))
torch.set_num_threads(_THREADS)


_REAL_IMPORTORSKIP = pytest.StashKey()


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: end-to-end runs of a minute or more")
    config.addinivalue_line("markers", "vllm: needs vLLM (make setup-vllm); skipped without it")
    config.addinivalue_line("markers", "distributed: starts several processes with torchrun")
    required = os.environ.get("GRPO_REQUIRE_EXTRAS", "").replace(",", " ").split()
    if required:
        config.stash[_REAL_IMPORTORSKIP] = pytest.importorskip
        pytest.importorskip = strict_importorskip(pytest.importorskip, set(required))


# The files that take longest, longest first, as the durations of a whole run (`--durations=0`, 2026-12-05, an
# AVX-512 Xeon: 250, 200, 95, 90, 90, 85, 75, 75, 60 s ...) measured them: `make test` (pytest-xdist, `--dist loadfile
# --no-loadscope-reorder`) hands them out first and in this order, so that no worker is left alone with one of them
# at the end. test_vllm_train waits for test_vllm_server's runs (finished_run), so it comes after a first round.
# Update it when a file's time moves.
LONGEST_FIRST = ["test_vllm_server.py", "test_faults.py", "test_resume.py", "test_async.py", "test_vllm_train.py",
                 "test_distributed.py", "test_learns.py", "test_smollm2.py", "test_judge_server.py", "test_tools_train.py",
                 "test_trainer.py", "test_vision_train.py",
                 "test_vllm.py", "test_tracking.py", "test_cli.py", "test_sandbox.py", "test_reference_sync.py",
                 "test_report.py"]


def pytest_collection_modifyitems(config, items):
    """The files of LONGEST_FIRST first, in its order, then the rest in theirs (within a file the order stays)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable


def pytest_unconfigure(config):
    if _REAL_IMPORTORSKIP in config.stash:
        pytest.importorskip = config.stash[_REAL_IMPORTORSKIP]


def strict_importorskip(importorskip, required: set[str]):
    """`pytest.importorskip`, except that a module of a package in `required` (top-level names, e.g. vllm, wandb,
    trackio) that cannot be imported fails the test, or the collection of its file, instead of skipping it.

    `make test` installs the vllm, wandb and trackio extras and sets GRPO_REQUIRE_EXTRAS to their names, so a
    broken install fails CI where it would otherwise skip their tests unnoticed; without the variable (a developer
    without the extras) they are skipped."""
    def strict(modname: str, *args, **kwargs):
        if modname.partition(".")[0] not in required:
            return importorskip(modname, *args, **kwargs)
        try:
            return importlib.import_module(modname)
        except ImportError as e:
            error = f"{type(e).__name__}: {e}"
        pytest.fail(f"GRPO_REQUIRE_EXTRAS names {modname.partition('.')[0]}, but import {modname} failed: {error}",
                    pytrace=False)
    return strict


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def random_model_dir(tmp_path_factory):
    """A small random Qwen2 model with the bundled character tokenizer, built locally (no downloads)."""
    import transformers

    from grpo.tiny import build_char_tokenizer, tiny_model_config

    transformers.utils.logging.disable_progress_bar()
    tok = build_char_tokenizer()
    cfg = tiny_model_config(tok, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg)
    path = tmp_path_factory.mktemp("random-tiny")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture
def grpo_cli(capsys, monkeypatch):
    """`grpo ARGS...` in this process: grpo.cli.main(argv), its exit status and what it printed, as
    subprocess.run returns them (without the start of a Python and torch process of its own). What main sets for
    the process (the warning format, the thread exception hook, transformers' verbosity) is put back after."""
    import subprocess
    import threading
    import warnings

    import transformers

    from grpo.cli import main

    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)
    monkeypatch.setattr(threading, "excepthook", threading.excepthook)
    verbosity = transformers.utils.logging.get_verbosity()

    def run(*args) -> subprocess.CompletedProcess:
        argv = [str(a) for a in args]
        capsys.readouterr()
        try:
            code = main(argv)
        except SystemExit as e:  # argparse's own errors
            code = e.code
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(["grpo", *argv], code, out, err)

    yield run
    transformers.utils.logging.set_verbosity(verbosity)


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory):
    """`finished_run(name, config, *overrides)`: the output directory of `grpo train config overrides...`, trained
    once for the whole suite and then only read, whichever test files ask for it. Under pytest-xdist the first
    worker to ask trains it in its process; another that asks meanwhile waits on a lock, then reads it."""
    import fcntl

    from grpo.config import load_config
    from grpo.trainer import train

    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "finished-runs"  # this session's
    root.mkdir(exist_ok=True)
    made: dict[str, tuple] = {}

    def run(name: str, config: str, *overrides: str):
        out = root / name
        with open(root / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            done = root / f"{name}.done"
            if not done.exists():
                train(load_config(config, [*overrides, f"train.output_dir={out}"]))
                done.write_text(repr(overrides))
        assert made.setdefault(name, (config, overrides)) == (config, overrides), f"two runs named {name}"
        assert done.read_text() == repr(overrides), f"two runs named {name}"
        return out

    return run
