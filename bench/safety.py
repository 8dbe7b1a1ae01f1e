"""What safety costs per optimizer step, on 2 gloo ranks (CPU), measured side by side.

    python bench/safety.py                       # resnet18 (CIFAR stem), 32 px, batch 16 per rank
    python bench/safety.py --arch small_cnn --batch-size 64 --steps 40

Runs the real training step of train_classifier.py (setup in a RunSession, train_one_epoch) on
synthetic data in four modes, interleaved over several rounds so that drift in the machine's
speed hits them alike: the per-step agreement (one all_reduce + one host read: stop signals and
non-finite losses) off and on, and on with a checkpoint every K steps (K = --ckpt-every, and 1).
Prints the median seconds per optimizer step of each mode and its ratio to the first.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import train_classifier  # noqa: E402
from ddp_utils.runtime.collectives import all_gather_object  # noqa: E402
from ddp_utils.runtime.spawn import spawn_local  # noqa: E402
from ddp_utils.runtime.stopping import StepVerdict  # noqa: E402
from ddp_utils.train.run import start_training  # noqa: E402
from ddp_utils.train.session import RunSession  # noqa: E402


def modes(ckpt_every: int) -> list[tuple[str, bool, int]]:
    return [("agreement off, no checkpoints", False, 0), ("agreement on, no checkpoints", True, 0),
            (f"agreement on, checkpoint every {ckpt_every}", True, ckpt_every),
            ("agreement on, checkpoint every step", True, 1)]


def no_agreement(nonfinite, overflow=None, give_up=False) -> StepVerdict:
    """The per-step agreement left out: no collective, no host read."""
    return StepVerdict()


def worker(rank: int, args: argparse.Namespace, out_dir: str) -> None:
    torch.set_num_threads(args.threads)
    cfg = train_classifier.ClassifierConfig(dataset="synthetic", synthetic_samples=args.samples, arch=args.arch,
                                            batch_size=args.batch_size, device="cpu", out=out_dir,
                                            keep_checkpoints=2, log_every=10**9)
    with RunSession(cfg) as session:
        measure(rank, args, out_dir, train_classifier.setup(cfg, session))


def measure(rank: int, args: argparse.Namespace, out_dir: str, run) -> None:
    meter = start_training(run)
    agreement = run.session.agree_on_step

    def steps(n: int) -> float:
        run.cfg.max_steps = run.state.step + n
        start = time.perf_counter()
        while run.state.step < run.cfg.max_steps:
            train_classifier.train_one_epoch(run, meter)
        return (time.perf_counter() - start) / n

    steps(3)  # warm-up: allocator, first DDP buckets
    times: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for name, agree, ckpt_every in modes(args.ckpt_every):
            run.session.agree_on_step = agreement if agree else no_agreement
            run.cfg.ckpt_every = ckpt_every
            times.setdefault(name, []).append(steps(args.steps))
    gathered = all_gather_object(times)
    if rank == 0:
        params = sum(p.numel() for p in run.model.parameters())
        size = (Path(out_dir) / "checkpoint_last.pt").stat().st_size
        print(f"2 gloo ranks x {args.threads} thread, {args.arch} ({params / 1e6:.1f} M parameters, "
              f"{size / 2**20:.1f} MiB checkpoint), batch {args.batch_size} per rank, 32 px; median of "
              f"{args.rounds} rounds x {args.steps} steps, slower rank")
        print(f"{'mode':40s} {'s/step':>8s} {'ratio':>7s}")
        base = None
        for name, _, _ in modes(args.ckpt_every):
            seconds = max(statistics.median(t[name]) for t in gathered)
            base = base or seconds
            print(f"{name:40s} {seconds:8.3f} {seconds / base:7.3f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", default="resnet18")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per mode and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ckpt-every", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--samples", type=int, default=100_000, help="synthetic training images")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as out_dir:
        # forkserver: the ranks fork from one process that imported the bench (and torch) once
        spawn_local(worker, 2, args, str(Path(out_dir) / "run"), start_method="forkserver")


if __name__ == "__main__":
    main()
