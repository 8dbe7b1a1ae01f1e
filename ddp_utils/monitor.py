"""What rank 0 reports while training: TensorBoard scalars and a progress line."""
from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

from .collectives import reduce_metrics

log = logging.getLogger("train")


class TensorBoard:
    """A SummaryWriter on rank 0, a no-op elsewhere (so callers need no rank checks)."""

    def __init__(self, log_dir: str | Path | None):
        self.writer = None
        if log_dir is not None:
            from torch.utils.tensorboard import SummaryWriter  # slow import: only rank 0 pays

            self.writer = SummaryWriter(str(log_dir))

    def scalars(self, step: int, **values: float) -> None:
        if self.writer is not None:
            for name, value in values.items():
                self.writer.add_scalar(name.replace("__", "/"), value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def format_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class Progress:
    """Step, loss, throughput and ETA on rank 0: a redrawn bar on a terminal, log lines elsewhere."""

    def __init__(self, total_steps: int, log_every: int, enabled: bool):
        self.total_steps, self.log_every, self.enabled = total_steps, log_every, enabled
        self.tty = enabled and sys.stdout.isatty()
        self.start_time = time.perf_counter()
        self.start_step: int | None = None

    def update(self, step: int, epoch: int, loss: float, lr: float, images_per_sec: float) -> None:
        if not self.enabled:
            return
        if self.start_step is None:
            self.start_step, self.start_time = step - 1, time.perf_counter()
        done = step - self.start_step
        eta = (time.perf_counter() - self.start_time) / done * (self.total_steps - step)
        text = (f"epoch {epoch} step {step}/{self.total_steps} loss {loss:.4f} lr {lr:.4g} "
                f"{images_per_sec:,.0f} img/s eta {format_duration(eta)}")
        if self.tty:
            width = 24
            filled = int(width * step / max(1, self.total_steps))
            sys.stdout.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {text}\033[K")
            sys.stdout.flush()
        elif step % self.log_every == 0 or step == self.total_steps:
            log.info(text)

    def end_line(self) -> None:
        if self.tty:
            sys.stdout.write("\n")


class StepMeter:
    """Per-step training metrics, averaged over steps and ranks at each --log-every boundary.

    Micro-step values are summed on the device (no host sync per micro-step); one all_reduce per
    logged step. Each metric is added as value / window_size, so one step contributes its mean.
    """

    def __init__(self, tb: TensorBoard, progress: Progress, device, world_size: int, log_every: int):
        self.tb, self.progress, self.device = tb, progress, device
        self.world_size, self.log_every = world_size, log_every
        self._reset()

    def _reset(self) -> None:
        self.sums: dict = {}
        self.images, self.steps, self.since = 0, 0, time.perf_counter()

    def add_micro(self, images: int, window_size: int, **metrics) -> None:
        """``images``: samples of this micro-step over all ranks; metrics: 0-dim tensors."""
        self.images += images
        for name, value in metrics.items():
            value = value.detach().float() / window_size
            self.sums[name] = self.sums[name] + value if name in self.sums else value

    def end_step(self, step: int, epoch: int, force: bool = False, **values: float) -> dict | None:
        """Call after each optimizer step; logs (and returns the averages) every log_every steps."""
        self.steps += 1
        if not (force or step % self.log_every == 0):
            return None
        elapsed = time.perf_counter() - self.since
        local = {name: value.item() for name, value in self.sums.items()}
        means = {k: v / (self.world_size * self.steps) for k, v in reduce_metrics(local, self.device).items()}
        rate = self.images / elapsed
        self.tb.scalars(step, **{f"train__{k}": v for k, v in {**means, **values}.items()},
                        train__images_per_sec=rate)
        self.progress.update(step, epoch, means.get("loss", float("nan")), values.get("lr", 0.0), rate)
        self._reset()
        return means
