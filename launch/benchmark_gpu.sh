#!/usr/bin/env bash
# Train-step throughput on one accelerator, all in one run (README, "Speed"): VirTex R-50 L1 H2048 beside its
# PyTorch reference (torch.compile, then eager), VirTex fed from host memory through the loop's device prefetch,
# VirTex with BatchNorm over the whole batch, LocTex and MCT; each at global batch 256 in bf16.
#   launch/benchmark_gpu.sh OUT_DIR [STEPS]
# Needs JAX with the accelerator's plugin, flax, optax, ml_collections, sentencepiece and (for the reference)
# PyTorch; TensorFlow is not needed.
set -euo pipefail
OUT=${1:?usage: launch/benchmark_gpu.sh OUT_DIR [STEPS]}; STEPS=${2:-30}
mkdir -p "$OUT"
export PYTHONPATH="$(cd "$(dirname "$0")/.." && pwd)${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | tee "$OUT/device.txt" || true
B="python3 -m vlrep.tools.benchmark --steps=$STEPS"
$B --config=configs/virtex.py --config.batch_size=256 --input=device --torch_reference --output="$OUT/virtex_device.json"
python3 -m vlrep.tools.torch_reference --batch_size=256 --steps="$STEPS" --nocompile --output="$OUT/torch_eager.json"
$B --config=configs/virtex.py --config.batch_size=256 --input=host --output="$OUT/virtex_host.json"
$B --config=configs/virtex.py --config.batch_size=256 --config.method.backbone.bn_group_size=0 --output="$OUT/virtex_bn_whole_batch.json"
$B --config=configs/loctex.py --config.batch_size=256 --input=device --output="$OUT/loctex_device.json"
$B --config=configs/mct.py:text=scratch,tags=True --config.batch_size=256 --input=device --output="$OUT/mct_device.json"
