"""MoCo's two-crop augmentation, scaled to 32 px (CIFAR, digits) or 224 px (ImageFolder) data.

v1 ("weak"): random resized crop (scale 0.2-1), grayscale p=0.2, colour jitter 0.4, flip.
v2 ("strong"): the same crop, colour jitter (0.4, 0.4, 0.4, 0.1) with p=0.8, grayscale p=0.2,
Gaussian blur (sigma 0.1-2) with p=0.5, flip. v2-noblur: v2 without the blur (the MoCo authors'
CIFAR demo has none; it also crops down to 8% of the image where we stop at 20%). Digits are never flipped (a mirrored digit is
another symbol); Gaussian noise (the synthetic set) gets only crops and flips.
"""
from __future__ import annotations

import torch
from torchvision.transforms import v2 as T

from .data import CIFAR10_MEAN, CIFAR10_STD, DIGITS_MEAN, DIGITS_STD, IMAGENET_MEAN, IMAGENET_STD


class TwoCrops:
    """Two independent augmentations of one image: the query view and the key view."""

    def __init__(self, transform):
        self.transform = transform

    def __call__(self, image):
        return self.transform(image), self.transform(image)


def _stats(dataset: str):
    return {"digits": (DIGITS_MEAN, DIGITS_STD), "cifar10": (CIFAR10_MEAN, CIFAR10_STD),
            "imagefolder": (IMAGENET_MEAN, IMAGENET_STD)}.get(dataset)


def moco_view_transform(dataset: str, size: int, aug: str) -> T.Compose:
    """One augmented view; ``aug`` is "v1" (weak), "v2" (strong, with blur) or "v2-noblur"."""
    decode = [T.ToImage(), T.ToDtype(torch.float32, scale=True)] if dataset in ("cifar10", "imagefolder") else []
    steps = decode + [T.RandomResizedCrop(size, scale=(0.2, 1.0), antialias=True)]
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
    stats = _stats(dataset)
    if stats is not None:
        steps.append(T.Normalize(*stats))
    steps.append(T.ToPureTensor())
    return T.Compose(steps)


def moco_train_transform(dataset: str, size: int, aug: str) -> TwoCrops:
    return TwoCrops(moco_view_transform(dataset, size, aug))
