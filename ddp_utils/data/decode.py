"""Reading and decoding image files into tensors, on the CPU (a DataLoader worker) or on the
training device (``--decode-on device``: nvJPEG on CUDA, through torchvision).

JPEGs are decoded by ``torchvision.io.decode_jpeg`` (libjpeg-turbo on the CPU; its output equals
PIL's, pixel for pixel), any other file by PIL. torchvision 0.29 deprecates its image decoding in
favour of TorchCodec; it is what both supported torchvision releases (0.26 on the GPU machines,
0.29 here) have, batched on CUDA, so its deprecation warning is silenced here, once.

A file the device decoder may not take (progressive, arithmetic-coded, CMYK or grayscale JPEGs,
anything that is not a complete baseline JPEG: :func:`device_decodable`) is decoded on the CPU
by the worker that read it, never skipped.
"""
from __future__ import annotations

import functools
import os
import warnings
from io import BytesIO
from typing import NamedTuple

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from .image_files import PLACEHOLDER_SIDE
from .packed import host_empty


@functools.lru_cache(maxsize=None)
def _jpeg_decoder():
    """(torchvision.io.decode_jpeg, its RGB mode), imported on first use (torchvision costs a
    process about 2 s), its deprecation warning silenced once."""
    warnings.filterwarnings("ignore", message="The image decoding and encoding capabilities of TorchVision are "
                                              "deprecated")
    from torchvision.io import ImageReadMode, decode_jpeg

    return decode_jpeg, ImageReadMode.RGB

_SOI, _EOI = b"\xff\xd8", b"\xff\xd9"
_BASELINE = (0xC0, 0xC1)  # SOF0, SOF1: Huffman-coded sequential DCT, what nvJPEG's batched path decodes
_OTHER_FRAMES = (0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF)  # progressive, lossless, ...


def read_bytes(path: str) -> Tensor:
    """The file's bytes as a 1-D uint8 tensor (read straight into it, no copy)."""
    with open(path, "rb") as f:
        data = torch.empty(os.fstat(f.fileno()).st_size, dtype=torch.uint8)
        f.readinto(data.numpy())
    return data


def is_jpeg(data: Tensor) -> bool:
    return data.numel() > 3 and bytes(data[:2].tolist()) == _SOI


def device_decodable(data: Tensor) -> bool:
    """Whether the bytes are a whole baseline JPEG with 3 components (YCbCr), the kind the device
    decoder is given: it starts with SOI, ends with EOI, and its first frame header is SOF0 or
    SOF1 with 3 components at 8 bits. Reads the markers only, not the image data."""
    raw = data.numpy().tobytes() if data.numel() < 65536 else data[:65536].numpy().tobytes()
    if not raw.startswith(_SOI) or bytes(data[-2:].tolist()) != _EOI:
        return False
    at = 2
    while at + 4 <= len(raw):
        if raw[at] != 0xFF:
            return False
        marker = raw[at + 1]
        if marker == 0xFF:  # fill byte
            at += 1
            continue
        length = int.from_bytes(raw[at + 2:at + 4], "big")
        if marker in _BASELINE:
            precision, components = raw[at + 4], raw[at + 9] if at + 9 < len(raw) else 0
            return precision == 8 and components == 3
        if marker in _OTHER_FRAMES or marker == 0xDA:  # another frame type, or scan data before a frame
            return False
        at += 2 + length
    return False


def decode_cpu(data: Tensor) -> Tensor:
    """3 x H x W uint8 RGB of an image file's bytes: torchvision for JPEG, PIL for the rest (a PNG
    named .JPEG, say) and for a JPEG torchvision refuses, so that what PIL reads is read
    (:func:`image_files.decode_rgb` decides what cannot be decoded). Raises on such a file."""
    if is_jpeg(data):
        decode_jpeg, rgb = _jpeg_decoder()
        try:
            return decode_jpeg(data, mode=rgb)
        except RuntimeError:
            pass
    with Image.open(BytesIO(data.numpy().tobytes())) as image:
        image.load()
        return torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1)


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


def decode_on(device: torch.device, batch: EncodedBatch) -> tuple[list[Tensor], list[int]]:
    """The batch's images on ``device``, 3 x H x W uint8 each: the encoded ones (device-decodable
    JPEGs) decoded there as one batch (nvJPEG on CUDA, libjpeg-turbo on the CPU), the decoded ones
    copied; and the positions of those that could not be decoded at all.

    One file the batched decoder refuses fails the whole batch (its header passed the worker's
    check, its data did not): the batch is then decoded image by image, on the device, else on
    the CPU (PIL reads some files that libjpeg-turbo refuses), else the image becomes the black
    placeholder a worker gives such a file, and its position is returned.

    On CUDA the images are ready for the caller's (the training) stream when this returns, and
    safe to free there: see :func:`_decode_on_cuda`."""
    if device.type != "cuda":
        return _decode_all(device, batch)
    return _decode_on_cuda(device, batch)


def _decode_on_cuda(device: torch.device, batch: EncodedBatch) -> tuple[list[Tensor], list[int]]:
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
        image.record_stream(consumer)
    return images, failed


@functools.lru_cache(maxsize=None)
def _decode_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def _decode_all(device: torch.device, batch: EncodedBatch) -> tuple[list[Tensor], list[int]]:
    images = batch.images()
    encoded = [i for i, image in enumerate(images) if image.dim() == 1]
    out = [image.to(device, non_blocking=True) if image.dim() == 3 else None for image in images]
    failed: list[int] = []
    if encoded:
        decode_jpeg, rgb = _jpeg_decoder()
        try:
            decoded = decode_jpeg([images[i] for i in encoded], mode=rgb, device=device)
        except RuntimeError:
            decoded = [_decode_one(device, images[i]) for i in encoded]
        for i, image in zip(encoded, decoded):
            if image is None:
                failed.append(i)
                image = torch.zeros((3, PLACEHOLDER_SIDE, PLACEHOLDER_SIDE), dtype=torch.uint8)
            out[i] = image.to(device, non_blocking=True)  # there already (a CPU decode's "cpu" is "cpu:0" too)
    return out, failed


def _decode_one(device: torch.device, data: Tensor) -> Tensor | None:
    """One JPEG's pixels: decoded on ``device``, else on the CPU, else None."""
    decode_jpeg, rgb = _jpeg_decoder()
    try:
        return decode_jpeg(data, mode=rgb, device=device)
    except RuntimeError:
        pass
    try:
        return decode_cpu(data)
    except (OSError, RuntimeError, SyntaxError, ValueError, Image.DecompressionBombError):
        return None
