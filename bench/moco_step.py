"""Where a MoCo optimizer step spends its time, on 2 gloo ranks (CPU), measured side by side.

    python bench/moco_step.py                          # resnet18 (CIFAR stem), 32 px, batch 32
    python bench/moco_step.py --arch small_cnn --batch-size 64 --steps 10

Prints the share of each part of one step (query forward+backward, key forward with shuffle BN,
enqueue, optimizer step, momentum update), the ratio of the full step to the compute
floor (query forward+backward plus a bare key-encoder forward), and the fused momentum update
(one torch._foreach_lerp_) against a Python loop over the parameters.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ddp_utils.models.backbones import build_model, without_head  # noqa: E402
from ddp_utils.models.moco import Encoder, MoCo, contrastive_loss  # noqa: E402
from ddp_utils.runtime.collectives import all_gather_object  # noqa: E402
from ddp_utils.runtime.dist import cleanup_distributed, init_distributed  # noqa: E402
from ddp_utils.runtime.spawn import spawn_local  # noqa: E402


def timed(fn, times: dict, name: str):
    torch.distributed.barrier()  # parts start together, so a part's time includes its waiting
    start = time.perf_counter()
    out = fn()
    times.setdefault(name, []).append(time.perf_counter() - start)
    return out


def loop_momentum_update(moco: MoCo, m: float) -> None:
    """The per-parameter Python loop that the fused update replaces."""
    with torch.no_grad():
        for k, q in zip(moco.encoder_k.parameters(), moco.encoder_q.parameters()):
            k.mul_(m).add_(q.detach(), alpha=1 - m)


def worker(rank: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    info = init_distributed("cpu")
    torch.manual_seed(0)
    backbone = build_model(args.arch, 10, args.image_size)
    _, width = without_head(backbone, 10)
    moco = MoCo(Encoder(backbone, width, 128, mlp=True), dim=128, K=args.moco_k, T=0.2)
    query = DDP(moco.encoder_q)
    optimizer = torch.optim.SGD(moco.encoder_q.parameters(), lr=0.03, momentum=0.9, weight_decay=1e-4)
    im_q, im_k = (torch.randn(args.batch_size, 3, args.image_size, args.image_size) for _ in range(2))
    parts: dict[str, list[float]] = {}
    totals: list[float] = []
    for step in range(args.steps + 1):  # step 0 warms up
        times: dict[str, list[float]] = {}
        # The parts, one by one (the same work as MoCo.forward + backward + enqueue + update).
        q = timed(lambda: F.normalize(query(im_q), dim=1), times, "query forward+backward")
        keys = timed(lambda: moco.keys(im_k), times, "key forward (shuffle BN)")  # (W*N) x C
        k = keys[rank * args.batch_size:(rank + 1) * args.batch_size]  # this rank's N x C

        def loss_and_backward():
            logits = torch.cat([(q * k).sum(1, keepdim=True), q @ moco.queue.clone()], dim=1) / moco.T
            contrastive_loss(logits)[0].backward()

        timed(loss_and_backward, times, "query forward+backward")
        timed(lambda: moco.enqueue(keys), times, "enqueue")
        timed(lambda: (optimizer.step(), optimizer.zero_grad(set_to_none=True)), times, "optimizer step")
        timed(lambda: moco.momentum_update(0.999), times, "momentum update")
        with torch.no_grad():
            timed(lambda: moco.encoder_k(im_k), times, "bare key forward")
        # The real step, whole.
        start = time.perf_counter()
        logits, all_keys = moco(im_q, im_k, query)
        contrastive_loss(logits)[0].backward()
        moco.enqueue(all_keys)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        moco.momentum_update(0.999)
        torch.distributed.barrier()
        if step > 0:
            totals.append(time.perf_counter() - start)
            for name, values in times.items():
                parts.setdefault(name, []).append(sum(values))
    fused, loop = [], []
    for _ in range(args.momentum_repeats):
        start = time.perf_counter()
        moco.momentum_update(0.999)
        fused.append(time.perf_counter() - start)
        start = time.perf_counter()
        loop_momentum_update(moco, 0.999)
        loop.append(time.perf_counter() - start)
    result = ({n: statistics.median(v) for n, v in parts.items()}, statistics.median(totals),
              statistics.median(fused), statistics.median(loop), len(list(moco.encoder_q.parameters())))
    gathered = all_gather_object(result)
    if info.is_main:
        report(args, *gathered[0])
    query = None  # no DDP model may outlive the group (runtime.dist.cleanup_distributed)
    cleanup_distributed()


def report(args, parts: dict[str, float], total: float, fused: float, loop: float, n_params: int) -> None:
    print(f"{args.arch}, {args.image_size} px, batch {args.batch_size} per rank, K={args.moco_k}, "
          f"2 gloo ranks x {args.threads} thread(s), median of {args.steps} steps")
    step_parts = [n for n in parts if n != "bare key forward"]
    parts_sum = sum(parts[n] for n in step_parts)
    for name in step_parts:
        print(f"  {name:<26} {parts[name] * 1e3:9.1f} ms  {100 * parts[name] / parts_sum:5.1f} %")
    floor = parts["query forward+backward"] + parts["bare key forward"]
    print(f"  {'sum of parts':<26} {parts_sum * 1e3:9.1f} ms")
    print(f"  full step, timed whole      {total * 1e3:8.1f} ms")
    shuffle = parts["key forward (shuffle BN)"] - parts["bare key forward"]
    print(f"  shuffle BN's share of the key forward (all_to_all + key all_gather) {shuffle * 1e3:.1f} ms")
    print(f"  compute floor (query fwd+bwd + bare key fwd) {floor * 1e3:.1f} ms; "
          f"full step / floor = {total / floor:.2f}")
    print(f"momentum update over {n_params} tensors: fused {fused * 1e3:.2f} ms, Python loop "
          f"{loop * 1e3:.2f} ms, loop/fused = {loop / fused:.2f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", default="resnet18")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--moco-k", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--momentum-repeats", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    # forkserver: the ranks fork from one process that imported the bench (and torch) once
    spawn_local(worker, 2, args, start_method="forkserver")


if __name__ == "__main__":
    main()
