#!/usr/bin/env bash
# N processes on this machine forming one JAX distributed runtime (coordinator on 127.0.0.1), as the hosts of
# a cluster do: a way to try multi-host runs without a cluster (the test suite does the same with 2 processes).
#   launch/local_processes.sh 2 configs/virtex.py:runlocal /tmp/vlrep_2proc [--config.KEY=VALUE ...]
# Each process gets DEVICES_PER_PROCESS CPU devices (default 1); logs go to WORKDIR/process_I.log.
set -euo pipefail
N=$1; CONFIG=$2; WORKDIR=$3; shift 3
PORT=${PORT:-$((20000 + RANDOM % 20000))}
mkdir -p "$WORKDIR"
pids=()
for ((i = 0; i < N; i++)); do
  XLA_FLAGS="--xla_force_host_platform_device_count=${DEVICES_PER_PROCESS:-1}" JAX_PLATFORMS=cpu \
    python -m vlrep.main --config="$CONFIG" --workdir="$WORKDIR" --coordinator_address="127.0.0.1:$PORT" \
    --num_processes="$N" --process_id="$i" "$@" > "$WORKDIR/process_$i.log" 2>&1 &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
tail -n 5 "$WORKDIR/process_0.log"
exit $status
