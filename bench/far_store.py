"""Training from an object store near and far, measured side by side in one run.

    python bench/far_store.py                          # 2,400 + 120 ImageNet-like images in 1 MB shards
    python bench/far_store.py --before 28751f1         # and the code of another commit, with the same data
    python bench/far_store.py --rounds 3               # each run 3 times, interleaved: the median

A local S3 server (moto) holds the shards of an ImageNet-like folder (``bench/imagenet_like.py``,
written by ``write_shards.py``); ``tests/far_network.py``'s proxy sits in front of it. Each row
is a real 2-rank MoCo run of ``train_moco.py`` under torchrun (2 DataLoader workers per rank, a
node cache smaller than the training split: the size ``--shard-cache-gb 0`` gives, ``--epochs``
epochs), whose requests the proxy counts:

* near: the proxy with no latency and no cap (the loopback server as it is);
* far: ``--latency-ms`` per request and ``--mbps`` MB/s per connection (100 ms and 2 MB/s: one
  connection carries about a third of what a rank reads here, as 100 MB/s does against the
  320 MB/s a GPU rank needs at 2,500 img/s of ImageNet);
* far, slow connections: the same latency and ``--slow-mbps`` MB/s per connection (0.3: a tenth,
  as a far region's 10-30 MB/s against a GPU rank's 320 MB/s), which only many downloads in
  flight carry;
* far, no read-ahead: the far network, each rank fetching only what its workers ask for, two
  shards at a time (``--shard-read-ahead 0 --shard-downloads 2``);
* ``--before REV``: the far and near rows run with the code of commit REV (a git worktree).

Printed per run and epoch: images per second, the share of the epoch the training loop waited for
data (the epoch's own log line) beside the near run's, the most downloads in flight the run's log
reports, and, per shard of the store: GETs, HEADs, ranged requests and MB downloaded. The figures
in docs/performance.md come from this command.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]  # the far network is the object-store tests' proxy
from far_network import FarNetwork  # noqa: E402

import write_shards  # noqa: E402
from bench.imagenet_like import write_imagenet_like  # noqa: E402
from bench.shards import start_s3  # noqa: E402

EPOCH_LINE = re.compile(r"epoch (\d+) trained in [\d.]+ s \((?:resumed part way, )?([\d,]+) img/s, waited for data "
                        r"(\d+)% of it\)")
IN_FLIGHT_LINE = re.compile(r"the read-ahead keeps up to \d+ download\(s\) in flight \((\d+) at most this epoch")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=2400, help="training images (val: a twentieth)")
    parser.add_argument("--shard-mb", type=float, default=1.0, help="MB per shard (write_shards.py --shard-mb)")
    parser.add_argument("--latency-ms", type=float, default=100.0, help="ms the far network adds to each request")
    parser.add_argument("--mbps", type=float, default=2.0, help="MB/s of each connection through the far network")
    parser.add_argument("--slow-mbps", type=float, default=0.3,
                        help="MB/s of each connection in the far row of slow connections")
    parser.add_argument("--epochs", type=int, default=2, help="epochs of each run")
    parser.add_argument("--batch-size", type=int, default=32, help="images per rank per step")
    parser.add_argument("--image-size", type=int, default=64, help="px the network sees")
    parser.add_argument("--before", default="", help="also run the code of this git revision (a worktree)")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of every run, interleaved; the median is printed")
    parser.add_argument("--work", default="", help="folder for the data and the runs (default: a temporary one)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one epoch: that it runs, not figures")
    args = parser.parse_args(argv)
    if args.smoke:
        args.images, args.shard_mb, args.latency_ms, args.epochs, args.batch_size = 24, 0.2, 10.0, 1, 4
    return args


def train(repo: Path, data_dir: str, out: Path, args: argparse.Namespace, extra: list[str], endpoint: str
          ) -> tuple[list[tuple[int, float, int, int | None]], float]:
    """One 2-rank MoCo run of ``repo``'s train_moco.py from ``data_dir``: [(epoch, img/s, data wait
    %, most downloads in flight or None)] from its log (kept in ``out``/log.txt), and its wall
    seconds."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(repo / "train_moco.py"), "--dataset", "shards", "--data-dir", data_dir, "--device", "cpu",
               "--arch", "small_cnn", "--image-size", str(args.image_size), "--batch-size", str(args.batch_size),
               "--workers", "2", "--moco-k", "256", "--knn-every", "0", "--epochs", str(args.epochs),
               "--log-every", "1000", "--shard-cache-dir", str(out / "cache"), "--out", str(out / "run"), *extra]
    env = {**os.environ, "AWS_ENDPOINT_URL": endpoint, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(repo)}
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    proc = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True)
    took = time.perf_counter() - started
    (out / "log.txt").write_text(proc.stdout + proc.stderr)  # the run's own lines, to read its phases
    if proc.returncode != 0:
        raise SystemExit(f"far_store: the run in {out} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    in_flight = [int(most) for most in IN_FLIGHT_LINE.findall(proc.stdout)] or [None] * args.epochs  # rank 0's
    epochs = [(int(e), float(rate.replace(",", "")), int(wait), most)
              for (e, rate, wait), most in zip(EPOCH_LINE.findall(proc.stdout), in_flight)]
    return epochs, took


def shard_requests(requests: list, shard_names: set[str]) -> dict[str, float]:
    """GETs, HEADs, ranged requests and MB per shard of the store, from the proxy's log."""
    per_shard = [r for r in requests if r.path.rsplit("/", 1)[-1] in shard_names]
    kinds = Counter(r.method for r in per_shard)
    shards = len(shard_names)
    return {"GET": kinds["GET"] / shards, "HEAD": kinds["HEAD"] / shards,
            "ranged": sum(r.range_header is not None for r in per_shard) / shards,
            "MB": sum(r.response_bytes for r in per_shard) / 1e6 / shards}


def summary(rounds: list) -> tuple[dict[int, tuple[float, float, int | None]], float, dict[str, float]]:
    """A run's rounds as one row: per epoch the median img/s and data wait and the most downloads
    in flight, the median wall seconds, and the requests of its first round (the same every round)."""
    epochs = sorted({epoch for run_epochs, _, _ in rounds for epoch, *_ in run_epochs})
    per_epoch = {}
    for epoch in epochs:
        rows = [row for run, _, _ in rounds for row in run if row[0] == epoch]
        flights = [most for *_, most in rows if most is not None]
        per_epoch[epoch] = (statistics.median(rate for _, rate, _, _ in rows),
                            statistics.median(wait for _, _, wait, _ in rows), max(flights) if flights else None)
    return per_epoch, statistics.median(took for _, took, _ in rounds), rounds[0][2]


def node_cache_gb(bucket: str, shards: Path, args: argparse.Namespace, work: Path) -> float:
    """GB of the node cache every run gets: what ``--shard-cache-gb 0`` sizes it to for these
    runs (the pre-flight's own sum; below the training split), rounded up to a kB. Passed to
    each run as it is, so that a ``--before`` revision gets the same."""
    import torch

    from ddp_utils.data.shards import ShardIndex
    from ddp_utils.train.preflight import check_cache_room, resolved_settings
    from train_moco import MocoConfig, script_data

    cfg = MocoConfig(dataset="shards", data_dir=bucket, workers=2, batch_size=args.batch_size, knn_every=0,
                     image_size=args.image_size, shard_cache_dir=str(work / "sizing"))
    resolved = resolved_settings(cfg, "torchrun", 2, torch.device("cpu"), world_size=2)
    indexes = tuple(ShardIndex.read(str(shards / split)) for split in ("train", "val"))
    return math.ceil(check_cache_room(cfg, resolved, indexes, ranks_on_node=2, node="0", script=script_data(cfg)) / 1e3) / 1e6


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="far-store-"))
    folder, shards = work / f"imagenet_like-{args.images}", work / f"shards-{args.shard_mb:g}mb-{args.images}"
    if not (folder / "train").is_dir():
        write_imagenet_like(folder, classes=3, train_per_class=args.images // 3,
                            val_per_class=max(1, args.images // 60), oddities=False)  # val: a twentieth
    if not shards.exists():
        assert write_shards.main([str(folder), str(shards), "--shard-mb", str(args.shard_mb)]) == 0
    names = {p.name for p in (shards / "train").glob("*.tar")}  # the kNN monitor is off: val is not read
    train_mb = sum(p.stat().st_size for p in (shards / "train").glob("*.tar")) / 1e6
    s3 = start_s3(shards)
    if s3 is None:
        raise SystemExit("far_store: moto_server is missing; pip install -r requirements-dev.txt")
    server, bucket = s3
    port = int(os.environ["AWS_ENDPOINT_URL"].rsplit(":", 1)[1])
    node_gb = node_cache_gb(bucket, shards, args, work)
    before = None
    if args.before:
        before = work / f"before-{args.before}"
        if not before.exists():
            subprocess.run(["git", "worktree", "add", "--detach", str(before), args.before], cwd=REPO, check=True,
                           capture_output=True)
    results: dict[str, list] = {}  # run: [(epochs, wall s, requests) per round]
    try:
        with FarNetwork(("127.0.0.1", port), latency_s=None, bytes_per_s=None) as proxy:
            far, slow = (args.latency_ms / 1000, args.mbps * 1e6), (args.latency_ms / 1000, args.slow_mbps * 1e6)
            runs = [("near", REPO, None, []), ("far", REPO, far, []),
                    (f"far, {args.slow_mbps:g} MB/s per connection", REPO, slow, []),
                    ("far, no read-ahead", REPO, far, ["--shard-read-ahead", "0", "--shard-downloads", "2"])]
            if args.smoke:  # that it runs, not the figures
                runs = runs[1:2]
            if before is not None:
                runs += [(f"near, {args.before}", before, None, []), (f"far, {args.before}", before, far, [])]
            for round_ in range(args.rounds):  # the runs interleaved: a slow minute of the machine hits each alike
                for name, repo, network, extra in runs:
                    cache = ["--shard-cache-gb", f"{node_gb if repo == REPO else node_gb / 2:.6f}"]  # then: per rank
                    latency_s, bytes_per_s = network or (None, None)
                    proxy.set(latency_s=latency_s, bytes_per_s=bytes_per_s)
                    first = len(proxy.requests)
                    out = work / "runs" / re.sub(r"\W+", "-", name)
                    shutil.rmtree(out, ignore_errors=True)
                    epochs, took = train(repo, bucket, out, args, cache + extra, proxy.url)
                    results.setdefault(name, []).append((epochs, took, shard_requests(proxy.requests[first:], names)))
                    print(f"round {round_ + 1}, {name}: {took:.0f} s", file=sys.stderr, flush=True)
    finally:
        server.terminate()
        if before is not None:
            subprocess.run(["git", "worktree", "remove", "--force", str(before)], cwd=REPO, capture_output=True)
    print(f"\n{args.images} training images in {len(names)} shards of about {args.shard_mb:g} MB ({train_mb:.0f} MB), "
          f"2 ranks x 2 workers, batch {args.batch_size}, {args.image_size} px; node cache "
          f"{node_gb * 1e3:.0f} MB; far: {args.latency_ms:g} ms per request, {args.mbps:g} MB/s per connection "
          f"({args.slow_mbps:g} MB/s in the slow row); median of {args.rounds} round(s), runs interleaved\n")
    table = {name: summary(rounds) for name, rounds in results.items()}
    near = table.get("near", next(iter(table.values())))[0]
    print("| run | epoch | img/s | vs near | waited for data | near waited | downloads in flight, at most | "
          "GET per shard | HEAD | ranged | MB per shard | wall s |\n"
          "| --- | --: | --: | --: | --: | --: | --: | --: | --: | --: | --: | --: |")
    for name, (epochs, took, requests) in table.items():
        for epoch, (rate, wait, most) in epochs.items():
            print(f"| {name} | {epoch} | {rate:,.0f} | {rate / near[epoch][0]:.2f}x | {wait:.0f}% | "
                  f"{near[epoch][1]:.0f}% | {'' if most is None else most} | {requests['GET']:.2f} | "
                  f"{requests['HEAD']:.2f} | {requests['ranged']:.2f} | {requests['MB']:.2f} | {took:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
