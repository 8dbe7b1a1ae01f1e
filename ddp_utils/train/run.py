"""The record of one training run, built once by each script's ``setup`` (:class:`TrainRun`:
what it is made of, where it stands, its batches), and its start (:func:`start_training`)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..data.pipeline import Loaders
from ..runtime.dist import DistInfo, unwrap
from ..runtime.logs import release_held_logs
from .accumulation import steps_per_epoch
from .batches import TrainingBatches
from .monitor import INPUT_BOUND, Progress, StepMeter, TensorBoard, input_advice
from .optimization import LRSchedule
from .run_state import RunState, is_complete
from .train_config import ResolvedSettings, TrainConfig

if TYPE_CHECKING:
    from .session import RunSession

log = logging.getLogger("train")


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
    resolved: ResolvedSettings         # what the "auto" data flags became (preflight.resolved_settings)
    facts: dict[str, Any] = field(default_factory=dict)  # must match on resume (e.g. the class count)
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


def start_training(run: TrainRun) -> StepMeter:
    """Everything is built and checked: show the start-up log, arm Ctrl-C's checkpoint, and
    return the meter of the training steps."""
    cfg, info = run.cfg, run.info
    log.info("global batch %d = %d rank(s) x %d accum steps x %d per micro-batch; %d optimizer "
             "steps per epoch, %d in all", info.world_size * cfg.accum_steps * cfg.batch_size,
             info.world_size, cfg.accum_steps, cfg.batch_size,
             steps_per_epoch(run.loaders.batches_per_epoch, cfg.accum_steps), run.total_steps)
    remark = cfg.global_batch_remark(info.world_size)
    if remark:
        log.warning("%s", remark)
    release_held_logs(show=True)
    run.session.signals.training_started()
    progress = Progress(min(run.total_steps, cfg.max_steps or run.total_steps), cfg.epochs, info.is_main,
                        start_step=run.state.step)
    return StepMeter(run.tb, progress, info.device, info.world_size, cfg.log_every, run.batches.data_wait)
