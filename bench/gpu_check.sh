#!/usr/bin/env bash
# One prepared check of the GPU path, under 9 minutes on one GPU; installs nothing.
#
#   bash bench/gpu_check.sh                 # from anywhere; python3 as found
#   PYTHON=/path/to/python bash bench/gpu_check.sh
#   PYTHON=.venv/bin/python bash bench/gpu_check.sh --cpu-smoke   # the same commands, tiny, on the CPU
#
# First a pre-flight (bench/gpu_preflight.py): torch, torchvision (with its compiled ops),
# tensorboard and numpy import, and torch can use the GPU; otherwise one line says what is
# missing and the script exits 2 at once (on a machine without a GPU too). Then one markdown
# table, ready for the README, one row per figure:
#
# - throughput (bench/throughput.py, bf16): ResNet-18 32 px classifier and MoCo with the CIFAR-10
#   demo's settings at batch 512 on synthetic data (noise: its MoCo augmentation is crops and flips
#   only); ResNet-50 224 px MoCo v2 at batch 256 with plain BatchNorm (--bn-splits 1, as each of 8
#   GPUs would run it) on the noise CIFAR-10 folder below, so that the full v2 recipe runs at 224 px
#   (colour jitter, grayscale, blur on the crops, resized up from 32 px).
# - the CIFAR-10 demo recipe (recipes/moco_cifar10_demo.json, one process, split BN in 8 groups,
#   --amp bf16 --tf32) on a CIFAR-10-size folder of noise images (50,000 + 10,000 at 32 px, so
#   colour jitter and grayscale run as on the real data): epoch 2's time from the log's "epoch 2
#   trained in X s" line (training only: no checkpoint, no kNN), one kNN pass (bank 50,000,
#   10,000 queries) from its own log line, and the CUDA syncs per optimizer step after 10 warm-up
#   steps (torch.cuda.set_sync_debug_mode("warn"), bench/cuda_syncs.py).
# - the JPEG path: ResNet-50 MoCo v2 and the linear probe at 224 px on an ImageNet-like folder of
#   JPEGs (bench/imagenet_like.py, 2,560 + 80 images), --aug-on device, decoded by the workers and
#   by the GPU (--decode-on device): img/s and the share of time spent waiting for data over steps
#   10-18 of the first epoch's 20 (after a warm-up interval; no checkpoint, no epoch start inside).
# - the device finish (bench/device_finish.py) on that folder: nvJPEG against the CPU decoder on
#   the same files (max and mean absolute difference); a race probe (decode while a ResNet-50
#   backward is queued, 50 times: decoded images against an idle GPU's and the CPU's, queued
#   reads of freed memory against their known values) and its control (20 times, the decoder
#   without a stream of its own: above 0 shows the probe provokes the race); the loader alone
#   (no model) in img/s at 8 and all usable workers, both decode modes, with the host's share
#   inside the decoder; a sample's MoCo v2 views in a batch of 128 against alone (max |diff|,
#   at most 1e-5 promised); the per-batch device time of each device_finish/* profiler range (copy,
#   decode, crop, colour, blur, normalize) and the peak memory.
# - smoke runs of the paths the figures above leave out: the classifier with --compile, fp16,
#   --clip-grad and --accum-steps 2 through one evaluate(); MoCo with --aug-on loader
#   --workers 4 (pinned memory) through one kNN pass, with its CUDA syncs per step.
#
# Every part runs under `timeout`, clamped so that the whole script stays within GPU_CHECK_BUDGET
# seconds (default 500); a part that fails or times out gets a FAILED row and the script goes on.
# Exit code: 0 when every part passed, 1 when one failed, 2 when the machine cannot run the check.
set -u

cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python3}
BUDGET=${GPU_CHECK_BUDGET:-500}
KILL_AFTER=5  # seconds between timeout's TERM and its KILL

case "${1:-}" in
--cpu-smoke)  # the same commands with tiny sizes, to check them without a GPU
    MODE="CPU smoke test (tiny sizes, not a measurement)"
    LANES=2
    PREFLIGHT=(--cpu)
    DEVICE=cpu; ARCH18=small_cnn; BATCH18=64; ARCH50=small_cnn; SIZE50=64; BATCH50=16
    STEPS=(--steps 2 --warmup 1 --rounds 1)
    CIFAR_TRAIN=1024; CIFAR_TEST=256; RECIPE_SIZE=(--arch small_cnn --batch-size 128 --bn-splits 2)
    COMPILE=(); SMOKE_ARCH=small_cnn; SMOKE_BATCH=32; SMOKE_SAMPLES=128
    SMOKE_WARMUP=2; SMOKE_STEPS=6  # the MoCo smoke run: steps not counted for syncs, steps in all
    JPEG_PER_CLASS=4; JPEG_BATCH=8; JPEG_STEPS=4; JPEG_LOG=2  # 5 steps an epoch: steps 3-4 parsed
    DF_FILES=0; RACE=(--iterations 2 --arch resnet18); RACE_CONTROL=(--iterations 2 --arch resnet18)
    LOADER_WORKERS=(1 2)
    LOADER_BATCHES=(--warmup-batches 1 --batches 4); BREAKDOWN=(--loader-workers 1 --warmup-batches 1 --batches 2)
    ;;
"")
    MODE="GPU check"
    LANES=1
    PREFLIGHT=()
    DEVICE=cuda; ARCH18=resnet18; BATCH18=512; ARCH50=resnet50; SIZE50=224; BATCH50=${BATCH50:-256}
    STEPS=(--steps 20 --warmup 5 --rounds 3)
    CIFAR_TRAIN=50000; CIFAR_TEST=10000; RECIPE_SIZE=()
    COMPILE=(--compile); SMOKE_ARCH=resnet18; SMOKE_BATCH=256; SMOKE_SAMPLES=4096
    SMOKE_WARMUP=10; SMOKE_STEPS=40
    JPEG_PER_CLASS=256; JPEG_BATCH=128; JPEG_STEPS=18; JPEG_LOG=9  # 20 steps an epoch: steps 10-18 parsed
    # bench/device_finish.py: decode-diff's files, the race probe's and its control's iterations, the
    # loader's workers (-1: every usable CPU but the rank's) and batches (4 + 16: the first epoch's
    # 20), the profiled batches
    DF_FILES=512; RACE=(--iterations 50 --arch resnet50); RACE_CONTROL=(--iterations 20 --arch resnet50)
    LOADER_WORKERS=(8 -1)
    LOADER_BATCHES=(--warmup-batches 4 --batches 16); BREAKDOWN=(--loader-workers 4 --warmup-batches 2 --batches 5)
    ;;
*)
    echo "usage: bash bench/gpu_check.sh [--cpu-smoke]" >&2
    exit 2
    ;;
esac

# ----------------------------------------------------------------------------- pre-flight
if ! command -v "$PY" >/dev/null; then
    echo "gpu_check: no python at PYTHON=$PY; set PYTHON=/path/to/python" >&2
    exit 2
fi
MACHINE=$("$PY" bench/gpu_preflight.py "${PREFLIGHT[@]}") || exit 2

TMP=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX") || exit 1
trap 'rm -rf "$TMP"' EXIT
START=$SECONDS
FAILED_LIST="$TMP/failed"  # "part|its output file" for each part that failed, from either lane
: >"$FAILED_LIST"
PART_WHY=""

# run_part NAME LIMIT OUTFILE CMD...: CMD under `timeout LIMIT` (less if the budget runs low),
# stdout and stderr to OUTFILE; returns CMD's exit code and records a failure.
run_part() {
    local name=$1 limit=$2 out=$3
    shift 3
    local left=$((BUDGET - (SECONDS - START) - KILL_AFTER))
    ((limit > left)) && limit=$left
    if ((limit < 5)); then
        PART_WHY="not run: the ${BUDGET} s budget is spent"
        : >"$out"
        echo "$name|$out" >>"$FAILED_LIST"
        return 125
    fi
    timeout --kill-after="$KILL_AFTER" "$limit" "$@" >"$out" 2>&1
    local rc=$?
    if ((rc != 0)); then
        if ((rc == 124 || rc == 137)); then PART_WHY="timed out after ${limit} s"; else PART_WHY="exit code $rc"; fi
        echo "$name|$out" >>"$FAILED_LIST"
    fi
    return "$rc"
}

# field FILE REGEX: the first capture group of the last line of FILE matching REGEX (sed -E)
field() { grep -E "$2" "$1" | tail -n 1 | sed -E "s#.*$2.*#\\1#"; }

echo "## ${MODE}, $(date -u '+%Y-%m-%d %H:%M UTC')"
echo
echo "$MACHINE"
echo
echo "| part | what ran | figure | detail |"
echo "|---|---|---:|---|"

# Each group of parts is a function: the CPU smoke test runs the CIFAR-10 lane (its folder, the
# throughput rows, the demo recipe, then the smoke runs) beside the JPEG lane (its folder, the JPEG
# path, the device finish), one thread each, and prints their rows in the usual order once both
# are done; the GPU check runs them one after another, printing each row as it comes, so that no
# two measurements share the GPU.
cifar_parts() {
    # ----------------------------------------------------------------------------- the noise CIFAR-10 folder
    # Written first: the ResNet-50 MoCo v2 throughput row and the CIFAR-10 demo recipe both read it.
    CIFAR="$TMP/cifar"
    if run_part "noise CIFAR-10 folder" 60 "$TMP/cifar.log" "$PY" -c \
        "import sys; sys.path.insert(0, 'tests'); from fake_cifar import write_noise_cifar10, cifar_env; \
    write_noise_cifar10('$CIFAR', $CIFAR_TRAIN, $CIFAR_TEST); print(cifar_env('$TMP/site')['PYTHONPATH'])"; then
        CIFAR_PATH=$(tail -n 1 "$TMP/cifar.log")  # the md5 check of torchvision's CIFAR10 off, for these files only
    else
        echo "| noise CIFAR-10 folder | writing it (the v2 throughput row and the demo recipe read it) | FAILED | $PART_WHY |"
        CIFAR_PATH=""
    fi

    # ----------------------------------------------------------------------------- throughput
    COMMON=(--device "$DEVICE" --amp bf16 --aug-on device --table brief "${STEPS[@]}")
    CIFAR_MOCO=(--moco-k 4096 --moco-m 0.99 --moco-t 0.1 --no-mlp --aug v2-noblur)
    # The ResNet-50 row reads the noise CIFAR-10 folder: synthetic data's MoCo recipe is crops and flips
    # only, CIFAR-10's is the whole v2 one (colour jitter, grayscale, blur), run on the 224 px crops.
    ROWS=(
        "60|ResNet-18 32 px classifier|--script classifier --dataset synthetic --arch $ARCH18 --image-size 32 --batch-size $BATCH18"
        "60|ResNet-18 32 px MoCo|--script moco --dataset synthetic --arch $ARCH18 --image-size 32 --batch-size $BATCH18 ${CIFAR_MOCO[*]}"
        "90|ResNet-50 224 px MoCo v2, full v2 recipe|--script moco --preset v2 --dataset cifar10 --data-dir $CIFAR --arch $ARCH50 --image-size $SIZE50 --batch-size $BATCH50 --bn-splits 1"
    )
    for spec in "${ROWS[@]}"; do
        IFS='|' read -r limit name row_args <<<"$spec"
        out="$TMP/throughput_${limit}_${name// /_}"
        row_env=()
        if [[ "$row_args" == *"--dataset cifar10"* ]]; then
            if [ -z "$CIFAR_PATH" ]; then
                echo "| throughput | $name | FAILED | not run: no noise CIFAR-10 folder |"
                continue
            fi
            row_env=("PYTHONPATH=$CIFAR_PATH")
        fi
        # shellcheck disable=SC2086  # row_args holds plain words, split on purpose
        if run_part "throughput: $name" "$limit" "$out" env "${row_env[@]}" "$PY" bench/throughput.py $row_args "${COMMON[@]}"; then
            grep -E '^\| throughput' "$out"
        else
            echo "| throughput | $name | FAILED | $PART_WHY |"
        fi
    done

    # ----------------------------------------------------------------------------- the CIFAR-10 demo recipe
    RECIPE=(bench/cuda_syncs.py --warmup-steps 10 train_moco.py --config recipes/moco_cifar10_demo.json
        --data-dir "$CIFAR" --device "$DEVICE" --amp bf16 --tf32 --epochs 2 "${RECIPE_SIZE[@]}"
        --log-every 1000 --out "$TMP/recipe")
    if [ -n "$CIFAR_PATH" ]; then
        what="moco_cifar10_demo.json, --amp bf16 --tf32, CIFAR-10-size noise folder ($CIFAR_TRAIN + $CIFAR_TEST)"
        if PYTHONPATH="$CIFAR_PATH" run_part "CIFAR-10 demo recipe" 120 "$TMP/recipe.log" "$PY" "${RECIPE[@]}"; then
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
    fi

}

jpeg_parts() {
    # ----------------------------------------------------------------------------- the JPEG path
    # ResNet-50 MoCo v2 and the linear probe on an ImageNet-like folder of JPEGs (bench/imagenet_like.py),
    # --aug-on device, decoded by the workers (CPU) and by the GPU (--decode-on device): img/s and the
    # share of time the loop waited for data, from the last progress line: the second --log-every
    # interval, steps JPEG_LOG+1 to JPEG_STEPS (GPU: 10-18), inside the first epoch (GPU: 20 steps),
    # so it holds neither the first batches and cuDNN's autotuning (the first interval) nor an epoch's
    # end (its checkpoint, the next epoch's refill of the workers' prefetch); --max-steps's checkpoint
    # comes after the line.
    JPEG="$TMP/jpeg"
    JPEG_OK=""
    if run_part "ImageNet-like JPEG folder" 120 "$TMP/jpeg.log" "$PY" bench/imagenet_like.py "$JPEG" \
        --classes 10 --train-per-class "$JPEG_PER_CLASS" --val-per-class 8; then
        JPEG_OK=1
        for decode in loader device; do
            for script in moco probe; do
                if [ "$script" = moco ]; then
                    cmd=(train_moco.py --preset v2 --moco-k 16384 --bn-splits 1 --knn-every 0)
                    what="$ARCH50 MoCo v2, --decode-on $decode"
                else
                    cmd=(train_classifier.py --linear-probe --lr 30 --weight-decay 0)
                    what="$ARCH50 linear probe, --decode-on $decode"
                fi
                out="$TMP/jpeg_${script}_${decode}.log"
                if run_part "JPEG path: $what" 90 "$out" "$PY" "${cmd[@]}" --dataset imagefolder --data-dir "$JPEG" \
                    --device "$DEVICE" --arch "$ARCH50" --image-size "$SIZE50" --batch-size "$JPEG_BATCH" --aug-on device \
                    --decode-on "$decode" --workers -1 --epochs 100 --max-steps "$JPEG_STEPS" --ckpt-every 0 \
                    --log-every "$JPEG_LOG" --out "$TMP/jpeg_${script}_${decode}"; then
                    rate=$(field "$out" ' ([0-9,.]+) img/s data wait')
                    wait=$(field "$out" 'data wait ([0-9]+)%')
                    echo "| JPEG path | $what, batch $JPEG_BATCH, $(field "$out" '([0-9]+ DataLoader worker\(s\) per rank)') | ${rate:-?} img/s | steps $((JPEG_LOG + 1))-$JPEG_STEPS of epoch 1 (no checkpoint, no epoch start); waited for data ${wait:-?}% of them |"
                else
                    echo "| JPEG path | $what | FAILED | $PART_WHY |"
                fi
            done
        done
    else
        echo "| JPEG path | writing the ImageNet-like folder | FAILED | $PART_WHY |"
    fi

    # ----------------------------------------------------------------------------- the device finish
    # bench/device_finish.py on the same folder, each part its own process and limit: nvJPEG against
    # the CPU decoder; the race probe (exit 1 when an iteration differed: its row, then a FAILED row),
    # then its control (the decoder without a stream of its own, in a process of its own, as it may
    # corrupt what the backward reads: above 0 shows the probe provokes the race); the loader alone
    # (no model); a sample's views in a batch against alone (the blur's, grayscale's and jitter's
    # sub-batches change size with the batch); the per-batch profile of FinishOnDevice.finish.
    DEVICE_FINISH=(bench/device_finish.py --data-dir "$JPEG" --device "$DEVICE" --batch-size "$JPEG_BATCH"
        --image-size "$SIZE50")
    # device_part ROW LIMIT WHAT ARGS...: one part, its rows, or what it printed and a FAILED row
    DEVICE_PARTS=0
    device_part() {
        local name=$1 limit=$2 what=$3
        shift 3
        local out="$TMP/device_$((DEVICE_PARTS += 1)).log"
        if [ -z "$JPEG_OK" ]; then
            echo "| $name | $what | FAILED | not run: no ImageNet-like folder |"
            return
        fi
        run_part "device finish: $name" "$limit" "$out" "$PY" "${DEVICE_FINISH[@]}" "$@"
        local rc=$?
        grep -E "^\| $name \|" "$out"
        ((rc == 0)) || echo "| $name | $what | FAILED | $PART_WHY |"
    }
    device_part "device decode" 60 "decode_on($DEVICE) vs decode_cpu" decode-diff --files "$DF_FILES"
    device_part "race probe" 90 "decode_on($DEVICE) while a backward is queued" race "${RACE[@]}"
    device_part "race probe" 45 "the control: decode without a stream of its own" race --unprotected "${RACE_CONTROL[@]}"
    device_part "loader" 120 "FinishOnDevice batches alone" loader --workers "${LOADER_WORKERS[@]}" "${LOADER_BATCHES[@]}"
    device_part "batch independence" 45 "views in a packed batch against each alone" independence
    device_part "device finish" 60 "FinishOnDevice.finish under torch.profiler" breakdown "${BREAKDOWN[@]}"

}

smoke_parts() {
    # ----------------------------------------------------------------------------- smoke runs
    SMOKE=(--device "$DEVICE" --arch "$SMOKE_ARCH" --image-size 32 --batch-size "$SMOKE_BATCH" --log-every 1000)
    what="classifier ${COMPILE[*]:-(no --compile on the CPU)} --amp fp16 --clip-grad 1 --accum-steps 2, one epoch + evaluate()"
    if run_part "smoke: classifier" 100 "$TMP/smoke_classifier.log" "$PY" train_classifier.py "${SMOKE[@]}" "${COMPILE[@]}" \
        --dataset synthetic --synthetic-samples "$SMOKE_SAMPLES" --amp fp16 --clip-grad 1 --accum-steps 2 --epochs 1 \
        --out "$TMP/smoke_classifier"; then
        acc=$(field "$TMP/smoke_classifier.log" 'final val acc1 ([0-9.]+)%')
        echo "| smoke | $what | passed | val acc1 ${acc:-?}% on noise (chance 10%) |"
    else
        echo "| smoke | $what | FAILED | $PART_WHY |"
    fi
    if [ -n "$CIFAR_PATH" ]; then
        what="MoCo --aug-on loader --workers 4 (pinned memory), $((SMOKE_STEPS - SMOKE_WARMUP)) steps after one kNN pass"
        if PYTHONPATH="$CIFAR_PATH" run_part "smoke: MoCo loader path" 60 "$TMP/smoke_moco.log" "$PY" bench/cuda_syncs.py \
            --warmup-steps "$SMOKE_WARMUP" train_moco.py "${SMOKE[@]}" --dataset cifar10 --data-dir "$CIFAR" --aug-on loader \
            --workers 4 --knn-every 1 --max-steps "$SMOKE_STEPS" --out "$TMP/smoke_moco"; then
            knn=$(field "$TMP/smoke_moco.log" 'step 0: kNN acc1 .* in ([0-9.]+) s')
            syncs=$(field "$TMP/smoke_moco.log" 'CUDA syncs per optimizer step: (.*)')
            echo "| smoke | $what | passed | kNN pass ${knn:-?} s |"
            echo "| CUDA syncs | MoCo's steps with --aug-on loader | ${syncs:-?} | budget: 1 per step |"
        else
            echo "| smoke | $what | FAILED | $PART_WHY |"
        fi
    fi

}

if ((LANES == 2)); then
    export OMP_NUM_THREADS=1  # one core per lane
    { cifar_parts >"$TMP/rows_cifar.md"; smoke_parts >"$TMP/rows_smoke.md"; } &
    jpeg_parts >"$TMP/rows_jpeg.md" &
    wait
    cat "$TMP/rows_cifar.md" "$TMP/rows_jpeg.md" "$TMP/rows_smoke.md"
else
    cifar_parts
    jpeg_parts
    smoke_parts
fi

# ----------------------------------------------------------------------------- summary
mapfile -t FAILED <"$FAILED_LIST"
echo
echo "Total $((SECONDS - START)) s after the pre-flight."
if ((${#FAILED[@]} == 0)); then
    echo "All parts passed."
    exit 0
fi
for entry in "${FAILED[@]}"; do
    echo
    echo "FAILED: ${entry%%|*}; the last lines of its output:"
    echo '```'
    tail -n 15 "${entry#*|}"
    echo '```'
done
exit 1
