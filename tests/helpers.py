"""Shared test helpers: run the real CLIs in subprocesses, and run functions on N gloo ranks."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import torch

from ddp_utils.runtime.spawn import spawn_local

REPO = Path(__file__).resolve().parent.parent


def cli_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The test process's environment without any launcher variables leaking into the child."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "TORCHELASTIC_")) and k not in
           ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"  # 2 ranks on 2 cores: oversubscription would only slow tests
    env["PYTHONPATH"] = str(REPO)
    return {**env, **(extra or {})}


def run_cli(script: str, args: list[str], nproc: int = 1, timeout: float = 300,
            env: dict[str, str] | None = None, torchrun_args: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``python SCRIPT ARGS`` for one process, ``torchrun --standalone`` for several."""
    if nproc == 1:
        cmd = [sys.executable, str(REPO / script), *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", *torchrun_args, str(REPO / script), *args]
    return subprocess.run(cmd, cwd=REPO, env=cli_env(env), capture_output=True, text=True,
                          timeout=timeout)


def assert_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"


def load_ckpt(path: Path) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=True)


def _rank_entry(rank: int, fn: Callable, out_dir: str, args: tuple) -> None:
    from ddp_utils.runtime.dist import cleanup_distributed, init_distributed

    info = init_distributed("cpu", timeout_s=60)
    try:
        torch.save(fn(info, *args), Path(out_dir) / f"rank{rank}.pt")
    finally:
        cleanup_distributed()


def run_on_ranks(fn: Callable, tmp_path: Path, *args: Any, world_size: int = 2) -> list[Any]:
    """Run ``fn(dist_info, *args)`` on ``world_size`` gloo ranks; returns each rank's result.

    ``fn`` must be importable (defined at module level) and return torch.save-able data.
    """
    spawn_local(_rank_entry, world_size, fn, str(tmp_path), args)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def read_scalars(tb_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series in a TensorBoard folder, read with tensorboard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def write_image_folder(root: Path, per_class: int = 12) -> None:
    """A tiny ImageNet-layout tree made of digits (real images, written as PNG files)."""
    from PIL import Image

    from ddp_utils.data.sets import DigitsDataset

    digits = DigitsDataset(train=True)
    for split in ("train", "val"):
        for cls in range(3):
            (root / split / f"class{cls}").mkdir(parents=True)
        counts = {c: 0 for c in range(3)}
        for i in range(len(digits)):
            image, label = digits[i]
            if label < 3 and counts[label] < per_class:
                pixels = (image.permute(1, 2, 0) * 255).to(torch.uint8).numpy()
                Image.fromarray(pixels).save(root / split / f"class{label}" / f"{i}.png")
                counts[label] += 1
