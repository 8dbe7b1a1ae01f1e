"""What a CPU cannot show of the device path's CUDA branches, one table row each, for
bench/gpu_check.sh (docs/performance.md's GPU section lists them as what a first GPU run must
confirm):

    python bench/gpu_hazards.py --data-dir JPEG_FOLDER --device cuda
    python bench/gpu_hazards.py --data-dir JPEG_FOLDER --device cpu --batch-size 8 --image-size 64   # smoke

1. **switches**: a thread makes packed batches' MoCo v2 views (blur in every view) while this
   thread reads cuDNN's process-wide switches, set away from their defaults, as often as it can:
   the reads that differed (0 passes); and the blur's depthwise kernel called by name against
   ``F.conv2d`` with cuDNN off (bit for bit passes).
2. **roi index**: an atlas of tiles over ``roi_align``'s 32-bit reach (on CUDA 171 tiles of
   2,048 x 2,048, 8.6 GB in float32; on the CPU a small one with the reach lowered), one image in
   its last tile: its crops against the same crops of the image alone (within the place bound,
   1e-3, passes). One call over that atlas would read wrong pixels or fault; this one is split.
3. **out of memory**: on CUDA the GPU's memory filled to within a few MB, then a batch of JPEGs
   decoded there: it must decode or raise the device's error, never call an image refused (on
   the CPU a decoder that raises ``torch.OutOfMemoryError`` stands in).
4. **pack**: the ops ``pack_gathered`` issues for a batch against ``pack``'s (five copies an
   image), and the device time of each.
5. **memory held**: the device memory a FinishOnDevice pass of MoCo v2 batches holds while it
   runs and once it is left after a few batches, as the training loop leaves it at
   ``--max-steps`` (the float atlas and the batches made ahead let go: under a quarter passes).
6. **fp32 atlas**: the device time of both MoCo v2 views of packed batches from the float32 tiles
   against the float64 atlas of commit b89e742 (``bench/at_commit.py``), side by side.

Exit 1 when a check fails (its row says FAILED), 2 when the device asked for is not there.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.augment import KernelCounter  # noqa: E402
from bench.device_finish import decodable, folder_files, row, sync  # noqa: E402
from ddp_utils.data import batch_augment as ba  # noqa: E402
from ddp_utils.data import files_on_device  # noqa: E402
from ddp_utils.data.batch_augment import BatchAugment, DeviceAugment  # noqa: E402
from ddp_utils.data.files_on_device import DeviceMemory, EncodedBatch, decode_on, pack, pack_gathered  # noqa: E402
from ddp_utils.data.host_memory import mean_image_pixels  # noqa: E402
from ddp_utils.data.image_files import decode_cpu, image_files_of, read_bytes  # noqa: E402
from ddp_utils.data.pipeline import DataPlan, build_data  # noqa: E402
from ddp_utils.data.recipes import moco_recipe  # noqa: E402

FLOAT64_COMMIT = "b89e742"  # the last commit whose atlas is float64
PLACE_BOUND = 1e-3


def device_ms(fn, device: torch.device, repeats: int = 5) -> float:
    """Milliseconds per call of ``fn`` on ``device`` after one warm-up (CUDA events on CUDA)."""
    fn()
    sync(device)
    if device.type != "cuda":
        started = time.perf_counter()
        for _ in range(repeats):
            fn()
        return 1e3 * (time.perf_counter() - started) / repeats
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def images_of(args: argparse.Namespace) -> list[torch.Tensor]:
    return [decode_cpu(read_bytes(str(path))) for path in folder_files(args.data_dir, args.batch_size)]


def moco_views(size: int) -> DeviceAugment:
    return DeviceAugment(BatchAugment(moco_recipe("imagefolder", size, "v2"), size), seed=0, views=2)


def switches(args: argparse.Namespace, device: torch.device) -> bool:
    cudnn = torch.backends.cudnn
    kept = (cudnn.benchmark, cudnn.deterministic, cudnn.allow_tf32)
    atlas, places = pack(images_of(args))
    atlas = atlas.to(device)
    recipe = dataclasses.replace(moco_recipe("imagefolder", args.image_size, "v2"), blur_p=1.0)  # blur every view
    augment = DeviceAugment(BatchAugment(recipe, args.image_size), seed=0, views=2)
    reads = differed = 0
    try:
        cudnn.benchmark, cudnn.deterministic, cudnn.allow_tf32 = True, True, False
        wanted = (cudnn.enabled, True, True, False)
        done = threading.Event()

        def make() -> None:
            for epoch in range(args.repeats):
                augment.packed(atlas, places, epoch, torch.arange(len(places)))
                sync(device)
            done.set()

        worker = threading.Thread(target=make)
        worker.start()
        while not done.is_set() and worker.is_alive():
            reads += 1
            differed += (cudnn.enabled, cudnn.benchmark, cudnn.deterministic, cudnn.allow_tf32) != wanted
        worker.join()
    finally:
        cudnn.benchmark, cudnn.deterministic, cudnn.allow_tf32 = kept
    x = torch.rand(1, 96, 80, 90, device=device)
    taps = torch.rand(96, 1, 1, 23, device=device)
    with cudnn.flags(enabled=False):
        reference = F.conv2d(x, taps, groups=96)
    same = torch.equal(ba.depthwise(x, taps), reference)
    ok = done.is_set() and differed == 0 and same
    print(row("hazard 1: process-wide switches", f"MoCo v2 views made in a thread on {device.type} while the "
              f"training thread reads cuDNN's switches", f"{differed} of {reads:,} reads differed",
              f"the blur's kernel by name {'bit for bit' if same else 'DIFFERS from'} F.conv2d with cuDNN off"
              + ("" if ok else "; FAILED")), flush=True)
    return ok


def roi_index(args: argparse.Namespace, device: torch.device) -> bool:
    image = images_of(args)[0]
    reach = ba.ROI_ALIGN_ELEMENTS
    side = reach // (3 * 2048 * 2048) + 1 if device.type == "cuda" else 5
    tile = 2048 if device.type == "cuda" else max(image.shape[1:]) + 2
    if device.type != "cuda":  # the reach lowered: the same split on a small atlas
        ba.ROI_ALIGN_ELEMENTS = 2 * 3 * tile * tile
    try:
        return _far_crops(args, device, image, side, tile)
    finally:
        ba.ROI_ALIGN_ELEMENTS = reach


def _far_crops(args: argparse.Namespace, device: torch.device, image: torch.Tensor, side: int, tile: int) -> bool:
    tiles = torch.zeros(side, 3, tile, tile, device=device)
    h, w = image.shape[1:]
    tiles[-1, :, 1:1 + h, 1:1 + w] = image.to(device) / 255
    alone = torch.zeros(1, 3, h + 2, w + 2, device=device)
    alone[0, :, 1:1 + h, 1:1 + w] = image.to(device) / 255
    boxes = torch.tensor([[0.0, 0.0, h, w], [h / 4, w / 5, h / 2, w / 3]], device=device)
    places = torch.tensor([[(side - 1) * tile + 1, 1, h, w]] * 2, device=device)
    far = ba.crop_from_atlas(tiles, places, boxes, args.image_size)
    near = ba.crop_from_atlas(alone, torch.tensor([[1, 1, h, w]] * 2, device=device), boxes, args.image_size)
    worst = float((far - near).abs().max())
    elements = tiles.numel()
    del tiles
    ok = worst <= PLACE_BOUND
    print(row("hazard 2: roi_align's 32-bit index", f"an image in the last of {side} tiles ({elements:,} elements, "
              f"over roi_align's reach of {ba.ROI_ALIGN_ELEMENTS:,})", f"max {worst:.2g}",
              f"its crops against the image alone; at most {PLACE_BOUND:g}" + ("" if ok else "; FAILED")), flush=True)
    return ok


def out_of_memory(args: argparse.Namespace, device: torch.device) -> bool:
    data, _ = decodable(folder_files(args.data_dir, args.batch_size))
    batch = EncodedBatch.join(data)
    filler, decoder = [], files_on_device.jpeg_decoder
    if device.type == "cuda":
        chunk = 1 << 30
        while chunk >= 1 << 20:  # fill the GPU to within a MB
            try:
                filler.append(torch.empty(chunk, dtype=torch.uint8, device=device))
            except torch.OutOfMemoryError:
                chunk //= 2
        how = f"{len(data)} JPEGs decoded on a GPU filled to within 1 MB"
    else:
        def full(*_args, **_kwargs):
            raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")
        files_on_device.jpeg_decoder = lambda: (full, None)
        how = f"{len(data)} JPEGs decoded by a stand-in decoder that runs out of memory"
    try:
        images, failed = decode_on(device, batch)
        outcome, ok = f"decoded, {len(failed)} called refused", not failed
    except (torch.OutOfMemoryError, RuntimeError) as err:
        outcome, ok = f"raised {type(err).__name__}", True
    finally:
        filler.clear()
        files_on_device.jpeg_decoder = decoder
    print(row("hazard 3: out of memory called a refused image", how, outcome,
              "out of memory must be raised as it is, never retried as refused images" + ("" if ok else "; FAILED")),
          flush=True)
    return ok


def packing(args: argparse.Namespace, device: torch.device) -> bool:
    images = [image.to(device) for image in images_of(args)]
    counts = []
    for fn in (pack, pack_gathered):
        with KernelCounter() as counter:
            fn(images)
        counts.append(counter.kernels)
    times = [device_ms(lambda fn=fn: fn(images), device) for fn in (pack, pack_gathered)]
    print(row("hazard 4: the device pack's launches", f"{len(images)} decoded images packed on {device.type}",
              f"{counts[1]} ops against {counts[0]}", f"pack_gathered {times[1]:.2f} ms, pack (five copies an image) "
              f"{times[0]:.2f} ms"), flush=True)
    return counts[1] < counts[0] or len(images) < 4


def allocated(device: torch.device) -> int:
    sync(device)
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def memory_held(args: argparse.Namespace, device: torch.device) -> bool:
    plan = DataPlan(dataset="imagefolder", data_dir=args.data_dir, image_size=args.image_size, synthetic_samples=0,
                    debug=False, seed=0, batch_size=args.batch_size, workers=0, normalization="auto",
                    recipe=moco_recipe("imagefolder", args.image_size, "v2"), views=2, aug_on_device=True,
                    decode_on_device=False)
    before = allocated(device)
    loaders = build_data(plan, rank=0, world_size=1, device=device)
    loaders.set_epoch(0)
    batches = iter(loaders.train)
    taken = [next(batches) for _ in range(min(args.repeats, len(loaders.train)))]
    running = allocated(device)
    del taken, batches
    loaders.stop_making(loaders.train)  # the pass left early, as the training loop leaves it at --max-steps
    ended = allocated(device)
    atlas = loaders.train.augment.atlas_bytes
    loaders.close()
    estimate = DeviceMemory.of_pass(mean_image_pixels(image_files_of(loaders.train_set)), args.batch_size, 2,
                                    args.image_size, decode_on_device=False)
    ok = atlas == 0 and (device.type != "cuda" or ended - before < (running - before) // 4)
    print(row("hazard 5: atlases held", f"{args.repeats} training batches of {args.batch_size} (MoCo v2) on "
              f"{device.type}, then the pass left as --max-steps leaves it", f"{(ended - before) / 1e6:.1f} MB held after",
              f"{(running - before) / 1e6:.1f} MB while running (--check estimates {estimate.total / 1e6:.1f} MB: the "
              f"float atlas, made batches); float atlas kept after: {atlas} bytes" + ("" if ok else "; FAILED")),
          flush=True)
    return ok


def float_atlas(args: argparse.Namespace, device: torch.device) -> bool:
    from bench.at_commit import module_at

    images = images_of(args)
    atlas, places = pack(images)
    atlas, index = atlas.to(device), torch.arange(len(images))
    old = module_at(FLOAT64_COMMIT, "ddp_utils/data/batch_augment.py")
    at_float64 = old.DeviceAugment(old.BatchAugment(moco_recipe("imagefolder", args.image_size, "v2"), args.image_size),
                                   seed=0, views=2)
    now = moco_views(args.image_size)
    fp32 = device_ms(lambda: now.packed(atlas, places, 0, index), device, args.repeats)
    fp64 = device_ms(lambda: at_float64.packed(atlas, places, 0, index), device, args.repeats)
    print(row("hazard 9: the float64 atlas", f"both MoCo v2 views of {len(images)} images at {args.image_size} px on "
              f"{device.type}", f"{fp32 / len(images):.3f} ms/img fp32, {fp64 / len(images):.3f} fp64",
              f"float32 tiles against the float64 atlas of {FLOAT64_COMMIT}: {fp64 / fp32:.2f}x"), flush=True)
    return True


CHECKS = (switches, roi_index, out_of_memory, packing, memory_held, float_atlas)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", required=True, help="an ImageNet-like folder (bench/imagenet_like.py)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--batch-size", type=int, default=128, help="images per batch")
    parser.add_argument("--image-size", type=int, default=224, help="px of the views")
    parser.add_argument("--repeats", type=int, default=5, help="batches timed or made per check")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"{Path(sys.argv[0]).name}: error: --device cuda, but torch sees no usable GPU", file=sys.stderr)
        return 2
    results = [check(args, device) for check in CHECKS]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
