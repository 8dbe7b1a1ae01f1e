"""Images of different sizes as one tensor, so that a whole batch of decoded JPEGs crosses to the
training device in one copy and its views are cut from it there.

:func:`pack` places each image (3 x h x w, uint8) in an atlas (H x W x 3: channels last, the
decoders' own layout, so that each image goes in with one contiguous copy per row) row by row.
``places`` (B x 4: top, left, height, width) say where each image lies; the device reads each
image as a view of its own pixels (``batch_augment.resize_from_atlas``), never the gaps between
them. The same function runs in a DataLoader worker (CPU decoding) and on the training device
(GPU decoding).
"""
from __future__ import annotations

import ctypes
import functools
import mmap
import os
import sys
from typing import Callable

import torch
from torch import Tensor

ATLAS_WIDTH = 2048  # px: rows of the atlas are at least this wide (wider for a wider image)


def placements(sizes: list[tuple[int, int]], width: int | None = None) -> tuple[list[tuple[int, int, int, int]],
                                                                              int, int]:
    """Where each (h, w) image goes: ([(top, left, h, w), ...] in the order of ``sizes``, atlas
    height, atlas width). Rows (shelves) are filled tallest image first, so that images of one
    row have similar heights: a row is as tall as its tallest."""
    width = max(width or ATLAS_WIDTH, max(w for _, w in sizes))
    places: list[tuple[int, int, int, int]] = [(0, 0, 0, 0)] * len(sizes)
    x, y, row = 0, 0, 0
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i][0]):  # stable: ties keep their order
        h, w = sizes[i]
        if x + w > width:
            x, y, row = 0, y + row, 0
        places[i] = (y, x, h, w)
        x, row = x + w, max(row, h)
    return places, y + row, width


def pack(images: list[Tensor], buffer: Callable[[int], Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """(atlas H x W x 3 uint8, places B x 4 int64 on the host) of ``images`` (each 3 x h x w
    uint8, any memory layout, all on one device); the atlas is made by ``buffer(numel)`` (1-D
    uint8) where given, else anew where the images are. Nothing reads between the images, so
    the atlas is not initialised."""
    places, height, width = placements([(im.shape[1], im.shape[2]) for im in images])
    numel = height * width * 3
    atlas = (images[0].new_empty(numel) if buffer is None else buffer(numel)).view(height, width, 3)
    for (top, left, h, w), image in zip(places, images):
        atlas[top:top + h, left:left + w] = image.permute(1, 2, 0)
    return atlas, torch.tensor(places, dtype=torch.int64)


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


# A worker's batches in flight: DataLoader's prefetch (at most loading.TRAIN_PREFETCH = 2) plus
# the one it fills (tested against the prefetch).
KEPT_PER_WORKER = 3
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


def unpack(atlas: Tensor, places: Tensor) -> list[Tensor]:
    """The images back as 3 x h x w views into ``atlas`` (for tests)."""
    return [atlas[t:t + h, left:left + w].permute(2, 0, 1) for t, left, h, w in places.tolist()]
