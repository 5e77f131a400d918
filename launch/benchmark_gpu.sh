#!/usr/bin/env bash
# Train-step throughput on one accelerator (docs/speed.md): the VirTex step (R-50, L1 H2048, batch 256, bf16) with
# every speed switch A/B against the plain step in one process (windows round-robin), the device time by kernel
# class before and after, the fair PyTorch reference (same optimizer and BatchNorm groups; torch.compile default
# and max-autotune) beside vlrep's step, XLA's GPU flags, LocTex and MCT with and without the switches, and the
# pallas_conv1x1 kernels one ResNet-50 convolution at a time over several tile settings.
#   launch/benchmark_gpu.sh OUT_DIR [PARTS] [STEPS] [WINDOWS]
# PARTS (comma-separated, default all of them): kernels, optimizer, head_backbone, torch, xla, methods. Each part is
# one or a few processes of a few minutes; run them in separate calls where a call's time is limited. A variant
# that fails to compile (e.g. a kernel Triton refuses) is reported in the JSON with its error; the others run.
# Needs JAX with the accelerator's plugin, flax, optax, ml_collections, sentencepiece and (for the reference)
# PyTorch; TensorFlow is not needed.
set -euo pipefail
OUT=${1:?usage: launch/benchmark_gpu.sh OUT_DIR [PARTS] [STEPS] [WINDOWS]}
PARTS=${2:-kernels,optimizer,head_backbone,torch,xla,methods}; STEPS=${3:-20}; WINDOWS=${4:-3}
mkdir -p "$OUT"
export PYTHONPATH="$(cd "$(dirname "$0")/.." && pwd)${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | tee "$OUT/device.txt" || true
B="python3 -m vlrep.tools.benchmark --steps=$STEPS --windows=$WINDOWS --input=device"
VIRTEX="--config=configs/virtex.py --config.batch_size=256"
ALL_BACKBONE="method.backbone.fused_bn_act=True,method.backbone.fast_max_pool=True,method.backbone.conv1x1_as_dot=True"
ALL_OPTIM="optim.grad_norm_once=True,optim.lookahead_sync_only=True,optim.flat_update=True"
ALL_HEAD="method.fused_qkv=True,method.fused_memory_kv=True,method.vocab_multiple=128"
ALL="$ALL_BACKBONE,$ALL_OPTIM,$ALL_HEAD,rng_impl=unsafe_rbg"
has() { [[ ",$PARTS," == *",$1,"* ]]; }

if has kernels; then  # the Pallas 1x1 convolution + BatchNorm kernels against XLA, per shape and tile setting
  python3 -m vlrep.tools.kernel_benchmark --batch=256 --group=32 --output="$OUT/kernels.json" | tail -n 12
fi

if has optimizer; then  # fixed per-step cost, and the RNG behind dropout
  $B $VIRTEX --output="$OUT/virtex_optimizer.json" \
    --variant=no_lookahead_no_clip:optim.lookahead_steps=0,optim.grad_clip_norm=0.0 \
    --variant=grad_norm_once:optim.grad_norm_once=True \
    --variant=lookahead_sync_only:optim.lookahead_sync_only=True \
    --variant=flat_update:optim.flat_update=True \
    --variant=rbg:rng_impl=rbg \
    --variant=unsafe_rbg:rng_impl=unsafe_rbg
fi
if has head_backbone; then  # the textual head's and the backbone's switches; all switches together; profiles
  $B $VIRTEX --output="$OUT/virtex_head_backbone.json" --profile --output_dir="$OUT/profile_virtex" \
    --variant=fused_qkv:method.fused_qkv=True \
    --variant=fused_memory_kv:method.fused_memory_kv=True \
    --variant=vocab_multiple_128:method.vocab_multiple=128 \
    --variant=fused_bn_act:method.backbone.fused_bn_act=True \
    --variant=fast_max_pool:method.backbone.fast_max_pool=True \
    --variant=conv1x1_as_dot:method.backbone.conv1x1_as_dot=True \
    --variant=pallas_conv1x1:method.backbone.pallas_conv1x1=True \
    --variant="all:$ALL" \
    --variant="all_pallas:$ALL,method.backbone.pallas_conv1x1=True"
fi
if has torch; then  # the fair reference first (it frees the device before JAX takes it), then vlrep's step
  $B $VIRTEX --output="$OUT/virtex_vs_torch.json" --torch_reference --torch_modes=default,max-autotune \
    --variant="all:$ALL" --variant="all_pallas:$ALL,method.backbone.pallas_conv1x1=True"
fi
if has xla; then  # XLA's GPU flags are read when the backend starts: one process per setting
  for FLAGS_NAME in default no_triton_gemm no_command_buffer; do
    case $FLAGS_NAME in
      default) X="" ;;
      no_triton_gemm) X="--xla_gpu_enable_triton_gemm=false" ;;
      no_command_buffer) X="--xla_gpu_enable_command_buffer=" ;;
    esac
    XLA_FLAGS="${XLA_FLAGS:-} $X" $B $VIRTEX --output="$OUT/virtex_xla_$FLAGS_NAME.json" --gemm_size=0
  done
fi
if has methods; then
  M_ALL="$ALL_BACKBONE,optim.flat_update=True,rng_impl=unsafe_rbg"
  $B --config=configs/loctex.py --config.batch_size=256 --output="$OUT/loctex.json" \
    --variant="all:$M_ALL" --variant="all_pallas:$M_ALL,method.backbone.pallas_conv1x1=True"
  $B --config=configs/mct.py:text=scratch,tags=True --config.batch_size=256 --output="$OUT/mct.json" \
    --variant="all:$M_ALL" --variant="all_pallas:$M_ALL,method.backbone.pallas_conv1x1=True"
fi
