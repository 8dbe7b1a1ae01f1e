"""Image files that cannot be decoded, on the data side: the rank's registry of them
(:class:`UnreadableFiles`, whose ``record`` each pass of image files calls on the batches it hands
out), their reason found by decoding them once more, how they are named to a user, and
``--check-data``'s pass that decodes whole splits. What a run then does (stop, list them, refuse
to resume until they decode) is ``train/unreadable_files.py``.

A file that cannot be decoded never raises inside a DataLoader worker: the traceback would name no
file, and the rank that met it would leave while its peers wait in a collective. It comes as a
black placeholder with target ``-1 - index`` (``image_files.ImageFiles``); the pass finds such
targets on the host, records the file here and hands on the batch with a valid target, so every
rank finishes the step and the per-step agreement stops them together. A shard that an object
store did not give travels the same way, and is recorded as the store's fault
(``object_store.StoreError``), never as an image that cannot be decoded.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
from torch.utils.data import Dataset

from ..config import UsageError
from ..runtime.collectives import all_gather_object
from .image_files import IN_SHARD, ImageFiles, ShardFiles, UnreadableImage, decode_rgb, image_files_of
from .object_store import StoreError
from .shards import ShardIndex


def decode_problem(files: ImageFiles, index: int) -> UnreadableImage | None:
    """Why sample ``index`` cannot be decoded (PIL's reason, or why its bytes could not be read:
    a shard cut short), or None when it decodes. A shard the object store does not give raises
    its :class:`object_store.StoreError`."""
    try:
        files.decode_pil(index)
    except UnreadableImage as err:
        return err
    except OSError as err:
        return UnreadableImage(files.name(index), str(err))
    return None


def why_unreadable(files: ImageFiles, index: int) -> UnreadableImage:
    """A sample that could not be decoded, with the reason PIL gives when it decodes it once more."""
    return decode_problem(files, index) or UnreadableImage(files.name(index),
                                                           "could not be decoded where the run decoded it")


def decode_again(name: str, indexes: dict[str, ShardIndex]) -> UnreadableImage | None:
    """Decode once more the image file or shard record that a run named ``name``
    (``ImageFiles.name``); None when it decodes now or is gone. ``indexes``: the shard indexes
    read so far, by folder (each is read once)."""
    if not os.path.exists(name):
        return _decode_record_again(name, indexes) if IN_SHARD in name else None
    try:
        decode_rgb(name)
    except UnreadableImage as err:
        return err
    return None


def _decode_record_again(name: str, indexes: dict[str, ShardIndex]) -> UnreadableImage | None:
    """Decode once more the shard record a run named ``name`` ("PATH in SHARD"); None when it
    decodes now or is gone (its shards written again without it)."""
    path, shard = name.rsplit(IN_SHARD, 1)
    root = shard.rsplit("/", 1)[0]
    if root not in indexes:
        indexes[root] = ShardIndex.read(root)
    paths = indexes[root].paths.split("\0")
    return decode_problem(ShardFiles(indexes[root]), paths.index(path)) if path in paths else None


@dataclass
class UnreadableFiles:
    """What this rank could not read so far (training, evaluation and kNN-bank batches): files
    it could not decode, and shards the object store did not give (``store_faults``)."""

    found: list[UnreadableImage] = field(default_factory=list)
    store_faults: list[StoreError] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.found or self.store_faults)

    def record(self, batch: list | tuple, files: ImageFiles) -> list | tuple:
        """``batch`` (of ``files``, its targets on the host) with each placeholder's target replaced
        by a valid label, its file recorded here (or the store's fault that kept it from being
        read): what a pass of image files calls on each batch it hands out."""
        targets = batch[1]
        if not (targets < 0).any():  # a host tensor: no device is read
            return batch
        for code in targets[targets < 0].tolist():
            try:
                self.found.append(why_unreadable(files, -1 - code))
            except StoreError as fault:
                self.store_faults.append(fault)
        return [batch[0], targets.clamp(min=0), *batch[2:]]

    def on_every_rank(self) -> tuple[list[UnreadableImage], list[StoreError]]:
        """Every rank's files and store faults, each once (every rank must call: one all_gather_object)."""
        everyone = all_gather_object(([(e.path, e.reason) for e in self.found], self.store_faults))
        unique = dict.fromkeys(item for files, _ in everyone for item in files)
        faults = {str(fault): fault for _, rank_faults in everyone for fault in rank_faults}
        return [UnreadableImage(path, reason) for path, reason in unique], list(faults.values())


def check_decodes(files: ImageFiles, threads: int) -> list[UnreadableImage]:
    """Decode every file of ``files`` on ``threads`` threads (PIL's decoder releases the GIL),
    shards' samples shard by shard (a cache smaller than the data downloads each shard once); the
    files that fail, in the data set's order."""
    order = np.argsort(files.index.shard, kind="stable") if isinstance(files, ShardFiles) else np.arange(len(files))
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        found = zip(order.tolist(), pool.map(lambda index: decode_problem(files, index), order.tolist()))
        return [err for _, err in sorted(found, key=lambda pair: pair[0]) if err is not None]


def decode_every_file(*splits: Dataset, threads: int) -> int:
    """``--check-data``: decode every image file of the splits on ``threads`` threads; the number
    of files, or UsageError listing each file that fails on a line of its own."""
    files = [image_files_of(split) for split in splits]
    bad = [err for f in files if f is not None for err in check_decodes(f, threads)]
    total = sum(len(f) for f in files if f is not None)
    if bad:
        listed = "".join(f"\n  {err}" for err in bad)
        raise UsageError(f"--check-data: {len(bad)} of {total:,} image files cannot be decoded; fix or remove "
                         f"them:{listed}")
    return total


def describe_unreadable(files: list[UnreadableImage], shown: int = 3) -> str:
    """"cannot decode PATH (reason)", or "cannot decode 5 files: A (..); B (..); C (..) and 2 more"."""
    if len(files) == 1:
        return f"cannot decode {files[0]}"
    more = f" and {len(files) - shown} more" if len(files) > shown else ""
    return f"cannot decode {len(files)} files: {'; '.join(map(str, files[:shown]))}{more}"


def fix_hint(files: list[UnreadableImage]) -> str:
    """What the user does about ``files``: an image file is fixed or removed; a shard record is
    made whole by copying its shard again (shards hold only files that decoded when written)."""
    if all(IN_SHARD in f.path for f in files):
        one = len({f.path.rsplit(IN_SHARD, 1)[1] for f in files}) == 1
        return (f"copy {'its' if len(files) == 1 else 'their'} shard{'' if one else 's'} again from where "
                f"write_shards.py wrote {'it' if one else 'them'} (--check-data compares every shard with its index)")
    return f"fix or remove {'it' if len(files) == 1 else 'them'} (--check-data lists every such file)"
