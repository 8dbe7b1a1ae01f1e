"""The kNN monitor's bank and traffic per rank, gathered (old) against sharded (new).

    python bench/knn.py                                  # M 20,000 x D 512, 2,000 queries, k 200
    python bench/knn.py --bank 40000 --rounds 5

Measured on 2 gloo ranks (CPU, random unit features, nn.Identity backbone, so a pass is the
search alone): the bytes of the bank each rank holds (the tensor the search is given), the bytes
each rank receives in collectives, the number of collectives, and the median wall time of one
``knn_accuracy`` pass (slower rank; modes interleaved over --rounds). The same quantities are then
computed by formula (checked against the measurement at the small scale) for ImageNet: M =
1,281,167, D = 2048, 50,000 queries, k = 200, W = 8 and 64, sharded bank in bf16 (the CUDA default).
Prints a markdown table.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]  # the gathered search is the tests' oracle
import knn_reference as reference  # noqa: E402

import ddp_utils.eval.knn as knn  # noqa: E402
from ddp_utils.data.order import ShardedEvalSampler  # noqa: E402
from ddp_utils.data.pipeline import data_loader  # noqa: E402
from ddp_utils.runtime.collectives import all_gather_object  # noqa: E402
from ddp_utils.runtime.dist import cleanup_distributed, init_distributed  # noqa: E402
from ddp_utils.runtime.spawn import spawn_local  # noqa: E402

IMAGENET = dict(M=1_281_167, D=2048, N=50_000, k=200)
LABEL_BYTES = 8  # int64 labels
# Tensor-level collectives, with how a received byte count follows from the tensors handed over.
GATHERS = ("all_gather", "all_gather_into_tensor", "all_gather_single", "all_to_all_single")


# ----------------------------------------------------------------------------- formulas
def gathered_cost(M: int, D: int, N: int, k: int, W: int) -> dict:
    """The gathered search (tests/knn_reference.py): every rank ends with the whole fp32 bank."""
    m = math.ceil(M / W)
    return {"bank": M * (D * 4 + LABEL_BYTES), "received": (W - 1) * m * (D * 4 + LABEL_BYTES) + 16,
            "collectives": 5}  # 2 x (size exchange + all_gather) for features and labels, 1 all_reduce


def sharded_cost(M: int, D: int, N: int, k: int, W: int, bank_bytes: int, queries_per_step: int = 1024) -> dict:
    """knn_accuracy: this rank's rows of the bank; per step the queries (fp32) go to every rank
    and each (query, rank) top list (12 bytes an entry) goes back to the query's owner."""
    m = math.ceil(M / W)
    per_rank = math.ceil(max(queries_per_step, 16) / W)
    steps = math.ceil(math.ceil(N / W) / per_rank)
    width = min(k, m)
    per_step = (W - 1) * per_rank * (D * 4 + width * 12)
    return {"bank": m * (D * bank_bytes + LABEL_BYTES), "received": (W - 1) * 3 * 8 + steps * per_step + 16,
            "collectives": 2 + 2 * steps}


# ----------------------------------------------------------------------------- measurement
class Probe:
    """Bank bytes the searches are given; collectives and bytes received (own share excluded)."""

    def __init__(self, world: int):
        self.world, self.bank, self.calls, self.received, self.depth = world, 0, 0, 0, 0

    @contextmanager
    def installed(self):
        real = {"sharded": knn.knn_predict_sharded, "gathered": reference.knn_predict}
        collectives = {n: getattr(dist, n) for n in GATHERS + ("all_reduce", "all_gather_object") if hasattr(dist, n)}

        def search(fn):
            def wrapper(features, bank, bank_labels, *args, **kwargs):
                self.bank = bank.numel() * bank.element_size() + bank_labels.numel() * bank_labels.element_size()
                return fn(features, bank, bank_labels, *args, **kwargs)
            return wrapper

        def collective(name, fn):
            def wrapper(*args, **kwargs):
                if self.depth == 0:
                    self.calls += 1
                    out = args[0]
                    size = sum(t.numel() * t.element_size() for t in (out if isinstance(out, list) else [out])) \
                        if name != "all_gather_object" else 0  # a few pickled ints
                    self.received += size if name == "all_reduce" else size * (self.world - 1) // self.world
                self.depth += 1
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.depth -= 1
            return wrapper

        knn.knn_predict_sharded, reference.knn_predict = search(real["sharded"]), search(real["gathered"])
        for name, fn in collectives.items():
            setattr(dist, name, collective(name, fn))
        try:
            yield self
        finally:
            knn.knn_predict_sharded, reference.knn_predict = real["sharded"], real["gathered"]
            for name, fn in collectives.items():
                setattr(dist, name, fn)


def worker(rank: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    info = init_distributed("cpu")
    gen = torch.Generator().manual_seed(0)  # the same data on every rank; each loads its shard
    bank = TensorDataset(torch.randn(args.bank, args.dim, generator=gen), torch.randint(0, 100, (args.bank,), generator=gen))
    val = TensorDataset(torch.randn(args.queries, args.dim, generator=gen), torch.randint(0, 100, (args.queries,), generator=gen))
    loaders = [data_loader(data, ShardedEvalSampler(data, info.world_size, info.rank), batch_size=500, workers=0,
                           pin_memory=False, train=False) for data in (bank, val)]
    modes = {"gathered": reference.knn_accuracy_gathered, "sharded": knn.knn_accuracy}
    times: dict[str, list[float]] = {name: [] for name in modes}
    facts: dict[str, dict] = {}
    for round_ in range(args.rounds + 1):  # round 0 warms up and measures bytes
        for name, fn in modes.items():
            probe = Probe(info.world_size)
            with probe.installed():
                dist.barrier()
                start = time.perf_counter()
                acc = fn(nn.Identity(), *loaders, 100, info.device, k=args.k, T=0.1)
                seconds = time.perf_counter() - start
            if round_ == 0:
                facts[name] = {"bank": probe.bank, "received": probe.received, "collectives": probe.calls, "acc": acc}
            else:
                times[name].append(seconds)
    gathered = all_gather_object((facts, times))
    if rank == 0:
        report(args, info.world_size, gathered)
    cleanup_distributed()


# ----------------------------------------------------------------------------- report
def fmt_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def report(args: argparse.Namespace, world: int, per_rank: list) -> None:
    facts = {name: {key: max(f[name][key] for f, _ in per_rank) for key in ("bank", "received", "collectives")}
             for name in ("gathered", "sharded")}
    assert per_rank[0][0]["gathered"]["acc"] == per_rank[0][0]["sharded"]["acc"], "sharded != gathered accuracy"
    seconds = {name: max(statistics.median(t[name]) for _, t in per_rank) for name in ("gathered", "sharded")}
    small = dict(M=args.bank, D=args.dim, N=args.queries, k=args.k)
    formula = {"gathered": gathered_cost(**small, W=world), "sharded": sharded_cost(**small, W=world, bank_bytes=4)}
    for name in facts:  # the formulas must reproduce what was measured
        for key in ("bank", "received", "collectives"):
            assert facts[name][key] == formula[name][key], (name, key, facts[name][key], formula[name][key])
    print(f"kNN monitor, one pass: bank M x D, N queries, k={args.k}; per rank; gathered bank fp32. Measured on "
          f"{world} gloo ranks x {args.threads} thread (median of {args.rounds} rounds, slower rank; measured "
          f"bytes equal the formula); ImageNet rows by formula.\n")
    print("| setting | W | bank per rank: gathered | bank per rank: sharded | received per rank: gathered "
          "| received per rank: sharded | collectives: gathered | collectives: sharded | time: gathered "
          "| time: sharded |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    g, s = facts["gathered"], facts["sharded"]
    print(f"| measured: M {args.bank:,}, D {args.dim}, N {args.queries:,} | {world} | {fmt_bytes(g['bank'])} "
          f"| {fmt_bytes(s['bank'])} (fp32) | {fmt_bytes(g['received'])} | {fmt_bytes(s['received'])} "
          f"| {g['collectives']} | {s['collectives']} | {seconds['gathered']:.2f} s | {seconds['sharded']:.2f} s |")
    for W in (8, 64):
        g, s = gathered_cost(**IMAGENET, W=W), sharded_cost(**IMAGENET, W=W, bank_bytes=2)
        print(f"| formula: ImageNet M {IMAGENET['M']:,}, D {IMAGENET['D']}, N {IMAGENET['N']:,} | {W} "
              f"| {fmt_bytes(g['bank'])} | {fmt_bytes(s['bank'])} (bf16) | {fmt_bytes(g['received'])} "
              f"| {fmt_bytes(s['received'])} | {g['collectives']} | {s['collectives']} | - | - |")
    print("\nBank bytes include the int64 labels. The gathered search also holds the all_gather's output "
          "and its concatenation at once (about 2x its bank) while gathering; the sharded search's "
          "scratch per step is (W x ceil(1024 / W)) queries x min(32,768, M / W) bank rows x 16 bytes "
          "(fp32 similarity, int32 and int64 keys: at most 0.54 GB) plus, for a bf16 bank, the fp32 copy "
          "of one block (0.27 GB at D 2048), whatever M.")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bank", type=int, default=20_000, help="bank rows M")
    parser.add_argument("--dim", type=int, default=512, help="feature dimension D")
    parser.add_argument("--queries", type=int, default=2_000, help="validation queries N")
    parser.add_argument("--k", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = parser.parse_args(argv)
    # forkserver: the ranks fork from one process that imported the bench (and torch) once
    spawn_local(worker, 2, args, start_method="forkserver")


if __name__ == "__main__":
    main()
