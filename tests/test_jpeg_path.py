"""The JPEG path (ImageFolder): workers decode and pack, the device crops (``--aug-on device``), or
workers only read the bytes and the device decodes (``--decode-on device``, here with the CPU as
the device). Packed batches crop exactly what each image alone gives; the crop boxes keep
torchvision's distribution and are a function of (seed, epoch, index, view) alone; the pixels
agree with torchvision's resized crops to within resampling (the bound below); the device
decoder gets only what it may take, the rest is decoded by the worker, never skipped; both
decoding places give the same batches bit for bit; the loader path's blur is torchvision's."""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms.v2 import functional as TF

from ddp_utils.data.batch_augment import BatchAugment, as_float_rgb, atlas_as_float, draws
from ddp_utils.data.decode import decode_cpu, device_decodable, read_bytes
from ddp_utils.data.image_folder import ImageFiles
from ddp_utils.data.packed import pack, placements, unpack
from ddp_utils.data.pipeline import DataPlan, build_data
from ddp_utils.data.recipes import AugmentRecipe, classifier_recipe, moco_recipe
from ddp_utils.data.transforms import SeparableGaussianBlur

CPU = torch.device("cpu")
# The resampling bound, in levels of 255, at ImageNet's 224 px: roi_align averages bilinear
# samples over each output pixel's footprint where torchvision's antialiased resize weighs them
# with a triangle; measured on these photographs: 0.6 on average, 2.0 at most for one image.
MEAN_BOUND, IMAGE_MEAN_BOUND = 1.0 / 255, 3.0 / 255


def photos(folder: Path, count: int = 24) -> list[torch.Tensor]:
    paths = sorted((folder / "train").glob("n*/train_*.JPEG"))[:count]
    return [decode_cpu(read_bytes(str(p))) for p in paths]


def packed_float(images: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    atlas, places = pack(images)
    return atlas_as_float(atlas), places


# ----------------------------------------------------------------------------- packing
def test_pack_places_every_image_inside_a_border_that_repeats_its_edge():
    g = torch.Generator().manual_seed(0)
    sizes = [(375, 500), (500, 375), (7, 1200), (1, 1), (333, 500), (900, 2100)]
    images = [torch.randint(0, 256, (3, h, w), generator=g, dtype=torch.uint8) for h, w in sizes]
    atlas, places = pack(images)
    assert atlas.shape[2] == 3 and atlas.shape[1] >= 2102 and places.tolist()[5][:2] == [1, 1]  # the tallest first
    for image, back, (top, left, h, w) in zip(images, unpack(atlas, places), places.tolist()):
        assert torch.equal(back, image)
        hwc = image.permute(1, 2, 0)
        assert torch.equal(atlas[top - 1, left:left + w], hwc[0]) and torch.equal(atlas[top + h, left:left + w], hwc[-1])
        assert torch.equal(atlas[top:top + h, left - 1], hwc[:, 0]) and torch.equal(atlas[top:top + h, left + w], hwc[:, -1])
        assert torch.equal(atlas[top - 1, left - 1], hwc[0, 0]) and torch.equal(atlas[top + h, left + w], hwc[-1, -1])
    boxes = [(t - 1, left - 1, h + 2, w + 2) for t, left, h, w in places.tolist()]
    for i, (t, left, h, w) in enumerate(boxes):  # bordered boxes never overlap
        for t2, left2, h2, w2 in boxes[i + 1:]:
            assert t + h <= t2 or t2 + h2 <= t or left + w <= left2 or left2 + w2 <= left


def test_an_atlas_of_imagenet_size_images_wastes_under_a_quarter_of_its_pixels():
    """Rows filled tallest first: the atlas of 256 images of ImageNet's common sizes and a tail
    of larger ones holds under 1.25 x their pixels (rows in the order given: 1.37 x)."""
    g = torch.Generator().manual_seed(0)
    common = [(375, 500), (500, 375), (333, 500), (500, 333), (281, 500), (500, 500), (1200, 1600), (427, 640)]
    sizes = [common[i] for i in torch.randint(0, len(common), (256,), generator=g).tolist()]
    _, height, width = placements(sizes)
    assert height * width < 1.25 * sum(h * w for h, w in sizes)


def test_a_view_cropped_from_the_atlas_is_the_view_of_the_image_alone(jpeg_folder):
    """Random crops (boxes at the image's edges included) and the evaluation view, from packed
    batches, against the same recipe on each image alone (an atlas of one): the border gives
    roi_align at an edge what it reads there alone."""
    images = photos(jpeg_folder, 12)
    x, places = packed_float(images)
    index = torch.arange(len(images))
    for recipe in (AugmentRecipe(crop_scale=(0.9, 1.0), crop_ratio=(0.5, 2.0)), AugmentRecipe()):
        augment = BatchAugment(recipe, 64)
        u = draws(0, 0, index)
        together = augment.apply_packed(x, places, u)
        for i, image in enumerate(images):
            alone, alone_places = packed_float([image])
            torch.testing.assert_close(together[i:i + 1], augment.apply_packed(alone, alone_places, u[i:i + 1]),
                                       rtol=0, atol=1e-6)


def test_a_samples_views_do_not_depend_on_its_place_in_a_batch_of_256_imagenet_size_images():
    """Both MoCo v2 views (colour and blur included, in normalised units) of one image alone and
    last in a batch of 256 ImageNet-size images (an atlas about 20,000 rows tall): within 1e-5.
    With a float32 atlas they are not (positions there are 1/512 px apart): the check can fail."""
    g = torch.Generator().manual_seed(0)
    sizes = [(375, 500), (500, 375), (333, 500), (500, 333), (400, 400), (480, 640)]
    last = torch.randint(0, 256, (3, 375, 500), generator=g, dtype=torch.uint8)  # noise: the steepest edges
    images = [torch.zeros((3, *sizes[i % len(sizes)]), dtype=torch.uint8) for i in range(255)] + [last]
    atlas, places = pack(images)
    assert atlas.shape[0] > 16384  # positions there are 1/512 px apart in float32
    alone_atlas, alone_places = pack([last])
    augment = BatchAugment(moco_recipe("imagefolder", 224, "v2"), 224)
    u = draws(0, 3, torch.tensor([12345]), views=2)
    batch, batch_float32 = atlas_as_float(atlas), as_float_rgb(atlas.permute(2, 0, 1)[None]).contiguous()
    for view in (u[:, :u.shape[1] // 2], u[:, u.shape[1] // 2:]):
        alone = augment.apply_packed(atlas_as_float(alone_atlas), alone_places, view)
        assert (augment.apply_packed(batch, places[-1:], view) - alone).abs().max() <= 1e-5
        assert (augment.apply_packed(batch_float32, places[-1:], view) - alone).abs().max() > 1e-4


# ----------------------------------------------------------------------------- boxes and pixels
def test_crop_boxes_of_images_of_different_sizes_are_those_each_size_draws_alone():
    """Per-sample sizes draw exactly the boxes the one-size path draws (whose distribution the
    KS tests of test_batch_augment.py check against torchvision), bit for bit."""
    augment = BatchAugment(moco_recipe("imagefolder", 224, "v2"), 224)
    index = torch.arange(500)
    heights = torch.tensor([375, 500, 333, 1200, 40] * 100)
    widths = torch.tensor([500, 375, 500, 700, 300] * 100)
    mixed = augment.crop_boxes(heights, widths, seed=3, epoch=2, index=index, view=1)
    for h, w in {(375, 500), (500, 375), (333, 500), (1200, 700), (40, 300)}:
        rows = (heights == h) & (widths == w)
        alone = augment.crop_boxes(h, w, seed=3, epoch=2, index=index[rows], view=1)
        assert torch.equal(mixed[rows], alone), (h, w)
    reversed_batch = augment.crop_boxes(heights.flip(0), widths.flip(0), seed=3, epoch=2, index=index.flip(0), view=1)
    assert torch.equal(reversed_batch.flip(0), mixed)  # a function of (seed, epoch, index, view): not the batch


def test_device_crops_agree_with_torchvisions_resized_crops_within_resampling(jpeg_folder):
    """The same boxes, resampled from the atlas (roi_align) and by torchvision (the worker path
    before: ``resized_crop`` with antialiasing, uint8); and the evaluation view against
    Resize(256) + CenterCrop(224): the mean difference under 1 level of 255, under 3 per image."""
    images = photos(jpeg_folder)
    x, places = packed_float(images)
    index = torch.arange(len(images))
    crop = BatchAugment(AugmentRecipe(crop_scale=(0.08, 1.0)), 224)
    boxes = crop.crop_boxes(places[:, 2], places[:, 3], seed=0, epoch=0, index=index)
    ours = crop.apply_packed(x, places, draws(0, 0, index))
    theirs = torch.stack([TF.resized_crop(image, *box, [224, 224], antialias=True).float() / 255
                          for image, box in zip(images, boxes.tolist())])
    evaluation = BatchAugment(AugmentRecipe(), 224).apply_packed(x, places, draws(0, 0, index))
    reference = torch.stack([TF.center_crop(TF.resize(image, 256, antialias=True), 224).float() / 255
                             for image in images])
    for a, b in ((ours, theirs), (evaluation, reference)):
        difference = (a - b).abs()
        assert difference.mean() < MEAN_BOUND and difference.mean((1, 2, 3)).max() < IMAGE_MEAN_BOUND


# ----------------------------------------------------------------------------- decoding
def _jpeg(image: Image.Image, **options) -> torch.Tensor:
    buffer = io.BytesIO()
    image.save(buffer, format=options.pop("format", "JPEG"), **options)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def test_the_device_decoder_is_given_only_whole_baseline_colour_jpegs(jpeg_folder):
    photo = Image.open(sorted((jpeg_folder / "train").glob("n*/train_*.JPEG"))[0]).convert("RGB")
    baseline = _jpeg(photo, quality=90)
    assert device_decodable(baseline)
    not_for_it = {"progressive": _jpeg(photo, quality=90, progressive=True), "cmyk": _jpeg(photo.convert("CMYK")),
                  "grayscale": _jpeg(photo.convert("L")), "png": _jpeg(photo, format="PNG"),
                  "truncated": baseline[: len(baseline) // 2], "trailing bytes": torch.cat([baseline, baseline[:7]]),
                  "empty": baseline[:0]}
    assert {name for name, data in not_for_it.items() if device_decodable(data)} == set()
    encoded = ImageFiles(str(jpeg_folder / "train")).reading("encoded")
    kinds = {Path(path).name: encoded[i][0].dim() for i, (path, _) in enumerate(encoded.samples)}
    assert kinds["odd_cmyk.JPEG"] == kinds["odd_gray.JPEG"] == kinds["odd_png.JPEG"] == 3  # decoded by the worker
    assert {dim for name, dim in kinds.items() if name.startswith("train_")} == {1}  # bytes, for the device


@pytest.mark.parametrize("views", [1, 2])
def test_decoding_on_the_device_gives_the_workers_batches_bit_for_bit(jpeg_folder, tmp_path, views):
    """With the CPU as the device, --decode-on device runs the device path's own code (the batch
    decoded by the training process, then packed): training, evaluation and kNN-bank batches
    equal those of workers that decode, the CMYK, grayscale and PNG files among them."""
    recipe = moco_recipe("imagefolder", 32, "v2") if views == 2 else classifier_recipe("imagefolder", 32)

    def batches(decode_on_device: bool) -> list:
        plan = DataPlan(dataset="imagefolder", data_dir=str(jpeg_folder), image_size=32, synthetic_samples=0,
                        debug=False, seed=0, batch_size=13, workers=1, normalization="auto", recipe=recipe,
                        views=views, aug_on_device=True, decode_on_device=decode_on_device, bank_samples=0)
        loaders = build_data(plan, rank=0, world_size=1, device=CPU)
        loaders.set_epoch(1)
        return [*loaders.train, *loaders.val, *loaders.bank]

    workers, device = batches(False), batches(True)
    assert len(workers) == len(device) == 3 + 1 + 1
    for (a, y), (b, z) in zip(workers, device):
        assert torch.equal(y, z)
        for x1, x2 in zip(a if isinstance(a, tuple) else [a], b if isinstance(b, tuple) else [b]):
            assert torch.equal(x1, x2)


def test_the_workers_decode_as_pil_does(jpeg_folder):
    """torchvision's decoder (the device path's workers) and PIL (the loader path) give the same
    pixels, the odd files included."""
    for path, _ in ImageFiles(str(jpeg_folder / "train")).samples:
        pil = torch.from_numpy(np.array(Image.open(path).convert("RGB"))).permute(2, 0, 1)
        assert torch.equal(decode_cpu(read_bytes(path)), pil), path


# ----------------------------------------------------------------------------- the loader path
@pytest.mark.parametrize("kernel, side", [(3, 16), (5, 32), (23, 224)])
def test_the_loader_paths_blur_is_torchvisions(kernel, side):
    """Two 1-D passes for torchvision's 2-D Gaussian: the same sigma drawn from the same RNG, the
    same values to float rounding."""
    from torchvision.transforms import v2 as T

    image = torch.rand(3, side, side, generator=torch.Generator().manual_seed(side))
    torch.manual_seed(7)
    ours = SeparableGaussianBlur(kernel, (0.1, 2.0))(image)
    after_ours = torch.rand(1)
    torch.manual_seed(7)
    theirs = T.GaussianBlur(kernel, sigma=(0.1, 2.0))(image)
    assert torch.equal(torch.rand(1), after_ours)  # one draw each
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)


def test_the_loader_paths_colour_jitter_is_torchvisions():
    """torchvision's ColorJitter with the hue shift in closed form: the same draws and order from
    the same RNG, the same values to float rounding, on plain tensors and torchvision Images."""
    from torchvision import tv_tensors
    from torchvision.transforms import v2 as T

    from ddp_utils.data.transforms import ColorJitterFastHue

    g = torch.Generator().manual_seed(1)
    for image in (torch.rand(3, 40, 56, generator=g), tv_tensors.Image(torch.rand(3, 32, 32, generator=g))):
        for seed in range(20):
            torch.manual_seed(seed)
            ours = ColorJitterFastHue(0.4, 0.4, 0.4, 0.4)(image)
            torch.manual_seed(seed)
            theirs = T.ColorJitter(0.4, 0.4, 0.4, 0.4)(image)
            torch.testing.assert_close(torch.as_tensor(ours), torch.as_tensor(theirs), rtol=0, atol=1e-5)
