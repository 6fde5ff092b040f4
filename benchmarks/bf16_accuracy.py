"""What bfloat16 autocast costs in accuracy: completion log-probs under `model.autocast_bf16=true` against float32.

The bundled tiny model (trained, so its distributions are those of a real policy) samples G completions for
held-out prompts of the default task; their log-probs are then computed exactly as the trainer computes them
(shared prompts, the lean forward, log-probs from hidden states) in float32 and under bf16 autocast (eager
attention, bfloat16 output projection, float32 log-softmax). Reported: the per-token difference, the
per-sequence log-ratio that a bf16 forward would put into the importance ratio, the ratio of the sequence
probabilities, and the k3 KL estimate between the two.

With `--model smollm2-135m-instruct` the same for the real model of docs/smollm2.md, on the prompts and with the
sampling of its shipped job (`grpo train smollm2_stories`: the stories task through the chat template, 48 new
tokens at temperature 0.7, 32 prompts × 8).

    python benchmarks/bf16_accuracy.py      # writes benchmarks/results/bf16_accuracy.{json,md}
    python benchmarks/bf16_accuracy.py --model smollm2-135m-instruct   # ... bf16_accuracy_smollm2.{json,md}
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def main() -> None:
    import transformers

    from grpo.config import DataConfig, ModelConfig
    from grpo.models import load_model
    from grpo.policy import completion_logprobs, forward_path
    from grpo.rollout import HFGenerator, Sampling
    from grpo.tasks import load_task

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", choices=["tiny", "smollm2-135m-instruct"])
    args = p.parse_args()
    real = args.model != "tiny"
    torch.manual_seed(0)
    transformers.utils.logging.disable_progress_bar()
    fp32, tok = load_model(ModelConfig(path=args.model))
    bf16, _ = load_model(ModelConfig(path=args.model, autocast_bf16=True))  # the same weights, eager attention
    if real:
        examples = load_task(DataConfig(task="stories"), 0).eval[:32]
        prompts = [tok.apply_chat_template([{"role": "user", "content": e.prompt}], tokenize=False,
                                           add_generation_prompt=True) for e in examples]
        sampling, temperature = Sampling(8, 48, temperature=0.7), 0.7
    else:
        prompts = [e.prompt for e in load_task(DataConfig(task="mixed"), 0).eval[:64]]
        sampling, temperature = Sampling(8, 32), 1.0
    rollout = HFGenerator(fp32, tok, add_special_tokens=not real).generate(prompts, sampling,
                                                                           seeds=list(range(len(prompts))))
    args_ = (rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids, rollout.completion_mask)
    with torch.inference_mode():
        a = completion_logprobs(fp32, *args_, temperature=temperature, chunk_size=1024,
                                path=forward_path(fp32, share_prompt=True, lean=True))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            b = completion_logprobs(bf16, *args_, temperature=temperature, chunk_size=1024,
                                    path=forward_path(bf16, share_prompt=True, lean=True))
    mask = rollout.completion_mask.bool()
    diff = (b - a)[mask]
    seq = ((b - a) * mask).sum(1)
    k3 = (torch.exp(a - b) - (a - b) - 1)[mask]
    res = {
        "sequences": len(rollout), "tokens": int(mask.sum()),
        "token_abs_diff_mean": diff.abs().mean().item(), "token_abs_diff_max": diff.abs().max().item(),
        "token_logp_fp32_mean": a[mask].mean().item(),
        "seq_log_ratio_abs_mean": seq.abs().mean().item(), "seq_log_ratio_abs_max": seq.abs().max().item(),
        "seq_ratio_min": seq.exp().min().item(), "seq_ratio_max": seq.exp().max().item(),
        "k3_mean": k3.mean().item(),
    }
    out = HERE / "results" / ("bf16_accuracy_smollm2" if real else "bf16_accuracy")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
    what = ("SmolLM2-135M-Instruct, the stories task through the chat template at temperature 0.7" if real
            else "Bundled tiny model")
    md = (f"{what}, {res['sequences']} sampled completions ({res['tokens']} tokens) of held-out prompts; "
          "bf16 autocast against float32:\n\n"
          "| measure | value |\n|---|---:|\n"
          f"| mean log-prob per token (float32) | {res['token_logp_fp32_mean']:.4f} |\n"
          f"| mean \\|Δ log-prob\\| per token | {res['token_abs_diff_mean']:.2e} |\n"
          f"| max \\|Δ log-prob\\| per token | {res['token_abs_diff_max']:.2e} |\n"
          f"| mean \\|Δ log-prob\\| per sequence | {res['seq_log_ratio_abs_mean']:.2e} |\n"
          f"| sequence probability ratio, min – max | {res['seq_ratio_min']:.4f} – {res['seq_ratio_max']:.4f} |\n"
          f"| k3 KL estimate per token | {res['k3_mean']:.2e} |\n")
    out.with_suffix(".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
