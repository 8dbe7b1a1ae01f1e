"""A DataLoader worker's CPU time per training image on the loader path, against torchvision's reference.

    python bench/train_view.py                         # an ImageNet-like folder of 128 JPEGs, best of 3
    python bench/train_view.py --data /data/imagenet --images 512

Where torchvision's per-sample steps (--auto-augment, --random-erase) keep a run's augmentation in the
DataLoader workers, each worker's cost per image decides how many cores a GPU needs. Both sides, one
thread (``torch.set_num_threads(1)``: a worker's), on the same JPEG files, each image with its own seed:

* ours: the training split's sample as the workers read it (``ImageFiles``: PIL decode) and the view
  ``transforms.view_transform`` builds from ``recipes.classifier_recipe`` (torchvision.transforms.v2 on
  the 8-bit tensor: crop, flip, automatic augmentation, to float, normalise, erase);
* torchvision's reference, written out here as references/classification/presets.py does it with its
  default PIL backend (torchvision.transforms): PIL decode, RandomResizedCrop and the flip and the
  automatic augmentation on the PIL image, PILToTensor, to float, Normalize, RandomErasing.

Rows: the classic recipe (224 px crop, flip), the v2 recipe (176 px, ta_wide, erasing p 0.1), and the v2
recipe with RandAugment (magnitude 9) or AugMix (severity 3) instead. Printed: CPU milliseconds per image
(``time.process_time``: this process's CPU, decode included), the best of ``--repeats`` passes over the
files, the two sides taking turns; the ratio is torchvision's over ours (above 1: ours is cheaper).
Figures, never assertions.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from PIL import Image
from torchvision import transforms as V1

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.imagenet_like import write_imagenet_like  # noqa: E402
from ddp_utils.data.recipes import classifier_recipe  # noqa: E402
from ddp_utils.data.sets import NORMALIZATION, load_split  # noqa: E402
from ddp_utils.data.transforms import view_transform  # noqa: E402

# (row, training crop px, --auto-augment, --random-erase, its own setting)
ROWS = [("classic: crop 224, flip", 224, "", 0.0, {}),
        ("v2: crop 176, flip, ta_wide, erase 0.1", 176, "ta_wide", 0.1, {}),
        ("v2 with ra (magnitude 9)", 176, "ra", 0.1, {"ra_magnitude": 9}),
        ("v2 with augmix (severity 3)", 176, "augmix", 0.1, {"augmix_severity": 3})]
BILINEAR = V1.InterpolationMode.BILINEAR


def reference(size: int, auto_augment: str, erase: float, own: dict) -> V1.Compose:
    """presets.ClassificationPresetTrain's steps, PIL backend, from torchvision's public classes."""
    mean, std = NORMALIZATION["imagefolder"]
    steps = [V1.RandomResizedCrop(size, interpolation=BILINEAR, antialias=True), V1.RandomHorizontalFlip(0.5)]
    if auto_augment == "ra":
        steps.append(V1.RandAugment(interpolation=BILINEAR, magnitude=own.get("ra_magnitude", 9)))
    elif auto_augment == "ta_wide":
        steps.append(V1.TrivialAugmentWide(interpolation=BILINEAR))
    elif auto_augment == "augmix":
        steps.append(V1.AugMix(interpolation=BILINEAR, severity=own.get("augmix_severity", 3)))
    elif auto_augment:
        steps.append(V1.AutoAugment(V1.AutoAugmentPolicy(auto_augment), interpolation=BILINEAR))
    steps += [V1.PILToTensor(), V1.ConvertImageDtype(torch.float), V1.Normalize(mean, std)]
    return V1.Compose(steps + ([V1.RandomErasing(p=erase)] if erase else []))


def cpu_ms_per_image(make_view, count: int) -> float:
    """CPU ms per image of ``make_view(i)`` over images 0..count-1, each seeded with its index."""
    start = time.process_time()
    for i in range(count):
        torch.manual_seed(i)
        make_view(i)
    return 1e3 * (time.process_time() - start) / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", default="", help="an ImageFolder root (train/ inside); default: an ImageNet-like "
                        "folder made in a temporary folder (bench/imagenet_like.py)")
    parser.add_argument("--images", type=int, default=128, help="training images timed per pass")
    parser.add_argument("--repeats", type=int, default=3, help="passes per side; the best is printed")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one pass: that it runs")
    args = parser.parse_args()
    if args.smoke:
        args.images, args.repeats = 4, 1
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = args.data
        if not root:
            root = str(Path(tmp) / "imagenet_like")
            per_class = max(1, -(-args.images // 4))
            write_imagenet_like(root, classes=4, train_per_class=per_class, val_per_class=1, oddities=False)
        files = load_split("imagefolder", root, True, 224)  # the workers' reads: PIL images
        count = min(args.images, len(files))
        paths = [files.samples[i][0] for i in range(count)]
        print(f"CPU ms per training image, one thread, {count} JPEG files of {root if args.data else 'an ImageNet-like folder'}, "
              f"best of {args.repeats}\n")
        print("| recipe | ours (ms) | torchvision's reference (ms) | ratio |")
        print("| --- | ---: | ---: | ---: |")
        for name, size, auto_augment, erase, own in ROWS:
            ours_view = view_transform(classifier_recipe("imagefolder", size, auto_augment=auto_augment,
                                                         random_erase=erase, **own), "imagefolder", size)
            theirs_view = reference(size, auto_augment, erase, own)
            sides = {"ours": lambda i: ours_view(files[i][0]),
                     "theirs": lambda i: theirs_view(Image.open(paths[i]).convert("RGB"))}
            for make in sides.values():  # warm-up: first calls build caches and load kernels
                cpu_ms_per_image(make, min(count, 2))
            best = {side: float("inf") for side in sides}
            for _ in range(args.repeats):
                for side, make in sides.items():
                    best[side] = min(best[side], cpu_ms_per_image(make, count))
            print(f"| {name} | {best['ours']:.2f} | {best['theirs']:.2f} | {best['theirs'] / best['ours']:.2f}x |")


if __name__ == "__main__":
    main()
