"""The record of one training run, built once by each script's ``setup``: what it is made of
(:class:`TrainRun`) and where it stands (:class:`RunState`)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator

import torch
from torch import nn

from ..data.pipeline import Loaders
from ..data.sets import IMAGE_FILES
from ..runtime.dist import DistInfo, unwrap
from .accumulation import MicroStep, WindowStart, plan_windows
from .monitor import TensorBoard, WaitClock
from .optimization import LRSchedule
from .train_config import TrainConfig

if TYPE_CHECKING:
    from .session import RunSession

log = logging.getLogger("train")
INPUT_BOUND = 0.2  # an epoch that waited for its batches longer than this share of its time is input-bound


@dataclass
class RunState:
    """Where a run stands: the position every checkpoint records and every message counts by."""

    epoch: int = 0              # epochs completed (0-based index of the epoch in progress)
    step: int = 0               # optimizer steps taken, applied or skipped: the one step counter
    batches_done: int = 0       # micro-batches of `epoch` this rank consumed (a multiple of accum_steps)
    nonfinite_skipped: int = 0  # optimizer steps skipped for a non-finite loss (--skip-nonfinite)

    def next_epoch(self) -> None:
        self.epoch, self.batches_done = self.epoch + 1, 0

    @property
    def epoch_number(self) -> int:
        """The epoch of the last step, counted from 1, as every message counts epochs (0 = none yet)."""
        return self.epoch if self.batches_done == 0 else self.epoch + 1

    def describe(self) -> str:
        return describe_position(self.step, self.epoch, self.batches_done)


def is_complete(cfg: TrainConfig, state: RunState) -> bool:
    """Nothing left to train: every epoch done, or --max-steps reached."""
    return state.epoch >= cfg.epochs or bool(cfg.max_steps and state.step >= cfg.max_steps)


def describe_position(step: int, epoch: int, batches_done: int) -> str:
    if batches_done == 0:
        return f"step {step}, end of epoch {epoch}" if epoch else f"step {step}"
    return f"step {step}, in epoch {epoch + 1}"


def input_advice(cfg: TrainConfig, resolved: dict[str, Any]) -> str:
    """What feeds an input-bound run faster, given where its batches are made; "" where nothing
    does: in-memory data augmented on the device waits only for that augmentation's own work,
    which on a CPU is the training process's (the epoch's line still says how long)."""
    workers, where = resolved.get("workers", cfg.workers), resolved.get("aug_on", "loader")
    tips = []
    if where == "loader" or cfg.dataset in IMAGE_FILES:  # DataLoader workers make (part of) each batch
        tips.append(f"more --workers (now {workers} per rank; -1 sizes them to the CPUs this process may use)")
    if where == "loader":
        tips.append("--aug-on device (augmentation as whole batches on the training device)")
    return "try " + "; ".join(tips) if tips else ""


class TrainingBatches:
    """This rank's training batches, epoch by epoch, in accumulation windows. A batch counts as
    consumed (``state.batches_done``) when it is handed out; the window in progress can be given
    up (:meth:`undo_window`); the time the loop waits for batches is measured (``data_wait``)."""

    def __init__(self, loaders: Loaders, state: RunState, accum_steps: int, model: nn.Module, device: torch.device):
        self.loaders, self.state, self.accum_steps = loaders, state, accum_steps
        self.data_wait = WaitClock()
        self.epoch_started = (0.0, 0, 0.0)  # this epoch's start here: time, batches done, data wait
        self._window_start = 0  # state.batches_done before the window in progress
        self._window_undo = WindowStart(model, device)  # the rest of what the window changes
        self._batches: Iterator | None = None

    def this_epoch(self) -> Iterator[tuple[MicroStep, Any]]:
        """The rest of this epoch's batches, each with its place in its accumulation window."""
        state = self.state
        self.loaders.set_epoch(state.epoch, skip_batches=state.batches_done)
        if state.batches_done >= self.loaders.batches_per_epoch:  # resumed with fewer batches per epoch
            state.next_epoch()
            self.loaders.set_epoch(state.epoch)
        self.epoch_started = (time.perf_counter(), state.batches_done, self.data_wait.seconds)
        self._batches = self.data_wait.call(lambda: iter(self.loaders.train))  # may start the workers
        for micro in plan_windows(len(self.loaders.train), self.accum_steps):
            batch = self.data_wait.next(self._batches)
            if batch is None:
                return
            if micro.index == 0:
                self._window_start = state.batches_done
                self._window_undo.save()
            state.batches_done += 1
            yield micro, batch

    def prepare_next(self) -> None:
        """Batches made on the device: queue the next one's augmentation now, so the device
        works on it while the host waits (a no-op for DataLoader workers, which run ahead anyway)."""
        prepare = getattr(self._batches, "prepare_next", None)
        if prepare is not None:
            self.data_wait.call(prepare)

    def undo_window(self) -> None:
        """Every rank: give up the window in progress (its optimizer step was not taken): its
        batches count as unseen again, and BatchNorm statistics, RNG streams and counters are as
        the last completed step left them."""
        self.state.batches_done = self._window_start
        self._window_undo.restore()


@dataclass(kw_only=True)
class TrainRun:
    """What one run is made of. ``model`` is what checkpoints store; ``network`` is what runs
    forward (DDP-wrapped when distributed, compiled with --compile)."""

    cfg: TrainConfig
    info: DistInfo
    session: RunSession                # signals, the per-step agreement, fault plan, last checkpoint
    loaders: Loaders
    model: nn.Module
    network: nn.Module
    optimizer: torch.optim.Optimizer
    lr_schedule: LRSchedule            # the LR of each optimizer step, from state.step
    scaler: torch.amp.GradScaler       # disabled unless --amp fp16
    total_steps: int
    state: RunState
    tb: TensorBoard
    script: str                        # "train_classifier.py" / "train_moco.py"
    facts: dict[str, Any] = field(default_factory=dict)  # must match on resume (e.g. the class count)
    resolved: dict[str, Any] = field(default_factory=dict)  # what the "auto" data flags became (preflight.resolved_settings)
    preempted: bool = False
    batches: TrainingBatches = field(init=False, repr=False)
    said_input_bound: bool = False

    def __post_init__(self):
        # DDP_FAULT=nan:RANK:STEP (tests): a NaN from the network's forward of that step
        self.session.faults.install(unwrap(self.network), self.info.rank, lambda: self.state.step + 1)
        self.batches = TrainingBatches(self.loaders, self.state, self.cfg.accum_steps, unwrap(self.model),
                                       self.info.device)

    def end_epoch_if_done(self) -> None:
        """After an optimizer step: once the epoch's batches are all consumed, the next epoch
        starts, so every message and checkpoint of the step agrees on which epoch it ended."""
        state = self.state
        if state.batches_done < self.loaders.batches_per_epoch:
            return
        started, first_batch, waited_before = self.batches.epoch_started
        seconds = max(time.perf_counter() - started, 1e-9)
        images = (state.batches_done - first_batch) * self.cfg.batch_size * self.info.world_size
        waited = (self.batches.data_wait.seconds - waited_before) / seconds
        fallbacks = self.loaders.decode_fallbacks  # --decode-on device: images its decoder refused, so far
        refused = (f"; {fallbacks.count:,} image(s) the {self.info.device.type} decoder refused decoded on the CPU "
                   f"so far" if fallbacks is not None and fallbacks.count else "")
        log.info("epoch %d trained in %.1f s (%s%s img/s, waited for data %.0f%% of it%s)", state.epoch_number,
                 seconds, "resumed part way, " if first_batch else "", f"{images / seconds:,.0f}", 100 * waited,
                 refused)
        advice = input_advice(self.cfg, self.resolved)
        if waited > INPUT_BOUND and advice and not first_batch and not self.said_input_bound and self.info.is_main:
            self.said_input_bound = True
            log.warning("input-bound: the training loop waited for its batches %.0f%% of epoch %d (rank 0); %s",
                        100 * waited, state.epoch_number, advice)
        state.next_epoch()

    def checkpoint_extras(self) -> dict[str, Any]:
        """What a script keeps in its checkpoints beside the common entries (the classifier: its
        EMA of the weights); a resume reads it back in the script's ``setup``."""
        return {}

    def finished(self) -> bool:
        """All epochs done, --max-steps reached, or stopped by a preemption signal."""
        return self.preempted or is_complete(self.cfg, self.state)
