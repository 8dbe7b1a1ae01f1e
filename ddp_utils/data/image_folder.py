"""ImageFolder's data set, each file read as the path that uses it needs it (its own module: it
imports torchvision, which a run without image files never pays for)."""
from __future__ import annotations

import copy

import torch
from PIL import Image
from torchvision import datasets

from .decode import decode_cpu, device_decodable, read_bytes
from .image_files import PLACEHOLDER_SIDE, UnreadableImage, decode_rgb


class ImageFiles(datasets.ImageFolder):
    """torchvision's ImageFolder; each file as ``read`` says: "pil", a PIL RGB image
    (:func:`decode_rgb`: the loader path, the reference); "tensor", 3 x H x W uint8 RGB
    (``decode.decode_cpu``: workers of the device path); "encoded", the file's bytes (1-D uint8)
    when the device can decode them (``decode.device_decodable``), else decoded as "tensor". A
    file that cannot be decoded gives a black placeholder and target ``-1 - index`` (see
    ``image_files``' module docstring)."""

    read = "pil"

    def reading(self, read: str) -> ImageFiles:
        """The same files, read as ``read``."""
        if read not in ("pil", "tensor", "encoded"):
            raise ValueError(f"ImageFiles: read must be pil, tensor or encoded, not {read!r}")
        other = copy.copy(self)
        other.read = read
        return other

    def __getitem__(self, index: int):
        path, target = self.samples[index]
        try:
            return self._load(path), target
        except (UnreadableImage, OSError, RuntimeError, SyntaxError, ValueError):
            if self.read == "pil":
                return Image.new("RGB", (PLACEHOLDER_SIDE, PLACEHOLDER_SIDE)), -1 - index
            return torch.zeros((3, PLACEHOLDER_SIDE, PLACEHOLDER_SIDE), dtype=torch.uint8), -1 - index

    def _load(self, path: str):
        if self.read == "pil":
            return decode_rgb(path)
        data = read_bytes(path)
        if self.read == "encoded" and device_decodable(data):
            return data
        return decode_cpu(data)
