#!/usr/bin/env bash
# Train-step throughput on one accelerator (docs/speed.md): the VirTex step (R-50, L1 H2048, batch 256, bf16) with
# every speed switch A/B against the plain step in one process (windows round-robin), the device time by kernel
# class before and after, the fair PyTorch reference (same optimizer and BatchNorm groups; torch.compile default
# and max-autotune) beside vlrep's step, XLA's GPU flags, and LocTex and MCT with and without the switches.
#   launch/benchmark_gpu.sh OUT_DIR [PARTS] [STEPS] [WINDOWS] [DEADLINE_S]
# PARTS (comma-separated, default all): switches (every switch of the VirTex step; `optimizer` and `head_backbone`
# name its two halves), torch, methods, xla; `groups` (not in the default) is the short form that fits one 15-minute
# lease: the switches in three groups (backbone, optimizer + RNG, textual head) and all together, beside the plain
# step and the torch.compile default reference; `singles` times each switch alone in two processes (optimizer and
# RNG switches, each with its own plain step; textual-head and backbone switches, optional), without profiles. All parts start at once, one process each (xla: two), and
# share the device through vlrep.tools.device_turns: they compile together (XLA's autotuning, torch.compile and
# Triton take far longer than the timing), and time one at a time once all are ready, so no timed window shares
# the device. The VirTex process is waited for; the others (references, other methods) are killed and reported if
# still compiling DEADLINE_S seconds (default 330) after the start, and the rest time without them. A variant that
# fails to build or compile is reported in the JSON with its error; the others run. Results: OUT_DIR/*.json,
# profile.md, log.txt; a summary table at the end.
# Needs JAX with the accelerator's plugin, flax, optax, ml_collections, sentencepiece and (for the reference)
# PyTorch; TensorFlow is not needed.
set -uo pipefail
OUT=${1:?usage: launch/benchmark_gpu.sh OUT_DIR [PARTS] [STEPS] [WINDOWS] [DEADLINE_S]}
PARTS=${2:-switches,torch,methods,xla}; STEPS=${3:-20}; WINDOWS=${4:-3}; DEADLINE_S=${5:-330}
mkdir -p "$OUT"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | tee "$OUT/device.txt" || true
has() { [[ ",$PARTS," == *",$1,"* ]]; }
for P in ${PARTS//,/ }; do
  case $P in switches|optimizer|head_backbone|groups|singles|torch|methods|xla) ;; *) echo "unknown part '$P' (known: switches, optimizer, head_backbone, groups, singles, torch, methods, xla)" >&2; exit 2 ;; esac
done
has switches && PARTS="$PARTS,optimizer,head_backbone"

ALL_BACKBONE="method.backbone.fused_bn_act=True,method.backbone.fast_max_pool=True,method.backbone.conv1x1_as_dot=True"
ALL_OPTIM="optim.grad_norm_once=True,optim.lookahead_sync_only=True,optim.flat_update=True"
ALL_HEAD="method.fused_qkv=True,method.fused_memory_kv=True,method.vocab_multiple=128"
ALL="$ALL_BACKBONE,$ALL_OPTIM,$ALL_HEAD,rng_impl=unsafe_rbg"
M_ALL="$ALL_BACKBONE,optim.flat_update=True,rng_impl=unsafe_rbg"
VIRTEX="--config=configs/virtex.py --config.batch_size=256"

# One command line per process; the torch reference runs as two more processes started by the VirTex one.
declare -A CMDS
V=()
if has optimizer; then  # fixed per-step cost, and the RNG behind dropout
  V+=(--variant=no_lookahead_no_clip:optim.lookahead_steps=0,optim.grad_clip_norm=0.0
    --variant=grad_norm_once:optim.grad_norm_once=True --variant=lookahead_sync_only:optim.lookahead_sync_only=True
    --variant=flat_update:optim.flat_update=True --variant=rbg:rng_impl=rbg --variant=unsafe_rbg:rng_impl=unsafe_rbg)
fi
if has head_backbone; then  # the textual head's and the backbone's switches
  V+=(--variant=fused_qkv:method.fused_qkv=True --variant=fused_memory_kv:method.fused_memory_kv=True
    --variant=vocab_multiple_128:method.vocab_multiple=128 --variant=fused_bn_act:method.backbone.fused_bn_act=True
    --variant=fast_max_pool:method.backbone.fast_max_pool=True
    --variant=conv1x1_as_dot:method.backbone.conv1x1_as_dot=True)
fi
if has groups; then  # one config per group of switches: what a short lease can compile
  V+=(--variant=backbone:$ALL_BACKBONE --variant=optimizer_rng:$ALL_OPTIM,rng_impl=unsafe_rbg --variant=head:$ALL_HEAD)
fi
PARTIES=0
if has singles; then  # each switch alone; two processes so that the first one's results survive the deadline
  CMDS[virtex_optimizer]="$VIRTEX --variant=grad_norm_once:optim.grad_norm_once=True
    --variant=lookahead_sync_only:optim.lookahead_sync_only=True --variant=flat_update:optim.flat_update=True
    --variant=unsafe_rbg:rng_impl=unsafe_rbg --compile_threads=5 --offload_states"
  CMDS[virtex_head_backbone]="$VIRTEX --variant=fused_qkv:method.fused_qkv=True
    --variant=fused_memory_kv:method.fused_memory_kv=True --variant=vocab_multiple_128:method.vocab_multiple=128
    --variant=fused_bn_act:method.backbone.fused_bn_act=True --variant=fast_max_pool:method.backbone.fast_max_pool=True
    --variant=conv1x1_as_dot:method.backbone.conv1x1_as_dot=True --compile_threads=7 --offload_states --gemm_size=0
    --turn_optional"
elif has groups && ! has torch; then
  PARTIES=1
  CMDS[virtex]="$VIRTEX ${V[*]} --variant=all:$ALL
    --profile --profile_variants=baseline,all --output_dir=/tmp/vlrep_gpu_profile --compile_threads=5 --offload_states
    --torch_reference --torch_modes=default"
elif has optimizer || has head_backbone || has torch; then  # all switches together; profiles before and after
  T=""; has torch && T="--torch_reference --torch_modes=default,max-autotune" && PARTIES=$((PARTIES + 2))
  CMDS[virtex]="$VIRTEX ${V[*]} --variant=all:$ALL
    --profile --profile_variants=baseline,all --output_dir=/tmp/vlrep_gpu_profile --compile_threads=6 --offload_states $T"
fi
if has methods; then  # LocTex and MCT, plain and with the switches that apply to them
  for M in loctex mct; do
    C="--config=configs/$M.py --config.batch_size=256"; [[ $M == mct ]] && C="--config=configs/mct.py:text=scratch,tags=True --config.batch_size=256"
    CMDS[$M]="$C --variant=all:$M_ALL --compile_threads=2 --gemm_size=0 --turn_optional"
  done
fi
if has xla; then  # XLA's GPU flags are read when the backend starts: one process per setting (default: virtex's)
  CMDS[xla_no_triton_gemm]="$VIRTEX --gemm_size=0"
  CMDS[xla_no_command_buffer]="$VIRTEX --gemm_size=0"
fi
PARTIES=$((PARTIES + ${#CMDS[@]}))
TURNS=/tmp/vlrep_gpu_turns.$$; DEADLINE=$(($(date +%s) + DEADLINE_S))
TURN="--turn_dir=$TURNS --turn_parties=$PARTIES --turn_deadline=$DEADLINE"
echo "$(date -u +%T) starting $PARTIES processes; timing starts when all have compiled (at the latest in ${DEADLINE_S} s)"

PIDS=()
for NAME in "${!CMDS[@]}"; do
  X=""
  [[ $NAME == xla_no_triton_gemm ]] && X="--xla_gpu_enable_triton_gemm=false"
  [[ $NAME == xla_no_command_buffer ]] && X="--xla_gpu_enable_command_buffer="
  env ${X:+XLA_FLAGS="${XLA_FLAGS:-} $X"} python3 -m vlrep.tools.benchmark --steps="$STEPS" --windows="$WINDOWS" --input=device \
    ${CMDS[$NAME]} --output="$OUT/$NAME.json" $TURN >"/tmp/vlrep_gpu_$NAME.log" 2>&1 & PIDS+=($!)
done
STATUS=0
for P in "${PIDS[@]}"; do wait "$P" || STATUS=1; done
echo "$(date -u +%T) all processes ended"
[[ -f /tmp/vlrep_gpu_profile/profile.md ]] && cp /tmp/vlrep_gpu_profile/profile.md "$OUT/"
for L in /tmp/vlrep_gpu_*.log; do echo "=== $L"; grep -v -E "^(I|W)[0-9]{4} " "$L" | tail -n 40; done >"$OUT/log.txt"
python3 "$ROOT/launch/benchmark_gpu_summary.py" "$OUT"
exit $STATUS
