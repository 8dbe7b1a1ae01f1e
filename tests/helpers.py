"""Shared test helpers: run the real CLIs in subprocesses or in this process, copy a run's
checkpoint into a new run folder, and run functions on N gloo ranks."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ddp_utils.runtime.spawn import spawn_local

REPO = Path(__file__).resolve().parent.parent

TINY_DIGITS = ["--device", "cpu", "--dataset", "digits", "--arch", "small_cnn", "--image-size", "16",
               "--batch-size", "16", "--accum-steps", "2", "--log-every", "1"]
# 2 ranks x 16 x A=2: 22 optimizer steps per epoch of digits (719 images per rank)
STEPS_PER_EPOCH = 22
# The classifier: a cosine-epoch schedule with warm-up (its LR changes at the epoch boundary)
CLASSIFIER_REF = TINY_DIGITS + ["--lr", "0.05", "--lr-schedule", "cosine-epoch", "--warmup-steps", "3",
                                "--epochs", "2"]
# MoCo: the momentum schedule on, 30 steps (across the first epoch's end)
MOCO_REF = TINY_DIGITS + ["--moco-k", "200", "--moco-m-cos", "--epochs", "2", "--knn-every", "0",
                          "--max-steps", "30"]
# The symmetric loss: both crops' keys enqueued (2 x 64 per step into K = 200)
SYMMETRIC_REF = TINY_DIGITS + ["--moco-k", "200", "--symmetric", "--epochs", "1", "--knn-every", "0",
                               "--max-steps", "10"]


@dataclass
class Reference:
    """A finished 2-rank run with a checkpoint of every optimizer step."""

    script: str
    args: list[str]
    out: Path
    stdout: str
    checkpoints: dict[int, Path] = field(default_factory=dict)

    def checkpoint(self, step: int) -> Path:
        if not self.checkpoints:
            self.checkpoints = {load_ckpt(p)["step"]: p for p in self.out.glob("checkpoint_*.pt")}
        return self.checkpoints[step]

    @property
    def final(self) -> dict:
        return load_ckpt(self.out / "checkpoint_last.pt")


def assert_same_state(a: dict, b: dict) -> None:
    """Two checkpoints hold the same run state: weights, buffers, optimizer, bit for bit."""
    assert (a["step"], a["epoch"], a["batches_done"]) == (b["step"], b["epoch"], b["batches_done"])
    for name, value in a["model"].items():
        assert torch.equal(value, b["model"][name]), name
    assert a["optimizer"]["param_groups"][0]["lr"] == b["optimizer"]["param_groups"][0]["lr"]
    for key, state in a["optimizer"]["state"].items():
        assert torch.equal(state["momentum_buffer"], b["optimizer"]["state"][key]["momentum_buffer"])


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


def in_process(main: Callable[[list[str]], int], args: list[str], capsys) -> subprocess.CompletedProcess:
    """A script's ``main(args)`` called in this process (seconds faster than a subprocess), with
    stdout and stderr as the user would see them; an argparse or flag error's SystemExit is its
    exit code."""
    try:
        code = main(args)
    except SystemExit as stop:
        code = stop.code
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, captured.out, captured.err)


def resume_folder(checkpoint: Path, out: Path) -> Path:
    """A new run folder holding a copy of ``checkpoint`` as its newest: ``--resume auto`` there
    continues from it."""
    out.mkdir(parents=True)
    shutil.copyfile(checkpoint, out / "checkpoint_last.pt")
    return out


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


def bare_run(network: torch.nn.Module, optimizer: torch.optim.Optimizer, *, accum_steps: int = 1,
             scaler: torch.amp.GradScaler | None = None, clip_grad: float = 0.0, lr_schedule=None,
             guard=None, step: int = 0):
    """A TrainRun around ``network`` with what ``optimizer_step`` reads, for tests of the
    accumulation mechanics on toy models (no data, no run folder)."""
    from types import SimpleNamespace

    from ddp_utils.runtime.dist import DistInfo, get_rank, get_world_size, unwrap
    from ddp_utils.runtime.faults import FaultPlan
    from ddp_utils.runtime.stopping import StepGuard
    from ddp_utils.train.run import RunState, TrainRun
    from ddp_utils.train.schedule import LRSchedule
    from train_classifier import ClassifierConfig

    device = torch.device("cpu")
    session = SimpleNamespace(guard=guard or StepGuard(None, device), faults=FaultPlan())
    info = DistInfo(get_rank(), get_rank(), get_world_size(), get_world_size(), device, None, "test")
    return TrainRun(cfg=ClassifierConfig(device="cpu", accum_steps=accum_steps, clip_grad=clip_grad), info=info,
                    session=session, loaders=None, model=unwrap(network), network=network, optimizer=optimizer,
                    lr_schedule=lr_schedule or LRSchedule(optimizer.param_groups[0]["lr"], "constant"),
                    scaler=scaler or torch.amp.GradScaler("cpu", enabled=False), total_steps=0,
                    state=RunState(step=step), tb=None, script="test")


def train_windows(run, batches, loss_fn) -> list:
    """The scripts' accumulation loop (train_classifier.train_one_epoch) on toy batches:
    ``loss_fn(run.network, batch)`` per micro-step; returns each micro-step's StepResult or None."""
    from ddp_utils.train.accumulation import no_sync, optimizer_step, plan_windows

    results, window_loss = [], 0.0
    for micro, batch in zip(plan_windows(len(batches), run.cfg.accum_steps), batches):
        with no_sync(run.network, enabled=not micro.is_last):
            loss = loss_fn(run.network, batch)
            run.scaler.scale(loss / micro.window_size).backward()
        window_loss = window_loss + loss.detach() / micro.window_size
        results.append(optimizer_step(run, window_loss) if micro.is_last else None)
        window_loss = 0.0 if micro.is_last else window_loss
    return results
