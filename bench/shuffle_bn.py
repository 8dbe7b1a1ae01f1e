"""Shuffle BN's communication per step: gathering the whole key batch versus one all_to_all.

    python bench/shuffle_bn.py                  # under a minute on 2 CPU cores
    python bench/shuffle_bn.py --repeats 9

Old path (gather-based, kept here as the reference): all_gather the W*N key images, broadcast
rank 0's permutation, keep N; all_gather the N x C keys to un-shuffle; all_gather them again
for the queue. New path (``models/shuffle_bn.py``: ``shuffle_to_ranks`` + ``gather_unshuffled``): no
permutation is sent (every rank derives it from the shuffle seed and the key-batch count, on the
CPU), one all_to_all in which each image goes only to the rank that encodes it, one all_gather
of the keys that serves the un-shuffle and the queue.

Prints (markdown, ready for the README):
1. bytes per rank per step, counted at the collectives' calls on 2 and 4 gloo ranks, next to
   the formula's value for the same setting;
2. the formula at 224 px, batch 32 per rank, fp32 images, 128-d keys, for W = 8 ... 1024;
3. wall time of the communication alone (no encoder: shuffle the images, bring the keys home
   and give the queue every rank's keys), median of a few repeats, old versus new;
4. the host (CPU) time the new path spends deriving the permutation and its index plan
   (``shuffle_permutation`` + ``plan_shuffle``) per key batch, at batch 32 per rank.

Bytes: "received" is what a rank gets from its peers (its own share and images it keeps are not
counted); "sent" is its own data handed to a collective for peers, counted once (a ring
all_gather forwards peers' shares too, so it physically sends about what it receives). The
all_to_all's traffic depends on the permutation: the formula uses its mean, (W-1)/W of the N
images leave and arrive. MB = 10^6 bytes.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ddp_utils.models.shuffle_bn import (  # noqa: E402
    gather_unshuffled,
    plan_shuffle,
    shuffle_permutation,
    shuffle_to_ranks,
)
from ddp_utils.runtime.collectives import all_gather_object, broadcast_, concat_all_gather  # noqa: E402
from ddp_utils.runtime.dist import cleanup_distributed, get_rank, get_world_size, init_distributed  # noqa: E402
from ddp_utils.runtime.spawn import spawn_local  # noqa: E402

KEY_DIM = 128
SETTINGS = ((32, 256), (224, 32))  # (image size, key images per rank)
FORMULA_WORLDS = (8, 16, 32, 64, 128, 256, 512, 1024)
MB = 1e6


# ----------------------------------------------------------------------------- the two paths
@torch.no_grad()
def old_step(x: torch.Tensor, encoded: torch.Tensor, perm: torch.Tensor | None = None) -> torch.Tensor:
    """Gather-based shuffle BN's communication; ``encoded`` stands in for the key encoder.
    Rank 0 draws the permutation (or takes ``perm``) and broadcasts it."""
    world, rank = get_world_size(), get_rank()
    x_all = concat_all_gather(x)  # (W*N) images on every rank
    if rank == 0:
        perm = torch.randperm(x_all.shape[0]) if perm is None else perm.clone()
    else:
        perm = torch.empty(x_all.shape[0], dtype=torch.long)
    broadcast_(perm, src=0)
    shuffled = x_all[perm.view(world, -1)[rank]]
    k = encoded[: shuffled.shape[0]]
    local = concat_all_gather(k)[torch.argsort(perm).view(world, -1)[rank]]  # un-shuffle
    return concat_all_gather(local)  # and once more for the queue


class NewPath:
    """The new path's communication, as ``MoCo.keys`` does it: key batch number ``count``."""

    def __init__(self):
        self.count = 0

    @torch.no_grad()
    def __call__(self, x: torch.Tensor, encoded: torch.Tensor) -> torch.Tensor:
        world = get_world_size()
        plan = plan_shuffle(shuffle_permutation(0, self.count, world * len(x)), get_rank(), world, x.device)
        self.count += 1
        shuffled = shuffle_to_ranks(x, plan)
        return gather_unshuffled(encoded[: shuffled.shape[0]], plan)


# ----------------------------------------------------------------------------- byte counting
class ByteCounter:
    """Wraps the collectives both paths use and adds up the bytes each rank passes to them."""

    def __init__(self):
        self.sent = self.received = 0
        self.real = {name: getattr(dist, name) for name in ("broadcast", "all_gather", "all_to_all_single")}

    def __enter__(self):
        rank, world = get_rank(), get_world_size()
        real = self.real

        def broadcast(tensor, src=0, **kwargs):
            nbytes = tensor.numel() * tensor.element_size()
            if rank == src:
                self.sent += nbytes
            else:
                self.received += nbytes
            return real["broadcast"](tensor, src=src, **kwargs)

        def all_gather(outputs, tensor, **kwargs):
            nbytes = tensor.numel() * tensor.element_size()
            self.sent += nbytes
            self.received += (world - 1) * nbytes
            return real["all_gather"](outputs, tensor, **kwargs)

        def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, **kwargs):
            row = input[0].numel() * input.element_size()
            self.sent += row * sum(s for p, s in enumerate(input_split_sizes) if p != rank)
            self.received += row * sum(s for p, s in enumerate(output_split_sizes) if p != rank)
            return real["all_to_all_single"](output, input, output_split_sizes=output_split_sizes,
                                             input_split_sizes=input_split_sizes, **kwargs)

        dist.broadcast, dist.all_gather, dist.all_to_all_single = broadcast, all_gather, all_to_all_single
        return self

    def __exit__(self, *exc):
        for name, fn in self.real.items():
            setattr(dist, name, fn)


def formula(world: int, n: int, size: int, key_dim: int = KEY_DIM) -> dict[str, float]:
    """Mean bytes per rank per step (old perm: rank 0 sends it, the W-1 others receive it; the
    new path sends no permutation)."""
    image, key, perm = 3 * size * size * 4, key_dim * 4, world * n * 8
    moved = (world - 1) / world * n  # mean images per rank that leave for (and arrive from) peers
    return {
        "old_received": (world - 1) * n * image + (world - 1) / world * perm + 2 * (world - 1) * n * key,
        "new_received": moved * image + (world - 1) * n * key,
        "old_sent": n * image + perm / world + 2 * n * key,
        "new_sent": moved * image + n * key,
    }


def planning_ms(world: int, n: int, repeats: int) -> float:
    """Median host time (ms) of the new path's permutation and index plan for one key batch."""
    times = []
    for count in range(repeats):
        start = time.perf_counter()
        plan_shuffle(shuffle_permutation(0, count, world * n), world // 2, world, torch.device("cpu"))
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


# ----------------------------------------------------------------------------- the worker
def timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()  # the step is over when the slowest rank is done
    return time.perf_counter() - start


def worker(rank: int, args: argparse.Namespace, out_dir: str) -> None:
    info = init_distributed("cpu")
    new_step = NewPath()
    torch.manual_seed(rank)
    results = []
    for size, n in SETTINGS:
        x = torch.randn(n, 3, size, size)
        encoded = torch.nn.functional.normalize(torch.randn(n, KEY_DIM), dim=1)
        old_steps = lambda: old_step(x, encoded)  # noqa: E731
        new_steps = lambda: new_step(x, encoded)  # noqa: E731
        # the new path's next permutation, given to the old one: the same global keys
        perm = shuffle_permutation(0, new_step.count, get_world_size() * n)
        reference = old_step(x, encoded, perm)
        assert torch.equal(new_steps(), reference)
        counts = {}
        for name, fn in (("old", old_steps), ("new", new_steps)):
            bytes_sent, bytes_received = [], []
            for _ in range(args.byte_steps):  # the all_to_all's traffic varies with the permutation
                with ByteCounter() as counter:
                    fn()
                bytes_sent.append(counter.sent)
                bytes_received.append(counter.received)
            counts[f"{name}_sent"] = statistics.mean(bytes_sent)
            counts[f"{name}_received"] = statistics.mean(bytes_received)
        times = {"old": [], "new": []}
        for repeat in range(args.repeats + 1):  # repeat 0 warms up
            for name, fn in (("old", old_steps), ("new", new_steps)):
                elapsed = timed(fn)
                if repeat:
                    times[name].append(elapsed)
        results.append({"size": size, "n": n, "counts": counts,
                        "old_s": statistics.median(times["old"]), "new_s": statistics.median(times["new"])})
    gathered = all_gather_object(results)
    if info.is_main:
        torch.save(gathered, Path(out_dir) / f"w{info.world_size}.pt")
    cleanup_distributed()


# ----------------------------------------------------------------------------- report
def report(measured: dict[int, list], args: argparse.Namespace) -> None:
    print(f"### Shuffle BN communication per step (gloo, CPU; MB = 10^6 bytes; mean over ranks and "
          f"{args.byte_steps} permutations)\n")
    print("| W | image | N/rank | old recv MB | new recv MB | formula old / new | old sent MB | new sent MB |")
    print("|---|---|---|---|---|---|---|---|")
    for world, per_rank in measured.items():
        for i, (size, n) in enumerate(SETTINGS):
            mean = {key: statistics.mean(r[i]["counts"][key] for r in per_rank) / MB
                    for key in per_rank[0][i]["counts"]}
            f = {key: value / MB for key, value in formula(world, n, size).items()}
            print(f"| {world} | {size} px | {n} | {mean['old_received']:.3f} | {mean['new_received']:.3f} | "
                  f"{f['old_received']:.3f} / {f['new_received']:.3f} | {mean['old_sent']:.3f} | "
                  f"{mean['new_sent']:.3f} |")
    print("\n### By formula: 224 px, batch 32 per rank, fp32 images, 128-d keys "
          "(received per rank per step, mean)\n")
    print("| W | old MB received | new MB received | old / new |")
    print("|---|---|---|---|")
    for world in FORMULA_WORLDS:
        f = formula(world, 32, 224)
        print(f"| {world} | {f['old_received'] / MB:,.1f} | {f['new_received'] / MB:,.1f} | "
              f"{f['old_received'] / f['new_received']:,.1f} |")
    print("\n### Host time of the new path's permutation + index plan per key batch "
          "(CPU, median, batch 32 per rank; main process, no other work)\n")
    print("| W | W*N | ms |")
    print("|---|---|---|")
    for world in FORMULA_WORLDS:
        print(f"| {world} | {world * 32} | {planning_ms(world, 32, 21):.3f} |")
    print(f"\n### Wall time of the communication alone (median of {args.repeats}; 1 thread per rank, "
          "ranks share the machine's cores)\n")
    print("| W | image | N/rank | old ms | new ms | old / new |")
    print("|---|---|---|---|---|---|")
    for world, per_rank in measured.items():
        for r in per_rank[0]:
            print(f"| {world} | {r['size']} px | {r['n']} | {r['old_s'] * 1e3:.1f} | {r['new_s'] * 1e3:.1f} | "
                  f"{r['old_s'] / r['new_s']:.2f} |")


def main(argv: list[str] | None = None) -> None:
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--byte-steps", type=int, default=10)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as out_dir:
        measured = {}
        for world in args.worlds:
            # forkserver: the ranks fork from one process that imported the bench (and torch) once
            spawn_local(worker, world, args, out_dir, start_method="forkserver")
            measured[world] = torch.load(Path(out_dir) / f"w{world}.pt", weights_only=True)  # plain numbers
    report(measured, args)


if __name__ == "__main__":
    main()
