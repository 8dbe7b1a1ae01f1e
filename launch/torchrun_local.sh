#!/usr/bin/env bash
# One node, every GPU (or NPROC CPU processes); torchrun --standalone picks a free port itself.
#
#   launch/torchrun_local.sh train_classifier.py --dataset cifar10 --download --arch resnet18
#   NPROC=2 launch/torchrun_local.sh train_moco.py --device cpu --dataset digits
#
# NPROC defaults to the number of visible GPUs, or 2 CPU processes on a machine without any.
# The script's --check runs first, once: bad input is one line and exit 2, no worker started.
# MAX_RESTARTS (default 3): when a worker dies, torchrun restarts the whole group up to this many
# times and the run continues from its newest checkpoint (--resume if-restarted is added unless
# the arguments have --resume or --overwrite: a first attempt into a used --out is refused).
# MAX_RESTARTS=0 turns restarts off.
set -euo pipefail
if [[ $# -lt 1 ]]; then
    echo "usage: [NPROC=N] [MAX_RESTARTS=K] $0 SCRIPT.py [ARGS...]" >&2
    exit 2
fi
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
script=$1; shift
args=("$@")
source "$here/restarts.sh"
nproc=${NPROC:-$(${PYTHON:-python} -c 'import torch; print(torch.cuda.device_count() or 2)')}
check_before_launch "$nproc" "$nproc"
cmd=("${PYTHON:-python}" -m torch.distributed.run --standalone --nnodes=1 --nproc-per-node="$nproc"
     --max-restarts="$max_restarts" "$script" "${args[@]}")
echo "+ ${cmd[*]}" >&2
exec "${cmd[@]}"
