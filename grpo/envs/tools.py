"""Multi-turn episodes with tools (`rollout.environment=tools`): the model writes a turn; when the turn calls
tools (found by the `tools.parser`), the environment runs them, appends their results as the chat template
renders tool messages, and the model goes on; the episode ends when a turn calls nothing, or at a limit.

Tokens. The episode is one sequence after the prompt: the model's turns exactly as sampled, and between them
the tokens the environment inserted (the chat template's text for the tool results and the next assistant
header). The model's tokens have loss mask 1; the inserted ones 0, so their log-probs never enter the ratio,
the KL or the normaliser (`Rollout.loss_mask`). A turn continues from the episode's exact token ids: nothing
the model wrote is ever re-tokenized.

The inserted text is what the chat template writes after an assistant turn: the history, a placeholder for the
model's turn, the tool messages and the generation prompt are rendered, and the text after the placeholder is
inserted (without the EOS the model wrote itself; Qwen's newline after it is the template's). So a template
that rewrites assistant turns (trims them, strips or adds think blocks) changes nothing here.
`check_tool_template` refuses, at load, one that cannot hold a tool conversation.

Limits, each recorded as the episode's stop reason (`grpo.envs.base.STOP_REASONS`):
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

from grpo.envs.base import Episode
from grpo.errors import DataError
from grpo.rollout import Generator, Rollout, Sampling
from grpo.rollout.base import prompt_seeds
from grpo.tasks.base import Example
from grpo.envs.tool_calls import TOOL_PARSERS, Tool, ToolCall, call_tools

PLACEHOLDER = "grpo-assistant-turn-7c1f"  # stands for a model turn when the template renders what follows it


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
    """Episodes in which the model calls `tools` in its chat template's format (see the module docstring)."""

    def __init__(self, tokenizer, tools: dict[str, Tool], parser: str, *, pad_id: int,
                 context: int, max_turns: int = 4, max_tokens: int = 0, system_prompt: str = "",
                 all_finished: Callable[[bool], bool] | None = None, chat_template_kwargs: dict | None = None):
        """`tools`: name -> `grpo.envs.tool_calls.Tool`; `parser`: a name in `grpo.envs.tool_calls.TOOL_PARSERS`;
        `context`: the most positions the model takes (prompt and episode); `max_tokens`: the most episode tokens
        after the prompt (0: the context alone limits them). `all_finished(done)`: with several processes, True only when every
        process's episodes are done, so that all of them sample the same number of turns (the generator's
        decoding steps may be collective). `chat_template_kwargs`: more keyword arguments of apply_chat_template
        (model.chat_template_kwargs)."""
        self.tokenizer = tokenizer
        self.template_kwargs = dict(chat_template_kwargs or {})
        self.tools = tools
        self.parse = TOOL_PARSERS[parser]
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
                                                  tokenize=False, add_generation_prompt=generation_prompt,
                                                  **self.template_kwargs)

    def _inserted(self, history: list[dict], results: list[dict], eos: int) -> list[int]:
        """The tokens the environment appends after a model turn that ended with `eos` and called tools: the
        template's text after an assistant turn (with `history` before it), the tool messages `results` and the
        next generation prompt. The turn is rendered as a placeholder, so that a template which rewrites an
        assistant message (strips whitespace or reasoning, adds an empty think block) changes nothing here."""
        text = self._render(history + [{"role": "assistant", "content": PLACEHOLDER}] + results, True)
        at = text.rfind(PLACEHOLDER)
        if at < 0:
            raise DataError("the chat template does not render an assistant message's content; the tools "
                            "environment needs one that does")
        tail = text[at + len(PLACEHOLDER):]
        eos_text = self.tokenizer.decode([eos])
        if eos_text and tail.startswith(eos_text):  # the model wrote that token itself
            tail = tail[len(eos_text):]
        return self.tokenizer(tail, add_special_tokens=False)["input_ids"]

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
                                f"{self.context} positions: {e.prompt[:80]!r}; shorten the prompts or use a "
                                "model with a longer context")
            limit, reason = (room, "context") if not self.max_tokens or room < self.max_tokens else (
                self.max_tokens, "max_tokens")
            prompts.append(ids)
            episodes += [_Episode(ids, limit, reason, [dict(m) for m in user]) for _ in range(g)]

        # turn 0: the G episodes of each example from its prompt and seed; each turn at most
        # rollout.max_new_tokens tokens and what is left of its episode's room
        cap = sampling.max_new_tokens
        r = generator.generate(prompts, sampling, seeds, [min(cap, episodes[i * g].room) for i in range(len(prompts))])
        device = r.completion_ids.device
        with_logp = r.sampler_logp is not None  # the engine reports log-probs of its own (vLLM)
        version = r.version  # an episode's: its first turn's (the oldest weights that sampled it)
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
        return self._assemble(episodes, with_logp, None if version is None else version.cpu()).to(device)

    def _take(self, episodes: list[_Episode], r: Rollout) -> None:
        """Append each row of `r` (one turn) to its episode; run the calls of the turns that made some."""
        lengths = r.lengths.tolist()
        for j, ep in enumerate(episodes):
            tokens = r.completion_ids[j, :lengths[j]].tolist()
            logp = r.sampler_logp[j, :lengths[j]].tolist() if r.sampler_logp is not None else [0.0] * len(tokens)
            eos = tokens[-1] if not bool(r.truncated[j]) else None
            content = self._append_turn(ep, tokens, logp, eos)
            if not ep.stop:
                self._respond(ep, content, eos)

    def _append_turn(self, ep: _Episode, tokens: list[int], logp: list[float], eos: int | None) -> str:
        """Add a model turn to the episode (its tokens trained); stop the episode at a length limit. Returns the
        turn's text (without its EOS)."""
        if eos is None:  # cut off: by the episode's limit when the turn had all the room left, else by its own
            ep.stop, ep.truncated = (ep.limit_reason if len(tokens) == ep.room else "turn_length"), True
        ep.tokens += tokens
        ep.mask += [1] * len(tokens)
        ep.logp += logp
        ep.turns += 1
        ep.turn_token_ends.append(len(ep.tokens) - (eos is not None))
        content = self.tokenizer.decode(tokens[:-1] if eos is not None else tokens, skip_special_tokens=True)
        ep.messages.append({"role": "assistant", "content": content})
        return content

    def _respond(self, ep: _Episode, content: str, eos: int) -> None:
        """The environment's answer to a finished model turn: the episode ends when the turn calls no tool (or
        at the turn limit); else the calls run and their results are appended (not trained)."""
        calls = self._calls(content)
        if calls:
            ep.messages[-1]["tool_calls"] = [
                {"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls if not c.error]
        if not calls:
            ep.stop = "done"
            return
        if ep.turns >= self.max_turns:
            ep.stop = "max_turns"
            return
        results = call_tools(self.tools, calls)
        ep.tool_calls += len(results)
        ep.tool_errors += sum(res.error for res in results)
        tool_messages = [{"role": "tool", "name": res.name, "content": res.content} for res in results]
        inserted = self._inserted(ep.messages[:-1], tool_messages, eos)
        ep.messages += tool_messages
        if len(inserted) >= ep.room:  # no room left for another model turn
            inserted = inserted[:ep.room]
            ep.stop, ep.truncated = ep.limit_reason, True
        ep.tokens += inserted
        ep.mask += [0] * len(inserted)
        ep.logp += [0.0] * len(inserted)

    def _calls(self, content: str) -> list[ToolCall]:
        """The calls of a turn; a parser that fails on what the model wrote gives one malformed call."""
        if not self.tools:
            return []
        try:
            return self.parse(content)
        except Exception as e:  # noqa: BLE001 - a registered parser on odd model output: the model reads why
            return [ToolCall("", error=f"error: the tool call could not be read ({type(e).__name__}: {e})"[:300])]

    def _assemble(self, episodes: list[_Episode], with_logp: bool, version) -> Rollout:
        texts, records = [], []
        for ep in episodes:
            text_len = len(ep.tokens) - (not ep.truncated)  # the tokens before the final EOS
            texts.append(self.tokenizer.decode(ep.tokens[:text_len], skip_special_tokens=True))
            ends = [len(self.tokenizer.decode(ep.tokens[:e], skip_special_tokens=True)) for e in ep.turn_token_ends]
            records.append(Episode(ep.messages, ends, ep.turns, ep.tool_calls, ep.tool_errors, ep.stop))
        return Rollout.from_tokens([ep.prompt for ep in episodes], [ep.tokens for ep in episodes],
                                   pad_id=self.pad_id, truncated=[ep.truncated for ep in episodes], texts=texts,
                                   loss_masks=[ep.mask for ep in episodes],
                                   logprobs=[ep.logp for ep in episodes] if with_logp else None, episodes=records,
                                   version=None if version is None else version.tolist())


def check_tool_template(tokenizer, schemas: list[dict]) -> None:
    """A clear error when the tokenizer's chat template cannot hold a tool conversation: no template, or one
    that does not render tool results (or, given tools, does not show them to the model)."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError("rollout.environment=tools needs a chat template, and the tokenizer has none; use a chat "
                        "model's tokenizer (one whose template takes tools=, such as Qwen2.5's)")
    probe = "grpo-probe-result-31337"
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": PLACEHOLDER},
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
    if not 0 <= text.find(PLACEHOLDER) < text.find(probe):
        raise DataError("the tokenizer's chat template does not render an assistant turn's content before the tool "
                        "results that follow it; the tools environment needs one that does")
    names = [s["function"]["name"] for s in schemas]
    if names and not all(name in text for name in names):
        raise DataError("the tokenizer's chat template does not show the tools to the model (it ignores tools=); "
                        "use a model whose chat template supports tools")
