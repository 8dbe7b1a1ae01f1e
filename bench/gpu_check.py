"""One prepared check of the GPU path on one GPU, within GPU_CHECK_BUDGET seconds; installs nothing.

    bash bench/gpu_check.sh                     # python3 as found; PYTHON=/path/to/python to choose
    OUT=/some/folder bash bench/gpu_check.sh    # the log is $OUT/gpu_check.log
    bash bench/gpu_check.sh --plan              # the plan only: each part's limit against the budget
    bash bench/gpu_check.sh --cpu-smoke         # the same commands, tiny, on the CPU

:data:`PARTS` is the check: each part one command under its own time limit, in the table's order,
the deciding parts first; one after another on a GPU, two side by side in --cpu-smoke. The
pre-flight (``bench/gpu_preflight.py``) comes before them: when it fails (no GPU, no torch, a
torch the driver cannot run) one line says why and the exit code is 2.
Each part counts at its limit + KILL_AFTER (the time between the timeout's TERM and its KILL),
and MARGIN seconds are kept for the runner. The pre-flight and the decisive parts are always
planned, and a budget smaller than they need is refused (one line, exit 2); the others are
planned in order while they fit, and those after the first that does not run only if the time
left when their turn comes covers their limit, else their row says "not run".

Every line goes to the console and to the log (``$OUT/gpu_check.log``, else
``runs/gpu_check/<UTC time>.log``), named first and last: the plan, a line as each part starts
and ends, its rows as it ends (side by side, a part's lines wait for those of the parts before
it), then the last lines of what failed and the whole markdown table again, so that a console
that keeps only its last lines still holds it. Exit code 0 when every part that ran passed, 1
when one failed or timed out (its row says FAILED; the others still run), 2 when the machine
cannot run the check. docs/performance.md describes each row.

Only the standard library is imported here: the pre-flight reports a missing torch.
"""
from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
KILL_AFTER = 5  # seconds between a part's TERM and its KILL
MARGIN = 5      # seconds of the budget kept for the runner's own work
GPU_BUDGET = 560
PREFLIGHT = "bench/gpu_preflight.py"  # its Python command line; --cpu added in --cpu-smoke
PREFLIGHT_LIMITS = (45, 60)  # seconds on a GPU, in --cpu-smoke


@dataclass(frozen=True)
class Part:
    """One command of the check. ``command``: its Python command line, each ``{name}`` a size of
    :data:`GPU` or :data:`CPU_SMOKE` (a word that is one ``{name}`` of a list: that list's words).
    ``row``: the table's first cell of its rows. ``read``: its rows from its output when it passed
    (default: the output's lines starting ``| <row>``). ``needs``: the key of the part that writes
    what it reads; when that part did not pass, this one is not run. ``fits``: its ``read`` sets
    sizes in ``s`` that the parts after it use; where parts run side by side, those start once it
    has ended."""

    key: str
    row: str
    what: str
    command: str
    limits: tuple[int, int]  # seconds on a GPU, in --cpu-smoke
    decisive: bool = False
    needs: str = ""
    read: Callable[[str, dict], list[str]] | None = None
    fits: bool = False


def field(text: str, pattern: str) -> str:
    """The first group of ``pattern`` in the last line where it is found, or "?"."""
    found = [m.group(1) for m in map(re.compile(pattern).search, text.splitlines()) if m]
    return found[-1] if found else "?"


def own_rows(row: str) -> Callable[[str, dict], list[str]]:
    """The output's lines that start ``| <row>``: the rows a part's command prints."""
    return lambda text, s: [line for line in text.splitlines() if line.startswith(f"| {row}")]


def capture_row(text: str, s: dict) -> list[str]:
    said = "; ".join(line.strip().replace("|", "\\|") for line in text.splitlines() if line.strip())[-600:]
    return [f"| graph capture | bench/augment_capture.py --device {s['device']}: the packed augmentation captured as a "
            f"graph against eager | equal | {said or 'exit 0'} |"]


def fitted(text: str, s: dict) -> list[str]:
    """The /dev/shm row; its sizes (``batch=B workers=W,... cap=C smoke_workers=S``, the workers
    asked resolved in order) go to ``s`` for the loader parts, the JPEG rows and the MoCo smoke."""
    words = dict(word.split("=", 1) for word in field(text, r"^(batch=.*)").split())
    workers = [int(w) for w in words["workers"].split(",")]
    n = len(s["loader_workers"])
    s.update(shm_batch=int(words["batch"]), loader_fit=list(dict.fromkeys(workers[:n])), all_fit=workers[n],
             breakdown_fit=workers[n + 1], smoke_fit=int(words["smoke_workers"]), shm_said="")
    return [line for line in text.splitlines() if line.startswith("| /dev/shm |")]


def jpeg_row(what: str) -> Callable[[str, dict], list[str]]:
    """The JPEG path's row: img/s and the data wait of the last progress line, steps jpeg_log + 1
    to jpeg_steps, inside the first epoch: after a warm-up interval (the first batches, cuDNN's
    autotuning), before the epoch's end (its checkpoint, the workers' refill for the next one)."""
    def read(text: str, s: dict) -> list[str]:
        workers = field(text, r"([0-9]+ DataLoader worker\(s\) per rank)")
        return [f"| JPEG path | {what.format(**s)}, batch {s['shm_batch']}, {workers}{s['shm_said']} | "
                f"{field(text, r' ([0-9,.]+) img/s data wait')} img/s | steps {s['jpeg_log'] + 1}-{s['jpeg_steps']} of "
                f"epoch 1 (no checkpoint, no epoch start); waited for data {field(text, r'data wait ([0-9]+)%')}% of them |"]
    return read


def recipe_rows(text: str, s: dict) -> list[str]:
    what = (f"moco_cifar10_demo.json, --amp bf16 --tf32, CIFAR-10-size noise folder "
            f"({s['cifar_train']} + {s['cifar_test']})")
    return [f"| CIFAR-10 demo recipe | {what}: epoch 2, training only | {field(text, r'epoch 2 trained in ([0-9.]+) s')} s "
            f"| {field(text, r'epoch 2 trained in [0-9.]+ s \(([0-9,.]+) img/s')} img/s; colour jitter and grayscale "
            "included; no checkpoint, no kNN |",
            f"| CIFAR-10 demo recipe | one kNN pass after epoch 2 (k 200, bank {s['cifar_train']}, {s['cifar_test']} "
            f"queries) | {field(text, r'kNN acc1 .* in ([0-9.]+) s')} s | the head's 128-d features, bf16 bank |",
            f"| CUDA syncs | the recipe's steps (--aug-on device) | {field(text, r'CUDA syncs per optimizer step: (.*)')} "
            "| budget: 1 per step (the ranks' agreement) |"]


def classifier_smoke_row(text: str, s: dict) -> list[str]:
    compiled = " ".join(s["compile"]) or "(no --compile on the CPU)"
    return [f"| smoke | classifier {compiled} --amp fp16 --clip-grad 1 --accum-steps 2, one epoch + evaluate() | passed "
            f"| val acc1 {field(text, r'final val acc1 ([0-9.]+)%')}% on noise (chance 10%) |"]


def moco_smoke_rows(text: str, s: dict) -> list[str]:
    return [f"| smoke | MoCo --aug-on loader --workers {s['smoke_fit']} (pinned memory){s['shm_said']}, "
            f"{s['smoke_steps'] - s['smoke_warmup']} steps after one kNN pass | passed "
            f"| kNN pass {field(text, r'step 0: kNN acc1 .* in ([0-9.]+) s')} s |",
            f"| CUDA syncs | MoCo's steps with --aug-on loader | {field(text, r'CUDA syncs per optimizer step: (.*)')} "
            "| budget: 1 per step |"]


FINISH = "--data-dir {jpeg} --device {device} --image-size {size50}"  # device_finish.py's parts
THROUGHPUT = "bench/throughput.py --device {device} --amp bf16 --aug-on device --table brief {steps}"
JPEG_RUN = ("--dataset imagefolder --data-dir {jpeg} --device {device} --arch {arch50} --image-size {size50} "
            "--batch-size {shm_batch} --aug-on device --workers {all_fit} --epochs 100 --max-steps {jpeg_steps} "
            "--ckpt-every 0 --log-every {jpeg_log}")
JPEG_MOCO = "train_moco.py --preset v2 --moco-k 16384 --bn-splits 1 --knn-every 0 " + JPEG_RUN
JPEG_PROBE = "train_classifier.py --linear-probe --lr 30 --weight-decay 0 " + JPEG_RUN
SMOKE = "--device {device} --arch {smoke_arch} --log-every 1000"
PARTS = [
    # decisive: the ImageNet-like folder, and on it what decides whether the GPU path is right
    Part("jpeg_folder", "JPEG path", "writing the ImageNet-like JPEG folder",
         "bench/imagenet_like.py {jpeg} --classes 10 --train-per-class {jpeg_per_class} --val-per-class 8",
         (45, 45), True),
    Part("decode", "device decode", "device_finish.py decode-diff: nvJPEG against the CPU decoder",
         "bench/device_finish.py decode-diff " + FINISH + " --batch-size {jpeg_batch} --files {df_files}",
         (30, 45), True, "jpeg_folder"),
    Part("race", "race probe", "device_finish.py race: decode while a backward is queued",
         "bench/device_finish.py race " + FINISH + " --batch-size {jpeg_batch} {race}", (45, 45), True, "jpeg_folder"),
    # in a process of its own: without a stream of its own the decoder may corrupt what the backward reads
    Part("race_control", "race probe", "device_finish.py race --unprotected: the control",
         "bench/device_finish.py race --unprotected " + FINISH + " --batch-size {jpeg_batch} {race_control}",
         (30, 45), True, "jpeg_folder"),
    Part("independence", "batch independence", "device_finish.py independence: views in a batch against alone",
         "bench/device_finish.py independence " + FINISH + " --batch-size {jpeg_batch}", (30, 45), True, "jpeg_folder"),
    Part("hazards", "hazard", "gpu_hazards.py: what a CPU cannot show, a row each",
         "bench/gpu_hazards.py " + FINISH + " --batch-size {jpeg_batch} {hazards}", (60, 90), True, "jpeg_folder"),
    Part("capture", "graph capture", "augment_capture.py: the augmentation captured against eager",
         "bench/augment_capture.py --device {device}", (60, 90), True, read=capture_row),
    # the loader: its workers and batch fitted to /dev/shm, so that the project's own check lets them through
    Part("shm", "/dev/shm", "gpu_preflight.py --shm: workers and batch fitted to /dev/shm",
         "bench/gpu_preflight.py --shm --jpeg-dir {jpeg} --batch {jpeg_batch} --image-size {size50} "
         "--workers {loader_workers} -1 {breakdown_workers} --smoke-batch {smoke_batch} --smoke-workers {smoke_workers}",
         (20, 45), needs="jpeg_folder", read=fitted, fits=True),
    Part("loader", "loader", "device_finish.py loader: FinishOnDevice batches alone",
         "bench/device_finish.py loader " + FINISH + " --batch-size {shm_batch} --workers {loader_fit} {loader_batches}",
         (75, 75), needs="jpeg_folder"),
    Part("breakdown", "device finish", "device_finish.py breakdown: FinishOnDevice.finish under torch.profiler",
         "bench/device_finish.py breakdown " + FINISH + " --batch-size {shm_batch} --loader-workers {breakdown_fit} "
         "{breakdown}", (45, 75), needs="jpeg_folder"),
    # throughput: noise images of CIFAR-10's size, so that colour jitter and grayscale run as on the real data
    Part("cifar_folder", "noise CIFAR-10 folder", "writing the noise CIFAR-10 folder",
         "-c \"import sys; sys.path.insert(0, 'tests'); from fake_cifar import write_noise_cifar10, cifar_env; "
         "write_noise_cifar10('{cifar}', {cifar_train}, {cifar_test}); cifar_env('{site}')\"", (30, 30)),
    Part("tp_classifier", "throughput", "throughput.py: ResNet-18 32 px classifier",
         THROUGHPUT + " --script classifier --dataset synthetic --arch {arch18} --image-size 32 --batch-size {batch18}",
         (45, 60)),
    Part("tp_moco", "throughput", "throughput.py: ResNet-18 32 px MoCo",
         THROUGHPUT + " --script moco --dataset synthetic --arch {arch18} --image-size 32 --batch-size {batch18} "
         "--moco-k 4096 --moco-m 0.99 --moco-t 0.1 --no-mlp --aug v2-noblur", (45, 60)),
    # synthetic data's MoCo augmentation is crops and flips only; the noise folder's is the whole v2 one
    Part("tp_v2", "throughput", "throughput.py: ResNet-50 224 px MoCo v2, full v2 recipe",
         THROUGHPUT + " --script moco --preset v2 --dataset cifar10 --data-dir {cifar} --arch {arch50} "
         "--image-size {size50} --batch-size {batch50} --bn-splits 1", (60, 90), needs="cifar_folder"),
    *(Part(f"jpeg_{kind}_{on}", "JPEG path", f"JPEG path: ResNet-50 {what}, --decode-on {on}",
           f"{command} --decode-on {on} --out {{tmp}}/jpeg_{kind}_{on}", (60, 75), needs="jpeg_folder",
           read=jpeg_row(f"{{arch50}} {what}, --decode-on {on}"))
      for on in ("loader", "device")
      for kind, what, command in (("moco", "MoCo v2", JPEG_MOCO), ("probe", "linear probe", JPEG_PROBE))),
    Part("recipe", "CIFAR-10 demo recipe", "the CIFAR-10 demo recipe: 2 epochs, one kNN pass",
         "bench/cuda_syncs.py --warmup-steps 10 train_moco.py --config recipes/moco_cifar10_demo.json --data-dir {cifar} "
         "--device {device} --amp bf16 --tf32 --epochs 2 {recipe_size} --log-every 1000 --out {tmp}/recipe",
         (90, 120), needs="cifar_folder", read=recipe_rows),
    # smoke runs of the paths the figures above leave out
    Part("smoke_classifier", "smoke", "smoke: classifier (--compile on a GPU), fp16, --clip-grad, --accum-steps 2",
         "train_classifier.py " + SMOKE + " {compile} {classifier_smoke} --dataset synthetic --amp fp16 --clip-grad 1 "
         "--accum-steps 2 --epochs 1 --out {tmp}/smoke_classifier", (100, 60), read=classifier_smoke_row),
    Part("smoke_moco", "smoke", "smoke: MoCo --aug-on loader, pinned memory, one kNN pass",
         "bench/cuda_syncs.py --warmup-steps {smoke_warmup} train_moco.py " + SMOKE + " --image-size 32 "
         "--batch-size {smoke_batch} --dataset cifar10 --data-dir {cifar} --aug-on loader --workers {smoke_fit} "
         "--knn-every 1 --max-steps {smoke_steps} --out {tmp}/smoke_moco", (60, 60), needs="cifar_folder",
         read=moco_smoke_rows),
]
# Sizes on a GPU. Loader and breakdown workers: -1 is every usable CPU but the rank's; the /dev/shm
# fit caps them. JPEG rows: 20 steps an epoch at batch 128, steps 10-18 parsed.
GPU = dict(device="cuda", arch18="resnet18", batch18=512, arch50="resnet50", size50=224, batch50=256,
           steps=["--steps", "20", "--warmup", "5", "--rounds", "3"], cifar_train=50000, cifar_test=10000,
           recipe_size=[], compile=["--compile"], smoke_arch="resnet18", smoke_batch=256,
           classifier_smoke=["--image-size", "32", "--batch-size", "256", "--synthetic-samples", "4096"],
           smoke_warmup=10, smoke_steps=40, jpeg_per_class=256, jpeg_batch=128, jpeg_steps=18, jpeg_log=9,
           df_files=512, hazards=[], race=["--iterations", "50", "--arch", "resnet50"],
           race_control=["--iterations", "20", "--arch", "resnet50"], loader_workers=[8, -1], breakdown_workers=4,
           smoke_workers=4, loader_batches=["--warmup-batches", "4", "--batches", "16"],
           breakdown=["--warmup-batches", "2", "--batches", "5"])
# Tiny sizes on the CPU, to check the commands before GPU time is spent: JPEG rows 5 steps an epoch,
# steps 3-4 parsed; the classifier's smoke run one optimizer step, as fp16 convolutions are slow on a CPU.
CPU_SMOKE = {**GPU, **dict(
    device="cpu", arch18="small_cnn", batch18=32, arch50="small_cnn", size50=64, batch50=8,
    steps=["--steps", "2", "--warmup", "1", "--rounds", "1"], cifar_train=256, cifar_test=64,
    recipe_size=["--arch", "small_cnn", "--batch-size", "128", "--bn-splits", "2"], compile=[], smoke_arch="small_cnn",
    smoke_batch=32, classifier_smoke=["--image-size", "16", "--batch-size", "8", "--synthetic-samples", "16"],
    smoke_warmup=2, smoke_steps=6, jpeg_per_class=4, jpeg_batch=8, jpeg_steps=4, jpeg_log=2, df_files=0,
    hazards=["--repeats", "2"], race=["--iterations", "2", "--arch", "resnet18"],
    race_control=["--iterations", "2", "--arch", "resnet18"],
    loader_workers=[1], breakdown_workers=1, smoke_workers=2, loader_batches=["--warmup-batches", "1", "--batches", "4"],
    breakdown=["--warmup-batches", "1", "--batches", "2"])}


def argv(template: str, s: dict) -> list[str]:
    """The command's words: a word that is one ``{name}`` of a list is its words; the others formatted."""
    words = []
    for word in shlex.split(template):
        value = s.get(word[1:-1]) if word[:1] == "{" and word[-1:] == "}" else None
        words += [str(v) for v in value] if isinstance(value, list) else [word.format(**s)]
    return words


@dataclass
class Plan:
    budget: int
    preflight: int  # the pre-flight's limit
    limits: list[int]
    planned: list[bool]
    used: int       # what the planned parts take of the budget, the pre-flight and the margin included
    decisive: int   # the budget the pre-flight and the decisive parts need
    every: int      # the budget that plans every part


def plan(parts: list[Part], smoke: bool, budget: int | None) -> Plan:
    """Each part's limit and whether it is planned; ``budget`` None: GPU_BUDGET on a GPU, every
    part in --cpu-smoke."""
    limits = [part.limits[smoke] for part in parts]
    preflight = PREFLIGHT_LIMITS[smoke]
    used = decisive = every = preflight + KILL_AFTER + MARGIN
    every += sum(limit + KILL_AFTER for limit in limits)
    budget = budget if budget is not None else every if smoke else GPU_BUDGET
    planned, open_ = [], True
    for part, limit in zip(parts, limits):
        fits = part.decisive or (open_ and used + limit + KILL_AFTER <= budget)
        open_ = open_ and fits
        planned.append(fits)
        used += (limit + KILL_AFTER) * fits
        decisive = used if part.decisive else decisive
    return Plan(budget, preflight, limits, planned, used, decisive, every)


def plan_lines(parts: list[Part], p: Plan) -> list[str]:
    lines = [f"plan for GPU_CHECK_BUDGET={p.budget} s: each part under a time limit, +{KILL_AFTER} s between its TERM "
             f"and KILL; +{MARGIN} s for the runner itself",
             f"  {0:2d}. {'pre-flight: gpu_preflight.py':<72} {p.preflight:4d} s  decisive"]
    for i, (part, limit, planned) in enumerate(zip(parts, p.limits, p.planned), 1):
        state = "decisive" if part.decisive else "planned" if planned else "if time is left"
        lines.append(f"  {i:2d}. {part.what:<72} {limit:4d} s  {state}")
    lines.append(f"planned: {p.used} s of the {p.budget} s budget (the pre-flight and the decisive parts: {p.decisive} s)")
    if not all(p.planned):
        lines.append(f"if time is left: {p.planned.count(False)} part(s), each run only if the time left covers its "
                     f"limit; GPU_CHECK_BUDGET={p.every} plans every part")
    return lines


def start_limited(command: list[str], out: Path, env: dict) -> subprocess.Popen:
    """``command`` started with its output to ``out``, in a process group of its own (its
    DataLoader workers in it too), so that :func:`stop_group` ends all of it."""
    with open(out, "w") as file:
        return subprocess.Popen(command, stdout=file, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                start_new_session=True)


def run_limited(command: list[str], limit: float, out: Path, env: dict) -> int | None:
    """``command`` with its output to ``out``; its exit code, or None when it ran past ``limit``
    seconds (then :func:`stop_group`)."""
    proc = start_limited(command, out, env)
    try:
        return proc.wait(limit)
    except subprocess.TimeoutExpired:
        stop_group(proc)
        return None
    except BaseException:  # the runner interrupted: its part goes with it
        kill_group(proc)
        raise


def stop_group(proc: subprocess.Popen) -> None:
    """TERM to the whole process group, KILL_AFTER seconds later KILL."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(KILL_AFTER)
    except subprocess.TimeoutExpired:
        pass
    kill_group(proc)


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # the whole group has ended
        pass
    proc.wait()


def run_parts(parts: list[Part], p: Plan, s: dict, say: Callable[[str], None], start: float,
              at_once: int = 1) -> tuple[list[str], list[tuple[str, Path]], list[str]]:
    """Runs the plan, ``at_once`` parts side by side, each started in the table's order once the
    part it ``needs`` and every part before it that ``fits`` sizes have ended: a planned part under
    its limit (less when the budget runs low), the others only when the time left covers their
    limit + KILL_AFTER. Says a line as each starts and ends, then its rows, in the table's order: a
    part's lines wait for those of the parts before it. Returns the table's rows, the failed parts
    (what, output file) and those left out for the budget."""
    python = os.environ.get("PYTHON") or sys.executable
    # the noise CIFAR-10 folder's md5 bypass first (tests/fake_cifar.py: CIFAR-10's files only)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [s["site"], str(REPO), os.environ.get("PYTHONPATH")]))}
    if at_once > 1:  # side by side: a thread each rather than every part's torch on every core
        env.setdefault("OMP_NUM_THREADS", "1")
    n, index = len(parts), {part.key: i for i, part in enumerate(parts)}
    lines: list[list[str]] = [[] for _ in parts]  # each part's lines not yet said
    rows: list[list[str] | None] = [None] * n      # each part's rows, once it has ended
    failed: dict[int, tuple[str, Path]] = {}
    running: dict[int, tuple[subprocess.Popen, float, int, Path]] = {}  # proc, began, its limit, its output
    passed, not_run, started, said = set(), [], 0, 0

    def tag(i: int) -> str:
        return f"[{time.monotonic() - start:4.0f} s] {i + 1}/{n} {parts[i].what}"

    def finish(i: int, code: int | None, began: float, clamped: int, out: Path, spent: bool = False) -> None:
        part = parts[i]
        text = out.read_text(errors="replace") if out.exists() else ""
        if code == 0:
            passed.add(part.key)
            state, rows[i] = "passed", (part.read or own_rows(part.row))(text, s)
        else:
            why = ("not run: the budget is spent" if spent else f"timed out after {clamped} s" if code is None
                   else f"exit code {code}")
            state = f"FAILED ({why})"
            rows[i] = own_rows(part.row)(text, s) + [f"| {part.row} | {part.what} | FAILED | {why} |"]
            failed[i] = (part.what, out)
        lines[i] += [f"{tag(i)}: {state} in {time.monotonic() - began:.0f} s", *rows[i]]

    def begin(i: int) -> None:
        part, limit, planned = parts[i], p.limits[i], p.planned[i]
        elapsed = time.monotonic() - start
        left = int(p.budget - elapsed - MARGIN)
        if not planned and left < limit + KILL_AFTER:
            rows[i] = [f"| {part.row} | {part.what} | not run | left out for the budget: not in the plan for {p.budget} s, "
                       f"and the {left} s left were fewer than its limit + {KILL_AFTER} |"]
            not_run.append(part.what)
            lines[i] += [f"{tag(i)}: not run (left out for the budget: {left} s left, its limit {limit} s)", *rows[i]]
        elif part.needs in index and part.needs not in passed:
            rows[i] = [f"| {part.row} | {part.what} | FAILED | not run: {parts[index[part.needs]].what} did not pass |"]
            lines[i] += [f"{tag(i)}: not run (its input is missing)", *rows[i]]
        else:
            clamped = min(limit, int(p.budget - elapsed - KILL_AFTER))
            out = Path(s["tmp"]) / f"{part.key}.log"
            lines[i].append(f"{tag(i)}: starts, limit {clamped} s")
            if clamped < min(limit, 5):  # the budget left it under 5 s: not worth starting
                finish(i, 125, time.monotonic(), clamped, out, spent=True)
            else:
                running[i] = (start_limited([python, *argv(part.command, s)], out, env), time.monotonic(), clamped, out)

    def may_start(i: int) -> bool:
        waits = [index.get(parts[i].needs, n)] + [j for j in range(i) if parts[j].fits]
        return len(running) < at_once and all(j >= i or rows[j] is not None for j in waits)

    try:
        while said < n:
            while started < n and may_start(started):
                begin(started)
                started += 1
            for i, (proc, began, clamped, out) in list(running.items()):
                timed_out = proc.poll() is None and time.monotonic() - began >= clamped
                if proc.returncode is None and not timed_out:
                    continue
                if timed_out:
                    stop_group(proc)
                del running[i]
                finish(i, None if timed_out else proc.returncode, began, clamped, out)
            while said < n:
                for line in lines[said]:
                    say(line)
                lines[said].clear()
                if rows[said] is None:
                    break
                said += 1
            if running:
                time.sleep(0.05)
    except BaseException:  # the runner interrupted: its parts go with it
        for proc, *_ in running.values():
            kill_group(proc)
        raise
    return [row for part_rows in rows for row in part_rows], [failed[i] for i in sorted(failed)], not_run


def open_log() -> Path:
    """$OUT/gpu_check.log, else runs/gpu_check/<UTC time>.log, else a temporary file."""
    out = os.environ.get("OUT")
    for log in ([Path(out) / "gpu_check.log"] if out else []) + [
            REPO / "runs" / "gpu_check" / f"{datetime.now(timezone.utc):%Y%m%d-%H%M%S}.log"]:
        try:
            log.parent.mkdir(parents=True, exist_ok=True)
            log.write_text("")
            return log.resolve()
        except OSError:
            pass
    return Path(tempfile.mkstemp(prefix="gpu_check.", suffix=".log")[1])


def refuse(message: str) -> int:
    """One line on stderr (and in $OUT/gpu_check.log when OUT is set); exit code 2."""
    print(message, file=sys.stderr)
    if os.environ.get("OUT"):
        try:
            Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
            (Path(os.environ["OUT"]) / "gpu_check.log").write_text(message + "\n")
        except OSError:
            pass
    return 2


def main(args: list[str], parts: list[Part] = PARTS) -> int:
    if not set(args) <= {"--cpu-smoke", "--plan"}:
        print("usage: bash bench/gpu_check.sh [--cpu-smoke] [--plan]", file=sys.stderr)
        return 2
    smoke, budget = "--cpu-smoke" in args, os.environ.get("GPU_CHECK_BUDGET")
    if budget is not None and not budget.isdigit():
        print(f"gpu_check: GPU_CHECK_BUDGET={budget}: a whole number of seconds, please", file=sys.stderr)
        return 2
    p = plan(parts, smoke, None if budget is None else int(budget))
    if p.budget < p.decisive:
        print(f"gpu_check: GPU_CHECK_BUDGET={p.budget} s is less than the pre-flight and the decisive parts need "
              f"({p.decisive} s: their limits, +{KILL_AFTER} s each, +{MARGIN} s); set GPU_CHECK_BUDGET={p.decisive} "
              "or more", file=sys.stderr)
        return 2
    if "--plan" in args:
        print("\n".join(plan_lines(parts, p)))
        return 0

    start = time.monotonic()  # the budget counts from here: the pre-flight is in it
    python = os.environ.get("PYTHON") or sys.executable
    with tempfile.TemporaryDirectory(prefix="gpu_check.") as tmp:
        out = Path(tmp) / "preflight.log"
        code = run_limited([python, *shlex.split(PREFLIGHT), *(["--cpu"] if smoke else [])], p.preflight, out,
                           dict(os.environ))
        said = out.read_text(errors="replace").strip().splitlines()
        if code is None:
            return refuse(f"gpu_check: the pre-flight (bench/gpu_preflight.py: importing torch, torchvision, tensorboard "
                          f"and asking for the GPU) took longer than its {p.preflight} s limit")
        if code != 0:
            return refuse(said[-1] if said else f"gpu_check: bench/gpu_preflight.py exited with code {code} and said nothing")
        machine, preflight_took = said[-1], time.monotonic() - start
        log = open_log()
        with open(log, "a") as file:
            def say(line: str = "") -> None:
                print(line, flush=True)
                file.write(line + "\n")
                file.flush()

            title = (f"## {'CPU smoke test (tiny sizes, not a measurement)' if smoke else 'GPU check'}, "
                     f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}")
            head = [title, "", machine, ""]
            for line in [f"log: {log}", *head, *plan_lines(parts, p)]:
                say(line)
            say(f"[{preflight_took:4.0f} s] 0/{len(parts)} pre-flight: passed in {preflight_took:.0f} s")
            s = {**(CPU_SMOKE if smoke else GPU), "tmp": tmp, "jpeg": f"{tmp}/jpeg", "cifar": f"{tmp}/cifar",
                 "site": f"{tmp}/site"}
            # without the /dev/shm fit, the parts that hand batches over through it run without workers
            s.update(shm_batch=s["jpeg_batch"], loader_fit=[0], all_fit=0, breakdown_fit=0, smoke_fit=0,
                     shm_said=" (no /dev/shm fit: no workers)")
            table, failed, not_run = run_parts(parts, p, s, say, start, at_once=2 if smoke else 1)
            for what, output in failed:
                lines = output.read_text(errors="replace").splitlines()[-15:] if output.exists() else []
                for line in ["", f"FAILED: {what}; the last lines of its output:", "```", *lines, "```"]:
                    say(line)
            say()
            say(f"Total {time.monotonic() - start:.0f} s of the {p.budget} s budget, the pre-flight included. "
                "The whole table:")
            for line in ["", *head, "| part | what ran | figure | detail |", "|---|---|---:|---|", *table, ""]:
                say(line)
            if not_run:
                say(f"Not run, left out for the budget (GPU_CHECK_BUDGET={p.every} runs every part): "
                    f"{'; '.join(not_run)}.")
            names = "; ".join(what for what, _ in failed)
            say(f"{len(failed)} part(s) FAILED: {names}." if failed else "All parts that ran passed.")
            say(f"log: {log}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
