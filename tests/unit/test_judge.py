"""The LLM judge's parts that need no model: its parsers on answers in the OpenAI shapes, its template, its
validation, and how it meets an endpoint that misbehaves (down, slow, failing then answering, malformed JSON,
answers it cannot read, scores out of range), served here by a small local HTTP server on 127.0.0.1. A real judge
model (SmolLM2-135M-Instruct on a real vLLM server): tests/integration/test_judge_server.py."""
import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from grpo.config import JudgeConfig, load_config
from grpo.errors import ConfigError
from grpo.rewards import score
from grpo.rewards.calls import run
from grpo.rewards.judge import Judge, JudgeError, template_fields


def chat(content=None, top=None):
    choice = {"message": {"role": "assistant", "content": content}}
    if top is not None:
        choice["logprobs"] = {"content": [{"token": "x", "logprob": 0.0,
                                           "top_logprobs": [{"token": t, "logprob": lp} for t, lp in top]}]}
    return {"choices": [choice]}


def completion(text=None, top=None):
    choice = {"text": text}
    if top is not None:
        choice["logprobs"] = {"top_logprobs": [dict(top)]}
    return {"choices": [choice]}


def judge(**kw):
    return Judge(JudgeConfig(**{"model": "m", "url": "http://127.0.0.1:9/v1", **kw}))


def test_token_prob_sums_the_tokens_probability_in_either_api():
    import math
    top = [("Yes", math.log(0.5)), (" yes", math.log(0.2)), ("No", math.log(0.3))]
    assert judge().parse(chat(top=top)) == pytest.approx(0.7)
    assert judge(chat=False).parse(completion(top=top)) == pytest.approx(0.7)
    assert judge(token="No").parse(chat(top=top)) == pytest.approx(0.3)
    assert judge().parse(chat(top=[("Maybe", 0.0)])) == 0.0  # not among the top ones: probability ~0
    with pytest.raises(ValueError, match="no log-probs"):
        judge().parse(chat(content="Yes"))


@pytest.mark.parametrize("text, value", [("Yes.", 1.0), (" no, it is wrong", 0.0), ("YES", 1.0)])
def test_yes_no(text, value):
    assert judge(parser="yes_no").parse(chat(text)) == value
    assert judge(parser="yes_no", chat=False).parse(completion(text)) == value


@pytest.mark.parametrize("text, value", [("7", 7.0), ("Score: 8.5/10", 8.5), (" 0", 0.0), ("10", 10.0)])
def test_number(text, value):
    assert judge(parser="number").parse(chat(text)) == value


@pytest.mark.parametrize("parser, text, says", [("yes_no", "Maybe", "neither yes nor no"),
                                                ("number", "great", "no number"),
                                                ("number", "11", "outside [judge.min_score, judge.max_score]"),
                                                ("number", "-1", "outside")])
def test_answers_it_cannot_read_are_errors(parser, text, says):
    import re
    with pytest.raises(ValueError, match=re.escape(says)):
        judge(parser=parser).parse(chat(text))


def test_the_template_is_filled_with_the_examples_fields():
    j = judge(template="Q: {prompt} A: {completion} Ref: {answer}")
    assert template_fields(j.cfg.template) == {"prompt", "completion", "answer"}
    assert j.render("1+1", " 2", {"answer": "2"}) == "Q: 1+1 A:  2 Ref: 2"
    j.check_fields({"answer", "task"})
    with pytest.raises(ConfigError, match=r"judge.template names \{solution\}, which the data's examples lack; it can "
                                          r"use \{prompt\}, \{completion\} and \{answer\}, \{task\}"):
        judge(template="{solution}").check_fields({"answer", "task"})


@pytest.mark.parametrize("overrides, says", [
    (["judge.launch=true"], "judge.model is empty"),
    (["judge.model=m"], "the judge needs an endpoint: set judge.url"),
    (["judge.model=m", "judge.url=http://x/v1", "judge.launch=true"], "not both"),
    (["judge.model=m", "judge.url=localhost:8000"], "is not an http:// or https:// URL"),
    (["judge.model=m", "judge.url=http://"], "is not an http:// or https:// URL with a host"),
    (["judge.model=m", "judge.url=http://x/v1", "judge.parser=number", "judge.min_score=5", "judge.max_score=5"],
     "judge.min_score=5 must be less than judge.max_score=5"),
    (["judge.model=m", "judge.url=http://x/v1", "judge.api_key_env=sk-123"], "is not an environment variable's name"),
    (["judge.model=m", "judge.url=http://x/v1", "judge.parser=vibes"], "judge.parser"),
    (["judge.model=m", "judge.url=http://x/v1", "eval.reward=judge"], "eval.reward: the judge's score is no verdict"),
])
def test_bad_judge_settings_are_one_line(overrides, says):
    with pytest.raises(ConfigError, match=says) as e:
        load_config(None, ["rewards=[judge]", *overrides])
    assert "\n" not in str(e.value)


# ---- a local endpoint that misbehaves as told

class Endpoint:
    """An OpenAI-style /v1/chat/completions on 127.0.0.1: `plan` is a list of what to do for each request in
    turn ('ok', 'slow', '500', 'garbage', 'maybe', 'eleven'); the last one repeats."""

    def __init__(self, plan):
        self.plan, self.seen = list(plan), []
        self.open = self.most_open = 0  # requests being answered now, and the most at once
        lock = threading.Lock()
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                endpoint.seen.append((self.path, body, self.headers.get("Authorization")))
                what = endpoint.plan.pop(0) if len(endpoint.plan) > 1 else endpoint.plan[0]
                if what == "slow":
                    with lock:
                        endpoint.open += 1
                        endpoint.most_open = max(endpoint.most_open, endpoint.open)
                    threading.Event().wait(0.5)
                    with lock:
                        endpoint.open -= 1
                    what = "ok"
                if what == "500":
                    self.send_response(500)
                    self.end_headers()
                    return
                text = {"ok": "Yes, 7", "maybe": "Maybe", "eleven": "11"}.get(what)  # "ok": any parser reads it
                raw = (b"{not json" if what == "garbage" else b'{"choices": ["x"]}' if what == "odd"
                       else json.dumps(chat(text, top=[("Yes", 0.0)])).encode())
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()  # its listening socket too


@pytest.fixture
def endpoint():
    made = []

    def make(plan):
        made.append(Endpoint(plan))
        return made[-1]

    yield make
    for e in made:
        e.close()


def ask(j, completions, **fields):
    return run(j(prompts=["q"] * len(completions), completions=completions, **fields))


def test_scores_come_back_and_identical_requests_are_sent_once(endpoint, monkeypatch):
    e = endpoint(["ok"])
    monkeypatch.setenv("MY_JUDGE_KEY", "secret-123")
    j = judge(url=e.url, api_key_env="MY_JUDGE_KEY")
    assert ask(j, ["a", "a", "b", "a"]) == [1.0] * 4
    assert j.sent == 2 and len(e.seen) == 2  # "a" once, "b" once
    assert ask(j, ["b", "c"]) == [1.0] * 2 and j.sent == 3  # the same step's next round: only "c" is new
    path, body, auth = e.seen[0]
    assert path == "/v1/chat/completions" and body["model"] == "m" and body["max_tokens"] == 1
    assert body["logprobs"] is True and "Question: q" in body["messages"][0]["content"]
    assert auth == "Bearer secret-123"
    assert j.take_figures() == {"judge/failures": 0.0, "judge/requests": 6.0, "judge/seconds": pytest.approx(
        j.seconds, abs=10)} and j.requests == 0
    assert ask(j, ["a"]) == [1.0] and j.sent == 4  # the next step asks afresh


def test_retries_with_backoff_then_an_answer(endpoint):
    e = endpoint(["500", "500", "ok"])
    j = judge(url=e.url, retries=2, backoff_s=0.01)
    assert ask(j, ["a"]) == [1.0] and j.sent == 3


@pytest.mark.parametrize("plan, extra, says", [
    (["500"], {"retries": 1, "backoff_s": 0.01}, "HTTP 500 (after 1 retries)"),
    (["slow"], {"timeout_s": 0.1, "retries": 0}, "no answer within judge.timeout_s=0.1 s"),
    (["garbage"], {}, "an answer it could not read"),
    (["odd"], {}, "an answer it could not read (AttributeError"),  # JSON of another shape
    (["maybe"], {"parser": "yes_no"}, "neither yes nor no"),
    (["eleven"], {"parser": "number"}, "outside [judge.min_score, judge.max_score] = [0, 10]"),
])
def test_a_failure_is_none_counted_and_too_many_stop_the_run(endpoint, plan, extra, says):
    e = endpoint(plan)
    j = judge(url=e.url, max_failure_frac=0.5, **extra)
    with pytest.raises(JudgeError, match="the judge failed on 2 of 2 completions, more than judge.max_failure_frac=0.5"):
        ask(j, ["a", "b"])
    assert says in j.last_failure
    # under the share: None for the failed one (left out of its group's statistics), counted; one request at a
    # time, so the first completion's meets the misbehaviour (and its retries do)
    e.plan[:] = ["500", "500", "ok"] if plan[0] == "500" else [plan[0], "ok"]
    j2 = judge(url=e.url, max_failure_frac=0.5, concurrency=1, **extra)
    got = ask(j2, ["c", "d", "e"])
    assert got[0] is None and None not in got[1:] and j2.failures == 1 and j2.requests == 3


def test_an_endpoint_that_is_down_is_a_failure_that_names_it():
    j = judge(url="http://127.0.0.1:9/v1", retries=1, backoff_s=0.01)  # port 9 (discard): nothing listens
    with pytest.raises(JudgeError, match="ConnectError"):
        ask(j, ["a"])


def test_through_score_the_judges_own_line_and_its_figures(endpoint):
    e = endpoint(["ok"])
    j = judge(url=e.url)
    s = score([j], None, ["q", "q"], ["a", "b"], {"answer": ["1", "1"]})
    assert s.per_fn["judge"].tolist() == [1.0, 1.0]
    e.plan[:] = ["garbage"]
    with pytest.raises(JudgeError) as raised:  # its own line, not wrapped in a per-completion search
        score([j], None, ["q", "q"], ["c", "d"], {"answer": ["1", "1"]})
    assert str(raised.value).startswith("the judge failed on 2 of 2 completions")


@pytest.mark.parametrize("concurrency", [1, 4])
def test_the_judge_keeps_up_to_its_limit_of_requests_in_flight(endpoint, concurrency):
    e = endpoint(["slow"])  # each answer after 0.5 s: requests sent together overlap
    j = judge(url=e.url, concurrency=concurrency, timeout_s=30)
    assert ask(j, [str(i) for i in range(8)]) == [1.0] * 8
    assert e.most_open == concurrency and asyncio.iscoroutinefunction(type(j).__call__)


def test_judge_launch_under_torchrun_is_refused():
    from grpo.validate import validate
    with pytest.raises(ConfigError, match="judge.launch starts a server in each process"):
        validate(load_config(None, ["rewards=[judge]", "judge.launch=true", "judge.model=m"]), world_size=2)


def test_a_closed_judge_launches_again_on_its_next_request():
    class Server:
        stopped = 0

        def stop(self, grace):
            Server.stopped += 1

    j = judge(launch=True, url="")
    j.server, j.url = Server(), "http://127.0.0.1:1/v1"
    j.close()
    j.close()  # idempotent
    assert Server.stopped == 1 and j.server is None and j.url == ""
