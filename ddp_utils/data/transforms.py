"""Per-sample torchvision pipelines, run in DataLoader workers: the evaluation transform, and the
training views built from an :class:`AugmentRecipe` (the reference for the batched path).

Order of a training view: decode (files), geometry on the decoded image, to float, colour, flip,
normalisation; the batched path (``batch_augment``) takes the same steps in the same order.
"""
from __future__ import annotations

import torch
from torchvision.transforms import v2 as T

from .batch_augment import BatchAugment
from .loading import DeviceAugment, Transform
from .recipes import AugmentRecipe, photometric_only
from .sets import normalization_stats

AUG_ON = ("auto", "device", "loader")
FROM_FILES = ("cifar10", "imagefolder")  # decoded from PIL images; the others are float tensors


def _decode(dataset: str) -> list:
    return [T.ToImage()] if dataset in FROM_FILES else []  # PIL -> uint8 tensor


def _to_float(dataset: str) -> list:
    return [T.ToDtype(torch.float32, scale=True)] if dataset in FROM_FILES else []


def _normalize(mean, std) -> list:
    return [] if mean is None else [T.Normalize(mean, std)]


def _fixed_geometry(dataset: str, size: int) -> list:
    """Evaluation geometry: ImageFolder resized and centre-cropped; CIFAR-10 resized if asked for
    another size; digits and synthetic images are generated at ``size`` already."""
    if dataset == "imagefolder":
        return [T.Resize(round(size * 256 / 224), antialias=True), T.CenterCrop(size)]
    return [T.Resize(size, antialias=True)] if dataset == "cifar10" and size != 32 else []


def _geometry(recipe: AugmentRecipe, dataset: str, size: int) -> list:
    if recipe.crop_scale is not None:
        return [T.RandomResizedCrop(size, scale=recipe.crop_scale, ratio=recipe.crop_ratio, antialias=True)]
    if recipe.pad_crop:
        return _fixed_geometry(dataset, size) + [T.RandomCrop(size, padding=recipe.pad_crop)]
    return _fixed_geometry(dataset, size)


def _maybe(p: float, step) -> object:
    return step if p == 1 else T.RandomApply([step], p=p)


def _colour(recipe: AugmentRecipe) -> list:
    gray = [T.RandomGrayscale(p=recipe.gray_p)] if recipe.gray_p > 0 else []
    steps = list(gray) if recipe.gray_before_jitter else []
    if recipe.jitter is not None and recipe.jitter_p > 0:
        steps.append(_maybe(recipe.jitter_p, T.ColorJitter(*recipe.jitter)))
    steps += [] if recipe.gray_before_jitter else gray
    if recipe.blur_p > 0:
        steps.append(_maybe(recipe.blur_p, T.GaussianBlur(recipe.blur_kernel, sigma=recipe.blur_sigma)))
    return steps


def eval_transform(dataset: str, size: int, normalization: str = "auto") -> T.Compose:
    stats = normalization_stats(dataset, normalization) or (None, None)
    return T.Compose(_decode(dataset) + _fixed_geometry(dataset, size) + _to_float(dataset)
                     + _normalize(*stats) + [T.ToPureTensor()])


def view_transform(recipe: AugmentRecipe, dataset: str, size: int) -> T.Compose:
    """One training view of one sample, as ``recipe`` says."""
    flip = [T.RandomHorizontalFlip()] if recipe.flip else []
    return T.Compose(_decode(dataset) + _geometry(recipe, dataset, size) + _to_float(dataset) + _colour(recipe)
                     + flip + _normalize(recipe.mean, recipe.std) + [T.ToPureTensor()])


class TwoCrops:
    """Two independent augmentations of one image: MoCo's query view and key view."""

    def __init__(self, transform: Transform):
        self.transform = transform

    def __call__(self, image):
        return self.transform(image), self.transform(image)


def augment_on_device(aug_on: str, dataset: str, device: torch.device) -> bool:
    """``--aug-on``: device, loader, or auto = device, except ImageFolder on a CPU, where the
    DataLoader workers' cores would otherwise sit idle while the training process augments."""
    if aug_on == "auto":
        return dataset != "imagefolder" or device.type == "cuda"
    return aug_on == "device"


def training_augmentation(recipe: AugmentRecipe, dataset: str, size: int, seed: int, views: int,
                          on_device: bool) -> tuple[Transform | None, DeviceAugment | None]:
    """``views`` views per sample: (what the workers run per sample, what the device runs per batch).

    On the loader path the workers do it all. On the device path in-memory data needs no worker
    at all; ImageFolder's workers decode and crop (decoding needs the whole image anyway) and the
    device does the rest.
    """
    if not on_device:
        one_view = view_transform(recipe, dataset, size)
        return (one_view if views == 1 else TwoCrops(one_view)), None
    if dataset != "imagefolder":
        return None, DeviceAugment(BatchAugment(recipe, size), seed, views)
    one_view = T.Compose([T.ToImage(), *_geometry(recipe, dataset, size), T.ToPureTensor()])  # uint8
    per_sample = one_view if views == 1 else TwoCrops(one_view)
    return per_sample, DeviceAugment(BatchAugment(photometric_only(recipe), size), seed, views)
