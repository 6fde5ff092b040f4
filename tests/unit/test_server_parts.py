"""The vLLM server backend's parts that need no server: the command line a server starts with, the answers of
/inference/v1/generate read as vLLM's outputs, the server's own error read from its log, the config's checks,
and a URL that answers but is not a vLLM server (a plain HTTP server, on 127.0.0.1)."""
import http.server
import threading

import pytest

from grpo.config import VLLMConfig, load_config
from grpo.errors import ConfigError
from grpo.rollout.vllm_common import EngineError
from grpo.rollout.vllm_server import (EXTENSION, SERVED_NAME, Client, _request_output, log_error, serve_command)
from grpo.validate import validate


def test_the_command_a_server_starts_with():
    cmd, env = serve_command("/m", vllm_cfg=VLLMConfig(kv_cache_gib=0.5), host="127.0.0.1", port=8123,
                             max_model_len=512)
    line = " ".join(cmd)
    assert cmd[1:5] == ["-m", "grpo.rollout.vllm_cli", "serve", "/m"]
    for flag in ("--host 127.0.0.1", "--port 8123", f"--served-model-name {SERVED_NAME}", "--max-model-len 512",
                 "--logprobs-mode processed_logprobs", "--enable-scale-out", f"--worker-extension-cls {EXTENSION}",
                 "--no-enable-prefix-caching", "--no-enable-chunked-prefill", "--max-num-batched-tokens 16384",
                 f"--kv-cache-memory-bytes {2**29}", "--enforce-eager"):
        assert flag in line, flag
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # on CPU the model runs in the engine's process
    assert "OMP_NUM_THREADS" not in env  # vllm.threads=0: PyTorch's default
    _, one = serve_command("/m", vllm_cfg=VLLMConfig(threads=1), host="127.0.0.1", port=1, max_model_len=512)
    assert one["OMP_NUM_THREADS"] == "1" and one["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert cmd[cmd.index("--weight-transfer-config") + 1] == '{"backend": "grpo_gloo"}'  # grpo's engine on a CPU
    gpu, gpu_env = serve_command("/m", vllm_cfg=VLLMConfig(), host="::1", port=1, max_model_len=512, device="cuda")
    assert "--gpu-memory-utilization" in gpu and "--no-enable-chunked-prefill" not in gpu
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in gpu_env
    assert gpu[gpu.index("--weight-transfer-config") + 1] == '{"backend": "nccl"}'  # vLLM's own on a GPU
    for asked, device, engine in [("gloo", "cuda", "grpo_gloo"), ("nccl", "cpu", "nccl"), ("file", "cpu", "grpo_gloo"),
                                  ("file", "cuda", "nccl")]:
        c, _ = serve_command("/m", vllm_cfg=VLLMConfig(), host="::1", port=1, max_model_len=512, device=device,
                             weight_transfer=asked)
        assert c[c.index("--weight-transfer-config") + 1] == f'{{"backend": "{engine}"}}', (asked, device)


def test_a_generate_answer_reads_as_vllms_outputs():
    out = {"choices": [
        {"index": 1, "token_ids": [5, 6], "finish_reason": "length", "weight_versions": [{"weight_version": "3"}],
         "logprobs": {"content": [{"token_id": 5, "logprob": -0.5}, {"token_id": 6, "logprob": -1.25}]}},
        {"index": 0, "token_ids": [7], "finish_reason": "stop", "logprobs": None}]}
    r = _request_output(out, "http://s", 3)
    a, b = r.outputs
    assert (a.index, a.token_ids, a.finish_reason) == (1, [5, 6], "length")
    assert [d[t].logprob for d, t in zip(a.logprobs, a.token_ids)] == [-0.5, -1.25]
    assert b.logprobs is None
    with pytest.raises(EngineError, match="sampled with weight version 3, not the trainer's 4"):
        _request_output(out, "http://s", 4)
    with pytest.raises(EngineError, match="without completions"):
        _request_output({"choices": []}, "http://s", 0)


def test_the_servers_error_is_read_from_its_log(tmp_path):
    log = tmp_path / "s.log"
    log.write_text("INFO starting\nTraceback (most recent call last):\n  File x\n"
                   "ValueError: No supported config format found in /nowhere\nINFO bye\n")
    assert log_error(log) == "ValueError: No supported config format found in /nowhere"
    log.write_text("INFO only\n")
    assert log_error(log) == "INFO only"
    assert log_error(tmp_path / "missing.log") == "(no log)"


@pytest.mark.parametrize("url", ["127.0.0.1:8000", "ftp://127.0.0.1:8000", "http://127.0.0.1:8000/v1"])
def test_a_url_that_is_not_a_servers_base_is_refused(url):
    with pytest.raises(ConfigError, match="vllm_server.urls: .* is not a server's base URL"):
        load_config(None, ["rollout.backend=vllm_server", f"vllm_server.urls=[{url}]"])


def test_launching_on_an_open_address_needs_an_api_key(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with pytest.raises(ConfigError, match="not a loopback address: set VLLM_API_KEY"):
        load_config(None, ["rollout.backend=vllm_server", "vllm_server.host=0.0.0.0"])
    monkeypatch.setenv("VLLM_API_KEY", "k")
    validate(load_config(None, ["rollout.backend=vllm_server", "vllm_server.host=0.0.0.0"]))


@pytest.fixture
def plain_http_server():
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = b"<html>hello</html>" if self.path == "/" else b"not found"
            self.send_response(200 if self.path == "/" else 404)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_a_url_that_is_not_a_vllm_server_is_one_line(plain_http_server):
    from grpo.rollout.vllm_server import VLLMServerGenerator
    with pytest.raises(EngineError, match=f"{plain_http_server} is not a vLLM server"):
        c = Client(plain_http_server, timeout=5)
        VLLMServerGenerator._check_servers(type("G", (), {"clients": [c]})(), None)


def test_a_url_where_nothing_listens_is_one_line():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(EngineError, match=f"the vLLM server at http://127.0.0.1:{port} did not answer when asked "
                                          "to say its version"):
        Client(f"http://127.0.0.1:{port}", timeout=5).call("GET", "/version", what="say its version")
