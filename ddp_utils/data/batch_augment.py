"""Augmentation of a whole batch on the training device, with tensor ops only.

Why: the per-sample torchvision pipelines in ``transforms.py`` run one Python call per op per
image in DataLoader workers, which caps throughput on small images long before the GPU is busy.
Here a batch that is already on the device goes through each step once, as a handful of
vectorised ops; the same code runs on CPU and CUDA tensors (bench/augment.py measures it).

Semantics follow the per-sample pipelines step for step and in the same order: random resized crop
(torchvision's ``RandomResizedCrop.get_params``) or pad-and-crop (``RandomCrop(size, padding=p)``,
zero fill), then photometric (MoCo v1: grayscale then colour jitter; v2: jitter with p, grayscale,
Gaussian blur with p), then horizontal flip, then normalisation. Colour ops use torchvision's
definitions (``adjust_brightness/contrast/saturation/hue``, ``rgb_to_grayscale`` weights,
``GaussianBlur``'s kernel and reflect padding) and ColorJitter's per-sample random op order; they
agree with torchvision to float rounding (tested). The one deliberate difference is resampling,
see :func:`_resample_boxes`; uniforms carry 24 random bits.

Randomness is counter based: every random number is a hash of (seed, epoch, sample index, stream,
column), see :func:`uniforms`. A sample therefore gets the same crop and colours whatever batch,
rank or position it lands in, so a resumed or re-sharded run replays exactly, and there is no
generator state to save. Streams are ``8 * view + purpose``: the two MoCo views and the separate
decisions (crop, jitter, grayscale, blur, flip) are independent, and dropping one step
(:func:`photometric_only` drops the crop) leaves the others' draws unchanged. Pixels, not just
draws, are bit-identical whatever the batch on CPU (tested, 1 and 2 threads). On CUDA the draws
are identical by construction; the contrast step's per-image mean is a reduction whose kernel
configuration may follow the batch size, so a pixel could differ in its last bit (not tested
here: no GPU).

No host synchronisation: every op runs on the whole batch and each sample keeps its own result
(``torch.where`` on per-sample values, ``lerp`` with 0/1 weights, gathers), never ``.item()``,
boolean-mask indexing or ``nonzero``, which would stall a CUDA stream to learn how to split the
batch (tested by running on meta tensors, which have no values to read). The photometric steps
work in place on a buffer the call owns: on CPU a fresh large tensor costs page faults that
often weigh more than the arithmetic.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torchvision.ops import roi_align

__all__ = ["AugmentRecipe", "BatchAugment", "classifier_recipe", "moco_recipe", "photometric_only",
           "sample_crop_boxes", "uniforms"]

# ----------------------------------------------------------------------------- counter-based randomness
_MASK32 = 0xFFFF_FFFF
# Odd multipliers below 2**31: a 32-bit value times one stays below 2**63, so no int64 product
# overflows (signed overflow would be undefined on some backends). Avalanche measured at the
# noise floor of 200k samples for one round; every input word goes through at least two.
_MUL1, _MUL2 = 0x7FEB_352D, 0x6C8E_9CF5
_START = 0x243F_6A88  # arbitrary non-zero start (the first digits of pi)
_ATTEMPTS = 10  # torchvision's RandomResizedCrop tries 10 boxes before its centre-crop fallback
_CROP, _JITTER, _GRAY, _BLUR, _FLIP = range(5)  # purposes; stream = 8 * view + purpose
_LUMA = (0.2989, 0.587, 0.114)  # ITU-R 601-2 luma, with torchvision's 0.2989 for red
_HUE_RAMPS = ((3.0, 2.0, 4.0), (1.0, -1.0, -1.0), (-1.0, 2.0, 2.0))  # centre, slope, offset for R, G, B


def _mix32(h):
    """Bijective 32-bit finaliser (xorshift-multiply rounds as in MurmurHash3's fmix32).

    Works on Python ints and on int64 tensors alike; inputs must be in [0, 2**32)."""
    h = h ^ (h >> 16)
    h = (h * _MUL1) & _MASK32
    h = h ^ (h >> 15)
    h = (h * _MUL2) & _MASK32
    return h ^ (h >> 16)


def _scalar_key(seed: int, epoch: int, stream: int) -> int:
    """The (seed, epoch, stream) part of the hash, folded once on the host (each modulo 2**64)."""
    h = _START
    for word in (seed, seed >> 32, epoch, epoch >> 32, stream, stream >> 32):
        h = _mix32(h ^ (word & _MASK32))
    return h


def uniforms(seed: int, epoch: int, index: Tensor, stream: int, count: int) -> Tensor:
    """B x count float32 uniforms in [0, 1), a pure function of (seed, epoch, index, stream, column).

    ``index`` (B, int64, on any device) holds the samples' data-set indices; row b depends only on
    ``index[b]``, never on the batch around it. The state is 32 bits held in int64 tensors, with
    every intermediate below 2**63 (32-bit values times multipliers below 2**31, masked back to 32
    bits); values carry 24 random bits, so each is an exact float32 multiple of 2**-24.
    """
    idx = index.to(torch.int64)
    h = _mix32((idx & _MASK32) ^ _scalar_key(seed, epoch, stream))  # B
    h = _mix32(h ^ ((idx >> 32) & _MASK32))  # B
    columns = torch.arange(count, dtype=torch.int64, device=idx.device)
    h = _mix32(_mix32(h[:, None] ^ columns))  # B x count: two rounds so neighbouring columns decorrelate
    return (h >> 8).to(torch.float32) * 2.0 ** -24


def _stream(view: int, purpose: int) -> int:
    return 8 * view + purpose


Draw = Callable[[int, int], Tensor]  # (purpose, count) -> B x count uniforms


def _drawer(seed: int, epoch: int, index: Tensor, view: int) -> Draw:
    """The uniforms of one view of these samples, by purpose (crop, jitter, ...)."""
    return lambda purpose, count: uniforms(seed, epoch, index, _stream(view, purpose), count)


def _uniform_ints(u: Tensor, high: Tensor | int) -> Tensor:
    """Integers uniform in [0, high] from uniforms ``u`` (like ``torch.randint(0, high + 1)``)."""
    drawn = torch.floor(u * (high + 1)).to(torch.int64)
    return torch.clamp(drawn, max=high)  # u * n may round up to n in float32


# ----------------------------------------------------------------------------- recipe
@dataclass(frozen=True)
class AugmentRecipe:
    """One augmented view, in the terms of the per-sample torchvision pipelines.

    The geometric step is at most one of ``crop_scale`` (random resized crop with ``crop_ratio``)
    and ``pad_crop`` (zero-pad by that many pixels, then a random window of the output size).
    Photometric steps: ``jitter`` = (brightness, contrast, saturation, hue) strengths applied with
    ``jitter_p``; grayscale with ``gray_p`` (before the jitter if ``gray_before_jitter``, as in
    MoCo v1, else after it, as in v2); Gaussian blur with ``blur_p``, sigma ~ U(``blur_sigma``),
    an odd ``blur_kernel``. Then a horizontal flip with p 0.5 if ``flip``, then ``(x - mean) / std``
    if ``mean`` is set. The defaults do nothing but resize to the output size.
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
        if not all(0.0 <= p <= 1.0 for p in (self.jitter_p, self.gray_p, self.blur_p)):
            raise ValueError("AugmentRecipe: probabilities must lie in [0, 1]")


def photometric_only(recipe: AugmentRecipe) -> AugmentRecipe:
    """``recipe`` without its crop, for data whose crop is done per sample in the DataLoader
    (ImageFolder: decoding needs the full image anyway); flip and normalisation stay."""
    return replace(recipe, crop_scale=None, pad_crop=0)


def moco_recipe(aug: str, size: int, *, crop_min: float = 0.2, flip: bool = True,
                mean: tuple[float, ...] | None = None, std: tuple[float, ...] | None = None) -> AugmentRecipe:
    """The view of ``transforms.moco_view_transform`` (``aug`` "v1", "v2" or "v2-noblur") at ``size``,
    crops from ``crop_min`` of the image area."""
    crop = dict(crop_scale=(crop_min, 1.0), flip=flip, mean=mean, std=std)
    if aug == "v1":
        return AugmentRecipe(**crop, gray_p=0.2, gray_before_jitter=True, jitter=(0.4, 0.4, 0.4, 0.4))
    if aug not in ("v2", "v2-noblur"):
        raise ValueError(f"unknown MoCo augmentation {aug!r}")
    blur = dict(blur_p=0.5, blur_kernel=2 * max(1, round(0.05 * size)) + 1) if aug == "v2" else {}
    return AugmentRecipe(**crop, jitter=(0.4, 0.4, 0.4, 0.1), jitter_p=0.8, gray_p=0.2, **blur)


def classifier_recipe(size: int, *, flip: bool = True, mean: tuple[float, ...] | None = None,
                      std: tuple[float, ...] | None = None) -> AugmentRecipe:
    """The 32 px classifier's training view: ``RandomCrop(size, padding=max(1, size // 8))`` + flip."""
    return AugmentRecipe(pad_crop=max(1, size // 8), flip=flip, mean=mean, std=std)


# ----------------------------------------------------------------------------- geometry
def _fallback_box(height: int, width: int, ratio: tuple[float, float]) -> tuple[int, int, int, int]:
    """torchvision's centre crop when no attempt fits: the whole image, its ratio clamped."""
    in_ratio = width / height
    h, w = height, width
    if in_ratio < min(ratio):
        h = int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        w = int(round(height * max(ratio)))
    return (height - h) // 2, (width - w) // 2, h, w


def sample_crop_boxes(seed: int, epoch: int, index: Tensor, height: int, width: int,
                      scale: tuple[float, float] = (0.08, 1.0), ratio: tuple[float, float] = (3 / 4, 4 / 3),
                      view: int = 0) -> Tensor:
    """B x 4 int64 boxes (top, left, height, width): ``RandomResizedCrop.get_params``, vectorised.

    The boxes a :class:`BatchAugment` with this crop uses for ``view`` of a height x width batch.
    """
    u = uniforms(seed, epoch, index, _stream(view, _CROP), 2 * _ATTEMPTS + 2)
    return _resized_crop_boxes(u, height, width, scale, ratio)


def _resized_crop_boxes(u: Tensor, height: int, width: int, scale: tuple[float, float],
                        ratio: tuple[float, float]) -> Tensor:
    """Random resized crop boxes (B x 4) from B x 22 uniforms.

    All 10 attempts are drawn for every sample (area fraction ~ U(scale), log aspect ratio
    ~ U(log ratio), w = round(sqrt(a r)), h = round(sqrt(a / r))) and the first that fits is kept;
    the offsets, drawn once per sample, are uniform integers, as torchvision draws them only for
    the attempt it accepts. Samples where no attempt fits get the centre-crop fallback.
    """
    area = float(height * width) * (scale[0] + (scale[1] - scale[0]) * u[:, :_ATTEMPTS])  # B x 10
    lo, hi = math.log(ratio[0]), math.log(ratio[1])
    aspect = torch.exp(lo + (hi - lo) * u[:, _ATTEMPTS:2 * _ATTEMPTS])  # B x 10
    w = torch.round(torch.sqrt(area * aspect)).to(torch.int64)
    h = torch.round(torch.sqrt(area / aspect)).to(torch.int64)
    fits = (w > 0) & (w <= width) & (h > 0) & (h <= height)  # B x 10
    first = fits.to(torch.uint8).argmax(1, keepdim=True)  # argmax returns the first maximum
    found = fits.any(1)  # B
    top0, left0, h0, w0 = _fallback_box(height, width, ratio)
    h = torch.where(found, h.gather(1, first).squeeze(1), h0)
    w = torch.where(found, w.gather(1, first).squeeze(1), w0)
    top = torch.where(found, _uniform_ints(u[:, -2], height - h), top0)
    left = torch.where(found, _uniform_ints(u[:, -1], width - w), left0)
    return torch.stack([top, left, h, w], 1)


def _pad_crop_boxes(u: Tensor, height: int, width: int, pad: int, out: int) -> Tensor:
    """B x 4 windows of ``RandomCrop(out, padding=pad)`` in input coordinates (top may be < 0)."""
    if min(height, width) + 2 * pad < out:
        raise ValueError(f"pad_crop: a {height}x{width} image padded by {pad} is smaller than {out} px")
    top = _uniform_ints(u[:, 0], height + 2 * pad - out) - pad
    left = _uniform_ints(u[:, 1], width + 2 * pad - out) - pad
    side = torch.full_like(top, out)
    return torch.stack([top, left, side, side], 1)


def _resample_boxes(x: Tensor, boxes: Tensor, out: int) -> Tensor:
    """Each sample's box resized to out x out with ``roi_align`` (aligned, adaptive sampling).

    Why roi_align: it takes the boxes directly and, with ``sampling_ratio=0``, averages
    ceil(box / out) bilinear samples per output pixel along each axis, so upscaling (or a same-size
    crop) is torchvision's bilinear resize with half-pixel centres and downscaling averages the
    covered pixels, close to torchvision's antialiased triangle filter. grid_sample takes one
    sample per output pixel and aliases when shrinking. The difference from torchvision: output
    pixels whose sample point falls within half a pixel of the box edge read the pixels just
    outside the box, where torchvision, which crops first, repeats the edge pixel. Considered and
    measured: separable resampling matrices (two batched matmuls) match torchvision exactly and
    are faster on CPU, but CUDA matmuls follow the global TF32 switch, which this repository's
    fast path turns on (about 1e-3 error); roi_align is a plain float32 kernel.
    """
    top, left, h, w = boxes.to(x.dtype).unbind(1)  # B each
    batch = torch.arange(len(x), device=x.device, dtype=x.dtype)
    rois = torch.stack([batch, left, top, left + w, top + h], 1)  # B x 5: (b, x1, y1, x2, y2)
    return roi_align(x, rois, output_size=out, spatial_scale=1.0, sampling_ratio=0, aligned=True)


def _crop_windows(x: Tensor, boxes: Tensor, pad: int, out: int) -> Tensor:
    """Integer out x out windows of the zero-padded batch, taken with two gathers (exact copies)."""
    x = F.pad(x, (pad, pad, pad, pad))  # B x C x (H + 2p) x (W + 2p), zero fill
    b, c, _, padded_w = x.shape
    steps = torch.arange(out, device=x.device)
    rows = (boxes[:, 0:1] + pad) + steps  # B x out
    cols = (boxes[:, 1:2] + pad) + steps  # B x out
    x = x.gather(2, rows[:, None, :, None].expand(b, c, out, padded_w))  # B x C x out x (W + 2p)
    return x.gather(3, cols[:, None, None, :].expand(b, c, out, out))  # B x C x out x out


# ----------------------------------------------------------------------------- colour
def _gray(x: Tensor) -> Tensor:
    """B x 1 x H x W luma, the weights and op order of torchvision's ``rgb_to_grayscale``."""
    r, g, b = x.unbind(1)
    return r.mul(_LUMA[0]).add_(g, alpha=_LUMA[1]).add_(b, alpha=_LUMA[2]).unsqueeze(1)


def _per_sample(values: Tensor) -> Tensor:
    return values[:, None, None, None]  # B -> B x 1 x 1 x 1, to broadcast over images


def _blend_step_(x: Tensor, op: Tensor, factor: Tensor) -> Tensor:
    """One of brightness, contrast, saturation per sample (``op`` 0, 1 or 2; B each), in place.

    All three are torchvision's ``_blend(x, target, factor)`` = clamp(factor x + (1 - factor)
    target, 0, 1) with target 0 (brightness), the mean of the grayscale image (contrast) or the
    grayscale image (saturation); a factor of 1 leaves the sample exactly unchanged. The mean is
    taken over columns, then rows, so each sample is reduced in the same order whatever the batch.
    """
    gray = _gray(x)  # B x 1 x H x W
    mean = gray.mean(3, keepdim=True).mean(2, keepdim=True)  # B x 1 x 1 x 1
    f = _per_sample(factor)
    target = gray.mul_(_per_sample(op == 2)).add_(mean * _per_sample(op == 1)).mul_(1 - f)  # B x 1 x H x W
    return x.mul_(f).add_(target).clamp_(0, 1)  # B x 3 x H x W


def _hue_sextant(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Hue times 6 in [-1, 5) (B x H x W), and the channel max and min, as in torchvision's
    ``_rgb_to_hsv`` (red, then green, then blue wins a tie for the maximum). Written with ``out=``
    and in-place ops: on CPU every fresh buffer costs page faults, more than the arithmetic."""
    r, g, b = x.unbind(1)
    maxc = torch.maximum(r, g)
    maxc = torch.maximum(maxc, b, out=maxc)
    minc = torch.minimum(r, g)
    minc = torch.minimum(minc, b, out=minc)
    spread = maxc - minc
    hue = (r - g).add_(spread, alpha=4)  # blue is the maximum
    hue = torch.where(maxc == g, (b - r).add_(spread, alpha=2), hue, out=hue)
    hue = torch.where(maxc == r, g - b, hue, out=hue)
    return hue.div_(spread.masked_fill_(spread == 0, 1.0)), maxc, minc  # grey pixels: hue 0


def _shift_hue(x: Tensor, shift: Tensor) -> Tensor:
    """torchvision's ``adjust_hue`` with a per-sample shift (B), without building HSV images.

    In HSV terms every channel is min + (max - min) ramp(6 h): v (1 - s) = min and v s = max - min,
    and max and min do not change with the hue. The ramps are the usual piecewise-linear hue
    curves, clamp(a |6 h - c| + o, 0, 1): (c, a, o) = (3, 1, -1) for red, (2, -1, 2) green,
    (4, -1, 2) blue, equal to torchvision's sector table up to float rounding.
    """
    sextant, maxc, minc = _hue_sextant(x)  # B x H x W each
    sextant = sextant.add_(6.0 * shift[:, None, None])
    sextant = sextant.sub_(torch.floor(sextant / 6.0).mul_(6.0)).unsqueeze(1)  # B x 1 x H x W in [0, 6]
    centre, slope, offset = (_constant(v, x.device, x.dtype).view(1, 3, 1, 1) for v in _HUE_RAMPS)
    ramp = (sextant - centre).abs_().mul_(slope).add_(offset).clamp_(0.0, 1.0)  # B x 3 x H x W
    return ramp.mul_(maxc.sub_(minc).unsqueeze(1)).add_(minc.unsqueeze(1))


def _jitter_draws(u: Tensor, strengths: tuple[float, float, float, float]) -> tuple[Tensor, Tensor]:
    """Factors (B x 4: brightness, contrast, saturation, hue shift) and op orders (B x 4).

    Factors are U[max(0, 1 - s), 1 + s] (hue: U[-s, s]) as ColorJitter draws them; the order is
    the argsort of four uniforms, a uniformly random permutation like ``torch.randperm(4)``.
    """
    columns = []
    for i, s in enumerate(strengths):
        lo, hi = (-s, s) if i == 3 else (max(0.0, 1.0 - s), 1.0 + s)
        columns.append(lo + (hi - lo) * u[:, i])
    return torch.stack(columns, 1), u[:, 4:8].argsort(1)


def _color_jitter_(x: Tensor, factors: Tensor, order: Tensor, applied: Tensor, hue: bool = True) -> Tensor:
    """ColorJitter, in place, with each sample's factors and op order (0-3 = B, C, S, H) as
    torchvision applies them, on the samples ``applied`` (B bools); the others come out unchanged.

    Hue (the costly op) runs once for the whole batch; the three blend ops run in three slots
    before it and three after, each sample using the slots on its side of its hue position and
    passing the others unchanged (factor 1, exact for values in [0, 1]). Same result as four
    slots that each evaluate all four ops, with one hue conversion instead of four. The random
    order costs about 30% more than one fixed order at 32 px (bench/augment.py), a few percent of
    the whole view, so torchvision's semantics are kept.
    """
    blend = torch.where(applied[:, None], factors[:, :3], 1.0)  # B x 3; 1 = unchanged
    hue_at = (order == 3).to(torch.uint8).argmax(1) if hue else torch.full_like(order[:, 0], 3)  # B
    positions = torch.arange(4, device=x.device).expand_as(order)
    rest = order.gather(1, torch.where(order == 3, 4, positions).argsort(1)[:, :3])  # B x 3, hue left out
    for before in (True, False) if hue else (True,):
        for slot in range(3):
            active = (slot < hue_at) if before else (slot >= hue_at)  # B
            factor = torch.where(active, blend.gather(1, rest[:, slot:slot + 1]).squeeze(1), 1.0)
            x = _blend_step_(x, rest[:, slot], factor)
        if before and hue:
            x = _select_(x, applied, _shift_hue(x, factors[:, 3]))
    return x


def _gaussian_blur(x: Tensor, sigma: Tensor, size: int) -> Tensor:
    """torchvision's ``gaussian_blur`` with a per-sample sigma (B): separable, reflect padding.

    Each pass sums ``size`` shifted slices of the padded batch, each times its per-sample tap
    weight (``addcmul_`` into one buffer), rather than a grouped convolution with one group per
    plane. Measured on one CPU thread at 32 px, the grouped convolution (oneDNN) made the whole
    MoCo v2 view about 25% slower, mostly in buffer allocation and layout reorders; the taps are
    also plain float32 elementwise ops, so no cuDNN algorithm choice or TF32 setting can change a
    sample's pixels with the batch around it. (Padding both axes first and filtering the padded
    rows too equals torchvision's 2-D convolution, since reflection copies whole rows.)
    """
    b, c, h, w = x.shape
    pad = size // 2
    offsets = torch.arange(size, device=x.device, dtype=x.dtype) - pad
    taps = torch.softmax(-0.5 * (offsets / sigma[:, None]) ** 2, dim=1)  # B x size, as torchvision
    taps = taps[:, None, None, None, :]  # B x 1 x 1 x 1 x size
    padded = F.pad(x, (pad, pad, pad, pad), mode="reflect")  # B x 3 x (H + 2p) x (W + 2p)
    rows = padded[..., 0:w] * taps[..., 0]  # B x 3 x (H + 2p) x W
    for i in range(1, size):
        rows.addcmul_(padded[..., i:i + w], taps[..., i])
    out = rows[:, :, 0:h] * taps[..., 0]  # B x 3 x H x W
    for i in range(1, size):
        out.addcmul_(rows[:, :, i:i + h], taps[..., i])
    return out


def _select_(x: Tensor, chosen: Tensor, new: Tensor) -> Tensor:
    """Overwrites the samples ``chosen`` (B bools) of ``x`` with those of ``new``, bit for bit.

    ``torch.lerp`` with a 0/1 weight is an exact selection, because ATen evaluates it from the
    nearer end (w < 0.5: x + w (new - x), else new - (new - x)(1 - w)); on CPU it is several
    times faster than ``torch.where`` with a broadcast condition (tested against it).
    """
    return x.lerp_(new, _per_sample(chosen.to(x.dtype)))


@functools.lru_cache(maxsize=None)
def _constant(values: tuple[float, ...], device: torch.device, dtype: torch.dtype) -> Tensor:
    """A small constant tensor, copied to each device once: a host-to-device copy synchronises."""
    return torch.tensor(values, device=device, dtype=dtype)


# ----------------------------------------------------------------------------- the pipeline
class BatchAugment:
    """Applies an :class:`AugmentRecipe` to a batch on its device; the output is out x out.

    ``augment(images, seed, epoch, index, view)``: ``images`` B x C x H x W, uint8 (0-255) or float
    (0-1), C 1 or 3 (1 is repeated to RGB); ``index`` the samples' data-set indices (B, int64, same
    device); ``view`` numbers independent views of one sample (MoCo's query 0 and key 1). Returns
    a new B x 3 x out x out float32 tensor; ``images`` is never modified.
    """

    def __init__(self, recipe: AugmentRecipe, out_size: int):
        self.recipe, self.out_size = recipe, out_size

    def __call__(self, images: Tensor, seed: int, epoch: int, index: Tensor, view: int = 0) -> Tensor:
        r, draw = self.recipe, _drawer(seed, epoch, index, view)
        x = self._geometry(_as_float_rgb(images), index, draw)  # B x 3 x out x out
        if x is images:
            x = x.clone()  # the steps below work in place, on a buffer of our own
        x = self._photometric_(x, draw)
        if r.flip:
            x = _select_(x, draw(_FLIP, 1)[:, 0] < 0.5, x.flip(3))
        if r.mean is not None:
            mean, std = (_constant(v, x.device, x.dtype).view(1, -1, 1, 1) for v in (r.mean, r.std))
            x = x.sub_(mean).div_(std)
        return x

    def crop_boxes(self, height: int, width: int, seed: int, epoch: int, index: Tensor,
                   view: int = 0) -> Tensor:
        """B x 4 int64 (top, left, height, width) of each sample's crop, in input pixels; a pad crop's
        window may start above or left of the image (its zero padding); no crop: the whole image."""
        return self._boxes(height, width, index, _drawer(seed, epoch, index, view))

    def _boxes(self, height: int, width: int, index: Tensor, draw: Draw) -> Tensor:
        r = self.recipe
        if r.crop_scale is not None:
            u = draw(_CROP, 2 * _ATTEMPTS + 2)
            return _resized_crop_boxes(u, height, width, r.crop_scale, r.crop_ratio)
        if r.pad_crop:
            return _pad_crop_boxes(draw(_CROP, 2), height, width, r.pad_crop, self.out_size)
        zeros = torch.zeros_like(index, dtype=torch.int64)  # B, made on the device (no host copy)
        return torch.stack([zeros, zeros, zeros + height, zeros + width], 1)

    def _geometry(self, x: Tensor, index: Tensor, draw: Draw) -> Tensor:
        """Crop (or pad-and-crop) and resample to out x out; without a crop, only resize if needed."""
        r, (height, width) = self.recipe, x.shape[-2:]
        if r.crop_scale is None and not r.pad_crop and (height, width) == (self.out_size, self.out_size):
            return x
        boxes = self._boxes(height, width, index, draw)  # B x 4
        if r.pad_crop:
            return _crop_windows(x, boxes, r.pad_crop, self.out_size)
        return _resample_boxes(x, boxes, self.out_size)

    def _photometric_(self, x: Tensor, draw: Draw) -> Tensor:
        """Jitter, grayscale and blur in the recipe's order, in place on ``x`` (B x 3 x H x W)."""
        r = self.recipe
        if r.gray_before_jitter:
            x = self._maybe_gray_(x, draw)
        if r.jitter is not None and r.jitter_p > 0:
            u = draw(_JITTER, 9)  # apply, 4 factors, 4 order keys
            factors, order = _jitter_draws(u[:, 1:], r.jitter)
            x = _color_jitter_(x, factors, order, u[:, 0] < r.jitter_p, hue=r.jitter[3] > 0)
        if not r.gray_before_jitter:
            x = self._maybe_gray_(x, draw)
        if r.blur_p > 0:
            u = draw(_BLUR, 2)  # apply, sigma
            lo, hi = r.blur_sigma
            x = _select_(x, u[:, 0] < r.blur_p, _gaussian_blur(x, lo + (hi - lo) * u[:, 1], r.blur_kernel))
        return x

    def _maybe_gray_(self, x: Tensor, draw: Draw) -> Tensor:
        if self.recipe.gray_p <= 0:
            return x
        return _select_(x, draw(_GRAY, 1)[:, 0] < self.recipe.gray_p, _gray(x).expand_as(x))


def _as_float_rgb(images: Tensor) -> Tensor:
    """B x 3 x H x W float32 in [0, 1] (uint8 scaled as torchvision's ``to_dtype(scale=True)``)."""
    if images.dim() != 4 or images.shape[1] not in (1, 3):
        raise ValueError(f"BatchAugment: expected B x C x H x W images with C 1 or 3, got {tuple(images.shape)}")
    if images.dtype == torch.uint8:
        x = images.to(torch.float32).mul_(1.0 / 255)
    elif images.is_floating_point():
        x = images.to(torch.float32)
    else:
        raise TypeError(f"BatchAugment: images must be uint8 or floating point, got {images.dtype}")
    return x.expand(-1, 3, -1, -1).contiguous() if x.shape[1] == 1 else x
