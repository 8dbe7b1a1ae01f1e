"""The README's accuracy figures, measured over seeds: the classifier quick start, the MoCo quick
start's kNN at epochs 0/5/10/15, and the digits probe of its backbone beside a random one.

    python bench/readme_figures.py [--seeds 0,1,2,3,4] [--kernels native,avx2] [--runs ...] [--keep DIR]

Each seed runs the README's commands (2 CPU ranks under torchrun) with ``--seed`` added, the
probe on that seed's MoCo run; ``--runs`` picks them (``symmetric``: the MoCo quick start with
``--symmetric``, the report table's second row). ``--kernels avx2`` runs them again with PyTorch's and oneDNN's
AVX2 kernels (``ATEN_CPU_CAPABILITY=avx2``, ``ONEDNN_MAX_CPU_ISA=AVX2``) on a CPU that has
AVX-512: CPU kernels round differently per instruction set, so a figure that repeats bit for bit
on one CPU type need not on another. Prints each run's figures and, per figure and kernel set,
the range over seeds. Runs go to a temporary folder unless ``--keep DIR``. ``--smoke`` runs each
command as one process (no torchrun) of 2 optimizer steps, its kNN at epochs 0 and 1: the
commands and the parsing of their logs, not the figures.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# The README's commands ("Two commands", "MoCo quick start and linear probe"), minus --out.
CLASSIFIER = ["train_classifier.py", "--dataset", "digits", "--device", "cpu", "--batch-size", "32",
              "--lr", "0.05", "--warmup-steps", "20", "--epochs", "14"]
MOCO = ["train_moco.py", "--config", "recipes/moco_digits_quickstart.json"]
PROBE = ["train_classifier.py", "--config", "recipes/probe_digits.json"]
KERNELS = {"native": {}, "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}}
KNN_EPOCHS, SMOKE_KNN_EPOCHS = (0, 5, 10, 15), (0, 1)  # the quick start's --knn-every 5; --smoke: start and end
SMOKE_STEPS = 2


def figures_of(run: str, knn_epochs: tuple[int, ...] = KNN_EPOCHS) -> tuple[str, ...]:
    return {"classifier": ("classifier",), "moco": tuple(f"kNN epoch {e}" for e in knn_epochs),
            "probe": ("probe", "random probe"), "symmetric": tuple(f"symmetric kNN epoch {e}" for e in knn_epochs)}[run]


RUNS = ("classifier", "moco", "probe", "symmetric")


def torchrun(args: list[str], env: dict[str, str], smoke: bool) -> str:
    """``args`` under torchrun on 2 CPU ranks; ``smoke``: one plain process of SMOKE_STEPS steps."""
    if smoke:
        cmd = [sys.executable, *args, "--max-steps", str(SMOKE_STEPS)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *args]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, **env})
    if proc.returncode:
        raise SystemExit(f"{' '.join(args[:3])} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.stdout + proc.stderr


def final_val_acc(log: str) -> float:
    return float(re.search(r"final val acc1 ([\d.]+)%", log).group(1))


def knn_by_epoch(log: str, prefix: str = "") -> dict[str, float]:
    return {f"{prefix}kNN epoch {epoch}": float(acc)
            for epoch, acc in re.findall(r"epoch (\d+) step \d+: kNN acc1 ([\d.]+)%", log)}


def figures_of_seed(seed: int, runs: list[str], env: dict[str, str], out: Path, smoke: bool) -> dict[str, float]:
    seed_flag = ["--seed", str(seed)]
    found = {}

    def run(args: list[str]) -> str:
        return torchrun(args, env, smoke)

    if "classifier" in runs:
        found["classifier"] = final_val_acc(run(CLASSIFIER + seed_flag + ["--out", str(out / "classifier")]))
    if "moco" in runs or "probe" in runs:
        found.update(knn_by_epoch(run(MOCO + seed_flag + ["--out", str(out / "moco")])))
    if "probe" in runs:
        found["probe"] = final_val_acc(run(PROBE + seed_flag + ["--pretrained", str(out / "moco"),
                                                                "--out", str(out / "probe")]))
        found["random probe"] = final_val_acc(run(PROBE + seed_flag + [
            "--pretrained", "", "--image-size", "16", "--out", str(out / "probe_random")]))
    if "symmetric" in runs:
        found.update(knn_by_epoch(run(MOCO + seed_flag + ["--symmetric", "--out", str(out / "symmetric")]),
                                  "symmetric "))
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated --seed values")
    parser.add_argument("--kernels", default="native", help=f"comma-separated kernel sets: {', '.join(KERNELS)}")
    parser.add_argument("--runs", default="classifier,moco,probe", help=f"comma-separated: {', '.join(RUNS)}")
    parser.add_argument("--keep", type=Path, help="write the runs here (KERNELS/seedN/...) instead of a temporary folder")
    parser.add_argument("--smoke", action="store_true", help=f"each command one process (no torchrun) of {SMOKE_STEPS} steps")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    kernels = args.kernels.split(",")
    runs = args.runs.split(",")
    if unknown := set(kernels) - set(KERNELS):
        parser.error(f"unknown kernel set {sorted(unknown)}; choose from {', '.join(KERNELS)}")
    if unknown := set(runs) - set(RUNS):
        parser.error(f"unknown run {sorted(unknown)}; choose from {', '.join(RUNS)}")
    knn_epochs = SMOKE_KNN_EPOCHS if args.smoke else KNN_EPOCHS
    figures = [figure for run in runs for figure in figures_of(run, knn_epochs)]
    results: dict[tuple[str, int], dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        for kernel in kernels:
            for seed in seeds:
                results[kernel, seed] = found = figures_of_seed(seed, runs, KERNELS[kernel], root / kernel / f"seed{seed}",
                                                            args.smoke)
                print(f"  {kernel:6s} seed {seed}: " + ", ".join(f"{k} {found[k]:.2f}" for k in figures), flush=True)
    print("\n| figure | kernels | range over seeds " + ",".join(map(str, seeds)) + " | each seed |\n| --- | --- | --- | --- |")
    for figure in figures:
        for kernel in kernels:
            values = [results[kernel, seed][figure] for seed in seeds]
            print(f"| {figure} | {kernel} | {min(values):.2f}-{max(values):.2f}% | "
                  f"{' / '.join(f'{v:.2f}' for v in values)} |")


if __name__ == "__main__":
    main()
