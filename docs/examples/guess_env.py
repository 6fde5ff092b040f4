"""A multi-turn environment of your own, for grpo: the model guesses the answer, the environment says "higher"
or "lower", and the model tries again, up to `max_turns` guesses (docs/tools.md, "Your own environment").

    grpo train tiny rollout.environment=guess_env:GuessNumber rewards=[final_number] eval.reward=final_number

with this file's directory on PYTHONPATH (or in the working directory). Each example's `answer` is the number
to find. An episode is the prompt, then the model's guesses and the environment's hints in turn:

    12+7=  | 21<eos> | " lower\n" | 19<eos>
    prompt | model   | inserted  | model

The model's tokens have loss mask 1 and the inserted hints 0: the model learns to guess, never to write the
hints. `Rollout.from_tokens` pads the episodes into a `Rollout`; `Episode` records the messages (a user turn per
hint) and where each guess ends, which the rewards get as `messages` and `turn_ends` (the built-in
`final_number` scores the last guess).
"""
from __future__ import annotations

import re
from dataclasses import replace

from grpo.envs.base import Episode
from grpo.envs.single_turn import prompt_formatter
from grpo.envs.tools import turn_seed
from grpo.rollout import Rollout

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class GuessNumber:
    """grpo calls the class with the arguments its signature names, among model, tokenizer, cfg, all_finished
    and tools (here all but tools); `max_turns` keeps its default."""

    def __init__(self, model, tokenizer, cfg, all_finished, max_turns: int = 3):
        self.tokenizer = tokenizer
        self.render = prompt_formatter(tokenizer, cfg.model)   # the prompt, through the chat template if it is on
        self.add_special_tokens = not cfg.model.chat_template   # as the built-in generators encode prompts
        self.context = model.config.max_position_embeddings     # the most positions the model takes
        self.all_finished = all_finished
        self.max_turns = max_turns
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def hint(self, guess: str, answer: str) -> str | None:
        """What the environment says to a guess: None when it is right (the episode ends)."""
        numbers = NUMBER.findall(guess)
        if not numbers:
            return " a number, please\n"
        if float(numbers[-1]) == float(answer):
            return None
        return " higher\n" if float(numbers[-1]) < float(answer) else " lower\n"

    def rollout(self, generator, examples, sampling, seeds):
        g = sampling.n
        prompts = [self.tokenizer(self.render(e.prompt), add_special_tokens=self.add_special_tokens)["input_ids"]
                   for e in examples]
        episodes = [{"example": e, "prompt": p, "tokens": [], "mask": [], "ends": [], "stop": "",
                     "truncated": False, "messages": [{"role": "user", "content": e.prompt}]}
                    for e, p in zip(examples, prompts) for _ in range(g)]

        # turn 0: G guesses per example from its seed; later turns one per episode, each from a seed of its own
        # (the example's, the episode's index and the turn's), so an episode depends on its example's seed alone
        first = generator.generate(prompts, sampling, seeds,
                                   [self._room(episodes[i * g], sampling) for i in range(len(prompts))])
        self._take(episodes, first)
        one = replace(sampling, n=1)
        for t in range(1, self.max_turns):
            active = [i for i, ep in enumerate(episodes) if not ep["stop"]]
            if self.all_finished(not active):
                break
            if not active:  # other processes still sample (their decoding steps may be collective): join them
                generator.generate([episodes[0]["prompt"]], one, [0], [1])
                continue
            r = generator.generate([episodes[i]["prompt"] + episodes[i]["tokens"] for i in active], one,
                                   [turn_seed(seeds[i // g], i % g, t) for i in active],
                                   [self._room(episodes[i], sampling) for i in active])
            self._take([episodes[i] for i in active], r)

        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        records = [Episode(ep["messages"], [len(decode(ep["tokens"][:k])) for k in ep["ends"]], turns=len(ep["ends"]),
                           stop=ep["stop"]) for ep in episodes]
        return Rollout.from_tokens([ep["prompt"] for ep in episodes], [ep["tokens"] for ep in episodes],
                                   pad_id=self.pad_id, truncated=[ep["truncated"] for ep in episodes],
                                   tokenizer=self.tokenizer, loss_masks=[ep["mask"] for ep in episodes],
                                   episodes=records, device=first.completion_ids.device)

    def _room(self, ep, sampling) -> int:
        """The most tokens the next guess may take: rollout.max_new_tokens, and what is left of the model's
        context (a turn cut there is truncated)."""
        return max(1, min(sampling.max_new_tokens, self.context - len(ep["prompt"]) - len(ep["tokens"])))

    def _take(self, episodes, r) -> None:
        lengths = r.lengths.tolist()
        for j, ep in enumerate(episodes):
            tokens = r.completion_ids[j, :lengths[j]].tolist()
            truncated = bool(r.truncated[j])
            ep["tokens"] += tokens
            ep["mask"] += [1] * len(tokens)                    # the model's guess: trained
            ep["ends"].append(len(ep["tokens"]) - (not truncated))  # the guess's text ends before its EOS
            guess = self.tokenizer.decode(tokens if truncated else tokens[:-1], skip_special_tokens=True)
            ep["messages"].append({"role": "assistant", "content": guess})
            if truncated:  # no EOS: cut off by max_new_tokens or the context
                ep["stop"], ep["truncated"] = "turn_length", True
                continue
            hint = self.hint(guess, ep["example"].answer)
            if hint is None:
                ep["stop"] = "done"
                continue
            if len(ep["ends"]) >= self.max_turns:
                ep["stop"] = "max_turns"
                continue
            inserted = self.tokenizer(hint, add_special_tokens=False)["input_ids"]
            if len(ep["prompt"]) + len(ep["tokens"]) + len(inserted) >= self.context:  # no room for another guess
                ep["stop"] = "context"
                continue
            ep["tokens"] += inserted
            ep["mask"] += [0] * len(inserted)                  # the environment's hint: not trained
            ep["messages"].append({"role": "user", "content": hint.strip()})
