#!/usr/bin/env bash
# One multi-GPU host: a single process drives all local GPUs (the batch is sharded over them).
#   launch/multi_gpu.sh configs/virtex.py /data/runs/virtex [--config.KEY=VALUE ...]
# Rerunning the same command resumes from the last checkpoint in the workdir.
set -euo pipefail
CONFIG=$1; WORKDIR=$2; shift 2
exec python -m vlrep.main --config="$CONFIG" --workdir="$WORKDIR" "$@"
