"""Build the bundled tool model (`model.path: tiny-tools`): a character-level Qwen2 model with a chat template,
warm-started to sometimes call a calculator on the built-in `products` task.

    python scripts/build_tiny_tools_model.py        # writes grpo/assets/tiny-tools

The warm start is supervised fine-tuning on the *train* split of `products` ("Calculate 347 * 2918"; the
held-out split is never seen). Each target is a whole episode rendered by the model's chat template
(`grpo.tiny.TOOL_CHAT_TEMPLATE`), with the loss on the assistant's tokens only (as GRPO trains them):
- with probability p the model calls the calculator, reads the result and answers with it (p is
  --p-tool-early for the first --early-frac of the steps, where the model learns to copy the operands into the
  call and the result into its answer, then --p-tool, which sets how often it calls):
  `[calculator(expression="347 * 2918")]` EOS, `<|tool|>1012546` EOS `<|assistant|>`, `1012546` EOS;
- otherwise it answers at once with the true product, which a 1 M-parameter model cannot compute: it learns
  the answer's shape (how many digits, the first and last ones) and guesses the rest.
The model therefore samples a call now and then but does not call greedily, and its own answers are almost
always wrong: GRPO, rewarded by `final_number`, learns to call the tool (docs/tools.md has the figures).

Seeded: the same arguments give the same weights on the same machine and thread count.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from build_tiny_model import warm_start  # noqa: E402  (this directory is on sys.path)
from grpo.envs.tool_calls import calculator, load_tools  # noqa: E402
from grpo.envs.tools import ToolEnvironment  # noqa: E402
from grpo.evaluation import evaluate  # noqa: E402
from grpo.rewards import final_number  # noqa: E402
from grpo.rollout import HFGenerator, Sampling  # noqa: E402
from grpo.tasks import load_builtin_task  # noqa: E402
from grpo.tiny import TINY_TOOLS_DIR, build_tool_tokenizer, tiny_model_config  # noqa: E402


def episode(tok, schemas, example, use_tool: bool) -> tuple[list[int], list[int]]:
    """The token ids of a whole episode and its loss mask (1 on the assistant's tokens, EOS included)."""
    a, b = example.fields["a"], example.fields["b"]
    messages = [{"role": "user", "content": example.prompt}]
    if use_tool:
        expression = f"{a} * {b}"
        messages += [{"role": "assistant", "content": f'[calculator(expression="{expression}")]'},
                     {"role": "tool", "content": calculator(expression)}]
    messages.append({"role": "assistant", "content": example.answer})
    ids, mask, text = [], [], ""

    def add(rendered: str, trained: bool) -> None:
        nonlocal text
        new = tok(rendered[len(text):], add_special_tokens=False)["input_ids"]
        ids.extend(new)
        mask.extend([int(trained)] * len(new))
        text = rendered

    for k, m in enumerate(messages):
        if m["role"] == "assistant":  # the generation prompt before a turn is the environment's, not the model's
            add(tok.apply_chat_template(messages[:k], tools=schemas, tokenize=False, add_generation_prompt=True), False)
        add(tok.apply_chat_template(messages[:k + 1], tools=schemas, tokenize=False), m["role"] == "assistant")
    return ids, mask


def batch(tok, schemas, examples, rng: random.Random, size: int, p_tool: float):
    rows = [episode(tok, schemas, rng.choice(examples), rng.random() < p_tool) for _ in range(size)]
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((size, width), tok.pad_token_id)
    labels = torch.full((size, width), -100)
    mask = torch.zeros(size, width, dtype=torch.long)
    for i, (x, m) in enumerate(rows):
        ids[i, :len(x)] = torch.tensor(x)
        mask[i, :len(x)] = 1
        labels[i, :len(x)] = torch.where(torch.tensor(m) == 1, torch.tensor(x), -100)
    return ids, mask, labels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=TINY_TOOLS_DIR)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=1300)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--p-tool", type=float, default=0.1, help="share of targets that call the calculator at the end")
    ap.add_argument("--p-tool-early", type=float, default=0.6,
                    help="that share in the first --early-frac of the steps, where the model learns to copy")
    ap.add_argument("--early-frac", type=float, default=0.75)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="1 keeps the build reproducible and immune to other load")
    ap.add_argument("--max-new-tokens", type=int, default=48, help="as rollout.max_new_tokens of the tool job")
    ap.add_argument("--eval-size", type=int, default=256, help="held-out problems to measure on")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    transformers.utils.logging.disable_progress_bar()
    tok = build_tool_tokenizer(128)
    cfg = tiny_model_config(tok, hidden_size=args.hidden, num_hidden_layers=args.layers,
                            intermediate_size=4 * args.hidden, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=128)
    model = transformers.Qwen2ForCausalLM(cfg)
    params = sum(p.numel() for p in model.parameters())
    task = load_builtin_task("products", args.seed)
    tools = load_tools(["calculator"])
    schemas = [t.schema for t in tools.values()]
    print(f"{params:,} parameters; {len(task.train)} training problems, {len(task.eval)} held out", flush=True)

    def make_batch(step: int):
        p_tool = args.p_tool_early if step <= args.early_frac * args.steps else args.p_tool
        return batch(tok, schemas, task.train, rng, args.batch_size, p_tool)

    sft_seconds = warm_start(model, make_batch, steps=args.steps, lr=args.lr, warmup=args.warmup)

    model.eval()
    generator = HFGenerator(model, tok, add_special_tokens=False)
    env = ToolEnvironment(tok, tools, "pythonic", pad_id=tok.pad_token_id, context=128,
                          max_turns=2, max_tokens=80)
    held_out = task.eval[:args.eval_size]
    held = evaluate(env, generator, held_out, final_number, max_new_tokens=args.max_new_tokens, pass_k=8,
                    temperature=1.0, seed=0)
    sampled = env.rollout(generator, held_out, Sampling(8, args.max_new_tokens, 1.0), seeds=list(range(len(held_out))))
    calls = [e.tool_calls > 0 for e in sampled.episodes]
    right = final_number([e.prompt for e in held_out for _ in range(8)], sampled.texts,
                         [e.answer for e in held_out for _ in range(8)],
                         messages=[e.messages for e in sampled.episodes])
    held["sampled_call_rate"] = sum(calls) / len(calls)
    held["accuracy_with_call"] = sum(r for r, c in zip(right, calls) if c) / max(1, sum(calls))
    held["accuracy_without_call"] = sum(r for r, c in zip(right, calls) if not c) / max(1, len(calls) - sum(calls))
    report = {"parameters": params, "sft_seconds": round(sft_seconds, 1), "threads": args.threads,
              "held_out": {k: round(v, 4) for k, v in held.items()}, "args": {k: str(v) for k, v in vars(args).items()}}
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    tok.save_pretrained(args.out)
    (args.out / "warmstart.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["held_out"], indent=2))
    print(f"saved to {args.out} ({(args.out / 'model.safetensors').stat().st_size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
