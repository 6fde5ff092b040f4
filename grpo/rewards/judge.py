"""An LLM judge as a reward function: `judge` in the rewards list, set up by the config's `judge` section
(docs/rewards.md#llm-judges).

For each completion, `judge.template` is filled with the example's fields, the prompt and the completion, and
sent to an OpenAI-compatible endpoint (`judge.url`, or a local vLLM server grpo starts for `judge.model` with
`judge.launch`): as the user's message of a chat completion (`judge.chat`), or as a raw completion prompt. The
answer becomes a score by `judge.parser`:
- `token_prob`: the probability the judge gives `judge.token` (Yes) as its first token, from the top log-probs
  of one generated token (verl's GenRM style); 0 when it is not among them;
- `yes_no`: 1.0 when the answer's first word is yes, 0.0 when it is no;
- `number`: the answer's first number, which must lie in [judge.min_score, judge.max_score].

Requests are asynchronous (the judge is an `async def` reward, so it runs beside the other rewards), at most
`judge.concurrency` at a time, each with a timeout and `judge.retries` retries with exponential back-off on a
connection error, a timeout or an HTTP 5xx/429 answer. Identical requests of a step are sent once. A completion
the judge fails on (no answer after the retries, malformed JSON, an answer the parser cannot read or out of its
range) gets None, which leaves it out of its group's statistics; the step logs how many (`judge/failures`, of
`judge/requests`). A batch in which more than `judge.max_failure_frac` of the completions fail stops the run with
one line. The API key is read from the environment variable `judge.api_key_env` names, never from the config,
and is never logged.
"""
from __future__ import annotations

import asyncio
import atexit
import math
import os
import re
import string
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from grpo.errors import ConfigError, GRPOError

NAME = "judge"
PARSERS = ("token_prob", "yes_no", "number")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_WORD = re.compile(r"[A-Za-z]+")


class JudgeError(GRPOError):
    """The judge failed on too many completions of a batch, or could not be started: one line."""


def template_fields(template: str) -> set[str]:
    """The field names `template` refers to ({prompt}, {completion}, {answer}, ...)."""
    try:
        return {name.split(".")[0].split("[")[0] for _, name, _, _ in string.Formatter().parse(template) if name}
    except ValueError as e:
        raise ConfigError(f"judge.template is not a valid template: {e}") from None


class Failure(Exception):
    """One completion's request failed (after its retries): the reason, for the logs."""


class Judge:
    """The `judge` reward: `await judge(prompts=..., completions=..., **fields)` -> one float or None each."""

    __name__ = NAME

    def __init__(self, cfg, *, run_dir: Path | None = None, vllm_cfg=None, seed: int = 0):
        """`cfg`: the config's `judge` section; `run_dir`: where a launched server's log goes (else a temporary
        directory); `vllm_cfg`: the `vllm` section, which sizes a launched server."""
        if cfg.parser not in PARSERS:
            raise ConfigError(f"judge.parser={cfg.parser!r}; choose one of {', '.join(PARSERS)}")
        self.cfg, self.run_dir, self.vllm_cfg, self.seed = cfg, run_dir, vllm_cfg, seed
        self.fields = template_fields(cfg.template)
        self.url = cfg.url.rstrip("/")
        self.server = None
        self._launch_lock = threading.Lock()
        self._clients: dict = {}  # one HTTP client per event loop
        self.failures = self.requests = 0          # since the step's figures were last taken
        self.sent = 0                               # HTTP requests sent, retries included (for the tests)
        self._cache: dict[str, float] = {}          # this step's answers by request (dynamic sampling's rounds)
        self.seconds = 0.0
        self.last_failure = ""

    def __repr__(self) -> str:
        return f"Judge({self.cfg.model or self.url!r})"

    # ---- fields and figures

    def check_fields(self, available: set[str]) -> None:
        """Refuse a template that names a field the examples lack (at load, before any request)."""
        missing = sorted(self.fields - available - {"prompt", "completion"})
        if missing:
            raise ConfigError(f"judge.template names {', '.join('{' + m + '}' for m in missing)}, which the data's "
                              f"examples lack; it can use {{prompt}}, {{completion}} and "
                              f"{', '.join('{' + f + '}' for f in sorted(available)) or 'no other field'}")

    def take_figures(self) -> dict[str, float]:
        """`judge/failures`, `judge/requests` and `judge/seconds` since the last call (the step's)."""
        out = {"judge/failures": float(self.failures), "judge/requests": float(self.requests),
               "judge/seconds": self.seconds}
        self.failures = self.requests = 0
        self.seconds = 0.0
        self._cache.clear()  # a step's cache: the next step asks afresh
        return out

    # ---- the reward

    async def __call__(self, prompts: Sequence[str], completions: Sequence[str], **fields) -> list[float | None]:
        n = len(completions)
        texts = [self.render(prompts[i], completions[i], {k: v[i] for k, v in fields.items()
                                                           if isinstance(v, (list, tuple)) and len(v) == n})
                 for i in range(n)]
        await asyncio.to_thread(self.ensure_server)
        start = time.perf_counter()
        # identical requests are sent once a step (a group's equal completions; a prompt drawn again by dynamic
        # sampling's next round): answers kept until the step's figures are taken
        unique = [t for t in dict.fromkeys(texts) if t not in self._cache]
        semaphore = asyncio.Semaphore(self.cfg.concurrency)
        results = await asyncio.gather(*(self._guarded(semaphore, t) for t in unique))
        self._cache.update((t, v) for t, v in zip(unique, results) if not isinstance(v, Failure))
        by_text = {**self._cache, **dict(zip(unique, results))}
        scores, failed = [], 0
        for t in texts:
            value = by_text[t]
            if isinstance(value, Failure):
                failed += 1
                self.last_failure = str(value)
                scores.append(None)
            else:
                scores.append(value)
        self.failures += failed
        self.requests += n
        self.seconds += time.perf_counter() - start
        if n and failed / n > self.cfg.max_failure_frac:
            raise JudgeError(f"the judge failed on {failed} of {n} completions, more than judge.max_failure_frac="
                             f"{self.cfg.max_failure_frac:g}; the last failure: {self.last_failure}")
        return scores

    def render(self, prompt: str, completion: str, fields: dict) -> str:
        values = {**fields, "prompt": prompt, "completion": completion}
        try:
            return self.cfg.template.format_map(values)
        except KeyError as e:
            raise ConfigError(f"judge.template names {{{e.args[0]}}}, which this example lacks") from None

    async def _guarded(self, semaphore: asyncio.Semaphore, text: str):
        async with semaphore:
            try:
                return await self._ask(text)
            except Failure as e:
                return e

    async def _ask(self, text: str) -> float:
        """One completion's score, retried on transient failures; raises Failure."""
        import httpx

        cfg = self.cfg
        body = self._body(text)
        path = "/chat/completions" if cfg.chat else "/completions"
        headers = {"Content-Type": "application/json"}
        if cfg.api_key_env and os.environ.get(cfg.api_key_env):
            headers["Authorization"] = f"Bearer {os.environ[cfg.api_key_env]}"
        client = self._client()
        reason = ""
        for attempt in range(cfg.retries + 1):
            if attempt:
                await asyncio.sleep(cfg.backoff_s * 2 ** (attempt - 1))
            self.sent += 1
            try:
                r = await client.post(self.url + path, json=body, headers=headers, timeout=cfg.timeout_s)
            except httpx.TimeoutException:
                reason = f"no answer within judge.timeout_s={cfg.timeout_s:g} s"
                continue
            except httpx.HTTPError as e:
                reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'connection failed'}"
                continue
            if r.status_code == 429 or r.status_code >= 500:
                reason = f"HTTP {r.status_code}"
                continue
            if r.status_code != 200:
                raise Failure(f"HTTP {r.status_code} from {self.url + path}: {r.text[:200]}")
            try:
                return self.parse(r.json())
            except Exception as e:  # noqa: BLE001 - any answer of the wrong shape is this completion's failure
                raise Failure(f"an answer it could not read ({type(e).__name__}: {str(e)[:200]})") from None
        raise Failure(f"{self.url + path}: {reason} (after {cfg.retries} retries)")

    def _body(self, text: str) -> dict:
        cfg = self.cfg
        body: dict = {"model": cfg.model, "temperature": 0.0,
                      "max_tokens": 1 if cfg.parser == "token_prob" else cfg.max_tokens}
        if cfg.chat:
            body["messages"] = [{"role": "user", "content": text}]
            if cfg.parser == "token_prob":
                body.update(logprobs=True, top_logprobs=20)
        else:
            body["prompt"] = text
            if cfg.parser == "token_prob":
                body["logprobs"] = 20
        return body

    def parse(self, answer: dict) -> float:
        """The score in one OpenAI-style answer (chat or completion); ValueError when there is none."""
        choice = answer["choices"][0]
        cfg = self.cfg
        if cfg.parser == "token_prob":
            if cfg.chat:
                content = (choice.get("logprobs") or {}).get("content") or []
                if not content:
                    raise ValueError("no log-probs in the answer")
                top = {e["token"]: e["logprob"] for e in content[0].get("top_logprobs") or []}
            else:
                tops = (choice.get("logprobs") or {}).get("top_logprobs") or []
                if not tops:
                    raise ValueError("no log-probs in the answer")
                top = dict(tops[0])
            want = cfg.token.strip().casefold()
            return min(1.0, sum(math.exp(lp) for tok, lp in top.items() if tok.strip().casefold() == want))
        text = (choice.get("message") or {}).get("content") if cfg.chat else choice.get("text")
        if not isinstance(text, str):
            raise ValueError("no text in the answer")
        if cfg.parser == "yes_no":
            word = _WORD.search(text)
            verdict = word.group(0).casefold() if word else ""
            if verdict not in ("yes", "no"):
                raise ValueError(f"neither yes nor no: {text[:80]!r}")
            return 1.0 if verdict == "yes" else 0.0
        number = _NUMBER.search(text)
        if number is None:
            raise ValueError(f"no number: {text[:80]!r}")
        value = float(number.group(0))
        if not cfg.min_score <= value <= cfg.max_score:
            raise ValueError(f"{value:g} is outside [judge.min_score, judge.max_score] = [{cfg.min_score:g}, "
                             f"{cfg.max_score:g}]")
        return value

    def _client(self):
        import httpx

        loop = asyncio.get_running_loop()
        client = self._clients.get(id(loop))
        if client is None:
            limits = httpx.Limits(max_connections=self.cfg.concurrency, max_keepalive_connections=self.cfg.concurrency)
            client = self._clients[id(loop)] = httpx.AsyncClient(limits=limits)
        return client

    # ---- a local server (judge.launch)

    def ensure_server(self) -> None:
        """With judge.launch: start the local vLLM server once (the first batch waits for it)."""
        if not self.cfg.launch or self.server is not None:
            return
        with self._launch_lock:
            if self.server is None:
                self.server = launch_judge(self.cfg, run_dir=self.run_dir, vllm_cfg=self.vllm_cfg, seed=self.seed)
                self.url = self.server.url + "/v1"
                atexit.register(self.server.stop, 5.0)

    def close(self) -> None:
        """Stop a launched server (idempotent); a later call launches a new one."""
        if self.server is not None:
            self.server.stop(grace=5.0)
            self.server, self.url = None, self.cfg.url.rstrip("/")


def launch_judge(cfg, *, run_dir: Path | None, vllm_cfg, seed: int = 0):
    """A local `vllm serve` of `judge.model` on 127.0.0.1, healthy, as a `Launched` (its log:
    <run_dir>/judge-server.log)."""
    import importlib.util
    import sys
    import tempfile

    from grpo.models import resolve_model_path
    from grpo.rollout.vllm_server import Launched, free_port, wait_healthy

    if importlib.util.find_spec("vllm") is None:
        from grpo.rollout.vllm_common import INSTALL
        raise ConfigError(f"judge.launch needs vLLM installed here, which it is not; install it with {INSTALL}")
    source = resolve_model_path(cfg.model)
    local = Path(source).expanduser()
    model = str(local.resolve()) if local.exists() else source
    host, port = "127.0.0.1", free_port("127.0.0.1")
    import torch
    gpu = torch.cuda.is_available()
    cmd = [sys.executable, "-m", "grpo.rollout.vllm_cli", "serve", model, "--host", host, "--port", str(port),
           "--served-model-name", cfg.model, "--dtype", "auto" if gpu else "float32", "--seed", str(seed),
           "--max-model-len", str(cfg.max_model_len), "--no-enable-prefix-caching", "--disable-log-stats",
           "--disable-uvicorn-access-log", "--max-logprobs", "20"]
    if vllm_cfg is None or vllm_cfg.enforce_eager:
        cmd.append("--enforce-eager")
    env = {"VLLM_LOGGING_LEVEL": "INFO", "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND",
                                                                                    "nobind"),
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if gpu:
        cmd += ["--gpu-memory-utilization", str(vllm_cfg.gpu_memory_utilization if vllm_cfg else 0.3)]
    else:
        cmd += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(cfg.max_model_len, 8192))]
        gib = vllm_cfg.kv_cache_gib if vllm_cfg else 1.0
        if gib:
            cmd += ["--kv-cache-memory-bytes", str(int(gib * 2**30))]
    log_dir = Path(run_dir) if run_dir else Path(tempfile.mkdtemp(prefix="grpo-judge-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / "judge-server.log"
    log.write_text(f"# {' '.join(cmd)}\n")
    server = Launched(cmd, env, f"http://{host}:{port}", log, None)
    try:
        wait_healthy(server, Path(model) if local.exists() else model, time.monotonic() + cfg.startup_timeout_s,
                     cfg.startup_timeout_s)
    except GRPOError as e:
        server.stop(grace=5.0)
        why = str(e).replace("vllm_server.startup_timeout_s", "judge.startup_timeout_s")
        raise JudgeError(f"the judge's server for judge.model={cfg.model!r} did not start: {why}") from None
    except BaseException:
        server.stop(grace=5.0)
        raise
    return server
