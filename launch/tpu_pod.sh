#!/usr/bin/env bash
# TPU VM pod: installs vlrep on every worker and starts the same command on all of them (jax.distributed
# finds the pod topology itself). The workdir must be on a bucket all workers can reach.
#   launch/tpu_pod.sh NAME ZONE configs/virtex.py gs://BUCKET/runs/virtex [--config.KEY=VALUE ...]
set -euo pipefail
NAME=$1; ZONE=$2; CONFIG=$3; WORKDIR=$4; shift 4
REPO=${VLREP_REPO:-https://github.com/vlrep/vlrep}
gcloud compute tpus tpu-vm ssh "$NAME" --zone="$ZONE" --worker=all --command="
  set -e; [ -d vlrep ] || git clone $REPO vlrep; cd vlrep && git pull -q
  pip install -q -e . 'jax[tpu]' -f https://storage.googleapis.com/jax-releases/libtpu_releases.html
  python -m vlrep.main --multihost --config=$CONFIG --workdir=$WORKDIR $*"
