# Sourced by the launch scripts (not run on its own): torchrun's restart settings.
#
# Reads MAX_RESTARTS (default 3) and the array `args` (the training script's arguments); sets
# `max_restarts`. With restarts on, --resume auto is appended to `args` (unless they already
# resume or overwrite), so a restarted group continues from the newest checkpoint.
add_resume_auto() {
    local arg
    for arg in "${args[@]}"; do
        case "$arg" in --resume|--resume=*|--overwrite) return 0 ;; esac
    done
    args+=(--resume auto)
}

max_restarts=${MAX_RESTARTS:-3}
if ! [[ $max_restarts =~ ^[0-9]+$ ]]; then
    echo "MAX_RESTARTS must be a whole number >= 0, got '$max_restarts'" >&2
    exit 2
fi
if [[ $max_restarts -gt 0 ]]; then
    add_resume_auto
    # torchrun shares its rendezvous store with the workers by default; a restarted group can then
    # read the dead group's addresses and hang at start-up (pytorch/pytorch#135712). A fresh store
    # per restart avoids it.
    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
fi
