#!/usr/bin/env bash
# Train-step throughput on one accelerator, all in one run (README, "Speed"): VirTex R-50 L1 H2048 beside its
# PyTorch reference, VirTex fed from host memory, and LocTex, each at global batch 256 in bf16.
#   launch/benchmark_gpu.sh OUT_DIR [STEPS]
# Needs JAX with the accelerator's plugin, flax, optax, ml_collections, sentencepiece and (for the reference)
# PyTorch; TensorFlow is not needed.
set -euo pipefail
OUT=${1:?usage: launch/benchmark_gpu.sh OUT_DIR [STEPS]}; STEPS=${2:-30}
mkdir -p "$OUT"
export PYTHONPATH="$(cd "$(dirname "$0")/.." && pwd)${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | tee "$OUT/device.txt" || true
python3 -m vlrep.tools.benchmark --config=configs/virtex.py --config.batch_size=256 --steps="$STEPS" \
  --input=device --torch_reference --output="$OUT/virtex_device.json"
python3 -m vlrep.tools.benchmark --config=configs/virtex.py --config.batch_size=256 --steps="$STEPS" \
  --input=host --output="$OUT/virtex_host.json"
python3 -m vlrep.tools.benchmark --config=configs/loctex.py --config.batch_size=256 --steps="$STEPS" \
  --input=device --output="$OUT/loctex_device.json"
