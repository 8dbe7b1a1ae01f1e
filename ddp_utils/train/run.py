"""The record of one training run, built once by each script's ``setup``, and where it stands."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator

import torch
from torch import nn

from ..data.loading import Loaders
from ..runtime.dist import DistInfo, unwrap
from .accumulation import MicroStep, plan_windows
from .monitor import TensorBoard
from .schedule import LRSchedule
from .train_config import TrainConfig

if TYPE_CHECKING:
    from .session import RunSession

log = logging.getLogger("train")


@dataclass
class RunState:
    epoch: int = 0              # epochs completed (0-based index of the epoch in progress)
    step: int = 0               # optimizer steps taken, applied or skipped: the one step counter
    batches_done: int = 0       # micro-batches of `epoch` this rank consumed (a multiple of accum_steps)
    nonfinite_skipped: int = 0  # optimizer steps skipped for a non-finite loss (--skip-nonfinite)

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
    preempted: bool = False
    epoch_started: tuple[float, int] = (0.0, 0)  # when this epoch started here, at which batch
    _batches: Iterator | None = field(default=None, init=False, repr=False)  # this epoch's batch iterator

    def __post_init__(self):
        # DDP_FAULT=nan:RANK:STEP (tests): a NaN from the network's forward of that step
        self.session.faults.install(unwrap(self.network), self.info.rank, lambda: self.state.step + 1)

    def micro_batches(self) -> Iterator[tuple[MicroStep, Any]]:
        """The rest of this epoch's batches, each with its place in its accumulation window. A
        batch counts as consumed (``state.batches_done``) when it is handed out."""
        state = self.state
        if state.batches_done >= self.loaders.batches_per_epoch:  # resumed with fewer batches per epoch
            state.epoch, state.batches_done = state.epoch + 1, 0
        self.loaders.set_epoch(state.epoch, skip_batches=state.batches_done)
        self.epoch_started = (time.perf_counter(), state.batches_done)
        self._batches = iter(self.loaders.train)
        for micro, batch in zip(plan_windows(len(self.loaders.train), self.cfg.accum_steps), self._batches):
            state.batches_done += 1
            yield micro, batch

    def prepare_next_batch(self) -> None:
        """Batches made on the device: queue the next one's augmentation now, so the device
        works on it while the host waits (a no-op for DataLoader workers, which run ahead anyway)."""
        prepare = getattr(self._batches, "prepare_next", None)
        if prepare is not None:
            prepare()

    def end_epoch_if_done(self) -> None:
        """After an optimizer step: once the epoch's batches are all consumed, the next epoch
        starts, so every message and checkpoint of the step agrees on which epoch it ended."""
        state = self.state
        if state.batches_done < self.loaders.batches_per_epoch:
            return
        started, first_batch = self.epoch_started
        seconds = time.perf_counter() - started
        images = (state.batches_done - first_batch) * self.cfg.batch_size * self.info.world_size
        log.info("epoch %d trained in %.1f s (%s%s img/s)", state.epoch_number, seconds,
                 "resumed part way, " if first_batch else "", f"{images / max(seconds, 1e-9):,.0f}")
        state.epoch, state.batches_done = state.epoch + 1, 0

    def finished(self) -> bool:
        """All epochs done, --max-steps reached, or stopped by a preemption signal."""
        return self.preempted or is_complete(self.cfg, self.state)
