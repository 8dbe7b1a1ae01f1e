"""Per-sample torchvision pipelines, run in DataLoader workers on the loader path: a view built
from an :class:`AugmentRecipe` (a training view, or the evaluation view of
``recipes.eval_recipe``), the reference for the batched path.

Order of a view: decode (files), geometry on the decoded image, to float, colour (jitter,
grayscale), blur, flip, normalisation; the batched path (``batch_augment``) takes the same steps
in the same order. A view without colour or blur flips right after the geometry (the same
pixels and draws: the conversion to float draws nothing), which is torchvision's classification
order (references/classification/presets.py): crop, flip, automatic augmentation on the 8-bit
image, to float, normalisation, random erasing; the last two steps and the automatic
augmentation only run here (``AugmentRecipe.per_sample_only``). Nothing here comes from the batched path: its hue shift and blur are
written here on their own, and each is tested against torchvision's.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torchvision.transforms import v2 as T

from .recipes import AugmentRecipe, evaluation_resize
from .sets import FROM_FILES, IMAGE_FILES


def _decode(dataset: str) -> list:
    return [T.ToImage()] if dataset in FROM_FILES else []  # PIL -> uint8 tensor


def _to_float(dataset: str) -> list:
    return [T.ToDtype(torch.float32, scale=True)] if dataset in FROM_FILES else []


def _normalize(recipe: AugmentRecipe) -> list:
    return [] if recipe.mean is None else [T.Normalize(recipe.mean, recipe.std)]


def _fixed_geometry(dataset: str, size: int, resize: int = 0, interpolation: str = "bilinear") -> list:
    """Evaluation geometry: ImageFolder resized (the short side to ``resize`` px, 0: the 256/224
    rule) and centre-cropped; CIFAR-10 resized if asked for another size; digits and synthetic
    images are generated at ``size`` already."""
    if dataset in IMAGE_FILES:
        return [T.Resize(evaluation_resize(size, resize), T.InterpolationMode(interpolation), antialias=True),
                T.CenterCrop(size)]
    return [T.Resize(size, antialias=True)] if dataset == "cifar10" and size != 32 else []


def _geometry(recipe: AugmentRecipe, dataset: str, size: int) -> list:
    if recipe.crop_scale is not None:
        return [T.RandomResizedCrop(size, scale=recipe.crop_scale, ratio=recipe.crop_ratio,
                                    interpolation=T.InterpolationMode(recipe.interpolation), antialias=True)]
    if recipe.pad_crop:
        return _fixed_geometry(dataset, size) + [T.RandomCrop(size, padding=recipe.pad_crop)]
    return _fixed_geometry(dataset, size, recipe.resize, recipe.interpolation)


def auto_augment(recipe: AugmentRecipe) -> list:
    """``recipe.auto_augment`` as torchvision's class, with the recipe's interpolation, as its
    classification recipe passes it (bilinear by default; the classes' own default is nearest)."""
    name, mode = recipe.auto_augment, T.InterpolationMode(recipe.interpolation)
    if not name:
        return []
    if name == "ra":
        return [T.RandAugment(magnitude=recipe.ra_magnitude, interpolation=mode)]
    if name == "ta_wide":
        return [T.TrivialAugmentWide(interpolation=mode)]
    if name == "augmix":
        return [T.AugMix(severity=recipe.augmix_severity, interpolation=mode)]
    return [T.AutoAugment(T.AutoAugmentPolicy(name), interpolation=mode)]


def _erase(recipe: AugmentRecipe) -> list:
    """torchvision's RandomErasing (its area, aspect and zero fill) on the normalised tensor."""
    return [T.RandomErasing(p=recipe.random_erase)] if recipe.random_erase > 0 else []


def _maybe(p: float, step) -> object:
    return step if p == 1 else T.RandomApply([step], p=p)


def _colour(recipe: AugmentRecipe) -> list:
    """Jitter and grayscale, in the recipe's order."""
    gray = [T.RandomGrayscale(p=recipe.gray_p)] if recipe.gray_p > 0 else []
    steps = list(gray) if recipe.gray_before_jitter else []
    if recipe.jitter is not None and recipe.jitter_p > 0:
        steps.append(_maybe(recipe.jitter_p, ColorJitterFastHue(*recipe.jitter)))
    return steps + ([] if recipe.gray_before_jitter else gray)


def _blur(recipe: AugmentRecipe) -> list:
    return [_maybe(recipe.blur_p, SeparableGaussianBlur(recipe.blur_kernel, recipe.blur_sigma))] \
        if recipe.blur_p > 0 else []


class ColorJitterFastHue(T.ColorJitter):
    """torchvision's ColorJitter on float tensors (its draws from the global RNG, its random
    order, its brightness, contrast and saturation kernels) with the hue shift in closed form
    (:func:`shifted_hue`: torchvision's ``adjust_hue`` to float rounding, in a third of its time)."""

    def transform(self, inpt, params):
        output = inpt
        for fn_id in params["fn_idx"].tolist():
            if fn_id == 3 and params["hue_factor"] is not None:
                output = shifted_hue(output, params["hue_factor"])
            else:
                output = super().transform(output, {**params, "fn_idx": [fn_id]})
        return output


def shifted_hue(image: torch.Tensor, shift: float) -> torch.Tensor:
    """torchvision's ``adjust_hue`` of a float C x H x W image in [0, 1] without HSV images. The
    hue h in [0, 1) as torchvision's ``_rgb_to_hsv`` gets it (red, then green, then blue wins a
    tie; grey pixels 0), moved by ``shift``; each channel is then min + (max - min) x its ramp of
    6 h, clamp(|6 h - c| - 1, 0, 1) for red (c = 3) and clamp(2 - |6 h - c|, 0, 1) for green
    (c = 2) and blue (c = 4): max and min do not change with the hue."""
    r, g, b = image.unbind(-3)
    maxc = torch.maximum(torch.maximum(r, g), b)
    minc = torch.minimum(torch.minimum(r, g), b)
    spread = maxc - minc
    six_h = torch.where(maxc == r, g - b, torch.where(maxc == g, (b - r) + 2 * spread, (r - g) + 4 * spread))
    six_h = six_h / torch.where(spread == 0, 1.0, spread)
    six_h = torch.remainder(six_h + 6 * torch.tensor(shift), 6.0)  # the shift rounded to float32 first
    ramps = torch.stack([(six_h - 3).abs() - 1, 2 - (six_h - 2).abs(), 2 - (six_h - 4).abs()], -3).clamp(0, 1)
    return torch.addcmul(minc.unsqueeze(-3), ramps, spread.unsqueeze(-3))


class SeparableGaussianBlur:
    """torchvision's GaussianBlur on a float C x H x W tensor (its sigma draw from the global RNG,
    its 1-D kernel, reflect padding) computed in two 1-D passes: 2k multiply-adds per pixel
    instead of k x k (for the 23-tap kernel at 224 px, a tenth of the work). Its taps are
    torchvision's own formula, bit for bit. The batched path's ``gaussian_blur`` computes a row of
    taps per sample in another order of float operations: one tap function for both would move
    one path's pixels in the last bit, and tie this reference to the path it checks."""

    def __init__(self, kernel_size: int, sigma: tuple[float, float]):
        self.kernel_size, self.sigma = kernel_size, sigma

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        sigma = torch.empty(1).uniform_(self.sigma[0], self.sigma[1]).item()  # as T.GaussianBlur draws it
        k, (height, width) = self.kernel_size, image.shape[-2:]
        half = (k - 1) / (2.0 * math.sqrt(2.0))
        taps = torch.softmax(torch.linspace(-half, half, k, dtype=image.dtype).div(sigma).pow(2).neg(), dim=0).tolist()
        padded = F.pad(image.reshape(-1, *image.shape[-3:]), (k // 2,) * 4, mode="reflect")
        rows = padded[..., 0:width] * taps[0]  # the horizontal pass: a weighted sum of shifted columns
        for i in range(1, k):
            rows.add_(padded[..., i:i + width], alpha=taps[i])
        out = rows[..., 0:height, :] * taps[0]  # then the vertical one
        for i in range(1, k):
            out.add_(rows[..., i:i + height, :], alpha=taps[i])
        return out.reshape(image.shape)


def view_transform(recipe: AugmentRecipe, dataset: str, size: int) -> T.Compose:
    """One view of one sample, as ``recipe`` says (the evaluation view: ``recipes.eval_recipe``,
    resize, centre crop and normalisation): torchvision's transforms, the hue shift and the blur
    computed faster (:class:`ColorJitterFastHue`, :class:`SeparableGaussianBlur`: the same values
    to float rounding). The automatic augmentation needs 8-bit images (``FROM_FILES``): a
    ValueError for the float tensors of the other data sets."""
    if recipe.auto_augment and dataset not in FROM_FILES:
        raise ValueError(f"auto_augment {recipe.auto_augment!r} needs 8-bit images ({', '.join(FROM_FILES)}); "
                         f"{dataset}'s are float tensors")
    flip = [T.RandomHorizontalFlip()] if recipe.flip else []
    colour = _colour(recipe) + _blur(recipe)
    early, late = (flip, []) if not colour else ([], flip)  # torchvision's order where nothing is between them
    return T.Compose(_decode(dataset) + _geometry(recipe, dataset, size) + early + auto_augment(recipe)
                     + _to_float(dataset) + colour + late + _normalize(recipe) + _erase(recipe) + [T.ToPureTensor()])


class TwoCrops:
    """Two independent augmentations of one image: MoCo's query view and key view."""

    def __init__(self, transform: Callable):
        self.transform = transform

    def __call__(self, image):
        return self.transform(image), self.transform(image)
