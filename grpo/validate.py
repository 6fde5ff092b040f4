"""Cross-field validation and the load warnings of a `grpo.config.Config`: each rule that involves several
options or a registry (rollout backends, environments, rewards, tools) has one clear error, and each known trap
(a combination that runs but is a mistake) one warning.

`validate_once` runs them once per configuration: `load_config` calls it on every config it loads (through
`grpo.config.LOAD_CHECKS`, which this module fills when imported), and `train` calls it again, which checks only a
config built or changed in Python since. The module also gives the registries' names to whoever shows the options'
help (`registry_names`). It stands above the registries it reads; grpo.config imports none of them.
"""
from __future__ import annotations

import importlib.util
import os
import re
import urllib.parse
import warnings

import torch

from grpo.config import LOAD_CHECKS, Config, explicit_keys
from grpo.envs import ENVIRONMENTS, resolve_environment
from grpo.errors import ConfigError
from grpo.imports import accepts
from grpo.models import check_model_path
from grpo.rewards import REWARDS, resolve_reward
from grpo.rollout import BACKENDS, resolve_backend
from grpo.envs.tool_calls import TOOL_PARSERS, TOOLS, load_tools


def validate_once(cfg: Config, world_size: int | None = None, *, num_rewards: int | None = None,
                  reward_names: tuple[str, ...] = (), given=None) -> None:
    """`validate`, and a warning for each of the `traps`, unless this config was validated already as it is now
    and for as many processes (`load_config` validates; `train` then only checks Python reward functions,
    `num_rewards`, against reward_weights). A config changed since, or built in Python, is validated.
    `reward_names`: the names of the Python reward functions given, which eval.reward and eval.rewards may name.
    `given`: see `validate`. A trap already warned of for the config this one was made from (`carry_validation`)
    is not warned of again."""
    world, content = _world(world_size), cfg.to_dict()
    done = getattr(cfg, "_validated", None)  # (world size, the config as it was validated, the traps warned of)
    if done is not None and done[:2] == (world, content):
        if num_rewards is not None:
            _check_reward_weights(cfg, num_rewards)
        return
    validate(cfg, world, num_rewards=num_rewards, reward_names=reward_names, given=given)
    warned = done[2] if done is not None else frozenset()
    if done is None or done[1] != content:  # the same config on another number of processes has the same traps
        messages = traps(cfg)
        for message in messages:
            if message not in warned:
                warnings.warn(message, stacklevel=2)
        warned = warned | frozenset(messages)
    cfg._validated = (world, content, warned)


def carry_validation(old: Config, new: Config) -> Config:
    """`new` (a copy of `old` with some fields replaced) remembers the traps `old` was warned of, so that
    validating it warns only of new ones."""
    if new is not old and getattr(old, "_validated", None) is not None:
        new._validated = old._validated
    return new


def registry_names() -> dict[str, list[str]]:
    """The names each registry holds now, by the registry an option names (`opt(..., names=...)`): what
    `{names}` stands for in its help (`grpo.config.describe_options`, docs/configuration.md)."""
    return {"rollout backends": list(BACKENDS), "environments": list(ENVIRONMENTS),
            "tool-call parsers": list(TOOL_PARSERS), "tools": list(TOOLS), "rewards": list(REWARDS)}


def traps(cfg: Config, explicit: set[str] | None = None) -> list[str]:
    """Combinations that run but are known mistakes, each as the warning `validate_once` gives once. `explicit`:
    the dotted keys the user set (default: `grpo.config.explicit_keys(cfg)`); a setting that cannot act is flagged
    only when set on purpose (not by a preset, such as dapo's clip-higher, which acts as soon as the data are
    off-policy)."""
    explicit = explicit_keys(cfg) if explicit is None else explicit
    a, r = cfg.algo, cfg.rollout
    out = []
    if a.ratio_level == "sequence" and a.aggregation == "token_mean":
        out.append("algo.ratio_level=sequence (GSPO) with algo.aggregation=token_mean weights each sequence by its "
                   "length, while GSPO's objective is a mean over sequences (its paper, and verl, which forces "
                   "seq_mean): use algo.aggregation=seq_mean")
    if a.num_iterations == 1 and r.backend == "hf":  # no off-policy data: the ratio is exactly 1 (docs/training.md)
        why = ("with algo.num_iterations=1 and the in-process sampler (rollout.backend=hf) every ratio is exactly 1, "
               "so it cannot act; it needs off-policy data (algo.num_iterations > 1, or a sampler of its own)")
        clips = sorted(k for k in ("algo.clip_low", "algo.clip_high") if k in explicit)
        if clips:
            out.append(f"{' and '.join(clips)} set: {why}")
        if a.dual_clip:
            out.append(f"algo.dual_clip={a.dual_clip:g}: {why}")
        if a.off_policy_mask_threshold is not None:
            out.append(f"algo.off_policy_mask_threshold={a.off_policy_mask_threshold:g}: with algo.num_iterations=1 "
                       "and the in-process sampler the old policy is the current one, so OPSM's statistic is 0 and it "
                       "never drops a sequence; it needs a sampler of its own or algo.num_iterations > 1")
        corrections = sorted(k for k in explicit if k.startswith("algo.sampler_correction"))
        if corrections:
            out.append(f"{', '.join(corrections)} set: the in-process sampler's log-probs are the trainer's own, "
                       "so the sampler-trainer correction is exactly 1 and cannot act")
    if r.top_p < 1 or r.top_k or r.min_p:  # Keep Sampling Mask (SPEC 14.12): exact where the replayed K is the sampler
        what = " and ".join(x for x in (f"rollout.top_p={r.top_p:g}" if r.top_p < 1 else "",
                                        f"rollout.top_k={r.top_k}" if r.top_k else "",
                                        f"rollout.min_p={r.min_p:g}" if r.min_p else "") if x)
        why = []
        if r.backend != "hf":
            why.append(f"rollout.backend={r.backend} samples from the engine's own logits, and its kept set can "
                       "differ from the one replayed on the trainer's at boundary tokens (mismatch/* measures it)")
        if a.num_iterations > 1 or cfg.train.steps_per_generation > 1:
            why.append("with algo.num_iterations > 1 or train.steps_per_generation > 1 the updates after a batch's "
                       "first replay the kept set at their own weights, not the sampler's")
        if why:
            out.append(f"{what}: the loss's ratio is to the policy renormalised over the kept set of each position, "
                       f"replayed on the trainer's logits (docs/objective.md, Top-p / top-k sampling and the ratio), "
                       f"which is approximate here: {'; '.join(why)}")
    if r.repetition_penalty != 1:  # history-dependent: no kept set to replay, the sampler's softmax is not the policy's
        engine = ("; the engine's log-probs are of the penalised distribution, so mismatch/* counts the penalty and "
                  "algo.sampler_correction reweights toward the unpenalised policy" if r.backend != "hf" else "")
        out.append(f"rollout.repetition_penalty={r.repetition_penalty:g}: completions are sampled from the policy "
                   "with the logits of the tokens already seen penalised, but the loss's ratio and KL are those of "
                   f"the unpenalised policy, so training is off-policy by the penalty{engine}")
    return out


def _check_judge(j, world: int) -> None:
    """The judge's endpoint and parser, before anything starts (the template's fields are checked against the
    data once it is loaded, grpo.trainer)."""
    if not j.model:
        raise ConfigError("judge.model is empty: name the model the judge asks for (with judge.launch, the model to "
                          "serve, e.g. smollm2-135m-instruct)")
    if bool(j.url) == bool(j.launch):
        raise ConfigError("the judge needs an endpoint: set judge.url (an OpenAI-compatible base URL) or "
                          "judge.launch=true (a local vLLM server of judge.model), not both" if j.url else
                          "the judge needs an endpoint: set judge.url (an OpenAI-compatible base URL, e.g. "
                          "http://127.0.0.1:8000/v1) or judge.launch=true (a local vLLM server of judge.model)")
    if j.url and (not j.url.startswith(("http://", "https://")) or not urllib.parse.urlsplit(j.url).hostname):
        raise ConfigError(f"judge.url={j.url!r} is not an http:// or https:// URL with a host")
    if j.launch and world > 1:
        raise ConfigError("judge.launch starts a server in each process, and under torchrun they would share one "
                          "device and log; start one judge server (python -m grpo.rollout.vllm_cli serve MODEL) and "
                          "give its URL as judge.url")
    if j.parser == "number" and not j.min_score < j.max_score:
        raise ConfigError(f"judge.min_score={j.min_score:g} must be less than judge.max_score={j.max_score:g}")
    if j.api_key_env and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", j.api_key_env):
        raise ConfigError(f"judge.api_key_env={j.api_key_env!r} is not an environment variable's name (the key "
                          "itself never goes into the config)")


def validate(cfg: Config, world_size: int | None = None, *, num_rewards: int | None = None,
             reward_names: tuple[str, ...] = (), given=None) -> None:
    """Every rule that involves more than one field, each with one clear error. `world_size`: the number of
    processes (None: torchrun's WORLD_SIZE, or 1). `num_rewards`: how many Python reward functions replace
    `cfg.rewards` (`train(cfg, rewards=[...])`); `reward_weights` must then have that many values. `reward_names`:
    their names, which eval.reward and eval.rewards may name. `given`: what `grpo.train` was given as objects
    (`grpo.trainer.Given`): its `tools` are checked in place of tools.names (which records their names), and a
    model object's name_or_path (model.path) needn't exist."""
    world = _world(world_size)
    for key, value in (("model.path", cfg.model.path), ("data.path", cfg.data.path),
                       ("data.eval_path", cfg.data.eval_path)):
        if not isinstance(value, str):
            what = "model" if key == "model.path" else "train_dataset" if key == "data.path" else "eval_dataset"
            raise ConfigError(f"{key} must be a path or a name (a str), got a {type(value).__name__} object; pass a "
                              f"loaded model or a data set object as grpo.train({what}=...)")
    if getattr(given, "model", None) is None:
        check_model_path(cfg.model.path)
    tools = getattr(given, "tools", None)
    tools = cfg.tools.names if tools is None else tools
    for field, names in (("rewards", cfg.rewards), ("eval.rewards", cfg.eval.rewards)):
        for name in names:
            if isinstance(name, str) and name.startswith("rm:"):
                check_model_path(name[3:], f"{field}: {name!r}")
    if not cfg.rewards:
        raise ConfigError("rewards is empty; name at least one reward function")
    for name in cfg.rewards:
        resolve_reward(name, field="rewards", judge=cfg.judge)
    if cfg.eval.reward not in reward_names:
        resolve_reward(cfg.eval.reward, field="eval.reward")
    for name in cfg.eval.rewards:
        if name not in reward_names:
            resolve_reward(name, field="eval.rewards", judge=cfg.judge)
    if "judge" in cfg.rewards or "judge" in cfg.eval.rewards:
        _check_judge(cfg.judge, world)
    if any(n.startswith("rm:") for n in [*cfg.rewards, *cfg.eval.rewards]) and cfg.reward_model.device:
        try:
            kind = torch.device(cfg.reward_model.device).type
        except RuntimeError:
            raise ConfigError(f"reward_model.device={cfg.reward_model.device!r} is not a device (cpu, cuda, cuda:1, "
                              "...); empty: the policy's") from None
        if kind == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"reward_model.device={cfg.reward_model.device!r} but PyTorch sees no CUDA device")
    _check_reward_weights(cfg, num_rewards)
    if cfg.rollout.min_new_tokens > cfg.rollout.max_new_tokens:
        raise ConfigError(f"rollout.min_new_tokens={cfg.rollout.min_new_tokens} is more than rollout.max_new_tokens="
                          f"{cfg.rollout.max_new_tokens}; it must be at most max_new_tokens")
    if any(not x for x in cfg.rollout.stop):
        raise ConfigError("rollout.stop holds an empty string, which every text holds at once: give non-empty stop "
                          "strings, or rollout.stop=[] for none")
    if "overlong" in cfg.rewards and cfg.overlong_buffer > cfg.rollout.max_new_tokens:
        raise ConfigError(f"overlong_buffer={cfg.overlong_buffer} is larger than rollout.max_new_tokens="
                          f"{cfg.rollout.max_new_tokens}; the penalty ramps over the last overlong_buffer tokens")
    resolve_backend(cfg.rollout.backend)  # a built-in name, or a 'module:Name' that imports and is a backend
    environment = resolve_environment(cfg.rollout.environment)  # the same for environments
    if not isinstance(environment, str) and accepts(environment, "tools"):
        load_tools(tools)  # a user's environment that takes tools gets tools.names's
    if cfg.rollout.environment == "tools":
        if cfg.rollout.stop:
            raise ConfigError("rollout.stop ends a model turn at a stop string, and rollout.environment=tools needs "
                              "each model turn to end at EOS, where the tool results follow: leave rollout.stop out")
        if not cfg.model.chat_template:
            raise ConfigError("rollout.environment=tools renders episodes with the chat template: set "
                              "model.chat_template=true")
        if not tools:
            raise ConfigError("tools.names is empty; name at least one tool for rollout.environment=tools")
        load_tools(tools)  # each name imports (a parser registered in a tool's module is then known)
        if cfg.tools.parser not in TOOL_PARSERS:
            raise ConfigError(f"tools.parser={cfg.tools.parser!r} is not a tool-call parser; choose one of "
                              f"{', '.join(map(repr, TOOL_PARSERS))}")
        if "python" in cfg.tools.names and cfg.sandbox.timeout_s >= cfg.tools.timeout_s:
            raise ConfigError(f"sandbox.timeout_s={cfg.sandbox.timeout_s:g} must be less than tools.timeout_s="
                              f"{cfg.tools.timeout_s:g}, so that the python tool's executions end before its calls "
                              "time out")
        if "overlong" in cfg.rewards:
            raise ConfigError("the overlong reward counts one completion's tokens against rollout.max_new_tokens; "
                              "with rollout.environment=tools that is one turn, and the episode is longer: leave "
                              "it out")
    if cfg.rollout.backend == "vllm" and importlib.util.find_spec("vllm") is None:
        from grpo.rollout.vllm_engine import INSTALL
        raise ConfigError(f"rollout.backend=vllm needs vLLM, which is not installed; install it with {INSTALL}")
    if cfg.rollout.backend == "vllm_server":
        for url in cfg.vllm_server.urls:
            parsed = urllib.parse.urlparse(url)
            if parsed.scheme not in ("http", "https") or not parsed.hostname or parsed.path not in ("", "/"):
                raise ConfigError(f"vllm_server.urls: {url!r} is not a server's base URL; give scheme, host and "
                                  "port, e.g. http://127.0.0.1:8000 (grpo serve prints it)")
        if not cfg.vllm_server.urls and importlib.util.find_spec("vllm") is None:
            from grpo.rollout.vllm_common import INSTALL
            raise ConfigError("rollout.backend=vllm_server with no vllm_server.urls launches vLLM servers here, and "
                              f"vLLM is not installed; install it with {INSTALL}, or give vllm_server.urls")
        from grpo.rollout.vllm_server import open_host_error
        if not cfg.vllm_server.urls and (why := open_host_error(cfg.vllm_server.host)):
            raise ConfigError(why)
    k = cfg.rollout.max_staleness
    if k and cfg.rollout.backend == "hf":
        raise ConfigError(f"rollout.max_staleness={k} samples ahead of the trainer, and rollout.backend=hf samples "
                          "from the very model being trained: use rollout.backend=vllm or vllm_server, or "
                          "rollout.max_staleness=0")
    if k and k >= cfg.train.steps:
        raise ConfigError(f"rollout.max_staleness={k} must be less than train.steps={cfg.train.steps}: with k >= "
                          "the steps every batch would come from the initial weights")
    if cfg.algo.ref_sync_every and not cfg.algo.beta:
        raise ConfigError(f"algo.ref_sync_every={cfg.algo.ref_sync_every} resets the KL reference, but algo.beta=0 "
                          "loads none: set algo.beta > 0 or algo.ref_sync_every=0")
    if cfg.algo.dual_clip and not cfg.algo.dual_clip > 1:
        raise ConfigError(f"algo.dual_clip={cfg.algo.dual_clip:g} must be more than 1 (the surrogate of a token with "
                          "Â < 0 is bounded at c·Â, c > 1), or 0 to turn it off")
    if cfg.algo.multi_objective_aggregation == "normalize_then_sum" and cfg.algo.scale != "group":
        raise ConfigError(f"algo.scale={cfg.algo.scale} does not apply with algo.multi_objective_aggregation="
                          "normalize_then_sum (GDPO standardises each reward within its group, then the sum over the "
                          "batch): leave algo.scale=group, or use sum_then_normalize")
    if cfg.algo.surrogate.startswith("dppo") and cfg.algo.ratio_level != "token":
        raise ConfigError(f"algo.surrogate={cfg.algo.surrogate} masks tokens by their own probabilities, and "
                          f"algo.ratio_level={cfg.algo.ratio_level} gives one ratio per sequence: set "
                          "algo.ratio_level=token")
    if cfg.algo.dual_clip and cfg.algo.surrogate != "clip":
        raise ConfigError(f"algo.dual_clip={cfg.algo.dual_clip:g} bounds PPO's clipped surrogate; algo.surrogate="
                          f"{cfg.algo.surrogate} has none: set algo.dual_clip=0 or algo.surrogate=clip")
    if cfg.algo.unbiased_kl != "off" and not cfg.algo.beta:
        raise ConfigError(f"algo.unbiased_kl={cfg.algo.unbiased_kl} corrects the KL term, and algo.beta=0 has none: "
                          "set algo.beta > 0 or algo.unbiased_kl=off")
    if cfg.algo.entropy_coef_min > cfg.algo.entropy_coef_max:
        raise ConfigError(f"algo.entropy_coef_min={cfg.algo.entropy_coef_min:g} must be at most "
                          f"algo.entropy_coef_max={cfg.algo.entropy_coef_max:g}")
    if cfg.algo.sampler_correction_floor >= cfg.algo.sampler_correction_cap:
        raise ConfigError(f"algo.sampler_correction_floor={cfg.algo.sampler_correction_floor} must be less than "
                          f"algo.sampler_correction_cap={cfg.algo.sampler_correction_cap}")
    if cfg.vllm.max_model_len and cfg.vllm.max_model_len <= cfg.rollout.max_new_tokens:
        raise ConfigError(f"vllm.max_model_len={cfg.vllm.max_model_len} leaves no room for a prompt: it must be "
                          f"more than rollout.max_new_tokens={cfg.rollout.max_new_tokens} (or 0, the model's)")
    if cfg.lora.rank and cfg.lora.dropout:
        raise ConfigError(f"lora.dropout={cfg.lora.dropout:g} is not supported: GRPO's ratio compares the training "
                          "pass with the log-probs of the policy that sampled, and dropout in the training pass "
                          "only would make them different networks; set lora.dropout=0")
    if cfg.lora.rank and cfg.compute.sharding == "fsdp":
        raise ConfigError("lora.rank > 0 with compute.sharding=fsdp is not supported; use compute.sharding=ddp")
    if cfg.train.prompts_per_step % world:
        raise ConfigError(f"train.prompts_per_step={cfg.train.prompts_per_step} must be a multiple of the number "
                          f"of processes ({world})")
    share = cfg.train.prompts_per_step // world
    if cfg.train.steps_per_generation > 1 and share % cfg.train.steps_per_generation:
        raise ConfigError(f"train.steps_per_generation={cfg.train.steps_per_generation} must divide the groups each "
                          f"process trains: train.prompts_per_step={cfg.train.prompts_per_step} over {world} "
                          f"process(es) is {share} a process")
    if cfg.train.overwrite and cfg.train.resume:
        raise ConfigError(f"train.overwrite=true would delete the run that train.resume={cfg.train.resume!r} "
                          "continues; give one of them")
    if len(set(cfg.log.trackers)) < len(cfg.log.trackers):
        raise ConfigError(f"log.trackers={cfg.log.trackers} names a tracker twice; name each at most once")
    if cfg.optim.warmup_steps >= cfg.train.steps:
        raise ConfigError(f"optim.warmup_steps={cfg.optim.warmup_steps} must be less than train.steps="
                          f"{cfg.train.steps}")


def _check_reward_weights(cfg: Config, num_rewards: int | None) -> None:
    if cfg.reward_weights is not None and len(cfg.reward_weights) != (num_rewards or len(cfg.rewards)):
        given = (f"{num_rewards} reward functions are given" if num_rewards
                 else f"rewards names {len(cfg.rewards)} functions")
        raise ConfigError(f"reward_weights has {len(cfg.reward_weights)} values but {given}; give one weight per "
                          "function")


def _world(world_size: int | None) -> int:
    return world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))


LOAD_CHECKS.append(validate_once)
