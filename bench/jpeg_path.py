"""The JPEG input path per CPU core: what a DataLoader worker does per image on each of this
project's paths, side by side with the official MoCo v2 pipeline, in one run.

    python bench/jpeg_path.py                         # an ImageNet-like folder in a temp dir
    python bench/jpeg_path.py --data-dir /data/imagenet --images 2000
    python bench/jpeg_path.py --rounds 5 --images 400

One process, one thread (``torch.set_num_threads(1)``): a worker's view of the work. Each row is
the CPU time (``process_time``, so other jobs on the machine do not count) of the same images,
each decoded from its file and made into the row's sample, batches collated as the DataLoader
would (32 per batch, the cost shared by its images); the rows take turns over ``--rounds`` rounds
and each reports its median round. The handing over of batches between processes (shared
memory) is left out on every row alike, except the two rows "in a DataLoader worker".

Rows:

* decoding alone: PIL (what the loader path and the official pipeline use) and
  ``torchvision.io.decode_jpeg`` (what the device path's workers use; the same pixels);
* MoCo v2, two views: the official pipeline as published (facebookresearch/moco: ImageFolder's PIL
  loader, ``TwoCropsTransform`` of torchvision's PIL transforms with PIL's Gaussian blur); this
  project's loader path (``--aug-on loader``); the device path before this change (the worker
  decoded and made both crop-resizes on uint8) and now (the worker decodes and packs; the
  device crops), and with ``--decode-on device`` (the worker reads the file's bytes);
* the classifier's view (random resized crop and flip) and the evaluation view (resize and
  centre crop): the loader path against the device path's worker;
* the device path's worker as it runs in a DataLoader worker (the process marked as one, so that
  batches are packed into shared memory as there, each released once packed, as the training
  process releases it once copied): decode + pack now (a reused buffer) against the same at commit
  8719b0f (a fresh shared-memory atlas per batch, each image inside a copied one-pixel border),
  its ``pack`` read from git (``bench/at_commit.py``);
* for reference, what the training process itself does per image on the device path when the
  device is this CPU (on a GPU that work is the GPU's).

The folder: ``bench/imagenet_like.py`` (real photographs, ImageNet's sizes, quality 90, a CMYK, a
grayscale and a PNG-named file) unless ``--data-dir`` names an ImageFolder root (its train/).
"""
from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from PIL import Image, ImageFilter

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.at_commit import module_at  # noqa: E402
from bench.imagenet_like import write_imagenet_like  # noqa: E402
from ddp_utils import hashing  # noqa: E402
from ddp_utils.data.batch_augment import BatchAugment, DeviceAugment  # noqa: E402
from ddp_utils.data.files_on_device import FinishOnDevice, collate_files, pack_to_share  # noqa: E402
from ddp_utils.data.image_files import FolderListing, ImageFiles, decode_cpu, decode_rgb, read_bytes  # noqa: E402
from ddp_utils.data.pipeline import SeededTransform  # noqa: E402
from ddp_utils.data.recipes import AugmentRecipe, classifier_recipe, eval_recipe, moco_recipe  # noqa: E402
from ddp_utils.data.sets import IMAGENET_MEAN, IMAGENET_STD  # noqa: E402
from ddp_utils.data.transforms import TwoCrops, view_transform  # noqa: E402

BATCH = 32
SIZE = 224


# ----------------------------------------------------------------------------- the official pipeline
class PILGaussianBlur:
    """The official MoCo v2 blur: PIL's GaussianBlur with a radius drawn from [0.1, 2.0]."""

    def __init__(self, sigma=(0.1, 2.0)):
        self.sigma = sigma

    def __call__(self, image):
        return image.filter(ImageFilter.GaussianBlur(radius=random.uniform(*self.sigma)))


def official_moco_v2():
    """MoCo v2's training augmentation as published, built from torchvision's (v1) transforms."""
    from torchvision import transforms as T1

    view = T1.Compose([
        T1.RandomResizedCrop(SIZE, scale=(0.2, 1.0)),
        T1.RandomApply([T1.ColorJitter(0.4, 0.4, 0.4, 0.1)], p=0.8),
        T1.RandomGrayscale(p=0.2),
        T1.RandomApply([PILGaussianBlur()], p=0.5),
        T1.RandomHorizontalFlip(),
        T1.ToTensor(),
        T1.Normalize(IMAGENET_MEAN, IMAGENET_STD)])
    return lambda image: (view(image), view(image))


class SeededBefore(SeededTransform):
    """SeededTransform as it was before this change: ``torch.manual_seed`` per sample, which also
    queues a seed for every CUDA device (about a millisecond on a CUDA build of torch)."""

    def __getitem__(self, key):
        epoch, index = key if isinstance(key, tuple) else (0, key)
        image, target = self.base[index]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(hashing.seed(self.seed, epoch, index))
            image = self.transform(image)
        return (image, target, epoch, index) if self.with_key else (image, target)


def loader_view_before(recipe: AugmentRecipe):
    """The loader path's MoCo v2 view as it was before this change: decoded to a tensor first,
    every step on float tensors, torchvision's 2-D Gaussian blur."""
    from torchvision.transforms import v2 as T

    return T.Compose([
        T.ToImage(), T.RandomResizedCrop(SIZE, scale=recipe.crop_scale, ratio=recipe.crop_ratio, antialias=True),
        T.ToDtype(torch.float32, scale=True), T.RandomApply([T.ColorJitter(*recipe.jitter)], p=recipe.jitter_p),
        T.RandomGrayscale(p=recipe.gray_p),
        T.RandomApply([T.GaussianBlur(recipe.blur_kernel, sigma=recipe.blur_sigma)], p=recipe.blur_p),
        T.RandomHorizontalFlip(), T.Normalize(recipe.mean, recipe.std), T.ToPureTensor()])


@contextlib.contextmanager
def as_a_dataloader_worker():
    """This process seen as DataLoader worker 0 (what decides where a batch is packed: shared
    memory in a worker), so that a row packs exactly as a worker does."""
    from torch.utils.data._utils import worker

    saved, worker._worker_info = worker._worker_info, worker.WorkerInfo(id=0, num_workers=1, seed=0, dataset=None)
    try:
        yield
    finally:
        worker._worker_info = saved


def pil_loader(path: str) -> Image.Image:
    """torchvision ImageFolder's default loader, as the official code reads its files."""
    with open(path, "rb") as f:
        return Image.open(f).convert("RGB")


# ----------------------------------------------------------------------------- rows
def rows(files: ImageFiles) -> dict[str, callable]:
    """Row name -> function(indices) doing that row's per-image work on those samples."""
    paths = [path for path, _ in files.samples]
    official = official_moco_v2()
    moco = moco_recipe("imagefolder", SIZE, "v2")
    classifier = classifier_recipe("imagefolder", SIZE)

    def per_sample(dataset, collate=torch.utils.data.default_collate):
        def run(indices):
            for start in range(0, len(indices), BATCH):
                collate([dataset[(0, i)] for i in indices[start:start + BATCH]])
        return run

    def official_row(indices):
        for start in range(0, len(indices), BATCH):
            torch.utils.data.default_collate([(official(pil_loader(paths[i])), 0) for i in indices[start:start + BATCH]])

    from torchvision.transforms import v2 as T

    def crop_resize(scale):  # what the device path's workers ran per view before this change
        return T.Compose([T.ToImage(), T.RandomResizedCrop(SIZE, scale=scale, antialias=True), T.ToPureTensor()])
    tensor, encoded = files.reading("decoded"), files.reading("encoded")
    packed_at_8719b0f = module_at("8719b0f", "ddp_utils/data/packed.py")

    def in_a_worker(pack_batch):
        def run(indices):
            with as_a_dataloader_worker():
                for start in range(0, len(indices), BATCH):
                    pack_batch([tensor[i][0] for i in indices[start:start + BATCH]])
        return run
    return {
        "decode alone: PIL": lambda indices: [decode_rgb(paths[i]) for i in indices],
        "decode alone: torchvision.io.decode_jpeg (the device path's workers)":
            lambda indices: [decode_cpu(read_bytes(paths[i])) for i in indices],
        "MoCo v2, two views: the official pipeline (PIL transforms, PIL blur)": official_row,
        "MoCo v2, two views: --aug-on loader before this change (float tensor ops, a 2-D blur)":
            per_sample(SeededBefore(files, TwoCrops(loader_view_before(moco)), 0)),
        "MoCo v2, two views: --aug-on loader": per_sample(SeededTransform(files, TwoCrops(
            view_transform(moco, "imagefolder", SIZE)), 0)),
        "MoCo v2, two views: --aug-on device before this change (decode + two crop-resizes)":
            per_sample(SeededBefore(files, TwoCrops(crop_resize((0.2, 1.0))), 0, with_key=True)),
        "MoCo v2, two views: --aug-on device (decode + pack)":
            per_sample(SeededTransform(tensor, None, 0, with_key=True), collate_files),
        "decode + pack in a DataLoader worker at 8719b0f (a fresh shared-memory atlas per batch, bordered)":
            in_a_worker(packed_at_8719b0f.pack),
        "decode + pack in a DataLoader worker (a reused shared-memory buffer)":
            in_a_worker(lambda images: pack_to_share(images).release()),
        "MoCo v2, two views: --aug-on device --decode-on device (read the bytes)":
            per_sample(SeededTransform(encoded, None, 0, with_key=True), collate_files),
        "classifier view: --aug-on loader": per_sample(SeededTransform(files, view_transform(
            classifier, "imagefolder", SIZE), 0)),
        "classifier view: --aug-on device before this change (decode + a crop-resize)":
            per_sample(SeededBefore(files, crop_resize((0.08, 1.0)), 0, with_key=True)),
        "classifier view: --aug-on device (decode + pack)":
            per_sample(SeededTransform(tensor, None, 0, with_key=True), collate_files),
        "evaluation view: before this change (the loader path on every path)":
            per_sample(SeededBefore(files, view_transform(eval_recipe("imagefolder"), "imagefolder", SIZE), 0)),
        "evaluation view: --aug-on loader": per_sample(SeededTransform(files, view_transform(eval_recipe("imagefolder"), "imagefolder", SIZE), 0)),
        "evaluation view: --aug-on device (decode + pack)":
            per_sample(SeededTransform(tensor, None, 0, with_key=True), collate_files),
        "reference: the training process on a CPU device, MoCo v2 two views of packed batches":
            device_side(tensor, moco),
    }


def device_side(tensor_files: ImageFiles, recipe: AugmentRecipe):
    """What FinishOnDevice does per image with the CPU as the device, batches packed beforehand."""
    finish = FinishOnDevice(torch.utils.data.DataLoader([]), DeviceAugment(BatchAugment(recipe, SIZE), 0, 2),
                            torch.device("cpu"), tensor_files)
    dataset = SeededTransform(tensor_files, None, 0, with_key=True)
    cache: dict[tuple[int, ...], list] = {}

    def run(indices):
        for start in range(0, len(indices), BATCH):
            key = tuple(indices[start:start + BATCH])
            if key not in cache:  # packed once, outside the timing of later rounds
                cache[key] = collate_files([dataset[(0, i)] for i in key])
            finish.finish(cache[key])
    return run


def measure(files: ImageFiles, count: int, rounds: int) -> list[tuple[str, float]]:
    indices = list(range(min(count, len(files))))
    table = rows(files)
    table["reference: the training process on a CPU device, MoCo v2 two views of packed batches"](indices)  # packs
    seconds: dict[str, list[float]] = {name: [] for name in table}
    for _ in range(rounds):
        for name, run in table.items():
            random.seed(0)
            torch.manual_seed(0)
            started = time.process_time()
            run(indices)
            seconds[name].append(time.process_time() - started)
    return [(name, statistics.median(s) / len(indices)) for name, s in seconds.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--data-dir", help="an ImageFolder root (its train/ is read); default: a new ImageNet-like one")
    parser.add_argument("--images", type=int, default=320, help="images per row and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="8 images, 1 round: that every row runs (the test suite's)")
    args = parser.parse_args()
    if args.smoke:
        args.images, args.rounds = 8, 1
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = args.data_dir
        if root is None:
            root = str(Path(tmp) / "imagenet_like")
            write_imagenet_like(root, classes=8, train_per_class=max(1, -(-args.images // 8)), val_per_class=1)
        files = ImageFiles(FolderListing.of(str(Path(root) / "train")))
        results = measure(files, args.images, args.rounds)
    rate = {name: 1 / per_image for name, per_image in results}
    official = rate["MoCo v2, two views: the official pipeline (PIL transforms, PIL blur)"]
    print(f"{min(args.images, len(files))} images, {args.rounds} rounds, median; one core (1 thread), CPU time\n")
    print("| what runs per image | img/s per core | ms per image | vs the official MoCo v2 | vs before this change |")
    print("| --- | --- | --- | --- | --- |")
    for name, per_image in results:
        before = BEFORE.get(name)
        print(f"| {name} | {rate[name]:,.0f} | {1000 * per_image:.2f} | {rate[name] / official:.2f}x | "
              f"{f'{rate[name] / rate[before]:.2f}x' if before else ''} |")


# each row against what the same worker ran before this change (ImageFolder's evaluation took the
# loader path on every path then)
BEFORE = {
    "MoCo v2, two views: --aug-on loader": "MoCo v2, two views: --aug-on loader before this change (float tensor ops, a 2-D blur)",
    "MoCo v2, two views: --aug-on device (decode + pack)":
        "MoCo v2, two views: --aug-on device before this change (decode + two crop-resizes)",
    "MoCo v2, two views: --aug-on device --decode-on device (read the bytes)":
        "MoCo v2, two views: --aug-on device before this change (decode + two crop-resizes)",
    "classifier view: --aug-on device (decode + pack)":
        "classifier view: --aug-on device before this change (decode + a crop-resize)",
    "evaluation view: --aug-on loader": "evaluation view: before this change (the loader path on every path)",
    "evaluation view: --aug-on device (decode + pack)": "evaluation view: before this change (the loader path on every path)",
    "decode + pack in a DataLoader worker (a reused shared-memory buffer)":
        "decode + pack in a DataLoader worker at 8719b0f (a fresh shared-memory atlas per batch, bordered)",
}


if __name__ == "__main__":
    main()
