"""The host's work per training step for the device augmentation, now against an earlier commit.

    python bench/augment_host.py                  # against 6a4b01f (the per-image exact crops)
    python bench/augment_host.py --before 8719b0f --repeats 5

On a GPU every op the augmentation dispatches is a kernel launch the host issues (a few
microseconds each), and the host must issue a whole step's launches within the step's time:
at 2,500 img/s a 256-image step has about 100 ms. Measured here on the CPU (one thread, eager),
both MoCo v2 views of packed batches as ``DeviceAugment.packed`` runs them (uniforms and places
copied in, the atlas made float, every view cut, coloured, blurred, flipped and normalised):

1. ops dispatched per batch against the batch size (a dispatch-mode counter, views and
   metadata ops left out): on a GPU, the kernels launched;
2. host milliseconds per 256-image step on thumbnails (ImageNet's shapes at 1/32 of their
   sides, 8 px views): the same ops on so few pixels that the time is Python and dispatch,
   the part of a step the host spends whatever the GPU (a GPU adds each launch's own cost);
3. milliseconds per 256-image step at full size (224 px views of ImageNet-size images) with
   the CPU as the device: the arithmetic a GPU takes over, for scale.

Both sides run in one process, turn about (``bench/at_commit.py`` loads the older module); the
best of ``--repeats`` is printed with the ratio. Figures, never assertions.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.at_commit import module_at  # noqa: E402
from bench.augment import KernelCounter  # noqa: E402
from ddp_utils.data import batch_augment as now  # noqa: E402
from ddp_utils.data.files_on_device import pack  # noqa: E402
from ddp_utils.data.recipes import moco_recipe  # noqa: E402

SIZES = [(375, 500), (500, 375), (333, 500), (500, 333), (400, 400), (480, 640)]  # ImageNet's common sizes
THUMBNAIL = 32  # thumbnails' sides: ImageNet's over this (about 15 px)
THUMBNAIL_VIEW = 8  # px: the thumbnails' views


def packed_batch(batch: int, shrink: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """A packed batch of noise images of ImageNet's shapes, their sides divided by ``shrink``."""
    g = torch.Generator().manual_seed(0)
    return pack([torch.randint(0, 256, (3, h // shrink, w // shrink), dtype=torch.uint8, generator=g)
                 for h, w in (SIZES[i % len(SIZES)] for i in range(batch))])


def augmenters(before: str, size: int) -> dict[str, object]:
    old = module_at(before, "ddp_utils/data/batch_augment.py")
    recipe = moco_recipe("imagefolder", size, "v2")
    return {before: old.DeviceAugment(old.BatchAugment(recipe, size), seed=0, views=2),
            "now": now.DeviceAugment(now.BatchAugment(recipe, size), seed=0, views=2)}


def ops_per_batch(augment, batch: int) -> int:
    """Ops of a batch after one of its size (which makes the kept buffers and cached constants)."""
    atlas, places = packed_batch(batch, THUMBNAIL)
    augment.packed(atlas, places, 0, torch.arange(batch))
    with KernelCounter() as counter:
        augment.packed(atlas, places, 0, torch.arange(batch))
    return counter.kernels


def best_ms(runs: dict[str, object], repeats: int) -> dict[str, float]:
    """Best wall milliseconds of each run, the runs taking turns (the first call of each a warm-up)."""
    for run in runs.values():
        run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(1e3 * (time.perf_counter() - start))
    return {name: min(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", default="6a4b01f", help="the commit to compare with")
    parser.add_argument("--batches", type=int, nargs="+", default=[32, 64, 128, 256, 512])
    parser.add_argument("--step-batch", type=int, default=256, help="images per timed step")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat: that it runs")
    args = parser.parse_args()
    if args.smoke:
        args.batches, args.step_batch, args.repeats = [4, 8], 4, 1
    torch.set_num_threads(1)
    small, full = augmenters(args.before, THUMBNAIL_VIEW), augmenters(args.before, 224)
    names = list(small)
    print(f"Both MoCo v2 views of packed batches, {names[0]} against now, the CPU as the device, one thread\n")
    print(f"| images per batch | {' | '.join(f'ops, {n}' for n in names)} |")
    print("| ---: | " + " | ".join("---:" for _ in names) + " |")
    for batch in args.batches:
        print(f"| {batch} | " + " | ".join(f"{ops_per_batch(small[n], batch):,}" for n in names) + " |")

    batch, index = args.step_batch, torch.arange(args.step_batch)
    thumbnails, images = packed_batch(batch, THUMBNAIL), packed_batch(batch)
    host = best_ms({n: (lambda a=a: a.packed(*thumbnails, 0, index)) for n, a in small.items()}, args.repeats)
    whole = best_ms({n: (lambda a=a: a.packed(*images, 0, index)) for n, a in full.items()}, args.repeats)
    print(f"\n| ms per {batch}-image step, best of {args.repeats} | {' | '.join(names)} | ratio |")
    print("| --- | ---: | ---: | ---: |")
    for label, ms in ((f"host: thumbnails (1/{THUMBNAIL} of the sides), {THUMBNAIL_VIEW} px views", host),
                      ("with the arithmetic: full size, 224 px views", whole)):
        first, last = (ms[n] for n in names)
        print(f"| {label} | {first:,.1f} | {last:,.1f} | {first / last:.2f}x |")


if __name__ == "__main__":
    main()
