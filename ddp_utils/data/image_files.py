"""Image files (``--dataset imagefolder`` and ``shards``) as samples: listed, read and decoded on
the CPU. An image folder's listing (:class:`FolderListing`, made once per job), its files
(:class:`ImageFiles`) or the same files read from its shards (:class:`ShardFiles`), each file read
as the path that uses it needs it (PIL, pixels decoded on the CPU, or its bytes for the device's
decoder), and the helpers that find the files under a run's wrappers.

Every file is decoded to RGB whatever it holds (CMYK, grayscale, a PNG named ``.JPEG``: ImageNet
has all three): JPEGs by ``torchvision.io.decode_jpeg`` (libjpeg-turbo; its output equals PIL's,
pixel for pixel), any other file by PIL. torchvision 0.29 deprecates its image decoding in favour
of TorchCodec; it is what both supported torchvision releases (0.26 on the GPU machines, 0.29
here) have, batched on CUDA, so its deprecation warning is silenced here, once. torchvision is
imported on first use only: a run without image files never pays for it (about 2 s a process).
The JPEG marker test :func:`device_decodable` says which files the "encoded" read hands to the
device's decoder (nvJPEG, ``files_on_device.decode_on``); it is here, where that read chooses, as
``files_on_device`` imports this module.

A file that cannot be decoded raises :class:`UnreadableImage` when decoded directly and comes as
a black placeholder with target ``-1 - index`` as a sample (``unreadable``: why;
``unreadable.UnreadableFiles.record`` records it).
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import os
import warnings
from dataclasses import dataclass
from io import BytesIO
from typing import Sequence

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch import Tensor
from torch.utils.data import Dataset, Subset

from .object_store import StoreError, is_object_store
from .shard_cache import NodeCache
from .shards import ShardIndex, ShardReader

PLACEHOLDER_SIDE = 8  # px: the placeholder's side (any transform resizes it)
IN_SHARD = " in "  # a shard record's name: "PATH in SHARD" (ShardFiles.name)
READS = ("pil", "decoded", "encoded")


# ----------------------------------------------------------------------------- decoding on the CPU
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


# ----------------------------------------------------------------------------- the files as samples
@dataclass(frozen=True)
class FolderListing:
    """One split of an image folder as torchvision's ImageFolder lists it: ``classes`` (the
    sorted class folders), and each file's path below ``root`` and class index, in ImageFolder's
    order. Compact, so that one rank can list a split and send it to the others: the paths are
    one string and the targets one array, not a Python object per file."""

    root: str
    classes: tuple[str, ...]
    paths: str            # the files' paths relative to ``root``, NUL between two (no path holds one)
    targets: np.ndarray   # int32, one per file

    @classmethod
    def of(cls, root: str) -> FolderListing:
        """``root`` listed by torchvision's ImageFolder; FileNotFoundError, as it raises, for a
        class folder without images or a root without class folders."""
        from torchvision.datasets import ImageFolder

        listing = ImageFolder(root)
        cut = len(os.path.join(listing.root, ""))  # its root, "~" expanded
        return cls(listing.root, tuple(listing.classes), "\0".join(path[cut:] for path, _ in listing.samples),
                   np.array([target for _, target in listing.samples], dtype=np.int32))

    @functools.cached_property
    def fingerprint(self) -> str:
        """sha256 of the classes, paths and targets: what identifies the files listed (wherever
        the folder lies)."""
        digest = hashlib.sha256("\0".join(self.classes).encode())
        digest.update(self.paths.encode())
        digest.update(self.targets.astype("<i4").tobytes())
        return digest.hexdigest()

    def with_files(self, paths: Sequence[str]) -> FolderListing:
        """This listing with the files ``paths`` (below ``root``, each in one of its class folders)
        in it, where ImageFolder lists them: by class, then folder, then name."""
        if not paths:
            return self
        index = {name: number for number, name in enumerate(self.classes)}
        listed = list(zip(self.paths.split("\0"), self.targets.tolist())) if self.paths else []
        listed += [(path, index[path.split("/", 1)[0]]) for path in paths]
        listed.sort(key=lambda item: (item[1], os.path.dirname(item[0]), os.path.basename(item[0])))
        return dataclasses.replace(self, paths="\0".join(path for path, _ in listed),
                                   targets=np.array([target for _, target in listed], dtype=np.int32))

    def samples(self) -> list[tuple[str, int]]:
        """ImageFolder's ``samples``: (path, class index) per file, the paths as it writes them."""
        if not self.paths:
            return []
        head = os.path.join(self.root, "")
        return [(head + path, target) for path, target in zip(self.paths.split("\0"), self.targets.tolist())]


class ImageFiles(Dataset):
    """The files of a :class:`FolderListing` (``classes``, ``samples``: (path, class)), each
    file as ``read`` says: "pil", a PIL RGB image (:func:`decode_rgb`: the loader path, the
    reference); "decoded", 3 x H x W uint8 RGB (:func:`decode_cpu`: workers of the device path);
    "encoded", the file's bytes (1-D uint8) when the device can decode them
    (:func:`device_decodable`), else decoded as "decoded". A file that cannot be decoded gives a
    black placeholder and target ``-1 - index``. Sample ``i`` is named by :meth:`name`, read by
    :meth:`bytes_of` and decoded to PIL by :meth:`decode_pil`: :class:`ShardFiles` reads the
    same files from shards."""

    read = "pil"

    def __init__(self, listing: FolderListing):
        self.root, self.classes, self.samples = listing.root, list(listing.classes), listing.samples()
        self.fingerprint = listing.fingerprint  # what identifies these files (data_fingerprint)

    def reading(self, read: str) -> ImageFiles:
        """The same files, read as ``read``."""
        if read not in READS:
            raise ValueError(f"ImageFiles: read must be one of {', '.join(READS)}, not {read!r}")
        other = copy.copy(self)
        other.read = read
        return other

    def __len__(self) -> int:
        return len(self.samples)

    def size_sample(self, count: int) -> Sequence[int]:
        """At most ``count`` indices spread evenly over the files, whose sizes stand for all."""
        return range(0, len(self), max(1, len(self) // count))[:count]

    def file_facts(self, index: int) -> FileFacts | None:
        """Sample ``index``'s bytes, size in pixels and whether the device decoder takes it, read
        from the file's header; None when it cannot be read or has no header PIL knows."""
        try:
            data = self.bytes_of(index)
            with Image.open(BytesIO(data.numpy().tobytes())) as image:
                return FileFacts(data.numel(), image.size, device_decodable(data))
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError):
            return None

    def first_samples(self, count: int) -> Sequence[int]:
        """``count`` samples to show (TensorBoard's augmentation preview): the first ones."""
        return range(min(count, len(self)))

    def name(self, index: int) -> str:
        """What names sample ``index`` to a user: its file's path."""
        return self.samples[index][0]

    def target(self, index: int) -> int:
        return self.samples[index][1]

    def bytes_of(self, index: int) -> Tensor:
        """The file's bytes, 1-D uint8."""
        return read_bytes(self.samples[index][0])

    def decode_pil(self, index: int) -> Image.Image:
        """The whole image as PIL RGB (:func:`decode_rgb`); UnreadableImage if it cannot be decoded."""
        return decode_rgb(self.samples[index][0])

    def __getitem__(self, index: int):
        target = self.target(index)
        try:
            return self._load(index), target
        except (UnreadableImage, StoreError, OSError, RuntimeError, SyntaxError, ValueError):
            if self.read == "pil":
                return Image.new("RGB", (PLACEHOLDER_SIDE, PLACEHOLDER_SIDE)), -1 - index
            return torch.zeros((3, PLACEHOLDER_SIDE, PLACEHOLDER_SIDE), dtype=torch.uint8), -1 - index

    def _load(self, index: int):
        if self.read == "pil":
            return self.decode_pil(index)
        data = self.bytes_of(index)
        if self.read == "encoded" and device_decodable(data):
            return data
        return decode_cpu(data)


@dataclass(frozen=True)
class FileFacts:
    """What start-up needs of an image file to bound the workers' memory."""

    bytes: int
    size: tuple[int, int]   # (width, height), px
    device_decodable: bool  # :func:`device_decodable`


class ShardFiles(ImageFiles):
    """The files of one split written by ``write_shards.py`` (``shards.ShardIndex``), read from
    the shards by their number (``shards.ShardReader``), in the folder's order: everything else
    as :class:`ImageFiles`. A sample is named by its original path and its shard."""

    def __init__(self, index: ShardIndex, cache: NodeCache | None = None):
        self.root, self.classes, self.index, self.fingerprint = index.root, list(index.classes), index, index.fingerprint
        self.reader = ShardReader(index, cache)  # cache: where shards from an object store are kept

    def __len__(self) -> int:
        return len(self.index)

    def first_samples(self, count: int) -> Sequence[int]:
        """From an object store, ``count`` samples of the first shard (which mixes the classes):
        one download, not one per sample."""
        if is_object_store(self.root):
            return np.flatnonzero(self.index.shard == 0)[:count].tolist()
        return super().first_samples(count)

    def size_sample(self, count: int) -> Sequence[int]:
        """Spread over the files when the index gives their sizes (nothing is read for them);
        else, from an object store, the first shard's (one download)."""
        if is_object_store(self.root) and self.index.width is None:
            return self.first_samples(count)
        return super().size_sample(count)

    def file_facts(self, index: int) -> FileFacts | None:
        """From the index where it has them (written by ``write_shards.py``), else from the header."""
        if self.index.width is None:
            return super().file_facts(index)
        return FileFacts(int(self.index.size[index]), (int(self.index.width[index]), int(self.index.height[index])),
                         bool(self.index.device_decodable[index]))

    def name(self, index: int) -> str:
        shard = self.index.shards[int(self.index.shard[index])]["name"]
        return f"{self.index.path(index)}{IN_SHARD}{self.root}/{shard}"

    def target(self, index: int) -> int:
        return int(self.index.label[index])

    def bytes_of(self, index: int) -> Tensor:
        return self.reader.read(index)

    def decode_pil(self, index: int) -> Image.Image:
        try:
            return decode_rgb_bytes(self.bytes_of(index).numpy().tobytes(), "")
        except UnreadableImage as err:  # named here only: a name is a walk through every path
            raise UnreadableImage(self.name(index), err.reason) from None


def data_fingerprint(train: FolderListing | ShardIndex, val: FolderListing | ShardIndex) -> str:
    """What identifies a run's image files, both splits (their listings, or their shards'
    indexes): a checkpoint records it, and a resume on other files is refused."""
    return hashlib.sha256(f"{train.fingerprint}\0{val.fingerprint}".encode()).hexdigest()[:16]


def underlying(ds: Dataset) -> Dataset:
    """The data set under Subsets and the wrappers that keep its samples (a ``base``:
    ``pipeline.SeededTransform``)."""
    while isinstance(ds, Subset) or hasattr(ds, "base"):
        ds = ds.dataset if isinstance(ds, Subset) else ds.base
    return ds


def image_files_of(ds: Dataset) -> ImageFiles | None:
    """The :class:`ImageFiles` under ``ds``, or None for other data."""
    files = underlying(ds)
    return files if isinstance(files, ImageFiles) else None


def read_as(raw: Dataset, read: str) -> Dataset:
    """``raw`` (ImageFiles, or a Subset of it) with its files read as ``read`` (:meth:`ImageFiles.reading`)."""
    if isinstance(raw, Subset):
        return Subset(read_as(raw.dataset, read), raw.indices)
    if not isinstance(raw, ImageFiles):
        raise TypeError(f"read_as: image files expected, got {type(raw).__name__}")
    return raw.reading(read)


def sample_path(raw: Dataset, index: int) -> str:
    """The file behind sample ``index`` of ``raw`` (ImageFiles, or Subsets of it), as
    :meth:`ImageFiles.name` names it."""
    while isinstance(raw, Subset):
        raw, index = raw.dataset, raw.indices[index]
    return raw.name(index)
