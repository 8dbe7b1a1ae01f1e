"""The start-up cost of an image folder's file list, per rank: every rank scans the tree (before)
against rank 0 scanning it and sending the listing to the others (``list_image_files_once``).

    python bench/file_list.py                      # ImageNet's shape: 1,281,167 + 50,000 empty files
    python bench/file_list.py --train 100000 --ranks 4 --root /mnt/shared/listing

The tree (``ROOT/train/nNNNN/`` and ``ROOT/val/nNNNN/``, 1,000 classes of empty ``.JPEG`` files:
the scan reads names, never contents) is written once and kept for later rounds. Each mode runs
on ``--ranks`` gloo ranks started together, each rank timing from the barrier before the listing
to holding both splits' listings as ``ImageFiles`` take them. Prints one markdown table: per mode
the slowest rank's median over ``--rounds`` (modes interleaved), the directory trees the job
scanned, and the listing's bytes as sent; and, for scale, rank 0's scan while the others idle.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import sys
import time
from pathlib import Path

import torch.distributed as dist

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from ddp_utils.data.image_files import ImageFiles  # noqa: E402
from ddp_utils.data.sets import list_image_split  # noqa: E402
from ddp_utils.runtime.collectives import all_gather_object  # noqa: E402
from ddp_utils.runtime.dist import cleanup_distributed, init_distributed  # noqa: E402
from ddp_utils.runtime.spawn import spawn_local  # noqa: E402
from ddp_utils.train.preflight import list_image_files_once  # noqa: E402
from train_classifier import ClassifierConfig  # noqa: E402

CLASSES = 1000
IMAGENET_TRAIN, IMAGENET_VAL = 1_281_167, 50_000


def write_tree(root: Path, train: int, val: int) -> None:
    """Empty files named like ImageNet's, spread evenly over CLASSES class folders; skipped when
    a tree of this size is already there."""
    stamp = root / f".written-{train}-{val}"
    if stamp.exists():
        return
    for split, count in (("train", train), ("val", val)):
        for c in range(CLASSES):
            folder = root / split / f"n{c:08d}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(c, count, CLASSES):
                (folder / f"n{c:08d}_{i}.JPEG").touch()
    stamp.touch()


def _rank(rank: int, root: str, rounds: int, results: str) -> None:
    info = init_distributed("cpu", timeout_s=3600)
    cfg = ClassifierConfig(dataset="imagefolder", data_dir=root, device="cpu")
    times: dict[str, list[float]] = {"every rank scans": [], "rank 0 scans, sends": [], "rank 0 scans alone": []}
    sizes = {}
    for _ in range(rounds):
        for mode in times:
            dist.barrier()
            start = time.perf_counter()
            if mode == "every rank scans" or (mode == "rank 0 scans alone" and info.is_main):
                listings = (list_image_split(root, True), list_image_split(root, False))
            elif mode == "rank 0 scans, sends":
                listings, _ = list_image_files_once(cfg, info)
            else:
                continue  # the others idle
            files = [ImageFiles(listing) for listing in listings]  # what a run's data set holds
            times[mode].append(time.perf_counter() - start)
            sizes[mode] = len(pickle.dumps(listings))
            counts = len(files[0]), len(files[1])
    every = {mode: all_gather_object(t) for mode, t in times.items()}
    slowest = {mode: [max(per_rank) for per_rank in zip(*[t for t in ranks if t])] for mode, ranks in every.items()}
    if info.is_main:
        Path(results).write_text(json.dumps([slowest, sizes, *counts, info.world_size]))
    cleanup_distributed()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default="/tmp/file_list_tree", help="where the tree of empty files is written")
    parser.add_argument("--train", type=int, default=IMAGENET_TRAIN, help="files in train/")
    parser.add_argument("--val", type=int, default=IMAGENET_VAL, help="files in val/")
    parser.add_argument("--ranks", type=int, default=2, help="gloo ranks on this machine")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds of each mode")
    args = parser.parse_args(argv)
    root = Path(args.root)
    started = time.perf_counter()
    write_tree(root, args.train, args.val)
    print(f"tree: {args.train:,} + {args.val:,} files in {CLASSES} classes at {root} "
          f"(ready in {time.perf_counter() - started:.0f} s); {args.ranks} ranks, {os.cpu_count()} CPUs")
    results = root / "results.json"
    # forkserver: the ranks fork from one process that imported the bench (and torch) once
    spawn_local(_rank, args.ranks, str(root), args.rounds, str(results), start_method="forkserver")
    slowest, sizes, n_train, n_val, world = json.loads(results.read_text())
    assert (n_train, n_val) == (args.train, args.val)
    print()
    print("| mode | start-up of the slowest rank (median) | directory trees scanned by the job | listing sent |")
    print("|---|---:|---:|---:|")
    for mode, scans in (("every rank scans", world), ("rank 0 scans, sends", 1), ("rank 0 scans alone", 1)):
        sent = f"{sizes[mode] / 1e6:.1f} MB to {world - 1} rank(s)" if mode == "rank 0 scans, sends" else "nothing"
        print(f"| {mode} | {statistics.median(slowest[mode]):.2f} s | {scans} | {sent} |")


if __name__ == "__main__":
    main()
