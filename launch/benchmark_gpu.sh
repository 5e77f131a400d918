#!/usr/bin/env bash
# Train-step throughput on one accelerator (docs/speed.md): the VirTex step (R-50, L1 H2048, batch 256, bf16) with
# the device time by kernel class, the fair PyTorch reference (same optimizer and BatchNorm groups; torch.compile
# default and max-autotune) beside it, the official kdexd/virtex step, an XLA GPU flag, and the LocTex and MCT
# steps.
#   launch/benchmark_gpu.sh OUT_DIR [PARTS] [STEPS] [WINDOWS] [DEADLINE_S]
# PARTS (comma-separated, default virtex,torch,official,methods,xla): virtex (the plain step, profiled), torch (the
# references, beside virtex), official (kdexd/virtex's own step, vlrep.bench.official_virtex: needs a checkout in
# $VIRTEX_SRC, default ./.virtex_src, and fvcore, yacs, iopath, loguru importable), methods (LocTex and MCT), xla
# (a flag setting). All parts start at once, one process each (torch: two more),
# and share the device through vlrep.bench.device_turns: they compile together (XLA's autotuning,
# torch.compile and Triton take far longer than the timing), and time one at a time once all are ready, so no
# timed window shares the device. The VirTex process is waited for; the others (references, other methods, XLA
# flags) are killed and reported if still compiling DEADLINE_S seconds (default 330) after the start, and the rest
# time without them. Results: OUT_DIR/*.json, profile.md, log.txt; a summary table at the end. VIRTEX_ARGS (the
# environment) adds flags to the VirTex process, e.g. "--windows=5 --variant=NAME:KEY=VALUE --compile_threads=3";
# TORCH_MODES (default "default,max-autotune") picks the references' torch.compile modes (each is a party in the
# turns, so never pass --torch_modes through VIRTEX_ARGS: the script would wait for a reference that never comes).
# Every JAX process may grow to 75% of the card's memory: on one H200 the seven processes of all parts left MCT's
# step without memory (docs/speed.md), so give `methods` a call of its own when running every part.
# The speed switches this script once measured were removed (docs/speed.md); `git show aa09bc1:launch/benchmark_gpu.sh`
# has the parts that measured them, `git show 8557da6:launch/benchmark_gpu.sh` the BatchNorm levers part (`levers`).
# Needs JAX with the accelerator's plugin, flax, optax, ml_collections, sentencepiece and (for the reference)
# PyTorch; TensorFlow is not needed.
set -uo pipefail
OUT=${1:?usage: launch/benchmark_gpu.sh OUT_DIR [PARTS] [STEPS] [WINDOWS] [DEADLINE_S]}
PARTS=${2:-virtex,torch,official,methods,xla}; STEPS=${3:-20}; WINDOWS=${4:-3}; DEADLINE_S=${5:-330}
mkdir -p "$OUT"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | tee "$OUT/device.txt" || true
has() { [[ ",$PARTS," == *",$1,"* ]]; }
for P in ${PARTS//,/ }; do
  case $P in virtex|torch|official|methods|xla) ;;
    *) echo "unknown part '$P' (known: virtex, torch, official, methods, xla)" >&2; exit 2 ;; esac
done
has torch && PARTS="$PARTS,virtex"  # the references are started by the VirTex process
VIRTEX_SRC=${VIRTEX_SRC:-$ROOT/.virtex_src}
if has official && [[ ! -f $VIRTEX_SRC/virtex/factories.py ]]; then
  echo "part 'official' needs a checkout of kdexd/virtex in \$VIRTEX_SRC ($VIRTEX_SRC)" >&2; exit 2
fi
VIRTEX="--config=configs/virtex.py --config.batch_size=256"

# One command line per process.
declare -A CMDS
PARTIES=0
if has virtex; then  # the plain step, its profile, and the references beside it
  TORCH_MODES=${TORCH_MODES:-default,max-autotune}; MODES=(${TORCH_MODES//,/ })
  T=""; has torch && T="--torch_reference --torch_modes=$TORCH_MODES" && PARTIES=$((PARTIES + ${#MODES[@]}))
  CMDS[virtex]="$VIRTEX --profile --output_dir=/tmp/vlrep_gpu_profile $T ${VIRTEX_ARGS:-}"
fi
if has methods; then  # LocTex and MCT (MCT's tag variant with a text encoder from scratch: no BERT folder needed)
  CMDS[loctex]="--config=configs/loctex.py --config.batch_size=256 --gemm_size=0 --turn_optional"
  CMDS[mct]="--config=configs/mct.py:text=scratch,tags=True --config.batch_size=256 --gemm_size=0 --turn_optional"
fi
# XLA's GPU flags are read when the backend starts: one process per setting (default: virtex's). Measured and
# tied or lost (docs/speed.md): --xla_gpu_enable_triton_gemm=false, --xla_gpu_enable_command_buffer=, and the one
# below (kept to be re-measured as XLA changes).
declare -A XLA_SETTINGS=(
  [xla_conv_fusion]="--xla_gpu_experimental_enable_conv_fusion=true"  # elementwise work fused into cuDNN convolutions
)
if has xla; then
  for NAME in "${!XLA_SETTINGS[@]}"; do CMDS[$NAME]="$VIRTEX --gemm_size=0 --turn_optional"; done
fi
PARTIES=$((PARTIES + ${#CMDS[@]}))
has official && PARTIES=$((PARTIES + 1))
TURNS=/tmp/vlrep_gpu_turns.$$; DEADLINE=$(($(date +%s) + DEADLINE_S))
TURN="--turn_dir=$TURNS --turn_parties=$PARTIES --turn_deadline=$DEADLINE"
echo "$(date -u +%T) starting $PARTIES processes; timing starts when all have compiled (at the latest in ${DEADLINE_S} s)"

PIDS=()
for NAME in "${!CMDS[@]}"; do
  X=${XLA_SETTINGS[$NAME]:-}
  env ${X:+XLA_FLAGS="${XLA_FLAGS:-} $X"} python3 -m vlrep.bench.benchmark --steps="$STEPS" --windows="$WINDOWS" --input=device \
    ${CMDS[$NAME]} --output="$OUT/$NAME.json" $TURN >"/tmp/vlrep_gpu_$NAME.log" 2>&1 & PIDS+=($!)
done
if has official; then  # the official code's own step (optional: killed if still warming up at the deadline)
  python3 -m vlrep.bench.official_virtex --virtex_src="$VIRTEX_SRC" --batch_size=256 --steps="$STEPS" \
    --windows="$WINDOWS" --output="$OUT/official_virtex.json" $TURN >/tmp/vlrep_gpu_official.log 2>&1 & PIDS+=($!)
fi
STATUS=0
for P in "${PIDS[@]}"; do wait "$P" || STATUS=1; done
echo "$(date -u +%T) all processes ended"
[[ -f /tmp/vlrep_gpu_profile/profile.md ]] && cp /tmp/vlrep_gpu_profile/profile.md "$OUT/"
for L in /tmp/vlrep_gpu_*.log; do echo "=== $L"; grep -v -E "^(I|W)[0-9]{4} " "$L" | tail -n 40; done >"$OUT/log.txt"
python3 "$ROOT/launch/benchmark_gpu_summary.py" "$OUT"
exit $STATUS
