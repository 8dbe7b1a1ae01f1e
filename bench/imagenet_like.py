"""An ImageNet-like folder of JPEGs made from real photographs, for the JPEG benchmark, the GPU
check and the tests (no data set can be downloaded here).

    python bench/imagenet_like.py /tmp/in_like                       # 10 classes x 64 train, x 16 val
    python bench/imagenet_like.py /tmp/in_like --classes 4 --train-per-class 8 --val-per-class 2

The layout is ImageNet's (``ROOT/train/nXXXXXXXX/*.JPEG``, ``ROOT/val/...``). Each image is a random
crop of one of the photographs scikit-learn ships (``sklearn.datasets.load_sample_images``: a
temple in China and a flower, 640 x 427), flipped or not, resized to a size drawn like ImageNet's
(about 55% 500 x 375, 15% 375 x 500, 10% 500 x 333, 20% with the long side uniform in 600-1,200 px),
saved as a baseline JPEG at quality 90 (4:2:0 chroma, as most of ImageNet). With ``oddities`` the
train split also holds what ImageNet itself holds besides: a CMYK JPEG, a grayscale JPEG and a PNG
file named ``.JPEG``, one each, in the first class. Everything is a function of ``seed``.
"""
from __future__ import annotations

import argparse
import random
from pathlib import Path

from PIL import Image

QUALITY = 90
ODDITIES = ("cmyk", "gray", "png")


def photographs() -> list[Image.Image]:
    """The real photographs an installed package ships (scikit-learn's sample images), as RGB."""
    from sklearn.datasets import load_sample_images

    return [Image.fromarray(image) for image in load_sample_images().images]


def imagenet_size(rng: random.Random) -> tuple[int, int]:
    """(width, height) drawn like ImageNet's: mostly 500 x 375, a tail to 1,200 px."""
    u = rng.random()
    if u < 0.55:
        return 500, 375
    if u < 0.70:
        return 375, 500
    if u < 0.80:
        return 500, 333
    long_side = rng.randint(600, 1200)
    short_side = round(long_side * rng.uniform(0.6, 0.9))
    return (long_side, short_side) if rng.random() < 0.7 else (short_side, long_side)


def render(photo: Image.Image, size: tuple[int, int], rng: random.Random) -> Image.Image:
    """A random crop of ``photo`` with ``size``'s aspect ratio, resized to ``size``."""
    width, height = size
    scale = rng.uniform(0.5, 1.0)
    crop_w = min(photo.width, round(photo.height * scale * width / height))
    crop_h = min(photo.height, round(crop_w * height / width))
    left, top = rng.randint(0, photo.width - crop_w), rng.randint(0, photo.height - crop_h)
    image = photo.crop((left, top, left + crop_w, top + crop_h)).resize(size, Image.BICUBIC)
    return image.transpose(Image.FLIP_LEFT_RIGHT) if rng.random() < 0.5 else image


def write_imagenet_like(root: str | Path, classes: int = 10, train_per_class: int = 64, val_per_class: int = 16,
                        seed: int = 0, oddities: bool = True) -> dict[str, Path]:
    """Write the folder; returns the odd files by kind (empty without ``oddities``)."""
    root, rng, sources = Path(root), random.Random(seed), photographs()
    for split, count in (("train", train_per_class), ("val", val_per_class)):
        for c in range(classes):
            folder = root / split / f"n{c:08d}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                image = render(sources[(c + i) % len(sources)], imagenet_size(rng), rng)
                image.save(folder / f"{split}_{c:04d}_{i:05d}.JPEG", quality=QUALITY)
    if not oddities:
        return {}
    odd = root / "train" / f"n{0:08d}"
    photo = render(sources[0], (500, 375), rng)
    made = {"cmyk": odd / "odd_cmyk.JPEG", "gray": odd / "odd_gray.JPEG", "png": odd / "odd_png.JPEG"}
    photo.convert("CMYK").save(made["cmyk"], quality=QUALITY)
    photo.convert("L").save(made["gray"], quality=QUALITY)
    photo.save(made["png"], format="PNG")
    return made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("root", help="folder to write (train/ and val/ inside)")
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--train-per-class", type=int, default=64)
    parser.add_argument("--val-per-class", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-oddities", action="store_true", help="leave out the CMYK, grayscale and PNG files")
    args = parser.parse_args()
    write_imagenet_like(args.root, args.classes, args.train_per_class, args.val_per_class, args.seed,
                        oddities=not args.no_oddities)
    count = args.classes * (args.train_per_class + args.val_per_class) + (0 if args.no_oddities else len(ODDITIES))
    print(f"wrote {count:,} images into {args.root}")


if __name__ == "__main__":
    main()
