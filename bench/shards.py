"""Shards against the image folder they were written from, measured side by side in one run.

    python bench/shards.py                       # a 3,000 + 200 image ImageNet-like folder, 8 ranks on paper
    python bench/shards.py --folder /data/imagenet-subset --shard-mb 64

Prints four markdown tables:

1. read + decode rate on one core: the same files read from the folder (one open each), from its
   shards on the file system (``pread`` of a shard open once) and from a bucket of an S3 server on
   localhost (moto, when installed: whole shards through a rank's cache), each as the device
   path's workers read them (the file's bytes, then decoded to uint8 pixels) and bytes only;
   rounds interleaved, the median;
2. file opens (or downloads) per rank in one epoch at ``--ranks`` ranks of ``--workers``
   DataLoader workers each, counted while one rank's epoch is read in its order;
3. start-up: listing a tree of ImageNet's 1,281,167 + 50,000 empty files against reading a shard
   index of as many records (the shard files are sparse: only their sizes are read;
   ``--startup-images`` for a smaller tree);
4. on paper: metadata operations per second at 64 nodes x 8 GPUs and 2,500 images/s per GPU.
"""
from __future__ import annotations

import argparse
import builtins
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import write_shards  # noqa: E402
from bench.file_list import IMAGENET_TRAIN, IMAGENET_VAL, write_tree  # noqa: E402
from bench.imagenet_like import write_imagenet_like  # noqa: E402
from ddp_utils.data.image_files import FolderListing, ImageFiles, ShardFiles  # noqa: E402
from ddp_utils.data.order import ResumableDistributedSampler, ShardAwareSampler  # noqa: E402
from ddp_utils.data.sets import list_image_split  # noqa: E402
from ddp_utils.data.shard_cache import NodeCache  # noqa: E402
from ddp_utils.data.shards import FORMAT, INDEX, RECORDS, VERSION, ShardIndex, shard_name  # noqa: E402
from ddp_utils.runtime.spawn import free_port  # noqa: E402

GPUS, RATE = 64 * 8, 2500  # on paper: 64 nodes x 8 GPUs, images per second per GPU


def read_rate(files: ImageFiles, order: list[int], decode: bool) -> float:
    """Images per second on this core: each of ``order`` read (and decoded) as the device path's
    workers do."""
    data = files.reading("decoded") if decode else files
    started = time.perf_counter()
    for i in order:
        data[i] if decode else data.bytes_of(i)  # noqa: B018
    return len(order) / (time.perf_counter() - started)


def start_s3(shards: Path) -> tuple[subprocess.Popen, str] | None:
    server = Path(sys.executable).with_name("moto_server")
    if not server.exists():
        return None
    import boto3

    port = free_port()
    proc = subprocess.Popen([str(server), "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    os.environ.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_ACCESS_KEY_ID="bench",
                      AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
    for _ in range(300):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.1)
    client = boto3.client("s3")
    client.create_bucket(Bucket="bench")
    for path in shards.rglob("*"):
        if path.is_file():
            client.upload_file(str(path), "bench", f"shards/{path.relative_to(shards)}")
    return proc, "s3://bench/shards"


def count_opens(read, order: list[int]) -> int:
    """Files opened while ``read(i)`` runs for each of ``order`` (``open`` and ``os.open``)."""
    opened = [0]
    real_open, real_os_open = builtins.open, os.open

    def counting_open(*args, **kwargs):
        opened[0] += 1
        return real_open(*args, **kwargs)

    def counting_os_open(*args, **kwargs):
        opened[0] += 1
        return real_os_open(*args, **kwargs)

    builtins.open, os.open = counting_open, counting_os_open
    try:
        for i in order:
            read(i)
    finally:
        builtins.open, os.open = real_open, real_os_open
    return opened[0]


def synthetic_index(root: Path, samples: int, shard_bytes: int, per_shard: int) -> None:
    """A shard index of ``samples`` records in sparse shard files (sizes only), as
    ``write_shards.py`` lays it out."""
    root.mkdir(parents=True, exist_ok=True)
    shards = -(-samples // per_shard)
    entries = []
    for number in range(shards):
        with open(root / shard_name(number), "wb") as f:
            f.truncate(shard_bytes)
        entries.append({"name": shard_name(number), "bytes": shard_bytes, "sha256": "0" * 64, "samples": per_shard})
    index = np.arange(samples)
    paths = "\0".join(f"n{i % 1000:08d}/n{i % 1000:08d}_{i}.JPEG" for i in range(samples))
    np.savez(root / RECORDS, shard=(index // per_shard).astype(np.int32), offset=(index % per_shard) * 110_000 + 1536,
             size=np.full(samples, 110_000), label=(index % 1000).astype(np.int32), index=index,
             paths=np.frombuffer(paths.encode(), dtype=np.uint8))
    (root / INDEX).write_text(json.dumps({"format": FORMAT, "version": VERSION, "classes": [
        f"n{c:08d}" for c in range(1000)], "samples": samples, "shards": entries, "left_out": []}))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", default="", help="an image folder (default: a bench/imagenet_like.py one)")
    parser.add_argument("--images", type=int, default=3000, help="training images of the default folder")
    parser.add_argument("--shard-mb", type=float, default=16.0, help="shard size for the folder's shards")
    parser.add_argument("--ranks", type=int, default=8, help="ranks of the job whose epoch is counted")
    parser.add_argument("--workers", type=int, default=8, help="DataLoader workers per rank")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--startup-images", type=int, default=IMAGENET_TRAIN,
                        help="training images of the start-up table's tree and index (default: ImageNet's)")
    parser.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "bench-shards"),
                        help="where the folder, its shards and the start-up table's tree are written (kept)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    work = Path(args.work)
    folder = Path(args.folder) if args.folder else work / "imagenet_like"
    if not args.folder and not (folder / "train").is_dir():
        classes = max(1, args.images // 300)
        write_imagenet_like(folder, classes=classes, train_per_class=-(-args.images // classes), val_per_class=20)
    shards = work / f"shards-{args.shard_mb:g}mb"
    if not shards.exists():
        assert write_shards.main([str(folder), str(shards), "--shard-mb", str(args.shard_mb)]) == 0

    folder_files = ImageFiles(FolderListing.of(str(folder / "train")))
    shard_files = ShardFiles(ShardIndex.read(str(shards / "train")))
    sources = {"folder (a file per image)": folder_files, "shards on the file system": shard_files}
    s3 = start_s3(shards)
    if s3:
        cache = NodeCache(str(work / "cache"), 8 << 30, rank=0, patience=0.0).prepare()
        sources["shards from S3 on localhost (cache warm)"] = ShardFiles(ShardIndex.read(f"{s3[1]}/train"), cache)
    order = torch.randperm(len(folder_files), generator=torch.Generator().manual_seed(0)).tolist()
    for files in sources.values():  # page cache and the S3 cache warm: the decoding and the reads compared
        read_rate(files, order, decode=False)
    rates = {(name, decode): [] for name in sources for decode in (False, True)}
    for _ in range(args.rounds):
        for name, files in sources.items():
            for decode in (False, True):
                rates[name, decode].append(read_rate(files, order, decode))
    base = statistics.median(rates["folder (a file per image)", True])
    print(f"\n{len(order):,} training images ({sum(os.path.getsize(p) for p, _ in folder_files.samples) / 1e6:,.0f} "
          f"MB) in {len(shard_files.index.shards)} shards of about {args.shard_mb:g} MB; one core, in the page cache, "
          f"median of {args.rounds} rounds\n")
    print("| source | bytes only, img/s | bytes + decode, img/s | decode rate vs the folder |\n| --- | --: | --: | --: |")
    for name in sources:
        decoded = statistics.median(rates[name, True])
        print(f"| {name} | {statistics.median(rates[name, False]):,.0f} | {decoded:,.0f} | {decoded / base:.2f}x |")

    # 2. one rank's epoch: opens (folder, shards) or downloads (bucket), that rank's own order
    per_rank = len(folder_files) // args.ranks
    sampler = ResumableDistributedSampler(folder_files, args.ranks, 0, seed=0)
    sampler.set_epoch(0)
    mine = [i for _, i in sampler][:per_rank]
    folder_opens = count_opens(folder_files.bytes_of, mine)
    per_worker = [count_opens(ShardFiles(shard_files.index).bytes_of, mine[w::args.workers])
                  for w in range(args.workers)]  # each worker process opens the shards it reads once
    print(f"\n| one rank of {args.ranks}, {args.workers} workers, one epoch ({per_rank:,} images) | files opened "
          f"| per image |\n| --- | --: | --: |")
    print(f"| folder | {folder_opens:,} | {folder_opens / per_rank:.2f} |")
    print(f"| shards on the file system (the samples order) | {sum(per_worker):,} | {sum(per_worker) / per_rank:.3f} |")
    if s3:
        aware = ShardAwareSampler(shard_files.index.shard, args.ranks, 0, seed=0)
        cache = NodeCache(str(work / "cache-rank0"), 8 << 30, rank=0, patience=0.0).prepare()
        bucket_files = ShardFiles(ShardIndex.read(f"{s3[1]}/train"), cache)
        for i in aware.order():
            bucket_files.bytes_of(int(i))
        downloads = len(cache.downloads())
        print(f"| shards from S3 (the shards order): downloads | {downloads:,} | {downloads / per_rank:.3f} |")
        s3[0].terminate()

    # 3. start-up: the scan of ImageNet's tree against reading an index of as many records
    train = args.startup_images
    tree, index_root = work / f"tree-{train}", work / f"index-{train}"
    write_tree(tree, train, train * IMAGENET_VAL // IMAGENET_TRAIN)
    if not (index_root / INDEX).exists():
        synthetic_index(index_root, train, 256_000_000, 2_300)
    scan, read = [], []
    for _ in range(args.rounds):
        started = time.perf_counter()
        listing = list_image_split(str(tree), True)
        ImageFiles(listing)
        scan.append(time.perf_counter() - started)
        started = time.perf_counter()
        index = ShardIndex.read(str(index_root))
        ShardFiles(index)
        read.append(time.perf_counter() - started)
    whose = "ImageNet's train/" if train == IMAGENET_TRAIN else "a train/ like ImageNet's"
    print(f"\n| start-up, {whose} ({train:,} images) | seconds | files and folders read |\n"
          "| --- | --: | --: |")
    print(f"| scan the folder (one rank) | {statistics.median(scan):.2f} | {1000 + 1:,} folders, "
          f"{train + 1000:,} entries |")
    print(f"| read the shards' index (one rank) | {statistics.median(read):.2f} | 2 files, 1 folder of "
          f"{len(index.shards) + 2:,} entries |")

    # 4. on paper
    images = GPUS * RATE
    per_shard = 256e6 / 110e3  # images in a 256 MB shard of ImageNet (110 kB a JPEG)
    print(f"\n| on paper: {GPUS} GPUs x {RATE:,} img/s = {images:,} img/s | metadata operations per second |\n"
          "| --- | --: |")
    print(f"| folder: an open (path lookup) per image | {images:,} |")
    print(f"| shards on a file system: each worker opens each shard once, then only reads | 0 after start-up "
          f"({GPUS} x {args.workers} workers x {IMAGENET_TRAIN / per_shard:,.0f} shards opens, once) |")
    print(f"| shards from S3: a download per {per_shard:,.0f} images | {images / per_shard:,.0f} GETs of whole shards "
          f"({images / per_shard * 256 / 8:,.0f} with 8 MB ranged parts) |")
    shutil.rmtree(work / "cache", ignore_errors=True)
    shutil.rmtree(work / "cache-rank0", ignore_errors=True)


if __name__ == "__main__":
    main()
