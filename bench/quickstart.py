"""The README's MoCo quick start, end to end, with augmentation in the DataLoader (per sample,
torchvision) and on the device (batched), run one after the other on the same machine.

    python bench/quickstart.py [--rounds 2] [--seeds 0,1]
    python bench/quickstart.py --smoke      # each run one process of 2 steps: the commands and the parsing

Prints wall time and final kNN accuracy per run and the loader/device time ratio. Runs go to a
temporary folder; nothing is written into runs/.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# The README's MoCo quick start (section "MoCo quick start and linear probe"), minus --out.
QUICK_START = ["--dataset", "digits", "--device", "cpu", "--image-size", "16", "--batch-size", "32",
               "--moco-k", "128", "--moco-m", "0.99", "--lr", "0.06", "--epochs", "15", "--knn-every", "5"]


def run(aug_on: str, seed: int, out: Path, smoke: bool) -> tuple[float, float]:
    launch = [] if smoke else ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd = [sys.executable, *launch, str(REPO / "train_moco.py"), *QUICK_START, "--seed", str(seed), "--aug-on", aug_on,
           "--out", str(out), *(["--max-steps", "2"] if smoke else [])]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    seconds = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"{aug_on} seed {seed} failed:\n{proc.stderr[-3000:]}")
    return seconds, float(re.search(r"final kNN acc1 ([\d.]+)%", proc.stdout).group(1))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=1, help="repeats of each (seed, mode), interleaved")
    parser.add_argument("--seeds", default="0", help="comma-separated --seed values")
    parser.add_argument("--smoke", action="store_true", help="each run one process (no torchrun) of 2 steps")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    results: dict[str, list[tuple[float, float]]] = {"loader": [], "device": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for seed in seeds:
                for mode in ("loader", "device"):  # interleaved: both see the same machine state
                    seconds, knn = run(mode, seed, Path(tmp) / f"{mode}_{seed}_{r}", args.smoke)
                    results[mode].append((seconds, knn))
                    print(f"  --aug-on {mode:6s} seed {seed} round {r}: {seconds:6.1f} s, final kNN {knn:.2f}%",
                          flush=True)
    print("\n| --aug-on | runs | median wall s | final kNN % (each run) |\n| --- | --- | --- | --- |")
    for mode, rows in results.items():
        print(f"| {mode} | {len(rows)} | {statistics.median(s for s, _ in rows):.1f} | "
              f"{', '.join(f'{k:.2f}' for _, k in rows)} |")
    ratio = statistics.median(s for s, _ in results["loader"]) / statistics.median(s for s, _ in results["device"])
    print(f"\nloader / device wall time: {ratio:.2f}x")


if __name__ == "__main__":
    main()
