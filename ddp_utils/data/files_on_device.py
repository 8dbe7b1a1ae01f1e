"""Image files finished on the training device (``--dataset imagefolder --aug-on device``): the
path ``pipeline`` chooses for them; nothing else needs this module.

One batch, in the order it passes here:

1. a DataLoader worker reads each file (``image_files.ImageFiles``, read as "decoded", or as
   "encoded" with ``--decode-on device``) and :func:`collate_files` packs the batch: decoded
   images into one atlas in a shared-memory buffer the worker reuses (:func:`pack`,
   :class:`PackedImages`, :class:`SharedBuffers`), a file's bytes into one
   :class:`EncodedBatch`;
2. in the training process, a thread of :class:`FinishOnDevice`'s (:class:`ThreadBatches`) takes the
   batch from the loader while the training loop computes, copies the atlas to the device, or
   decodes the encoded batch there (:func:`decode_on`: nvJPEG on CUDA, through torchvision; an
   image it refuses is decoded on the CPU and counted, :class:`DecodeFallbacks`) and packs it;
3. in that thread, ``batch_augment.DeviceAugment.packed`` cuts every view's crop from the atlas
   and augments the views as batches, keyed by (seed, epoch, index); the finished batch waits
   (at most :data:`AHEAD` of them) until the loop takes it. On CUDA steps 2 and 3 run on the
   device's data stream, and the batch is handed to the training stream as the loop takes it
   (``data_stream``: the training stream waits for the batch's event, its tensors are recorded
   on the training stream).

The atlas (H x W x 3 uint8: channels last, the decoders' own layout, so that each image goes in
with one contiguous copy per row) holds each image (3 x h x w) in rows; ``places`` (B x 4: top,
left, height, width) say where each image lies, and each view is read from a view of its
image's own pixels and its repeated edge (``batch_augment.crop_from_atlas``), never another image's. The same
:func:`pack` runs in a worker (CPU decoding) and on the training device (GPU decoding).
"""
from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
import logging
import mmap
import os
import re
import sys
import threading
import traceback
import weakref
from dataclasses import dataclass
from typing import Callable, Iterator, NamedTuple

import numpy as np
import torch
from torch import Tensor
from torch.profiler import record_function
from torch.utils.data import DataLoader, Dataset, default_collate

from .batch_augment import DeviceAugment, pinned_to_device
from .data_stream import Batches, CudaCalls, DataStream, LoopBatches, Made
from .host_memory import ATLAS_PADDING, KEPT_PER_WORKER, size_text
from .image_files import jpeg_decoder, sample_path
from .order import augmentation_index

ATLAS_WIDTH = 2048  # px: rows of the atlas are at least this wide (wider for a wider image)
EDGE = 1  # px: each image's edge repeated around it in the atlas (what the resampling may read beyond a crop)


# ----------------------------------------------------------------------------- 1. in the worker
def collate_files(samples: list) -> list:
    """A batch of image files from (image, target, epoch, index[, repetition]) samples: decoded images (3 x h x w
    uint8, each its own size) packed here, in the worker (:class:`PackedImages`, its atlas in a
    buffer the worker reuses); a batch that holds encoded ones (1-D bytes: ``--decode-on device``)
    joined into one :class:`EncodedBatch`."""
    images = [sample[0] for sample in samples]
    rest = default_collate([sample[1:] for sample in samples])  # targets, epochs, index[, repetitions]
    return [EncodedBatch.join(images) if any(image.dim() == 1 for image in images) else pack_to_share(images), *rest]


def placements(sizes: list[tuple[int, int]], width: int | None = None) -> tuple[list[tuple[int, int, int, int]],
                                                                              int, int]:
    """Where each (h, w) image goes: ([(top, left, h, w), ...] in the order of ``sizes``, atlas
    height, atlas width), each image with a one-pixel edge around it (its :data:`EDGE`, outside
    its place). Rows (shelves) are filled tallest image first, so that images of one row have
    similar heights: a row is as tall as its tallest.

    The atlas is a stack of square tiles, W x W (W at least :data:`ATLAS_WIDTH`, and more for an
    image that does not fit), each row in the first tile with room for it (shorter rows fill what
    taller ones left); the last tile is only as tall as its rows. The resampling reads the tiles as
    a batch of images (``batch_augment.atlas_for_resampling``), so that its coordinates stay
    under W."""
    width = max(width or ATLAS_WIDTH, *(max(h, w) + 2 * EDGE for h, w in sizes))
    places: list[tuple[int, int, int, int]] = [(0, 0, 0, 0)] * len(sizes)
    filled: list[int] = []  # rows of each tile taken so far
    x, y = width, 0  # the row being filled starts at y, its next image at x
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i][0]):  # stable: ties keep their order
        h, w = sizes[i]
        if x + w + 2 * EDGE > width:  # a new row, as tall as this image, in the first tile with room
            tile = next((t for t, rows in enumerate(filled) if rows + h + 2 * EDGE <= width), len(filled))
            if tile == len(filled):
                filled.append(0)
            x, y = 0, tile * width + filled[tile]
            filled[tile] += h + 2 * EDGE
        places[i] = (y + EDGE, x + EDGE, h, w)
        x += w + 2 * EDGE
    return places, (len(filled) - 1) * width + filled[-1], width


def pack(images: list[Tensor], buffer: Callable[[int], Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """(atlas H x W x 3 uint8, places B x 4 int64 on the host) of ``images`` (each 3 x h x w
    uint8, any memory layout, all on one device); the atlas is made by ``buffer(numel)`` (1-D
    uint8) where given, else anew where the images are. Each image's edge pixels are repeated
    once around it (the resampling reads up to one pixel beyond a crop; so it reads the image's
    own edge, as torchvision's resize does); nothing reads between the images, so the rest of
    the atlas is not initialised."""
    places, height, width = placements([(im.shape[1], im.shape[2]) for im in images])
    numel = height * width * 3
    atlas = (images[0].new_empty(numel) if buffer is None else buffer(numel)).view(height, width, 3)
    for (top, left, h, w), image in zip(places, images):
        atlas[top:top + h, left:left + w] = image.permute(1, 2, 0)
        rows = atlas[top:top + h]
        rows[:, left - 1] = rows[:, left]
        rows[:, left + w] = rows[:, left + w - 1]
        atlas[top - 1, left - 1:left + w + 1] = atlas[top, left - 1:left + w + 1]
        atlas[top + h, left - 1:left + w + 1] = atlas[top + h - 1, left - 1:left + w + 1]
    return atlas, torch.tensor(places, dtype=torch.int64)


def pack_gathered(images: list[Tensor]) -> tuple[Tensor, Tensor]:
    """:func:`pack` where the images are (on the device, after ``--decode-on device``), in a fixed
    number of ops whatever their count: one concatenation of the images and one gather of the
    atlas from it, its map computed there from a table the host writes and copies in one piece
    (per image its place and where its pixels start; per atlas row its shelf; per shelf and
    column the image there). Each image and its repeated edge are :func:`pack`'s exactly; the
    pixels between them are copies of a nearby image's (where :func:`pack` leaves them
    uninitialised). The atlas is H x W x 3 over planar memory (the gather's natural layout,
    which the resampling's planar copy reads contiguously)."""
    sizes = [(image.shape[1], image.shape[2]) for image in images]
    places, height, width = placements(sizes)
    tops = np.array([p[0] for p in places])
    shelf_tops, shelf_of = np.unique(tops, return_inverse=True)
    shelf_rows = np.zeros(len(shelf_tops), np.int64)  # each shelf's height, its edge rows included
    np.maximum.at(shelf_rows, shelf_of, [h + 2 * EDGE for h, _ in sizes])
    rows = np.zeros(height, np.int64)  # the shelf of each atlas row (rows below a tile's shelves: 0)
    for shelf, (top, tall) in enumerate(zip(shelf_tops, shelf_rows)):
        rows[top - EDGE:top - EDGE + tall] = shelf
    owner = np.zeros((len(shelf_tops), width), np.int64)  # the image in each shelf's columns
    starts = np.cumsum([0, *(h * w for h, w in sizes[:-1])])
    table = np.empty((len(sizes), _PACK_COLUMNS), np.int64)
    for i, ((top, left, h, w), start) in enumerate(zip(places, starts)):
        owner[shelf_of[i], left - EDGE:left + w + EDGE] = i
        table[i] = (top, left, h - 1, w - 1, w, start)
    index_type = torch.int32 if sum(h * w for h, w in sizes) < 2**31 and height * width < 2**31 else torch.int64
    host = torch.from_numpy(np.concatenate([table.ravel(), rows, owner.ravel()])).to(index_type)
    maps = pinned_to_device(host, images[0].device)  # one copy
    table, rows, owner = maps.split([table.size, height, owner.size])
    table = table.view(len(sizes), _PACK_COLUMNS)
    owners = owner.view(-1, width).index_select(0, rows).view(-1)  # H W: the image each atlas pixel copies

    def of(column: int) -> Tensor:  # H x W: that column of each pixel's image
        return table[:, column].index_select(0, owners).view(height, width)

    y = torch.arange(height, device=maps.device, dtype=index_type)[:, None]
    x = torch.arange(width, device=maps.device, dtype=index_type)[None, :]
    row = torch.minimum((y - of(0)).clamp_(min=0), of(2))  # clamped: the edge repeats the image's border
    column = torch.minimum((x - of(1)).clamp_(min=0), of(3))
    source = row.mul_(of(4)).add_(column).add_(of(5))
    pixels = torch.cat([image.reshape(3, -1) for image in images], 1)  # 3 x every pixel, image after image
    planar = pixels.index_select(1, source.view(-1)).view(3, height, width)
    return planar.permute(1, 2, 0), torch.tensor(places, dtype=torch.int64)


_PACK_COLUMNS = 6  # pack_gathered's table: top, left, last row, last column, width, first pixel


def unpack(atlas: Tensor, places: Tensor) -> list[Tensor]:
    """The images back as 3 x h x w views into ``atlas`` (for tests)."""
    return [atlas[t:t + h, left:left + w].permute(2, 0, 1) for t, left, h, w in places.tolist()]


class PackedImages:
    """A packed batch on its way from a DataLoader worker: ``atlas`` and ``places`` as
    :func:`pack` makes them, the atlas in a buffer the worker lends (``lease``, see
    :class:`SharedBuffers`; None when it is not lent). The training process calls
    :meth:`release` once it has copied the atlas out; :meth:`pin_memory`, which a DataLoader with
    ``pin_memory=True`` calls in its pin thread, copies it into pinned memory and releases it."""

    def __init__(self, atlas: Tensor, places: Tensor, lease: Tensor | None = None):
        self.atlas, self.places, self.lease = atlas, places, lease

    def release(self) -> None:
        """The worker may fill the atlas's buffer again: call once nothing reads it any more."""
        if self.lease is not None:
            self.lease.fill_(0)
            self.lease = None

    def pin_memory(self) -> PackedImages:
        pinned = PackedImages(self.atlas.pin_memory(), self.places.pin_memory())
        self.release()  # after the copy: this thread's GIL hand-over orders the store after its reads
        return pinned


def pack_to_share(images: list[Tensor]) -> PackedImages:
    """:func:`pack` for a batch that leaves this process: in a DataLoader worker, into a buffer
    of the worker's :class:`SharedBuffers`; elsewhere, into plain memory."""
    if torch.utils.data.get_worker_info() is None:
        return PackedImages(*pack(images))
    buffers = _worker_buffers()
    leases = []

    def lend(numel: int) -> Tensor:
        buffer, lease = buffers.take(numel)
        leases.append(lease)
        return buffer

    atlas, places = pack(images, lend)
    return PackedImages(atlas, places, leases[0])


class SharedBuffers:
    """A DataLoader worker's shared-memory buffers for its batches, reused: a fresh segment per
    batch costs a page fault and the zeroing of every page on first touch, more than the copy
    of the images into it. Each buffer is lent with a lease, a flag in shared memory that the
    training process clears when it has copied the batch out (:meth:`PackedImages.release`).

    A batch takes the smallest free buffer it fits; the pages beyond it are handed back to the
    system, so a buffer holds no more shared memory than its batch, as a fresh one would. At
    most ``size`` buffers are kept (made 1.25 x the batch that needed a new one, since atlases
    vary in size); when every kept one is lent, a fresh one serves that batch and is not kept,
    so a batch the training process never releases (a run that stops) costs reuse, never a wait."""

    def __init__(self, size: int):
        self.size = size
        self.kept: list[list] = []  # [1-D uint8 buffer, its lease (int32, 1 = lent), bytes in use]

    def take(self, numel: int) -> tuple[Tensor, Tensor]:
        """(a 1-D uint8 tensor of ``numel`` bytes in shared memory, its lease, already set)."""
        free = [entry for entry in self.kept if int(entry[1]) == 0]
        fits = [entry for entry in free if entry[0].numel() >= numel]
        if fits:
            entry = min(fits, key=lambda e: e[0].numel())
            if entry[2] > numel:
                _return_pages(entry[0], numel, entry[2])
        else:
            entry = [_shared_empty(int(numel * 1.25), torch.uint8), _shared_empty(1, torch.int32), 0]
            if free:  # the smallest free one makes room for this larger one
                smallest = min(free, key=lambda e: e[0].numel())
                self.kept[next(i for i, e in enumerate(self.kept) if e is smallest)] = entry
            elif len(self.kept) < self.size:
                self.kept.append(entry)
        entry[1].fill_(1)
        entry[2] = numel
        return entry[0][:numel], entry[1]


_buffers: dict[int, SharedBuffers] = {}  # by process id: a forked process starts with none of its own


def _worker_buffers() -> SharedBuffers:
    return _buffers.setdefault(os.getpid(), SharedBuffers(KEPT_PER_WORKER))


def _return_pages(buffer: Tensor, start: int, end: int) -> None:
    """Hands the shared-memory pages wholly within bytes [start, end) of ``buffer`` back to the
    system (Linux's MADV_REMOVE: they read as zeros if touched again); elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    page = mmap.PAGESIZE
    first = -(-(buffer.data_ptr() + start) // page) * page
    last = (buffer.data_ptr() + end) // page * page
    if last > first:
        _libc().madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_REMOVE)


_MADV_REMOVE = 9  # <sys/mman.h>: free a range of a shared mapping and its tmpfs backing


@functools.lru_cache(maxsize=None)
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _shared_empty(numel: int, dtype: torch.dtype) -> Tensor:
    storage = torch.UntypedStorage._new_shared(numel * dtype.itemsize)
    return torch.empty(0, dtype=dtype).set_(storage)


def host_empty(numel: int) -> Tensor:
    """An uninitialised 1-D uint8 host tensor. In a DataLoader worker it is made in shared memory,
    as ``default_collate`` makes its batches, so handing it to the training process copies nothing."""
    if torch.utils.data.get_worker_info() is None:
        return torch.empty(numel, dtype=torch.uint8)
    return _shared_empty(numel, torch.uint8)


class EncodedBatch(NamedTuple):
    """A batch's images for ``--decode-on device`` in one buffer, so that a worker hands over one
    tensor (one shared-memory segment) per batch, not one per image. ``data``: every image end to
    end, a file's bytes or, for a file its worker decoded, its 3 x h x w pixels; ``spans``: B x 4
    int64, (offset, length, h, w) of each, h = w = 0 for bytes."""

    data: Tensor
    spans: Tensor

    @staticmethod
    def join(images: list[Tensor]) -> EncodedBatch:
        """``images`` (1-D bytes or 3 x h x w uint8 each) in one buffer (in shared memory in a
        DataLoader worker)."""
        flat = [image.contiguous().view(-1) for image in images]
        lengths = [len(part) for part in flat]
        offsets = np.cumsum([0, *lengths[:-1]]).tolist()
        data = host_empty(sum(lengths))
        torch.cat(flat, out=data)
        sides = [tuple(image.shape[1:]) if image.dim() == 3 else (0, 0) for image in images]
        return EncodedBatch(data, torch.tensor([[o, n, h, w] for o, n, (h, w) in zip(offsets, lengths, sides)],
                                               dtype=torch.int64))

    def images(self) -> list[Tensor]:
        """Each image as a view into ``data``: 1-D bytes, or 3 x h x w pixels."""
        return [self.data[o:o + n] if h == 0 else self.data[o:o + n].view(3, h, w)
                for o, n, h, w in self.spans.tolist()]


# ----------------------------------------------------------------------------- 2. in the training process
AHEAD = 2  # batches a FinishOnDevice's thread has ready for the training loop, at most (0: no thread)
CLOSE_WAIT_S = 10.0  # s a dropped or closed iterator waits for its thread to end (a batch in the making)
THREAD_NAME = "device-batches-ahead"
log = logging.getLogger("train")


# Device bytes per atlas pixel: the float32 tiles a pass keeps (batch_augment.atlas_for_resampling),
# the uint8 atlas of the batch in the making, and with --decode-on device what pack_gathered adds
# at its peak (the decoded images and their concatenation, about 3 bytes each, five int32 maps)
FLOAT_ATLAS_BYTES, ATLAS_BYTES, PACK_PEAK_BYTES = 12, 3, 26


@dataclass(frozen=True)
class DeviceMemory:
    """Device bytes a pass of this path holds per rank, about (atlases vary with their images):
    the float atlas kept for the pass, the batch in the making, the finished batches (:data:`AHEAD`
    waiting, one being made, one the training step reads)."""

    atlas: int
    making: int
    made: int

    @property
    def total(self) -> int:
        return self.atlas + self.making + self.made

    @staticmethod
    def of_pass(mean_pixels: float, batch: int, views: int, size: int, decode_on_device: bool) -> DeviceMemory:
        atlas_pixels = ATLAS_PADDING * batch * mean_pixels
        making = (ATLAS_BYTES + (PACK_PEAK_BYTES if decode_on_device else 0)) * atlas_pixels
        return DeviceMemory(round(FLOAT_ATLAS_BYTES * atlas_pixels), round(making),
                            (AHEAD + 2) * batch * views * 3 * size * size * 4)


def describe_device_memory(train: DeviceMemory, evaluation: DeviceMemory, device: torch.device) -> str:
    """One line for ``--check``: what the path holds on ``device`` in a training and in an
    evaluation pass (never both: a pass lets its buffers go when it ends)."""
    return (f"device memory: the data path holds about {size_text(train.total)} per rank on {device.type} in a "
            f"training pass (the float atlas {size_text(train.atlas)}, the batch in the making "
            f"{size_text(train.making)}, {AHEAD + 2} finished batches {size_text(train.made)}) and "
            f"{size_text(evaluation.total)} in an evaluation pass; each pass lets them go when it ends")


class FinishOnDevice:
    """Finishes on the device what DataLoader workers started (``loader``: batches of
    :func:`collate_files`): every view cropped, resized, coloured, blurred, flipped and
    normalised as a batch by ``augment`` (the evaluation view with an evaluation recipe, which
    has no crop). An image the device cannot decode is read as the loader path reads it, from
    ``decoded`` (the loader's raw data set, read as "decoded"), target included, and counted in
    ``fallbacks``; ``record``: called on each batch handed out (``UnreadableFiles.record``).

    Iterated, a thread of its own (:class:`ThreadBatches`) takes each batch from the loader,
    copies it to the device or decodes it there, and augments it while the training loop
    computes; at most ``ahead`` made batches wait for the loop (``ahead`` 0: no thread, each batch
    made on the loop's thread when it is asked for or prepared, ``data_stream.LoopBatches``). On
    CUDA that work runs on the device's data stream, and each batch is handed to the training
    stream when the loop takes it (``data_stream``: who waits for whom). ``calls``:
    ``data_stream.DataStream``'s."""

    def __init__(self, loader: DataLoader, augment: DeviceAugment, device: torch.device, decoded: Dataset,
                 fallbacks: DecodeFallbacks | None = None, ahead: int | None = None, calls: CudaCalls | None = None,
                 record: Callable[[tuple], tuple] | None = None):
        self.loader, self.augment, self.device, self.decoded = loader, augment, device, decoded
        self.batch_size = loader.batch_size
        self.fallbacks = DecodeFallbacks() if fallbacks is None else fallbacks
        self.ahead = AHEAD if ahead is None else ahead
        self.record = record
        self.stream = DataStream(device, calls)
        self._making = threading.Lock()  # one batch at a time: the augmentation keeps buffers between batches
        self._last: _HandOver | None = None  # the last pass's thread

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Batches:
        if self.ahead <= 0:
            return LoopBatches(self._pass(iter(self.loader)), self.make, self.record)
        if self._last is not None and _one_iterator(self.loader):
            # the loader's one iterator (persistent workers) is reset below: the last pass's thread
            # must be off it first
            self._last.close(wait=None)
        self._last = _HandOver(self._pass(iter(self.loader)), self.make, self.ahead, _this_device(self.device))
        return ThreadBatches(self._last, self.record)

    def _pass(self, batches: Iterator) -> Iterator:
        """``batches``, the loader's of one pass; the float atlas let go when they end or are dropped."""
        try:
            yield from batches
        finally:
            self.augment.release()

    def close(self) -> None:
        """Stops the pass's thread, the batches it made and did not hand out dropped, and lets the
        augmentation's float atlas go: a pass that ends early (``--max-steps``), the run's end."""
        if self._last is not None:
            self._last.close()
            self._last = None
        self.augment.release()

    def finish(self, batch: list) -> tuple:
        """(views, targets) of one collated batch (:func:`collate_files`), for the caller's
        (the training) stream: :meth:`make` then ``hand_over``."""
        return self.make(batch).hand_over()

    def make(self, batch: list) -> Made:
        """One collated batch's (views, targets), made on the data stream and not yet handed to
        the training stream; the batch's host memory (pinned by the loader on CUDA) is held until
        its copy is done."""
        images = batch[0]
        source = images.data if isinstance(images, EncodedBatch) else images.atlas
        with self._making:
            return self.stream.run(lambda: self._finish_here(batch), hold=(source,))

    def _finish_here(self, batch: list) -> tuple:
        images, targets, epochs, index, *reps = batch  # repetitions: repeated augmentation's samples
        if isinstance(images, EncodedBatch):  # decoded and packed on the device
            with record_function("device_finish/decode"):
                decoded, failed = decode_on(self.device, images)
                for i in failed:  # what the device cannot decode: the CPU's decode, as a worker's
                    image, targets[i] = self.decoded[int(index[i])]
                    decoded[i] = image.to(self.device)
                fallen_back = [i for i in failed if targets[i] >= 0]  # not the placeholders: those are unreadable
                if fallen_back:
                    self.fallbacks.add(self.device, sample_path(self.decoded, int(index[fallen_back[0]])),
                                       len(fallen_back))
                # a fixed number of launches on CUDA; a CPU copies slices faster than it gathers
                atlas, places = (pack_gathered if self.device.type == "cuda" else pack)(decoded)
        else:
            atlas, places = images.atlas, images.places
            with record_function("device_finish/copy"):
                atlas = atlas.contiguous().to(self.device, non_blocking=True)  # contiguous: pack's always is
        drawn = augmentation_index(index, reps[0]) if reps else index  # each repetition augmented differently
        views = self.augment.packed(atlas, places, int(epochs[0]), drawn)
        if isinstance(images, PackedImages):
            images.release()  # copied out (or pinned already): its worker may fill the buffer again
        return views, targets


class DecodeFallbacks:
    """Images the device's decoder refused (``--decode-on device``), which the training process
    then decoded on the CPU, counted on this rank: a WARNING when the first comes, the count in
    each epoch's line (``train.run``). A file the CPU cannot decode either is not one of them: it
    is the run's unreadable file (``UnreadableFiles.record``), named there."""

    def __init__(self):
        self.count = 0
        self._lock = threading.Lock()

    def add(self, device: torch.device, first: str, count: int = 1) -> None:
        """``count`` more refused, the first of them the file ``first``."""
        with self._lock:
            said, self.count = self.count > 0, self.count + count
        if not said:
            log.warning("--decode-on device: the %s decoder refused %d image(s) of a batch (%s%s); the training "
                        "process decodes such images on the CPU, which is slower; each epoch's line counts them",
                        device.type, count, first, " among them" if count > 1 else "")


class ThreadBatches:
    """:class:`~data_stream.Batches` of a :class:`FinishOnDevice` pass, made by a thread of its own
    (named :data:`THREAD_NAME`, its :class:`_HandOver`) while the training loop computes:
    ``next()`` hands the loop the next one (waiting for it if the thread has none ready), on CUDA
    to the training stream then, through ``record`` where given. An error of the thread (of the
    loader, its workers, the store, the decoder) is raised by the ``next()`` of the batch it
    stopped at, as it was raised there (type and traceback). The thread ends when the batches
    do, when :meth:`close` is called or when this iterator is dropped (no reference cycle holds
    it: the thread holds no reference to it): then the loader's iterator goes too, and with it
    its workers unless they are persistent, as when a loop drops a DataLoader's iterator."""

    def __init__(self, handover: _HandOver, record: Callable[[tuple], tuple] | None = None):
        self._handover, self._record = handover, record
        self._close = weakref.finalize(self, handover.close)

    def __iter__(self) -> ThreadBatches:
        return self

    def __next__(self):
        item = self._handover.get()
        if isinstance(item, Made):
            batch = item.hand_over()
            return batch if self._record is None else self._record(batch)
        self.close()
        if isinstance(item, _Failed):
            raise item.error
        raise StopIteration

    def prepare_next(self) -> None:
        """Nothing: the thread makes the next batch already."""

    def close(self) -> None:
        """Stop the thread and wait for it (:data:`CLOSE_WAIT_S` at most); batches made and not
        handed out are dropped."""
        self._close()


class _Failed(NamedTuple):
    error: BaseException


_END = object()  # the thread's last hand-over when the loader's batches are all made


class _HandOver:
    """A pass's thread, which makes each batch of ``source`` (``make``) on ``device``, and the made
    batches on their way to the loop, ``depth`` at most: ``put`` waits while that many wait;
    :meth:`close` drops them, wakes both sides and waits for the thread. Held by the pass's
    :class:`ThreadBatches` and by its :class:`FinishOnDevice`; the thread holds it, never the
    :class:`ThreadBatches`."""

    def __init__(self, source: Iterator, make: Callable[[list], Made], depth: int, device: torch.device):
        self.depth, self.closed = depth, False
        self._items: collections.deque = collections.deque()
        self._cond = threading.Condition()  # re-entrant: a finalizer may close it inside put()
        self.thread = threading.Thread(target=_make_ahead, args=([source], make, self, device), name=THREAD_NAME,
                                       daemon=True)
        self.thread.start()

    def put(self, item) -> bool:
        """False when closed: ``item`` is not taken."""
        with self._cond:
            while len(self._items) >= self.depth and not self.closed:
                self._cond.wait()
            if self.closed:
                return False
            self._items.append(item)
            self._cond.notify_all()
            return True

    def get(self):
        """The next item; :data:`_END` once closed."""
        with self._cond:
            while not self._items and not self.closed:
                self._cond.wait()
            if not self._items:
                return _END
            item = self._items.popleft()
            self._cond.notify_all()
            return item

    def close(self, wait: float | None = CLOSE_WAIT_S) -> None:
        with self._cond:
            self.closed = True
            self._items.clear()
            self._cond.notify_all()
        if self.thread is not threading.current_thread():
            self.thread.join(wait)


def _make_ahead(source: list, make: Callable[[list], Made], handover: _HandOver, device: torch.device) -> None:
    """The thread's work: each batch of the pass (``source[0]``) made and handed over, in order,
    then :data:`_END`; an error handed over in its place. The pass is let go when the thread ends
    (``source`` emptied; the error's frames cleared of their locals): nothing of the loader's
    iterator outlives the thread, and the float atlas goes (:meth:`FinishOnDevice._pass`)."""
    batch = None
    try:
        if device.type == "cuda":
            torch.cuda.set_device(device)  # this thread's current device: the loop's
        for batch in source[0]:
            if handover.closed or not handover.put(make(batch)):
                break
            batch = None
        else:
            handover.put(_END)
    except BaseException as err:  # noqa: BLE001 - raised again by the loop's next(), at this batch
        traceback.clear_frames(err.__traceback__)
        handover.put(_Failed(err))
    finally:
        if batch is not None and isinstance(batch[0], PackedImages):
            batch[0].release()  # taken and not handed over: nothing reads it
        batch = None
        source.clear()


def _one_iterator(loader) -> bool:
    """Whether ``loader`` hands every pass the same iterator (a DataLoader's persistent workers)."""
    return bool(getattr(loader, "persistent_workers", False)) and getattr(loader, "num_workers", 0) > 0


def _this_device(device: torch.device) -> torch.device:
    """``device`` with its index (the loop's current device where it has none)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def decode_on(device: torch.device, batch: EncodedBatch) -> tuple[list[Tensor | None], list[int]]:
    """The batch's images on ``device``, 3 x H x W uint8 each: the encoded ones (device-decodable
    JPEGs) decoded there as one batch (nvJPEG on CUDA, libjpeg-turbo on the CPU), the decoded ones
    copied; and the positions of those the device could not decode (None there).

    One file the batched decoder refuses fails the whole batch (its header passed the worker's
    check, its data did not): the batch is then decoded image by image, and only the images the
    device refuses alone are returned as failed (the caller decodes them on the CPU: PIL reads
    some files that libjpeg-turbo refuses). The device failing is raised as it is, never taken
    for a refused image (:func:`_refused`: out of memory, an accelerator error), and so is a
    batch of several whose every image fails alone too (with the batch's error).

    On CUDA the images are ready for the caller's current stream when this returns (in
    :class:`FinishOnDevice`, the data stream), and safe to free there: see :func:`_decode_on_cuda`."""
    if device.type != "cuda":
        return _decode_all(device, batch)
    return _decode_on_cuda(device, batch)


def _decode_on_cuda(device: torch.device, batch: EncodedBatch) -> tuple[list[Tensor | None], list[int]]:
    """:func:`decode_on` on a stream of its own, its images then handed to the current stream.

    torchvision's batched decoder allocates its outputs on the current stream and writes them
    from a private stream (nvJPEG's hardware engine does not follow stream order either). On the
    training stream, an output could take a block that autograd has just freed while queued
    backward kernels still read it, and the decoder would overwrite it under them; on the data
    stream, one the last batch's augmentation still reads. On a stream of its own, the caching
    allocator hands the decoder only blocks freed on that stream, which no other stream's queued
    kernel can still be using:

    * the decode stream never waits for the current stream (its inputs are host memory);
    * the decoder makes the decode stream wait for its private stream, the current stream (the
      data stream in :class:`FinishOnDevice`) then waits for the decode stream (``wait_stream``),
      so that it reads whole images;
    * ``record_stream`` keeps each output's block out of the decode stream's pool until the
      current stream's kernels that read it (packing) are done."""
    consumer = torch.cuda.current_stream(device)
    stream = _decode_stream(device)
    with torch.cuda.stream(stream):
        images, failed = _decode_all(device, batch)
    consumer.wait_stream(stream)
    for image in images:
        if image is not None:
            image.record_stream(consumer)
    return images, failed


@functools.lru_cache(maxsize=None)
def _decode_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def _decode_all(device: torch.device, batch: EncodedBatch) -> tuple[list[Tensor | None], list[int]]:
    images = batch.images()
    encoded = [i for i, image in enumerate(images) if image.dim() == 1]
    out = [image.to(device, non_blocking=True) if image.dim() == 3 else None for image in images]
    failed: list[int] = []
    if encoded:
        decode_jpeg, rgb = jpeg_decoder()
        try:
            decoded = decode_jpeg([images[i] for i in encoded], mode=rgb, device=device)
        except RuntimeError as err:
            if not _refused(err):
                raise
            decoded = [_decode_one(device, images[i]) for i in encoded]
            if len(encoded) > 1 and all(image is None for image in decoded):
                raise RuntimeError(f"--decode-on device: the {device.type} decoder failed a batch of {len(encoded)} "
                                   f"JPEGs and then each of them alone: {err}") from err
        for i, image in zip(encoded, decoded):
            if image is None:
                failed.append(i)
            else:
                out[i] = image.to(device, non_blocking=True)  # there already
    return out, failed


def _decode_one(device: torch.device, data: Tensor) -> Tensor | None:
    """One JPEG's pixels decoded on ``device``; None if the device's decoder refuses it."""
    decode_jpeg, rgb = jpeg_decoder()
    try:
        return decode_jpeg(data, mode=rgb, device=device)
    except RuntimeError as err:
        if not _refused(err):
            raise
        return None


# The device failing rather than refusing an image: its memory (PyTorch's, or nvJPEG's own
# allocations outside PyTorch's cache) or a CUDA error
_DEVICE_FAILURES = tuple(getattr(torch, name) for name in ("OutOfMemoryError", "AcceleratorError") if hasattr(torch, name))
_DEVICE_FAILURE_TEXT = re.compile(r"out of memory|CUDA error|alloc", re.IGNORECASE)  # alloc: nvJPEG ALLOCATOR_FAILURE too


def _refused(err: RuntimeError) -> bool:
    """Whether a decoder's error refuses the image's data (which the CPU may then decode) rather
    than reports the device failing (out of memory, an accelerator error), which must stop the
    run as what it is: retried image by image and decoded on the CPU for the rest of the run, it
    would be called a refused image."""
    return not isinstance(err, _DEVICE_FAILURES) and not _DEVICE_FAILURE_TEXT.search(str(err))


# ----------------------------------------------------------------------------- the device's decoder
NVJPEG_BACKEND_HARDWARE = 3  # nvjpeg.h: nvjpegBackend_t
NVJPEG_STATUS_SUCCESS, NVJPEG_STATUS_ARCH_MISMATCH = 0, 7  # nvjpeg.h: nvjpegStatus_t


def describe_decoder(device: torch.device) -> str:
    """What decodes the JPEGs that ``--decode-on device`` gives ``device``, for the start-up line:
    on CUDA whether nvJPEG has the GPU's hardware JPEG decoder (:func:`nvjpeg_backend`)."""
    if device.type != "cuda":
        return f"JPEGs decoded on {device} by libjpeg-turbo (torchvision's decode_jpeg; no hardware decoder)"
    kind, detail = nvjpeg_backend(device)
    if kind == "hardware":
        return (f"JPEGs decoded on {device} by nvJPEG's hardware decoder (torchvision's batched decode_jpeg; "
                f"a JPEG the engine does not take goes to nvJPEG's CUDA decoder)")
    if kind == "software":
        return f"JPEGs decoded on {device} by nvJPEG in software (CUDA kernels): {detail}"
    return f"JPEGs decoded on {device} by nvJPEG, hardware decoder unknown ({detail})"


def nvjpeg_backend(device: torch.device, nvjpeg=None) -> tuple[str, str]:
    """("hardware" | "software" | "unknown", why) for torchvision's batched decoder on ``device``.

    torchvision's ``decode_jpegs_cuda`` says nothing of it in Python: its ``CUDAJpegDecoder``
    (made once per process, torchvision 0.19 on) calls ``nvjpegCreateEx(NVJPEG_BACKEND_HARDWARE,
    ...)``; NVJPEG_STATUS_ARCH_MISMATCH (a GPU without the engine: V100, consumer cards) makes it
    fall back to ``NVJPEG_BACKEND_DEFAULT`` and decode every image in software; success sends each
    JPEG that ``nvjpegDecodeBatchedSupported`` accepts to the engine (A100, H100, H200), the rest to
    software; any other status fails every batched decode. This makes the same call, on the same
    library (the libnvjpeg that torchvision's image library loaded: :func:`torchvision_nvjpeg`, or
    ``nvjpeg``, a stand-in), and lets the handle go."""
    if nvjpeg is None:
        nvjpeg, why = torchvision_nvjpeg()
        if nvjpeg is None:
            return "unknown", why
    handle = ctypes.c_void_p()
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        status = nvjpeg.nvjpegCreateEx(NVJPEG_BACKEND_HARDWARE, None, None, 0, ctypes.byref(handle))
        if status == NVJPEG_STATUS_SUCCESS:
            nvjpeg.nvjpegDestroy(handle)
            return "hardware", "nvjpegCreateEx(NVJPEG_BACKEND_HARDWARE) succeeded"
    if status == NVJPEG_STATUS_ARCH_MISMATCH:
        return "software", "this GPU has no hardware JPEG decoder (nvjpegCreateEx: NVJPEG_STATUS_ARCH_MISMATCH)"
    return "unknown", f"nvjpegCreateEx(NVJPEG_BACKEND_HARDWARE) returned status {status}"


def torchvision_nvjpeg() -> tuple[ctypes.CDLL | None, str]:
    """(the libnvjpeg that torchvision's image library loaded, its calls typed; "") or (None, why
    not): found among this process's mappings (Linux), once torchvision's image library is in."""
    jpeg_decoder()  # imports torchvision.io, which loads its image library and the libnvjpeg it links
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split(None, 5)[5].strip() for line in maps
                            if "libnvjpeg" in line and len(line.split(None, 5)) == 6})
    except OSError as err:
        return None, f"cannot list the libraries loaded ({err.strerror})"
    if not paths:
        return None, "torchvision's image library loaded no libnvjpeg"
    try:
        nvjpeg = ctypes.CDLL(paths[0])
    except OSError as err:
        return None, f"cannot open {paths[0]} ({err})"
    nvjpeg.nvjpegCreateEx.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint,
                                      ctypes.POINTER(ctypes.c_void_p)]
    nvjpeg.nvjpegCreateEx.restype = ctypes.c_int
    nvjpeg.nvjpegDestroy.argtypes = [ctypes.c_void_p]
    nvjpeg.nvjpegDestroy.restype = ctypes.c_int
    return nvjpeg, ""
