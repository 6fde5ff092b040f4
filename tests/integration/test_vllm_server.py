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
from grpo.policy.forward import completion_logprobs
from grpo.rollout import Sampling
from grpo.trainer import train

pytest.importorskip("vllm", reason="the vLLM server backend's tests need vLLM: pip install -e '.[vllm]'")

from grpo.rollout.vllm_common import EngineError  # noqa: E402
from grpo.rollout.vllm_server import VLLMServerGenerator, free_port  # noqa: E402

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[2]
# float32 on both sides, as the colocated engine (test_vllm.py): the server's kernels differ from transformers'
# in the order of summation only
LOGP_TOLERANCE = 1e-4
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


def _generator(url, policy, tokenizer):
    cfg = load_config(None, ["model.path=tiny", "rollout.backend=vllm_server", f"vllm_server.urls=[{url}]"])
    return VLLMServerGenerator(policy, tokenizer, cfg=cfg)


def _max_diff(model, rollout, temperature):
    with torch.no_grad():
        ours = completion_logprobs(model, rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids,
                                   rollout.completion_mask, temperature=temperature, chunk_size=64)
    mask = rollout.completion_mask.bool()
    return (ours - rollout.sampler_logp)[mask].abs().max().item()


def test_after_a_sync_the_servers_log_probs_are_the_trainers(server, tiny):
    url, _ = server
    policy, tokenizer = tiny
    model = policy
    gen = _generator(url, model, tokenizer)
    try:
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
