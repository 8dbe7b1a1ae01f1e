"""Image files finished on the training device (``--dataset imagefolder --aug-on device``): the
path ``pipeline`` chooses for them; nothing else needs this module.

One batch, in the order it passes here:

1. a DataLoader worker reads each file (``image_files.ImageFiles``, read as "decoded", or as
   "encoded" with ``--decode-on device``) and :func:`collate_files` packs the batch: decoded
   images into one atlas in a shared-memory buffer the worker reuses (:func:`pack`,
   :class:`PackedImages`, :class:`SharedBuffers`), a file's bytes into one
   :class:`EncodedBatch`;
2. the training process (:class:`FinishOnDevice`) copies the atlas to the device, or decodes the
   encoded batch there (:func:`decode_on`: nvJPEG on CUDA, through torchvision) and packs it;
3. ``batch_augment.DeviceAugment.packed`` cuts every view's crop from the atlas and augments
   the views as batches, keyed by (seed, epoch, index).

The atlas (H x W x 3 uint8: channels last, the decoders' own layout, so that each image goes in
with one contiguous copy per row) holds each image (3 x h x w) in rows; ``places`` (B x 4: top,
left, height, width) say where each image lies, and each view is read from a view of its
image's own pixels (``batch_augment.resize_from_atlas``), never the gaps between them. The same
:func:`pack` runs in a worker (CPU decoding) and on the training device (GPU decoding).
"""
from __future__ import annotations

import ctypes
import functools
import mmap
import os
import sys
from typing import Callable, NamedTuple

import numpy as np
import torch
from torch import Tensor
from torch.profiler import record_function
from torch.utils.data import DataLoader, Dataset, default_collate

from .batch_augment import DeviceAugment, PreparedAhead
from .host_memory import KEPT_PER_WORKER
from .image_files import jpeg_decoder

ATLAS_WIDTH = 2048  # px: rows of the atlas are at least this wide (wider for a wider image)


# ----------------------------------------------------------------------------- 1. in the worker
def collate_files(samples: list) -> list:
    """A batch of image files from (image, target, epoch, index) samples: decoded images (3 x h x w
    uint8, each its own size) packed here, in the worker (:class:`PackedImages`, its atlas in a
    buffer the worker reuses); a batch that holds encoded ones (1-D bytes: ``--decode-on device``)
    joined into one :class:`EncodedBatch`."""
    images = [sample[0] for sample in samples]
    rest = default_collate([sample[1:] for sample in samples])  # targets, epochs, index
    return [EncodedBatch.join(images) if any(image.dim() == 1 for image in images) else pack_to_share(images), *rest]


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
class FinishOnDevice:
    """Finishes on the device what DataLoader workers started (``loader``: batches of
    :func:`collate_files`): every view cropped, resized, coloured, blurred, flipped and
    normalised as a batch by ``augment`` (the evaluation view with an evaluation recipe, which
    has no crop). An image the device cannot decode is read as the loader path reads it, from
    ``decoded`` (the loader's raw data set, read as "decoded"), target included."""

    def __init__(self, loader: DataLoader, augment: DeviceAugment, device: torch.device, decoded: Dataset):
        self.loader, self.augment, self.device, self.decoded = loader, augment, device, decoded
        self.batch_size = loader.batch_size

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> PreparedAhead:
        return PreparedAhead(self._batches())

    def _batches(self):
        for batch in self.loader:
            yield self.finish(batch)

    def finish(self, batch: list) -> tuple:
        """(views, targets) of one collated batch (:func:`collate_files`)."""
        images, targets, epochs, index = batch
        if isinstance(images, EncodedBatch):  # decoded and packed on the device
            with record_function("device_finish/decode"):
                decoded, failed = decode_on(self.device, images)
                for i in failed:  # what the device cannot decode: the CPU's decode, as a worker's
                    image, targets[i] = self.decoded[int(index[i])]
                    decoded[i] = image.to(self.device)
                atlas, places = pack(decoded)
        else:
            atlas, places = images.atlas, images.places
            with record_function("device_finish/copy"):
                atlas = atlas.to(self.device, non_blocking=True)
        views = self.augment.packed(atlas, places, int(epochs[0]), index)
        if isinstance(images, PackedImages):
            images.release()  # copied out (or pinned already): its worker may fill the buffer again
        return views, targets


def decode_on(device: torch.device, batch: EncodedBatch) -> tuple[list[Tensor | None], list[int]]:
    """The batch's images on ``device``, 3 x H x W uint8 each: the encoded ones (device-decodable
    JPEGs) decoded there as one batch (nvJPEG on CUDA, libjpeg-turbo on the CPU), the decoded ones
    copied; and the positions of those the device could not decode (None there).

    One file the batched decoder refuses fails the whole batch (its header passed the worker's
    check, its data did not): the batch is then decoded image by image, and only the images the
    device refuses alone are returned as failed (the caller decodes them on the CPU: PIL reads
    some files that libjpeg-turbo refuses).

    On CUDA the images are ready for the caller's (the training) stream when this returns, and
    safe to free there: see :func:`_decode_on_cuda`."""
    if device.type != "cuda":
        return _decode_all(device, batch)
    return _decode_on_cuda(device, batch)


def _decode_on_cuda(device: torch.device, batch: EncodedBatch) -> tuple[list[Tensor | None], list[int]]:
    """:func:`decode_on` on a stream of its own, its images then handed to the current stream.

    torchvision's batched decoder allocates its outputs on the current stream and writes them
    from a private stream (nvJPEG's hardware engine does not follow stream order either). On the
    training stream, an output could take a block that autograd has just freed while queued
    backward kernels still read it, and the decoder would overwrite it under them. On a stream
    of its own, the caching allocator hands the decoder only blocks freed on that stream, which
    no other stream's queued kernel can still be using:

    * the decode stream never waits for the training stream (its inputs are host memory);
    * the decoder makes the decode stream wait for its private stream, the training stream then
      waits for the decode stream (``wait_stream``), so that it reads whole images;
    * ``record_stream`` keeps each output's block out of the decode stream's pool until the
      training stream's kernels that read it (packing) are done."""
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
        except RuntimeError:
            decoded = [_decode_one(device, images[i]) for i in encoded]
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
    except RuntimeError:
        return None
