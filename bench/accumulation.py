"""Gradient accumulation on 2 gloo ranks: traffic and time per optimizer step, no_sync vs not.

    python bench/accumulation.py                      # resnet18 (CIFAR stem), batch 8, 32 px
    python bench/accumulation.py --arch small_cnn --batch-size 32 --steps 5

For A in {1, 2, 4, 8} it prints the bytes all-reduced per optimizer step divided by the gradient
bytes (1.00 with the scripts' ``no_sync`` on all but a window's last micro-step, at every A; A for
a loop that syncs on every micro-step), and the time per optimizer step of both variants,
measured side by side in the same processes.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ddp_utils.models.backbones import build_model  # noqa: E402
from ddp_utils.runtime.collectives import all_gather_object  # noqa: E402
from ddp_utils.runtime.dist import cleanup_distributed, init_distributed  # noqa: E402
from ddp_utils.runtime.spawn import spawn_local  # noqa: E402
from ddp_utils.train.accumulation import no_sync, plan_windows  # noqa: E402

ACCUM_STEPS = (1, 2, 4, 8)


def time_steps(model: DDP, optimizer, batches, steps: int, traffic: dict, skip_sync: bool) -> tuple[float, float]:
    """Median seconds per optimizer step, and all-reduced bytes per optimizer step; each step is
    one window of all ``batches`` (``skip_sync``: no_sync on all but its last micro-step)."""
    times = []
    for step in range(steps + 1):  # the first step warms up (and lets DDP rebuild its buckets)
        traffic["bytes"] = 0
        torch.distributed.barrier()
        start = time.perf_counter()
        for micro, (x, y) in zip(plan_windows(len(batches), len(batches)), batches):
            with no_sync(model, enabled=skip_sync and not micro.is_last):
                (nn.functional.cross_entropy(model(x), y) / micro.window_size).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.distributed.barrier()
        if step > 0:
            times.append(time.perf_counter() - start)
    return statistics.median(times), traffic["bytes"]


def worker(rank: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    info = init_distributed("cpu")
    torch.manual_seed(0)
    model = DDP(build_model(args.arch, 10, args.image_size))
    traffic = {"bytes": 0}

    def counting_hook(state, bucket):
        traffic["bytes"] += bucket.buffer().numel() * bucket.buffer().element_size()
        return allreduce_hook(state, bucket)

    model.register_comm_hook(None, counting_hook)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    rows = []
    for accum in ACCUM_STEPS:
        batches = [(torch.randn(args.batch_size, 3, args.image_size, args.image_size),
                    torch.randint(10, (args.batch_size,))) for _ in range(accum)]
        ours_t, ours_b = time_steps(model, optimizer, batches, args.steps, traffic, skip_sync=True)
        naive_t, naive_b = time_steps(model, optimizer, batches, args.steps, traffic, skip_sync=False)
        rows.append((accum, ours_b / grad_bytes, naive_b / grad_bytes, ours_t, naive_t))
    rows_all = all_gather_object(rows)
    if info.is_main:
        print(f"{args.arch}, {args.image_size} px, batch {args.batch_size} per rank per micro-step, "
              f"2 gloo ranks x {args.threads} thread(s), gradients {grad_bytes / 2**20:.1f} MiB, "
              f"median of {args.steps} steps")
        print(f"{'A':>3} {'bytes/grad ours':>16} {'bytes/grad naive':>17} {'s/step ours':>12} "
              f"{'s/step naive':>13} {'naive/ours':>11}")
        for accum, ob, nb, ot, nt in rows_all[0]:
            print(f"{accum:>3} {ob:>16.2f} {nb:>17.2f} {ot:>12.3f} {nt:>13.3f} {nt / ot:>11.2f}")
    del model  # no DDP model may outlive the group (runtime.dist.cleanup_distributed)
    cleanup_distributed()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", default="resnet18")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps per variant and A")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = parser.parse_args(argv)
    # forkserver: the ranks fork from one process that imported the bench (and torch) once
    spawn_local(worker, 2, args, start_method="forkserver")


if __name__ == "__main__":
    main()
