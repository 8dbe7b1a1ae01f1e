"""Write an image folder's train/ and val/ as shards: tar files in WebDataset's layout, with an index.

    python write_shards.py /data/imagenet /data/imagenet-shards
    python write_shards.py SRC DST --shard-mb 256 --threads 16 --skip-unreadable

The index reads any sample by its number (the layout: ``ddp_utils/data/shards.py``). Every file is
read once, decoded to check it (as a run decodes it) and written with its original bytes, its class
index, its class folder's name and its index in the folder's listing, in an order drawn from --seed,
so that each shard holds a mix of the classes. A file that cannot be decoded is listed with its
reason and nothing is left at DST (exit 2), unless --skip-unreadable leaves such files out (they are
listed, and kept in index.json). DST appears only when both splits are written: the shards are
written into DST.partial-PID first, which an interrupted or failed run removes. Progress, with an
ETA, on stderr.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ddp_utils.config import UsageError, check_bounds, opt, parse_config, positional
from ddp_utils.data.image_files import FolderListing, UnreadableImage, decode_rgb_bytes, device_decodable
from ddp_utils.data.sets import check_data_dir, list_image_split
from ddp_utils.data.shards import (
    FORMAT,
    INDEX,
    RECORDS,
    VERSION,
    Record,
    file_sha256,
    image_members,
    sample_key,
    shard_name,
)

SCRIPT = "write_shards.py"
PROGRESS_EVERY_S = 5.0


@dataclass
class ShardsConfig:
    """write_shards.py's command line (``ddp_utils.config``: the flags, their bounds and errors)."""

    src: str = positional("the image folder: SRC/train/CLASS/* and SRC/val/CLASS/*")
    dst: str = positional("a new folder for the shards (DST/train/, DST/val/)")
    shard_mb: float = opt(256.0, "MB: a shard is closed once it holds this much", above=0)
    threads: int = opt(0, "threads that read and decode the files (0: every CPU this process may use)", at_least=0)
    seed: int = opt(0, "the files go into the shards in an order drawn from this seed, so that each shard mixes the "
                    "classes (the index keeps the folder's order)")
    skip_unreadable: bool = opt(False, "leave out files that cannot be decoded (listed) instead of stopping with "
                                "exit 2")


def parse_args(argv: list[str] | None) -> ShardsConfig:
    """The command line as a checked config; bad input: one line on stderr and exit 2."""
    cfg = parse_config(ShardsConfig, argv, __doc__, prog=SCRIPT, config_file=False)
    try:
        check_bounds(cfg)
    except UsageError as err:
        print(f"{SCRIPT}: error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    return cfg


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    threads = cfg.threads or len(os.sched_getaffinity(0))
    dst = Path(cfg.dst)
    partial = dst.with_name(f"{dst.name}.partial-{os.getpid()}")
    try:
        if importlib.util.find_spec("webdataset") is None:
            raise UsageError("the webdataset package is missing; install it: pip install -r requirements-shards.txt")
        problem = check_data_dir("imagefolder", cfg.src, download=False, named="SRC")
        if problem:
            raise UsageError(problem)
        if dst.exists():
            raise UsageError(f"DST {dst} exists; choose a new folder (nothing there is changed)")
        listings = {split: list_image_split(cfg.src, split == "train") for split in ("train", "val")}
        partial.mkdir(parents=True)
        left_out = []
        for split, listing in listings.items():
            left_out += write_split(listing, partial / split, int(cfg.shard_mb * 1e6), threads,
                                    cfg.skip_unreadable, split, cfg.seed)
        if left_out and not cfg.skip_unreadable:
            total = sum(len(listing.targets) for listing in listings.values())
            listed = "".join(f"\n  {err}" for err in left_out)
            raise UsageError(f"{len(left_out)} of {total:,} image files cannot be decoded; nothing was written; "
                             f"fix or remove them, or leave them out with --skip-unreadable:{listed}")
        partial.rename(dst)
    except UsageError as err:
        print(f"{SCRIPT}: error: {err}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        print(f"{SCRIPT}: interrupted; nothing was written at {dst}", file=sys.stderr, flush=True)
        return 130
    finally:
        if partial.exists():
            shutil.rmtree(partial)
    if left_out:
        print(f"left out {len(left_out)} file(s) that cannot be decoded:", *(f"  {err}" for err in left_out),
              sep="\n", flush=True)
    print(f"{SCRIPT}: wrote {dst} (train/ and val/)", flush=True)
    return 0


def write_split(listing: FolderListing, out: Path, shard_bytes: int, threads: int, skip_unreadable: bool,
                split: str, seed: int = 0) -> list[UnreadableImage]:
    """``listing``'s files as shards in ``out``, in an order drawn from ``seed`` (each shard a mix
    of the classes), with its index and records (in the folder's order); the files that cannot be
    decoded (left out with ``skip_unreadable``; else the writing stops at the first and the rest
    are only checked)."""
    out.mkdir(parents=True)
    samples = listing.samples()
    relative = listing.paths.split("\0") if listing.paths else []
    writer, kept, bad = _ShardWriter(out, shard_bytes), [], []
    progress = _Progress(split, len(samples))
    drawn = torch.randperm(len(samples), generator=torch.Generator().manual_seed(seed)).tolist()
    facts = {}  # i: (width, height, device-decodable) of each file written
    for done, (i, (data, error)) in enumerate(_checked_bytes(samples, drawn, threads), 1):
        if error is not None:
            bad.append(error)
        elif skip_unreadable or not bad:
            writer.add(i, data[0], relative[i], listing.classes[samples[i][1]], samples[i][1])
            kept.append(i)
            facts[i] = data[1]
        progress.update(done)
    writer.close()
    bad.sort(key=lambda err: err.path)
    if bad and not skip_unreadable:
        return bad
    records = writer.records()
    kept.sort()  # the records in the folder's order: sample i is the folder's i-th kept file
    order = [records[sample_key(i)] for i in kept]
    np.savez(out / RECORDS, shard=np.array([r.shard for r in order], dtype=np.int32),
             offset=np.array([r.offset for r in order], dtype=np.int64),
             size=np.array([r.size for r in order], dtype=np.int64),
             label=np.array([samples[i][1] for i in kept], dtype=np.int32), index=np.array(kept, dtype=np.int64),
             width=np.array([facts[i][0] for i in kept], dtype=np.int32),
             height=np.array([facts[i][1] for i in kept], dtype=np.int32),
             device_decodable=np.array([facts[i][2] for i in kept], dtype=bool),
             paths=np.frombuffer("\0".join(relative[i] for i in kept).encode(), dtype=np.uint8))
    (out / INDEX).write_text(json.dumps({
        "format": FORMAT, "version": VERSION, "split": split, "classes": list(listing.classes), "samples": len(kept),
        "written_in_order_drawn_from_seed": seed,
        "shards": writer.shards, "left_out": [str(err) for err in bad]}, indent=1) + "\n")
    progress.done(len(writer.shards), sum(s["bytes"] for s in writer.shards))
    return bad


def _checked_bytes(samples: list[tuple[str, int]], order: list[int], threads: int):
    """(i, ((bytes, (width, height, device-decodable)), None)) or (i, (None, UnreadableImage))
    for each file ``samples[i]``, ``i`` in ``order``; read and decoded on ``threads`` threads (the
    decoders release the GIL), a bounded number ahead."""
    def check(path: str):
        try:
            with open(path, "rb") as f:
                data = f.read()
            width, height = decode_rgb_bytes(data, path).size
            return (data, (width, height, device_decodable(torch.from_numpy(np.frombuffer(data, np.uint8).copy())))), None
        except UnreadableImage as err:
            return None, err
        except OSError as err:
            return None, UnreadableImage(path, str(err))

    with ThreadPoolExecutor(max_workers=threads) as pool:
        ahead: deque = deque()
        for i in order:
            ahead.append((i, pool.submit(check, samples[i][0])))
            if len(ahead) >= 4 * threads:
                j, future = ahead.popleft()
                yield j, future.result()
        while ahead:
            j, future = ahead.popleft()
            yield j, future.result()


class _ShardWriter:
    """Tar shards in WebDataset's layout (written by its TarWriter), a new one once a shard holds
    ``shard_bytes``; ``records()`` reads back where each image lies."""

    def __init__(self, out: Path, shard_bytes: int):
        self.out, self.shard_bytes = out, shard_bytes
        self.shards: list[dict] = []
        self._tar = None
        self._ext: dict[str, str] = {}
        self._keys: list[dict[str, str]] = []

    def add(self, index: int, data: bytes, path: str, class_name: str, label: int) -> str:
        import webdataset

        if self._tar is None:
            self._file = open(self.out / shard_name(len(self.shards)), "wb")
            self._tar = webdataset.TarWriter(self._file, encoder=False, mtime=0.0)
            self._keys.append({})
        key, ext = sample_key(index), (Path(path).suffix.lower().lstrip(".") or "img")
        meta = json.dumps({"path": path, "class": class_name, "index": index}).encode()
        self._tar.write({"__key__": key, ext: data, "cls": str(label).encode(), "json": meta})
        self._keys[-1][key] = ext
        if self._file.tell() >= self.shard_bytes:
            self._close_shard()
        return key

    def _close_shard(self) -> None:
        self._tar.close()
        self._file.close()
        path = self.out / shard_name(len(self.shards))
        self.shards.append({"name": path.name, "bytes": path.stat().st_size, "sha256": file_sha256(path),
                            "samples": len(self._keys[-1])})
        self._tar = None

    def close(self) -> None:
        if self._tar is not None:
            self._close_shard()

    def records(self) -> dict[str, Record]:
        """{key: where its image lies}, from the written shards' own tar headers."""
        found = {}
        for number, keys in enumerate(self._keys):
            for key, record in image_members(self.out / shard_name(number), keys).items():
                found[key] = Record(number, record.offset, record.size)
        return found


class _Progress:
    def __init__(self, split: str, total: int):
        self.split, self.total, self.start, self.last = split, total, time.perf_counter(), time.perf_counter()

    def update(self, done: int) -> None:
        now = time.perf_counter()
        if now - self.last >= PROGRESS_EVERY_S or done == self.total:
            self.last = now
            rate = done / max(now - self.start, 1e-9)
            eta = (self.total - done) / rate if rate else 0.0
            print(f"{self.split}: {done:,}/{self.total:,} files read and checked ({rate:,.0f}/s, ETA "
                  f"{time.strftime('%H:%M:%S', time.gmtime(eta))})", file=sys.stderr, flush=True)

    def done(self, shards: int, size: int) -> None:
        took = time.perf_counter() - self.start
        per_100k = took / max(self.total, 1) * 100_000
        print(f"{self.split}: {self.total:,} files in {shards} shard(s), {size / 1e6:,.1f} MB, in {took:.1f} s "
              f"({per_100k:,.0f} s per 100,000 files)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
