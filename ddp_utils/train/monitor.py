"""What rank 0 reports while training: TensorBoard scalars, a progress line, the share of time the
loop waited for its batches (``run.WaitClock`` measures it) and what to do when that share is
too high (:func:`input_advice`)."""
from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from ..data.sets import IMAGE_FILES
from ..runtime.collectives import all_reduce_sum

if TYPE_CHECKING:
    from .train_config import ResolvedSettings, TrainConfig

log = logging.getLogger("train")
TB_DIR = "tb"  # TensorBoard's folder in a run folder
INPUT_BOUND = 0.2  # an epoch that waited for its batches longer than this share of its time is input-bound


class TensorBoard:
    """A SummaryWriter on rank 0, a no-op elsewhere (so callers need no rank checks)."""

    def __init__(self, log_dir: str | Path | None, purge_step: int | None = None):
        """``purge_step``: on resume, the step after the checkpoint's; TensorBoard then hides the
        points a crashed attempt logged after that checkpoint, so each step appears once."""
        self.writer = None
        if log_dir is not None:
            from torch.utils.tensorboard import SummaryWriter  # slow import: only rank 0 pays

            self.writer = SummaryWriter(str(log_dir), purge_step=purge_step)

    def scalars(self, step: int, **values: float) -> None:
        if self.writer is not None:
            for name, value in values.items():
                self.writer.add_scalar(name.replace("__", "/"), value, step)

    def image(self, tag: str, image, step: int) -> None:
        """``image``: 3 x H x W in [0, 1]."""
        if self.writer is not None:
            self.writer.add_image(tag, image, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def last_accuracies(log_dir: str | Path) -> str:
    """"val/acc1 97.77% at step 308, ..." from a run's TensorBoard events: the last point of each
    accuracy series (empty if there is none)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if not Path(log_dir).is_dir():
        return ""
    logging.getLogger("tensorboard").setLevel(logging.WARNING)  # its INFO chatter about event files
    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    found = [(tag, events.Scalars(tag)[-1]) for tag in ("val/acc1", "val/acc5", "val_ema/acc1", "knn/acc1")
             if tag in events.Tags()["scalars"]]
    return ", ".join(f"{tag} {point.value:.2f}% at step {point.step}" for tag, point in found)


def format_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class Progress:
    """Step, loss, throughput and ETA on rank 0: a redrawn bar on a terminal, log lines elsewhere.

    The clock starts when the object is made (just before the first step of this process), so
    the first line's ETA already includes a whole step.
    """

    def __init__(self, total_steps: int, epochs: int, enabled: bool, start_step: int = 0):
        self.total_steps, self.epochs, self.enabled = total_steps, epochs, enabled
        self.tty = enabled and sys.stdout.isatty()
        self.start_step, self.start_time = start_step, time.perf_counter()

    def update(self, step: int, epoch: int, loss: float, lr: float, images_per_sec: float,
               data_wait: float = 0.0) -> None:
        """``epoch``: the step's epoch, counted from 1; ``data_wait``: the share of wall time
        spent waiting for batches since the last line (0..1)."""
        if not self.enabled:
            return
        done = max(1, step - self.start_step)
        eta = (time.perf_counter() - self.start_time) / done * (self.total_steps - step)
        text = (f"epoch {epoch}/{self.epochs} step {step}/{self.total_steps} loss {loss:.4f} lr {lr:.4g} "
                f"{images_per_sec:,.0f} img/s data wait {100 * data_wait:.0f}% eta {format_duration(eta)}")
        if self.tty:
            width = 24
            filled = int(width * step / max(1, self.total_steps))
            sys.stdout.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {text}\033[K")
            sys.stdout.flush()
        else:
            log.info(text)

    def end_line(self) -> None:
        if self.tty:
            sys.stdout.write("\n")


def input_advice(cfg: TrainConfig, resolved: ResolvedSettings) -> str:
    """What feeds an input-bound run faster, given where its batches are made; "" where nothing
    does: in-memory data augmented on the device waits only for that augmentation's own work,
    which on a CPU is the training process's (the epoch's line still says how long)."""
    tips = []
    if resolved.aug_on == "loader" or cfg.dataset in IMAGE_FILES:  # DataLoader workers make (part of) each batch
        tips.append(f"more --workers (now {resolved.workers} per rank; -1 sizes them to the CPUs this process may use)")
    if resolved.aug_on == "loader":
        tips.append("--aug-on device (augmentation as whole batches on the training device)")
    return "try " + "; ".join(tips) if tips else ""


class StepMeter:
    """Per-step training metrics, averaged over steps and ranks at each --log-every boundary.

    Micro-step values are summed on the device (no host read per micro-step), each as
    value / window size, so a step contributes its mean; one all_reduce per logged step. The
    share of wall time spent waiting for batches (``waited()``: the seconds this rank's
    ``TrainingBatches`` waited so far) is logged beside them.
    """

    def __init__(self, tb: TensorBoard, progress: Progress, device, world_size: int, log_every: int,
                 waited: Callable[[], float]):
        self.tb, self.progress, self.device = tb, progress, device
        self.world_size, self.log_every = world_size, log_every
        self.waited = waited
        self.window: dict = {}  # this optimizer step's sums so far
        self._reset()

    def _reset(self) -> None:
        self.sums: dict = {}
        self.images, self.steps, self.since = 0, 0, time.perf_counter()
        self.waited_before = self.waited()

    def add_micro(self, window_size: int, images: int, **metrics) -> None:
        """``images``: samples of this micro-step over all ranks; metrics: 0-dim tensors."""
        self.images += images
        for name, value in metrics.items():
            value = value.detach().float() / window_size
            self.window[name] = self.window[name] + value if name in self.window else value

    @property
    def window_loss(self) -> torch.Tensor:
        """The mean loss of this optimizer step's micro-steps so far, on the device."""
        return self.window["loss"]

    def end_step(self, step: int, epoch: int, force: bool = False, **values: float) -> dict | None:
        """Call after each optimizer step; logs (and returns the averages) every log_every steps,
        and at a ``force``d step (the run's last). Every rank must call it (it may all_reduce)."""
        for name, value in self.window.items():
            self.sums[name] = self.sums[name] + value if name in self.sums else value
        self.window = {}
        self.steps += 1
        if not (force or step % self.log_every == 0):
            return None
        elapsed = time.perf_counter() - self.since
        names = list(self.sums)
        # one all_reduce and one host read for all metrics
        summed = all_reduce_sum(torch.stack([self.sums[n] for n in names]).double()).tolist() if names else []
        means = {n: v / (self.world_size * self.steps) for n, v in zip(names, summed)}
        rate = self.images / elapsed
        waited = min(1.0, (self.waited() - self.waited_before) / elapsed)
        self.tb.scalars(step, **{f"train__{k}": v for k, v in {**means, **values}.items()},
                        train__images_per_sec=rate, train__data_wait_percent=100 * waited)
        self.progress.update(step, epoch, means.get("loss", float("nan")), values.get("lr", 0.0), rate, waited)
        self._reset()
        return means
