"""Batched device augmentation (ddp_utils/data/batch_augment.py) against torchvision, per sample,
and the per-sample pipelines built from the same recipes (ddp_utils/data/recipes.py).

Every test is deterministic (fixed seeds). Statistical tolerances are sized so that a correct
implementation would fail with probability below about 1e-4 on a fresh seed (each comment gives
the arithmetic), while the mistakes they guard against (a wrong range, a missing or reordered
step, a biased choice) move the statistic many times further.
"""
from __future__ import annotations

import math
import re
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torchvision import transforms as T1
from torchvision.transforms import v2 as T
from torchvision.transforms.v2 import functional as TF

from bench.augment import KernelCounter
from ddp_utils import hashing
from ddp_utils.data import batch_augment as ba
from ddp_utils.data.batch_augment import BatchAugment, DeviceAugment
from ddp_utils.data.recipes import AugmentRecipe, classifier_recipe, moco_recipe

# Two-sample Kolmogorov-Smirnov: P(D > c sqrt((n + m) / (n m))) <= 2 exp(-2 c^2), which is 1e-4
# at c = sqrt(ln(2e4) / 2) = 2.23 (conservative for the discrete distributions compared here).
KS_C = math.sqrt(math.log(2e4) / 2)
BINOMIAL_SDS = 5  # |count - n p| <= 5 sd: a correct rate fails with probability 6e-7
COMPILED_ROUND_OFF = 1e-5  # compiled against eager views: a few float32 steps of normalised values (std ~0.22)


@pytest.fixture(autouse=True)
def one_thread():
    """The per-sample torchvision references run thousands of tiny ops, for which a thread pool
    only adds overhead (8x here on a busy 2-core machine); the batched side does not need it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def uniforms(seed: int, epoch: int, index: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """The batched module's uniforms: columns ``first`` .. of (seed, epoch)'s hash."""
    return hashing.uniforms(hashing.key(seed, epoch), index, count, first)


def _moco(aug: str, size: int, mean=None, std=None) -> AugmentRecipe:
    """A MoCo view of colour images (flipped), with the given normalisation (none by default)."""
    return replace(moco_recipe("cifar10", size, aug), mean=mean, std=std)


def _pad_crop(size: int, flip: bool = True) -> AugmentRecipe:
    """The classifier's 32 px view without normalisation (flipped unless digits)."""
    return replace(classifier_recipe("cifar10" if flip else "digits", size), mean=None, std=None)


def _crop_boxes(index: torch.Tensor, height: int, width: int, scale, ratio=(3 / 4, 4 / 3)) -> torch.Tensor:
    return BatchAugment(AugmentRecipe(crop_scale=scale, crop_ratio=ratio), 8).crop_boxes(height, width, 0, 0, index)


def ks_statistic(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().sort().values, b.double().sort().values
    grid = torch.cat([a, b])
    cdf_a = torch.searchsorted(a, grid, right=True) / len(a)
    cdf_b = torch.searchsorted(b, grid, right=True) / len(b)
    return float((cdf_a - cdf_b).abs().max())


def ks_limit(n: int, m: int) -> float:
    return KS_C * math.sqrt((n + m) / (n * m))


def assert_binomial(count: int, n: int, p: float) -> None:
    sd = math.sqrt(n * p * (1 - p))
    assert abs(count - n * p) <= BINOMIAL_SDS * sd, f"{count} of {n}, expected {n * p:.0f} +- {sd:.1f}"


def colour_images(n: int, size: int, seed: int = 0) -> torch.Tensor:
    """n x 3 x size x size uint8 images with smooth colour gradients (saturated, no flat channel)."""
    g = torch.Generator().manual_seed(seed)
    coarse = torch.rand(n, 3, 4, 4, generator=g)
    return (torch.nn.functional.interpolate(coarse, size=(size, size), mode="bilinear") * 255).to(torch.uint8)


def as_float(images: torch.Tensor) -> torch.Tensor:
    return TF.to_dtype(images, torch.float32, scale=True)


def all_equal_channels(x: torch.Tensor) -> torch.Tensor:
    return (x[:, 0] == x[:, 1]).flatten(1).all(1) & (x[:, 1] == x[:, 2]).flatten(1).all(1)  # B


# ----------------------------------------------------------------------------- counter-based uniforms
def test_uniforms_are_a_pure_function_of_their_counters():
    index = torch.tensor([0, 5, 2**33 + 7, 123456789, 5])
    u = uniforms(7, 3, index, first=2, count=6)
    assert u.shape == (5, 6) and u.dtype == torch.float32
    assert (u >= 0).all() and (u < 1).all()
    assert torch.equal(u[1], u[4])  # same sample, same numbers
    assert torch.equal(uniforms(7, 3, index[[3, 1]], 2, 6), u[[3, 1]])  # whatever the batch
    assert torch.equal(uniforms(7, 3, index, 2, 3), u[:, :3])  # columns do not depend on count
    assert torch.equal(uniforms(7, 3, index, 0, 8)[:, 2:], u)  # nor on where the call starts
    for other in (uniforms(8, 3, index, 2, 6), uniforms(7, 4, index, 2, 6), uniforms(7, 3, index, 3, 6),
                  uniforms(-7, 3, index, 2, 6), uniforms(7 + 2**32, 3, index, 2, 6)):
        assert not torch.isclose(other, u).any()
    assert not torch.isclose(uniforms(7, 3, index + 2**32, 2, 6), u).any()  # the high index word counts


def test_uniforms_look_uniform_and_independent():
    n, count = 4096, 64
    u = uniforms(0, 0, torch.arange(n), first=0, count=count).double()  # n x count
    values = u.flatten()
    # Mean of N uniforms: sd 1/sqrt(12 N), 6e-4 here; 5 sd.
    assert abs(values.mean() - 0.5) < 5 / math.sqrt(12 * len(values))
    # 16 equal bins: chi-square with 15 degrees of freedom exceeds 60 with probability 2e-7.
    counts = torch.bincount((values * 16).long(), minlength=16).double()
    expected = len(values) / 16
    assert ((counts - expected) ** 2 / expected).sum() < 60

    def corr(a: torch.Tensor, b: torch.Tensor) -> float:
        a, b = a.flatten() - a.mean(), b.flatten() - b.mean()
        return float((a * b).sum() / (a.norm() * b.norm()))

    # A correlation of m independent pairs has sd 1/sqrt(m); 5 sd for each comparison.
    other_columns = uniforms(0, 0, torch.arange(n), first=count, count=count).double()
    other_epoch = uniforms(0, 1, torch.arange(n), first=0, count=count).double()
    for a, b in [(u[:, :-1], u[:, 1:]),  # neighbouring columns
                 (u[:-1], u[1:]),  # neighbouring indices
                 (u, other_columns), (u, other_epoch)]:
        assert abs(corr(a, b)) < 5 / math.sqrt(a.numel()), (a.shape, corr(a, b))


def test_runs_without_reading_values_on_the_device():
    """Images (and an atlas) on the meta device, indices on the host: any .item(), .tolist(),
    nonzero or boolean-mask index of a device tensor raises, so a pass here means the pipeline
    never synchronises a CUDA stream to read a value back. The batch of 64 makes every random
    step draw some samples and not others."""
    images = torch.empty(64, 3, 32, 32, dtype=torch.uint8, device="meta")
    index = torch.arange(64)
    u = ba.keyed_uniforms(0, 0, index)
    for column, p in ((ba.JITTER_COLUMN, 0.8), (ba.GRAY_COLUMN, 0.2), (ba.BLUR_COLUMN, 0.5), (ba.FLIP_COLUMN, 0.5)):
        assert 0 < int((u[:, column] < p).sum()) < 64
    for recipe, size in [(_moco("v2", 16, mean=(0.5,) * 3, std=(0.2,) * 3), 16),
                         (_moco("v1", 32), 32), (_pad_crop(32), 32)]:
        out = BatchAugment(recipe, size)(images, seed=0, epoch=0, index=index)
        assert out.device.type == "meta" and out.shape == (64, 3, size, size)
    atlas, places = _meta_atlas(64)
    for views in DeviceAugment(BatchAugment(moco_recipe("imagefolder", 224, "v2"), 224), seed=0, views=2).packed(
            atlas, places, 0, index):
        assert views.device.type == "meta" and views.shape == (64, 3, 224, 224)


def _meta_atlas(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A packed batch of ImageNet-like sizes, its atlas on the meta device (no pixels)."""
    from ddp_utils.data.files_on_device import placements

    sizes = [(375, 500), (500, 375), (333, 500), (1200, 800), (64, 48)]
    places, height, width = placements([sizes[i % len(sizes)] for i in range(batch)])
    return torch.empty(height, width, 3, dtype=torch.uint8, device="meta"), torch.tensor(places)


def test_a_batchs_views_are_a_fixed_number_of_kernels_whatever_its_size():
    """Both MoCo v2 views of packed ImageNet-like batches of 32 to 512 images (meta device: the
    ops a GPU would launch, without the arithmetic): the same count at every size, and no more
    than the 1,170 of 8719b0f's augmentation (one roi_align per view, before the exact crops)."""
    augment = DeviceAugment(BatchAugment(moco_recipe("imagefolder", 224, "v2"), 224), seed=0, views=2)
    counts = []
    for batch in (32, 128, 512):
        atlas, places = _meta_atlas(batch)
        with KernelCounter() as counter:
            augment.packed(atlas, places, 0, torch.arange(batch))
        counts.append(counter.kernels)
    assert max(counts) == min(counts) <= 1170, counts


@pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")  # cached constants: traced through
def test_the_packed_augmentation_is_one_graph_that_torch_compile_captures_whole():
    """The device side of a packed batch (atlas to float, every view from its uniforms) traced
    by torch.compile with fullgraph=True (a graph break or a data-dependent host read raises),
    its results eager's to float32 round-off (bit for bit on torch 2.14; 1.4e-6 apart on 2.11,
    whose trace rewrites an op or two). A CUDA graph needs the same of the GPU's kernels:
    bench/augment_capture.py probes it there."""
    import torch._dynamo

    augment = BatchAugment(moco_recipe("imagefolder", 64, "v2"), 64)
    g = torch.Generator().manual_seed(0)
    images = [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g) for h, w in ((40, 50), (70, 30), (33, 33))]
    from ddp_utils.data.files_on_device import pack

    def views(atlas, places, u):
        x = ba.atlas_for_resampling(atlas)
        return [augment.apply_packed(x, places, u[:, v * ba.VIEW_COLUMNS:(v + 1) * ba.VIEW_COLUMNS]) for v in (0, 1)]

    torch._dynamo.reset()
    captured = torch.compile(views, fullgraph=True, backend="eager", dynamic=False)
    atlas, places = pack(images)
    u = ba.keyed_uniforms(0, 0, torch.arange(len(images)), views=2)
    for ours, eager in zip(captured(atlas, places, u), views(atlas, places, u), strict=True):
        assert (ours - eager).abs().max() <= COMPILED_ROUND_OFF


# ----------------------------------------------------------------------------- the pipeline
def test_shapes_dtype_range_and_input_types():
    images = colour_images(8, 32)
    augment = BatchAugment(_moco("v2", 16), 16)  # no normalisation: values stay in [0, 1]
    index = torch.arange(100, 108)
    out = augment(images, seed=1, epoch=2, index=index)
    assert out.shape == (8, 3, 16, 16) and out.dtype == torch.float32
    assert out.min() >= 0 and out.max() <= 1
    floats = as_float(images)
    kept = floats.clone()
    assert torch.equal(augment(floats, seed=1, epoch=2, index=index), out)  # uint8 == scaled float
    assert torch.equal(floats, kept)  # the input is left alone
    gray = images[:, :1]
    assert torch.equal(augment(gray, 1, 2, index), augment(gray.expand(-1, 3, -1, -1), 1, 2, index))
    normalised = BatchAugment(_moco("v2", 16, mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.3)), 16)
    mean = torch.tensor([0.5, 0.4, 0.3]).view(1, 3, 1, 1)
    std = torch.tensor([0.2, 0.25, 0.3]).view(1, 3, 1, 1)
    torch.testing.assert_close(normalised(images, 1, 2, index), (out - mean) / std)
    identity = BatchAugment(AugmentRecipe(), 32)(floats, 1, 2, index)
    assert torch.equal(identity, floats) and identity is not floats
    with pytest.raises(ValueError):
        augment(images[:, :2], 1, 2, index)


@pytest.mark.parametrize("fields", [dict(crop_scale=(0.2, 1.0), pad_crop=4), dict(blur_kernel=4),
                                    dict(mean=(0.5,) * 3), dict(jitter=(0.4, 0.4, 0.4, 0.6)),
                                    dict(gray_p=1.5), dict(pad_crop=-1)])
def test_recipe_rejects_contradictions(fields):
    with pytest.raises(ValueError):
        AugmentRecipe(**fields)


@pytest.mark.parametrize("threads", [1, 2])  # thread count changes how ops split the work
@pytest.mark.parametrize("recipe, out", [(_moco("v2", 16, mean=(0.5,) * 3, std=(0.2,) * 3), 16),
                                         (_moco("v1", 32), 32), (_pad_crop(32), 32)])
def test_a_sample_gets_the_same_pixels_whatever_its_batch(recipe, out, threads):
    torch.set_num_threads(threads)  # the autouse fixture restores the count afterwards
    images, index = colour_images(12, 32), torch.arange(40, 52)
    augment = BatchAugment(recipe, out)
    full = augment(images, seed=3, epoch=5, index=index)
    order = torch.randperm(12, generator=torch.Generator().manual_seed(0))
    assert torch.equal(augment(images[order], 3, 5, index[order]), full[order])  # shuffled
    assert torch.equal(augment(images[7:10], 3, 5, index[7:10]), full[7:10])  # another batch size
    assert torch.equal(augment(images[4:5], 3, 5, index[4:5]), full[4:5])  # alone
    # Another epoch, view, seed or index redraws: every sample changes, except that a pad-crop
    # (9 x 9 offsets x flip: 162 outcomes) may repeat by chance for a sample or two.
    allowed_repeats = 2 if recipe.pad_crop else 0
    for other in (augment(images, 3, 6, index), augment(images, 3, 5, index, view=1),
                  augment(images, 4, 5, index), augment(images, 3, 5, index + 1000)):
        assert sum(torch.equal(a, b) for a, b in zip(other, full)) <= allowed_repeats


# ----------------------------------------------------------------------------- geometry
@pytest.mark.parametrize("height, width", [(24, 40), (10, 100)])  # the second mostly falls back
def test_crop_boxes_follow_torchvision_distribution(height, width):
    n, scale, ratio = 4000, (0.08, 1.0), (3 / 4, 4 / 3)
    ours = _crop_boxes(torch.arange(n), height, width, scale, ratio).double()  # n x 4
    image = torch.empty(3, height, width)
    with torch.random.fork_rng():  # torchvision draws from the global generator
        torch.manual_seed(0)
        theirs = [T1.RandomResizedCrop.get_params(image, scale, ratio) for _ in range(n)]
    theirs = torch.tensor(theirs).double()
    assert (ours[:, :2] >= 0).all() and (ours[:, 2:] >= 1).all()
    assert (ours[:, 0] + ours[:, 2] <= height).all() and (ours[:, 1] + ours[:, 3] <= width).all()
    limit = ks_limit(n, n)  # 0.050 for 4000 against 4000
    for name, stat in [("area", lambda b: b[:, 2] * b[:, 3]), ("aspect", lambda b: b[:, 3] / b[:, 2]),
                       ("top", lambda b: b[:, 0] / (height - b[:, 2] + 1)),
                       ("left", lambda b: b[:, 1] / (width - b[:, 3] + 1))]:
        assert ks_statistic(stat(ours), stat(theirs)) < limit, name


def test_crop_boxes_take_the_first_attempt_that_fits_else_the_centre():
    """On a 24 x 40 image: attempt 0 (the whole area, ratio 3/4) is 36 px tall and does not fit,
    attempt 1 (the smallest area, ratio 1) gives 9 x 9, later ones 23 x 23; with no attempt that
    fits, torchvision's fallback is the centre 24 x 32 (the ratio clamped to 4/3)."""
    u = torch.full((2, 22), 0.5)
    u[:, [0, 10]] = torch.tensor([0.999, 0.0])  # attempt 0: area fraction ~1, log ratio at its minimum
    u[0, [1, 11]] = torch.tensor([0.0, 0.5])  # attempt 1: area fraction 0.08, ratio 1
    u[1, 1:10], u[1, 11:20] = 0.999, 0.0  # sample 1: every attempt is too tall
    boxes = ba.resized_crop_boxes(u, 24, 40, (0.08, 1.0), (3 / 4, 4 / 3))
    assert boxes.tolist() == [[8, 16, 9, 9], [0, 4, 24, 32]]  # offsets: floor(0.5 * (24 - 9 + 1)), ...


def test_resized_crops_are_torchvision_bilinear_inside_the_box():
    """roi_align with aligned boxes is torchvision's bilinear resize wherever the sample point lies
    inside the box; at the box edge it reads the pixels just outside (torchvision clamps)."""
    images = as_float(colour_images(64, 32))
    index = torch.arange(64)
    augment = BatchAugment(AugmentRecipe(crop_scale=(0.2, 1.0)), 32)
    out = augment(images, seed=0, epoch=0, index=index)
    boxes = augment.crop_boxes(32, 32, seed=0, epoch=0, index=index)
    assert torch.equal(boxes, _crop_boxes(index, 32, 32, (0.2, 1.0)))
    steps = torch.arange(32) + 0.5
    for image, result, (top, left, h, w) in zip(images, out, boxes.tolist()):
        expected = TF.resized_crop(image, top, left, h, w, [32, 32], antialias=True)
        rows = ((steps * h / 32 - 0.5) >= 0) & ((steps * h / 32 - 0.5) <= h - 1)  # sample inside the box
        cols = ((steps * w / 32 - 0.5) >= 0) & ((steps * w / 32 - 0.5) <= w - 1)
        inside = result[:, rows][:, :, cols], expected[:, rows][:, :, cols]
        torch.testing.assert_close(*inside, atol=1e-5, rtol=0)
    whole = BatchAugment(AugmentRecipe(), 48)(images[:4], 0, 0, index[:4])  # no crop: a plain resize
    torch.testing.assert_close(whole, TF.resize(images[:4], [48, 48], antialias=True), atol=1e-5, rtol=0)
    smaller = BatchAugment(AugmentRecipe(), 16)(images[:4], 0, 0, index[:4])  # 2x2 box average
    torch.testing.assert_close(smaller, torch.nn.functional.avg_pool2d(images[:4], 2), atol=1e-6, rtol=0)


def test_pad_crop_offsets_are_uniform_and_windows_exact():
    n, pad = 4000, 4
    augment = BatchAugment(_pad_crop(32, flip=False), 32)
    assert augment.recipe.pad_crop == pad
    boxes = augment.crop_boxes(32, 32, seed=0, epoch=0, index=torch.arange(n))
    assert (boxes[:, 2:] == 32).all()
    for offsets in (boxes[:, 0] + pad, boxes[:, 1] + pad):
        counts = torch.bincount(offsets, minlength=2 * pad + 1)
        assert len(counts) == 2 * pad + 1  # nothing beyond 0..2p
        for count in counts.tolist():
            assert_binomial(count, n, 1 / (2 * pad + 1))
    images = as_float(colour_images(16, 32))
    out = augment(images, 0, 0, torch.arange(16))
    for image, result, (top, left, _, _) in zip(images, out, boxes[:16].tolist()):
        expected = TF.crop(TF.pad(image, [pad]), top + pad, left + pad, 32, 32)  # zero fill
        assert torch.equal(result, expected)


# ----------------------------------------------------------------------------- colour
def test_colour_ops_match_torchvision_per_sample():
    x = as_float(colour_images(16, 12))
    g = torch.Generator().manual_seed(1)
    factors = 1.5 * torch.rand(16, generator=g)
    shifts = torch.rand(16, generator=g) - 0.5
    sigmas = 0.1 + 1.9 * torch.rand(16, generator=g)
    for op, fn in enumerate([TF.adjust_brightness, TF.adjust_contrast, TF.adjust_saturation]):
        ours = ba.blend_step_(x.clone(), torch.full((16,), op), factors)
        theirs = torch.stack([fn(image, float(f)) for image, f in zip(x, factors)])
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)
    theirs = torch.stack([TF.adjust_hue(image, float(s)) for image, s in zip(x, shifts)])
    torch.testing.assert_close(ba.shift_hue(x, shifts), theirs, atol=1e-5, rtol=0)
    theirs = torch.stack([TF.gaussian_blur(image, [5, 5], [float(s)] * 2) for image, s in zip(x, sigmas)])
    torch.testing.assert_close(ba.gaussian_blur(x, sigmas, 5), theirs, atol=1e-6, rtol=0)
    assert torch.equal(ba.luma(x), TF.rgb_to_grayscale(x))


def test_colour_jitter_applies_each_samples_ops_in_its_own_order():
    x = as_float(colour_images(48, 8))
    u = uniforms(0, 0, torch.arange(48), 0, 8)
    factors, order = ba.jitter_draws(u, (0.4, 0.4, 0.4, 0.1))
    assert len(set(map(tuple, order.tolist()))) > 12  # many of the 24 orders occur
    applied = torch.arange(48) % 4 != 0
    ours = ba.color_jitter_(x.clone(), factors, order, applied)
    ops = [TF.adjust_brightness, TF.adjust_contrast, TF.adjust_saturation, TF.adjust_hue]
    for image, result, f, sequence, on in zip(x, ours, factors, order.tolist(), applied.tolist()):
        expected = image
        for op in sequence if on else []:
            expected = ops[op](expected, float(f[op]))
        if on:
            torch.testing.assert_close(result, expected, atol=1e-5, rtol=0)
        else:
            assert torch.equal(result, image)  # not applied: bit for bit unchanged


@pytest.mark.parametrize("step", ["grayscale", "blur", "flip"])
def test_a_random_step_changes_the_samples_that_draw_it_and_leaves_the_others_bit_for_bit(step):
    """Each random step runs on the whole batch and is kept by a per-sample mask: against the
    same recipe without the step, the samples that do not draw it are unchanged bit for bit,
    and those that do are the step applied to that sample alone."""
    bare = AugmentRecipe(flip=False, mean=None, std=None)
    recipe = {"grayscale": replace(bare, gray_p=0.5), "blur": replace(bare, blur_p=0.5, blur_kernel=5),
              "flip": replace(bare, flip=True)}[step]
    column = {"grayscale": ba.GRAY_COLUMN, "blur": ba.BLUR_COLUMN, "flip": ba.FLIP_COLUMN}[step]
    images, index = colour_images(64, 16), torch.arange(64)
    u = ba.keyed_uniforms(0, 0, index)
    drawn = u[:, column] < 0.5
    assert 0 < int(drawn.sum()) < 64
    before = BatchAugment(bare, 16).apply(images, u)
    after = BatchAugment(recipe, 16).apply(images, u)
    assert torch.equal(after[~drawn], before[~drawn])
    lo, hi = recipe.blur_sigma
    alone = {"grayscale": lambda x, i: ba.luma(x).expand_as(x), "flip": lambda x, i: x.flip(3),
             "blur": lambda x, i: ba.gaussian_blur(x, lo + (hi - lo) * u[i, column + 1:column + 2], 5)}[step]
    for i in drawn.nonzero().squeeze(1).tolist():
        assert torch.equal(after[i:i + 1], alone(before[i:i + 1], i))


def test_colour_jitter_matches_torchvision_distribution():
    """Per-sample change of mean brightness and of mean HSV saturation, ours against ColorJitter
    run image by image on the same images; both the means (5 standard errors) and the whole
    distributions (KS) must agree."""
    n, strengths = 2000, (0.4, 0.4, 0.4, 0.1)
    images = as_float(colour_images(n, 8, seed=3))
    ours = BatchAugment(AugmentRecipe(jitter=strengths), 8)(images, 0, 0, torch.arange(n))
    jitter = T.ColorJitter(*strengths)
    with torch.random.fork_rng():  # torchvision draws from the global generator
        torch.manual_seed(0)
        theirs = torch.stack([jitter(image) for image in images])

    def saturation(x):
        top, bottom = x.amax(1), x.amin(1)
        return torch.where(top > 0, (top - bottom) / top.clamp(min=1e-12), 0).mean((1, 2))

    for name, stat in [("brightness", lambda x: x.mean((1, 2, 3))), ("saturation", saturation)]:
        a, b = stat(ours) - stat(images), stat(theirs) - stat(images)
        standard_error = math.sqrt(a.var() / n + b.var() / n)
        assert abs(a.mean() - b.mean()) < 5 * standard_error, name
        assert ks_statistic(a, b) < ks_limit(n, n), name  # 0.070 for 2000 against 2000


def test_probabilities_of_jitter_grayscale_blur_and_flip():
    # 20,000 samples: 5 sd of a rate near 0.2 is 1.4 percentage points, so a rate off by 2 fails.
    n = 20_000
    images = as_float(colour_images(n, 8, seed=5))
    index = torch.arange(n)

    def changed(recipe):
        return ~(BatchAugment(recipe, 8)(images, 0, 0, index) == images).flatten(1).all(1)

    assert_binomial(int(changed(AugmentRecipe(jitter=(0.4, 0.4, 0.4, 0.1), jitter_p=0.8)).sum()), n, 0.8)
    # sigma >= 1 so every blur shows (below ~0.2 the neighbours' weights vanish in float32)
    blur = AugmentRecipe(blur_p=0.5, blur_sigma=(1.0, 2.0), blur_kernel=3)
    assert_binomial(int(changed(blur).sum()), n, 0.5)
    flipped = BatchAugment(AugmentRecipe(flip=True), 8)(images, 0, 0, index)
    mirrored = (flipped == images.flip(3)).flatten(1).all(1)
    assert torch.equal(mirrored, ~(flipped == images).flatten(1).all(1))  # flipped xor unchanged
    assert_binomial(int(mirrored.sum()), n, 0.5)
    for aug in ("v1", "v2"):  # in the full pipelines: no later step mixes the channels again
        out = BatchAugment(_moco(aug, 8), 8)(images, 0, 0, index)
        assert_binomial(int(all_equal_channels(out).sum()), n, 0.2)


def test_blur_sigma_is_drawn_uniformly_from_its_range():
    """The pipeline blurs with sigma = lo + (hi - lo) u, u the blur stream's second column."""
    images, index = as_float(colour_images(32, 8)), torch.arange(32)
    recipe = AugmentRecipe(blur_p=1.0, blur_sigma=(0.3, 1.7), blur_kernel=5)
    u = ba.keyed_uniforms(2, 1, index, first_view=1)[:, ba.BLUR_COLUMN:ba.BLUR_COLUMN + 2]
    expected = ba.gaussian_blur(images, 0.3 + 1.4 * u[:, 1], 5)
    assert torch.equal(BatchAugment(recipe, 8)(images, seed=2, epoch=1, index=index, view=1), expected)


def test_every_view_of_a_batch_is_drawn_in_one_call(monkeypatch):
    """DeviceAugment hashes the whole batch once for both MoCo views, and gives each view what
    BatchAugment draws for that view alone."""
    from ddp_utils.data.batch_augment import DeviceAugment

    images, index = colour_images(16, 32), torch.arange(100, 116)
    augment = BatchAugment(_moco("v2", 16, mean=(0.5,) * 3, std=(0.2,) * 3), 16)
    calls = []
    real = hashing.uniforms
    monkeypatch.setattr(hashing, "uniforms", lambda *a, **k: calls.append(1) or real(*a, **k))
    query, key = DeviceAugment(augment, seed=3, views=2)(images, 5, index)
    assert len(calls) == 1
    assert torch.equal(query, augment(images, 3, 5, index, view=0))
    assert torch.equal(key, augment(images, 3, 5, index, view=1))
    assert not torch.equal(query, key)


def test_grayscale_runs_before_or_after_the_jitter_as_the_recipe_says():
    images, index = as_float(colour_images(16, 8)), torch.arange(16)
    jitter = AugmentRecipe(jitter=(0.4, 0.4, 0.4, 0.4))
    jittered = BatchAugment(jitter, 8)(images, 0, 0, index)
    after = BatchAugment(AugmentRecipe(jitter=jitter.jitter, gray_p=1.0), 8)(images, 0, 0, index)
    assert torch.equal(after, ba.luma(jittered).expand_as(jittered))  # v2: grayscale of the jittered
    before = BatchAugment(AugmentRecipe(jitter=jitter.jitter, gray_p=1.0, gray_before_jitter=True), 8)
    gray = ba.luma(images).expand_as(images).contiguous()
    assert torch.equal(before(images, 0, 0, index), BatchAugment(jitter, 8)(gray, 0, 0, index))  # v1


# ----------------------------------------------------------------------------- recipes
def _steps(compose: T.Compose) -> list[str]:
    """The per-sample pipeline's steps by name, with what a RandomApply wraps and its p."""
    names = []
    for step in compose.transforms:
        if isinstance(step, T.RandomApply):
            names.append(f"{type(step.transforms[0]).__name__}(p={step.p})")
        else:
            names.append(type(step).__name__)
    return names


@pytest.mark.parametrize("aug, colour, blur", [
    ("v1", ["RandomGrayscale", "ColorJitterFastHue"], []),
    ("v2", ["ColorJitterFastHue(p=0.8)", "RandomGrayscale"], ["SeparableGaussianBlur(p=0.5)"]),
    ("v2-noblur", ["ColorJitterFastHue(p=0.8)", "RandomGrayscale"], []),
])
def test_the_per_sample_pipeline_takes_the_recipes_steps_in_its_order(aug, colour, blur):
    from ddp_utils.data.transforms import view_transform

    recipe = moco_recipe("cifar10", 32, aug, crop_min=0.08)
    pipeline = view_transform(recipe, "cifar10", 32)
    assert _steps(pipeline) == ["ToImage", "RandomResizedCrop", "ToDtype", *colour, *blur, "RandomHorizontalFlip",
                                "Normalize", "ToPureTensor"]
    crop = pipeline.transforms[1]
    assert crop.scale == (0.08, 1.0) and crop.ratio == recipe.crop_ratio
    digits = view_transform(moco_recipe("digits", 16, aug), "digits", 16)  # float tensors, never flipped
    assert _steps(digits) == ["RandomResizedCrop", *colour, *blur, "Normalize", "ToPureTensor"]
    noise = view_transform(moco_recipe("synthetic", 16, aug), "synthetic", 16)  # no colour, no normalisation
    assert _steps(noise) == ["RandomResizedCrop", "RandomHorizontalFlip", "ToPureTensor"]


def test_the_classifier_recipes_and_their_pipelines():
    from ddp_utils.data.transforms import view_transform

    cifar = classifier_recipe("cifar10", 32)
    assert (cifar.pad_crop, cifar.flip, cifar.crop_scale) == (4, True, None)
    # no colour step: the flip right after the crop, torchvision's order (the same pixels and draws)
    assert _steps(view_transform(cifar, "cifar10", 32)) == ["ToImage", "RandomCrop", "RandomHorizontalFlip",
                                                             "ToDtype", "Normalize", "ToPureTensor"]
    resized = view_transform(classifier_recipe("cifar10", 48), "cifar10", 48)  # resized to 48, then padded by 6
    assert _steps(resized)[1:3] == ["Resize", "RandomCrop"] and resized.transforms[2].padding == [6, 6, 6, 6]
    assert not classifier_recipe("digits", 32).flip
    imagenet = classifier_recipe("imagefolder", 224)
    assert imagenet.crop_scale == (0.08, 1.0) and imagenet.flip
    plain = view_transform(classifier_recipe("cifar10", 32, augment=False), "cifar10", 32)
    assert _steps(plain) == ["ToImage", "ToDtype", "Normalize", "ToPureTensor"]  # the evaluation pipeline


# ----------------------------------------------------------------------------- what a GPU run would show
SWITCHES = re.compile(r"torch\.backends\.|set_flush_denormal|use_deterministic_algorithms|set_float32_matmul_precision|"
                      r"set_num_threads")


def test_the_data_path_touches_no_process_wide_switch():
    """The device augmentation runs in a thread of its own beside the training thread: no module
    under ddp_utils/data/ reads or flips a process-wide switch (cuDNN's flags, TF32, determinism);
    the blur calls the CUDA depthwise kernel by name instead of turning cuDNN off around
    F.conv2d, and that kernel exists in this torch."""
    data = Path(ba.__file__).parent
    touching = {path.name: SWITCHES.findall(path.read_text()) for path in sorted(data.glob("*.py"))}
    assert {name: found for name, found in touching.items() if found} == {}
    assert torch._C._dispatch_has_kernel_for_dispatch_key("aten::_conv_depthwise2d", "CUDA")


def test_a_thread_augmenting_leaves_the_switches_as_the_training_thread_set_them():
    """The training thread sets cuDNN's switches away from their defaults; a thread then makes
    packed batches' MoCo v2 views (blur included) while the training thread reads the switches
    over and over: every read, and the switches afterwards, are as set."""
    from ddp_utils.data.files_on_device import pack

    cudnn = torch.backends.cudnn
    kept = (cudnn.enabled, cudnn.benchmark, cudnn.deterministic, cudnn.allow_tf32)
    g = torch.Generator().manual_seed(0)
    images = [torch.randint(0, 256, (3, 60, 80), dtype=torch.uint8, generator=g) for _ in range(8)]
    atlas, places = pack(images)
    augment = DeviceAugment(BatchAugment(replace(moco_recipe("imagefolder", 48, "v2"), blur_p=1.0), 48), seed=0,
                            views=2)
    try:
        cudnn.benchmark, cudnn.deterministic, cudnn.allow_tf32 = True, True, False
        wanted = (cudnn.enabled, True, True, False)
        done, seen = threading.Event(), set()
        worker = threading.Thread(target=lambda: [augment.packed(atlas, places, e, torch.arange(8)) for e in range(3)]
                                  and done.set())
        worker.start()
        while not done.is_set() and worker.is_alive():
            seen.add((cudnn.enabled, cudnn.benchmark, cudnn.deterministic, cudnn.allow_tf32))
        worker.join()
        assert done.is_set() and seen <= {wanted}
        assert (cudnn.enabled, cudnn.benchmark, cudnn.deterministic, cudnn.allow_tf32) == wanted
    finally:
        cudnn.enabled, cudnn.benchmark, cudnn.deterministic, cudnn.allow_tf32 = kept


def test_roi_align_is_called_on_slices_its_32_bit_index_can_read():
    """torchvision's roi_align indexes its input in 32-bit ints: an atlas of tiles over
    ROI_ALIGN_ELEMENTS is resampled one slice of tiles at a time (every box in each call, kept
    from the call holding its image), bit for bit the one-call result; the op count depends on
    the atlas's size only. At the real bound, 170 tiles of 2,048 x 2,048 are one call and 171
    two (meta tensors)."""
    g = torch.Generator().manual_seed(0)
    tiles = torch.rand(5, 3, 40, 64, generator=g)
    places = torch.tensor([[1 + 40 * t, 3 + 2 * t, 30, 50] for t in (4, 0, 2, 3, 1, 4, 2)])
    boxes = torch.tensor([[2.0, 5.0, 20.0, 31.0], [0.0, 0.0, 30.0, 50.0], [3.5, 1.25, 12.0, 9.0]] * 2 + [[1.0] * 4])
    whole = ba.crop_from_atlas(tiles, places, boxes, 16)
    calls = []
    real = torch.ops.torchvision.roi_align

    def counting(*args):
        calls.append(len(args[0]))
        return real(*args)

    for per_call, expected in ((5, [5]), (2, [2, 2, 1]), (1, [1] * 5)):
        calls.clear()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(ba, "ROI_ALIGN_ELEMENTS", per_call * 3 * 40 * 64)
            patch.setattr(torch.ops.torchvision, "roi_align", counting)
            assert torch.equal(ba.crop_from_atlas(tiles, places, boxes, 16), whole)
        assert calls == expected
    side = 2048
    for count, expected in ((170, 1), (171, 2)):
        meta = torch.empty(count, 3, side, side, device="meta")
        rois = torch.zeros(4, 5, device="meta")
        with KernelCounter() as counter:
            ba.resample_rois(meta, rois, 8)
        assert counter.kernels >= expected and (counter.kernels == 1) == (expected == 1), (count, counter.kernels)
    with pytest.raises(ValueError, match="32-bit"):
        ba.resample_rois(torch.empty(1, 3, 30_000, 30_000, device="meta"), torch.zeros(1, 5, device="meta"), 8)
