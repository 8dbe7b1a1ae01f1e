"""What rank 0 reports while training: TensorBoard scalars and a progress line."""
from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

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
