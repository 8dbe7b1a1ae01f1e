"""The training augmentations, each written once as an :class:`AugmentRecipe`, from which both
pipelines are built: per sample with torchvision (``transforms.view_transform``, the reference)
and per batch on the device (``batch_augment.BatchAugment``). MoCo v1 is "weak" (crop,
grayscale, jitter, flip), v2 "strong" (jitter with p 0.8, grayscale, blur with p 0.5), v2-noblur
the authors' CIFAR-10 demo. Digits are never flipped (a mirrored digit is another symbol)."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .sets import CIFAR10_DEMO_STD, CIFAR10_MEAN, IMAGE_FILES, NORMALIZATION

MOCO_AUGS = ("v1", "v2", "v2-noblur")
AUG_ON = ("auto", "device", "loader")
IMAGENET_CROP_SCALE = (0.08, 1.0)  # torchvision's RandomResizedCrop default
EVAL_RESIZE = 256 / 224  # ImageFolder's evaluation view: the short side resized to this x the crop, then centre-cropped
JITTER_V1 = (0.4, 0.4, 0.4, 0.4)   # brightness, contrast, saturation, hue
JITTER_V2 = (0.4, 0.4, 0.4, 0.1)
# torchvision's automatic augmentations (references/classification's --auto-augment): AutoAugment's
# three policies, RandAugment, TrivialAugmentWide, AugMix
AUTO_AUGMENTS = ("imagenet", "cifar10", "svhn", "ra", "ta_wide", "augmix")
# torchvision's InterpolationMode values that its resizes take on tensors (references/classification's --interpolation)
INTERPOLATIONS = ("bilinear", "bicubic", "nearest", "nearest-exact")



def evaluation_resize(size: int, resize: int = 0) -> int:
    """px of an image file's short side before the evaluation view's centre ``size`` crop:
    ``resize`` (--val-resize-size) if set, else ``size`` x 256/224."""
    return resize or round(size * EVAL_RESIZE)

@dataclass(frozen=True)
class AugmentRecipe:
    """One augmented view, step by step.

    Geometry, at most one of: ``crop_scale`` (random resized crop, area fraction in that range,
    aspect ratio in ``crop_ratio``) or ``pad_crop`` (zero-pad by that many pixels, then a random
    window of the output size). Colour: ``jitter`` = (brightness, contrast, saturation, hue)
    strengths, applied with ``jitter_p``; grayscale with ``gray_p``, before the jitter if
    ``gray_before_jitter`` (v1) else after it (v2); Gaussian blur with ``blur_p``, sigma uniform
    in ``blur_sigma``, an odd ``blur_kernel``. Then a horizontal flip with p 0.5 if ``flip``, then
    ``(x - mean) / std`` if ``mean`` is set. The defaults only resize to the output size.

    torchvision's classification recipe (per sample only: :attr:`per_sample_only`):
    ``auto_augment`` (one of AUTO_AUGMENTS, "" none) on the 8-bit image right after the crop
    and flip, with ``ra_magnitude`` (RandAugment) and ``augmix_severity`` (AugMix); random
    erasing with probability ``random_erase`` after the normalisation. ``resize``: the fixed
    geometry of image files (the evaluation view), the short side resized to this many px
    before the centre crop; 0 = round(size x 256/224). ``interpolation`` (one of INTERPOLATIONS):
    the resizes' and the automatic augmentation's; other than bilinear, per sample only.
    """

    crop_scale: tuple[float, float] | None = None
    crop_ratio: tuple[float, float] = (3 / 4, 4 / 3)
    pad_crop: int = 0
    flip: bool = False
    jitter: tuple[float, float, float, float] | None = None
    jitter_p: float = 1.0
    gray_p: float = 0.0
    gray_before_jitter: bool = False
    blur_p: float = 0.0
    blur_sigma: tuple[float, float] = (0.1, 2.0)
    blur_kernel: int = 5
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    auto_augment: str = ""
    ra_magnitude: int = 9
    augmix_severity: int = 3
    random_erase: float = 0.0
    resize: int = 0
    interpolation: str = "bilinear"

    @property
    def per_sample_only(self) -> bool:
        """Steps that only the per-sample (loader) path runs: torchvision's own classes, one
        Python call per image, whose draws cannot be made a batch's tensor ops bit for bit, and
        resizes other than the device path's bilinear ones."""
        return bool(self.auto_augment) or self.random_erase > 0 or self.interpolation != "bilinear"

    def __post_init__(self):
        for name in ("crop_scale", "crop_ratio", "jitter", "blur_sigma", "mean", "std"):
            value = getattr(self, name)
            if value is not None:  # lists become tuples: recipes compare equal and stay hashable
                object.__setattr__(self, name, tuple(float(v) for v in value))
        if self.pad_crop < 0:
            raise ValueError(f"AugmentRecipe: pad_crop {self.pad_crop} must be >= 0")
        if self.crop_scale is not None and self.pad_crop:
            raise ValueError("AugmentRecipe: crop_scale and pad_crop are alternatives; set one")
        if self.crop_scale is not None and not 0 < self.crop_scale[0] <= self.crop_scale[1]:
            raise ValueError(f"AugmentRecipe: crop_scale {self.crop_scale} must be (min, max) with 0 < min <= max")
        jitter = self.jitter
        if jitter is not None and (len(jitter) != 4 or min(jitter) < 0 or jitter[3] > 0.5):
            raise ValueError(f"AugmentRecipe: jitter {self.jitter} must be 4 non-negative strengths, hue <= 0.5")
        if self.blur_kernel < 1 or self.blur_kernel % 2 == 0:
            raise ValueError(f"AugmentRecipe: blur_kernel {self.blur_kernel} must be odd and positive")
        if (self.mean is None) != (self.std is None):
            raise ValueError("AugmentRecipe: set both mean and std, or neither")
        if not all(0.0 <= p <= 1.0 for p in (self.jitter_p, self.gray_p, self.blur_p, self.random_erase)):
            raise ValueError("AugmentRecipe: probabilities must lie in [0, 1]")
        if self.auto_augment and self.auto_augment not in AUTO_AUGMENTS:
            raise ValueError(f"AugmentRecipe: auto_augment {self.auto_augment!r}: one of {', '.join(AUTO_AUGMENTS)}")
        if self.auto_augment and (self.jitter is not None or self.gray_p or self.blur_p):
            # torchvision's recipe has no colour steps beside it; their place in its order is undefined
            raise ValueError("AugmentRecipe: auto_augment and the colour steps (jitter, grayscale, blur) are "
                             "alternatives; set one")
        if self.resize < 0:
            raise ValueError(f"AugmentRecipe: resize {self.resize} must be >= 0")
        if self.interpolation not in INTERPOLATIONS:
            raise ValueError(f"AugmentRecipe: interpolation {self.interpolation!r}: one of {', '.join(INTERPOLATIONS)}")


def eval_recipe(dataset: str, normalization: str = "auto", resize: int = 0,
                interpolation: str = "bilinear") -> AugmentRecipe:
    """The evaluation view: ``--normalization``'s statistics for ``dataset`` and nothing else
    (synthetic noise needs none); image files resized to ``resize`` px (0: the 256/224 rule) with
    ``interpolation`` before the centre crop. The one place the statistics are looked up: every
    other recipe adds its steps to this one."""
    if normalization == "cifar10-demo":
        return AugmentRecipe(mean=CIFAR10_MEAN, std=CIFAR10_DEMO_STD, resize=resize, interpolation=interpolation)
    mean, std = NORMALIZATION.get(dataset, (None, None))
    return AugmentRecipe(mean=mean, std=std, resize=resize, interpolation=interpolation)


def classifier_recipe(dataset: str, size: int, augment: bool = True, normalization: str = "auto",
                      **policy) -> AugmentRecipe:
    """The classifier's training view; without ``augment`` only the normalisation. ``policy``:
    torchvision's per-sample steps as AugmentRecipe fields (auto_augment, ra_magnitude,
    augmix_severity, random_erase, interpolation), added to the augmented view."""
    plain = eval_recipe(dataset, normalization, interpolation=policy.get("interpolation", "bilinear"))
    if not augment:
        return plain
    if dataset in IMAGE_FILES:
        return replace(plain, crop_scale=IMAGENET_CROP_SCALE, flip=True, **policy)
    # 32 px data: shift by up to an eighth of the side
    return replace(plain, pad_crop=max(1, size // 8), flip=dataset != "digits", **policy)


def moco_recipe(dataset: str, size: int, aug: str, crop_min: float = 0.2, normalization: str = "auto") -> AugmentRecipe:
    """One MoCo view (``aug``: v1, v2 or v2-noblur) at ``size`` px, crops from ``crop_min`` of the area."""
    if aug not in MOCO_AUGS:
        raise ValueError(f"unknown MoCo augmentation {aug!r}; one of {', '.join(MOCO_AUGS)}")
    crop = replace(eval_recipe(dataset, normalization), crop_scale=(crop_min, 1.0), flip=dataset != "digits")
    if dataset == "synthetic":  # Gaussian noise: colour has no meaning there
        return crop
    if aug == "v1":
        return replace(crop, gray_p=0.2, gray_before_jitter=True, jitter=JITTER_V1)
    # about a tenth of the side, odd: 23 px at 224, 5 px at 32
    blur = dict(blur_p=0.5, blur_kernel=2 * max(1, round(0.05 * size)) + 1) if aug == "v2" else {}
    return replace(crop, jitter=JITTER_V2, jitter_p=0.8, gray_p=0.2, **blur)


def augment_on_device(aug_on: str, dataset: str, device: torch.device, per_sample: bool = False) -> bool:
    """``--aug-on``: device, loader, or auto = device, except ImageFolder on a CPU, where the
    DataLoader workers' cores would otherwise sit idle while the training process augments,
    and except a view with steps only the loader runs (``per_sample``:
    :attr:`AugmentRecipe.per_sample_only`)."""
    if aug_on == "auto":
        return not per_sample and (dataset not in IMAGE_FILES or device.type == "cuda")
    return aug_on == "device"
