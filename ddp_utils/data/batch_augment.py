"""An :class:`AugmentRecipe` applied to a whole batch on the training device, with tensor ops:
:class:`BatchAugment` (one view) and :class:`DeviceAugment` (every view of a batch, keyed by
(seed, epoch, index)).

The per-sample torchvision pipeline (``transforms.view_transform``) makes one Python call per op
per image in DataLoader workers, which caps throughput on small images long before a GPU is busy;
here each step runs once per batch, the same code on CPU and CUDA. The steps and their order are
the per-sample pipeline's: crop, colour (torchvision's definitions and ColorJitter's per-sample
random op order), flip, normalisation; the colour steps agree with torchvision to float rounding.
Crops are resized by one ``roi_align`` per view (:func:`crop_from_atlas`, :func:`_resample_boxes`),
an average of bilinear samples close to torchvision's antialiased resize (the bound is tested).

A view is a fixed number of kernels whatever the batch: every random step (jitter, grayscale,
blur, flip) runs on every sample and a per-sample mask (``torch.where``) keeps it where drawn, so
the host never reads a draw and the kernels can be captured (CUDA graph, ``torch.compile``).

Randomness is counter based (``ddp_utils.hashing``, :func:`keyed_uniforms`): each draw is a
hash of (seed, epoch, sample index, column), so a sample gets the same draws whatever batch,
rank or position it lands in. A view takes :data:`VIEW_COLUMNS` columns, a fixed slice per
purpose (crop, jitter, ...); all views of a batch are drawn in one call on the host from the
samples' indices and copied to the device once, where every per-sample parameter (crop boxes,
factors, sigmas, masks) is computed.
"""
from __future__ import annotations

import functools
import importlib.util
import math
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.profiler import record_function

from .. import hashing
from ..runtime.device import memory_format
from .recipes import AugmentRecipe, evaluation_resize

_ATTEMPTS = 10  # torchvision's RandomResizedCrop tries 10 boxes before its centre-crop fallback
# The uniforms of one view: a fixed slice per purpose, so a step left out (photometric_only drops
# the crop) leaves the others' draws as they are. Crop: 10 areas, 10 aspects, 2 offsets; jitter:
# apply, 4 factors, 4 order keys; grayscale: apply; blur: apply, sigma; flip: apply.
CROP_COLUMN, JITTER_COLUMN, GRAY_COLUMN, BLUR_COLUMN, FLIP_COLUMN = 0, 2 * _ATTEMPTS + 2, 2 * _ATTEMPTS + 11, 2 * _ATTEMPTS + 12, 2 * _ATTEMPTS + 14
VIEW_COLUMNS = 2 * _ATTEMPTS + 15
_LUMA = (0.2989, 0.587, 0.114)  # ITU-R 601-2 luma, with torchvision's 0.2989 for red
_HUE_RAMPS = ((3.0, 2.0, 4.0), (1.0, -1.0, -1.0), (-1.0, 2.0, 2.0))  # centre, slope, offset for R, G, B

# Blur taps below this are 0, which changes a blurred value in [0, 1] by less than 1e-10 (an
# ulp of 1/255 is 5e-10); kept, their products through both passes fall below float32's normal
# range (1e-38), and a CPU multiplies such subnormal numbers some 10x slower
TAP_FLOOR = 1e-10
# roi_align (torchvision's CPU and CUDA kernels) indexes its input in 32-bit ints: one call reads
# an input of at most this many elements
ROI_ALIGN_ELEMENTS = 2**31
Draw = Callable[[int, int], Tensor]  # (purpose, count) -> B x count uniforms


def keyed_uniforms(seed: int, epoch: int, index: Tensor, views: int = 1, first_view: int = 0) -> Tensor:
    """B x (views * VIEW_COLUMNS) uniforms of the samples ``index``: views ``first_view`` ...,
    side by side, in one call (one hash of the whole batch instead of one per purpose and view)."""
    return hashing.uniforms(hashing.key(seed, epoch), index, views * VIEW_COLUMNS, first_view * VIEW_COLUMNS)


def _drawer(u: Tensor) -> Draw:
    """One view's uniforms (B x VIEW_COLUMNS) by purpose: ``draw(purpose, count)``."""
    return lambda purpose, count: u[:, purpose:purpose + count]


def _uniform_ints(u: Tensor, high: Tensor | int) -> Tensor:
    """Integers uniform in [0, high] from uniforms ``u`` (like ``torch.randint(0, high + 1)``)."""
    drawn = torch.floor(u * (high + 1)).to(torch.int64)
    return torch.clamp(drawn, max=high)  # u * n may round up to n in float32


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


def _fallback_boxes(height: Tensor, width: Tensor, ratio: tuple[float, float]) -> tuple[Tensor, ...]:
    """:func:`_fallback_box` of B images, each of its own size (int64, B each), in float64 like
    Python's arithmetic there."""
    in_ratio = width.double() / height.double()
    h = torch.where(in_ratio < min(ratio), torch.round(width.double() / min(ratio)).long(), height)
    w = torch.where(in_ratio > max(ratio), torch.round(height.double() * max(ratio)).long(), width)
    return (height - h) // 2, (width - w) // 2, h, w


def resized_crop_boxes(u: Tensor, height: int | Tensor, width: int | Tensor, scale: tuple[float, float],
                        ratio: tuple[float, float]) -> Tensor:
    """``RandomResizedCrop.get_params`` vectorised: B x 4 boxes (top, left, h, w) from B x 22 uniforms,
    for images of one size (``height``, ``width`` ints) or each of its own (int64 tensors, B).

    All 10 attempts are drawn for every sample and the first that fits is kept; the offsets are
    drawn once per sample (torchvision draws them only for the accepted attempt).
    """
    per_sample = torch.is_tensor(height)
    pixels = (height * width).to(torch.float32)[:, None] if per_sample else float(height * width)
    area = pixels * (scale[0] + (scale[1] - scale[0]) * u[:, :_ATTEMPTS])  # B x 10
    lo, hi = math.log(ratio[0]), math.log(ratio[1])
    aspect = torch.exp(lo + (hi - lo) * u[:, _ATTEMPTS:2 * _ATTEMPTS])  # B x 10
    w = torch.round(torch.sqrt(area * aspect)).to(torch.int64)
    h = torch.round(torch.sqrt(area / aspect)).to(torch.int64)
    high_h, high_w = (height[:, None], width[:, None]) if per_sample else (height, width)
    fits = (w > 0) & (w <= high_w) & (h > 0) & (h <= high_h)  # B x 10
    first = fits.to(torch.uint8).argmax(1, keepdim=True)  # argmax returns the first maximum
    found = fits.any(1)  # B
    top0, left0, h0, w0 = _fallback_boxes(height, width, ratio) if per_sample else _fallback_box(height, width, ratio)
    h = torch.where(found, h.gather(1, first).squeeze(1), h0)
    w = torch.where(found, w.gather(1, first).squeeze(1), w0)
    top = torch.where(found, _uniform_ints(u[:, -2], height - h), top0)
    left = torch.where(found, _uniform_ints(u[:, -1], width - w), left0)
    return torch.stack([top, left, h, w], 1)


def centre_boxes(height: Tensor, width: Tensor, out: int, resize: int) -> Tensor:
    """B x 4 float64 boxes (top, left, h, w, in input pixels, fractional) of torchvision's
    Resize(``resize``) (the short side to ``resize``, the long one truncated) then
    CenterCrop(``out``) (offsets rounded half to even) for images of per-sample sizes (int64
    tensors, B): the part of each image those keep, so that resampling the box to out x out
    samples where the resized image's pixels lie."""
    h, w = height.double(), width.double()
    short, long = torch.minimum(h, w), torch.maximum(h, w)
    new_long = torch.floor(resize * long / short)
    new_h = torch.where(h <= w, torch.full_like(h, resize), new_long)
    new_w = torch.where(h <= w, new_long, torch.full_like(w, resize))
    scale_h, scale_w = h / new_h, w / new_w  # input pixels per resized pixel
    top = torch.round((new_h - out) / 2) * scale_h
    left = torch.round((new_w - out) / 2) * scale_w
    return torch.stack([top, left, out * scale_h, out * scale_w], 1)


def crop_from_atlas(tiles: Tensor, places: Tensor, boxes: Tensor, out: int) -> Tensor:
    """B x 3 x out x out float32: each sample's box (``boxes`` B x 4, top, left, h, w in its
    image's pixels) of an atlas's tiles (N x 3 x T x W float32, :func:`atlas_for_resampling`;
    ``places`` B x 4 on its device: where each image lies in the N T x W atlas) resampled by one
    ``roi_align``.

    Each output pixel reads only its sample's image and the one-pixel edge ``files_on_device.pack``
    replicates around it, so a sample's view does not depend on its neighbours. The sampling
    positions are relative to the image's tile, at most T x W (2,048 px a side unless an image is
    wider), so float32 keeps them to 1/8,192 px: a view in a batch is the view alone to within
    that shift (the bound is tested)."""
    tile_rows = tiles.shape[2]
    tile = torch.div(places[:, 0], tile_rows, rounding_mode="floor")  # which tile the image lies in
    boxes = boxes.to(tiles.dtype)
    top = (places[:, 0] - tile * tile_rows).to(tiles.dtype) + boxes[:, 0]
    left = places[:, 1].to(tiles.dtype) + boxes[:, 1]
    rois = torch.stack([tile.to(tiles.dtype), left, top, left + boxes[:, 3], top + boxes[:, 2]], 1)
    return resample_rois(tiles, rois, out)


def resample_rois(x: Tensor, rois: Tensor, out: int) -> Tensor:
    """``roi_align(x, rois)`` resampled to out x out (scale 1, adaptive sampling, aligned): one call
    while ``x`` has at most :data:`ROI_ALIGN_ELEMENTS` elements; beyond, one call per slice of
    ``x`` under that size, each sample kept from the call that holds its image (every call
    resamples every box, its image index clamped into the slice: the op count depends on ``x``'s
    size only, never on the boxes)."""
    per_call = ROI_ALIGN_ELEMENTS // x[0].numel()
    if per_call < 1:
        raise ValueError(f"roi_align: one image of {tuple(x.shape[1:])} is over {ROI_ALIGN_ELEMENTS} elements, "
                         f"which its 32-bit indexing cannot read")
    if len(x) <= per_call:
        return torch.ops.torchvision.roi_align(x, rois, 1.0, out, out, 0, True)
    image = rois[:, 0]
    views = None
    for first in range(0, len(x), per_call):
        part = x[first:first + per_call]
        local = torch.cat([(image - first).clamp(0, len(part) - 1)[:, None], rois[:, 1:]], 1)
        made = torch.ops.torchvision.roi_align(part, local, 1.0, out, out, 0, True)
        inside = ((image >= first) & (image < first + len(part)))[:, None, None, None]
        views = made if views is None else torch.where(inside, made, views)
    return views


def _pad_crop_boxes(u: Tensor, height: int, width: int, pad: int, out: int) -> Tensor:
    """B x 4 windows of ``RandomCrop(out, padding=pad)`` in input coordinates (top may be < 0)."""
    if min(height, width) + 2 * pad < out:
        raise ValueError(f"pad_crop: a {height}x{width} image padded by {pad} is smaller than {out} px")
    top = _uniform_ints(u[:, 0], height + 2 * pad - out) - pad
    left = _uniform_ints(u[:, 1], width + 2 * pad - out) - pad
    side = torch.full_like(top, out)
    return torch.stack([top, left, side, side], 1)


def _resample_boxes(x: Tensor, boxes: Tensor, out: int) -> Tensor:
    """Each sample's box resized to out x out with ``roi_align`` (aligned, adaptive sampling):
    one call for a batch of images of one size.

    With ``sampling_ratio=0`` it averages ceil(box / out) bilinear samples per output pixel and
    axis: upscaling is a bilinear resize with half-pixel centres, downscaling averages the pixels
    covered, close to torchvision's antialiased filter. Unlike torchvision, which crops first,
    output pixels within half a pixel of the box edge read the pixels just outside it. Separable
    resampling matmuls would match torchvision exactly, but CUDA matmuls follow the TF32 switch
    of the fast path; roi_align is a plain float32 kernel.
    """
    top, left, h, w = boxes.to(x.dtype).unbind(1)  # B each
    batch = torch.arange(len(x), device=x.device, dtype=x.dtype)
    rois = torch.stack([batch, left, top, left + w, top + h], 1)  # B x 5: (b, x1, y1, x2, y2)
    return resample_rois(x, rois, out)


@functools.lru_cache(maxsize=None)
def roi_align() -> Callable:
    """torchvision's ``roi_align`` kernel, ``(input, rois, spatial_scale, out_h, out_w,
    sampling_ratio, aligned)``, loaded: :class:`BatchAugment` calls this when made, so that
    its views then find ``torch.ops.torchvision.roi_align`` (and a traced view loads nothing).
    Where torchvision's Python package is not imported yet, only its compiled library is
    loaded: ``import torchvision`` imports torch._dynamo, about 2 s per process, for this one
    operator (the same kernel either way)."""
    if not hasattr(torch.ops.torchvision, "roi_align") and "torchvision" not in sys.modules:
        spec = importlib.util.find_spec("torchvision")
        libraries = sorted(Path(spec.origin).parent.glob("_C*.so")) if spec and spec.origin else []
        for library in libraries:
            try:
                torch.ops.load_library(str(library))
                break
            except (OSError, RuntimeError):
                continue
    try:
        return torch.ops.torchvision.roi_align
    except (AttributeError, RuntimeError):  # no library found beside the package: its own loading
        import torchvision.ops  # noqa: F401

        return torch.ops.torchvision.roi_align


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
def luma(x: Tensor) -> Tensor:
    """B x 1 x H x W luma, the weights and op order of torchvision's ``rgb_to_grayscale``."""
    r, g, b = x.unbind(1)
    return r.mul(_LUMA[0]).add_(g, alpha=_LUMA[1]).add_(b, alpha=_LUMA[2]).unsqueeze(1)


def _per_sample(values: Tensor) -> Tensor:
    return values[:, None, None, None]  # B -> B x 1 x 1 x 1, to broadcast over images


def blend_step_(x: Tensor, op: Tensor, factor: Tensor) -> Tensor:
    """Brightness, contrast or saturation per sample (``op`` 0, 1 or 2; B each), in place.

    Each is torchvision's clamp(factor x + (1 - factor) target, 0, 1) with target 0, the mean of
    the grayscale image, or the grayscale image; a factor of 1 leaves a sample exactly unchanged.
    The mean is taken over columns, then rows, the same order whatever the batch. Three passes
    over ``x`` (grayscale, blend, clamp): the target is made at a third of its size and
    broadcast into the blend.
    """
    gray = luma(x)  # B x 1 x H x W
    mean = gray.mean(3, keepdim=True).mean(2, keepdim=True)  # B x 1 x 1 x 1
    f = _per_sample(factor)
    weight = (1 - f) * _per_sample(op == 2)  # of the grayscale image: saturation only
    offset = (1 - f) * _per_sample(op == 1) * mean  # of its mean: contrast only
    target = torch.addcmul(offset, gray, weight, out=gray)  # (1 - f) x target
    return torch.addcmul(target, x, f, out=x).clamp_(0, 1)


def _hue_sextant(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Hue times 6 in [-1, 5) (B x H x W) and the channel max and min, as torchvision's
    ``_rgb_to_hsv`` (red, then green, then blue wins a tie). In-place ops and ``out=``: on CPU a
    fresh buffer costs page faults that weigh more than the arithmetic."""
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


def shift_hue(x: Tensor, shift: Tensor, out: Tensor | None = None) -> Tensor:
    """torchvision's ``adjust_hue`` with a per-sample shift (B), without building HSV images:
    each channel is min + (max - min) ramp(6 h), with the piecewise-linear hue ramps
    clamp(a |6 h - c| + o, 0, 1), and max and min do not change with the hue. ``out`` may be
    ``x`` itself (read whole before it is written)."""
    sextant, maxc, minc = _hue_sextant(x)  # B x H x W each
    sextant = sextant.add_(6.0 * shift[:, None, None])
    sextant = torch.remainder(sextant, 6.0, out=sextant).unsqueeze(1)  # B x 1 x H x W in [0, 6]
    centre, slope, offset = (_constant(v, x.device, x.dtype).view(1, 3, 1, 1) for v in _HUE_RAMPS)
    ramp = (sextant - centre).abs_()  # B x 3 x H x W
    ramp = torch.addcmul(offset, ramp, slope, out=ramp).clamp_(0.0, 1.0)
    spread = maxc.sub_(minc).unsqueeze(1)
    return torch.addcmul(minc.unsqueeze(1), ramp, spread, out=torch.empty_like(x) if out is None else out)


def jitter_draws(u: Tensor, strengths: tuple[float, float, float, float]) -> tuple[Tensor, Tensor]:
    """Factors (B x 4: brightness, contrast, saturation, hue shift) and op orders (B x 4), drawn
    as ColorJitter draws them; the order is the argsort of four uniforms, a uniform permutation."""
    columns = []
    for i, s in enumerate(strengths):
        lo, hi = (-s, s) if i == 3 else (max(0.0, 1.0 - s), 1.0 + s)
        columns.append(lo + (hi - lo) * u[:, i])
    return torch.stack(columns, 1), u[:, 4:8].argsort(1)


def color_jitter_(x: Tensor, factors: Tensor, order: Tensor, applied: Tensor | None = None,
                  hue: bool = True) -> Tensor:
    """ColorJitter on the samples ``applied`` (B bool; None: every sample), in place, each with
    its own factors and op order (0-3 = B, C, S, H); the other samples come back bit for bit.

    The costly hue op runs once for the whole batch; the three blend ops run in three slots
    before it and three after, each sample using the slots on its side of its hue position and
    passing the others (factor 1, exact).
    """
    hue_at = (order == 3).to(torch.uint8).argmax(1) if hue else torch.full_like(order[:, 0], 3)  # B
    positions = torch.arange(4, device=x.device).expand_as(order)
    rest = order.gather(1, torch.where(order == 3, 4, positions).argsort(1)[:, :3])  # B x 3, hue left out
    for before in (True, False) if hue else (True,):
        for slot in range(3):
            active = (slot < hue_at) if before else (slot >= hue_at)  # B
            if applied is not None:
                active = active & applied
            factor = torch.where(active, factors[:, :3].gather(1, rest[:, slot:slot + 1]).squeeze(1), 1.0)
            x = blend_step_(x, rest[:, slot], factor)
        if before and hue:
            shifted = shift_hue(x, factors[:, 3])
            x = shifted if applied is None else torch.where(_per_sample(applied), shifted, x, out=x)
    return x


def gaussian_blur(x: Tensor, sigma: Tensor, size: int) -> Tensor:
    """torchvision's ``gaussian_blur`` with a per-sample sigma (B): separable, reflect padding,
    each pass one depthwise convolution (a group per sample and channel) with the sample's
    taps. Each output sums its taps in a fixed order, whatever the other samples: a sample
    blurs the same alone and in a batch (tested bit for bit on the CPU)."""
    b, c, h, w = x.shape
    pad = size // 2
    offsets = torch.arange(size, device=x.device, dtype=x.dtype) - pad
    taps = torch.softmax(-0.5 * (offsets / sigma[:, None]) ** 2, dim=1)  # B x size, as torchvision
    taps = F.threshold(taps, TAP_FLOOR, 0.0)  # no subnormal products (TAP_FLOOR)
    taps = taps.repeat_interleave(c, 0)  # (B * C) x size: one group per sample and channel
    padded = F.pad(x, (pad, pad, pad, pad), mode="reflect").view(1, b * c, h + 2 * pad, w + 2 * pad)
    rows = depthwise(padded, taps.view(b * c, 1, 1, size))  # 1 x BC x (H + 2p) x W
    return depthwise(rows, taps.view(b * c, 1, size, 1)).view(b, c, h, w)


def depthwise(x: Tensor, weight: Tensor) -> Tensor:
    """A depthwise convolution (one group per channel). On CUDA it calls PyTorch's own depthwise
    kernel by name (``aten::_conv_depthwise2d``, what ``F.conv2d`` runs when it does not pick
    cuDNN): cuDNN's would follow its TF32 switch and choose its algorithm by the batch's shape,
    and turning cuDNN off around the call would flip a process-wide switch under the training
    thread (the augmentation runs in a thread of its own). The op has no fake kernel, so a traced
    view (torch.compile) keeps ``F.conv2d``."""
    if x.device.type == "cuda" and not torch.compiler.is_compiling():
        return torch.ops.aten._conv_depthwise2d(x, weight, weight.shape[2:], None, (1, 1), (0, 0), (1, 1))
    return F.conv2d(x, weight, groups=x.shape[1])


def pinned_to_device(host: Tensor, device: torch.device) -> Tensor:
    """A small host tensor on ``device`` without a host wait: on CUDA copied from pinned memory,
    made contiguous first (a strided pinned tensor is copied through a pageable temporary)."""
    if host.device.type == "cpu" and device.type == "cuda" and not host.is_pinned():
        host = host.contiguous().pin_memory()
    return host.to(device, non_blocking=True)


def _where_drawn(drawn: Tensor, changed: Tensor, x: Tensor) -> Tensor:
    """``changed`` for the samples ``drawn`` (B bool), ``x`` for the others, written into
    ``changed`` (a buffer of the step's own)."""
    return torch.where(_per_sample(drawn), changed, x, out=changed)


@functools.lru_cache(maxsize=None)
def _constant(values: tuple[float, ...], device: torch.device, dtype: torch.dtype) -> Tensor:
    """A small constant tensor, copied to each device once: a host-to-device copy synchronises."""
    return torch.tensor(values, device=device, dtype=dtype)


# ----------------------------------------------------------------------------- the pipeline
class BatchAugment:
    """``augment(images, seed, epoch, index, view)``: ``images`` B x C x H x W, uint8 (0-255) or
    float (0-1), C 1 or 3; ``index`` the samples' data-set indices (B, int64, on the host);
    ``view`` numbers independent views of a sample (MoCo: query 0, key 1). Returns a new
    B x 3 x out x out float32 batch on the images' device; ``images`` is never modified.
    ``apply(images, u)`` takes the view's uniforms (B x VIEW_COLUMNS, from :func:`keyed_uniforms`,
    on the host or the device) instead.

    A view is a fixed sequence of kernels, whatever the batch's size and draws: no value is read
    back to the host and no shape depends on a draw. The steps are named for a profiler
    (``device_finish/crop``, ``/colour``, ``/blur``, ``/normalize``, the flip counted with the
    normalisation)."""

    def __init__(self, recipe: AugmentRecipe, out_size: int):
        if recipe.per_sample_only:  # the configs send such a recipe to the loader path
            raise ValueError("BatchAugment: automatic augmentation and random erasing run per sample only "
                             "(transforms.view_transform, the loader path)")
        self.recipe, self.out_size = recipe, out_size
        roi_align()  # the crops' kernel, loaded now rather than inside a traced view

    def __call__(self, images: Tensor, seed: int, epoch: int, index: Tensor, view: int = 0) -> Tensor:
        return self.apply(images, keyed_uniforms(seed, epoch, index, first_view=view))

    def apply(self, images: Tensor, u: Tensor, layout: torch.memory_format = torch.contiguous_format) -> Tensor:
        """The view of ``u``'s draws, written in memory format ``layout`` (channels_last for the
        network on CUDA: no copy to re-lay it afterwards)."""
        def crop(draw: Draw) -> Tensor:
            x = self._geometry(as_float_rgb(images), draw)
            return x.clone() if x is images else x  # the steps after it work in place, on a buffer of our own

        return self._view(crop, pinned_to_device(u, images.device), layout)

    def apply_packed(self, atlas: Tensor, places: Tensor, u: Tensor,
                     layout: torch.memory_format = torch.contiguous_format) -> Tensor:
        """:meth:`apply` for images of different sizes packed in one atlas (its tiles, N x 3 x T x W
        float32 in [0, 1], from :func:`atlas_for_resampling`; ``places`` B x 4 int64: top, left, height,
        width, as ``files_on_device.pack`` made them, on the host or the atlas's device): each
        sample's crop drawn for its own size and resampled from its place
        (:func:`crop_from_atlas`). A recipe without a crop gives the evaluation view."""
        r, places = self.recipe, pinned_to_device(places, atlas.device)

        def crop(draw: Draw) -> Tensor:
            height, width = places[:, 2], places[:, 3]
            if r.crop_scale is not None:
                boxes = resized_crop_boxes(draw(CROP_COLUMN, 2 * _ATTEMPTS + 2), height, width, r.crop_scale,
                                           r.crop_ratio)
            else:
                boxes = centre_boxes(height, width, self.out_size, self.eval_resize)
            return crop_from_atlas(atlas, places, boxes, self.out_size)

        return self._view(crop, pinned_to_device(u, atlas.device), layout)

    @property
    def eval_resize(self) -> int:
        """The evaluation view's resize (px of the short side before the centre crop)."""
        return evaluation_resize(self.out_size, self.recipe.resize)

    def crop_boxes(self, height: int, width: int, seed: int, epoch: int, index: Tensor, view: int = 0) -> Tensor:
        """B x 4 int64 (top, left, height, width) of each sample's crop in input pixels; a pad
        crop's window may start above or left of the image; no crop: the whole image."""
        return self._boxes(height, width, _drawer(keyed_uniforms(seed, epoch, index, first_view=view)))

    def _boxes(self, height: int, width: int, draw: Draw) -> Tensor:
        r = self.recipe
        if r.crop_scale is not None:
            return resized_crop_boxes(draw(CROP_COLUMN, 2 * _ATTEMPTS + 2), height, width, r.crop_scale, r.crop_ratio)
        if r.pad_crop:
            return _pad_crop_boxes(draw(CROP_COLUMN, 2), height, width, r.pad_crop, self.out_size)
        zeros = torch.zeros_like(draw(CROP_COLUMN, 1)[:, 0], dtype=torch.int64)  # B, on the device (no host copy)
        return torch.stack([zeros, zeros, zeros + height, zeros + width], 1)

    def _geometry(self, x: Tensor, draw: Draw) -> Tensor:
        """Crop (or pad-and-crop) and resample to out x out; without a crop, only resize if needed."""
        r, (height, width) = self.recipe, x.shape[-2:]
        if r.crop_scale is None and not r.pad_crop and (height, width) == (self.out_size, self.out_size):
            return x
        boxes = self._boxes(height, width, draw)  # B x 4
        if r.pad_crop:
            return _crop_windows(x, boxes, r.pad_crop, self.out_size)
        return _resample_boxes(x, boxes, self.out_size)

    def _view(self, crop: Callable[[Draw], Tensor], u: Tensor, layout: torch.memory_format) -> Tensor:
        """One view: ``crop(draw)`` (the geometry: B x 3 x out x out float32 in [0, 1], a buffer
        the steps below may change in place), then jitter, grayscale and blur in the recipe's
        order, flip and normalisation. ``u``: the view's uniforms (B x VIEW_COLUMNS) on the
        device; each random step runs on every sample and is kept where its draw says."""
        r, draw = self.recipe, _drawer(u)

        def chosen(column: int, p: float) -> Tensor:
            return draw(column, 1)[:, 0] < p  # B bool: the samples that draw the step

        with record_function("device_finish/crop"):
            x = crop(draw)
        with record_function("device_finish/colour"):
            if r.gray_before_jitter:
                x = self._gray_(x, chosen)
            if r.jitter is not None and r.jitter_p > 0:
                factors, order = jitter_draws(draw(JITTER_COLUMN + 1, 8), r.jitter)
                x = color_jitter_(x, factors, order, chosen(JITTER_COLUMN, r.jitter_p), hue=r.jitter[3] > 0)
            if not r.gray_before_jitter:
                x = self._gray_(x, chosen)
        if r.blur_p > 0:
            with record_function("device_finish/blur"):
                lo, hi = r.blur_sigma
                sigma = lo + (hi - lo) * draw(BLUR_COLUMN + 1, 1)[:, 0]
                x = _where_drawn(chosen(BLUR_COLUMN, r.blur_p), gaussian_blur(x, sigma, r.blur_kernel), x)
        with record_function("device_finish/normalize"):
            if r.flip:
                x = _where_drawn(chosen(FLIP_COLUMN, 0.5), x.flip(3), x)
            return normalize(x, r.mean, r.std, layout)

    def _gray_(self, x: Tensor, chosen: Callable[[int, float], Tensor]) -> Tensor:
        if self.recipe.gray_p <= 0:
            return x
        return torch.where(_per_sample(chosen(GRAY_COLUMN, self.recipe.gray_p)), luma(x), x, out=x)


class DeviceAugment:
    """The batched augmentation of ``views`` views of a batch, keyed by (seed, epoch, index),
    written in the network's memory format; ``index`` is on the host, where every view's
    uniforms are drawn in one call (:func:`keyed_uniforms`) and copied to the device once.
    Returns one batch, or a tuple of ``views`` batches."""

    def __init__(self, augment: BatchAugment, seed: int, views: int = 1):
        self.augment, self.seed, self.views = augment, seed, views
        self._atlas = torch.empty(0)  # kept between batches: see packed()

    def __call__(self, images, epoch: int, index: torch.Tensor):
        """The views of ``images``: one batch (every view is drawn from it) or, when DataLoader
        workers already cropped each view, a tuple with one batch per view."""
        sources = images if isinstance(images, (tuple, list)) else [images] * self.views
        device = sources[0].device
        layout = memory_format(device)
        return self._views(epoch, index, device, lambda view, u: self.augment.apply(sources[view], u, layout))

    def packed(self, atlas: torch.Tensor, places: torch.Tensor, epoch: int, index: torch.Tensor):
        """The views of images of different sizes packed in one atlas (H x W x 3 uint8, on the
        device; ``places`` B x 4, on the host): each cropped from its place
        (:meth:`BatchAugment.apply_packed`).

        The atlas is made float32 in one buffer kept for the pass's next batch (on the CPU a fresh
        one would cost a page fault per 4 KiB): 12 bytes per atlas pixel, the pass's largest
        atlas, until :meth:`release`."""
        x = atlas_for_resampling(atlas, buffer=self._kept_atlas)  # N x 3 x T x W, made once for every view
        device, layout = atlas.device, memory_format(atlas.device)
        places = pinned_to_device(places, device)
        return self._views(epoch, index, device, lambda view, u: self.augment.apply_packed(x, places, u, layout))

    def _kept_atlas(self, numel: int, device: torch.device) -> Tensor:
        """The kept float atlas, made anew when this atlas needs more or another device."""
        if self._atlas.device != device or self._atlas.numel() < numel:
            self._atlas = torch.empty(0)  # the old one freed first
            self._atlas = torch.empty(numel, dtype=torch.float32, device=device)
        return self._atlas

    @property
    def atlas_bytes(self) -> int:
        """Bytes of the float atlas kept for the pass (0 once released)."""
        return self._atlas.numel() * self._atlas.element_size()

    def release(self) -> None:
        """Lets the kept float atlas go (a pass has ended): on CUDA its block returns to the caching
        allocator, which can then give it to the training stream when memory runs short."""
        self._atlas = torch.empty(0)

    def _views(self, epoch: int, index: torch.Tensor, device: torch.device, make: Callable[[int, Tensor], Tensor]):
        """``make(view, u)`` for each view, ``u`` its B x VIEW_COLUMNS slice of one call's
        uniforms, copied to ``device`` in one piece."""
        u = pinned_to_device(keyed_uniforms(self.seed, epoch, index, self.views), device)
        views = [make(v, u[:, v * VIEW_COLUMNS:(v + 1) * VIEW_COLUMNS]) for v in range(self.views)]
        return views[0] if self.views == 1 else tuple(views)


def normalize(x: Tensor, mean: tuple[float, ...] | None, std: tuple[float, ...] | None,
              layout: torch.memory_format = torch.contiguous_format) -> Tensor:
    """``(x - mean) / std`` per channel (or ``x`` as it is without ``mean``), in memory format ``layout``."""
    if mean is None:
        return x.contiguous(memory_format=layout)
    scale = _constant(tuple(1 / s for s in std), x.device, x.dtype).view(1, -1, 1, 1)
    shift = _constant(tuple(-m / s for m, s in zip(mean, std)), x.device, x.dtype).view(1, -1, 1, 1)
    return torch.addcmul(shift, x, scale, out=torch.empty_like(x, memory_format=layout))  # one pass


def atlas_for_resampling(atlas: Tensor, buffer: Callable[[int, torch.device], Tensor] | None = None) -> Tensor:
    """The tiles of an H x W x 3 uint8 atlas (``files_on_device.pack``: W x W tiles stacked, the
    last one as tall as its rows) as N x 3 x T x W float32 in [0, 1] (uint8 x 1/255, as
    :func:`as_float_rgb`; T = W, or H for one tile), the input of :meth:`BatchAugment.apply_packed`,
    written into ``buffer(numel, device)`` (1-D float32, at least ``numel`` long) where given.
    Planar, so that each channel's rows read contiguously; the last tile's rows below the atlas
    are left uninitialised (no image lies there)."""
    height, width, _ = atlas.shape
    tile = min(height, width)
    tiles = -(-height // tile)
    last = height - (tiles - 1) * tile
    numel = tiles * 3 * tile * width
    planar = atlas.new_empty(numel, dtype=torch.float32) if buffer is None else buffer(numel, atlas.device)[:numel]
    planar = planar.view(tiles, 3, tile, width)
    whole = (tiles - 1) * tile  # rows of the full tiles: they and the last are two ops, whatever their count
    full, rest = atlas[:whole].view(tiles - 1, tile, width, 3), atlas[whole:]
    for part, rows in ((planar[:-1], full), (planar[-1, :, :last], rest)):
        part.copy_(rows.movedim(-1, -3)).mul_(1 / 255)  # a copy then a multiply: faster than one mul from uint8
    return planar


def as_float_rgb(images: Tensor) -> Tensor:
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
