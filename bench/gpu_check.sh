#!/usr/bin/env bash
# One prepared check of the GPU path on one GPU, within GPU_CHECK_BUDGET seconds (default 560,
# about 9 minutes; 900 for --cpu-smoke); installs nothing.
#
#   bash bench/gpu_check.sh                 # from anywhere; python3 as found
#   PYTHON=/path/to/python bash bench/gpu_check.sh
#   OUT=/some/folder bash bench/gpu_check.sh    # the log is $OUT/gpu_check.log
#   bash bench/gpu_check.sh --plan          # the plan only (each part's limit against the budget); runs nothing
#   PYTHON=.venv/bin/python bash bench/gpu_check.sh --cpu-smoke   # the same commands, tiny, on the CPU
#
# The order: the parts that decide come first.
#
# 0. pre-flight (bench/gpu_preflight.py): torch, torchvision (with its compiled ops), tensorboard
#    and numpy import, and torch can use the GPU; it also names /dev/shm's free room. Otherwise one
#    line says what is missing and the script exits 2 at once (on a machine without a GPU too).
# 1-7. decisive: an ImageNet-like folder of JPEGs (bench/imagenet_like.py, 2,560 + 80 images);
#    on it, bench/device_finish.py: nvJPEG against the CPU decoder on the same files (max and mean
#    absolute difference); the race probe (decode while a ResNet-50 backward is queued, 50 times:
#    decoded images against an idle GPU's and the CPU's, queued reads of freed memory against their
#    known values) and its control (20 times, the decoder without a stream of its own: above 0
#    shows the probe provokes the race); a sample's MoCo v2 views in a batch of 128 against alone
#    at its place and in an atlas of its own (max |diff|, at most 1e-5 and 1e-3 promised);
#    bench/gpu_hazards.py: what a CPU cannot show of the CUDA branches, a row each named for the
#    item of docs/performance.md's first-GPU-run list it shows ("hazard 1" ... "hazard 9"); then
#    bench/augment_capture.py: the packed augmentation captured (torch.compile fullgraph, a CUDA
#    graph of one atlas shape and batch size) against eager, exit 1 when they differ.
# 8-10. the loader: the workers and JPEG batch fitted to /dev/shm (gpu_preflight.py --shm: the most
#    workers whose batches host_memory.py's own check lets through, so that no part is refused; the
#    bound is in its fit_shared_memory), then device_finish.py's loader alone (no model) in img/s at
#    8 and all usable workers, both decode modes, with the host's share inside the decoder, and the
#    per-batch device time of each device_finish/* profiler range (copy, decode, crop, colour,
#    blur, normalize) with the peak memory.
# 11-19. throughput: a CIFAR-10-size folder of noise images (50,000 + 10,000 at 32 px, so that
#    colour jitter and grayscale run as on the real data); bench/throughput.py in bf16: ResNet-18
#    32 px classifier and MoCo with the CIFAR-10 demo's settings at batch 512 on synthetic data
#    (noise: its MoCo augmentation is crops and flips only), ResNet-50 224 px MoCo v2 at batch 256
#    with plain BatchNorm (--bn-splits 1, as each of 8 GPUs would run it) on the noise folder, so
#    that the full v2 recipe runs at 224 px (colour jitter, grayscale, blur on crops resized up
#    from 32 px); the JPEG path: ResNet-50 MoCo v2 and the linear probe at 224 px on the JPEG
#    folder, --aug-on device, decoded by the workers and by the GPU (--decode-on device): img/s and
#    the share of time waiting for data over steps 10-18 of the first epoch's 20 (after a warm-up
#    interval; no checkpoint, no epoch start inside); the CIFAR-10 demo recipe
#    (recipes/moco_cifar10_demo.json, one process, split BN in 8 groups, --amp bf16 --tf32) on the
#    noise folder: epoch 2's time from the log's "epoch 2 trained in X s" line (training only), one
#    kNN pass (bank 50,000, 10,000 queries), and the CUDA syncs per optimizer step after 10 warm-up
#    steps (torch.cuda.set_sync_debug_mode("warn"), bench/cuda_syncs.py).
# 20-21. smoke runs of the paths the figures above leave out: the classifier with --compile, fp16,
#    --clip-grad and --accum-steps 2 through one evaluate(); MoCo with --aug-on loader --workers 4
#    (pinned memory; fewer if /dev/shm is small) through one kNN pass, with its CUDA syncs per step.
#
# The budget. Every part runs under `timeout` at its own limit (PART_SPECS below), the pre-flight
# included, clamped to what is left of the budget; each part's worst case is its limit + 5 s (the
# time between timeout's TERM and KILL), and 5 s are kept for the script itself. Before running,
# the script prints the plan: each part's limit, the parts planned and their total against the
# budget. The pre-flight and the decisive parts are always planned; a budget smaller than they
# need (390 s on a GPU) is refused at once, one line, exit 2. The others are planned in order while
# their limits fit; the first that does not fit and those after it run only if, when their turn
# comes, the time left still covers their whole limit (the decisive parts rarely use all of
# theirs), else they get a "not run" row. At 560 s the plan holds the pre-flight, the decisive
# parts, the /dev/shm fit, the loader and the breakdown (545 s); the throughput rows and the
# smoke runs run on the time those leave; GPU_CHECK_BUDGET=1270 plans every part.
#
# The output. Every line goes to the console and to a log: $OUT/gpu_check.log when OUT is set,
# else runs/gpu_check/<UTC time>.log in the repository (a mktemp file if that cannot be written),
# named on the first line and the last. A line as each part starts and as it ends (its outcome and
# seconds), its table rows as it ends; at the end, after the last lines of what failed, the whole
# markdown table again (one row per figure, ready for the README), then one line of outcome, so
# that a console that keeps only its last lines still holds the complete table.
#
# --cpu-smoke: the same parts in the same order with tiny sizes on the CPU, in two lanes side by
# side (lane 1: the JPEG folder, the parts that read it and the JPEG path's MoCo rows; lane 2: the
# others, and the JPEG path's linear probe rows once lane 1 has fitted /dev/shm), each lane in the
# order above, planned per lane; the table in the order above.
#
# Exit code: 0 when every part that ran passed (a line names those left out for the budget), 1 when
# one failed or timed out (its row says FAILED; the script goes on), 2 when the machine cannot run
# the check or the budget cannot hold the pre-flight and the decisive parts.
set -u

cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python3}
KILL_AFTER=5  # seconds between timeout's TERM and its KILL
MARGIN=5      # seconds of the budget kept for the script's own work between the parts

SMOKE="" PLAN_ONLY=""
for arg in "$@"; do
    case "$arg" in
    --cpu-smoke) SMOKE=1 ;;
    --plan) PLAN_ONLY=1 ;;
    *)
        echo "usage: bash bench/gpu_check.sh [--cpu-smoke] [--plan]" >&2
        exit 2
        ;;
    esac
done
BUDGET=${GPU_CHECK_BUDGET:-560}
[ -n "$SMOKE" ] && BUDGET=${GPU_CHECK_BUDGET:-900}  # the CPU's limits are longer than a GPU's
if ! [[ "$BUDGET" =~ ^[0-9]+$ ]]; then
    echo "gpu_check: GPU_CHECK_BUDGET=$BUDGET: a whole number of seconds, please" >&2
    exit 2
fi

case "${SMOKE:+--cpu-smoke}" in
--cpu-smoke)  # the same commands with tiny sizes, to check them without a GPU
    MODE="CPU smoke test (tiny sizes, not a measurement)"
    LANES=2
    PREFLIGHT=(--cpu)
    DEVICE=cpu; ARCH18=small_cnn; BATCH18=64; ARCH50=small_cnn; SIZE50=64; BATCH50=16
    STEPS=(--steps 2 --warmup 1 --rounds 1)
    CIFAR_TRAIN=1024; CIFAR_TEST=256; RECIPE_SIZE=(--arch small_cnn --batch-size 128 --bn-splits 2)
    COMPILE=(); SMOKE_ARCH=small_cnn; SMOKE_BATCH=32
    # the classifier's smoke run: 2 optimizer steps of 2 micro-batches, kept small because fp16
    # convolutions are far slower than fp32 ones on a CPU
    CLASSIFIER_SMOKE=(--image-size 16 --batch-size 8 --synthetic-samples 32)
    SMOKE_WARMUP=2; SMOKE_STEPS=6  # the MoCo smoke run: steps not counted for syncs, steps in all
    JPEG_PER_CLASS=4; JPEG_BATCH=8; JPEG_STEPS=4; JPEG_LOG=2  # 5 steps an epoch: steps 3-4 parsed
    DF_FILES=0; RACE=(--iterations 2 --arch resnet18); RACE_CONTROL=(--iterations 2 --arch resnet18)
    LOADER_WORKERS=(1 2); BREAKDOWN_WORKERS=1; SMOKE_WORKERS=4
    LOADER_BATCHES=(--warmup-batches 1 --batches 4); BREAKDOWN=(--warmup-batches 1 --batches 2)
    ;;
"")
    MODE="GPU check"
    LANES=1
    PREFLIGHT=()
    DEVICE=cuda; ARCH18=resnet18; BATCH18=512; ARCH50=resnet50; SIZE50=224; BATCH50=${BATCH50:-256}
    STEPS=(--steps 20 --warmup 5 --rounds 3)
    CIFAR_TRAIN=50000; CIFAR_TEST=10000; RECIPE_SIZE=()
    COMPILE=(--compile); SMOKE_ARCH=resnet18; SMOKE_BATCH=256
    CLASSIFIER_SMOKE=(--image-size 32 --batch-size "$SMOKE_BATCH" --synthetic-samples 4096)
    SMOKE_WARMUP=10; SMOKE_STEPS=40
    JPEG_PER_CLASS=256; JPEG_BATCH=128; JPEG_STEPS=18; JPEG_LOG=9  # 20 steps an epoch: steps 10-18 parsed
    # bench/device_finish.py: decode-diff's files, the race probe's and its control's iterations, the
    # loader's workers (-1: every usable CPU but the rank's; both capped by /dev/shm) and batches
    # (4 + 16: the first epoch's 20), the breakdown's workers and profiled batches
    DF_FILES=512; RACE=(--iterations 50 --arch resnet50); RACE_CONTROL=(--iterations 20 --arch resnet50)
    LOADER_WORKERS=(8 -1); BREAKDOWN_WORKERS=4; SMOKE_WORKERS=4
    LOADER_BATCHES=(--warmup-batches 4 --batches 16); BREAKDOWN=(--warmup-batches 2 --batches 5)
    ;;
esac

# ----------------------------------------------------------------------------- the parts and their limits
# key | tier | lane in --cpu-smoke | limit on a GPU, s | limit in --cpu-smoke, s | the table's part | what it runs.
# In this order on a GPU, one after another; --cpu-smoke runs lane 1 beside lane 2, each in this order.
PREFLIGHT_LIMIT=45; ((LANES == 2)) && PREFLIGHT_LIMIT=60
PART_SPECS=(
    "jpeg_folder|decisive|1|45|45|JPEG path|writing the ImageNet-like JPEG folder"
    "decode|decisive|1|30|45|device decode|device_finish.py decode-diff: nvJPEG against the CPU decoder"
    "race|decisive|1|45|45|race probe|device_finish.py race: decode while a backward is queued"
    "race_control|decisive|1|30|45|race probe|device_finish.py race --unprotected: the control"
    "independence|decisive|1|30|45|batch independence|device_finish.py independence: views in a batch against alone"
    "hazards|decisive|1|60|90|first-run hazards|gpu_hazards.py: what a CPU cannot show, a row each"
    "capture|decisive|2|60|90|graph capture|augment_capture.py: the augmentation captured against eager"
    "shm|loader|1|20|45|/dev/shm|gpu_preflight.py --shm: workers and batch fitted to /dev/shm"
    "loader|loader|1|75|75|loader|device_finish.py loader: FinishOnDevice batches alone"
    "breakdown|loader|1|45|75|device finish|device_finish.py breakdown: FinishOnDevice.finish under torch.profiler"
    "cifar_folder|throughput|2|30|30|noise CIFAR-10 folder|writing the noise CIFAR-10 folder"
    "tp_classifier|throughput|2|45|60|throughput|throughput.py: ResNet-18 32 px classifier"
    "tp_moco|throughput|2|45|60|throughput|throughput.py: ResNet-18 32 px MoCo"
    "tp_v2|throughput|2|60|90|throughput|throughput.py: ResNet-50 224 px MoCo v2, full v2 recipe"
    "jpeg_moco_loader|throughput|1|60|75|JPEG path|JPEG path: ResNet-50 MoCo v2, --decode-on loader"
    "jpeg_probe_loader|throughput|2|60|75|JPEG path|JPEG path: ResNet-50 linear probe, --decode-on loader"
    "jpeg_moco_device|throughput|1|60|75|JPEG path|JPEG path: ResNet-50 MoCo v2, --decode-on device"
    "jpeg_probe_device|throughput|2|60|75|JPEG path|JPEG path: ResNet-50 linear probe, --decode-on device"
    "recipe|throughput|2|90|120|CIFAR-10 demo recipe|the CIFAR-10 demo recipe: 2 epochs, one kNN pass"
    "smoke_classifier|smoke|2|100|60|smoke|smoke: classifier (--compile on a GPU), fp16, --clip-grad, --accum-steps 2"
    "smoke_moco|smoke|2|60|60|smoke|smoke: MoCo --aug-on loader, pinned memory, one kNN pass"
)
KEYS=() TIERS=() LANE_OF=() LIMITS=() ROW_OF=() WHAT_OF=() PLANNED=()
for spec in "${PART_SPECS[@]}"; do
    IFS='|' read -r key tier lane gpu_limit smoke_limit row what <<<"$spec"
    KEYS+=("$key"); TIERS+=("$tier"); ROW_OF+=("$row"); WHAT_OF+=("$what")
    if ((LANES == 2)); then LANE_OF+=("$lane"); LIMITS+=("$smoke_limit"); else LANE_OF+=(1); LIMITS+=("$gpu_limit"); fi
done
NPARTS=${#KEYS[@]}

# The plan, per lane (one on a GPU): the pre-flight, the script's margin and the decisive parts
# first, then the others in order while their limits + KILL_AFTER fit the budget.
declare -A USED=() OPEN=() DECISIVE=() EVERY=()
for ((lane = 1; lane <= LANES; lane++)); do
    USED[$lane]=$((PREFLIGHT_LIMIT + KILL_AFTER + MARGIN)); OPEN[$lane]=1; DECISIVE[$lane]=${USED[$lane]}
    EVERY[$lane]=${USED[$lane]}
done
for ((i = 0; i < NPARTS; i++)); do
    lane=${LANE_OF[i]} cost=$((LIMITS[i] + KILL_AFTER))
    EVERY[$lane]=$((EVERY[$lane] + cost))
    if [ "${TIERS[i]}" = decisive ]; then
        PLANNED[i]=1; USED[$lane]=$((USED[$lane] + cost)); DECISIVE[$lane]=${USED[$lane]}
    elif ((OPEN[$lane] && USED[$lane] + cost <= BUDGET)); then
        PLANNED[i]=1; USED[$lane]=$((USED[$lane] + cost))
    else
        PLANNED[i]=0; OPEN[$lane]=0
    fi
done
NEED=0 ALL_PARTS=0  # the budget the decisive parts need, the budget that plans every part
for ((lane = 1; lane <= LANES; lane++)); do
    ((DECISIVE[$lane] > NEED)) && NEED=${DECISIVE[$lane]}
    ((EVERY[$lane] > ALL_PARTS)) && ALL_PARTS=${EVERY[$lane]}
done
if ((BUDGET < NEED)); then
    echo "gpu_check: GPU_CHECK_BUDGET=$BUDGET s is less than the pre-flight and the decisive parts need ($NEED s: their limits, +$KILL_AFTER s each, +$MARGIN s); set GPU_CHECK_BUDGET=$NEED or more" >&2
    exit 2
fi

print_plan() {
    local i lane lanes_said="" unplanned=0
    ((LANES == 2)) && lanes_said=" per lane (--cpu-smoke runs its 2 lanes side by side)"
    echo "plan for GPU_CHECK_BUDGET=$BUDGET s$lanes_said: each part under \`timeout\` at its limit, +$KILL_AFTER s between its TERM and KILL; +$MARGIN s for the script itself"
    printf '  %2d. %-72s %4d s  %s%s\n' 0 "pre-flight: gpu_preflight.py" "$PREFLIGHT_LIMIT" decisive \
        "$( ((LANES == 2)) && echo "  (before the lanes)")"
    for ((i = 0; i < NPARTS; i++)); do
        local state=planned
        [ "${TIERS[i]}" = decisive ] && state=decisive
        ((PLANNED[i])) || { state="if time is left"; unplanned=$((unplanned + 1)); }
        printf '  %2d. %-72s %4d s  %s%s\n' $((i + 1)) "${WHAT_OF[i]}" "${LIMITS[i]}" "$state" \
            "$( ((LANES == 2)) && echo "  (lane ${LANE_OF[i]})")"
    done
    for ((lane = 1; lane <= LANES; lane++)); do
        local which="planned"
        ((LANES == 2)) && which="lane $lane planned"
        echo "$which: ${USED[$lane]} s of the $BUDGET s budget (the pre-flight and the decisive parts: ${DECISIVE[$lane]} s)"
    done
    if ((unplanned)); then
        echo "if time is left: $unplanned part(s), each run only if the time left covers its limit; GPU_CHECK_BUDGET=$ALL_PARTS plans every part"
    fi
}
if [ -n "$PLAN_ONLY" ]; then
    print_plan
    exit 0
fi

# ----------------------------------------------------------------------------- pre-flight
# One line on stderr and exit 2 when the machine cannot run the check (in $OUT/gpu_check.log too
# when OUT is set); the log of a run that starts is opened after it.
die() {
    echo "$1" >&2
    if [ -n "${OUT:-}" ] && mkdir -p "$OUT" 2>/dev/null; then echo "$1" >"$OUT/gpu_check.log"; fi
    exit 2
}
if ! command -v "$PY" >/dev/null; then
    die "gpu_check: no python at PYTHON=$PY; set PYTHON=/path/to/python"
fi
TMP=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX") || exit 1
trap 'rm -rf "$TMP"' EXIT
START=$SECONDS  # the budget counts from here: the pre-flight is in it
MACHINE=$(timeout --kill-after="$KILL_AFTER" "$PREFLIGHT_LIMIT" "$PY" bench/gpu_preflight.py "${PREFLIGHT[@]}" 2>"$TMP/preflight.err")
rc=$?
if ((rc == 124 || rc == 137)); then
    die "gpu_check: the pre-flight (bench/gpu_preflight.py: importing torch, torchvision, tensorboard and asking for the GPU) took longer than its ${PREFLIGHT_LIMIT} s limit"
elif ((rc != 0)); then
    why=$(cat "$TMP/preflight.err")
    die "${why:-gpu_check: bench/gpu_preflight.py exited with code $rc and said nothing}"
fi
PREFLIGHT_TOOK=$((SECONDS - START))

if [ -n "${OUT:-}" ] && mkdir -p "$OUT" 2>/dev/null && : >"$OUT/gpu_check.log" 2>/dev/null; then
    LOG="$OUT/gpu_check.log"
elif mkdir -p runs/gpu_check 2>/dev/null && LOG="$PWD/runs/gpu_check/$(date -u '+%Y%m%d-%H%M%S').log" && : >"$LOG" 2>/dev/null; then
    :
else
    LOG=$(mktemp "${TMPDIR:-/tmp}/gpu_check.XXXXXX.log") || exit 1
fi
case "$LOG" in /*) ;; *) LOG="$PWD/$LOG" ;; esac

FAILED_LIST="$TMP/failed"  # "part|its output file" for each part that failed, from either lane
NOT_RUN_LIST="$TMP/not_run"  # the parts left out for the budget
: >"$FAILED_LIST"
: >"$NOT_RUN_LIST"
mkdir -p "$TMP/rows" "$TMP/done"
PART_WHY="" PART_RC=0 PART_LIMIT=0

# run_part NAME OUTFILE CMD...: CMD under `timeout PART_LIMIT` (less if the budget runs low),
# stdout and stderr to OUTFILE; returns CMD's exit code (PART_RC too) and records a failure.
run_part() {
    local name=$1 out=$2 limit=$PART_LIMIT
    shift 2
    local left=$((BUDGET - (SECONDS - START) - KILL_AFTER))
    ((limit > left)) && limit=$left
    if ((limit < 5)); then
        PART_WHY="not run: the ${BUDGET} s budget is spent"
        : >"$out"
        echo "$name|$out" >>"$FAILED_LIST"
        PART_RC=125
        return 125
    fi
    timeout --kill-after="$KILL_AFTER" "$limit" "$@" >"$out" 2>&1
    PART_RC=$?
    if ((PART_RC != 0)); then
        if ((PART_RC == 124 || PART_RC == 137)); then PART_WHY="timed out after ${limit} s"; else PART_WHY="exit code $PART_RC"; fi
        echo "$name|$out" >>"$FAILED_LIST"
    fi
    return "$PART_RC"
}

# await_part KEY: wait (at most this part's limit) until part KEY has ended: in --cpu-smoke it may
# run in the other lane; one after another on a GPU, it has.
await_part() {
    local deadline=$((SECONDS + PART_LIMIT))
    while [ ! -e "$TMP/done/$1" ] && ((SECONDS < deadline)); do sleep 1; done
}

# field FILE REGEX: the first capture group of the last line of FILE matching REGEX (sed -E)
field() { grep -E "$2" "$1" | tail -n 1 | sed -E "s#.*$2.*#\\1#"; }

# ----------------------------------------------------------------------------- the parts
# Each part_KEY runs one command through run_part and prints its rows (or a FAILED row).
JPEG="$TMP/jpeg"
JPEG_OK="$TMP/jpeg.ok"  # made once the folder is written: the other lane reads it too
CIFAR="$TMP/cifar" CIFAR_PATH=""

part_jpeg_folder() {
    if run_part "ImageNet-like JPEG folder" "$TMP/jpeg.log" "$PY" bench/imagenet_like.py "$JPEG" \
        --classes 10 --train-per-class "$JPEG_PER_CLASS" --val-per-class 8; then
        : >"$JPEG_OK"
    else
        echo "| JPEG path | writing the ImageNet-like folder | FAILED | $PART_WHY |"
    fi
}

# The device finish: bench/device_finish.py on the JPEG folder, each part its own process and limit:
# nvJPEG against the CPU decoder; the race probe (exit 1 when an iteration differed: its row, then a
# FAILED row), then its control (the decoder without a stream of its own, in a process of its own, as
# it may corrupt what the backward reads: above 0 shows the probe provokes the race); a sample's
# views in a batch against alone (the blur's, grayscale's and jitter's sub-batches change size with
# the batch); later the loader alone (no model) and the per-batch profile of FinishOnDevice.finish.
# device_part ROW WHAT ARGS...: one part, its rows, or what it printed and a FAILED row
device_part() {
    local name=$1 what=$2
    shift 2
    local out="$TMP/device_${KEY}.log"
    if [ ! -e "$JPEG_OK" ]; then
        echo "| $name | $what | FAILED | not run: no ImageNet-like folder |"
        return
    fi
    run_part "device finish: $name ($KEY)" "$out" "$PY" bench/device_finish.py --data-dir "$JPEG" --device "$DEVICE" \
        --image-size "$SIZE50" "$@"
    local rc=$?
    grep -E "^\| $name \|" "$out"
    ((rc == 0)) || echo "| $name | $what | FAILED | $PART_WHY |"
}
part_decode() {
    device_part "device decode" "decode_on($DEVICE) vs decode_cpu" decode-diff --batch-size "$JPEG_BATCH" --files "$DF_FILES"
}
part_race() {
    device_part "race probe" "decode_on($DEVICE) while a backward is queued" race --batch-size "$JPEG_BATCH" "${RACE[@]}"
}
part_race_control() {
    device_part "race probe" "the control: decode without a stream of its own" race --unprotected \
        --batch-size "$JPEG_BATCH" "${RACE_CONTROL[@]}"
}
part_independence() {
    device_part "batch independence" "views in a packed batch against each alone" independence --batch-size "$JPEG_BATCH"
}

# What a CPU cannot show of the CUDA branches (bench/gpu_hazards.py): a row each, "hazard N" for
# the item of the first GPU run's list it shows (docs/performance.md).
part_hazards() {
    local what="bench/gpu_hazards.py --device $DEVICE: what a CPU cannot show"
    if [ ! -e "$JPEG_OK" ]; then
        echo "| first-run hazards | $what | FAILED | not run: no ImageNet-like folder |"
        return
    fi
    run_part "first-run hazards" "$TMP/hazards.log" "$PY" bench/gpu_hazards.py --data-dir "$JPEG" --device "$DEVICE" \
        --image-size "$SIZE50" --batch-size "$JPEG_BATCH"
    local rc=$?
    grep -E "^\| hazard " "$TMP/hazards.log"
    ((rc == 0)) || echo "| first-run hazards | $what | FAILED | $PART_WHY |"
}

part_capture() {
    local what="bench/augment_capture.py --device $DEVICE: the packed augmentation captured as a graph against eager"
    if [ ! -f bench/augment_capture.py ]; then
        echo "| graph capture | $what | FAILED | not run: bench/augment_capture.py is missing |"
        echo "graph capture|/dev/null" >>"$FAILED_LIST"
        PART_RC=2 PART_WHY="bench/augment_capture.py is missing"
        return
    fi
    run_part "graph capture" "$TMP/capture.log" "$PY" bench/augment_capture.py --device "$DEVICE"
    local rc=$? said  # what it printed, one line a check: joined, its last 600 characters
    said=$(grep -v '^[[:space:]]*$' "$TMP/capture.log" | sed 's/|/\\|/g' | paste -s -d ';' | sed 's/;/; /g' | tail -c 600)
    if ((rc == 0)); then
        echo "| graph capture | $what | equal | ${said:-exit 0} |"
    elif ((rc == 1)); then
        echo "| graph capture | $what | FAILED: differs | ${said:-exit 1: the captured augmentation differs from eager} |"
    else
        echo "| graph capture | $what | FAILED | $PART_WHY${said:+; $said} |"
    fi
}

# The workers and the JPEG batch of the parts whose workers hand batches over through /dev/shm,
# fitted to it by gpu_preflight.py --shm (host_memory.py's bound; its docstring has the formula).
# Written to $TMP/shm.sizes; without it those parts run without workers (nothing in /dev/shm).
part_shm() {
    local jpeg=()
    [ -e "$JPEG_OK" ] && jpeg=(--jpeg-dir "$JPEG")
    if run_part "fit to /dev/shm" "$TMP/shm.log" "$PY" bench/gpu_preflight.py --shm "${jpeg[@]}" --batch "$JPEG_BATCH" \
        --image-size "$SIZE50" --workers "${LOADER_WORKERS[@]}" -1 "$BREAKDOWN_WORKERS" --smoke-batch "$SMOKE_BATCH" \
        --smoke-workers "$SMOKE_WORKERS"; then
        grep -E '^batch=' "$TMP/shm.log" | tail -n 1 >"$TMP/shm.sizes"
        grep -E '^\| /dev/shm \|' "$TMP/shm.log"
    else
        echo "| /dev/shm | fitting the loader parts' workers to it | FAILED | $PART_WHY; those parts run without workers |"
    fi
}
# shm_sizes: SHM_BATCH, LOADER_FIT (the loader part's workers), ALL_FIT (-1's), BREAKDOWN_FIT and
# SMOKE_FIT from $TMP/shm.sizes (gpu_preflight.py resolves the counts asked, in their order); no
# workers when it is missing.
shm_sizes() {
    SHM_BATCH=$JPEG_BATCH LOADER_FIT=(0) ALL_FIT=0 BREAKDOWN_FIT=0 SMOKE_FIT=0 SHM_SAID=" (no /dev/shm fit: no workers)"
    [ -s "$TMP/shm.sizes" ] || return 0
    local word resolved=() n=${#LOADER_WORKERS[@]} i
    for word in $(cat "$TMP/shm.sizes"); do
        case "$word" in
        batch=*) SHM_BATCH=${word#batch=} ;;
        workers=*) IFS=',' read -r -a resolved <<<"${word#workers=}" ;;
        smoke_workers=*) SMOKE_FIT=${word#smoke_workers=} ;;
        esac
    done
    ((${#resolved[@]} == n + 2)) || return 0
    LOADER_FIT=()
    for ((i = 0; i < n; i++)); do  # repeats left out
        [[ " ${LOADER_FIT[*]} " == *" ${resolved[i]} "* ]] || LOADER_FIT+=("${resolved[i]}")
    done
    ALL_FIT=${resolved[n]} BREAKDOWN_FIT=${resolved[n + 1]} SHM_SAID=""
}

part_loader() {
    shm_sizes
    device_part "loader" "FinishOnDevice batches alone$SHM_SAID" loader --batch-size "$SHM_BATCH" --workers "${LOADER_FIT[@]}" \
        "${LOADER_BATCHES[@]}"
}
part_breakdown() {
    shm_sizes
    device_part "device finish" "FinishOnDevice.finish under torch.profiler$SHM_SAID" breakdown --batch-size "$SHM_BATCH" \
        --loader-workers "$BREAKDOWN_FIT" "${BREAKDOWN[@]}"
}

# The noise CIFAR-10 folder: the ResNet-50 MoCo v2 throughput row, the demo recipe and the MoCo
# smoke run read it.
part_cifar_folder() {
    if run_part "noise CIFAR-10 folder" "$TMP/cifar.log" "$PY" -c \
        "import sys; sys.path.insert(0, 'tests'); from fake_cifar import write_noise_cifar10, cifar_env; \
    write_noise_cifar10('$CIFAR', $CIFAR_TRAIN, $CIFAR_TEST); print(cifar_env('$TMP/site')['PYTHONPATH'])"; then
        CIFAR_PATH=$(tail -n 1 "$TMP/cifar.log")  # the md5 check of torchvision's CIFAR10 off, for these files only
    else
        echo "| noise CIFAR-10 folder | writing it (the v2 throughput row, the demo recipe and the MoCo smoke run read it) | FAILED | $PART_WHY |"
    fi
}

# throughput_row NAME ARGS...: bench/throughput.py in bf16 with device augmentation. The ResNet-50
# row reads the noise CIFAR-10 folder: synthetic data's MoCo recipe is crops and flips only,
# CIFAR-10's is the whole v2 one (colour jitter, grayscale, blur), run on the 224 px crops.
throughput_row() {
    local name=$1 row_env=()
    shift
    if [[ " $* " == *" --dataset cifar10 "* ]]; then
        if [ -z "$CIFAR_PATH" ]; then
            echo "| throughput | $name | FAILED | not run: no noise CIFAR-10 folder |"
            return
        fi
        row_env=("PYTHONPATH=$CIFAR_PATH")
    fi
    local out="$TMP/throughput_${KEY}.log"
    if run_part "throughput: $name" "$out" env "${row_env[@]}" "$PY" bench/throughput.py "$@" --device "$DEVICE" \
        --amp bf16 --aug-on device --table brief "${STEPS[@]}"; then
        grep -E '^\| throughput' "$out"
    else
        echo "| throughput | $name | FAILED | $PART_WHY |"
    fi
}
CIFAR_MOCO=(--moco-k 4096 --moco-m 0.99 --moco-t 0.1 --no-mlp --aug v2-noblur)
part_tp_classifier() {
    throughput_row "ResNet-18 32 px classifier" --script classifier --dataset synthetic --arch "$ARCH18" --image-size 32 \
        --batch-size "$BATCH18"
}
part_tp_moco() {
    throughput_row "ResNet-18 32 px MoCo" --script moco --dataset synthetic --arch "$ARCH18" --image-size 32 \
        --batch-size "$BATCH18" "${CIFAR_MOCO[@]}"
}
part_tp_v2() {
    throughput_row "ResNet-50 224 px MoCo v2, full v2 recipe" --script moco --preset v2 --dataset cifar10 --data-dir "$CIFAR" \
        --arch "$ARCH50" --image-size "$SIZE50" --batch-size "$BATCH50" --bn-splits 1
}

# The JPEG path: ResNet-50 MoCo v2 and the linear probe on the ImageNet-like folder, --aug-on device,
# decoded by the workers (CPU) and by the GPU (--decode-on device), with the workers and batch fitted
# to /dev/shm: img/s and the share of time the loop waited for data, from the last progress line: the
# second --log-every interval, steps JPEG_LOG+1 to JPEG_STEPS (GPU: 10-18), inside the first epoch
# (GPU: 20 steps at batch 128), so it holds neither the first batches and cuDNN's autotuning (the
# first interval) nor an epoch's end (its checkpoint, the next epoch's refill of the workers'
# prefetch); --max-steps's checkpoint comes after the line.
jpeg_run() {
    local script=$1 decode=$2 cmd what
    if [ "$script" = moco ]; then
        cmd=(train_moco.py --preset v2 --moco-k 16384 --bn-splits 1 --knn-every 0)
        what="$ARCH50 MoCo v2, --decode-on $decode"
    else
        cmd=(train_classifier.py --linear-probe --lr 30 --weight-decay 0)
        what="$ARCH50 linear probe, --decode-on $decode"
    fi
    await_part shm  # the workers and batch fitted to /dev/shm (after the folder is written)
    if [ ! -e "$JPEG_OK" ]; then
        echo "| JPEG path | $what | FAILED | not run: no ImageNet-like folder |"
        return
    fi
    shm_sizes
    local out="$TMP/jpeg_${script}_${decode}.log"
    if run_part "JPEG path: $what" "$out" "$PY" "${cmd[@]}" --dataset imagefolder --data-dir "$JPEG" \
        --device "$DEVICE" --arch "$ARCH50" --image-size "$SIZE50" --batch-size "$SHM_BATCH" --aug-on device \
        --decode-on "$decode" --workers "$ALL_FIT" --epochs 100 --max-steps "$JPEG_STEPS" --ckpt-every 0 \
        --log-every "$JPEG_LOG" --out "$TMP/jpeg_${script}_${decode}"; then
        local rate wait
        rate=$(field "$out" ' ([0-9,.]+) img/s data wait')
        wait=$(field "$out" 'data wait ([0-9]+)%')
        echo "| JPEG path | $what, batch $SHM_BATCH, $(field "$out" '([0-9]+ DataLoader worker\(s\) per rank)')$SHM_SAID | ${rate:-?} img/s | steps $((JPEG_LOG + 1))-$JPEG_STEPS of epoch 1 (no checkpoint, no epoch start); waited for data ${wait:-?}% of them |"
    else
        echo "| JPEG path | $what | FAILED | $PART_WHY |"
    fi
}
part_jpeg_moco_loader() { jpeg_run moco loader; }
part_jpeg_probe_loader() { jpeg_run probe loader; }
part_jpeg_moco_device() { jpeg_run moco device; }
part_jpeg_probe_device() { jpeg_run probe device; }

part_recipe() {
    local what="moco_cifar10_demo.json, --amp bf16 --tf32, CIFAR-10-size noise folder ($CIFAR_TRAIN + $CIFAR_TEST)"
    if [ -z "$CIFAR_PATH" ]; then
        echo "| CIFAR-10 demo recipe | $what | FAILED | not run: no noise CIFAR-10 folder |"
        return
    fi
    if PYTHONPATH="$CIFAR_PATH" run_part "CIFAR-10 demo recipe" "$TMP/recipe.log" "$PY" bench/cuda_syncs.py --warmup-steps 10 \
        train_moco.py --config recipes/moco_cifar10_demo.json --data-dir "$CIFAR" --device "$DEVICE" --amp bf16 --tf32 \
        --epochs 2 "${RECIPE_SIZE[@]}" --log-every 1000 --out "$TMP/recipe"; then
        local epoch rate knn syncs
        epoch=$(field "$TMP/recipe.log" 'epoch 2 trained in ([0-9.]+) s')
        rate=$(field "$TMP/recipe.log" 'epoch 2 trained in [0-9.]+ s \(([0-9,.]+) img/s')
        knn=$(field "$TMP/recipe.log" 'kNN acc1 .* in ([0-9.]+) s')  # the last pass: after epoch 2
        syncs=$(field "$TMP/recipe.log" 'CUDA syncs per optimizer step: (.*)')
        echo "| CIFAR-10 demo recipe | $what: epoch 2, training only | ${epoch:-?} s | ${rate:-?} img/s; colour jitter and grayscale included; no checkpoint, no kNN |"
        echo "| CIFAR-10 demo recipe | one kNN pass after epoch 2 (k 200, bank $CIFAR_TRAIN, $CIFAR_TEST queries) | ${knn:-?} s | the head's 128-d features, bf16 bank |"
        echo "| CUDA syncs | the recipe's steps (--aug-on device) | ${syncs:-?} | budget: 1 per step (the ranks' agreement) |"
    else
        echo "| CIFAR-10 demo recipe | $what | FAILED | $PART_WHY |"
    fi
}

SMOKE_ARGS=(--device "$DEVICE" --arch "$SMOKE_ARCH" --log-every 1000)
part_smoke_classifier() {
    local what="classifier ${COMPILE[*]:-(no --compile on the CPU)} --amp fp16 --clip-grad 1 --accum-steps 2, one epoch + evaluate()"
    if run_part "smoke: classifier" "$TMP/smoke_classifier.log" "$PY" train_classifier.py "${SMOKE_ARGS[@]}" "${COMPILE[@]}" \
        "${CLASSIFIER_SMOKE[@]}" --dataset synthetic --amp fp16 --clip-grad 1 --accum-steps 2 --epochs 1 \
        --out "$TMP/smoke_classifier"; then
        local acc
        acc=$(field "$TMP/smoke_classifier.log" 'final val acc1 ([0-9.]+)%')
        echo "| smoke | $what | passed | val acc1 ${acc:-?}% on noise (chance 10%) |"
    else
        echo "| smoke | $what | FAILED | $PART_WHY |"
    fi
}
part_smoke_moco() {
    await_part shm
    shm_sizes
    local what="MoCo --aug-on loader --workers $SMOKE_FIT (pinned memory)$SHM_SAID, $((SMOKE_STEPS - SMOKE_WARMUP)) steps after one kNN pass"
    if [ -z "$CIFAR_PATH" ]; then
        echo "| smoke | $what | FAILED | not run: no noise CIFAR-10 folder |"
        return
    fi
    if PYTHONPATH="$CIFAR_PATH" run_part "smoke: MoCo loader path" "$TMP/smoke_moco.log" "$PY" bench/cuda_syncs.py \
        --warmup-steps "$SMOKE_WARMUP" train_moco.py "${SMOKE_ARGS[@]}" --image-size 32 --batch-size "$SMOKE_BATCH" \
        --dataset cifar10 --data-dir "$CIFAR" --aug-on loader --workers "$SMOKE_FIT" --knn-every 1 \
        --max-steps "$SMOKE_STEPS" --out "$TMP/smoke_moco"; then
        local knn syncs
        knn=$(field "$TMP/smoke_moco.log" 'step 0: kNN acc1 .* in ([0-9.]+) s')
        syncs=$(field "$TMP/smoke_moco.log" 'CUDA syncs per optimizer step: (.*)')
        echo "| smoke | $what | passed | kNN pass ${knn:-?} s |"
        echo "| CUDA syncs | MoCo's steps with --aug-on loader | ${syncs:-?} | budget: 1 per step |"
    else
        echo "| smoke | $what | FAILED | $PART_WHY |"
    fi
}

# ----------------------------------------------------------------------------- running the plan
# stamp: the seconds since the start, for the progress lines
stamp() { printf '[%4d s]' $((SECONDS - START)); }

# run_lane LANE: its parts in order; a planned part runs (its limit clamped to what is left), an
# unplanned one only if the time left covers its limit; each part's rows go to $TMP/rows/NN.
run_lane() {
    local lane=$1 i rows tag began left state
    for ((i = 0; i < NPARTS; i++)); do
        ((LANE_OF[i] == lane)) || continue
        rows="$TMP/rows/$(printf '%02d' $((i + 1)))"
        tag="$((i + 1))/$NPARTS ${WHAT_OF[i]}"
        ((LANES == 2)) && tag="$tag (lane $lane)"
        left=$((BUDGET - (SECONDS - START) - MARGIN))
        if ((PLANNED[i] || left >= LIMITS[i] + KILL_AFTER)); then
            echo "$(stamp) $tag: starts, limit ${LIMITS[i]} s"
            began=$SECONDS KEY=${KEYS[i]} PART_LIMIT=${LIMITS[i]} PART_RC=-1 PART_WHY=""
            "part_${KEYS[i]}" >"$rows"
            case "$PART_RC" in
            0) state="passed" ;;
            -1) state="not run (its input is missing)" ;;
            *) state="FAILED (${PART_WHY:-exit code $PART_RC})" ;;
            esac
            echo "$(stamp) $tag: $state in $((SECONDS - began)) s"
        else
            echo "| ${ROW_OF[i]} | ${WHAT_OF[i]} | not run | left out for the budget: not in the plan for $BUDGET s, and the $left s left were fewer than its limit + $KILL_AFTER |" >"$rows"
            echo "${WHAT_OF[i]}" >>"$NOT_RUN_LIST"
            echo "$(stamp) $tag: not run (left out for the budget: $left s left, its limit ${LIMITS[i]} s)"
        fi
        cat "$rows"
        : >"$TMP/done/${KEYS[i]}"
    done
}

TITLE="## ${MODE}, $(date -u '+%Y-%m-%d %H:%M UTC')"
table() {
    echo "$TITLE"
    echo
    echo "$MACHINE"
    echo
    echo "| part | what ran | figure | detail |"
    echo "|---|---|---:|---|"
    cat "$TMP/rows/"*
}

main() {
    echo "log: $LOG"
    echo "$TITLE"
    echo
    echo "$MACHINE"
    echo
    print_plan
    echo "$(stamp) 0/$NPARTS pre-flight: passed in $PREFLIGHT_TOOK s"
    if ((LANES == 2)); then
        export OMP_NUM_THREADS=1  # one core per lane
        run_lane 1 &
        run_lane 2 &
        wait
    else
        run_lane 1
    fi

    # ------------------------------------------------------------------------- summary: the table last
    local failed=() not_run=() entry
    mapfile -t failed <"$FAILED_LIST"
    mapfile -t not_run <"$NOT_RUN_LIST"
    for entry in "${failed[@]}"; do
        echo
        echo "FAILED: ${entry%%|*}; the last lines of its output:"
        echo '```'
        tail -n 15 "${entry#*|}"
        echo '```'
    done
    echo
    echo "Total $((SECONDS - START)) s of the $BUDGET s budget, the pre-flight included. The whole table:"
    echo
    table
    echo
    if ((${#not_run[@]})); then
        echo "Not run, left out for the budget (GPU_CHECK_BUDGET=$ALL_PARTS runs every part): $(printf '%s; ' "${not_run[@]}" | sed 's/; $//')."
    fi
    if ((${#failed[@]} == 0)); then
        echo "All parts that ran passed."
    else
        echo "${#failed[@]} part(s) FAILED: $(printf '%s; ' "${failed[@]%%|*}" | sed 's/; $//')."
    fi
    echo "log: $LOG"
    ((${#failed[@]} == 0))
}

main 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
