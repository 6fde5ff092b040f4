"""rollout.backend=vllm_server with real `vllm serve` processes on 127.0.0.1: one server, started with
`grpo serve`, serves the module's tests of the bundled tiny model; the tool job and the failure cases launch
their own (vllm_server.launch). No part of vLLM is mocked."""
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from grpo.config import load_config
from grpo.models import add_lora, load_model
from grpo.rollout import Sampling
from grpo.trainer import train

pytest.importorskip("vllm", reason="the vLLM server backend's tests need vLLM: pip install -e '.[vllm]'")

from grpo.rollout.vllm_common import EngineError  # noqa: E402
from grpo.rollout.vllm_server import VLLMServerGenerator, free_port  # noqa: E402
# float32 on both sides, as the colocated engine: the server's kernels differ from transformers' in the order of
# summation only (test_vllm's tolerance and its comparison)
from test_vllm import LOGP_TOLERANCE, _max_diff  # noqa: E402
from test_vllm_train import _rows as _all_rows  # noqa: E402 - every figure, perf/* too
from test_vllm_train import _same  # noqa: E402

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[2]
QUIET = ["log.progress=false", "log.trackers=[]", "log.chart=false"]
SERVE = ["vllm.kv_cache_gib=0.25"]


def _rows(path: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(x).items() if not k.startswith("perf/")}
            for x in (path / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`grpo serve model.path=tiny` in a process of its own: its URL, its log."""
    port = free_port("127.0.0.1")
    log = tmp_path_factory.mktemp("server") / "serve.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "grpo", "serve", "model.path=tiny", *SERVE,
                                 f"vllm_server.port={port}"], stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)
    yield url, log
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(60)


def test_grpo_serve_says_where_it_serves(server):
    url, log = server
    first = log.read_text().splitlines()[0]
    assert first.startswith(f"grpo serve: vLLM serves tiny at {url}") and f"vllm_server.urls=[{url}]" in first


@pytest.fixture(scope="module")
def tiny():
    return load_model(load_config(None, ["model.path=tiny"]).model)


def _generator(url, policy, tokenizer, *extra):
    cfg = load_config(None, ["model.path=tiny", "rollout.backend=vllm_server", f"vllm_server.urls=[{url}]", *extra])
    return VLLMServerGenerator(policy, tokenizer, cfg=cfg)


# both routes of the weights on a CPU: vLLM's weight-transfer protocol with grpo's gloo engine (auto's choice
# here), and safetensors reloaded in place
@pytest.mark.parametrize("transfer", ["auto", "file"])
def test_after_a_sync_the_servers_log_probs_are_the_trainers(server, tiny, transfer):
    url, _ = server
    policy, tokenizer = tiny
    model = policy
    gen = _generator(url, model, tokenizer, f"vllm_server.weight_transfer={transfer}")
    try:
        assert gen.transfer == {"auto": "gloo", "file": "file"}[transfer]
        s = Sampling(n=4, max_new_tokens=12, temperature=1.0)
        first = gen.generate(["12+7=", "3*4-5="], s, seeds=[1, 2])
        assert gen.version == 0 and first.version.tolist() == [0] * 8
        assert _max_diff(model, first, 1.0) < LOGP_TOLERANCE
        # new weights: the server samples from them, and its log-probs are the new policy's
        changed = {n: p.detach().clone() for n, p in model.named_parameters()}
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        gen.sync_weights(model)
        second = gen.generate(["12+7=", "3*4-5="], s, seeds=[1, 2])
        assert gen.version == 1 and second.version.tolist() == [1] * 8
        assert _max_diff(model, second, 1.0) < LOGP_TOLERANCE
        assert not torch.equal(first.completion_ids, second.completion_ids)
        with torch.no_grad():  # back to the first weights: the first samples again, token for token
            for n, p in model.named_parameters():
                p.copy_(changed[n])
        gen.sync_weights(model, 7)
        again = gen.generate(["12+7=", "3*4-5="], s, seeds=[1, 2])
        assert torch.equal(again.completion_ids, first.completion_ids) and again.version.tolist() == [7] * 8
    finally:
        gen.close()


def test_lora_reaches_the_server_merged(server):
    url, _ = server
    cfg = load_config(None, ["model.path=tiny", "lora.rank=4"])
    policy, tokenizer = load_model(cfg.model)
    policy = add_lora(policy, cfg.lora)
    with torch.no_grad():
        for n, p in policy.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    gen = _generator(url, policy, tokenizer)
    try:
        r = gen.generate(["12+7=", "3*4-5="], Sampling(n=4, max_new_tokens=12, temperature=1.0), seeds=[1, 2])
        assert _max_diff(policy, r, 1.0) < LOGP_TOLERANCE
    finally:
        gen.close()


@pytest.mark.slow
def test_the_default_job_on_a_server_it_launches_learns(finished_run):
    # trained once for the suite: test_vllm_train's two processes with a colocated engine each equal this run
    # figure for figure (the server samples the colocated engine's rows)
    from test_vllm_train import ON_A_SERVER
    out = finished_run("vllm-server-default-20", *ON_A_SERVER)
    rows = _rows(out)
    assert sum(r["sampling/reward_mean"] for r in rows[-10:]) > sum(r["sampling/reward_mean"] for r in rows[1:11])
    assert rows[-1]["eval/accuracy"] >= rows[0]["eval/accuracy"] + 0.10, (rows[0], rows[-1])
    assert all(0 <= r["mismatch/abs_diff_max"] < 1e-3 and r["mismatch/capped"] == 0 for r in rows[1:])
    assert all(r["perf/sync_seconds"] > 0 for r in _all_rows(out)[1:])  # the weights went to the server each step
    assert (out / "vllm-server-0.log").exists() and (out / "model" / "model.safetensors").exists()


@pytest.mark.slow
def test_a_run_resumed_on_a_server_equals_the_uninterrupted_one(server, finished_run, tmp_path):
    from test_vllm_train import FOUR_STEPS
    url, _ = server
    on_server = [*FOUR_STEPS[1:], "rollout.backend=vllm_server", f"vllm_server.urls=[{url}]"]
    parts = tmp_path / "parts"
    train(load_config(FOUR_STEPS[0], [*on_server, f"train.output_dir={parts}", "train.steps=2"]))
    train(load_config(FOUR_STEPS[0], [*on_server, f"train.output_dir={parts}", "train.resume=auto"]))
    whole = finished_run("vllm-four-steps", *FOUR_STEPS)  # on the colocated engine, which samples the same rows
    _same(_rows(whole), _rows(parts))
    assert (whole / "samples.jsonl").read_text() == (parts / "samples.jsonl").read_text()


@pytest.mark.slow
@pytest.mark.distributed
def test_two_trainer_processes_share_one_server(server, finished_run, tmp_path):
    from test_vllm_train import FOUR_STEPS
    url, _ = server
    out = tmp_path / "two"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
                        "grpo", "train", *FOUR_STEPS, "rollout.backend=vllm_server", f"vllm_server.urls=[{url}]",
                        f"train.output_dir={out}"], capture_output=True, text=True, timeout=900, cwd=ROOT,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    # each process sends its own prompts (to the same server) and the rows are the one-process run's: the figures
    # equal it to the rounding of sums over two processes; the mismatch figures, themselves rounding (about 1e-5),
    # stay below 1e-3. The weights: all but one in 10,000 coordinates within 1e-6, none beyond 1e-4 (half of one
    # step's lr). After 4 AdamW steps a coordinate whose gradient is mostly cancellation (rounding noise) moves by
    # a share of lr that the order of the sums decides (on an AVX-512 Xeon: 1 of 65,536 in one matrix, 1.3e-5),
    # while a wrong normaliser, shard or batch moves every coordinate
    from safetensors.torch import load_file
    one = finished_run("vllm-four-steps", *FOUR_STEPS)
    wa, wb = (load_file(p / "model" / "model.safetensors") for p in (one, out))
    assert wa.keys() == wb.keys()
    apart = sum(int(((wa[k] - wb[k]).abs() > 1e-6).sum()) for k in wa)
    assert apart <= sum(w.numel() for w in wa.values()) // 10_000, apart
    for k in wa:
        assert torch.allclose(wa[k], wb[k], atol=1e-4, rtol=0), (k, (wa[k] - wb[k]).abs().max())
    ra, rb = _rows(one), _rows(out)
    assert [r["step"] for r in ra] == [r["step"] for r in rb]
    for x, y in zip(ra, rb):
        assert x.keys() == y.keys()
        for k in x:
            if k.startswith("mismatch/abs_diff"):
                assert x[k] < 1e-3 and y[k] < 1e-3, (k, x[k], y[k])
            elif k.startswith("mismatch/k3"):
                assert abs(x[k]) < 1e-6 and abs(y[k]) < 1e-6, (k, x[k], y[k])
            else:
                assert x[k] == pytest.approx(y[k], rel=1e-4, abs=1e-6, nan_ok=True), (x["step"], k, x[k], y[k])


@pytest.mark.slow
def test_a_tool_job_on_a_server_it_launches(finished_run, tmp_path):
    from test_vllm_tools import TRAIN_2
    out = tmp_path / "tools"
    train(load_config(TRAIN_2[0], [*TRAIN_2[1:], "rollout.backend=vllm_server", "vllm_server.launch=1",
                                   f"train.output_dir={out}"]))
    log = (out / "vllm-server-0.log").read_text()
    assert "--worker-extension-cls grpo.rollout.vllm_worker.WorkerExtension" in log.splitlines()[0]
    assert "Application startup complete" in log
    rows = _rows(out)
    assert all(r["episode/turns"] >= 1 and r["mismatch/abs_diff_max"] < 1e-3 for r in rows[1:])
    # the multi-turn episodes continue from exact token ids on the server as on the colocated engine
    colocated = finished_run("vllm-tools-2", *TRAIN_2)
    _same(rows, _rows(colocated))
    assert (out / "samples.jsonl").read_text() == (colocated / "samples.jsonl").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("lag", [[], ["rollout.max_staleness=1"]], ids=["synchronous", "asynchronous"])
def test_a_server_killed_mid_run_stops_it_with_one_line_and_a_new_one_resumes_it(server, finished_run, tmp_path, lag):
    """Asynchronous, the server dies with a batch in flight on the sampling lane: the trainer raises its error
    where it waits for the batch, nothing half-trained, and the resume samples the batch again."""
    import re

    from test_vllm_train import FOUR_STEPS
    out = tmp_path / "run"
    args = [*FOUR_STEPS, *lag, "rollout.backend=vllm_server", "vllm_server.launch=1", "train.save_every=1"]
    proc = subprocess.Popen([sys.executable, "-m", "grpo", "train", *args, f"train.output_dir={out}"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    done = out / "checkpoints" / "step-00000002" / "COMPLETE"  # step 2's checkpoint, written after its row
    deadline = time.monotonic() + 600
    while not done.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    pid = int(re.search(r"^# pid (\d+)", (out / "vllm-server-0.log").read_text(), re.M).group(1))
    os.killpg(pid, signal.SIGKILL)  # the server and its engine, as the machine's OOM killer might
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 2, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"grpo: error: the vLLM server at http://127.0.0.1:") and "died" in last, last
    assert "Traceback" not in err and len(last) < 600
    # the last checkpoint is intact: a resume on another server (the module's) ends where the uninterrupted run ends
    result = train(load_config(args[0], [*args[1:], f"vllm_server.urls=[{server[0]}]", f"train.output_dir={out}",
                                         "train.resume=auto"]))
    assert result.resumed_from is not None
    # asynchronous: the colocated engine's run, as a server samples the same rows
    _same(_rows(finished_run("vllm-four-steps" + "-k1" * bool(lag), *FOUR_STEPS, *lag)), _rows(out))


def test_a_server_of_another_model_is_refused(server, random_model_dir):
    url, _ = server
    cfg = load_config(None, [f"model.path={random_model_dir}", "rollout.backend=vllm_server",
                             f"vllm_server.urls=[{url}]"])
    policy, tokenizer = load_model(cfg.model)
    with pytest.raises(EngineError, match=f"the vLLM server at {url} serves another model than model.path: "
                                          "hidden_size 128 there, 32 here"):
        VLLMServerGenerator(policy, tokenizer, cfg=cfg)
    # refused before any weight was sent: the server still serves the module's tests
    gen = _generator(url, *load_model(load_config(None, ["model.path=tiny"]).model))
    gen.close()


def test_a_weight_transfer_the_server_was_not_started_with_is_refused(server, tiny):
    url, _ = server  # a CPU server: grpo serve started it with grpo's gloo engine
    with pytest.raises(EngineError, match=f"vllm_server.weight_transfer=nccl needs servers started with the nccl "
                                          f"weight-transfer engine, and the one at {url} has grpo_gloo; start it "
                                          "with grpo serve vllm_server.weight_transfer=nccl"):
        _generator(url, *tiny, "vllm_server.weight_transfer=nccl")


def test_a_server_that_cannot_start_is_one_line_with_its_own_error(tmp_path, server):
    # a port another server holds: vLLM's own error, from the server's log
    url, _ = server
    port = url.rsplit(":", 1)[1]
    run_dir = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "grpo", "train", "rollout.backend=vllm_server", "vllm.kv_cache_gib=0.1",
                        f"vllm_server.port={port}", "train.steps=1", "eval.size=4", f"train.output_dir={run_dir}",
                        "log.progress=false"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"grpo: error: the vLLM server at {url} did not start"), last
    assert "Address already in use" in last or "address already in use" in last, last
    assert "Traceback" not in r.stderr and (run_dir / "vllm-server-0.log").exists()


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp2_weights_reach_the_server(server, tmp_path):
    """Two processes with FSDP2: after each step the gathered weights reach the server they share, so its
    log-probs keep agreeing with the sharded trainer's."""
    url, _ = server
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
                        "grpo", "train", "grpo/configs/tiny.yaml", "train.steps=3", "eval.size=50", "eval.every=0",
                        "eval.pass_k=0", "compute.threads=1", "compute.sharding=fsdp", "train.prompts_per_step=8",
                        *QUIET, "rollout.backend=vllm_server", f"vllm_server.urls=[{url}]",
                        f"train.output_dir={tmp_path}"], capture_output=True, text=True, timeout=900, cwd=ROOT,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    rows = _rows(tmp_path)
    assert len(rows) == 4 and all(r["mismatch/abs_diff_max"] < 1e-3 for r in rows[1:])
    assert rows[2]["kl"] > 0  # the policy moved, and the server followed it: the mismatch stayed at rounding
