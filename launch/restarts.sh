# Sourced by the launch scripts (not run on its own): the check before the launch and torchrun's
# restart settings.
#
# Reads MAX_RESTARTS (default 3), PYTHON, `script` and the array `args` (the training script and
# its arguments); stops with one line and exit 2 when the script is not a file or PYTHON cannot
# import torch; sets `max_restarts`. Unless `args` already choose (--resume, --overwrite),
# --resume if-restarted is appended: the first attempt is a fresh run, refused like a plain one
# if --out holds a run, and only restarted attempts (torchrun restarts, SLURM requeues) continue
# from the newest checkpoint.
add_resume_if_restarted() {
    local arg
    for arg in "${args[@]}"; do
        case "$arg" in --resume|--resume=*|--overwrite) return 0 ;; esac
    done
    args+=(--resume if-restarted)
}

# `check_before_launch WORLD_SIZE LOCAL_WORLD_SIZE`: SCRIPT --check once, as rank 0 of such a
# launch, in this process: a mistake stops here with its one line and exit 2, before any worker
# starts (and before torchrun could restart it). With --check among the arguments, that is all.
check_before_launch() {
    local rc=0 arg
    RANK=0 LOCAL_RANK=0 WORLD_SIZE=$1 LOCAL_WORLD_SIZE=$2 "${PYTHON:-python}" "$script" "${args[@]}" --check || rc=$?
    if [[ $rc != 0 ]]; then exit "$rc"; fi
    for arg in "${args[@]}"; do
        if [[ "$arg" == --check ]]; then exit 0; fi
    done
}

launcher=$(basename "$0")
if [[ ! -f "$script" ]]; then
    echo "$launcher: '$script' is not a file; the training script comes first, e.g. NPROC=2 $launcher train_moco.py ARGS" >&2
    exit 2
fi
# find_spec, not import: this costs milliseconds, and the launch imports torch soon enough
if ! "${PYTHON:-python}" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("torch") is None)' 2>/dev/null; then
    echo "$launcher: '${PYTHON:-python}' cannot import torch; activate the project's environment (source .venv/bin/activate) or set PYTHON=.venv/bin/python" >&2
    exit 2
fi

max_restarts=${MAX_RESTARTS:-3}
if ! [[ $max_restarts =~ ^[0-9]+$ ]]; then
    echo "MAX_RESTARTS must be a whole number >= 0, got '$max_restarts'" >&2
    exit 2
fi
add_resume_if_restarted
if [[ $max_restarts -gt 0 ]]; then
    # torchrun shares its rendezvous store with the workers by default; a restarted group can then
    # read the dead group's addresses and hang at start-up (pytorch/pytorch#135712). A fresh store
    # per restart avoids it.
    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
fi
