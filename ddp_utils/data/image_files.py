"""Image files (``--dataset imagefolder``): every file decoded to RGB whatever it holds (CMYK,
grayscale, a PNG named ``.JPEG``: ImageNet has all three), a file that cannot be decoded named
with its reason, and the data check that decodes whole splits on every usable core.

A file that cannot be decoded never raises inside a DataLoader worker: the traceback would name no
file, and the rank that met it would leave while its peers wait in a collective. It comes as a
black placeholder with target ``-1 - index``; :class:`CheckedBatches` finds such targets on the
host, records the file in the run's :class:`UnreadableFiles` and hands on the batch with a valid
target, so every rank finishes the step and the per-step agreement stops them together.
"""
from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Iterator

import torch
from PIL import Image, UnidentifiedImageError
from torch.utils.data import Dataset, Subset

from ..runtime.collectives import all_gather_object

PLACEHOLDER_SIDE = 8  # px: the placeholder's side (any transform resizes it)


class UnreadableImage(Exception):
    """A file that cannot be decoded; ``str()`` is "PATH (reason)"."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"{path} ({reason})")
        self.path, self.reason = path, reason


def decode_rgb(path: str) -> Image.Image:
    """The whole image, decoded (a truncated file fails here, not later) and converted to RGB."""
    try:
        with open(path, "rb") as f:
            image = Image.open(f)
            image.load()
            return image.convert("RGB")
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
        raise UnreadableImage(path, _reason(path, err)) from None


def _reason(path: str, err: Exception) -> str:
    if isinstance(err, UnidentifiedImageError):
        return "empty file" if os.path.getsize(path) == 0 else "not an image file PIL can read"
    text = str(err).split(". ")[0].strip() or type(err).__name__
    return text[0].lower() + text[1:]


def image_files_of(ds: Dataset) -> Dataset | None:
    """The ImageFiles (``image_folder``) under Subsets and wrappers (``base``), or None for other
    data (a run that loaded no image files never imported their module, or torchvision)."""
    while isinstance(ds, Subset) or hasattr(ds, "base"):
        ds = ds.dataset if isinstance(ds, Subset) else ds.base
    folder = sys.modules.get(f"{__package__}.image_folder")
    return ds if folder is not None and isinstance(ds, folder.ImageFiles) else None


def unreadable_in(files: Dataset, targets: torch.Tensor) -> list[UnreadableImage]:
    """The files behind the placeholder targets of a batch (a host tensor), with their reasons."""
    return [why_unreadable(files.samples[-1 - code][0]) for code in targets[targets < 0].tolist()]


def why_unreadable(path: str) -> UnreadableImage:
    """A file that could not be decoded, with the reason PIL gives when it decodes it once more."""
    try:
        decode_rgb(path)
    except UnreadableImage as err:
        return err
    return UnreadableImage(path, "could not be decoded where the run decoded it")


def sample_path(raw: Dataset, index: int) -> str:
    """The file behind sample ``index`` of ``raw`` (ImageFiles, or Subsets of it)."""
    while isinstance(raw, Subset):
        raw, index = raw.dataset, raw.indices[index]
    return raw.samples[index][0]


@dataclass
class UnreadableFiles:
    """The files this rank could not decode so far (training, evaluation and kNN-bank batches)."""

    found: list[UnreadableImage] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.found)

    def on_every_rank(self) -> list[UnreadableImage]:
        """Every rank's files, each once (every rank must call: one all_gather_object)."""
        everyone = all_gather_object([(e.path, e.reason) for e in self.found])
        unique = dict.fromkeys(item for rank in everyone for item in rank)
        return [UnreadableImage(path, reason) for path, reason in unique]


def describe_unreadable(files: list[UnreadableImage], shown: int = 3) -> str:
    """"cannot decode PATH (reason)", or "cannot decode 5 files: A (..); B (..); C (..) and 2 more"."""
    if len(files) == 1:
        return f"cannot decode {files[0]}"
    more = f" and {len(files) - shown} more" if len(files) > shown else ""
    return f"cannot decode {len(files)} files: {'; '.join(map(str, files[:shown]))}{more}"


def fix_hint(files: list[UnreadableImage]) -> str:
    return f"fix or remove {'it' if len(files) == 1 else 'them'} (--check-data lists every such file)"


class CheckedBatches:
    """Batches of image files with the placeholders found: ``batch[1]`` (targets, on the host)
    comes with valid labels, the unreadable files go into ``unreadable``. Has the loader's
    length, data set and batch size."""

    def __init__(self, loader, files: Dataset, unreadable: UnreadableFiles):
        self.loader, self.files, self.unreadable = loader, files, unreadable
        self.dataset, self.batch_size = loader.dataset, loader.batch_size

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator:
        for batch in self.loader:
            targets = batch[1]
            if (targets < 0).any():  # a host tensor: no device is read
                self.unreadable.found += unreadable_in(self.files, targets)
                batch = [batch[0], targets.clamp(min=0), *batch[2:]]
            yield batch


def check_decodes(files: Dataset, threads: int) -> list[UnreadableImage]:
    """Decode every file of ``files`` on ``threads`` threads (PIL's decoder releases the GIL);
    the files that fail, in the data set's order."""
    paths = [path for path, _ in files.samples]

    def problem(path: str) -> UnreadableImage | None:
        try:
            decode_rgb(path)
        except UnreadableImage as err:
            return err
        return None

    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        return [err for err in pool.map(problem, paths) if err is not None]
