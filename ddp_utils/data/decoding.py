"""An image file's bytes to pixels, on the CPU: torchvision's JPEG decoder, PIL for everything
else, the JPEG marker test that says which files the device's decoder is given, and
:class:`UnreadableImage`, what a file that cannot be decoded raises.

Every file is decoded to RGB whatever it holds (CMYK, grayscale, a PNG named ``.JPEG``:
ImageNet has all three). JPEGs are decoded by ``torchvision.io.decode_jpeg`` (libjpeg-turbo;
its output equals PIL's, pixel for pixel), any other file by PIL. torchvision 0.29 deprecates
its image decoding in favour of TorchCodec; it is what both supported torchvision releases
(0.26 on the GPU machines, 0.29 here) have, batched on CUDA, so its deprecation warning is
silenced here, once. torchvision is imported on first use only: a run without image files
never pays for it (about 2 s a process). The device's own decoder (nvJPEG) is
``files_on_device.decode_on``.
"""
from __future__ import annotations

import functools
import os
import warnings
from io import BytesIO

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch import Tensor


@functools.lru_cache(maxsize=None)
def jpeg_decoder():
    """(torchvision.io.decode_jpeg, its RGB mode), imported on first use, its deprecation warning
    silenced once."""
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
    decoder is given (progressive, arithmetic-coded, CMYK or grayscale JPEGs are not): it starts
    with SOI, ends with EOI, and its first frame header is SOF0 or SOF1 with 3 components at 8
    bits. Reads the markers only, not the image data."""
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
    (:func:`decode_rgb` decides what cannot be decoded). Raises on such a file."""
    if is_jpeg(data):
        decode_jpeg, rgb = jpeg_decoder()
        try:
            return decode_jpeg(data, mode=rgb)
        except RuntimeError:
            pass
    with Image.open(BytesIO(data.numpy().tobytes())) as image:
        image.load()
        return torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1)


def decode_rgb(path: str) -> Image.Image:
    """The whole image, decoded (a truncated file fails here, not later) and converted to RGB."""
    try:
        with open(path, "rb") as f:
            image = Image.open(f)
            image.load()
            return image.convert("RGB")
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
        raise UnreadableImage(path, _reason(err, empty=os.path.isfile(path) and os.path.getsize(path) == 0)) from None


def decode_rgb_bytes(data: bytes, name: str) -> Image.Image:
    """:func:`decode_rgb` of an image file's bytes; ``name`` says which file in the error."""
    try:
        with Image.open(BytesIO(data)) as image:
            image.load()
            return image.convert("RGB")
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
        raise UnreadableImage(name, _reason(err, empty=not data)) from None


class UnreadableImage(Exception):
    """A file that cannot be decoded; ``str()`` is "PATH (reason)"."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"{path} ({reason})")
        self.path, self.reason = path, reason


def _reason(err: Exception, empty: bool) -> str:
    if isinstance(err, UnidentifiedImageError):
        return "empty file" if empty else "not an image file PIL can read"
    text = str(err).split(". ")[0].strip() or type(err).__name__
    return text[0].lower() + text[1:]
