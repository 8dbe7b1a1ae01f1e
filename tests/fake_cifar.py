"""A tiny CIFAR-10 folder in torchvision's own on-disk format, and an environment that lets the
real CLIs read it.

``write_fake_cifar10(root)`` writes ``root/cifar-10-batches-py/`` exactly as
``torchvision.datasets.CIFAR10`` reads it: five ``data_batch_N`` pickles and one ``test_batch``
(dicts with str keys ``data``: uint8 N x 3072 rows, the red, green and blue 32 x 32 planes one after
the other; ``labels``: list of int; plus ``batch_label`` and ``filenames`` as in the real files) and
``batches.meta`` (``label_names``). The images are scikit-learn's handwritten digits (8 x 8,
upsampled to 32 x 32), drawn in a colour of their class over a random dark background with a little
noise, so the ten classes are real, varied images that a small network can learn.

torchvision checks each file's md5 against the real CIFAR-10's, which these files can never match.
``cifar_env(tmp)`` writes a ``sitecustomize.py`` into ``tmp`` and returns the environment for
``helpers.run_cli(..., env=...)``: with ``tmp`` first on PYTHONPATH, every child Python (torchrun's
workers too, which inherit it) skips the md5 comparison for CIFAR-10 only. Files must still exist,
and every other data set (CIFAR-100 included) is checked as before. The patch is applied lazily,
when ``torchvision.datasets.cifar`` is first imported, so a child that never reads CIFAR (torchrun's
own launcher process) imports nothing extra. ``python tests/fake_cifar.py SCRIPT ARGS`` (``main``)
applies the same patch in its own process and runs SCRIPT's ``main``: the entry point for
``helpers.run_ranks``, whose forked ranks run no ``sitecustomize``.
"""
from __future__ import annotations

import importlib
import os
import pickle
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent  # as in helpers.py, without importing torch here

BASE_FOLDER = "cifar-10-batches-py"
NUM_TRAIN_BATCHES = 5
LABEL_NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
# One foreground colour per class (RGB, 0..255): hue is a cue, shape is the rest.
CLASS_COLOURS = np.array([
    (230, 60, 50), (240, 150, 40), (235, 220, 60), (120, 210, 70), (50, 180, 160),
    (60, 150, 235), (90, 80, 220), (170, 80, 210), (225, 90, 170), (200, 200, 200)], dtype=np.float32)


def _upsample(images: np.ndarray, size: int = 32) -> np.ndarray:
    """Bilinear upsampling of N x 8 x 8 images in [0, 1] to N x size x size (pixel centres aligned)."""
    n, h, w = images.shape
    ys = np.clip((np.arange(size) + 0.5) * h / size - 0.5, 0, h - 1)
    xs = np.clip((np.arange(size) + 0.5) * w / size - 0.5, 0, w - 1)
    y0, x0 = np.floor(ys).astype(int), np.floor(xs).astype(int)
    y1, x1 = np.minimum(y0 + 1, h - 1), np.minimum(x0 + 1, w - 1)
    wy, wx = (ys - y0)[None, :, None], (xs - x0)[None, None, :]
    top = images[:, y0][:, :, x0] * (1 - wx) + images[:, y0][:, :, x1] * wx
    bottom = images[:, y1][:, :, x0] * (1 - wx) + images[:, y1][:, :, x1] * wx
    return top * (1 - wy) + bottom * wy


def _render(digits: np.ndarray, labels: np.ndarray, rng: np.random.RandomState) -> np.ndarray:
    """N x 8 x 8 digits (0..16) -> N x 3072 uint8 rows in CIFAR's layout (R plane, G plane, B plane)."""
    n = len(labels)
    alpha = _upsample(digits.astype(np.float32) / 16.0)[:, None]                       # N x 1 x 32 x 32
    fg = CLASS_COLOURS[labels] * rng.uniform(0.75, 1.0, (n, 1)).astype(np.float32)      # brightness varies
    bg = rng.uniform(0, 70, (n, 3)).astype(np.float32)                                  # dark, any hue
    pixels = bg[:, :, None, None] * (1 - alpha) + fg[:, :, None, None] * alpha          # N x 3 x 32 x 32
    pixels += rng.normal(0, 6, pixels.shape).astype(np.float32)
    return np.clip(np.rint(pixels), 0, 255).astype(np.uint8).reshape(n, 3 * 32 * 32)


def _dump(path: Path, obj: dict) -> None:
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=2)


def write_fake_cifar10(root: Path, train_per_class: int = 30, test_per_class: int = 10,
                       test_extra: int = 0, seed: int = 0) -> dict[str, int]:
    """Write ``root/cifar-10-batches-py`` with ``10 * train_per_class`` training images spread
    over the five training batches and ``10 * test_per_class + test_extra`` test images (one
    more of each of the first ``test_extra`` classes: an odd count does not split evenly over
    two ranks); no digit is in both splits. Returns the image counts: ``{"train": ..., "test": ...}``."""
    from sklearn.datasets import load_digits  # ships its data: no download

    bunch = load_digits()
    rng = np.random.RandomState(seed)
    train_idx, test_idx = [], []
    for cls in range(10):
        n_test = test_per_class + (cls < test_extra)
        members = rng.permutation(np.flatnonzero(bunch.target == cls))
        if len(members) < train_per_class + n_test:
            raise ValueError(f"class {cls} has only {len(members)} digits")
        train_idx += list(members[:train_per_class])
        test_idx += list(members[train_per_class:train_per_class + n_test])
    train_idx, test_idx = rng.permutation(train_idx), rng.permutation(test_idx)

    folder = Path(root) / BASE_FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    batches = [(f"data_batch_{b + 1}", f"training batch {b + 1} of {NUM_TRAIN_BATCHES}", part)
               for b, part in enumerate(np.array_split(train_idx, NUM_TRAIN_BATCHES))]
    batches.append(("test_batch", "testing batch 1 of 1", test_idx))
    for name, batch_label, idx in batches:
        labels = bunch.target[idx]
        _dump(folder / name, {
            "batch_label": batch_label,
            "labels": [int(t) for t in labels],
            "data": _render(bunch.images[idx], labels, rng),
            "filenames": [f"{LABEL_NAMES[t]}_s_{int(i):06d}.png" for t, i in zip(labels, idx)],
        })
    _dump(folder / "batches.meta", {"num_cases_per_batch": len(batches[0][2]), "label_names": LABEL_NAMES,
                                    "num_vis": 3 * 32 * 32})
    return {"train": len(train_idx), "test": len(test_idx)}


def write_noise_cifar10(root: Path, train: int = 50_000, test: int = 10_000, seed: int = 0) -> None:
    """``root/cifar-10-batches-py`` at CIFAR-10's real size, of uniform noise and random labels:
    for timing the real recipe (crops, colour, kNN bank) where the real files cannot be fetched;
    numpy only."""
    rng = np.random.RandomState(seed)
    folder = Path(root) / BASE_FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    parts = [(f"data_batch_{b + 1}", n) for b, n in enumerate(np.diff(np.linspace(0, train, NUM_TRAIN_BATCHES + 1)
                                                                       .astype(int)))]
    for name, n in parts + [("test_batch", test)]:
        labels = rng.randint(0, 10, n)
        _dump(folder / name, {"batch_label": name, "labels": [int(t) for t in labels],
                              "data": rng.randint(0, 256, (n, 3 * 32 * 32), dtype=np.uint8),
                              "filenames": [f"noise_{i:06d}.png" for i in range(n)]})
    _dump(folder / "batches.meta", {"num_cases_per_batch": parts[0][1], "label_names": LABEL_NAMES,
                                    "num_vis": 3 * 32 * 32})


# ----------------------------------------------------------------------------- the md5 bypass
SITECUSTOMIZE = '''\
"""Test-only (tests/fake_cifar.py): CIFAR-10 files are not compared with the real data set's md5.

Patched when torchvision.datasets.cifar is imported. Only CIFAR10 itself is affected (not its
subclass CIFAR100), and each file must still exist."""
import importlib.abc
import os
import sys

_TARGET = "torchvision.datasets.cifar"


def _patch(module):
    cifar10, original = module.CIFAR10, module.CIFAR10._check_integrity

    def _check_integrity(self):
        if type(self) is not cifar10:
            return original(self)
        files = [name for name, _ in self.train_list + self.test_list] + [self.meta["filename"]]
        return all(os.path.isfile(os.path.join(self.root, self.base_folder, f)) for f in files)

    cifar10._check_integrity = _check_integrity
    # _load_meta checks batches.meta's md5 on its own; md5=None makes that an existence check.
    cifar10.meta = {**cifar10.meta, "md5": None}
    cifar10.FAKE_CIFAR_MD5_BYPASS = True


class _Loader(importlib.abc.Loader):
    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        _patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                spec.loader = _Loader(spec.loader)
                return spec
        return None


sys.meta_path.insert(0, _Finder())
'''


def cifar_env(site_dir: Path) -> dict[str, str]:
    """Write the md5 bypass into ``site_dir`` and return the environment for ``run_cli(env=...)``:
    PYTHONPATH = site_dir, then the repository (run_cli's own PYTHONPATH is replaced, not merged)."""
    site_dir = Path(site_dir)
    site_dir.mkdir(parents=True, exist_ok=True)
    (site_dir / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return {"PYTHONPATH": os.pathsep.join([str(site_dir), str(REPO)])}


def main(argv: list[str]) -> int:
    """``python tests/fake_cifar.py SCRIPT ARGS...``: SCRIPT's ``main(ARGS)`` with the md5 bypass
    applied in this process first."""
    bypass: dict = {}
    exec(compile(SITECUSTOMIZE, "fake_cifar_sitecustomize", "exec"), bypass)
    if "torchvision.datasets.cifar" in sys.modules:  # imported before the finder was installed
        bypass["_patch"](sys.modules["torchvision.datasets.cifar"])
    sys.path.insert(0, str(REPO))
    script, args = argv[0], argv[1:]
    return importlib.import_module(Path(script).stem).main(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
