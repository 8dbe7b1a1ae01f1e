"""Per-sample transforms (torchvision v2), applied in DataLoader workers.

Classification: random crop with padding (+ flip) for 32 px data, random resized crop + flip for
ImageFolder; evaluation: resize/centre crop only.

MoCo's two-crop augmentation, scaled to 32 px (CIFAR, digits) or 224 px (ImageFolder) data.

v1 ("weak"): random resized crop (scale 0.2-1), grayscale p=0.2, colour jitter 0.4, flip.
v2 ("strong"): the same crop, colour jitter (0.4, 0.4, 0.4, 0.1) with p=0.8, grayscale p=0.2,
Gaussian blur (sigma 0.1-2) with p=0.5, flip. v2-noblur: v2 without the blur (the MoCo authors'
CIFAR demo has none; it also crops down to 8% of the image where we stop at 20%). Digits are never flipped (a mirrored digit is
another symbol); Gaussian noise (the synthetic set) gets only crops and flips.
"""
from __future__ import annotations

import torch
from torchvision.transforms import v2 as T

from .batch_augment import AugmentRecipe, BatchAugment, classifier_recipe, moco_recipe, photometric_only
from .loading import DeviceAugment, Transform
from .sets import normalization_stats


def _normalize(dataset: str, normalization: str = "auto") -> list:
    stats = normalization_stats(dataset, normalization)
    return [] if stats is None else [T.Normalize(*stats)]


def classification_transforms(dataset: str, size: int, augment: bool,
                              normalization: str = "auto") -> tuple[Transform, Transform]:
    """(train, eval) transforms; with ``augment=False`` the train pipeline is deterministic."""
    if dataset == "imagefolder":
        eval_geometry = [T.Resize(round(size * 256 / 224), antialias=True), T.CenterCrop(size)]
        train_geometry = [T.RandomResizedCrop(size, antialias=True), T.RandomHorizontalFlip()]
    else:  # 32 px data; digits and synthetic are already generated at `size`
        eval_geometry = [T.Resize(size, antialias=True)] if dataset == "cifar10" and size != 32 else []
        # Mirroring a digit changes its meaning (a mirrored 3 is no 3), so digits are only shifted.
        flip = [] if dataset == "digits" else [T.RandomHorizontalFlip()]
        train_geometry = eval_geometry + [T.RandomCrop(size, padding=max(1, size // 8))] + flip
    decode = [T.ToImage()] if dataset in ("cifar10", "imagefolder") else []  # PIL -> uint8 tensor
    finish = ([T.ToDtype(torch.float32, scale=True)] if decode else []) + _normalize(dataset, normalization)
    finish.append(T.ToPureTensor())
    train_tf = T.Compose(decode + (train_geometry if augment else eval_geometry) + finish)
    eval_tf = T.Compose(decode + eval_geometry + finish)
    return train_tf, eval_tf


# ----------------------------------------------------------------------------- MoCo views
class TwoCrops:
    """Two independent augmentations of one image: the query view and the key view."""

    def __init__(self, transform):
        self.transform = transform

    def __call__(self, image):
        return self.transform(image), self.transform(image)


def moco_view_transform(dataset: str, size: int, aug: str, crop_min: float = 0.2,
                        normalization: str = "auto") -> T.Compose:
    """One augmented view; ``aug`` is "v1" (weak), "v2" (strong, with blur) or "v2-noblur"."""
    decode = [T.ToImage(), T.ToDtype(torch.float32, scale=True)] if dataset in ("cifar10", "imagefolder") else []
    steps = decode + [T.RandomResizedCrop(size, scale=(crop_min, 1.0), antialias=True)]
    if dataset != "synthetic":
        if aug == "v1":
            steps += [T.RandomGrayscale(p=0.2), T.ColorJitter(0.4, 0.4, 0.4, 0.4)]
        else:
            blur_kernel = 2 * max(1, round(0.05 * size)) + 1  # 23 px at 224 (about 10%), 5 at 32
            steps += [T.RandomApply([T.ColorJitter(0.4, 0.4, 0.4, 0.1)], p=0.8), T.RandomGrayscale(p=0.2)]
            if aug == "v2":
                steps.append(T.RandomApply([T.GaussianBlur(blur_kernel, sigma=(0.1, 2.0))], p=0.5))
    if dataset != "digits":
        steps.append(T.RandomHorizontalFlip())
    steps += _normalize(dataset, normalization)
    steps.append(T.ToPureTensor())
    return T.Compose(steps)


def moco_train_transform(dataset: str, size: int, aug: str, crop_min: float = 0.2,
                         normalization: str = "auto") -> TwoCrops:
    return TwoCrops(moco_view_transform(dataset, size, aug, crop_min, normalization))


# ----------------------------------------------------------------------------- device augmentation
AUG_ON = ("auto", "device", "loader")


def augment_on_device(aug_on: str, dataset: str, device: torch.device) -> bool:
    """``--aug-on``: device, loader, or auto = the device, except ImageFolder on a CPU, where the
    DataLoader workers' cores would otherwise sit idle while the training process augments."""
    if aug_on == "auto":
        return dataset != "imagefolder" or device.type == "cuda"
    return aug_on == "device"


def _stats(dataset: str, normalization: str) -> dict:
    mean, std = normalization_stats(dataset, normalization) or (None, None)
    return dict(mean=mean, std=std)


def classifier_device_recipe(dataset: str, size: int, augment: bool, normalization: str = "auto") -> AugmentRecipe:
    """What :func:`classification_transforms` does to a training image, as a batched recipe."""
    if not augment:
        return AugmentRecipe(**_stats(dataset, normalization))  # resize to ``size`` (if needed) and normalise
    if dataset == "imagefolder":
        return AugmentRecipe(crop_scale=(0.08, 1.0), flip=True, **_stats(dataset, normalization))
    return classifier_recipe(size, flip=dataset != "digits", **_stats(dataset, normalization))


def moco_device_recipe(dataset: str, size: int, aug: str, crop_min: float = 0.2,
                       normalization: str = "auto") -> AugmentRecipe:
    """What :func:`moco_view_transform` does to one view, as a batched recipe."""
    if dataset == "synthetic":  # Gaussian noise: crops and flips only
        return AugmentRecipe(crop_scale=(crop_min, 1.0), flip=True)
    return moco_recipe(aug, size, crop_min=crop_min, flip=dataset != "digits", **_stats(dataset, normalization))


def device_training_augmentation(recipe: AugmentRecipe, dataset: str, size: int, seed: int,
                                 views: int) -> tuple[Transform | None, DeviceAugment]:
    """The per-sample half (for the workers; None for in-memory data) and the device half.

    Data read from files (ImageFolder) is decoded and cropped per sample, since decoding needs
    the whole image anyway; everything else runs on the device as a batch.
    """
    if dataset != "imagefolder":
        return None, DeviceAugment(BatchAugment(recipe, size), seed, views)
    if recipe.crop_scale is not None:
        crop = T.RandomResizedCrop(size, scale=recipe.crop_scale, ratio=recipe.crop_ratio, antialias=True)
    else:  # no augmentation: the evaluation geometry
        crop = T.Compose([T.Resize(round(size * 256 / 224), antialias=True), T.CenterCrop(size)])
    one_view = T.Compose([T.ToImage(), crop, T.ToPureTensor()])  # uint8 C x size x size
    per_sample = one_view if views == 1 else TwoCrops(one_view)
    return per_sample, DeviceAugment(BatchAugment(photometric_only(recipe), size), seed, views)
