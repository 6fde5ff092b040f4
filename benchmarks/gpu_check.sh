#!/usr/bin/env bash
# The GPU check: one CUDA GPU (an H200 here), only torch and transformers installed (no vLLM), under 8 minutes.
#   the trainer on CUDA in bf16 in one process of an NCCL group, a ~0.5 B random Qwen2: step time and MFU
#   the hf backend's rollout tokens/s on that model (lean decoding and transformers' forward)
# Usage (from the repository root): bash benchmarks/gpu_check.sh [RESULTS_DIR]   (default benchmarks/results)
# Writes RESULTS_DIR/gpu_check.json. docs/vllm.md has the figures of the last run, or says none was made.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-benchmarks/results}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0))"
timeout 470 python3 benchmarks/gpu_check.py "$out/gpu_check.json"
