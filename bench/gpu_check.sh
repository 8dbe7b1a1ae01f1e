#!/usr/bin/env bash
# One prepared check of the GPU fast path, at most 5 minutes on one GPU; installs nothing.
#
#   bash bench/gpu_check.sh                 # from the repository root; python3 as found
#   PYTHON=/path/to/python bash bench/gpu_check.sh
#   PYTHON=.venv/bin/python bash bench/gpu_check.sh --cpu-smoke   # the same steps, tiny, on the CPU
#
# Prints markdown ready to paste into the README: the date, python/torch/torchvision versions,
# nvidia-smi -L and the GPU's name and memory; then bench/throughput.py's table for ResNet-18
# 32 px classifier and MoCo (batch 512, bf16, synthetic data) and ResNet-50 224 px MoCo v2
# (--preset v2, synthetic data); then seconds per epoch of the CIFAR-10-size MoCo recipe on 50,000
# synthetic 32 px images (train_moco.py, one process, 2 epochs, the second reported). Every part
# runs under `timeout`, clamped so the whole script stays within GPU_CHECK_BUDGET seconds (default
# 285); a part that fails or times out is reported and the script goes on with the next one.
# One process at a time (NCCL cannot put two ranks on one GPU).
set -u

cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python3}
BUDGET=${GPU_CHECK_BUDGET:-285}
KILL_AFTER=5  # seconds between timeout's TERM and its KILL

if [ "${1:-}" = "--cpu-smoke" ]; then  # the same commands with tiny sizes, to check them without a GPU
    MODE="CPU smoke test (tiny sizes, not a measurement)"
    DEVICE=cpu; ARCH18=small_cnn; BATCH18=64; ARCH50=small_cnn; SIZE50=64; BATCH50=16
    ROUNDS=1; STEPS=(--steps 2 --warmup 1 --rounds $ROUNDS); STEPS50=(--steps 2 --warmup 1 --rounds $ROUNDS)
    EPOCH_ARCH=small_cnn; EPOCH_BATCH=64; EPOCH_SAMPLES=512; EPOCH_PRECISION="fp32 (--amp auto on CPU)"
elif [ $# -gt 0 ]; then
    echo "usage: bash bench/gpu_check.sh [--cpu-smoke]" >&2
    exit 2
else
    MODE="GPU check"
    DEVICE=cuda; ARCH18=resnet18; BATCH18=512; ARCH50=resnet50; SIZE50=224; BATCH50=${BATCH50:-256}
    ROUNDS=3; STEPS=(--steps 20 --warmup 5 --rounds $ROUNDS); STEPS50=(--steps 10 --warmup 5 --rounds $ROUNDS)
    EPOCH_ARCH=resnet18; EPOCH_BATCH=512; EPOCH_SAMPLES=50000; EPOCH_PRECISION="bf16 (--amp auto)"
fi

TMP=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX") || exit 1
trap 'rm -rf "$TMP"' EXIT
START=$SECONDS
FAILED=()   # "part (why)" for each part that failed
ERRLOGS=()  # their stderr files
PART_WHY="" # set by run_part when it fails

# run_part NAME LIMIT OUTFILE CMD...: CMD under `timeout LIMIT` (less if the budget runs low),
# stdout to OUTFILE, stderr to OUTFILE.err; returns CMD's exit code, and records a failure.
run_part() {
    local name=$1 limit=$2 out=$3
    shift 3
    local left=$((BUDGET - (SECONDS - START) - KILL_AFTER))
    ((limit > left)) && limit=$left
    if ((limit < 5)); then
        PART_WHY="not run: the ${BUDGET} s budget is spent"
        FAILED+=("$name ($PART_WHY)")
        : >"$out"; : >"$out.err"
        return 125
    fi
    timeout --kill-after="$KILL_AFTER" "$limit" "$@" >"$out" 2>"$out.err"
    local rc=$?
    if ((rc != 0)); then
        if ((rc == 124 || rc == 137)); then PART_WHY="timed out after ${limit} s"; else PART_WHY="exit code $rc"; fi
        FAILED+=("$name ($PART_WHY)")
        ERRLOGS+=("$name|$out.err")
    fi
    return "$rc"
}

echo "## ${MODE}, $(date -u '+%Y-%m-%d %H:%M UTC')"
echo

# ----------------------------------------------------------------------------- versions
echo "### Software"
echo
if run_part "versions" 30 "$TMP/versions" "$PY" -c '
import platform, torch, torchvision
cuda = torch.version.cuda or "none"
cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else "none"
print("| python | torch | torchvision | CUDA (torch build) | cuDNN |")
print("|---|---|---|---|---|")
print(f"| {platform.python_version()} | {torch.__version__} | {torchvision.__version__} | {cuda} | {cudnn} |")'; then
    cat "$TMP/versions"
else
    echo "versions: FAILED ($PART_WHY)"
fi
echo

echo "### GPU"
echo
if command -v nvidia-smi >/dev/null 2>&1; then
    echo '```'
    run_part "nvidia-smi -L" 15 "$TMP/smi_list" nvidia-smi -L && cat "$TMP/smi_list" || echo "nvidia-smi -L: FAILED ($PART_WHY)"
    echo '```'
    echo
    if run_part "nvidia-smi --query-gpu" 15 "$TMP/smi_query" nvidia-smi --query-gpu=name,memory.total --format=csv; then
        # CSV (header line first) -> markdown table
        awk -F', *' '{ printf "|"; for (i = 1; i <= NF; i++) printf " %s |", $i; print "";
                       if (NR == 1) { printf "|"; for (i = 1; i <= NF; i++) printf "---|"; print "" } }' "$TMP/smi_query"
    else
        echo "nvidia-smi --query-gpu: FAILED ($PART_WHY)"
    fi
else
    echo "nvidia-smi: not found on PATH"
    [ "$DEVICE" = cuda ] && FAILED+=("nvidia-smi (not found)")
fi
echo

# ----------------------------------------------------------------------------- throughput
echo "### Throughput (bench/throughput.py, one process, synthetic data)"
echo
CIFAR_MOCO=(--moco-k 4096 --moco-m 0.99 --moco-t 0.1 --no-mlp --aug v2-noblur)
ROW_NAMES=("ResNet-18 32 px classifier" "ResNet-18 32 px MoCo" "ResNet-50 224 px MoCo v2")
ROW_LIMITS=(60 60 90)
ROW_ARGS=(
    "--script classifier --arch $ARCH18 --image-size 32 --batch-size $BATCH18 ${STEPS[*]}"
    "--script moco --arch $ARCH18 --image-size 32 --batch-size $BATCH18 ${CIFAR_MOCO[*]} ${STEPS[*]}"
    "--script moco --preset v2 --arch $ARCH50 --image-size $SIZE50 --batch-size $BATCH50 ${STEPS50[*]}"
)
COMMON=(--device "$DEVICE" --dataset synthetic --amp bf16 --aug-on device --table row)
if run_part "throughput table header" 30 "$TMP/header" "$PY" bench/throughput.py --table header; then
    cat "$TMP/header"
else
    echo "throughput table header: FAILED ($PART_WHY)"
    echo
fi
for i in "${!ROW_NAMES[@]}"; do
    # shellcheck disable=SC2086  # ROW_ARGS hold plain words, split on purpose
    if run_part "${ROW_NAMES[$i]}" "${ROW_LIMITS[$i]}" "$TMP/row$i" "$PY" bench/throughput.py ${ROW_ARGS[$i]} "${COMMON[@]}"; then
        cat "$TMP/row$i"
    else
        echo "| ${ROW_NAMES[$i]}: FAILED ($PART_WHY) |"
    fi
done
echo
echo "step: the script's own train_one_epoch, per optimizer step (img/s per rank); floor: forward +"
echo "backward + optimizer step of the same model on a batch already on the GPU (MoCo: + key forward"
echo "and queue matmul); step/floor: what the data path, shuffle BN, momentum update, enqueue and"
echo "the per-step agreement cost on top; loader aug / device aug: the per-sample torchvision"
echo "pipeline (one CPU process) against the batched device module, samples/s (MoCo: two views)."
echo "Synthetic data is Gaussian noise, so its augmentation is crops and flips only. Best of $ROUNDS round(s)."
echo

# ----------------------------------------------------------------------------- one epoch of the CIFAR-10-size recipe
echo "### Seconds per epoch: MoCo CIFAR-10 recipe on ${EPOCH_SAMPLES} synthetic 32 px images (one process)"
echo
STEPS_PER_EPOCH=$((EPOCH_SAMPLES / EPOCH_BATCH))
EPOCH_CMD=(train_moco.py --dataset synthetic --synthetic-samples "$EPOCH_SAMPLES" --arch "$EPOCH_ARCH"
    --batch-size "$EPOCH_BATCH" --moco-k 4096 --moco-m 0.99 --moco-t 0.1 --no-mlp --aug v2-noblur
    --lr 0.06 --weight-decay 5e-4 --epochs 2 --knn-every 0 --device "$DEVICE"
    --log-every "$STEPS_PER_EPOCH" --out "$TMP/moco_epochs")
# --log-every = one epoch: the progress line at each epoch's last step gives that epoch's img/s
# (timed from the previous line, so epoch 2 includes epoch 1's checkpoint write).
t0=$(date +%s.%N)
if run_part "MoCo CIFAR-10 recipe, 2 epochs" 120 "$TMP/epochs" "$PY" "${EPOCH_CMD[@]}"; then
    wall=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
    epoch_rate() {  # img/s on the progress line of optimizer step $1
        grep -E " step $1/[0-9]+ .* img/s" "$TMP/epochs" | tail -n 1 | sed -E 's/.* ([0-9][0-9,.]*) img\/s.*/\1/' | tr -d ,
    }
    rate1=$(epoch_rate "$STEPS_PER_EPOCH")
    rate2=$(epoch_rate $((2 * STEPS_PER_EPOCH)))
    images=$((STEPS_PER_EPOCH * EPOCH_BATCH))
    secs() { awk -v n="$images" -v r="$1" 'BEGIN { if (r > 0) printf "%.1f", n / r; else printf "?" }'; }
    echo "| recipe | data | batch | steps/epoch | epoch 1 s (warm-up) | epoch 2 s | epoch 2 img/s | whole command s |"
    echo "|---|---|---:|---:|---:|---:|---:|---:|"
    echo "| $EPOCH_ARCH, K 4096, m 0.99, T 0.1, linear head, v2-noblur, $EPOCH_PRECISION | synthetic ${EPOCH_SAMPLES} x 32 px | $EPOCH_BATCH | $STEPS_PER_EPOCH | $(secs "${rate1:-0}") | $(secs "${rate2:-0}") | ${rate2:-?} | $wall |"
    if [ -z "${rate2:-}" ]; then
        FAILED+=("seconds per epoch (no progress line at step $((2 * STEPS_PER_EPOCH)) in the log)")
        ERRLOGS+=("seconds per epoch|$TMP/epochs")
    fi
else
    echo "| MoCo CIFAR-10 recipe, 2 epochs: FAILED ($PART_WHY) |"
fi
echo
echo "Command: \`python ${EPOCH_CMD[*]}\` (--out in a temp folder)."
echo

# ----------------------------------------------------------------------------- summary
echo "### Result"
echo
echo "Total $((SECONDS - START)) s."
if ((${#FAILED[@]} == 0)); then
    echo "All parts passed."
    exit 0
fi
echo "Failed parts:"
for f in "${FAILED[@]}"; do echo "- $f"; done
for entry in ${ERRLOGS[@]+"${ERRLOGS[@]}"}; do
    echo
    echo "Last lines of ${entry%%|*}'s output:"
    echo '```'
    tail -n 15 "${entry#*|}"
    echo '```'
done
exit 1
