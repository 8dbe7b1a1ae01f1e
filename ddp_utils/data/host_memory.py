"""The host memory a rank's DataLoader workers fill: batches in shared memory (``/dev/shm``) on
their way to the training process, and on CUDA the pinned copies the loader makes of them; the
loader settings that bound it (each loader's prefetch, the evaluation batch's size); and the
pre-flight check that this node's ``/dev/shm`` can hold what its ranks need.

Bounds, per rank: a loader's batches in flight are at most ``workers x prefetch`` prepared plus
the one in use; a worker that packs decoded images keeps the buffers of its batches for the
next ones (``files_on_device.SharedBuffers``, at most :data:`KEPT_PER_WORKER`, each holding no
more than its last batch), so each such worker counts ``KEPT_PER_WORKER`` batches. A batch is in
shared memory until the loader pins it, then in pinned memory (the caching host allocator
rounds each block up to a power of two and keeps it for reuse), so each bound below holds for
either place. Evaluation and the kNN bank start their workers for each pass while the training
workers keep their prepared batches: both count at once.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

from torch.utils.data import Dataset

from ..config import UsageError
from .image_files import image_files_of

TRAIN_PREFETCH = 2     # batches each training worker prepares ahead (DataLoader's prefetch_factor)
EVAL_PREFETCH = 1      # batches each evaluation worker prepares ahead: the larger batches
# A worker's batches in flight: its prefetch (at most TRAIN_PREFETCH) plus the one it fills
# (tested against the prefetch).
KEPT_PER_WORKER = 3
EVAL_BATCH_FACTOR = 4  # evaluation batches are this many training micro-batches: no activations kept
EVAL_MAX_IMAGES = 256  # images per evaluation batch of image files, at most (or one training batch)
ATLAS_PADDING = 1.4     # an atlas's pixels over its images' pixels, at most (files_on_device.placements: 1.33 seen at 32)
SIZE_SAMPLE = 64        # image files whose headers give the mean image size
SHM_DIR = "/dev/shm"


@dataclass(frozen=True)
class LoaderMemory:
    """Bytes of one training and one evaluation batch as ``workers`` workers per rank hand them
    over, and how many of each a rank may hold at once (``kept``: the workers keep their
    buffers, ``files_on_device.SharedBuffers``)."""

    train_batch: int
    eval_batch: int
    workers: int
    kept: bool = False

    @property
    def train_in_flight(self) -> int:
        return self.workers * TRAIN_PREFETCH + 1

    @property
    def eval_in_flight(self) -> int:
        return self.workers * EVAL_PREFETCH + 1

    @property
    def per_rank(self) -> int:
        """Bytes in shared memory per rank, at most (also a bound of the pinned bytes, less
        the allocator's rounding)."""
        if self.kept:
            return (self.train_batch + self.eval_batch) * self.workers * KEPT_PER_WORKER
        return self.train_batch * self.train_in_flight + self.eval_batch * self.eval_in_flight

    @property
    def pinned_per_rank(self) -> int:
        """Pinned bytes per rank on CUDA, at most: the batches in flight, in the allocator's
        power-of-two blocks."""
        return _pow2(self.train_batch) * self.train_in_flight + _pow2(self.eval_batch) * self.eval_in_flight


def eval_batch_size(batch_size: int, image_files: bool) -> int:
    """Evaluation (and kNN-bank) batch size for a training micro-batch of ``batch_size``:
    ``EVAL_BATCH_FACTOR`` times it, capped for image files, whose batches go through shared memory."""
    if not image_files:
        return EVAL_BATCH_FACTOR * batch_size
    return min(EVAL_BATCH_FACTOR * batch_size, max(batch_size, EVAL_MAX_IMAGES))


def loader_memory(train: Dataset, *, batch_size: int, workers: int, views: int, image_size: int,
                  aug_on_device: bool, decode_on_device: bool) -> LoaderMemory | None:
    """The workers' batches of a run (None: no workers, or batches made on the device)."""
    files = image_files_of(train)
    if workers == 0 or (aug_on_device and files is None):
        return None
    eval_batch = eval_batch_size(batch_size, files is not None)
    if aug_on_device:  # an atlas of decoded images, or the files' bytes
        per_image = mean_encoded_bytes(files) if decode_on_device else ATLAS_PADDING * 3 * mean_image_pixels(files)
        train_sample, eval_sample = per_image, per_image
    else:  # per-sample transforms: float32 views at the network's size
        eval_sample = 3 * image_size * image_size * 4
        train_sample = views * eval_sample
    return LoaderMemory(train_batch=round(batch_size * train_sample), eval_batch=round(eval_batch * eval_sample),
                        workers=workers, kept=aug_on_device and not decode_on_device)


def _facts(files) -> list:
    """What the headers of at most SIZE_SAMPLE files spread over the split say
    (``ImageFiles.size_sample``, ``ImageFiles.file_facts``); files without one are left out."""
    return [facts for facts in map(files.file_facts, files.size_sample(SIZE_SAMPLE)) if facts is not None]


def mean_image_pixels(files) -> float:
    """Mean pixels per image over an even sample of the files, read from their headers."""
    pixels = [facts.size[0] * facts.size[1] for facts in _facts(files)]
    return sum(pixels) / len(pixels) if pixels else 0.0


def mean_encoded_bytes(files) -> float:
    """Mean bytes per image of an ``--decode-on device`` batch over an even sample of the files:
    the file's, or the pixels' of a file its worker decodes (``image_files.device_decodable``)."""
    sizes = [facts.bytes if facts.device_decodable else 3 * facts.size[0] * facts.size[1] for facts in _facts(files)]
    return sum(sizes) / len(sizes) if sizes else 0.0


def check_shared_memory(memory: LoaderMemory | None, ranks_on_node: int) -> None:
    """Bad input when this node's ``/dev/shm`` cannot hold its ranks' worker batches."""
    problem = shm_problem(memory, ranks_on_node)
    if problem:
        raise UsageError(problem)


def shm_problem(memory: LoaderMemory | None, ranks_on_node: int, shm_dir: str = SHM_DIR) -> str | None:
    """One line when ``shm_dir`` has less room than this node's ranks' workers need, with the fix;
    None when it has room (or does not exist: no POSIX shared memory there to check)."""
    if memory is None or not os.path.isdir(shm_dir):
        return None
    free = shutil.disk_usage(shm_dir).free
    need = ranks_on_node * memory.per_rank
    if need <= free:
        return None
    return (f"{shm_dir} has {size_text(free)} free; the DataLoader workers of this node's {ranks_on_node} rank(s) need "
            f"up to {size_text(need)} ({memory.workers} workers per rank, training batches of {size_text(memory.train_batch)}, "
            f"evaluation batches of {size_text(memory.eval_batch)}); give {shm_dir} more room (a container: docker run "
            f"--shm-size={_size_flag(need)} or --ipc=host) or lower --workers or --batch-size")


def describe_memory(memory: LoaderMemory, ranks_on_node: int, shm_dir: str = SHM_DIR) -> str:
    """One line for ``--check``: the workers' host memory per rank, and the room in ``shm_dir``."""
    room = f"; {shm_dir} has {size_text(shutil.disk_usage(shm_dir).free)} free" if os.path.isdir(shm_dir) else ""
    return (f"host memory: the DataLoader workers' batches take up to {size_text(memory.per_rank)} per rank in shared memory "
            f"({size_text(memory.pinned_per_rank)} pinned on CUDA), {size_text(ranks_on_node * memory.per_rank)} for this "
            f"node's {ranks_on_node} rank(s){room}")


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def size_text(n: float) -> str:
    """Bytes in words: "1.5 GB", "423.9 MB"."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def _size_flag(n: float) -> str:
    """docker's --shm-size value: whole gigabytes, rounded up."""
    return f"{-(-int(n) // 10**9)}g"
