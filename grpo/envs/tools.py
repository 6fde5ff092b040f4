"""Multi-turn episodes with tools (`rollout.environment=tools`): the model writes a turn; when the turn calls
tools (found by the `tools.parser`), the environment runs them, appends their results as the chat template
renders tool messages, and the model goes on; the episode ends when a turn calls nothing, or at a limit.

Tokens. The episode is one sequence after the prompt: the model's turns exactly as sampled, and between them
the tokens the environment inserted (the chat template's text for the tool results and the next assistant
header). The model's tokens have loss mask 1; the inserted ones 0, so their log-probs never enter the ratio,
the KL or the normaliser (`Rollout.loss_mask`). A turn continues from the episode's exact token ids: nothing
the model wrote is ever re-tokenized.

The inserted text is the difference the chat template makes: the history rendered with the tool messages and
the generation prompt, minus the history rendered alone (with the model's turn as an assistant message), plus
whatever the template writes after a turn's EOS (Qwen's newline). A template that does not render history the
same way twice (one that rewrites earlier turns) is refused with one line.

Limits, each recorded as the episode's stop reason (`grpo.rollout.base.STOP_REASONS`):
- `tools.max_turns` model turns; a last turn that still calls a tool ends the episode (`max_turns`);
- `rollout.max_new_tokens` tokens per turn; a turn without EOS by then ends it, truncated (`turn_length`);
- `tools.max_tokens` tokens in the whole episode after the prompt (`max_tokens`), and the model's context,
  prompt included (`context`): the episode is cut there, truncated, never run past it.

Randomness: the first turn samples the group's G episodes from the example's seed (as `single_turn` does);
turn t > 0 of episode j from a seed made of the example's seed, j and t. An episode therefore depends on its
example's seed alone, not on the batch it shares, the number of processes or a resume.

Rewards see the episode's text (what the model wrote and the tool results, decoded without special tokens)
and, through `Rollout.episodes`, its messages and the character offset at which each model turn ends
(`grpo.collect` passes them as the `messages` and `turn_ends` fields): a per-turn reward is a process reward
whose steps end at `turn_ends`.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from grpo.errors import DataError
from grpo.rollout import Generator, Rollout, Sampling
from grpo.rollout.base import Episode, prompt_seeds
from grpo.tasks.base import Example
from grpo.tools import TOOL_PARSERS, Tool, call_tools


def turn_seed(example_seed: int, episode: int, turn: int) -> int:
    """The sampling seed of turn `turn` > 0 of the `episode`-th episode of an example."""
    return hash((example_seed, episode, turn)) & (2**63 - 1)


@dataclass
class _Episode:
    prompt: list[int]
    limit: int                          # most tokens after the prompt
    limit_reason: str                   # "max_tokens" or "context": which of the two limits `limit` is
    messages: list[dict]
    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logp: list[float] = field(default_factory=list)
    turn_token_ends: list[int] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    stop: str = ""
    truncated: bool = False

    @property
    def room(self) -> int:
        return self.limit - len(self.tokens)


class ToolEnvironment:
    def __init__(self, tokenizer, tools: dict[str, Tool], parser: str, *, eos_ids: Sequence[int], pad_id: int,
                 context: int, max_turns: int = 4, max_tokens: int = 0, system_prompt: str = "",
                 all_finished: Callable[[bool], bool] | None = None):
        """`tools`: name -> `grpo.tools.Tool`; `parser`: a name in `grpo.tools.TOOL_PARSERS`; `context`: the most
        positions the model takes (prompt and episode); `max_tokens`: the most episode tokens after the prompt
        (0: the context alone limits them). `all_finished(done)`: with several processes, True only when every
        process's episodes are done, so that all of them sample the same number of turns (the generator's
        decoding steps may be collective)."""
        self.tokenizer = tokenizer
        self.tools = tools
        self.parse = TOOL_PARSERS[parser]
        self.eos_ids = set(eos_ids)
        self.pad_id = pad_id
        self.context = context
        self.max_turns = max_turns
        self.max_tokens = max_tokens
        self.all_finished = all_finished or (lambda done: done)
        self.system = [{"role": "system", "content": system_prompt}] if system_prompt else []
        self.schemas = [t.schema for t in tools.values()]
        check_tool_template(tokenizer, self.schemas)

    # ---- rendering

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        # an assistant message is rendered from its content, the model's own text, calls included: its parsed
        # `tool_calls` (kept for the rewards) would make a template such as Qwen's write the calls twice
        messages = [{k: v for k, v in m.items() if k != "tool_calls"} for m in messages]
        return self.tokenizer.apply_chat_template(self.system + messages, tools=self.schemas or None,
                                                  tokenize=False, add_generation_prompt=generation_prompt)

    def _inserted(self, messages: list[dict], results: list[dict], content: str, eos: int | None) -> list[int]:
        """The tokens the environment appends after a model turn (whose text is `content`, ended by `eos`):
        the template's text after the turn, its tool messages and the next generation prompt."""
        before = self._render(messages, False)
        after = self._render(messages + results, True)
        if not after.startswith(before):
            raise DataError("the chat template renders the earlier turns of an episode differently once tool "
                            "results follow them; the tools environment needs a template that only appends")
        end = before.rfind(content) + len(content) if content else len(before)
        if content and before.rfind(content) < 0:
            raise DataError("the chat template does not render an assistant message's content as it is; the tools "
                            "environment needs one that does")
        tail = before[end:]
        eos_text = self.tokenizer.decode([eos]) if eos is not None else ""
        if eos_text and tail.startswith(eos_text):  # the model wrote that token itself
            tail = tail[len(eos_text):]
        return self.tokenizer(tail + after[len(before):], add_special_tokens=False)["input_ids"]

    # ---- the Environment protocol

    def rollout(self, generator: Generator, examples: Sequence[Example], sampling: Sampling,
                seeds: Sequence[int] | None = None) -> Rollout:
        seeds = prompt_seeds(seeds, len(examples))
        g = sampling.n
        prompts, episodes = [], []
        for e in examples:
            user = [{"role": "user", "content": e.prompt}]
            ids = self.tokenizer(self._render(user, True), add_special_tokens=False)["input_ids"]
            room = self.context - len(ids)
            if room < 1:
                raise DataError(f"a prompt of {len(ids)} tokens leaves no room in the model's context of "
                                f"{self.context} positions: {e.prompt[:80]!r}")
            limit, reason = (room, "context") if not self.max_tokens or room < self.max_tokens else (
                self.max_tokens, "max_tokens")
            prompts.append(ids)
            episodes += [_Episode(ids, limit, reason, [dict(m) for m in user]) for _ in range(g)]

        # turn 0: the G episodes of each example from its prompt and seed; each turn at most
        # rollout.max_new_tokens tokens and what is left of its episode's room
        cap = sampling.max_new_tokens
        r = generator.generate(prompts, sampling, seeds, [min(cap, episodes[i * g].room) for i in range(len(prompts))])
        with_logp = r.sampler_logp is not None  # the engine reports log-probs of its own (vLLM)
        self._take(episodes, r)
        one = replace(sampling, n=1)
        for t in range(1, self.max_turns):
            active = [i for i, ep in enumerate(episodes) if not ep.stop]
            if self.all_finished(not active):
                break
            if not active:  # other processes still sample (their decoding steps may be collective): join them
                generator.generate([episodes[0].prompt], one, [0], [1])
                continue
            turn_seeds = [turn_seed(seeds[i // g], i % g, t) for i in active]
            r = generator.generate([episodes[i].prompt + episodes[i].tokens for i in active], one, turn_seeds,
                                   [min(cap, episodes[i].room) for i in active])
            self._take([episodes[i] for i in active], r)
        return self._assemble(episodes, with_logp)

    def _take(self, episodes: list[_Episode], r: Rollout) -> None:
        """Append each row of `r` (one turn) to its episode, then run the turn's tool calls."""
        lengths = r.lengths.tolist()
        for j, ep in enumerate(episodes):
            tokens = r.completion_ids[j, :lengths[j]].tolist()
            logp = r.sampler_logp[j, :lengths[j]].tolist() if r.sampler_logp is not None else [0.0] * len(tokens)
            eos = tokens[-1] if not bool(r.truncated[j]) else None
            if eos is None and len(tokens) == ep.room:  # the episode's limit, not the turn's
                ep.stop, ep.truncated = ep.limit_reason, True
            elif eos is None:  # rollout.max_new_tokens
                ep.stop, ep.truncated = "turn_length", True
            ep.tokens += tokens
            ep.mask += [1] * len(tokens)
            ep.logp += logp
            ep.turns += 1
            ep.turn_token_ends.append(len(ep.tokens) - (eos is not None))
            content = self.tokenizer.decode(tokens[:-1] if eos is not None else tokens, skip_special_tokens=True)
            calls = self.parse(content) if self.tools else []
            message = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                         for c in calls if not c.error]
            history = list(ep.messages)
            ep.messages.append(message)
            if ep.stop:
                continue
            if not calls:
                ep.stop = "done"
                continue
            if ep.turns >= self.max_turns:
                ep.stop = "max_turns"
                continue
            results = call_tools(self.tools, calls)
            ep.tool_calls += len(results)
            ep.tool_errors += sum(res.error for res in results)
            tool_messages = [{"role": "tool", "name": res.name, "content": res.content} for res in results]
            ep.messages += tool_messages
            inserted = self._inserted(history + [message], tool_messages, content, eos)
            if len(inserted) >= ep.room:  # no room left for another model turn
                inserted = inserted[:ep.room]
                ep.stop, ep.truncated = ep.limit_reason, True
            ep.tokens += inserted
            ep.mask += [0] * len(inserted)
            ep.logp += [0.0] * len(inserted)

    def _assemble(self, episodes: list[_Episode], with_logp: bool) -> Rollout:
        n = len(episodes)
        lp = max(len(ep.prompt) for ep in episodes)
        width = max(1, max(len(ep.tokens) for ep in episodes))
        prompt_ids = torch.full((n, lp), self.pad_id, dtype=torch.long)
        prompt_mask = torch.zeros((n, lp), dtype=torch.long)
        ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        loss = torch.zeros((n, width), dtype=torch.long)
        logp = torch.zeros((n, width), dtype=torch.float32)
        texts, records = [], []
        for i, ep in enumerate(episodes):
            k = len(ep.tokens)
            prompt_ids[i, lp - len(ep.prompt):] = torch.tensor(ep.prompt)
            prompt_mask[i, lp - len(ep.prompt):] = 1
            ids[i, :k] = torch.tensor(ep.tokens, dtype=torch.long)
            mask[i, :k] = 1
            loss[i, :k] = torch.tensor(ep.mask, dtype=torch.long)
            logp[i, :k] = torch.tensor(ep.logp, dtype=torch.float32)
            text_len = k - (not ep.truncated)  # the tokens before the final EOS
            texts.append(self.tokenizer.decode(ep.tokens[:text_len], skip_special_tokens=True))
            ends = [len(self.tokenizer.decode(ep.tokens[:e], skip_special_tokens=True)) for e in ep.turn_token_ends]
            records.append(Episode(ep.messages, ends, ep.turns, ep.tool_calls, ep.tool_errors, ep.stop))
        return Rollout(prompt_ids, prompt_mask, ids, mask, torch.tensor([ep.truncated for ep in episodes]), texts,
                       loss, logp if with_logp else None, records)


def check_tool_template(tokenizer, schemas: list[dict]) -> None:
    """A clear error when the tokenizer's chat template cannot hold a tool conversation: no template, or one
    that does not render tool results (or, given tools, does not show them to the model)."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError("rollout.environment=tools needs a chat template, and the tokenizer has none; use a chat "
                        "model's tokenizer (one whose template takes tools=, such as Qwen2.5's)")
    probe = "grpo-probe-result-31337"
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "call"},
                {"role": "tool", "name": "probe", "content": probe}]
    try:
        text = tokenizer.apply_chat_template(messages, tools=schemas or None, tokenize=False,
                                             add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - jinja's TemplateError, a template that raises on the tool role, ...
        raise DataError(f"the tokenizer's chat template cannot render a tool message: {' '.join(str(e).split())[:200]}"
                        "; use a model whose chat template supports tools") from None
    if probe not in text:
        raise DataError("the tokenizer's chat template does not render tool messages (role 'tool'); use a model "
                        "whose chat template supports tools, such as Qwen2.5's")
    names = [s["function"]["name"] for s in schemas]
    if names and not all(name in text for name in names):
        raise DataError("the tokenizer's chat template does not show the tools to the model (it ignores tools=); "
                        "use a model whose chat template supports tools")
