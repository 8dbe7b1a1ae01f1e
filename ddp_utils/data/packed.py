"""Images of different sizes as one tensor, so that a whole batch of decoded JPEGs is cropped and
resized on the device by one ``roi_align`` per view.

:func:`pack` places each image (3 x h x w, uint8) in an atlas (H x W x 3: channels last, the
decoders' own layout, so that each image goes in with one contiguous copy per row) row by row,
with a one-pixel border that repeats the image's edge: resampling near an edge, which reads the pixel
just outside a box, then reads what ``roi_align`` reads at the border of the image alone (it
clamps there). ``places`` (B x 4: top, left, height, width) say where each image lies. The same
function runs in a DataLoader worker (CPU decoding) and on the training device (GPU decoding).
"""
from __future__ import annotations

import torch
from torch import Tensor

ATLAS_WIDTH = 2048  # px: rows of the atlas are at least this wide (wider for a wider image)


def placements(sizes: list[tuple[int, int]], width: int | None = None) -> tuple[list[tuple[int, int, int, int]],
                                                                              int, int]:
    """Where each (h, w) image goes, each inside a one-pixel border: ([(top, left, h, w), ...] in
    the order of ``sizes``, atlas height, atlas width). Rows (shelves) are filled tallest image
    first, so that images of one row have similar heights: a row is as tall as its tallest."""
    width = max(width or ATLAS_WIDTH, max(w for _, w in sizes) + 2)
    places: list[tuple[int, int, int, int]] = [(0, 0, 0, 0)] * len(sizes)
    x, y, row = 0, 0, 0
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i][0]):  # stable: ties keep their order
        h, w = sizes[i]
        if x + w + 2 > width:
            x, y, row = 0, y + row, 0
        places[i] = (y + 1, x + 1, h, w)
        x, row = x + w + 2, max(row, h + 2)
    return places, y + row, width


def pack(images: list[Tensor]) -> tuple[Tensor, Tensor]:
    """(atlas H x W x 3 uint8, places B x 4 int64, on the host) of ``images`` (each 3 x h x w
    uint8, any memory layout, all on one device)."""
    places, height, width = placements([(im.shape[1], im.shape[2]) for im in images])
    atlas = _new_atlas(images[0], height, width)
    for (top, left, h, w), image in zip(places, images):
        atlas[top:top + h, left:left + w] = image.permute(1, 2, 0)
        atlas[top - 1, left:left + w] = atlas[top, left:left + w]  # the border repeats the edge
        atlas[top + h, left:left + w] = atlas[top + h - 1, left:left + w]
        atlas[top - 1:top + h + 1, left - 1] = atlas[top - 1:top + h + 1, left]
        atlas[top - 1:top + h + 1, left + w] = atlas[top - 1:top + h + 1, left + w - 1]
    return atlas, torch.tensor(places, dtype=torch.int64)


def _new_atlas(like: Tensor, height: int, width: int) -> Tensor:
    """An uninitialised H x W x 3 uint8 tensor where ``like`` is (in a DataLoader worker: in
    shared memory, :func:`host_empty`): nothing reads between the images' borders."""
    if like.device.type == "cpu" and torch.utils.data.get_worker_info() is not None:
        return host_empty(height * width * 3).view(height, width, 3)
    return like.new_empty((height, width, 3))


def host_empty(numel: int) -> Tensor:
    """An uninitialised 1-D uint8 host tensor. In a DataLoader worker it is made in shared memory,
    as ``default_collate`` makes its batches, so handing it to the training process copies nothing."""
    if torch.utils.data.get_worker_info() is None:
        return torch.empty(numel, dtype=torch.uint8)
    storage = torch.UntypedStorage._new_shared(numel)
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def unpack(atlas: Tensor, places: Tensor) -> list[Tensor]:
    """The images back as 3 x h x w views into ``atlas`` (for tests)."""
    return [atlas[t:t + h, left:left + w].permute(2, 0, 1) for t, left, h, w in places.tolist()]
