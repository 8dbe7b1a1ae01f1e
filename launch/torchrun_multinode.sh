#!/usr/bin/env bash
# Several nodes without SLURM: run this once on every node, with the same settings.
#
# c10d rendezvous (recommended; node ranks are assigned at the meeting, a node may join late):
#   NNODES=2 RDZV_ENDPOINT=node0.example.org:29400 launch/torchrun_multinode.sh train_moco.py ARGS...
# Static node ranks (the classic form; NODE_RANK=0 on the master node):
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=node0.example.org MASTER_PORT=29400 launch/torchrun_multinode.sh ...
#
# NPROC (default: GPUs on this node, or 1 on a CPU-only node) workers per node; RDZV_ID (default
# "ddp-image-training") must be the same on every node of one job and differ between jobs that
# share an endpoint. The port must be free on the first node and open between the nodes.
# The script's --check runs first on each node: bad input is one line and exit 2, no worker started.
# MAX_RESTARTS (default 3): restarts of the whole job after a worker dies, each continuing from the
# newest checkpoint (see launch/torchrun_local.sh); MAX_RESTARTS=0 turns them off.
set -euo pipefail
if [[ $# -lt 1 || -z "${NNODES:-}" ]]; then
    echo "usage: NNODES=N (RDZV_ENDPOINT=HOST:PORT | NODE_RANK=R MASTER_ADDR=HOST MASTER_PORT=PORT)" \
         "$0 SCRIPT.py [ARGS...]" >&2
    exit 2
fi
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
script=$1; shift
args=("$@")
source "$here/restarts.sh"
nproc=${NPROC:-$(${PYTHON:-python} -c 'import torch; print(torch.cuda.device_count() or 1)')}
check_before_launch "$((NNODES * nproc))" "$nproc"
if [[ -n "${NODE_RANK:-}" ]]; then
    : "${MASTER_ADDR:?set MASTER_ADDR with NODE_RANK}" "${MASTER_PORT:?set MASTER_PORT with NODE_RANK}"
    rendezvous=(--node-rank="$NODE_RANK" --master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT")
else
    : "${RDZV_ENDPOINT:?set RDZV_ENDPOINT=HOST:PORT (or NODE_RANK, MASTER_ADDR, MASTER_PORT)}"
    rendezvous=(--rdzv-backend=c10d --rdzv-endpoint="$RDZV_ENDPOINT" --rdzv-id="${RDZV_ID:-ddp-image-training}")
fi
cmd=("${PYTHON:-python}" -m torch.distributed.run --nnodes="$NNODES" --nproc-per-node="$nproc"
     --max-restarts="$max_restarts" "${rendezvous[@]}" "$script" "${args[@]}")
echo "+ ${cmd[*]}" >&2
exec "${cmd[@]}"
