"""The host memory one rank's DataLoader workers fill on the ImageFolder path, measured against
the bound the pre-flight checks (``ddp_utils.data.host_memory``), in one run.

    python bench/host_memory.py                          # an ImageNet-like folder in a temp dir
    python bench/host_memory.py --data-dir /data/imagenet --batch-sizes 32 256 --workers 8

For each batch size and decode place, the real loaders of one rank (``build_data``, the CPU as
the device) go through two training epochs and one evaluation pass while a thread samples the
shared memory in use (``/dev/shm``, less what was in use before) every millisecond; a slow
consumer (a sleep per batch, as a busy GPU) lets every worker fill its prefetch slots. Printed:
the peak, the bound, and the bound for ``--per-rank-workers`` workers (e.g. 13: a DGX H100's 112
cores over 8 GPUs), with the pinned bound on CUDA. Pinned memory itself needs a GPU to measure.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.imagenet_like import write_imagenet_like  # noqa: E402
from ddp_utils.data.host_memory import SHM_DIR, eval_batch_size  # noqa: E402
from ddp_utils.data.pipeline import DataPlan, build_data, plan_memory  # noqa: E402
from ddp_utils.data.recipes import moco_recipe  # noqa: E402


def peak_shm_while(work) -> int:
    """Peak bytes in use in /dev/shm above the level before, while ``work()`` runs."""
    base, peak, done = shutil.disk_usage(SHM_DIR).used, [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], shutil.disk_usage(SHM_DIR).used - base)
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        work()
    finally:
        done.set()
        sampler.join()
    return peak[0]


def measure(plan: DataPlan, consume_s: float):
    """(peak bytes, the training split)."""
    loaders = build_data(plan, rank=0, world_size=1, device=torch.device("cpu"))

    def work():
        for epoch in range(2):
            loaders.set_epoch(epoch)
            for _ in loaders.train:
                time.sleep(consume_s)
        for _ in loaders.val:
            time.sleep(consume_s)
    return peak_shm_while(work), loaders.train_set


def mb(n: float) -> str:
    return f"{n / 1e6:,.0f} MB"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--data-dir", help="an ImageFolder root; default: a new ImageNet-like one")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 256])
    parser.add_argument("--workers", type=int, default=2, help="workers of the measured run")
    parser.add_argument("--per-rank-workers", type=int, default=13, help="workers per rank of the computed column")
    parser.add_argument("--consume-ms", type=float, default=300, help="the consumer's time per batch")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = args.data_dir
        if root is None:
            root = str(Path(tmp) / "imagenet_like")
            most = max(args.batch_sizes)  # enough images to fill every worker's prefetch slots, in both passes
            write_imagenet_like(root, classes=8, train_per_class=-(-most * (2 * args.workers + 2) // 8),
                                val_per_class=-(-eval_batch_size(most, True) * (args.workers + 1) // 8))
        print(f"{SHM_DIR} peak over 2 epochs and an evaluation pass, {args.workers} workers, one rank\n")
        print(f"| images per GPU | decoding | measured peak | bound ({args.workers} workers) | "
              f"bound ({args.per_rank_workers} workers) | pinned on CUDA ({args.per_rank_workers} workers) |")
        print("| --- | --- | --- | --- | --- | --- |")
        for batch in args.batch_sizes:
            for decode_on_device in (False, True):
                plan = DataPlan(dataset="imagefolder", data_dir=root, image_size=224, synthetic_samples=0, debug=False,
                                seed=0, batch_size=batch, workers=args.workers, normalization="auto",
                                recipe=moco_recipe("imagefolder", 224, "v2"), views=2, aug_on_device=True,
                                decode_on_device=decode_on_device)
                peak, train_set = measure(plan, args.consume_ms / 1000)
                bound = plan_memory(plan, train_set)
                big = plan_memory(replace(plan, workers=args.per_rank_workers), train_set)
                print(f"| {batch} | {'device' if decode_on_device else 'workers'} | {mb(peak)} | {mb(bound.per_rank)} "
                      f"| {mb(big.per_rank)} | {mb(big.pinned_per_rank)} |", flush=True)


if __name__ == "__main__":
    main()
