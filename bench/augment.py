"""Per-sample torchvision augmentation against the batched device module, on one CPU thread.

    python bench/augment.py                      # MoCo v2, two views, 16 and 32 px, batch 256
    python bench/augment.py --samples 1024 --repeats 5

The per-sample side is what the DataLoader runs on the loader path: ``view_transform`` of
``moco_recipe("cifar10", size, "v2")`` (decode, random resized crop, jitter p 0.8, grayscale, blur p 0.5, flip, normalise)
called image by image on 32x32 uint8 CIFAR-like tensors, two views each; the seeding that
``SeededTransform`` adds around it is left out, which flatters the per-sample side. The batched
side is :class:`BatchAugment` with the same recipe on the same images, in batches, two views
(view 0 and 1). Both report samples (two views each) per second of CPU time (``process_time``,
so that other jobs on a shared machine do not count), the best of ``--repeats`` runs.

A second table times the colour jitter alone: per-sample random op order as torchvision (what
BatchAugment runs: three blend slots before the hue shift and three after) against one fixed
order (brightness, contrast, saturation, hue), to show what the exact semantics cost.

A third counts the kernels one training step launches for its augmentation (both views of one
batch, as ``DeviceAugment`` runs it; a dispatch-mode counter, views and metadata ops left out):
on a GPU each is a launch the host must issue, so the count bounds how early the next batch
can be queued. Side by side: the uniforms drawn in one hash call for both views, against one
call per purpose and view (5 purposes x 2 views).

A fourth is the ImageNet path's device side: both MoCo v2 views at 224 px of packed batches of
an ImageNet-like folder (``bench/imagenet_like.py``), as ``DeviceAugment.packed`` makes them
with the CPU as the device (the code a GPU runs, eager), against the same at commit 8719b0f
and at 28751f1 (a resize per image and view; read from git: ``bench/at_commit.py``): CPU time
per image on one thread, and the bytes its ops write per image (a dispatch-mode counter summing
each op's outputs, in-place ones included): on a GPU these passes are memory-bound, so bytes
written is what they cost there.
``--packed-only`` runs this table alone.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ddp_utils import hashing  # noqa: E402
from ddp_utils.data import batch_augment as ba  # noqa: E402
from ddp_utils.data.batch_augment import BatchAugment, DeviceAugment  # noqa: E402
from ddp_utils.data.recipes import moco_recipe  # noqa: E402
from ddp_utils.data.transforms import view_transform  # noqa: E402


def _cpu_seconds(fn) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def _best_seconds(fns, repeats: int) -> list[float]:
    """Best CPU time of each function; the functions take turns, so that a shared machine's load
    weighs on all of them alike. The first call of each is a warm-up."""
    for fn in fns:
        fn()
    times = [[_cpu_seconds(fn) for fn in fns] for _ in range(repeats)]
    return [min(column) for column in zip(*times)]


def per_sample_views(images: torch.Tensor, size: int):
    """Both views of every image, image by image, as the DataLoader's per-sample transform."""
    view = view_transform(moco_recipe("cifar10", size, "v2"), "cifar10", size)
    return lambda: [(view(image), view(image)) for image in images]


def batched_views(images: torch.Tensor, size: int, batch: int):
    """Both views of every image, ``batch`` images at a time, with :class:`BatchAugment`."""
    augment = BatchAugment(moco_recipe("cifar10", size, "v2"), size)
    index = torch.arange(len(images))

    def run():
        for start in range(0, len(images), batch):
            chunk, ids = images[start:start + batch], index[start:start + batch]
            for view in (0, 1):  # query and key
                augment(chunk, seed=0, epoch=0, index=ids, view=view)
    return run


def jitter_order_ms(size: int, batch: int, repeats: int) -> tuple[float, float]:
    """(random order, fixed order) milliseconds of CPU time for one batch of ColorJitter(0.4, 0.4,
    0.4, 0.1) applied to every sample."""
    x = torch.rand(batch, 3, size, size, generator=torch.Generator().manual_seed(0))
    factors, order = ba.jitter_draws(ba.keyed_uniforms(0, 0, torch.arange(batch))[:, :8], (0.4, 0.4, 0.4, 0.1))

    def fixed():
        y = x.clone()
        for op in range(3):
            y = ba.blend_step_(y, torch.full((batch,), op), factors[:, op])
        return ba.shift_hue(y, factors[:, 3], out=y)

    random_order, fixed_order = _best_seconds([lambda: ba.color_jitter_(x.clone(), factors, order), fixed], repeats)
    return 1e3 * random_order, 1e3 * fixed_order


class BytesWritten(TorchDispatchMode):
    """Sums the bytes of every tensor an op writes (its outputs, in-place and ``out=`` ones
    included; views write nothing)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.bytes += t.numel() * t.element_size()
        return out


def packed_views(images: int = 64, batch: int = 32, repeats: int = 3) -> dict[str, tuple[float, float]]:
    """{"8719b0f" | "28751f1" | "now": (CPU ms per image, MB written per image)} for both MoCo v2 views of
    packed batches of an ImageNet-like folder (see the module docstring)."""
    import tempfile

    from bench.at_commit import module_at
    from bench.imagenet_like import write_imagenet_like
    from ddp_utils.data.files_on_device import pack
    from ddp_utils.data.image_files import FolderListing, ImageFiles, decode_cpu, read_bytes

    with tempfile.TemporaryDirectory() as root:
        write_imagenet_like(root, classes=4, train_per_class=-(-images // 4), val_per_class=1)
        files = ImageFiles(FolderListing.of(f"{root}/train"))
        decoded = [decode_cpu(read_bytes(files.samples[i][0])) for i in range(images)]
    batches = [(pack(decoded[s:s + batch]), torch.arange(s, min(s + batch, images)))
               for s in range(0, images, batch)]
    recipe = moco_recipe("imagefolder", 224, "v2")
    now = DeviceAugment(BatchAugment(recipe, 224), seed=0, views=2)
    old = module_at("8719b0f", "ddp_utils/data/batch_augment.py")
    old_augment = old.BatchAugment(recipe, 224)

    def at_8719b0f(atlas, places, index):  # its DeviceAugment.packed, the atlas packed by today's pack
        u = old.draws(0, 0, index, 2)
        x = old.as_float_rgb(atlas.permute(2, 0, 1)[None])
        return [old_augment.apply_packed(x, places, u[:, v * ba.VIEW_COLUMNS:(v + 1) * ba.VIEW_COLUMNS])
                for v in range(2)]

    previous = module_at("28751f1", "ddp_utils/data/batch_augment.py")  # exact per-image resizes, subsets
    at_28751f1 = previous.DeviceAugment(previous.BatchAugment(recipe, 224), seed=0, views=2)
    runs = {"8719b0f": lambda: [at_8719b0f(atlas, places, index) for (atlas, places), index in batches],
            "28751f1": lambda: [at_28751f1.packed(atlas, places, 0, index) for (atlas, places), index in batches],
            "now": lambda: [now.packed(atlas, places, 0, index) for (atlas, places), index in batches]}
    seconds = _best_seconds(list(runs.values()), repeats)
    written = []
    for run in runs.values():
        with BytesWritten() as counter:
            run()
        written.append(counter.bytes)
    return {name: (1e3 * t / images, b / images / 1e6) for name, t, b in zip(runs, seconds, written)}


class KernelCounter(TorchDispatchMode):
    """Counts the operators that run a kernel (views and metadata-only ops left out)."""

    def __init__(self):
        super().__init__()
        self.kernels = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.overloadpacket not in (torch.ops.aten.detach, torch.ops.aten.alias):
            self.kernels += 1
        return func(*args, **(kwargs or {}))


def counted(fn) -> int:
    with KernelCounter() as counter:
        fn()
    return counter.kernels


def kernels_per_step(size: int, batch: int) -> tuple[int, int, int]:
    """(whole augmentation, its uniforms in one call, the same uniforms one call per purpose
    and view) kernels for both views of one batch of 32x32 uint8 images."""
    images = torch.randint(0, 256, (batch, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    index = torch.arange(batch)
    augment = DeviceAugment(BatchAugment(moco_recipe("cifar10", size, "v2"), size), seed=0, views=2)
    purposes = [(ba.CROP_COLUMN, ba.JITTER_COLUMN - ba.CROP_COLUMN), (ba.JITTER_COLUMN, 9), (ba.GRAY_COLUMN, 1), (ba.BLUR_COLUMN, 2), (ba.FLIP_COLUMN, 1)]
    key = hashing.key(0, 0)

    def per_purpose():
        for view in (0, 1):
            for first, count in purposes:
                hashing.uniforms(key, index, count, view * ba.VIEW_COLUMNS + first)
    return (counted(lambda: augment(images, 0, index)), counted(lambda: ba.keyed_uniforms(0, 0, index, views=2)),
            counted(per_purpose))


def benchmark(sizes=(16, 32), batch: int = 256, per_sample: int = 512, batched: int = 2048,
              repeats: int = 3, threads: int = 1) -> list[tuple[int, float, float]]:
    """(size, per-sample samples/s, batched samples/s) for each output size, and prints a table."""
    torch.set_num_threads(threads)
    images = torch.randint(0, 256, (max(per_sample, batched), 3, 32, 32), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(0))
    rows = []
    print(f"MoCo v2, two views of 32x32 uint8 images, {threads} thread(s), batch {batch}")
    print(f"{'size':>5} {'per-sample/s':>13} {'batched/s':>10} {'ratio':>6}")
    for size in sizes:
        slow, fast = _best_seconds([per_sample_views(images[:per_sample], size),
                                    batched_views(images[:batched], size, batch)], repeats)
        slow, fast = per_sample / slow, batched / fast  # samples (two views each) per second
        rows.append((size, slow, fast))
        print(f"{size:>5} {slow:>13,.0f} {fast:>10,.0f} {fast / slow:>5.1f}x")
    print(f"\ncolour jitter alone, ms per batch of {batch}")
    print(f"{'size':>5} {'random order':>13} {'fixed order':>12}")
    for size in sizes:
        random_order, fixed_order = jitter_order_ms(size, batch, repeats)
        print(f"{size:>5} {random_order:>13.2f} {fixed_order:>12.2f}")
    print(f"\nkernels per training step: both views of a batch of {batch}")
    print(f"{'size':>5} {'augmentation':>13} {'uniforms, one call':>19} {'one per purpose':>16} {'ratio':>6}")
    for size in sizes:
        whole, one_call, per_purpose = kernels_per_step(size, batch)
        print(f"{size:>5} {whole:>13} {one_call:>19} {per_purpose:>16} {per_purpose / one_call:>5.1f}x")
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--samples", type=int, default=512, help="images for the per-sample side")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--packed-only", action="store_true", help="only the ImageNet path's table")
    parser.add_argument("--packed-images", type=int, default=64,
                        help="images of the ImageNet path's table, in batches of up to 32; 0 leaves the table out")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.packed_images > 0:
        batch = min(32, args.packed_images)
        rows = packed_views(images=args.packed_images, batch=batch, repeats=args.repeats)
        print(f"ImageNet path, both MoCo v2 views at 224 px of packed batches of {batch}, the CPU as the device, "
              f"{args.threads} thread(s), best of {args.repeats}")
        print(f"{'':>9} {'CPU ms/img':>11} {'MB written/img':>15}")
        for name, (ms, mb) in rows.items():
            print(f"{name:>9} {ms:>11.2f} {mb:>15.1f}")
        print()
    if args.packed_only:
        return
    benchmark(tuple(args.sizes), args.batch_size, args.samples, batched=8 * args.batch_size,  # eight batches
              repeats=args.repeats, threads=args.threads)


if __name__ == "__main__":
    main()
