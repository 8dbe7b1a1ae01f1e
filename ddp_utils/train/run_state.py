"""Where a run stands (:class:`RunState`): the position every checkpoint records, every message
counts by and a resume starts from."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .train_config import TrainConfig


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
