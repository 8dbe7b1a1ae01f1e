#!/usr/bin/env bash
# The body of every SLURM job of this project; launch/slurm_*.sbatch call it inside the
# allocation (not meant to be submitted itself):
#
#   bash /path/to/repo/launch/slurm_job.sh SCRIPT.py [ARGS...]
#
# LAUNCH_MODE=torchrun (default): srun starts one torchrun per node; torchrun starts one worker
#   per GPU (or NPROC_PER_NODE workers) and the nodes meet through c10d rendezvous on the first
#   host of the allocation, at a port derived from the job id. A worker that dies makes torchrun
#   restart the group, up to MAX_RESTARTS times (default 3), from the newest checkpoint.
# LAUNCH_MODE=srun: srun starts one task per GPU itself (set --ntasks-per-node to the GPUs per
#   node); each worker reads SLURM_PROCID/SLURM_NTASKS (ddp_utils.runtime.launch.detect_launch). No
#   restarts within the job: a failed task fails the job.
#
# Runs SCRIPT --check once first (bad input: one line in the job log, exit 2, no srun). Adds
# --resume if-restarted (unless ARGS has --resume or --overwrite): a requeued attempt continues
# from the newest checkpoint, a first attempt into a used --out is refused; and, without --out in
# ARGS, an --out that is stable across requeues: runs/JOBNAME_JOBID. Relative paths are taken from the
# directory sbatch was called in. Preemption: SLURM's USR1 (#SBATCH --signal) or
# `scancel --signal=USR1 JOBID` makes every worker finish its optimizer step; rank 0 checkpoints
# and writes OUT/PREEMPTED; this script then requeues the job, which resumes where it stopped.
set -uo pipefail

say() { echo "$(date +%H:%M:%S) [job] $*"; }  # the training log's time format: gaps can be read

if [[ $# -lt 1 || -z "${SLURM_JOB_ID:-}" ]]; then
    echo "usage: bash launch/slurm_job.sh SCRIPT.py [ARGS...]  (inside a SLURM job: sbatch launch/slurm_*.sbatch)" >&2
    exit 2
fi
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "${SLURM_SUBMIT_DIR:-.}"
script=$repo/$1; shift
args=("$@")

out=""
for ((i = 0; i < ${#args[@]}; i++)); do
    case "${args[i]}" in
        --out) out="${args[i + 1]:-}" ;;
        --out=*) out="${args[i]#--out=}" ;;
    esac
done
if [[ -z "$out" ]]; then
    out="runs/${SLURM_JOB_NAME:-job}_${SLURM_JOB_ID}"
    args+=(--out "$out")
fi
source "$repo/launch/restarts.sh"  # MAX_RESTARTS (torchrun mode), --resume if-restarted

head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
port=$((15000 + SLURM_JOB_ID % 15000))  # same rule as init_distributed's srun branch
nnodes=${SLURM_JOB_NUM_NODES:-1}
gpus=${SLURM_GPUS_ON_NODE:-0}
nproc=${NPROC_PER_NODE:-}
if [[ -z "$nproc" ]]; then
    if [[ "$gpus" -gt 0 ]]; then nproc=$gpus; else nproc=${SLURM_CPUS_ON_NODE:-1}; fi
fi
mode=${LAUNCH_MODE:-torchrun}
if [[ $mode != torchrun && $mode != srun ]]; then
    echo "LAUNCH_MODE must be torchrun or srun, got '$mode'" >&2
    exit 2
fi
python_bin=${PYTHON:-python}
# srun no longer inherits --cpus-per-task from sbatch (Slurm >= 22.05): pass it on explicitly.
cpus=()
if [[ -n "${SLURM_CPUS_PER_TASK:-}" ]]; then cpus=(--cpus-per-task="$SLURM_CPUS_PER_TASK"); fi
# A marker left by an earlier attempt must not requeue this one if it fails before training.
rm -f "$out/PREEMPTED" "$out/STORE_UNAVAILABLE"

say "job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $nnodes node(s): $SLURM_JOB_NODELIST; mode $mode; out $out"
if [[ ${SLURM_RESTART_COUNT:-0} -gt 0 ]]; then
    :  # a requeue repeats arguments its first attempt checked; the workers check the checkpoint
elif [[ $mode == srun ]]; then
    check_before_launch "${SLURM_NTASKS:-1}" "${SLURM_NTASKS_PER_NODE:-${SLURM_NTASKS:-1}}"
else
    check_before_launch "$((nnodes * nproc))" "$nproc"
fi
case "$mode" in
    torchrun)
        # torchrun's agent must survive USR1 (by default it dies of it): `trap '' USR1` makes the
        # agent ignore it; the workers install their own handler and get the signal from SLURM.
        # Only the head node's agent hosts the rendezvous store (torchrun reads PET_RDZV_CONF as
        # --rdzv-conf): left to match the endpoint's name against its machine's names and
        # addresses, torchrun may find no host, or let any agent host where nodes share a machine.
        cmd=("$python_bin" -m torch.distributed.run --nnodes="$nnodes" --nproc-per-node="$nproc"
             --rdzv-backend=c10d --rdzv-endpoint="$head_node:$port" --rdzv-id="$SLURM_JOB_ID"
             --max-restarts="$max_restarts" "$script" "${args[@]}")
        say "+ srun --ntasks=$nnodes --ntasks-per-node=1 ${cpus[*]} ${cmd[*]}"
        HEAD_NODE=$head_node srun --ntasks="$nnodes" --ntasks-per-node=1 "${cpus[@]}" bash -c '
            trap "" USR1
            is_host=0; [[ $SLURMD_NODENAME == "$HEAD_NODE" ]] && is_host=1
            export PET_RDZV_CONF=is_host=$is_host
            exec "$@"' torchrun "${cmd[@]}"
        ;;
    srun)
        cmd=("$python_bin" "$script" "${args[@]}")
        say "+ MASTER_ADDR=$head_node MASTER_PORT=$port srun ${cpus[*]} ${cmd[*]}"
        MASTER_ADDR=$head_node MASTER_PORT=$port srun "${cpus[@]}" "${cmd[@]}"
        ;;
esac
rc=$?

if [[ $rc == 0 && -f "$out/PREEMPTED" ]]; then
    say "preempted at $(cat "$out/PREEMPTED"); requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID" || { say "scontrol requeue failed" >&2; exit 1; }
    exit 0
fi
# The object store did not answer for --store-timeout (the run checkpointed and exited 75; under
# torchrun, after its own restarts): requeued, up to STORE_REQUEUES times (requeues of any kind counted).
if [[ $rc != 0 && -f "$out/STORE_UNAVAILABLE" && ${SLURM_RESTART_COUNT:-0} -lt ${STORE_REQUEUES:-3} ]]; then
    say "training stopped because the object store did not answer ($out/STORE_UNAVAILABLE); requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID" || { say "scontrol requeue failed" >&2; exit 1; }
    exit 0
fi
say "training exited with code $rc"
exit $rc
