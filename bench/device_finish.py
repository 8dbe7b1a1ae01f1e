"""The JPEG path's device side, part by part, on an ImageNet-like folder (bench/imagenet_like.py):
bench/gpu_check.sh's decode, race, loader, batch-independence and breakdown rows.

    python bench/device_finish.py decode-diff --data-dir DIR --device cuda
    python bench/device_finish.py race --data-dir DIR --device cuda --iterations 50
    python bench/device_finish.py loader --data-dir DIR --device cuda --workers 8 -1
    python bench/device_finish.py independence --data-dir DIR --device cuda
    python bench/device_finish.py breakdown --data-dir DIR --device cuda

Each prints markdown rows ``| part | what ran | figure | detail |`` (gpu_check.sh's table) and
exits 0; 1 when what it checks fails (a race seen, a decode that fails or changes an image's
size), 2 on a usage error. With ``--device cpu`` every part runs the same code on the CPU (the
training process decodes, as ``--decode-on device`` does there): a check of the plumbing, not
a measurement.

* ``decode-diff``: ``files_on_device.decode_on(device, batch)`` (nvJPEG on CUDA) against ``decode_cpu``
  (libjpeg-turbo, the workers' decoder) of the same files: max and mean |diff| in uint8 levels
  over every channel value. Only the device-decodable files (baseline 3-component JPEGs) go to
  the device, as in training.
* ``race``: ``decode_on`` while a forward + backward of the network is queued on the training
  stream, launched but not synchronised (the freed activations' blocks back in the caching
  allocator), and while reductions of freed "sentinel" tensors of known values are queued behind
  it (pytorch/vision#9606's probe: a decoder handed a block that queued kernels still read
  corrupts their results). Per iteration: the decoded images against the same batch decoded on
  an idle device (bit-identical), against ``decode_cpu`` (within the idle device's own max
  |diff| from it on these files, i.e. decode-diff's figure), and the sentinels' sums against
  their known values. Reports the iterations where anything differed. ``--unprotected`` is the
  control: the same probe with decode_on's body (``files_on_device._decode_all``) run on the training
  stream, as torchvision's decoder is called without a stream of its own; a count above 0 there
  shows that the probe provokes the race the real path must not show.
* ``loader``: the training loader alone (``pipeline.build_data``'s ``FinishOnDevice`` batches:
  workers, pinned copy, decode, crops, colour, blur, normalisation; no model) in img/s, per
  workers count and ``--decode-on`` mode, over batches inside one epoch after a warm-up, with
  the share of the main process's wall time spent inside ``decode_on`` (device decode: the host
  waits there for nvJPEG).
* ``independence``: each sample's two MoCo v2 views made on the device in a packed batch of
  ``--batch-size`` images, against the same made alone at its place in the same atlas (every
  kernel on a batch of one: a kernel whose rounding follows the batch's shape shows here; bit for
  bit on the CPU, tested; exit 1 above 1e-5) and alone in an atlas of its own (resampled at other
  tile coordinates; exit 1 above 1e-3, the bound the device path promises): the max |diff|
  (normalised units) of each and the samples not bit for bit at their place.
* ``breakdown``: ``FinishOnDevice.finish`` on held batches (MoCo v2 recipe, 2 views) under
  ``torch.profiler``: per batch, the time of each ``device_finish/*`` range (on CUDA the
  kernels' device time attributed to the range, on the CPU its CPU time; ``?`` where the range
  is not in the profile), the host wall time of a whole finish (synchronised, without the
  profiler) and the peak device memory allocated.
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ddp_utils.config import UsageError  # noqa: E402
from ddp_utils.data import files_on_device  # noqa: E402
from ddp_utils.data.batch_augment import BatchAugment, DeviceAugment  # noqa: E402
from ddp_utils.data.files_on_device import EncodedBatch, decode_on, pack  # noqa: E402
from ddp_utils.data.image_files import decode_cpu, device_decodable, read_bytes  # noqa: E402
from ddp_utils.data.pipeline import DataPlan, build_data, default_workers  # noqa: E402
from ddp_utils.data.recipes import moco_recipe  # noqa: E402

RANGES = ("copy", "decode", "crop", "colour", "blur", "normalize")  # device_finish/<name>, in pipeline order
IMAGE_SUFFIXES = (".jpeg", ".jpg", ".png")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def row(part: str, what: str, figure: str, detail: str) -> str:
    return f"| {part} | {what} | {figure} | {detail} |"


def folder_files(root: str, limit: int = 0) -> list[Path]:
    """The folder's image files, train/ then val/, sorted; the first ``limit`` (0: all)."""
    files = [p for split in ("train", "val") for p in sorted((Path(root) / split).glob("*/*"))
             if p.suffix.lower() in IMAGE_SUFFIXES]
    if not files:
        raise UsageError(f"--data-dir {root}: no image files under train/ or val/")
    return files[:limit] if limit else files


def decodable(files: list[Path]) -> tuple[list[Tensor], int]:
    """(the bytes of each device-decodable file, how many files were not)."""
    data = [read_bytes(str(path)) for path in files]
    kept = [d for d in data if device_decodable(d)]
    return kept, len(data) - len(kept)


def decode_batches(device: torch.device, data: list[Tensor], batch_size: int) -> list[Tensor]:
    """Every file's pixels as ``decode_on(device, ...)`` gives them, ``batch_size`` files a call;
    raises when a file fails to decode."""
    out = []
    for start in range(0, len(data), batch_size):
        images, failed = decode_on(device, EncodedBatch.join(data[start:start + batch_size]))
        if failed:
            raise RuntimeError(f"decode_on({device}) could not decode {len(failed)} file(s) of a batch")
        out += images
    return out


def abs_diff(a: Tensor, b: Tensor) -> Tensor:
    """|a - b| of two 3 x H x W uint8 images, as int16 on ``b``'s device; raises on a size mismatch."""
    if a.shape != b.shape:
        raise RuntimeError(f"decoded sizes differ: {tuple(a.shape)} on the device, {tuple(b.shape)} on the CPU")
    return (a.to(b.device).to(torch.int16) - b.to(torch.int16)).abs()


# ----------------------------------------------------------------------------- decode-diff
def decode_diff(args: argparse.Namespace, device: torch.device) -> int:
    data, left = decodable(folder_files(args.data_dir, args.files))
    if not data:
        raise UsageError(f"--data-dir {args.data_dir}: no device-decodable JPEG among the files")
    on_device = decode_batches(device, data, args.batch_size)
    worst, total, differing, values = 0, 0, 0, 0
    for image, raw in zip(on_device, data):
        diff = abs_diff(image, decode_cpu(raw))
        worst = max(worst, int(diff.max()))
        total += int(diff.sum(dtype=torch.int64))
        differing += int((diff > 0).sum())
        values += diff.numel()
    what = (f"decode_on({device.type}) vs decode_cpu, {len(data):,} baseline JPEGs of the ImageNet-like folder, "
            f"batches of {args.batch_size}")
    print(row("device decode", what, f"max {worst}, mean {total / values:.3f}",
              f"absolute difference in uint8 levels, over every channel value; {100 * differing / values:.1f}% of values differ; "
              f"{left} other file(s) left to the CPU (not device-decodable)"))
    return 0


# ----------------------------------------------------------------------------- race
def race_model(arch: str, device: torch.device) -> torch.nn.Module:
    import torchvision

    model = getattr(torchvision.models, arch)(num_classes=1000).to(device)
    return model.to(memory_format=torch.channels_last) if device.type == "cuda" else model


def race(args: argparse.Namespace, device: torch.device) -> int:
    data, _ = decodable(folder_files(args.data_dir))
    data = data[:args.batch_size]
    if len(data) < args.batch_size:
        raise UsageError(f"--data-dir {args.data_dir}: {len(data)} device-decodable JPEGs, fewer than "
                         f"--batch-size {args.batch_size}")
    batch = EncodedBatch.join(data)
    on_cpu = [decode_cpu(raw).to(device) for raw in data]
    sync(device)
    idle = decode_batches(device, data, len(data))  # nothing else queued: the reference
    bound = max(int(abs_diff(image, cpu).max()) for image, cpu in zip(idle, on_cpu))
    shapes = [tuple(image.shape) for image in idle]

    model = race_model(args.arch, device)
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
    if device.type == "cuda":
        x = x.contiguous(memory_format=torch.channels_last)
    amp = dict(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def forward_backward() -> None:
        with torch.autocast(**amp):
            loss = model(x).float().square().mean()
        loss.backward()  # on CUDA: launched, not waited for; the activations' blocks are freed now

    forward_backward()  # warm-up: cuDNN's first calls, the allocator's pools
    model.zero_grad(set_to_none=True)
    sync(device)
    seen = {"vs idle device": 0, "vs CPU": 0, "queued reads": 0}
    differed = 0
    for iteration in range(args.iterations):
        fills = [1 + (iteration + i) % 250 for i in range(len(shapes))]
        sentinels = [torch.full(shape, v, dtype=torch.uint8, device=device) for shape, v in zip(shapes, fills)]
        expected = torch.tensor([s.numel() * v for s, v in zip(sentinels, fills)], dtype=torch.int64, device=device)
        sync(device)  # the sentinels hold their values before anything below is queued
        forward_backward()
        sums = torch.stack([s.sum(dtype=torch.int64) for s in sentinels])  # queued behind the backward
        del sentinels  # their blocks are free on the training stream while those reductions wait
        if args.unprotected:  # the control: decode_on's body on the training stream, no stream of its own
            images, failed = files_on_device._decode_all(device, batch)
        else:
            images, failed = decode_on(device, batch)  # the real code under test
        if failed or [tuple(image.shape) for image in images] != shapes:
            bad = dict.fromkeys(seen, True)
        else:  # read on the training stream, after the decode and the backward; one host read
            vs_idle = torch.stack([(image != ref).any() for image, ref in zip(images, idle)]).any()
            vs_cpu = torch.stack([abs_diff(image, cpu).max() for image, cpu in zip(images, on_cpu)]).max() > bound
            hits = torch.stack([vs_idle, vs_cpu, (sums != expected).any()]).tolist()
            bad = dict(zip(seen, hits))
        for name, hit in bad.items():
            seen[name] += hit
        differed += any(bad.values())
        del images, sums
        model.zero_grad(set_to_none=True)
    how = "unprotected decode (control: no stream of its own)" if args.unprotected else f"decode_on({device.type})"
    what = (f"{how} of {len(data)} JPEGs while a {args.arch} forward + backward at batch {args.batch_size}, "
            f"{args.image_size} px is queued, x {args.iterations}")
    detail = "; ".join(f"{name}: {n}" for name, n in seen.items())
    print(row("race probe", what, f"{differed} of {args.iterations} differed",
              f"iterations that differed {detail} (CPU bound: max absolute difference {bound}, the idle device's); "
              + ("a count above 0 shows the probe provokes the race; " if args.unprotected else "")
              + "pytorch/vision#9606 saw 199 of 200"), flush=True)
    return 1 if differed and not args.unprotected else 0


# ----------------------------------------------------------------------------- loader
def plan_for(args: argparse.Namespace, workers: int, decode_on_device: bool) -> DataPlan:
    """The MoCo v2 training data of ``--data-dir`` as train_moco.py plans it with ``--aug-on device``."""
    return DataPlan(dataset="imagefolder", data_dir=args.data_dir, image_size=args.image_size, synthetic_samples=0,
                    debug=False, seed=0, batch_size=args.batch_size, workers=workers, normalization="auto",
                    recipe=moco_recipe("imagefolder", args.image_size, "v2"), views=2, aug_on_device=True,
                    decode_on_device=decode_on_device)


class DecodeClock:
    """Wall seconds the main process spends inside ``decode_on`` when ``FinishOnDevice`` calls it
    (files_on_device's own reference wrapped, the real function called)."""

    def __init__(self):
        self.seconds, self._real = 0.0, files_on_device.decode_on

    def __enter__(self) -> DecodeClock:
        def timed(device, batch):
            started = time.perf_counter()
            try:
                return self._real(device, batch)
            finally:
                self.seconds += time.perf_counter() - started

        files_on_device.decode_on = timed
        return self

    def __exit__(self, *exc) -> None:
        files_on_device.decode_on = self._real


def resolve_workers(asked: int) -> int:
    return default_workers("imagefolder", 1) if asked == -1 else asked  # -1: every usable CPU but the rank's


def loader(args: argparse.Namespace, device: torch.device) -> int:
    counts = [resolve_workers(w) for w in args.workers]
    for mode in args.decode_on:
        for workers in counts:
            loaders = build_data(plan_for(args, workers, mode == "device"), rank=0, world_size=1, device=device)
            per_epoch = len(loaders.train)
            if args.warmup_batches + args.batches > per_epoch:
                raise UsageError(f"{per_epoch} batches of {args.batch_size} per epoch: --warmup-batches + --batches "
                                 "must fit in one (the interval stays inside the epoch)")
            loaders.set_epoch(0)
            batches = iter(loaders.train)
            with DecodeClock() as clock:
                for _ in range(args.warmup_batches):  # the workers' start, pinned buffers, first allocations
                    next(batches)
                sync(device)
                clock.seconds, started = 0.0, time.perf_counter()
                for _ in range(args.batches):
                    next(batches)
                sync(device)
                seconds = time.perf_counter() - started
            rate = args.batches * args.batch_size / seconds
            share = f"; host in decode_on {100 * clock.seconds / seconds:.0f}% of it" if mode == "device" else ""
            what = (f"FinishOnDevice batches, --decode-on {mode}, {workers} worker(s), MoCo v2 2 views, "
                    f"{args.image_size} px, batch {args.batch_size}, no model")
            print(row("loader", what, f"{rate:,.0f} img/s",
                      f"batches {args.warmup_batches + 1}-{args.warmup_batches + args.batches} of epoch 0's "
                      f"{per_epoch}, after {args.warmup_batches} warm-up{share}"), flush=True)
            del batches, loaders
            gc.collect()  # the persistent workers leave with their iterator
    return 0


# ----------------------------------------------------------------------------- independence
SHAPE_BOUND = 1e-5  # normalised units: a sample's views in a batch and alone at the same place
PLACE_BOUND = 1e-3  # normalised units: ... and alone in an atlas of its own (docs/data.md)


def independence(args: argparse.Namespace, device: torch.device) -> int:
    files = folder_files(args.data_dir)[:args.batch_size]
    images = [decode_cpu(read_bytes(str(path))) for path in files]
    recipe = moco_recipe("imagefolder", args.image_size, "v2")
    augment = DeviceAugment(BatchAugment(recipe, args.image_size), seed=0, views=2)
    index = torch.arange(len(images))
    atlas, places = pack(images)
    atlas = atlas.to(device)
    together = augment.packed(atlas, places, 0, index)
    by_shape, by_place, differing = 0.0, 0.0, 0
    for i, image in enumerate(images):
        same_place = augment.packed(atlas, places[i:i + 1], 0, index[i:i + 1])  # every kernel on a batch of one
        own_atlas, own_places = pack([image])
        alone = augment.packed(own_atlas.to(device), own_places, 0, index[i:i + 1])
        shape = max(float((view[i:i + 1] - own).abs().max()) for view, own in zip(together, same_place))
        place = max(float((view[i:i + 1] - own).abs().max()) for view, own in zip(together, alone))
        by_shape, by_place, differing = max(by_shape, shape), max(by_place, place), differing + (shape > 0)
    what = (f"MoCo v2 views on {device.type} of {len(images)} images, in one packed batch, each alone at its "
            f"place and in an atlas of its own, {args.image_size} px")
    print(row("batch independence", what, f"max {by_shape:.2g} at its place, {by_place:.2g} alone",
              f"{differing} of {len(images)} samples not bit for bit at their place; normalised units; the device "
              f"path promises at most {SHAPE_BOUND:g} and {PLACE_BOUND:g}"), flush=True)
    return 1 if by_shape > SHAPE_BOUND or by_place > PLACE_BOUND else 0


# ----------------------------------------------------------------------------- breakdown
def range_times(events, device: torch.device, batches: int) -> dict[str, float | None]:
    """Milliseconds per batch of each ``device_finish/<name>`` range in a profile's ``events``
    (``prof.events()``): on CUDA the device time of the kernels launched inside it, on the CPU
    its CPU time; None for a range the profile does not hold."""
    from torch.autograd import DeviceType

    def device_us(event) -> float:  # device_time_total: newer torch; cuda_time_total: its older name
        value = getattr(event, "device_time_total", None)
        return event.cuda_time_total if value is None else value

    out: dict[str, float | None] = {}
    for name in RANGES:
        hits = [e for e in events if e.name == f"device_finish/{name}" and e.device_type == DeviceType.CPU]
        if not hits:
            out[name] = None
            continue
        us = sum(device_us(e) if device.type == "cuda" else e.cpu_time_total for e in hits)
        out[name] = us / 1000 / batches
    return out


def breakdown(args: argparse.Namespace, device: torch.device) -> int:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    per_mode, walls, peaks = {}, {}, {}
    for mode in args.decode_on:
        loaders = build_data(plan_for(args, args.loader_workers, mode == "device"), rank=0, world_size=1,
                             device=device)
        finish = loaders.train
        needed = args.warmup_batches + args.batches
        if needed > len(finish):
            raise UsageError(f"{len(finish)} batches of {args.batch_size} per epoch: fewer than --warmup-batches + "
                             "--batches")
        loaders.set_epoch(0)
        held = []
        for batch in finish.loader:  # the workers' collated batches, held, so that only finish() is timed
            held.append(batch)  # (the workers then idle: their prefetch slots are full)
            if len(held) == needed:
                break
        warmup, timed = held[:args.warmup_batches], held[args.warmup_batches:]
        for batch in warmup:
            finish.finish(batch)
        sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        started = time.perf_counter()
        for batch in timed:
            finish.finish(batch)
        sync(device)
        walls[mode] = (time.perf_counter() - started) * 1000 / len(timed)
        peaks[mode] = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        with profile(activities=activities) as prof:
            for batch in timed:
                finish.finish(batch)
            sync(device)
        per_mode[mode] = range_times(prof.events(), device, len(timed))
        del held, warmup, timed, finish, loaders
        gc.collect()  # the persistent workers leave with their loader

    modes = args.decode_on
    said = " / ".join(f"decode on {m}" for m in modes)
    kind = "the kernels' device time" if device.type == "cuda" else "CPU time"
    setup = f"MoCo v2 2 views, {args.image_size} px, batch {args.batch_size}"
    for name in RANGES:
        cells = []
        for m in modes:
            ms = per_mode[m][name]
            cells.append("-" if name == "decode" and m == "loader" else "?" if ms is None else f"{ms:.2f}")
        print(row("device finish", f"device_finish/{name} per batch (both views), {said}", " / ".join(cells) + " ms",
                  f"{kind} inside the range, {args.batches} batches after {args.warmup_batches} warm-up; "
                  "?: the range is not in that mode's profile"))
    peak = " / ".join("-" if peaks[m] is None else f"{peaks[m]:.2f}" for m in modes)
    print(row("device finish", f"whole FinishOnDevice.finish per batch, {said}, {setup}",
              " / ".join(f"{walls[m]:.2f}" for m in modes) + " ms",
              f"host wall time, synchronised, no profiler; peak device memory allocated {peak} GiB"))
    return 0


# ----------------------------------------------------------------------------- command line
PARTS = {"decode-diff": decode_diff, "race": race, "loader": loader, "independence": independence,
         "breakdown": breakdown}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("part", choices=tuple(PARTS))
    parser.add_argument("--data-dir", required=True, help="an ImageNet-like folder (bench/imagenet_like.py)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--batch-size", type=int, default=128, help="images per batch (decode call, loader batch)")
    parser.add_argument("--image-size", type=int, default=224, help="px of the views and of the race's network input")
    parser.add_argument("--files", type=int, default=512, help="decode-diff: the first this many files; 0 = all")
    parser.add_argument("--iterations", type=int, default=50, help="race: probe iterations")
    parser.add_argument("--arch", default="resnet50", help="race: the torchvision network whose backward is queued")
    parser.add_argument("--unprotected", action="store_true",
                        help="race: the control, decode_on's body on the training stream (expected to differ on a "
                             "GPU whose decoder has the race; never an exit code 1)")
    parser.add_argument("--workers", type=int, nargs="+", default=[8, -1],
                        help="loader: workers counts, -1 = every usable CPU but one")
    parser.add_argument("--decode-on", nargs="+", default=["loader", "device"], choices=("loader", "device"),
                        help="loader, breakdown: the decode modes")
    parser.add_argument("--loader-workers", type=int, default=4, help="breakdown: workers that make the held batches")
    parser.add_argument("--warmup-batches", type=int, default=4, help="loader, breakdown: untimed batches first")
    parser.add_argument("--batches", type=int, default=16, help="loader, breakdown: timed batches")
    args = parser.parse_args(argv)
    for name in ("batch_size", "image_size", "iterations", "batches"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    for name in ("files", "warmup_batches", "loader_workers"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0")
    if any(w < -1 for w in args.workers):
        parser.error("--workers: counts >= 0, or -1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"{Path(sys.argv[0]).name}: error: --device cuda, but torch sees no usable GPU", file=sys.stderr)
        return 2
    try:
        return PARTS[args.part](args, device)
    except UsageError as err:
        print(f"{Path(sys.argv[0]).name}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
