"""Training throughput of one configuration: the real step against its compute floor, and the
per-sample loader augmentation against the batched device module, measured side by side.

    python bench/throughput.py --script moco --arch small_cnn --device cpu --dataset digits --batch-size 64
    python bench/throughput.py --script classifier --arch resnet18 --device cuda --batch-size 512
    python bench/throughput.py --script moco --arch resnet50 --image-size 224 --batch-size 128 --preset v2

One process. The run is built as the script's ``main`` builds it: the script's own config class
parsed from the flags (any flag this tool does not know, e.g. ``--preset v2`` or ``--moco-k 4096``,
goes to the script) by ``parse_args``, a ``RunSession``, then the script's ``setup(cfg, session)``;
nothing is written under runs/ (``--out`` is a temp folder).
Each round measures, in this order:

* step: ``--steps`` optimizer steps of the script's own ``train_one_epoch`` (data fetch,
  augmentation, forward, backward, the per-step agreement, optimizer step; MoCo: also the key
  encoder with shuffle BN, the momentum update and the enqueue);
* floor: forward + backward + optimizer step of the same network on one batch that is already on
  the device, same precision and memory format (MoCo: also the key encoder's forward under
  no_grad and the queue matmul; no shuffle, no momentum update, no enqueue), ``--steps`` times;
* loader aug: the per-sample torchvision pipeline the DataLoader runs (``SeededTransform`` and
  collation, in the main process) over one batch of raw samples held in memory;
* device aug: the batched ``DeviceAugment`` on the same samples as one batch already on the
  device, ``--aug-repeats`` times.

Every timing synchronises CUDA before reading the clock; ``--warmup`` steps (and floor
iterations) run first (cudnn.benchmark's autotuning, --compile's compilation). The table keeps
the best of ``--rounds`` rounds for each measurement. MoCo's augmentation samples are two views
each. ``--table row`` prints only the markdown row and ``--table header`` only the header, to
gather several configurations in one table (bench/gpu_check.sh).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ddp_utils.config import UsageError  # noqa: E402
from ddp_utils.data.batch_augment import BatchAugment, DeviceAugment  # noqa: E402
from ddp_utils.data.pipeline import SeededTransform, padded_for_crop  # noqa: E402
from ddp_utils.data.recipes import classifier_recipe, moco_recipe  # noqa: E402
from ddp_utils.data.sets import in_memory_tensors  # noqa: E402
from ddp_utils.data.transforms import TwoCrops, view_transform  # noqa: E402
from ddp_utils.models.moco import contrastive_loss  # noqa: E402
from ddp_utils.runtime.device import memory_format, to_device  # noqa: E402
from ddp_utils.runtime.launch import detect_launch  # noqa: E402
from ddp_utils.runtime.precision import autocast  # noqa: E402
from ddp_utils.runtime.stopping import RunStopped  # noqa: E402
from ddp_utils.train.run import start_training  # noqa: E402
from ddp_utils.train.session import RunSession  # noqa: E402
from ddp_utils.train.train_config import parse_args as parse_script_args  # noqa: E402

SCRIPTS = {"classifier": ("train_classifier", "ClassifierConfig"), "moco": ("train_moco", "MocoConfig")}
DATASETS = ("synthetic", "digits", "cifar10")  # in memory: both augmentation paths apply
MAX_SYNTHETIC_BATCHES = 8  # synthetic epochs this many batches long (the set is generated up front)
COLUMNS = ("run", "data", "batch", "device", "precision", "aug on", "step ms", "img/s", "floor ms",
           "step/floor", "loader aug/s", "device aug/s", "device/loader", "peak GiB")
ALIGN = ("---", "---", "---:", "---", "---", "---", "---:", "---:", "---:", "---:", "---:", "---:", "---:", "---:")


# ----------------------------------------------------------------------------- building the run
def script_argv(args: argparse.Namespace, extra: list[str], out: str) -> list[str]:
    """The script's command line: this tool's settings, then every flag it does not know (later
    flags win, so an extra flag overrides a setting made here)."""
    argv = ["--dataset", args.dataset, "--arch", args.arch, "--batch-size", str(args.batch_size),
            "--image-size", str(args.image_size), "--aug-on", args.aug_on, "--amp", args.amp,
            "--device", args.device, "--out", out, "--epochs", "1000"]  # the schedule never ends here
    if args.compile:
        argv.append("--compile")
    if args.dataset == "synthetic" and not any(a.startswith("--synthetic-samples") for a in extra):
        batches = max(1, min(args.warmup + args.steps, MAX_SYNTHETIC_BATCHES))
        argv += ["--synthetic-samples", str(args.batch_size * batches)]
    return argv + extra


def build_run(args: argparse.Namespace, extra: list[str], out: str, stack: contextlib.ExitStack):
    """(script module, run): config parsed and the run set up as the script's ``main`` does, in a
    session that ``stack`` closes."""
    module_name, config_name = SCRIPTS[args.script]
    script = importlib.import_module(module_name)
    if detect_launch().world_size != 1:
        raise UsageError("one process only: run it with plain python, not torchrun or srun")
    cfg = parse_script_args(getattr(script, config_name), script_argv(args, extra, out), f"{module_name}.py flags")
    session = stack.enter_context(RunSession(cfg))
    return script, script.setup(cfg, session)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------- (a) the training step
class RealSteps:
    """Optimizer steps of the script's own epoch loop; each call continues where the last stopped
    (the epoch resumes part-way; a finished epoch starts the next)."""

    def __init__(self, script, run):
        self.script, self.run = script, run
        self.meter = start_training(run)
        self.meter.progress.enabled = False

    def __call__(self, steps: int) -> float:
        run = self.run
        target = run.state.step + steps
        run.cfg.max_steps = target
        sync(run.info.device)
        start = time.perf_counter()
        while run.state.step < target:
            self.script.train_one_epoch(run, self.meter)
        sync(run.info.device)
        return time.perf_counter() - start


# ----------------------------------------------------------------------------- (b) the compute floor
def floor_step_fn(args: argparse.Namespace, run):
    """One optimizer step of the bare model on a batch already on the device (with
    --accum-steps A: A forward+backward passes on that batch, then the optimizer step)."""
    cfg, device, optimizer, scaler = run.cfg, run.info.device, run.optimizer, run.scaler
    images, targets = next(iter(run.loaders.train))  # one real (augmented) batch, kept

    accum = cfg.accum_steps  # as many forward+backward passes per optimizer step as the real step

    def backward(loss: torch.Tensor) -> None:
        scaler.scale(loss / accum).backward()

    def optimizer_step() -> None:
        scaler.step(optimizer)  # a disabled scaler (no fp16) just steps
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

    if args.script == "classifier":
        x, y = to_device(images, device), targets.to(device)
        network = run.network
        network.train()

        def step() -> None:
            for _ in range(accum):
                with autocast(cfg.amp, device):
                    loss = F.cross_entropy(network(x), y)
                backward(loss)
            optimizer_step()
        return step

    im_q, im_k = (to_device(v, device) for v in images)
    moco, query = run.moco, run.network
    moco.train()

    def step() -> None:
        for _ in range(accum):
            with autocast(cfg.amp, device):
                with torch.no_grad():
                    k = F.normalize(moco.encoder_k(im_k), dim=1)
                q = F.normalize(query(im_q), dim=1)
                logits = torch.cat([(q * k).sum(1, keepdim=True), q @ moco.queue], dim=1) / moco.T
                loss, _ = contrastive_loss(logits)
            backward(loss)
        optimizer_step()
    return step


def time_repeats(fn, repeats: int, device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync(device)
    return time.perf_counter() - start


# ----------------------------------------------------------------------------- (c) augmentation
class Samples(Dataset):
    """Raw samples fetched once, so the loader side times augmentation, not data generation."""

    def __init__(self, samples: list):
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        return self.samples[index]


def augmentation_fns(args: argparse.Namespace, run):
    """(loader side, device side, samples per call of each) on the first samples of the split."""
    cfg, device = run.cfg, run.info.device
    raw = run.loaders.train_set
    size = run.resolved.image_size
    n = min(args.aug_samples or cfg.batch_size, len(raw))
    if args.script == "classifier":
        recipe, views = classifier_recipe(cfg.dataset, size, cfg.augment, cfg.normalization), 1
    else:
        recipe, views = moco_recipe(cfg.dataset, size, cfg.aug, cfg.crop_min, cfg.normalization), 2
    one_view = view_transform(recipe, cfg.dataset, size)
    loader_tf = one_view if views == 1 else TwoCrops(one_view)
    per_sample = DataLoader(SeededTransform(Samples([raw[i] for i in range(n)]), loader_tf, cfg.seed),
                            batch_size=n, num_workers=0)  # the loader path of a 0-worker DataLoader

    def loader_side() -> None:
        for _ in per_sample:
            pass

    device_augment = DeviceAugment(BatchAugment(recipe, size), cfg.seed, views)
    if run.loaders.plan.aug_on_device:  # the split the run already holds on the device (padded by build_data)
        images = run.loaders.train.images[:n]
    else:
        tensors = in_memory_tensors(raw)
        if tensors is None:
            raise UsageError(f"--dataset {cfg.dataset}: not an in-memory data set")
        images = padded_for_crop(tensors[0][:n], device_augment.augment).to(device)  # as build_data does
    index = torch.arange(n, device=device)
    device_side = lambda: device_augment(images, 0, index)  # noqa: E731
    return loader_side, device_side, n


# ----------------------------------------------------------------------------- the measurement
def measure(args: argparse.Namespace, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="throughput-") as tmp, contextlib.ExitStack() as stack:
        script, run = build_run(args, extra, str(Path(tmp) / "run"), stack)
        return measure_run(args, script, run)


def measure_run(args: argparse.Namespace, script, run) -> dict:
    device, cfg = run.info.device, run.cfg
    real_steps = RealSteps(script, run)
    floor_step = floor_step_fn(args, run)
    loader_aug, device_aug, aug_n = augmentation_fns(args, run)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    # warm-up: cudnn.benchmark's autotuning, --compile's compilation, first-call allocations
    if args.warmup:
        real_steps(args.warmup)
        time_repeats(floor_step, args.warmup, device)
    loader_aug()
    time_repeats(device_aug, 1, device)
    best = {"step": float("inf"), "floor": float("inf"), "loader": float("inf"), "device": float("inf")}
    for _ in range(args.rounds):  # interleaved, so that a noisy moment hits one round of each
        best["step"] = min(best["step"], real_steps(args.steps))
        best["floor"] = min(best["floor"], time_repeats(floor_step, args.steps, device))
        best["loader"] = min(best["loader"], time_repeats(loader_aug, 1, device))
        best["device"] = min(best["device"], time_repeats(device_aug, args.aug_repeats, device))
    images_per_step = cfg.batch_size * cfg.accum_steps
    return dict(
        cfg=cfg, device=device, image_size=run.resolved.image_size, on_device=run.loaders.plan.aug_on_device,
        precision=run.resolved.amp.replace("none", "fp32") + (" compiled" if cfg.compile else ""), aug_samples=aug_n,
        step_s=best["step"] / args.steps, floor_s=best["floor"] / args.steps,
        step_rate=images_per_step * args.steps / best["step"],
        loader_rate=aug_n / best["loader"], device_rate=aug_n * args.aug_repeats / best["device"],
        peak_gib=torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None)


# ----------------------------------------------------------------------------- the table
def header_lines() -> list[str]:
    return ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join(ALIGN) + "|"]


def describe_run(args: argparse.Namespace, cfg) -> str:
    text = f"{args.script} {cfg.arch}"
    if args.script == "moco":
        text += f" K {cfg.moco_k}, T {cfg.moco_t:g}, {'MLP' if cfg.mlp else 'linear'} head, {cfg.aug}"
    if cfg.accum_steps > 1:
        text += f", accum {cfg.accum_steps}"
    return text


def row(args: argparse.Namespace, r: dict) -> str:
    cfg, device = r["cfg"], r["device"]
    cells = [describe_run(args, cfg), f"{cfg.dataset} {r['image_size']} px", str(cfg.batch_size),
             device.type, r["precision"], "device" if r["on_device"] else "loader",
             f"{r['step_s'] * 1e3:.1f}", f"{r['step_rate']:,.0f}", f"{r['floor_s'] * 1e3:.1f}",
             f"{r['step_s'] / r['floor_s']:.2f}", f"{r['loader_rate']:,.0f}", f"{r['device_rate']:,.0f}",
             f"{r['device_rate'] / r['loader_rate']:.1f}x",
             "-" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"]
    return "| " + " | ".join(cells) + " |"


def brief_row(args: argparse.Namespace, r: dict) -> str:
    """One row of bench/gpu_check.sh's table: | part | what ran | figure | detail |."""
    cfg = r["cfg"]
    what = (f"{describe_run(args, cfg)}, {cfg.dataset} {r['image_size']} px, batch {cfg.batch_size}, "
            f"{r['precision']}, aug on {'device' if r['on_device'] else 'loader'}")
    detail = (f"step {r['step_s'] * 1e3:.1f} ms = {r['step_s'] / r['floor_s']:.2f} x floor; device aug "
              f"{r['device_rate']:,.0f}/s vs loader {r['loader_rate']:,.0f}/s"
              + ("" if r["peak_gib"] is None else f"; peak {r['peak_gib']:.1f} GiB"))
    return f"| throughput | {what} | {r['step_rate']:,.0f} img/s | {detail} |"


def preamble(args: argparse.Namespace, r: dict) -> list[str]:
    device = r["device"]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} thread(s)"
    layout = "channels_last" if memory_format(device) == torch.channels_last else "contiguous (NCHW)"
    return [f"torch {torch.__version__} on {name}; one process; {layout}; best of {args.rounds} round(s) of "
            f"{args.steps} steps after {args.warmup} warm-up steps; augmentation on {r['aug_samples']} samples"]


LEGEND = ("step: the script's train_one_epoch per optimizer step (img/s per rank); floor: forward + "
          "backward + optimizer step on a batch already on the device (MoCo: + key forward and queue "
          "matmul); loader aug: per-sample torchvision pipeline in the main process; device aug: "
          "batched module on the device (samples/s; MoCo samples are two views)")


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    # allow_abbrev=False: a prefix such as --aug belongs to the script, not to --aug-on here
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False,
                                     epilog="Other flags are passed to the script's config (e.g. --preset v2, "
                                            "--moco-k 4096, --accum-steps 2).")
    parser.add_argument("--script", choices=tuple(SCRIPTS), help="train_classifier.py or train_moco.py")
    parser.add_argument("--arch", default="small_cnn")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--aug-on", default="auto", choices=("auto", "device", "loader"),
                        help="where the training step augments (both paths are timed for the ratio)")
    parser.add_argument("--batch-size", type=int, default=64, help="images per optimizer step and rank")
    parser.add_argument("--image-size", type=int, default=0, help="0 = the data set's own")
    parser.add_argument("--dataset", default="synthetic", choices=DATASETS)
    parser.add_argument("--amp", default="auto", choices=("auto", "none", "bf16", "fp16"))
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--steps", type=int, default=10, help="timed optimizer steps per round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (autotuning, compilation)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of all four measurements; best kept")
    parser.add_argument("--aug-samples", type=int, default=0, help="samples per augmentation call; 0 = batch size")
    parser.add_argument("--aug-repeats", type=int, default=5, help="device augmentation calls per round")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads; 0 = torch's default")
    parser.add_argument("--table", default="full", choices=("full", "row", "brief", "header"),
                        help="full: description, table and legend; row: the markdown row only; brief: "
                             "gpu_check.sh's row; header: the table header only (nothing measured)")
    args, extra = parser.parse_known_args(argv)
    if args.table != "header":
        if args.script is None:
            parser.error("--script is required")
        for name in ("steps", "rounds", "aug_repeats", "batch_size"):
            if getattr(args, name) <= 0:
                parser.error(f"--{name.replace('_', '-')} must be positive")
        for name in ("warmup", "aug_samples", "threads"):
            if getattr(args, name) < 0:
                parser.error(f"--{name.replace('_', '-')} must be >= 0")
    return args, extra


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(argv)
    if args.table == "header":
        print("\n".join(header_lines()))
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        result = measure(args, extra)
    except UsageError as err:
        print(f"{Path(sys.argv[0]).name}: error: {err}", file=sys.stderr)
        return 2
    except RunStopped as stop:  # e.g. a NaN/Inf loss during the timed steps
        print(f"{Path(sys.argv[0]).name}: stopped: {stop}", file=sys.stderr)
        return stop.code
    if args.table in ("row", "brief"):
        print(row(args, result) if args.table == "row" else brief_row(args, result))
        return 0
    print("\n".join(preamble(args, result)))
    print()
    print("\n".join(header_lines() + [row(args, result)]))
    print()
    print(LEGEND)
    return 0


if __name__ == "__main__":
    sys.exit(main())
