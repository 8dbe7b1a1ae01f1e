"""The JPEG path (ImageFolder): workers decode and pack, the device crops (``--aug-on device``), or
workers only read the bytes and the device decodes (``--decode-on device``, here with the CPU as
the device). Packed batches crop what each image alone gives, to float32 round-off; the crop boxes keep
torchvision's distribution and are a function of (seed, epoch, index, view) alone; the pixels
are close to torchvision's resized crops (a bound in levels of 255); the device
decoder gets only what it may take, the rest is decoded by the worker, never skipped; both
decoding places give the same batches bit for bit; the loader path's blur is torchvision's."""
from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torchvision.transforms.v2 import functional as TF

from ddp_utils.data import files_on_device
from ddp_utils.data.batch_augment import (
    BatchAugment,
    DeviceAugment,
    as_float_rgb,
    atlas_for_resampling,
    keyed_uniforms,
)
from ddp_utils.data.files_on_device import (
    EncodedBatch,
    PackedImages,
    SharedBuffers,
    collate_files,
    decode_on,
    pack,
    pack_gathered,
    placements,
    unpack,
)
from ddp_utils.data.host_memory import KEPT_PER_WORKER
from ddp_utils.data.image_files import FolderListing, ImageFiles, decode_cpu, device_decodable, read_bytes
from ddp_utils.data.pipeline import DataPlan, build_data
from ddp_utils.data.recipes import AugmentRecipe, classifier_recipe, moco_recipe
from ddp_utils.data.transforms import SeparableGaussianBlur

CPU = torch.device("cpu")


def photos(folder: Path, count: int = 24) -> list[torch.Tensor]:
    paths = sorted((folder / "train").glob("n*/train_*.JPEG"))[:count]
    return [decode_cpu(read_bytes(str(p))) for p in paths]


def packed_float(images: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    atlas, places = pack(images)
    return atlas_for_resampling(atlas), places


def same_to_the_place_shift(ours: torch.Tensor, alone: torch.Tensor) -> None:
    """A view from a batch against the same view alone, both resampled in float32 at positions
    relative to their tile (under 2,048 px: kept to 1/8,192 px): at most 1e-3 apart at the
    normalised range (1/16 of a grey level of 255), 1e-4 on average. Measured on noise (the
    steepest edges) last in a batch of 256: at most 8e-4, mean at most 8e-5; on photographs 1e-6."""
    difference = (ours - alone).abs()
    assert difference.max() <= 1e-3 and difference.mean() <= 1e-4


# ----------------------------------------------------------------------------- packing
def test_pack_places_every_image_whole_and_apart_with_its_edge_repeated_around_it():
    g = torch.Generator().manual_seed(0)
    sizes = [(375, 500), (500, 375), (7, 1200), (1, 1), (333, 500), (900, 2100)]
    images = [torch.randint(0, 256, (3, h, w), generator=g, dtype=torch.uint8) for h, w in sizes]
    atlas, places = pack(images)
    assert atlas.shape[2] == 3 and atlas.shape[1] >= 2102 and places.tolist()[5][:2] == [1, 1]  # the tallest first
    for image, back in zip(images, unpack(atlas, places)):
        assert torch.equal(back, image)
    boxes = places.tolist()
    for i, (t, left, h, w) in enumerate(boxes):
        framed = atlas[t - 1:t + h + 1, left - 1:left + w + 1].permute(2, 0, 1)  # the image and its edge
        assert torch.equal(framed, F.pad(images[i][None].float(), (1, 1, 1, 1), mode="replicate")[0].byte())
        assert t >= 1 and left >= 1 and t + h + 1 <= atlas.shape[0] and left + w + 1 <= atlas.shape[1]
        for t2, left2, h2, w2 in boxes[i + 1:]:  # images and their edges never overlap
            assert t + h + 1 <= t2 - 1 or t2 + h2 + 1 <= t - 1 or left + w + 1 <= left2 - 1 or left2 + w2 + 1 <= left - 1


def test_packing_where_the_images_are_is_a_fixed_number_of_ops_and_packs_as_the_workers_do():
    """pack_gathered (decoded on the device): each image and its repeated edge exactly as pack's,
    at the same places, over several tiles, and the views made from it pack's bit for bit; the
    same op count for 32, 128 and 512 images of
    ImageNet's sizes (meta device: what a GPU would launch), where pack makes five copies an
    image."""
    from bench.augment import KernelCounter

    g = torch.Generator().manual_seed(0)
    sizes = [(375, 500), (500, 375), (7, 1200), (1, 1), (333, 500), (900, 2100)] * 4
    images = [torch.randint(0, 256, (3, h, w), generator=g, dtype=torch.uint8) for h, w in sizes]
    (atlas, places), (gathered, same_places) = pack(images), pack_gathered(images)
    assert torch.equal(places, same_places) and gathered.shape == atlas.shape and atlas.shape[0] > atlas.shape[1]
    for t, left, h, w in places.tolist():
        assert torch.equal(gathered[t - 1:t + h + 1, left - 1:left + w + 1], atlas[t - 1:t + h + 1, left - 1:left + w + 1])
    augment, index = DeviceAugment(BatchAugment(moco_recipe("imagefolder", 32, "v2"), 32), seed=0, views=2), \
        torch.arange(len(images))
    for ours, theirs in zip(augment.packed(gathered, places, 0, index), augment.packed(atlas, places, 0, index)):
        assert torch.equal(ours, theirs)  # its planar memory read as the workers' atlas is
    common = [(375, 500), (500, 375), (333, 500), (1200, 800), (64, 48)]
    counts = []
    for batch in (32, 128, 512):
        on_meta = [torch.empty(3, *common[i % len(common)], dtype=torch.uint8, device="meta") for i in range(batch)]
        with KernelCounter() as counter:
            pack_gathered(on_meta)
        counts.append(counter.kernels)
    assert max(counts) == min(counts) <= 25, counts


def test_a_workers_buffer_is_lent_until_released_then_filled_again():
    """A lent buffer is never handed out again before its lease is cleared; a released one is
    (the same shared memory); at most ``size`` are kept, and when all are lent a fresh one serves."""
    buffers = SharedBuffers(size=2)
    first, first_lease = buffers.take(1000)
    second, second_lease = buffers.take(1000)
    assert int(first_lease) == int(second_lease) == 1 and first.data_ptr() != second.data_ptr()
    third, _ = buffers.take(1000)  # both kept ones lent: a fresh one, not kept
    assert third.data_ptr() not in (first.data_ptr(), second.data_ptr()) and len(buffers.kept) == 2
    assert first.is_shared() and third.is_shared()
    first_lease.fill_(0)  # what PackedImages.release() does in the training process
    again, lease = buffers.take(900)
    assert again.data_ptr() == first.data_ptr() and again.numel() == 900 and lease is first_lease
    second_lease.fill_(0)
    larger, _ = buffers.take(5000)  # too large for the free one: it makes room
    assert larger.numel() == 5000 and larger.data_ptr() != second.data_ptr() and len(buffers.kept) == 2


def _shared_memory_resident() -> int:
    """Bytes of shared memory this process has resident (Linux: /proc/self/status RssShmem)."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("RssShmem:"))
    return int(line.split()[1]) * 1024


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="needs Linux's /proc")
def test_a_reused_buffer_holds_no_more_shared_memory_than_its_batch():
    """A buffer reused for a smaller batch hands the pages beyond it back: the shared memory
    resident falls by what the larger batch had touched beyond the smaller one."""
    buffers, mb = SharedBuffers(size=1), 1 << 20
    before = _shared_memory_resident()
    buffer, lease = buffers.take(64 * mb)
    buffer.fill_(1)  # every page touched, as an atlas is
    assert _shared_memory_resident() - before >= 63 * mb
    lease.fill_(0)
    small, _ = buffers.take(4 * mb)
    assert small.data_ptr() == buffer.data_ptr()  # the same buffer, reused
    assert _shared_memory_resident() - before <= 5 * mb
    assert int(small.min()) == 1  # what the batch keeps is untouched


def test_loader_workers_reuse_their_buffers_and_the_batches_stay_exact(jpeg_folder):
    """Through a real DataLoader (2 workers), 12 packed batches consumed as FinishOnDevice consumes
    them: each equals the same images packed in this process, bit for bit, and the workers
    filled at most 2 x KEPT_PER_WORKER shared-memory segments, not one per batch."""
    files = ImageFiles(FolderListing.of(str(jpeg_folder / "train")))
    images = [decode_cpu(read_bytes(path)) for path, _ in files.samples[:24]]
    samples = [(image, 0, 0, i) for i, image in enumerate(images)]
    loader = torch.utils.data.DataLoader(samples * 6, batch_size=12, num_workers=2, collate_fn=collate_files)
    segments = set()
    for i, (batch, *_) in enumerate(loader):
        assert isinstance(batch, PackedImages) and batch.lease is not None and int(batch.lease) == 1
        expected = pack(images[(12 * i) % 24:(12 * i) % 24 + 12])
        assert torch.equal(batch.places, expected[1])
        assert all(torch.equal(a, b) for a, b in zip(unpack(batch.atlas, batch.places), unpack(*expected)))
        fd, _ = batch.atlas.untyped_storage()._share_fd_cpu_()
        segments.add(os.fstat(fd).st_ino)
        batch.release()
        assert batch.lease is None
    assert i == 11 and len(segments) <= 2 * KEPT_PER_WORKER


def test_the_pin_thread_pins_a_packed_batch_and_releases_its_buffer(monkeypatch):
    """The DataLoader's own pin step (torch's, as its pin thread runs it) reaches
    PackedImages.pin_memory, which copies the atlas out and only then clears the lease."""
    buffers = SharedBuffers(size=1)
    atlas, places = pack([torch.full((3, 4, 5), 7, dtype=torch.uint8)], lambda n: buffers.take(n)[0])
    lease = buffers.kept[0][1]
    copies = []

    def fake_pin(tensor, *args):  # no CUDA here: a copy stands in for the pinned one
        if tensor.data_ptr() == atlas.data_ptr():
            assert int(lease) == 1  # still lent while the atlas is copied
        copies.append(tensor.clone())
        return copies[-1]

    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    from torch.utils.data._utils.pin_memory import pin_memory

    batch = [PackedImages(atlas, places, lease), torch.zeros(1)]
    pinned = pin_memory(batch)[0]
    assert isinstance(pinned, PackedImages) and pinned.atlas is copies[0] and pinned.lease is None
    assert int(lease) == 0 and torch.equal(pinned.atlas, atlas)


def test_an_atlas_of_imagenet_size_images_wastes_under_30_percent_of_its_pixels():
    """Rows filled tallest first, each in the first tile with room: the atlas of 256 images of
    ImageNet's common sizes and a tail of larger ones holds under 1.3 x their pixels (1.28; each
    row in the next tile instead: 1.71 x), in square tiles that no image crosses."""
    g = torch.Generator().manual_seed(0)
    common = [(375, 500), (500, 375), (333, 500), (500, 333), (281, 500), (500, 500), (1200, 1600), (427, 640)]
    sizes = [common[i] for i in torch.randint(0, len(common), (256,), generator=g).tolist()]
    places, height, width = placements(sizes)
    assert height * width < 1.3 * sum(h * w for h, w in sizes)
    assert height > 10 * width  # several W x W tiles
    assert all((top - 1) // width == (top + h) // width for top, _, h, _ in places)


def test_a_view_cropped_from_the_atlas_is_the_view_of_the_image_alone(jpeg_folder):
    """Random crops (boxes at the image's edges included) and the evaluation view, from packed
    batches, against the same recipe on each image alone (an atlas of one): the same to the shift
    of its place (:func:`same_to_the_place_shift`)."""
    images = photos(jpeg_folder, 12)
    x, places = packed_float(images)
    index = torch.arange(len(images))
    for recipe in (AugmentRecipe(crop_scale=(0.9, 1.0), crop_ratio=(0.5, 2.0)), AugmentRecipe()):
        augment = BatchAugment(recipe, 64)
        u = keyed_uniforms(0, 0, index)
        together = augment.apply_packed(x, places, u)
        for i, image in enumerate(images):
            alone, alone_places = packed_float([image])
            same_to_the_place_shift(together[i:i + 1], augment.apply_packed(alone, alone_places, u[i:i + 1]))


def test_a_samples_views_do_not_depend_on_its_place_in_a_batch_of_256_imagenet_size_images():
    """Both MoCo v2 views (colour and blur included) of one image alone and last in a batch of
    256 ImageNet-size images (an atlas about 28,000 rows tall, where float32 positions would be
    1/1,024 px apart): within the bound of :func:`same_to_the_place_shift`, since the atlas is
    resampled as tiles of 2,048 rows."""
    g = torch.Generator().manual_seed(0)
    sizes = [(375, 500), (500, 375), (333, 500), (500, 333), (400, 400), (480, 640)]
    last = torch.randint(0, 256, (3, 375, 500), generator=g, dtype=torch.uint8)  # noise: the steepest edges
    images = [torch.zeros((3, *sizes[i % len(sizes)]), dtype=torch.uint8) for i in range(255)] + [last]
    atlas, places = pack(images)
    assert atlas.shape[0] > 16384
    alone_atlas, alone_places = pack([last])
    augment = BatchAugment(moco_recipe("imagefolder", 224, "v2"), 224)
    u = keyed_uniforms(0, 3, torch.tensor([12345]), views=2)
    batch = atlas_for_resampling(atlas)
    for view in (u[:, :u.shape[1] // 2], u[:, u.shape[1] // 2:]):
        alone = augment.apply_packed(atlas_for_resampling(alone_atlas), alone_places, view)
        same_to_the_place_shift(augment.apply_packed(batch, places[-1:], view), alone)


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


def test_device_crops_are_close_to_torchvisions_resized_crops(jpeg_folder):
    """The same boxes, resampled from the atlas and by torchvision (``resized_crop`` with
    antialiasing, on the image as floats); the evaluation view against Resize(256) +
    CenterCrop(224). ``roi_align`` averages bilinear samples over each output pixel's box where
    torchvision weighs a tent twice as wide: on 256 ImageNet-like photographs the largest
    difference was 32 levels of 255 (at sharp edges), 1 value in 1,000 beyond 11 levels, the
    mean 0.42-0.50 levels. Bound here: at most 40 levels, 0.2% beyond 12, mean under 0.7."""
    images = photos(jpeg_folder)
    x, places = packed_float(images)
    index = torch.arange(len(images))
    floats = [as_float_rgb(image[None])[0] for image in images]
    crop = BatchAugment(AugmentRecipe(crop_scale=(0.08, 1.0)), 224)
    boxes = crop.crop_boxes(places[:, 2], places[:, 3], seed=0, epoch=0, index=index)
    ours = crop.apply_packed(x, places, keyed_uniforms(0, 0, index))
    theirs = torch.stack([TF.resized_crop(image, *box, [224, 224], antialias=True)
                          for image, box in zip(floats, boxes.tolist())])
    evaluation = BatchAugment(AugmentRecipe(), 224).apply_packed(x, places, keyed_uniforms(0, 0, index))
    resized = torch.stack([TF.center_crop(TF.resize(image, 256, antialias=True), 224) for image in floats])
    for a, b in ((ours, theirs), (evaluation, resized)):
        levels = (a - b).abs() * 255
        assert levels.max() <= 40 and (levels > 12).float().mean() <= 0.002 and levels.mean() < 0.7


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
    encoded = ImageFiles(FolderListing.of(str(jpeg_folder / "train"))).reading("encoded")
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


def test_the_device_running_out_of_memory_is_raised_never_taken_for_a_refused_image(jpeg_folder, monkeypatch):
    """decode_on with a decoder that fails: out of memory (PyTorch's, or a CUDA error's or
    nvJPEG allocator's text) and an accelerator error are raised as they are, never retried
    image by image and decoded on the CPU as refused images; a batch whose every image fails
    alone too raises with the batch's error; one bad file among good ones is that file alone."""
    files = sorted((jpeg_folder / "train").glob("n*/train_*.JPEG"))[:3]
    batch = EncodedBatch.join([read_bytes(str(path)) for path in files])
    decode_jpeg, rgb = files_on_device.jpeg_decoder()

    def decoder(fail):
        return lambda data, mode, device: fail(data) or decode_jpeg(data, mode=mode, device=device)

    def raising(error):
        def fail(data):
            raise error
        return fail

    failures = [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                RuntimeError("CUDA error: an illegal memory access was encountered"),
                RuntimeError("nvjpegDecodeBatched failed: NVJPEG_STATUS_ALLOCATOR_FAILURE")]
    if hasattr(torch, "AcceleratorError"):
        failures.append(torch.AcceleratorError("CUDA error: out of memory"))
    for error in failures:
        monkeypatch.setattr(files_on_device, "jpeg_decoder", lambda: (decoder(raising(error)), rgb))
        with pytest.raises(type(error)) as raised:
            decode_on(CPU, batch)
        assert raised.value is error
    refusal = RuntimeError("Unsupported marker type 0xd9")
    monkeypatch.setattr(files_on_device, "jpeg_decoder", lambda: (decoder(raising(refusal)), rgb))
    with pytest.raises(RuntimeError, match="failed a batch of 3 JPEGs and then each of them alone: Unsupported marker"):
        decode_on(CPU, batch)
    bad = batch.images()[1]

    def refuses_the_second(data):
        if isinstance(data, list) or data.data_ptr() == bad.data_ptr():
            if isinstance(data, list) and all(d.data_ptr() != bad.data_ptr() for d in data):
                return None
            raise refusal
    monkeypatch.setattr(files_on_device, "jpeg_decoder", lambda: (decoder(refuses_the_second), rgb))
    images, failed = decode_on(CPU, batch)
    assert failed == [1] and images[1] is None and images[0] is not None and images[2] is not None


def test_the_workers_decode_as_pil_does(jpeg_folder):
    """torchvision's decoder (the device path's workers) and PIL (the loader path) give the same
    pixels, the odd files included."""
    for path, _ in ImageFiles(FolderListing.of(str(jpeg_folder / "train"))).samples:
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
