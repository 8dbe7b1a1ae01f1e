"""bench/gpu_check.sh's pre-flight: can this machine run the check at all? And its /dev/shm sizing.

    python bench/gpu_preflight.py          # needs a usable CUDA GPU
    python bench/gpu_preflight.py --cpu    # imports only (gpu_check.sh --cpu-smoke)
    python bench/gpu_preflight.py --shm --jpeg-dir DIR --batch 128 --image-size 224 --workers 8 -1 \\
        --smoke-batch 256 --smoke-workers 4

Imports what the check runs (torch, torchvision with its compiled ops, tensorboard, numpy) and
asks torch for the GPU. Prints one line: what it found and /dev/shm's free room (exit 0), or what
is missing and what to do (exit 2). Only the standard library is imported before torch, so that a
missing torch is reported too.

``--shm`` sizes the check's parts whose DataLoader workers hand their batches over through
/dev/shm (the JPEG path, the loader alone, the breakdown, the MoCo loader smoke run) so that the
project's own check of it (``ddp_utils/data/host_memory.py``, at each run's start) passes on
this machine (:func:`fit_shared_memory`); it prints the sizes as ``name=value`` words on one
line, then the table's ``/dev/shm`` row. ``GPU_CHECK_SHM_BYTES`` stands in for /dev/shm's free
bytes (for the tests).
"""
from __future__ import annotations

import argparse
import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

SHM_DIR = "/dev/shm"
SHM_SHARE = 0.9  # the share of /dev/shm's free room the sizing fills at most: other processes use it too
MIN_BATCH = 8    # the JPEG batch is halved down to this before the workers go to 0


def fail(message: str) -> None:
    print(f"gpu_check: {message}", file=sys.stderr)
    sys.exit(2)


def nvidia_smi(query: str) -> str | None:
    """First GPU's ``--query-gpu`` fields, or None without a working nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def imports() -> str:
    found = []
    for name, fix in (("torch", "install PyTorch"), ("torchvision", "install the torchvision that pairs with torch"),
                      ("numpy", "install numpy"), ("tensorboard", "pip install tensorboard")):
        try:
            module = importlib.import_module(name)
        except Exception as err:  # noqa: BLE001 - any import failure is reported the same way
            fail(f"{sys.executable} cannot import {name} ({type(err).__name__}: {str(err).splitlines()[0]}); {fix}, "
                 "or set PYTHON=/path/to/python")
        found.append(f"{name} {getattr(module, '__version__', '?')}")
    try:  # torchvision's compiled ops fail to load next to a torch it was not built for
        from torchvision.ops import roi_align  # noqa: F401
        importlib.import_module("torch.utils.tensorboard")
    except Exception as err:  # noqa: BLE001
        fail(f"{type(err).__name__}: {str(err).splitlines()[0]}; torch and torchvision must be a matching pair")
    return ", ".join(found)


def gpu(torch) -> str:
    built_for = torch.version.cuda
    if built_for is None:
        fail(f"torch {torch.__version__} is a CPU-only build: install a CUDA build of torch")
    if not torch.cuda.is_available():
        driver = nvidia_smi("driver_version")
        if driver is None:
            fail("no usable NVIDIA GPU (torch.cuda.is_available() is False, nvidia-smi absent or failing); this "
                 "check needs one (--cpu-smoke runs its commands on the CPU)")
        fail(f"torch {torch.__version__} (built for CUDA {built_for}) cannot use the GPU with NVIDIA driver {driver}: "
             f"install a driver that supports CUDA {built_for}, or a torch build for the driver's CUDA version; "
             "--device auto would silently train on the CPU")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from ddp_utils.runtime.precision import native_bf16

    props = torch.cuda.get_device_properties(0)
    driver = nvidia_smi("driver_version") or "?"
    bf16 = "native bf16" if native_bf16(torch.device("cuda", 0)) else "no native bf16: --amp auto trains in fp32"
    return (f"{torch.cuda.get_device_name(0)} ({props.total_memory / 2**30:.0f} GiB, {bf16}), "
            f"{torch.cuda.device_count()} visible, driver {driver}, CUDA {built_for}")


# ----------------------------------------------------------------------------- /dev/shm
def shm_free(shm_dir: str = SHM_DIR) -> int | None:
    """Free bytes in ``shm_dir`` as host_memory.shm_problem reads them (shutil.disk_usage's free:
    statvfs's f_bavail x f_frsize), or ``GPU_CHECK_SHM_BYTES`` when set; None without that folder
    (no POSIX shared memory there: the project's check passes)."""
    override = os.environ.get("GPU_CHECK_SHM_BYTES", "").strip()
    if override:
        return int(override)
    try:
        stat = os.statvfs(shm_dir)
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize


def size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def shm_said(free: int | None) -> str:
    return f"{SHM_DIR} {size(free)} free" if free is not None else f"no {SHM_DIR}"


def most_workers(need, room: float | None, up_to: int) -> int:
    """The most workers in 0..``up_to`` whose ``need(workers)`` bytes fit in ``room`` (None: any)."""
    workers = up_to
    while workers > 0 and room is not None and need(workers) > room:
        workers -= 1
    return workers


def fit_shared_memory(free: int | None, jpeg_dir: str | None, batch: int, image_size: int, asked: list[int],
                      smoke_batch: int, smoke_workers: int) -> dict:
    """The loader parts' sizes for ``free`` bytes of /dev/shm and one rank: each run's need by
    ``host_memory.loader_memory`` (the function the project's check calls), at most
    ``SHM_SHARE x free``. The bounds it computes, per rank (host_memory.py; W workers, T and E the
    bytes of a training batch of B images and of an evaluation batch of ``eval_batch_size(B)``,
    256 images at B = 64 or 128):

    * ``--aug-on device --decode-on loader``: the workers keep their buffers (decoded atlases of
      ATLAS_PADDING x 3 x the folder's mean pixels per image), (T + E) x W x KEPT_PER_WORKER;
    * ``--decode-on device`` (the files' bytes per image) and ``--aug-on loader`` (float32 views,
      views x 3 x S x S x 4 bytes per image): T x (W x TRAIN_PREFETCH + 1) + E x (W x EVAL_PREFETCH + 1).

    Both grow with W and B. The JPEG parts get the most workers whose larger need (of the two
    decode modes) fits, up to the largest count in ``asked`` (-1: every usable CPU but the
    rank's), at batch ``batch``; when not one worker fits, the batch is halved (down to
    MIN_BATCH); when nothing fits, 0 workers at ``batch`` (the training process reads: nothing
    goes through /dev/shm). The MoCo smoke run (CIFAR-10 at 32 px, ``--aug-on loader``) gets the
    most of ``smoke_workers`` that fit at ``smoke_batch``. ``free`` None: no limit.

    Returns ``batch``; ``cap``, the JPEG parts' most workers; ``workers``, each of ``asked``
    resolved and capped, in order; ``smoke_workers``; ``need``, ``smoke_need``: bytes at those
    sizes; ``per_worker``: the JPEG parts' bytes for each worker at that batch."""
    import torch
    from torch.utils.data import TensorDataset

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from ddp_utils.data.host_memory import loader_memory
    from ddp_utils.data.pipeline import default_workers
    from ddp_utils.data.sets import load_raw_splits

    room = None if free is None else SHM_SHARE * free
    every = default_workers("imagefolder", 1)
    up_to = max(every if w == -1 else w for w in asked)

    def jpeg_need(train, b: int):
        def need(workers: int) -> int:
            memories = [loader_memory(train, batch_size=b, workers=workers, views=2, image_size=image_size,
                                      aug_on_device=True, decode_on_device=on_device) for on_device in (False, True)]
            return max(0 if memory is None else memory.per_rank for memory in memories)  # None: no workers
        return need

    chosen, cap, need, per_worker = batch, 0, 0, 0
    if jpeg_dir is not None:
        train, _ = load_raw_splits("imagefolder", jpeg_dir, image_size, 0, False)
        b = batch
        while True:
            cap = most_workers(jpeg_need(train, b), room, up_to)
            if cap > 0 or b // 2 < MIN_BATCH:
                break
            b //= 2
        chosen = b if cap > 0 else batch
        need, per_worker = jpeg_need(train, chosen)(cap), jpeg_need(train, chosen)(1)
    workers = [min(every if w == -1 else w, cap) for w in asked]
    plain = TensorDataset(torch.empty(0))  # not image files: the loader path's float32 views

    def smoke_need(w: int) -> int:
        memory = loader_memory(plain, batch_size=smoke_batch, workers=w, views=2, image_size=32, aug_on_device=False,
                               decode_on_device=False)
        return 0 if memory is None else memory.per_rank

    smoke = most_workers(smoke_need, room, smoke_workers)
    return {"batch": chosen, "cap": cap, "workers": workers, "smoke_workers": smoke, "need": need,
            "smoke_need": smoke_need(smoke), "per_worker": per_worker}


def shm_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="gpu_preflight.py --shm")
    parser.add_argument("--jpeg-dir", help="the ImageNet-like folder (left out: no JPEG parts to size)")
    parser.add_argument("--batch", type=int, required=True, help="the JPEG parts' batch, at most")
    parser.add_argument("--image-size", type=int, required=True)
    parser.add_argument("--workers", type=int, nargs="+", required=True, help="the counts asked, -1 = all usable")
    parser.add_argument("--smoke-batch", type=int, required=True)
    parser.add_argument("--smoke-workers", type=int, required=True)
    args = parser.parse_args(argv)
    free = shm_free()
    fit = fit_shared_memory(free, args.jpeg_dir, args.batch, args.image_size, args.workers, args.smoke_batch,
                            args.smoke_workers)
    print(f"batch={fit['batch']} workers={','.join(map(str, fit['workers']))} cap={fit['cap']} "
          f"smoke_workers={fit['smoke_workers']}")
    bound = "no limit" if free is None else f"at most {SHM_SHARE:.0%} of it"
    counts = sorted(set(fit["workers"]), reverse=True)
    jpeg = (f"JPEG batch {fit['batch']}, {' or '.join(map(str, counts))} worker(s) (up to {fit['cap']} fit, "
            f"{size(fit['per_worker'])} each); " if args.jpeg_dir else "no JPEG folder; ")
    print(f"| /dev/shm | the loader parts' workers and batch, fitted to {SHM_DIR} (host_memory.py's bound, one rank) "
          f"| {shm_said(free).removeprefix(SHM_DIR + ' ')} | {jpeg}MoCo smoke {fit['smoke_workers']} worker(s); "
          f"needs {size(fit['need'])} and {size(fit['smoke_need'])}, {bound} |")


def main() -> None:
    argv = sys.argv[1:]
    if argv[:1] == ["--shm"]:
        return shm_main(argv[1:])
    cpu_only = argv == ["--cpu"]
    if argv not in ([], ["--cpu"]):
        fail("usage: python bench/gpu_preflight.py [--cpu]")
    found = imports()
    import torch

    where = "CPU smoke test" if cpu_only else gpu(torch)
    print(f"python {sys.version.split()[0]}, {found}; {where}; {shm_said(shm_free())}")


if __name__ == "__main__":
    main()
